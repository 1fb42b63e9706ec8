"""Strided dgrad as stride-1 forward convolutions, one per phase
(conv_phases.dgrad_phases / dgrad_by_phases / dgrad): the decomposition
against lax's gradient over strides, dilations, padding, groups, ranks and
dtypes (CPU: the forward primitive's reference runs each phase); which calls
take it (the public ops' data gradients and strided transposed
convolutions), and which keep the dgrad primitive; the CUDA lowering (the
forward's custom calls, none of dgrad's), benchmark mode (each phase's
forward is timed) and conv_algorithms' report; on the GPU, the kernels
against XLA and deterministic runs."""

import functools

import hypothesis
from hypothesis import strategies as st
import jax
from jax import lax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_dnn
from helpers import check_fwd_bwd, cuda_hlo
from op_cases import randn
from test_conv import _check
from jax_dnn._src.conv import primitives as prims
from jax_dnn._src.conv import phases as conv_phases
from jax_dnn._src.conv import tuning as conv_tuning
from jax_dnn._src import extension
from jax_dnn._src import plans

_TARGETS = ("jax_dnn_conv_fwd", "jax_dnn_conv_dgrad", "jax_dnn_conv_wgrad")


@pytest.fixture(autouse=True)
def default_settings():
  """Each test in deterministic mode (where the phases run: by default
  XLA's strided dgrad runs, faster) with benchmark off, restored after."""
  saved = jax_dnn.config.deterministic, jax_dnn.config.benchmark
  jax_dnn.config.update("deterministic", True)
  jax_dnn.config.update("benchmark", False)
  yield
  jax_dnn.config.update("deterministic", saved[0])
  jax_dnn.config.update("benchmark", saved[1])
_DN = {1: ("NWC", "WIO", "NWC"), 2: ("NHWC", "HWIO", "NHWC"), 3: ("NDHWC", "DHWIO", "NDHWC")}


def _pads(padding, spatial, window, strides, dilation):
  if isinstance(padding, str):
    eff = [(k - 1) * d + 1 for k, d in zip(window, dilation)]
    return [tuple(p) for p in lax.padtype_to_pads(spatial, eff, strides, padding)]
  return [tuple(p) for p in padding]


def _lax_dx(x_shape, w, dy, *, groups, strides, dilation, pads):
  """lax's data gradient: x [N, *spatial, C], w [K, *window, C/G] in the
  caller's rank, fp32 at HIGHEST."""
  nsp = len(x_shape) - 2
  dn = lax.ConvDimensionNumbers((0, nsp + 1) + tuple(range(1, nsp + 1)),
                                (0, nsp + 1) + tuple(range(1, nsp + 1)),
                                (0, nsp + 1) + tuple(range(1, nsp + 1)))
  # The padding as its own lax.pad, the convolution VALID: XLA:CPU's input
  # gradient of a convolution padded past its window (e.g. 6 before a 4-tap
  # window) reads uninitialized memory now and then (jaxlib 0.10).
  padded = lambda x: lax.pad(x, jnp.float32(0), [(0, 0, 0)] + [(lo, hi, 0) for lo, hi in pads]
                             + [(0, 0, 0)])
  conv = lambda x: lax.conv_general_dilated(
      padded(x), w.astype(jnp.float32), strides, "VALID", rhs_dilation=dilation,
      dimension_numbers=dn, feature_group_count=groups, precision=lax.Precision.HIGHEST)
  return jax.vjp(conv, jnp.zeros(x_shape, jnp.float32))[1](dy.astype(jnp.float32))[0]


def _to3(a, nsp):
  return a.reshape(a.shape[:1] + (1,) * (3 - nsp) + a.shape[1:])


