"""group_norm and instance_norm, channels last: x [N, *spatial, C].

    y = act((x - mean) * rstd * scale + bias),  rstd = 1 / sqrt(var + epsilon)

with mean and var over each sample's spatial positions and the C / G
channels of a group (G = num_groups; instance norm: one channel a group),
and act one of bias_act's activations or none (SiLU: the diffusion UNet's
GroupNorm + SiLU in one pass).

Numerics: statistics and math in fp32 (float64 and complex x, which only
the reference takes: in x's dtype), the variance two-pass exact (not
E[x^2] - E[x]^2); y in x's dtype; the primitives take the parameters as fp32
[P, C] (cast here) and return fp32 parameter gradients, cast back to the
parameters' dtypes. The backward recomputes z = xhat * scale + bias and
fuses act'(z). Parameter gradients are reduced over samples and positions
in a fixed order (deterministic).

Residuals: the forward also returns each (sample, group)'s (mean, rstd) as
`stats` [N, G, 2] fp32; the backward takes (x, scale, bias, stats).

Which runs: the kernels where group_norm_plan takes the problem and runs it
by default; instance norm (one channel a group, C > 1) runs XLA's
computation of the references unless jax_dnn.config deterministic (read
when traced, passed as the primitives' `deterministic` param) asks for the
kernels (the plan's by_default and its measurement).

Shapes inside the primitives: x [N, *spatial, C] as given; scale, bias
[P, C]: sample n uses set n // (N / P). P is 1 unless vmap batched the
parameters; the batching rules fold vmap's axis into N (and into P).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from jax_dnn._src import activation as activation_lib
from jax_dnn._src.activation import NO_ACTIVATION
from jax_dnn._src import checks
from jax_dnn._src.config import config
from jax_dnn._src import plans
from jax_dnn._src import sharding
from jax_dnn._src.batching import (NOT_MAPPED, batch_size, fold_param_sets, merge_leading,
                                   move_to_front, split_leading)
from jax_dnn._src.primitive import ShapedArray, define_primitive, vjp_op


# --- references (pure JAX; what non-CUDA platforms run) ----------------------


def _math_dtype(dtype):
  """fp32, or x's dtype where wider (float64, complex: the reference alone)."""
  return jnp.promote_types(dtype, jnp.float32)


