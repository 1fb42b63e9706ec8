"""The image examples (examples/train_cnn.py, train_unet.py) at size tiny on
CPU: the loss falls, the jax_dnn and Flax/XLA backends start from equal
parameter trees and agree after the same steps, make_step follows the
benchmark's contract on a 1-device mesh, float16's loss scaling skips an
overflowing step, and the digits load offline.

Each example compiles one training step per backend (fp32), shared between
tests through module-scoped fixtures: compiling dominates the time. The
float16 loss scaling, shared by both examples (train_cnn.make_trainer), runs
on a small net of the same layers.
"""

import importlib.util
import os
import pathlib
import socket
import sys

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"
STEPS = 12


def _load(name):
  """Imports examples/<name>.py by path, as the benchmark does."""
  if name in sys.modules:
    return sys.modules[name]
  spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
  module = importlib.util.module_from_spec(spec)
  sys.modules[name] = module
  spec.loader.exec_module(module)
  return module


@pytest.fixture(scope="module")
def cnn():
  return _load("train_cnn")


@pytest.fixture(scope="module")
def unet():
  return _load("train_unet")


@pytest.fixture(scope="module")
def image_data():
  _load("train_cnn")  # puts examples/ on sys.path
  return _load("image_data")


def _leaves(state):
  return [np.asarray(x) for x in jax.tree.leaves(state)]


def _paths(state):
  return [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(state)[0]]


def _train(module, trainer, steps, seed=0):
  data = module.batches("tiny", seed=seed)
  state, losses = trainer.state, []
  for _ in range(steps):
    batch = jax.device_put(next(data), jax.sharding.NamedSharding(
        trainer.mesh, jax.sharding.PartitionSpec("data")))
    state, loss = trainer.step(state, batch)
    losses.append(float(loss))
  trainer.state = state
  return losses


def _runs(module):
  """fp32 losses with each backend from seed 0: make_step (the benchmark's
  entry point; jax_dnn on an explicit 1-device mesh, xla with mesh=None), one
  step on its random batch, then STEPS steps on real batches."""
  cnn = _load("train_cnn")
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
  out = {"runs": {}, "initial": {}}
  for backend, backend_mesh in (("jax_dnn", mesh), ("xla", None)):
    step, state, batch = module.make_step(backend, "tiny", mesh=backend_mesh, dtype="float32")
    out["initial"][backend] = jax.tree.map(np.array, state["model"])
    state, loss = step(state, batch)
    if backend == "jax_dnn":
      out.update(batch=batch, random_loss=float(loss), mesh=mesh,
                 after_random_step=_leaves(state["model"]),
                 replicated=all(x.sharding.is_fully_replicated and x.sharding.mesh == mesh
                                for x in jax.tree.leaves(state["model"])),
                 changed=any(not np.array_equal(a, np.asarray(b)) for a, b in
                             zip(_leaves(out["initial"][backend]),
                                 jax.tree.leaves(state["model"]))))
    trainer = cnn.Trainer(step=step, state=state, graphdef=None,
                          mesh=backend_mesh or cnn.data_mesh())
    out["runs"][backend] = _train(module, trainer, STEPS)
  return out


@pytest.fixture(scope="module")
def cnn_runs(cnn):
  return _runs(cnn)


@pytest.fixture(scope="module")
def unet_runs(unet):
  return _runs(unet)


def _check_loss_falls(losses, margin):
  # Mean of the last 4 steps against the first: single steps are noisy
  # (batch 16 / 8), the trend is not.
  assert np.all(np.isfinite(losses)), losses
  assert np.mean(losses[-4:]) < losses[0] - margin, losses


def _check_backends_agree(runs, tol):
  np.testing.assert_allclose(runs["jax_dnn"], runs["xla"], rtol=0, atol=tol)


