"""layer_norm and rms_norm: against fp64 references over dtypes and awkward
shapes (including per-group parameters), the saved statistics, optional
parameters, bad inputs. jit/vmap/grad, check_grads and the CUDA lowering:
tests/test_transforms.py (the table in tests/op_cases.py)."""

import contextlib
import functools

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_dnn
from helpers import DTYPES, check_fwd_bwd, on_gpu, randn, x64

EPS = 1e-5


def naive_layer_norm(x, scale, bias, epsilon=EPS):
  dt = x.dtype
  mean = jnp.mean(x, axis=-1, keepdims=True)
  var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
  y = (x - mean) * jax.lax.rsqrt(var + jnp.asarray(epsilon, dt))
  return (y * scale.astype(dt) + bias.astype(dt)).astype(dt)


def naive_rms_norm(x, scale, epsilon=EPS):
  dt = x.dtype
  ms = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
  return (x * jax.lax.rsqrt(ms + jnp.asarray(epsilon, dt)) * scale.astype(dt)).astype(dt)


OPS = {
    "layer_norm": (functools.partial(jax_dnn.layer_norm, epsilon=EPS), naive_layer_norm, 2),
    "rms_norm": (functools.partial(jax_dnn.rms_norm, epsilon=EPS), naive_rms_norm, 1),
}

# 1 row, width 1, odd widths (scalar path), each team size, the uncached
# wide-row path (> 16384 columns forward, > 8192 backward), empty rows; for the
# register-row backward: 1 and 2 vectors a thread, rows that end inside a
# team's last vectors, and teams that visit several rows (6000 rows); rows
# split over a cluster (20000; fp32 12288) into equal shares of whole
# vectors (65544 bf16/f16: 5 blocks, the last two vectors short), and past the
# cluster path (65544 fp32). Forward cluster split: streamed, 3 blocks (32776
# bf16/f16; fp32 20000), 5 (65544 bf16/f16; fp32 32776); the register-row
# kernels over clusters past that (65544 fp32 in 5 equal shares, one row a
# pass; 262144 bf16/f16 in 8 full blocks, two rows a pass and a last row
# alone; fp32 and the backward take the fallback there). 1500 x 3000: the
# 16-bit backward's 128-thread teams visit rows enough to prefetch the row
# after next into L2 (each team 3 rows on a 132-SM GPU).
SHAPES = [(1, 1), (3, 7), (2, 3, 100), (64, 1024), (5, 4097), (16, 4096), (3, 12288), (2, 20000),
          (0, 16), (7, 200), (33, 520), (6000, 264), (2, 65544), (3, 32776), (3, 262144),
          (1500, 3000)]


def _params(width, n, dtype, key=7):
  return [randn(key + i, (width,), dtype, scale=0.5, offset=1.0 - i) for i in range(n)]


@pytest.mark.parametrize("name", OPS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_against_reference(device, name, dtype, shape):
  ours, naive, nparams = OPS[name]
  # An offset mean tests the variance for cancellation.
  x = randn(1, shape, dtype, scale=2.0, offset=3.0)
  args = (x, *_params(shape[-1], nparams, dtype))
  reused = check_fwd_bwd(device, ours, naive, args, dtype, what=name)
  if on_gpu(device) and x.size:
    assert reused >= 1, "the output did not land in a poisoned buffer"


# Outlier channels (a few columns a thousand times the rest, as in large
# language models' activations), one of them the first value of a team's
# first thread: statistics that lose precision to cancellation (E[x^2] -
# E[x]^2, or sums about a shift far from the mean, such as a row's first
# value) would show it here. Register rows of one and two warps, a cluster,
# the fallback.
@pytest.mark.parametrize("name", OPS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", [(64, 1024), (16, 4096), (5, 4097), (4, 40000)], ids=str)
def test_outlier_channels(device, name, dtype, shape):
  ours, naive, nparams = OPS[name]
  cols = np.arange(shape[-1])
  outliers = jnp.asarray(np.where(cols % 2 == 0, 3000.0, -3000.0), dtype)
  x = jnp.where(cols % 257 == 0, outliers, randn(21, shape, dtype, scale=2.0, offset=0.5))
  args = (x, *_params(shape[-1], nparams, dtype))
  check_fwd_bwd(device, ours, naive, args, dtype, what=name)


# The 16-bit layer-norm forward two rows a team (LayerNormPairFwdKernel
# outside clusters: 1025-3584 and 16385-32768 wide): an odd last row without
# a partner, rows ending inside a team's vectors (3000: 64-thread teams;
# 24000: 512), and per-group parameters (vmap) with an even number of rows a
# group (pairs never straddle two param_sets: 32-, 64- and 512-thread teams) and
# an odd one (the one-row kernel).
# Also its neighbor at 3585-4096 wide, one row a 128-thread team of 4
# vectors a thread (4000: rows ending inside the team's last vectors).
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", [(5, 3000), (7, 1536), (3, 24000), (3, 6, 2048), (3, 5, 2048),
                                   (2, 4, 3000), (2, 4, 24000), (5, 4000)], ids=str)
