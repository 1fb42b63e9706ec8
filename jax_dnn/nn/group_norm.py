"""GroupNorm and InstanceNorm as Flax NNX layers, drop-in for
flax.nnx.GroupNorm / flax.nnx.InstanceNorm: subclasses with the same
constructor arguments, defaults, attributes and parameters (`scale`, `bias`),
whose default layout runs jax_dnn's group_norm / instance_norm.

The kernels take features last with statistics over every non-batch axis
(GroupNorm's default reduction_axes, InstanceNorm's default feature_axes),
without `mask` or `axis_name`/`axis_index_groups`, on x of rank >= 2 whose
promoted dtype is float32, bfloat16 or float16. Everything else runs Flax's
own computation. Like Flax, x and the parameters are promoted to a common
dtype (`dtype` when given) and normalized in it with fp32 statistics; the
kernels compute the exact variance whatever `use_fast_variance` says (Flax's
fast E[x^2] - E[x]^2 loses precision where the mean is large against the
standard deviation).

One keyword-only option beyond Flax's: `activation` (default None), one of
jax_dnn.bias_act's activations applied to the output and fused into the
kernels ("silu": the diffusion UNet's GroupNorm + SiLU).
"""

from __future__ import annotations

import math
from types import MappingProxyType
from typing import Any

from flax import nnx
from flax.nnx.nn import dtypes as nn_dtypes
import jax.numpy as jnp

from jax_dnn._src import activation as activation_lib
from jax_dnn._src import checks
from jax_dnn._src import group_norm as group_norm_lib


def _tuple(axes) -> tuple[int, ...]:
  return tuple(axes) if isinstance(axes, (tuple, list)) else (axes,)


def _axes(ndim, axes) -> frozenset[int]:
  return frozenset(a % ndim for a in _tuple(axes))


def _check_features(layer, x, axes, num_features):
  """Flax reshapes x (GroupNorm) or the parameters (InstanceNorm) onto x's
  feature axes, which fails with an opaque reshape error where their size
  is not num_features: name the mismatch instead (axes out of range: Flax's
  own error)."""
  axes = _tuple(axes)
  if not all(-x.ndim <= a < x.ndim for a in axes):
    return
  features = math.prod(x.shape[a] for a in axes)
  if features != num_features:
    raise ValueError(f"jax_dnn.nn.{type(layer).__name__}: x has {features} features along "
                     f"axes {tuple(axes)} (shape {tuple(x.shape)}); the layer was built for "
                     f"num_features={num_features}")


def _activate(layer, y):
  if layer.activation is None:
    return y
  return activation_lib.apply(
      y, activation_lib.activation_arg(layer.__class__.__name__, layer.activation))


def _call(layer, flax_call, x, mask, kernel):
  """kernel(x, scale, bias) on the promoted operands where the layer's
  options (layer._takes_kernel) and the promoted dtype allow it; else Flax's
  own computation, flax_call(x, mask=mask), then the activation."""
  if layer._takes_kernel(x, mask):  # pylint: disable=protected-access
    scale = layer.scale[...] if layer.scale is not None else None
    bias = layer.bias[...] if layer.bias is not None else None
    xp, scale, bias = layer.promote_dtype((x, scale, bias), dtype=layer.dtype)
    if checks.kernel_dtype(xp.dtype):
      return kernel(xp, scale, bias)
  return _activate(layer, flax_call(x, mask=mask))


class GroupNorm(nnx.GroupNorm):
  """Group normalization (see flax.nnx.GroupNorm), optionally with a fused activation."""

  def __init__(self, num_features: int, num_groups: int | None = 32,
               group_size: int | None = None, *, epsilon: float = 1e-6, dtype: Any = None,
               param_dtype: Any = jnp.float32, use_bias: bool = True, use_scale: bool = True,
               bias_init=nnx.initializers.zeros_init(), scale_init=nnx.initializers.ones_init(),
               reduction_axes=None, axis_name=None, axis_index_groups=None,
               use_fast_variance: bool = True, promote_dtype=nn_dtypes.promote_dtype,
               rngs: nnx.Rngs, bias_metadata=MappingProxyType({}),
               scale_metadata=MappingProxyType({}), activation: str | None = None):
    activation_lib.activation_arg("jax_dnn.nn.GroupNorm", activation)
    super().__init__(num_features, num_groups, group_size, epsilon=epsilon, dtype=dtype,
                     param_dtype=param_dtype, use_bias=use_bias, use_scale=use_scale,
                     bias_init=bias_init, scale_init=scale_init, reduction_axes=reduction_axes,
                     axis_name=axis_name, axis_index_groups=axis_index_groups,
                     use_fast_variance=use_fast_variance, promote_dtype=promote_dtype,
                     rngs=rngs, bias_metadata=bias_metadata, scale_metadata=scale_metadata)
    self.activation = activation

  def _takes_kernel(self, x, mask) -> bool:
    if mask is not None or self.axis_name is not None or self.axis_index_groups is not None:
      return False
    if x.ndim < 2 or x.shape[-1] != self.num_groups * self.group_size:
      return False
    return (self.reduction_axes is None
            or _axes(x.ndim, self.reduction_axes) == frozenset(range(1, x.ndim)))

  def __call__(self, x, *, mask=None):
    _check_features(self, x, (-1,), self.num_groups * self.group_size)
    kernel = lambda x, scale, bias: group_norm_lib.group_norm(
        x, scale, bias, num_groups=self.num_groups, epsilon=self.epsilon,
        activation=self.activation)
    return _call(self, super().__call__, x, mask, kernel)


class InstanceNorm(nnx.InstanceNorm):
  """Instance normalization (see flax.nnx.InstanceNorm), optionally with a fused activation."""

  def __init__(self, num_features: int, *, epsilon: float = 1e-6, dtype: Any = None,
               param_dtype: Any = jnp.float32, use_bias: bool = True, use_scale: bool = True,
               bias_init=nnx.initializers.zeros, scale_init=nnx.initializers.ones,
               feature_axes=-1, axis_name=None, axis_index_groups=None,
               use_fast_variance: bool = True, promote_dtype=nn_dtypes.promote_dtype,
               rngs: nnx.Rngs, bias_metadata=MappingProxyType({}),
               scale_metadata=MappingProxyType({}), activation: str | None = None):
    activation_lib.activation_arg("jax_dnn.nn.InstanceNorm", activation)
    super().__init__(num_features, epsilon=epsilon, dtype=dtype, param_dtype=param_dtype,
                     use_bias=use_bias, use_scale=use_scale, bias_init=bias_init,
                     scale_init=scale_init, feature_axes=feature_axes, axis_name=axis_name,
                     axis_index_groups=axis_index_groups, use_fast_variance=use_fast_variance,
                     promote_dtype=promote_dtype, rngs=rngs, bias_metadata=bias_metadata,
                     scale_metadata=scale_metadata)
    self.activation = activation

  def _takes_kernel(self, x, mask) -> bool:
    if mask is not None or self.axis_name is not None or self.axis_index_groups is not None:
      return False
    return (x.ndim >= 2 and x.shape[-1] == self.num_features
            and _axes(x.ndim, self.feature_axes) == frozenset({x.ndim - 1}))

  def __call__(self, x, *, mask=None):
    if self.scale is not None or self.bias is not None:  # Flax takes any width without them
      _check_features(self, x, self.feature_axes, self.num_features)
    kernel = lambda x, scale, bias: group_norm_lib.instance_norm(
        x, scale, bias, epsilon=self.epsilon, activation=self.activation)
    return _call(self, super().__call__, x, mask, kernel)
