"""Convolutions: conv_general_dilated and conv_transpose against lax's (on
the GPU: fp64 references and the tolerance rule) over spatial ranks,
strides, dilations, padding, groups, lhs dilation and dimension numbers;
the fused conv against its composition; matmul against jnp; per-example kernels under vmap; the
paths each call takes; bad inputs; deterministic mode; the CUDA lowering.
jit/vmap/grad/vmap(grad), check_grads, sharding and export of the table's
cases: tests/test_transforms.py and the other readers of tests/op_cases.py."""

import contextlib
import dataclasses
import functools
import re

import hypothesis
from hypothesis import strategies as st
import jax
from jax import lax
from jax.test_util import check_grads
import jax.numpy as jnp
import numpy as np
import pytest

import jax_dnn
from helpers import DTYPES, check_fwd_bwd, cuda_hlo, on_gpu, x64
from op_cases import randn
from jax_dnn._src.conv import primitives as conv_primitives
from jax_dnn._src import extension
from jax_dnn._src import plans

HIGHEST = lax.Precision.HIGHEST
# The references' precision: lax's default, exact fp32 on the CPU; on a GPU
# TF32 for fp32 operands, as the kernels compute them, so that the tolerance
# rule's same-dtype baseline is what JAX computes in fp32 there.
REF_PRECISION = None


def _check(device, ours, naive, args, dtype, what):
  """ours against naive (lax), values and the VJP with a random
  cotangent. GPU: helpers.check_fwd_bwd (fp64 references, the tolerance
  rule, poisoned outputs); returns how many outputs reused poisoned buffers.
  CPU (the reference path, where what is checked is the mapping onto the
  primitives): against naive on the same inputs in fp32, which costs no
  fp64 compilation; reduced-precision results within their rounding (2^-8
  relative for bf16, after fp32 accumulation)."""
  if on_gpu(device):
    return check_fwd_bwd(device, ours, naive, args, dtype, what=what)
  up = lambda fn: (lambda *a: fn(*[x.astype(jnp.float32) for x in a]))
  tol = 1e-5 if dtype == jnp.float32 else 2e-2
  got = jax.jit(ours)(*args)
  assert got.dtype == args[0].dtype, (what, got.dtype)
  want = jax.jit(up(naive))(*args)
  scale = max(1.0, float(jnp.max(jnp.abs(want))))
  np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=tol, atol=tol * scale,
                             err_msg=f"{what} forward")
  dy = randn(1000, got.shape, dtype)
  vjp = lambda fn: jax.jit(lambda *a: jax.vjp(fn, *a[:-1])[1](a[-1]))
  grads = zip(vjp(ours)(*args, dy), vjp(up(naive))(*args, dy.astype(jnp.float32)))
  for i, (g, w) in enumerate(grads):
    assert g.dtype == args[i].dtype, (what, i, g.dtype)
    scale = max(1.0, float(jnp.max(jnp.abs(w.astype(jnp.float32)))))
    np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), rtol=tol,
                               atol=tol * scale, err_msg=f"{what} grad of arg {i}")
  return 0
_PRIMS = ("jax_dnn_conv_fwd", "jax_dnn_conv_dgrad", "jax_dnn_conv_wgrad")


def _lax(**kw):
  return lambda x, w: lax.conv_general_dilated(x, w, precision=REF_PRECISION, **kw)


def _ours(**kw):
  return lambda x, w: jax_dnn.conv_general_dilated(x, w, **kw)


def _shapes(dn, n, c, k, spatial, window, groups):
  """lhs and rhs shapes for dimension numbers `dn` (strings)."""
  lhs_spec, rhs_spec, _ = dn
  sizes = dict(zip("DHW"[3 - len(spatial):], spatial))
  wsizes = dict(zip("DHW"[3 - len(window):], window))
  lhs = tuple(n if ch == "N" else c if ch == "C" else sizes[ch] for ch in lhs_spec)
  rhs = tuple(k if ch == "O" else c // groups if ch == "I" else wsizes[ch] for ch in rhs_spec)
  return lhs, rhs


_DN = {1: ("NWC", "WIO", "NWC"), 2: ("NHWC", "HWIO", "NHWC"), 3: ("NDHWC", "DHWIO", "NDHWC")}
_NCHW = {1: ("NCW", "OIW", "NCW"), 2: ("NCHW", "OIHW", "NCHW"), 3: ("NCDHW", "OIDHW", "NCDHW")}

# (name, spatial rank, n, c, k, spatial, window, groups, dn, kwargs). Odd
# sizes, batch 1, channels that are not a multiple of 8 throughout.
CASES = [
    ("1d_same", 1, 2, 5, 7, (13,), (3,), 1, _DN[1], dict(window_strides=(1,), padding="SAME")),
    ("1d_strided_dilated", 1, 3, 6, 4, (17,), (3,), 1, _DN[1],
     dict(window_strides=(2,), padding="VALID", rhs_dilation=(3,))),
    ("2d_nhwc_same", 2, 2, 6, 9, (7, 9), (3, 3), 1, _DN[2],
     dict(window_strides=(1, 1), padding="SAME")),
    ("2d_same_lower_strided", 2, 1, 3, 5, (8, 11), (4, 3), 1, _DN[2],
     dict(window_strides=(2, 3), padding="SAME_LOWER")),
    ("2d_explicit_negative", 2, 2, 4, 6, (9, 7), (3, 2), 1, _DN[2],
     dict(window_strides=(1, 2), padding=((2, -1), (-2, 3)), rhs_dilation=(2, 1))),
    ("2d_nchw_groups", 2, 2, 6, 9, (7, 6), (3, 3), 3, _NCHW[2],
     dict(window_strides=(2, 1), padding=((1, 1), (0, 2)), feature_group_count=3)),
    ("2d_depthwise", 2, 2, 5, 10, (9, 8), (3, 3), 5, _DN[2],
     dict(window_strides=(1, 1), padding="SAME", feature_group_count=5)),
    ("2d_other_layout", 2, 2, 5, 3, (6, 7), (2, 3), 1, ("HCNW", "IWHO", "WNHC"),
     dict(window_strides=(1, 2), padding="VALID")),
    ("2d_1x1", 2, 3, 12, 5, (5, 4), (1, 1), 1, _NCHW[2], dict(window_strides=(1, 1),
                                                              padding="VALID")),
    ("3d_same", 3, 1, 3, 4, (5, 6, 4), (3, 3, 3), 1, _DN[3],
     dict(window_strides=(1, 1, 1), padding="SAME")),
    ("3d_ncdhw_strided", 3, 2, 4, 6, (6, 5, 7), (2, 3, 3), 2, _NCHW[3],
     dict(window_strides=(2, 1, 2), padding=((0, 1), (1, 1), (2, 0)), rhs_dilation=(1, 2, 1),
          feature_group_count=2)),
    # lhs dilation: the data-gradient kernel.
    ("1d_lhs_dilated", 1, 2, 3, 5, (6,), (3,), 1, _DN[1],
     dict(window_strides=(1,), padding=((2, 2),), lhs_dilation=(2,))),
    ("2d_lhs_dilated", 2, 2, 4, 6, (5, 4), (3, 4), 1, _DN[2],
     dict(window_strides=(1, 1), padding=((1, 2), (3, 0)), lhs_dilation=(2, 3))),
    ("2d_lhs_dilated_groups_nchw", 2, 1, 6, 4, (4, 5), (3, 3), 2, _NCHW[2],
     dict(window_strides=(1, 1), padding=((2, 1), (1, 1)), lhs_dilation=(3, 2),
          feature_group_count=2)),
    ("2d_lhs_and_rhs_dilated", 2, 2, 3, 5, (4, 5), (3, 2), 1, _DN[2],
     dict(window_strides=(1, 1), padding=((3, 1), (0, 2)), lhs_dilation=(2, 2),
          rhs_dilation=(2, 3))),
    ("2d_lhs_dilated_wide_padding", 2, 1, 3, 4, (4, 3), (2, 3), 1, _DN[2],
     dict(window_strides=(1, 1), padding=((4, -1), (-1, 5)), lhs_dilation=(2, 2))),
    ("3d_lhs_dilated", 3, 1, 4, 3, (3, 4, 3), (2, 3, 3), 1, _DN[3],
     dict(window_strides=(1, 1, 1), padding=((1, 1), (2, 2), (0, 1)), lhs_dilation=(2, 2, 2))),
    # Taken by lax only: lhs dilation with window strides.
    ("2d_lhs_dilated_strided", 2, 2, 3, 4, (5, 4), (3, 3), 1, _DN[2],
     dict(window_strides=(2, 1), padding=((1, 1), (1, 1)), lhs_dilation=(2, 2))),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0])
