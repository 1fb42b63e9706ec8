"""batch_norm and batch_norm_inference, and jax_dnn.nn.BatchNorm: against an
fp64 reference over dtypes and 1D/2D/3D shapes (batch 1, odd sizes,
channels not a multiple of 8), large mean offsets, the fused residual and
activation against their composition, flax.nnx.BatchNorm (outputs,
gradients, running statistics, eval mode), cross-device statistics on
several host devices, and bad inputs. jit/vmap/grad, check_grads and the
CUDA lowering of the small case: tests/test_transforms.py (the table in
tests/op_cases.py)."""

import functools

from flax import nnx
import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import numpy as np
import pytest

import jax_dnn
from helpers import DTYPES, check_fwd_bwd, cuda_hlo, f64, on_gpu, randn, x64

EPS = 1e-5
ACTS = [None, "relu", "gelu", "gelu_tanh", "silu", "sigmoid", "tanh"]
_JAX_ACT = {None: lambda z: z, "relu": jax.nn.relu,
            "gelu": functools.partial(jax.nn.gelu, approximate=False),
            "gelu_tanh": functools.partial(jax.nn.gelu, approximate=True),
            "silu": jax.nn.silu, "sigmoid": jax.nn.sigmoid, "tanh": jnp.tanh}


def naive_batch_norm(x, scale, bias, residual=None, activation=None, epsilon=EPS):
  """Plain jnp in x's dtype (the tolerance rule's same-dtype baseline; in
  fp64 the reference): two-pass statistics over every axis but the last."""
  dt = x.dtype
  axes = tuple(range(x.ndim - 1))
  mean = jnp.mean(x, axis=axes)
  var = jnp.mean(jnp.square(x - mean), axis=axes)
  z = (x - mean) * jax.lax.rsqrt(var + jnp.asarray(epsilon, dt)) * scale.astype(dt) + bias.astype(dt)
  if residual is not None:
    z = z + residual
  return _JAX_ACT[activation](z).astype(dt), mean, var


def _params(c, dtype=jnp.float32, key=7):
  return randn(key, (c,), dtype, scale=0.5, offset=1.0), randn(key + 1, (c,), dtype, scale=0.5)


