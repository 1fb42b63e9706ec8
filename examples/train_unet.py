"""Trains a small diffusion UNet (Flax NNX) to denoise scikit-learn's
handwritten digits with jax_dnn's convolutions, fused GroupNorm + SiLU and
attention, and prints a falling loss, the step time and the test loss. Runs
on CPU (jax_dnn's reference path) or on every visible GPU (jax_dnn's kernels).

    pip install ".[examples]"
    python examples/train_unet.py                       # 32^2, one run on all GPUs
    python examples/train_unet.py --size realistic      # batch 32, 64^2
    python examples/train_unet.py --backend xla         # the same model from Flax's layers

The model (Ho et al. 2020's UNet, scaled down): a 3x3 convolution in; at each
resolution residual blocks [GroupNorm+SiLU, 3x3 conv, + timestep embedding,
GroupNorm+SiLU, 3x3 conv, + shortcut], self-attention over the pixels at the
lowest resolutions, then a stride-2 3x3 convolution down; a middle of
block / attention / block; the mirror image up, each level concatenating the
skip from its way down and upsampling with a 4x4 stride-2 transposed
convolution; GroupNorm+SiLU and a 3x3 convolution out. The timestep enters as
a sinusoidal embedding through a two-layer MLP.

The task: epsilon prediction (DDPM). For an image x0, a timestep t uniform in
[0, T) and noise eps ~ N(0, I), the model sees x_t = sqrt(a_t) x0 +
sqrt(1 - a_t) eps (a_t: the cosine schedule of Nichol & Dhariwal 2021) and
is trained on mean((model(x_t, t) - eps)^2).

`--backend xla` swaps jax_dnn.nn.Conv / ConvTranspose / GroupNorm(activation=
"silu") / MultiHeadAttention for nnx.Conv / ConvTranspose / GroupNorm +
jax.nn.silu / MultiHeadAttention: the same parameter tree and values for a
seed. Numerics, data parallelism and float16 loss scaling as in
train_cnn.py, whose training machinery this reuses; there is no batch norm,
so nothing crosses devices in the forward pass.
"""

import argparse
import dataclasses
import math
import pathlib
import sys
from typing import Any, Callable

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

import jax_dnn.nn

_HERE = str(pathlib.Path(__file__).resolve().parent)
if _HERE not in sys.path:
  sys.path.insert(0, _HERE)
import image_data  # pylint: disable=wrong-import-position
import train_cnn  # pylint: disable=wrong-import-position

# channels: the first level's; mults: each level's channels / channels (one
# level per resolution, halving); attention at the levels whose resolution is
# at most attn_resolution, and in the middle. groups: GroupNorm's (divides
# every level's channels, and twice that after a skip concatenation).
SIZES = {
    "tiny": dict(image_size=16, batch=8, channels=16, mults=(1, 2), blocks=1, groups=8,
                 heads=2, attn_resolution=8, optimizer="adamw", lr=2e-3, weight_decay=0.0),
    "small": dict(image_size=32, batch=64, channels=64, mults=(1, 2, 2), blocks=2, groups=32,
                  heads=4, attn_resolution=8, optimizer="adamw", lr=3e-4, weight_decay=0.0),
    "realistic": dict(image_size=64, batch=32, channels=128, mults=(1, 2, 2, 2), blocks=2,
                      groups=32, heads=4, attn_resolution=16, optimizer="adamw", lr=2e-4,
                      weight_decay=0.0),
}
TIMESTEPS = 1000


# ---------------------------------------------------------------------------
# The two backends.

@dataclasses.dataclass(frozen=True)
class Layers:
  conv: type                  # nnx.Conv's constructor
  conv_transpose: type        # nnx.ConvTranspose's constructor
  group_norm_silu: Callable   # (channels, groups, dtype, rngs) -> module computing silu(gn(x))
  group_norm: type            # nnx.GroupNorm's constructor
  attention: type             # nnx.MultiHeadAttention's constructor


class _XlaGroupNormSiLU(nnx.GroupNorm):
  """nnx.GroupNorm followed by jax.nn.silu (a subclass, so its parameters
  are named as jax_dnn.nn.GroupNorm's)."""

  def __call__(self, x):
    return jax.nn.silu(super().__call__(x))


