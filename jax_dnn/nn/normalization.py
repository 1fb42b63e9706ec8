"""LayerNorm and RMSNorm as Flax NNX layers, drop-in for flax.nnx.LayerNorm /
flax.nnx.RMSNorm: same constructor arguments, defaults and parameter names
(`scale`, `bias`), computed by jax_dnn's fused kernels.

Like Flax, x and the parameters are promoted to a common dtype (`dtype` when
given), and the normalization runs in that dtype with fp32 statistics
(float64 and complex, and a `mask`: the reference, in that dtype; a row the
mask leaves empty gives the bias, where Flax's gives NaN). Only normalization
over the last axis is fused; other `reduction_axes` / `feature_axes` raise a
ValueError, as do the cross-device `axis_name` options.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from flax import nnx
from flax.nnx.nn import dtypes as nn_dtypes
import jax.numpy as jnp

from jax_dnn._src.layer_norm import normalize


def _check_last_axis(layer: str, reduction_axes, feature_axes, axis_name, axis_index_groups):
  for name, v in (("reduction_axes", reduction_axes), ("feature_axes", feature_axes)):
    axes = tuple(v) if isinstance(v, (tuple, list)) else (v,)
    if axes != (-1,):
      raise ValueError(f"jax_dnn.nn.{layer}: only {name}=-1 is supported, got {v!r}")
  if axis_name is not None or axis_index_groups is not None:
    raise ValueError(f"jax_dnn.nn.{layer}: axis_name / axis_index_groups are not supported")


def _param(use, init, rngs, shape, dtype, metadata):
  """A parameter as Flax's layers make it: nnx.Param with its metadata, or an
  absent one as pytree data (nnx.data, Flax >= 0.12), as theirs is."""
  if use:
    return nnx.Param(init(rngs.params(), shape, dtype), **metadata)
  return nnx.data(None) if hasattr(nnx, "data") else None


class LayerNorm(nnx.Module):
  """Layer normalization over the last axis (see flax.nnx.LayerNorm)."""

  def __init__(self, num_features: int, *, epsilon: float = 1e-6, dtype: Any = None,
               param_dtype: Any = jnp.float32, use_bias: bool = True, use_scale: bool = True,
               bias_init=nnx.initializers.zeros, scale_init=nnx.initializers.ones,
               reduction_axes=-1, feature_axes=-1, axis_name=None, axis_index_groups=None,
               use_fast_variance: bool = True, promote_dtype=nn_dtypes.promote_dtype,
               rngs: nnx.Rngs, bias_metadata: Mapping[str, Any] = MappingProxyType({}),
               scale_metadata: Mapping[str, Any] = MappingProxyType({})):
    _check_last_axis("LayerNorm", reduction_axes, feature_axes, axis_name, axis_index_groups)
    shape = (num_features,)
    self.scale = _param(use_scale, scale_init, rngs, shape, param_dtype, scale_metadata)
    self.bias = _param(use_bias, bias_init, rngs, shape, param_dtype, bias_metadata)
    self.num_features = num_features
    self.epsilon = epsilon
    self.dtype = dtype
    self.param_dtype = param_dtype
    self.use_bias = use_bias
    self.use_scale = use_scale
    self.reduction_axes = reduction_axes
    self.feature_axes = feature_axes
    self.axis_name = axis_name
    self.axis_index_groups = axis_index_groups
    # Kept as Flax keeps it; the kernels always compute the two-pass variance.
    self.use_fast_variance = use_fast_variance
    self.promote_dtype = promote_dtype

  def __call__(self, x, *, mask=None):
    scale = self.scale[...] if self.scale is not None else None
    bias = self.bias[...] if self.bias is not None else None
    x, scale, bias = self.promote_dtype((x, scale, bias), dtype=self.dtype)
    return normalize("layer_norm", x, scale, bias, epsilon=self.epsilon, rms=False, mask=mask)


class RMSNorm(nnx.Module):
  """RMS normalization over the last axis (see flax.nnx.RMSNorm)."""

  def __init__(self, num_features: int, *, epsilon: float = 1e-6, dtype: Any = None,
               param_dtype: Any = jnp.float32, use_scale: bool = True,
               scale_init=nnx.initializers.ones, reduction_axes=-1, feature_axes=-1,
               axis_name=None, axis_index_groups=None, use_fast_variance: bool = True,
               promote_dtype=nn_dtypes.promote_dtype, rngs: nnx.Rngs,
               scale_metadata: Mapping[str, Any] = MappingProxyType({})):
    _check_last_axis("RMSNorm", reduction_axes, feature_axes, axis_name, axis_index_groups)
    self.scale = _param(use_scale, scale_init, rngs, (num_features,), param_dtype, scale_metadata)
    self.num_features = num_features
    self.epsilon = epsilon
    self.dtype = dtype
    self.param_dtype = param_dtype
    self.use_scale = use_scale
    self.reduction_axes = reduction_axes
    self.feature_axes = feature_axes
    self.axis_name = axis_name
    self.axis_index_groups = axis_index_groups
    self.use_fast_variance = use_fast_variance
    self.promote_dtype = promote_dtype

  def __call__(self, x, mask=None):
    scale = self.scale[...] if self.scale is not None else None
    x, scale = self.promote_dtype((x, scale), dtype=self.dtype)
    return normalize("rms_norm", x, scale, None, epsilon=self.epsilon, rms=True, mask=mask)
