"""Group norm + SiLU and instance norm, channels last: jax_dnn's kernels
against flax.nnx.GroupNorm / InstanceNorm (followed by jax.nn.silu where
fused), jitted, in GB/s.

Flax runs with dtype = x's dtype (bf16 layers compute in bf16 with fp32
statistics, as a bf16 model configures them) and its default fast variance;
ours takes the same x and fp32 parameters. Shapes: the Stable-Diffusion UNet's
group norms (32 groups, 64^2 x 320, 32^2 x 640, 128^2 x 128), a 3D UNet's
(64^3 x 64), a VAE decoder's (512^2 x 128), and an instance norm at 64^2 x
256.

Bytes of one application, counting the arrays of x's size only (parameters
and statistics are negligible):
  fwd      x read + y written               2 |x|
  bwd      x, dy read + dx written          3 |x|
  fwd+bwd  x, dy read + y, dx written       4 |x|
"""

from __future__ import annotations

import functools
import math

from flax import nnx
import jax
import jax.numpy as jnp

import jax_dnn
from jax_dnn.benchmark import harness

PASSES = {"fwd": 2, "bwd": 3, "fwd+bwd": 4}
_SHORT = {"bfloat16": "bf16", "float16": "f16", "float32": "f32"}

# (op, shape [N, *spatial, C], groups; None: instance norm), all bf16.
SHAPES = (
    ("group_norm+silu", (8, 64, 64, 320), 32),
    ("group_norm+silu", (8, 32, 32, 640), 32),
    ("group_norm+silu", (16, 128, 128, 128), 32),
    ("group_norm+silu", (2, 64, 64, 64, 64), 32),
    ("group_norm+silu", (1, 512, 512, 128), 32),
    ("instance_norm", (32, 64, 64, 256), None),
)
QUICK = (SHAPES[0], SHAPES[-1])


def _label(op, shape, dtype):
  n, c = shape[0], shape[-1]
  spatial = "x".join(map(str, shape[1:-1]))
  return f"{op} {n}x{spatial}x{c} {_SHORT[dtype]}"


def cases(quick: bool) -> list[harness.Case]:
  return [harness.Case(op=op, shape=shape, dtype="bfloat16",
                       label=_label(op, shape, "bfloat16"), options=(("groups", groups),))
          for op, shape, groups in (QUICK if quick else SHAPES)]


def _flax(layer, activation):
  """f(x, scale, bias): Flax's layer with the given parameters, then act."""
  graphdef, state = nnx.split(layer)
  paths, treedef = jax.tree_util.tree_flatten_with_path(state)
  names = ["scale" if "scale" in jax.tree_util.keystr(p) else "bias" for p, _ in paths]

  def fn(x, scale, bias):
    given = {"scale": scale, "bias": bias}
    model = nnx.merge(graphdef, jax.tree.unflatten(treedef, [given[n] for n in names]))
    return activation(model(x))
  return fn


def impls(case: harness.Case) -> dict:
  c, dtype = case.shape[-1], jnp.dtype(case.dtype)
  groups = case.option("groups")
  if case.op == "instance_norm":
    theirs = nnx.InstanceNorm(c, dtype=dtype, rngs=nnx.Rngs(0))
    return {"ours": jax_dnn.instance_norm, "flax": _flax(theirs, lambda y: y)}
  theirs = nnx.GroupNorm(c, num_groups=groups, dtype=dtype, rngs=nnx.Rngs(0))
  ours = functools.partial(jax_dnn.group_norm, num_groups=groups, activation="silu")
  return {"ours": ours, "flax": _flax(theirs, jax.nn.silu)}


def workload(case: harness.Case, settings: harness.Settings) -> harness.Workload:
  """Random normal x (mean 0.5) and dy, K sets of each (harness.input_sets),
  and the parameters 1 + 0.1 * normal and 0.1 * normal, shared by the sets."""
  dtype = jnp.dtype(case.dtype)
  c = case.shape[-1]
  nbytes = math.prod(case.shape) * dtype.itemsize
  sets = harness.input_sets(nbytes, settings)
  kx, kdy, kp = jax.random.split(jax.random.key(0), 3)

  def normal(key, i, shape):
    return jax.random.normal(jax.random.fold_in(key, i), shape, jnp.float32)

  params = (1.0 + 0.1 * normal(kp, 0, (c,)), 0.1 * normal(kp, 1, (c,)))
  return harness.Workload(
      fns=impls(case),
      args=[((0.5 + normal(kx, i, case.shape)).astype(dtype), *params) for i in range(sets)],
      cotangents=[normal(kdy, i, case.shape).astype(dtype) for i in range(sets)],
      work={mode: passes * nbytes for mode, passes in PASSES.items()},
      tolerance=harness.tolerance(dtype))


def plot_point(row: dict):
  """Panel per op and mode, x = the MiB of x."""
  mib = math.prod(row["shape"]) * jnp.dtype(row["dtype"]).itemsize / 2**20
  return f"{row['op']}, {row['mode']}", mib, ""


FAMILY = harness.Family(
    name="group_norm", unit="GB/s", ceiling="copy", impls=("ours", "flax"), reference=("flax",),
    cases=cases, workload=workload, plot_point=plot_point, plot_x="x (MiB, bf16)")
