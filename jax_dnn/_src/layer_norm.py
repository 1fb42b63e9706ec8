"""layer_norm and rms_norm over the last axis (one kernel family).

    layer_norm: y = (x - mean) / sqrt(var + epsilon) * scale + bias
    rms_norm:   y = x / sqrt(mean(x^2) + epsilon) * scale

Numerics: statistics and math in fp32 (float64 and complex x, which only the
reference takes: in x's dtype); y in x's dtype; the kernels take the
parameters as fp32 [param_sets, width] (cast here) and return fp32 parameter
gradients, cast back to the parameters' dtypes. Parameter gradients are
reduced across rows deterministically (per-block partials summed in a fixed
order).

Residuals: the layer norm's forward also returns each row's (mean, rstd) as
`stats` [..., 2] fp32, and its backward takes them (x, scale, stats), where
recomputing them cost the backward a second team reduction and a pass over
the row. RMS norm saves nothing: its
backward's one reduction carries the sum of squares along with sum(g * x),
so its residuals are (x, scale) and a gradient-only program skips its
forward.

Shapes: x [..., W]; scale, bias [W]. Inside the primitives the parameters are
[G, W]: row r uses set r // (rows / G). G is 1 unless vmap batched the
parameters; the batching rules fold that axis into G instead of looping.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from jax_dnn._src import checks
from jax_dnn._src import plans
from jax_dnn._src import sharding
from jax_dnn._src.batching import NOT_MAPPED, batch_size, fold_param_sets, move_to_front, split_leading
from jax_dnn._src.primitive import ShapedArray, define_primitive, vjp_op


def _by_param_set(a, params):
  """Views a [rows, ...] fp32 array as [G, rows / G, ...] to apply [G, W] params."""
  g = params.shape[0]
  return a.reshape((g, -1) + a.shape[1:])


# --- references (pure JAX; what non-CUDA platforms run) ----------------------


def _compute_dtype(dtype):
  """fp32, or x's dtype where wider (float64, complex: the reference alone)."""
  return jnp.promote_types(dtype, jnp.float32)


def _abs_sq(v):
  return jnp.real(v * jnp.conj(v)) if jnp.iscomplexobj(v) else v * v


def _row_stats(x2, rms, epsilon, where=None):
  """mean ([R, 1]; 0 for RMS norm) and rstd ([R, 1]) of rows [R, W], over the
  columns `where` [R, W] marks (all when None). A row with none marked has
  mean 0 and rstd 0 (y = bias): no NaN from masking, in values or gradients."""
  if where is None:
    mean_of = lambda v: jnp.mean(v, axis=-1, keepdims=True)
  else:
    count = jnp.sum(where, axis=-1, keepdims=True)
    mean_of = lambda v: jnp.sum(v, axis=-1, keepdims=True, where=where) / jnp.maximum(count, 1)
  mean = 0.0 if rms else mean_of(x2)
  rstd = jax.lax.rsqrt(mean_of(_abs_sq(x2 if rms else x2 - mean)) + epsilon)
  if where is not None:
    rstd = jnp.where(count > 0, rstd, 0.0)
  return mean, rstd


def _fwd_reference(x, scale, bias=None, *, epsilon, rms, where=None):
  width = x.shape[-1]
  x2 = x.reshape(-1, width).astype(_compute_dtype(x.dtype))
  if where is not None:
    where = jnp.broadcast_to(where, x.shape).reshape(-1, width)
  mean, rstd = _row_stats(x2, rms, epsilon, where)
  y = _by_param_set((x2 - mean) * rstd, scale) * scale[:, None, :]
  if rms:
    return y.reshape(x.shape).astype(x.dtype)
  y = (y + bias[:, None, :]).reshape(x.shape).astype(x.dtype)
  return y, jnp.concatenate([mean, rstd], axis=-1).reshape(_stats_shape(x.shape))


def _bwd_reference(dy, x, scale, *stats, epsilon, rms):
  width = x.shape[-1]
  x2 = x.reshape(-1, width).astype(jnp.float32)
  dy2 = dy.reshape(-1, width).astype(jnp.float32)
  if rms:
    mean, rstd = _row_stats(x2, rms, epsilon)
  else:  # the forward's (mean, rstd)
    st = stats[0].reshape(-1, 2)
    mean, rstd = st[:, :1], st[:, 1:]
  xhat = (x2 - mean) * rstd
  g = (_by_param_set(dy2, scale) * scale[:, None, :]).reshape(-1, width)
  mean_gx = jnp.mean(g * xhat, axis=-1, keepdims=True)
  if rms:
    dx = rstd * (g - xhat * mean_gx)
  else:
    dx = rstd * (g - jnp.mean(g, axis=-1, keepdims=True) - xhat * mean_gx)
  dx = dx.reshape(x.shape).astype(x.dtype)
  dscale = jnp.sum(_by_param_set(dy2 * xhat, scale), axis=1)
  if rms:
    return dx, dscale
  return dx, dscale, jnp.sum(_by_param_set(dy2, scale), axis=1)


