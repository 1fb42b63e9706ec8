"""relu, gelu (exact and tanh), silu, sigmoid, tanh, and the fused bias_act:
against fp64 references over shapes and dtypes, extreme inputs, bad inputs.
jit/vmap/grad, check_grads and the CUDA lowering of each op:
tests/test_transforms.py (the table in tests/op_cases.py)."""

import contextlib
import functools

import jax
from jax.test_util import check_grads
import jax.numpy as jnp
import numpy as np
import pytest

import jax_dnn
from helpers import DTYPES, check_fwd_bwd, on_gpu, randn, x64

UNARY = {
    "relu": (jax_dnn.relu, jax.nn.relu),
    "gelu": (functools.partial(jax_dnn.gelu, approximate=False),
             functools.partial(jax.nn.gelu, approximate=False)),
    "gelu_tanh": (jax_dnn.gelu, functools.partial(jax.nn.gelu, approximate=True)),
    "silu": (jax_dnn.silu, jax.nn.silu),
    "sigmoid": (jax_dnn.sigmoid, jax.nn.sigmoid),
    "tanh": (jax_dnn.tanh, jnp.tanh),
}
NAIVE = {name: naive for name, (_, naive) in UNARY.items()}

# Sizes that are / are not a multiple of the vector width, 1 element, empty.
SHAPES = [(1,), (7,), (3, 1000), (4, 257), (64, 1024), (0, 4)]


@pytest.mark.parametrize("name", UNARY)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_unary_against_reference(device, name, dtype, shape):
  ours, naive = UNARY[name]
  x = randn(1, shape, dtype, scale=3.0)
  reused = check_fwd_bwd(device, ours, naive, (x,), dtype, what=name)
  if on_gpu(device) and x.size:
    assert reused >= 1


def naive_bias_act(x, bias, activation):
  return NAIVE[activation](x + bias.astype(x.dtype)).astype(x.dtype)


@pytest.mark.parametrize("activation", UNARY)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", [(1, 1), (5, 7), (2, 3, 96), (300, 64), (64, 4096), (0, 8)],
                         ids=str)
def test_bias_act_against_reference(device, activation, dtype, shape):
  x = randn(2, shape, dtype, scale=2.0)
  bias = randn(3, shape[-1:], dtype)
  reused = check_fwd_bwd(device, functools.partial(jax_dnn.bias_act, activation=activation),
                         functools.partial(naive_bias_act, activation=activation), (x, bias),
                         dtype, what=f"bias_act {activation}")
  if on_gpu(device) and x.size:
    assert reused >= 1


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("width", [72, 35], ids=lambda w: f"width{w}")
def test_bias_act_grouped(device, dtype, width):
  """vmap over x and bias: each group of rows takes its own bias (the
  kernels' split of a flat index into row, column and group) across many
  blocks; width 35 takes the scalar path."""
  x = randn(9, (3, 700, width), dtype, scale=2.0)
  bias = randn(10, (3, width), dtype)
  act = functools.partial(jax_dnn.bias_act, activation="gelu")
  naive = functools.partial(naive_bias_act, activation="gelu")
  check_fwd_bwd(device, jax.vmap(act), jax.vmap(naive), (x, bias), dtype, what="grouped bias_act")


# Inputs large enough for the forward's wide layout (four 16-byte units a
# thread, over 8 blocks an SM: ~1.6-1.8 M units, past that on up to 200 SMs),
# where a thread's units share a bias column: blocks of 256, 128 and 32 units
# of columns (4096, 3072 and 11008 wide bf16; rows not a multiple of a
# block's rows), rows that divide 256 units (1024 wide; 4 wide on the scalar
# path), fp32 (4-element units); and where they do not (1000 wide bf16: 125
# units). The backward's two-row loop (every activation but the erf GELU)
# and one-row loop (erf GELU) see several rows a thread here.
WIDE = [((3458, 4096), jnp.bfloat16), ((4501, 3072), jnp.bfloat16), ((1201, 11008), jnp.bfloat16),
        ((13501, 1024), jnp.float16), ((450001, 4), jnp.bfloat16), ((3458, 4096), jnp.float32),
        ((13501, 1000), jnp.bfloat16)]


