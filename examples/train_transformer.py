"""A small decoder-only Transformer trained on the Python standard library's
source, bytes as tokens, with packed sequences. Prints a falling loss and the
step time.

    python examples/train_transformer.py                  # jax_dnn, size small
    python examples/train_transformer.py --backend xla    # jax.nn / flax.nnx layers
    python examples/train_transformer.py --size tiny --steps 200 --norm layer

Each row of a batch packs several excerpts (text_data.packed_batch), each its
own segment: attention is causal and stays within a segment, positions
restart at each segment's start, and a segment's last byte carries no loss,
so no excerpt sees another. The pieces, jax_dnn / --backend xla:
  attention   jax_dnn.dot_product_attention (is_causal, q/kv_segment_ids) /
              jax.nn.dot_product_attention (is_causal, a mask from the segment ids;
              XLA's attention, or cuDNN's with --xla-attention cudnn on a GPU)
  norms       jax_dnn.nn.RMSNorm or LayerNorm (--norm) / nnx.RMSNorm or nnx.LayerNorm
  MLP         bias + GELU (tanh form) fused by jax_dnn.bias_act / jax.nn.gelu in fp32
  loss        jax_dnn.log_softmax / jax.nn.log_softmax
Everything else (embeddings, linear layers, adamw) is shared, and the
parameter trees of the two backends are the same.

Letters: B batch, T tokens a row, D model width, N heads, Hd head width, V = 256.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

from flax import nnx
import jax
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
    "tiny": {"batch": 4, "seq_len": 64, "dim": 64, "heads": 4, "layers": 2,
             "learning_rate": 3e-3},
    "small": {"batch": 16, "seq_len": 512, "dim": 512, "heads": 8, "layers": 6,
              "learning_rate": 1e-3},
    # The benchmark size: 16k tokens a step (8 x 2048), width 2048, 16 heads of 128.
    "realistic": {"batch": 8, "seq_len": 2048, "dim": 2048, "heads": 16, "layers": 4,
                  "learning_rate": 3e-4},
}

NORMS = {("jax_dnn", "rms"): jax_dnn.nn.RMSNorm, ("jax_dnn", "layer"): jax_dnn.nn.LayerNorm,
         ("xla", "rms"): nnx.RMSNorm, ("xla", "layer"): nnx.LayerNorm}


class Attention(nnx.Module):
  """Causal self-attention within segments; N heads of Hd = D / N."""

  def __init__(self, dim, heads, *, backend, xla_attention, dtype, rngs):
    self.backend, self.heads, self.xla_attention = backend, heads, xla_attention
    self.qkv = nnx.Linear(dim, 3 * dim, use_bias=False, dtype=dtype, rngs=rngs)
    self.out = nnx.Linear(dim, dim, use_bias=False, dtype=dtype, rngs=rngs)

  def __call__(self, x, segment_ids):
    b, t, d = x.shape
    q, k, v = jnp.unstack(self.qkv(x).reshape(b, t, 3, self.heads, d // self.heads), axis=2)
    if self.backend == "jax_dnn":
      o = jax_dnn.dot_product_attention(q, k, v, is_causal=True, q_segment_ids=segment_ids,
                                        kv_segment_ids=segment_ids)
    else:
      # [B, 1, T, T]: query i may see key j of its own segment (padding,
      # segment 0, sees padding; it carries no loss). Never a fully masked
      # row (a token sees itself), where the two attentions would differ.
      mask = (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]
      o = jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True,
                                       implementation=self.xla_attention)
    return self.out(o.reshape(b, t, d))


class MLP(nnx.Module):
  """Linear (no bias) -> bias + GELU -> Linear, 4x wide."""

  def __init__(self, dim, *, backend, dtype, rngs):
    self.backend = backend
    self.up = nnx.Linear(dim, 4 * dim, use_bias=False, dtype=dtype, rngs=rngs)
    self.bias = nnx.Param(jnp.zeros((4 * dim,), jnp.float32))
    self.down = nnx.Linear(4 * dim, dim, dtype=dtype, rngs=rngs)

  def __call__(self, x):
    h = self.up(x)
    if self.backend == "jax_dnn":
      h = jax_dnn.bias_act(h, self.bias[...], activation="gelu_tanh")
    else:  # bias_act's math: the bias add and GELU in fp32, rounded once
      h = jax.nn.gelu(h.astype(jnp.float32) + self.bias[...], approximate=True).astype(h.dtype)
    return self.down(h)


class Block(nnx.Module):
  """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x))."""

  def __init__(self, dim, heads, *, backend, norm, xla_attention, dtype, rngs):
    norm_cls = NORMS[(backend, norm)]
    self.norm1 = norm_cls(dim, dtype=dtype, rngs=rngs)
    self.attn = Attention(dim, heads, backend=backend, xla_attention=xla_attention,
                          dtype=dtype, rngs=rngs)
    self.norm2 = norm_cls(dim, dtype=dtype, rngs=rngs)
    self.mlp = MLP(dim, backend=backend, dtype=dtype, rngs=rngs)

  def __call__(self, x, segment_ids):
    x = x + self.attn(self.norm1(x), segment_ids)
    return x + self.mlp(self.norm2(x))


class Transformer(nnx.Module):
  """Byte and learned position embeddings -> blocks -> norm -> V logits."""

  def __init__(self, *, backend, norm, xla_attention, seq_len, dim, heads, layers, dtype,
               rngs):
    self.log_softmax = {"jax_dnn": jax_dnn.log_softmax, "xla": jax.nn.log_softmax}[backend]
    self.embed = nnx.Embed(text_data.VOCAB, dim, dtype=dtype, rngs=rngs)
    self.pos_embed = nnx.Embed(seq_len, dim, dtype=dtype, rngs=rngs)
    self.blocks = nnx.List([Block(dim, heads, backend=backend, norm=norm,
                                  xla_attention=xla_attention, dtype=dtype, rngs=rngs)
                            for _ in range(layers)])
    self.norm = NORMS[(backend, norm)](dim, dtype=dtype, rngs=rngs)
    self.head = nnx.Linear(dim, text_data.VOCAB, dtype=dtype, rngs=rngs)

  def __call__(self, tokens, segment_ids, positions):
    """tokens, segment_ids, positions [B, T] int -> log-probabilities [B, T, V] fp32."""
    x = text_training.embed_bytes(self.embed, tokens) + self.pos_embed(positions)
    for block in self.blocks:
      x = block(x, segment_ids)
    return self.log_softmax(self.head(self.norm(x)).astype(jnp.float32))


def token_losses(model: Transformer, batch) -> jax.Array:
  """Next-byte cross-entropy of every token [B, T] (padding included)."""
  logp = model(batch["tokens"], batch["segment_ids"], batch["positions"])
  return -jnp.take_along_axis(logp, batch["targets"][..., None], axis=-1)[..., 0]


def loss_fn(model: Transformer, batch) -> jax.Array:
  """Mean cross-entropy over the tokens that have a next byte in their segment."""
  w = batch["weights"]
  return jnp.sum(token_losses(model, batch) * w) / jnp.maximum(jnp.sum(w), 1.0)


def _config(size, global_batch, overrides):
  if size not in SIZES:
    raise ValueError(f"size must be one of {sorted(SIZES)}, got {size!r}")
  # norm: "rms" or "layer"; xla_attention: jax.nn.dot_product_attention's
  # implementation for --backend xla ("xla", or "cudnn" on a GPU).
  cfg = dict(SIZES[size], norm="rms", xla_attention="xla")
  unknown = set(overrides) - set(cfg)
  if unknown:
    raise TypeError(f"unknown hyper-parameters {sorted(unknown)}; known: {sorted(cfg)}")
  cfg.update(overrides)
  if global_batch is not None:
    cfg["batch"] = global_batch
  if cfg["dim"] % cfg["heads"]:
    raise ValueError(f"heads ({cfg['heads']}) must divide dim ({cfg['dim']})")
  return cfg


def build(backend: str, size: str = "tiny", *, seed: int = 0, dtype: str = "bfloat16",
          **overrides):
  """(model, optimizer, config) for a backend and size."""
  if backend not in ("jax_dnn", "xla"):
    raise ValueError(f"backend must be 'jax_dnn' or 'xla', got {backend!r}")
  cfg = _config(size, None, overrides)
  # bf16 compute, fp32 parameters (each layer's param_dtype default).
  model = Transformer(backend=backend, norm=cfg["norm"], xla_attention=cfg["xla_attention"],
                      seq_len=cfg["seq_len"], dim=cfg["dim"], heads=cfg["heads"],
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
  batch = text_data.packed_batch(rng, text_data.random_documents(rng), cfg["batch"],
                                 cfg["seq_len"])
  return text_training.jit_step(model, optimizer, loss_fn, batch, mesh)


def batches(size: str = "tiny", *, global_batch: int | None = None, seed: int = 0,
            split: str = "train"):
  """Endless packed batches of the standard library's source (make_step's structure)."""
  cfg = _config(size, global_batch, {})
  return text_data.stream(text_data.packed_batch, text_data.documents(split), cfg["batch"],
                          cfg["seq_len"], seed)


def main(argv=None) -> float:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--backend", choices=["jax_dnn", "xla"], default="jax_dnn")
  ap.add_argument("--size", choices=sorted(SIZES), default="small")
  ap.add_argument("--norm", choices=["rms", "layer"], default="rms")
  ap.add_argument("--xla-attention", choices=["xla", "cudnn"], default="xla",
                  help="jax.nn.dot_product_attention's implementation for --backend xla")
  ap.add_argument("--steps", type=int, default=500)
  ap.add_argument("--batch", type=int, default=None, help="global batch (default: the size's)")
  ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--log-every", type=int, default=50)
  ap.add_argument("--eval-batches", type=int, default=10,
                  help="validation batches evaluated after training")
  args = ap.parse_args(argv)

  cfg = _config(args.size, args.batch, {})
  mesh, devices = text_training.data_mesh(cfg["batch"])
  print(f"devices: {devices}; jax_dnn kernels built: {jax_dnn.has_cuda_kernels()}")
  print(f"backend {args.backend}, {cfg['layers']} layers, width {cfg['dim']}, "
        f"{cfg['heads']} heads, {args.norm} norm, batch {cfg['batch']} x {cfg['seq_len']} "
        f"tokens, {args.dtype}")
  graphdef, step, state, _ = _make_step(args.backend, args.size, global_batch=args.batch,
                                        mesh=mesh, seed=args.seed, dtype=args.dtype,
                                        norm=args.norm, xla_attention=args.xla_attention)
  place = text_training.placer(mesh)
  state, final = text_training.train(step, state,
                                     batches(args.size, global_batch=args.batch, seed=args.seed),
                                     place, steps=args.steps, log_every=args.log_every)
  validation = batches(args.size, global_batch=args.batch, seed=args.seed, split="validation")
  loss = text_training.evaluate(loss_fn, graphdef, state, validation, args.eval_batches, place)
  print(f"validation loss ({args.eval_batches} batches of held-out files) {loss:.4f}")
  return final

if __name__ == "__main__":
  main()