# 1D (N, L, C), 2D (N, H, W, C), 3D (N, D, H, W, C) and plain [N, C]; batch 1,
# odd sizes, channels 1, 3, 13, 24, 72 (not multiples of 8) and 256.
SHAPES = [(4, 7, 13), (1, 9, 3), (2, 5, 6, 24), (3, 7, 5, 16), (1, 3, 4, 5, 72), (2, 3, 3, 3, 8),
          (37, 256), (5, 1), (2, 14, 14, 256)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_against_reference(device, dtype, shape):
  x = randn(0, shape, dtype, scale=2.0, offset=0.5)
  scale, bias = _params(shape[-1])
  ours = lambda x, s, b: jax_dnn.batch_norm(x, s, b)[0]
  naive = lambda x, s, b: naive_batch_norm(x, s, b)[0]
  check_fwd_bwd(device, ours, naive, [x, scale, bias], dtype, what=f"{shape}")


@pytest.mark.parametrize("activation", ACTS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_residual_and_activation(device, activation, dtype):
  shape = (3, 5, 7, 40)
  x, r = randn(1, shape, dtype, scale=1.5, offset=-0.5), randn(2, shape, dtype)
  scale, bias = _params(shape[-1])
  ours = lambda x, s, b, r: jax_dnn.batch_norm(x, s, b, residual=r, activation=activation)[0]
  naive = lambda x, s, b, r: naive_batch_norm(x, s, b, r, activation)[0]
  check_fwd_bwd(device, ours, naive, [x, scale, bias, r], dtype, what=str(activation))


@pytest.mark.parametrize("activation", ["relu", "silu"])
def test_fused_equals_composition(device, activation):
  """act(bn(x) + residual) in one op equals the composition of the unfused
  op, the add and jax.nn's activation: values and gradients (fp32)."""
  del device
  shape = (2, 6, 5, 24)
  x, r = randn(3, shape, jnp.float32, offset=1.0), randn(4, shape, jnp.float32)
  scale, bias = _params(shape[-1])
  fused = lambda x, s, b, r: jax_dnn.batch_norm(x, s, b, residual=r, activation=activation)
  composed = lambda x, s, b, r: (lambda y, m, v: (_JAX_ACT[activation](y + r), m, v))(
      *jax_dnn.batch_norm(x, s, b))
  loss = lambda f: lambda *a: jnp.sum(jnp.sin(f(*a)[0]))
  for got, want in [(jax.jit(fused)(x, scale, bias, r), jax.jit(composed)(x, scale, bias, r)),
                    (jax.jit(jax.grad(loss(fused), (0, 1, 2, 3)))(x, scale, bias, r),
                     jax.jit(jax.grad(loss(composed), (0, 1, 2, 3)))(x, scale, bias, r))]:
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("fast", [True, False])
@pytest.mark.parametrize("shape", [(8, 9, 11, 24), (2, 3, 1000, 5)])
def test_statistics(device, shape, fast):
  """The returned mean and (biased) variance in fp32 against fp64, and their
  gradients (a loss of them, as a running-average update would not take,
  but a user may)."""
  del device
  x = randn(5, shape, jnp.bfloat16, scale=3.0, offset=2.0)
  fn = lambda x: jax_dnn.batch_norm(x, use_fast_variance=fast)[1:]
  mean, var = jax.jit(fn)(x)
  assert mean.dtype == var.dtype == jnp.float32
  axes = tuple(range(x.ndim - 1))
  x64 = np.asarray(x.astype(jnp.float32), np.float64)
  np.testing.assert_allclose(mean, x64.mean(axes), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(var, x64.var(axes), rtol=1e-5)
  loss = lambda f: lambda x: jnp.sum(jnp.cos(f(x)[0]) + jnp.sin(f(x)[1]))
  naive = lambda x: naive_batch_norm(x, jnp.ones(x.shape[-1]), jnp.zeros(x.shape[-1]))[1:]
  got = jax.jit(jax.grad(loss(fn)))(x.astype(jnp.float32))
  want = f64(jax.grad(loss(naive)), x)
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_large_mean_offset(device, dtype):
  """Channels whose mean is 1e3-1e4 times their spread: the centred second
  pass (use_fast_variance=False) keeps the variance to fp32 rounding; the
  one-pass E[x^2] - E[x]^2 (Flax's default formula too) loses about
  eps32 * (mean / std)^2 of it, here 0.1 to 10 times the variance itself:
  checked only against that bound."""
  del device
  n, c = (64, 5, 5), 24
  # bf16 holds 8 bits: an offset of 100 std leaves a spread of ~50 steps.
  top = 1e4 if dtype == jnp.float32 else 1e2
  offsets = jnp.asarray(np.geomspace(top / 10, top, c), jnp.float32)
  x = (randn(6, n + (c,), jnp.float32) + offsets).astype(dtype)
  x64 = np.asarray(x.astype(jnp.float32), np.float64)
  mean64, var64 = x64.mean((0, 1, 2)), x64.var((0, 1, 2))
  y, mean, var = jax.jit(functools.partial(jax_dnn.batch_norm, use_fast_variance=False))(x)
  # The sums' rounding: up to ~30 fp32 ulps where the GPU adds a row part's
  # terms in sequence.
  np.testing.assert_allclose(mean, mean64, rtol=2e-6)
  np.testing.assert_allclose(var, var64, rtol=2e-5)
  want = (x64 - mean64) / np.sqrt(var64 + EPS)
  # |x - mean| is exact in fp32 up to rounding x (bf16: exact) by eps32 * |x|.
  tol = 4 * np.finfo(np.float32).eps * np.max(np.abs(x64) / np.sqrt(var64))
  if dtype != jnp.float32:  # y rounded to bf16
    tol += 2.0 ** -8 * np.max(np.abs(want))
  np.testing.assert_allclose(np.asarray(y, np.float64), want, atol=tol)
  _, _, fast_var = jax.jit(jax_dnn.batch_norm)(x)
  bound = 64 * np.finfo(np.float32).eps * (mean64 ** 2 + var64) / var64
  assert np.all(np.abs(np.asarray(fast_var) - var64) / var64 <= bound + 1e-6)
  # (64 ulps: the cancellation's 1 and the sums' own rounding, as above.)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", [None, "relu", "silu"])
def test_inference_against_reference(device, dtype, activation):
  shape = (3, 5, 4, 20)
  x, r = randn(7, shape, dtype, scale=2.0, offset=1.0), randn(8, shape, dtype)
  mean, var = randn(9, (20,), jnp.float32, offset=1.0), randn(10, (20,), jnp.float32, scale=0.3,
                                                              offset=2.0)
  scale, bias = _params(20)

  def naive(x, m, v, s, b, r):
    dt = x.dtype
    z = (x - m.astype(dt)) * jax.lax.rsqrt(v.astype(dt) + jnp.asarray(EPS, dt)) * s.astype(dt)
    return _JAX_ACT[activation](z + b.astype(dt) + r).astype(dt)

  ours = lambda x, m, v, s, b, r: jax_dnn.batch_norm_inference(
      x, m, v, s, b, residual=r, activation=activation)
  check_fwd_bwd(device, ours, naive, [x, mean, var, scale, bias, r], dtype, what=str(activation))


def test_optional_parameters_and_param_dtypes(device):
  """scale/bias None are ones/zeros; bf16 parameters get bf16 gradients."""
  del device
  x = randn(11, (4, 3, 16), jnp.float32)
  ones, zeros = jnp.ones(16, jnp.bfloat16), jnp.zeros(16, jnp.bfloat16)
  a = jax_dnn.batch_norm(x)
  b = jax_dnn.batch_norm(x, ones, zeros)
  for g, w in zip(a, b):
    np.testing.assert_array_equal(g, w)
  grads = jax.grad(lambda s, b: jnp.sum(jax_dnn.batch_norm(x, s, b)[0] ** 3), (0, 1))(ones, zeros)
  assert all(g.dtype == jnp.bfloat16 for g in grads)


def test_vmap_gives_each_instance_its_statistics(device):
  del device
  x = randn(12, (3, 4, 5, 8), jnp.float32, scale=2.0)
  x = x * jnp.arange(1, 4, dtype=jnp.float32)[:, None, None, None]  # other spreads
  got = jax.jit(jax.vmap(jax_dnn.batch_norm))(x)
  for i in range(3):
    for g, w in zip(got, jax_dnn.batch_norm(x[i])):
      np.testing.assert_allclose(g[i], w, rtol=1e-5, atol=1e-5)


# --- jax_dnn.nn.BatchNorm against flax.nnx.BatchNorm ----------------------------------------


def _layers(c, **kw):
  theirs = nnx.BatchNorm(c, rngs=nnx.Rngs(0), **kw)
  ours = jax_dnn.nn.BatchNorm(c, rngs=nnx.Rngs(0), **kw)
  # Non-trivial parameters and running statistics, the same in both.
  for layer in (theirs, ours):
    if layer.scale is not None:
      layer.scale[...] = randn(13, (c,), layer.scale[...].dtype, scale=0.5, offset=1.0)
    if layer.bias is not None:
      layer.bias[...] = randn(14, (c,), layer.bias[...].dtype, scale=0.5)
    layer.mean[...] = randn(15, (c,), jnp.float32, scale=0.5)
    layer.var[...] = randn(16, (c,), jnp.float32, scale=0.2, offset=1.5)
  return ours, theirs


def _state_close(ours, theirs, tol):
  a, b = nnx.state(ours), nnx.state(theirs)
  for (pa, va), (pb, vb) in zip(jax.tree.leaves_with_path(a), jax.tree.leaves_with_path(b)):
    assert pa == pb
    assert va.dtype == vb.dtype, (pa, va.dtype, vb.dtype)
    np.testing.assert_allclose(np.asarray(va, np.float32), np.asarray(vb, np.float32), rtol=tol,
                               atol=tol, err_msg=str(pa))


@pytest.mark.parametrize("kwargs", [
    {}, {"momentum": 0.9, "epsilon": 1e-3}, {"use_fast_variance": False},
    {"use_bias": False}, {"use_scale": False}, {"dtype": jnp.bfloat16},
    {"param_dtype": jnp.bfloat16}, {"axis": 1}, {"axis": -2},
])
@pytest.mark.parametrize("shape", [(4, 6, 5, 12), (3, 9, 7), (2, 3, 4, 3, 24), (16, 12)])
def test_layer_matches_flax(device, kwargs, shape):
  """Same state tree (names, dtypes), outputs, gradients and running
  statistics after three training steps, then eval mode."""
  c = shape[kwargs.get("axis", -1)]
  ours, theirs = _layers(c, **kwargs)
  # fp32: our sums and XLA's add in different orders (the loss sums 1440
  # sines); bf16: Flax rounds some intermediates to bf16 that we keep fp32.
  tol = 2e-2 if jnp.bfloat16 in kwargs.values() else 1e-4 if on_gpu(device) else 2e-5
  _state_close(ours, theirs, 0)

  @nnx.jit
  def step(layer, x):
    def loss(layer):
      y = layer(x, use_running_average=False)
      return jnp.sum(jnp.sin(y.astype(jnp.float32))), y
    (l, y), g = nnx.value_and_grad(loss, has_aux=True, argnums=nnx.DiffState(0, nnx.Param))(layer)
    return l, y, g

  for i in range(3):
    x = randn(20 + i, shape, jnp.float32, scale=2.0, offset=0.5 * i)
    got, want = step(ours, x), step(theirs, x)
    assert got[1].dtype == want[1].dtype
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      w = np.asarray(w, np.float32)
      # dscale and dbias sum 1440 products: at bf16 their error follows the
      # largest sum, not each element's own size.
      atol = tol * max(1.0, float(np.abs(w).max())) if jnp.bfloat16 in kwargs.values() else tol
      np.testing.assert_allclose(np.asarray(g, np.float32), w, rtol=tol, atol=atol)
    _state_close(ours, theirs, tol)
  x = randn(30, shape, jnp.float32)
  got = nnx.jit(lambda m, x: m(x, use_running_average=True))(ours, x)
  want = nnx.jit(lambda m, x: m(x, use_running_average=True))(theirs, x)
  np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=tol,
                             atol=tol)
  # Gradients in eval mode too (with respect to x and the parameters).
  gx = lambda m: jax.grad(lambda x: jnp.sum(jnp.sin(m(x, use_running_average=True).astype(
      jnp.float32))))(x)
  if kwargs.get("dtype") != jnp.bfloat16:
    np.testing.assert_allclose(np.asarray(gx(ours), np.float32),
                               np.asarray(gx(theirs), np.float32), rtol=tol, atol=tol)
    return
  # dtype=bf16: Flax's eval mode computes x - mean and the scaling in bf16,
  # ours in fp32. The tolerance rule against Flax in fp32 on the same inputs.
  theirs_bf16 = gx(theirs)
  theirs.dtype = None
  x = x.astype(jnp.bfloat16).astype(jnp.float32)
  ref = np.asarray(gx(theirs), np.float64)
  err = lambda g: np.max(np.abs(np.asarray(g, np.float64) - ref))
  assert err(gx(ours)) <= 2 * err(theirs_bf16) + 2.0 ** -8 * np.max(np.abs(ref))


def test_layer_construction_flag_and_eval_view(device):
  """use_running_average from the constructor, from __call__ (which wins),
  and from nnx.view / model.eval(); no flag anywhere is Flax's error."""
  del device
  x = randn(31, (5, 4, 8), jnp.float32, offset=1.0)
  ours, theirs = _layers(8, use_running_average=True)
  np.testing.assert_allclose(ours(x), theirs(x), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(ours(x, False), theirs(x, False), rtol=1e-5, atol=1e-5)
  ours.eval()
  theirs.eval()
  np.testing.assert_allclose(ours(x), theirs(x), rtol=1e-5, atol=1e-5)
  none = jax_dnn.nn.BatchNorm(8, use_running_average=None, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="use_running_average"):
    none(x)
  assert isinstance(ours, nnx.BatchNorm)


def test_layer_mask_runs_flax(device):
  """A mask (which the kernels do not take) gives Flax's result."""
  del device
  x = randn(32, (6, 5, 8), jnp.float32)
  mask = jax.random.bernoulli(jax.random.key(0), 0.7, x.shape)
  ours, theirs = _layers(8)
  np.testing.assert_allclose(ours(x, mask=mask), theirs(x, mask=mask), rtol=1e-6)
  _state_close(ours, theirs, 1e-6)


def test_layer_float64_runs_flax(device):
  """float64 (which the kernels do not take) gives Flax's result."""
  del device
  from helpers import x64  # pylint: disable=g-import-not-at-top
  with x64():
    x = jnp.asarray(np.random.default_rng(0).standard_normal((6, 5, 8)))
    ours, theirs = _layers(8, dtype=jnp.float64)
    np.testing.assert_allclose(ours(x), theirs(x), rtol=1e-12)
    _state_close(ours, theirs, 1e-12)


def _flax_batch_norm(x, scale, bias, fast):
  """flax.nnx.BatchNorm's training output and batch statistics for x [..., C]
  with these parameters (promoted with x, as the layer promotes them)."""
  from flax.nnx.nn import normalization  # pylint: disable=g-import-not-at-top
  layer = nnx.BatchNorm(x.shape[-1], use_fast_variance=fast, param_dtype=scale.dtype,
                        rngs=nnx.Rngs(0))
  layer.scale[...], layer.bias[...] = scale, bias
  x = layer.promote_dtype((x, scale), dtype=None)[0]
  mean, var = normalization._compute_stats(x, tuple(range(x.ndim - 1)), None,  # pylint: disable=protected-access
                                           use_fast_variance=fast)
  return layer(x, use_running_average=False), mean, var


@pytest.mark.parametrize("fast", [True, False])
@pytest.mark.parametrize("dtype", [jnp.int32, jnp.bool_, jnp.complex64, "float64"],
                         ids=lambda d: jnp.dtype(d).name)
def test_other_dtypes_as_flax(dtype, fast):
  """Integers and bools normalize as float32 (Flax promotes them with its
  float32 parameters); float64 (under x64) and complex run Flax's
  computation in their dtype. batch_norm_inference likewise."""
  with x64():
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.integers(-3, 4, (6, 5, 4)))
    x = x.astype(dtype) if dtype != "float64" else x + jnp.asarray(rng.normal(size=x.shape))
    if dtype == jnp.complex64:
      x = x + 1j * jnp.asarray(rng.integers(-3, 4, x.shape), jnp.float32)
    pdtype = jnp.float64 if dtype == "float64" else jnp.float32
    scale = jnp.asarray(rng.uniform(0.5, 1.5, 4), pdtype)
    bias = jnp.asarray(rng.normal(size=4), pdtype)
    y, mean, var = jax_dnn.batch_norm(x, scale, bias, use_fast_variance=fast)
    want_y, want_mean, want_var = _flax_batch_norm(x, scale, bias, fast)
    tol = 1e-12 if dtype == "float64" else 1e-5
    assert y.dtype == want_y.dtype and mean.dtype == jnp.result_type(want_y, jnp.float32)
    np.testing.assert_allclose(y, want_y, rtol=tol, atol=tol)
    np.testing.assert_allclose(mean, want_mean, rtol=tol, atol=tol)
    np.testing.assert_allclose(var, want_var, rtol=tol, atol=tol)
    if dtype != jnp.complex64:  # (Flax keeps real running statistics)
      y = jax_dnn.batch_norm_inference(x, mean, var, scale, bias)
      np.testing.assert_allclose(y, want_y, rtol=tol, atol=tol)


def test_numpy_inputs():
  x = np.random.default_rng(6).normal(size=(5, 3))  # float64: float32 without x64
  y, mean, _ = jax_dnn.batch_norm(x)
  assert y.dtype == mean.dtype == jnp.float32
  np.testing.assert_allclose(mean, x.mean(0), rtol=1e-6)


@pytest.mark.parametrize("shape", [(0, 4, 3), (5, 0, 3), (4, 0)], ids=str)
def test_empty_inputs_as_flax(shape):
  """No rows, or no channels: Flax's empty output, and its statistics (0 / 0
  where there are no rows), in the layer's running averages too."""
  x = jnp.ones(shape, jnp.float32)
  y, mean, var = jax_dnn.batch_norm(x)
  assert y.shape == shape and mean.shape == var.shape == (shape[-1],)
  assert np.all(np.isnan(mean)) and np.all(np.isnan(var))
  assert jax_dnn.batch_norm_inference(x, mean, var).shape == shape
  ours, theirs = _layers(shape[-1])
  assert ours(x, use_running_average=False).shape == theirs(x, use_running_average=False).shape
  _state_close(ours, theirs, 0)
  assert jax.grad(lambda x: jnp.sum(jax_dnn.batch_norm(x)[0]))(x).shape == shape


@pytest.mark.parametrize("axis", [-1, 1])
def test_layer_residual_and_activation(device, axis):
  del device
  x, r = randn(33, (4, 6, 10), jnp.float32), randn(34, (4, 6, 10), jnp.float32)
  ours, theirs = _layers(x.shape[axis], axis=axis)
  got = ours(x, residual=r, activation="relu")
  want = jax.nn.relu(theirs(x) + r)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  _state_close(ours, theirs, 1e-6)
  with pytest.raises(ValueError, match="activation"):
    ours(x, activation="swish")


# --- cross-device statistics on host devices (conftest: 8 CPU devices) ----------------------


def _mesh(n=4):
  return Mesh(np.array(jax.devices("cpu")[:n]), ("data",))


def _bn_loss(axis_name=None, axis_index_groups=None, **kw):
  def loss(x, scale, bias, residual):
    y, mean, var = jax_dnn.batch_norm(x, scale, bias, residual=residual, activation="relu",
                                      axis_name=axis_name, axis_index_groups=axis_index_groups,
                                      **kw)
    return jnp.sum(jnp.sin(3.0 * y)), (y, mean, var)
  return loss


def _bn_args(shape=(8, 5, 3, 24)):
  return [randn(40, shape, jnp.float32, scale=2.0, offset=1.0), *_params(shape[-1]),
          randn(41, shape, jnp.float32)]


@pytest.mark.parametrize("fast", [True, False])
def test_shard_map_axis_name_equals_one_device(fast):
  """Batch split over 4 devices with axis_name: y, the statistics and the
  gradients equal one device's over the whole batch (dscale, dbias: each
  device's share, summed by JAX's transpose of the shared parameters)."""
  mesh = _mesh()
  args = _bn_args()
  fn = jax.value_and_grad(_bn_loss(use_fast_variance=fast), argnums=(0, 1, 2, 3), has_aux=True)
  want = jax.jit(fn)(*args)
  fn_sm = jax.value_and_grad(_bn_loss("data", use_fast_variance=fast), argnums=(0, 1, 2, 3),
                             has_aux=True)

  def body(x, s, b, r):
    (l, (y, m, v)), g = fn_sm(x, s, b, r)
    return jax.lax.psum(l, "data"), y, m, v, g

  batch, rep = P("data"), P()
  got = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(batch, rep, rep, batch),
                              out_specs=(rep, batch, rep, rep, (batch, rep, rep, batch))))(*args)
  (wl, (wy, wm, wv)), wg = want
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves((wl, wy, wm, wv, wg))):
    np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-5)
  # The forward's collectives: one all-reduce of the stacked per-channel
  # sums (two passes: one more, of the centred sums).
  fwd = jax.shard_map(lambda x: jax_dnn.batch_norm(x, axis_name="data", use_fast_variance=fast),
                      mesh=mesh, in_specs=batch, out_specs=(batch, rep, rep))
  assert jax.jit(fwd).lower(args[0]).as_text().count("all_reduce") == (1 if fast else 2)