# --- primitives ---------------------------------------------------------------


def _stats_shape(x_shape):
  """Layer norm's saved statistics: (mean, rstd) of each row of x."""
  return tuple(x_shape[:-1]) + (2,)


def _fwd_abstract(x, scale, *bias, epsilon, rms):
  y = ShapedArray(x.shape, x.dtype)
  return y if rms else (y, ShapedArray(_stats_shape(x.shape), jnp.float32))


def _bwd_abstract(dy, x, scale, *stats, epsilon, rms):
  dx = ShapedArray(x.shape, x.dtype)
  dparam = ShapedArray(scale.shape, jnp.float32)
  return (dx, dparam) if rms else (dx, dparam, dparam)


def _bwd_workspace(avals, *, epsilon, rms):
  """The parameter gradients' partial sums [G, parts, sums, W]
  (LayerNormBwdParts). A symbolic row count (jax.export) is passed as
  plans.LARGE: the parts' upper bound, whatever the rows."""
  del epsilon
  x, (param_sets, width) = avals[1], avals[2].shape
  rows = plans.static_dim(math.prod(x.shape[:-1]), plans.LARGE)
  parts = plans.layer_norm_bwd_parts(rows, param_sets, width, rms)
  return (ShapedArray((param_sets, parts, 1 if rms else 2, width), jnp.float32),)


def _fwd_batch(args, dims, *, epsilon, rms):
  x, params = args[0], args[1:]
  size = batch_size(args, dims)
  x = move_to_front(x, dims[0], size)
  # The kernel takes scale and bias with the same number of parameter copies:
  # one shared copy only while neither is batched.
  shared = all(d is NOT_MAPPED for d in dims[1:])
  params = [fold_param_sets(p, d, size, shared_ok=shared) for p, d in zip(params, dims[1:])]
  if rms:
    return rms_norm_fwd_p.bind(x, *params, epsilon=epsilon), 0
  return layer_norm_fwd_p.bind(x, *params, epsilon=epsilon), [0, 0]


def _bwd_batch(args, dims, *, epsilon, rms):
  dy, x, scale, *stats = args
  size = batch_size(args, dims)
  dy, x = move_to_front(dy, dims[0], size), move_to_front(x, dims[1], size)
  stats = [move_to_front(s, d, size) for s, d in zip(stats, dims[3:])]
  scale = fold_param_sets(scale, dims[2], size, shared_ok=False)
  prim = rms_norm_bwd_p if rms else layer_norm_bwd_p
  dx, *dparams = prim.bind(dy, x, scale, *stats, epsilon=epsilon)
  dparams = [split_leading(d, size) for d in dparams]
  return [dx, *dparams], [0] * (len(dparams) + 1)


def _sharding(operands, results, *, epsilon, rms, backward=False):
  """Rows split (see sharding.param_set_rows); the normalized width stays
  whole; the parameter gradients are summed over the devices holding rows;
  layer norm's stats [..., 2] split with their rows."""
  del results, epsilon
  b = sharding.RuleBuilder()
  param_sets, width = operands[2] if backward else operands[1]
  x, g = sharding.param_set_rows(b, operands[1] if backward else operands[0], param_sets, b.own(width))
  param = (g, x[-1])
  stats = None if rms else x[:-1] + (b.own(2),)
  if backward:  # dy, x, scale[, stats] -> dx, dscale[, dbias]
    b.operand(*x)
    b.operand(*x)
    b.operand(*param)
    if not rms:
      b.operand(*stats)
    b.result(*x)
    for _ in range(1 if rms else 2):
      b.result(*param, sum_=True)
  else:  # x, scale[, bias] -> y[, stats]
    b.operand(*x)
    for _ in operands[1:]:
      b.operand(*param)
    b.result(*x)
    if not rms:
      b.result(*stats)
  return b.build()


def _define(name, rms):
  fwd = define_primitive(
      f"{name}_fwd",
      abstract_eval=functools.partial(_fwd_abstract, rms=rms),
      batching_rule=functools.partial(_fwd_batch, rms=rms),
      reference=functools.partial(_fwd_reference, rms=rms),
      multiple_results=not rms,  # layer norm: (y, stats)
      sharding=functools.partial(_sharding, rms=rms),
  )
  bwd = define_primitive(
      f"{name}_bwd",
      abstract_eval=functools.partial(_bwd_abstract, rms=rms),
      batching_rule=functools.partial(_bwd_batch, rms=rms),
      reference=functools.partial(_bwd_reference, rms=rms),
      multiple_results=True,
      workspace=functools.partial(_bwd_workspace, rms=rms),
      sharding=functools.partial(_sharding, rms=rms, backward=True),
  )
  return fwd, bwd


