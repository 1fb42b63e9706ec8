"""Pooling: jax_dnn against flax.linen's pooling (XLA's reduce_window, and
select_and_scatter for max pooling's gradient), and against XLA's mean for
global and adaptive average pooling, on the same inputs, in GB/s.

Implementations: "ours" is jax_dnn's default (jax_dnn.pool_plan: XLA's
forward where the windows tile the input, the kernels elsewhere);
"kernels" is jax_dnn under jax_dnn.config deterministic, where every
forward runs the kernels (the measurement behind pool_plan's rule).

Bytes of one application (x [N, *spatial, C], y [N, *out, C], dy like y,
dx like x; each array counted once; the same count for every
implementation):
  fwd      x read + y written
  bwd      dy read + dx written (+ one byte an output for max pooling: the
           argmax offsets its gradient reads)
  fwd+bwd  x, dy read + y, dx written (+ the offsets written and read)
"""

from __future__ import annotations

import math

from flax.linen import pooling as flax_pooling
import jax
import jax.numpy as jnp

import jax_dnn
from jax_dnn.benchmark import harness


def _adaptive_avg_xla(x, out):
  """Adaptive average pooling where the output divides the input (as in
  these cases): a reshape and a mean, what a user writes for XLA."""
  n, h, w, c = x.shape
  xf = x.astype(jnp.float32).reshape(n, out, h // out, out, w // out, c)
  return jnp.mean(xf, axis=(2, 4)).astype(x.dtype)


def _deterministic(fn):
  """fn traced under jax_dnn.config deterministic (read when traced)."""

  def traced(x):
    before = jax_dnn.config.deterministic
    jax_dnn.config.update("deterministic", True)
    try:
      return fn(x)
    finally:
      jax_dnn.config.update("deterministic", before)

  return traced


# op -> (ours, XLA/Flax, max pooling: its backward reads argmax offsets)
OPS = {
    "max_pool 3x3 s2": (lambda x: jax_dnn.max_pool(x, (3, 3), (2, 2), ((1, 1), (1, 1))),
                        lambda x: flax_pooling.max_pool(x, (3, 3), (2, 2), ((1, 1), (1, 1))),
                        True),
    "avg_pool 2x2 s2": (lambda x: jax_dnn.avg_pool(x, (2, 2), (2, 2)),
                        lambda x: flax_pooling.avg_pool(x, (2, 2), (2, 2)), False),
    "global avg_pool": (lambda x: jax_dnn.adaptive_avg_pool(x, 1),
                        lambda x: jnp.mean(x.astype(jnp.float32), axis=(1, 2),
                                           keepdims=True).astype(x.dtype), False),
    "adaptive avg_pool 7x7": (lambda x: jax_dnn.adaptive_avg_pool(x, 7),
                              lambda x: _adaptive_avg_xla(x, 7), False),
    "max_pool 2x2x2 s2": (lambda x: jax_dnn.max_pool(x, (2, 2, 2), (2, 2, 2)),
                          lambda x: flax_pooling.max_pool(x, (2, 2, 2), (2, 2, 2)), True),
    "max_pool 2x2 s2": (lambda x: jax_dnn.max_pool(x, (2, 2), (2, 2)),
                        lambda x: flax_pooling.max_pool(x, (2, 2), (2, 2)), True),
    "avg_pool 3x3 s1": (lambda x: jax_dnn.avg_pool(x, (3, 3), (1, 1), "SAME"),
                        lambda x: flax_pooling.avg_pool(x, (3, 3), (1, 1), "SAME"), False),
}

# (op, x shape, dtype): the ResNet stem's max pool (N 128 and 256), a 2x2
# average pool on the same activations, ConvNeXt/ResNet heads' global
# average pool, an adaptive pool to 7x7 (VGG's head), a 3D UNet's max pool.
CASES = (
    ("max_pool 3x3 s2", (128, 112, 112, 64), "bfloat16"),
    ("max_pool 3x3 s2", (256, 112, 112, 64), "bfloat16"),
    ("max_pool 3x3 s2", (128, 112, 112, 64), "float32"),
    ("avg_pool 2x2 s2", (128, 112, 112, 64), "bfloat16"),
    ("global avg_pool", (128, 7, 7, 2048), "bfloat16"),
    ("global avg_pool", (256, 7, 7, 2048), "bfloat16"),
    ("adaptive avg_pool 7x7", (128, 14, 14, 512), "bfloat16"),
    ("max_pool 2x2x2 s2", (2, 64, 64, 64, 32), "bfloat16"),
    ("max_pool 2x2 s2", (128, 112, 112, 64), "bfloat16"),
    ("avg_pool 3x3 s1", (128, 56, 56, 64), "bfloat16"),
)
QUICK_CASES = (CASES[0], CASES[4])

_SHORT = {"bfloat16": "bf16", "float16": "f16", "float32": "f32"}


def cases(quick: bool) -> list[harness.Case]:
  return [harness.Case(op=op, shape=shape, dtype=dtype,
                       label=f"{op} {'x'.join(map(str, shape))} {_SHORT[dtype]}")
          for op, shape, dtype in (QUICK_CASES if quick else CASES)]


def workload(case: harness.Case, settings: harness.Settings) -> harness.Workload:
  ours, xla, reads_x = OPS[case.op]
  dtype = jnp.dtype(case.dtype)
  x_bytes = math.prod(case.shape) * dtype.itemsize
  y_shape = jax.eval_shape(ours, jax.ShapeDtypeStruct(case.shape, dtype)).shape
  y_bytes = math.prod(y_shape) * dtype.itemsize
  sets = harness.input_sets(x_bytes, settings)
  kx, kdy = jax.random.split(jax.random.key(0))

  def normal(key, i, shape):
    return jax.random.normal(jax.random.fold_in(key, i), shape, jnp.float32).astype(dtype)

  offsets = y_bytes // dtype.itemsize if reads_x else 0
  bwd = y_bytes + x_bytes + offsets
  return harness.Workload(
      fns={"ours": ours, "kernels": _deterministic(ours), "xla": xla},
      args=[(normal(kx, i, case.shape),) for i in range(sets)],
      cotangents=[normal(kdy, i, y_shape) for i in range(sets)],
      work={"fwd": x_bytes + y_bytes, "bwd": bwd,
            "fwd+bwd": 2 * (x_bytes + y_bytes + offsets)},
      tolerance=harness.tolerance(dtype))


def plot_point(row: dict):
  """Panel per op and mode; x = the input's size in MB."""
  size = math.prod(row["shape"]) * jnp.dtype(row["dtype"]).itemsize / 1e6
  return f"{row['op']}, {row['mode']}", size, _SHORT[row["dtype"]]


FAMILY = harness.Family(
    name="pooling", unit="GB/s", ceiling="copy", impls=("ours", "kernels", "xla"),
    reference=("xla",),
    cases=cases, workload=workload, plot_point=plot_point, plot_x="input size (MB)")