def test_conv_general_dilated(device, case, dtype):
  name, _, n, c, k, spatial, window, groups, dn, kw = case
  if dtype != jnp.float32 and not on_gpu(device) and name not in (
      "2d_nhwc_same", "2d_lhs_dilated", "2d_depthwise"):
    pytest.skip("CPU: the reduced precisions on three layouts (the reference path casts alike)")
  lhs_shape, rhs_shape = _shapes(dn, n, c, k, spatial, window, groups)
  x, w = randn(1, lhs_shape, dtype), randn(2, rhs_shape, dtype, scale=0.5)
  kw = dict(kw, dimension_numbers=dn)
  reused = _check(device, _ours(**kw), _lax(**kw), (x, w), dtype, what=name)
  if on_gpu(device):
    assert reused >= 1, "the output did not land in a poisoned buffer"


# --- conv_transpose --------------------------------------------------------------------

TRANSPOSE_CASES = [
    ("1d_same", (2, 7, 3), (4, 3, 5), dict(strides=(2,), padding="SAME")),
    ("2d_same_s2", (2, 5, 4, 6), (4, 4, 6, 3), dict(strides=(2, 2), padding="SAME")),
    ("2d_valid_s3", (1, 4, 3, 5), (3, 2, 5, 4), dict(strides=(3, 2), padding="VALID")),
    ("2d_explicit", (2, 4, 5, 3), (3, 3, 3, 6), dict(strides=(2, 1), padding=((1, 2), (0, 1)))),
    ("2d_dilated", (2, 4, 4, 3), (3, 2, 3, 2), dict(strides=(2, 2), padding="SAME",
                                                    rhs_dilation=(2, 1))),
    ("2d_consistent", (2, 4, 5, 3), (3, 3, 3, 5), dict(strides=(2, 2), padding=((1, 1), (1, 0)),
                                                       use_consistent_padding=True)),
    ("2d_nchw", (2, 3, 4, 5), (6, 3, 3, 3), dict(strides=(2, 2), padding="SAME",
                                                 dimension_numbers=("NCHW", "OIHW", "NCHW"))),
    ("3d_same", (1, 3, 4, 3, 4), (2, 3, 2, 4, 3), dict(strides=(2, 2, 1), padding="SAME")),
]


@pytest.mark.parametrize("transpose_kernel", [False, True])
@pytest.mark.parametrize("case", TRANSPOSE_CASES, ids=lambda c: c[0])
def test_conv_transpose(device, case, transpose_kernel):
  name, lhs_shape, rhs_shape, kw = case
  if transpose_kernel and not on_gpu(device) and name not in ("1d_same", "2d_same_s2", "2d_nchw",
                                                                 "3d_same"):
    pytest.skip("CPU: transpose_kernel on four layouts (a flip and a swap before the call)")
  kw = dict(kw, transpose_kernel=transpose_kernel)
  if transpose_kernel:  # the kernel's O and I swap roles
    spec = kw.get("dimension_numbers", (None, "HWIO" if len(rhs_shape) == 4 else None, None))[1]
    if spec is not None:
      rhs_shape = list(rhs_shape)
      i, o = spec.index("I"), spec.index("O")
      rhs_shape[i], rhs_shape[o] = rhs_shape[o], rhs_shape[i]
    else:
      rhs_shape = rhs_shape[:-2] + (rhs_shape[-1], rhs_shape[-2])
  dtype = jnp.bfloat16 if on_gpu(device) else jnp.float32
  x, w = randn(3, lhs_shape, dtype), randn(4, tuple(rhs_shape), dtype, scale=0.5)
  ours = lambda x, w: jax_dnn.conv_transpose(x, w, **kw)
  naive = lambda x, w: lax.conv_transpose(x, w, precision=REF_PRECISION, **kw)
  _check(device, ours, naive, (x, w), dtype, what=name)


def test_conv_transpose_runs_the_data_gradient():
  x, w = randn(5, (2, 5, 4, 6), jnp.float32), randn(6, (4, 4, 6, 3), jnp.float32)
  fn = lambda x, w: jax_dnn.conv_transpose(x, w, (2, 2), "SAME")
  text = str(jax.make_jaxpr(fn)(x, w))
  assert "jax_dnn_conv_dgrad" in text and "jax_dnn_conv_fwd" not in text
  assert "conv_general_dilated" not in text  # no forward over inserted zeros
  text = str(jax.make_jaxpr(jax.grad(lambda x, w: jnp.sum(fn(x, w)), (0, 1)))(x, w))
  assert "jax_dnn_conv_fwd" in text and "jax_dnn_conv_wgrad" in text


# --- the lhs-dilation mapping, over many random configurations -------------------------


@hypothesis.settings(max_examples=15, deadline=None, derandomize=True, database=None)
@hypothesis.given(
    st.integers(1, 2),  # spatial rank
    st.lists(st.integers(1, 3), min_size=2, max_size=2),  # lhs dilation
    st.lists(st.integers(1, 2), min_size=2, max_size=2),  # rhs dilation
    st.lists(st.integers(1, 4), min_size=2, max_size=2),  # window
    st.lists(st.tuples(st.integers(-2, 4), st.integers(-2, 4)), min_size=2, max_size=2),
    st.sampled_from([1, 2]))
def test_lhs_dilation_against_lax(nsp, lhs_dil, rhs_dil, window, pads, groups):
  spatial = (4, 3)[:nsp]
  x = randn(7, (2, *spatial, 2 * groups), jnp.float32)
  w = randn(8, (*window[:nsp], 2, 3 * groups), jnp.float32)
  kw = dict(window_strides=(1,) * nsp, padding=tuple(pads[:nsp]), lhs_dilation=lhs_dil[:nsp],
            rhs_dilation=rhs_dil[:nsp], dimension_numbers=_DN[nsp], feature_group_count=groups)
  try:
    want_shape = jax.eval_shape(_lax(**kw), x, w).shape
  except (ValueError, TypeError):
    hypothesis.assume(False)
  hypothesis.assume(0 not in want_shape)
  dy = randn(9, want_shape, jnp.float32)
  # Jitted: XLA's CPU runtime, op by op, gets the data gradient wrong where
  # the padding passes the window (lo >= k: lax's transpose pads negatively).
  vjp = lambda fn: jax.jit(lambda x, w, dy: (fn(x, w), jax.vjp(fn, x, w)[1](dy)))
  (got, grads_got), (want, grads_want) = vjp(_ours(**kw))(x, w, dy), vjp(_lax(**kw))(x, w, dy)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  for g, wt in zip(grads_got, grads_want):
    np.testing.assert_allclose(g, wt, rtol=1e-5, atol=1e-5)


# --- the fused form and matmul ---------------------------------------------------------


