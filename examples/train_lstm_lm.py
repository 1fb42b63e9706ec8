"""A character-level language model on the Python standard library's source:
byte embedding -> stacked LSTM (or GRU) layers -> projection to 256 logits.
Prints a falling loss, the step time and text sampled from the model.

    python examples/train_lstm_lm.py                      # jax_dnn, size small
    python examples/train_lstm_lm.py --backend xla        # flax.nnx.RNN's scan
    python examples/train_lstm_lm.py --backend cudnn      # jax.experimental.rnn.lstm
    python examples/train_lstm_lm.py --size tiny --steps 200 --cell gru

Each layer is jax_dnn.nn.RNN over a Flax cell (nnx.OptimizedLSTMCell or
nnx.GRUCell): the cell holds the parameters and jax_dnn runs the whole
sequence as one recurrence. `--backend xla` wraps the same cells in
flax.nnx.RNN (a scan over the cell), so both backends start from the same
parameter tree and values. `--backend cudnn` (LSTM only) runs each layer as
jax.experimental.rnn.lstm, JAX's cuDNN path, on the same cells' parameters
packed into its flat layout; it takes fp32 only, so those layers compute in
fp32 whatever --dtype says (on a machine without a GPU it runs that module's
reference scan, lstm_ref). Sequences are ragged (text_data.ragged_batch):
each row has its own length, the recurrence takes them as seq_lengths and
padded steps carry no loss. Samples run the cells step by step (greedy and
at a temperature), which is the same computation as the RNN layers.

Letters: B batch, T steps, E embedding width, H hidden width, V = 256 bytes.
"""

from __future__ import annotations

import argparse
import functools
import pathlib
import sys

from flax import nnx
import jax
from jax.experimental import rnn as jax_rnn
import jax.numpy as jnp
import numpy as np

import jax_dnn
import jax_dnn.nn

_HERE = str(pathlib.Path(__file__).resolve().parent)
if _HERE not in sys.path:  # text_data.py sits beside this file
  sys.path.insert(0, _HERE)
import text_data  # pylint: disable=g-import-not-at-top,wrong-import-position
import text_training  # pylint: disable=g-import-not-at-top,wrong-import-position

SIZES = {
    # CPU CI: a few seconds to compile, well under a second a step.
    "tiny": {"batch": 8, "steps": 32, "embed": 16, "hidden": 32, "layers": 2,
             "learning_rate": 1e-2},
    "small": {"batch": 64, "steps": 128, "embed": 128, "hidden": 512, "layers": 2,
              "learning_rate": 2e-3},
    # The benchmark size: batch 64 x 256 steps, hidden 1024.
    "realistic": {"batch": 64, "steps": 256, "embed": 512, "hidden": 1024, "layers": 2,
                  "learning_rate": 1e-3},
}

CELLS = {"lstm": nnx.OptimizedLSTMCell, "gru": nnx.GRUCell}
# The backends make_step takes (jax_dnn.benchmark.models times each).
BACKENDS = ("jax_dnn", "xla", "cudnn")


class CudnnLSTM(nnx.RNN):
  """flax.nnx.RNN over an nnx.OptimizedLSTMCell whose sequence runs as
  jax.experimental.rnn.lstm: the cell keeps the parameters (the other
  backends' tree), packed here into cuDNN's flat layout (W_ih [4H, I],
  W_hh [4H, H], b_ih, b_hh; gates i, f, g, o, as the cell splits them) in
  fp32, the one dtype that op takes. Zero initial carry, as Flax's default."""

  def __call__(self, inputs, *, seq_lengths=None):
    cell = self.cell
    batch, steps, features = inputs.shape
    hidden = cell.hidden_features
    f32 = jnp.float32
    k_h, b_h = cell.dense_h.kernel[...].astype(f32), cell.dense_h.bias[...].astype(f32)
    weights = jnp.concatenate([cell.dense_i.kernel[...].astype(f32).T.ravel(), k_h.T.ravel(),
                               jnp.zeros_like(b_h), b_h])
    zeros = jnp.zeros((1, batch, hidden), f32)
    lengths = (jnp.full((batch,), steps, jnp.int32) if seq_lengths is None
               else jnp.asarray(seq_lengths).astype(jnp.int32))
    shape = dict(input_size=features, hidden_size=hidden, num_layers=1, dropout=0.0,
                 bidirectional=False)
    x = inputs.astype(f32)
    if jax.default_backend() == "gpu":
      y, _, _ = jax_rnn.lstm(x, zeros, zeros, weights, lengths, **shape)
    else:  # jax.experimental.rnn.lstm lowers for CUDA only
      w_ih, w_hh, b_ih, b_hh = jax_rnn.unpack_lstm_weights(
          weights, features, hidden, 1, False)
      y, _, _ = jax_rnn.lstm_ref(x, zeros, zeros, w_ih, w_hh, b_ih, b_hh, lengths, **shape)
    return y.astype(cell.dtype or inputs.dtype)


