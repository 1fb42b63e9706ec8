"""softmax and log_softmax along any axis.

The kernels take float32, bfloat16 and float16 arrays and one int axis;
everything else jax.nn.softmax / log_softmax accept runs jax.nn's function.

Numerics: fp32 max/sum/exp, output in the input dtype. The backward takes
x as its residual and recomputes y = softmax(x) in fp32:
  softmax:      dx = y * (dy - sum(dy * y))
  log_softmax:  dx = dy - y * sum(dy)
so the forward saves nothing and a gradient-only program skips the forward
kernel (XLA removes it); the recomputed y is also more accurate than a
bf16-rounded saved one.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_dnn._src import checks
from jax_dnn._src import sharding
from jax_dnn._src.batching import batch_size, move_to_front
from jax_dnn._src.primitive import ShapedArray, define_primitive, vjp_op


# --- references (pure JAX; what non-CUDA platforms run) ----------------------


def _softmax_fwd_reference(x, *, axis, log):
  xf = x.astype(jnp.float32)
  y = jax.nn.log_softmax(xf, axis=axis) if log else jax.nn.softmax(xf, axis=axis)
  return y.astype(x.dtype)


def _softmax_bwd_reference(dy, x, *, axis, log):
  yf = jax.nn.softmax(x.astype(jnp.float32), axis=axis)
  dyf = dy.astype(jnp.float32)
  if log:
    dx = dyf - yf * jnp.sum(dyf, axis=axis, keepdims=True)
  else:
    dx = yf * (dyf - jnp.sum(dyf * yf, axis=axis, keepdims=True))
  return dx.astype(x.dtype)


# --- primitives ---------------------------------------------------------------


def _shifted_axis(axis, bdim):
  return axis + 1 if bdim <= axis else axis


def _fwd_batch(args, dims, *, axis, log):
  (x,), (bdim,) = args, dims
  # The batch axis stays where it is; only the softmax axis index moves.
  return softmax_fwd_p.bind(x, axis=_shifted_axis(axis, bdim), log=log), bdim


def _bwd_batch(args, dims, *, axis, log):
  size = batch_size(args, dims)
  dy, x = (move_to_front(a, d, size) for a, d in zip(args, dims))
  return softmax_bwd_p.bind(dy, x, axis=axis + 1, log=log), 0


def _sharding(operands, results, *, axis, log):
  """Every dimension but the softmax axis splits."""
  del results, log
  return sharding.same_shape(operands[-1], len(operands), whole_axis=axis)


softmax_fwd_p = define_primitive(
    "softmax_fwd",
    abstract_eval=lambda x, *, axis, log: ShapedArray(x.shape, x.dtype),
    batching_rule=_fwd_batch,
    reference=_softmax_fwd_reference,
    multiple_results=False,
    sharding=_sharding,
)

softmax_bwd_p = define_primitive(
    "softmax_bwd",
    abstract_eval=lambda dy, x, *, axis, log: ShapedArray(x.shape, x.dtype),
    batching_rule=_bwd_batch,
    reference=_softmax_bwd_reference,
    multiple_results=False,
    sharding=_sharding,
)


# --- public API -------------------------------------------------------------------

_softmax = vjp_op(softmax_fwd_p, softmax_bwd_p)


def _apply(op, x, axis, where, log):
  """The kernels for one int axis of an array they take; jax.nn's function
  itself for the rest (integer, complex, float64 or weakly typed x, a tuple,
  None or named axis, `where`), with its dtype rules, values and errors."""
  if (not checks.kernels_take(x) or where is not None or isinstance(axis, bool)
      or not isinstance(axis, (int, np.integer))):
    peer = jax.nn.log_softmax if log else jax.nn.softmax
    return peer(x, axis=axis, where=where)
  if x.ndim == 0:
    raise ValueError(f"{op}: x must have rank >= 1, got a scalar")
  axis = checks.normalize_axis(op, axis, x.ndim)
  return _softmax(jnp.asarray(x), axis=axis, log=log)


def softmax(x: jax.Array, axis: int = -1, where: jax.Array | None = None) -> jax.Array:
  """Softmax of `x` along `axis`, like `jax.nn.softmax`.

  fp32/bf16/fp16 in, same dtype out; statistics in fp32. Differentiable
  (custom VJP), batchable (vmap folds into the kernel's rows).
  """
  return _apply("softmax", x, axis, where, log=False)


def log_softmax(x: jax.Array, axis: int = -1, where: jax.Array | None = None) -> jax.Array:
  """Log-softmax of `x` along `axis`, like `jax.nn.log_softmax`."""
  return _apply("log_softmax", x, axis, where, log=True)