def _phases_dx(x_shape, w, dy, *, groups, strides, dilation, pads):
  """dgrad_by_phases on the primitives' layout, back in the caller's rank."""
  nsp = len(x_shape) - 2
  lead = lambda v, fill: (fill,) * (3 - nsp) + tuple(v)
  params = dict(k_per_group=0 if groups == 1 else w.shape[0] // groups, rank=nsp,
                stride=lead(strides, 1), dilation=lead(dilation, 1),
                pad_lo=lead([p[0] for p in pads], 0), pad_hi=lead([p[1] for p in pads], 0),
                deterministic=False, benchmark=False, precision="highest",
                input=lead(x_shape[1:-1], 1))
  dx = conv_phases.dgrad_by_phases(_to3(dy, nsp), _to3(w, nsp), **params)
  return dx.reshape(x_shape)


# name, spatial, window, C/G, K, groups, strides, dilation, padding
CASES = [
    ("1d_s2_same", (9,), (3,), 4, 6, 1, (2,), (1,), "SAME"),
    ("1d_s3_dilated", (17,), (3,), 3, 5, 1, (3,), (2,), ((2, 1),)),
    ("1d_stride_past_window", (10,), (2,), 3, 4, 1, (3,), (1,), "VALID"),
    ("1d_padding_only_phases", (4,), (2,), 2, 3, 1, (3,), (1,), ((4, 5),)),
    ("2d_resnet_3x3_s2", (14, 14), (3, 3), 8, 8, 1, (2, 2), (1, 1), "SAME"),
    ("2d_resnet_1x1_s2", (14, 14), (1, 1), 8, 16, 1, (2, 2), (1, 1), "VALID"),
    ("2d_4x4_s2", (8, 8), (4, 4), 8, 4, 1, (2, 2), (1, 1), ((1, 1), (1, 1))),
    ("2d_mixed_odd_asymmetric", (11, 13), (3, 4), 3, 5, 1, (2, 3), (1, 2), ((1, 0), (2, 3))),
    ("2d_dilation_shares_stride", (12, 9), (3, 3), 2, 4, 1, (2, 2), (2, 2), ((2, 2), (1, 3))),
    ("2d_grouped", (9, 10), (3, 3), 2, 6, 3, (2, 2), (1, 1), "SAME"),
    ("2d_depthwise_multiplier", (11, 8), (5, 5), 1, 8, 4, (2, 2), (1, 1), "SAME"),
    ("2d_window_past_input", (3, 5), (5, 3), 2, 3, 1, (3, 2), (1, 1), ((3, 2), (1, 1))),
    ("3d_s2", (5, 6, 7), (3, 3, 3), 4, 4, 1, (2, 2, 1), (1, 1, 1), "SAME"),
    ("3d_mixed_dilated_grouped", (7, 6, 9), (2, 3, 3), 2, 4, 2, (1, 3, 2), (2, 1, 1), "VALID"),
]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0])
def test_phases_against_lax(case, dtype):
  """The decomposition itself (any stride; its forwards run lax's
  convolution here) against lax's gradient."""
  _, spatial, window, cg, k, groups, strides, dilation, padding = case
  pads = _pads(padding, spatial, window, strides, dilation)
  x_shape = (2, *spatial, cg * groups)
  w = randn(1, (k, *window, cg), dtype)
  out = [(s + lo + hi - (kk - 1) * d - 1) // st + 1
         for s, kk, st, d, (lo, hi) in zip(spatial, window, strides, dilation, pads)]
  dy = randn(2, (2, *out, k), dtype)
  kw = dict(groups=groups, strides=strides, dilation=dilation, pads=pads)
  got = jax.jit(functools.partial(_phases_dx, x_shape, **kw))(w, dy)
  assert got.dtype == dtype and got.shape == x_shape
  want = _lax_dx(x_shape, w, dy, **kw)
  tol = 1e-5 if dtype == jnp.float32 else 1e-2
  np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=tol,
                             atol=tol * max(1.0, float(jnp.max(jnp.abs(want)))))


@hypothesis.settings(max_examples=60, deadline=None)
@hypothesis.given(size=st.integers(1, 12), window=st.integers(1, 5), stride=st.integers(1, 4),
                  dilation=st.integers(1, 3), lo=st.integers(0, 6), hi=st.integers(0, 6))
