"""softmax / log_softmax: against fp64 references over shapes, axes and
dtypes, bad inputs. jit/vmap/grad, check_grads and the CUDA lowering:
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

# (shape, axis): 1 row, odd widths, tile remainders, widths that take each
# team size, rows split over clusters, the backward's uncached long-row path
# (rows up to 1.2 times the register layout: 32776 bf16/f16, 18000 fp32),
# and non-last axes (strided kernel).
CASES = [
    ((1, 1), -1),
    ((1, 7), -1),
    ((3, 1000), -1),
    ((5, 4097), -1),
    ((64, 1024), -1),
    ((2, 3, 33), 1),
    ((4, 5, 6), 0),
    ((7, 3, 5), 1),
    ((6, 16, 64), 1),
    ((2, 40000), -1),
    ((3, 32776), -1),  # forward split over a cluster, shares of whole vectors
    ((2, 18000), -1),  # fp32: forward over 2 blocks, backward the fallback
    ((0, 8), -1),
]

OPS = {
    "softmax": (jax_dnn.softmax, jax.nn.softmax),
    "log_softmax": (jax_dnn.log_softmax, jax.nn.log_softmax),
}


@pytest.mark.parametrize("name", OPS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape,axis", CASES, ids=str)
def test_against_reference(device, name, dtype, shape, axis):
  ours, naive = OPS[name]
  x = randn(1, shape, dtype, scale=3.0)
  reused = check_fwd_bwd(device, functools.partial(ours, axis=axis),
                         functools.partial(naive, axis=axis), (x,), dtype, what=name)
  if on_gpu(device) and x.size:
    assert reused >= 1, "the output did not land in a poisoned buffer"


@pytest.mark.parametrize("n", [131072, 262144, 300001])
def test_very_long_rows(device, n):
  if not on_gpu(device):
    pytest.skip("kernel-only size: the long-row path exists only in the CUDA kernel")
  x = randn(2, (3, n), jnp.bfloat16, scale=4.0)
  check_fwd_bwd(device, jax_dnn.softmax, jax.nn.softmax, (x,), jnp.bfloat16, what="long row")


# Rows split over clusters, more rows than clusters fit on the GPU (up to ~200
# SMs), so that each persistent cluster streams several rows (RowFeed's next-
# row copies), in shares that are not whole segments: bf16 50000 (2 blocks)
# and 65544 (3), fp32 32776 (3), forward and backward.
@pytest.mark.parametrize("name", OPS)
@pytest.mark.parametrize("shape,dtype", [((300, 50000), jnp.bfloat16), ((260, 65544), jnp.bfloat16),
                                         ((300, 32776), jnp.float32)], ids=str)
def test_streamed_cluster_rows(device, name, shape, dtype):
  if not on_gpu(device):
    pytest.skip("kernel-only layout: the CPU path has no clusters")
  ours, naive = OPS[name]
  x = randn(5, shape, dtype, scale=3.0)
  assert check_fwd_bwd(device, ours, naive, (x,), dtype, what=name) >= 1


# The table's cases (tests/test_transforms.py) take axis 1 (softmax) and -1
# (log_softmax); here the leading axis.
@pytest.mark.parametrize("name", OPS)
def test_check_grads_axis0(device, name):
  ours, _ = OPS[name]
  x = randn(5, (3, 6), jnp.float32)
  check_grads(lambda v: ours(v, axis=0), (x,), order=1, modes=("rev",), atol=1e-2, rtol=1e-2)


def test_bad_inputs():
  x = jnp.ones((2, 3), jnp.float32)
  with pytest.raises(ValueError, match="axis 2 is out of range"):
    jax_dnn.softmax(x, axis=2)
  with pytest.raises(ValueError, match="rank >= 1"):
    jax_dnn.softmax(jnp.float32(1.0))


def _result(fn, x):
  """fn's result type (dtype, shape, weak type) and values, or its exception's type."""
  try:
    y = fn(x)
  except Exception as e:  # pylint: disable=broad-except
    return type(e), None
  return jax.typeof(y), np.asarray(y)


# What the kernels do not take, as (input, whether under x64), and the
# arguments they do not: the peers promote integers to float32, raise
# TypeError for bool and ValueError for a scalar over axis -1, keep complex.
DTYPE_GRID = {
    "int32": (np.array([[-2, 0, 3], [1, 1, 4]], np.int32), False),
    "bool": (np.array([[True, False, True]]), False),
    "complex64": (np.array([[1 + 1j, -2.0, 0.5j]], np.complex64), False),
    "python float": (-1.5, False),
    "float64": (np.array([[-1.5, 0.25, 2.0], [3.0, -1.0, 0.5]]), True),
}
ARG_GRID = {
    "axis=None": dict(axis=None),
    "axis=(0, 1)": dict(axis=(0, 1)),
    "where": dict(where=np.array([True, False, True])),
}


@pytest.mark.parametrize("name", OPS)
def test_dtypes_and_arguments_like_peer(device, name):
  ours, peer = OPS[name]
  cases = [(what, x, wide, {}) for what, (x, wide) in DTYPE_GRID.items()]
  cases += [(what, randn(3, (2, 3), jnp.float32), False, kw) for what, kw in ARG_GRID.items()]
  for what, x, wide, kw in cases:
    with x64() if wide else contextlib.nullcontext():
      (got_type, got) = _result(functools.partial(ours, **kw), x)
      (want_type, want) = _result(functools.partial(peer, **kw), x)
    assert got_type == want_type, what
    if want is not None:
      np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6, err_msg=what)


# One NaN in a reduced column, one +inf in another: NaN exactly where the
# peer has it (both whole columns: inf - inf at the max), elsewhere the
# peer's values.
@pytest.mark.parametrize("name", OPS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("axis", [0, 1, 2])
def test_nan_like_peer(device, name, dtype, axis):
  ours, peer = OPS[name]
  x = randn(61, (4, 5, 6), dtype, scale=3.0).at[1, 2, 3].set(jnp.nan).at[3, 0, 5].set(jnp.inf)
  got = np.asarray(jax.jit(functools.partial(ours, axis=axis))(x).astype(jnp.float32))
  want = np.asarray(peer(x.astype(jnp.float32), axis=axis).astype(dtype).astype(jnp.float32))
  assert np.isnan(want).any() and not np.isnan(want).all()
  np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
  tol = {jnp.dtype(jnp.float32): 1e-5, jnp.dtype(jnp.bfloat16): 2e-2,
         jnp.dtype(jnp.float16): 2e-3}[jnp.dtype(dtype)]
  np.testing.assert_allclose(got, want, rtol=tol, atol=tol)


# Widths that are not a multiple of the 16-byte vector (one element a
# "vector": ScalarRow, ffi/common/row_regs.cuh): small odd and prime widths
# on both devices; on the GPU each team size and elements a thread, many rows
# a launch, the widest scalar rows (16383 forward, 16381 backward) and past
# them (65537: the fallback). The forward's ShiftedRow (the aligned vectors
# covering each row): rows at every offset in a vector (odd widths, many
# rows), the last row's chunk past the tensor's end, one row, widths that
# fill a shape from the last offset (249: 32 x 1 bf16 vectors) or just
# overflow it (250), and the widest (32761 bf16/f16; fp32 16381).
ODD_WIDTHS = [(5, 7), (3, 1025)]
ODD_WIDTHS_GPU = [(700, 1), (3000, 33), (3000, 1000), (40, 1025), (300, 4097), (5, 12289),
                  (3, 16381), (3, 65537), (1, 4097), (9, 7), (64, 249), (64, 250), (3, 32761)]


def _check_odd(device, name, shape, dtype, key):
  ours, naive = OPS[name]
  x = randn(key, shape, dtype, scale=3.0)
  reused = check_fwd_bwd(device, ours, naive, (x,), dtype, what=f"{name} {shape}")
  if on_gpu(device):
    assert reused >= 1, "the output did not land in a poisoned buffer"


@pytest.mark.parametrize("name", OPS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", ODD_WIDTHS, ids=str)
def test_odd_widths(device, name, dtype, shape):
  _check_odd(device, name, shape, dtype, key=31)


@pytest.mark.gpu
@pytest.mark.parametrize("name", OPS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", ODD_WIDTHS_GPU, ids=str)
def test_odd_widths_gpu(gpu, name, dtype, shape):
  _check_odd(gpu, name, shape, dtype, key=32)
