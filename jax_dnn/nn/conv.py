"""Conv and ConvTranspose as Flax NNX layers, drop-in for flax.nnx.Conv /
flax.nnx.ConvTranspose: same constructor arguments, defaults and parameter
names (`kernel` [*window, C/groups, K], `bias` [K]), computed by jax_dnn.

Conv is flax.nnx.Conv with jax_dnn.conv_general_dilated as its convolution;
where the layer has a bias and nothing beyond the fused form's reach (no input
dilation, SAME/VALID/explicit padding, default precision and output type), the
convolution and the bias add run as one jax_dnn.conv, so the bias costs no
pass of its own over the output, forward or backward. Flax's ConvTranspose calls lax.conv_transpose
directly, so ConvTranspose repeats its __call__ around jax_dnn.conv_transpose
(including CIRCULAR padding's periodic wrap).

Like Flax, inputs are channels-last [*batch, *spatial, C]; any number of
leading batch dimensions (none included) are folded into one.
"""

from __future__ import annotations

from flax import nnx
from flax.nnx.nn import linear as nn_linear
import jax.numpy as jnp

import jax_dnn


def _per_axis(value, rank: int) -> tuple[int, ...]:
  """Flax's reading of strides / dilations: None means 1, an int every axis."""
  if value is None:
    value = 1
  return (value,) * rank if isinstance(value, int) else tuple(value)


def _fold_batch(inputs, rank: int):
  """[*batch, *spatial, C] -> ([B, *spatial, C], batch shape or None when already one axis)."""
  batch_dims = inputs.ndim - (rank + 1)
  if batch_dims == 1:
    return inputs, None
  return inputs.reshape((-1,) + inputs.shape[batch_dims:]), inputs.shape[:batch_dims]


def _unfold_batch(y, batch_shape):
  return y if batch_shape is None else y.reshape(batch_shape + y.shape[1:])


def _masked_kernel(layer):
  if layer.mask is not None and layer.mask.shape != layer.kernel_shape:
    raise ValueError("Mask needs to have the same shape as weights. "
                     f"Shapes are: {layer.mask.shape}, {layer.kernel_shape}")
  kernel = layer.kernel[...]
  return kernel * layer.mask if layer.mask is not None else kernel


class Conv(nnx.Conv):
  """flax.nnx.Conv computed by jax_dnn (see flax.nnx.Conv for the arguments)."""

  def __init__(self, *args, conv_general_dilated=jax_dnn.conv_general_dilated, **kwargs):
    super().__init__(*args, conv_general_dilated=conv_general_dilated, **kwargs)

  def _fusable(self, padding, out_sharding) -> bool:
    """Whether jax_dnn.conv computes this call: bias and convolution in one op.
    Strides or dilations < 1 take Flax's path, whose conv_general_dilated
    raises lax's error types for them."""
    rank = len(self.kernel_size)
    steps = _per_axis(self.strides, rank) + _per_axis(self.kernel_dilation, rank)
    return (self.bias is not None
            and all(isinstance(v, int) and v >= 1 for v in steps)
            and self.conv_general_dilated is jax_dnn.conv_general_dilated
            and _per_axis(self.input_dilation, rank) == (1,) * rank
            and (padding in ("SAME", "VALID") or not isinstance(padding, str))
            and self.precision is None and self.preferred_element_type is None
            and out_sharding is None)

  def __call__(self, inputs, out_sharding=None):
    rank = len(self.kernel_size)
    padding = nn_linear.canonicalize_padding(self.padding, rank)
    if not self._fusable(padding, out_sharding):
      return super().__call__(inputs, out_sharding=out_sharding)
    x, batch_shape = _fold_batch(inputs, rank)
    x, kernel, bias = self.promote_dtype((x, _masked_kernel(self), self.bias[...]),
                                         dtype=self.dtype)
    y = jax_dnn.conv(x, kernel, bias, strides=_per_axis(self.strides, rank), padding=padding,
                     dilation=_per_axis(self.kernel_dilation, rank),
                     groups=self.feature_group_count)
    return _unfold_batch(y, batch_shape)


class ConvTranspose(nnx.ConvTranspose):
  """flax.nnx.ConvTranspose computed by jax_dnn.conv_transpose (see
  flax.nnx.ConvTranspose for the arguments)."""

  def __call__(self, inputs):
    rank = len(self.kernel_size)
    x, batch_shape = _fold_batch(inputs, rank)
    strides = _per_axis(self.strides, rank)
    padding = nn_linear.canonicalize_padding(self.padding, rank)
    circular = padding == "CIRCULAR"
    bias = self.bias[...] if self.bias is not None else None
    x, kernel, bias = self.promote_dtype((x, _masked_kernel(self), bias), dtype=self.dtype)
    y = jax_dnn.conv_transpose(
        x, kernel, strides, "VALID" if circular else padding,
        rhs_dilation=_per_axis(self.kernel_dilation, rank),
        transpose_kernel=self.transpose_kernel, precision=self.precision,
        preferred_element_type=self.preferred_element_type)
    if circular:
      y = _wrap_periodically(y, [n * s for n, s in zip(x.shape[1:-1], strides)],
                             right_heavy=self.transpose_kernel)
    if bias is not None:
      y += bias.reshape((1,) * (y.ndim - 1) + (-1,))
    return _unfold_batch(y, batch_shape)


def _wrap_periodically(y, periods, *, right_heavy: bool):
  """CIRCULAR padding, as Flax computes it: pad each spatial axis of y to a
  whole even number of periods (the input's extent times the stride), the odd
  element on the left (right when the kernel is transposed, mirroring Conv),
  and sum the periods."""
  pads = []
  for extent, period in zip(y.shape[1:-1], periods):
    diff = -(extent - period) % (2 * period)
    pads.append((diff // 2, (diff + 1) // 2) if right_heavy else ((diff + 1) // 2, diff // 2))
  y = jnp.pad(y, [(0, 0)] + pads + [(0, 0)])
  for axis, period in enumerate(periods, start=1):
    # The count of periods spelled out: -1 is ambiguous for an empty batch.
    y = y.reshape(y.shape[:axis] + (y.shape[axis] // period, period)
                  + y.shape[axis + 1:]).sum(axis=axis)
  return y

