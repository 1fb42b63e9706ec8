"""group_norm and instance_norm (channels last): against fp64 references over
dtypes, 1D/2D/3D shapes, group counts and sizes, fused activations; the
saved statistics; the Flax drop-ins against flax.nnx.GroupNorm /
InstanceNorm (outputs, gradients, parameter trees, the layouts they hand to
Flax); bad inputs. jit/vmap/grad, check_grads, sharding, export and the CUDA
lowering: the table in tests/op_cases.py."""

import functools

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_dnn
import jax_dnn.nn
from helpers import DTYPES, check_fwd_bwd, f64, on_gpu, randn, x64

EPS = 1e-5
ACTS = {None: lambda z: z, "relu": jax.nn.relu, "silu": jax.nn.silu, "sigmoid": jax.nn.sigmoid,
        "tanh": jnp.tanh, "gelu": functools.partial(jax.nn.gelu, approximate=False),
        "gelu_tanh": functools.partial(jax.nn.gelu, approximate=True)}


def naive_group_norm(x, scale, bias, groups, activation=None, epsilon=EPS):
  """Plain jnp in x's dtype (the tolerance rule's same-dtype baseline; in
  fp64 the reference)."""
  dt = x.dtype
  n, c = x.shape[0], x.shape[-1]
  xg = x.reshape(n, -1, groups, c // groups)
  mean = jnp.mean(xg, axis=(1, 3), keepdims=True)
  var = jnp.mean(jnp.square(xg - mean), axis=(1, 3), keepdims=True)
  y = ((xg - mean) * jax.lax.rsqrt(var + jnp.asarray(epsilon, dt))).reshape(x.shape)
  return ACTS[activation](y * scale.astype(dt) + bias.astype(dt)).astype(dt)


def _params(c, dtype, key=7):
  return [randn(key + i, (c,), dtype, scale=0.5, offset=1.0 - i) for i in range(2)]


def _check(device, shape, dtype, groups, activation=None, *, offset=3.0, key=1, gsize=False,
           kernel=True):
  x = randn(key, shape, dtype, scale=2.0, offset=offset)
  kw = dict(num_groups=None, group_size=shape[-1] // groups) if gsize else dict(num_groups=groups)
  ours = lambda x, s, b: jax_dnn.group_norm(x, s, b, epsilon=EPS, activation=activation, **kw)
  naive = lambda x, s, b: naive_group_norm(x, s, b, groups, activation)
  reused = check_fwd_bwd(device, ours, naive, (x, *_params(shape[-1], dtype)), dtype,
                         what=f"group_norm {shape} G={groups} {activation}")
  if on_gpu(device) and x.size and kernel:
    assert reused >= 1, "the output did not land in a poisoned buffer"


# 1D / 2D / 3D, batch 1, no spatial axes, one position; groups of one
# channel, of all channels, odd group sizes and channel counts that are not
# a multiple of 8 (the kernels' narrower vectors and scalar path).
SHAPES = [  # (shape, groups)
    ((1, 7, 32), 8),          # 1D, batch 1
    ((2, 5, 6, 64), 32),      # 2D, 2 channels a group
    ((2, 3, 4, 5, 16), 4),    # 3D
    ((3, 9, 12), 12),         # one channel a group
    ((2, 4, 4, 20), 5),       # 20 channels: 4-element vectors, 4 a group
    ((2, 6, 6, 30), 3),       # 30 channels: 2-element vectors, 10 a group
    ((2, 5, 7), 7),           # 7 channels: scalar path
    ((2, 1, 96), 1),          # one position, one group (layer norm over C)
    ((4, 24), 4),             # no spatial axes
]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape,groups", SHAPES, ids=str)
def test_against_reference(device, dtype, shape, groups):
  _check(device, shape, dtype, groups)


@pytest.mark.parametrize("activation", [a for a in ACTS if a is not None])
def test_fused_activations(device, activation):
  _check(device, (2, 6, 5, 32), jnp.float32, 8, activation)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_fused_silu_is_the_composition(device, dtype):
  """group_norm(activation="silu") == silu(group_norm(...)), values and
  gradients, within the rounding of the unfused form's intermediate."""
  x = randn(3, (2, 8, 8, 64), dtype, scale=2.0, offset=1.0)
  scale, bias = _params(64, jnp.float32)
  fused = lambda x, s, b: jax_dnn.group_norm(x, s, b, num_groups=32, activation="silu")
  plain = lambda x, s, b: jax.nn.silu(jax_dnn.group_norm(x, s, b, num_groups=32))
  dy = randn(4, x.shape, dtype)
  (y1, g1), (y2, g2) = [(f(x, scale, bias), jax.vjp(f, x, scale, bias)[1](dy))
                        for f in (jax.jit(fused), jax.jit(plain))]
  # The unfused form rounds the norm's output to x's dtype before the SiLU.
  tol = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2, jnp.float16: 3e-3}[dtype]
  for a, b in zip((y1, *g1), (y2, *g2)):
    ref = max(1.0, float(jnp.max(jnp.abs(b.astype(jnp.float32)))))
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                               atol=tol * ref * (8 if a.ndim == 1 else 1), rtol=0)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("gsize", [False, True], ids=["num_groups", "group_size"])
def test_num_groups_or_group_size(device, dtype, gsize):
  _check(device, (2, 4, 3, 48), dtype, 6, "silu", gsize=gsize)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", [(2, 9, 8), (1, 4, 4, 4, 24), (3, 5)], ids=str)