def _check_make_step(module, out, image_size, classes=None):
  batch = out["batch"]
  b = module.SIZES["tiny"]["batch"]
  assert batch["image"].shape == (b, image_size, image_size, 3)
  assert float(batch["image"].min()) >= -1.0 and float(batch["image"].max()) <= 1.0
  if classes is not None:
    assert batch["label"].shape == (b,) and batch["label"].dtype == jnp.int32
    assert 0 <= int(batch["label"].min()) and int(batch["label"].max()) < classes
  for x in jax.tree.leaves(batch):
    assert x.sharding.spec == jax.sharding.PartitionSpec("data")
  assert np.isfinite(out["random_loss"])
  assert out["replicated"], "the state is not replicated over the mesh"
  assert out["changed"], "the step left every parameter as it was"


class _SmallNet(nnx.Module):
  """Conv + fused BatchNorm/ReLU + pooling + Linear in float16: the
  example's layers and Trainer at a size whose fp16 step compiles in
  seconds on CPU (the ResNet's takes ~15 s there)."""

  def __init__(self, rngs):
    import jax_dnn.nn  # pylint: disable=import-outside-toplevel
    self.conv = jax_dnn.nn.Conv(3, 8, (3, 3), use_bias=False, dtype=jnp.float16, rngs=rngs)
    self.bn = jax_dnn.nn.BatchNorm(8, dtype=jnp.float16, rngs=rngs)
    self.head = nnx.Linear(8, 10, dtype=jnp.float16, rngs=rngs)

  def __call__(self, x):
    y = self.bn(self.conv(x.astype(jnp.float16)), use_running_average=False, activation="relu")
    return self.head(jnp.mean(y, axis=(1, 2))).astype(jnp.float32)


def test_fp16_loss_scaling(cnn):
  """A scale of 2^30 overflows fp16's backward: the step is skipped (every
  array of the model and optimizer state, batch statistics included,
  unchanged) and the scale halved. At 2^4 the same compiled step updates the
  parameters and counts a good step; after growth_interval good steps the
  scale doubles."""
  import jax_dnn  # pylint: disable=import-outside-toplevel

  def loss_fn(model, batch, key):
    del key
    return cnn.cross_entropy(jax_dnn.log_softmax, model(batch["image"]), batch["label"])

  trainer = cnn.make_trainer(_SmallNet(nnx.Rngs(0)), cnn.make_optimizer("sgd", 0.1, 0.0),
                             loss_fn, mesh=cnn.data_mesh(),
                             loss_scale=cnn.LossScale(2.0**30, growth_interval=2))
  batch = next(cnn.batches("tiny"))
  before = _leaves(trainer.state["model"])
  state, loss = trainer.step(trainer.state, batch)
  assert np.isfinite(float(loss))
  assert float(state["loss_scale"]["scale"]) == 2.0**29
  assert int(state["loss_scale"]["good_steps"]) == 0
  for a, b in zip(before, _leaves(state["model"])):
    np.testing.assert_array_equal(a, b)

  state["loss_scale"] = {"scale": jnp.float32(2.0**4), "good_steps": jnp.int32(0)}
  state, loss = trainer.step(state, batch)
  assert np.isfinite(float(loss))
  assert (float(state["loss_scale"]["scale"]), int(state["loss_scale"]["good_steps"])) == (16, 1)
  after = _leaves(state["model"])
  assert all(np.all(np.isfinite(a)) for a in after if a.dtype.kind == "f")
  assert any(not np.array_equal(a, b) for a, b in zip(before, after))
  state, _ = trainer.step(state, batch)
  assert (float(state["loss_scale"]["scale"]), int(state["loss_scale"]["good_steps"])) == (32, 0)


def test_cnn_low_precision_keeps_fp32_parameters(cnn):
  """--dtype sets the layers' compute dtype; parameters stay fp32."""
  model = nnx.eval_shape(lambda: cnn.ResNet(depth=18, width=4, dtype=jnp.float16,
                                            rngs=nnx.Rngs(0)))
  assert model.stem_conv.dtype == jnp.float16 and model.stem_bn.dtype == jnp.float16
  assert model.stem_conv.kernel.dtype == jnp.float32  # fp32 parameters


