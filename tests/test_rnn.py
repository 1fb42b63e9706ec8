"""lstm, gru, rnn and the recurrent layers: against jax.experimental.rnn's
reference, an independent per-step reference written here, and Flax's RNN /
Bidirectional; transforms, the CUDA lowering, bad inputs; GPU cases on the
kernels (marker gpu) under docs/design.md's tolerance rule."""

from __future__ import annotations

import functools

from flax import nnx
import jax
from jax.experimental import rnn as jax_rnn
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jax.test_util import check_grads
import numpy as np
import pytest

from helpers import DTYPES, assert_rule, check_fwd_bwd, cuda_hlo, f64, x64
import jax_dnn
from jax_dnn import nn as jnn
from jax_dnn._src import extension
from jax_dnn._src import plans
from jax_dnn._src.rnn import recurrence as rec
from jax_dnn._src.rnn import weights as rnn_weights

GATES = {"lstm": 4, "gru": 3, "rnn_tanh": 1, "rnn_relu": 1}
KINDS = {"lstm": rec.LSTM, "gru": rec.GRU, "rnn_tanh": rec.RNN_TANH,
         "rnn_relu": rec.RNN_RELU}


def randn(key, shape, dtype, scale=1.0):
  """Random normal data rounded to dtype, from NumPy (no compilation for each
  new shape, as jax.random would need)."""
  x = scale * np.random.default_rng(key).standard_normal(shape, np.float32)
  return jnp.asarray(x.astype(jnp.dtype(dtype)))


# --- an independent reference: PyTorch's equations, one step at a time -------------


def _naive(mode, x, h_0, c_0, weights, lens, input_size, hidden_size, num_layers,
           bidirectional):
  """PyTorch's nn.LSTM / GRU / RNN over batch-major x, a scan over t in the
  inputs' dtype: a row's steps t >= len are skipped (state kept, output 0),
  and the reverse direction scans t = T - 1 down to 0, i.e. from each row's
  last valid step. Weights are read off the flat vector here."""
  g, h = GATES[mode], hidden_size
  dirs = 2 if bidirectional else 1
  sizes, offset, mats = [], 0, []
  for layer in range(num_layers):
    width = input_size if layer == 0 else dirs * h
    for _ in range(dirs):
      sizes += [(g * h, width), (g * h, h)]
  for shape in sizes + [(g * h,)] * (2 * num_layers * dirs):
    n = int(np.prod(shape))
    mats.append(weights[offset:offset + n].reshape(shape))
    offset += n
  assert offset == weights.shape[0]
  w, b = mats[:len(sizes)], mats[len(sizes):]
  sig = jax.nn.sigmoid
  steps = x.shape[1]
  inputs, h_n, c_n = x, [], []
  for layer in range(num_layers):
    outs = []
    for d in range(dirs):
      p = layer * dirs + d
      w_ih, w_hh, b_ih, b_hh = w[2 * p], w[2 * p + 1], b[2 * p], b[2 * p + 1]
      def step(carry, xs, w_ih=w_ih, w_hh=w_hh, b_ih=b_ih, b_hh=b_hh):
        hs, cs = carry
        xt, t = xs
        valid = (t < lens)[:, None]
        zi = xt @ w_ih.T + b_ih
        zh = hs @ w_hh.T + b_hh
        if mode == "lstm":
          i, f, gg, o = jnp.split(zi + zh, 4, axis=-1)
          c_new = sig(f) * cs + sig(i) * jnp.tanh(gg)
          h_new = sig(o) * jnp.tanh(c_new)
          cs = jnp.where(valid, c_new, cs)
        elif mode == "gru":
          r = sig(zi[:, :h] + zh[:, :h])
          u = sig(zi[:, h:2 * h] + zh[:, h:2 * h])
          n = jnp.tanh(zi[:, 2 * h:] + r * zh[:, 2 * h:])
          h_new = (1 - u) * n + u * hs
        else:
          h_new = jnp.tanh(zi + zh) if mode == "rnn_tanh" else jnp.maximum(zi + zh, 0)
        return (jnp.where(valid, h_new, hs), cs), jnp.where(valid, h_new, 0).astype(x.dtype)

      c_init = c_0[p] if mode == "lstm" else jnp.zeros((), x.dtype)
      (hs, cs), ys = jax.lax.scan(step, (h_0[p], c_init),
                                  (jnp.swapaxes(inputs, 0, 1), jnp.arange(steps)),
                                  reverse=d == 1)
      outs.append(jnp.swapaxes(ys, 0, 1))
      h_n.append(hs)
      c_n.append(cs)
    inputs = jnp.concatenate(outs, axis=-1)
  if mode == "lstm":
    return inputs, jnp.stack(h_n), jnp.stack(c_n)
  return inputs, jnp.stack(h_n)


def _ours(mode, *args):
  """jax_dnn's op of `mode` with _naive's signature."""
  x, h_0, c_0, weights, lens, input_size, hidden_size, num_layers, bidirectional = args
  static = (input_size, hidden_size, num_layers, 0.0, bidirectional)
  if mode == "lstm":
    return jax_dnn.lstm(x, h_0, c_0, weights, lens, *static)
  if mode == "gru":
    return jax_dnn.gru(x, h_0, weights, lens, *static)
  return jax_dnn.rnn(x, h_0, weights, lens, *static, nonlinearity=mode.removeprefix("rnn_"))


def _problem(mode, batch=3, steps=5, inputs=3, hidden=4, layers=1, bidirectional=False,
             dtype=jnp.float32, key=0):
  dirs = 2 if bidirectional else 1
  count = rnn_weights.num_params(GATES[mode], inputs, hidden, layers, bidirectional)
  x = randn(key, (batch, steps, inputs), dtype)
  h_0 = randn(key + 1, (dirs * layers, batch, hidden), dtype, scale=0.5)
  c_0 = randn(key + 2, (dirs * layers, batch, hidden), dtype, scale=0.5)
  w = randn(key + 3, (count,), dtype, scale=0.5)
  return x, h_0, c_0, w


def _lens(batch, steps):
  """Ragged lengths: full, short, 1, and (from 4 rows on) 0."""
  return jnp.asarray([steps, 2, 1, 0, steps - 1, 3][:batch], jnp.int32)


def _sum_squares(outs):
  return sum(jnp.sum(jnp.square(o.astype(jnp.float32))) for o in jax.tree.leaves(outs))


# --- lstm against jax.experimental.rnn -----------------------------------------------