def test_phases_of_one_axis(size, window, stride, dilation, lo, hi):
  """Every 1D geometry (the phases are per axis, so this covers each axis of
  the 2D/3D cases' geometries)."""
  hypothesis.assume(size + lo + hi >= (window - 1) * dilation + 1)
  out = (size + lo + hi - (window - 1) * dilation - 1) // stride + 1
  w, dy = randn(3, (2, window, 3), jnp.float32), randn(4, (1, out, 2), jnp.float32)
  kw = dict(groups=1, strides=(stride,), dilation=(dilation,), pads=[(lo, hi)])
  np.testing.assert_allclose(_phases_dx((1, size, 3), w, dy, **kw),
                             _lax_dx((1, size, 3), w, dy, **kw), rtol=1e-5, atol=1e-5)


def test_axis_phases():
  """ResNet's 3x3 stride 2 (SAME from an even input: padding 0 / 1): taps
  {0, 2} for even rows, {1} for odd; a 1x1 stride 2 reaches the even rows
  only; dilation 2 at stride 2 reaches only residues of the padding's parity."""
  even, odd = conv_phases.axis_phases(56, 3, 2, 1, 0, 28)
  assert (even.taps, even.pad_lo, even.pad_hi, even.extent) == ((0, 2), 1, 0, 28)
  assert (odd.taps, odd.pad_lo, odd.pad_hi, odd.extent) == ((1,), 0, 0, 28)
  even, odd = conv_phases.axis_phases(56, 1, 2, 1, 0, 28)
  assert even.taps == (0,) and odd is None
  first, second = conv_phases.axis_phases(9, 3, 2, 2, 2, 5)
  assert first.taps == (0, 1, 2) and first.dilation == 1 and second is None
  # 4x4 stride 2, padding 1 (conv_transpose's SAME): two taps each.
  assert [p.taps for p in conv_phases.axis_phases(16, 4, 2, 1, 1, 8)] == [(1, 3), (0, 2)]


# --- which calls run the phases --------------------------------------------------------------


def _require_plans():
  if not plans.has_conv_plans():
    pytest.skip("the extension has no convolution plans")


def _names(fn, *args):
  text = str(jax.make_jaxpr(fn)(*args))
  return text.count("jax_dnn_conv_fwd["), text.count("jax_dnn_conv_dgrad[")


def _grad(fn):
  return jax.grad(lambda *a: jnp.sum(fn(*a).astype(jnp.float32)), (0, 1))


# name, fn(x, w), x shape, w shape, phases taken by the kernels' plans.
_NHWC = _DN[2]
OPS = [
    ("conv_3x3_s2", lambda x, w: jax_dnn.conv(x, w, strides=2), (2, 14, 14, 16), (3, 3, 16, 16)),
    ("conv_1x1_s2", lambda x, w: jax_dnn.conv(x, w, strides=2, padding="VALID"),
     (2, 14, 14, 16), (1, 1, 16, 32)),
    ("conv_transpose_4x4_s2",
     lambda x, w: jax_dnn.conv_transpose(x, w, (2, 2), "SAME", dimension_numbers=_NHWC),
     (2, 7, 7, 16), (4, 4, 16, 8)),
    ("conv_transpose_3x3_s2_valid",
     lambda x, w: jax_dnn.conv_transpose(x, w, (2, 2), "VALID", dimension_numbers=_NHWC),
     (2, 5, 6, 8), (3, 3, 8, 16)),
    ("nchw_negative_padding_dilated",
     lambda x, w: jax_dnn.conv_general_dilated(x, w, (2, 3), ((-1, 2), (3, -2)),
                                               rhs_dilation=(2, 1)),
     (2, 16, 13, 15), (8, 16, 3, 2)),
    ("1d_s3_dilated",
     lambda x, w: jax_dnn.conv(x, w, strides=3, dilation=2, padding=((2, 0),)),
     (2, 23, 8), (3, 8, 16)),
    ("3d_s2", lambda x, w: jax_dnn.conv(x, w, strides=(2, 2, 1)), (1, 6, 7, 5, 8),
     (3, 3, 3, 8, 8)),
]


