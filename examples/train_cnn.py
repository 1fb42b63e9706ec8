"""Trains a ResNet (Flax NNX) on scikit-learn's handwritten digits with
jax_dnn's convolutions, fused batch norm + residual + ReLU and pooling, and
prints a falling loss, the step time and the test accuracy. Runs on CPU
(jax_dnn's reference path) or on every visible GPU (jax_dnn's kernels).

    pip install ".[examples]"
    python examples/train_cnn.py                          # ResNet-18, 32^2, one run on all GPUs
    python examples/train_cnn.py --depth 50 --size realistic --benchmark-mode
    python examples/train_cnn.py --backend xla            # the same model from Flax's layers
    python examples/train_cnn.py --dtype float16          # fp16 compute, dynamic loss scaling

The model: ResNet-18 (basic blocks) or ResNet-50 (bottlenecks, --depth 50).
At 224^2 the ImageNet stem (7x7 stride-2 convolution, 3x3 stride-2 max pool);
at small images the CIFAR stem (one 3x3 convolution, no pool), which keeps
the 32^2 digits from shrinking to 1x1 before the last stage. Each batch norm
that ends a block computes relu(bn(x) + shortcut) in one pass through
jax_dnn.nn.BatchNorm's residual= and activation=. `--backend xla` builds the
same modules from nnx.Conv, nnx.BatchNorm, jax.nn.relu, flax.linen.max_pool
and jnp.mean: jax_dnn's layers are drop-ins, so both backends start from the
same parameter tree and values for a seed.

Numerics: parameters, optimizer state and batch-norm statistics in fp32;
convolutions, activations and the head in --dtype (bfloat16 by default); the
loss in fp32. float16's narrow range needs loss scaling (LossScale below).

Data parallel: a 1-D mesh "data" over every visible device; the batch is
split over it and the parameters replicated. Under jit the batch norm's
mean and variance are reductions over the whole (sharded) batch axis, which
XLA computes with an all-reduce across devices (NCCL on GPUs): the
statistics are those of the global batch, i.e. synced across devices, with no
axis_name needed (that is for shard_map/pmap, where each device sees only its
shard). Run as a program, it asks XLA to overlap those collectives with
the backward's compute and to combine the gradients' all-reduces
(OVERLAP_FLAGS), unless XLA_FLAGS already names either setting.

The module also serves `python -m jax_dnn.benchmark models` (SIZES,
make_step, batches; see the contract in the benchmark) and train_unet.py,
which reuses the training machinery below (LossScale, the step, the CLI loop).
"""


import argparse
import dataclasses
import os
import pathlib
import sys
from typing import Any, Callable

from flax import linen
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jax_dnn
import jax_dnn.nn

# image_data.py sits beside this file; the benchmark imports this module by
# path, so the folder may not be on sys.path yet.
_HERE = str(pathlib.Path(__file__).resolve().parent)
if _HERE not in sys.path:
  sys.path.insert(0, _HERE)
import image_data  # pylint: disable=wrong-import-position
import step_loop  # pylint: disable=wrong-import-position

# tiny: CPU CI, a step in well under a second; small: a real run on one GPU;
# realistic: the benchmark's ResNet-50, batch 256, 224^2, ImageNet's 1000-way
# head (the digits' labels 0-9 are valid classes of it).
SIZES = {
    "tiny": dict(depth=18, width=8, image_size=16, batch=16, classes=10,
                 optimizer="sgd", lr=0.05, weight_decay=5e-4),
    "small": dict(depth=18, width=64, image_size=32, batch=128, classes=10,
                  optimizer="sgd", lr=0.1, weight_decay=5e-4),
    "realistic": dict(depth=50, width=64, image_size=224, batch=256, classes=1000,
                      optimizer="sgd", lr=0.1, weight_decay=1e-4),
}

# (blocks per stage, bottleneck?) by depth, as in He et al. 2016, table 1.
_RESNETS = {18: ((2, 2, 2, 2), False), 34: ((3, 4, 6, 3), False),
            50: ((3, 4, 6, 3), True), 101: ((3, 4, 23, 3), True)}
DTYPES = {"bfloat16": jnp.bfloat16, "float16": jnp.float16, "float32": jnp.float32}


# ---------------------------------------------------------------------------
# The two backends: what differs between a jax_dnn model and a Flax/XLA one.