def test_instance_norm(device, dtype, shape):
  x = randn(5, shape, dtype, scale=2.0, offset=3.0)
  ours = lambda x, s, b: jax_dnn.instance_norm(x, s, b, epsilon=EPS)
  naive = lambda x, s, b: naive_group_norm(x, s, b, shape[-1])
  params = _params(shape[-1], dtype)
  if len(shape) > 2 or dtype != jnp.float32:
    check_fwd_bwd(device, ours, naive, (x, *params), dtype, what="instance_norm")
    return
  # No spatial axes: one element a group, so xhat = 0, y = bias and dx = 0
  # exactly. fp32 references get dx = 0 with no rounding at all (the rule's
  # bound is its floor); the kernels' per-group sums round by ~2^-24 of
  # |dz * scale|, which dx's factor rstd = EPS^-1/2 (316) scales.
  y = jax.jit(ours)(x, *params)
  np.testing.assert_allclose(np.asarray(y), np.broadcast_to(params[1], shape), rtol=0, atol=1e-6)
  dz = randn(6, shape, dtype)
  dx = jax.jit(jax.grad(lambda x: jnp.vdot(ours(x, *params), dz)))(x)
  bound = 8 * 2.0**-24 * EPS**-0.5 * float(jnp.max(jnp.abs(dz * params[0])))
  assert float(jnp.max(jnp.abs(dx))) <= bound, (float(jnp.max(jnp.abs(dx))), bound)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", [(2, 9, 8), (1, 4, 4, 4, 24)], ids=str)
def test_instance_norm_kernels(device, dtype, shape):
  """Instance norm under jax_dnn.config deterministic: the kernels (XLA's
  computation is the default, group_norm_plan's by_default)."""
  before = jax_dnn.config.deterministic
  jax_dnn.config.update("deterministic", True)
  try:
    test_instance_norm(device, dtype, shape)
  finally:
    jax_dnn.config.update("deterministic", before)


@pytest.mark.parametrize("offset", [100.0, 1e4])
def test_large_mean_offset(device, offset):
  """Groups whose mean is far from 0 against their standard deviation (1):
  an E[x^2] - E[x]^2 variance would be off by about offset^2 * 2^-24 (6e-4
  of the variance at 100, 6 times it at 1e4); the kernels' shifted sums and
  the reference's two passes lose only the mean's rounding."""
  shape = (2, 16, 16, 64)
  x = randn(11, shape, jnp.float32, scale=1.0, offset=offset)
  scale, bias = _params(64, jnp.float32)
  y = jax.jit(lambda x: jax_dnn.group_norm(x, scale, bias, num_groups=8, epsilon=EPS))(x)
  want = f64(lambda x, s, b: naive_group_norm(x, s, b, 8), x, scale, bias)
  # The fp32 mean of 2048 values: up to log2(2048) = 11 roundings of
  # 2^-24 offset (pairwise sums; 16 here), times rstd ~ 1 and |scale| <= 2.5.
  np.testing.assert_allclose(np.asarray(y, np.float64), want, rtol=0,
                             atol=16 * offset * 2.0**-24 * 2.5 + 1e-5)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_saved_statistics(device, dtype):
  """The forward's residuals: each (sample, group)'s (mean, rstd) in fp32."""
  from jax_dnn._src import group_norm as lib  # pylint: disable=g-import-not-at-top
  shape, groups = (3, 10, 7, 40), 8
  params = [jnp.ones((1, 40), jnp.float32), jnp.zeros((1, 40), jnp.float32)]
  fwd = jax.jit(lambda x: lib.group_norm_fwd_p.bind(x, *params, groups=groups, epsilon=EPS,
                                                    activation=lib.NO_ACTIVATION,
                                                    deterministic=False))
  for key in (31, 32):  # two inputs: a stat left unwritten cannot pass on the first one's
    x = randn(key, shape, dtype, scale=2.0, offset=3.0)
    _, stats = fwd(x)
    assert stats.shape == (3, groups, 2) and stats.dtype == jnp.float32
    xg = np.asarray(jnp.asarray(x, jnp.float32), np.float64).reshape(3, -1, groups, 5)
    mean = xg.mean((1, 3))
    rstd = 1 / np.sqrt(xg.var((1, 3)) + EPS)
    np.testing.assert_allclose(np.asarray(stats[..., 0]), mean, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(stats[..., 1]), rstd, rtol=1e-5)