def _check_same_state(a, b):
  """Equal parameter trees: the same paths, variable types and values."""
  assert _paths(a) == _paths(b)
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(_leaves(a), _leaves(b)):
    np.testing.assert_array_equal(x, y)


# ---------------------------------------------------------------------------
# train_cnn.py


def test_cnn_forward_backends_agree(cnn, monkeypatch):
  """Bottleneck blocks and the ImageNet stem (max pool), which the
  training runs (ResNet-18, CIFAR stem) do not reach, in training and
  evaluation mode (running averages), fp32: the same logits from the same
  parameters."""
  import jax_dnn.nn  # pylint: disable=import-outside-toplevel
  # ResNet-50's bottlenecks with one block a stage (a quarter of its 16): the
  # same code, a quarter of the compile.
  monkeypatch.setitem(cnn._RESNETS, 14, ((1, 1, 1, 1), True))  # pylint: disable=protected-access
  make = lambda b: cnn.ResNet(backend=b, depth=14, width=2, imagenet_stem=True,
                              dtype=jnp.float32, rngs=nnx.Rngs(1))
  # jax_dnn's layers where it has drop-ins, Flax's in the other.
  models = {b: nnx.eval_shape(lambda b=b: make(b)) for b in ("jax_dnn", "xla")}
  assert isinstance(models["jax_dnn"].stem_conv, jax_dnn.nn.Conv)
  assert isinstance(models["jax_dnn"].blocks[0].bn3, jax_dnn.nn.BatchNorm)
  assert not isinstance(models["xla"].stem_conv, jax_dnn.nn.Conv)
  assert not isinstance(models["xla"].blocks[0].bn3, jax_dnn.nn.BatchNorm)

  def init_and_run(b):
    model = make(b)
    state = jax.tree.map(jnp.copy, nnx.state(model))  # the initial values, before the forward
    x = jax.random.uniform(jax.random.key(0), (4, 32, 32, 3), minval=-1, maxval=1)
    train = model(x, train=True)  # also moves the running averages
    return state, (train, model(x, train=False))

  # Both models built and run in one program: one compile, not one per
  # initializer shape.
  out = jax.jit(lambda: {b: init_and_run(b) for b in models})()
  _check_same_state(out["jax_dnn"][0], out["xla"][0])
  y = {b: logits for b, (_, logits) in out.items()}
  for a, b in zip(y["jax_dnn"], y["xla"]):
    # fp32 sums of <= 7*7*3 or 3*3*16 products in different orders (~1e-6
    # relative), through 18 layers each renormalized by batch norm.
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


def test_cnn_loss_falls(cnn_runs):
  for losses in cnn_runs["runs"].values():
    _check_loss_falls(losses, margin=0.1)


def test_cnn_backends_agree(cnn_runs):
  _check_same_state(cnn_runs["initial"]["jax_dnn"], cnn_runs["initial"]["xla"])
  # fp32 on CPU, where both backends run XLA's convolutions and jax_dnn's
  # references: the losses differ by summation order only (~1e-6 relative a
  # step); 12 SGD steps amplify that at most a few hundredfold.
  _check_backends_agree(cnn_runs["runs"], tol=2e-3)


def test_cnn_make_step_on_a_mesh(cnn, cnn_runs):
  _check_make_step(cnn, cnn_runs, cnn.SIZES["tiny"]["image_size"], classes=10)


def test_cnn_bad_arguments(cnn):
  with pytest.raises(ValueError, match="size"):
    cnn.make_step("jax_dnn", "huge")
  with pytest.raises(ValueError, match="depth"):
    cnn.ResNet(depth=19, rngs=nnx.Rngs(0))
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("model",))
  with pytest.raises(ValueError, match="data"):
    cnn.make_step("jax_dnn", mesh=mesh)