def test_shard_map_gradients_through_the_statistics():
  """A loss of y summed over the devices plus one of the returned (shared)
  statistics: dx equals one device's (JAX's types sum the statistics'
  cotangents over the devices)."""
  mesh = _mesh()
  x = _bn_args()[0]

  def loss(x, axis_name=None):
    y, m, v = jax_dnn.batch_norm(x, axis_name=axis_name)
    y_part = jnp.sum(jnp.sin(y))
    if axis_name is not None:
      y_part = jax.lax.psum(y_part, axis_name)
    return y_part + jnp.sum(jnp.cos(m) * 3) + jnp.sum(v ** 2)

  want = jax.jit(jax.grad(loss))(x)
  got = jax.jit(jax.shard_map(jax.grad(functools.partial(loss, axis_name="data")), mesh=mesh,
                              in_specs=P("data"), out_specs=P("data")))(x)
  np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


def test_shard_map_without_axis_name_is_per_device():
  """Without axis_name each device normalizes its own block (Flax's rule)."""
  mesh = _mesh()
  x = _bn_args()[0]
  got = jax.jit(jax.shard_map(lambda x: jax_dnn.batch_norm(x)[0], mesh=mesh, in_specs=P("data"),
                              out_specs=P("data")))(x)
  want = jnp.concatenate([jax_dnn.batch_norm(b)[0] for b in jnp.split(x, 4)])
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_axis_index_groups():
  """Statistics over groups of devices: [[0, 1], [2, 3]] normalizes each
  half of the batch on its own (pmap: shard_map's psum takes no groups)."""
  x = _bn_args()[0]
  f = lambda x: jax_dnn.batch_norm(x, axis_name="i", axis_index_groups=[[0, 1], [2, 3]])[0]
  got = jax.pmap(f, axis_name="i", devices=jax.devices("cpu")[:4])(
      x.reshape((4, 2) + x.shape[1:])).reshape(x.shape)
  want = jnp.concatenate([jax_dnn.batch_norm(h)[0] for h in jnp.split(x, 2)])
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_pmap_axis_name():
  args = _bn_args()
  devs = jax.devices("cpu")[:4]
  f = lambda x: jax_dnn.batch_norm(x, axis_name="i")[0]
  got = jax.pmap(f, axis_name="i", devices=devs)(args[0].reshape((4, 2) + args[0].shape[1:]))
  np.testing.assert_allclose(got.reshape(args[0].shape), jax_dnn.batch_norm(args[0])[0],
                             rtol=1e-5, atol=1e-5)