class CharRNN(nnx.Module):
  """Embedding -> `layers` recurrent layers -> Linear to V logits."""

  def __init__(self, *, backend: str, cell: str, embed: int, hidden: int, layers: int,
               dtype, rngs: nnx.Rngs):
    # jax_dnn.nn.RNN subclasses nnx.RNN and takes the same cell, so the two
    # backends build identical parameter trees from the same rngs.
    rnn = {"jax_dnn": jax_dnn.nn.RNN, "xla": nnx.RNN, "cudnn": CudnnLSTM}[backend]
    self.log_softmax = jax_dnn.log_softmax if backend == "jax_dnn" else jax.nn.log_softmax
    self.embed = nnx.Embed(text_data.VOCAB, embed, dtype=dtype, rngs=rngs)
    widths = [embed] + [hidden] * layers
    self.layers = nnx.List([
        rnn(CELLS[cell](widths[i], hidden, dtype=dtype, rngs=rngs), rngs=rngs)
        for i in range(layers)])
    self.head = nnx.Linear(hidden, text_data.VOCAB, dtype=dtype, rngs=rngs)

  def __call__(self, tokens, seq_lengths=None):
    """tokens [B, T] int -> log-probabilities [B, T, V] float32."""
    x = text_training.embed_bytes(self.embed, tokens)
    for layer in self.layers:
      x = layer(x, seq_lengths=seq_lengths)
    return self.log_softmax(self.head(x).astype(jnp.float32))

  def step(self, carries, token):
    """One step through the cells: token [B] -> (carries, log-probs [B, V])."""
    x = text_training.embed_bytes(self.embed, token)
    new = []
    for layer, carry in zip(self.layers, carries):
      carry, x = layer.cell(carry, x)
      new.append(carry)
    return new, self.log_softmax(self.head(x).astype(jnp.float32))

  def initial_carries(self, batch: int):
    return [layer.cell.initialize_carry((batch, layer.cell.in_features), layer.rngs)
            for layer in self.layers]


def loss_fn(model: CharRNN, batch) -> jax.Array:
  """Mean next-byte cross-entropy over the valid steps (t < seq_lengths)."""
  logp = model(batch["tokens"], batch["seq_lengths"])
  nll = -jnp.take_along_axis(logp, batch["targets"][..., None], axis=-1)[..., 0]
  steps = batch["tokens"].shape[1]
  valid = jnp.arange(steps)[None, :] < batch["seq_lengths"][:, None]
  return jnp.sum(jnp.where(valid, nll, 0.0)) / jnp.maximum(jnp.sum(valid), 1)


def _config(size, global_batch, overrides):
  if size not in SIZES:
    raise ValueError(f"size must be one of {sorted(SIZES)}, got {size!r}")
  cfg = dict(SIZES[size], cell="lstm")
  unknown = set(overrides) - set(cfg)
  if unknown:
    raise TypeError(f"unknown hyper-parameters {sorted(unknown)}; known: {sorted(cfg)}")
  cfg.update(overrides)
  if global_batch is not None:
    cfg["batch"] = global_batch
  return cfg


def build(backend: str, size: str = "tiny", *, seed: int = 0, dtype: str = "bfloat16",
          **overrides):
  """(model, optimizer, config) for a backend and size."""
  if backend not in BACKENDS:
    raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
  cfg = _config(size, None, overrides)
  if backend == "cudnn" and cfg["cell"] != "lstm":
    raise ValueError("backend 'cudnn' (jax.experimental.rnn) has the LSTM only, "
                     f"not cell={cfg['cell']!r}")
  # bf16 compute, fp32 parameters (each layer's param_dtype default).
  model = CharRNN(backend=backend, cell=cfg["cell"], embed=cfg["embed"], hidden=cfg["hidden"],
                  layers=cfg["layers"], dtype=jnp.dtype(dtype), rngs=nnx.Rngs(seed))
  return model, text_training.adamw_optimizer(model, cfg["learning_rate"]), cfg


def make_step(backend: str, size: str = "tiny", *, global_batch: int | None = None,
              mesh: jax.sharding.Mesh | None = None, seed: int = 0, dtype: str = "bfloat16",
              **overrides):
  """(step, state, batch): see EXAMPLES_CONTRACT. Data parallel over `mesh`'s
  "data" axis: the batch is split, parameters and optimizer state replicated
  (XLA all-reduces the gradients)."""
  return _make_step(backend, size, global_batch=global_batch, mesh=mesh, seed=seed,
                    dtype=dtype, **overrides)[1:]