def _composed(x, kernel, bias=None, *, residual=None, activation=None, strides=1,
              padding="SAME", dilation=1, groups=1):
  nsp = x.ndim - 2
  tup = lambda v: (v,) * nsp if isinstance(v, int) else tuple(v)
  if isinstance(padding, int):
    padding = [(padding, padding)] * nsp
  y = lax.conv_general_dilated(x, kernel, tup(strides), padding, rhs_dilation=tup(dilation),
                               dimension_numbers=_DN[nsp], feature_group_count=groups,
                               precision=REF_PRECISION)
  if bias is not None:
    y = y + bias
  if residual is not None:
    y = y + residual
  acts = {"relu": jax.nn.relu, "gelu": functools.partial(jax.nn.gelu, approximate=False),
          "gelu_tanh": functools.partial(jax.nn.gelu, approximate=True), "silu": jax.nn.silu,
          "sigmoid": jax.nn.sigmoid, "tanh": jnp.tanh}
  return y if activation is None else acts[activation](y)


FUSED = [  # (x shape, kernel shape, options, bias, residual)
    ((2, 7, 9, 6), (3, 3, 6, 5), dict(), True, True),
    ((1, 9, 5), (3, 5, 4), dict(strides=2, padding="VALID"), True, False),
    ((2, 6, 7, 4), (3, 2, 2, 6), dict(groups=2, dilation=(2, 1), padding=1), False, True),
    ((2, 3, 4, 5, 3), (2, 3, 3, 3, 4), dict(strides=(1, 2, 1)), True, True),
    ((2, 8, 8, 6), (3, 3, 1, 6), dict(groups=6, padding=((1, 0), (-1, 2))), True, False),
]


@pytest.mark.parametrize("activation", [None, "relu", "gelu", "gelu_tanh", "silu", "sigmoid",
                                        "tanh"])
@pytest.mark.parametrize("case", range(len(FUSED)))
def test_fused_against_composition(device, case, activation):
  x_shape, k_shape, opts, has_bias, has_res = FUSED[case]
  acts = [None, "relu", "gelu", "gelu_tanh", "silu", "sigmoid", "tanh"]
  if activation is not None and acts.index(activation) % len(FUSED) != case and not on_gpu(
      device):
    pytest.skip("CPU: each activation on one shape (the reference applies it alike)")
  dtype = jnp.bfloat16 if on_gpu(device) else jnp.float32
  x, kernel = randn(10, x_shape, dtype), randn(11, k_shape, dtype, scale=0.5)
  args = [x, kernel]
  out = jax.eval_shape(functools.partial(_composed, **opts), x, kernel)
  if has_bias:
    args.append(randn(12, (k_shape[-1],), dtype))
  if has_res:
    args.append(randn(13, out.shape, dtype))

  def split(fn):
    def call(x, kernel, *rest):
      bias = rest[0] if has_bias else None
      residual = rest[-1] if has_res else None
      return fn(x, kernel, bias, residual=residual, activation=activation, **opts)
    return call

  _check(device, split(jax_dnn.conv), split(_composed), args, dtype,
                what=f"conv {case} {activation}")


def test_fused_training_runs_gelu_after_the_kernel():
  """gelu and silu need z for their derivative: under differentiation the
  forward kernel runs without them and jax_dnn's activation follows; relu's
  derivative comes from y, so it stays fused."""
  x, kernel = randn(14, (1, 5, 5, 3), jnp.float32), randn(15, (3, 3, 3, 4), jnp.float32)
  for act, fused in (("gelu", False), ("relu", True)):
    loss = lambda x, k, act=act: jnp.sum(jax_dnn.conv(x, k, activation=act))
    text = str(jax.make_jaxpr(jax.grad(loss, (0, 1)))(x, kernel))
    fwd = re.search(r"jax_dnn_conv_fwd\[\s*activation=(-?\d+)", text)
    assert fwd and (int(fwd.group(1)) >= 0) == fused, (act, fwd)
    assert ("jax_dnn_activation_fwd" in text) != fused
    inference = str(jax.make_jaxpr(functools.partial(jax_dnn.conv, activation=act))(x, kernel))
    assert "jax_dnn_activation_fwd" not in inference


@pytest.mark.parametrize("x_shape", [(5,), (3, 5), (2, 3, 5), (2, 2, 2, 2, 5), (2, 1, 2, 3, 1, 5)],
                         ids=str)
@pytest.mark.parametrize("activation", [None, "gelu_tanh"])
def test_matmul(device, x_shape, activation):
  if activation is None and len(x_shape) not in (1, 3) and not on_gpu(device):
    pytest.skip("CPU: no activation on two shapes")
  dtype = jnp.bfloat16 if on_gpu(device) else jnp.float32
  args = [randn(16, x_shape, dtype), randn(17, (5, 7), dtype, scale=0.5), randn(18, (7,), dtype)]
  ours = lambda x, w, b: jax_dnn.matmul(x, w, b, activation=activation)
  naive = lambda x, w, b: _composed_matmul(x, w, b, activation)
  _check(device, ours, naive, args, dtype, what=f"matmul {x_shape}")


def _composed_matmul(x, w, b, activation):
  y = jnp.matmul(x, w, precision=REF_PRECISION) + b
  return y if activation is None else jax.nn.gelu(y, approximate=True)


def test_matmul_without_bias():
  x, w = randn(19, (4, 6), jnp.float32), randn(20, (6, 3), jnp.float32)
  np.testing.assert_allclose(jax_dnn.matmul(x, w), jnp.matmul(x, w, precision=HIGHEST),
                             rtol=1e-5, atol=1e-5)


# --- vmap: per-example kernels fold into channel groups ---------------------------------


