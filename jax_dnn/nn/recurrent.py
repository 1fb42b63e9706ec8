"""Recurrent layers over jax_dnn's recurrence op (jax_dnn/_src/rnn/).

RNN and Bidirectional are drop-in for flax.nnx.RNN / flax.nnx.Bidirectional:
the same constructors, call arguments, parameter trees and results. When the
cell is an nnx.LSTMCell, nnx.OptimizedLSTMCell, nnx.GRUCell or nnx.SimpleCell
(relu or tanh, residual=False) with its default gate and activation functions
and promote_dtype, in float32, bfloat16 or float16, the whole sequence runs
as one recurrence, with the cell's own parameters: its input kernels give the
input projection (one GEMM for every step), its recurrent kernel the
transposed W_hh (computed in the call; the parameter tree is the cell's).
Any other cell runs as Flax runs it (nnx.scan over the cell). Bidirectional
runs its two directions as one recurrence (one launch) where both are such
RNNs of one kind, dtype and width and the kernels' plan fits them together.

fp32 products follow Flax's on the same device: TF32 (the kernels) where
XLA runs Flax's per-step products as TF32 (two or more rows under JAX's
default matmul precision on Ampere and later GPUs), exact fp32 (the
reference) where it runs them exact (one row at any precision, as XLA
computes a vector-matrix product; "highest" or "float32").

Where Flax's results are defined they are matched: the outputs at each
sequence's valid steps and the carry at its last valid step. Two things
differ where seq_lengths are given: outputs at padded steps are zeros (Flax
continues the recurrence over the padding, which no caller should read), and
a sequence of length 0 returns the initial carry (Flax returns the carry
after the last padded step).

LSTM and GRU are multi-layer networks in PyTorch's form (num_layers,
bidirectional, dropout between layers) with one flat weight parameter in
cuDNN's layout, which jax_dnn.rnn_weights_from_torch fills from a PyTorch
nn.LSTM / nn.GRU state dict.
"""

from __future__ import annotations

import math
from typing import Any

from flax import nnx
from flax.nnx import rnglib
from flax.nnx.nn import dtypes as nn_dtypes
import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from jax_dnn._src import checks
from jax_dnn._src.rnn import layers as rnn_layers
from jax_dnn._src.rnn import recurrence as rec
from jax_dnn._src.rnn import weights as rnn_weights

_F32 = jnp.float32


def _default_fns(cell) -> bool:
  return (cell.promote_dtype is nn_dtypes.promote_dtype
          and getattr(cell, "gate_fn", jax.nn.sigmoid) is jax.nn.sigmoid
          and cell.activation_fn is jnp.tanh)


def _cell_parts(cell):
  """(kind, input kernel [I, G*H], input bias [G*H] or None, recurrent kernel
  [H, G*H], recurrent bias or None) of a cell the recurrence takes; None for
  any other cell."""
  kind = type(cell)
  if kind is nnx.OptimizedLSTMCell and _default_fns(cell):
    return (rec.LSTM, cell.dense_i.kernel[...], None, cell.dense_h.kernel[...],
            cell.dense_h.bias[...])
  if kind is nnx.LSTMCell and _default_fns(cell):
    dense_i = (cell.ii, cell.if_, cell.ig, cell.io)
    dense_h = (cell.hi, cell.hf, cell.hg, cell.ho)
    cat = lambda layers, name: jnp.concatenate([getattr(d, name)[...] for d in layers], axis=-1)
    return rec.LSTM, cat(dense_i, "kernel"), None, cat(dense_h, "kernel"), cat(dense_h, "bias")
  if kind is nnx.GRUCell and _default_fns(cell):
    return (rec.GRU, cell.dense_i.kernel[...], cell.dense_i.bias[...],
            cell.dense_h.kernel[...], None)
  if (kind is nnx.SimpleCell and not cell.residual
      and cell.promote_dtype is nn_dtypes.promote_dtype):
    act = {jnp.tanh: rec.RNN_TANH, jax.nn.relu: rec.RNN_RELU}.get(cell.activation_fn)
    if act is not None:
      return act, cell.dense_i.kernel[...], cell.dense_i.bias[...], cell.dense_h.kernel[...], None
  return None