@dataclasses.dataclass(frozen=True)
class Layers:
  conv: type                  # nnx.Conv's constructor
  batch_norm: type            # nnx.BatchNorm's constructor
  norm_act: Callable          # (bn, x, *, train, residual, activation) -> act(bn(x) + residual)
  max_pool: Callable          # flax.linen.max_pool's signature
  global_avg_pool: Callable   # [B, H, W, C] -> [B, C]
  log_softmax: Callable


def _jax_dnn_norm_act(bn, x, *, train, residual=None, activation=None):
  # One pass: normalize, add the shortcut, ReLU (and their fused backward).
  return bn(x, use_running_average=not train, residual=residual, activation=activation)


def _xla_norm_act(bn, x, *, train, residual=None, activation=None):
  y = bn(x, use_running_average=not train)
  if residual is not None:
    y = y + residual
  return jax.nn.relu(y) if activation == "relu" else y


def _jax_dnn_global_avg_pool(x):
  return jax_dnn.adaptive_avg_pool(x, 1).reshape(x.shape[0], x.shape[-1])


BACKENDS = {
    "jax_dnn": Layers(conv=jax_dnn.nn.Conv, batch_norm=jax_dnn.nn.BatchNorm,
                      norm_act=_jax_dnn_norm_act, max_pool=jax_dnn.max_pool,
                      global_avg_pool=_jax_dnn_global_avg_pool,
                      log_softmax=jax_dnn.log_softmax),
    "xla": Layers(conv=nnx.Conv, batch_norm=nnx.BatchNorm, norm_act=_xla_norm_act,
                  max_pool=linen.max_pool, global_avg_pool=lambda x: jnp.mean(x, axis=(1, 2)),
                  log_softmax=jax.nn.log_softmax),
}


# ---------------------------------------------------------------------------
# The model.