def test_per_example_parameters_under_vmap(device):
  """vmap over x and the parameters (folded into parameter sets) equals a
  loop over the examples, values and all gradients."""
  x = randn(12, (3, 2, 5, 4, 16), jnp.float32, scale=2.0, offset=1.0)
  scale = randn(13, (3, 16), jnp.float32, scale=0.5, offset=1.0)
  bias = randn(14, (3, 16), jnp.float32, scale=0.5)
  loss = lambda x, s, b: jnp.sum(jnp.sin(jax_dnn.group_norm(x, s, b, num_groups=4,
                                                            activation="silu")))
  vg = jax.jit(jax.vmap(jax.value_and_grad(loss, argnums=(0, 1, 2))))(x, scale, bias)
  for i in range(3):
    v, g = jax.value_and_grad(loss, argnums=(0, 1, 2))(x[i], scale[i], bias[i])
    np.testing.assert_allclose(vg[0][i], v, rtol=1e-5, atol=1e-5)
    for a, b in zip(vg[1], g):
      np.testing.assert_allclose(a[i], b, rtol=1e-5, atol=1e-5)


def test_optional_parameters_and_dtypes(device):
  x = randn(6, (2, 5, 33), jnp.bfloat16, offset=1.0)
  y = jax_dnn.group_norm(x, num_groups=3)
  assert y.dtype == jnp.bfloat16
  want = f64(lambda x: naive_group_norm(x, jnp.ones(33), jnp.zeros(33), 3, epsilon=1e-6), x)
  np.testing.assert_allclose(np.asarray(y, np.float64), want, atol=3e-2, rtol=0)
  # Parameters in another float dtype: their gradients come back in it.
  s16 = jnp.ones(33, jnp.float16)
  g = jax.grad(lambda s: jnp.sum(jax_dnn.group_norm(x, s, num_groups=3).astype(jnp.float32)
                                 * x.astype(jnp.float32)))(s16)
  assert g.dtype == jnp.float16