def test_jit_with_a_split_batch_takes_global_statistics():
  """Under jit a batch split over devices is one batch: the partitioner adds
  each shard's per-channel sums (an all-reduce of them, no gather of x)."""
  mesh = _mesh(8)
  args = _bn_args()
  fn = jax.value_and_grad(_bn_loss(), argnums=(0, 1, 2, 3), has_aux=True)
  want = jax.jit(fn)(*args)
  specs = [P("data"), P(), P(), P("data")]
  split = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, specs)]
  got = jax.jit(fn)(*split)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-5)
  text = jax.jit(fn).lower(*split).compile().as_text()
  assert "all-reduce" in text and "all-gather" not in text


def test_layer_axis_name_matches_flax():
  """The Flax layers with axis_name inside shard_map: outputs and the
  running statistics agree (the update is the same on every device)."""
  mesh = _mesh()
  x = _bn_args()[0]
  out = {}
  for cls in (nnx.BatchNorm, jax_dnn.nn.BatchNorm):
    layer = cls(24, axis_name="data", rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(layer)

    def body(state, x, graphdef=graphdef):
      m = nnx.merge(graphdef, state)
      y = m(x, use_running_average=False)
      return y, nnx.state(m)

    out[cls] = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P("data")),
                                     out_specs=(P("data"), P())))(state, x)
  for g, w in zip(jax.tree.leaves(out[jax_dnn.nn.BatchNorm]), jax.tree.leaves(out[nnx.BatchNorm])):
    np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-5)