@pytest.mark.parametrize("in_axes,groups", [((0, 0), 1), ((None, 0), 2), ((2, 3), 2)], ids=str)
def test_vmapped_kernels(in_axes, groups):
  """Per-example kernels fold into channel groups: values and per-example
  gradients against lax's own batching, for the forward and the
  lhs-dilated (data-gradient) path."""
  v = 3
  x = randn(21, (v, 2, 6, 5, 4), jnp.float32)  # [V, N, H, W, C]
  w = randn(22, (v, 3, 3, 4 // groups, 6), jnp.float32)  # [V, H, W, C / G, K]
  x = x[0] if in_axes[0] is None else jnp.moveaxis(x, 0, in_axes[0])
  w = jnp.moveaxis(w, 0, in_axes[1])
  for lhs_dilation, strides in ((None, (2, 1)), ((2, 1), (1, 1))):
    kw = dict(window_strides=strides, padding=((1, 1), (2, 0)), lhs_dilation=lhs_dilation,
              dimension_numbers=_DN[2], feature_group_count=groups)
    ours, theirs = (jax.vmap(f(**kw), in_axes=in_axes) for f in (_ours, _lax))
    np.testing.assert_allclose(jax.jit(ours)(x, w), jax.jit(theirs)(x, w), rtol=1e-5, atol=1e-5)
    loss = lambda f: (lambda x, w: jnp.sum(jnp.sin(f(x, w))))
    per_example = lambda f, kw=kw: jax.jit(jax.vmap(jax.grad(loss(f(**kw)), (0, 1)),
                                                    in_axes=in_axes))
    for g, wt in zip(per_example(_ours)(x, w), per_example(_lax)(x, w)):
      np.testing.assert_allclose(g, wt, rtol=1e-5, atol=1e-5)


def test_vmap_folds_never_loops():
  x, w = randn(23, (3, 2, 6, 5, 4), jnp.float32), randn(24, (3, 3, 3, 4, 6), jnp.float32)
  fn = jax.vmap(jax.grad(lambda x, w: jnp.sum(jax_dnn.conv(x, w) ** 2), (0, 1)))
  text = str(jax.make_jaxpr(fn)(x, w))
  assert "while" not in text and "scan" not in text
  assert text.count("jax_dnn_conv_") >= 3


# --- which path a call takes ----------------------------------------------------------------


def _prims_in(fn, *args):
  text = str(jax.make_jaxpr(fn)(*args))
  return {p for p in _PRIMS if p in text}, text


def test_channels_last_transposes_only_the_kernel():
  x, w = randn(25, (2, 6, 5, 4), jnp.float32), randn(26, (3, 3, 4, 6), jnp.float32)
  found, text = _prims_in(lambda x, w: jax_dnn.conv_general_dilated(
      x, w, (1, 1), "SAME", dimension_numbers=_DN[2]), x, w)
  assert found == {"jax_dnn_conv_fwd"}
  assert text.count("transpose[") == 1 and "f32[6,3,3,4] = transpose" in text, text


@pytest.mark.parametrize("kw,dtypes,path", [
    (dict(batch_group_count=2), (jnp.float32,) * 2, "lax"),
    (dict(preferred_element_type=jnp.float32), (jnp.bfloat16,) * 2, "lax"),
    (dict(preferred_element_type=jnp.bfloat16), (jnp.bfloat16,) * 2, "ours"),
    (dict(precision=lax.DotAlgorithmPreset.F32_F32_F32), (jnp.float32,) * 2, "lax"),
    (dict(precision=HIGHEST), (jnp.float32,) * 2, "ours"),  # the reference at HIGHEST on CUDA
    (dict(), (jnp.float64,) * 2, "lax"),
    (dict(), (jnp.int32,) * 2, "lax"),
], ids=["batch_groups", "preferred_f32", "preferred_same", "dot_algorithm", "highest", "f64",
        "int32"])
def test_what_runs_lax(kw, dtypes, path):
  """Calls the kernels take in no form run lax itself, with lax's result."""
  x = np.arange(2 * 4 * 5 * 5).reshape(2, 4, 5, 5) % 7 - 3
  w = np.arange(4 * 4 * 3 * 3).reshape(4, 4, 3, 3) % 5 - 2
  fn = lambda x, w: jax_dnn.conv_general_dilated(x, w, (1, 1), "SAME", **kw)
  with x64() if jnp.float64 in dtypes else contextlib.nullcontext():
    x, w = jnp.asarray(x, dtypes[0]), jnp.asarray(w, dtypes[1])
    found, _ = _prims_in(fn, x, w)
    assert bool(found) == (path == "ours"), found
    want = lax.conv_general_dilated(x, w, (1, 1), "SAME", **kw)
    got = fn(x, w)
    assert got.dtype == want.dtype
    np.testing.assert_allclose(np.asarray(got, np.float64), np.asarray(want, np.float64),
                               rtol=1e-2, atol=1e-2)


def test_fp32_precision_reaches_the_primitives():
  """fp32 at HIGHEST (argument or jax.default_matmul_precision) is the
  primitives' `precision` param: their CUDA lowering then runs the reference."""
  x, w = randn(27, (1, 4, 4, 3), jnp.float32), randn(28, (2, 2, 3, 4), jnp.float32)
  conv = lambda **kw: str(jax.make_jaxpr(lambda x, w: jax_dnn.conv_general_dilated(
      x, w, (1, 1), "SAME", dimension_numbers=_DN[2], **kw))(x, w))
  assert "precision=default" in conv()
  assert "precision=highest" in conv(precision=HIGHEST)
  assert "precision=highest" in conv(precision=(lax.Precision.DEFAULT, HIGHEST))
  with jax.default_matmul_precision("highest"):
    assert "precision=highest" in conv()
  xb, wb = x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
  text = str(jax.make_jaxpr(lambda x, w: jax_dnn.conv_general_dilated(
      x, w, (1, 1), "SAME", dimension_numbers=_DN[2], precision=HIGHEST))(xb, wb))
  assert "precision=default" in text  # bf16 products are exact: no reference needed


# --- deterministic mode ----------------------------------------------------------------------


def test_deterministic_setting_reaches_every_primitive():
  x, w = randn(29, (2, 5, 5, 3), jnp.float32), randn(30, (3, 3, 3, 4), jnp.float32)
  # A new function each time: a traced one keeps the setting it was traced with.
  grad = lambda: jax.grad(lambda x, w: jnp.sum(jax_dnn.conv(x, w) ** 2), (0, 1))
  assert "deterministic=True" not in str(jax.make_jaxpr(grad())(x, w))
  jax_dnn.config.update("deterministic", True)
  try:
    text = str(jax.make_jaxpr(grad())(x, w))
  finally:
    jax_dnn.config.update("deterministic", False)
  assert text.count("deterministic=True") == 3 and "deterministic=False" not in text


@pytest.mark.gpu
@pytest.mark.parametrize("shape,kernel,groups", [((8, 28, 28, 64), (3, 3, 64, 64), 1),
                                                 ((4, 20, 20, 96), (3, 3, 1, 96), 96),
                                                 ((4, 20, 20, 64), (3, 3, 4, 64), 16)],
                         ids=["dense", "depthwise", "grouped"])
def test_deterministic_runs_are_bitwise_equal(gpu, shape, kernel, groups):
  del gpu
  x = randn(31, shape, jnp.bfloat16)
  w = randn(32, kernel, jnp.bfloat16, scale=0.2)
  dy = randn(33, shape[:-1] + (kernel[-1],), jnp.bfloat16)
  jax_dnn.config.update("deterministic", True)
  try:
    vjp = jax.jit(lambda x, w, dy: jax.vjp(functools.partial(jax_dnn.conv, groups=groups),
                                           x, w)[1](dy))
    first, second = vjp(x, w, dy), vjp(x, w, dy)
  finally:
    jax_dnn.config.update("deterministic", False)
  for a, b in zip(first, second):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


# --- the kernels' own paths -----------------------------------------------------------------

# Problems each kernel takes (channels multiples of 8), through jax_dnn.conv:
# (name, x shape, kernel shape [*window, C/groups, K], conv keywords,
#  deterministic, the algorithms fwd / dgrad / wgrad run (None: XLA)).
# Small wgrads run on the implicit GEMM only when deterministic (too few
# output tiles otherwise); the direct depthwise kernels likewise.
KERNEL_CASES = [
    ("2d_3x3", (2, 12, 10, 64), (3, 3, 64, 128), dict(), False,
     ("implicit_gemm_128x128", "implicit_gemm_128x64", None)),
    ("2d_3x3_bias_res_relu_det", (2, 9, 11, 32), (3, 3, 32, 48),
     dict(bias=True, residual=True, activation="relu"), True,
     ("implicit_gemm_128x64", "implicit_gemm_128x64", "implicit_gemm_128x128")),
    ("2d_s2_dilated_det", (2, 17, 15, 16), (3, 3, 16, 32), dict(strides=2, dilation=2,
                                                               padding="VALID"), True,
     ("implicit_gemm_128x64", "strided_dgrad_phases", "implicit_gemm_128x128")),
    ("2d_1x1", (2, 9, 7, 64), (1, 1, 64, 256), dict(bias=True), True,
     ("gemm_1x1", "gemm_1x1", "gemm_1x1")),
    ("1d_k5_det", (2, 50, 32), (5, 32, 64), dict(), True,
     ("implicit_gemm_128x64", "implicit_gemm_128x64", "implicit_gemm_128x128")),
    ("3d_3x3x3_det", (1, 6, 7, 5, 16), (3, 3, 3, 16, 32), dict(residual=True), True,
     ("implicit_gemm_128x128", "implicit_gemm_128x128", "implicit_gemm_128x128")),
    ("2d_depthwise_det", (2, 13, 12, 64), (3, 3, 1, 64), dict(groups=64, bias=True), True,
     ("depthwise_direct", "depthwise_direct", "depthwise_direct")),
    ("2d_depthwise_7x7_s2_det", (2, 15, 14, 40), (7, 7, 1, 40), dict(groups=40, strides=2),
     True, ("depthwise_direct", "depthwise_direct", "depthwise_direct")),
    # The tiled direct kernel's paths: unrolled 3/5/7 windows at W stride 1
    # and 2, the runtime tap loop (dilated), 1D and 3D, tiles past the edges,
    # channel slices of 48 (144 = 3 x 48) and a partial one (88 = 48 + 40).
    ("2d_depthwise_3x3_c144_res_silu_det", (2, 19, 23, 144), (3, 3, 1, 144),
     dict(groups=144, bias=True, residual=True, activation="silu"), True,
     ("depthwise_direct", "depthwise_direct", "depthwise_direct")),
    ("2d_depthwise_5x5_s2_c88_det", (1, 17, 30, 88), (5, 5, 1, 88), dict(groups=88, strides=2),
     True, ("depthwise_direct", "depthwise_direct", "depthwise_direct")),
    ("2d_depthwise_3x3_dilated_det", (2, 12, 9, 32), (3, 3, 1, 32),
     dict(groups=32, dilation=(2, 3), padding=((3, 1), (0, 4))), True,
     ("depthwise_direct", "depthwise_direct", "depthwise_direct")),
    ("1d_depthwise_k7_det", (3, 37, 24), (7, 1, 24), dict(groups=24, bias=True), True,
     ("depthwise_direct", "depthwise_direct", "depthwise_direct")),
    ("3d_depthwise_3x3x3_det", (1, 5, 6, 7, 16), (3, 3, 3, 1, 16), dict(groups=16), True,
     ("depthwise_direct", "depthwise_direct", "depthwise_direct")),
    # grouped_direct: ResNeXt's 4 channels a group, 6 in and 3 out a group
    # (wgrad: XLA), strided (dgrad: grouped phases), 3D (wgrad: XLA).
    ("2d_grouped_c4_det", (2, 13, 12, 64), (3, 3, 4, 64), dict(groups=16, bias=True), True,
     ("grouped_direct", "grouped_direct", "grouped_direct")),
    ("2d_grouped_6to3_res_relu_det", (2, 9, 15, 48), (3, 3, 6, 24),
     dict(groups=8, residual=True, activation="relu"), True,
     ("grouped_direct", "grouped_direct", None)),
    ("2d_grouped_s2_det", (2, 15, 14, 64), (3, 3, 8, 64), dict(groups=8, strides=2), True,
     ("grouped_direct", "strided_dgrad_phases", "grouped_direct")),
    ("3d_grouped_det", (1, 5, 6, 7, 32), (3, 3, 3, 4, 32), dict(groups=8), True,
     ("grouped_direct", "grouped_direct", None)),
]


def _per_axis(v, n):
  return tuple(v) if isinstance(v, (tuple, list)) else (v,) * n


@pytest.mark.parametrize("case", KERNEL_CASES, ids=lambda c: c[0])
def test_kernel_cases_plan_their_algorithms(case):
  """CPU: the registry plans each kernel case's ops on the algorithms listed
  (bf16, an H100's 132 SMs), so the GPU test below runs the kernels it names."""
  if not plans.has_conv_plans():
    pytest.skip("jax_dnn's extension is not built: no conv plans")
  name, x_shape, k_shape, kw, det, algos = case
  kw = dict(kw)
  spec = lambda shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16)
  x, w = spec(x_shape), spec(k_shape)
  bias = spec(k_shape[-1:]) if kw.pop("bias", False) else None
  has_residual = kw.pop("residual", False)
  activation = kw.pop("activation", None)
  residual = spec(jax.eval_shape(lambda x, w: jax_dnn.conv(x, w, **kw), x, w).shape)
  got = jax_dnn.conv_algorithms(x, w, bias, residual=residual if has_residual else None,
                                activation=activation, deterministic=det, sm_count=132, **kw)
  ran = tuple(None if got[op].chosen is None else got[op].chosen.name
              for op in ("fwd", "dgrad", "wgrad"))
  assert ran == algos, (name, ran, [str(got[op]) for op in got])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("case", KERNEL_CASES, ids=lambda c: c[0])
def test_kernels_take_these(gpu, case, dtype):
  """Values and gradients of problems the kernels take, and that they do:
  the plan's choice for each op is the algorithm listed (fp16 has no
  gemm_1x1 or 3D kernels: there the lists name what remains)."""
  name, x_shape, k_shape, kw, det, algos = case
  kw = dict(kw)
  k = k_shape[-1]
  x = randn(50, x_shape, dtype)
  w = randn(51, k_shape, dtype, scale=0.3)
  bias = randn(52, (k,), dtype) if kw.pop("bias", False) else None
  has_residual = kw.pop("residual", False)
  activation = kw.pop("activation", None)
  res_shape = jax.eval_shape(lambda x, w: jax_dnn.conv(x, w, **kw), x, w).shape
  residual = randn(53, res_shape, dtype) if has_residual else None
  got = jax_dnn.conv_algorithms(x, w, bias, residual=residual, activation=activation,
                                deterministic=det, **kw)
  ran = tuple(None if got[op].chosen is None else got[op].chosen.name
              for op in ("fwd", "dgrad", "wgrad"))
  want = algos
  if dtype == jnp.float16 and (name.startswith("3d") or name == "2d_1x1"):
    want = ran  # no fp16 kernel: whatever the plan says, the check below must hold
  assert ran == want, (name, ran, [str(got[op]) for op in got])

  args = [x, w] + [a for a in (bias, residual) if a is not None]

  def optional(extra):  # the given optional operands back in their places
    given = iter(extra)
    return tuple(next(given) if a is not None else None for a in (bias, residual))

  def ours(x, w, *extra):
    b, r = optional(extra)
    return jax_dnn.conv(x, w, b, residual=r, activation=activation, **kw)

  def naive(x, w, *extra):
    b, r = optional(extra)
    n = len(x_shape) - 2
    up = jnp.promote_types(x.dtype, jnp.float32)  # fp32 math; fp64 where check_fwd_bwd asks
    y = lax.conv_general_dilated(
        x.astype(up), w.astype(up), _per_axis(kw.get("strides", 1), n),
        kw.get("padding", "SAME"), rhs_dilation=_per_axis(kw.get("dilation", 1), n),
        dimension_numbers=_DN[n], feature_group_count=kw.get("groups", 1), precision=HIGHEST)
    y = y + (0 if b is None else b.astype(up)) + (0 if r is None else r.astype(up))
    y = {None: lambda v: v, "relu": jax.nn.relu, "silu": jax.nn.silu}[activation](y)
    return y.astype(x.dtype)

  before = jax_dnn.config.deterministic
  jax_dnn.config.update("deterministic", det)
  try:
    reused = check_fwd_bwd(gpu, ours, naive, args, dtype, what=name)
  finally:
    jax_dnn.config.update("deterministic", before)
  assert reused >= 1, "the output did not land in a poisoned buffer"


# --- bad inputs --------------------------------------------------------------------------------


def _lax_error(fn):
  try:
    fn()
  except (ValueError, TypeError, RuntimeError) as e:
    return e
  raise AssertionError("lax accepted it")


@pytest.mark.parametrize("lhs_shape,rhs_shape,kw", [
    ((2, 4, 5, 5), (6, 3, 3, 3), dict()),  # mismatched channels
    ((2, 6, 5, 5), (4, 2, 3, 3), dict(feature_group_count=4)),  # groups do not divide C
    ((2, 6, 5, 5), (5, 2, 3, 3), dict(feature_group_count=3)),  # nor K
    ((2, 4, 5, 5), (6, 4, 3, 3), dict(padding=((-4, -3), (0, 0)))),  # negative beyond the input
    ((2, 4, 5), (6, 4, 3, 3), dict()),  # ranks differ
    ((2, 4, 5, 5), (6, 4, 3, 3), dict(window_strides=(1,))),  # strides of the wrong rank
    ((2, 4, 5, 5), (6, 4, 3, 3), dict(padding="FULL")),
], ids=["channels", "groups_c", "groups_k", "negative_padding", "ranks", "strides", "padding"])
def test_bad_inputs_raise_as_lax(lhs_shape, rhs_shape, kw):
  x, w = jnp.ones(lhs_shape), jnp.ones(rhs_shape)
  kw = dict(dict(window_strides=(1, 1), padding="VALID"), **kw)
  want = _lax_error(lambda: lax.conv_general_dilated(x, w, **kw))
  with pytest.raises(type(want), match=re.escape(str(want).splitlines()[0])):
    jax_dnn.conv_general_dilated(x, w, **kw)


_NHWC = ("NHWC", "HWIO", "NHWC")


@pytest.mark.parametrize("kw,name", [
    (dict(window_strides=(0, 1)), "window_strides"),
    (dict(window_strides=(1, -1)), "window_strides"),
    (dict(rhs_dilation=(-1, 1)), "rhs_dilation"),
    (dict(lhs_dilation=(1, 0)), "lhs_dilation"),
], ids=str)
def test_nonpositive_strides_and_dilations_are_named(kw, name):
  """lax's exception type (its verifier's ValueError for strides, under jit;
  its TypeError for dilations), with a message naming the argument."""
  x, w = randn(1, (1, 5, 5, 2), jnp.float32), randn(2, (3, 3, 2, 4), jnp.float32)
  bad = kw[name]
  kw = dict(dict(window_strides=(1, 1), padding=((1, 1), (1, 1)), dimension_numbers=_NHWC), **kw)
  want = _lax_error(lambda: jax.jit(lambda x, w: lax.conv_general_dilated(x, w, **kw))(x, w))
  with pytest.raises(type(want), match=f"conv_general_dilated: {name} must hold positive ints"):
    jax.jit(lambda x, w: jax_dnn.conv_general_dilated(x, w, **kw))(x, w)
  # conv_transpose's strides (lax's lhs dilation there).
  want = _lax_error(lambda: lax.conv_transpose(x, w, bad, "SAME"))
  with pytest.raises(type(want), match="conv_transpose: strides must hold positive ints"):
    jax_dnn.conv_transpose(x, w, bad, "SAME")


def _lax_fused(x, k, b, strides=1, padding="SAME"):
  return lax.conv_general_dilated(x, k, (strides,) * (x.ndim - 2), padding,
                                  dimension_numbers=_NHWC) + b


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.complex64, "float64", "numpy"],
                         ids=lambda d: jnp.dtype(d).name if d != "numpy" else d)