def test_bad_inputs():
  x = jnp.ones((2, 4, 8), jnp.float32)
  with pytest.raises(ValueError, match="group_norm: num_groups must be a positive int dividing "
                     "the 8 channels"):
    jax_dnn.group_norm(x, num_groups=3)
  with pytest.raises(ValueError, match="group_size must be a positive int dividing"):
    jax_dnn.group_norm(x, num_groups=None, group_size=3)
  with pytest.raises(ValueError, match="exactly one of num_groups and group_size"):
    jax_dnn.group_norm(x, num_groups=2, group_size=4)
  with pytest.raises(ValueError, match="exactly one of num_groups and group_size"):
    jax_dnn.group_norm(x, num_groups=None)
  with pytest.raises(ValueError, match="num_groups must be a positive int"):
    jax_dnn.group_norm(x, num_groups=0)
  with pytest.raises(TypeError, match="group_norm: x must be an array"):
    jax_dnn.group_norm([[1.0, 2.0]], num_groups=2)
  with pytest.raises(ValueError, match=r"rank >= 2"):
    jax_dnn.instance_norm(jnp.ones(8))
  with pytest.raises(ValueError, match=r"channels\) must be > 0"):
    jax_dnn.instance_norm(jnp.ones((3, 0)))
  with pytest.raises(ValueError, match=r"group_norm: scale must have shape \(8,\)"):
    jax_dnn.group_norm(x, jnp.ones(4), num_groups=2)
  with pytest.raises(ValueError, match="epsilon must be > 0"):
    jax_dnn.instance_norm(x, epsilon=0.0)
  with pytest.raises(ValueError, match="instance_norm: activation must be None or one of"):
    jax_dnn.instance_norm(x, activation="swish")
  with pytest.raises(ValueError, match="activation must be None or one of"):
    jax_dnn.nn.GroupNorm(8, num_groups=2, activation="swish", rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="does not divide"):  # Flax's own check
    jax_dnn.nn.GroupNorm(10, num_groups=4, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("shape", [(0, 4, 8), (2, 0, 8), (0, 0, 8)], ids=str)
def test_empty_inputs_as_flax(shape):
  """No samples or no positions: Flax's empty result (functions and layers),
  its gradients empty too."""
  x = jnp.ones(shape, jnp.float32)
  for y in (jax_dnn.group_norm(x, num_groups=2), jax_dnn.instance_norm(x),
            jax_dnn.nn.GroupNorm(8, num_groups=2, rngs=nnx.Rngs(0))(x),
            jax_dnn.nn.InstanceNorm(8, rngs=nnx.Rngs(0))(x)):
    assert y.shape == nnx.InstanceNorm(8, rngs=nnx.Rngs(0))(x).shape == shape
    assert y.dtype == jnp.float32
  g = jax.grad(lambda s: jnp.sum(jax_dnn.instance_norm(x, s)))(jnp.ones(8))
  np.testing.assert_array_equal(g, np.zeros(8))


def _flax_group_norm(x, scale, bias, groups):
  layer = nnx.GroupNorm(x.shape[-1], num_groups=groups, use_fast_variance=False,
                        param_dtype=scale.dtype, rngs=nnx.Rngs(0))
  layer.scale[...], layer.bias[...] = scale, bias
  return layer(x)


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.bool_, jnp.complex64, "float64"],
                         ids=lambda d: jnp.dtype(d).name)
def test_other_dtypes_as_flax(dtype):
  """Integers and bools normalize as float32 (Flax promotes them with its
  float32 parameters); float64 (under x64) and complex run the reference in
  their dtype: Flax's values and dtype, and float64 gradients."""
  with x64():
    rng = np.random.default_rng(8)
    x = jnp.asarray(rng.integers(-3, 4, (2, 5, 6)))
    x = x.astype(dtype) if dtype != "float64" else x + jnp.asarray(rng.normal(size=x.shape))
    if dtype == jnp.complex64:
      x = x + 1j * jnp.asarray(rng.integers(-3, 4, x.shape), jnp.float32)
    pdtype = jnp.float64 if dtype == "float64" else jnp.float32
    scale = jnp.asarray(rng.uniform(0.5, 1.5, 6), pdtype)
    bias = jnp.asarray(rng.normal(size=6), pdtype)
    tol = 1e-12 if dtype == "float64" else 1e-5
    for groups in (3, 6):
      y = (jax_dnn.group_norm(x, scale, bias, num_groups=groups) if groups == 3
           else jax_dnn.instance_norm(x, scale, bias))
      want = _flax_group_norm(x, scale, bias, groups)
      assert y.dtype == want.dtype
      np.testing.assert_allclose(y, want, rtol=tol, atol=tol)
    if dtype == "float64":
      grad = lambda f: jax.grad(lambda x, s: jnp.sum(jnp.sin(f(x, s))), (0, 1))(x, scale)
      ours = grad(lambda x, s: jax_dnn.group_norm(x, s, bias, num_groups=3))
      theirs = grad(lambda x, s: _flax_group_norm(x, s, bias, 3))
      for a, b in zip(ours, theirs):
        assert a.dtype == jnp.float64
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)
  x = np.random.default_rng(9).normal(size=(2, 5, 6))  # NumPy float64: float32 without x64
  assert jax_dnn.group_norm(x, num_groups=3).dtype == jnp.float32