@pytest.mark.gpu
@pytest.mark.parametrize("shape,dtype", WIDE, ids=lambda a: str(a) if isinstance(a, tuple)
                         else jnp.dtype(a).name)
def test_bias_act_wide(gpu, shape, dtype):
  x = randn(11, shape, dtype, scale=2.0)
  bias = randn(12, shape[-1:], dtype)
  for activation in ("gelu_tanh", "relu", "silu", "sigmoid", "gelu"):
    reused = check_fwd_bwd(gpu, functools.partial(jax_dnn.bias_act, activation=activation),
                           functools.partial(naive_bias_act, activation=activation), (x, bias),
                           dtype, what=f"wide bias_act {activation}")
    assert reused >= 1


# Where the kernels' sigmoid 1 / (1 + e) (tanh GELU, SiLU, sigmoid) meets
# e = inf (s = 0, and e * s = NaN in the gradients' 1 - s = e s), e = 0, and
# results near fp32's smallest normal; fp16 takes the values it can hold.
# Past 1.8e19, x^2 overflows fp32 (the tanh GELU's gradient polynomial).
EXTREME = [-3e38, -2e19, -1e10, -1e4, -100.0, -89.0, -50.0, -20.0, -10.0, -7.0, -5.0, -1.0, -1e-3,
           -1e-30, 0.0, 1e-30, 1e-3, 1.0, 5.0, 7.0, 10.0, 20.0, 50.0, 89.0, 100.0, 1e4, 1e10, 2e19,
           3e38]


def _sigmoid64(z):
  with np.errstate(over="ignore"):
    return 1.0 / (1.0 + np.exp(-z))


def _stable_reference(name, x):
  """(y, dy/dx) in fp64 through sigmoid(z) and 1 - sigmoid(z) = sigmoid(-z),
  without the cancellation that jax.nn's forms have even in fp64 (1 + tanh(u)
  at x = -7, s (1 - s) at x = 50)."""
  if name == "sigmoid":
    return _sigmoid64(x), _sigmoid64(x) * _sigmoid64(-x)
  if name == "silu":
    s = _sigmoid64(x)
    return x * s, s + x * s * _sigmoid64(-x)
  k, c = np.sqrt(2.0 / np.pi), 0.044715
  two_u = 2.0 * k * (x + c * x**3)
  s = _sigmoid64(two_u)
  return x * s, s + 2.0 * k * x * s * _sigmoid64(-two_u) * (1.0 + 3.0 * c * x * x)