def test_other_dtypes_run_lax(dtype):
  """conv and matmul take what lax.conv_general_dilated and jnp.matmul take
  (integers, complex, float64 under x64; NumPy float64 as float32 without
  it): their values and dtypes."""
  rng = np.random.default_rng(3)
  shapes = [(2, 6, 5, 3), (3, 3, 3, 4), (4,)]
  with x64() if dtype == "float64" else contextlib.nullcontext():
    if dtype == "numpy":
      x, k, b = (rng.normal(size=s) for s in shapes)
    else:
      x, k, b = (jnp.asarray(rng.integers(-3, 4, s)).astype(dtype) for s in shapes)
      if dtype == jnp.complex64:
        x = x + 1j * x[::-1]
    y = jax_dnn.conv(x, k, b, strides=2, activation="relu" if dtype == jnp.int32 else None)
    want = _lax_fused(jnp.asarray(x), jnp.asarray(k), jnp.asarray(b), 2)
    want = jax.nn.relu(want) if dtype == jnp.int32 else want
    assert y.dtype == want.dtype
    np.testing.assert_allclose(y, want, rtol=1e-6, atol=1e-6)
    xm, wm = np.asarray(x)[..., 0, :], np.asarray(k)[0, 0]  # [2, 6, 3] @ [3, 4]
    y, want = jax_dnn.matmul(xm, wm, b), jnp.matmul(jnp.asarray(xm), jnp.asarray(wm)) + b
    assert y.dtype == want.dtype
    np.testing.assert_allclose(y, want, rtol=1e-6, atol=1e-6)


