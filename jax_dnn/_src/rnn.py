"""Recurrent networks: LSTM, GRU and Elman RNN (tanh or relu); multi-layer,
bidirectional, ragged lengths.

Letters: T time steps, B batch, I input features, H hidden features, G gates
(LSTM 4: i, f, g, o; GRU 3: r, z, n; RNN 1), S state slots, L layers,
D directions (2 when bidirectional), P = L * D pseudo-layers (forward 0,
reverse 0, forward 1, ...).

The path of one call (lstm, gru, rnn):
  1. per layer, the input projection of every step and both directions as one
     GEMM through XLA: gx = x @ W_ih^T + b_ih, time-major [T, B, D * G * H];
  2. per layer, one recurrence (`recurrence`) over both directions where the
     kernels' plan fits them side by side in one launch, else one a
     direction: a custom VJP whose forward binds rnn_fwd and whose backward
     binds rnn_bwd (our kernels on CUDA, a lax.scan elsewhere);
  3. the directions' outputs concatenated, dropout between layers.
After the backward recurrence the weight gradients are GEMMs in XLA:
dW_hh = sum_t dgh_t^T hprev_t and db_hh = sum dgh (here), dW_ih, db_ih and dx
(autodiff of step 1).

The recurrence, for row b at step t (z = gx_t + W_hh h_{t-1} + b_hh, fp32):
  LSTM: i, f, o = sigmoid(z_i, z_f, z_o), g = tanh(z_g);
        c_t = f * c_{t-1} + i * g, h_t = o * tanh(c_t)
  GRU:  r = sigmoid(gx_r + hh_r), u = sigmoid(gx_z + hh_z),
        n = tanh(gx_n + r * hh_n), h_t = (1 - u) * n + u * h_{t-1},
        hh = W_hh h_{t-1} + b_hh (b_hh's n part inside r * (), as cuDNN and
        PyTorch; Flax's GRUCell is the case b_hh = 0)
  RNN:  h_t = tanh(z) or relu(z)
Row b runs steps t = 0 .. len_b - 1, or with reverse from len_b - 1 down to 0
(each sequence reversed within its own length, as cuDNN's bidirectional
layers over packed sequences); steps t >= len_b give y = 0 and leave the
state alone; len_b = 0 gives the initial state and all-zero y. Lengths are
read on the device (never on the host), clamped to [0, T].

Numerics: the computation dtype is x's (float32, bfloat16, float16; float64
runs the reference): the weights and initial states are cast to it, as a
model in that dtype holds them. Gates and the cell state are fp32 (float64
for float64); the matmul W_hh h_{t-1} takes h_{t-1} rounded to the dtype (y
is stored in the dtype and is exactly the value multiplied) and accumulates
in fp32; GRU's u * h_{t-1} takes the fp32 h_{t-1}.

float32 products are what the peers' are on the same GPU under the same
matmul precision (the `precision` argument, else jax.default_matmul_precision):
HIGHEST ("highest", "float32") is exact fp32, so the recurrence runs the
reference (the kernels' tensor cores take TF32); anything else (None,
"default", "high", "tensorfloat32", "bfloat16") is TF32 in XLA's fp32 dots
and in jax.experimental.rnn's cuDNN LSTM on Ampere and later GPUs (an H200,
jax 0.11: 3e-4 relative error in a dot, 5e-4 in that LSTM, at any batch),
so the kernels run. `precision` also applies to the GEMMs XLA runs (the
input projection, the weight gradients). The Flax layers (nn/recurrent.py)
follow Flax's per-step products, exact fp32 for a batch of one row.

Flat weight layout (cuDNN's, as jax.experimental.rnn's LSTM): for each
pseudo-layer p in order, W_ih^p [G * H, I_p] then W_hh^p [G * H, H]
(row-major), then for each pseudo-layer b_ih^p [G * H] then b_hh^p [G * H];
I_p is I in layer 0 and D * H above. Gates are stacked along the rows in
PyTorch's order (LSTM i, f, g, o; GRU r, z, n), so a PyTorch nn.LSTM/GRU/RNN
state dict maps onto it one array at a time (rnn_weights_from_torch).

The primitives, for one layer over K directions (K = 1, or 2: a
bidirectional layer's forward and reverse recurrences, packed along the
features as the layer's projection and output have them; `reverse` is then
False; the input dtype is gx's; c0, c_n, dc_n, dc0 are empty [0] arrays
except for LSTM, dgh_n except for GRU):
  rnn_fwd  gx [T, B, K*G*H], w_hh [K*G*H, H], b_hh [K*G*H], h0 [B, K*H],
           c0 [B, K*H], seq_lengths [B] int32
           -> y [T, B, K*H], h_n [B, K*H], c_n [B, K*H],
              states [T, B, S, K*H] fp32
  rnn_bwd  dy [T, B, K*H], dh_n [B, K*H], dc_n [B, K*H], w_hh, h0, c0,
           seq_lengths, states -> dgx [T, B, K*G*H] fp32,
           dgh_n [T, B, K*H] fp32, dh0 [B, K*H] fp32, dc0 [B, K*H] fp32
`states` are the residuals the backward reads, per valid step (zeros at
padded steps): LSTM S = 5 (i, f, g, o, c_t); GRU S = 5 (r, u, n, hh_n, h_t);
RNN S = 1 (h_t). dgh_n is the gradient with respect to hh's n slot.
"""

from __future__ import annotations

import functools
import math
import numbers
import re
from typing import Any

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from jax_dnn._src import checks
from jax_dnn._src import mesh_types
from jax_dnn._src import plans
from jax_dnn._src import sharding
from jax_dnn._src.batching import (NOT_MAPPED, batch_size, merge_leading, move_to_front,
                                   split_leading)
from jax_dnn._src.derivatives import custom_vjp
from jax_dnn._src.primitive import ShapedArray, define_primitive

# The kernels' `kind` attribute.
LSTM, GRU, RNN_TANH, RNN_RELU = 0, 1, 2, 3
KIND_NAMES = {LSTM: "lstm", GRU: "gru", RNN_TANH: "rnn_tanh", RNN_RELU: "rnn_relu"}
GATES = {LSTM: 4, GRU: 3, RNN_TANH: 1, RNN_RELU: 1}
SLOTS = {LSTM: 5, GRU: 5, RNN_TANH: 1, RNN_RELU: 1}

_F32 = jnp.float32


def acc_dtype(dtype):
  """The dtype of the gates, states and sums for inputs of `dtype`: float32,
  or float64 for float64 inputs."""
  return jnp.promote_types(dtype, _F32)


def empty(dtype):
  return jnp.zeros((0,), dtype)


def _dot_precision(exact):
  return lax.Precision.HIGHEST if exact else None


# --- references (pure JAX; what non-CUDA platforms run) ----------------------