@dataclasses.dataclass(frozen=True)
class Ctx:
  """How every layer is built: backend, compute dtype (parameters fp32)."""
  layers: Layers
  dtype: Any

  def conv(self, cin, cout, kernel, stride=1, *, rngs):
    # He-normal over fan-out (torchvision's ResNet init); no bias before a
    # batch norm, whose own bias makes it redundant. Padding k // 2 on each
    # side (not "SAME", which pads (0, 1) at stride 2) as in the reference
    # ResNet.
    return self.layers.conv(
        cin, cout, (kernel, kernel), strides=stride, padding=((kernel // 2, kernel // 2),) * 2,
        use_bias=False, dtype=self.dtype, param_dtype=jnp.float32,
        kernel_init=nnx.initializers.variance_scaling(2.0, "fan_out", "normal"),
        rngs=rngs)

  def bn(self, channels, *, rngs, zero_scale=False):
    # momentum 0.9 (PyTorch's 0.1): the running averages settle in tens of
    # steps, which the short runs' evaluation needs. zero_scale on a block's
    # last batch norm starts each residual block as the identity (Goyal et
    # al. 2017), which makes large-batch SGD stable from the first step.
    return self.layers.batch_norm(
        channels, momentum=0.9, epsilon=1e-5, dtype=self.dtype, param_dtype=jnp.float32,
        scale_init=nnx.initializers.zeros_init() if zero_scale else nnx.initializers.ones_init(),
        rngs=rngs)


class Shortcut(nnx.Module):
  """1x1 convolution + batch norm where the shape changes; identity otherwise."""

  def __init__(self, ctx, cin, cout, stride, *, rngs):
    self.ctx = ctx
    self.project = stride != 1 or cin != cout
    if self.project:
      self.conv = ctx.conv(cin, cout, 1, stride, rngs=rngs)
      self.bn = ctx.bn(cout, rngs=rngs)

  def __call__(self, x, train):
    if not self.project:
      return x
    return self.ctx.layers.norm_act(self.bn, self.conv(x), train=train)


class BasicBlock(nnx.Module):
  """ResNet-18/34's block: relu(bn(conv3x3(relu(bn(conv3x3(x))))) + shortcut)."""
  expansion = 1

  def __init__(self, ctx, cin, width, stride, *, rngs):
    self.ctx = ctx
    self.conv1 = ctx.conv(cin, width, 3, stride, rngs=rngs)
    self.bn1 = ctx.bn(width, rngs=rngs)
    self.conv2 = ctx.conv(width, width, 3, rngs=rngs)
    self.bn2 = ctx.bn(width, rngs=rngs, zero_scale=True)
    self.shortcut = Shortcut(ctx, cin, width, stride, rngs=rngs)

  def __call__(self, x, train):
    norm_act = self.ctx.layers.norm_act
    y = norm_act(self.bn1, self.conv1(x), train=train, activation="relu")
    return norm_act(self.bn2, self.conv2(y), train=train, residual=self.shortcut(x, train),
                    activation="relu")


class Bottleneck(nnx.Module):
  """ResNet-50's block: 1x1 down to width, 3x3 (the stride, as torchvision's
  "ResNet v1.5"), 1x1 up to 4 x width; the last batch norm fuses the
  shortcut and ReLU."""
  expansion = 4

  def __init__(self, ctx, cin, width, stride, *, rngs):
    self.ctx = ctx
    cout = width * self.expansion
    self.conv1 = ctx.conv(cin, width, 1, rngs=rngs)
    self.bn1 = ctx.bn(width, rngs=rngs)
    self.conv2 = ctx.conv(width, width, 3, stride, rngs=rngs)
    self.bn2 = ctx.bn(width, rngs=rngs)
    self.conv3 = ctx.conv(width, cout, 1, rngs=rngs)
    self.bn3 = ctx.bn(cout, rngs=rngs, zero_scale=True)
    self.shortcut = Shortcut(ctx, cin, cout, stride, rngs=rngs)

  def __call__(self, x, train):
    norm_act = self.ctx.layers.norm_act
    y = norm_act(self.bn1, self.conv1(x), train=train, activation="relu")
    y = norm_act(self.bn2, self.conv2(y), train=train, activation="relu")
    return norm_act(self.bn3, self.conv3(y), train=train, residual=self.shortcut(x, train),
                    activation="relu")


class ResNet(nnx.Module):
  """ResNet for NHWC images; logits [B, classes] in fp32."""

  def __init__(self, *, backend="jax_dnn", depth=18, width=64, classes=10, imagenet_stem=False,
               in_channels=3, dtype=jnp.bfloat16, rngs):
    if depth not in _RESNETS:
      raise ValueError(f"depth must be one of {sorted(_RESNETS)}, got {depth}")
    ctx = Ctx(BACKENDS[backend], dtype)
    self.ctx = ctx
    self.imagenet_stem = imagenet_stem
    stage_blocks, bottleneck = _RESNETS[depth]
    block = Bottleneck if bottleneck else BasicBlock
    self.stem_conv = ctx.conv(in_channels, width, 7 if imagenet_stem else 3,
                              2 if imagenet_stem else 1, rngs=rngs)
    self.stem_bn = ctx.bn(width, rngs=rngs)
    blocks, cin = [], width
    for stage, n in enumerate(stage_blocks):
      for i in range(n):
        # The first block of stages 2-4 halves the resolution.
        stride = 2 if stage > 0 and i == 0 else 1
        blocks.append(block(ctx, cin, width * 2**stage, stride, rngs=rngs))
        cin = width * 2**stage * block.expansion
    self.blocks = nnx.List(blocks)
    self.head = nnx.Linear(cin, classes, dtype=dtype, param_dtype=jnp.float32, rngs=rngs)

  def __call__(self, x, train: bool = True):
    layers = self.ctx.layers
    x = x.astype(self.ctx.dtype)
    x = layers.norm_act(self.stem_bn, self.stem_conv(x), train=train, activation="relu")
    if self.imagenet_stem:
      x = layers.max_pool(x, (3, 3), strides=(2, 2), padding=((1, 1), (1, 1)))
    for block in self.blocks:
      x = block(x, train)
    return self.head(layers.global_avg_pool(x)).astype(jnp.float32)


def cross_entropy(log_softmax, logits, labels):
  logp = log_softmax(logits)
  return -jnp.mean(jnp.take_along_axis(logp, labels[:, None], axis=-1))


# ---------------------------------------------------------------------------
# Training machinery (shared with train_unet.py).

@dataclasses.dataclass(frozen=True)
class LossScale:
  """Dynamic loss scaling for float16: the loss is multiplied by `scale`
  before the backward pass so small gradients do not flush to zero in fp16,
  and the gradients divided by it after. A step whose gradients are not all
  finite (the scaled backward overflowed fp16's 65504) is skipped and the
  scale halved; after `growth_interval` good steps in a row it doubles, so it
  settles just under the overflow point. The defaults are PyTorch GradScaler's
  and jmp's."""
  initial: float = 2.0**15
  growth_interval: int = 2000

  def init(self):
    return {"scale": jnp.float32(self.initial), "good_steps": jnp.int32(0)}

  def update(self, state, finite):
    good = jnp.where(finite, state["good_steps"] + 1, 0)
    grow = good >= self.growth_interval
    scale = jnp.where(finite, jnp.where(grow, state["scale"] * 2, state["scale"]),
                      jnp.maximum(state["scale"] / 2, 1.0))
    return {"scale": scale, "good_steps": jnp.where(grow, 0, good)}


def all_finite(tree):
  return jnp.all(jnp.stack([jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(tree)]))


def make_optimizer(name, lr, weight_decay, decay_steps=None):
  """SGD with Nesterov momentum 0.9 or AdamW; cosine decay over decay_steps
  when given."""
  schedule = optax.cosine_decay_schedule(lr, decay_steps) if decay_steps else lr
  if name == "sgd":
    # Weight decay added to the gradient (L2), as ResNet training does.
    return optax.chain(optax.add_decayed_weights(weight_decay),
                       optax.sgd(schedule, momentum=0.9, nesterov=True))
  if name == "adamw":
    return optax.adamw(schedule, weight_decay=weight_decay)
  raise ValueError(f"optimizer must be 'sgd' or 'adamw', got {name!r}")


def data_mesh(mesh=None):
  """The given 1-D mesh "data", or one over the first device."""
  if mesh is None:
    return jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
  if mesh.axis_names != ("data",):
    raise ValueError(f"mesh must be 1-D with axis 'data', got axes {mesh.axis_names}")
  return mesh


def replicated(mesh):
  return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())


def batch_sharded(mesh):
  return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))