def _flax_rngs(module, rngs):
  """The rngs Flax's RNN hands to initialize_carry (the same stream updates)."""
  if rngs is None:
    rngs = module.rngs
  if isinstance(rngs, rnglib.Rngs):
    rngs = rngs.carry.fork()
  return rngs


def _lengths(seq_lengths, batch_dims, *, reads_them):
  """seq_lengths as the op's [B] int32 lengths: of the inputs' batch shape
  (or broadcast to it). Flax indexes with them where a reverse direction
  flips each sequence or the carry is returned, raising a TypeError for
  non-integers there, and ignores them elsewhere: so do these checks."""
  lens = jnp.asarray(seq_lengths)
  if reads_them and not jnp.issubdtype(lens.dtype, jnp.integer):
    raise TypeError(f"RNN: seq_lengths must be integers (they index the steps of a reverse "
                    f"direction and the returned carry); got {lens.dtype}")
  try:
    fits = np.broadcast_shapes(lens.shape, batch_dims) == tuple(batch_dims)
  except ValueError:
    fits = False
  if not fits:
    raise ValueError(f"RNN: seq_lengths must have the inputs' batch shape {tuple(batch_dims)} "
                     f"(one length a sequence); got shape {lens.shape}")
  return jnp.broadcast_to(lens, batch_dims).astype(jnp.int32).reshape(-1)


def _check_carry(cell, initial_carry, batch_dims, hidden):
  """initial_carry against the cell's: an LSTM's (c, h), else h, each
  [*batch, H]. The wrong structure is a ValueError and the wrong shape a
  TypeError, the types Flax's cells raise for them (unpacking the carry;
  lax's shape checks)."""
  want = tuple(batch_dims) + (hidden,)
  lstm = isinstance(cell, (nnx.LSTMCell, nnx.OptimizedLSTMCell))
  parts = tuple(initial_carry) if lstm and isinstance(initial_carry, (tuple, list)) else (
      initial_carry,)
  expected = f"(c, h), each of shape {want}" if lstm else f"an array of shape {want}"
  shapes = jax.tree.map(lambda a: tuple(np.shape(a)), initial_carry)
  got = (f"{len(initial_carry)} arrays of shapes {shapes}"
         if isinstance(initial_carry, (tuple, list)) else f"an array of shape {shapes}")
  if len(parts) != (2 if lstm else 1) or not all(hasattr(a, "shape") for a in parts):
    raise ValueError(f"RNN: initial_carry must be {expected}, a {type(cell).__name__}'s "
                     f"carry; got {got}")
  if any(tuple(a.shape) != want for a in parts):
    raise TypeError(f"RNN: initial_carry must be {expected}, a {type(cell).__name__}'s carry "
                    f"(the inputs' batch shape, hidden_features); got {got}")