# --- CUDA lowering and bad inputs -------------------------------------------------------------


def test_cuda_lowering_calls_the_kernels():
  """Training and inference, forward and backward, with a residual and an
  activation, 3D: our four targets (the table's case covers the rest)."""
  if not jax_dnn.has_cuda_kernels():
    pytest.skip("jax_dnn was built without CUDA kernels: the CUDA lowering is the reference")
  args = [a.astype(jnp.bfloat16) for a in _bn_args((2, 3, 4, 5, 16))]
  loss = lambda *a: _bn_loss()(*a)[0]
  text = cuda_hlo(jax.grad(loss, argnums=(0, 1, 2, 3)), *args)
  for target in ("stats", "fwd", "bwd_stats", "bwd"):
    assert f"custom_call @jax_dnn_batch_norm_{target}(" in text, target


@pytest.mark.parametrize("rows, param_sets, width, dtype, sms, parts", [
    (128 * 56 * 56, 1, 256, "bfloat16", 132, 2112),  # one channel tile: 16 blocks an SM
    (256 * 14 * 14, 1, 1024, "bfloat16", 132, 528),  # four tiles
    (128 * 56 * 56, 1, 256, "bfloat16", 0, 4096),  # no device known: 256 SMs' worth
    (40, 3, 13, "float32", 132, 1),  # 13 rows a set: at least 64 rows a part
    (1 << 26, 1, 1 << 20, "float32", 10 ** 5, 32),  # the workspace's 256 MiB
    (1 << 30, 1, 8, "bfloat16", 10 ** 5, 65535),  # gridDim.y
])
def test_plan_parts(rows, param_sets, width, dtype, sms, parts):
  from jax_dnn._src import extension, plans  # pylint: disable=g-import-not-at-top
  if extension.module() is None:
    pytest.skip("jax_dnn's extension is not built: no plans")
  assert plans.batch_norm_parts(rows, param_sets, width, dtype,
                                plans.device_props(sm_count=sms)) == parts


