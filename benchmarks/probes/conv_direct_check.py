"""Checks and times the direct convolution kernels (depthwise_direct,
grouped_direct) on a GPU, against lax.conv_general_dilated (XLA, cuDNN).

  cd tests && python ../benchmarks/probes/conv_direct_check.py [--skip-check] [--skip-time] [--json out.json]

Run from tests/ after installing the CUDA build (pip install .), so that
`import jax_dnn` finds the installed package with its kernels, not the source
tree. Takes about a minute.

(a) Correctness, in the deterministic mode (which takes the direct kernels):
forward (with bias / residual / activation where the case asks), dgrad and
wgrad of jax_dnn.conv on awkward shapes (odd extents, padding past the
window, strides, dilations, ranks 1-3, bf16 / fp16 / fp32, channel counts that
split into partial slices or are not a multiple of 8, a multiplier, N = 0),
each output landing in a buffer poisoned with NaN first, against lax in fp32
at HIGHEST precision on the same rounded inputs: max error <= tol x
max(1, max |reference|) (tol: half-ulp-scale of the dtype plus fp32
reassociation), and two runs bitwise equal. Prints the algorithm each op ran.

(b) Time: ours (deterministic mode: the direct kernels) and XLA on the
benchmark set's depthwise and grouped layers, bf16, SAME: fwd, dgrad (dx
alone) and wgrad (dkernel alone), jitted, warmed up, the median over 25
samples of 4 back-to-back calls each (block_until_ready after each sample).
GB/s counts x and y once (fwd: x, y; dgrad: dy, dx; wgrad: x, dy); ratio is
XLA's time over ours (> 1: ours is faster).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
import warnings
import zlib

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

import jax_dnn

HIGHEST = lax.Precision.HIGHEST
DN = {1: ("NWC", "WIO", "NWC"), 2: ("NHWC", "HWIO", "NHWC"), 3: ("NDHWC", "DHWIO", "NDHWC")}
TOL = {jnp.dtype(jnp.bfloat16): 1e-2, jnp.dtype(jnp.float16): 2e-3,
       jnp.dtype(jnp.float32): 2e-5}
ACT = {None: lambda v: v, "relu": jax.nn.relu, "silu": jax.nn.silu,
       "gelu": functools.partial(jax.nn.gelu, approximate=False)}

# (name, x shape, kernel shape [*window, C/groups, K], dtype, conv keywords).
# bias / residual / activation in the keywords: the fused epilogue.
CASES = [
    # depthwise: the tiled kernel (fprop, stride-1 dgrad) ...
    ("dw 3x3 c144 res silu", (2, 19, 23, 144), (3, 3, 1, 144), jnp.bfloat16,
     dict(groups=144, bias=True, residual=True, activation="silu")),
    ("dw 5x5 s2 c88", (1, 17, 30, 88), (5, 5, 1, 88), jnp.bfloat16, dict(groups=88, strides=2)),
    ("dw 3x3 dilated pad", (2, 12, 9, 32), (3, 3, 1, 32), jnp.float16,
     dict(groups=32, dilation=(2, 3), padding=((3, 1), (0, 4)))),
    ("dw 1d k7", (3, 37, 24), (7, 1, 24), jnp.bfloat16, dict(groups=24, bias=True)),
    ("dw 3d 3x3x3 gelu", (1, 5, 6, 7, 16), (3, 3, 3, 1, 16), jnp.bfloat16,
     dict(groups=16, residual=True, activation="gelu")),
    ("dw 7x7 fp32 relu", (2, 14, 14, 64), (7, 7, 1, 64), jnp.float32,
     dict(groups=64, bias=True, activation="relu")),
    ("dw 7x7 s2", (2, 9, 9, 64), (7, 7, 1, 64), jnp.bfloat16, dict(groups=64, strides=2)),
    ("dw 3x3 pad past window", (1, 6, 5, 40), (3, 3, 1, 40), jnp.bfloat16,
     dict(groups=40, padding=((4, 4), (5, 0)))),
    ("dw 1d k3 dilated fp32", (2, 50, 8), (3, 1, 8), jnp.float32, dict(groups=8, dilation=4)),
    ("dw 9x9 big", (1, 40, 41, 256), (9, 9, 1, 256), jnp.bfloat16, dict(groups=256)),
    # ... and the other direct kernels: a multiplier, C % 8 != 0, N = 0.
    ("dw multiplier 2", (2, 8, 8, 16), (3, 3, 1, 32), jnp.bfloat16, dict(groups=16)),
    ("dw c12 fp16", (2, 8, 9, 12), (3, 3, 1, 12), jnp.float16, dict(groups=12)),
    ("dw n=0", (0, 8, 8, 32), (3, 3, 1, 32), jnp.bfloat16, dict(groups=32)),
    # grouped_direct (strided dgrad, 3D wgrad and groups of 3 or 6: XLA).
    ("g 4/group bias", (2, 13, 12, 64), (3, 3, 4, 64), jnp.bfloat16, dict(groups=16, bias=True)),
    ("g 6->3 res relu fp16", (2, 9, 15, 48), (3, 3, 6, 24), jnp.float16,
     dict(groups=8, residual=True, activation="relu")),
    ("g 8/group s2", (2, 15, 14, 64), (3, 3, 8, 64), jnp.bfloat16, dict(groups=8, strides=2)),
    ("g 3d", (1, 5, 6, 7, 32), (3, 3, 3, 4, 32), jnp.bfloat16, dict(groups=8)),
    ("g 16/group 7x7", (2, 11, 13, 256), (7, 7, 16, 256), jnp.bfloat16, dict(groups=16)),
    ("g 3/group fp32", (2, 10, 10, 96), (3, 3, 3, 96), jnp.float32, dict(groups=32)),
    ("g 4/group dilated fp32", (2, 20, 20, 128), (3, 3, 4, 128), jnp.float32,
     dict(groups=32, dilation=2)),
]

# (label, N, spatial, C, K, window, groups).
LAYERS = [
    ("convnext dw 7x7 56^2 128", 64, (56, 56), 128, 128, (7, 7), 128),
    ("convnext dw 7x7 28^2 256", 64, (28, 28), 256, 256, (7, 7), 256),
    ("mobilenet dw 3x3 112^2 32", 128, (112, 112), 32, 32, (3, 3), 32),
    ("mobilenet dw 3x3 56^2 144", 128, (56, 56), 144, 144, (3, 3), 144),
    ("resnext g32 3x3 56^2 128", 128, (56, 56), 128, 128, (3, 3), 32),
    ("resnext g32 3x3 28^2 256", 128, (28, 28), 256, 256, (3, 3), 32),
]


def per_axis(v, n):
  return tuple(v) if isinstance(v, (tuple, list)) else (v,) * n


def reference(x, w, b, r, kw):
  """lax in fp32 at HIGHEST precision, the epilogue in fp32."""
  n = x.ndim - 2
  y = lax.conv_general_dilated(
      x.astype(jnp.float32), w.astype(jnp.float32), per_axis(kw.get("strides", 1), n),
      kw.get("padding", "SAME"), rhs_dilation=per_axis(kw.get("dilation", 1), n),
      dimension_numbers=DN[n], feature_group_count=kw.get("groups", 1), precision=HIGHEST)
  if b is not None:
    y = y + b.astype(jnp.float32)
  if r is not None:
    y = y + r.astype(jnp.float32)
  return ACT[kw.get("activation")](y)


def deterministic(on: bool):
  jax_dnn.config.update("deterministic", on)


def poisoned(fn, *args, runs=2):
  """jit(fn)(*args) `runs` times (one compilation), each with its outputs in
  buffers filled with NaN first; returns ([outputs of each run], how many
  outputs of the first run reused a poisoned buffer)."""
  leaves = jax.tree.leaves(jax.eval_shape(fn, *args))
  call = jax.jit(lambda poison, *a: fn(*a), donate_argnums=0, keep_unused=True)
  outs, reused = [], 0
  for i in range(runs):
    poison = [jnp.full(s.shape, jnp.nan, s.dtype) for s in leaves]
    ptrs = {p.unsafe_buffer_pointer() for p in poison if p.size}
    with warnings.catch_warnings():
      warnings.filterwarnings("ignore", message=".*donated buffers were not usable.*")
      out = call(poison, *args)
    if i == 0:
      reused = sum(o.unsafe_buffer_pointer() in ptrs for o in jax.tree.leaves(out) if o.size)
    outs.append(out)
  return outs, reused


def check_case(case) -> tuple[bool, str]:
  name, x_shape, k_shape, dtype, kw = case
  kw = dict(kw)
  conv_kw = {k: v for k, v in kw.items() if k not in ("bias", "residual", "activation")}
  keys = jax.random.split(jax.random.key(zlib.crc32(name.encode())), 5)
  x = jax.random.normal(keys[0], x_shape, jnp.float32).astype(dtype)
  fan_in = int(np.prod(k_shape[:-1]))
  w = (jax.random.normal(keys[1], k_shape, jnp.float32) / np.sqrt(fan_in)).astype(dtype)
  y_shape = jax.eval_shape(lambda x, w: jax_dnn.conv(x, w, **conv_kw), x, w).shape
  normal = lambda key, shape: jax.random.normal(key, shape, jnp.float32).astype(dtype)
  b = normal(keys[2], k_shape[-1:]) if kw.get("bias") else None
  r = normal(keys[3], y_shape) if kw.get("residual") else None
  dy = jax.random.normal(keys[4], y_shape, jnp.float32).astype(dtype)
  act = kw.get("activation")

  def ours(x, w, dy):
    y, back = jax.vjp(lambda x, w: jax_dnn.conv(x, w, b, residual=r, activation=act, **conv_kw),
                      x, w)
    return (y,) + tuple(back(dy))

  def ref(x, w, dy):
    y, back = jax.vjp(lambda x, w: reference(x, w, b, r, kw), x.astype(jnp.float32),
                      w.astype(jnp.float32))
    return (y,) + tuple(back(dy.astype(jnp.float32)))

  deterministic(True)
  try:
    algos = jax_dnn.conv_algorithms(x, w, b, residual=r, activation=act, **conv_kw)
    ran = "/".join("xla" if algos[op].chosen is None else algos[op].chosen.name.split("_")[0]
                   for op in ("fwd", "dgrad", "wgrad"))
    (got, again), reused = poisoned(ours, x, w, dy)
  finally:
    deterministic(False)
  want = jax.jit(ref)(x, w, dy)
  problems = []
  for what, g, a, e in zip(("y", "dx", "dw"), got, again, want):
    g32 = np.asarray(g.astype(jnp.float32))
    e32 = np.asarray(e)
    if g.shape != e.shape or g.dtype != dtype:
      problems.append(f"{what}: {g.shape} {g.dtype} vs {e.shape}")
      continue
    if g.size == 0:
      continue
    if not np.all(np.isfinite(g32)):
      problems.append(f"{what}: non-finite (unwritten?)")
      continue
    err = float(np.max(np.abs(g32 - e32)))
    bound = TOL[jnp.dtype(dtype)] * max(1.0, float(np.max(np.abs(e32))))
    if err > bound:
      problems.append(f"{what}: max error {err:.3g} > {bound:.3g}")
    if not np.array_equal(g32, np.asarray(a.astype(jnp.float32)), equal_nan=True):
      problems.append(f"{what}: two runs differ")
  if ran.replace("xla", "").strip("/") and reused == 0:
    problems.append("no output landed in a poisoned buffer")
  return not problems, f"{name:28s} {jnp.dtype(dtype).name:8s} ran {ran:22s} " + (
      "ok" if not problems else "FAIL: " + "; ".join(problems))


def time_fn(fn, *args, samples=25, per_sample=4) -> float:
  """Median ms of one call."""
  for _ in range(3):
    jax.block_until_ready(fn(*args))
  times = []
  for _ in range(samples):
    t0 = time.perf_counter()
    for _ in range(per_sample):
      out = fn(*args)
    jax.block_until_ready(out)
    times.append((time.perf_counter() - t0) / per_sample * 1e3)
  return statistics.median(times)


def time_layer(layer) -> list[dict]:
  label, n, spatial, c, k, window, groups = layer
  keys = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(keys[0], (n, *spatial, c), jnp.bfloat16)
  w = (jax.random.normal(keys[1], (*window, c // groups, k), jnp.float32)
       / np.sqrt(np.prod(window) * c // groups)).astype(jnp.bfloat16)
  dy = jax.random.normal(keys[2], (n, *spatial, k), jnp.bfloat16)
  rank = len(spatial)
  impls = {
      "ours": lambda x, w: jax_dnn.conv(x, w, groups=groups),
      "xla": lambda x, w: lax.conv_general_dilated(x, w, (1,) * rank, "SAME",
                                                   dimension_numbers=DN[rank],
                                                   feature_group_count=groups),
  }
  ops = {
      "fwd": lambda f: lambda x, w, dy: f(x, w),
      "dgrad": lambda f: lambda x, w, dy: jax.vjp(lambda x: f(x, w), x)[1](dy)[0],
      "wgrad": lambda f: lambda x, w, dy: jax.vjp(lambda w: f(x, w), w)[1](dy)[0],
  }
  act_bytes = x.size * 2 + dy.size * 2  # x (or dx) and y (or dy), bf16
  rows = []
  for op, make in ops.items():
    row = dict(layer=label, op=op)
    for impl, f in impls.items():
      deterministic(impl == "ours")
      try:
        fn = jax.jit(make(f))
        if impl == "ours":
          got = jax_dnn.conv_algorithms(x, w, groups=groups)[op].chosen
          row["algorithm"] = "xla" if got is None else got.name
        row[impl] = time_fn(fn, x, w, dy)
      finally:
        deterministic(False)
    row["gbs"] = act_bytes / (row["ours"] * 1e-3) / 1e9
    row["ratio"] = row["xla"] / row["ours"]
    rows.append(row)
  return rows


def copy_bandwidth() -> float:
  """GB/s of a 1 GiB bf16 copy (read + write)."""
  a = jnp.ones((1 << 29,), jnp.bfloat16)
  ms = time_fn(jax.jit(lambda a: a + 1), a, samples=10)
  return 2 * a.size * 2 / (ms * 1e-3) / 1e9


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--skip-check", action="store_true")
  parser.add_argument("--skip-time", action="store_true")
  parser.add_argument("--json", help="write the timing rows here")
  args = parser.parse_args()
  if jax.devices()[0].platform != "gpu" or not jax_dnn.has_cuda_kernels():
    print("needs a GPU and jax_dnn built with its CUDA kernels (run from tests/ after "
          "pip install .)")
    return 2
  print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}, jax_dnn from {jax_dnn.__file__}")
  failed = 0
  start = time.perf_counter()
  if not args.skip_check:
    print("\n(a) correctness, deterministic mode (fwd/dgrad/wgrad algorithm)")
    for case in CASES:
      ok, line = check_case(case)
      failed += not ok
      print(" ", line, flush=True)
    print(f"  {len(CASES) - failed}/{len(CASES)} ok ({time.perf_counter() - start:.0f} s)")
  if not args.skip_time:
    copy = copy_bandwidth()
    print(f"\n(b) time, bf16, ms (ours: deterministic mode); copy bandwidth {copy:.0f} GB/s")
    print(f"  {'layer':28s} {'op':6s} {'algorithm':16s} {'ours':>7s} {'xla':>7s} "
          f"{'GB/s':>6s} {'%copy':>6s} {'xla/ours':>8s}")
    rows = []
    for layer in LAYERS:
      for row in time_layer(layer):
        rows.append(row)
        print(f"  {row['layer']:28s} {row['op']:6s} {row['algorithm']:16s} {row['ours']:7.3f} "
              f"{row['xla']:7.3f} {row['gbs']:6.0f} {100 * row['gbs'] / copy:5.0f}% "
              f"{row['ratio']:7.2f}x", flush=True)
    if args.json:
      with open(args.json, "w") as f:
        json.dump(dict(device=jax.devices()[0].device_kind, copy_gbs=copy, rows=rows), f,
                  indent=1)
  print(f"\n{time.perf_counter() - start:.0f} s")
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
