"""Batch norm in training mode with a fused ReLU (and ResNet's residual add):
jax_dnn.batch_norm against flax.nnx.BatchNorm followed by jax.nn.relu, both
jitted, in GB/s of the copy bandwidth. NHWC / NDHWC, channels last.

Bytes of one application, counting the arrays of x's size only (parameters
and statistics are C-wide): each input read once and each output written
once, as the issue measures XLA:
  fwd      x read + y written                     2
  bwd      x, dy read + dx written                3
  fwd+bwd  x, dy read + y, dx written             4
with the residual one more in each (read forward; its gradient written
backward). The kernels move more: the forward reads x twice (statistics,
then the apply) and the backward reads x and dy twice (the sums, then dx).
"""

from __future__ import annotations

import math

from flax import nnx
import jax
import jax.numpy as jnp

import jax_dnn
from jax_dnn.benchmark import harness

EPSILON = 1e-5

# The issue's shapes: ResNet-50's stage 1 (N=128, 56^2, 256) and stage 3
# (N=256, 14^2, 1024) batch norms, and a 3D UNet's (2, 64^3, 64); the
# residual add at stage 1, forward only: Flax adds the residual to a bf16 y,
# ours to the fp32 one, so where the sum is near 0 the two ReLUs' gradients
# straddle the kink (dy against 0: errors of order 1 in the check of a
# backward).
CASES = (
    ("batch_norm_relu", (128, 56, 56, 256)),
    ("batch_norm_relu", (256, 14, 14, 1024)),
    ("batch_norm_relu", (2, 64, 64, 64, 64)),
    ("batch_norm_add_relu", (128, 56, 56, 256)),
)
QUICK = (("batch_norm_relu", (128, 56, 56, 256)),)
PASSES = {"fwd": 2, "bwd": 3, "fwd+bwd": 4}


def _ours(residual: bool):
  if residual:
    return lambda x, s, b, r: jax_dnn.batch_norm(x, s, b, residual=r, activation="relu",
                                                 epsilon=EPSILON)[0]
  return lambda x, s, b: jax_dnn.batch_norm(x, s, b, activation="relu", epsilon=EPSILON)[0]


def _flax(residual: bool):
  """nnx.BatchNorm (its own code: fast variance, fp32 statistics) + relu,
  with the given parameters."""
  def fn(x, s, b, *r):
    layer = nnx.BatchNorm(x.shape[-1], epsilon=EPSILON, dtype=x.dtype, rngs=nnx.Rngs(0))
    layer.scale[...] = s
    layer.bias[...] = b
    y = layer(x, use_running_average=False)
    return jax.nn.relu(y + r[0] if residual else y)
  return fn


def _label(op, shape):
  dims = "x".join(map(str, shape))
  return f"{op} {dims} bf16"


def cases(quick: bool) -> list[harness.Case]:
  return [harness.Case(op=op, shape=shape, dtype="bfloat16", label=_label(op, shape),
                       modes=("fwd",) if op == "batch_norm_add_relu" else harness.MODES)
          for op, shape in (QUICK if quick else CASES)]


def workload(case: harness.Case, settings: harness.Settings) -> harness.Workload:
  """Random x (and residual) and dy, K sets of each (harness.input_sets);
  scale 1 + 0.1 normal and bias 0.05 normal, shared.

  x is normal pushed 0.5 away from 0 (sign(n) * (0.5 + |n|), std 1.43), so
  normalized x keeps 0.35 away from 0 and, with |bias| under 0.2 (4 sigma),
  no y lies near ReLU's kink: Flax rounds y to bf16 before its ReLU and we do not, and
  an element whose two y straddle 0 takes dy in one backward and 0 in the
  other (errors of order 1 that say nothing about either). The residual case
  is forward only."""
  residual = case.op == "batch_norm_add_relu"
  dtype = jnp.dtype(case.dtype)
  c = case.shape[-1]
  nbytes = math.prod(case.shape) * dtype.itemsize
  sets = harness.input_sets(nbytes * (2 if residual else 1), settings)
  kx, kr, kdy, kp = jax.random.split(jax.random.key(0), 4)

  def normal(key, i, shape):
    return jax.random.normal(jax.random.fold_in(key, i), shape, jnp.float32)

  def away_from_zero(key, i, shape):
    n = normal(key, i, shape)
    return jnp.sign(n) * (0.5 + jnp.abs(n))

  params = (1.0 + 0.1 * normal(kp, 0, (c,)), 0.05 * normal(kp, 1, (c,)))
  args = []
  for i in range(sets):
    extra = (normal(kr, i, case.shape).astype(dtype),) if residual else ()
    args.append((away_from_zero(kx, i, case.shape).astype(dtype), *params, *extra))
  return harness.Workload(
      fns={"ours": _ours(residual), "flax": _flax(residual)},
      args=args,
      cotangents=[normal(kdy, i, case.shape).astype(dtype) for i in range(sets)],
      work={mode: (passes + residual) * nbytes for mode, passes in PASSES.items()},
      tolerance=harness.tolerance(dtype))


def plot_point(row: dict):
  """Panel per mode, x = the case's tensor size in MB, one variant a case."""
  size = math.prod(row["shape"]) * 2 / 1e6
  return f"{row['mode']}", size, row["op"]


FAMILY = harness.Family(
    name="batch_norm", unit="GB/s", ceiling="copy", impls=("ours", "flax"), reference=("flax",),
    cases=cases, workload=workload, plot_point=plot_point, plot_x="x (MB, bf16)")