def _prepare(module, inputs, *, initial_carry, seq_lengths, return_carry, time_major,
             reverse, keep_order, rngs):
  """flax.nnx.RNN.__call__ up to the recurrence op: (its operands as a dict,
  finish(y, h_n, c_n) -> the call's result), or NotImplemented where the
  cell or the dtypes are not the op's."""
  cell = module.cell
  parts = _cell_parts(cell)
  if parts is None or not hasattr(inputs, "ndim") or inputs.ndim < 2:
    return NotImplemented
  kind, k_i, b_i, k_h, b_h = parts
  lstm = kind == rec.LSTM
  params = [p for p in (k_i, b_i, k_h, b_h) if p is not None]
  carry_dtypes = ([c.dtype for c in jax.tree.leaves(initial_carry)] if initial_carry is not None
                  else [cell.param_dtype])
  dtype = cell.dtype or jnp.result_type(inputs, *params, *carry_dtypes)
  if not checks.kernel_dtype(dtype):
    return NotImplemented
  # Flax's outputs: the cell's dtype, promoted with the carry's through
  # the state update (LSTM's c, GRU's blend with h); SimpleCell's stay in it.
  out_dtype = dtype if kind in (rec.RNN_TANH, rec.RNN_RELU) else jnp.result_type(
      dtype, *carry_dtypes)

  return_carry = module.return_carry if return_carry is None else return_carry
  time_major = module.time_major if time_major is None else time_major
  reverse = module.reverse if reverse is None else reverse
  keep_order = module.keep_order if keep_order is None else keep_order
  time_axis = 0 if time_major else inputs.ndim - 2
  rngs = _flax_rngs(module, rngs)
  if initial_carry is None:
    initial_carry = cell.initialize_carry(
        inputs.shape[:time_axis] + inputs.shape[time_axis + 1:], rngs)

  x = jnp.moveaxis(inputs, time_axis, 0)  # [T, *batch, I]
  steps, batch_dims, hidden = x.shape[0], x.shape[1:-1], k_h.shape[0]
  batch = math.prod(batch_dims)
  x = x.reshape(steps, batch, x.shape[-1])
  if seq_lengths is None:
    lens = jnp.full((batch,), steps, jnp.int32)
  else:
    lens = _lengths(seq_lengths, batch_dims, reads_them=reverse or return_carry)
  _check_carry(cell, initial_carry, batch_dims, hidden)
  # Flax's cell multiplies one step's B rows at a time. With one row XLA
  # computes those fp32 products as vector-matrix ones, exact whatever the
  # precision (an H200, jax 0.11: to H = 1024 at least), and from B = 2 on
  # as TF32 under JAX's default: with one row the input projection and the
  # recurrence run exact fp32 too (jax_dnn/_src/rnn/layers.py's docstring gives the rule).
  exact = batch == 1 and jnp.dtype(dtype) == jnp.float32
  precision = lax.Precision.HIGHEST if exact else None
  gx = jnp.einsum("tbi,ig->tbg", x.astype(dtype), k_i.astype(dtype), precision=precision,
                  preferred_element_type=_F32)
  if b_i is not None:
    gx = gx + b_i.astype(_F32)
  rows = k_h.shape[1]
  b_hh = b_h.astype(dtype) if b_h is not None else jnp.zeros((rows,), dtype)
  flat = lambda a: a.reshape(batch, hidden).astype(dtype)
  c0, h0 = (flat(initial_carry[0]), flat(initial_carry[1])) if lstm else (
      rec.empty(dtype), flat(initial_carry))
  operands = dict(gx=gx.astype(dtype), w_hh=k_h.T.astype(dtype), b_hh=b_hh, h0=h0, c0=c0,
                  seq_lengths=lens, kind=kind, reverse=bool(reverse), precision=precision)

  def finish(y, h_n, c_n):
    if reverse and not keep_order:  # Flax's outputs then run in each sequence's step order
      y = rec.flip_within_lengths(y, jnp.clip(lens, 0, steps))
    y = jnp.moveaxis(y.reshape((steps,) + batch_dims + (hidden,)), 0, time_axis).astype(out_dtype)
    if not return_carry:
      return y
    unflat = lambda a: a.reshape(batch_dims + (hidden,)).astype(out_dtype)
    return ((unflat(c_n), unflat(h_n)) if lstm else unflat(h_n)), y

  return operands, finish


def _run(module, inputs, **kwargs):
  call = _prepare(module, inputs, **kwargs)
  if call is NotImplemented:
    return nnx.RNN.__call__(module, inputs, **kwargs)
  operands, finish = call
  return finish(*rec.recurrence(**operands))


def _run_pair(fwd, bwd, inputs, fwd_kwargs, bwd_kwargs):
  """Bidirectional's two directions when both are RNNs: as one recurrence
  (rnn_lib's packed directions) where both run through the op with the same
  kind, dtype and width and the kernels' plan fits them side by side, else
  each as _run does; None when either is another RNNBase."""
  rnns = (nnx.RNN, RNN)
  if not all(type(m) in rnns for m in (fwd, bwd)):  # pylint: disable=unidiomatic-typecheck
    return None
  # The forward's carry is initialized first, as Flax's order draws them.
  calls = [_prepare(m, inputs, **k) for m, k in ((fwd, fwd_kwargs), (bwd, bwd_kwargs))]
  if NotImplemented not in calls:
    (a, finish_a), (b, finish_b) = calls
    steps, batch, _ = a["gx"].shape
    # Both take the same inputs and seq_lengths (Bidirectional passes them).
    same = (a["kind"] == b["kind"] and a["gx"].dtype == b["gx"].dtype
            and a["gx"].shape == b["gx"].shape and a["w_hh"].shape == b["w_hh"].shape)
    if same and rec.fuses_directions(a["kind"], a["gx"].dtype, steps, batch,
                                         a["w_hh"].shape[1]):
      ops = [tuple(c[name] for name in ("gx", "w_hh", "b_hh", "h0", "c0")) for c in (a, b)]
      out_a, out_b = rec.recurrence_pair(*ops, a["seq_lengths"], kind=a["kind"],
                                             precision=a["precision"])
      return [finish_a(*out_a), finish_b(*out_b)]
  results = []
  for module, kwargs, call in zip((fwd, bwd), (fwd_kwargs, bwd_kwargs), calls):
    if call is NotImplemented:
      results.append(nnx.RNN.__call__(module, inputs, **kwargs))
    else:
      operands, finish = call
      results.append(finish(*rec.recurrence(**operands)))
  return results


