"""Elementwise activations and the fused bias + activation.

    relu, gelu (exact or tanh approximation), silu, sigmoid, tanh:  y = act(x)
    bias_act(x, bias, activation):  y = act(x + bias), bias over the last axis

The kernels take float32, bfloat16 and float16 arrays; anything else
(integer, bool, complex, float64 under x64, Python scalars) runs jax.nn's
function itself (`apply`), with its dtype rules, values and errors.

Numerics: fp32 math, output in x's dtype. The backward recomputes act'(x)
from the saved input (one read of x and dy, one write of dx); bias_act's
dbias is reduced over rows deterministically (per-block partials summed in a
fixed order) and returned in bias's dtype. The primitives take bias as fp32
[G, W]; G > 1 only when vmap batched the bias (see layer_norm.py).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jax_dnn._src import checks
from jax_dnn._src import plans
from jax_dnn._src import sharding
from jax_dnn._src.batching import batch_size, fold_param_sets, move_to_front, split_leading
from jax_dnn._src.primitive import ShapedArray, define_primitive, vjp_op

# FFI attribute values; the numbering matches enum Activation in ffi/activation/activation.h.
ACTIVATIONS = {"relu": 0, "gelu": 1, "gelu_tanh": 2, "silu": 3, "sigmoid": 4, "tanh": 5}
NAMES = {v: k for k, v in ACTIVATIONS.items()}
# The fused ops' (conv, batch norm, group norm) activation param where none
# is applied.
NO_ACTIVATION = -1


def activation_arg(op: str, activation: str | None) -> int:
  """The fused ops' activation param for their `activation` argument: None,
  or a name of ACTIVATIONS."""
  if activation is None:
    return NO_ACTIVATION
  if activation not in ACTIVATIONS:
    raise ValueError(f"{op}: activation must be None or one of {sorted(ACTIVATIONS)}; "
                     f"got {activation!r}")
  return ACTIVATIONS[activation]


def apply(x, activation: int):
  """act(x) as jax.nn computes it (x for NO_ACTIVATION): the paths without
  the kernels, and the references."""
  if activation == NO_ACTIVATION:
    return x
  name = NAMES[activation]
  if name == "relu":
    return jax.nn.relu(x)
  if name == "gelu":
    return jax.nn.gelu(x, approximate=False)
  if name == "gelu_tanh":
    return jax.nn.gelu(x, approximate=True)
  if name == "silu":
    return jax.nn.silu(x)
  if name == "sigmoid":
    return jax.nn.sigmoid(x)
  return jnp.tanh(x)


def _act_grad(x, activation):
  return jax.vmap(jax.grad(lambda v: apply(v, activation)))(x.ravel()).reshape(x.shape)


# --- references (pure JAX; what non-CUDA platforms run) ----------------------


def _with_bias(x, bias):
  xf = x.astype(jnp.float32)
  if bias is None:
    return xf
  g, w = bias.shape
  return (xf.reshape(g, -1, w) + bias[:, None, :]).reshape(x.shape)


def _fwd_reference(x, bias=None, *, activation):
  return apply(_with_bias(x, bias), activation).astype(x.dtype)


def _bwd_reference(dy, x, bias=None, *, activation):
  z = _with_bias(x, bias)
  dx = dy.astype(jnp.float32) * _act_grad(z, activation)
  if bias is None:
    return dx.astype(x.dtype)
  g, w = bias.shape
  dbias = jnp.sum(dx.reshape(g, -1, w), axis=1)
  return dx.astype(x.dtype), dbias


# --- primitives ---------------------------------------------------------------


def _act_fwd_batch(args, dims, *, activation):
  (x,), (d,) = args, dims
  return activation_fwd_p.bind(x, activation=activation), d  # elementwise


def _act_bwd_batch(args, dims, *, activation):
  size = batch_size(args, dims)
  dy, x = (move_to_front(a, d, size) for a, d in zip(args, dims))
  return activation_bwd_p.bind(dy, x, activation=activation), 0


def _bias_fwd_batch(args, dims, *, activation):
  x, bias = args
  size = batch_size(args, dims)
  x = move_to_front(x, dims[0], size)
  bias = fold_param_sets(bias, dims[1], size, shared_ok=True)
  return bias_act_fwd_p.bind(x, bias, activation=activation), 0


def _bias_bwd_batch(args, dims, *, activation):
  dy, x, bias = args
  size = batch_size(args, dims)
  dy, x = move_to_front(dy, dims[0], size), move_to_front(x, dims[1], size)
  bias = fold_param_sets(bias, dims[2], size, shared_ok=False)
  dx, dbias = bias_act_bwd_p.bind(dy, x, bias, activation=activation)
  return [dx, split_leading(dbias, size)], [0, 0]


def _bias_bwd_abstract(dy, x, bias, *, activation):
  return ShapedArray(x.shape, x.dtype), ShapedArray(bias.shape, jnp.float32)


def _bias_bwd_workspace(avals, *, activation):
  """dbias's partial sums [G, parts, 1, W] (BiasActBwdParts). A symbolic row
  count (jax.export) is passed as plans.LARGE: the parts' upper bound,
  whatever the rows."""
  del activation
  _, x, bias = avals
  g, w = bias.shape
  rows = plans.static_dim(math.prod(x.shape[:-1]), plans.LARGE)
  parts = plans.bias_act_bwd_parts(rows, g, w, jnp.dtype(x.dtype).name)
  return (ShapedArray((g, parts, 1, w), jnp.float32),)


# --- sharding rules: every dimension splits (elementwise); with a bias, its
# columns split with x's and dbias is summed over the devices holding rows.


def _act_sharding(operands, results, **params):
  del results, params
  return sharding.same_shape(operands[-1], len(operands))


def _bias_sharding(operands, results, **params):
  del params
  b = sharding.RuleBuilder()
  shape, (param_sets, width) = operands[-2], operands[-1]
  x, g = sharding.param_set_rows(b, shape, param_sets, b.factor("w", width))
  for _ in operands[:-1]:
    b.operand(*x)
  b.operand(g, "w")
  b.result(*x)
  if len(results) > 1:  # the backward's dbias
    b.result(g, "w", sum_=True)
  return b.build()


activation_fwd_p = define_primitive(
    "activation_fwd",
    abstract_eval=lambda x, *, activation: ShapedArray(x.shape, x.dtype),
    batching_rule=_act_fwd_batch,
    reference=_fwd_reference,
    multiple_results=False,
    sharding=_act_sharding,
)
activation_bwd_p = define_primitive(
    "activation_bwd",
    abstract_eval=lambda dy, x, *, activation: ShapedArray(x.shape, x.dtype),
    batching_rule=_act_bwd_batch,
    reference=_bwd_reference,
    multiple_results=False,
    sharding=_act_sharding,
)
bias_act_fwd_p = define_primitive(
    "bias_act_fwd",
    abstract_eval=lambda x, bias, *, activation: ShapedArray(x.shape, x.dtype),
    batching_rule=_bias_fwd_batch,
    reference=_fwd_reference,
    multiple_results=False,
    sharding=_bias_sharding,
)
bias_act_bwd_p = define_primitive(
    "bias_act_bwd",
    abstract_eval=_bias_bwd_abstract,
    batching_rule=_bias_bwd_batch,
    reference=_bwd_reference,
    multiple_results=True,
    workspace=_bias_bwd_workspace,
    sharding=_bias_sharding,
)


_activation = vjp_op(activation_fwd_p, activation_bwd_p)
_bias_act = vjp_op(bias_act_fwd_p, bias_act_bwd_p)


# --- public API -------------------------------------------------------------------


def _apply(name: str, x):
  if not checks.kernels_take(x):
    return apply(x, ACTIVATIONS[name])
  return _activation(jnp.asarray(x), activation=ACTIVATIONS[name])


def _unary(name: str):
  def fn(x: jax.Array) -> jax.Array:
    return _apply(name, x)

  fn.__name__ = name
  return fn


relu = _unary("relu")
relu.__doc__ = "max(x, 0) elementwise; gradient 0 at x = 0 (as jax.nn.relu)."
silu = _unary("silu")
silu.__doc__ = "x * sigmoid(x) elementwise (a.k.a. swish)."
sigmoid = _unary("sigmoid")
sigmoid.__doc__ = "1 / (1 + exp(-x)) elementwise."
tanh = _unary("tanh")
tanh.__doc__ = "tanh(x) elementwise."


def gelu(x: jax.Array, approximate: bool = True) -> jax.Array:
  """GELU elementwise; `approximate=True` (the jax.nn.gelu default) uses tanh."""
  if not isinstance(approximate, bool):
    raise TypeError(f"gelu: approximate must be a bool, got {approximate!r}")
  return _apply("gelu_tanh" if approximate else "gelu", x)


def bias_act(x: jax.Array, bias: jax.Array, activation: str = "gelu") -> jax.Array:
  """act(x + bias) in one pass; bias has shape (x.shape[-1],).

  activation: one of "relu", "gelu" (exact), "gelu_tanh", "silu", "sigmoid",
  "tanh". The result is in x's dtype; where x or bias is not what the kernels
  take (x integer, bool, complex, float64; bias not floating), it is
  act(x + bias) with JAX's dtype promotion. The backward gives dx and dbias
  (reduced over all leading axes).
  """
  op = "bias_act"
  if activation not in ACTIVATIONS:
    raise ValueError(f"{op}: activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}")
  if jnp.ndim(x) == 0:
    raise ValueError(f"{op}: x must have rank >= 1, got a scalar")
  width = jnp.shape(x)[-1]
  checks.check_param_shape(op, "bias", bias, width)
  code = ACTIVATIONS[activation]
  if not (checks.kernels_take(x) and jnp.issubdtype(bias.dtype, jnp.floating)):
    return apply(x + bias, code)
  if width == 0:  # no columns: nothing for the kernels to do
    return jnp.zeros(x.shape, x.dtype)
  return _bias_act(jnp.asarray(x), bias.astype(jnp.float32).reshape(1, width), activation=code)
