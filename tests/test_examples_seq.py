"""The sequence examples (examples/train_lstm_lm.py, train_transformer.py and
their data, examples/text_data.py) at size tiny on CPU: the data loads with
the network cut, the loss falls, --backend xla agrees with jax_dnn step by
step from the same parameters, padding and packing are masked, and the data
parallel step matches the one-device step."""

import importlib.util
import pathlib
import re
import socket

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_dnn

_EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"


def _load(name):
  spec = importlib.util.spec_from_file_location(f"examples_{name}", _EXAMPLES / f"{name}.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


lstm_lm = _load("train_lstm_lm")
transformer = _load("train_transformer")
text_data = lstm_lm.text_data  # the module the examples import

# Losses of the two backends after the same steps on the same batches, from
# the same parameters. float32: both compute the same math, the order of
# sums aside (measured gap <= 1e-6 over 8 steps). bfloat16: the backends round
# at different places (jax_dnn's recurrence keeps its state in fp32, Flax's
# cell rounds each gate to bf16; attention's softmax likewise); the measured
# gap is <= 6e-4 over 8 steps, and 5e-3 is 8x that while well below bf16's
# unit roundoff at these losses (2^-8 * 4 = 0.016), which a systematic
# difference would reach.
_TOLERANCE = {"float32": 1e-4, "bfloat16": 5e-3}
_STEPS = 8


def _losses(module, backend, dtype, **overrides):
  step, state, _ = module.make_step(backend, "tiny", dtype=dtype, **overrides)
  data = module.batches("tiny")
  losses = []
  for _ in range(_STEPS):
    state, loss = step(state, next(data))
    losses.append(float(loss))
  return np.array(losses)


def _check_backends_agree(module, dtype, **overrides):
  ours = _losses(module, "jax_dnn", dtype, **overrides)
  flax = _losses(module, "xla", dtype, **overrides)
  assert np.all(np.isfinite(ours))
  # From ln 256 = 5.55, 8 adamw steps learn at least the bytes' frequencies.
  assert ours[-2:].mean() < ours[0] - 0.3, ours
  np.testing.assert_allclose(ours, flax, rtol=0, atol=_TOLERANCE[dtype])


def _params(model):
  return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def _check_same_params(module, **overrides):
  ours, _, _ = module.build("jax_dnn", "tiny", **overrides)
  flax, _, _ = module.build("xla", "tiny", **overrides)
  ours, flax = _params(ours), _params(flax)
  assert jax.tree.structure(ours) == jax.tree.structure(flax)
  jax.tree.map(np.testing.assert_array_equal, ours, flax)


def _two_device_mesh():
  return jax.make_mesh((2,), ("data",), devices=jax.devices("cpu")[:2])


def _check_data_parallel(module):
  """Two steps on a 2-device mesh (batch split) give the one-device losses."""
  losses = []
  for mesh in (None, _two_device_mesh()):
    step, state, batch = module.make_step("jax_dnn", "tiny", mesh=mesh, dtype="float32")
    state, first = step(state, batch)
    state, second = step(state, batch)
    losses.append([float(first), float(second)])
  # fp32; only the order of the gradient sums differs.
  np.testing.assert_allclose(losses[0], losses[1], rtol=1e-5)


# --- data ------------------------------------------------------------------


def test_text_data_loads_offline(monkeypatch):
  def refuse(*args, **kwargs):
    raise OSError("network access in a test of offline data")

  monkeypatch.setattr(socket.socket, "connect", refuse)
  monkeypatch.setattr(socket, "create_connection", refuse)
  text_data.documents.cache_clear()
  train, validation = text_data.documents("train"), text_data.documents("validation")
  assert len(train) > 100 and len(validation) > 10
  assert sum(d.size for d in train) > 1_000_000
  assert all(d.dtype == np.uint8 for d in train + validation)
  files = text_data.stdlib_files()
  assert files == sorted(files) and all(f.suffix == ".py" for f in files)
  # No file in both splits.
  assert not {d.tobytes() for d in train} & {d.tobytes() for d in validation}


def test_ragged_batch_is_well_formed():
  rng = np.random.default_rng(0)
  b = text_data.ragged_batch(rng, text_data.documents("train"), 16, 40)
  lens = b["seq_lengths"]
  assert b["tokens"].shape == b["targets"].shape == (16, 40) and lens.shape == (16,)
  assert lens.min() >= 10 and lens.max() <= 40 and len(set(lens.tolist())) > 1
  for row, n in enumerate(lens):
    np.testing.assert_array_equal(b["tokens"][row, 1:n], b["targets"][row, :n - 1])
    assert not b["tokens"][row, n:].any() and not b["targets"][row, n:].any()


def test_packed_batch_is_well_formed():
  rng = np.random.default_rng(0)
  b = text_data.packed_batch(rng, text_data.documents("train"), 8, 64)
  seg, pos, w = b["segment_ids"], b["positions"], b["weights"]
  assert seg.max() > 2  # several excerpts a row
  for row in range(8):
    for s in set(seg[row].tolist()) - {0}:
      idx = np.flatnonzero(seg[row] == s)
      assert np.all(np.diff(idx) == 1)  # a segment is contiguous
      np.testing.assert_array_equal(pos[row, idx], np.arange(idx.size))
      # The next byte within the segment is the target; the last has no loss.
      np.testing.assert_array_equal(b["targets"][row, idx[:-1]], b["tokens"][row, idx[1:]])
      np.testing.assert_array_equal(w[row, idx], [1.0] * (idx.size - 1) + [0.0])
    assert not w[row][seg[row] == 0].any()


# --- the LSTM language model -------------------------------------------------


@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_lstm_lm_parameter_trees_equal(cell):
  _check_same_params(lstm_lm, cell=cell)


@pytest.mark.parametrize("cell, dtype", [("lstm", "bfloat16"), ("gru", "float32")])
def test_lstm_lm_backends_agree(cell, dtype):
  _check_backends_agree(lstm_lm, dtype, cell=cell)


def test_lstm_lm_cudnn_backend_is_the_same_lstm():
  """--backend cudnn: the cells' parameters packed into jax.experimental.rnn's
  flat layout give the scan's outputs at every valid step (fp32; on CPU the
  module's lstm_ref), and the model trains to the xla backend's losses;
  GRU cells are refused (that module has the LSTM only)."""
  cell = nnx.OptimizedLSTMCell(5, 7, rngs=nnx.Rngs(0))
  cell.dense_h.bias[...] = jax.random.normal(jax.random.key(3), cell.dense_h.bias[...].shape)
  x = jax.random.normal(jax.random.key(1), (3, 6, 5))
  lengths = jnp.array([6, 2, 0])
  ours = lstm_lm.CudnnLSTM(cell, rngs=nnx.Rngs(0))(x, seq_lengths=lengths)
  flax = nnx.RNN(cell, rngs=nnx.Rngs(0))(x, seq_lengths=lengths)
  valid = np.arange(6)[None, :] < np.asarray(lengths)[:, None]
  np.testing.assert_allclose(np.asarray(ours)[valid], np.asarray(flax)[valid], rtol=0, atol=1e-6)
  np.testing.assert_allclose(_losses(lstm_lm, "cudnn", "float32"),
                             _losses(lstm_lm, "xla", "float32"), rtol=0,
                             atol=_TOLERANCE["float32"])
  with pytest.raises(ValueError, match="has the LSTM only"):
    lstm_lm.build("cudnn", "tiny", cell="gru")


@pytest.mark.parametrize("backend", ["jax_dnn", "xla"])
def test_lstm_lm_padding_is_masked(backend):
  model, _, _ = lstm_lm.build(backend, "tiny", dtype="float32")
  batch = next(lstm_lm.batches("tiny"))
  loss = float(lstm_lm.loss_fn(model, batch))
  rng = np.random.default_rng(1)
  padded = np.arange(batch["tokens"].shape[1])[None, :] >= batch["seq_lengths"][:, None]
  assert padded.any()
  noisy = dict(batch)
  for key in ("tokens", "targets"):
    noisy[key] = np.where(padded, rng.integers(0, 256, padded.shape), batch[key])
  assert float(lstm_lm.loss_fn(model, noisy)) == loss
  # ... while a valid step counts.
  changed = dict(batch, targets=batch["targets"].copy())
  changed["targets"][0, 0] = (changed["targets"][0, 0] + 1) % 256
  assert float(lstm_lm.loss_fn(model, changed)) != loss


@pytest.mark.parametrize("backend", ["jax_dnn", "xla"])
def test_lstm_lm_sampling_steps_match_the_model(backend):
  """The step-by-step cells (sampling) give the layers' log-probabilities."""
  model, _, _ = lstm_lm.build(backend, "tiny", dtype="float32")
  tokens = jnp.asarray(next(lstm_lm.batches("tiny"))["tokens"][:2, :12])
  whole = model(tokens)
  carries, steps = model.initial_carries(2), []
  for t in range(tokens.shape[1]):
    carries, logp = model.step(carries, tokens[:, t])
    steps.append(logp)
  np.testing.assert_allclose(jnp.stack(steps, axis=1), whole, rtol=1e-5, atol=1e-5)
  text = lstm_lm.generate(model, b"def ", 16)
  assert text.startswith("def ") and len(text.encode("utf-8", "replace")) >= 16
  assert text == lstm_lm.generate(model, b"def ", 16)  # greedy is deterministic


def test_lstm_lm_data_parallel():
  _check_data_parallel(lstm_lm)


def test_lstm_lm_main(capsys):
  loss = lstm_lm.main(["--size", "tiny", "--steps", "3", "--log-every", "1",
                       "--sample-every", "3", "--sample-length", "8", "--eval-batches", "1"])
  out = capsys.readouterr().out
  assert np.isfinite(loss) and "step time" in out and "sample (temperature 0.8)" in out
  assert "validation loss" in out


def test_train_chains_states_and_calls_every_in_order(capsys):
  """text_training.train keeps a step queued behind the one it reads: each
  step still takes the state the step before returned, `every` sees each
  step's state before the next step takes it over, and every loss counts."""
  step = jax.jit(lambda state, batch: (state + 1, state * 10.0 + batch["x"]),
                 donate_argnums=0)
  seen = []
  data = ({"x": np.float32(i % 3)} for i in range(100))
  state, final = lstm_lm.text_training.train(
      step, jnp.float32(0), data, jax.device_put, steps=6, log_every=2,
      every=lambda i, s: seen.append((i, float(s))))
  assert float(state) == 6.0 and seen == [(i, i + 1.0) for i in range(6)]
  assert final == pytest.approx(np.mean([10 * i + i % 3 for i in range(6)]))
  out = capsys.readouterr().out
  assert "step     4  loss 41.0000" in out and "step time" in out


# --- the Transformer -----------------------------------------------------------


@pytest.mark.parametrize("norm", ["rms", "layer"])
def test_transformer_parameter_trees_equal(norm):
  _check_same_params(transformer, norm=norm)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_transformer_backends_agree(dtype):
  _check_backends_agree(transformer, dtype)


@pytest.mark.parametrize("backend", ["jax_dnn", "xla"])
def test_transformer_packing_does_not_leak(backend):
  """Rewriting one excerpt of a packed row leaves the others' losses alone."""
  model, _, _ = transformer.build(backend, "tiny", dtype="float32")
  batch = next(transformer.batches("tiny"))
  seg = batch["segment_ids"]
  assert seg[0].max() >= 2  # row 0 packs more than one excerpt
  first = seg == 1
  first[1:] = False  # row 0's first excerpt
  rng = np.random.default_rng(1)
  changed = dict(batch)
  changed["tokens"] = np.where(first, rng.integers(0, 256, first.shape), batch["tokens"])
  before = np.asarray(transformer.token_losses(model, batch))
  after = np.asarray(transformer.token_losses(model, changed))
  others = ~first & (seg > 0)
  np.testing.assert_allclose(after[others], before[others], rtol=1e-6, atol=1e-6)
  assert np.abs(after[first] - before[first]).max() > 1e-3


def test_transformer_data_parallel():
  _check_data_parallel(transformer)


def test_transformer_main(capsys):
  loss = transformer.main(["--size", "tiny", "--steps", "3", "--log-every", "1",
                           "--backend", "xla", "--norm", "layer", "--eval-batches", "1"])
  out = capsys.readouterr().out
  assert np.isfinite(loss) and "step time" in out and "step     2" in out
  assert "validation loss" in out


# --- on a GPU the steps run jax_dnn's kernels ----------------------------------


@pytest.mark.skipif(not jax_dnn.has_cuda_kernels(),
                    reason="lowering to the kernels needs the extension built with CUDA")
@pytest.mark.parametrize("name, overrides, ops", [
    ("lstm_lm", {"cell": "lstm"}, ["rnn", "softmax"]),
    ("lstm_lm", {"cell": "gru"}, ["rnn", "softmax"]),
    ("transformer", {"norm": "rms"}, ["attention", "bias_act", "rms_norm", "softmax"]),
    ("transformer", {"norm": "layer"}, ["attention", "bias_act", "layer_norm", "softmax"]),
])
def test_cuda_lowering_of_the_step_calls_the_kernels(name, overrides, ops):
  """The jax_dnn step lowered for CUDA calls each op's forward and backward
  kernel (none of them falls back to its reference)."""
  module = {"lstm_lm": lstm_lm, "transformer": transformer}[name]
  step, state, batch = module.make_step("jax_dnn", "tiny", **overrides)
  text = step.trace(state, batch).lower(lowering_platforms=("cuda",)).as_text()
  called = set(re.findall(r"@jax_dnn_(\w+)_(?:fwd|bwd)\b", text))
  assert called == set(ops)
  for op in ops:
    assert f"@jax_dnn_{op}_fwd" in text and f"@jax_dnn_{op}_bwd" in text