# ---------------------------------------------------------------------------
# train_unet.py


def test_unet_attention_placement(unet):
  # Attention at the levels at most attn_resolution (8: the second of the
  # tiny UNet's 16 and 8) and in the middle.
  model = nnx.eval_shape(lambda: unet.UNet(
      backend="jax_dnn", image_size=16, channels=8, mults=(1, 2), blocks=1, groups=4, heads=2,
      attn_resolution=8, rngs=nnx.Rngs(5)))
  assert [b.attn is not None for b in model.down if isinstance(b, unet.ResBlock)] == [False, True]
  assert [b.attn is not None for b in model.mid] == [True, False]
  assert [b.attn is not None for b in model.up if isinstance(b, unet.ResBlock)] == [True, False]


def test_unet_loss_falls(unet_runs):
  for losses in unet_runs["runs"].values():
    _check_loss_falls(losses, margin=0.2)


def test_unet_backends_agree(unet_runs):
  _check_same_state(unet_runs["initial"]["jax_dnn"], unet_runs["initial"]["xla"])
  # As the CNN's (fp32, summation order only); AdamW normalizes each update,
  # so tiny gradient differences move parameters by up to lr: a looser bound.
  _check_backends_agree(unet_runs["runs"], tol=5e-3)


def test_unet_make_step_on_a_mesh(unet, unet_runs):
  _check_make_step(unet, unet_runs, unet.SIZES["tiny"]["image_size"])


def test_unet_alpha_bar(unet):
  a = np.asarray(unet.alpha_bar(jnp.arange(unet.TIMESTEPS)))
  assert a[0] == pytest.approx(1.0, abs=1e-3) and a[-1] < 1e-3
  assert np.all(np.diff(a) <= 0)


# ---------------------------------------------------------------------------
# image_data.py


def test_digits_load_offline(image_data, monkeypatch):
  def no_network(*args, **kwargs):
    raise OSError("network access in a test of offline data")
  monkeypatch.setattr(socket, "socket", no_network)
  monkeypatch.setattr(socket, "create_connection", no_network)
  image_data._digits.cache_clear()  # pylint: disable=protected-access
  (x_train, y_train), (x_test, y_test) = image_data._digits()  # pylint: disable=protected-access
  assert len(y_train) + len(y_test) == 1797
  assert len(y_test) == image_data.num_examples("test") == 359
  assert set(np.unique(y_train)) == set(range(10))
  # The split is disjoint: no test image among the training images.
  train_rows = {row.tobytes() for row in x_train.reshape(len(x_train), -1)}
  overlap = sum(row.tobytes() in train_rows for row in x_test.reshape(len(x_test), -1))
  assert overlap < 5  # the digits hold a handful of exact duplicate images

  images, labels = image_data.test_set(32)
  assert images.shape == (359, 32, 32, 3) and images.dtype == np.float32
  assert images.min() == -1.0 and images.max() == 1.0
  np.testing.assert_array_equal(labels, y_test)


def test_upscale_is_bilinear(image_data):
  (x, _), _ = image_data._digits()  # pylint: disable=protected-access
  big = image_data.upscale(x[:4], 24, channels=1)[..., 0]
  ref = jax.image.resize(jnp.asarray(x[:4]), (4, 24, 24), "bilinear")
  np.testing.assert_allclose(big, 2 * np.asarray(ref) - 1, atol=1e-6)


