"""Flax NNX layers: jax_dnn.nn.Conv / ConvTranspose against flax.nnx.Conv /
ConvTranspose, and flax.nnx.Conv running jax_dnn.conv_general_dilated.

Each case builds both layers from the same arguments and seed and checks the
parameter trees, outputs and gradients (parameters and input, for a random
cotangent) against Flax's. Error measure: max |ours - flax| / (1 + max |flax|);
1e-5 in fp32 on the CPU (the same math, summed in another order); 5e-3 on a
GPU, where both sides run fp32 through TF32 (10-bit mantissa: 2^-11 relative
per product, well under 1e-3 of the output's scale after the sum); 2e-2 in
bf16 (the fused bias add rounds once where Flax rounds twice: a few bf16
ulps of 2^-8).
"""

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_dnn
import jax_dnn.nn
from helpers import randn, x64

# (in, out, kernel_size, x shape, constructor options): 1D/2D/3D, strides,
# dilations, every padding form Flax takes, groups, masks, channel counts that
# are not a multiple of 8, and zero or two leading batch dimensions.
CONV_CASES = {
    "1d": (4, 6, 3, (2, 11, 4), {}),
    "1d_causal_dilated": (3, 5, (3,), (2, 13, 3), {"padding": "CAUSAL", "kernel_dilation": 2}),
    "1d_strided_valid": (8, 8, 5, (3, 20, 8), {"strides": 2, "padding": "VALID"}),
    "2d": (5, 7, (3, 3), (2, 9, 8, 5), {}),
    "2d_strided": (8, 16, (3, 3), (2, 15, 14, 8), {"strides": 2}),
    "2d_explicit_padding": (6, 4, (3, 2), (2, 7, 9, 6),
                            {"padding": ((1, 2), (0, 1)), "strides": (1, 2)}),
    "2d_int_padding": (4, 4, (3, 3), (1, 6, 6, 4), {"padding": 1, "kernel_dilation": (2, 1)}),
    "2d_circular": (3, 5, (3, 3), (2, 7, 6, 3), {"padding": "CIRCULAR", "strides": 2}),
    "2d_reflect": (3, 5, (3, 3), (2, 7, 6, 3), {"padding": "REFLECT"}),
    "2d_grouped": (8, 12, (3, 3), (2, 7, 7, 8), {"feature_group_count": 4}),
    "2d_depthwise": (6, 6, (5, 5), (2, 9, 9, 6), {"feature_group_count": 6}),
    "2d_no_bias": (4, 6, (3, 3), (2, 6, 6, 4), {"use_bias": False}),
    "2d_input_dilation": (4, 6, (3, 3), (2, 5, 5, 4),
                          {"input_dilation": 2, "padding": ((1, 1), (2, 0))}),
    "2d_masked": (2, 4, (3, 3), (2, 6, 6, 2),
                  {"mask": jnp.tril(jnp.ones((3, 3, 2, 4))), "padding": "VALID"}),
    "2d_unbatched": (3, 4, (3, 3), (6, 5, 3), {}),
    "2d_two_batch_dims": (3, 4, (3, 3), (2, 3, 6, 5, 3), {}),
    "3d": (4, 6, (3, 3, 3), (2, 6, 5, 7, 4), {}),
    "3d_strided": (3, 8, (3, 2, 3), (1, 7, 6, 8, 3), {"strides": (1, 2, 2), "padding": "VALID"}),
}

TRANSPOSE_CASES = {
    "1d": (4, 6, 3, (2, 11, 4), {}),
    "1d_strided_dilated": (3, 5, 4, (2, 9, 3), {"strides": 2, "kernel_dilation": 2}),
    "2d": (5, 7, (3, 3), (2, 6, 5, 5), {}),
    "2d_strided_valid": (8, 4, (4, 4), (2, 6, 6, 8), {"strides": 2, "padding": "VALID"}),
    "2d_explicit_padding": (3, 4, (3, 3), (2, 5, 6, 3),
                            {"strides": (2, 1), "padding": ((1, 2), (0, 1))}),
    "2d_circular": (3, 4, (5, 4), (1, 7, 7, 3), {"strides": 2, "padding": "CIRCULAR"}),
    "2d_circular_transposed": (3, 4, (5, 6), (1, 7, 7, 3),
                               {"strides": 2, "padding": "CIRCULAR", "transpose_kernel": True}),
    "2d_transpose_kernel": (5, 3, (3, 3), (2, 5, 5, 5), {"strides": 2, "transpose_kernel": True}),
    "2d_no_bias": (4, 6, (3, 3), (2, 5, 5, 4), {"use_bias": False}),
    "2d_masked": (2, 4, (3, 3), (2, 5, 5, 2), {"mask": jnp.tril(jnp.ones((3, 3, 2, 4)))}),
    "2d_two_batch_dims": (3, 4, (2, 2), (2, 3, 4, 5, 3), {"strides": 2}),
    "3d": (4, 6, (3, 3, 3), (1, 4, 5, 3, 4), {"strides": 2}),
}


