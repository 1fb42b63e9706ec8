"""LayerNorm and RMSNorm as Flax NNX layers, drop-in for flax.nnx.LayerNorm /
flax.nnx.RMSNorm: same constructor arguments, defaults and parameter names
(`scale`, `bias`), computed by jax_dnn's fused kernels.

Like Flax, x and the parameters are promoted to a common dtype (`dtype` when
given), and the normalization runs in that dtype with fp32 statistics. Only
normalization over the last axis is fused; other `reduction_axes` /
`feature_axes` raise a ValueError, as do the cross-device `axis_name` options.
"""

from __future__ import annotations

from typing import Any

from flax import nnx
from flax.nnx.nn import dtypes as nn_dtypes
import jax.numpy as jnp

from jax_dnn._src.layer_norm import layer_norm, rms_norm


def _check_last_axis(layer: str, reduction_axes, feature_axes, axis_name, axis_index_groups):
  for name, v in (("reduction_axes", reduction_axes), ("feature_axes", feature_axes)):
    axes = tuple(v) if isinstance(v, (tuple, list)) else (v,)
    if axes != (-1,):
      raise ValueError(f"jax_dnn.nn.{layer}: only {name}=-1 is supported, got {v!r}")
  if axis_name is not None or axis_index_groups is not None:
    raise ValueError(f"jax_dnn.nn.{layer}: axis_name / axis_index_groups are not supported")


class LayerNorm(nnx.Module):
  """Layer normalization over the last axis (see flax.nnx.LayerNorm)."""

  def __init__(self, num_features: int, *, epsilon: float = 1e-6, dtype: Any = None,
               param_dtype: Any = jnp.float32, use_bias: bool = True, use_scale: bool = True,
               bias_init=nnx.initializers.zeros, scale_init=nnx.initializers.ones,
               reduction_axes=-1, feature_axes=-1, axis_name=None, axis_index_groups=None,
               use_fast_variance: bool = True, promote_dtype=nn_dtypes.promote_dtype,
               rngs: nnx.Rngs):
    del use_fast_variance  # the kernel always computes the exact two-pass variance
    _check_last_axis("LayerNorm", reduction_axes, feature_axes, axis_name, axis_index_groups)
    shape = (num_features,)
    self.scale = nnx.Param(scale_init(rngs.params(), shape, param_dtype)) if use_scale else None
    self.bias = nnx.Param(bias_init(rngs.params(), shape, param_dtype)) if use_bias else None
    self.num_features = num_features
    self.epsilon = epsilon
    self.dtype = dtype
    self.param_dtype = param_dtype
    self.use_bias = use_bias
    self.use_scale = use_scale
    self.promote_dtype = promote_dtype

  def __call__(self, x, *, mask=None):
    if mask is not None:
      raise ValueError("jax_dnn.nn.LayerNorm: mask is not supported")
    scale = self.scale[...] if self.scale is not None else None
    bias = self.bias[...] if self.bias is not None else None
    x, scale, bias = self.promote_dtype((x, scale, bias), dtype=self.dtype)
    return layer_norm(x, scale, bias, epsilon=self.epsilon)


class RMSNorm(nnx.Module):
  """RMS normalization over the last axis (see flax.nnx.RMSNorm)."""

  def __init__(self, num_features: int, *, epsilon: float = 1e-6, dtype: Any = None,
               param_dtype: Any = jnp.float32, use_scale: bool = True,
               scale_init=nnx.initializers.ones, reduction_axes=-1, feature_axes=-1,
               axis_name=None, axis_index_groups=None, use_fast_variance: bool = True,
               promote_dtype=nn_dtypes.promote_dtype, rngs: nnx.Rngs):
    del use_fast_variance
    _check_last_axis("RMSNorm", reduction_axes, feature_axes, axis_name, axis_index_groups)
    self.scale = (nnx.Param(scale_init(rngs.params(), (num_features,), param_dtype))
                  if use_scale else None)
    self.num_features = num_features
    self.epsilon = epsilon
    self.dtype = dtype
    self.param_dtype = param_dtype
    self.use_scale = use_scale
    self.promote_dtype = promote_dtype

  def __call__(self, x, *, mask=None):
    if mask is not None:
      raise ValueError("jax_dnn.nn.RMSNorm: mask is not supported")
    scale = self.scale[...] if self.scale is not None else None
    x, scale = self.promote_dtype((x, scale), dtype=self.dtype)
    return rms_norm(x, scale, epsilon=self.epsilon)