def test_bad_inputs():
  x = jnp.ones((4, 8), jnp.float32)
  bn = jax_dnn.batch_norm
  with pytest.raises(TypeError, match="x must be an array"):
    bn([1.0, 2.0])
  with pytest.raises(ValueError, match="scalar"):
    bn(jnp.float32(1.0))
  with pytest.raises(ValueError, match=r"scale must have shape \(8,\)"):
    bn(x, jnp.ones(7))
  with pytest.raises(TypeError, match="bias must be floating"):
    bn(x, None, jnp.ones(8, jnp.int32))
  with pytest.raises(ValueError, match="residual must have x's shape"):
    bn(x, residual=jnp.ones((4, 7)))
  with pytest.raises(TypeError, match="residual must have x's dtype"):
    bn(x, residual=jnp.ones((4, 8), jnp.bfloat16))
  with pytest.raises(ValueError, match="activation must be None or one of"):
    bn(x, activation="swish")
  with pytest.raises(ValueError, match="epsilon must be > 0"):
    bn(x, epsilon=0.0)
  with pytest.raises(TypeError, match="use_fast_variance must be a bool"):
    bn(x, use_fast_variance=1)
  with pytest.raises(ValueError, match="axis_index_groups needs an axis_name"):
    bn(x, axis_index_groups=[[0]])
  with pytest.raises(TypeError, match="mean is required"):
    jax_dnn.batch_norm_inference(x, None, jnp.ones(8))
  with pytest.raises(ValueError, match=r"var must have shape \(8,\)"):
    jax_dnn.batch_norm_inference(x, jnp.ones(8), jnp.ones(3))


