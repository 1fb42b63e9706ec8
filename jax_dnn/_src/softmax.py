"""softmax and log_softmax along any axis.

Numerics: fp32 max/sum/exp, output in the input dtype. The backward uses the
forward output y as its residual:
  softmax:      dx = y * (dy - sum(dy * y))
  log_softmax:  dx = dy - exp(y) * sum(dy)
"""

from __future__ import annotations

import functools

import jax
from jax.interpreters import batching
import jax.numpy as jnp

from jax_dnn._src import checks
from jax_dnn._src.primitive import ShapedArray, define_primitive, move_to_front


# --- references (pure JAX; what non-CUDA platforms run) ----------------------


def _softmax_fwd_reference(x, *, axis, log):
  xf = x.astype(jnp.float32)
  y = jax.nn.log_softmax(xf, axis=axis) if log else jax.nn.softmax(xf, axis=axis)
  return y.astype(x.dtype)


def _softmax_bwd_reference(y, dy, *, axis, log):
  yf, dyf = y.astype(jnp.float32), dy.astype(jnp.float32)
  if log:
    dx = dyf - jnp.exp(yf) * jnp.sum(dyf, axis=axis, keepdims=True)
  else:
    dx = yf * (dyf - jnp.sum(dyf * yf, axis=axis, keepdims=True))
  return dx.astype(y.dtype)


# --- primitives ---------------------------------------------------------------


def _shifted_axis(axis, bdim):
  return axis + 1 if bdim <= axis else axis


def _fwd_batch(args, dims, *, axis, log):
  (x,), (bdim,) = args, dims
  # The batch axis stays where it is; only the softmax axis index moves.
  return softmax_fwd_p.bind(x, axis=_shifted_axis(axis, bdim), log=log), bdim


def _bwd_batch(args, dims, *, axis, log):
  y, dy = args
  size = next(a.shape[d] for a, d in zip(args, dims) if d is not batching.not_mapped)
  y, dy = (move_to_front(a, d, size) for a, d in zip(args, dims))
  return softmax_bwd_p.bind(y, dy, axis=axis + 1, log=log), 0


softmax_fwd_p = define_primitive(
    "softmax_fwd",
    abstract_eval=lambda x, *, axis, log: ShapedArray(x.shape, x.dtype),
    batching_rule=_fwd_batch,
    reference=_softmax_fwd_reference,
    multiple_results=False,
)

softmax_bwd_p = define_primitive(
    "softmax_bwd",
    abstract_eval=lambda y, dy, *, axis, log: ShapedArray(y.shape, y.dtype),
    batching_rule=_bwd_batch,
    reference=_softmax_bwd_reference,
    multiple_results=False,
)


# --- custom VJP and public API -------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _softmax(x, axis, log):
  return softmax_fwd_p.bind(x, axis=axis, log=log)


def _softmax_vjp_fwd(x, axis, log):
  y = softmax_fwd_p.bind(x, axis=axis, log=log)
  return y, y


def _softmax_vjp_bwd(axis, log, y, dy):
  return (softmax_bwd_p.bind(y, dy.astype(y.dtype), axis=axis, log=log),)


_softmax.defvjp(_softmax_vjp_fwd, _softmax_vjp_bwd)


def _check(op, x, axis):
  checks.check_float(op, "x", x)
  if x.ndim == 0:
    raise ValueError(f"{op}: x must have rank >= 1, got a scalar")
  return checks.normalize_axis(op, axis, x.ndim)


def softmax(x: jax.Array, axis: int = -1) -> jax.Array:
  """Softmax of `x` along `axis` (one int), like `jax.nn.softmax`.

  fp32/bf16/fp16 in, same dtype out; statistics in fp32. Differentiable
  (custom VJP), batchable (vmap folds into the kernel's rows).
  """
  axis = _check("softmax", x, axis)
  return _softmax(x, axis, False)


def log_softmax(x: jax.Array, axis: int = -1) -> jax.Array:
  """Log-softmax of `x` along `axis`, like `jax.nn.log_softmax`."""
  axis = _check("log_softmax", x, axis)
  return _softmax(x, axis, True)