@pytest.mark.parametrize("op", OPS, ids=lambda o: o[0])
def test_public_ops_run_the_phases(device, op):
  """The data gradients of strided convolutions, and strided transposed
  convolutions, run as forward convolutions (no dgrad primitive), with
  lax's values and gradients (CPU: the primitives' references; GPU: the
  kernels, under the tolerance rule)."""
  _require_plans()
  name, fn, x_shape, w_shape = op
  x, w = randn(10, x_shape, jnp.bfloat16), randn(11, w_shape, jnp.bfloat16, scale=0.3)
  fwd, dgrad = _names(_grad(fn), x, w)
  assert dgrad == 0 and fwd >= 2, (name, fwd, dgrad)
  _check(device, fn, _OPS_NAIVE[name], [x, w], jnp.bfloat16, name)


# lax's op for each OPS entry.
_HI = lax.Precision.HIGHEST
_OPS_NAIVE = {
    "conv_3x3_s2": lambda x, w: lax.conv_general_dilated(x, w, (2, 2), "SAME",
                                                         dimension_numbers=_NHWC, precision=_HI),
    "conv_1x1_s2": lambda x, w: lax.conv_general_dilated(x, w, (2, 2), "VALID",
                                                         dimension_numbers=_NHWC, precision=_HI),
    "conv_transpose_4x4_s2": lambda x, w: lax.conv_transpose(x, w, (2, 2), "SAME",
                                                             dimension_numbers=_NHWC,
                                                             precision=_HI),
    "conv_transpose_3x3_s2_valid": lambda x, w: lax.conv_transpose(
        x, w, (2, 2), "VALID", dimension_numbers=_NHWC, precision=_HI),
    "nchw_negative_padding_dilated": lambda x, w: lax.conv_general_dilated(
        x, w, (2, 3), ((-1, 2), (3, -2)), rhs_dilation=(2, 1), precision=_HI),
    "1d_s3_dilated": lambda x, w: lax.conv_general_dilated(
        x, w, (3,), ((2, 0),), rhs_dilation=(2,), dimension_numbers=_DN[1], precision=_HI),
    "3d_s2": lambda x, w: lax.conv_general_dilated(x, w, (2, 2, 1), "SAME",
                                                   dimension_numbers=_DN[3], precision=_HI),
}


def test_what_keeps_the_dgrad_primitive():
  """The primitive (a kernel, or XLA) where the phases do not run: outside
  deterministic mode (XLA's strided dgrad, faster); in it, channels no
  forward kernel takes, fp32 at HIGHEST, a strided depthwise dgrad that the
  direct kernel takes itself, stride 1 and JAX_DNN_IMPL=reference; grouped
  phases run on grouped_direct."""
  _require_plans()
  conv = lambda **kw: (lambda x, w: jax_dnn.conv(x, w, **kw))
  x, w = jnp.zeros((2, 14, 14, 16), jnp.bfloat16), jnp.zeros((3, 3, 16, 16), jnp.bfloat16)
  grouped = (x, jnp.zeros((3, 3, 4, 16), jnp.bfloat16))
  depthwise = (x, jnp.zeros((3, 3, 1, 16), jnp.bfloat16))
  assert _names(_grad(conv(strides=2)), x, w)[1] == 0  # deterministic (the fixture)
  assert _names(_grad(conv(strides=2)), x[..., :6], w[:, :, :6, :6])[1] == 1
  assert _names(_grad(conv(strides=1)), x, w)[1] == 1
  with jax.default_matmul_precision("highest"):
    assert _names(_grad(conv(strides=2)), x.astype(jnp.float32), w.astype(jnp.float32))[1] == 1
  # grouped_direct takes the grouped phases; depthwise_direct the strided dgrad.
  assert _names(_grad(conv(strides=2, groups=4)), *grouped)[1] == 0
  assert _names(_grad(conv(strides=2, groups=16)), *depthwise)[1] == 1
  with pytest.MonkeyPatch.context() as mp:
    mp.setenv("JAX_DNN_IMPL", "reference")  # XLA's own lowering everywhere
    assert _names(_grad(conv(strides=2)), x, w)[1] == 1
  jax_dnn.config.update("deterministic", False)  # the fixture restores it
  assert _names(_grad(conv(strides=2)), x, w)[1] == 1
  assert _names(_grad(conv(strides=2, groups=4)), *grouped)[1] == 1