def test_layer_with_the_wrong_feature_count():
  """A clear error naming the features, where Flax's reshape fails; an
  InstanceNorm without parameters takes any width, as Flax's."""
  x = randn(1, (2, 4, 6), jnp.float32)
  with pytest.raises(ValueError, match="GroupNorm: x has 6 features.*num_features=8"):
    jax_dnn.nn.GroupNorm(8, num_groups=4, rngs=nnx.Rngs(0))(x)
  with pytest.raises(ValueError, match="InstanceNorm: x has 6 features.*num_features=3"):
    jax_dnn.nn.InstanceNorm(3, rngs=nnx.Rngs(0))(x)
  kw = dict(use_bias=False, use_scale=False, rngs=nnx.Rngs(0))
  np.testing.assert_allclose(jax_dnn.nn.InstanceNorm(3, **kw)(x), nnx.InstanceNorm(3, **kw)(x),
                             rtol=1e-5, atol=1e-5)


# --- the Flax drop-ins ------------------------------------------------------------


def _perturbed(layer, key):
  state = nnx.state(layer, nnx.Param)
  nnx.update(layer, jax.tree.map(lambda a: a + 0.1 * randn(key, a.shape, a.dtype), state))


def _compare_layers(ours, theirs, x, tol, after=lambda y: y):
  """Same parameter tree; same outputs and gradients (x and parameters)."""
  so, st = nnx.state(ours, nnx.Param), nnx.state(theirs, nnx.Param)
  assert (jax.tree.map(lambda a: (a.shape, a.dtype), so)
          == jax.tree.map(lambda a: (a.shape, a.dtype), st))
  _perturbed(ours, 9)
  _perturbed(theirs, 9)

  def grads(layer, post):
    def loss(layer, x):
      y = post(layer(x))
      return jnp.sum(jnp.sin(y.astype(jnp.float32))), y
    (_, y), g = nnx.value_and_grad(loss, argnums=(0, 1), has_aux=True)(layer, x)
    return y, g

  (y, g), (y_ref, g_ref) = grads(ours, lambda y: y), grads(theirs, after)
  assert y.dtype == y_ref.dtype, (y.dtype, y_ref.dtype)
  np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(y_ref, np.float32),
                             rtol=tol, atol=tol)
  for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_ref)):
    assert a.dtype == b.dtype
    ref = max(1.0, float(np.max(np.abs(np.asarray(b, np.float32)))))
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                               rtol=tol, atol=tol * ref)


# use_fast_variance=False on Flax's side: the kernels compute the exact
# variance (Flax's default E[x^2] - E[x]^2 differs by its own rounding).
@pytest.mark.parametrize("shape,kwargs", [
    ((2, 6, 5, 64), {}),                                                  # 32 groups
    ((2, 7, 24), {"num_groups": 4}),                                      # 1D
    ((1, 3, 4, 5, 16), {"num_groups": None, "group_size": 2}),            # 3D, batch 1
    ((2, 4, 4, 32), {"num_groups": 8, "use_bias": False}),
    ((2, 4, 4, 32), {"num_groups": 8, "use_scale": False, "epsilon": 1e-3}),
    ((2, 4, 4, 32), {"num_groups": 8, "reduction_axes": (1, 2, -1)}),     # the default, spelled out
    ((2, 5, 20), {"num_groups": 5, "param_dtype": jnp.bfloat16}),
], ids=str)
def test_group_norm_layer_matches_flax(device, shape, kwargs):
  x = randn(1, shape, jnp.float32, scale=2.0, offset=2.0)
  c = shape[-1]
  ours = jax_dnn.nn.GroupNorm(c, rngs=nnx.Rngs(0), **kwargs)
  theirs = nnx.GroupNorm(c, rngs=nnx.Rngs(0), use_fast_variance=False, **kwargs)
  assert isinstance(ours, nnx.GroupNorm)
  tol = 2e-2 if kwargs.get("param_dtype") else 5e-5
  _compare_layers(ours, theirs, x, tol)


def test_group_norm_layer_bf16_and_silu(device):
  """bf16 compute (dtype=bfloat16): the output in bf16 like Flax's; the fused
  SiLU equals Flax's layer followed by jax.nn.silu."""
  x = randn(2, (2, 8, 8, 64), jnp.bfloat16, scale=2.0, offset=1.0)
  ours = jax_dnn.nn.GroupNorm(64, dtype=jnp.bfloat16, activation="silu", rngs=nnx.Rngs(0))
  theirs = nnx.GroupNorm(64, dtype=jnp.bfloat16, use_fast_variance=False, rngs=nnx.Rngs(0))
  _compare_layers(ours, theirs, x, 3e-2, after=jax.nn.silu)