BACKENDS = {
    "jax_dnn": Layers(
        conv=jax_dnn.nn.Conv, conv_transpose=jax_dnn.nn.ConvTranspose,
        # One pass: statistics, normalize, scale/shift and SiLU.
        group_norm_silu=lambda c, g, dtype, rngs: jax_dnn.nn.GroupNorm(
            c, g, dtype=dtype, activation="silu", rngs=rngs),
        group_norm=jax_dnn.nn.GroupNorm, attention=jax_dnn.nn.MultiHeadAttention),
    "xla": Layers(
        conv=nnx.Conv, conv_transpose=nnx.ConvTranspose,
        group_norm_silu=lambda c, g, dtype, rngs: _XlaGroupNormSiLU(c, g, dtype=dtype,
                                                                    rngs=rngs),
        group_norm=nnx.GroupNorm, attention=nnx.MultiHeadAttention),
}


# ---------------------------------------------------------------------------
# The model.

# DDPM's initialization: Glorot-uniform kernels everywhere.
_KERNEL_INIT = nnx.initializers.variance_scaling(1.0, "fan_avg", "uniform")


@dataclasses.dataclass(frozen=True)
class Ctx:
  layers: Layers
  dtype: Any
  groups: int

  def conv(self, cin, cout, kernel=3, stride=1, *, rngs):
    return self.layers.conv(cin, cout, (kernel, kernel), strides=stride,
                            padding=((kernel // 2, kernel // 2),) * 2, dtype=self.dtype,
                            param_dtype=jnp.float32, kernel_init=_KERNEL_INIT, rngs=rngs)

  def linear(self, din, dout, *, rngs):
    return nnx.Linear(din, dout, dtype=self.dtype, param_dtype=jnp.float32,
                      kernel_init=_KERNEL_INIT, rngs=rngs)

  def norm_silu(self, channels, *, rngs):
    return self.layers.group_norm_silu(channels, self.groups, self.dtype, rngs)


def timestep_embedding(t, dim):
  """[B] float timesteps -> [B, dim] sinusoids (Vaswani et al.'s, as DDPM)."""
  half = dim // 2
  freqs = jnp.exp(-math.log(10_000.0) * jnp.arange(half, dtype=jnp.float32) / half)
  angles = t.astype(jnp.float32)[:, None] * freqs[None, :]
  return jnp.concatenate([jnp.sin(angles), jnp.cos(angles)], axis=-1)


class ResBlock(nnx.Module):
  """x + conv(silu(gn(conv(silu(gn(x))) + temb))), then self-attention when
  heads is given."""

  def __init__(self, ctx, cin, cout, temb_dim, *, heads=None, rngs):
    self.norm1 = ctx.norm_silu(cin, rngs=rngs)
    self.conv1 = ctx.conv(cin, cout, rngs=rngs)
    self.temb = ctx.linear(temb_dim, cout, rngs=rngs)
    self.norm2 = ctx.norm_silu(cout, rngs=rngs)
    # Zero-initialized last convolution: each block starts as the identity
    # (DDPM's init), so a deep stack trains from the first step.
    self.conv2 = ctx.layers.conv(cout, cout, (3, 3), padding=((1, 1),) * 2, dtype=ctx.dtype,
                                 param_dtype=jnp.float32,
                                 kernel_init=nnx.initializers.zeros_init(), rngs=rngs)
    self.skip = ctx.conv(cin, cout, 1, rngs=rngs) if cin != cout else None
    self.attn = AttnBlock(ctx, cout, heads, rngs=rngs) if heads else None

  def __call__(self, x, temb):
    h = self.conv1(self.norm1(x))
    h = h + self.temb(temb)[:, None, None, :]
    h = self.conv2(self.norm2(h))
    h = h + (self.skip(x) if self.skip is not None else x)
    return self.attn(h) if self.attn is not None else h


class AttnBlock(nnx.Module):
  """x + attention(GroupNorm(x)) over the H*W pixels as tokens."""

  def __init__(self, ctx, channels, heads, *, rngs):
    self.norm = ctx.layers.group_norm(channels, ctx.groups, dtype=ctx.dtype, rngs=rngs)
    # keep_rngs=False: no dropout, so the layer carries no PRNG state.
    self.attn = ctx.layers.attention(heads, channels, dtype=ctx.dtype, param_dtype=jnp.float32,
                                     kernel_init=_KERNEL_INIT, decode=False, keep_rngs=False,
                                     rngs=rngs)

  def __call__(self, x):
    b, h, w, c = x.shape
    tokens = self.norm(x).reshape(b, h * w, c)
    return x + self.attn(tokens, deterministic=True).reshape(b, h, w, c)


class UNet(nnx.Module):
  """eps prediction: (x_t [B, S, S, C], t [B]) -> [B, S, S, C] in fp32."""

  def __init__(self, *, backend="jax_dnn", image_size=32, in_channels=3, channels=64,
               mults=(1, 2, 2), blocks=2, groups=32, heads=4, attn_resolution=8,
               dtype=jnp.bfloat16, rngs):
    ctx = Ctx(BACKENDS[backend], dtype, groups)
    self.dtype = dtype
    self.channels = channels
    temb_dim = 4 * channels
    self.temb1 = ctx.linear(channels, temb_dim, rngs=rngs)
    self.temb2 = ctx.linear(temb_dim, temb_dim, rngs=rngs)
    self.conv_in = ctx.conv(in_channels, channels, rngs=rngs)

    def block(cin, cout, resolution):
      return ResBlock(ctx, cin, cout, temb_dim, rngs=rngs,
                      heads=heads if resolution <= attn_resolution else None)

    down, skip_channels, c, res = [], [], channels, image_size
    for level, mult in enumerate(mults):
      for _ in range(blocks):
        down.append(block(c, channels * mult, res))
        c = channels * mult
      skip_channels.append(c)
      if level < len(mults) - 1:
        down.append(ctx.conv(c, c, 3, 2, rngs=rngs))
        res //= 2
    self.down = nnx.List(down)
    self.mid = nnx.List([ResBlock(ctx, c, c, temb_dim, heads=heads, rngs=rngs),
                         ResBlock(ctx, c, c, temb_dim, rngs=rngs)])
    up = []
    for level in reversed(range(len(mults))):
      cout = channels * mults[level]
      for i in range(blocks):
        # The first block of a level takes the skip concatenated to its input.
        cin = c + skip_channels[level] if i == 0 else cout
        up.append(block(cin, cout, res))
        c = cout
      if level > 0:
        # 4x4 kernel at stride 2: every output pixel sees 2x2 input pixels (a
        # 2x2 kernel sees one, a checkerboard).
        up.append(ctx.layers.conv_transpose(c, c, (4, 4), strides=(2, 2), padding="SAME",
                                            dtype=dtype, param_dtype=jnp.float32,
                                            kernel_init=_KERNEL_INIT, rngs=rngs))
        res *= 2
    self.up = nnx.List(up)
    self.norm_out = ctx.norm_silu(c, rngs=rngs)
    self.conv_out = ctx.conv(c, in_channels, rngs=rngs)
    self.blocks = blocks
    self.levels = len(mults)

  def __call__(self, x, t):
    temb = timestep_embedding(t, self.channels).astype(self.dtype)
    temb = self.temb2(jax.nn.silu(self.temb1(temb)))
    temb = jax.nn.silu(temb)  # every block's projection sees silu(temb), as DDPM's
    h = self.conv_in(x.astype(self.dtype))
    skips = []
    layers = iter(self.down)
    for level in range(self.levels):
      for _ in range(self.blocks):
        h = next(layers)(h, temb)
      skips.append(h)
      if level < self.levels - 1:
        h = next(layers)(h)
    for block in self.mid:
      h = block(h, temb)
    layers = iter(self.up)
    for level in reversed(range(self.levels)):
      for i in range(self.blocks):
        if i == 0:
          h = jnp.concatenate([h, skips[level]], axis=-1)
        h = next(layers)(h, temb)
      if level > 0:
        h = next(layers)(h)
    return self.conv_out(self.norm_out(h)).astype(jnp.float32)


def alpha_bar(t):
  """The cosine schedule's signal fraction at integer timesteps t in [0, T)
  (Nichol & Dhariwal 2021, s = 0.008), clipped away from 0 at the end."""
  s = 0.008
  f = jnp.cos((t.astype(jnp.float32) / TIMESTEPS + s) / (1 + s) * jnp.pi / 2) ** 2
  f0 = math.cos(s / (1 + s) * math.pi / 2) ** 2
  return jnp.clip(f / f0, 1e-5, 1.0)


def denoising_loss(model, x0, key):
  """mean((model(x_t, t) - eps)^2), t and eps drawn from key."""
  kt, kn = jax.random.split(key)
  t = jax.random.randint(kt, (x0.shape[0],), 0, TIMESTEPS)
  eps = jax.random.normal(kn, x0.shape, jnp.float32)
  a = alpha_bar(t)[:, None, None, None]
  x_t = jnp.sqrt(a) * x0 + jnp.sqrt(1.0 - a) * eps
  return jnp.mean((model(x_t, t) - eps) ** 2)


# ---------------------------------------------------------------------------
# This model's entry points (the benchmark's contract).

def build(backend="jax_dnn", size="tiny", *, global_batch=None, mesh=None, seed=0,
          dtype="bfloat16", **overrides):
  """(Trainer, config) for the UNet of `size`."""
  cfg = train_cnn.config_for(SIZES, size, global_batch, overrides)
  mesh = train_cnn.data_mesh(mesh)
  train_cnn.check_batch(cfg["batch"], mesh)
  model = UNet(backend=backend, image_size=cfg["image_size"], channels=cfg["channels"],
               mults=tuple(cfg["mults"]), blocks=cfg["blocks"], groups=cfg["groups"],
               heads=cfg["heads"], attn_resolution=cfg["attn_resolution"],
               dtype=train_cnn.DTYPES[dtype], rngs=nnx.Rngs(seed))

  def loss_fn(model, batch, key):
    return denoising_loss(model, batch["image"], key)

  tx = train_cnn.make_optimizer(cfg["optimizer"], cfg["lr"], cfg["weight_decay"],
                                cfg.get("decay_steps"))
  loss_scale = (train_cnn.LossScale(cfg.get("loss_scale", 2.0**15),
                                    cfg.get("growth_interval", 2000))
                if dtype == "float16" else None)
  trainer = train_cnn.make_trainer(model, tx, loss_fn, mesh=mesh, seed=seed,
                                   loss_scale=loss_scale)
  return trainer, cfg


def make_step(backend: str, size: str = "tiny", *, global_batch: int | None = None,
              mesh: jax.sharding.Mesh | None = None, seed: int = 0, dtype: str = "bfloat16",
              **overrides):
  """(step, state, batch): one jitted training step of the UNet of `size`
  (overrides: any SIZES field, or loss_scale / growth_interval for float16),
  its state on the mesh (with the PRNG key that draws timesteps and noise)
  and a random batch {"image": [B, S, S, 3] in [-1, 1]} split over it."""
  trainer, cfg = build(backend, size, global_batch=global_batch, mesh=mesh, seed=seed,
                       dtype=dtype, **overrides)
  s, b = cfg["image_size"], cfg["batch"]
  batch = train_cnn.random_batch({"image": ((b, s, s, 3), "image")}, trainer.mesh, seed)
  return trainer.step, trainer.state, batch


def batches(size: str = "tiny", *, global_batch: int | None = None, seed: int = 0):
  """The digits at the size's resolution: {"image"} numpy batches."""
  cfg = train_cnn.config_for(SIZES, size, global_batch, {})
  for batch in image_data.train_batches(cfg["batch"], cfg["image_size"], seed=seed):
    yield {"image": batch["image"]}


def evaluate_loss(trainer, image_size, batch, seed=0):
  """The denoising loss on the test split, with timesteps and noise from a
  fixed key (the same draws for every evaluation of a run)."""
  @jax.jit
  def loss(model_state, images, key):
    model, _ = nnx.merge(trainer.graphdef, model_state)
    return denoising_loss(model, images, key)

  images, _ = image_data.test_set(image_size)
  if len(images) < batch:  # a global batch beyond the split: repeat it
    images = np.resize(images, (batch,) + images.shape[1:])
  total, n_batches = 0.0, len(images) // batch
  for i in range(n_batches):
    chunk = train_cnn.shard_batch(images[i * batch:(i + 1) * batch], trainer.mesh)
    total += float(loss(trainer.state["model"], chunk, jax.random.key(seed + 100 + i)))
  return total / n_batches


def main(argv=None) -> float:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  train_cnn.add_common_flags(ap, SIZES)
  ap.add_argument("--channels", type=int, default=None, help="the first level's channels")
  ap.add_argument("--image-size", type=int, default=None)
  args = ap.parse_args(argv)

  if args.benchmark_mode:
    jax_dnn.config.update("benchmark", True)
  mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
  train_cnn.print_setup(args, mesh)
  trainer, cfg = build(args.backend, args.size, global_batch=args.batch, mesh=mesh,
                       seed=args.seed, dtype=args.dtype, channels=args.channels,
                       image_size=args.image_size, optimizer=args.optimizer, lr=args.lr,
                       decay_steps=args.steps)
  print(f"UNet channels {cfg['channels']} x {cfg['mults']}, {cfg['image_size']}^2 images, "
        f"global batch {cfg['batch']}, {cfg['optimizer']} lr {cfg['lr']}", flush=True)
  data = image_data.device_batches(cfg["batch"], cfg["image_size"], seed=args.seed,
                                   sharding=train_cnn.batch_sharded(trainer.mesh))
  loss, step_ms = train_cnn.train_loop(trainer, data, args.steps)
  train_cnn.print_step_time(trainer, cfg["batch"], args.steps, step_ms)
  print(f"test loss {evaluate_loss(trainer, cfg['image_size'], cfg['batch'], args.seed):.4f}")
  print(f"final loss {loss:.4f}")
  return loss


if __name__ == "__main__":
  main()
