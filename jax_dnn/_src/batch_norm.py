"""Batch normalization over every axis but the last (channels-last: NWC, NHWC,
NDHWC, or any [..., C]), with a fused residual add and activation.

    training:   mean, var = the batch's per-channel statistics
    inference:  mean, var given (running averages)
    y = act((x - mean) / sqrt(var + epsilon) * scale + bias + residual)

Statistics: each step is a per-channel reduction over the M rows of x viewed
as [M, C] (one primitive), an optional `lax.psum` of those C-wide sums over
`axis_name` (Flax's cross-device batch statistics: one all-reduce of 2 x C
floats, not of the activations), and an elementwise apply (another
primitive); the backward likewise. The sums are additive, so the same
primitives also split over a device mesh under jit (the partitioner adds
each shard's sums).

Variance: the reduction returns sum(x - k) and sum((x - k)^2) for a
per-channel shift k. use_fast_variance=True (Flax's default) reads x once
for the statistics, with k = 0: var = E[x^2] - E[x]^2, as Flax computes it
(fp32 sums, clipped at 0), which loses about eps32 * (mean / std)^2 of the
variance to cancellation. use_fast_variance=False reads x twice: the first
pass gives the mean, the second takes k = mean and gives the centred sum of
squares (plus the first-order correction from sum(x - mean)), as exact as a
two-pass variance in fp32, with one more all-reduce under `axis_name`.

Numerics: statistics and math in fp32; y in x's dtype; parameters any float
dtype, their gradients in their dtypes. Per-channel sums are reduced in a
fixed order on the GPU (deterministic). Integer and bool x normalize as
float32; float64 and complex x, and x without rows or channels, run Flax's
computation (_flax_stats, _flax_apply) in x's dtype.

Primitives (x, dy, dx, residual [..., C]; the per-channel operands [G, ., C]
fp32, G parameter sets: row r of x viewed as [M, C] uses set r // (M / G);
G is 1 unless vmap batched the statistics or parameters, whose batching
rules fold the vmapped axis into G instead of looping):
  batch_norm_stats     x, shift [G, C]             -> sum(x - k), sum((x - k)^2)   [G, C] each
  batch_norm_fwd       x, coefs [G, 2, C], res     -> y = act(x * a + b + res)
  batch_norm_bwd_stats dy, x, coefs [G, 3, C], res -> sum(dz), sum(dz * (x - m))  [G, C] each
  batch_norm_bwd       dy, x, coefs [G, 6, C], res -> dx = k1 * dz + k2 * (x - m) + k3, dres = dz
with dz = dy * act'(x * a + b + res) and coefs rows (a, b, m, k1, k2, k3).
An absent residual is an empty [0] array (and so is dres then).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp

from jax_dnn._src import checks
from jax_dnn._src import mesh_types
from jax_dnn._src import plans
from jax_dnn._src import sharding
from jax_dnn._src import activation as activation_lib
from jax_dnn._src.activation import NO_ACTIVATION
from jax_dnn._src.batching import NOT_MAPPED, batch_size, fold_param_sets, move_to_front, split_leading
from jax_dnn._src.derivatives import custom_vjp
from jax_dnn._src.primitive import ShapedArray, define_primitive


def _present(residual) -> bool:
  """Whether the optional residual (x's shape, or an empty [0]) is given."""
  return residual.ndim != 1 or residual.shape[0] != 0


def _empty(dtype):
  return jnp.zeros((0,), dtype)


# --- references (pure JAX; what non-CUDA platforms run) ----------------------


def _rows(a, g):
  """[..., C] -> fp32 [G, M / G, C]."""
  return a.astype(jnp.float32).reshape(g, -1, a.shape[-1])


def _z(x, coefs, residual):
  g = coefs.shape[0]
  z = _rows(x, g) * coefs[:, None, 0] + coefs[:, None, 1]
  return z + _rows(residual, g) if _present(residual) else z


def _act_and_grad(z, activation):
  """act(z) and act'(z), elementwise."""
  y, vjp = jax.vjp(lambda v: activation_lib.apply(v, activation), z)
  return y, vjp(jnp.ones_like(z))[0]


def _dz(dy, x, coefs, residual, activation):
  dz = _rows(dy, coefs.shape[0])
  if activation == NO_ACTIVATION:
    return dz
  return dz * _act_and_grad(_z(x, coefs, residual), activation)[1]


def _stats_reference(x, shift):
  d = _rows(x, shift.shape[0]) - shift[:, None, :]
  return jnp.sum(d, axis=1), jnp.sum(d * d, axis=1)


def _fwd_reference(x, coefs, residual, *, activation):
  z = _z(x, coefs, residual)
  z = activation_lib.apply(z, activation)
  return z.reshape(x.shape).astype(x.dtype)


def _bwd_stats_reference(dy, x, coefs, residual, *, activation):
  dz = _dz(dy, x, coefs, residual, activation)
  xc = _rows(x, coefs.shape[0]) - coefs[:, None, 2]
  return jnp.sum(dz, axis=1), jnp.sum(dz * xc, axis=1)


def _bwd_reference(dy, x, coefs, residual, *, activation):
  dz = _dz(dy, x, coefs, residual, activation)
  xc = _rows(x, coefs.shape[0]) - coefs[:, None, 2]
  dx = dz * coefs[:, None, 3] + xc * coefs[:, None, 4] + coefs[:, None, 5]
  dres = dz.reshape(residual.shape).astype(residual.dtype) if _present(residual) else residual
  return dx.reshape(x.shape).astype(x.dtype), dres


# --- primitives ---------------------------------------------------------------


def _x_and_per_channel(avals):
  """x and the per-channel operand of a primitive's operands: (x, shift),
  (x, coefs, residual) or (dy, x, coefs, residual)."""
  return (avals[0], avals[1]) if len(avals) < 4 else (avals[1], avals[2])


def _sums_abstract(*avals, **params):
  del params
  x, per_channel = _x_and_per_channel(avals)
  shape = (per_channel.shape[0], x.shape[-1])
  return ShapedArray(shape, jnp.float32), ShapedArray(shape, jnp.float32)


def _fwd_abstract(x, coefs, residual, *, activation):
  del coefs, residual, activation
  return ShapedArray(x.shape, x.dtype)


def _bwd_abstract(dy, x, coefs, residual, *, activation):
  del dy, coefs, activation
  return ShapedArray(x.shape, x.dtype), ShapedArray(residual.shape, residual.dtype)


def _stats_workspace(avals, **params):
  """The per-block partial sums [G, parts, 2, C] (BatchNormParts). A symbolic
  row count (jax.export) is passed as plans.LARGE: the parts' upper bound,
  whatever the rows."""
  del params
  x, per_channel = _x_and_per_channel(avals)
  g, c = per_channel.shape[0], x.shape[-1]
  rows = plans.static_dim(math.prod(x.shape[:-1]), plans.LARGE)
  parts = plans.batch_norm_parts(rows, g, c, jnp.dtype(x.dtype).name)
  return (ShapedArray((g, parts, 2, c), jnp.float32),)


def _supported(avals, **params):
  """The kernels' grid takes at most 65535 parameter sets (gridDim.z)."""
  del params
  return _x_and_per_channel(avals)[1].shape[0] <= 65535


def _residual_to_front(residual, dim, size):
  return move_to_front(residual, dim, size) if _present(residual) else residual


def _stats_batch(args, dims):
  x, shift = args
  size = batch_size(args, dims)
  x = move_to_front(x, dims[0], size)
  # Each vmapped instance has its own statistics: always fold into G.
  shift = fold_param_sets(shift, dims[1], size, shared_ok=False)
  return [split_leading(s, size) for s in batch_norm_stats_p.bind(x, shift)], [0, 0]


def _fwd_batch(args, dims, *, activation):
  x, coefs, residual = args
  size = batch_size(args, dims)
  x = move_to_front(x, dims[0], size)
  coefs = fold_param_sets(coefs, dims[1], size, shared_ok=True)
  residual = _residual_to_front(residual, dims[2], size)
  return batch_norm_fwd_p.bind(x, coefs, residual, activation=activation), 0


def _bwd_stats_batch(args, dims, *, activation):
  dy, x, coefs, residual = args
  size = batch_size(args, dims)
  dy, x = move_to_front(dy, dims[0], size), move_to_front(x, dims[1], size)
  coefs = fold_param_sets(coefs, dims[2], size, shared_ok=False)
  residual = _residual_to_front(residual, dims[3], size)
  sums = batch_norm_bwd_stats_p.bind(dy, x, coefs, residual, activation=activation)
  return [split_leading(s, size) for s in sums], [0, 0]


def _bwd_batch(args, dims, *, activation):
  dy, x, coefs, residual = args
  size = batch_size(args, dims)
  dy, x = move_to_front(dy, dims[0], size), move_to_front(x, dims[1], size)
  coefs = fold_param_sets(coefs, dims[2], size, shared_ok=True)
  present = _present(residual)
  residual = _residual_to_front(residual, dims[3], size)
  dx, dres = batch_norm_bwd_p.bind(dy, x, coefs, residual, activation=activation)
  return [dx, dres], [0, 0 if present else NOT_MAPPED]


def _sharding(operands, results, *, kind, **params):
  """Rows split (see sharding.param_set_rows), channels split with the
  per-channel operands; the reductions' sums are added over the devices
  holding rows."""
  del params
  b = sharding.RuleBuilder()
  x_shape, per_channel = _x_and_per_channel(operands)
  c = b.factor("c", x_shape[-1])
  x, g = sharding.param_set_rows(b, x_shape, per_channel[0], c)
  res = lambda shape: x if _shape_present(shape) else (b.own(shape[0]),)
  b.operand(*x)  # x, or dy
  if kind in ("bwd_stats", "bwd"):  # x
    b.operand(*x)
  if kind == "stats":  # shift
    b.operand(g, c)
  else:  # coefs, residual
    b.operand(g, b.own(per_channel[1]), c)
    b.operand(*res(operands[-1]))
  if kind in ("stats", "bwd_stats"):
    b.result(g, c, sum_=True)
    b.result(g, c, sum_=True)
  else:  # y | dx, dres
    b.result(*x)
    if kind == "bwd":
      b.result(*res(results[1]))
  return b.build()


def _shape_present(shape) -> bool:
  return len(shape) != 1 or shape[0] != 0


batch_norm_stats_p = define_primitive(
    "batch_norm_stats",
    supported=_supported,
    abstract_eval=_sums_abstract,
    batching_rule=_stats_batch,
    reference=_stats_reference,
    multiple_results=True,
    workspace=_stats_workspace,
    sharding=functools.partial(_sharding, kind="stats"),
)
batch_norm_fwd_p = define_primitive(
    "batch_norm_fwd",
    supported=_supported,
    abstract_eval=_fwd_abstract,
    batching_rule=_fwd_batch,
    reference=_fwd_reference,
    multiple_results=False,
    sharding=functools.partial(_sharding, kind="fwd"),
)
batch_norm_bwd_stats_p = define_primitive(
    "batch_norm_bwd_stats",
    supported=_supported,
    abstract_eval=_sums_abstract,
    batching_rule=_bwd_stats_batch,
    reference=_bwd_stats_reference,
    multiple_results=True,
    workspace=_stats_workspace,
    sharding=functools.partial(_sharding, kind="bwd_stats"),
)
batch_norm_bwd_p = define_primitive(
    "batch_norm_bwd",
    supported=_supported,
    abstract_eval=_bwd_abstract,
    batching_rule=_bwd_batch,
    reference=_bwd_reference,
    multiple_results=True,
    sharding=functools.partial(_sharding, kind="bwd"),
)


# --- the ops: per-channel math between the primitives ---------------------------------
# Inside these functions x is one instance (vmap folds its axis into G in the
# primitives' batching rules), so the per-channel arrays are [C] and the
# primitives' [G, ., C] operands have G = 1.


def _bind(prim, *args, **params):
  return prim.bind(*mesh_types.same_manual_axes(*args), **params)


def _psum(a, cfg):
  if cfg.axis_name is None:
    return a
  return jax.lax.psum(a, cfg.axis_name, axis_index_groups=cfg.axis_index_groups)


def _count(x, cfg):
  """The rows the statistics average over: this device's, times the devices
  (or the group's) along axis_name."""
  rows = math.prod(x.shape[:-1])
  # A symbolic batch (jax.export) is a value of the program.
  rows = float(rows) if plans.is_static(rows) else jnp.asarray(rows).astype(jnp.float32)
  if cfg.axis_name is None:
    return rows
  # A psum of a Python int is the axis (or group) size, known while tracing:
  # no collective.
  return rows * jax.lax.psum(1, cfg.axis_name, axis_index_groups=cfg.axis_index_groups)


def _batch_stats(cfg, x):
  """The batch's fp32 (mean, var) [C] (see the module docstring)."""
  n = _count(x, cfg)
  zero = jnp.zeros((1, x.shape[-1]), jnp.float32)
  s1, s2 = _bind(batch_norm_stats_p, x, zero)
  if cfg.fast_variance:
    s = _psum(jnp.stack([s1[0], s2[0]]), cfg)
    mean = s[0] / n
    return mean, jnp.maximum(s[1] / n - mean * mean, 0.0), n
  mean = _psum(s1[0], cfg) / n
  d1, d2 = _bind(batch_norm_stats_p, x, mean[None])
  d = _psum(jnp.stack([d1[0], d2[0]]), cfg) / n
  return mean, jnp.maximum(d[1] - d[0] * d[0], 0.0), n


def _apply_coefs(mean, rstd, scale, bias):
  a = scale * rstd
  return a, bias - mean * a


def _grad_sums(cfg, dy, x, residual, mean, rstd, scale, bias):
  a, b = _apply_coefs(mean, rstd, scale, bias)
  coefs = jnp.stack([a, b, mean])[None]
  sdz, sdzc = _bind(batch_norm_bwd_stats_p, dy, x, coefs, residual, activation=cfg.activation)
  return a, b, sdz[0], sdzc[0]


def _grad_apply(cfg, dy, x, residual, a, b, mean, k1, k2, k3):
  coefs = jnp.stack([a, b, mean, k1, k2, k3])[None]
  return _bind(batch_norm_bwd_p, dy, x, coefs, residual, activation=cfg.activation)


def _train_fwd(cfg, x, scale, bias, residual):
  mean, var, n = _batch_stats(cfg, x)
  rstd = jax.lax.rsqrt(var + cfg.epsilon)
  a, b = _apply_coefs(mean, rstd, scale, bias)
  y = _bind(batch_norm_fwd_p, x, jnp.stack([a, b])[None], residual, activation=cfg.activation)
  return (y, mean, var), (x, scale, bias, residual, mean, rstd, n)


@functools.partial(custom_vjp, nondiff_argnums=(0,))
def _train(cfg, x, scale, bias, residual):
  return _train_fwd(cfg, x, scale, bias, residual)[0]


def _train_bwd(cfg, res, cts):
  x, scale, bias, residual, mean, rstd, n = res
  dy, dmean, dvar = cts
  a, b, sdz, sdzc = _grad_sums(cfg, dy.astype(x.dtype), x, residual, mean, rstd, scale, bias)
  # dx needs the sums over the whole batch (every device's rows); dscale and
  # dbias are this device's share (added over the devices by whoever
  # reduces parameter gradients: JAX's transpose of the shared parameters'
  # cast inside shard_map, the caller under pmap).
  g = _psum(jnp.stack([sdz, sdzc]), cfg)
  k2 = -a * rstd * rstd * g[1] / n + 2.0 * dvar / n
  k3 = -a * g[0] / n + dmean / n
  dx, dres = _grad_apply(cfg, dy.astype(x.dtype), x, residual, a, b, mean, a, k2, k3)
  return dx, sdzc * rstd, sdz, dres


_train.defvjp(_train_fwd, _train_bwd)


def _infer_fwd(cfg, x, mean, var, scale, bias, residual):
  rstd = jax.lax.rsqrt(var + cfg.epsilon)
  a, b = _apply_coefs(mean, rstd, scale, bias)
  y = _bind(batch_norm_fwd_p, x, jnp.stack([a, b])[None], residual, activation=cfg.activation)
  return y, (x, scale, bias, residual, mean, rstd)


@functools.partial(custom_vjp, nondiff_argnums=(0,))
def _infer(cfg, x, mean, var, scale, bias, residual):
  return _infer_fwd(cfg, x, mean, var, scale, bias, residual)[0]


def _infer_bwd(cfg, res, dy):
  x, scale, bias, residual, mean, rstd = res
  a, b, sdz, sdzc = _grad_sums(cfg, dy.astype(x.dtype), x, residual, mean, rstd, scale, bias)
  zero = jnp.zeros_like(a)
  dx, dres = _grad_apply(cfg, dy.astype(x.dtype), x, residual, a, b, mean, a, zero, zero)
  dmean = -a * sdz
  dvar = -0.5 * scale * rstd * rstd * rstd * sdzc
  return dx, dmean, dvar, sdzc * rstd, sdz, dres


_infer.defvjp(_infer_fwd, _infer_bwd)


# --- public API -------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Config:
  """The static options (hashable: the custom VJPs' nondiff argument)."""
  epsilon: float
  activation: int
  axis_name: Any = None
  axis_index_groups: tuple[tuple[int, ...], ...] | None = None
  fast_variance: bool = True


def _groups(op, axis_name, axis_index_groups):
  """axis_index_groups as nested tuples (hashable)."""
  if axis_index_groups is None:
    return None
  if axis_name is None:
    raise ValueError(f"{op}: axis_index_groups needs an axis_name")
  return tuple(tuple(int(i) for i in g) for g in axis_index_groups)



def _as_inexact(op, name, a):
  """a as a jax array; integers and bools as float32 (what Flax's promotion
  with its float32 parameters makes of them)."""
  checks.check_array(op, name, a)
  a = jnp.asarray(a)
  return a if jnp.issubdtype(a.dtype, jnp.inexact) else a.astype(jnp.float32)


def _check_x(op, x):
  x = _as_inexact(op, "x", x)
  if x.ndim == 0:
    raise ValueError(f"{op}: x must have rank >= 1 (channels along the last axis), got a scalar")
  return x


def _flax_stats(cfg, x):
  """Flax's batch statistics (nnx.BatchNorm's), in x's dtype and at least
  fp32, E|x|^2 - |E x|^2 or E|x - E x|^2: what runs x the kernels do not
  take (float64, complex) and x without rows (NaN, as Flax's)."""
  axes = tuple(range(x.ndim - 1))
  x = x.astype(jnp.promote_types(x.dtype, jnp.float32))
  abs_sq = lambda a: jnp.real(a * jnp.conj(a))
  mean = lambda a: (jnp.mean(a, axes) if cfg.axis_name is None else jax.lax.pmean(
      jnp.mean(a, axes), cfg.axis_name, axis_index_groups=cfg.axis_index_groups))
  mu = mean(x)
  if cfg.fast_variance:
    return mu, jnp.maximum(0.0, mean(abs_sq(x)) - abs_sq(mu))
  return mu, mean(abs_sq(x - mu))


def _flax_apply(cfg, x, mean, var, scale, bias, residual):
  """y from the statistics as Flax normalizes (the partner of _flax_stats),
  then the residual and the activation; in x's dtype."""
  mul = jax.lax.rsqrt(var + cfg.epsilon)
  if scale is not None:
    mul = mul * scale
  y = (x - mean) * mul
  if bias is not None:
    y = y + bias
  if _present(residual):
    y = y + residual
  y = activation_lib.apply(y, cfg.activation)
  return y.astype(x.dtype)


def _param(op, x, p, name, default):
  """A per-channel argument as fp32 [C] (default when None)."""
  if p is None:
    return jnp.full((x.shape[-1],), default, jnp.float32)
  checks.check_param(op, name, p, x.shape[-1])
  return p.astype(jnp.float32)


def _residual(op, x, residual):
  if residual is None:
    return _empty(x.dtype)
  residual = _as_inexact(op, "residual", residual)
  if tuple(residual.shape) != tuple(x.shape):
    raise ValueError(f"{op}: residual must have x's shape {tuple(x.shape)}, "
                     f"got {tuple(residual.shape)}")
  if residual.dtype != x.dtype:
    raise TypeError(f"{op}: residual must have x's dtype {x.dtype}, got {residual.dtype}")
  return residual


def batch_norm(x: jax.Array, scale: jax.Array | None = None, bias: jax.Array | None = None, *,
               residual: jax.Array | None = None, activation: str | None = None,
               epsilon: float = 1e-5, axis_name=None, axis_index_groups=None,
               use_fast_variance: bool = True) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Batch normalization in training mode, over every axis of `x` but the last.

    y = act((x - mean) / sqrt(var + epsilon) * scale + bias + residual)

  with the batch's per-channel mean and (biased) variance.

  Args:
    x: [..., C] (N, *spatial, C: channels last); float32, bfloat16 and
      float16 run the kernels (others: the module docstring).
    scale, bias: [C] (any float dtype), or None (ones, zeros).
    residual: x's shape and dtype, added before the activation
      (ResNet's relu(bn(x) + shortcut)), or None.
    activation: None or one of bias_act's: "relu", "gelu", "gelu_tanh",
      "silu", "sigmoid", "tanh".
    epsilon: added to the variance.
    axis_name, axis_index_groups: as Flax's: inside shard_map, pmap or a
      named vmap, the statistics are those of the whole batch over this
      mesh axis (one all-reduce of per-channel sums).
    use_fast_variance: var = E[x^2] - E[x]^2 from one pass (as Flax's
      default); False: a second pass centred on the mean (exact for inputs
      whose mean is large against their spread; see the module docstring).
  Returns:
    (y in x's dtype, mean [C] fp32, var [C] fp32; in x's dtype for float64
    and complex x, as Flax's): the statistics for updating running averages.
  """
  op = "batch_norm"
  x = _check_x(op, x)
  epsilon = checks.check_epsilon(op, epsilon)
  if not isinstance(use_fast_variance, bool):
    raise TypeError(f"{op}: use_fast_variance must be a bool, got {use_fast_variance!r}")
  cfg = _Config(epsilon, activation_lib.activation_arg(op, activation), axis_name,
                _groups(op, axis_name, axis_index_groups), use_fast_variance)
  args = (x, _param(op, x, scale, "scale", 1.0), _param(op, x, bias, "bias", 0.0),
          _residual(op, x, residual))
  if not checks.kernel_dtype(x.dtype) or x.size == 0:
    mean, var = _flax_stats(cfg, x)
    return _flax_apply(cfg, x, mean, var, scale, bias, args[-1]), mean, var
  return _train(cfg, *mesh_types.same_manual_axes(*args))


def batch_norm_inference(x: jax.Array, mean: jax.Array, var: jax.Array,
                         scale: jax.Array | None = None, bias: jax.Array | None = None, *,
                         residual: jax.Array | None = None, activation: str | None = None,
                         epsilon: float = 1e-5) -> jax.Array:
  """Batch normalization with given statistics (e.g. running averages), in
  one pass over x:

    y = act((x - mean) / sqrt(var + epsilon) * scale + bias + residual)

  Args as batch_norm's; mean, var: [C], any float dtype. Gradients flow to
  x, mean, var, scale, bias and residual.
  """
  op = "batch_norm_inference"
  x = _check_x(op, x)
  epsilon = checks.check_epsilon(op, epsilon)
  cfg = _Config(epsilon, activation_lib.activation_arg(op, activation))
  for name, p in (("mean", mean), ("var", var)):
    if p is None:
      raise TypeError(f"{op}: {name} is required, got None")
  args = (x, _param(op, x, mean, "mean", 0.0), _param(op, x, var, "var", 1.0),
          _param(op, x, scale, "scale", 1.0), _param(op, x, bias, "bias", 0.0),
          _residual(op, x, residual))
  if not checks.kernel_dtype(x.dtype) or x.size == 0:
    return _flax_apply(cfg, x, mean, var, scale, bias, args[-1])
  return _infer(cfg, *mesh_types.same_manual_axes(*args))