def _tolerance(device, dtype=jnp.float32):
  if jnp.dtype(dtype) != jnp.float32:
    return 2e-2
  return 1e-5 if device.platform == "cpu" else 5e-3


def _error(a, b) -> float:
  a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
  assert a.shape == b.shape
  return float(np.max(np.abs(a - b)) / (1.0 + np.max(np.abs(b))))


def _pair(ours_cls, theirs_cls, args, kwargs):
  """Our layer and Flax's from the same arguments and seed; a nonzero bias
  (Flax initializes it to zeros) so that it counts."""
  kwargs = dict(kwargs, bias_init=nnx.initializers.normal(0.5))
  return (ours_cls(*args, rngs=nnx.Rngs(0), **kwargs),
          theirs_cls(*args, rngs=nnx.Rngs(0), **kwargs))


def _output_and_grads(layer, x, dy):
  """y, and the gradients of sum(y * dy) with respect to the parameters and x (jitted)."""
  graphdef, params, rest = nnx.split(layer, nnx.Param, ...)

  def loss(params, x):
    return jnp.sum(nnx.merge(graphdef, params, rest)(x).astype(jnp.float32) * dy)

  y = jax.jit(lambda params, x: nnx.merge(graphdef, params, rest)(x))(params, x)
  return y, jax.jit(jax.grad(loss, argnums=(0, 1)))(params, x)


def _check_against_flax(ours, theirs, x, tol):
  # Same state trees: names, shapes, dtypes and (same seed) values.
  ours_state, theirs_state = nnx.state(ours), nnx.state(theirs)
  assert jax.tree.structure(ours_state) == jax.tree.structure(theirs_state)
  for a, b in zip(jax.tree.leaves(ours_state), jax.tree.leaves(theirs_state)):
    assert a.shape == b.shape and a.dtype == b.dtype
    np.testing.assert_array_equal(a, b)
  y_ref = theirs(x)
  dy = randn(7, y_ref.shape, jnp.float32)
  (y, (gp, gx)), (y_ref, (gp_ref, gx_ref)) = (_output_and_grads(m, x, dy) for m in (ours, theirs))
  assert y.shape == y_ref.shape and y.dtype == y_ref.dtype
  assert _error(y, y_ref) <= tol
  assert _error(ours(x), y_ref) <= tol  # eager, outside jit
  assert gx.dtype == gx_ref.dtype and _error(gx, gx_ref) <= tol
  assert jax.tree.structure(gp) == jax.tree.structure(gp_ref)
  for g, g_ref in zip(jax.tree.leaves(gp), jax.tree.leaves(gp_ref)):
    assert g.dtype == g_ref.dtype and _error(g, g_ref) <= tol


@pytest.mark.parametrize("name", list(CONV_CASES))
def test_conv_matches_flax(device, name):
  cin, cout, kernel_size, shape, kwargs = CONV_CASES[name]
  ours, theirs = _pair(jax_dnn.nn.Conv, nnx.Conv, (cin, cout, kernel_size), kwargs)
  _check_against_flax(ours, theirs, randn(1, shape, jnp.float32), _tolerance(device))


@pytest.mark.parametrize("name", list(TRANSPOSE_CASES))
def test_conv_transpose_matches_flax(device, name):
  cin, cout, kernel_size, shape, kwargs = TRANSPOSE_CASES[name]
  ours, theirs = _pair(jax_dnn.nn.ConvTranspose, nnx.ConvTranspose, (cin, cout, kernel_size),
                       kwargs)
  _check_against_flax(ours, theirs, randn(2, shape, jnp.float32), _tolerance(device))


@pytest.mark.parametrize("cls,flax_cls", [(jax_dnn.nn.Conv, nnx.Conv),
                                          (jax_dnn.nn.ConvTranspose, nnx.ConvTranspose)])