def test_grouped_phases_deterministic():
  """Deterministic mode: grouped strided dgrad runs as grouped phases, with
  lax's gradient."""
  _require_plans()
  x, w = randn(12, (2, 11, 12, 16), jnp.bfloat16), randn(13, (3, 3, 4, 16), jnp.bfloat16)
  dy = randn(14, (2, 6, 6, 16), jnp.bfloat16)
  before = jax_dnn.config.deterministic
  jax_dnn.config.update("deterministic", True)
  try:
    fn = lambda x: jax_dnn.conv(x, w, strides=2, groups=4)
    assert _names(lambda x, dy: jax.vjp(fn, x)[1](dy), x, dy)[1] == 0
    got = jax.jit(lambda x, dy: jax.vjp(fn, x)[1](dy)[0])(x, dy)
  finally:
    jax_dnn.config.update("deterministic", before)
  want = _lax_dx(x.shape, jnp.moveaxis(w, -1, 0), dy, groups=4, strides=(2, 2),
                 dilation=(1, 1), pads=_pads("SAME", (11, 12), (3, 3), (2, 2), (1, 1)))
  np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=1e-2,
                             atol=1e-2 * float(jnp.max(jnp.abs(want))))


def test_vmap_of_the_phases():
  """vmap over the batch and over per-example kernels (the forward's
  batching rules fold both), against lax under vmap (fp32 at the default
  precision: the kernels' TF32 on a GPU, exact on the CPU)."""
  _require_plans()
  x, w = randn(15, (3, 2, 9, 10, 8), jnp.float32), randn(16, (3, 3, 3, 8, 8), jnp.float32)
  dy = randn(17, (3, 2, 5, 5, 8), jnp.float32)
  ours = lambda x, w, dy: jax.vjp(lambda x, w: jax_dnn.conv(x, w, strides=2), x, w)[1](dy)
  naive = lambda x, w, dy: jax.vjp(lambda x, w: lax.conv_general_dilated(
      x, w, (2, 2), "SAME", dimension_numbers=_NHWC, precision=lax.Precision.HIGHEST), x, w)[1](dy)
  for axes in ((0, None, 0), (0, 0, 0)):
    w_in = w if axes[1] == 0 else w[0]
    assert _names(jax.vmap(ours, axes), x, w_in, dy)[1] == 0
    got = jax.jit(jax.vmap(ours, axes))(x, w_in, dy)
    want = jax.vmap(naive, axes)(x, w_in, dy)
    for g, r in zip(got, want):
      np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("axis_type", ["auto", "explicit", "shard_map"])