@pytest.mark.parametrize("shape,kwargs", [
    ((2, 6, 5, 16), {}),
    ((3, 9, 8), {"use_bias": False}),
    ((1, 3, 4, 5, 8), {"epsilon": 1e-3}),
], ids=str)
def test_instance_norm_layer_matches_flax(device, shape, kwargs):
  x = randn(3, shape, jnp.float32, scale=2.0, offset=2.0)
  ours = jax_dnn.nn.InstanceNorm(shape[-1], rngs=nnx.Rngs(0), **kwargs)
  theirs = nnx.InstanceNorm(shape[-1], rngs=nnx.Rngs(0), use_fast_variance=False, **kwargs)
  assert isinstance(ours, nnx.InstanceNorm)
  _compare_layers(ours, theirs, x, 5e-5)


def _no_kernel_calls(fn, *args):
  """The jaxpr of fn has no group norm primitive (Flax's own computation ran)."""
  return "group_norm_fwd" not in str(jax.make_jaxpr(fn)(*args))


def test_layouts_the_kernels_do_not_take_run_flax(device):
  """A mask, statistics over other axes, features on another axis: Flax's computation (the activation after it), identical to Flax's layer."""
  x = randn(4, (2, 6, 5, 16), jnp.float32, offset=1.0)
  mask = jnp.asarray(np.random.default_rng(0).random(x.shape) > 0.3)
  cases = [
      (dict(num_groups=4), dict(mask=mask)),
      (dict(num_groups=4, reduction_axes=(2, -1)), {}),
  ]
  for kwargs, call in cases:
    ours = jax_dnn.nn.GroupNorm(16, activation="tanh", rngs=nnx.Rngs(0), **kwargs)
    theirs = nnx.GroupNorm(16, rngs=nnx.Rngs(0), **kwargs)
    assert _no_kernel_calls(lambda x: ours(x, **call), x)
    np.testing.assert_allclose(ours(x, **call), jnp.tanh(theirs(x, **call)), rtol=1e-6, atol=1e-6)
  inst = jax_dnn.nn.InstanceNorm(6, feature_axes=1, rngs=nnx.Rngs(0))
  assert _no_kernel_calls(inst, x)
  np.testing.assert_allclose(inst(x), nnx.InstanceNorm(6, feature_axes=1, rngs=nnx.Rngs(0))(x),
                             rtol=1e-6, atol=1e-6)
  assert not _no_kernel_calls(jax_dnn.nn.InstanceNorm(16, rngs=nnx.Rngs(0)), x)


def test_layer_under_jit_and_vmap(device):
  x = randn(5, (3, 2, 4, 4, 32), jnp.float32, offset=1.0)
  layer = jax_dnn.nn.GroupNorm(32, num_groups=8, activation="silu", rngs=nnx.Rngs(0))
  ref = nnx.GroupNorm(32, num_groups=8, use_fast_variance=False, rngs=nnx.Rngs(0))
  got = nnx.jit(lambda m, x: jax.vmap(m)(x))(layer, x)
  np.testing.assert_allclose(got, jax.nn.silu(jax.vmap(ref)(x)), rtol=5e-5, atol=5e-5)


# --- GPU: shapes that reach the kernels' variants ---------------------------------

# Several statistics blocks a sample (the splits), rows that end inside a
# block step, one position, the widest channel vectors a block row takes
# (4096 bf16), channels the kernels leave to the reference (8192 bf16), and
# the Stable-Diffusion layers scaled down.
GPU_SHAPES = [((2, 32, 32, 320), 32, jnp.bfloat16), ((1, 64, 64, 128), 32, jnp.bfloat16),
              ((4, 17, 19, 640), 32, jnp.float16), ((3, 1, 1, 96), 32, jnp.float32),
              ((2, 33, 4096), 32, jnp.bfloat16), ((2, 9, 8192), 32, jnp.bfloat16),
              ((2, 8, 8, 8, 64), 16, jnp.bfloat16), ((5, 300, 24), 24, jnp.bfloat16),
              ((2, 100, 36), 12, jnp.float32), ((2, 50, 7), 7, jnp.float16)]


@pytest.mark.gpu
@pytest.mark.parametrize("shape,groups,dtype", GPU_SHAPES, ids=str)
@pytest.mark.parametrize("activation", [None, "silu"])
def test_kernel_shapes(gpu, shape, groups, dtype, activation):
  _check(gpu, shape, dtype, groups, activation, kernel=shape[-1] != 8192)


