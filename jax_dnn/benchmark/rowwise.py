"""Memory-bound ops over the last axis of x [R, W] (R rows of width W): the
shapes they sweep and how one case becomes a workload.

An op here is (ours, xla, params): ours is the jax_dnn function, xla the same
math written in jnp and fused by XLA (what a user writes), both called as
f(x, *params) with `params` per-feature [W] fp32 arrays (scale, bias).
Bytes of one application, counting the arrays of x's size only (parameters
and per-row statistics are negligible):
  fwd      x read + y written               2 R W
  bwd      x, dy read + dx written          3 R W
  fwd+bwd  x, dy read + y, dx written       4 R W
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jax_dnn.benchmark import harness

# The widths of common models, then odd and prime widths (no vector width
# divides them) with rows such that a timed call, at most 32 sets of x, reads
# at least 1 GiB (1024x1024 reads 64 MiB).
SHAPES = (
    ((1024, 1024), "bfloat16"), ((16384, 1024), "bfloat16"), ((16384, 4096), "bfloat16"),
    ((16384, 8192), "bfloat16"), ((4096, 131072), "bfloat16"), ((16384, 4096), "float32"),
    ((32768, 1000), "bfloat16"), ((16384, 4097), "bfloat16"), ((8192, 12289), "bfloat16"),
    ((2048, 65537), "bfloat16"),
)
# --quick: the headline shape and one odd width.
QUICK_SHAPES = (((16384, 4096), "bfloat16"), ((16384, 4097), "bfloat16"))
PASSES = {"fwd": 2, "bwd": 3, "fwd+bwd": 4}  # arrays of x's size one application moves
PLOT_X = "row width W (bf16)"

_SHORT = {"bfloat16": "bf16", "float16": "f16", "float32": "f32"}


def cases(ops: dict, quick: bool, *, max_width: dict | None = None) -> list[harness.Case]:
  """Every op of `ops` over SHAPES (QUICK_SHAPES); max_width: op -> the widest
  W it runs (an elementwise op gains nothing from long rows)."""
  shapes = QUICK_SHAPES if quick else SHAPES
  return [harness.Case(op=op, shape=shape, dtype=dtype,
                       label=f"{op} {shape[0]}x{shape[1]} {_SHORT[dtype]}")
          for op in ops for shape, dtype in shapes
          if shape[1] <= (max_width or {}).get(op, math.inf)]


def workload(op, case: harness.Case, settings: harness.Settings) -> harness.Workload:
  """Random normal x and dy, K sets of each (harness.input_sets), and the
  parameters 1 + 0.1 * normal, shared by the sets."""
  ours, xla, nparams = op
  rows, width = case.shape
  dtype = jnp.dtype(case.dtype)
  nbytes = rows * width * dtype.itemsize
  sets = harness.input_sets(nbytes, settings)
  kx, kdy, kp = jax.random.split(jax.random.key(0), 3)

  def normal(key, i, shape):
    return jax.random.normal(jax.random.fold_in(key, i), shape, jnp.float32)

  params = tuple(1.0 + 0.1 * normal(kp, i, (width,)) for i in range(nparams))
  return harness.Workload(
      fns={"ours": ours, "xla": xla},
      args=[(normal(kx, i, case.shape).astype(dtype), *params) for i in range(sets)],
      cotangents=[normal(kdy, i, case.shape).astype(dtype) for i in range(sets)],
      work={mode: passes * nbytes for mode, passes in PASSES.items()},
      tolerance=harness.tolerance(dtype))


def plot_point(row: dict):
  """Panel per op and mode, x = W; bf16 only (the last rows count listed wins a width)."""
  if row["dtype"] != "bfloat16":
    return None
  return f"{row['op']}, {row['mode']}", row["shape"][1], ""


def family(name: str, ops: dict, *, max_width: dict | None = None) -> harness.Family:
  """The declaration every row-op family shares: ours against XLA, in GB/s of
  the copy bandwidth."""
  return harness.Family(
      name=name, unit="GB/s", ceiling="copy", impls=("ours", "xla"), reference=("xla",),
      cases=lambda quick: cases(ops, quick, max_width=max_width),
      workload=lambda case, settings: workload(ops[case.op], case, settings),
      plot_point=plot_point, plot_x=PLOT_X)