def test_layer_norm_two_rows_a_team(device, dtype, shape):
  ours, naive, _ = OPS["layer_norm"]
  x = randn(31, shape, dtype, scale=2.0, offset=3.0)
  params = [randn(40 + i, shape[:-2] + shape[-1:], dtype, scale=0.5, offset=1.0 - i)
            for i in range(2)]
  if len(shape) == 3:
    ours, naive = jax.vmap(ours), jax.vmap(naive)
  check_fwd_bwd(device, ours, naive, (x, *params), dtype, what="layer_norm")


@pytest.mark.parametrize("name", OPS)
def test_fp32_params_with_bf16_input(device, name):
  ours, naive, nparams = OPS[name]
  x = randn(2, (8, 256), jnp.bfloat16)
  args = (x, *_params(256, nparams, jnp.float32))
  check_fwd_bwd(device, ours, naive, args, jnp.bfloat16, what=name)


@pytest.mark.parametrize("name", OPS)
@pytest.mark.parametrize("param_sets,rows", [(3, 512), (300, 8)])
def test_vmapped_parameter_gradients(device, name, param_sets, rows):
  """Per-group parameters (vmap over x and the parameters) on 1024-wide bf16
  rows: on the GPU 3 param_sets of 512 rows give each group 64 blocks of partial
  sums; 300 param_sets are more than the blocks that fit at once, one part each.
  Both against the reference, and the same bits from two calls."""
  ours, naive, nparams = OPS[name]
  dtype = jnp.bfloat16
  x = randn(11, (param_sets, rows, 1024), dtype, scale=2.0, offset=3.0)
  params = [randn(30 + i, (param_sets, 1024), dtype, scale=0.5, offset=1.0 - i) for i in range(nparams)]
  check_fwd_bwd(device, jax.vmap(ours), jax.vmap(naive), (x, *params), dtype, what=name)
  if on_gpu(device):
    dy = randn(99, x.shape, dtype)
    vjp = jax.jit(lambda *a: jax.vjp(jax.vmap(ours), *a[:-1])[1](a[-1]))
    for u, w in zip(vjp(x, *params, dy), vjp(x, *params, dy)):
      np.testing.assert_array_equal(u, w)


