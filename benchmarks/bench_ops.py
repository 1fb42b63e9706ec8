"""Side-by-side benchmark of jax_dnn's memory-bound ops against the XLA path.

For each op, shape and dtype it times, in one process and on the same inputs:
  ours  - the jax_dnn op (our CUDA kernels)
  xla   - the same math written in jnp and fused by XLA (what a user writes)
in three modes:
  fwd      y = op(x)                          bytes: x read + y written
  bwd      grads of <op(x), dy> w.r.t. inputs bytes: x, dy read + dx written
  fwd+bwd  y and those grads                  bytes: x, dy read + y, dx written
(per-feature parameters and per-row statistics are negligible and not
counted). `bwd` times the backward alone: each implementation's VJP applied
to dy, its residuals computed before the timed calls (jax.vjp's pullback,
its residuals passed in as arguments), as a training step runs it. Until
2026-11-24 (session 31) `bwd` timed a gradient-only program (jax.vjp and
its pullback in one jit), in which XLA drops whatever part of a forward the
gradients do not need: for XLA's path that included recomputing its
statistics, and for ours nothing, since our backward recomputed them; now
the layer norm's backward takes the forward's saved statistics. GB/s is those bytes
over the median time; "copy%" is that over the copy bandwidth measured in the
same run (an elementwise x * 2, bytes read + written).

Timing: each jitted call applies the op to K different input sets, K large
enough that one call moves at least 1 GiB of input (and cycles well past
L2); median of 5 repeats of 20 calls after warm-up. One application per call
(K = 1 on the large shapes, as before 2026-11-22) timed the host's dispatch
as much as the GPU: ncu showed our 70 us softmax kernel measured as 80 us
and XLA's 75 us one as 90 us, so the ratio depended on each path's dispatch
cost. Correctness is checked in the
same run (ours vs xla, loose tolerance).

Usage: python benchmarks/bench_ops.py [--quick] [--json out.json]
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import statistics
import time

import jax
import jax.numpy as jnp

import jax_dnn

EPS = 1e-5
L2_BYTES = 64 << 20  # cycle through more input bytes than L2 holds (50-60 MB on H100/H200)
CALL_BYTES = 1 << 30  # input bytes per jitted call, so that the GPU, not dispatch, sets the time


def xla_layer_norm(x, scale, bias):
  xf = x.astype(jnp.float32)
  mean = jnp.mean(xf, -1, keepdims=True)
  var = jnp.mean(jnp.square(xf - mean), -1, keepdims=True)
  return ((xf - mean) * jax.lax.rsqrt(var + EPS) * scale + bias).astype(x.dtype)


def xla_rms_norm(x, scale):
  xf = x.astype(jnp.float32)
  return (xf * jax.lax.rsqrt(jnp.mean(xf * xf, -1, keepdims=True) + EPS) * scale).astype(x.dtype)


def xla_softmax(x):
  return jax.nn.softmax(x.astype(jnp.float32), axis=-1).astype(x.dtype)


def xla_gelu(x):
  return jax.nn.gelu(x.astype(jnp.float32)).astype(x.dtype)


def xla_bias_gelu(x, bias):
  return jax.nn.gelu(x.astype(jnp.float32) + bias).astype(x.dtype)


# name -> (ours, xla, number of per-feature parameters)
OPS = {
    "layer_norm": (functools.partial(jax_dnn.layer_norm, epsilon=EPS), xla_layer_norm, 2),
    "rms_norm": (functools.partial(jax_dnn.rms_norm, epsilon=EPS), xla_rms_norm, 1),
    "softmax": (jax_dnn.softmax, xla_softmax, 0),
    "gelu": (jax_dnn.gelu, xla_gelu, 0),
    "bias_act(gelu)": (functools.partial(jax_dnn.bias_act, activation="gelu_tanh"), xla_bias_gelu, 1),
}


def make_modes(fn, params):
  """mode -> (prepare, apply, passes): prepare(x, dy) gives an input set's
  arguments for apply (untimed), apply(*args) is what a timed call runs,
  passes the arrays of x's size it moves."""

  def fwd(x, dy):
    del dy
    return (x,)

  def pullback(x, dy):
    # The residuals come back from jit as the pullback's leaves (a Partial).
    return (jax.jit(lambda v: jax.vjp(fn, v, *params)[1])(x), dy)

  def fwd_bwd(x, dy):
    y, vjp = jax.vjp(fn, x, *params)
    return y, vjp(dy)

  return {"fwd": (fwd, lambda x: fn(x, *params), 2),
          "bwd": (pullback, lambda vjp, dy: vjp(dy), 3),
          "fwd+bwd": (lambda x, dy: (x, dy), fwd_bwd, 4)}


def batched_call(apply):
  """One jitted call applying `apply` to every input set of a list."""
  return jax.jit(lambda sets: [apply(*args) for args in sets])


def time_fn(fn, inputs, repeats=5, calls=20):
  """Median seconds per op application; fn maps a list of input sets."""
  out = fn(inputs)
  jax.block_until_ready(out)
  samples = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    for _ in range(calls):
      out = fn(inputs)
    jax.block_until_ready(out)
    samples.append((time.perf_counter() - t0) / calls / len(inputs))
  return statistics.median(samples)