def _clamp(seq_lengths, steps):
  return jnp.clip(seq_lengths.astype(jnp.int32), 0, steps)


def flip_within_lengths(a, lens):
  """a [T, B, ...] with each row's first len_b steps reversed. A padded step
  t >= len_b maps to T + len_b - 1 - t, again a padded step."""
  steps = a.shape[0]
  idx = (lens[None, :] - 1 - jnp.arange(steps, dtype=jnp.int32)[:, None]) % steps
  idx = jnp.broadcast_to(idx.reshape(idx.shape + (1,) * (a.ndim - 2)), a.shape)
  return jnp.take_along_axis(a, idx, axis=0)


def _in_step_order(reverse, lens):
  """Maps [T, B, ...] between time order and the order a row's steps run in."""
  return (lambda a: flip_within_lengths(a, lens)) if reverse else (lambda a: a)


def _step(kind, gxt, hh, h_prev, c_prev):
  """One step, fp32: gxt = gx_t, hh = W_hh h_{t-1} + b_hh [B, G*H].
  Returns h_t, c_t and the step's state slots."""
  if kind == LSTM:
    zi, zf, zg, zo = jnp.split(gxt + hh, 4, axis=-1)
    i, f, g, o = jax.nn.sigmoid(zi), jax.nn.sigmoid(zf), jnp.tanh(zg), jax.nn.sigmoid(zo)
    c = f * c_prev + i * g
    return o * jnp.tanh(c), c, (i, f, g, o, c)
  if kind == GRU:
    xr, xz, xn = jnp.split(gxt, 3, axis=-1)
    hr, hz, hn = jnp.split(hh, 3, axis=-1)
    r, u = jax.nn.sigmoid(xr + hr), jax.nn.sigmoid(xz + hz)
    n = jnp.tanh(xn + r * hn)
    h = (1.0 - u) * n + u * h_prev
    return h, c_prev, (r, u, n, hn, h)
  z = gxt + hh
  h = jnp.tanh(z) if kind == RNN_TANH else jnp.maximum(z, 0.0)
  return h, c_prev, (h,)


def directions_of(w_hh, kind) -> int:
  """K, the directions packed in a primitive's operands: w_hh [K*G*H, H]."""
  return w_hh.shape[0] // (GATES[kind] * w_hh.shape[1])


def _halves(a, axis=-1):
  """The two directions' parts of a packed operand (w_hh: its rows, axis 0);
  an empty [0] operand is both's."""
  if a.shape == (0,):
    return a, a
  return tuple(jnp.split(a, 2, axis=axis))


def _joined(a, b, axis=-1):
  """The packed operand of two directions' parts (_halves' inverse)."""
  return a if a.shape == (0,) else jnp.concatenate([a, b], axis=axis)


def _fwd_reference(gx, w_hh, b_hh, h0, c0, seq_lengths, *, kind, reverse, exact=False):
  if directions_of(w_hh, kind) == 2:  # the forward direction, then the reverse one
    ops = [_halves(gx), _halves(w_hh, 0), _halves(b_hh), _halves(h0), _halves(c0)]
    outs = [_fwd_reference(*(op[d] for op in ops), seq_lengths, kind=kind, reverse=bool(d),
                           exact=exact) for d in range(2)]
    return tuple(_joined(a, b) for a, b in zip(*outs))
  steps, batch, _ = gx.shape
  dtype, acc = gx.dtype, acc_dtype(gx.dtype)
  lens = _clamp(seq_lengths, steps)
  order = _in_step_order(reverse, lens)
  lstm = kind == LSTM
  bias = b_hh.astype(acc)
  c_init = c0.astype(acc) if lstm else jnp.zeros((batch, 0), acc)

  def body(carry, xs):
    h_prev, c_prev = carry
    gxt, k = xs
    hh = jnp.dot(h_prev.astype(dtype), w_hh.T, precision=_dot_precision(exact),
                 preferred_element_type=acc) + bias
    h, c, slots = _step(kind, gxt.astype(acc), hh, h_prev, c_prev)
    valid = (k < lens)[:, None]
    y = jnp.where(valid, h, 0.0).astype(dtype)
    states = jnp.where(valid[:, None, :], jnp.stack(slots, axis=1), 0.0)
    return (jnp.where(valid, h, h_prev), jnp.where(valid, c, c_prev)), (y, states)

  (h, c), (y, states) = lax.scan(body, (h0.astype(acc), c_init),
                                 (order(gx), jnp.arange(steps, dtype=jnp.int32)))
  c_n = c.astype(dtype) if lstm else empty(dtype)
  return order(y), h.astype(dtype), c_n, order(states)


def _bwd_reference(dy, dh_n, dc_n, w_hh, h0, c0, seq_lengths, states, *, kind, reverse,
                   exact=False):
  if directions_of(w_hh, kind) == 2:
    ops = [_halves(dy), _halves(dh_n), _halves(dc_n), _halves(w_hh, 0), _halves(h0),
           _halves(c0)]
    outs = [_bwd_reference(*(op[d] for op in ops), seq_lengths, _halves(states)[d], kind=kind,
                           reverse=bool(d), exact=exact) for d in range(2)]
    return tuple(_joined(a, b) for a, b in zip(*outs))
  steps, batch, hidden = dy.shape
  acc = acc_dtype(dy.dtype)
  lens = _clamp(seq_lengths, steps)
  order = _in_step_order(reverse, lens)
  w = w_hh.astype(acc)
  matmul = functools.partial(jnp.dot, precision=_dot_precision(exact))
  st = order(states)
  # The state before each step: the previous step's, the initial one first.
  if kind == LSTM:
    prev = jnp.concatenate([c0.astype(acc)[None], st[:-1, :, 4]], axis=0)
  elif kind == GRU:
    prev = jnp.concatenate([h0.astype(acc)[None], st[:-1, :, 4]], axis=0)
  else:
    prev = jnp.zeros((steps, batch, 0), acc)

  def body(carry, xs):
    dh, dc = carry
    dyt, s, p, k = xs
    dh_t = dh + dyt.astype(acc)
    dgh_n = jnp.zeros((batch, 0), acc)
    dc_prev = dc
    if kind == LSTM:
      i, f, g, o, c = (s[:, j] for j in range(5))
      tc = jnp.tanh(c)
      dc_t = dc + dh_t * o * (1.0 - tc * tc)
      dgx = jnp.concatenate([dc_t * g * i * (1.0 - i), dc_t * p * f * (1.0 - f),
                             dc_t * i * (1.0 - g * g), dh_t * tc * o * (1.0 - o)], axis=-1)
      dh_prev = matmul(dgx, w)
      dc_prev = dc_t * f
    elif kind == GRU:
      r, u, n, hn = (s[:, j] for j in range(4))
      dn = dh_t * (1.0 - u) * (1.0 - n * n)
      dr = dn * hn * r * (1.0 - r)
      du = dh_t * (p - n) * u * (1.0 - u)
      dgh_n = dn * r
      dgx = jnp.concatenate([dr, du, dn], axis=-1)
      dh_prev = dh_t * u + matmul(jnp.concatenate([dr, du, dgh_n], axis=-1), w)
    else:
      h = s[:, 0]
      # relu: jax.nn.relu's gradient, where(z > 0, g, 0) (h > 0 exactly
      # where z > 0; a NaN z gives h = NaN and gradient 0).
      dgx = dh_t * (1.0 - h * h) if kind == RNN_TANH else jnp.where(h > 0, dh_t, 0.0)
      dh_prev = matmul(dgx, w)
    valid = (k < lens)[:, None]
    return ((jnp.where(valid, dh_prev, dh), jnp.where(valid, dc_prev, dc)),
            (jnp.where(valid, dgx, 0.0), jnp.where(valid, dgh_n, 0.0)))

  dc_init = dc_n.astype(acc) if kind == LSTM else jnp.zeros((batch, 0), acc)
  (dh0, dc0), (dgx, dgh_n) = lax.scan(
      body, (dh_n.astype(acc), dc_init),
      (order(dy), st, prev, jnp.arange(steps, dtype=jnp.int32)), reverse=True)
  dgh_n = order(dgh_n) if kind == GRU else empty(acc)
  return order(dgx), dgh_n, dh0, dc0 if kind == LSTM else empty(acc)