# The streamed backward, more rows than blocks (clusters) fit on the GPU (up
# to ~200 SMs), so that each persistent block (cluster) streams several rows
# (RowFeed) and adds their parameter gradients. One block a row: 256 threads
# at 6000 bf16 (rows ending inside the last vectors), 4104 fp16 (the first
# aligned width past the register-row kernel) and 4096 fp32, 512 at 16384
# fp16 and 6000 fp32, per-group parameters with several parts a group, and
# more param_sets than blocks (one part each). Clusters: bf16 and fp16 50000 (4
# blocks), bf16 100000 (7), fp32 20000 (3), in shares that are not whole
# segments; bf16 131072 and fp32 65536 (8 blocks, the widest cluster); and
# per-group parameters (vmap), 2-block clusters with several parts a group;
# the same bits from two calls. The forward at the cluster widths (past 32768
# bf16/fp16, 16384 fp32) streams too (layer_norm_fwd_stream.cu), two rows a
# pass: 300 rows stride over the persistent clusters; per-group parameters
# with several rows a part (3 x 100 x 20000 fp32) and with one row a part
# (2 x 6 x 40000, 3 x 5 x 40000), the last pass of a part with one row (301 x
# 50000, 40 x 131072), and more param_sets than clusters fit at once (60 x 3 x
# 40000: one part a group, in two waves).
@pytest.mark.parametrize("name", OPS)
@pytest.mark.parametrize("shape,dtype", [((1001, 6000), jnp.bfloat16), ((700, 4096), jnp.float32),
                                         ((401, 16384), jnp.float16), ((3, 333, 6000), jnp.bfloat16),
                                         ((400, 3, 8192), jnp.bfloat16), ((600, 4104), jnp.float16),
                                         ((500, 6000), jnp.float32),
                                         ((300, 50000), jnp.bfloat16), ((300, 50000), jnp.float16),
                                         ((60, 100000), jnp.bfloat16), ((300, 20000), jnp.float32),
                                         ((40, 131072), jnp.bfloat16), ((40, 65536), jnp.float32),
                                         ((3, 100, 20000), jnp.bfloat16), ((2, 6, 40000), jnp.float16),
                                         ((3, 5, 40000), jnp.bfloat16), ((301, 50000), jnp.bfloat16),
                                         ((60, 3, 40000), jnp.bfloat16), ((3, 100, 20000), jnp.float32)],
                         ids=str)
def test_streamed_rows(device, name, shape, dtype):
  if not on_gpu(device):
    pytest.skip("kernel-only layout: the CPU path has no clusters or streams")
  ours, naive, nparams = OPS[name]
  x = randn(13, shape, dtype, scale=2.0, offset=3.0)
  if len(shape) == 3:
    ours, naive = jax.vmap(ours), jax.vmap(naive)
    params = [randn(40 + i, (shape[0], shape[-1]), dtype, scale=0.5, offset=1.0 - i)
              for i in range(nparams)]
  else:
    params = _params(shape[-1], nparams, dtype)
  assert check_fwd_bwd(device, ours, naive, (x, *params), dtype, what=name) >= 1
  dy = randn(98, x.shape, dtype)
  vjp = jax.jit(lambda *a: jax.vjp(ours, *a[:-1])[1](a[-1]))
  for u, w in zip(vjp(x, *params, dy), vjp(x, *params, dy)):
    np.testing.assert_array_equal(u, w)


# The layer norm's residuals: each row's (mean, rstd) from the forward, which
# the backward reads instead of recomputing them. Every forward kernel: a
# team a row (1 and several rows a team), the unaligned fallback, the
# streamed clusters (32776; fp32 20000: one row a part; 200 x 40000: two-row
# passes), the register-row clusters past them (140000 16-bit in pairs with
# the last row alone; 70000 fp32 one row a pass), and the uncached-tail
# fallback past the clusters (300000; fp32 140000).
# Two inputs in turn, so a row the kernel left unwritten cannot pass on the
# first input's values.
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", [(6000, 264), (5, 4097), (2, 3, 1024), (3, 32776), (200, 40000),
                                   (3, 140000), (3, 70000), (1, 300000)], ids=str)
def test_layer_norm_stats(device, dtype, shape):
  from jax_dnn._src import layer_norm as layer_norm_lib  # pylint: disable=g-import-not-at-top
  params = [p.astype(jnp.float32).reshape(1, -1) for p in _params(shape[-1], 2, dtype)]
  fwd = jax.jit(lambda x: layer_norm_lib.layer_norm_fwd_p.bind(x, *params, epsilon=EPS))
  for key in (31, 32):
    x = randn(key, shape, dtype, scale=2.0, offset=3.0)
    y, stats = fwd(x)
    assert stats.shape == shape[:-1] + (2,) and stats.dtype == jnp.float32
    xf = np.asarray(jnp.asarray(x, jnp.float32), np.float64)
    mean = xf.mean(-1)
    rstd = 1 / np.sqrt(((xf - mean[..., None]) ** 2).mean(-1) + EPS)
    # fp32 sums of up to 3e5 values (std 2 about 3): relative errors ~1e-6.
    np.testing.assert_allclose(np.asarray(stats[..., 0]), mean, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(stats[..., 1]), rstd, rtol=1e-5)
  scale, bias = (np.asarray(p[0], np.float64) for p in params)
  want = (xf - mean[..., None]) * rstd[..., None] * scale + bias
  # y in x's dtype: |y| < ~6 here, bf16's half-ulp there is 2^-6.
  np.testing.assert_allclose(np.asarray(y, np.float64), want, rtol=1e-2, atol=2e-2)