# GPU only: the reference path (jax.nn's forms in fp32) fails the relative
# bound here by cancellation, which the kernels' forms avoid. Results under
# 1e-30 in magnitude may come out as 0 (silu(-89) = -2e-37: the sigmoid's
# exp overflows; XLA's fp32 silu gives 0 there too).
@pytest.mark.gpu
@pytest.mark.parametrize("name", ["gelu_tanh", "silu", "sigmoid"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", [(4, 64), (5, 7)], ids=str)  # vector and scalar paths
def test_sigmoid_forms_at_extreme_inputs(gpu, name, dtype, shape):
  vals = np.array([v for v in EXTREME if abs(v) <= float(jnp.finfo(dtype).max)])
  x = jnp.asarray(np.resize(vals, shape), dtype)
  assert x.size >= len(vals)  # every value, on either path
  ref, ref_dx = _stable_reference(name, np.asarray(x, np.float64))
  assert np.all(np.isfinite(ref)) and np.all(np.isfinite(ref_dx))
  rtol = 1e-4 if dtype == jnp.float32 else 1e-2
  atol = max(float(jnp.finfo(dtype).tiny), 1e-30)  # fp16: 6.1e-5, its smallest normal
  zero_bias = jnp.zeros(shape[-1:], dtype)  # the bias + activation kernels, on the same values
  with_bias = lambda a: jax_dnn.bias_act(a, zero_bias, activation=name)
  for op, ours in (("unary", UNARY[name][0]), ("bias_act", with_bias)):
    y, vjp = jax.vjp(jax.jit(ours), x)
    (dx,) = vjp(jnp.ones_like(y))
    for what, out, r in (("forward", y, ref), ("gradient", dx, ref_dx)):
      out = np.asarray(jnp.asarray(out, jnp.float32), np.float64)
      assert np.all(np.isfinite(out)), (name, op, what, np.asarray(x)[~np.isfinite(out)])
      bad = np.abs(out - r) > rtol * np.abs(r) + atol
      assert not bad.any(), (name, op, what, np.asarray(x, np.float64)[bad], out[bad], r[bad])


# The unary ops and one activation of bias_act: tests/test_transforms.py.
@pytest.mark.parametrize("name", [n for n in UNARY if n != "relu"])
def test_bias_act_check_grads(device, name):
  x = randn(7, (4, 5), jnp.float32)
  check_grads(functools.partial(jax_dnn.bias_act, activation=name), (x, randn(8, (5,), jnp.float32)),
              order=1, modes=("rev",), atol=1e-2, rtol=1e-2)


def test_relu_grad_at_zero_matches_jax(device):
  x = jnp.array([-1.0, 0.0, 2.0], jnp.float32)
  np.testing.assert_array_equal(jax.grad(lambda v: jax_dnn.relu(v).sum())(x),
                                jax.grad(lambda v: jax.nn.relu(v).sum())(x))


def test_bad_inputs():
  x = jnp.ones((2, 8), jnp.float32)
  with pytest.raises(ValueError, match="activation must be one of"):
    jax_dnn.bias_act(x, jnp.ones(8), activation="swish")
  with pytest.raises(ValueError, match=r"bias must have shape \(8,\)"):
    jax_dnn.bias_act(x, jnp.ones(3))
  with pytest.raises(TypeError, match="approximate must be a bool"):
    jax_dnn.gelu(x, approximate="yes")


# bias_act on rows that are not a multiple of the 16-byte vector (the scalar
# path: the forward's row tiles, or its flat kernel where a tile's threads
# would idle (33 wide); 8 rows in flight a thread backward): small odd and
# prime widths on both devices; on the GPU row counts that end inside a
# tile, many rows a thread backward, and prime widths.
ODD_WIDTHS = [(5, 7), (3, 1025)]
ODD_WIDTHS_GPU = [(20001, 33), (3000, 1000), (900, 4097), (300, 12289), (20, 65537)]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", ODD_WIDTHS, ids=str)
def test_bias_act_odd_widths(device, dtype, shape):
  x = randn(41, shape, dtype, scale=2.0)
  bias = randn(42, shape[-1:], dtype)
  reused = check_fwd_bwd(device, functools.partial(jax_dnn.bias_act, activation="gelu_tanh"),
                         functools.partial(naive_bias_act, activation="gelu_tanh"), (x, bias),
                         dtype, what=f"bias_act {shape}")
  if on_gpu(device):
    assert reused >= 1


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", ODD_WIDTHS_GPU, ids=str)
def test_bias_act_odd_widths_gpu(gpu, dtype, shape):
  x = randn(43, shape, dtype, scale=2.0)
  bias = randn(44, shape[-1:], dtype)
  for activation in ("gelu_tanh", "gelu"):
    reused = check_fwd_bwd(gpu, functools.partial(jax_dnn.bias_act, activation=activation),
                           functools.partial(naive_bias_act, activation=activation), (x, bias),
                           dtype, what=f"bias_act {activation} {shape}")
    assert reused >= 1


def _result(fn, *args):
  """fn's result type (dtype, shape, weak type) and values, or its exception's type."""
  try:
    y = fn(*args)
  except Exception as e:  # pylint: disable=broad-except
    return type(e), None
  return jax.typeof(y), np.asarray(y)


def assert_like_peer(what, ours, peer, *args):
  (got_type, got), (want_type, want) = _result(ours, *args), _result(peer, *args)
  assert got_type == want_type, what
  if want is not None:
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6, err_msg=what)


# What the kernels do not take, as (input, whether under x64): the peers
# return int for relu, float32 for gelu/tanh, raise TypeError for
# sigmoid/silu of int or bool, keep complex, type Python scalars weakly. A
# NumPy float64 array without x64 is float32 to JAX: the kernels run it.
DTYPE_GRID = {
    "int32": (np.array([[-2, 0, 3]], np.int32), False),
    "bool": (np.array([[True, False, True]]), False),
    "complex64": (np.array([[1 + 1j, -2.0, 0.5j]], np.complex64), False),
    "python float": (-1.5, False),
    "python int": (3, False),
    "numpy float64": (np.array([[-1.5, 0.25, 2.0]]), False),
    "float64": (np.array([[-1.5, 0.25, 2.0]]), True),
}


@pytest.mark.parametrize("name", UNARY)
def test_dtypes_like_peer(device, name):
  ours, peer = UNARY[name]
  for what, (x, wide) in DTYPE_GRID.items():
    with x64() if wide else contextlib.nullcontext():
      assert_like_peer(what, ours, peer, x)


@pytest.mark.parametrize("activation", ["relu", "gelu_tanh", "sigmoid"])
def test_bias_act_dtypes_like_peer(device, activation):
  """bias_act of what the kernels do not take is act(x + bias), JAX's promotion."""
  ours = functools.partial(jax_dnn.bias_act, activation=activation)
  peer = lambda x, bias: NAIVE[activation](x + bias)
  bias = np.array([0.5, -1.0, 2.0], np.float32)
  for what, (x, wide) in DTYPE_GRID.items():
    if np.ndim(x):  # bias_act takes x of rank >= 1
      with x64() if wide else contextlib.nullcontext():
        assert_like_peer(what, ours, peer, x, bias)
  x = np.array([[-1.5, 0.25, 2.0]], np.float32)
  assert_like_peer("int32 bias", ours, peer, x, np.array([1, -2, 0], np.int32))


# NaN, +inf and -inf give what the peer gives (jax.nn's forms in fp32, rounded
# once): NaN exactly where it has NaN, the same infinities, close elsewhere.
TOL = {jnp.dtype(jnp.float32): 1e-5, jnp.dtype(jnp.bfloat16): 2e-2, jnp.dtype(jnp.float16): 2e-3}


@pytest.mark.parametrize("name", UNARY)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_nan_and_inf_like_peer(device, name, dtype):
  ours, peer = UNARY[name]
  x = randn(51, (3, 8), dtype, scale=3.0)
  x = x.at[0, 1].set(jnp.nan).at[1, 2].set(jnp.inf).at[2, 3].set(-jnp.inf).at[2, 5].set(jnp.nan)
  bias = randn(52, (8,), dtype)
  with_bias = lambda a, b: jax_dnn.bias_act(a, b, activation=name)
  for got, want in ((jax.jit(ours)(x), peer(x.astype(jnp.float32))),
                    (jax.jit(with_bias)(x, bias),
                     peer(x.astype(jnp.float32) + bias.astype(jnp.float32)))):
    got = np.asarray(got.astype(jnp.float32))
    want = np.asarray(want.astype(dtype).astype(jnp.float32))
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_allclose(got, want, rtol=TOL[jnp.dtype(dtype)], atol=TOL[jnp.dtype(dtype)])


def test_bias_act_no_columns(device):
  """x [3, 0]: an empty result and empty gradients, as act(x + bias)."""
  x, bias = jnp.ones((3, 0), jnp.bfloat16), jnp.ones((0,), jnp.float32)
  y = jax.jit(jax_dnn.bias_act)(x, bias)
  assert y.shape == (3, 0) and y.dtype == jnp.bfloat16
  loss = lambda a, b: jax_dnn.bias_act(a, b).astype(jnp.float32).sum()
  dx, dbias = jax.grad(loss, (0, 1))(x, bias)
  assert (dx.shape, dx.dtype) == ((3, 0), jnp.bfloat16)
  assert (dbias.shape, dbias.dtype) == ((0,), jnp.float32)