class RNN(nnx.RNN):
  """flax.nnx.RNN (same arguments) that runs LSTM, GRU and simple cells as
  one jax_dnn recurrence (module docstring)."""

  def __call__(self, inputs, *, initial_carry=None, seq_lengths=None, return_carry=None,
               time_major=None, reverse=None, keep_order=None, rngs=None):
    return _run(self, inputs, initial_carry=initial_carry, seq_lengths=seq_lengths,
                return_carry=return_carry, time_major=time_major, reverse=reverse,
                keep_order=keep_order, rngs=rngs)


def _direction(module, inputs, **kwargs):
  """One direction of Bidirectional: a Flax or jax_dnn RNN through the
  recurrence op where it takes the cell; any other RNNBase as it is."""
  if type(module) in (nnx.RNN, RNN):  # pylint: disable=unidiomatic-typecheck
    return _run(module, inputs, **kwargs)
  return module(inputs, **kwargs)


class Bidirectional(nnx.Bidirectional):
  """flax.nnx.Bidirectional (same arguments): each direction that is an
  nnx.RNN or jax_dnn.nn.RNN over a supported cell runs as one recurrence."""

  def __call__(self, inputs, *, initial_carry=None, rngs=None, seq_lengths=None,
               return_carry=None, time_major=None, reverse=None, keep_order=None):
    del reverse, keep_order  # unused, as in Flax
    time_major = self.time_major if time_major is None else time_major
    return_carry = self.return_carry if return_carry is None else return_carry
    if rngs is None:
      rngs = self.rngs
    if isinstance(rngs, rnglib.Rngs):
      rngs = rngs.carry
    fwd_carry, bwd_carry = initial_carry if initial_carry is not None else (None, None)
    common = dict(rngs=rngs, seq_lengths=seq_lengths, return_carry=True, time_major=time_major)
    fwd_kwargs = dict(common, initial_carry=fwd_carry, reverse=False, keep_order=None)
    bwd_kwargs = dict(common, initial_carry=bwd_carry, reverse=True, keep_order=True)
    pair = _run_pair(self.forward_rnn, self.backward_rnn, inputs, fwd_kwargs, bwd_kwargs)
    if pair is None:
      (carry_fwd, out_fwd), (carry_bwd, out_bwd) = (
          _direction(self.forward_rnn, inputs, **fwd_kwargs),
          _direction(self.backward_rnn, inputs, **bwd_kwargs))
    else:
      (carry_fwd, out_fwd), (carry_bwd, out_bwd) = pair
    outputs = jax.tree.map(self.merge_fn, out_fwd, out_bwd)
    return ((carry_fwd, carry_bwd), outputs) if return_carry else outputs