def check_batch(global_batch, mesh):
  n = mesh.devices.size
  if global_batch % n:
    raise ValueError(f"the global batch ({global_batch}) must split evenly over the "
                     f"{n} devices of the mesh")


@dataclasses.dataclass
class Trainer:
  """A model's jitted training step and its state, on a data-parallel mesh.

  state = {"model": nnx state of (model, optimizer), "key": PRNG key,
           "loss_scale": LossScale state (float16 only)}
  """
  step: Callable
  state: dict
  graphdef: Any
  mesh: Any


def make_trainer(model, tx, loss_fn, *, mesh, seed=0, loss_scale: LossScale | None = None):
  """loss_fn(model, batch, key) -> fp32 scalar loss. Returns a Trainer whose
  step(state, batch) -> (state, loss) runs one forward, backward and update,
  jitted, state replicated over the mesh and donated."""
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  graphdef, model_state = nnx.split((model, optimizer))
  state = {"model": model_state, "key": jax.random.key(seed + 1)}
  if loss_scale is not None:
    state["loss_scale"] = loss_scale.init()
  state = jax.device_put(state, replicated(mesh))

  def step(state, batch):
    # The arrays before the update (merge may hand the state's own Variables
    # to the model, which the update then rebinds).
    before = jax.tree.leaves(state["model"])
    model, optimizer = nnx.merge(graphdef, state["model"])
    key, step_key = jax.random.split(state["key"])
    scale = state["loss_scale"]["scale"] if loss_scale is not None else None

    def objective(model):
      loss = loss_fn(model, batch, step_key)
      return (loss * scale if scale is not None else loss), loss

    (_, loss), grads = nnx.value_and_grad(objective, has_aux=True)(model)
    if scale is not None:
      grads = jax.tree.map(lambda g: g / scale, grads)
    optimizer.update(model, grads)
    new = {"model": nnx.state((model, optimizer)), "key": key}
    if loss_scale is not None:
      # Skip the whole update (parameters, optimizer moments and step count,
      # batch statistics) when the fp16 backward overflowed.
      finite = all_finite(grads)
      after, treedef = jax.tree.flatten(new["model"])
      new["model"] = jax.tree.unflatten(
          treedef, [jnp.where(finite, a, b) for a, b in zip(after, before)])
      new["loss_scale"] = loss_scale.update(state["loss_scale"], finite)
    return new, loss

  step = jax.jit(step, donate_argnums=0,
                 out_shardings=(replicated(mesh), replicated(mesh)))
  return Trainer(step=step, state=state, graphdef=graphdef, mesh=mesh)


def shard_batch(batch, mesh):
  return jax.device_put(batch, batch_sharded(mesh))


def random_batch(shapes, mesh, seed):
  """{name: (shape, kind)} -> arrays made on the devices, already split over
  the mesh (a 256 x 224^2 batch never crosses the host link). kind: "image"
  (uniform in [-1, 1]) or an int n (labels in [0, n))."""
  def make():
    keys = jax.random.split(jax.random.key(seed + 2), len(shapes))
    out = {}
    for k, (name, (shape, kind)) in zip(keys, sorted(shapes.items())):
      out[name] = (jax.random.uniform(k, shape, jnp.float32, -1.0, 1.0) if kind == "image"
                   else jax.random.randint(k, shape, 0, kind, jnp.int32))
    return out
  return jax.jit(make, out_shardings=batch_sharded(mesh))()


