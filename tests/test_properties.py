"""Property-based tests (hypothesis): every op against its peer over random
shapes (0- and 1-size axes included), dtypes, strides, paddings and axes
within the documented domain, with NaN and +-Inf injected.

Each property asserts the peer's semantics: the same shape and dtype, NaN at
the same positions, the same infinities, and values within the op's
tolerance elsewhere. On the CPU the reference path runs; the `device`
fixture's gpu variant runs the same properties on the kernels.

Examples are drawn small (the kernels' tiles are reached by their own
tests); `derandomize` keeps CI reproducible, and each property runs a fixed
number of examples.
"""

from __future__ import annotations

from flax.linen import pooling as flax_pooling
from hypothesis import HealthCheck, given, settings, strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_dnn

_SETTINGS = settings(max_examples=25, deadline=None, derandomize=True, database=None,
                     suppress_health_check=[HealthCheck.function_scoped_fixture,
                                            HealthCheck.too_slow])
_FLOATS = (jnp.float32, jnp.bfloat16, jnp.float16)
# Relative tolerance a dtype: a few units in the last place of the
# dtype's result (the kernels compute in fp32 and round once).
_TOL = {jnp.dtype(jnp.float32): 1e-5, jnp.dtype(jnp.bfloat16): 2e-2,
        jnp.dtype(jnp.float16): 2e-3}


def _shape(min_rank=0, max_rank=3, max_side=9):
  return st.lists(st.integers(0, max_side), min_size=min_rank, max_size=max_rank).map(tuple)


@st.composite
def _array(draw, shape, dtype, special=True):
  """Random normal values in dtype, some replaced by NaN, +inf or -inf."""
  seed = draw(st.integers(0, 2**31 - 1))
  rng = np.random.default_rng(seed)
  x = 2.0 * rng.standard_normal(shape).astype(np.float32)
  if special and x.size:
    for value in draw(st.lists(st.sampled_from([np.nan, np.inf, -np.inf]), max_size=3)):
      x.flat[rng.integers(x.size)] = value
  return jnp.asarray(x, dtype)


def _assert_like_peer(got, want, tol):
  """Same shape and dtype; NaN where the peer has NaN (and only there); the
  same infinities; close elsewhere."""
  assert got.shape == want.shape, (got.shape, want.shape)
  assert got.dtype == want.dtype, (got.dtype, want.dtype)
  g = np.asarray(got.astype(jnp.float32)) if got.dtype != jnp.bool_ else np.asarray(got)
  w = np.asarray(want.astype(jnp.float32)) if want.dtype != jnp.bool_ else np.asarray(want)
  np.testing.assert_array_equal(np.isnan(g), np.isnan(w), err_msg="NaN positions")
  np.testing.assert_array_equal(np.isposinf(g), np.isposinf(w), err_msg="+inf positions")
  np.testing.assert_array_equal(np.isneginf(g), np.isneginf(w), err_msg="-inf positions")
  finite = np.isfinite(w)
  np.testing.assert_allclose(g[finite], w[finite], rtol=tol, atol=tol)


_UNARY = {
    "relu": (jax_dnn.relu, jax.nn.relu),
    "gelu": (lambda x: jax_dnn.gelu(x, approximate=False),
             lambda x: jax.nn.gelu(x, approximate=False)),
    "gelu_tanh": (jax_dnn.gelu, jax.nn.gelu),
    "silu": (jax_dnn.silu, jax.nn.silu),
    "sigmoid": (jax_dnn.sigmoid, jax.nn.sigmoid),
    "tanh": (jax_dnn.tanh, jnp.tanh),
}


@pytest.mark.parametrize("name", list(_UNARY))
def test_activation_like_peer(device, name):
  del device
  ours, peer = _UNARY[name]

  @_SETTINGS
  @given(st.data())
  def check(data):
    dtype = data.draw(st.sampled_from(_FLOATS))
    x = data.draw(_array(data.draw(_shape()), dtype))
    # The peer in fp32, rounded once (as the kernels compute): jax's bf16
    # GELU rounds its intermediates and differs by more than an ulp.
    want = peer(x.astype(jnp.float32)).astype(dtype)
    _assert_like_peer(jax.jit(ours)(x), want, 2 * _TOL[jnp.dtype(dtype)])

  check()


@pytest.mark.parametrize("log", [False, True])
def test_softmax_like_peer(device, log):
  del device
  ours = jax_dnn.log_softmax if log else jax_dnn.softmax
  peer = jax.nn.log_softmax if log else jax.nn.softmax

  @_SETTINGS
  @given(st.data())
  def check(data):
    dtype = data.draw(st.sampled_from(_FLOATS))
    shape = data.draw(_shape(min_rank=1))
    axis = data.draw(st.integers(-len(shape), len(shape) - 1))
    x = data.draw(_array(shape, dtype))
    want = peer(x.astype(jnp.float32), axis=axis).astype(dtype)
    tol = 4 * _TOL[jnp.dtype(dtype)]
    _assert_like_peer(jax.jit(lambda a: ours(a, axis=axis))(x), want, tol)

  check()


def _layer_norm_peer(x, scale, bias, rms):
  xf = x.astype(jnp.float32)
  if rms:
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, -1, keepdims=True) + 1e-6) * scale
  else:
    mean = xf.mean(-1, keepdims=True)
    y = (xf - mean) * jax.lax.rsqrt(jnp.square(xf - mean).mean(-1, keepdims=True) + 1e-6)
    y = y * scale + bias
  return y.astype(x.dtype)