# --- the GPU: shapes past one block of rows and channels --------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(8, 56, 56, 64), (4, 14, 14, 1030), (3, 17, 9, 7, 36),
                                   (40000, 12), (2, 3, 5)])
@pytest.mark.parametrize("activation", [None, "relu"])
def test_gpu_large(gpu, dtype, shape, activation):
  x, r = randn(50, shape, dtype, scale=2.0, offset=3.0), randn(51, shape, dtype)
  scale, bias = _params(shape[-1])
  ours = lambda x, s, b, r: jax_dnn.batch_norm(x, s, b, residual=r, activation=activation)[0]
  naive = lambda x, s, b, r: naive_batch_norm(x, s, b, r, activation)[0]
  reused = check_fwd_bwd(gpu, ours, naive, [x, scale, bias, r], dtype, what=str(shape))
  assert reused >= 1 or not on_gpu(gpu)


@pytest.mark.gpu
def test_gpu_deterministic(gpu):
  del gpu
  args = [a.astype(jnp.bfloat16) for a in _bn_args((16, 28, 28, 96))]
  fn = jax.jit(jax.value_and_grad(lambda *a: _bn_loss()(*a)[0], argnums=(0, 1, 2, 3)))
  a, b = fn(*args), fn(*args)
  for g, w in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))


