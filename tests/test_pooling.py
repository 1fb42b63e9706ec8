"""max_pool, avg_pool, adaptive_max_pool, adaptive_avg_pool: values and
gradients against flax.linen's pooling (jax.grad of lax.reduce_window) and an
independent NumPy reference (loops over windows), over 1D/2D/3D, strides,
SAME/VALID/explicit padding, windows larger than the stride, batch 1, odd
sizes, channels that are no multiple of a 16-byte vector, ties, -inf and
large values; the inputs' layouts (no batch axis, several); bad inputs.
jit/vmap/grad, sharding, export and the CUDA lowering: the table in
tests/op_cases.py."""

import itertools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_dnn
from jax_dnn._src import extension
from jax_dnn._src import plans
from jax_dnn._src import pooling
from helpers import DTYPES, check_fwd_bwd, cuda_hlo, on_gpu, randn, x64

# --- the NumPy reference ------------------------------------------------------------


def _bins(length, out):
  """PyTorch's adaptive bins of one axis: [(start, end)] for each output."""
  return [(o * length // out, -(-(o + 1) * length // out)) for o in range(out)]


def _windows(length, window, stride, lo, hi):
  """Pooling windows of one axis: [(first position, K)] (may reach padding)."""
  out = max(0, (length + lo + hi - window) // stride + 1)
  return [(o * stride - lo, window) for o in range(out)]


def np_pool(x, dy, kind, axes_windows, *, adaptive, count_include_pad=True):
  """x [N, *spatial, C] (fp64). axes_windows: for each spatial axis, a list of
  (start, size) windows. Returns y and the VJP with cotangent dy: max's
  gradient goes to the first maximal position in row-major window order,
  padding (value -inf) included for pooling windows, excluded for adaptive
  bins (no padding there)."""
  n, c = x.shape[0], x.shape[-1]
  spatial = x.shape[1:-1]
  outs = tuple(len(w) for w in axes_windows)
  y = np.zeros((n,) + outs + (c,))
  dx = np.zeros_like(x)
  for o in itertools.product(*[range(k) for k in outs]):
    ranges = [range(s, s + k) for s, k in (axes_windows[a][o[a]] for a in range(len(outs)))]
    positions = list(itertools.product(*ranges))
    inside = [p for p in positions if all(0 <= p[a] < spatial[a] for a in range(len(p)))]
    for b in range(n):
      for ch in range(c):
        if kind == "max":
          best, where = -np.inf, None
          for p in positions if not adaptive else inside:
            v = x[(b,) + p + (ch,)] if p in inside else -np.inf
            if where is None or v > best:
              best, where = v, p
          y[(b,) + o + (ch,)] = best
          if where in inside:
            dx[(b,) + where + (ch,)] += dy[(b,) + o + (ch,)]
        else:
          total = sum(x[(b,) + p + (ch,)] for p in inside)
          div = len(positions) if count_include_pad and not adaptive else len(inside)
          y[(b,) + o + (ch,)] = total / div
          for p in inside:
            dx[(b,) + p + (ch,)] += dy[(b,) + o + (ch,)] / div
  return y, dx


def _pads(spatial, window, strides, padding):
  if isinstance(padding, str):
    return jax.lax.padtype_to_pads(spatial, window, strides, padding)
  return padding


def _ours_and_np(kind, x, dy, window, strides, padding, count_include_pad=True):
  spatial = x.shape[1:-1]
  pads = _pads(spatial, window, strides, padding)
  wins = [_windows(s, k, st, lo, hi) for s, k, st, (lo, hi) in zip(spatial, window, strides, pads)]
  return np_pool(np.asarray(x, np.float64), np.asarray(dy, np.float64), kind, wins,
                 adaptive=False, count_include_pad=count_include_pad)


# --- cases --------------------------------------------------------------------------

# (shape [N, *spatial, C], window, strides, padding): 1D/2D/3D; windows larger
# than the stride (overlapping, each input in several windows), equal, smaller
# (inputs in no window); SAME/VALID/explicit (asymmetric, wider than the
# window's reach); batch 1; odd sizes; channels 1, 3, 5, 12 (no multiple of a
# 16-byte vector in 16-bit types), 16, 64.
CASES = [
    ((2, 13, 5), (3,), (2,), "SAME"),
    ((1, 17, 3), (4,), (3,), ((2, 1),)),
    ((3, 9, 16), (2,), (2,), "VALID"),
    ((2, 7, 9, 3), (3, 3), (2, 2), "SAME"),
    ((1, 8, 8, 64), (3, 3), (2, 2), ((1, 1), (1, 1))),
    ((2, 11, 6, 12), (3, 2), (1, 2), "VALID"),
    ((2, 6, 7, 5), (2, 2), (3, 3), "VALID"),
    ((1, 5, 5, 1), (5, 5), (1, 1), ((2, 2), (2, 2))),
    ((2, 5, 6, 7, 3), (2, 3, 2), (2, 1, 2), "SAME"),
    ((1, 4, 5, 6, 16), (2, 2, 2), (2, 2, 2), "VALID"),
    ((2, 3, 7, 5, 5), (3, 3, 3), (1, 2, 2), ((1, 1), (0, 2), (2, 0))),
]
CASE_IDS = [f"{s}-w{w}-s{st}-{p}" for s, w, st, p in CASES]


def _flax(kind, count_include_pad=True):
  if kind == "max":
    return nn.max_pool
  # flax divides by an fp32 count without count_include_pad: its result is fp32.
  return lambda x, *a: nn.avg_pool(x, *a, count_include_pad=count_include_pad).astype(x.dtype)


def _ours(kind, count_include_pad=True):
  if kind == "max":
    return jax_dnn.max_pool
  return lambda x, *a: jax_dnn.avg_pool(x, *a, count_include_pad=count_include_pad)


KINDS = [("max", True), ("avg", True), ("avg", False)]
KIND_IDS = ["max", "avg", "avg-exclude-pad"]


@pytest.mark.parametrize("kind", KINDS, ids=KIND_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_against_flax(device, case, dtype, kind):
  shape, window, strides, padding = case
  kind, include = kind
  x = randn(1, shape, dtype, scale=2.0)
  ours = lambda x: _ours(kind, include)(x, window, strides, padding)
  theirs = lambda x: _flax(kind, include)(x, window, strides, padding)
  reused = check_fwd_bwd(device, ours, theirs, (x,), dtype, what=f"{kind} pool")
  if on_gpu(device):
    assert reused >= 1, "the output did not land in a poisoned buffer"


@pytest.mark.parametrize("kind", KINDS, ids=KIND_IDS)
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_against_numpy(case, kind):
  shape, window, strides, padding = case
  kind, include = kind
  x = randn(2, shape, jnp.float32)
  fn = lambda x: _ours(kind, include)(x, window, strides, padding)
  y, vjp = jax.vjp(fn, x)
  dy = randn(3, y.shape, jnp.float32)
  want_y, want_dx = _ours_and_np(kind, x, dy, window, strides, padding, include)
  np.testing.assert_allclose(y, want_y, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(vjp(dy)[0], want_dx, rtol=1e-5, atol=1e-5)


CPU = jax.devices("cpu")[0]

# Ties: values from {0, 1, 2} (most windows hold several maxima) and a
# constant input; windows over padding with -inf inputs (a padded position
# first in its window then wins the tie, and the gradient is dropped, as
# XLA's select_and_scatter_add drops it).
TIE_CASES = [
    ((2, 9, 8, 3), (3, 3), (2, 2), "SAME"),
    ((2, 9, 8, 3), (3, 3), (1, 1), ((1, 1), (1, 1))),
    ((2, 10, 3), (4,), (1,), ((2, 3),)),
    ((1, 5, 4, 6, 2), (2, 3, 2), (1, 2, 1), "SAME"),
]


@pytest.mark.parametrize("fill", ["small_ints", "constant", "neg_inf", "inf_mix"])
@pytest.mark.parametrize("case", TIE_CASES, ids=[str(c[0]) for c in TIE_CASES])
def test_max_pool_ties_as_xla(device, case, fill):
  shape, window, strides, padding = case
  rng = np.random.default_rng(5)
  if fill == "small_ints":
    x = rng.integers(0, 3, shape).astype(np.float32)
  elif fill == "constant":
    x = np.full(shape, 1.5, np.float32)
  elif fill == "neg_inf":
    x = np.full(shape, -np.inf, np.float32)
  else:  # -inf, +inf and large finite values
    x = rng.choice(np.array([-np.inf, np.inf, -3e38, 3e38, 0.0], np.float32), shape)
  for dtype in DTYPES:
    xd = jnp.asarray(x, dtype)
    ours = jax.jit(lambda x: jax_dnn.max_pool(x, window, strides, padding))
    # XLA's rule as XLA:CPU applies it (jax.grad of lax.reduce_window max),
    # against ours on each device.
    theirs = jax.jit(lambda x: nn.max_pool(x, window, strides, padding))  # x placed on CPU
    y, vjp = jax.vjp(ours, xd)
    y2, vjp2 = jax.vjp(theirs, jax.device_put(xd, CPU))
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(y2, np.float32))
    # Integer cotangents: sums exact in every dtype, so any misplaced
    # gradient shows.
    dy = jnp.asarray(rng.integers(1, 5, y.shape), dtype)
    np.testing.assert_array_equal(np.asarray(vjp(dy)[0], np.float32),
                                  np.asarray(vjp2(jax.device_put(dy, CPU))[0], np.float32),
                                  err_msg=str(dtype))
    want_y, want_dx = _ours_and_np("max", np.asarray(xd, np.float64), np.asarray(dy, np.float64),
                                   window, strides, padding)
    np.testing.assert_array_equal(np.asarray(y, np.float64), want_y)
    np.testing.assert_array_equal(np.asarray(vjp(dy)[0], np.float64), want_dx)


def test_max_pool_nan_propagates(device):
  del device
  x = np.arange(2 * 6 * 6 * 3, dtype=np.float32).reshape(2, 6, 6, 3)
  x[0, 2, 3, 1] = np.nan
  y = jax.jit(lambda x: jax_dnn.max_pool(x, (3, 3), (2, 2)))(x)
  y2 = nn.max_pool(x, (3, 3), (2, 2))
  np.testing.assert_array_equal(np.isnan(y), np.isnan(y2))
  assert np.isnan(y).sum() == 2


def test_avg_pool_large_values_sum_in_fp32(device):
  """fp16 values near its largest: a same-dtype sum overflows (flax gives
  inf); ours sums in fp32 and rounds the average."""
  del device
  x = jnp.full((2, 6, 6, 8), 60000.0, jnp.float16)
  y = jax.jit(lambda x: jax_dnn.avg_pool(x, (3, 3), (3, 3)))(x)
  np.testing.assert_array_equal(np.asarray(y, np.float32), 60000.0)
  x = jnp.full((1, 4, 4, 2), 3e38, jnp.float32)
  assert np.all(np.asarray(jax_dnn.max_pool(x, (2, 2), (2, 2))) == np.float32(3e38))


# --- adaptive -----------------------------------------------------------------------

# (shape, output_size): sizes that divide, that do not (bins overlap by one),
# an output larger than the input (positions in two bins), global pooling
# (1), None (the axis kept), 1D/2D/3D, channels 3, 12, 64, 2048.
ADAPTIVE = [
    ((2, 10, 5), (3,)),
    ((2, 7, 9, 3), (3, 4)),
    ((1, 7, 7, 64), (7, 7)),
    ((2, 5, 6, 12), (8, 9)),
    ((2, 14, 14, 16), (4, None)),
    ((3, 7, 7, 2048), (1, 1)),
    ((2, 9, 5, 3), (1, 1)),
    ((2, 4, 5, 6, 3), (2, 3, 4)),
    ((1, 6, 6, 6, 16), (1, 1, 1)),
]
ADAPTIVE_IDS = [f"{s}-{o}" for s, o in ADAPTIVE]


def _np_adaptive(kind, x, dy, output_size):
  spatial = x.shape[1:-1]
  wins = [[(s, e - s) for s, e in _bins(length, length if o is None else o)]
          for length, o in zip(spatial, output_size)]
  return np_pool(np.asarray(x, np.float64), np.asarray(dy, np.float64), kind, wins,
                 adaptive=True)


ADAPTIVE_OPS = {"max": jax_dnn.adaptive_max_pool, "avg": jax_dnn.adaptive_avg_pool}


@pytest.mark.parametrize("kind", ["max", "avg"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("case", ADAPTIVE, ids=ADAPTIVE_IDS)
def test_adaptive(device, case, dtype, kind):
  shape, output_size = case
  x = randn(4, shape, dtype)
  fn = jax.jit(lambda x: ADAPTIVE_OPS[kind](x, output_size))
  y, vjp = jax.vjp(fn, x)
  dy = randn(5, y.shape, dtype)
  dx = vjp(dy)[0]
  want_y, want_dx = _np_adaptive(kind, np.asarray(x, np.float64), np.asarray(dy, np.float64),
                                 output_size)
  assert y.dtype == dtype and dx.dtype == dtype
  # fp32 sums of at most a few thousand terms, rounded once to the dtype:
  # half an ulp of the dtype (fp32: the sums' rounding, ~terms * 2^-24).
  tol = {jnp.dtype(jnp.float32): 1e-5, jnp.dtype(jnp.bfloat16): 8e-3,
         jnp.dtype(jnp.float16): 1e-3}[jnp.dtype(dtype)]
  np.testing.assert_allclose(np.asarray(y, np.float64), want_y, rtol=tol, atol=tol)
  np.testing.assert_allclose(np.asarray(dx, np.float64), want_dx, rtol=tol, atol=tol)


def test_adaptive_avg_global_is_mean(device):
  """Global average pooling (output 1) of a ResNet head's shape equals the
  mean over the spatial axes; at the benchmark's size too."""
  del device
  for shape in ((4, 7, 7, 2048), (2, 56, 56, 64), (1, 3, 1000, 8)):
    x = randn(6, shape, jnp.bfloat16)
    y = jax.jit(lambda x: jax_dnn.adaptive_avg_pool(x, 1))(x)
    want = jnp.mean(x.astype(jnp.float32), axis=(1, 2), keepdims=True)
    np.testing.assert_allclose(np.asarray(y, np.float32), want, rtol=8e-3, atol=1e-3)


def test_adaptive_ties_go_to_first():
  x = np.zeros((1, 5, 4, 1), np.float32)
  y, vjp = jax.vjp(lambda x: jax_dnn.adaptive_max_pool(x, (2, 3)), jnp.asarray(x))
  dx = np.asarray(vjp(jnp.ones_like(y))[0])[0, :, :, 0]
  # Bins rows [0, 3), [2, 5); columns [0, 2), [1, 3), [2, 4): the first
  # position of each bin takes its gradient.
  want = np.zeros((5, 4))
  for r in (0, 2):
    for c in (0, 1, 2):
      want[r, c] += 1
  np.testing.assert_array_equal(dx, want)


# --- layouts ------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["max_pool", "avg_pool"])
def test_layouts_like_flax(name):
  """No batch axis, and several batch axes (string padding, which flax
  takes with several)."""
  ours, theirs = getattr(jax_dnn, name), getattr(nn, name)
  x = randn(7, (9, 8, 5), jnp.float32)
  np.testing.assert_allclose(ours(x, (3, 3), (2, 2), "SAME"), theirs(x, (3, 3), (2, 2), "SAME"),
                             rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(ours(x, (3,), padding=((1, 1),)),
                             theirs(x, (3,), padding=((1, 1),)), rtol=1e-5, atol=1e-6)
  x = randn(8, (2, 3, 7, 6, 4), jnp.float32)
  np.testing.assert_allclose(ours(x, (2, 3), (2, 1), "SAME"), theirs(x, (2, 3), (2, 1), "SAME"),
                             rtol=1e-5, atol=1e-6)
  g = jax.grad(lambda x: jnp.sum(jnp.sin(ours(x, (2, 3), (2, 1), "SAME"))))(x)
  g2 = jax.grad(lambda x: jnp.sum(jnp.sin(theirs(x, (2, 3), (2, 1), "SAME"))))(x)
  np.testing.assert_allclose(g, g2, rtol=1e-5, atol=1e-6)


def test_adaptive_layouts():
  x = randn(9, (7, 9, 3), jnp.float32)  # no batch axis: a tuple output_size
  y = jax_dnn.adaptive_avg_pool(x, (2, 3))
  want, _ = _np_adaptive("avg", np.asarray(x)[None], np.zeros((1, 2, 3, 3)), (2, 3))
  np.testing.assert_allclose(y, want[0], rtol=1e-6)
  assert jax_dnn.adaptive_max_pool(randn(9, (2, 7, 9, 3), jnp.float32), 2).shape == (2, 2, 2, 3)


def test_empty_output_like_flax():
  x = randn(1, (2, 3, 3, 4), jnp.float32)
  assert jax_dnn.max_pool(x, (4, 4)).shape == nn.max_pool(x, (4, 4)).shape == (2, 0, 0, 4)


def test_empty_input_axis_reads_padding_alone():
  """An empty spatial axis with padding: every window is padding (-inf for
  max, 0 for the average), gradients included."""
  x = randn(1, (2, 0, 5, 3), jnp.float32)
  for ours, theirs in ((jax_dnn.max_pool, nn.max_pool), (jax_dnn.avg_pool, nn.avg_pool)):
    call = lambda f, x: f(x, (2, 2), padding=((1, 1), (0, 0)))
    np.testing.assert_array_equal(call(ours, x), call(theirs, x))
    assert jax.grad(lambda x: jnp.sum(call(ours, x)))(x).shape == x.shape


# --- inputs the kernels do not take: flax's computation -------------------------------


def _small_ints(shape):
  return np.random.default_rng(3).integers(-4, 5, shape)


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.uint8, jnp.bool_, jnp.complex64],
                         ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("name", ["max_pool", "avg_pool"])
def test_other_dtypes_as_flax(name, dtype):
  """Integer, bool and complex inputs: flax's values and dtype (an integer
  average is float32; bool averages raise, as flax's)."""
  x = jnp.asarray(_small_ints((2, 7, 6, 3))).astype(dtype)
  if dtype == jnp.complex64:
    x = x + 1j * jnp.asarray(_small_ints((2, 7, 6, 3)), jnp.float32)[::-1]
  ours, theirs = getattr(jax_dnn, name), getattr(nn, name)
  args = ((3, 2), (2, 1), ((1, 1), (0, 1)))
  if name == "avg_pool" and dtype == jnp.bool_:
    with pytest.raises(TypeError):
      theirs(x, *args)
    with pytest.raises(TypeError):
      ours(x, *args)
    return
  y, want = ours(x, *args), theirs(x, *args)
  assert y.dtype == want.dtype and y.shape == want.shape
  np.testing.assert_allclose(y, want, rtol=1e-6)


@pytest.mark.parametrize("name", ["max_pool", "avg_pool"])
def test_float64_and_numpy_inputs_as_flax(name):
  ours, theirs = getattr(jax_dnn, name), getattr(nn, name)
  x = np.random.default_rng(4).normal(size=(2, 9, 4))  # NumPy float64: float32 without x64
  y = ours(x, (3,), (2,), "SAME")
  assert y.dtype == jnp.float32
  np.testing.assert_allclose(y, theirs(x, (3,), (2,), "SAME"), rtol=1e-6)
  with x64():
    x = jnp.asarray(x)
    fn = lambda x: jnp.sum(jnp.sin(ours(x, (3,), (2,), "SAME")))
    y, want = ours(x, (3,), (2,), "SAME"), theirs(x, (3,), (2,), "SAME")
    assert y.dtype == jnp.float64
    np.testing.assert_allclose(y, want, rtol=1e-13)
    np.testing.assert_allclose(
        jax.grad(fn)(x), jax.grad(lambda x: jnp.sum(jnp.sin(theirs(x, (3,), (2,), "SAME"))))(x),
        rtol=1e-13)


@pytest.mark.parametrize("name", ["max_pool", "avg_pool"])
def test_four_spatial_axes_as_flax(name):
  x = randn(5, (2, 4, 3, 5, 4, 2), jnp.float32)
  args = ((2, 2, 3, 2), (1, 2, 1, 2), "SAME")
  ours, theirs = getattr(jax_dnn, name), getattr(nn, name)
  np.testing.assert_allclose(ours(x, *args), theirs(x, *args), rtol=1e-6)


# (padding, count_include_pad): crops on one side, both, crop and pad on
# one axis; crops that pass each other (nothing of the axis left: windows
# of padding alone, as lax pads).
NEGATIVE_PADDING = [
    (((-1, 0), (0, -2)), True),
    (((-2, 1), (1, -1)), False),
    (((-1, -1), (2, -1)), True),
    (((-8, 5), (0, 0)), True),
    (((5, -8), (1, 1)), True),
    (((-4, -3), (0, 0)), False),
]


@pytest.mark.parametrize("padding, include", NEGATIVE_PADDING, ids=str)
@pytest.mark.parametrize("name", ["max_pool", "avg_pool"])
def test_negative_padding_crops_as_flax(name, padding, include):
  x = randn(6, (2, 6, 5, 3), jnp.float32)
  kw = {} if name == "max_pool" else dict(count_include_pad=include)
  ours = lambda x: getattr(jax_dnn, name)(x, (2, 2), (1, 2), padding, **kw)
  want = getattr(nn, name)(x, (2, 2), (1, 2), padding, **kw)
  y = ours(x)
  assert y.shape == want.shape
  # flax's average over a window of padding alone without count_include_pad
  # is 0 / 0; ours is 0 (avg_pool's docstring).
  np.testing.assert_allclose(y, jnp.where(jnp.isnan(want), 0.0, want), rtol=1e-6)
  # The gradient: flax's of the input cropped first (jax.grad of flax's
  # reduce_window with negative padding itself fails in lax's slice).
  if all(min(lo, 0) + min(hi, 0) + length >= 0 for (lo, hi), length in zip(padding, (6, 5))):
    crop = [(0, 0, 0)] + [(min(lo, 0), min(hi, 0), 0) for lo, hi in padding] + [(0, 0, 0)]
    rest = [(max(lo, 0), max(hi, 0)) for lo, hi in padding]
    theirs = lambda x: getattr(nn, name)(jax.lax.pad(x, 0.0, crop), (2, 2), (1, 2), rest, **kw)
    dy = randn(7, y.shape, jnp.float32)
    np.testing.assert_allclose(jax.vjp(ours, x)[1](dy)[0], jax.vjp(theirs, x)[1](dy)[0],
                               rtol=1e-6, atol=1e-6)


# --- bad inputs ---------------------------------------------------------------------


@pytest.mark.parametrize("call, error, match", [
    (lambda x: jax_dnn.max_pool(x, 3), TypeError, "window_shape"),
    (lambda x: jax_dnn.max_pool(x, (3, 0)), ValueError, "window_shape"),
    (lambda x: jax_dnn.max_pool(x, (1, 1, 1, 1)), ValueError, "inputs"),
    (lambda x: jax_dnn.max_pool(x, (2, 2), (1,)), ValueError, "strides"),
    (lambda x: jax_dnn.max_pool(x, (2, 2), (1, 0)), ValueError, "strides"),
    (lambda x: jax_dnn.max_pool(x, (2, 2), padding="FULL"), ValueError, "padding"),
    (lambda x: jax_dnn.max_pool(x, (2, 2), padding=((1, 1),)), ValueError, "padding"),
    (lambda x: jax_dnn.avg_pool(x, (2, 2), count_include_pad="yes"), TypeError,
     "count_include_pad"),
    (lambda x: jax_dnn.max_pool(x[0, 0], (2, 2)), ValueError, "inputs"),
    (lambda x: jax_dnn.avg_pool([1.0], (1,)), TypeError, "inputs"),
    (lambda x: jax_dnn.max_pool(x, (2, 2), padding=((1, 1.5), (0, 0))), TypeError, "padding"),
    (lambda x: jax_dnn.adaptive_max_pool(x.astype(jnp.int32), 2), TypeError, "inputs"),
    (lambda x: jax_dnn.adaptive_avg_pool(x, (0, 2)), ValueError, "output_size"),
    (lambda x: jax_dnn.adaptive_avg_pool(x, "7"), TypeError, "output_size"),
    (lambda x: jax_dnn.adaptive_max_pool(x, (2, 2, 2, 2)), ValueError, "output_size"),
    (lambda x: jax_dnn.adaptive_max_pool(x[0, 0], 2), ValueError, "output_size"),
])
def test_bad_inputs(call, error, match):
  x = randn(0, (2, 6, 6, 3), jnp.float32)
  with pytest.raises(error, match=match):
    call(x)


# --- the kernels' variants (CUDA lowering; GPU numerics above) ----------------------


def _targets(text):
  return {t for t in ("max_pool_fwd", "max_pool_bwd", "max_pool_idx_fwd", "max_pool_idx_bwd",
                      "avg_pool_fwd", "avg_pool_bwd") if f"custom_call @jax_dnn_{t}(" in text}


# (call, the forward's targets, the forward and backward's under grad), as
# pool_plan chooses them by default.
LOWERINGS = [
    # Overlapping max windows: XLA's forward alone; under grad the kernels
    # (the argmax offsets). Overlapping average windows: the kernels.
    (lambda x: jax_dnn.max_pool(x, (3, 3), (2, 2), "SAME"),
     set(), {"max_pool_idx_fwd", "max_pool_idx_bwd"}),
    (lambda x: jax_dnn.avg_pool(x, (3, 3), (1, 1), "SAME"),
     {"avg_pool_fwd"}, {"avg_pool_fwd", "avg_pool_bwd"}),
    # Windows that tile the input: XLA's forward, broadcast backwards (max
    # still writes its offsets in the kernel).
    (lambda x: jax_dnn.avg_pool(x, (2, 2), (2, 2)), set(), set()),
    (lambda x: jax_dnn.max_pool(x, (2, 2), (2, 2)), set(), {"max_pool_idx_fwd"}),
    (lambda x: jax_dnn.adaptive_avg_pool(x, 3), set(), set()),
    # Global average pooling: its reduction kernel, a broadcast backward.
    (lambda x: jax_dnn.adaptive_avg_pool(x, 1), {"avg_pool_fwd"}, {"avg_pool_fwd"}),
    # Uneven bins: the kernels; bins of more than 255 positions keep x and y.
    (lambda x: jax_dnn.adaptive_max_pool(x, 4), {"max_pool_fwd"},
     {"max_pool_idx_fwd", "max_pool_idx_bwd"}),
    (lambda x: jax_dnn.adaptive_max_pool(x, (1, 2)), {"max_pool_fwd"},
     {"max_pool_fwd", "max_pool_bwd"}),
]


def _vjp_ones(fn, x):
  y, vjp = jax.vjp(fn, x)
  return y, vjp(jnp.ones_like(y))[0]


def test_cuda_lowering_calls_the_pool_kernels(monkeypatch):
  """The CUDA lowering's custom calls as pool_plan chooses them, their
  attributes and the global pool's workspace (from the plan); on a build
  without the kernels the lowering is asked to take them anyway (it only
  prints the program)."""
  if not jax_dnn.has_cuda_kernels():
    monkeypatch.setattr(extension, "use_kernel", lambda target: True)
  x = randn(0, (2, 9, 9, 16), jnp.bfloat16)
  for i, (fn, fwd, train) in enumerate(LOWERINGS):
    xi = randn(0, (2, 23, 23, 16), jnp.bfloat16) if i == len(LOWERINGS) - 1 else x
    assert _targets(cuda_hlo(fn, xi)) == fwd, i
    assert _targets(cuda_hlo(lambda x: _vjp_ones(fn, x), xi)) == train, i
  text = cuda_hlo(lambda x: _vjp_ones(lambda x: jax_dnn.max_pool(x, (3, 3), (2, 2), "SAME"), x), x)
  assert "out_h = 5 : i64" in text and "pad_h = 1 : i64" in text and "stride_w = 2 : i64" in text
  assert "deterministic" not in text  # the plan's choice, no kernel attribute
  # The argmax offsets: one uint8 an output.
  text = cuda_hlo(lambda x: _vjp_ones(LOWERINGS[0][0], x), x)
  assert "tensor<2x1x5x5x16xui8>" in text
  # Global average pooling of few columns splits its positions over blocks:
  # the workspace [N, parts, C] is a second result of the call.
  parts = plans.pool_global_parts(1, 64, 96 * 96, 1, True, "bfloat16")
  assert parts > 1
  x = randn(0, (1, 96, 96, 64), jnp.bfloat16)
  text = cuda_hlo(lambda x: jax_dnn.adaptive_avg_pool(x, 1), x)
  assert f"tensor<1x{parts}x64xf32>" in text


def test_deterministic_takes_the_kernels(monkeypatch):
  """Under jax_dnn.config deterministic, the forwards that XLA runs by
  default (tiling windows) run the kernels; the setting is read when traced."""
  if extension.module() is None:
    pytest.skip("jax_dnn's extension is not built: no plans (the global pool's workspace)")
  if not jax_dnn.has_cuda_kernels():
    monkeypatch.setattr(extension, "use_kernel", lambda target: True)
  x = randn(0, (2, 8, 8, 16), jnp.bfloat16)
  # New functions each time: a traced function's program is cached with
  # the setting it was traced under.
  fns = lambda: [lambda x: jax_dnn.avg_pool(x, (2, 2), (2, 2)),
                 lambda x: jax_dnn.max_pool(x, (2, 2), (2, 2)),
                 lambda x: jax_dnn.adaptive_avg_pool(x, 4)]
  before = jax_dnn.config.deterministic
  try:
    jax_dnn.config.update("deterministic", True)
    got = [_targets(cuda_hlo(fn, x)) for fn in fns()]
  finally:
    jax_dnn.config.update("deterministic", before)
  assert got == [{"avg_pool_fwd"}, {"max_pool_fwd"}, {"avg_pool_fwd"}]
  assert [_targets(cuda_hlo(fn, x)) for fn in fns()] == [set(), set(), set()]


def test_pool_plan():
  """pool_plan's choices: XLA forwards and broadcast backwards where the
  windows tile the input (a VALID remainder included), XLA's forward alone
  for overlapping max windows, the kernels for overlapping average windows,
  uneven bins and global average pooling; argmax
  offsets for windows of at most 255 positions."""
  plan = jax_dnn.pool_plan
  p = plan("max_pool", (8, 112, 112, 64), (3, 3), (2, 2), ((1, 1), (1, 1)))
  assert (p.forward, p.residuals, p.backward) == ("xla", "argmax", "kernel")
  p = plan("max_pool", (8, 112, 112, 64), (3, 3), (2, 2), ((1, 1), (1, 1)), deterministic=True)
  assert (p.forward, p.residuals, p.backward) == ("kernel", "argmax", "kernel")
  p = plan("avg_pool", (8, 112, 112, 64), (3, 3), (1, 1), "SAME")
  assert (p.forward, p.backward) == ("kernel", "kernel")
  p = plan("avg_pool", (8, 112, 112, 64), (2, 2), (2, 2))
  assert (p.forward, p.residuals, p.backward) == ("xla", "none", "broadcast")
  p = plan("avg_pool", (8, 113, 112, 64), (2, 2), (2, 2))  # an odd row past the windows
  assert (p.forward, p.backward) == ("xla", "broadcast")
  p = plan("avg_pool", (8, 112, 112, 64), (2, 2), (2, 2), "SAME", deterministic=True)
  assert (p.forward, p.backward) == ("kernel", "broadcast")
  p = plan("avg_pool", (8, 7, 7, 64), (2, 2), (2, 2), "SAME")  # padding reached
  assert (p.forward, p.backward) == ("kernel", "kernel")
  p = plan("max_pool", (2, 64, 64, 64, 32), (2, 2, 2), (2, 2, 2))
  assert (p.forward, p.residuals, p.backward) == ("xla", "argmax", "broadcast")
  p = plan("adaptive_avg_pool", (8, 14, 14, 512), output_size=7)
  assert (p.forward, p.backward) == ("xla", "broadcast")
  p = plan("adaptive_avg_pool", (8, 7, 7, 2048), output_size=1)
  assert (p.forward, p.backward) == ("kernel", "broadcast")
  assert plan("adaptive_avg_pool", (8, 7, 7, 2048), output_size=1, deterministic=True) == p
  p = plan("adaptive_max_pool", (8, 14, 14, 512), output_size=5)
  assert (p.forward, p.residuals, p.backward) == ("kernel", "argmax", "kernel")
  p = plan("adaptive_max_pool", (8, 16, 16, 8), output_size=1)  # 256 positions a bin
  assert (p.forward, p.residuals, p.backward) == ("xla", "x_y", "kernel")
  p = plan("max_pool", (8, 15, 17, 8), (15, 17))  # 255 positions: offsets 0..254
  assert p.residuals == "argmax"
  with pytest.raises(ValueError, match="unknown op"):
    plan("min_pool", (8, 4, 4, 8), (2, 2))


def _np_argmax_offsets(x, window, strides, pads):
  """Each window's argmax as its row-major offset into the window, 255
  where a padded position wins (XLA's rule, padding as -inf, first max wins,
  NaN largest): x [N, *spatial, C] fp64."""
  spatial = x.shape[1:-1]
  wins = [_windows(s, k, st, lo, hi) for s, k, st, (lo, hi) in zip(spatial, window, strides, pads)]
  outs = tuple(len(w) for w in wins)
  idx = np.zeros((x.shape[0],) + outs + (x.shape[-1],), np.uint8)
  for o in itertools.product(*[range(k) for k in outs]):
    starts = [wins[a][o[a]][0] for a in range(len(outs))]
    for b, ch in itertools.product(range(x.shape[0]), range(x.shape[-1])):
      best, where = None, None
      for j, off in enumerate(itertools.product(*[range(k) for k in window])):
        p = tuple(s + d for s, d in zip(starts, off))
        inside = all(0 <= p[a] < spatial[a] for a in range(len(p)))
        v = x[(b,) + p + (ch,)] if inside else -np.inf
        if where is None or v > best or (np.isnan(v) and not np.isnan(best)):
          best, where = v, (j, inside)
      idx[(b,) + o + (ch,)] = where[0] if where[1] else 255
  return idx


@pytest.mark.parametrize("fill", ["small_ints", "neg_inf", "nan"])
@pytest.mark.parametrize("case", TIE_CASES + [CASES[7], CASES[10]],
                         ids=[str(c[0]) for c in TIE_CASES + [CASES[7], CASES[10]]])
def test_argmax_offsets(device, case, fill):
  """The argmax offsets that max pooling keeps for its gradient: the same
  array from the reference (CPU) and the forward kernel (GPU), against a
  NumPy loop; ties, windows of -inf behind padding, NaN."""
  del device
  shape, window, strides, padding = case
  rng = np.random.default_rng(7)
  x = rng.integers(0, 3, shape).astype(np.float32)
  if fill == "neg_inf":
    x = np.where(rng.random(shape) < 0.7, -np.inf, x).astype(np.float32)
  elif fill == "nan":
    x = np.where(rng.random(shape) < 0.1, np.nan, x).astype(np.float32)
  rank = len(window)
  xj = jnp.asarray(x, jnp.bfloat16)
  window, strides, pads = pooling._window_args("max_pool", xj, window, strides, padding)
  params = pooling._window_params(xj.shape[1:-1], window, strides, pads)
  params.update(count_include_pad=False, deterministic=False)
  x5, _ = pooling._to_3d(xj, rank)
  y, idx = jax.jit(lambda x: pooling.max_pool_idx_fwd_p.bind(x, **params))(x5)
  assert idx.dtype == jnp.uint8 and idx.shape == y.shape
  want = _np_argmax_offsets(np.asarray(xj, np.float64), window, strides,
                            _pads(shape[1:-1], window, strides, padding))
  np.testing.assert_array_equal(np.asarray(idx).reshape(want.shape), want)
  np.testing.assert_array_equal(np.asarray(y, np.float32).reshape(want.shape),
                                np.asarray(nn.max_pool(xj, window, strides, padding), np.float32))


TILED = [
    ((2, 9, 16), (2,), (2,), "VALID"),
    ((2, 9, 7, 3), (2, 2), (2, 2), "VALID"),  # a row and a column past the windows
    ((1, 4, 6, 6, 16), (2, 2, 2), (2, 2, 2), "VALID"),
    ((2, 6, 9, 5), (3, 3), (3, 3), "SAME"),  # SAME that reaches no padding
]


@pytest.mark.parametrize("case", TILED, ids=[str(c) for c in TILED])
def test_tiled_backwards_are_broadcasts(device, case):
  """Where the windows tile the input, the backwards are broadcasts in JAX
  (no backward primitive): max's from the argmax offsets equals XLA's
  gradient exactly (ties included), avg's is dy / prod(window)."""
  shape, window, strides, padding = case
  rng = np.random.default_rng(8)
  x = jnp.asarray(rng.integers(0, 3, shape), jnp.float32)
  dy_shape = nn.max_pool(x, window, strides, padding).shape
  dy = jnp.asarray(rng.integers(1, 5, dy_shape), jnp.float32)
  for ours, theirs in ((jax_dnn.max_pool, nn.max_pool), (jax_dnn.avg_pool, nn.avg_pool)):
    fn = lambda x: ours(x, window, strides, padding)
    grad = lambda x, dy: jax.vjp(fn, x)[1](dy)[0]
    jaxpr = str(jax.make_jaxpr(grad)(x, dy))
    assert "jax_dnn_max_pool_idx_bwd[" not in jaxpr and "jax_dnn_avg_pool_bwd[" not in jaxpr
    want = jax.vjp(lambda x: theirs(x, window, strides, padding), jax.device_put(x, CPU))[1](
        jax.device_put(dy, CPU))[0]
    np.testing.assert_array_equal(np.asarray(jax.jit(grad)(x, dy)), np.asarray(want))
  del device


def test_global_avg_pool_backward_is_a_broadcast():
  x = randn(9, (3, 7, 7, 32), jnp.float32)
  dy = randn(10, (3, 1, 1, 32), jnp.float32)
  grad = lambda x, dy: jax.vjp(lambda x: jax_dnn.adaptive_avg_pool(x, 1), x)[1](dy)[0]
  assert "jax_dnn_avg_pool_bwd[" not in str(jax.make_jaxpr(grad)(x, dy))
  # XLA may multiply by 1/49: an ulp of fp32.
  np.testing.assert_allclose(np.asarray(grad(x, dy)),
                             np.broadcast_to(np.asarray(dy) / np.float32(49), x.shape), rtol=2e-7)


# Shapes that reach each kernel variant on the GPU: 16-byte channel vectors
# (C 64 bf16, C 2048) and scalar channels (C 3, 5); the global average
# pooling's one-block-a-column path (N*C large: (16, 7^2, 2048)) and its
# split over blocks (few columns, long spatial axes: (1, 96^2, 64), fp32 and
# 16-bit); offsets past 2^31 elements: test_offsets_past_int32.
GPU_VARIANTS = [
    ("max", (4, 28, 28, 64), (3, 3), (2, 2), "SAME"),
    ("max", (2, 9, 30, 8), (2, 3), (1, 2), ((1, 0), (0, 2))),  # 32-bit floats: 4-wide vectors
    ("max", (2, 8, 14, 16), (2, 2), (2, 2), "VALID"),
    ("avg", (4, 28, 28, 64), (2, 2), (2, 2), "VALID"),
    ("max", (3, 9, 11, 5), (3, 3), (1, 1), ((1, 1), (1, 1))),
    ("avg", (2, 6, 8, 10, 3), (2, 2, 2), (2, 2, 2), "SAME"),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("case", GPU_VARIANTS, ids=[str(c) for c in GPU_VARIANTS])
def test_kernel_variants(device, case, dtype):
  kind, shape, window, strides, padding = case
  x = randn(11, shape, dtype, scale=3.0)
  check_fwd_bwd(device, lambda x: _ours(kind)(x, window, strides, padding),
                lambda x: _flax(kind)(x, window, strides, padding), (x,), dtype, what=kind)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", [(16, 7, 7, 2048), (1, 96, 96, 64), (2, 33, 17, 3)], ids=str)
def test_global_avg_pool_variants(device, shape, dtype):
  x = randn(12, shape, dtype, offset=1.0)
  mean = lambda x: jnp.mean(x.astype(jnp.float32), axis=(1, 2), keepdims=True).astype(x.dtype)
  check_fwd_bwd(device, lambda x: jax_dnn.adaptive_avg_pool(x, 1), mean, (x,), dtype,
                what="global avg pool")


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("case", GPU_VARIANTS, ids=[str(c) for c in GPU_VARIANTS])
def test_kernel_variants_deterministic(device, case, dtype):
  """The same under deterministic, where the forward kernels also take the
  tiling windows that XLA runs by default."""
  before = jax_dnn.config.deterministic
  jax_dnn.config.update("deterministic", True)
  try:
    test_kernel_variants(device, case, dtype)
  finally:
    jax_dnn.config.update("deterministic", before)


# Adaptive bins on the kernels: uneven bins (argmax offsets, gather
# backwards), bins of more than 255 positions (max keeps x and y), tiling
# bins (XLA's forward, broadcast backward; the kernel under deterministic).
ADAPTIVE_VARIANTS = [((4, 14, 14, 64), (5, 5)), ((2, 23, 23, 8), (1, 2)),
                     ((4, 14, 14, 64), (7, 7)), ((2, 6, 10, 12, 5), (4, 3, 5))]


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("kind", ["max", "avg"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("case", ADAPTIVE_VARIANTS, ids=[str(c) for c in ADAPTIVE_VARIANTS])
def test_adaptive_kernel_variants(device, case, dtype, kind, deterministic):
  """As test_adaptive (NumPy's first-max rule: ties in 16-bit types are
  common), on these shapes, with and without deterministic."""
  before = jax_dnn.config.deterministic
  jax_dnn.config.update("deterministic", deterministic)
  try:
    test_adaptive(device, case, dtype, kind)
  finally:
    jax_dnn.config.update("deterministic", before)


def test_global_pool_is_deterministic(device):
  x = randn(13, (2, 96, 96, 64), jnp.float32)
  fn = jax.jit(lambda x: jax_dnn.adaptive_avg_pool(x, 1))
  a, b = np.asarray(fn(x)), np.asarray(fn(x))
  np.testing.assert_array_equal(a, b)
  del device



@pytest.mark.gpu
def test_offsets_past_int32(gpu):
  """x of 2^31 + 2^17 bf16 elements (4.3 GB): the last windows, forward and
  backward, against NumPy on their slice (32-bit offsets would wrap)."""
  del gpu
  length, c = (1 << 21) + 128, 1024
  x = jax.jit(lambda k: jax.random.normal(k, (1, length, c), jnp.bfloat16))(jax.random.key(3))
  dy = jnp.full((1, length // 2, c), 0.5, jnp.bfloat16)

  def tails(x, dy):
    y, vjp = jax.vjp(lambda x: jax_dnn.max_pool(x, (2,), (2,)), x)
    return y[0, -8:], vjp(dy)[0][0, -16:], jax_dnn.avg_pool(x, (2,), (2,))[0, -8:]

  y, dx, avg = (np.asarray(a, np.float32) for a in jax.jit(tails)(x, dy))
  xs = np.asarray(x[0, -16:], np.float32).reshape(8, 2, c)
  np.testing.assert_array_equal(y, xs.max(axis=1))
  first = xs[:, 0] >= xs[:, 1]  # a tie goes to the first
  want_dx = np.stack([np.where(first, 0.5, 0.0), np.where(first, 0.0, 0.5)], axis=1)
  np.testing.assert_array_equal(dx, want_dx.reshape(16, c))
  # fp32 mean of two bf16 values rounded to bf16: half a bf16 ulp.
  np.testing.assert_allclose(avg, xs.mean(axis=1), rtol=4e-3, atol=1e-6)
