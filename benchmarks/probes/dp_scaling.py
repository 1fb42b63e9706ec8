"""Where a data-parallel ResNet training step's extra time goes, and whether
an XLA setting recovers it.

  cd tests && python3 ../benchmarks/probes/dp_scaling.py --devices 2        # GPU host, ~6 min
  cd tests && XLA_FLAGS=--xla_force_host_platform_device_count=2 \
      python3 ../benchmarks/probes/dp_scaling.py --size tiny --devices 2    # CPU, end to end

1. `nvidia-smi topo -m` and the devices' kinds.
2. All-reduce of S bytes fp32 a device over the N devices: a jitted shard_map
   of 16 dependent psums (one launch for all; XLA cannot combine them),
   median of 7 calls / the all-reduces compiled; bus bandwidth
   2 (N - 1) / N * S / time, as NCCL's tests report it.
3. examples/train_cnn.py's step (backends jax_dnn and xla) timed as `python
   -m jax_dnn.benchmark models` times it, at 1 device and at N (weak scaling),
   with its compiled HLO's collectives: ops of each kind (a static count),
   the bytes a device puts in (an all-gather's output, a reduce-scatter's
   input, else the result) and their time if run one after another, from
   (2)'s curve interpolated in bytes.
4. The N-device step at XLA_FLAGS variants (VARIANTS); a flag that the
   installed jaxlib's libraries lack is dropped (XLA aborts on it).
Each measurement runs in its own process: XLA_FLAGS is read once, and the
parent starts no backend, which would hold the GPUs' memory. The children
share a per-fusion autotune cache, so every variant runs the same kernels for
XLA's fusions; the NCCL environment passes through unchanged. A backend that
fails is reported with its reason; children past --budget-s are skipped.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import math
import mmap
import os
from pathlib import Path
import re
import statistics
import subprocess
import sys
import tempfile
import time

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import jaxlib
import numpy as np

BACKENDS = ("jax_dnn", "xla")
ALL_REDUCE_SIZES = {"4 KiB": 4 << 10, "256 KiB": 256 << 10, "4 MiB": 4 << 20, "100 MiB": 100 << 20}
LHS = "--xla_gpu_enable_latency_hiding_scheduler=true"
VARIANTS = {"default": [], "lhs": [LHS],
            "lhs+combine128M": [LHS, "--xla_gpu_all_reduce_combine_threshold_bytes=134217728"]}
AUTOTUNE_CACHE = "--xla_gpu_per_fusion_autotune_cache_dir"
KINDS = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")
# "%name = SHAPE kind(" or "kind-start(": SHAPE an array or a tuple of arrays.
_OP = re.compile(r"^\s*(?:ROOT\s+)?%?\S+\s*=\s*(.+?)\s+(" + "|".join(KINDS) + r")(-start)?\(")
_ARRAY = re.compile(r"\b(?:pred|[a-z]+(\d+)\w*)\[([\d,]*)\]")  # (bits; none: pred, dims)
RESULT = "DP_SCALING_RESULT "  # a child's last stdout line: this tag, then JSON


def count_collectives(hlo: str, devices: int) -> dict[str, list[int]]:
  """{kind: the bytes a device puts into each of its ops} over the HLO's collectives."""
  found = {kind: [] for kind in KINDS}
  for line in hlo.splitlines():
    if m := _OP.match(line):
      shape, kind, start = m.groups()
      sizes = [math.prod(int(d) for d in dims.split(",") if d) * max(1, int(bits or 8) // 8)
               for bits, dims in _ARRAY.findall(shape)]
      if start and kind == "all-gather":  # (operands..., outputs...)
        sizes = sizes[len(sizes) // 2:]
      elif start and kind == "collective-permute":  # (input, output, contexts...)
        sizes = sizes[:1]
      found[kind].append(sum(sizes) * (devices if kind == "reduce-scatter" else 1))
  return found


def estimate_us(nbytes: int, curve: list[tuple[int, float]]) -> float:
  """An all-reduce of `nbytes` from the measured (bytes, us) points: linear
  between them, the smallest's time below, the largest's bandwidth above."""
  sizes, times = zip(*curve)
  return float(np.interp(nbytes, sizes, times)) * max(1.0, nbytes / sizes[-1])


def seconds_of(fn, *args) -> float:
  t0 = time.perf_counter()
  jax.block_until_ready(fn(*args))
  return time.perf_counter() - t0


def all_reduce_bench(devices: int, chain: int = 16, rounds: int = 7) -> list[dict]:
  mesh = Mesh(np.array(jax.devices()[:devices]), ("data",))

  @jax.jit
  @functools.partial(jax.shard_map, mesh=mesh, in_specs=P("data"), out_specs=P("data"))
  def psum_chain(x):
    for _ in range(chain):  # zeros stay zeros: no overflow however long the chain
      x = jax.lax.psum(x, "data")
    return x

  rows = []
  for label, nbytes in ALL_REDUCE_SIZES.items():
    x = jax.device_put(np.zeros((devices, nbytes // 4), np.float32),
                       NamedSharding(mesh, P("data")))
    samples = [seconds_of(psum_chain, x) for _ in range(2 + rounds)][2:]  # 2 to warm up
    # The jit cache's executable: the all-reduces XLA kept of the chain.
    ops = len(count_collectives(psum_chain.lower(x).compile().as_text(), devices)["all-reduce"])
    seconds = statistics.median(samples) / max(ops, 1)
    rows.append(dict(size=label, bytes=nbytes, ops=ops, us=seconds * 1e6,
                     busbw=2 * (devices - 1) / devices * nbytes / seconds / 1e9))
  return rows


def time_backend(module, backend: str, devices: int, args) -> dict:
  """One backend's step at `devices` devices: ms, losses, collectives; or its failure."""
  from jax_dnn.benchmark import harness, models  # pylint: disable=import-outside-toplevel
  mesh = None if devices == 1 else Mesh(np.array(jax.devices()[:devices]), ("data",))
  try:
    step, state, batch = module.make_step(backend, args.size, mesh=mesh, seed=0,
                                          global_batch=args.per_device_batch * devices)
    seconds, steps, first, last, state = models.time_step(step, state, batch, harness.Settings())
    hlo = step.lower(state, batch).compile().as_text()  # the jit cache's executable
  except Exception as e:  # noqa: BLE001 - reported; the other backend still runs
    return {"error": harness.short_reason(e)}
  print(f"  {backend} at {devices}: {seconds * 1e3:.2f} ms", file=sys.stderr, flush=True)
  return dict(ms=seconds * 1e3, steps=steps, loss=[first, last],
              collectives=count_collectives(hlo, devices))


def child(args) -> dict:
  # Imported here: the parent loads neither jax_dnn nor a backend, whose
  # client would hold the GPUs' memory that the children need.
  from jax_dnn.benchmark import harness, models  # pylint: disable=import-outside-toplevel
  if len(jax.devices()) < args.devices:
    return {"error": f"{len(jax.devices())} devices visible, --devices {args.devices}"}
  directory, how = models.find_examples()
  module = models.load_example(directory / "train_cnn.py") if directory else how
  if isinstance(module, str):
    return {"error": module}
  out = {"platform": jax.devices()[0].platform, "jax": jax.__version__,
         "kinds": [d.device_kind for d in jax.devices()[:args.devices]]}
  try:
    if args.child == "base":
      out["all_reduce"] = all_reduce_bench(args.devices)
  except Exception as e:  # noqa: BLE001 - reported; the steps still run
    out["error"] = f"all-reduce: {harness.short_reason(e)}"
  devices = 1 if args.child == "base" else args.devices
  for backend in BACKENDS:
    out[backend] = time_backend(module, backend, devices, args)
    gc.collect()
    jax.clear_caches()  # compiled steps hold device memory
  return out


def known_flags(flags: list[str]) -> set[str]:
  """The flags (names before "=") whose names the installed jaxlib's or GPU
  plugin's shared libraries hold; all of them when no library is found."""
  site = Path(jaxlib.__file__).resolve().parents[1]
  libs = [p for pattern in ("jaxlib/**/*.so", "jax_cuda*/**/*.so", "jax_plugins/**/*.so")
          for p in site.glob(pattern)]
  names = {f: f.split("=")[0].lstrip("-").encode() for f in flags}
  found = set()
  for lib in libs:
    with open(lib, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as data:
      found |= {f for f, name in names.items() if f not in found and data.find(name) >= 0}
  print(f"flags checked in {len(libs)} libraries under {site}: "
        f"missing {sorted(set(flags) - found) or 'none'}")
  return found if libs else set(flags)


def run_child(name: str, flags: list[str], args, deadline: float) -> dict:
  left = deadline - time.monotonic()
  if left < 20:
    return {"error": f"skipped: {left:.0f} s of --budget-s left"}
  env = dict(os.environ, XLA_FLAGS=" ".join([os.environ.get("XLA_FLAGS", "")] + flags).strip())
  cmd = [sys.executable, __file__, "--child", name, "--size", args.size,
         "--devices", str(args.devices), "--per-device-batch", str(args.per_device_batch)]
  print(f"== {name}: XLA_FLAGS={env['XLA_FLAGS'] or '(none)'}", flush=True)
  t0 = time.monotonic()
  try:
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True, timeout=left,
                          check=False)
  except subprocess.TimeoutExpired:
    return {"error": f"timed out after {left:.0f} s"}
  lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT)]
  if not lines:
    return {"error": f"exit status {proc.returncode}, no result (its stderr is above)"}
  print(f"   ({time.monotonic() - t0:.0f} s)", flush=True)
  return json.loads(lines[-1][len(RESULT):])


def collectives(r: dict, curve) -> tuple[str, float | None]:
  """A step's collectives in words, and their serial time in ms estimated from `curve`."""
  if "collectives" not in r:
    return r.get("error", "-"), None
  words = ", ".join(f"{kind} {len(each)} ops {sum(each) / 2**20:.1f} MiB"
                    for kind, each in r["collectives"].items() if each) or "none"
  if not curve:
    return words, None
  est = sum(estimate_us(b, curve) for each in r["collectives"].values() for b in each) / 1e3
  return f"{words}; est. serial {est:.2f} ms", est


def report(args, base: dict, variants: dict) -> None:
  n, curve = args.devices, [(r["bytes"], r["us"]) for r in base.get("all_reduce", [])]
  runs = {"1 device": base, **{f"{n} devices, {k}": v for k, v in variants.items()}}
  row = lambda label, cells: print(f"  {label:30}" + "".join(f"{c:>18}" for c in cells))
  print(f"\n== report: ResNet {args.size}, {args.per_device_batch} images a device, {n} x "
        f"{', '.join(sorted(set(base.get('kinds', ['?']))))} ({base.get('platform', '?')}, "
        f"jax {base.get('jax', '?')})")
  print(f"all-reduce, fp32 over {n} devices:")
  row("size", ("time us", "bus GB/s"))
  for r in base.get("all_reduce", []):
    row(r["size"], (f"{r['us']:.1f}", f"{r['busbw']:.1f}"))
  print("step ms (weak-scaling efficiency):")
  row("", BACKENDS)
  one = {b: base[b]["ms"] for b in BACKENDS if "ms" in base.get(b, {})}
  for label, r in runs.items():
    ms = {b: r[b]["ms"] for b in BACKENDS if "ms" in r.get(b, {})}
    row(label, [f"{ms[b]:.2f}" + (f" ({one[b] / ms[b]:.0%})" if r is not base and b in one else "")
                if b in ms else "-" for b in BACKENDS])
  print("collectives in the compiled step (static count, bytes a device puts in):")
  for b in BACKENDS:
    for label, r in runs.items():
      print(f"  {b:8} {label:26} {collectives(r.get(b, {}), curve)[0]}")
  default = variants.get("default", {})
  print(f"ms added at {n} devices with the default flags (collectives est. serial + the rest), "
        f"and each variant's change:")
  for b in (b for b in BACKENDS if b in one and "ms" in default.get(b, {})):
    extra, est = default[b]["ms"] - one[b], collectives(default[b], curve)[1]
    split = "" if est is None else f" ({est:.2f} + {extra - est:.2f})"
    print(f"  {b:8} +{extra:.2f}{split}" + "".join(
        f"; {k} {v[b]['ms'] - default[b]['ms']:+.2f}" for k, v in variants.items()
        if k != "default" and "ms" in v.get(b, {})))
  for label, r in runs.items():
    errors = r.get("error") or {b: r[b]["error"] for b in BACKENDS if "error" in r.get(b, {})}
    if errors:
      print(f"  {label} failed: {errors}")


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--devices", type=int, default=2)
  ap.add_argument("--size", default="realistic", help="train_cnn.SIZES: tiny, small, realistic")
  ap.add_argument("--per-device-batch", type=int, default=64)
  ap.add_argument("--budget-s", type=float, default=330.0,
                  help="the children's wall time, all together")
  ap.add_argument("--child", help=argparse.SUPPRESS)
  args = ap.parse_args(argv)
  if args.child:
    print(RESULT + json.dumps(child(args)), flush=True)
    return
  deadline = time.monotonic() + args.budget_s
  try:
    print(subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True,
                         timeout=30, check=False).stdout)
  except (OSError, subprocess.TimeoutExpired) as e:
    print(f"nvidia-smi topo -m: {e}")
  with tempfile.TemporaryDirectory(prefix="dp_scaling_autotune_") as cache:
    wanted = sorted({f for flags in VARIANTS.values() for f in flags}
                    | {f"{AUTOTUNE_CACHE}={cache}"})
    known = known_flags(wanted)
    shared = [f for f in wanted if f.startswith(AUTOTUNE_CACHE) and f in known]
    base = run_child("base", shared, args, deadline)
    print(f"   devices: {base.get('kinds', base.get('error'))}")
    variants = {}
    for name, flags in VARIANTS.items():
      if all(f in known for f in flags):
        variants[name] = run_child(name, shared + flags, args, deadline)
      else:
        print(f"== {name}: dropped, a flag is missing from jaxlib")
  report(args, base, variants)


if __name__ == "__main__":
  main()