@pytest.mark.parametrize("kwargs", [{"dtype": jnp.bfloat16},
                                    {"param_dtype": jnp.bfloat16},
                                    {"dtype": jnp.bfloat16,
                                     "preferred_element_type": jnp.float32}])
def test_low_precision_matches_flax(device, cls, flax_cls, kwargs):
  ours, theirs = _pair(cls, flax_cls, (8, 16, (3, 3)), dict(kwargs, strides=2))
  _check_against_flax(ours, theirs, randn(3, (2, 9, 9, 8), jnp.float32),
                      _tolerance(device, jnp.bfloat16))


def test_defaults_and_attributes_are_flax_s():
  """Constructor defaults, parameter names and public attributes as Flax's."""
  for cls, flax_cls in ((jax_dnn.nn.Conv, nnx.Conv),
                        (jax_dnn.nn.ConvTranspose, nnx.ConvTranspose)):
    ours, theirs = cls(3, 4, (3, 3), rngs=nnx.Rngs(0)), flax_cls(3, 4, (3, 3), rngs=nnx.Rngs(0))
    assert isinstance(ours, flax_cls)
    for attr in vars(theirs):
      if attr.startswith("_") or attr == "conv_general_dilated":
        continue
      a, b = getattr(ours, attr), getattr(theirs, attr)
      if isinstance(b, nnx.Variable):
        np.testing.assert_array_equal(a[...], b[...])
      else:
        assert a == b, attr
  assert jax_dnn.nn.Conv(3, 4, 3, rngs=nnx.Rngs(0)).conv_general_dilated is (
      jax_dnn.conv_general_dilated)


@pytest.mark.parametrize("cls,flax_cls", [(jax_dnn.nn.Conv, nnx.Conv),
                                          (jax_dnn.nn.ConvTranspose, nnx.ConvTranspose)])
def test_state_moves_between_ours_and_flax(cls, flax_cls):
  """A checkpoint of one loads into the other: split, merge and update."""
  x = randn(4, (2, 8, 8, 3), jnp.float32)
  ours = cls(3, 5, (3, 3), rngs=nnx.Rngs(1), bias_init=nnx.initializers.normal(0.5))
  theirs = flax_cls(3, 5, (3, 3), rngs=nnx.Rngs(2))
  graphdef, state = nnx.split(ours)
  flax_graphdef, flax_state = nnx.split(theirs)
  assert jax.tree.structure(state) == jax.tree.structure(flax_state)
  nnx.update(theirs, state)
  assert _error(theirs(x), ours(x)) <= 1e-5
  merged = nnx.merge(graphdef, flax_state)
  assert type(merged) is cls
  assert _error(merged(x), nnx.merge(flax_graphdef, flax_state)(x)) <= 1e-5


def test_flax_conv_takes_our_conv_general_dilated(device):
  """flax.nnx.Conv(..., conv_general_dilated=jax_dnn.conv_general_dilated)."""
  kwargs = dict(strides=2, feature_group_count=2, kernel_dilation=(1, 2),
                bias_init=nnx.initializers.normal(0.5))
  ours = nnx.Conv(4, 6, (3, 3), conv_general_dilated=jax_dnn.conv_general_dilated,
                  rngs=nnx.Rngs(0), **kwargs)
  theirs = nnx.Conv(4, 6, (3, 3), rngs=nnx.Rngs(0), **kwargs)
  _check_against_flax(ours, theirs, randn(5, (2, 9, 10, 4), jnp.float32), _tolerance(device))


def _spy(monkeypatch, name):
  calls = []
  real = getattr(jax_dnn, name)

  def spy(*args, **kwargs):
    calls.append(name)
    return real(*args, **kwargs)
  monkeypatch.setattr(jax_dnn, name, spy)
  return calls