def test_matmul_of_bools_as_jnp():
  x, w = jnp.asarray([[True, False], [False, False]]), jnp.asarray([[True], [True]])
  y = jax_dnn.matmul(x, w)
  assert y.dtype == jnp.bool_
  np.testing.assert_array_equal(y, jnp.matmul(x, w))


def test_window_past_the_input_gives_no_output():
  """As lax: extent 0 where the window does not fit the padded input."""
  x, k, b = randn(3, (2, 4, 5, 3), jnp.float32), randn(4, (6, 2, 3, 4), jnp.float32), jnp.ones(4)
  y = jax_dnn.conv(x, k, b, padding="VALID")
  assert y.shape == _lax_fused(x, k, b, padding="VALID").shape == (2, 0, 4, 4)
  assert jax.grad(lambda x: jnp.sum(jax_dnn.conv(x, k, b, padding="VALID")))(x).shape == x.shape


@pytest.mark.parametrize("sm_count", [-1, 0, 1.5, True])
def test_conv_algorithms_rejects_a_nonpositive_sm_count(sm_count):
  x = jax.ShapeDtypeStruct((8, 28, 28, 64), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((3, 3, 64, 128), jnp.bfloat16)
  with pytest.raises(ValueError, match="sm_count must be None .* or a positive int"):
    jax_dnn.conv_algorithms(x, k, sm_count=sm_count)


def test_bad_inputs_of_the_fused_form():
  x, k = jnp.ones((2, 5, 5, 4)), jnp.ones((3, 3, 4, 6))
  with pytest.raises(ValueError, match=r"conv: kernel must be \[\*window, C / groups, K\]"):
    jax_dnn.conv(x, jnp.ones((3, 4, 6)))
  with pytest.raises(ValueError, match="conv: x has 4 channels; with groups=2"):
    jax_dnn.conv(x, k, groups=2)
  with pytest.raises(ValueError, match="groups=3 does not divide x's 4 channels"):
    jax_dnn.conv(x, k, groups=3)
  with pytest.raises(ValueError, match="groups=2 does not divide the kernel's 5 output"):
    jax_dnn.conv(x, jnp.ones((3, 3, 2, 5)), groups=2)
  with pytest.raises(ValueError, match=r"conv: x must be \[N, \*spatial, C\]"):
    jax_dnn.conv(jnp.ones((2, 4)), jnp.ones((3, 4)))
  with pytest.raises(ValueError, match=r"conv: bias must have shape \(6,\)"):
    jax_dnn.conv(x, k, jnp.ones(4))
  with pytest.raises(ValueError, match=r"conv: residual must have the output's shape"):
    jax_dnn.conv(x, k, residual=jnp.ones((2, 5, 5, 4)))
  with pytest.raises(ValueError, match="conv: activation must be None or one of"):
    jax_dnn.conv(x, k, activation="swish")
  with pytest.raises(ValueError, match="conv: negative padding"):
    jax_dnn.conv(x, k, padding=((-4, -3), (0, 0)))
  with pytest.raises(TypeError, match="conv: strides must be an int or 2 ints"):
    jax_dnn.conv(x, k, strides=(1, 2, 3))
  with pytest.raises(ValueError, match="conv: dilation must be >= 1"):
    jax_dnn.conv(x, k, dilation=0)
  with pytest.raises(ValueError, match=r"matmul: x must be \[..., K\] with K = w.shape\[0\] = 4"):
    jax_dnn.matmul(jnp.ones((3, 5)), jnp.ones((4, 2)))
  with pytest.raises(ValueError, match=r"matmul: w must be \[K, N\]"):
    jax_dnn.matmul(jnp.ones((3, 4)), jnp.ones((4,)))
  with pytest.raises(ValueError, match="conv_transpose: lhs and rhs must have one rank"):
    jax_dnn.conv_transpose(jnp.ones((2, 4, 4, 3)), jnp.ones((3, 3, 3)), (2, 2), "SAME")


# --- small fp32 gradients, numerically -------------------------------------------------------


@pytest.mark.parametrize("fn,shapes", [
    (lambda x, w: jax_dnn.conv_general_dilated(
        x, w, (1, 1), ((1, 2), (2, 0)), lhs_dilation=(2, 1), rhs_dilation=(1, 2),
        dimension_numbers=_DN[2], feature_group_count=2), ((1, 3, 3, 4), (2, 2, 2, 4))),
    (lambda x, w: jax_dnn.conv_general_dilated(x, w, (2,), "SAME", dimension_numbers=_DN[1]),
     ((2, 7, 3), (3, 3, 2))),
    (lambda x, w: jax_dnn.conv(x, w, strides=(1, 2, 1), activation="tanh"),
     ((1, 3, 4, 3, 2), (2, 2, 2, 2, 3))),
], ids=["lhs_dilated_grouped", "1d_strided", "3d_fused"])
def test_check_grads(fn, shapes):
  args = [randn(34 + i, s, jnp.float32) for i, s in enumerate(shapes)]
  with jax.default_matmul_precision("highest"):
    check_grads(fn, args, order=1, modes=("rev",), atol=1e-2, rtol=1e-2)


# --- plans and the CUDA lowering ---------------------------------------------------------------


def _require_conv_kernels():
  if not jax_dnn.has_cuda_kernels():
    pytest.skip("jax_dnn was built without CUDA kernels: the CUDA lowering is the reference")
  if not plans.has_conv_plans():
    pytest.skip("the extension has no conv_plan (the convolution's algorithm registry)")


def test_cuda_lowering_calls_the_conv_kernels():
  _require_conv_kernels()
  # Large enough that the plan takes the implicit-GEMM wgrad (>= one 128x128
  # output tile an SM: 2048/128 x 9*256/128 = 288 tiles); lowering runs nothing.
  x, w = randn(40, (2, 16, 16, 256), jnp.bfloat16), randn(41, (3, 3, 256, 2048), jnp.bfloat16)
  b, r = randn(42, (2048,), jnp.bfloat16), randn(43, (2, 16, 16, 2048), jnp.bfloat16)
  fn = lambda x, w, b, r: jax_dnn.conv(x, w, b, residual=r, activation="relu")
  loss = lambda *a: jnp.sum(fn(*a).astype(jnp.float32))
  text = cuda_hlo(jax.grad(loss, (0, 1, 2, 3)), x, w, b, r)
  for target in _PRIMS:
    assert f"custom_call @{target}(" in text, target
  # A transposed convolution at stride 1 is a forward convolution with the
  # window flipped (lhs dilation 1): the forward kernel. (Strided ones:
  # test_strided_dgrad_cuda_lowering.)
  xt = randn(44, (2, 8, 8, 256), jnp.bfloat16)
  text = cuda_hlo(lambda x, w: jax_dnn.conv_transpose(x, w, (1, 1), "SAME",
                                                      dimension_numbers=_DN[2]), xt, w)
  assert "custom_call @jax_dnn_conv_fwd(" in text
  # fp32 at HIGHEST: exact fp32 through the reference.
  text = cuda_hlo(lambda x, w: jax_dnn.conv_general_dilated(
      x, w, (1, 1), "SAME", dimension_numbers=_DN[2], precision=HIGHEST),
                  x.astype(jnp.float32), w.astype(jnp.float32))
  assert "jax_dnn_conv" not in text

  # jax.export (the handlers are not covered by its compatibility checks).
  exported = jax.export.export(jax.jit(jax.grad(loss, (0, 1, 2, 3))), platforms=("cuda",),
                               disabled_checks=jax_dnn.export_disabled_checks())(x, w, b, r)
  for target in _PRIMS:
    assert f"custom_call @{target}(" in exported.mlir_module(), target


def test_conv_algorithms():
  x = jax.ShapeDtypeStruct((8, 28, 28, 64), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((3, 3, 64, 128), jnp.bfloat16)
  if not plans.has_conv_plans():
    with pytest.raises(RuntimeError, match="no convolution plans"):
      jax_dnn.conv_algorithms(x, k)
    pytest.skip("the extension has no conv_plan (the convolution's algorithm registry)")
  result = jax_dnn.conv_algorithms(x, k, activation="relu", sm_count=132)
  assert set(result) == {"fwd", "dgrad", "wgrad"}
  for op, choice in result.items():
    assert choice.problem["op"] == op and choice.problem["k"] == 128
    assert choice.algorithms and all(a.supported or a.reason for a in choice.algorithms)
    if choice.chosen is not None:
      assert choice.chosen.name in [a.name for a in choice.algorithms if a.supported]
    assert op in str(choice)
  assert result["fwd"].problem["activation"] == 0
  det = jax_dnn.conv_algorithms(x, k, deterministic=True, sm_count=132)
  for choice in det.values():
    assert choice.chosen is None or choice.chosen.deterministic


def test_plan_key_of_each_primitive():
  """The problems the plans are asked about, from the primitives' operands."""
  x, w = randn(45, (2, 7, 9, 6), jnp.float32), randn(46, (3, 3, 3, 8), jnp.float32)
  text = str(jax.make_jaxpr(jax.grad(lambda x, w: jnp.sum(jax_dnn.conv(
      x, w, strides=(2, 1), groups=2)), (0, 1)))(x, w))
  assert text.count("k_per_group=4") == 3
  params = dict(k_per_group=4, rank=2, stride=(1, 2, 1), dilation=(1, 1, 1), pad_lo=(0, 1, 1),
                pad_hi=(0, 1, 1), deterministic=False, precision="default")
  s = lambda *shape: jax.core.ShapedArray(shape, jnp.bfloat16)
  fwd = conv_primitives.plan_key("fwd", [s(2, 1, 7, 9, 6), s(8, 1, 3, 3, 3), s(8), s(0)],
                                 dict(params, activation=0))
  shapes = dict(dtype="bfloat16", n=2, c=6, k=8, groups=2, input=(1, 7, 9), window=(1, 3, 3),
                output=(1, 4, 9), stride=(1, 2, 1), dilation=(1, 1, 1), pad_lo=(0, 1, 1),
                pad_hi=(0, 1, 1), rank=2)
  assert fwd == conv_primitives.ConvKey(op="fwd", activation=0, bias=True, residual=False,
                                        **shapes)
  dgrad = conv_primitives.plan_key("dgrad", [s(2, 1, 4, 9, 8), s(8, 1, 3, 3, 3)],
                                   dict(params, input=(1, 7, 9)))
  assert dgrad == conv_primitives.ConvKey(op="dgrad", **shapes)
  wgrad = conv_primitives.plan_key("wgrad", [s(2, 1, 7, 9, 6), s(2, 1, 4, 9, 8)],
                                   dict(params, window=(1, 3, 3)))
  assert wgrad == conv_primitives.ConvKey(op="wgrad", **shapes)


# --- the CUDA lowering's use of the plans, against a stand-in registry -------------------------


@dataclasses.dataclass(frozen=True)
class _Algorithm:
  """The extension's ConvAlgorithm's attributes."""
  id: int
  name: str
  supported: bool
  reason: str = ""
  workspace_bytes: int = 0
  deterministic: bool = True


def _stand_in_plan(problem, deterministic=False, device=None):
  """Takes one group only and fuses every activation but sigmoid; wgrad asks
  128 bytes of workspace."""
  del device
  if problem["groups"] > 1:
    return _Algorithm(-1, "", False, "groups > 1")
  if problem["activation"] == 4:
    return _Algorithm(-1, "", False, "sigmoid is not fused")
  op = ("fwd", "dgrad", "wgrad").index(problem["op"])
  return _Algorithm(3 + op, f"gemm_{problem['op']}", True,
                    workspace_bytes=128 if op == 2 else 0, deterministic=deterministic)


@pytest.fixture
def stand_in_registry(monkeypatch):
  """The extension's plan functions and registered targets replaced by a
  stand-in: the lowering's glue (supported, workspace, attributes) is
  checked on any build. The real registry: test_cuda_lowering_calls_the_conv_kernels."""
  monkeypatch.setattr(plans, "has_conv_plans", lambda: True)
  monkeypatch.setattr(plans, "conv_problem", lambda **kw: kw)
  monkeypatch.setattr(plans, "conv_plan", _stand_in_plan)
  monkeypatch.setattr(plans, "conv_algorithms", lambda problem, device=None: [
      _stand_in_plan(problem), _Algorithm(9, "direct_depthwise", False, "groups != channels")])
  monkeypatch.setattr(extension, "registered_targets", lambda: frozenset(_PRIMS))
  conv_primitives._plan.cache_clear()  # pylint: disable=protected-access
  yield
  conv_primitives._plan.cache_clear()  # pylint: disable=protected-access


def _calls(text, target):
  return [l for l in text.splitlines() if f"custom_call @{target}(" in l]


def test_lowering_glue_with_a_stand_in_registry(stand_in_registry):
  del stand_in_registry
  # Shapes of this test alone: JAX caches lowerings.
  x, w = randn(50, (3, 11, 13, 5), jnp.bfloat16), randn(51, (3, 2, 5, 7), jnp.bfloat16)
  b = randn(52, (7,), jnp.bfloat16)
  fn = lambda x, w, b: jax_dnn.conv(x, w, b, strides=(2, 1), activation="relu")
  text = cuda_hlo(jax.grad(lambda *a: jnp.sum(fn(*a).astype(jnp.float32)), (0, 1, 2)), x, w, b)
  (fwd,), (dgrad,), (wgrad,) = (_calls(text, t) for t in _PRIMS)
  for call, algo in ((fwd, 3), (dgrad, 4), (wgrad, 5)):
    assert f"algo = {algo} : i64" in call and "groups = 1 : i64" in call, call
    assert "rank = 2 : i64" in call and "stride = dense<[1, 2, 1]> : tensor<3xi64>" in call, call
    assert "deterministic" not in call and "precision" not in call, call
  assert "activation = 0 : i64" in fwd and "pad_lo = dense<[0, 1, 0]> : tensor<3xi64>" in fwd, fwd
  assert "tensor<0xui8>" in fwd and "tensor<128xui8>" in wgrad  # the workspace results
  # Two groups: the stand-in takes none, so the reference runs.
  text = cuda_hlo(lambda x, w: jax_dnn.conv(x, w, groups=5), x, randn(53, (3, 2, 1, 10),
                                                                      jnp.bfloat16))
  assert "jax_dnn_conv" not in text and "stablehlo.convolution" in text
  # fp32 at HIGHEST: the reference; at the default precision: the kernels (TF32).
  xf, wf = x.astype(jnp.float32), w.astype(jnp.float32)
  call = lambda **kw: cuda_hlo(lambda x, w: jax_dnn.conv_general_dilated(
      x, w, (1, 1), "SAME", dimension_numbers=_DN[2], **kw), xf, wf)
  assert not _calls(call(precision=HIGHEST), "jax_dnn_conv_fwd")
  assert _calls(call(), "jax_dnn_conv_fwd")


def test_an_activation_the_kernel_does_not_fuse(stand_in_registry):
  """The stand-in fuses no sigmoid: the kernel runs without it and jax_dnn's
  activation op follows (not the reference for the whole op)."""
  del stand_in_registry
  x, w = randn(54, (2, 7, 5, 3), jnp.bfloat16), randn(55, (3, 3, 3, 5), jnp.bfloat16)
  for act, fused in (("sigmoid", False), ("tanh", True)):
    fn = functools.partial(jax_dnn.conv, activation=act)
    text = str(jax.make_jaxpr(fn)(x, w))
    fwd = re.search(r"jax_dnn_conv_fwd\[\s*activation=(-?\d+)", text)
    assert (int(fwd.group(1)) >= 0) == fused and ("jax_dnn_activation_fwd" in text) != fused
    text = cuda_hlo(jax.grad(lambda x, w, fn=fn: jnp.sum(fn(x, w).astype(jnp.float32)), (0, 1)),
                    x, w)
    assert all(_calls(text, t) for t in _PRIMS), act
    np.testing.assert_allclose(np.asarray(jax.jit(fn)(x, w), np.float32),
                               np.asarray(_composed(x, w, activation=act), np.float32),
                               rtol=2e-2, atol=2e-2)


def test_conv_algorithms_report(stand_in_registry):
  del stand_in_registry
  x = jax.ShapeDtypeStruct((4, 9, 10, 6), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((3, 3, 6, 8), jnp.bfloat16)
  result = jax_dnn.conv_algorithms(x, k, jax.ShapeDtypeStruct((8,), jnp.bfloat16),
                                   activation="silu", strides=2, deterministic=True)
  assert [result[op].chosen.name for op in ("fwd", "dgrad", "wgrad")] == [
      "gemm_fwd", "gemm_dgrad", "gemm_wgrad"]
  fwd = result["fwd"].problem
  assert (fwd["n"], fwd["c"], fwd["k"], fwd["input"], fwd["output"], fwd["stride"]) == (
      4, 6, 8, (1, 9, 10), (1, 5, 5), (1, 2, 2))
  assert fwd["activation"] == 3 and fwd["bias"] and not fwd["residual"]
  assert result["wgrad"].chosen.workspace_bytes == 128 and result["wgrad"].chosen.deterministic
  text = str(result["dgrad"])
  assert "runs gemm_dgrad" in text and "- direct_depthwise: groups != channels" in text
  grouped = jax_dnn.conv_algorithms(x, jax.ShapeDtypeStruct((3, 3, 3, 8), jnp.bfloat16),
                                    groups=2)
  assert grouped["fwd"].chosen is None and "runs the reference" in str(grouped["fwd"])


def test_flax_conv_takes_it():
  """flax.nnx.Conv(..., conv_general_dilated=jax_dnn.conv_general_dilated):
  Flax passes ConvDimensionNumbers, precision and preferred_element_type."""
  from flax import nnx  # pylint: disable=g-import-not-at-top
  x = randn(60, (2, 9, 8, 6), jnp.float32)
  for kw in (dict(strides=2, padding="SAME"), dict(feature_group_count=2, kernel_dilation=2),
             dict(input_dilation=2, padding=((1, 2), (2, 1)))):
    ours = nnx.Conv(6, 4, (3, 3), conv_general_dilated=jax_dnn.conv_general_dilated,
                    rngs=nnx.Rngs(0), **kw)
    theirs = nnx.Conv(6, 4, (3, 3), rngs=nnx.Rngs(0), **kw)
    with jax.default_matmul_precision("highest"):
      np.testing.assert_allclose(ours(x), theirs(x), rtol=1e-5, atol=1e-5, err_msg=str(kw))
