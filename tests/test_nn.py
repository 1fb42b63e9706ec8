"""Flax NNX layers: drop-in for flax.nnx.LayerNorm / RMSNorm."""

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_dnn.nn
from helpers import randn


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