layer_norm_fwd_p, layer_norm_bwd_p = _define("layer_norm", rms=False)
rms_norm_fwd_p, rms_norm_bwd_p = _define("rms_norm", rms=True)


# bias is not needed by the backward: keep (x, scale) and the forward's stats.
_layer_norm = vjp_op(layer_norm_fwd_p, layer_norm_bwd_p, bwd_argnums=(0, 1), saved=1)
_rms_norm = vjp_op(rms_norm_fwd_p, rms_norm_bwd_p)


# --- public API -------------------------------------------------------------------


def _param_rows(param, width, default, dtype):
  """A parameter as the primitives take it: [1, W] in dtype (default when None)."""
  if param is None:
    return jnp.full((1, width), default, dtype)
  return param.astype(dtype).reshape(1, width)


def _check_mask(op, mask, x_shape):
  checks.check_array(op, "mask", mask)
  if mask.dtype != jnp.bool_:  # as jnp.mean(where=...), which Flax's layers call
    raise ValueError(f"{op}: mask must be a boolean array, got dtype {mask.dtype}")
  try:
    shape = jnp.broadcast_shapes(mask.shape, x_shape)
  except ValueError:
    shape = None
  if shape != tuple(x_shape):
    raise ValueError(f"{op}: mask of shape {tuple(mask.shape)} does not broadcast to x's "
                     f"shape {tuple(x_shape)}")


def _as_inexact(x, params):
  """Integer and bool x promoted as Flax's canonicalize_dtype promotes them:
  with the parameters, to float32 where that is not yet inexact."""
  dtype = jnp.result_type(x, *[p for p in params if p is not None])
  return x.astype(dtype if jnp.issubdtype(dtype, jnp.inexact) else
                  jnp.promote_types(jnp.float32, dtype))


def normalize(op, x, scale, bias, *, epsilon, rms, mask=None):
  """layer_norm (rms=False) or rms_norm; `mask` (a boolean array that
  broadcasts to x, as Flax's layers take it) restricts the statistics to the
  positions it marks.

  The kernels run float32, bfloat16 and float16 x without a mask; the
  reference in x's dtype, differentiated by JAX, runs the rest (float64,
  complex, a mask). Integer and bool x are promoted first (`_as_inexact`).
  """
  checks.check_array(op, "x", x)
  if x.ndim == 0:
    raise ValueError(f"{op}: x must have rank >= 1 (normalized over the last axis), got a scalar")
  width = x.shape[-1]
  for name, p in (("scale", scale), ("bias", bias)):
    if p is not None:
      checks.check_param(op, name, p, width)
  epsilon = checks.check_epsilon(op, epsilon)
  if mask is not None:
    _check_mask(op, mask, x.shape)
  x = jnp.asarray(x)
  if not jnp.issubdtype(x.dtype, jnp.inexact):
    x = _as_inexact(x, (scale, bias))
  if width == 0:  # nothing to normalize: an empty result, as Flax's
    return jnp.zeros(x.shape, x.dtype)

  kernels = checks.kernels_take(x) and mask is None
  dtype = jnp.float32 if kernels else _compute_dtype(x.dtype)
  scale = _param_rows(scale, width, 1.0, dtype)
  if rms:
    if kernels:
      return _rms_norm(x, scale, epsilon=epsilon)
    return _fwd_reference(x, scale, epsilon=epsilon, rms=True, where=mask)
  bias = _param_rows(bias, width, 0.0, dtype)
  if kernels:
    return _layer_norm(x, scale, bias, epsilon=epsilon)
  return _fwd_reference(x, scale, bias, epsilon=epsilon, rms=False, where=mask)[0]


def layer_norm(x: jax.Array, scale: jax.Array | None = None, bias: jax.Array | None = None, *,
               epsilon: float = 1e-6) -> jax.Array:
  """Layer normalization over the last axis of `x`.

  Args:
    x: [..., W]; float32, bfloat16 and float16 run the kernels (other dtypes:
      see `normalize`).
    scale: [W] (any float dtype), or None for no scale.
    bias: [W], or None for no bias.
    epsilon: added to the variance.
  Returns y in x's dtype (integer and bool x: promoted as Flax promotes
  them, see `_as_inexact`). Gradients flow to x, scale and bias in their
  dtypes.
  """
  return normalize("layer_norm", x, scale, bias, epsilon=epsilon, rms=False)


def rms_norm(x: jax.Array, scale: jax.Array | None = None, *, epsilon: float = 1e-6) -> jax.Array:
  """RMS normalization over the last axis: x / sqrt(mean(x^2) + epsilon) * scale.

  Args:
    x: [..., W]; float32, bfloat16 and float16 run the kernels (other dtypes:
      see `normalize`).
    scale: [W] (any float dtype), or None for no scale.
    epsilon: added to the mean square.
  """
  return normalize("rms_norm", x, scale, None, epsilon=epsilon, rms=True)