def test_phases_split_over_devices(axis_type):
  """The batch split over 4 CPU devices, the kernel's output channels over
  2: the phases (one of them zero, the 1x1's odd rows and columns) give
  lax's gradients, typed as their primals under explicit mesh axes."""
  _require_plans()
  P = jax.sharding.PartitionSpec  # pylint: disable=invalid-name
  kind = jax.sharding.AxisType.Explicit if axis_type == "explicit" else jax.sharding.AxisType.Auto
  mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(kind, kind),
                       devices=jax.devices("cpu")[:8])
  x = randn(18, (8, 9, 10, 16), jnp.float32)
  specs = (P("data"), P(None, None, None, "model"))
  for window, padding in (((3, 3), "SAME"), ((2, 1), "VALID")):
    w = randn(19, (*window, 16, 8), jnp.float32, scale=0.3)
    loss = lambda conv: (lambda x, w: jnp.sum(jnp.sin(conv(x, w))))
    ours = jax.grad(loss(lambda x, w: jax_dnn.conv(x, w, strides=(2, 3), padding=padding)),
                    (0, 1))
    naive = jax.grad(loss(lambda x, w: lax.conv_general_dilated(
        x, w, (2, 3), padding, dimension_numbers=_NHWC, precision=lax.Precision.HIGHEST)), (0, 1))
    assert _names(ours, x, w)[1] == 0
    want = naive(x, w)
    if axis_type == "shard_map":
      # Each device's batch rows, the whole kernel (its gradient, of an
      # operand that does not vary over "data", comes summed over it).
      fn = jax.shard_map(ours, mesh=mesh, in_specs=(P("data"), P()),
                         out_specs=(P("data"), P()))
      got = jax.jit(fn)(x, w)
    else:
      with jax.set_mesh(mesh):
        split = [jax.device_put(a, jax.sharding.NamedSharding(mesh, sp))
                 for a, sp in zip((x, w), specs)]
        got = jax.jit(ours)(*split)
      if axis_type == "explicit":
        full = lambda a: tuple(a.sharding.spec) + (None,) * (a.ndim - len(a.sharding.spec))
        for g, a in zip(got, split):
          assert full(g) == full(a), (g.sharding.spec, a.sharding.spec)
    for g, r in zip(got, want):
      np.testing.assert_allclose(np.asarray(g), r, rtol=1e-4, atol=1e-4)


# --- the CUDA lowering, benchmark mode and conv_algorithms ----------------------------------


@pytest.fixture
def conv_targets(monkeypatch):
  """The conv targets registered (a CPU-only build registers none), the
  real plans: the CUDA lowering calls the kernels the plans take."""
  _require_plans()
  monkeypatch.setattr(extension, "registered_targets", lambda: frozenset(_TARGETS))
  prims._plan.cache_clear()  # pylint: disable=protected-access
  yield
  prims._plan.cache_clear()  # pylint: disable=protected-access


def _calls(text, target):
  return [l for l in text.splitlines() if f"custom_call @{target}(" in l]


def test_strided_dgrad_cuda_lowering(conv_targets):
  """ResNet's 3x3 and 1x1 stride-2 layers' gradients, and a 4x4 stride-2
  transposed convolution: the forward kernel's calls, one a phase some tap
  reaches, at stride 1; none of dgrad's."""
  del conv_targets
  x = randn(20, (2, 16, 16, 64), jnp.bfloat16)
  for window, phases in (((3, 3), 4), ((1, 1), 1)):
    w = randn(21, (*window, 64, 128), jnp.bfloat16)
    text = cuda_hlo(_grad(lambda x, w: jax_dnn.conv(x, w, strides=2)), x, w)
    fwd = _calls(text, "jax_dnn_conv_fwd")
    # (The forward's y is unused by the gradient of its sum: jit drops it.)
    assert len(fwd) == phases and not _calls(text, "jax_dnn_conv_dgrad"), window
    assert all("stride = dense<1> : tensor<3xi64>" in c for c in fwd), fwd
  w = randn(22, (4, 4, 64, 32), jnp.bfloat16)
  text = cuda_hlo(lambda x, w: jax_dnn.conv_transpose(x, w, (2, 2), "SAME",
                                                      dimension_numbers=_NHWC), x, w)
  fwd = _calls(text, "jax_dnn_conv_fwd")
  assert len(fwd) == 4 and not _calls(text, "jax_dnn_conv_dgrad")
  # Each phase: a 2x2 window; the result 32 channels at 16x16 per phase.
  assert all("tensor<32x1x2x2x64xbf16>" in c and "tensor<2x1x16x16x32xbf16>" in c
             for c in fwd), fwd