def _make_step(backend, size, *, global_batch, mesh, seed, dtype, **overrides):
  """make_step's (step, state, batch) after the graphdef of (model, optimizer)."""
  cfg = _config(size, global_batch, overrides)
  model, optimizer, _ = build(backend, size, seed=seed, dtype=dtype, **overrides)
  rng = np.random.default_rng(seed)
  batch = text_data.ragged_batch(rng, text_data.random_documents(rng), cfg["batch"],
                                 cfg["steps"])
  return text_training.jit_step(model, optimizer, loss_fn, batch, mesh)


def batches(size: str = "tiny", *, global_batch: int | None = None, seed: int = 0,
            split: str = "train"):
  """Endless ragged batches of the standard library's source (make_step's structure)."""
  cfg = _config(size, global_batch, {})
  return text_data.stream(text_data.ragged_batch, text_data.documents(split), cfg["batch"],
                          cfg["steps"], seed)


@functools.partial(jax.jit, static_argnums=(0, 3))
def _generate(graphdef, state, prompt, length, temperature, key):
  """prompt [P] int32 -> P + length bytes: the prompt through the cells, then
  `length` samples (greedy where temperature == 0)."""
  model = nnx.merge(graphdef, state)
  carries = model.initial_carries(1)

  def feed(carries, token):
    carries, logp = model.step(carries, token[None])
    return carries, logp[0]

  carries, logps = jax.lax.scan(feed, carries, prompt)

  def sample(loop, key):
    carries, logp = loop
    greedy = jnp.argmax(logp)
    drawn = jax.random.categorical(key, logp / jnp.maximum(temperature, 1e-6))
    token = jnp.where(temperature > 0, drawn, greedy).astype(jnp.int32)
    carries, logp = feed(carries, token)
    return (carries, logp), token

  _, tokens = jax.lax.scan(sample, (carries, logps[-1]), jax.random.split(key, length))
  return jnp.concatenate([prompt, tokens])


def generate(model: CharRNN, prompt: bytes, length: int, temperature: float = 0.0,
             seed: int = 0) -> str:
  graphdef, state = nnx.split(model)
  out = _generate(graphdef, state, jnp.asarray(np.frombuffer(prompt, np.uint8), jnp.int32),
                  length, jnp.float32(temperature), jax.random.key(seed))
  return bytes(np.asarray(out, np.uint8)).decode("utf-8", errors="replace")


def main(argv=None) -> float:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--backend", choices=BACKENDS, default="jax_dnn")
  ap.add_argument("--size", choices=sorted(SIZES), default="small")
  ap.add_argument("--cell", choices=sorted(CELLS), default="lstm")
  ap.add_argument("--steps", type=int, default=500)
  ap.add_argument("--batch", type=int, default=None, help="global batch (default: the size's)")
  ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--log-every", type=int, default=50)
  ap.add_argument("--eval-batches", type=int, default=10,
                  help="validation batches evaluated after training")
  ap.add_argument("--sample-every", type=int, default=250)
  ap.add_argument("--sample-length", type=int, default=200)
  args = ap.parse_args(argv)

  cfg = _config(args.size, args.batch, {})
  mesh, devices = text_training.data_mesh(cfg["batch"])
  print(f"devices: {devices}; jax_dnn kernels built: {jax_dnn.has_cuda_kernels()}")
  print(f"backend {args.backend}, {args.cell} x {cfg['layers']}, hidden {cfg['hidden']}, "
        f"batch {cfg['batch']} x {cfg['steps']} steps, {args.dtype}")
  graphdef, step, state, _ = _make_step(args.backend, args.size, global_batch=args.batch,
                                        mesh=mesh, seed=args.seed, dtype=args.dtype,
                                        cell=args.cell)
  place = text_training.placer(mesh)

  def show_samples(i, state):
    if not args.sample_every or (i + 1) % args.sample_every:
      return
    model, _ = nnx.merge(graphdef, state)
    for temperature in (0.0, 0.8):
      text = generate(model, b"def ", args.sample_length, temperature, seed=args.seed)
      print(f"--- sample (temperature {temperature}) ---\n{text}\n---")

  state, final = text_training.train(step, state,
                                     batches(args.size, global_batch=args.batch, seed=args.seed),
                                     place, steps=args.steps, log_every=args.log_every,
                                     every=show_samples)
  validation = batches(args.size, global_batch=args.batch, seed=args.seed, split="validation")
  loss = text_training.evaluate(loss_fn, graphdef, state, validation, args.eval_batches, place)
  print(f"validation loss ({args.eval_batches} batches of held-out files) {loss:.4f}")
  return final

if __name__ == "__main__":
  main()