def test_batches_deterministic(image_data):
  def first(seed, n=3, batch=100):
    it = image_data.train_batches(batch, 8, seed=seed)
    return [next(it)["label"] for _ in range(n)]
  np.testing.assert_array_equal(first(0), first(0))
  assert not np.array_equal(first(0)[0], first(1)[0])
  # Batches larger than the split run over epochs; an epoch is a permutation.
  n = image_data.num_examples("train")
  epoch = next(image_data.train_batches(n, 8, seed=2))["label"]
  (_, y_train), _ = image_data._digits()  # pylint: disable=protected-access
  np.testing.assert_array_equal(np.sort(epoch), np.sort(y_train))
  assert next(image_data.train_batches(2 * n + 1, 8))["image"].shape == (2 * n + 1, 8, 8, 3)


@pytest.mark.skipif(len(jax.devices()) < 2, reason="needs 2 devices (conftest gives 8 CPU ones)")
def test_cnn_data_parallel_matches_one_device(cnn, cnn_runs):
  """One step on the same global batch (make_step's random batch, the same
  values whatever the mesh) split over 2 devices and on 1 (the fixture's):
  the batch norm's statistics are the global batch's under jit + sharding,
  so the loss, parameters and running averages agree (fp32; sums in another
  order across devices: ~1e-6 relative)."""
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("data",))
  step, state, batch = cnn.make_step("jax_dnn", "tiny", mesh=mesh, dtype="float32")
  state, loss = step(state, batch)
  assert float(loss) == pytest.approx(cnn_runs["random_loss"], rel=1e-5)
  for a, b in zip(cnn_runs["after_random_step"], _leaves(state["model"])):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_device_batches_match_train_batches(image_data):
  """The training loops' batches (upscaled on the devices, split over the
  mesh) are train_batches' (numpy) within float32 rounding, in order."""
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("data",))
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
  host = image_data.train_batches(6, 20, seed=3)
  device = image_data.device_batches(6, 20, seed=3, sharding=sharding)
  for _ in range(3):
    a, b = next(host), next(device)
    assert b["image"].sharding.is_equivalent_to(sharding, 4)
    assert b["image"].shape == a["image"].shape and b["image"].dtype == np.float32
    np.testing.assert_allclose(np.asarray(b["image"]), a["image"], rtol=0, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(b["label"]), a["label"])


def test_train_loop_chains_states_and_reports(cnn, capsys):
  """train_loop keeps a step queued behind the one it reads: each step still
  takes the state the step before returned and every loss is reported, in
  order; the step time covers the steps after the first."""
  step = jax.jit(lambda state, batch: (state + 1, state * 10.0 + batch["x"][0]))
  data = ({"x": np.full((2,), i % 3, np.float32)} for i in range(100))
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
  trainer = cnn.Trainer(step=step, state=jnp.float32(0), graphdef=None, mesh=mesh)
  loss, step_ms = cnn.train_loop(trainer, data, 7, log_every=3, last=2)
  assert float(trainer.state) == 7.0
  assert loss == pytest.approx(np.mean([50 + 5 % 3, 60 + 6 % 3]))
  assert np.isfinite(step_ms) and step_ms >= 0
  out = capsys.readouterr().out
  assert [line.split()[1] for line in out.splitlines()] == ["0", "3", "6"]
  assert "loss 30.0000" in out  # step 3: state 3, x = 0


def test_overlap_collectives_adds_its_flags_once(cnn, monkeypatch):
  """The program's XLA flags join the user's and never override a setting
  the user named."""
  monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/x")
  cnn.overlap_collectives()
  flags = os.environ["XLA_FLAGS"].split()
  assert flags == ["--xla_dump_to=/tmp/x", *cnn.OVERLAP_FLAGS]
  cnn.overlap_collectives()
  assert os.environ["XLA_FLAGS"].split() == flags
  monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_latency_hiding_scheduler=false")
  cnn.overlap_collectives()
  assert os.environ["XLA_FLAGS"] == "--xla_gpu_enable_latency_hiding_scheduler=false"
  monkeypatch.delenv("XLA_FLAGS")
  cnn.overlap_collectives()
  assert os.environ["XLA_FLAGS"].split() == list(cnn.OVERLAP_FLAGS)