# --- primitives ---------------------------------------------------------------


def _state_shape(shape, kind):
  """[B, H] for LSTM's cell state, [0] for the kinds that have none."""
  return tuple(shape) if kind == LSTM else (0,)


def _fwd_abstract(gx, w_hh, b_hh, h0, c0, seq_lengths, *, kind, reverse, exact):
  del b_hh, c0, seq_lengths, reverse, exact
  steps, batch, _ = gx.shape
  features = directions_of(w_hh, kind) * w_hh.shape[1]  # K * H
  return (ShapedArray((steps, batch, features), gx.dtype), ShapedArray(h0.shape, gx.dtype),
          ShapedArray(_state_shape(h0.shape, kind), gx.dtype),
          ShapedArray((steps, batch, SLOTS[kind], features), acc_dtype(gx.dtype)))


def _bwd_abstract(dy, dh_n, dc_n, w_hh, h0, c0, seq_lengths, states, *, kind, reverse, exact):
  del dh_n, dc_n, c0, seq_lengths, states, reverse, exact
  steps, batch, hidden = dy.shape
  dgh_n = (steps, batch, hidden) if kind == GRU else (0,)
  acc = acc_dtype(dy.dtype)
  return (ShapedArray((steps, batch, w_hh.shape[0]), acc), ShapedArray(dgh_n, acc),
          ShapedArray(h0.shape, acc), ShapedArray(_state_shape(h0.shape, kind), acc))


def _plan(avals, kind):
  """The kernels' plan for this call (fwd: avals[0] = gx, avals[1] = w_hh;
  bwd: avals[0] = dy, avals[3] = w_hh; gx and dy [T, B, .]), or None where
  the extension has no rnn plans or the sizes are symbolic (jax.export: the
  workspace depends on T and B)."""
  x, w_hh = avals[0], avals[1] if len(avals) == 6 else avals[3]
  hidden = w_hh.shape[1]
  if not plans.is_static(x.shape[0], x.shape[1], hidden):
    return None
  return plan_for(kind, x.dtype, x.shape[0], x.shape[1], hidden, directions_of(w_hh, kind))


def plan_for(kind, dtype, steps, batch, hidden, directions=1):
  """The kernels' plan (plans.rnn_plan), or None where the extension has no
  rnn plans."""
  rnn_plan = getattr(plans, "rnn_plan", None)
  if rnn_plan is None:
    return None
  try:
    return rnn_plan(KIND_NAMES[kind], jnp.dtype(dtype).name, int(steps), int(batch),
                    int(hidden), device=None, directions=int(directions))
  except RuntimeError:  # the extension is not built: no plans
    return None


def _supported(avals, *, kind, reverse, exact):
  """The kernels' plan takes the call and runs it by default (batches past
  the plan's kRnnDefaultMaxBatch run the reference's scan, faster there);
  fp32 at HIGHEST precision (exact fp32 products, which the kernels' TF32
  tensor cores do not give) runs the reference."""
  del reverse
  if exact:
    return False
  plan = _plan(avals, kind)
  return plan is not None and bool(plan.supported) and bool(plan.by_default)


def _ffi_params(avals, *, kind, reverse, exact):
  del exact
  return {"kind": kind, "reverse": int(reverse), "variant": int(_plan(avals, kind).variant)}


def _workspace(avals, *, kind, reverse, exact, backward=False):
  """The kernel's workspace, u8[bytes] ([0] when none): the plan's size."""
  del reverse, exact
  plan = _plan(avals, kind)
  size = plan.bwd_workspace_bytes if backward else plan.fwd_workspace_bytes
  return (ShapedArray((int(size),), jnp.uint8),)


def _fold_seq(x, dim, size):
  """[T, B, ...] with vmap's axis at `dim` -> [T, size * B, ...]."""
  x = jnp.moveaxis(move_to_front(x, dim, size), 0, 1)
  return x.reshape((x.shape[0], x.shape[1] * x.shape[2]) + x.shape[3:])