@pytest.mark.gpu
def test_deterministic(gpu):
  x = randn(8, (4, 32, 32, 320), jnp.bfloat16, scale=2.0, offset=1.0)
  scale, bias = _params(320, jnp.float32)
  dy = randn(9, x.shape, jnp.bfloat16)
  f = lambda x, s, b: jax_dnn.group_norm(x, s, b, activation="silu")
  vjp = jax.jit(lambda x, s, b, dy: jax.vjp(f, x, s, b)[1](dy))
  for u, w in zip(vjp(x, scale, bias, dy), vjp(x, scale, bias, dy)):
    np.testing.assert_array_equal(u, w)


# --- the CUDA lowering's plan, on any machine ----------------------------------------


def _needs_plans():
  from jax_dnn._src import extension  # pylint: disable=g-import-not-at-top
  if extension.module() is None:
    pytest.skip("jax_dnn's extension is not built: no kernel plans")


@pytest.fixture
def kernels_registered(monkeypatch):
  """Lowers for CUDA as a build with the group norm kernels would (the
  extension's plans decide; no kernel runs)."""
  from jax_dnn._src import extension  # pylint: disable=g-import-not-at-top
  _needs_plans()
  real = extension.use_kernel
  monkeypatch.setattr(extension, "use_kernel",
                      lambda t: t.startswith("jax_dnn_group_norm") or real(t))


def test_cuda_lowering_workspaces(kernels_registered):
  """The Stable-Diffusion layer (8 x 64^2 x 320 bf16): the forward's partials
  [N, splits, G, 2] and the backward's three workspaces as the plan sizes
  them (no device here: 132 SMs, 2 blocks each over the 8 samples, 33
  splits a sample)."""
  del kernels_registered
  from helpers import cuda_hlo  # pylint: disable=g-import-not-at-top
  from jax_dnn._src import plans  # pylint: disable=g-import-not-at-top
  x = jnp.zeros((8, 64, 64, 320), jnp.bfloat16)
  scale = jnp.ones(320, jnp.float32)
  fn = lambda x, s, b: jax.vjp(lambda *a: jax_dnn.group_norm(*a, activation="silu"),
                               x, s, b)[1](x)
  text = cuda_hlo(fn, x, scale, scale)
  plan = plans.group_norm_plan(8, 4096, 320, 32, "bfloat16")
  assert plan.supported and (plan.vec, plan.threads_x, plan.threads_y) == (8, 40, 6)
  splits = plan.splits
  if plans.current_device().sm_count == 0:
    assert splits == 33
  assert f"tensor<8x{splits}x32x2xf32>" in text
  assert f"tensor<8x{splits}x2x320xf32>" in text and "tensor<8x2x320xf32>" in text
  assert "jax_dnn_group_norm_fwd" in text and "jax_dnn_group_norm_bwd" in text
  assert "activation = 3 : i64" in text and "groups = 32 : i64" in text


def test_cuda_lowering_leaves_wide_channels_to_the_reference(kernels_registered):
  """More than 512 16-byte vectors of channels a position (8192 bf16): the
  plan declines, and the CUDA lowering is the reference's."""
  del kernels_registered
  from helpers import cuda_hlo  # pylint: disable=g-import-not-at-top
  x = jnp.zeros((2, 9, 8192), jnp.bfloat16)
  assert "jax_dnn_group_norm" not in cuda_hlo(lambda x: jax_dnn.group_norm(x), x)
  assert "jax_dnn_group_norm_fwd" in cuda_hlo(lambda x: jax_dnn.group_norm(x[:, :, :4096]), x)


