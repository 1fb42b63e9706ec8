"""The public recurrent ops (lstm, gru, rnn) over the flat weights
(weights.py) and one recurrence a layer (recurrence.py); letters as in
__init__.py.

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
"""

from __future__ import annotations

import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_dnn._src import checks
from jax_dnn._src.rnn.recurrence import (GATES, GRU, LSTM, RNN_RELU, RNN_TANH, acc_dtype, empty,
                                         fuses_directions, recurrence, recurrence_pair)
from jax_dnn._src.rnn.weights import check_sizes, unpack

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
  w_ih, w_hh, b_ih, b_hh = unpack(GATES[kind], weights, input_size, hidden_size, num_layers,
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