def print_step_time(trainer, batch, steps, step_ms):
  """The step time and images/s train_loop measured, and fp16's final loss scale."""
  print(f"step time {step_ms:.2f} ms (mean of steps 2..{steps}); "
        f"{batch / step_ms * 1e3:.0f} images/s", flush=True)
  if "loss_scale" in trainer.state:
    print(f"loss scale {float(trainer.state['loss_scale']['scale']):g}")


def train_loop(trainer, data, steps, *, log_every=10, last=10):
  """Runs `steps` steps (step_loop.run_steps: the next batch placed while a
  step runs), printing the loss and the step's wall time; returns (mean loss
  over the last `last` steps, mean step time in ms after the first, which
  compiles)."""
  def report(i, loss, seconds):
    if i % log_every == 0 or i == steps - 1:  # step 0's time includes its compile
      print(f"step {i:5d}  loss {loss:.4f}  ({seconds * 1e3:.1f} ms)", flush=True)

  trainer.state, losses, step_s = step_loop.run_steps(
      trainer.step, trainer.state, lambda: shard_batch(next(data), trainer.mesh), steps,
      report=report)
  return float(np.mean(losses[-last:])), step_s * 1e3


def add_common_flags(ap, sizes):
  ap.add_argument("--backend", choices=["jax_dnn", "xla"], default="jax_dnn")
  ap.add_argument("--size", choices=sorted(sizes), default="small")
  ap.add_argument("--steps", type=int, default=300)
  ap.add_argument("--batch", type=int, default=None,
                  help="global batch, split over every visible device (default: the size's)")
  ap.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16",
                  help="compute dtype; parameters stay float32 (float16: dynamic loss scaling)")
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--optimizer", choices=["sgd", "adamw"], default=None)
  ap.add_argument("--lr", type=float, default=None)
  ap.add_argument("--benchmark-mode", action="store_true",
                  help="jax_dnn.config benchmark: each new convolution is timed once when "
                       "compiled (the first step) and the fastest algorithm cached")


def print_setup(args, mesh):
  print(f"devices: {mesh.devices.size} x {jax.devices()[0].device_kind} "
        f"({jax.default_backend()}); jax_dnn kernels built: {jax_dnn.has_cuda_kernels()}; "
        f"backend {args.backend}, dtype {args.dtype}", flush=True)


def config_for(sizes, size, global_batch, overrides):
  """sizes[size] with the overrides that are not None and the global batch."""
  if size not in sizes:
    raise ValueError(f"size must be one of {sorted(sizes)}, got {size!r}")
  cfg = dict(sizes[size], **{k: v for k, v in overrides.items() if v is not None})
  if global_batch is not None:
    cfg["batch"] = global_batch
  return cfg


# ---------------------------------------------------------------------------
# This model's entry points (the benchmark's contract).

def build(backend="jax_dnn", size="tiny", *, global_batch=None, mesh=None, seed=0,
          dtype="bfloat16", **overrides):
  """(Trainer, config, model loss function) for the ResNet of `size`."""
  cfg = config_for(SIZES, size, global_batch, overrides)
  mesh = data_mesh(mesh)
  check_batch(cfg["batch"], mesh)
  model = ResNet(backend=backend, depth=cfg["depth"], width=cfg["width"],
                 classes=cfg["classes"], imagenet_stem=cfg["image_size"] >= 128,
                 dtype=DTYPES[dtype], rngs=nnx.Rngs(seed))
  log_softmax = BACKENDS[backend].log_softmax

  def loss_fn(model, batch, key):
    del key
    return cross_entropy(log_softmax, model(batch["image"], train=True), batch["label"])

  tx = make_optimizer(cfg["optimizer"], cfg["lr"], cfg["weight_decay"], cfg.get("decay_steps"))
  loss_scale = (LossScale(cfg.get("loss_scale", 2.0**15), cfg.get("growth_interval", 2000))
                if dtype == "float16" else None)
  trainer = make_trainer(model, tx, loss_fn, mesh=mesh, seed=seed, loss_scale=loss_scale)
  return trainer, cfg