@pytest.mark.gpu
def test_gpu_statistics_on_two_gpus(gpu):
  """The batch split over two GPUs with axis_name: y, the statistics and the
  gradients equal one GPU's over the whole batch (the kernels on each)."""
  del gpu
  gpus = jax.devices("gpu")
  if len(gpus) < 2:
    pytest.skip(f"needs 2 CUDA devices (found {len(gpus)})")
  mesh = Mesh(np.array(gpus[:2]), ("data",))
  x, scale, bias, residual = _bn_args((16, 28, 28, 96))
  x = x.astype(jnp.bfloat16)
  # Pre-activations within rounding of 0 may take opposite sides of ReLU's
  # kink on one GPU and on two (the fp32 sums' order differs), flipping
  # their whole gradient: the residual moves them at least 0.05 away.
  xf = x.astype(jnp.float32)
  z = ((xf - xf.mean((0, 1, 2))) * jax.lax.rsqrt(xf.var((0, 1, 2)) + 1e-5) * scale + bias
       + residual.astype(jnp.bfloat16).astype(jnp.float32))
  residual = (residual + jnp.where(jnp.abs(z) < 0.05, 0.1, 0.0)).astype(jnp.bfloat16)
  args = [x, scale, bias, residual]
  fn = jax.value_and_grad(_bn_loss(), argnums=(0, 1, 2, 3), has_aux=True)
  want = jax.jit(fn)(*args)
  fn_sm = jax.value_and_grad(_bn_loss("data"), argnums=(0, 1, 2, 3), has_aux=True)

  def body(x, s, b, r):
    (l, (y, m, v)), g = fn_sm(x, s, b, r)
    return jax.lax.psum(l, "data"), y, m, v, g

  batch, rep = P("data"), P()
  got = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(batch, rep, rep, batch),
                              out_specs=(rep, batch, rep, rep, (batch, rep, rep, batch))))(*args)
  (wl, (wy, wm, wv)), wg = want
  # bf16 y and dx: one rounding apart where the fp32 sums' order differs.
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves((wl, wy, wm, wv, wg)), strict=True):
    np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), rtol=2e-2,
                               atol=2e-2)