def test_cuda_lowering_instance_norm_defaults_to_xla(kernels_registered):
  """Instance norm (one channel a group): the plan's by_default is off, so
  the CUDA lowering is the reference's unless deterministic; group norm's
  stays on the kernels."""
  del kernels_registered
  from helpers import cuda_hlo  # pylint: disable=g-import-not-at-top
  from jax_dnn._src import plans  # pylint: disable=g-import-not-at-top
  x = jnp.zeros((4, 16, 16, 64), jnp.bfloat16)
  plan = plans.group_norm_plan(4, 256, 64, 64, "bfloat16")
  assert plan.supported and not plan.by_default and "instance norm" in plan.reason
  assert plans.group_norm_plan(4, 256, 64, 32, "bfloat16").by_default
  assert plans.group_norm_plan(4, 256, 1, 1, "bfloat16").by_default  # C = 1: one group
  # New functions each time: a traced function keeps the setting it was traced under.
  grad = lambda: (lambda x: jax.grad(lambda x: jnp.sum(jax_dnn.instance_norm(x)
                                                       .astype(jnp.float32)))(x))
  assert "jax_dnn_group_norm" not in cuda_hlo(grad(), x)
  assert "jax_dnn_group_norm_fwd" in cuda_hlo(lambda x: jax_dnn.group_norm(x, num_groups=32), x)
  before = jax_dnn.config.deterministic
  jax_dnn.config.update("deterministic", True)
  try:
    text = cuda_hlo(grad(), x)
  finally:
    jax_dnn.config.update("deterministic", before)
  assert "jax_dnn_group_norm_fwd" in text and "jax_dnn_group_norm_bwd" in text
  assert "deterministic" not in text  # the plan's choice, no kernel attribute


def test_export_with_a_symbolic_batch(kernels_registered):
  """jax.export with a symbolic N: the workspaces follow N (one statistics
  block a sample: the plan's answer for plans.LARGE samples)."""
  del kernels_registered
  n, = jax.export.symbolic_shape("n")
  x = jax.ShapeDtypeStruct((n, 16, 16, 64), jnp.bfloat16)
  p = jax.ShapeDtypeStruct((64,), jnp.float32)
  fn = jax.jit(lambda x, s, b: jax.vjp(lambda *a: jax_dnn.group_norm(*a, num_groups=8), x, s,
                                        b)[1](x))
  exp = jax.export.export(fn, platforms=["cuda"], disabled_checks=[
      jax.export.DisabledSafetyCheck.custom_call(t)
      for t in ("jax_dnn_group_norm_fwd", "jax_dnn_group_norm_bwd")])(x, p, p)
  text = exp.mlir_module()
  assert "jax_dnn_group_norm_bwd" in text and "tensor<?x1x8x2xf32>" in text


@pytest.mark.parametrize("n,spatial,c,dtype,sms,want", [
    # (vec, threads_x, threads_y, chunk_samples, splits): 256-thread blocks,
    # the whole batch a chunk; 2 blocks an SM (rounded down) over the
    # samples, each at least 4 steps of threads_y positions.
    (8, 4096, 320, "bfloat16", 132, (8, 40, 6, 8, 33)),
    (8, 4096, 320, "bfloat16", 0, (8, 40, 6, 8, 33)),       # no device: 132 SMs
    (16, 16384, 128, "bfloat16", 132, (8, 16, 16, 16, 16)),
    (1, 262144, 128, "bfloat16", 132, (8, 16, 16, 1, 264)),
    (8, 4096, 320, "float32", 78, (4, 80, 3, 8, 19)),
    (2, 100, 36, "float32", 132, (4, 9, 28, 2, 1)),          # 4 steps: one block a sample
    (3, 50, 7, "float16", 132, (1, 7, 36, 3, 1)),            # one element a thread
    (2, 0, 64, "bfloat16", 132, (8, 8, 32, 2, 1)),           # no positions
    (600, 64, 64, "bfloat16", 132, (8, 8, 32, 600, 1)),      # more samples than blocks
])
def test_plan(n, spatial, c, dtype, sms, want):
  from jax_dnn._src import plans  # pylint: disable=g-import-not-at-top
  _needs_plans()
  plan = plans.group_norm_plan(n, spatial, c, 32 if c % 32 == 0 else 1, dtype,
                               plans.device_props(sm_count=sms))
  assert plan.supported, plan.reason
  assert (plan.vec, plan.threads_x, plan.threads_y, plan.chunk_samples, plan.splits) == want
  assert plan.apply_rows == 4 * plan.threads_y


@pytest.mark.parametrize("c,groups,dtype,why", [
    (8192, 32, "bfloat16", "more than 512 vectors"),
    (4096, 32, "float32", "more than 512 vectors"),
    (514, 2, "bfloat16", "more than 512 vectors"),   # 514: one element a thread
    (30, 4, "bfloat16", "divisible by groups"),
])
def test_plan_declines(c, groups, dtype, why):
  from jax_dnn._src import plans  # pylint: disable=g-import-not-at-top
  _needs_plans()
  plan = plans.group_norm_plan(2, 64, c, groups, dtype, plans.device_props(sm_count=132))
  assert not plan.supported and why in plan.reason
