"""Flax NNX layers: drop-in for flax.nnx.LayerNorm / RMSNorm."""

import inspect

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_dnn.nn
from helpers import randn, x64


@pytest.mark.parametrize("kwargs", [{}, {"use_bias": False}, {"use_scale": False},
                                    {"epsilon": 1e-3, "param_dtype": jnp.bfloat16}])
def test_layer_norm_matches_flax(device, kwargs):
  x = randn(1, (4, 6, 32), jnp.float32, offset=2.0)
  ours = jax_dnn.nn.LayerNorm(32, rngs=nnx.Rngs(0), **kwargs)
  theirs = nnx.LayerNorm(32, rngs=nnx.Rngs(0), **kwargs)
  # Same parameter names, shapes and dtypes.
  ours_state, theirs_state = nnx.state(ours, nnx.Param), nnx.state(theirs, nnx.Param)
  assert jax.tree.map(lambda a: (a.shape, a.dtype), ours_state) == jax.tree.map(
      lambda a: (a.shape, a.dtype), theirs_state)
  # Perturb the parameters identically so that scale/bias matter.
  for st in (ours_state, theirs_state):
    nnx.update(ours if st is ours_state else theirs,
               jax.tree.map(lambda a: a + 0.1 * randn(9, a.shape, a.dtype), st))
  y, y_ref = ours(x), theirs(x)
  assert y.dtype == y_ref.dtype
  np.testing.assert_allclose(y, y_ref, rtol=2e-2 if kwargs.get("param_dtype") else 2e-5,
                             atol=2e-2 if kwargs.get("param_dtype") else 2e-5)


@pytest.mark.parametrize("kwargs", [{}, {"use_scale": False}])
def test_rms_norm_matches_flax(device, kwargs):
  x = randn(2, (3, 64), jnp.float32)
  ours = jax_dnn.nn.RMSNorm(64, rngs=nnx.Rngs(0), **kwargs)
  theirs = nnx.RMSNorm(64, rngs=nnx.Rngs(0), **kwargs)
  np.testing.assert_allclose(ours(x), theirs(x), rtol=2e-5, atol=2e-5)