def test_lstm_matches_jax_experimental_reference():
  """Two bidirectional layers: values and gradients (x, h_0, c_0, weights)
  against lstm_ref, ragged lengths >= 1 (lstm_ref reads the carry at
  length - 1)."""
  inputs, hidden, batch, steps, layers, bidirectional = 3, 4, 3, 5, 2, True
  x, h_0, c_0, w = _problem("lstm", batch, steps, inputs, hidden, layers, bidirectional)
  w = jax_rnn.init_lstm_weight(jax.random.key(3), inputs, hidden, layers, bidirectional)
  lens = jnp.asarray([5, 2, 1], jnp.int32)
  static = (inputs, hidden, layers, 0.0, bidirectional)

  def ours(x, h_0, c_0, w):
    return jax_dnn.lstm(x, h_0, c_0, w, lens, *static)

  def ref(x, h_0, c_0, w):
    unpacked = jax_rnn.unpack_lstm_weights(w, inputs, hidden, layers, bidirectional)
    return jax_rnn.lstm_ref(x, h_0, c_0, *unpacked, lens, *static)

  for a, b in zip(jax.jit(ours)(x, h_0, c_0, w), ref(x, h_0, c_0, w)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  loss = lambda fn: lambda *a: _sum_squares(fn(*a))
  got = jax.jit(jax.grad(loss(ours), argnums=(0, 1, 2, 3)))(x, h_0, c_0, w)
  want = jax.grad(loss(ref), argnums=(0, 1, 2, 3))(x, h_0, c_0, w)
  for a, b in zip(got, want):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_weight_helpers_match_jax_experimental():
  args = (5, 7, 3, True)
  assert jax_dnn.get_num_params_in_lstm(*args) == jax_rnn.get_num_params_in_lstm(*args)
  w = jax_dnn.init_lstm_weight(jax.random.key(0), *args)
  np.testing.assert_array_equal(w, jax_rnn.init_lstm_weight(jax.random.key(0), *args))
  ours, theirs = jax_dnn.unpack_lstm_weights(w, *args), jax_rnn.unpack_lstm_weights(w, *args)
  for a, b in zip(ours, theirs):
    assert sorted(a) == sorted(b)
    for p in a:
      np.testing.assert_array_equal(a[p], b[p])
  np.testing.assert_array_equal(jax_dnn.pack_rnn_weights(*ours), w)
  gru = jax_dnn.unpack_gru_weights(jax_dnn.init_gru_weight(jax.random.key(1), *args), *args)
  assert gru[0][0].shape == (21, 5) and gru[0][2].shape == (21, 14) and gru[3][5].shape == (21,)
  assert jax_dnn.get_num_params_in_rnn(2, 3, 1, False) == 3 * 2 + 3 * 3 + 2 * 3


# --- gru and rnn against the per-step reference ----------------------------------------


@pytest.mark.parametrize("mode,layers,bidirectional", [("gru", 1, True), ("rnn_tanh", 2, False),
                                                       ("rnn_relu", 1, False)])
def test_against_per_step_reference(mode, layers, bidirectional):
  """Ragged lengths (including 0 and T): values and gradients of every input."""
  inputs, hidden = 3, 4
  x, h_0, c_0, w = _problem(mode, 5, 5, inputs, hidden, layers, bidirectional, key=10)
  lens = _lens(5, 5)
  static = (inputs, hidden, layers, bidirectional)
  ours = lambda x, h, c, w: _ours(mode, x, h, c, w, lens, *static)
  naive = lambda x, h, c, w: _naive(mode, x, h, c, w, lens, *static)
  for a, b in zip(jax.jit(ours)(x, h_0, c_0, w), naive(x, h_0, c_0, w)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
  argnums = (0, 1, 2, 3) if mode == "lstm" else (0, 1, 3)
  loss = lambda fn: lambda *a: _sum_squares(fn(*a))
  got = jax.jit(jax.grad(loss(ours), argnums=argnums))(x, h_0, c_0, w)
  want = jax.jit(jax.grad(loss(naive), argnums=argnums))(x, h_0, c_0, w)
  for a, b in zip(got, want):
    np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5)


def test_length_zero_gives_initial_state_and_zero_outputs():
  x, h_0, c_0, w = _problem("lstm", 2, 4, 3, 4, 1, True)
  y, h_n, c_n = jax_dnn.lstm(x, h_0, c_0, w, jnp.asarray([0, 4], jnp.int32), 3, 4, 1, 0.0, True)
  np.testing.assert_array_equal(y[0], 0)
  np.testing.assert_array_equal(h_n[:, 0], h_0[:, 0])
  np.testing.assert_array_equal(c_n[:, 0], c_0[:, 0])
  assert np.all(np.abs(y[1]) > 0)


def test_lengths_beyond_the_sequence_on_the_device_are_clamped():
  x, h_0, _, w = _problem("gru", 3, 4, 3, 4)
  run = lambda lens: jax.jit(jax_dnn.gru, static_argnums=(4, 5, 6, 7, 8))(
      x, h_0, w, jnp.asarray(lens, jnp.int32), 3, 4, 1, 0.0, False)
  for a, b in zip(run([9, -2, 4]), run([4, 0, 4])):
    np.testing.assert_array_equal(a, b)


def test_empty_sequence():
  x, h_0, c_0, w = _problem("lstm", 2, 0, 3, 4)
  y, h_n, c_n = jax_dnn.lstm(x, h_0, c_0, w, jnp.zeros(2, jnp.int32), 3, 4, 1, 0.0, False)
  assert y.shape == (2, 0, 4)
  np.testing.assert_array_equal(h_n, h_0)
  np.testing.assert_array_equal(c_n, c_0)


def test_low_precision_reference_path():
  """bf16/f16 inputs run in their dtype (weights and states cast to it), y in
  it, h_n in h_0's: the tolerance rule against the f64 per-step reference."""
  dtype = jnp.bfloat16
  x, h_0, c_0, w = _problem("lstm", 3, 4, 8, 16, 1, False, dtype=dtype)
  lens = _lens(3, 4)
  static = (8, 16, 1, False)
  out = jax.jit(lambda *a: _ours("lstm", *a, lens, *static))(x, h_0, c_0, w)
  assert out[0].dtype == dtype and out[1].dtype == dtype
  ref = f64(lambda *a: _naive("lstm", *a[:4], a[4], *static), x, h_0, c_0, w, lens)
  same = _naive("lstm", x, h_0, c_0, w, lens, *static)
  for o, r, s in zip(out, ref, same):
    assert_rule(o, r, s, dtype)


# --- the recurrence primitive's reference -------------------------------------------


def _loop(kind, gx, w_hh, b_hh, h0, c0, lens, reverse):
  """The contract's recurrence, one row and one step at a time (fp32 inputs)."""
  steps, batch, _ = gx.shape
  hidden = w_hh.shape[1]
  gx, w_hh, b_hh, h0 = (np.asarray(a, np.float64) for a in (gx, w_hh, b_hh, h0))
  sig = lambda v: 1 / (1 + np.exp(-v))
  slots = rec.SLOTS[kind]
  y = np.zeros((steps, batch, hidden))
  states = np.zeros((steps, batch, slots, hidden))
  h_n, c_n = h0.copy(), np.asarray(c0, np.float64).copy()
  for b in range(batch):
    n_valid = min(max(int(lens[b]), 0), steps)
    h, c = h0[b], (c_n[b] if kind == rec.LSTM else None)
    for t in (range(n_valid - 1, -1, -1) if reverse else range(n_valid)):
      hh = w_hh @ h + b_hh
      if kind == rec.LSTM:
        z = gx[t, b] + hh
        i, f, g, o = sig(z[:hidden]), sig(z[hidden:2 * hidden]), np.tanh(
            z[2 * hidden:3 * hidden]), sig(z[3 * hidden:])
        c = f * c + i * g
        h = o * np.tanh(c)
        states[t, b] = [i, f, g, o, c]
      elif kind == rec.GRU:
        r = sig(gx[t, b, :hidden] + hh[:hidden])
        u = sig(gx[t, b, hidden:2 * hidden] + hh[hidden:2 * hidden])
        n = np.tanh(gx[t, b, 2 * hidden:] + r * hh[2 * hidden:])
        h = (1 - u) * n + u * h
        states[t, b] = [r, u, n, hh[2 * hidden:], h]
      else:
        z = gx[t, b] + hh
        h = np.tanh(z) if kind == rec.RNN_TANH else np.maximum(z, 0)
        states[t, b, 0] = h
      y[t, b] = h
    h_n[b] = h
    if kind == rec.LSTM:
      c_n[b] = c
  return y, h_n, c_n, states


def _recurrence_args(kind, steps=6, batch=5, hidden=3, key=20):
  g = rec.GATES[kind] * hidden
  gx = randn(key, (steps, batch, g), jnp.float32)
  w_hh = randn(key + 1, (g, hidden), jnp.float32, scale=0.6)
  b_hh = randn(key + 2, (g,), jnp.float32, scale=0.3)
  h0 = randn(key + 3, (batch, hidden), jnp.float32)
  c0 = (randn(key + 4, (batch, hidden), jnp.float32) if kind == rec.LSTM
        else jnp.zeros((0,), jnp.float32))
  return gx, w_hh, b_hh, h0, c0


@pytest.mark.parametrize("kind,reverse", [("lstm", False), ("lstm", True), ("gru", True),
                                          ("rnn_tanh", False), ("rnn_relu", True)])
def test_primitive_reference_against_a_loop(kind, reverse):
  """y, h_n, c_n and the states (zeros at padded steps) for lengths T, 0, 1,
  beyond T and negative; the backward's dgx, dh0, dc0 against the VJP of
  the forward and its dgh_n against the gradient of b_hh."""
  kind = KINDS[kind]
  args = _recurrence_args(kind)
  lens = jnp.asarray([6, 0, 1, 9, -3], jnp.int32)
  fwd = jax.jit(functools.partial(rec._fwd_reference, kind=kind, reverse=reverse))  # pylint: disable=protected-access
  out = fwd(*args, lens)
  want = _loop(kind, *args, np.asarray(lens), reverse)
  for name, o, w in zip(("y", "h_n", "c_n", "states"), out, want):
    if name == "c_n" and kind != rec.LSTM:
      assert o.shape == (0,)
      continue
    np.testing.assert_allclose(o, w, rtol=1e-5, atol=1e-6, err_msg=name)

  dy = randn(30, out[0].shape, jnp.float32)
  dh_n = randn(31, out[1].shape, jnp.float32)
  dc_n = randn(32, out[2].shape, jnp.float32)
  gx, w_hh, b_hh, h0, c0 = args
  dgx, dgh_n, dh0, dc0 = jax.jit(functools.partial(
      rec._bwd_reference, kind=kind, reverse=reverse))(  # pylint: disable=protected-access
          dy, dh_n, dc_n, w_hh, h0, c0, lens, out[3])
  _, vjp = jax.vjp(lambda *a: fwd(*a, lens)[:3], gx, w_hh, b_hh, h0, c0)
  vgx, _, vb, vh0, vc0 = vjp((dy, dh_n, dc_n))
  np.testing.assert_allclose(dgx, vgx, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(dh0, vh0, rtol=1e-5, atol=1e-6)
  if kind == rec.LSTM:
    np.testing.assert_allclose(dc0, vc0, rtol=1e-5, atol=1e-6)
  hidden = w_hh.shape[1]
  dgh = jnp.concatenate([dgx[..., :2 * hidden], dgh_n], -1) if kind == rec.GRU else dgx
  np.testing.assert_allclose(dgh.sum((0, 1)), vb, rtol=1e-5, atol=1e-5)
  assert np.all(np.asarray(dgx)[:, 1] == 0)  # length 0: no gradient


def _packed_against_split(kind, dtype, steps, batch, hidden, lens, key):
  """The recurrence over two packed directions and one recurrence a
  direction (the second reversed): outputs, and the gradients of every
  input under random cotangents, as (packed, split) pairs."""
  g = rec.GATES[kind] * hidden
  lstm = kind == rec.LSTM
  gx = randn(key, (steps, batch, 2 * g), dtype)
  w_hh = randn(key + 1, (2 * g, hidden), dtype, scale=1 / np.sqrt(hidden))
  b_hh = randn(key + 2, (2 * g,), dtype, scale=0.3)
  h0 = randn(key + 3, (batch, 2 * hidden), dtype, scale=0.5)
  c0 = randn(key + 4, (batch, 2 * hidden), dtype, scale=0.5) if lstm else jnp.zeros((0,), dtype)
  cts = [randn(key + 5 + i, s, dtype) for i, s in enumerate(
      [(steps, batch, 2 * hidden), (batch, 2 * hidden), (batch, 2 * hidden) if lstm else (0,)])]

  def packed(*a):
    return rec.recurrence(*a, lens, kind=kind, reverse=False)

  def split(gx, w_hh, b_hh, h0, c0):
    half = lambda a, d: a if a.shape == (0,) else jnp.split(a, 2, axis=-1)[d]
    outs = [rec.recurrence(half(gx, d), jnp.split(w_hh, 2)[d], half(b_hh, d), half(h0, d),
                               half(c0, d), lens, kind=kind, reverse=bool(d)) for d in range(2)]
    return tuple(a if a.shape == (0,) else jnp.concatenate([a, b], -1) for a, b in zip(*outs))

  results = []
  for fn in (packed, split):
    run = jax.jit(lambda *a, fn=fn: (fn(*a), jax.vjp(fn, *a)[1](tuple(cts))))
    outs, grads = run(gx, w_hh, b_hh, h0, c0)
    results.append(tuple(outs) + tuple(grads))
  return zip(*results)


@pytest.mark.parametrize("kind", ["lstm", "gru", "rnn_tanh", "rnn_relu"])
def test_packed_directions_match_one_recurrence_each(kind):
  """A bidirectional layer's two directions packed in one recurrence give
  what one recurrence a direction gives: outputs and the gradients of gx,
  w_hh, b_hh, h0 and c0, with lengths 0, 1, T and beyond T."""
  lens = jnp.asarray([6, 0, 1, 9, 4], jnp.int32)
  for a, b in _packed_against_split(KINDS[kind], jnp.float32, 6, 5, 3, lens, key=40):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_packed_directions_reverse_raises():
  g = 4 * 3
  with pytest.raises(ValueError, match="reverse must be False with two directions"):
    rec.recurrence(jnp.ones((2, 1, 2 * g)), jnp.ones((2 * g, 3)), jnp.ones((2 * g,)),
                       jnp.ones((1, 6)), jnp.ones((1, 6)), jnp.ones((1,), jnp.int32),
                       kind=rec.LSTM, reverse=True)


def test_primitive_rounds_h_to_the_input_dtype_before_the_matmul():
  """bf16: W_hh multiplies y_{t-1} (h rounded to bf16), not the fp32 h."""
  kind = rec.RNN_TANH
  gx, w_hh, b_hh, h0, c0 = (a.astype(jnp.bfloat16) for a in _recurrence_args(kind, steps=2))
  lens = jnp.full((5,), 2, jnp.int32)
  y, _, _, states = rec._fwd_reference(gx, w_hh, b_hh, h0, c0, lens, kind=kind,  # pylint: disable=protected-access
                                           reverse=False)
  hh = jnp.dot(y[0], w_hh.T, preferred_element_type=jnp.float32) + b_hh.astype(jnp.float32)
  np.testing.assert_allclose(states[1, :, 0], jnp.tanh(gx[1].astype(jnp.float32) + hh),
                             rtol=1e-6, atol=1e-6)


# --- transforms ----------------------------------------------------------------------


def test_vmap_folds_into_the_batch_and_matches_a_loop():
  x, h_0, c_0, w = _problem("lstm", 2, 4, 3, 4, 1, True)
  xs = jnp.stack([x, 0.5 * x, -x])
  lens = jnp.asarray([[4, 1], [0, 3], [2, 2]], jnp.int32)
  fn = lambda x, lens: jax_dnn.lstm(x, h_0, c_0, w, lens, 3, 4, 1, 0.0, True)
  got = jax.jit(jax.vmap(fn))(xs, lens)
  for i in range(3):
    for a, b in zip(got, fn(xs[i], lens[i])):
      np.testing.assert_allclose(a[i], b, rtol=1e-6, atol=1e-6)
  text = str(jax.make_jaxpr(jax.vmap(fn))(xs, lens))
  assert "jax_dnn_rnn_fwd" in text and "while" not in text.split("jax_dnn_rnn_fwd")[0]


def test_vmap_over_weights_and_vmap_of_grad():
  x, h_0, _, w = _problem("gru", 2, 3, 3, 4)
  ws = jnp.stack([w, 0.7 * w])
  lens = jnp.asarray([3, 2], jnp.int32)
  loss = lambda w, x: _sum_squares(jax_dnn.gru(x, h_0, w, lens, 3, 4, 1, 0.0, False))
  got = jax.jit(jax.vmap(jax.grad(loss, argnums=(0, 1)), in_axes=(0, None)))(ws, x)
  grad = jax.jit(jax.grad(loss, argnums=(0, 1)))
  for a, b in zip(got, grad(ws[1], x)):
    np.testing.assert_allclose(a[1], b, rtol=1e-5, atol=1e-6)
  got = jax.jit(jax.vmap(grad, in_axes=(None, 0)))(w, jnp.stack([x, -x]))
  for a, b in zip(got, grad(w, -x)):
    np.testing.assert_allclose(a[1], b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", ["lstm", "gru", "rnn_tanh"])
def test_check_grads(mode):
  x, h_0, c_0, w = _problem(mode, 2, 3, 2, 3, 1, True, key=40)
  lens = jnp.asarray([3, 2], jnp.int32)
  fn = jax.jit(lambda x, h, c, w: _ours(mode, x, h, c, w, lens, 2, 3, 1, True))
  check_grads(fn, (x, h_0, c_0, w), order=1, modes=["rev"], atol=5e-3, rtol=5e-3)


def test_higher_order_grad_runs_the_reference_jvp():
  x, h_0, _, w = _problem("rnn_tanh", 2, 2, 2, 2)
  lens = jnp.asarray([2, 1], jnp.int32)
  fn = lambda w: _sum_squares(jax_dnn.rnn(x, h_0, w, lens, 2, 2, 1, 0.0, False))
  naive = lambda w: _sum_squares(_naive("rnn_tanh", x, h_0, None, w, lens, 2, 2, 1, False))
  v = randn(50, w.shape, jnp.float32)
  hvp = lambda f: jax.jit(jax.grad(lambda w: jnp.vdot(jax.grad(f)(w), v)))(w)
  np.testing.assert_allclose(hvp(fn), hvp(naive), rtol=1e-4, atol=1e-5)


def test_batch_split_over_devices():
  mesh = Mesh(np.array(jax.devices("cpu")[:4]), ("data",))
  x, h_0, c_0, w = _problem("lstm", 8, 3, 3, 4)
  lens = jnp.asarray([3, 3, 2, 1, 0, 3, 2, 3], jnp.int32)
  fn = lambda x, h, c, lens: jax.grad(
      lambda x, h, c: _sum_squares(jax_dnn.lstm(x, h, c, w, lens, 3, 4, 1, 0.0, False)),
      argnums=(0, 1, 2))(x, h, c)
  want = jax.jit(fn)(x, h_0, c_0, lens)
  specs = [P("data"), P(None, "data"), P(None, "data"), P("data")]
  split = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip((x, h_0, c_0, lens), specs)]
  got = jax.jit(fn)(*split)
  for a, b in zip(got, want):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  text = jax.jit(fn).lower(*split).compile().as_text()
  assert "all-gather" not in text


# --- dropout ----------------------------------------------------------------------------


def test_dropout_between_layers():
  x, h_0, c_0, w = _problem("lstm", 2, 4, 3, 4, 2, False)
  lens = jnp.asarray([4, 3], jnp.int32)
  lstm = jax.jit(jax_dnn.lstm, static_argnums=(5, 6, 7, 8, 9))
  run = lambda p, key, layers=2, w=w, h=h_0, c=c_0: lstm(
      x, h, c, w, lens, 3, 4, layers, p, False, dropout_rng=key)
  key = jax.random.key(7)
  base, dropped = run(0.0, None), run(0.5, key)
  np.testing.assert_array_equal(dropped[0], run(0.5, key)[0])  # one key, one mask
  # Layer 0's outputs (h_n[0]) are untouched; layer 1 sees the dropped inputs.
  np.testing.assert_array_equal(dropped[1][0], base[1][0])
  assert not np.allclose(dropped[1][1], base[1][1])
  # One layer: no dropout anywhere.
  w1 = w[:rnn_weights.num_params(4, 3, 4, 1, False)]
  one = run(0.5, key, 1, jnp.zeros_like(w1) + 0.1, h_0[:1], c_0[:1])
  np.testing.assert_array_equal(one[0], run(0.0, None, 1, jnp.zeros_like(w1) + 0.1, h_0[:1],
                                            c_0[:1])[0])


# --- bad inputs -----------------------------------------------------------------------


def test_bad_inputs_raise():
  x, h_0, c_0, w = _problem("lstm", 2, 4, 3, 4)
  lens = jnp.asarray([4, 4], jnp.int32)
  args = (3, 4, 1, 0.0, False)
  with pytest.raises(ValueError, match="weights must be the flat vector of shape \\(144,\\)"):
    jax_dnn.lstm(x, h_0, c_0, w[:-1], lens, *args)
  with pytest.raises(ValueError, match="x must have shape"):
    jax_dnn.lstm(x[..., :2], h_0, c_0, w, lens, *args)
  with pytest.raises(ValueError, match="h_0 must have shape"):
    jax_dnn.lstm(x, h_0[:, :1], c_0, w, lens, *args)
  with pytest.raises(ValueError, match="c_0 must have shape"):
    jax_dnn.lstm(x, h_0, c_0[0], w, lens, *args)
  with pytest.raises(TypeError, match="x has dtype int32"):
    jax_dnn.lstm(x.astype(jnp.int32), h_0, c_0, w, lens, *args)
  with pytest.raises(TypeError, match="seq_lengths must be integers"):
    jax_dnn.lstm(x, h_0, c_0, w, lens.astype(jnp.float32), *args)
  with pytest.raises(ValueError, match="seq_lengths must have shape"):
    jax_dnn.lstm(x, h_0, c_0, w, lens[:1], *args)
  with pytest.raises(ValueError, match=r"seq_lengths must lie in \[0, T\] = \[0, 4\]"):
    jax_dnn.lstm(x, h_0, c_0, w, np.asarray([5, 1], np.int32), *args)
  with pytest.raises(ValueError, match="dropout=0.5 needs dropout_rng"):
    jax_dnn.lstm(x, h_0, c_0, w, lens, 3, 4, 1, 0.5, False)
  with pytest.raises(ValueError, match="dropout must be a probability"):
    jax_dnn.lstm(x, h_0, c_0, w, lens, 3, 4, 1, 1.5, False)
  with pytest.raises(ValueError, match="num_layers must be an int >= 1"):
    jax_dnn.lstm(x, h_0, c_0, w, lens, 3, 4, 0, 0.0, False)
  with pytest.raises(ValueError, match="nonlinearity must be 'tanh' or 'relu'"):
    jax_dnn.rnn(x, h_0, w, lens, 3, 4, 1, 0.0, False, nonlinearity="sigmoid")
  with pytest.raises(ValueError, match="weights must be the flat vector"):
    jax_dnn.gru(x, h_0, w, lens, *args)  # LSTM-sized weights


def test_weight_helpers_reject_sizes_that_do_not_match():
  """Sizes, vectors and per-layer arrays that do not make the layout raise
  a ValueError naming the argument, never a silently wrong model."""
  lstm_w = jax_dnn.init_lstm_weight(jax.random.key(0), 3, 4, 1, False)
  with pytest.raises(ValueError, match=r"unpack_gru_weights: weights must be the flat vector "
                                       r"of shape \(108,\).*got shape \(144,\)"):
    jax_dnn.unpack_gru_weights(lstm_w, 3, 4, 1, False)
  with pytest.raises(ValueError, match="get_num_params_in_gru: hidden_size must be an int >= 1; "
                                       "got -3"):
    jax_dnn.get_num_params_in_gru(4, -3, 1, False)
  with pytest.raises(ValueError, match="get_num_params_in_lstm: input_size must be an int"):
    jax_dnn.get_num_params_in_lstm(0, 4, 1, False)
  with pytest.raises(ValueError, match="init_lstm_weight: hidden_size must be an int >= 1"):
    jax_dnn.init_lstm_weight(jax.random.key(0), 3, 0, 1, False)
  with pytest.raises(TypeError, match="get_num_params_in_rnn: bidirectional must be a bool"):
    jax_dnn.get_num_params_in_rnn(3, 4, 1, "no")
  w_ih, w_hh, b_ih, b_hh = jax_dnn.unpack_lstm_weights(
      jax_dnn.init_lstm_weight(jax.random.key(0), 3, 4, 2, False), 3, 4, 2, False)
  with pytest.raises(ValueError, match=r"pack_rnn_weights: W_ih, W_hh, b_ih and b_hh must each "
                                       r"hold one array per pseudo-layer.*'W_hh': 1"):
    jax_dnn.pack_rnn_weights(w_ih, {0: w_hh[0]}, b_ih, b_hh)
  with pytest.raises(ValueError, match=r"W_hh\[1\] must have shape \(16, 4\).*got \(16, 5\)"):
    jax_dnn.pack_rnn_weights(w_ih, {0: w_hh[0], 1: jnp.zeros((16, 5))}, b_ih, b_hh)
  with pytest.raises(ValueError, match=r"b_ih\[0\] must have shape \(16,\).*got \(12,\)"):
    jax_dnn.pack_rnn_weights(w_ih, w_hh, {0: b_ih[0][:12], 1: b_ih[1]}, b_hh)
  with pytest.raises(ValueError, match=r"W_ih\[1\] must have shape \(16, "):
    jax_dnn.pack_rnn_weights({0: w_ih[0], 1: w_ih[1][:12]}, w_hh, b_ih, b_hh)
  with pytest.raises(ValueError, match=r"W_hh\[0\] must have shape \(G \* hidden_size, "
                                       r"hidden_size\)"):
    jax_dnn.pack_rnn_weights(w_ih, {0: w_hh[0][:, :3], 1: w_hh[1]}, b_ih, b_hh)


def test_torch_state_dict_errors_name_the_tensor():
  sd = jax_dnn.rnn_weights_to_torch(
      np.asarray(jax_dnn.init_lstm_weight(jax.random.key(0), 3, 4, 2, True)), "lstm", 3, 4, 2,
      True)
  convert = jax_dnn.rnn_weights_from_torch
  with pytest.raises(ValueError, match="missing bias_hh_l0$"):
    convert({k: v for k, v in sd.items() if k != "bias_hh_l0"})
  with pytest.raises(ValueError, match=r"weight_hh_l0 must have shape \(G \* hidden_size, "
                                       r"hidden_size\).*got \(16, 5\)"):
    convert({**sd, "weight_hh_l0": np.zeros((16, 5), np.float32)})
  with pytest.raises(ValueError, match=r"weight_hh_l1_reverse must have shape \(16, 4\).*got "
                                       r"\(16, 3\)"):
    convert({**sd, "weight_hh_l1_reverse": np.zeros((16, 3), np.float32)})
  with pytest.raises(ValueError, match=r"weight_ih_l1 must have shape \(16, 8\)"):
    convert({**sd, "weight_ih_l1": np.zeros((16, 4), np.float32)})
  with pytest.raises(ValueError, match=r"bias_ih_l1 must have shape \(16,\)"):
    convert({**sd, "bias_ih_l1": np.zeros((12,), np.float32)})
  with pytest.raises(ValueError, match="no weight_hh_l0 in the state dict"):
    convert({k: v for k, v in sd.items() if k != "weight_hh_l0"})
  one_way = {k: v for k, v in sd.items() if "reverse" not in k and "l1" not in k}
  with pytest.raises(ValueError, match=r"unexpected keys \['bias_hh_l0_reverse'\] for 1 "
                                       "layers, one direction"):
    convert({**one_way, "bias_hh_l0_reverse": sd["bias_hh_l0_reverse"]})
  with pytest.raises(ValueError, match="missing weight_hh_l1"):
    convert({k: v for k, v in sd.items() if k != "weight_hh_l1"})


def test_float64_runs_the_reference():
  """Under jax_enable_x64, float64 inputs (jax.experimental.rnn.lstm's cuDNN
  path takes them) run the reference in float64: values and gradients as
  the float64 per-step reference, within float64 rounding."""
  with x64():
    x, h_0, c_0, w = (a.astype(jnp.float64) for a in _problem("lstm", 3, 4, 3, 4, 1, True))
    lens = jnp.asarray([4, 2, 0], jnp.int32)
    static = (3, 4, 1, True)
    ours = lambda *a: _ours("lstm", *a, lens, *static)
    naive = lambda *a: _naive("lstm", *a, lens, *static)
    outs = jax.jit(ours)(x, h_0, c_0, w)
    assert [o.dtype for o in outs] == [jnp.float64] * 3
    for a, b in zip(outs, naive(x, h_0, c_0, w)):
      np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)
    grad = lambda fn: jax.jit(jax.grad(lambda *a: jnp.sum(jnp.concatenate(
        [jnp.ravel(jnp.sin(o)) for o in fn(*a)])), argnums=(0, 1, 2, 3)))
    for a, b in zip(grad(ours)(x, h_0, c_0, w), grad(naive)(x, h_0, c_0, w)):
      assert a.dtype == jnp.float64
      np.testing.assert_allclose(a, b, rtol=1e-11, atol=1e-12)
    layer = jnn.GRU(3, 4, param_dtype=jnp.float64, rngs=nnx.Rngs(0))
    assert layer(x)[0].dtype == jnp.float64


# --- PyTorch state dicts ------------------------------------------------------------


def test_torch_state_dict_round_trip_and_names():
  w = np.asarray(jax_dnn.init_gru_weight(jax.random.key(0), 3, 4, 2, True))
  sd = jax_dnn.rnn_weights_to_torch(w, "gru", 3, 4, 2, True)
  assert sorted(sd) == sorted(f"{k}_{m}_l{l}{s}" for k in ("weight", "bias") for m in ("ih", "hh")
                              for l in (0, 1) for s in ("", "_reverse"))
  assert sd["weight_ih_l0"].shape == (12, 3) and sd["weight_ih_l1_reverse"].shape == (12, 8)
  assert sd["weight_hh_l1"].shape == (12, 4) and sd["bias_hh_l0_reverse"].shape == (12,)
  np.testing.assert_array_equal(jax_dnn.rnn_weights_from_torch(sd), w)
  no_bias = {k: v for k, v in sd.items() if k.startswith("weight")}
  back = jax_dnn.rnn_weights_from_torch(no_bias)
  biases = 2 * 2 * 2 * 12  # layers x directions x (ih, hh) x 3H
  np.testing.assert_array_equal(back[:-biases], w[:-biases])
  np.testing.assert_array_equal(back[-biases:], 0)
  with pytest.raises(ValueError, match="unexpected keys"):
    jax_dnn.rnn_weights_from_torch({**sd, "weight_hr_l0": np.zeros((4, 4))})
  with pytest.raises(ValueError, match="weights must have shape"):
    jax_dnn.rnn_weights_to_torch(w[:-1], "gru", 3, 4, 2, True)


def test_torch_state_dict_runs_pytorchs_equations():
  """A state dict's arrays used as PyTorch's nn.GRU uses them (written out
  here) give jax_dnn.gru's results on the converted flat vector."""
  rng = np.random.default_rng(0)
  hidden, inputs = 4, 3
  sd = {"weight_ih_l0": rng.normal(size=(12, inputs)), "weight_hh_l0": rng.normal(size=(12, 4)),
        "bias_ih_l0": rng.normal(size=12), "bias_hh_l0": rng.normal(size=12)}
  sd = {k: v.astype(np.float32) for k, v in sd.items()}
  x = rng.normal(size=(2, 3, inputs)).astype(np.float32)
  h = np.zeros((2, hidden), np.float32)
  sig = lambda v: 1 / (1 + np.exp(-v))
  for t in range(3):
    gi = x[:, t] @ sd["weight_ih_l0"].T + sd["bias_ih_l0"]
    gh = h @ sd["weight_hh_l0"].T + sd["bias_hh_l0"]
    r, z = sig(gi[:, :4] + gh[:, :4]), sig(gi[:, 4:8] + gh[:, 4:8])
    n = np.tanh(gi[:, 8:] + r * gh[:, 8:])
    h = (1 - z) * n + z * h
  w = jax_dnn.rnn_weights_from_torch(sd)
  _, h_n = jax_dnn.gru(jnp.asarray(x), jnp.zeros((1, 2, hidden)), jnp.asarray(w),
                       jnp.full((2,), 3, jnp.int32), inputs, hidden, 1, 0.0, False)
  np.testing.assert_allclose(h_n[0], h, rtol=1e-5, atol=1e-5)


# --- the CUDA lowering (a fake plan: no extension needed) ------------------------------


class _FakePlan:
  supported, by_default, reason, variant = True, True, "", 3
  fwd_workspace_bytes, bwd_workspace_bytes = 1234, 5678


@pytest.fixture
def fake_kernels(monkeypatch):
  """Lowers for CUDA as a build with the recurrence kernels would, with a
  fake plan (the real one: tests/test_rnn_plan.py)."""
  real = extension.use_kernel
  monkeypatch.setattr(extension, "use_kernel",
                      lambda t: t.startswith("jax_dnn_rnn") or real(t))
  calls = []

  def rnn_plan(kind, dtype, seq_len, batch, hidden, device=None, directions=1):
    calls.append((kind, dtype, seq_len, batch, hidden, device, directions))
    return _FakePlan()

  monkeypatch.setattr(plans, "rnn_plan", rnn_plan, raising=False)
  return calls


def _bidirectional_lstm_grad_hlo():
  x, h_0, c_0, w = _problem("lstm", 2, 5, 3, 4, 1, True, dtype=jnp.bfloat16)
  lens = jnp.asarray([5, 2], jnp.int32)
  fn = lambda x, h, c, w: jax.grad(lambda *a: _sum_squares(
      jax_dnn.lstm(*a, lens, 3, 4, 1, 0.0, True)), argnums=(0, 1, 2, 3))(x, h, c, w)
  return cuda_hlo(fn, x, h_0, c_0, w)


def test_cuda_lowering_calls_the_kernels(fake_kernels):
  """A bidirectional layer whose plan fits both directions: one launch
  each way, w_hh [2 G H, H], the reverse direction implied."""
  text = _bidirectional_lstm_grad_hlo()
  assert text.count("@jax_dnn_rnn_fwd") == 1 and text.count("@jax_dnn_rnn_bwd") == 1
  assert "tensor<1234xui8>" in text and "tensor<5678xui8>" in text
  assert "variant = 3" in text and "reverse = 0" in text and "kind = 0" in text
  assert "tensor<32x4xbf16>" in text and "reverse = 1" not in text
  assert ("lstm", "bfloat16", 5, 2, 4, None, 2) in fake_kernels


def test_cuda_lowering_of_directions_the_plan_does_not_fit_together(monkeypatch, fake_kernels):
  """Where the plan declines two directions side by side, one launch a
  direction, the second reversed."""

  class OneOnly(_FakePlan):
    supported, reason = False, "too wide"

  real = plans.rnn_plan
  monkeypatch.setattr(plans, "rnn_plan", lambda *a, directions=1, **k: (
      OneOnly() if directions == 2 else real(*a, directions=directions, **k)))
  text = _bidirectional_lstm_grad_hlo()
  assert text.count("@jax_dnn_rnn_fwd") == 2 and text.count("@jax_dnn_rnn_bwd") == 2
  assert "reverse = 1" in text and "tensor<32x4xbf16>" not in text
  assert ("lstm", "bfloat16", 5, 2, 4, None, 1) in fake_kernels


def test_cuda_lowering_of_gru_under_vmap(fake_kernels):
  """vmap folds into the kernel's batch: one call of batch 3 * 2."""
  x, h_0, _, w = _problem("gru", 2, 5, 3, 4)
  fn = jax.vmap(lambda x: jax_dnn.gru(x, h_0, w, jnp.asarray([5, 1], jnp.int32), 3, 4, 1, 0.0,
                                      False)[0])
  text = cuda_hlo(fn, jnp.stack([x, x, x]))
  assert text.count("@jax_dnn_rnn_fwd") == 1
  assert ("gru", "float32", 5, 6, 4, None, 1) in fake_kernels


def _entry_point(name, batch):
  """fn(x [batch, 5, 3] fp32, precision) of one public entry point over a
  recurrence of width 4 (precision: the argument where the entry point has
  one, else ignored)."""
  lens = jnp.full((batch,), 5, jnp.int32)
  if name in ("lstm", "gru", "rnn"):
    _, h_0, c_0, w = _problem({"rnn": "rnn_tanh"}.get(name, name), batch, 5, 3, 4, 1, True)
    args = (lens, 3, 4, 1, 0.0, True)
    op = {"lstm": lambda x, p: jax_dnn.lstm(x, h_0, c_0, w, *args, p),
          "gru": lambda x, p: jax_dnn.gru(x, h_0, w, *args, p),
          "rnn": lambda x, p: jax_dnn.rnn(x, h_0, w, *args, p)}[name]
    return lambda x, precision=None: op(x, precision)[0]
  if name in ("nn.LSTM", "nn.GRU"):
    layer = (jnn.LSTM if name == "nn.LSTM" else jnn.GRU)(3, 4, bidirectional=True,
                                                          rngs=nnx.Rngs(0))
    return lambda x, precision=None: layer(x, seq_lengths=lens)[0]
  carry = lambda: (jnp.zeros((batch, 4)),) * 2
  if name == "nn.Bidirectional":
    module = jnn.Bidirectional(jnn.RNN(nnx.LSTMCell(3, 4, rngs=nnx.Rngs(0))),
                               jnn.RNN(nnx.GRUCell(3, 4, rngs=nnx.Rngs(1))))
    return lambda x, precision=None: module(x, initial_carry=(carry(), carry()[0]))
  module = jnn.RNN(nnx.LSTMCell(3, 4, rngs=nnx.Rngs(0)), reverse=name == "nn.RNN reverse")
  return lambda x, precision=None: module(x, initial_carry=carry(), seq_lengths=lens)


@pytest.mark.parametrize("name", ["lstm", "gru", "rnn", "nn.LSTM", "nn.GRU", "nn.RNN",
                                  "nn.RNN reverse", "nn.Bidirectional"])
def test_cuda_lowering_follows_the_matmul_precision(fake_kernels, name):
  """fp32 runs the TF32 kernels where the peer's fp32 products are TF32 on
  the GPU (JAX's default, "tensorfloat32") and the exact reference where
  they are exact ("highest", "float32"); bf16 always runs the kernels. The
  Flax layers' peer multiplies one step's rows at a time, a vector-matrix
  product in full fp32 for one row: batch 1 runs exact there."""
  del fake_kernels
  kernel = lambda fn, x: "@jax_dnn_rnn_fwd" in cuda_hlo(fn, x)
  flax_layer = name.startswith("nn.") and name not in ("nn.LSTM", "nn.GRU")
  for batch in (1, 2):
    fn = _entry_point(name, batch)
    x = randn(batch, (batch, 5, 3), jnp.float32)
    tf32 = not (flax_layer and batch == 1)
    assert kernel(fn, x) == tf32, batch
    with jax.default_matmul_precision("tensorfloat32"):
      assert kernel(fn, x) == tf32, batch
    for exact in ("highest", "float32"):
      with jax.default_matmul_precision(exact):
        assert not kernel(fn, x), (batch, exact)
        if name in ("lstm", "gru", "rnn"):  # (the layers' fp32 parameters promote bf16 x)
          assert kernel(fn, x.astype(jnp.bfloat16))
    if name in ("lstm", "gru", "rnn"):
      assert not kernel(functools.partial(fn, precision="highest"), x)
      assert kernel(functools.partial(fn, precision="tensorfloat32"), x)


def test_cuda_lowering_without_plans_runs_the_reference(monkeypatch):
  real = extension.use_kernel
  monkeypatch.setattr(extension, "use_kernel", lambda t: t.startswith("jax_dnn_rnn") or real(t))
  monkeypatch.delattr(plans, "rnn_plan", raising=False)
  x, h_0, _, w = _problem("rnn_tanh", 2, 5, 3, 4)
  text = cuda_hlo(lambda x: jax_dnn.rnn(x, h_0, w, jnp.asarray([5, 1], jnp.int32), 3, 4, 1, 0.0,
                                        False)[0], x)
  assert "jax_dnn_rnn" not in text


def test_cuda_lowering_of_an_unsupported_plan_runs_the_reference(monkeypatch):
  real = extension.use_kernel
  monkeypatch.setattr(extension, "use_kernel", lambda t: t.startswith("jax_dnn_rnn") or real(t))

  class Unsupported(_FakePlan):
    supported, reason = False, "too wide"

  monkeypatch.setattr(plans, "rnn_plan", lambda *a, **k: Unsupported(), raising=False)
  x, h_0, _, w = _problem("rnn_tanh", 2, 5, 3, 4)
  text = cuda_hlo(lambda x: jax_dnn.rnn(x, h_0, w, jnp.asarray([5, 1], jnp.int32), 3, 4, 1, 0.0,
                                        False)[0], x)
  assert "jax_dnn_rnn" not in text


# --- Flax layers ----------------------------------------------------------------------------


CELLS = {
    "LSTMCell": nnx.LSTMCell,
    "OptimizedLSTMCell": nnx.OptimizedLSTMCell,
    "GRUCell": nnx.GRUCell,
    "SimpleCell": nnx.SimpleCell,
}


def _valid(lens, shape):
  """[B, T, 1] mask of each row's valid steps (all where lens is None)."""
  if lens is None:
    return np.ones(shape[:2] + (1,))
  return (np.arange(shape[1])[None, :] < np.asarray(lens)[:, None])[..., None]


def _carry(cell, batch, key):
  h = randn(key, (batch, cell.hidden_features), jnp.float32, scale=0.5)
  if isinstance(cell, (nnx.LSTMCell, nnx.OptimizedLSTMCell)):
    return (randn(key + 1, h.shape, jnp.float32, scale=0.5), h)
  return h


def _rows(carry, rows):
  return jax.tree.map(lambda a: np.asarray(a)[rows], carry)


@pytest.mark.parametrize("cell,reverse,keep_order", [
    ("LSTMCell", False, False), ("OptimizedLSTMCell", True, True), ("GRUCell", True, False),
    ("SimpleCell", True, True)])
def test_nn_rnn_matches_flax(cell, reverse, keep_order):
  """Ragged lengths (0 and T among them): outputs at valid steps, zeros at
  padded ones, carries (length 0: the initial carry), and the gradients of a
  masked loss w.r.t. inputs, parameters and initial carry."""
  cell = CELLS[cell](3, 4, rngs=nnx.Rngs(0))
  x = randn(60, (4, 5, 3), jnp.float32)
  carry = _carry(cell, 4, 61)
  graph, params = nnx.split(cell)
  lens = jnp.asarray([5, 2, 0, 3], jnp.int32)
  mask = _valid(lens, x.shape)  # reverse without keep_order: valid steps still come first
  rows = np.asarray(lens) > 0

  def loss(rnn_cls, params, x, carry):
    rnn = rnn_cls(nnx.merge(graph, params), reverse=reverse, keep_order=keep_order)
    c, y = rnn(x, initial_carry=carry, seq_lengths=lens, return_carry=True)
    return (jnp.sum(jnp.sin(y) * mask)
            + sum(jnp.sum(jnp.cos(a[rows])) for a in jax.tree.leaves(c))), (c, y)

  run = lambda cls: jax.jit(jax.value_and_grad(functools.partial(loss, cls), argnums=(0, 1, 2),
                                               has_aux=True))(params, x, carry)
  (l1, (c1, y1)), g1 = run(jnn.RNN)
  (l2, (c2, y2)), g2 = run(nnx.RNN)
  np.testing.assert_allclose(y1 * mask, y2 * mask, rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(y1 * (1 - mask), 0)
  for a, b in zip(jax.tree.leaves(_rows(c1, 2)), jax.tree.leaves(_rows(carry, 2))):
    np.testing.assert_array_equal(a, b)
  for a, b in zip(jax.tree.leaves(_rows(c1, rows)), jax.tree.leaves(_rows(c2, rows))):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(l1, l2, rtol=1e-5)
  for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_nn_rnn_keeps_the_cells_parameters_and_uses_the_kernel_path():
  cell = nnx.OptimizedLSTMCell(3, 4, rngs=nnx.Rngs(0))
  ours, theirs = jnn.RNN(cell), nnx.RNN(cell)
  assert jax.tree.structure(nnx.state(ours, nnx.Param)) == jax.tree.structure(
      nnx.state(theirs, nnx.Param))
  x = randn(1, (2, 5, 3), jnp.float32)
  carry = _carry(cell, 2, 2)

  def jaxpr(module, carry):
    graph, state = nnx.split(module)
    return str(jax.make_jaxpr(lambda s, x: nnx.merge(graph, s)(x, initial_carry=carry))(state, x))

  assert "jax_dnn_rnn_fwd" in jaxpr(ours, carry)
  # A cell with other activations runs Flax's scan.
  other = jnn.RNN(nnx.GRUCell(3, 4, activation_fn=jax.nn.relu, rngs=nnx.Rngs(0)))
  assert "jax_dnn_rnn_fwd" not in jaxpr(other, carry[1])


def test_nn_rnn_options_batch_one_time_major_and_default_carry():
  cell = nnx.GRUCell(3, 4, rngs=nnx.Rngs(0))
  x = randn(3, (6, 1, 3), jnp.float32)  # time-major, batch 1
  ours = jnn.RNN(cell, time_major=True, return_carry=True)
  theirs = nnx.RNN(cell, time_major=True, return_carry=True)
  (c1, y1), (c2, y2) = ours(x), theirs(x)
  np.testing.assert_allclose(y1, y2, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(c1, c2, rtol=1e-5, atol=1e-6)
  y = jnn.RNN(nnx.SimpleCell(3, 4, rngs=nnx.Rngs(1)))(x[:, 0])  # unbatched [T, F]
  np.testing.assert_allclose(y, nnx.RNN(nnx.SimpleCell(3, 4, rngs=nnx.Rngs(1)))(x[:, 0]),
                             rtol=1e-5, atol=1e-6)


def test_nn_rnn_dtypes_follow_flax():
  """A bfloat16 cell (dtype=) over fp32 carries: Flax's result dtypes (the
  carry's fp32 through the state update), values within bf16 rounding."""
  cell = nnx.LSTMCell(3, 4, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
  x = randn(4, (2, 5, 3), jnp.float32)
  carry = _carry(cell, 2, 5)
  (c1, y1), (c2, y2) = (cls(cell, return_carry=True)(x, initial_carry=carry)
                        for cls in (jnn.RNN, nnx.RNN))
  assert y1.dtype == y2.dtype and [a.dtype for a in c1] == [a.dtype for a in c2]
  # bf16 products and gates (Flax) against fp32 gates (ours): a few bf16 ulps.
  np.testing.assert_allclose(y1, y2, rtol=0, atol=2e-2)


def test_nn_rnn_under_nnx_jit_and_vmap():
  cell = nnx.LSTMCell(3, 4, rngs=nnx.Rngs(0))
  ours, theirs = jnn.RNN(cell), nnx.RNN(cell)
  x = randn(5, (3, 2, 5, 3), jnp.float32)  # two batch dimensions
  carry = (jnp.zeros((3, 2, 4)), jnp.zeros((3, 2, 4)))
  y1 = nnx.jit(lambda m, x: m(x, initial_carry=carry))(ours, x)
  np.testing.assert_allclose(y1, theirs(x, initial_carry=carry), rtol=1e-5, atol=1e-6)
  y2 = jax.vmap(lambda x: ours(x, initial_carry=(carry[0][0], carry[1][0])))(x)
  np.testing.assert_allclose(y2, y1, rtol=1e-5, atol=1e-6)


def test_nn_bidirectional_matches_flax():
  fwd = nnx.OptimizedLSTMCell(3, 4, rngs=nnx.Rngs(0))
  bwd = nnx.GRUCell(3, 4, rngs=nnx.Rngs(1))
  x = randn(7, (3, 5, 3), jnp.float32)
  lens = jnp.asarray([5, 1, 3], jnp.int32)
  carry = (_carry(fwd, 3, 8), _carry(bwd, 3, 9))
  ours = jnn.Bidirectional(nnx.RNN(fwd), jnn.RNN(bwd), return_carry=True)
  theirs = nnx.Bidirectional(nnx.RNN(fwd), nnx.RNN(bwd), return_carry=True)
  (c1, y1), (c2, y2) = (m(x, initial_carry=carry, seq_lengths=lens) for m in (ours, theirs))
  mask = _valid(lens, x.shape)
  np.testing.assert_allclose(y1 * mask, y2 * mask, rtol=1e-5, atol=1e-6)
  for a, b in zip(jax.tree.leaves(c1), jax.tree.leaves(c2)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  graph, state = nnx.split(ours)
  assert "jax_dnn_rnn_fwd" in str(jax.make_jaxpr(
      lambda s, x: nnx.merge(graph, s)(x, initial_carry=carry, seq_lengths=lens))(state, x))


@pytest.mark.parametrize("cells", [(nnx.LSTMCell, nnx.OptimizedLSTMCell),
                                   (nnx.GRUCell, nnx.GRUCell)])
def test_nn_bidirectional_runs_one_recurrence_and_matches_flax(cells):
  """Two cells of one kind: one recurrence over both directions (one
  rnn_fwd in the jaxpr where the extension's plans exist, else one a
  direction), Flax's outputs, carries and gradients; without an initial
  carry too (the cells' initializers, forward first)."""
  fwd, bwd = cells[0](3, 4, rngs=nnx.Rngs(0)), cells[1](3, 4, rngs=nnx.Rngs(1))
  x = randn(17, (3, 5, 3), jnp.float32)
  lens = jnp.asarray([5, 1, 3], jnp.int32)
  mask = _valid(lens, x.shape)
  carry = (_carry(fwd, 3, 18), _carry(bwd, 3, 19))
  graph, params = nnx.split((fwd, bwd))

  def loss(bidir_cls, rnn_cls, params, x, carry):
    cells = nnx.merge(graph, params)
    module = bidir_cls(rnn_cls(cells[0]), rnn_cls(cells[1]), return_carry=True)
    c, y = module(x, initial_carry=carry, seq_lengths=lens)
    return jnp.sum(jnp.sin(y) * mask) + sum(jnp.sum(a) for a in jax.tree.leaves(c)), (c, y)

  run = lambda *classes: jax.jit(jax.value_and_grad(
      functools.partial(loss, *classes), argnums=(0, 1, 2), has_aux=True))(params, x, carry)
  (l1, (c1, y1)), g1 = run(jnn.Bidirectional, jnn.RNN)
  (l2, (c2, y2)), g2 = run(nnx.Bidirectional, nnx.RNN)
  np.testing.assert_allclose(y1 * mask, y2 * mask, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(l1, l2, rtol=1e-5)
  for a, b in zip(jax.tree.leaves((c1, g1)), jax.tree.leaves((c2, g2))):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
  ours = jnn.Bidirectional(jnn.RNN(fwd), jnn.RNN(bwd), return_carry=True)
  theirs = nnx.Bidirectional(nnx.RNN(fwd), nnx.RNN(bwd), return_carry=True)
  graph, state = nnx.split(ours)
  text = str(jax.make_jaxpr(
      lambda s, x: nnx.merge(graph, s)(x, initial_carry=carry, seq_lengths=lens))(state, x))
  kind = rec.LSTM if cells[0] is nnx.LSTMCell else rec.GRU
  has_plans = rec.plan_for(kind, jnp.float32, 5, 3, 4) is not None
  assert rec.fuses_directions(kind, jnp.float32, 5, 3, 4) == has_plans
  assert text.count("rnn_fwd") == (1 if has_plans else 2)
  y1, y2 = (m(x, seq_lengths=lens)[1] for m in (ours, theirs))
  np.testing.assert_allclose(y1 * mask, y2 * mask, rtol=1e-5, atol=1e-6)


def test_nn_lstm_and_gru_layers():
  """The layers run jax_dnn.lstm / gru on their flat `weights`; dropout
  between layers in training only; gradients reach the weights."""
  lstm = jnn.LSTM(3, 4, 2, dropout=0.5, rngs=nnx.Rngs(0))
  assert lstm.weights.shape == (jax_dnn.get_num_params_in_lstm(3, 4, 2, False),)
  x = randn(10, (2, 5, 3), jnp.float32)
  lens = jnp.asarray([5, 3], jnp.int32)
  call = nnx.jit(lambda m, x: m(x, seq_lengths=lens))
  lstm.eval()
  y, (h_n, c_n) = call(lstm, x)
  want = jax.jit(jax_dnn.lstm, static_argnums=(5, 6, 7, 8, 9))(
      x, jnp.zeros((2, 2, 4)), jnp.zeros((2, 2, 4)), lstm.weights[...], lens, 3, 4, 2, 0.0, False)
  for a, b in zip((y, h_n, c_n), want):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
  lstm.train()
  y_train, _ = call(lstm, x)
  assert not np.allclose(y_train, y)
  gru = jnn.GRU(3, 4, time_major=True, rngs=nnx.Rngs(1))
  gru.weights[...] = jax_dnn.rnn_weights_from_torch(
      jax_dnn.rnn_weights_to_torch(gru.weights[...], "gru", 3, 4, 1, False))
  loss = lambda m, x: jnp.sum(m(x)[0])
  (value, grads) = nnx.jit(nnx.value_and_grad(loss))(gru, jnp.swapaxes(x, 0, 1))
  want = jax.jit(jax_dnn.gru, static_argnums=(4, 5, 6, 7, 8))(
      x, jnp.zeros((1, 2, 4)), gru.weights[...], jnp.full((2,), 5, jnp.int32), 3, 4, 1, 0.0, False)
  np.testing.assert_allclose(value, jnp.sum(want[0]), rtol=1e-6)
  assert np.all(np.isfinite(grads["weights"][...])) and np.any(grads["weights"][...] != 0)


def test_nn_rnn_seq_lengths_checks_follow_flax():
  """Float lengths: Flax's TypeError where it indexes with them (a reverse
  direction, the returned carry, Bidirectional), accepted where it ignores
  them. Lengths of another batch shape: a ValueError naming seq_lengths
  (Flax's broadcasting ValueError where it reads them); a scalar broadcasts."""
  cell = nnx.LSTMCell(3, 4, rngs=nnx.Rngs(0))
  x = randn(20, (3, 5, 3), jnp.float32)
  lens = jnp.asarray([5, 3, 2], jnp.int32)
  floats = lens.astype(jnp.float32)
  for kwargs in (dict(reverse=True), dict(return_carry=True)):
    for cls in (jnn.RNN, nnx.RNN):
      with pytest.raises(TypeError, match="seq_lengths must be integers" if cls is jnn.RNN
                         else "integer"):
        cls(cell)(x, seq_lengths=floats, **kwargs)
      with pytest.raises(ValueError, match=r"seq_lengths must have the inputs' batch shape "
                                           r"\(3,\).*got shape \(2,\)" if cls is jnn.RNN
                         else "broadcast"):
        cls(cell)(x, seq_lengths=lens[:2], **kwargs)
  for cls in (jnn.Bidirectional, nnx.Bidirectional):
    with pytest.raises(TypeError):
      cls(jnn.RNN(cell), jnn.RNN(cell))(x, seq_lengths=floats)
  nnx.RNN(cell)(x, seq_lengths=floats)  # forward, no carry: Flax ignores the lengths
  np.testing.assert_array_equal(jnn.RNN(cell)(x, seq_lengths=floats),
                                jnn.RNN(cell)(x, seq_lengths=lens))
  with pytest.raises(ValueError, match="seq_lengths must have the inputs' batch shape"):
    jnn.RNN(cell)(x, seq_lengths=lens[:2])
  got, want = (m(cell, return_carry=True)(x, seq_lengths=jnp.asarray(3))
               for m in (jnn.RNN, nnx.RNN))
  for a, b in zip(jax.tree.leaves(got[0]), jax.tree.leaves(want[0])):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("cell,carry,error,match", [
    ("LSTMCell", ((3, 5), (3, 5)), TypeError,
     r"\(c, h\), each of shape \(3, 4\), a LSTMCell's carry.*got 2 arrays of shapes "
     r"\(\(3, 5\), \(3, 5\)\)"),
    ("LSTMCell", ((4, 4), (4, 4)), TypeError, r".*got 2 arrays of shapes \(\(4, 4\), \(4, 4\)\)"),
    ("LSTMCell", (3, 4), ValueError, r"\(c, h\).*got an array of shape \(3, 4\)"),
    ("LSTMCell", ((3, 4),) * 3, ValueError, ".*got 3 arrays of shapes"),
    ("GRUCell", (3, 5), TypeError, r"an array of shape \(3, 4\), a GRUCell's carry.*got an "
                                   r"array of shape \(3, 5\)"),
    ("SimpleCell", ((3, 4),) * 2, ValueError, r"an array of shape \(3, 4\), a SimpleCell's"),
])
def test_nn_rnn_bad_initial_carry_raises(cell, carry, error, match):
  """The exception type Flax's cells raise (lax's TypeError for a carry of
  the wrong shape, a ValueError for the wrong structure), with a message
  naming initial_carry, its shapes and the expected ones."""
  cell = CELLS[cell](3, 4, rngs=nnx.Rngs(0))
  x = randn(21, (3, 5, 3), jnp.float32)
  carry = (jnp.zeros(carry) if isinstance(carry[0], int)
           else tuple(jnp.zeros(shape) for shape in carry))
  with pytest.raises(error, match="RNN: initial_carry must be " + match):
    jnn.RNN(cell)(x, initial_carry=carry)
  with pytest.raises(error):
    nnx.RNN(cell)(x, initial_carry=carry)


def test_nn_rnn_fp32_error_within_flax(device):
  """fp32 RNN(LSTMCell, reverse=True), outputs and gradients against float64
  under the tolerance rule, Flax's fp32 run on the same device the
  baseline: with one row Flax's products are exact fp32 (XLA's
  vector-matrix products) and so are ours; with three both are TF32 on a
  GPU."""
  cell = nnx.LSTMCell(8, 32, rngs=nnx.Rngs(0))
  graph, params = nnx.split(cell)
  leaves, tree = jax.tree.flatten(params)

  def run(cls):
    def fn(x, c, h, *leaves):
      module = cls(nnx.merge(graph, jax.tree.unflatten(tree, leaves)), reverse=True,
                   keep_order=True)
      return module(x, initial_carry=(c, h))
    return fn

  for batch in (1, 3):
    x = randn(22, (batch, 16, 8), jnp.float32)
    c, h = (randn(k, (batch, 32), jnp.float32, scale=0.5) for k in (23, 24))
    check_fwd_bwd(device, run(jnn.RNN), run(nnx.RNN), (x, c, h, *leaves), jnp.float32,
                  key=25, what=f"batch {batch}")


def test_relu_nan_propagates_as_the_peers(device):
  """The ReLU RNN: a NaN in one step of one row's input makes that row's
  outputs NaN from that step on and its final state NaN, as jax.nn.relu
  in Flax's SimpleCell and the per-step reference (jnp.maximum); a NaN
  cotangent where relu's input is negative gives a zero gradient, as
  jax.nn.relu's where(z > 0, g, 0)."""
  tol = 1e-2 if device.platform == "gpu" else 1e-5  # TF32 on the GPU (test_kernel_nn_rnn...)
  graph, params = nnx.split(nnx.SimpleCell(3, 4, activation_fn=jax.nn.relu, rngs=nnx.Rngs(0)))
  x = randn(26, (3, 6, 3), jnp.float32).at[1, 2, 0].set(jnp.nan)
  carry = randn(27, (3, 4), jnp.float32, scale=0.5)
  run = lambda cls: jax.jit(lambda p, x, c: cls(nnx.merge(graph, p), return_carry=True)(
      x, initial_carry=c))
  c1, y1 = run(jnn.RNN)(params, x, carry)
  c2, y2 = run(nnx.RNN)(params, x, carry)
  assert np.all(np.isnan(y1[1, 2:])) and np.all(np.isnan(c1[1]))
  np.testing.assert_array_equal(np.isnan(y1), np.isnan(y2))
  np.testing.assert_allclose(y1, y2, rtol=tol, atol=tol)
  np.testing.assert_allclose(c1, c2, rtol=tol, atol=tol)

  x, h_0, _, w = _problem("rnn_relu", 3, 6, 3, 4, key=28)
  lens = jnp.asarray([6, 6, 4], jnp.int32)
  op = lambda x: jax_dnn.rnn(x, h_0, w, lens, 3, 4, 1, 0.0, False, nonlinearity="relu")[0]
  naive = lambda x: _naive("rnn_relu", x, h_0, None, w, lens, 3, 4, 1, False)[0]
  xn = x.at[0, 3, 1].set(jnp.nan)
  got, want = jax.jit(op)(xn), naive(xn)
  assert np.all(np.isnan(got[0, 3:])) and not np.any(np.isnan(got[1:]))
  np.testing.assert_allclose(got, want, rtol=tol, atol=tol)

  x = randn(29, (3, 6, 3), jnp.float32)
  _, y = run(nnx.RNN)(params, x, carry)
  dead = tuple(int(i[0]) for i in np.nonzero(np.asarray(y) == 0))  # relu's input < 0 there
  dy = jnp.ones_like(y).at[dead].set(jnp.nan)
  vjp = lambda cls: jax.jit(lambda p, x, c, dy: jax.vjp(
      lambda p, x, c: run(cls)(p, x, c)[1], p, x, c)[1](dy))(params, x, carry, dy)
  for a, b in zip(jax.tree.leaves(vjp(jnn.RNN)), jax.tree.leaves(vjp(nnx.RNN))):
    assert np.all(np.isfinite(a)) and np.all(np.isfinite(b))
    np.testing.assert_allclose(a, b, rtol=tol, atol=tol)


# --- GPU: the kernels ------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", ["lstm", "gru", "rnn_tanh", "rnn_relu"])
def test_kernels_against_the_per_step_reference(gpu, mode, dtype):
  """Two bidirectional layers, ragged lengths (0 and T among them), odd
  sizes: values and gradients of every input under the tolerance rule, the
  outputs in poisoned buffers. (The reference path's CPU cases:
  test_against_per_step_reference, test_low_precision_reference_path.)"""
  inputs, hidden, layers, batch, steps = 5, 24, 2, 6, 9
  x, h_0, c_0, w = _problem(mode, batch, steps, inputs, hidden, layers, True, dtype=dtype, key=70)
  if mode == "rnn_relu":  # unit-scale weights grow a ReLU RNN's h past fp16's range in 9 steps
    w = (w * 0.2).astype(dtype)
  lens = _lens(batch, steps)
  static = (inputs, hidden, layers, True)
  # check_fwd_bwd takes one output: y, h_n (and c_n) flattened into one.
  flat = lambda outs: jnp.concatenate([o.reshape(-1) for o in outs])
  if mode == "lstm":
    args = (x, h_0, c_0, w)
    ours = lambda x, h, c, w: flat(_ours(mode, x, h, c, w, lens, *static))
    naive = lambda x, h, c, w: flat(_naive(mode, x, h, c, w, lens, *static))
  else:
    args = (x, h_0, w)
    ours = lambda x, h, w: flat(_ours(mode, x, h, None, w, lens, *static))
    naive = lambda x, h, w: flat(_naive(mode, x, h, None, w, lens, *static))
  check_fwd_bwd(gpu, ours, naive, args, dtype, key=71, what=mode)


@pytest.mark.gpu
@pytest.mark.parametrize("hidden", [64, 256, 1024])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_kernel_long_sequences(gpu, hidden, dtype):
  """T = 2048: the kernel's error against the f64 reference is bounded by the
  rule with the same-dtype run of the per-step reference as the baseline."""
  del gpu
  batch, steps = 4, 2048
  x, h_0, c_0, w = _problem("lstm", batch, steps, hidden, hidden, 1, False, dtype=dtype, key=80)
  w = (w * (1.0 / np.sqrt(hidden))).astype(dtype)  # a NumPy scalar would promote bf16 to f32
  lens = jnp.asarray([steps, 1000, 1, 0], jnp.int32)
  static = (hidden, hidden, 1, False)
  out = jax.jit(lambda *a: _ours("lstm", *a, lens, *static))(x, h_0, c_0, w)
  naive = jax.jit(lambda *a: _naive("lstm", *a, lens, *static))
  ref = f64(lambda *a: _naive("lstm", *a[:4], a[4], *static), x, h_0, c_0, w, lens)
  same = naive(x, h_0, c_0, w)
  for o, r, s in zip(out, ref, same):
    assert_rule(o, r, s, dtype)


@pytest.mark.gpu
def test_kernel_nn_rnn_matches_flax(gpu):
  del gpu
  for cls in CELLS.values():
    cell = cls(32, 64, rngs=nnx.Rngs(0))
    x = randn(90, (8, 33, 32), jnp.float32)
    carry = _carry(cell, 8, 91)
    lens = jnp.asarray([33, 1, 0, 17, 32, 5, 33, 2], jnp.int32)
    mask = _valid(lens, x.shape)
    c1, y1 = jnn.RNN(cell)(x, initial_carry=carry, seq_lengths=lens, return_carry=True)
    c2, y2 = nnx.RNN(cell)(x, initial_carry=carry, seq_lengths=lens, return_carry=True)
    # fp32 runs TF32 tensor cores in the recurrence: 1e-2 covers 33 steps of
    # TF32's 2^-11 relative error in each matmul.
    np.testing.assert_allclose(y1 * mask, y2 * mask, rtol=1e-2, atol=1e-2)
    rows = np.asarray(lens) > 0
    for a, b in zip(jax.tree.leaves(_rows(c1, rows)), jax.tree.leaves(_rows(c2, rows))):
      np.testing.assert_allclose(a, b, rtol=1e-2, atol=1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_kernel_packed_directions_match_one_launch_each(gpu, kind):
  """Two directions in one launch (rnn_plan's directions=2, U = 16 at H =
  768) against one launch a direction (U = 8), bf16, ragged: the two differ
  only in the fp32 sums' order (each block starts its K slices elsewhere),
  so they agree to a few bf16 roundings after 64 steps."""
  del gpu
  steps, batch, hidden = 64, 16, 768
  plan = rec.plan_for(KINDS[kind], jnp.bfloat16, steps, batch, hidden, directions=2)
  assert plan.supported and plan.directions == 2 and plan.units == 16
  lens = jnp.asarray([64, 0, 1, 63, 30, 64, 2, 17] * 2, jnp.int32)
  for a, b in _packed_against_split(KINDS[kind], jnp.bfloat16, steps, batch, hidden, lens,
                                    key=95):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    if b.size == 0:  # c0 / c_n of a GRU
      assert a.shape == b.shape
      continue
    assert np.all(np.isfinite(a))
    scale = np.max(np.abs(b)) + 1e-6
    assert np.max(np.abs(a - b)) <= 3e-2 * scale, (np.max(np.abs(a - b)), scale)


@pytest.mark.gpu
def test_kernel_nn_bidirectional_matches_flax(gpu):
  """Two LSTM cells in one launch (both directions side by side) against
  Flax's two scans, fp32 (TF32 in the recurrence: the tolerance of
  test_kernel_nn_rnn_matches_flax)."""
  del gpu
  fwd = nnx.LSTMCell(32, 64, rngs=nnx.Rngs(0))
  bwd = nnx.OptimizedLSTMCell(32, 64, rngs=nnx.Rngs(1))
  x = randn(92, (8, 33, 32), jnp.float32)
  lens = jnp.asarray([33, 1, 0, 17, 32, 5, 33, 2], jnp.int32)
  carry = (_carry(fwd, 8, 93), _carry(bwd, 8, 94))
  mask = _valid(lens, x.shape)
  c1, y1 = jnn.Bidirectional(jnn.RNN(fwd), jnn.RNN(bwd), return_carry=True)(
      x, initial_carry=carry, seq_lengths=lens)
  c2, y2 = nnx.Bidirectional(nnx.RNN(fwd), nnx.RNN(bwd), return_carry=True)(
      x, initial_carry=carry, seq_lengths=lens)
  np.testing.assert_allclose(y1 * mask, y2 * mask, rtol=1e-2, atol=1e-2)
  rows = np.asarray(lens) > 0
  for a, b in zip(jax.tree.leaves(_rows(c1, rows)), jax.tree.leaves(_rows(c2, rows))):
    np.testing.assert_allclose(a, b, rtol=1e-2, atol=1e-2)