@pytest.mark.parametrize("rms", [False, True])
def test_norm_like_peer(device, rms):
  del device

  @_SETTINGS
  @given(st.data())
  def check(data):
    dtype = data.draw(st.sampled_from(_FLOATS))
    shape = data.draw(_shape(min_rank=1))
    shape = shape[:-1] + (max(shape[-1], 1),)  # a row of at least one feature
    x = data.draw(_array(shape, dtype))
    scale = data.draw(_array(shape[-1:], jnp.float32, special=False))
    bias = data.draw(_array(shape[-1:], jnp.float32, special=False))
    if rms:
      got = jax.jit(lambda a, s: jax_dnn.rms_norm(a, s, epsilon=1e-6))(x, scale)
    else:
      got = jax.jit(lambda a, s, b: jax_dnn.layer_norm(a, s, b, epsilon=1e-6))(x, scale, bias)
    # A row holding +-inf is NaN in both (inf - inf); the row's other
    # values too.
    _assert_like_peer(got, _layer_norm_peer(x, scale, bias, rms), 8 * _TOL[jnp.dtype(dtype)])

  check()


@pytest.mark.parametrize("kind", ["max", "avg"])
def test_pool_like_flax(device, kind):
  del device
  ours = jax_dnn.max_pool if kind == "max" else jax_dnn.avg_pool
  peer = flax_pooling.max_pool if kind == "max" else flax_pooling.avg_pool

  @_SETTINGS
  @given(st.data())
  def check(data):
    dtype = data.draw(st.sampled_from(_FLOATS))
    spatial = data.draw(st.integers(1, 2))
    window = tuple(data.draw(st.lists(st.integers(1, 3), min_size=spatial, max_size=spatial)))
    strides = tuple(data.draw(st.lists(st.integers(1, 3), min_size=spatial, max_size=spatial)))
    sizes = tuple(w + data.draw(st.integers(0, 5)) for w in window)
    padding = data.draw(st.sampled_from(["VALID", "SAME"]))
    shape = (data.draw(st.integers(1, 3)), *sizes, data.draw(st.integers(1, 9)))
    x = data.draw(_array(shape, dtype))
    kwargs = dict(window_shape=window, strides=strides, padding=padding)
    got = jax.jit(lambda a: ours(a, **kwargs))(x)
    want = peer(x.astype(jnp.float32), **kwargs).astype(dtype)
    _assert_like_peer(got, want, 4 * _TOL[jnp.dtype(dtype)])

  check()


def test_conv_like_lax(device):
  """Values (finite inputs: a convolution's NaN positions follow from its
  windows, which the value comparison checks)."""
  del device

  @_SETTINGS
  @given(st.data())
  def check(data):
    dtype = data.draw(st.sampled_from(_FLOATS))
    spatial = data.draw(st.integers(1, 2))
    pick = lambda lo, hi: tuple(data.draw(st.lists(st.integers(lo, hi), min_size=spatial,
                                                   max_size=spatial)))
    window, strides, dilation = pick(1, 3), pick(1, 2), pick(1, 2)
    groups = data.draw(st.sampled_from([1, 2]))
    cin, cout = groups * data.draw(st.integers(1, 4)), groups * data.draw(st.integers(1, 3))
    sizes = tuple((w - 1) * d + 1 + data.draw(st.integers(0, 4))
                  for w, d in zip(window, dilation))
    padding = data.draw(st.sampled_from(["VALID", "SAME"]))
    x = data.draw(_array((data.draw(st.integers(1, 2)), cin, *sizes), dtype, special=False))
    w = data.draw(_array((cout, cin // groups, *window), dtype, special=False))
    kwargs = dict(window_strides=strides, padding=padding, rhs_dilation=dilation,
                  feature_group_count=groups, preferred_element_type=jnp.float32)
    got = jax.jit(lambda a, b: jax_dnn.conv_general_dilated(a, b, **kwargs))(x, w)
    with jax.default_matmul_precision("highest"):
      want = jax.lax.conv_general_dilated(x.astype(jnp.float32), w.astype(jnp.float32),
                                          **kwargs)
    # fp32 inputs may run TF32 (2^-10 relative a product); sums of up to
    # 4 x 9 products of values ~2.
    tol = 1e-2 if dtype == jnp.float32 else 4 * _TOL[jnp.dtype(dtype)]
    _assert_like_peer(got, want, tol * max(1.0, float(np.sqrt(cin * np.prod(window)))))

  check()


def test_attention_like_peer(device):
  del device

  @_SETTINGS
  @given(st.data())
  def check(data):
    dtype = data.draw(st.sampled_from([jnp.bfloat16, jnp.float16]))
    b, t, s = data.draw(st.integers(1, 2)), data.draw(st.integers(1, 9)), data.draw(st.integers(1, 9))
    kv_heads = data.draw(st.integers(1, 2))
    n, h = kv_heads * data.draw(st.integers(1, 2)), data.draw(st.sampled_from([8, 16, 24]))
    causal = data.draw(st.booleans())
    q = data.draw(_array((b, t, n, h), dtype, special=False))
    k = data.draw(_array((b, s, kv_heads, h), dtype, special=False))
    v = data.draw(_array((b, s, kv_heads, h), dtype, special=False))
    got = jax.jit(lambda *a: jax_dnn.dot_product_attention(*a, is_causal=causal))(q, k, v)
    f32 = [a.astype(jnp.float32) for a in (q, k, v)]
    with jax.default_matmul_precision("highest"):
      want = jax.nn.dot_product_attention(*f32, is_causal=causal).astype(dtype)
    _assert_like_peer(got, want, 8 * _TOL[jnp.dtype(dtype)])

  check()