def test_benchmark_mode_times_each_phase(conv_targets, monkeypatch, tmp_path):
  """Benchmark mode (deterministic, the fixture's): nothing is timed while
  tracing; lowering times each phase's forward, and conv_algorithms
  then reports the phases' times."""
  del conv_targets
  monkeypatch.setenv("JAX_DNN_CACHE_DIR", str(tmp_path))
  timed = []

  def measure(problem, algorithms, reference):
    del reference
    del problem
    timed.append([a.name for a in algorithms])
    return {a.name: 0.1 * (i + 1) for i, a in enumerate(algorithms)} | {"xla": 1.0}

  monkeypatch.setattr(conv_tuning, "TUNER", conv_tuning.Tuner(
      measure=measure, device=lambda: "NVIDIA Test GPU sm_count=132 cc=9.0"))
  before = jax_dnn.config.benchmark
  jax_dnn.config.update("benchmark", True)
  try:
    x, w = randn(23, (2, 12, 12, 64), jnp.bfloat16), randn(24, (3, 3, 64, 64), jnp.bfloat16)
    fn = lambda x, w: jax_dnn.conv(x, w, strides=2)
    traced = jax.jit(_grad(fn)).trace(x, w)
    assert not timed
    text = traced.lower(lowering_platforms=("cuda",)).as_text()
    assert len(_calls(text, "jax_dnn_conv_fwd")) == 4  # the phases (y is unused)
    report = jax_dnn.conv_algorithms(x, w, strides=2)
  finally:
    jax_dnn.config.update("benchmark", before)
  # The 4 phases' forwards (no dgrad problem; deterministic mode, where the
  # phases run, leaves the wgrad one candidate and XLA out: nothing to time).
  assert len(timed) == 4, timed
  dgrad = report["dgrad"]
  assert dgrad.chosen.name == "strided_dgrad_phases" and len(dgrad.phases) == 4
  assert all(sub.times_ms is not None for _, sub in dgrad.phases), str(dgrad)


def test_conv_algorithms_reports_the_phases():
  _require_plans()
  x = jax.ShapeDtypeStruct((8, 56, 56, 64), jnp.bfloat16)
  report = jax_dnn.conv_algorithms(x, jax.ShapeDtypeStruct((3, 3, 64, 64), jnp.bfloat16),
                                   strides=2, sm_count=132)
  assert list(report) == ["fwd", "dgrad", "wgrad"]
  dgrad = report["dgrad"]
  assert dgrad.problem["stride"] == (1, 2, 2) and dgrad.problem["op"] == "dgrad"
  assert dgrad.chosen.name == "strided_dgrad_phases" and dgrad.chosen.deterministic
  assert dgrad.chosen in dgrad.algorithms
  assert [r for r, _ in dgrad.phases] == [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1)]
  assert [s.problem["window"] for _, s in dgrad.phases] == [(1, 2, 2), (1, 2, 1), (1, 1, 2),
                                                             (1, 1, 1)]
  assert dgrad.phases[-1][1].chosen.name == "gemm_1x1"
  text = str(dgrad)
  assert "runs strided_dgrad_phases" in text and "strided dgrad: CUTLASS" in text
  one = jax_dnn.conv_algorithms(x, jax.ShapeDtypeStruct((1, 1, 64, 256), jnp.bfloat16),
                                strides=2, padding="VALID", sm_count=132)["dgrad"]
  assert [s is None for _, s in one.phases] == [False, True, True, True]
  assert "phase (0, 1, 1): zeros" in str(one) and "(3 no tap reaches: zeros)" in str(one)
  # No forward kernel takes 6 channels: the dgrad primitive, XLA.
  odd = jax_dnn.conv_algorithms(jax.ShapeDtypeStruct((8, 56, 56, 6), jnp.bfloat16),
                                jax.ShapeDtypeStruct((3, 3, 6, 6), jnp.bfloat16), strides=2)
  assert odd["dgrad"].chosen is None and not odd["dgrad"].phases