def _split_seq(x, size):
  return x.reshape((x.shape[0], size, x.shape[1] // size) + x.shape[2:])


def _fold_rows(x, dim, size):
  return merge_leading(move_to_front(x, dim, size))


def _fwd_batch(args, dims, **params):
  kind = params["kind"]
  size = batch_size(args, dims)
  if dims[1] is not NOT_MAPPED or dims[2] is not NOT_MAPPED:
    # Recurrent weights of their own for each vmapped instance: no kernel
    # takes them; XLA's batched scan does.
    fn = functools.partial(_fwd_reference, **params)
    return list(jax.vmap(fn, in_axes=tuple(dims))(*args)), [0, 0, 0, 0]
  gx, w_hh, b_hh, h0, c0, seq_lengths = args
  lstm = kind == LSTM
  c0 = _fold_rows(c0, dims[4], size) if lstm else empty(gx.dtype)
  y, h_n, c_n, states = rnn_fwd_p.bind(
      _fold_seq(gx, dims[0], size), w_hh, b_hh, _fold_rows(h0, dims[3], size), c0,
      _fold_rows(seq_lengths, dims[5], size), **params)
  c_n = split_leading(c_n, size) if lstm else c_n
  return ([_split_seq(y, size), split_leading(h_n, size), c_n, _split_seq(states, size)],
          [1, 0, 0 if lstm else NOT_MAPPED, 1])


def _bwd_batch(args, dims, **params):
  kind = params["kind"]
  size = batch_size(args, dims)
  if dims[3] is not NOT_MAPPED:
    fn = functools.partial(_bwd_reference, **params)
    return list(jax.vmap(fn, in_axes=tuple(dims))(*args)), [0, 0, 0, 0]
  dy, dh_n, dc_n, w_hh, h0, c0, seq_lengths, states = args
  lstm, gru = kind == LSTM, kind == GRU
  if lstm:
    dc_n, c0 = _fold_rows(dc_n, dims[2], size), _fold_rows(c0, dims[5], size)
  else:
    dc_n, c0 = empty(dy.dtype), empty(dy.dtype)
  dgx, dgh_n, dh0, dc0 = rnn_bwd_p.bind(
      _fold_seq(dy, dims[0], size), _fold_rows(dh_n, dims[1], size), dc_n, w_hh,
      _fold_rows(h0, dims[4], size), c0, _fold_rows(seq_lengths, dims[6], size),
      _fold_seq(states, dims[7], size), **params)
  return ([_split_seq(dgx, size), _split_seq(dgh_n, size) if gru else dgh_n,
           split_leading(dh0, size), split_leading(dc0, size) if lstm else dc0],
          [1, 1 if gru else NOT_MAPPED, 0, 0 if lstm else NOT_MAPPED])


_FWD_ROLES = (("seq", "whole", "whole", "rows", "rows", "batch"), ("seq", "rows", "rows", "seq"))
_BWD_ROLES = (("seq", "rows", "rows", "whole", "rows", "rows", "batch", "seq"),
              ("seq", "seq", "rows", "rows"))


def _sharding(operands, results, *, kind, reverse, exact, backward=False):
  """The batch splits (sequences are independent); time, the features and
  the recurrent weights stay whole. Empty [0] operands are their own."""
  del kind, reverse, exact
  b = sharding.RuleBuilder()
  time, batch = b.own(operands[0][0]), b.factor("b", operands[0][1])

  def factors(shape, role):
    if tuple(shape) == (0,):
      return (b.own(0),)
    if role == "seq":
      return (time, batch) + tuple(b.own(s) for s in shape[2:])
    if role == "rows":
      return (batch,) + tuple(b.own(s) for s in shape[1:])
    if role == "batch":
      return (batch,)
    return tuple(b.own(s) for s in shape)

  ops, res = _BWD_ROLES if backward else _FWD_ROLES
  for shape, role in zip(operands, ops):
    b.operand(*factors(shape, role))
  for shape, role in zip(results, res):
    b.result(*factors(shape, role))
  return b.build()


rnn_fwd_p = define_primitive(
    "rnn_fwd",
    abstract_eval=_fwd_abstract,
    batching_rule=_fwd_batch,
    reference=_fwd_reference,
    multiple_results=True,  # (y, h_n, c_n, states)
    ffi_params=_ffi_params,
    supported=_supported,
    workspace=_workspace,
    sharding=_sharding,
)
rnn_bwd_p = define_primitive(
    "rnn_bwd",
    abstract_eval=_bwd_abstract,
    batching_rule=_bwd_batch,
    reference=_bwd_reference,
    multiple_results=True,  # (dgx, dgh_n, dh0, dc0)
    ffi_params=_ffi_params,
    supported=_supported,
    workspace=functools.partial(_workspace, backward=True),
    sharding=functools.partial(_sharding, backward=True),
)


# --- the recurrence op (custom VJP) -----------------------------------------------


def _previous_h(y, h0, lens, reverse):
  """hprev [T, B, H]: the h each step multiplied by W_hh: h0 at a sequence's
  first step, else y at the step before (reverse: the step after)."""
  steps = jnp.arange(y.shape[0], dtype=jnp.int32)[:, None]
  zero = jnp.zeros_like(y[:1])
  if reverse:
    shifted, first = jnp.concatenate([y[1:], zero], axis=0), steps == (lens - 1)[None, :]
  else:
    shifted, first = jnp.concatenate([zero, y[:-1]], axis=0), steps == 0
  return jnp.where(first[..., None], h0[None], shifted)


@functools.partial(custom_vjp, nondiff_argnums=(6, 7, 8))
def _recurrence(gx, w_hh, b_hh, h0, c0, seq_lengths, kind, reverse, exact):
  y, h_n, c_n, _ = rnn_fwd_p.bind(gx, w_hh, b_hh, h0, c0, seq_lengths, kind=kind,
                                  reverse=reverse, exact=exact)
  return y, h_n, c_n


def _recurrence_fwd(gx, w_hh, b_hh, h0, c0, seq_lengths, kind, reverse, exact):
  y, h_n, c_n, states = rnn_fwd_p.bind(gx, w_hh, b_hh, h0, c0, seq_lengths, kind=kind,
                                       reverse=reverse, exact=exact)
  return (y, h_n, c_n), (gx, w_hh, b_hh, h0, c0, seq_lengths, states, y)


def _recurrence_bwd(kind, reverse, exact, res, cts):
  gx, w_hh, b_hh, h0, c0, seq_lengths, states, y = res
  dy, dh_n, dc_n = cts
  dtype = y.dtype
  dgx, dgh_n, dh0, dc0 = rnn_bwd_p.bind(dy.astype(dtype), dh_n.astype(dtype),
                                        dc_n.astype(dtype), w_hh, h0, c0, seq_lengths, states,
                                        kind=kind, reverse=reverse, exact=exact)
  hidden = w_hh.shape[1]
  packed = directions_of(w_hh, kind) == 2
  lens = _clamp(seq_lengths, y.shape[0])
  # Under explicit mesh axes the batch the weight gradient sums over may be
  # split: the sum is typed as W_hh (a direction's rows of it).
  spec = sharding.explicit_spec(w_hh)
  typed = {} if spec is None else {"out_sharding": jax.sharding.PartitionSpec(*spec)}
  parts = _halves if packed else lambda a: (a,)
  dw_hh, db_hh = [], []
  for d, (dgx_d, dgh_n_d, y_d, h0_d) in enumerate(zip(*map(parts, (dgx, dgh_n, y, h0)))):
    dgh = jnp.concatenate([dgx_d[..., :2 * hidden], dgh_n_d], axis=-1) if kind == GRU else dgx_d
    # The weight gradient as one GEMM over all steps, operands in the dtype
    # (tensor cores for bf16/fp16), fp32 accumulation.
    dw_hh.append(jnp.einsum("tbg,tbh->gh", dgh.astype(dtype),
                            _previous_h(y_d, h0_d, lens, reverse or d == 1),
                            precision=_dot_precision(exact),
                            preferred_element_type=acc_dtype(dtype),
                            **typed))
    db_hh.append(jnp.sum(dgh, axis=(0, 1)))
  dw_hh, db_hh = jnp.concatenate(dw_hh, axis=0), jnp.concatenate(db_hh)
  cts = (dgx.astype(dtype), dw_hh.astype(w_hh.dtype), db_hh.astype(b_hh.dtype),
         dh0.astype(h0.dtype), dc0.astype(c0.dtype))
  primals = (gx, w_hh, b_hh, h0, c0)
  return tuple(mesh_types.like_primal(ct, p) for ct, p in zip(cts, primals)) + (None,)


_recurrence.defvjp(_recurrence_fwd, _recurrence_bwd)


def recurrence(gx, w_hh, b_hh, h0, c0, seq_lengths, *, kind: int, reverse: bool,
               precision: Any = None):
  """One layer of the recurrence (module docstring), in gx's dtype, over K
  directions packed along the features (K = 1; or 2, forward then reverse,
  with reverse=False: see `fuses_directions`).

  gx [T, B, K*G*H] (the input projection, b_ih included), w_hh [K*G*H, H],
  b_hh [K*G*H], h0 [B, K*H], c0 [B, K*H] (LSTM; an empty [0] array
  otherwise), all of one float dtype; seq_lengths [B] int32 (clamped to
  [0, T]). precision: lax's, or None for jax.default_matmul_precision: fp32
  at HIGHEST runs the reference (exact fp32 products), any other the TF32
  kernels (module docstring). Returns y [T, B, K*H], h_n [B, K*H], c_n
  [B, K*H] (LSTM; else [0]).
  """
  if directions_of(w_hh, kind) == 2 and reverse:
    raise ValueError("recurrence: reverse must be False with two directions packed (the "
                     "second runs in reverse)")
  if gx.shape[0] == 0:
    return jnp.zeros((0,) + h0.shape, gx.dtype), h0, c0
  asked = checks.matmul_precision(precision, gx.dtype)
  exact = jnp.dtype(gx.dtype) == jnp.float32 and asked in ("highest", None)
  args = mesh_types.same_manual_axes(gx, w_hh, b_hh, h0, c0, seq_lengths)
  return _recurrence(*args, kind, bool(reverse), exact)


def recurrence_pair(forward, backward, seq_lengths, *, kind: int, precision: Any = None):
  """A bidirectional layer's two recurrences as one (`recurrence` over both
  directions packed; see `fuses_directions` for where that pays): forward
  and backward are each a direction's (gx, w_hh, b_hh, h0, c0) as
  `recurrence` takes them, the backward one run in reverse. Returns each
  direction's (y, h_n, c_n)."""
  packed = [_joined(f, b, axis=0 if i == 1 else -1)  # w_hh (i = 1) on its rows
            for i, (f, b) in enumerate(zip(forward, backward))]
  outs = recurrence(*packed, seq_lengths, kind=kind, reverse=False, precision=precision)
  return tuple(zip(*map(_halves, outs)))


def fuses_directions(kind, dtype, steps, batch, hidden) -> bool:
  """Whether a bidirectional layer runs its two directions as one
  recurrence: where the kernels' plan fits both side by side and runs them
  by default: one launch a direction puts the two in series (LSTM B = 16,
  T = 1024, H = 768 bf16 on an H100, forward + backward: 12.75 ms in one
  launch, 20.54 in two). Elsewhere (no plans, shapes past the plan, symbolic
  sizes) one recurrence a direction, the same values."""
  if not plans.is_static(steps, batch, hidden):
    return False
  plan = plan_for(kind, dtype, steps, batch, hidden, directions=2)
  return plan is not None and bool(plan.supported) and bool(plan.by_default)


# --- the flat weight layout -------------------------------------------------------------


def check_sizes(op, input_size, hidden_size, num_layers, bidirectional):
  """The network's shape arguments: ints >= 1 and a bool (a ValueError or
  TypeError naming the argument otherwise)."""
  sizes = tuple(check_positive_int(op, name, v) for name, v in (
      ("input_size", input_size), ("hidden_size", hidden_size), ("num_layers", num_layers)))
  if not isinstance(bidirectional, (bool, np.bool_)):
    raise TypeError(f"{op}: bidirectional must be a bool; got {bidirectional!r}")
  return sizes + (bool(bidirectional),)


def _param_shapes(op, gates, input_size, hidden_size, num_layers, bidirectional):
  """The flat layout's arrays in order (module docstring)."""
  input_size, hidden_size, num_layers, bidirectional = check_sizes(
      op, input_size, hidden_size, num_layers, bidirectional)
  dirs = 2 if bidirectional else 1
  rows = gates * hidden_size
  mats, biases = [], []
  for layer in range(num_layers):
    width = input_size if layer == 0 else dirs * hidden_size
    for _ in range(dirs):
      mats += [(rows, width), (rows, hidden_size)]
      biases += [(rows,), (rows,)]
  return mats + biases


def num_params(gates, input_size, hidden_size, num_layers, bidirectional, *,
               op="num_params") -> int:
  return sum(math.prod(s) for s in _param_shapes(op, gates, input_size, hidden_size,
                                                 num_layers, bidirectional))


def _unpack(gates, weights, input_size, hidden_size, num_layers, bidirectional, *, op):
  """(W_ih, W_hh, b_ih, b_hh), each a dict pseudo-layer -> array."""
  shapes = _param_shapes(op, gates, input_size, hidden_size, num_layers, bidirectional)
  count = sum(math.prod(s) for s in shapes)
  if tuple(np.shape(weights)) != (count,):
    raise ValueError(f"{op}: weights must be the flat vector of shape ({count},) for "
                     f"input_size={input_size}, hidden_size={hidden_size}, "
                     f"num_layers={num_layers}, bidirectional={bool(bidirectional)}; got shape "
                     f"{tuple(np.shape(weights))}")
  pseudo = num_layers * (2 if bidirectional else 1)
  parts, offset = [], 0
  for shape in shapes:
    size = math.prod(shape)
    parts.append(weights[offset:offset + size].reshape(shape))
    offset += size
  mats, biases = parts[:2 * pseudo], parts[2 * pseudo:]
  return ({p: mats[2 * p] for p in range(pseudo)}, {p: mats[2 * p + 1] for p in range(pseudo)},
          {p: biases[2 * p] for p in range(pseudo)}, {p: biases[2 * p + 1] for p in range(pseudo)})


def init_weights(gates, rng, input_size, hidden_size, num_layers, bidirectional, *,
                 op="init_weights"):
  count = num_params(gates, input_size, hidden_size, num_layers, bidirectional, op=op)
  k = np.sqrt(1.0 / hidden_size)
  return jax.random.uniform(rng, (count,), jnp.float32, minval=-k, maxval=k)


def get_num_params_in_lstm(input_size: int, hidden_size: int, num_layers: int,
                           bidirectional: bool) -> int:
  """The flat LSTM weight vector's length (as jax.experimental.rnn's)."""
  return num_params(4, input_size, hidden_size, num_layers, bidirectional,
                    op="get_num_params_in_lstm")


def get_num_params_in_gru(input_size: int, hidden_size: int, num_layers: int,
                          bidirectional: bool) -> int:
  """The flat GRU weight vector's length."""
  return num_params(3, input_size, hidden_size, num_layers, bidirectional,
                    op="get_num_params_in_gru")


def get_num_params_in_rnn(input_size: int, hidden_size: int, num_layers: int,
                          bidirectional: bool) -> int:
  """The flat Elman RNN weight vector's length."""
  return num_params(1, input_size, hidden_size, num_layers, bidirectional,
                    op="get_num_params_in_rnn")


def init_lstm_weight(rng, input_size: int, hidden_size: int, num_layers: int,
                     bidirectional: bool) -> jax.Array:
  """Flat fp32 LSTM weights from U(-k, k), k = sqrt(1 / hidden_size) (PyTorch's)."""
  return init_weights(4, rng, input_size, hidden_size, num_layers, bidirectional,
                      op="init_lstm_weight")


def init_gru_weight(rng, input_size: int, hidden_size: int, num_layers: int,
                    bidirectional: bool) -> jax.Array:
  """Flat fp32 GRU weights from U(-k, k), k = sqrt(1 / hidden_size)."""
  return init_weights(3, rng, input_size, hidden_size, num_layers, bidirectional,
                      op="init_gru_weight")


def init_rnn_weight(rng, input_size: int, hidden_size: int, num_layers: int,
                    bidirectional: bool) -> jax.Array:
  """Flat fp32 Elman RNN weights from U(-k, k), k = sqrt(1 / hidden_size)."""
  return init_weights(1, rng, input_size, hidden_size, num_layers, bidirectional,
                      op="init_rnn_weight")


def unpack_lstm_weights(weights, input_size: int, hidden_size: int, num_layers: int,
                        bidirectional: bool):
  """(W_ih, W_hh, b_ih, b_hh): dicts pseudo-layer -> [4H, I_p], [4H, H], [4H], [4H]."""
  return _unpack(4, weights, input_size, hidden_size, num_layers, bidirectional,
                 op="unpack_lstm_weights")


def unpack_gru_weights(weights, input_size: int, hidden_size: int, num_layers: int,
                       bidirectional: bool):
  """(W_ih, W_hh, b_ih, b_hh): dicts pseudo-layer -> [3H, I_p], [3H, H], [3H], [3H]."""
  return _unpack(3, weights, input_size, hidden_size, num_layers, bidirectional,
                 op="unpack_gru_weights")


def unpack_rnn_weights(weights, input_size: int, hidden_size: int, num_layers: int,
                       bidirectional: bool):
  """(W_ih, W_hh, b_ih, b_hh): dicts pseudo-layer -> [H, I_p], [H, H], [H], [H]."""
  return _unpack(1, weights, input_size, hidden_size, num_layers, bidirectional,
                 op="unpack_rnn_weights")


def _gate_rows(op, name, shape):
  """G * H of a recurrent weight [G * H, H] (G = 4 LSTM, 3 GRU, 1 RNN)."""
  if len(shape) != 2 or shape[1] == 0 or shape[0] not in [g * shape[1] for g in (4, 3, 1)]:
    raise ValueError(f"{op}: {name} must have shape (G * hidden_size, hidden_size) with G = 4 "
                     f"(LSTM), 3 (GRU) or 1 (RNN); got {tuple(shape)}")
  return shape[0]


def pack_rnn_weights(W_ih, W_hh, b_ih, b_hh):  # pylint: disable=invalid-name
  """The flat vector of per-pseudo-layer arrays (dicts p -> array, or
  sequences in pseudo-layer order): the inverse of unpack_*_weights."""
  op = "pack_rnn_weights"
  parts = {"W_ih": W_ih, "W_hh": W_hh, "b_ih": b_ih, "b_hh": b_hh}
  counts = {name: len(d) for name, d in parts.items()}
  if len(set(counts.values())) != 1 or not counts["W_hh"]:
    raise ValueError(f"{op}: W_ih, W_hh, b_ih and b_hh must each hold one array per "
                     f"pseudo-layer, as many in each; got {counts}")
  parts = {name: [d[p] for p in range(len(d))] for name, d in parts.items()}
  rows = _gate_rows(op, "W_hh[0]", np.shape(parts["W_hh"][0]))
  hidden = np.shape(parts["W_hh"][0])[1]
  for p in range(counts["W_hh"]):
    width = np.shape(parts["W_ih"][p])[-1] if np.ndim(parts["W_ih"][p]) == 2 else "I_p"
    want = {"W_ih": (rows, width), "W_hh": (rows, hidden), "b_ih": (rows,), "b_hh": (rows,)}
    for name, shape in want.items():
      if tuple(np.shape(parts[name][p])) != shape:
        raise ValueError(f"{op}: {name}[{p}] must have shape {shape} (G * H = {rows}, "
                         f"H = {hidden}, as W_hh[0]); got {tuple(np.shape(parts[name][p]))}")
  mats = [m for pair in zip(parts["W_ih"], parts["W_hh"]) for m in pair]
  biases = [v for pair in zip(parts["b_ih"], parts["b_hh"]) for v in pair]
  return jnp.concatenate([jnp.ravel(a) for a in mats + biases])


_TORCH_KEY = re.compile(r"(weight|bias)_(ih|hh)_l(\d+)(_reverse)?")


def rnn_weights_from_torch(state_dict) -> np.ndarray:
  """The flat weight vector of a PyTorch nn.LSTM / nn.GRU / nn.RNN state dict.

  state_dict: PyTorch's names (weight_ih_l0, weight_hh_l0, bias_ih_l0,
  bias_hh_l0, ..._reverse) to arrays (NumPy, or anything np.asarray takes:
  `{k: v.numpy() for k, v in module.state_dict().items()}`). PyTorch's gate
  orders are the layout's; bias=False modules (no bias_* at all) give zero
  biases. Every array must have the shape PyTorch's module gives it: a
  ValueError names the first that does not. Returns a NumPy vector in the
  arrays' dtype, for jax_dnn.lstm / gru / rnn.
  """
  op = "rnn_weights_from_torch"
  arrays = {k: np.asarray(v) for k, v in state_dict.items()}
  unknown = sorted(k for k in arrays if not _TORCH_KEY.fullmatch(k))
  if unknown:
    raise ValueError(f"{op}: unexpected keys {unknown} (projections, proj_size > 0, are not "
                     "supported; strip any module prefix)")
  for name in ("weight_ih_l0", "weight_hh_l0"):
    if name not in arrays:
      raise ValueError(f"{op}: no {name} in the state dict")
  rows = _gate_rows(op, "weight_hh_l0", arrays["weight_hh_l0"].shape)
  hidden = arrays["weight_hh_l0"].shape[1]
  if arrays["weight_ih_l0"].ndim != 2:
    raise ValueError(f"{op}: weight_ih_l0 must have shape ({rows}, input_size); got "
                     f"{arrays['weight_ih_l0'].shape}")
  num_layers = 1 + max(int(_TORCH_KEY.fullmatch(k).group(3)) for k in arrays)
  dirs = 2 if "weight_ih_l0_reverse" in arrays else 1
  has_bias = any(k.startswith("bias") for k in arrays)
  dtype = arrays["weight_ih_l0"].dtype

  def get(name, shape):
    if name not in arrays:
      raise ValueError(f"{op}: missing {name}")
    if arrays[name].shape != shape:
      raise ValueError(f"{op}: {name} must have shape {shape} (hidden_size {hidden} and "
                       f"{rows // hidden} gates, as weight_hh_l0); got {arrays[name].shape}")
    return arrays[name]

  mats, biases, used = [], [], set()
  for layer in range(num_layers):
    width = arrays["weight_ih_l0"].shape[1] if layer == 0 else dirs * hidden
    for suffix in ("", "_reverse")[:dirs]:
      for kind, cols in (("ih", width), ("hh", hidden)):
        names = f"weight_{kind}_l{layer}{suffix}", f"bias_{kind}_l{layer}{suffix}"
        mats.append(get(names[0], (rows, cols)))
        biases.append(get(names[1], (rows,)) if has_bias else np.zeros((rows,), dtype))
        used.update(names)
  extra = sorted(set(arrays) - used)
  if extra:
    raise ValueError(f"{op}: unexpected keys {extra} for {num_layers} layers, "
                     f"{'bidirectional' if dirs == 2 else 'one direction'}")
  return np.concatenate([a.ravel().astype(dtype) for a in mats + biases])


def rnn_weights_to_torch(weights, mode: str, input_size: int, hidden_size: int,
                         num_layers: int, bidirectional: bool) -> dict[str, np.ndarray]:
  """A PyTorch state dict (NumPy arrays under PyTorch's names) of a flat
  weight vector; mode "lstm", "gru" or "rnn" (either nonlinearity). Load it
  with `module.load_state_dict({k: torch.from_numpy(v) for k, v in d.items()})`."""
  gates = {"lstm": 4, "gru": 3, "rnn": 1, "rnn_tanh": 1, "rnn_relu": 1}.get(mode)
  if gates is None:
    raise ValueError(f"rnn_weights_to_torch: mode must be 'lstm', 'gru' or 'rnn'; got {mode!r}")
  weights = np.asarray(weights)
  expected = num_params(gates, input_size, hidden_size, num_layers, bidirectional,
                        op="rnn_weights_to_torch")
  if weights.shape != (expected,):
    raise ValueError(f"rnn_weights_to_torch: weights must have shape ({expected},) for this "
                     f"{mode}; got {weights.shape}")
  w_ih, w_hh, b_ih, b_hh = _unpack(gates, weights, input_size, hidden_size, num_layers,
                                   bidirectional, op="rnn_weights_to_torch")
  dirs = 2 if bidirectional else 1
  out = {}
  for p in range(num_layers * dirs):
    suffix = f"l{p // dirs}" + ("_reverse" if p % dirs else "")
    out[f"weight_ih_{suffix}"] = np.array(w_ih[p])
    out[f"weight_hh_{suffix}"] = np.array(w_hh[p])
    out[f"bias_ih_{suffix}"] = np.array(b_ih[p])
    out[f"bias_hh_{suffix}"] = np.array(b_hh[p])
  return out


# --- public API ---------------------------------------------------------------------


def check_positive_int(op, name, v, minimum=1) -> int:
  if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < minimum:
    raise ValueError(f"{op}: {name} must be an int >= {minimum}; got {v!r}")
  return int(v)


def check_dropout(op, dropout) -> float:
  if not isinstance(dropout, numbers.Real) or not 0 <= dropout < 1:
    raise ValueError(f"{op}: dropout must be a probability in [0, 1); got {dropout!r}")
  return float(dropout)


def _check_state(op, name, a, shape):
  checks.check_array(op, name, a)
  if tuple(a.shape) != shape:
    raise ValueError(f"{op}: {name} must have shape (num_directions * num_layers, batch, "
                     f"hidden_size) = {shape}; got {tuple(a.shape)}")
  if not jnp.issubdtype(a.dtype, jnp.floating):
    raise TypeError(f"{op}: {name} must be floating point; got {a.dtype}")


def _check_lengths(op, seq_lengths, batch, steps):
  checks.check_array(op, "seq_lengths", seq_lengths)
  if tuple(seq_lengths.shape) != (batch,):
    raise ValueError(f"{op}: seq_lengths must have shape (batch,) = ({batch},); got "
                     f"{tuple(seq_lengths.shape)}")
  if not jnp.issubdtype(seq_lengths.dtype, jnp.integer):
    raise TypeError(f"{op}: seq_lengths must be integers (int32); got {seq_lengths.dtype}")
  # Host (NumPy) lengths are checked here; device arrays are never read on
  # the host (no synchronization): the ops clamp them to [0, T].
  if isinstance(seq_lengths, np.ndarray) and seq_lengths.size and (
      seq_lengths.min() < 0 or seq_lengths.max() > steps):
    raise ValueError(f"{op}: seq_lengths must lie in [0, T] = [0, {steps}]; got values in "
                     f"[{seq_lengths.min()}, {seq_lengths.max()}]")


def run_layers(op, kind, x, h_0, c_0, weights, seq_lengths, input_size, hidden_size,
               num_layers, bidirectional, precision, between_layers):
  """The multi-layer, multi-direction network (module docstring's path).
  between_layers(layer, inputs) gives layer `layer`'s inputs (dropout)."""
  input_size, hidden_size, num_layers, bidirectional = check_sizes(
      op, input_size, hidden_size, num_layers, bidirectional)
  checks.check_array(op, "x", x)
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise TypeError(f"{op}: x has dtype {x.dtype}; supported: floating point (float32, "
                    "bfloat16, float16 on the kernels; float64 on the reference)")
  if x.ndim != 3 or x.shape[2] != input_size:
    raise ValueError(f"{op}: x must have shape (batch, seq_len, input_size={input_size}); got "
                     f"{tuple(x.shape)}")
  batch, steps = x.shape[0], x.shape[1]
  dirs = 2 if bidirectional else 1
  state_shape = (dirs * num_layers, batch, hidden_size)
  _check_state(op, "h_0", h_0, state_shape)
  if kind == LSTM:
    _check_state(op, "c_0", c_0, state_shape)
  checks.check_array(op, "weights", weights)
  w_ih, w_hh, b_ih, b_hh = _unpack(GATES[kind], weights, input_size, hidden_size, num_layers,
                                   bidirectional, op=op)
  if not jnp.issubdtype(weights.dtype, jnp.floating):
    raise TypeError(f"{op}: weights must be floating point; got {weights.dtype}")
  _check_lengths(op, seq_lengths, batch, steps)

  dtype = x.dtype
  rows = GATES[kind] * hidden_size
  lens = jnp.asarray(seq_lengths).astype(jnp.int32)
  inputs = jnp.swapaxes(x, 0, 1)  # [T, B, I]
  h_n, c_n = [], []
  for layer in range(num_layers):
    if layer:
      inputs = between_layers(layer, inputs)
    ps = [layer * dirs + d for d in range(dirs)]
    # Both directions' projections as one GEMM.
    w = jnp.concatenate([w_ih[p] for p in ps], axis=0).astype(dtype)
    bias = jnp.concatenate([b_ih[p] for p in ps]).astype(acc_dtype(dtype))
    gx = (jnp.einsum("tbi,gi->tbg", inputs, w, precision=precision,
                     preferred_element_type=acc_dtype(dtype)) + bias).astype(dtype)
    ops = [(gx[..., d * rows:(d + 1) * rows], w_hh[p].astype(dtype), b_hh[p].astype(dtype),
            h_0[p].astype(dtype), c_0[p].astype(dtype) if kind == LSTM else empty(dtype))
           for d, p in enumerate(ps)]
    if dirs == 2 and fuses_directions(kind, dtype, steps, batch, hidden_size):
      results = recurrence_pair(*ops, lens, kind=kind, precision=precision)
    else:
      results = [recurrence(*op, lens, kind=kind, reverse=bool(d), precision=precision)
                 for d, op in enumerate(ops)]
    outs = []
    for y, h, c in results:
      outs.append(y)
      h_n.append(h)
      c_n.append(c)
    inputs = outs[0] if dirs == 1 else jnp.concatenate(outs, axis=-1)
  y = jnp.swapaxes(inputs, 0, 1)
  h_n = jnp.stack(h_n).astype(h_0.dtype)
  if kind == LSTM:
    return y, h_n, jnp.stack(c_n).astype(c_0.dtype)
  return y, h_n


def _dropout_between_layers(op, dropout, dropout_rng):
  rate = check_dropout(op, dropout)
  if rate == 0.0:
    return lambda layer, inputs: inputs
  if dropout_rng is None:
    raise ValueError(f"{op}: dropout={dropout} needs dropout_rng (a PRNG key) for its masks; "
                     "pass dropout=0.0 for inference")

  def apply(layer, inputs):
    keep = jax.random.bernoulli(jax.random.fold_in(dropout_rng, layer), 1.0 - rate,
                                inputs.shape)
    return jnp.where(keep, inputs / jnp.asarray(1.0 - rate, inputs.dtype), 0).astype(inputs.dtype)

  return apply


def lstm(x: jax.Array, h_0: jax.Array, c_0: jax.Array, weights: jax.Array,
         seq_lengths: jax.Array, input_size: int, hidden_size: int, num_layers: int,
         dropout: float, bidirectional: bool, precision: Any = None, *,
         dropout_rng: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
  """LSTM over batch-major sequences, as jax.experimental.rnn.lstm.

  Args:
    x: [B, T, input_size], float32, bfloat16 or float16 (the computation's
      dtype; float64, under jax_enable_x64, runs the reference).
    h_0, c_0: [D * num_layers, B, hidden_size], pseudo-layers in order
      (forward 0, reverse 0, forward 1, ...).
    weights: the flat vector (module docstring's layout; init_lstm_weight,
      rnn_weights_from_torch).
    seq_lengths: [B] int32, read on the device; each row's steps beyond its
      length give zero outputs, a reverse direction runs each sequence
      backwards within its length.
    input_size, hidden_size, num_layers, bidirectional: the network's shape.
    dropout: the probability of dropping each input of layers 1 .. L - 1
      (the outputs of the layers below), as cuDNN and PyTorch; > 0 needs
      dropout_rng.
    precision: of the fp32 products, as lax's (None: jax.default_matmul_precision):
      HIGHEST exact fp32, any other TF32 on the GPU (module docstring).
    dropout_rng: the PRNG key of the dropout masks (keyword only).
  Returns y [B, T, D * hidden_size] in x's dtype, h_n and c_n
  [D * num_layers, B, hidden_size] in h_0's and c_0's dtypes.
  """
  between = _dropout_between_layers("lstm", dropout, dropout_rng)
  return run_layers("lstm", LSTM, x, h_0, c_0, weights, seq_lengths, input_size, hidden_size,
                    num_layers, bidirectional, precision, between)


def gru(x: jax.Array, h_0: jax.Array, weights: jax.Array, seq_lengths: jax.Array,
        input_size: int, hidden_size: int, num_layers: int, dropout: float,
        bidirectional: bool, precision: Any = None, *,
        dropout_rng: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
  """GRU over batch-major sequences, in lstm's form (no cell state), with
  cuDNN's and PyTorch's gates: r = sigmoid(W_ir x + b_ir + W_hr h + b_hr),
  z likewise, n = tanh(W_in x + b_in + r * (W_hn h + b_hn)),
  h' = (1 - z) * n + z * h. Weights: the flat layout of init_gru_weight.
  Returns y [B, T, D * hidden_size] and h_n [D * num_layers, B, hidden_size].
  """
  between = _dropout_between_layers("gru", dropout, dropout_rng)
  return run_layers("gru", GRU, x, h_0, None, weights, seq_lengths, input_size, hidden_size,
                    num_layers, bidirectional, precision, between)


def rnn(x: jax.Array, h_0: jax.Array, weights: jax.Array, seq_lengths: jax.Array,
        input_size: int, hidden_size: int, num_layers: int, dropout: float,
        bidirectional: bool, precision: Any = None, *, nonlinearity: str = "tanh",
        dropout_rng: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
  """Elman RNN, h' = nonlinearity(W_ih x + b_ih + W_hh h + b_hh), in lstm's
  form (no cell state); nonlinearity "tanh" or "relu" (PyTorch's nn.RNN).
  Weights: the flat layout of init_rnn_weight. Returns y [B, T, D * H] and
  h_n [D * num_layers, B, H]."""
  kinds = {"tanh": RNN_TANH, "relu": RNN_RELU}
  if nonlinearity not in kinds:
    raise ValueError(f"rnn: nonlinearity must be 'tanh' or 'relu'; got {nonlinearity!r}")
  between = _dropout_between_layers("rnn", dropout, dropout_rng)
  return run_layers("rnn", kinds[nonlinearity], x, h_0, None, weights, seq_lengths,
                    input_size, hidden_size, num_layers, bidirectional, precision, between)
