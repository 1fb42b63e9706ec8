"""Times jax_dnn's row ops against XLA at an aligned width and at widths that
are not a multiple of the 16-byte vector, forward and forward+backward.

  python benchmarks/probes/row_ops_ab.py --json new.json [--ours-only] [--quick]
      [--ops softmax,...] [--shapes 16384x4097,...] [--dtypes bfloat16,...] [--modes fwd]
  python benchmarks/probes/row_ops_ab.py --table base.json new.json   # base: another build

Ops: layer_norm, rms_norm, softmax, bias_act (tanh GELU); XLA's side is the
same math in jnp (fp32 inside), jitted. Each jitted call applies the op to K
input sets, K large enough that a call moves at least 1 GiB (bytes read +
written); the time is the median of 5 repeats of 20 calls after a warm-up,
per application. The table gives ms and XLA's time over ours (> 1: ours is
faster); with two files, the first's ours (before) beside the second's.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time

GIB = 1 << 30
# The aligned headline shape, then odd and prime widths (x of 96-192 MiB at
# 16 bits, so that a call needs few input sets).
SHAPES = [(16384, 4096), (65536, 1000), (16384, 4097), (8192, 12289), (1024, 65537)]
DTYPES = ["bfloat16", "float16", "float32"]
MODES = ["fwd", "fwd+bwd"]


def _ops():
  """name -> (ours, xla, number of fp32 per-feature parameters): the
  benchmark families' own pairs (jax_dnn/benchmark/)."""
  from jax_dnn.benchmark import activations, norms, softmax
  return {**norms.OPS, "softmax": softmax.OPS["softmax"],
          "bias_act": activations.OPS["bias_act(gelu)"]}


def _time(fn, inputs, repeats=5, calls=20):
  import jax
  jax.block_until_ready(fn(inputs))
  samples = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    for _ in range(calls):
      out = fn(inputs)
    jax.block_until_ready(out)
    samples.append((time.perf_counter() - t0) / calls / len(inputs))
  return statistics.median(samples)


def run(args):
  import jax
  import jax.numpy as jnp
  ops = _ops()
  if args.ops:
    ops = {k: ops[k] for k in args.ops.split(",")}
  shapes = SHAPES[:3] if args.quick else SHAPES
  if args.shapes:
    shapes = [tuple(int(d) for d in s.split("x")) for s in args.shapes.split(",")]
  dtypes = args.dtypes.split(",") if args.dtypes else DTYPES
  modes = args.modes.split(",") if args.modes else MODES
  records = []
  for name, (ours, xla, nparams) in ops.items():
    for shape in shapes:
      for dname in dtypes:
        dtype = jnp.dtype(dname)
        nbytes = math.prod(shape) * dtype.itemsize
        params = [jnp.full(shape[-1:], 1.0 + 0.1 * i, jnp.float32) for i in range(nparams)]
        for mode in modes:
          moved = nbytes * (2 if mode == "fwd" else 4)
          k = max(1, -(-GIB // moved))
          keys = jax.random.split(jax.random.key(1), 2 * k)
          sets = [(jax.random.normal(keys[2 * i], shape, dtype), jax.random.normal(keys[2 * i + 1], shape, dtype))
                  for i in range(k)]
          for impl, fn in (("ours", ours), ("xla", xla)):
            if impl == "xla" and args.ours_only:
              continue
            if mode == "fwd":
              apply = lambda x, dy, fn=fn: fn(x, *params)
            else:
              def apply(x, dy, fn=fn):
                y, vjp = jax.vjp(fn, x, *params)
                return y, vjp(dy)
            call = jax.jit(lambda s, apply=apply: [apply(x, dy) for x, dy in s])
            ms = _time(call, sets) * 1e3
            records.append({"op": name, "shape": list(shape), "dtype": dname, "mode": mode,
                            "impl": impl, "ms": ms})
            print(f"{name:10s} {str(shape):15s} {dname:8s} {mode:7s} {impl:4s} {ms:8.4f} ms",
                  flush=True)
            if args.json:  # after every case: a run cut short keeps what it measured
              with open(args.json, "w") as f:
                json.dump({"device": jax.devices()[0].device_kind, "jax": jax.__version__,
                           "records": records}, f)
          del sets
  return {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "records": records}


def table(paths):
  runs = [json.load(open(p)) for p in paths]
  def index(r):
    return {(x["op"], tuple(x["shape"]), x["dtype"], x["mode"], x["impl"]): x["ms"] for x in r["records"]}
  new = index(runs[-1])
  base = index(runs[0]) if len(runs) > 1 else {}
  print(f"device: {runs[-1]['device']}, jax {runs[-1]['jax']}; ms, and x = XLA time / ours")
  print(f"{'op':10s} {'shape':13s} {'dtype':5s} {'mode':7s} {'xla':>7s} "
        + (f"{'before':>7s} {'x':>5s} " if base else "") + f"{'after':>7s} {'x':>5s}")
  worst = []
  for (op, shape, dtype, mode, impl), ms in new.items():
    if impl != "ours":
      continue
    xla = new.get((op, shape, dtype, mode, "xla"))
    b = base.get((op, shape, dtype, mode, "ours"))
    dt = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}[dtype]
    line = f"{op:10s} {'x'.join(map(str, shape)):13s} {dt:5s} {mode:7s} {xla or 0:7.4f} "
    if base:
      line += f"{b or 0:7.4f} {(xla / b) if (xla and b) else 0:5.2f} "
    line += f"{ms:7.4f} {(xla / ms) if xla else 0:5.2f}"
    print(line)
    if xla:
      worst.append((xla / ms, op, shape, dtype, mode))
  if worst:
    worst.sort()
    print("slowest against XLA:", "; ".join(f"{o} {'x'.join(map(str, s))} {d} {m} {r:.2f}"
                                            for r, o, s, d, m in worst[:5]))


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--json", help="write the timings here")
  ap.add_argument("--ours-only", action="store_true", help="skip XLA (a baseline build's run)")
  ap.add_argument("--quick", action="store_true", help="the first three shapes only")
  ap.add_argument("--ops", help="comma-separated ops (default: all)")
  ap.add_argument("--shapes", help="comma-separated RxC shapes (default: the built-in sweep)")
  ap.add_argument("--dtypes", help="comma-separated dtypes (default: bfloat16,float16,float32)")
  ap.add_argument("--modes", help="fwd, fwd+bwd or both comma-separated (default: both)")
  ap.add_argument("--table", nargs="+", metavar="JSON", help="print the table of these runs")
  args = ap.parse_args()
  if args.table:
    table(args.table)
    return
  out = run(args)
  if args.json:
    with open(args.json, "w") as f:
      json.dump(out, f)
  else:
    json.dump(out, sys.stdout)


if __name__ == "__main__":
  main()
