"""BatchNorm as a Flax NNX layer, drop-in for flax.nnx.BatchNorm: the same
class (a subclass), so the same constructor arguments and defaults, parameter
(`scale`, `bias`) and batch-statistic (`mean`, `var`) names, running-average
update and `__call__(x, use_running_average=None, *, mask=None)`.

Features along the last axis (axis=-1, the default: channels-last NWC, NHWC,
NDHWC) without a mask, in fp32/bf16/fp16, run jax_dnn's batch_norm /
batch_norm_inference; any other axis, a mask or float64 runs Flax's own
computation. As in Flax, x, the
statistics and the parameters are promoted to a common dtype (`dtype` when
given), the statistics are at least fp32, and `axis_name` /
`axis_index_groups` take the statistics over a mesh axis. The variance:
`use_fast_variance` selects E[x^2] - E[x]^2 (one pass) or a second pass
centred on the mean, as Flax's flag does (both with fp32 sums).

Beyond Flax, `__call__` takes keyword-only `residual` and `activation`
(None by default, Flax's behaviour): act(bn(x) + residual) in the same pass,
ResNet's relu(bn(x) + shortcut).
"""

from __future__ import annotations

from flax import nnx
from flax.nnx.module import first_from
import jax

from jax_dnn._src import activation as activation_lib
from jax_dnn._src import checks
from jax_dnn._src.batch_norm import batch_norm, batch_norm_inference


class BatchNorm(nnx.BatchNorm):
  """Batch normalization (see flax.nnx.BatchNorm), with an optional fused
  residual add and activation."""

  def __call__(self, x, use_running_average: bool | None = None, *, mask=None,
               residual=None, activation: str | None = None):
    """Normalizes x with the batch's statistics (and updates the running
    averages) or, with use_running_average, with the running averages.

    residual: added to the normalized x before the activation (x's shape).
    activation: None or one of "relu", "gelu", "gelu_tanh", "silu",
      "sigmoid", "tanh", applied last.
    """
    use_running_average = first_from(
        use_running_average, self.use_running_average,
        error_msg="No `use_running_average` argument was provided to BatchNorm: pass it to "
                  "the constructor or to __call__ (as for flax.nnx.BatchNorm).")
    act = activation_lib.activation_arg("jax_dnn.nn.BatchNorm", activation)
    scale = self.scale[...] if self.scale is not None else None
    bias = self.bias[...] if self.bias is not None else None
    xp, mean, var, scale, bias = self.promote_dtype(
        (x, self.mean[...], self.var[...], scale, bias), dtype=self.dtype)
    last = isinstance(self.axis, int) and self.axis in (-1, x.ndim - 1)
    if mask is not None or not last or not checks.kernel_dtype(xp.dtype):
      y = super().__call__(x, use_running_average, mask=mask)
      if residual is not None:
        y = y + residual
      return activation_lib.apply(y, act).astype(y.dtype)
    x = xp
    if residual is not None:
      residual = residual.astype(x.dtype)
    if use_running_average:
      return batch_norm_inference(x, mean, var, scale, bias, residual=residual,
                                  activation=activation, epsilon=self.epsilon)
    y, mean, var = batch_norm(x, scale, bias, residual=residual, activation=activation,
                              epsilon=self.epsilon, axis_name=self.axis_name,
                              axis_index_groups=self.axis_index_groups,
                              use_fast_variance=self.use_fast_variance)
    # As Flax: the update is cut from the gradient for variables that are
    # array refs (which can update in place); Flax releases without the
    # attribute have none.
    can_update = any(getattr(v, "_can_update", False) for v in (self.mean, self.var))
    stop_gradient = jax.lax.stop_gradient if can_update else (lambda v: v)
    self.mean[...] = stop_gradient(self.momentum * self.mean[...] + (1 - self.momentum) * mean)
    self.var[...] = stop_gradient(self.momentum * self.var[...] + (1 - self.momentum) * var)
    return y
