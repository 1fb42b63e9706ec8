"""The networks' weights; letters as in __init__.py.

Flat weight layout (cuDNN's, as jax.experimental.rnn's LSTM): for each
pseudo-layer p in order, W_ih^p [G * H, I_p] then W_hh^p [G * H, H]
(row-major), then for each pseudo-layer b_ih^p [G * H] then b_hh^p [G * H];
I_p is I in layer 0 and D * H above. Gates are stacked along the rows in
PyTorch's order (LSTM i, f, g, o; GRU r, z, n), so a PyTorch nn.LSTM/GRU/RNN
state dict maps onto it one array at a time (rnn_weights_from_torch).
"""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import numpy as np

from jax_dnn._src.checks import check_positive_int

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


def unpack(gates, weights, input_size, hidden_size, num_layers, bidirectional, *, op):
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
  return unpack(4, weights, input_size, hidden_size, num_layers, bidirectional,
                 op="unpack_lstm_weights")


def unpack_gru_weights(weights, input_size: int, hidden_size: int, num_layers: int,
                       bidirectional: bool):
  """(W_ih, W_hh, b_ih, b_hh): dicts pseudo-layer -> [3H, I_p], [3H, H], [3H], [3H]."""
  return unpack(3, weights, input_size, hidden_size, num_layers, bidirectional,
                 op="unpack_gru_weights")


def unpack_rnn_weights(weights, input_size: int, hidden_size: int, num_layers: int,
                       bidirectional: bool):
  """(W_ih, W_hh, b_ih, b_hh): dicts pseudo-layer -> [H, I_p], [H, H], [H], [H]."""
  return unpack(1, weights, input_size, hidden_size, num_layers, bidirectional,
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
  w_ih, w_hh, b_ih, b_hh = unpack(gates, weights, input_size, hidden_size, num_layers,
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