def test_conv_runs_our_ops(monkeypatch):
  """The fused op where the layer has a bias and nothing the fused form lacks;
  the layer's conv_general_dilated (jax_dnn's by default) otherwise."""
  x = randn(6, (2, 6, 6, 4), jnp.float32)
  fused = _spy(monkeypatch, "conv")
  jax_dnn.nn.Conv(4, 8, (3, 3), rngs=nnx.Rngs(0))(x)
  jax_dnn.nn.Conv(4, 8, (3, 3), padding=((0, 1), (2, 0)), strides=2, rngs=nnx.Rngs(0))(x)
  assert fused == ["conv", "conv"]
  seen = []
  for kwargs in ({"use_bias": False}, {"input_dilation": 2, "padding": 1},
                 {"padding": "CIRCULAR"},
                 {"precision": jax.lax.Precision.HIGHEST},
                 {"preferred_element_type": jnp.float32}):
    def general(*args, **kw):
      seen.append(kwargs)
      return jax.lax.conv_general_dilated(*args, **kw)
    y = jax_dnn.nn.Conv(4, 8, (3, 3), rngs=nnx.Rngs(0), **kwargs)(x)
    y_ref = nnx.Conv(4, 8, (3, 3), rngs=nnx.Rngs(0), **kwargs)(x)
    assert _error(y, y_ref) <= 1e-5
    jax_dnn.nn.Conv(4, 8, (3, 3), rngs=nnx.Rngs(0), conv_general_dilated=general, **kwargs)(x)
  assert fused == ["conv", "conv"] and len(seen) == 5
  transposed = _spy(monkeypatch, "conv_transpose")
  jax_dnn.nn.ConvTranspose(4, 8, (3, 3), strides=2, rngs=nnx.Rngs(0))(x)
  assert transposed == ["conv_transpose"]


def test_mask_of_the_wrong_shape_raises():
  for cls in (jax_dnn.nn.Conv, jax_dnn.nn.ConvTranspose):
    layer = cls(2, 4, (3, 3), mask=jnp.ones((3, 3, 4, 2)), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="Mask needs to have the same shape as weights"):
      layer(jnp.ones((1, 5, 5, 2)))


def test_edge_inputs_as_flax():
  """A window past the input (no output), float64 under x64, an empty batch
  with CIRCULAR padding (Flax's own reshape fails there: ours gives the
  empty result), and a negative dilation (Flax's exception type, the
  argument named)."""
  conv = lambda cls, **kw: _pair(cls, nnx.Conv if cls is jax_dnn.nn.Conv else nnx.ConvTranspose,
                                 (3, 4, (3, 3)), kw)
  ours, theirs = conv(jax_dnn.nn.Conv, padding="VALID")
  x = randn(1, (2, 2, 5, 3), jnp.float32)
  assert ours(x).shape == theirs(x).shape == (2, 0, 3, 4)
  with x64():
    ours, theirs = conv(jax_dnn.nn.Conv, param_dtype=jnp.float64)
    x = jnp.asarray(np.random.default_rng(2).normal(size=(2, 5, 5, 3)))
    y, want = ours(x), theirs(x)
    assert y.dtype == want.dtype == jnp.float64
    np.testing.assert_allclose(y, want, rtol=1e-12, atol=1e-12)
  ours, theirs = conv(jax_dnn.nn.ConvTranspose, strides=2, padding="CIRCULAR")
  assert ours(jnp.ones((0, 5, 5, 3))).shape == (0,) + theirs(jnp.ones((1, 5, 5, 3))).shape[1:]
  ours, theirs = conv(jax_dnn.nn.Conv, kernel_dilation=-1)
  x = randn(1, (1, 5, 5, 3), jnp.float32)
  try:
    theirs(x)
  except (TypeError, ValueError) as e:
    want = type(e)
  with pytest.raises(want, match="rhs_dilation must hold positive ints"):
    ours(x)


def test_training_step_under_nnx_jit(device):
  """nnx.jit + nnx.grad through a small Conv -> ConvTranspose model, as Flax's."""
  class Model(nnx.Module):
    def __init__(self, conv, conv_t, rngs):
      self.down = conv(3, 8, (3, 3), strides=2, rngs=rngs)
      self.up = conv_t(8, 3, (2, 2), strides=2, rngs=rngs)

    def __call__(self, x):
      return self.up(jax.nn.relu(self.down(x)))

  x = randn(8, (2, 8, 8, 3), jnp.float32)

  @nnx.jit
  def step(model):
    loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - x) ** 2))(model)
    return loss, grads

  loss, grads = step(Model(jax_dnn.nn.Conv, jax_dnn.nn.ConvTranspose, nnx.Rngs(0)))
  loss_ref, grads_ref = step(Model(nnx.Conv, nnx.ConvTranspose, nnx.Rngs(0)))
  tol = _tolerance(device)
  assert abs(float(loss) - float(loss_ref)) <= tol * (1 + abs(float(loss_ref)))
  assert jax.tree.structure(grads) == jax.tree.structure(grads_ref)
  for g, g_ref in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_ref)):
    assert _error(g, g_ref) <= tol