def test_gradients_through_the_layer(device):
  x = randn(3, (8, 16), jnp.bfloat16)
  model = jax_dnn.nn.LayerNorm(16, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
  ref = nnx.LayerNorm(16, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
  loss = lambda m: jnp.sum(m(x).astype(jnp.float32) ** 2)
  g = nnx.grad(loss)(model)
  g_ref = nnx.grad(loss)(ref)
  assert g["scale"][...].dtype == jnp.float32
  np.testing.assert_allclose(g["scale"][...], g_ref["scale"][...], rtol=5e-2, atol=5e-2)
  np.testing.assert_allclose(g["bias"][...], g_ref["bias"][...], rtol=5e-2, atol=5e-2)


def test_unsupported_axes_raise():
  with pytest.raises(ValueError, match="only reduction_axes=-1"):
    jax_dnn.nn.LayerNorm(8, reduction_axes=(-2, -1), rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="axis_name"):
    jax_dnn.nn.RMSNorm(8, axis_name="batch", rngs=nnx.Rngs(0))


LAYERS = [(jax_dnn.nn.LayerNorm, nnx.LayerNorm), (jax_dnn.nn.RMSNorm, nnx.RMSNorm)]


def _signature(fn):
  return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


@pytest.mark.parametrize("ours,theirs", LAYERS, ids=lambda c: c.__name__)
def test_signatures_match_flax(ours, theirs):
  """Every argument of the installed Flax's layer, in its position, kind and default."""
  for method in ("__init__", "__call__"):
    assert _signature(getattr(ours, method)) == _signature(getattr(theirs, method)), method


@pytest.mark.parametrize("kwargs", [{"use_bias": False}, {"use_scale": False}, {}])
@pytest.mark.parametrize("ours,theirs", LAYERS, ids=lambda c: c.__name__)
def test_parameter_metadata_and_state_match_flax(ours, theirs, kwargs):
  if ours is jax_dnn.nn.RMSNorm:
    kwargs = {k: v for k, v in kwargs.items() if k != "use_bias"}
  else:
    kwargs = dict(kwargs, bias_metadata={"kind": "shift"})
  kwargs["scale_metadata"] = {"kind": "gain"}
  ours, theirs = (layer(6, rngs=nnx.Rngs(0), **kwargs) for layer in (ours, theirs))
  ours_state, theirs_state = nnx.state(ours), nnx.state(theirs)
  assert jax.tree.structure(ours_state) == jax.tree.structure(theirs_state)
  for (path, a), (path_b, b) in zip(nnx.to_flat_state(ours_state), nnx.to_flat_state(theirs_state)):
    assert path == path_b and type(a) is type(b)
    assert a.get_metadata() == b.get_metadata(), path
    np.testing.assert_array_equal(a[...], b[...])


def _mask(shape, seed):
  """Random positions, at least one in each row."""
  m = np.random.default_rng(seed).random(shape) < 0.6
  m[..., 0] = True
  return jnp.asarray(m)


@pytest.mark.parametrize("ours,theirs", LAYERS, ids=lambda c: c.__name__)
def test_mask_matches_flax(device, ours, theirs):
  """Statistics over the masked positions (RMSNorm's mask positional, as
  Flax's); a row with no position gives the bias, not Flax's NaN."""
  x = randn(4, (3, 5, 16), jnp.float32, offset=1.0)
  ours, theirs = (layer(16, rngs=nnx.Rngs(0)) for layer in (ours, theirs))
  for layer in (ours, theirs):  # parameters that matter, the same in both
    for name in ("scale", "bias"):
      if hasattr(layer, name):
        getattr(layer, name)[...] = randn(5, (16,), jnp.float32, offset=1.0)
  mask = _mask(x.shape, 0)
  call = (lambda m, a, k: m(a, mask=k)) if isinstance(ours, jax_dnn.nn.LayerNorm) else (
      lambda m, a, k: m(a, k))
  np.testing.assert_allclose(call(ours, x, mask), call(theirs, x, mask), rtol=2e-5, atol=2e-5)
  # A mask broadcast over the rows.
  np.testing.assert_allclose(call(ours, x, mask[0, 0]), call(theirs, x, mask[0, 0]),
                             rtol=2e-5, atol=2e-5)
  empty_row = mask.at[1, 2].set(False)
  y = call(ours, x, empty_row)
  bias = ours.bias[...] if isinstance(ours, jax_dnn.nn.LayerNorm) else jnp.zeros(16)
  np.testing.assert_array_equal(y[1, 2], bias)
  np.testing.assert_array_equal(np.delete(np.asarray(y).reshape(15, 16), 7, 0),
                                np.delete(np.asarray(call(ours, x, mask)).reshape(15, 16), 7, 0))
  grads = nnx.grad(lambda m: jnp.sum(call(m, x, empty_row) ** 2))(ours)
  assert all(np.isfinite(g).all() for g in jax.tree.leaves(grads))
  with pytest.raises(ValueError, match="mask must be a boolean array"):
    call(ours, x, mask.astype(jnp.int32))
  with pytest.raises(ValueError, match="does not broadcast"):
    call(ours, x, mask[:2])


@pytest.mark.parametrize("ours,theirs", LAYERS, ids=lambda c: c.__name__)
def test_float64_and_integer_inputs_match_flax(device, ours, theirs):
  x_int = jnp.asarray(np.arange(-8, 16).reshape(3, 8) ** 2 % 7, jnp.int32)
  layers = [layer(8, rngs=nnx.Rngs(0)) for layer in (ours, theirs)]
  y, want = (layer(x_int) for layer in layers)
  assert y.dtype == want.dtype == jnp.float32
  np.testing.assert_allclose(y, want, rtol=2e-5, atol=2e-5)
  with x64():
    x = jnp.asarray(np.random.default_rng(1).normal(size=(3, 8)))
    layers = [layer(8, param_dtype=jnp.float64, use_fast_variance=False, rngs=nnx.Rngs(0))
              for layer in (ours, theirs)]
    y, want = (layer(x) for layer in layers)
    assert y.dtype == want.dtype == jnp.float64
    np.testing.assert_allclose(y, want, rtol=1e-12, atol=1e-12)