def copy_bandwidth():
  """Best of a few plain streaming kernels over 1 GiB (bytes read + written)."""
  best = 0.0
  for dtype in (jnp.bfloat16, jnp.float32):
    x = jax.random.normal(jax.random.key(0), ((1 << 30) // jnp.dtype(dtype).itemsize,), dtype)
    for fn in (lambda v: v * 2, lambda v: -v):
      t = time_fn(jax.jit(lambda xs, fn=fn: [fn(v) for v in xs]), [x])
      best = max(best, 2 * x.nbytes / t / 1e9)
    del x
  return best


def bench_case(name, shape, dtype, copy_gbs, key):
  ours, xla, nparams = OPS[name]
  rows, width = shape
  nbytes = math.prod(shape) * jnp.dtype(dtype).itemsize
  sets = max(1, min(32, math.ceil(max(L2_BYTES / nbytes, CALL_BYTES / nbytes))))
  k = jax.random.split(jax.random.key(key), 3)
  xs = [jax.random.normal(jax.random.fold_in(k[0], i), shape, jnp.float32).astype(dtype)
        for i in range(sets)]
  dys = [jax.random.normal(jax.random.fold_in(k[1], i), shape, jnp.float32).astype(dtype)
         for i in range(sets)]
  params = [1.0 + 0.1 * jax.random.normal(jax.random.fold_in(k[2], i), (width,), jnp.float32)
            for i in range(nparams)]
  rows_out = []
  for mode in ("fwd", "bwd", "fwd+bwd"):
    inputs, batched = {}, {}
    for impl, f in (("ours", ours), ("xla", xla)):
      prepare, apply, passes = make_modes(f, params)[mode]
      inputs[impl] = [prepare(x, dy) for x, dy in zip(xs, dys)]
      batched[impl] = batched_call(apply)
    # Correctness in the same run: ours against the XLA path on the first set.
    a = jax.tree.leaves(batched["ours"](inputs["ours"][:1]))
    b = jax.tree.leaves(batched["xla"](inputs["xla"][:1]))
    err = max(float(jnp.max(jnp.abs(u.astype(jnp.float32) - v.astype(jnp.float32)))
                    / (1.0 + float(jnp.max(jnp.abs(v.astype(jnp.float32)))))) for u, v in zip(a, b))
    tol = 5e-2 if dtype != jnp.float32 else 1e-3
    times = {impl: time_fn(f, inputs[impl]) for impl, f in batched.items()}
    del inputs
    gbs = {impl: passes * nbytes / t / 1e9 for impl, t in times.items()}
    rows_out.append(dict(
        op=name, shape=list(shape), dtype=jnp.dtype(dtype).name, mode=mode,
        ours_ms=times["ours"] * 1e3, xla_ms=times["xla"] * 1e3,
        ours_gbs=gbs["ours"], xla_gbs=gbs["xla"], ours_copy_frac=gbs["ours"] / copy_gbs,
        speedup=times["xla"] / times["ours"], max_rel_err=err, ok=bool(err <= tol)))
  return rows_out


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--quick", action="store_true", help="a few shapes only")
  ap.add_argument("--json", default="bench_ops.json")
  ap.add_argument("--ops", default=",".join(OPS))
  args = ap.parse_args()

  dev = jax.devices()[0]
  print(f"device: {dev.device_kind}; jax {jax.__version__}; kernels: {jax_dnn.has_cuda_kernels()}")
  copy_gbs = copy_bandwidth()
  print(f"copy bandwidth (read + write): {copy_gbs:.0f} GB/s")
  if args.quick:
    cases = [((16384, 4096), jnp.bfloat16)]
  else:
    cases = [((1024, 1024), jnp.bfloat16), ((16384, 1024), jnp.bfloat16),
             ((16384, 4096), jnp.bfloat16), ((16384, 8192), jnp.bfloat16),
             ((4096, 131072), jnp.bfloat16), ((16384, 4096), jnp.float32)]
  results = []
  for i, name in enumerate(args.ops.split(",")):
    for shape, dtype in cases:
      if name in ("gelu", "bias_act(gelu)") and shape[1] > 8192:
        continue  # elementwise: row length is irrelevant
      results.extend(bench_case(name, shape, dtype, copy_gbs, key=i))
      r = results[-1]
      print(f"  {name:15s} {str(shape):16s} {r['dtype']:8s} done", flush=True)
  meta = dict(device=dev.device_kind, jax=jax.__version__, copy_gbs=copy_gbs,
              date=time.strftime("%Y-%m-%d"))
  with open(args.json, "w") as f:
    json.dump(dict(meta=meta, results=results), f, indent=1)

  print(f"\n{'op':15s} {'shape':14s} {'dtype':8s} {'mode':8s} {'ours GB/s':>9s} {'copy%':>6s} "
        f"{'xla GB/s':>9s} {'x XLA':>6s} {'ok':>3s}")
  for r in results:
    print(f"{r['op']:15s} {'x'.join(map(str, r['shape'])):14s} {r['dtype']:8s} {r['mode']:8s} "
          f"{r['ours_gbs']:9.0f} {100 * r['ours_copy_frac']:5.0f}% {r['xla_gbs']:9.0f} "
          f"{r['speedup']:6.2f} {'y' if r['ok'] else 'NO':>3s}")


if __name__ == "__main__":
  main()