def make_step(backend: str, size: str = "tiny", *, global_batch: int | None = None,
              mesh: jax.sharding.Mesh | None = None, seed: int = 0, dtype: str = "bfloat16",
              **overrides):
  """(step, state, batch): one jitted training step of the ResNet of `size`
  (overrides: any SIZES field, e.g. depth=50, or loss_scale / growth_interval
  for float16), its state on the mesh and a random batch
  {"image": [B, S, S, 3] in [-1, 1], "label": [B]} split over it."""
  trainer, cfg = build(backend, size, global_batch=global_batch, mesh=mesh, seed=seed,
                       dtype=dtype, **overrides)
  s, b = cfg["image_size"], cfg["batch"]
  batch = random_batch({"image": ((b, s, s, 3), "image"), "label": ((b,), cfg["classes"])},
                       trainer.mesh, seed)
  return trainer.step, trainer.state, batch


def batches(size: str = "tiny", *, global_batch: int | None = None, seed: int = 0):
  """The digits at the size's resolution: {"image", "label"} numpy batches."""
  cfg = config_for(SIZES, size, global_batch, {})
  return image_data.train_batches(cfg["batch"], cfg["image_size"], seed=seed)


def accuracy(trainer, image_size, batch):
  """Top-1 accuracy on the test split, batch norm on its running averages."""
  @jax.jit
  def predict(model_state, images):
    model, _ = nnx.merge(trainer.graphdef, model_state)
    return jnp.argmax(model(images, train=False), axis=-1)

  images, labels = image_data.test_set(image_size)
  correct = 0
  for start in range(0, len(labels), batch):
    # Pad the last chunk to the batch so it splits over the mesh like the others.
    chunk = images[start:start + batch]
    n = len(chunk)
    chunk = np.concatenate([chunk, np.zeros((batch - n,) + chunk.shape[1:], chunk.dtype)])
    pred = predict(trainer.state["model"], shard_batch(chunk, trainer.mesh))
    correct += int(np.sum(np.asarray(pred)[:n] == labels[start:start + n]))
  return correct / len(labels)


# XLA's latency-hiding scheduler runs the data-parallel step's all-reduces
# alongside the backward's compute, and a 128 MiB combine threshold merges
# the gradients' all-reduces. ResNet-50, 64 images a GPU, 2 H200s (step ms,
# default flags -> these): jax_dnn 22.80 -> 18.80, XLA 22.41 -> 21.45
# (benchmarks/probes/dp_scaling.py); the scheduler alone took XLA's step to 28.37.
OVERLAP_FLAGS = ("--xla_gpu_enable_latency_hiding_scheduler=true",
                 "--xla_gpu_all_reduce_combine_threshold_bytes=134217728")


def overlap_collectives():
  """Adds OVERLAP_FLAGS to XLA_FLAGS unless it sets either; XLA reads them
  once, when JAX first starts its backend, so this runs before that."""
  flags = os.environ.get("XLA_FLAGS", "")
  if not any(f.split("=")[0] in flags for f in OVERLAP_FLAGS):
    os.environ["XLA_FLAGS"] = " ".join([flags, *OVERLAP_FLAGS]).strip()


def main(argv=None) -> float:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  add_common_flags(ap, SIZES)
  ap.add_argument("--depth", type=int, choices=sorted(_RESNETS), default=None)
  ap.add_argument("--width", type=int, default=None, help="the first stage's channels")
  ap.add_argument("--image-size", type=int, default=None)
  args = ap.parse_args(argv)

  if args.benchmark_mode:
    jax_dnn.config.update("benchmark", True)
  mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
  print_setup(args, mesh)
  trainer, cfg = build(args.backend, args.size, global_batch=args.batch, mesh=mesh,
                       seed=args.seed, dtype=args.dtype, depth=args.depth, width=args.width,
                       image_size=args.image_size, optimizer=args.optimizer, lr=args.lr,
                       decay_steps=args.steps)
  print(f"ResNet-{cfg['depth']} width {cfg['width']}, {cfg['image_size']}^2 images, "
        f"global batch {cfg['batch']}, {cfg['optimizer']} lr {cfg['lr']}", flush=True)
  data = image_data.device_batches(cfg["batch"], cfg["image_size"], seed=args.seed,
                                   sharding=batch_sharded(trainer.mesh))
  loss, step_ms = train_loop(trainer, data, args.steps)
  print_step_time(trainer, cfg["batch"], args.steps, step_ms)
  print(f"test accuracy {accuracy(trainer, cfg['image_size'], cfg['batch']):.3f}")
  print(f"final loss {loss:.4f}")
  return loss


if __name__ == "__main__":
  overlap_collectives()
  main()