# --- on the GPU --------------------------------------------------------------------------------


# name, fn(x, w), x shape, w shape: ResNet-50's strided layers (N reduced), a
# UNet/GAN 4x4 stride-2 transposed convolution, 1D and 3D.
GPU_CASES = [
    ("resnet_3x3_s2", lambda x, w: jax_dnn.conv(x, w, strides=2), (8, 56, 56, 128),
     (3, 3, 128, 128)),
    ("resnet_1x1_s2_downsample", lambda x, w: jax_dnn.conv(x, w, strides=2, padding="VALID"),
     (8, 56, 56, 256), (1, 1, 256, 512)),
    ("transposed_4x4_s2", lambda x, w: jax_dnn.conv_transpose(
        x, w, (2, 2), "SAME", dimension_numbers=_NHWC), (4, 32, 32, 512), (4, 4, 512, 256)),
    ("1d_k3_s2_dilated", lambda x, w: jax_dnn.conv(x, w, strides=2, dilation=3),
     (4, 1001, 64), (3, 64, 64)),
    ("3d_3x3x3_s2", lambda x, w: jax_dnn.conv(x, w, strides=2), (2, 16, 16, 16, 32),
     (3, 3, 3, 32, 64)),
]

_NAIVE = {
    "resnet_3x3_s2": lambda x, w: lax.conv_general_dilated(x, w, (2, 2), "SAME",
                                                           dimension_numbers=_NHWC),
    "resnet_1x1_s2_downsample": lambda x, w: lax.conv_general_dilated(
        x, w, (2, 2), "VALID", dimension_numbers=_NHWC),
    "transposed_4x4_s2": lambda x, w: lax.conv_transpose(x, w, (2, 2), "SAME",
                                                         dimension_numbers=_NHWC),
    "1d_k3_s2_dilated": lambda x, w: lax.conv_general_dilated(
        x, w, (2,), "SAME", rhs_dilation=(3,), dimension_numbers=_DN[1]),
    "3d_3x3x3_s2": lambda x, w: lax.conv_general_dilated(x, w, (2, 2, 2), "SAME",
                                                         dimension_numbers=_DN[3]),
}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: c[0])
def test_phases_on_the_kernels(gpu, case, dtype):
  """Values and gradients against XLA's under the tolerance rule, the
  outputs poisoned; the data gradient ran as phases on the kernels."""
  name, fn, x_shape, w_shape = case
  x, w = randn(30, x_shape, dtype), randn(31, w_shape, dtype, scale=0.1)
  # No fp16 3D forward kernel: its phases are not taken, XLA's dgrad runs.
  xla_dgrad = dtype == jnp.float16 and len(x_shape) == 5
  assert _names(_grad(fn), x, w)[1] == int(xla_dgrad), name
  reused = check_fwd_bwd(gpu, fn, _NAIVE[name], [x, w], dtype, what=name)
  assert reused >= 1, "the output did not land in a poisoned buffer"


@pytest.mark.gpu
def test_phases_deterministic_runs_are_bitwise_equal(gpu):
  del gpu
  x = randn(32, (8, 28, 28, 128), jnp.bfloat16)
  w = randn(33, (3, 3, 128, 256), jnp.bfloat16, scale=0.1)
  dy = randn(34, (8, 14, 14, 256), jnp.bfloat16)
  before = jax_dnn.config.deterministic
  jax_dnn.config.update("deterministic", True)
  try:
    fn = jax.jit(lambda x, w, dy: jax.vjp(lambda x, w: jax_dnn.conv(x, w, strides=2),
                                          x, w)[1](dy))
    first, second = fn(x, w, dy), fn(x, w, dy)
  finally:
    jax_dnn.config.update("deterministic", before)
  for a, b in zip(first, second):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
