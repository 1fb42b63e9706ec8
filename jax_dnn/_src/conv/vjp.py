"""The convolution's custom VJPs, which the public ops (api.py) call."""

from __future__ import annotations

import functools

import jax.numpy as jnp

from jax_dnn._src import activation as activation_lib
from jax_dnn._src.activation import NO_ACTIVATION
from jax_dnn._src import plans
from jax_dnn._src.mesh_types import like_primal, same_manual_axes
from jax_dnn._src.derivatives import custom_vjp
from jax_dnn._src.conv.phases import dgrad
from jax_dnn._src.conv.primitives import conv_fwd_p, conv_wgrad_p, plan_for, present

_FROM_OUTPUT = frozenset(activation_lib.ACTIVATIONS[n] for n in ("relu", "sigmoid", "tanh"))


# --- custom VJPs ----------------------------------------------------------------------


def _geometry(params):
  """The params dgrad and wgrad share with the forward (all but activation)."""
  return {k: v for k, v in params.items() if k != "activation"}


def _act_backward(dy, saved, activation):
  """g = dy * act'(z), from y (relu, sigmoid, tanh) or from z (the others)."""
  if activation == NO_ACTIVATION:
    return dy
  if activation not in _FROM_OUTPUT:
    return activation_lib.activation_bwd_p.bind(dy, saved, activation=activation)
  y, g = saved.astype(jnp.float32), dy.astype(jnp.float32)
  name = activation_lib.NAMES[activation]
  if name == "relu":
    g = jnp.where(y > 0, g, 0.0)
  elif name == "sigmoid":
    g = g * y * (1.0 - y)
  else:  # tanh
    g = g * (1.0 - y * y)
  return g.astype(dy.dtype)


def _kernel_fuses(operands, params) -> bool:
  """Whether the forward kernel takes the activation fused: False only
  where the plan takes the problem without it but not with it (the
  kernels fuse some activations). Asked while tracing, of the heuristic
  (nothing is timed at trace time: in benchmark mode the lowering times
  the form chosen here); elsewhere both forms compute the same."""
  if params["activation"] == NO_ACTIVATION or not plans.has_conv_plans():
    return True
  params = dict(params, benchmark=False)
  if plan_for("fwd", operands, params) is not None:
    return True
  return plan_for("fwd", operands, dict(params, activation=NO_ACTIVATION)) is None


def _fused_forward(x, w, bias, residual, params):
  """act(conv + bias + residual): in one kernel where it fuses the
  activation, else the kernel and jax_dnn's activation op after it."""
  if _kernel_fuses((x, w, bias, residual), params):
    return conv_fwd_p.bind(x, w, bias, residual, **params)
  z = conv_fwd_p.bind(x, w, bias, residual, **dict(params, activation=NO_ACTIVATION))
  return activation_lib.activation_fwd_p.bind(z, activation=params["activation"])


@functools.partial(custom_vjp, nondiff_argnums=(0,))
def _conv(params, x, w, bias, residual):
  return _fused_forward(x, w, bias, residual, dict(params))


def _conv_fwd(params, x, w, bias, residual):
  p = dict(params)
  act = p["activation"]
  if act == NO_ACTIVATION or act in _FROM_OUTPUT:
    y = _fused_forward(x, w, bias, residual, p)
    saved = y
  else:
    saved = conv_fwd_p.bind(x, w, bias, residual, **dict(p, activation=NO_ACTIVATION))
    y = activation_lib.activation_fwd_p.bind(saved, activation=act)
  return y, (x, w, bias, residual, saved)


def _conv_bwd(params, res, dy):
  x, w, bias, residual, saved = res
  p = dict(params)
  geo = _geometry(p)
  g = _act_backward(dy.astype(x.dtype), saved, p["activation"])
  dx = dgrad(g, w, input=tuple(x.shape[1:4]), **geo)
  dw = conv_wgrad_p.bind(x, g, window=tuple(w.shape[1:4]), **geo)
  dbias = (jnp.sum(g.astype(jnp.float32), axis=(0, 1, 2, 3)).astype(bias.dtype)
           if present(bias) else jnp.zeros_like(bias))
  dres = g.astype(residual.dtype) if present(residual) else jnp.zeros_like(residual)
  return tuple(like_primal(ct, a) for ct, a in zip((dx, dw, dbias, dres),
                                                    (x, w, bias, residual)))


_conv.defvjp(_conv_fwd, _conv_bwd)


@functools.partial(custom_vjp, nondiff_argnums=(0,))
def _dgrad(params, dy, w):
  return dgrad(dy, w, **dict(params))


def _dgrad_fwd(params, dy, w):
  return _dgrad(params, dy, w), (dy, w)


def _dgrad_bwd(params, res, g):
  """dgrad is linear in dy and w: <dgrad(dy, w), g> = <dy, fwd(g, w)>."""
  dy, w = res
  geo = {k: v for k, v in dict(params).items() if k != "input"}
  empty = jnp.zeros((0,), dy.dtype)
  g, w, bias, residual = same_manual_axes(g.astype(dy.dtype), w, empty, empty)
  ddy = conv_fwd_p.bind(g, w, bias, residual, activation=NO_ACTIVATION, **geo)
  dw = conv_wgrad_p.bind(g, dy, window=tuple(w.shape[1:4]), **geo)
  return like_primal(ddy, dy), like_primal(dw, w)


_dgrad.defvjp(_dgrad_fwd, _dgrad_bwd)


def conv(x, w, bias, residual, **params):
  """act(conv(x, w) + bias + residual) over the canonical layout (see the
  file header); bias and residual [0] when absent. Differentiable."""
  return _conv(tuple(sorted(params.items())), *same_manual_axes(x, w, bias, residual))


def conv_dgrad(dy, w, **params):
  """The data gradient of conv(x, w) (no bias or activation) for x of
  spatial extents params["input"]: the transposed convolution.
  Differentiable."""
  return _dgrad(tuple(sorted(params.items())), *same_manual_axes(dy, w))
