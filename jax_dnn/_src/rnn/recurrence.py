"""One layer's recurrence over one or two directions; letters as in
__init__.py.

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
from typing import Any

import jax
from jax import lax
import jax.numpy as jnp

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