class _Stack(nnx.Module):
  """A multi-layer network over one flat weight parameter (the layout of jax_dnn/_src/rnn/weights.py)."""

  _KIND = rec.LSTM

  def __init__(self, input_size: int, hidden_size: int, num_layers: int = 1, *,
               bidirectional: bool = False, dropout: float = 0.0, time_major: bool = False,
               dtype: Any = None, param_dtype: Any = jnp.float32, rngs: nnx.Rngs):
    name = type(self).__name__
    gates = rec.GATES[self._KIND]
    for arg, v in (("input_size", input_size), ("hidden_size", hidden_size),
                   ("num_layers", num_layers)):
      checks.check_positive_int(name, arg, v)
    self.dropout = rnn_layers.check_dropout(name, dropout)
    self.input_size, self.hidden_size, self.num_layers = input_size, hidden_size, num_layers
    self.bidirectional, self.time_major = bool(bidirectional), time_major
    self.dtype, self.param_dtype = dtype, param_dtype
    # PyTorch's initialization: U(-k, k), k = 1 / sqrt(hidden_size).
    w = rnn_weights.init_weights(gates, rngs.params(), input_size, hidden_size, num_layers,
                             bidirectional)
    self.weights = nnx.Param(w.astype(param_dtype))
    self.drop = nnx.Dropout(self.dropout, rngs=rngs) if self.dropout > 0 else None

  def _apply(self, x, h_0, c_0, seq_lengths, deterministic, rngs):
    name = type(self).__name__
    checks.check_array(name, "x", x)
    if x.ndim != 3:
      raise ValueError(f"{name}: x must be [batch, time, features] (time_major: [time, "
                       f"batch, features]); got shape {tuple(x.shape)}")
    if self.time_major:
      x = jnp.swapaxes(x, 0, 1)
    weights = self.weights[...]
    dtype = self.dtype or jnp.result_type(x, weights)
    x = x.astype(dtype)
    batch, steps = x.shape[0], x.shape[1]
    state = (2 if self.bidirectional else 1) * self.num_layers, batch, self.hidden_size
    h_0 = jnp.zeros(state, dtype) if h_0 is None else h_0
    if self._KIND == rec.LSTM and c_0 is None:
      c_0 = jnp.zeros(state, dtype)
    lens = jnp.full((batch,), steps, jnp.int32) if seq_lengths is None else seq_lengths

    def between_layers(layer, inputs):
      del layer
      if self.drop is None:
        return inputs
      return self.drop(inputs, deterministic=deterministic, rngs=rngs)

    out = rnn_layers.run_layers(name, self._KIND, x, h_0, c_0, weights, lens, self.input_size,
                         self.hidden_size, self.num_layers, self.bidirectional, None,
                         between_layers)
    y = jnp.swapaxes(out[0], 0, 1) if self.time_major else out[0]
    return (y,) + tuple(out[1:])


class LSTM(_Stack):
  """Multi-layer LSTM as PyTorch's nn.LSTM (gates i, f, g, o), batch-major
  unless time_major.

  Args (constructor): input_size, hidden_size, num_layers; bidirectional;
    dropout (between layers, in training: see nnx.Dropout's train/eval and
    `deterministic`); time_major; dtype (of the computation; default: the
    promoted dtype of x and the weights); param_dtype; rngs ("params" for
    the weights, "dropout" for the masks).
  Parameter: `weights`, the flat vector of jax_dnn.lstm
    (jax_dnn.rnn_weights_from_torch gives it from nn.LSTM's state dict).
  Call: (x [B, T, input_size], initial_state=(h_0, c_0) or None (zeros),
    *, seq_lengths [B] or None, deterministic, rngs) -> (y [B, T, D * H],
    (h_n, c_n) [D * num_layers, B, H]).
  """

  _KIND = rec.LSTM

  def __call__(self, x, initial_state=None, *, seq_lengths=None, deterministic=None,
               rngs=None):
    h_0, c_0 = initial_state if initial_state is not None else (None, None)
    y, h_n, c_n = self._apply(x, h_0, c_0, seq_lengths, deterministic, rngs)
    return y, (h_n, c_n)


class GRU(_Stack):
  """Multi-layer GRU as PyTorch's nn.GRU (gates r, z, n; b_hn inside r * ()),
  in LSTM's form: `weights` is jax_dnn.gru's flat vector; call (x,
  initial_state=h_0 or None, *, seq_lengths, deterministic, rngs) ->
  (y [B, T, D * H], h_n [D * num_layers, B, H])."""

  _KIND = rec.GRU

  def __call__(self, x, initial_state=None, *, seq_lengths=None, deterministic=None,
               rngs=None):
    return self._apply(x, initial_state, None, seq_lengths, deterministic, rngs)