def _grouped(x, groups):
  """[N, S, G, C / G] view of x [N, *spatial, C], in _math_dtype."""
  n, c = x.shape[0], x.shape[-1]
  return x.astype(_math_dtype(x.dtype)).reshape(n, -1, groups, c // groups)


def _per_set(a, params):
  """a [N, S, C] times / plus [P, C] parameters: sample n uses set n // (N / P)."""
  p = params.shape[0]
  return a.reshape((p, -1) + a.shape[1:]), params[:, None, None, :]


def _stats(xg, epsilon):
  mean = jnp.mean(xg, axis=(1, 3))
  d = xg - mean[:, None, :, None]
  var = jnp.mean(jnp.real(d * jnp.conj(d)), axis=(1, 3))  # |d|^2
  return mean, jax.lax.rsqrt(var + epsilon)  # [N, G] each


def _xhat(xg, mean, rstd):
  n, s, g, cg = xg.shape
  return ((xg - mean[:, None, :, None]) * rstd[:, None, :, None]).reshape(n, s, g * cg)


def _affine(xhat, scale, bias):
  xs, sc = _per_set(xhat, scale)
  _, bs = _per_set(xhat, bias)
  return (xs * sc + bs).reshape(xhat.shape)


def _fwd_reference(x, scale, bias, *, groups, epsilon, activation, deterministic):
  del deterministic
  xg = _grouped(x, groups)
  mean, rstd = _stats(xg, epsilon)
  y = activation_lib.apply(_affine(_xhat(xg, mean, rstd), scale, bias), activation)
  return y.reshape(x.shape).astype(x.dtype), jnp.stack([mean, rstd], axis=-1)


def _bwd_reference(dy, x, scale, bias, stats, *, groups, epsilon, activation, deterministic):
  del epsilon, deterministic
  xg = _grouped(x, groups)
  mean, rstd = stats[..., 0], stats[..., 1]
  xhat = _xhat(xg, mean, rstd)  # [N, S, C]
  dz = dy.astype(jnp.float32).reshape(xhat.shape)
  if activation != NO_ACTIVATION:
    _, act_vjp = jax.vjp(functools.partial(activation_lib.apply, activation=activation),
                         _affine(xhat, scale, bias))
    dz = act_vjp(dz)[0]
  dzs, sc = _per_set(dz, scale)
  xs, _ = _per_set(xhat, scale)
  dbias = jnp.sum(dzs, axis=(1, 2))
  dscale = jnp.sum(dzs * xs, axis=(1, 2))
  n, s, c = xhat.shape
  gx = (dzs * sc).reshape(n, s, groups, c // groups)
  xh = xhat.reshape(gx.shape)
  m1 = jnp.mean(gx, axis=(1, 3), keepdims=True)
  m2 = jnp.mean(gx * xh, axis=(1, 3), keepdims=True)
  dx = rstd[:, None, :, None] * (gx - m1 - xh * m2)
  return dx.reshape(x.shape).astype(x.dtype), dscale, dbias


# --- primitives ---------------------------------------------------------------


def _stats_shape(x_shape, groups):
  return (x_shape[0], groups, 2)


def _fwd_abstract(x, scale, bias, *, groups, epsilon, activation, deterministic):
  del scale, bias, epsilon, activation, deterministic
  return (ShapedArray(x.shape, x.dtype),
          ShapedArray(_stats_shape(x.shape, groups), jnp.float32))


def _bwd_abstract(dy, x, scale, bias, stats, *, groups, epsilon, activation, deterministic):
  del dy, bias, stats, groups, epsilon, activation, deterministic
  dparam = ShapedArray(scale.shape, jnp.float32)
  return ShapedArray(x.shape, x.dtype), dparam, dparam


def _plan(x, groups):
  """The kernels' plan for x [N, *spatial, C]. A symbolic N (jax.export) is
  planned as plans.LARGE samples: one statistics block a sample, whatever N."""
  n = plans.static_dim(x.shape[0], plans.LARGE)
  spatial = math.prod(x.shape[1:-1])
  return plans.group_norm_plan(n, spatial, x.shape[-1], groups, jnp.dtype(x.dtype).name)


def _supported(avals, *, groups, deterministic, **params):
  """The kernels take the problem and run it by default (the plan's
  by_default: not instance norm), or deterministic asks for them."""
  del params
  x = avals[1] if len(avals) == 5 else avals[0]
  if not plans.is_static(*x.shape[1:]):
    return False
  plan = _plan(x, groups)
  return plan.supported and (plan.by_default or deterministic)


def _ffi_params(avals, *, deterministic, **params):
  """The kernels' attributes: groups, epsilon, activation."""
  del avals, deterministic
  return params


def _fwd_workspace(avals, *, groups, epsilon, activation, deterministic):
  """Each statistics block's partial sums [N, splits, G, 2]."""
  del epsilon, activation, deterministic
  x = avals[0]
  return (ShapedArray((x.shape[0], _plan(x, groups).splits, groups, 2), jnp.float32),)


def _bwd_workspace(avals, *, groups, epsilon, activation, deterministic):
  """Each block's per-channel sums [N, splits, 2, C] (of dz and dz * xhat);
  their sums over a sample's blocks [N, 2, C] (viewed as column_sum's
  [P, N / P, 2, C]); each (sample, group)'s dx coefficients [N, G, 2]."""
  del epsilon, activation, deterministic
  x = avals[1]
  n, c = x.shape[0], x.shape[-1]
  splits = _plan(x, groups).splits
  return (ShapedArray((n, splits, 2, c), jnp.float32), ShapedArray((n, 2, c), jnp.float32),
          ShapedArray((n, groups, 2), jnp.float32))


def _fold_x(x, dim, size):
  return merge_leading(move_to_front(x, dim, size))


def _fwd_batch(args, dims, *, groups, epsilon, activation, deterministic):
  x, scale, bias = args
  size = batch_size(args, dims)
  x = _fold_x(x, dims[0], size)
  # One shared parameter copy only while neither parameter is batched.
  shared = dims[1] is NOT_MAPPED and dims[2] is NOT_MAPPED
  scale, bias = (fold_param_sets(p, d, size, shared_ok=shared)
                 for p, d in zip((scale, bias), dims[1:]))
  y, stats = group_norm_fwd_p.bind(x, scale, bias, groups=groups, epsilon=epsilon,
                                   activation=activation, deterministic=deterministic)
  return [split_leading(y, size), split_leading(stats, size)], [0, 0]


def _bwd_batch(args, dims, *, groups, epsilon, activation, deterministic):
  dy, x, scale, bias, stats = args
  size = batch_size(args, dims)
  dy, x, stats = (_fold_x(a, d, size) for a, d in zip((dy, x, stats), (dims[0], dims[1], dims[4])))
  scale, bias = (fold_param_sets(p, d, size, shared_ok=False)
                 for p, d in zip((scale, bias), dims[2:4]))
  dx, dscale, dbias = group_norm_bwd_p.bind(dy, x, scale, bias, stats, groups=groups,
                                            epsilon=epsilon, activation=activation,
                                            deterministic=deterministic)
  return [split_leading(dx, size), split_leading(dscale, size), split_leading(dbias, size)], [0] * 3


def _sharding(operands, results, *, groups, epsilon, activation, deterministic,
              backward=False):
  """Samples split; under P > 1 parameter sets (vmap's axis folded into N as
  its major part) N is the compound (P, N / P) and splits along P, with the
  parameters. The spatial axes and channels stay whole (a group's statistics
  span them); the parameter gradients are summed over the devices holding
  samples; stats split with their samples."""
  del results, epsilon, activation, deterministic
  b = sharding.RuleBuilder()
  shape = operands[1] if backward else operands[0]
  param_sets, width = operands[2] if backward else operands[1]
  c = b.own(width)
  if param_sets == 1:
    n, g = b.factor("n", shape[0]), b.own(1)
  else:
    g = b.factor("g", param_sets)
    n = (g, b.factor("n", shape[0] // param_sets))
  x = (n,) + tuple(b.own(s) for s in shape[1:-1]) + (c,)
  param = (g, c)
  stats = (n, b.own(groups), b.own(2))
  if backward:  # dy, x, scale, bias, stats -> dx, dscale, dbias
    b.operand(*x)
    b.operand(*x)
    b.operand(*param)
    b.operand(*param)
    b.operand(*stats)
    b.result(*x)
    b.result(*param, sum_=True)
    b.result(*param, sum_=True)
  else:  # x, scale, bias -> y, stats
    b.operand(*x)
    b.operand(*param)
    b.operand(*param)
    b.result(*x)
    b.result(*stats)
  return b.build()


group_norm_fwd_p = define_primitive(
    "group_norm_fwd",
    abstract_eval=_fwd_abstract,
    batching_rule=_fwd_batch,
    reference=_fwd_reference,
    multiple_results=True,  # (y, stats)
    ffi_params=_ffi_params,
    supported=_supported,
    workspace=_fwd_workspace,
    sharding=_sharding,
)
group_norm_bwd_p = define_primitive(
    "group_norm_bwd",
    abstract_eval=_bwd_abstract,
    batching_rule=_bwd_batch,
    reference=_bwd_reference,
    multiple_results=True,
    ffi_params=_ffi_params,
    supported=_supported,
    workspace=_bwd_workspace,
    sharding=functools.partial(_sharding, backward=True),
)

_group_norm = vjp_op(group_norm_fwd_p, group_norm_bwd_p, saved=1)


# --- public API -------------------------------------------------------------------


def _prepare(op, x, param, name, default):
  """Checks one parameter and returns it as [1, C] in x's _math_dtype
  (default when None)."""
  width, dtype = x.shape[-1], _math_dtype(x.dtype)
  if param is None:
    return jnp.full((1, width), default, dtype)
  checks.check_param(op, name, param, width)
  return param.astype(dtype).reshape(1, width)


def _is_int(v) -> bool:
  return isinstance(v, int) and not isinstance(v, bool)


def _groups(op, channels, num_groups, group_size) -> int:
  """G from Flax's pair (num_groups, group_size): exactly one given."""
  if (num_groups is None) == (group_size is None):
    raise ValueError(f"{op}: give exactly one of num_groups and group_size (pass "
                     f"num_groups=None with group_size); got num_groups={num_groups!r}, "
                     f"group_size={group_size!r}")
  if group_size is not None:
    if not _is_int(group_size) or group_size <= 0 or channels % group_size:
      raise ValueError(f"{op}: group_size must be a positive int dividing the {channels} "
                       f"channels (x.shape[-1]); got {group_size!r}")
    return channels // group_size
  if not _is_int(num_groups) or num_groups <= 0 or channels % num_groups:
    raise ValueError(f"{op}: num_groups must be a positive int dividing the {channels} "
                     f"channels (x.shape[-1]); got {num_groups!r}")
  return num_groups



def _check_x(op, x):
  """x as a jax array, integers and bools as float32 (what Flax's promotion
  with its float32 parameters makes of them)."""
  checks.check_array(op, "x", x)
  x = jnp.asarray(x)
  if not jnp.issubdtype(x.dtype, jnp.inexact):
    x = x.astype(jnp.float32)
  if x.ndim < 2:
    raise ValueError(f"{op}: x must be [N, *spatial, C] (rank >= 2, channels last); got "
                     f"shape {tuple(x.shape)}")
  if x.shape[-1] == 0:
    raise ValueError(f"{op}: x.shape[-1] (channels) must be > 0, got shape {tuple(x.shape)}")
  return x


def _norm(op, x, scale, bias, groups, epsilon, activation):
  """The op on checked x: the kernels' primitives for their dtypes; the
  reference, differentiated by JAX, in float64 or complex x's dtype; an
  empty x's empty result (Flax's)."""
  epsilon = checks.check_epsilon(op, epsilon)
  act = activation_lib.activation_arg(op, activation)
  scale2 = _prepare(op, x, scale, "scale", 1.0)
  bias2 = _prepare(op, x, bias, "bias", 0.0)
  if x.size == 0:
    return jnp.zeros(x.shape, x.dtype)
  params = dict(groups=groups, epsilon=epsilon, activation=act,
                deterministic=bool(config.deterministic))
  if not checks.kernel_dtype(x.dtype):
    return _fwd_reference(x, scale2, bias2, **params)[0]
  return _group_norm(x, scale2, bias2, **params)


def group_norm(x: jax.Array, scale: jax.Array | None = None, bias: jax.Array | None = None, *,
               num_groups: int | None = 32, group_size: int | None = None,
               epsilon: float = 1e-6, activation: str | None = None) -> jax.Array:
  """Group normalization of channels-last x, with an optional fused activation.

  Statistics per sample and group of channels, over all spatial positions
  (as flax.nnx.GroupNorm with its default reduction axes):
  y = act((x - mean) / sqrt(var + epsilon) * scale + bias).

  Args:
    x: [N, *spatial, C] (any number of spatial axes, including none);
      float32, bfloat16 and float16 run the kernels, float64 and complex the
      reference in their dtype, integers and bools as float32.
    scale: [C] (any float dtype), or None for no scale.
    bias: [C], or None for no bias.
    num_groups: groups of channels (dividing C); or None with group_size.
    group_size: channels a group (dividing C), with num_groups=None.
    epsilon: added to the variance.
    activation: None, or one of bias_act's ("relu", "gelu", "gelu_tanh",
      "silu", "sigmoid", "tanh"), applied after the affine transform.
  Returns y in x's dtype. Gradients flow to x, scale and bias in their dtypes.
  """
  op = "group_norm"
  x = _check_x(op, x)
  groups = _groups(op, x.shape[-1], num_groups, group_size)
  return _norm(op, x, scale, bias, groups, epsilon, activation)


def instance_norm(x: jax.Array, scale: jax.Array | None = None, bias: jax.Array | None = None,
                  *, epsilon: float = 1e-6, activation: str | None = None) -> jax.Array:
  """Instance normalization of channels-last x: group_norm with one channel a
  group (as flax.nnx.InstanceNorm with feature_axes=-1): statistics per
  sample and channel over all spatial positions.

  Args:
    x: [N, *spatial, C], dtypes as group_norm's.
    scale, bias: [C] (any float dtype), or None.
    epsilon: added to the variance.
    activation: None, or one of bias_act's activations.
  """
  op = "instance_norm"
  x = _check_x(op, x)
  return _norm(op, x, scale, bias, x.shape[-1], epsilon, activation)