def test_optional_parameters(device):
  x = randn(6, (5, 33), jnp.float32)
  scale = randn(7, (33,), jnp.float32)
  ones, zeros = jnp.ones(33), jnp.zeros(33)
  tol = dict(rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(jax_dnn.layer_norm(x), naive_layer_norm(x, ones, zeros, 1e-6), **tol)
  np.testing.assert_allclose(jax_dnn.layer_norm(x, scale, epsilon=EPS),
                             naive_layer_norm(x, scale, zeros), **tol)
  np.testing.assert_allclose(jax_dnn.rms_norm(x), naive_rms_norm(x, ones, 1e-6), **tol)


def test_bad_inputs():
  x = jnp.ones((2, 8), jnp.float32)
  with pytest.raises(ValueError, match=r"layer_norm: scale must have shape \(8,\)"):
    jax_dnn.layer_norm(x, jnp.ones(4))
  with pytest.raises(ValueError, match=r"rms_norm: scale must have shape \(8,\)"):
    jax_dnn.rms_norm(x, jnp.ones((2, 8)))
  with pytest.raises(ValueError, match="rank >= 1"):
    jax_dnn.rms_norm(jnp.float32(1))
  with pytest.raises(ValueError, match="epsilon must be > 0"):
    jax_dnn.layer_norm(x, epsilon=0.0)
  with pytest.raises(TypeError, match="scale must be floating point"):
    jax_dnn.layer_norm(x, jnp.ones(8, jnp.int32))


def _flax_norm(name, x, scale, bias):
  """Flax's layer (exact variance) with the given parameters, or none."""
  kw = dict(epsilon=EPS, use_fast_variance=False, use_scale=scale is not None, rngs=nnx.Rngs(0))
  if scale is not None:
    kw["param_dtype"] = scale.dtype
  if name == "layer_norm":
    layer = nnx.LayerNorm(x.shape[-1], use_bias=bias is not None, **kw)
    if bias is not None:
      layer.bias[...] = bias
  else:
    layer = nnx.RMSNorm(x.shape[-1], **kw)
  if scale is not None:
    layer.scale[...] = scale
  return layer(x)


# Inputs the kernels do not take, as (x, parameters' dtype or None, whether
# under x64): Flax promotes integer and bool x with the parameters (to
# float32 without floating ones) and keeps float64 and complex.
DTYPE_GRID = {
    "int32": (np.arange(-6, 6, dtype=np.int32).reshape(2, 6) ** 2, jnp.float32, False),
    "int32, no parameters": (np.arange(-6, 6, dtype=np.int32).reshape(2, 6), None, False),
    "int32, bfloat16 parameters": (np.arange(12, dtype=np.int32).reshape(2, 6), jnp.bfloat16,
                                   False),
    "bool": (np.arange(12).reshape(2, 6) % 3 == 0, jnp.float32, False),
    "complex64": ((np.arange(12) + 1j * np.arange(12) ** 2).reshape(2, 6).astype(np.complex64),
                  jnp.float32, False),
    "float64": (np.random.default_rng(0).normal(size=(2, 6)), jnp.float64, True),
}


@pytest.mark.parametrize("name", OPS)
def test_dtypes_like_flax(device, name):
  ours = OPS[name][0]
  for what, (x, pdtype, wide) in DTYPE_GRID.items():
    with x64() if wide else contextlib.nullcontext():
      params = [None, None]
      if pdtype is not None:
        params = [p.astype(pdtype) for p in _params(6, 2, jnp.float32)]
      got = ours(x, *params[:OPS[name][2]])
      want = _flax_norm(name, x, *params)
      assert jax.typeof(got) == jax.typeof(want), what
      tol = 1e-12 if wide else 1e-2 if pdtype == jnp.bfloat16 else 1e-5
      np.testing.assert_allclose(got, want, rtol=tol, atol=tol, err_msg=what)
  with x64():  # float64 gradients, from JAX's differentiation of the reference
    x = jnp.asarray(DTYPE_GRID["float64"][0])
    scale = _params(6, 1, jnp.float32)[0].astype(jnp.float64)
    grads = jax.grad(lambda a, s: jnp.sum(ours(a, s) ** 3), (0, 1))(x, scale)
    want = jax.grad(lambda a, s: jnp.sum(_flax_norm(name, a, s, None) ** 3), (0, 1))(x, scale)
    for g, w in zip(grads, want):
      assert g.dtype == jnp.float64
      np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("name", OPS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_nan_in_one_row(device, name, dtype):
  """That row NaN; the others finite and as they are without it."""
  ours, _, nparams = OPS[name]
  x = randn(71, (4, 33), dtype, scale=2.0, offset=1.0)
  params = _params(33, nparams, dtype)
  got = np.asarray(jax.jit(ours)(x.at[2, 5].set(jnp.nan), *params).astype(jnp.float32))
  assert np.isnan(got[2]).all() and np.isfinite(np.delete(got, 2, axis=0)).all()
  want = np.asarray(jax.jit(ours)(x, *params).astype(jnp.float32))
  np.testing.assert_array_equal(np.delete(got, 2, axis=0), np.delete(want, 2, axis=0))


def test_no_columns(device):
  """x [3, 0]: an empty result (and empty gradients), as Flax's."""
  x, scale, bias = jnp.ones((3, 0), jnp.bfloat16), jnp.ones((0,)), jnp.zeros((0,))
  for name, (ours, _, nparams) in OPS.items():
    params = (scale, bias)[:nparams]
    y = jax.jit(ours)(x, *params)
    want = _flax_norm(name, x, scale, bias if nparams == 2 else None)
    assert y.shape == want.shape == (3, 0) and y.dtype == x.dtype
    loss = lambda *a: ours(*a).astype(jnp.float32).sum()
    grads = jax.grad(loss, tuple(range(nparams + 1)))(x, *params)
    assert [g.shape for g in grads] == [(3, 0)] + [(0,)] * nparams


# Widths that are not a multiple of the 16-byte vector (one element a
# "vector": ScalarRow, ffi/common/row_regs.cuh): small odd and prime widths
# on both devices; on the GPU each team size and elements a thread, many rows
# (teams of the backward's persistent blocks visit several, 1000 and 33
# wide), the forward's rows split over a cluster (20001, 65537) and past it
# (131073: the fallback), the backward's widest scalar rows (8191) and past
# them (12289, 65537: the fallback), and vmapped parameters (param_sets).
ODD_WIDTHS = [(5, 7), (3, 1025)]
ODD_WIDTHS_GPU = [(700, 1), (3000, 33), (3000, 1000), (40, 1025), (300, 4097), (9, 8191),
                  (5, 12289), (3, 20001), (3, 65537), (2, 131073), (3, 100, 1001)]


def _check_odd(device, name, shape, dtype):
  ours, naive, nparams = OPS[name]
  x = randn(21, shape, dtype, scale=2.0, offset=3.0)
  if len(shape) == 3:
    ours, naive = jax.vmap(ours), jax.vmap(naive)
    params = [randn(50 + i, (shape[0], shape[-1]), dtype, scale=0.5, offset=1.0 - i)
              for i in range(nparams)]
  else:
    params = _params(shape[-1], nparams, dtype)
  reused = check_fwd_bwd(device, ours, naive, (x, *params), dtype, what=f"{name} {shape}")
  if on_gpu(device):
    assert reused >= 1, "the output did not land in a poisoned buffer"


@pytest.mark.parametrize("name", OPS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", ODD_WIDTHS, ids=str)
def test_odd_widths(device, name, dtype, shape):
  _check_odd(device, name, shape, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("name", OPS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", ODD_WIDTHS_GPU, ids=str)
def test_odd_widths_gpu(gpu, name, dtype, shape):
  _check_odd(gpu, name, shape, dtype)
