"""Convolutions: the public ops.

  conv_general_dilated, conv_transpose: drop-ins for jax.lax's (same
    arguments, defaults, layouts, errors and results).
  conv: the fused form act(conv(x, kernel) + bias + residual), channels last
    with Flax's kernel layout [*window, C/groups, K].
  matmul: act(x @ w + bias), a 1x1 convolution on the same kernels.
  conv_algorithms: which algorithm forward, dgrad and wgrad run for a
    problem, and why the others do not (in benchmark mode, the times).

Each brings its operands to the primitives' layout (conv_primitives.py:
x [N, D, H, W, C], w [K, T, R, S, C/G]): transposes where the dimension
numbers differ (channels-last inputs transpose only the kernel), extent-1
axes in front of 1D and 2D problems, negative padding cropped from x.

What the kernels take in no form runs lax.conv_general_dilated itself:
batch_group_count > 1, preferred_element_type other than the operands'
dtype, a given out_sharding, operands of two dtypes or of a dtype other than fp32/bf16/fp16, a
precision given as a dot algorithm, spatial ranks other than 1-3, empty
operands or results, lhs dilation with window strides. fp32 at HIGHEST
precision (the argument, or jax.default_matmul_precision) goes through the
primitives, whose CUDA lowering then runs the reference: exact fp32, where
the kernels' TF32 would not be.

lhs dilation (the transposed convolution) runs the data-gradient kernel, not
a forward over inserted zeros. Per spatial axis, with lhs dilation L, window
k, rhs dilation d and padding (lo, hi) (window stride 1), the forward sums
    y[o] = sum_{i, r: L i = o - lo + d r} x[i] w[r],
and the data gradient of a convolution F' with stride L, dilation d,
padding (lo', hi') and kernel w'[r'] = w[k - 1 - r'] (window flipped, input
and output channels swapped within each group) sums
    dx[o] = sum_{i, r': o = L i - lo' + d r'} dy[i] w'[r'],
the same terms for lo' = d (k - 1) - lo; hi' = d (k - 1) - hi makes F' map
the O outputs back onto exactly the I inputs. A negative lo' (hi') is F'
cropping its input: its transpose leaves those outputs zero, so the kernel
runs with padding 0 on the O - |lo'| others and the result is zero-padded.
With L > 1 that data gradient is strided: it runs as prod(L) stride-1
forward convolutions, one per phase (residue of the output index modulo
L), interleaved (conv_phases.dgrad), as do the data gradients of
strided convolutions.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from jax_dnn._src import activation as activation_lib
from jax_dnn._src import checks
from jax_dnn._src.conv import primitives as prims
from jax_dnn._src.conv import phases as conv_phases
from jax_dnn._src.conv import vjp as conv_vjp
from jax_dnn._src.conv import tuning as conv_tuning
from jax_dnn._src import plans
from jax_dnn._src.config import config


def _is_int(v) -> bool:
  return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def _check_positive(op, name, values, error):
  """A stride or dilation entry < 1, named, as `error` (the type lax raises
  for it, where its own message does not name the argument or comes from
  the MLIR verifier); other mistakes are left to lax's checks."""
  try:
    bad = any(_is_int(v) and v < 1 for v in values)
  except TypeError:  # None or not a sequence
    return
  if bad:
    raise error(f"{op}: {name} must hold positive ints (one a spatial axis); "
                f"got {tuple(values)!r}")


def _has_zero(shape) -> bool:
  return any(_is_int(d) and d == 0 for d in shape)


def _pad3(values, fill) -> tuple[int, ...]:
  return (fill,) * (3 - len(values)) + tuple(int(v) for v in values)


def _to3(a, nsp):
  """[N, *spatial, C] -> [N, D, H, W, C]: extent-1 axes in front."""
  return lax.expand_dims(a, tuple(range(1, 4 - nsp))) if nsp < 3 else a


def _from3(a, nsp):
  return lax.squeeze(a, tuple(range(1, 4 - nsp))) if nsp < 3 else a


def _transpose(a, perm):
  return a if tuple(perm) == tuple(range(a.ndim)) else jnp.transpose(a, perm)


def _k_per_group(k, groups) -> int:
  """The primitives' k_per_group param (conv_primitives.py): K/G, 0 for one group."""
  return 0 if groups == 1 else k // groups


def _params(*, k_per_group, nsp, stride, dilation, pad_lo, pad_hi, precision):
  return dict(k_per_group=int(k_per_group), rank=nsp, stride=_pad3(stride, 1),
              dilation=_pad3(dilation, 1), pad_lo=_pad3(pad_lo, 0), pad_hi=_pad3(pad_hi, 0),
              deterministic=bool(config.deterministic), benchmark=bool(config.benchmark),
              precision=precision)


def _crop(x, pads):
  """x [N, *spatial, C] with negative padding taken off its spatial axes;
  returns it and the padding left (>= 0)."""
  index = [slice(None)] * x.ndim
  for i, (lo, hi) in enumerate(pads):
    index[1 + i] = slice(max(-lo, 0), hi if hi < 0 else None)
  if any(lo < 0 or hi < 0 for lo, hi in pads):
    x = x[tuple(index)]
  return x, [(max(lo, 0), max(hi, 0)) for lo, hi in pads]


def _empty(dtype):
  return jnp.zeros((0,), dtype)


# --- the canonical problem: x [N, *spatial, C], w [K, *window, C/G] ----------------


def _forward(x, w, pads, strides, rhs_dil, groups, precision, bias=None, residual=None,
             activation=activation_lib.NO_ACTIVATION):
  nsp = x.ndim - 2
  x, pads = _crop(x, pads)
  params = _params(k_per_group=_k_per_group(w.shape[0], groups), nsp=nsp, stride=strides,
                   dilation=rhs_dil,
                   pad_lo=[p[0] for p in pads], pad_hi=[p[1] for p in pads], precision=precision)
  bias = _empty(x.dtype) if bias is None else bias
  residual = _empty(x.dtype) if residual is None else _to3(residual, nsp)
  y = conv_vjp.conv(_to3(x, nsp), _to3(w, nsp), bias, residual, activation=activation, **params)
  return _from3(y, nsp)


def _transposed_pads(w_window, pads, lhs_dil, rhs_dil, out_spatial):
  """The data gradient's padding (lo', hi' >= 0), the zeros cropped from
  each side of its result, and its result's extents (see the header)."""
  lo_, hi_, crops, extent = [], [], [], []
  for k, (lo, hi), d, o in zip(w_window, pads, rhs_dil, out_spatial):
    plo, phi = d * (k - 1) - lo, d * (k - 1) - hi
    crops.append((max(-plo, 0), max(-phi, 0)))
    lo_.append(max(plo, 0))
    hi_.append(max(phi, 0))
    extent.append(o - crops[-1][0] - crops[-1][1])
  return lo_, hi_, crops, extent


def _transposed(x, w, pads, lhs_dil, rhs_dil, groups, precision, out_spatial):
  """The lhs-dilated forward as the data gradient of F' (see the header)."""
  nsp = x.ndim - 2
  k, window, cg = w.shape[0], tuple(w.shape[1:-1]), w.shape[-1]
  # w [K, *window, C/G] -> w' [C, *window, K/G]: within each group, input
  # and output channels swap; the window is flipped.
  wt = w.reshape((groups, k // groups) + window + (cg,))
  wt = jnp.transpose(wt, (0, nsp + 2) + tuple(range(2, nsp + 2)) + (1,))
  wt = lax.rev(wt.reshape((groups * cg,) + window + (k // groups,)), tuple(range(1, nsp + 1)))
  lo, hi, crops, extent = _transposed_pads(window, pads, lhs_dil, rhs_dil, out_spatial)
  params = _params(k_per_group=_k_per_group(groups * cg, groups), nsp=nsp, stride=lhs_dil,
                   dilation=rhs_dil, pad_lo=lo, pad_hi=hi,
                   precision=precision)
  y = _from3(conv_vjp.conv_dgrad(_to3(x, nsp), _to3(wt, nsp), input=_pad3(extent, 1), **params), nsp)
  if any(c != (0, 0) for c in crops):
    y = jnp.pad(y, [(0, 0)] + crops + [(0, 0)])
  return y


# --- conv_general_dilated ----------------------------------------------------------------

_OP = "conv_general_dilated"


def _lax_only(lhs, rhs, out, *, nsp, precision, preferred_element_type, batch_group_count,
              lhs_dil, strides, pads, window, rhs_dil, out_spatial) -> str | None:
  """Why the kernels cannot take this call in any form (None: they can)."""
  if jnp.dtype(lhs.dtype) != jnp.dtype(rhs.dtype):
    return "operands of two dtypes"
  if not checks.kernel_dtype(lhs.dtype):
    return f"dtype {lhs.dtype}"
  if preferred_element_type is not None and jnp.dtype(preferred_element_type) != lhs.dtype:
    return "preferred_element_type other than the operands' dtype"
  if precision is None:
    return "a dot-algorithm precision"
  if batch_group_count != 1:
    return "batch_group_count > 1"
  if not 1 <= nsp <= 3:
    return f"{nsp} spatial dimensions"
  if _has_zero(lhs.shape) or _has_zero(rhs.shape) or _has_zero(out.shape):
    return "empty operands or result"
  if any(d != 1 for d in lhs_dil):
    if any(s != 1 for s in strides):
      return "lhs dilation with window strides"
    if any(e < 1 for e in _transposed_pads(window, pads, lhs_dil, rhs_dil, out_spatial)[3]):
      return "padding that leaves no output the window reaches"
  return None


def conv_general_dilated(lhs, rhs, window_strides, padding, lhs_dilation=None, rhs_dilation=None,
                         dimension_numbers=None, feature_group_count=1, batch_group_count=1,
                         precision=None, preferred_element_type=None,
                         out_sharding=None) -> jax.Array:
  """jax.lax.conv_general_dilated on jax_dnn's kernels: the same arguments,
  defaults, layouts, errors and results (see its documentation). A given
  out_sharding runs lax's (the op's result is split as its sharding rule
  says: the batch, and output channels with the kernel).

  Channels-last layouts (e.g. ("NHWC", "HWIO", "NHWC")) transpose only the
  kernel; others are transposed around the kernels. lhs_dilation > 1 (a
  transposed convolution) runs the data-gradient kernel. Gradients with
  respect to lhs and rhs run the dgrad and wgrad kernels. Calls the kernels
  take in no form (module docstring) run lax's.
  """
  checks.check_array(_OP, "lhs", lhs)
  checks.check_array(_OP, "rhs", rhs)
  lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
  _check_positive(_OP, "window_strides", window_strides, ValueError)
  _check_positive(_OP, "lhs_dilation", lhs_dilation, TypeError)
  _check_positive(_OP, "rhs_dilation", rhs_dilation, TypeError)
  call = functools.partial(
      lax.conv_general_dilated, window_strides=window_strides, padding=padding,
      lhs_dilation=lhs_dilation, rhs_dilation=rhs_dilation, dimension_numbers=dimension_numbers,
      feature_group_count=feature_group_count, batch_group_count=batch_group_count,
      precision=precision, preferred_element_type=preferred_element_type,
      **({} if out_sharding is None else dict(out_sharding=out_sharding)))
  # lax's own argument checks (and errors), and the result's shape.
  out = jax.eval_shape(call, jax.ShapeDtypeStruct(lhs.shape, lhs.dtype),
                       jax.ShapeDtypeStruct(rhs.shape, rhs.dtype))
  nsp = lhs.ndim - 2
  dn = lax.conv_dimension_numbers(lhs.shape, rhs.shape, dimension_numbers)
  lhs_perm = (dn.lhs_spec[0], *dn.lhs_spec[2:], dn.lhs_spec[1])
  rhs_perm = (dn.rhs_spec[0], *dn.rhs_spec[2:], dn.rhs_spec[1])
  window = [rhs.shape[i] for i in dn.rhs_spec[2:]]
  strides = tuple(int(s) for s in window_strides)
  lhs_dil = tuple(lhs_dilation) if lhs_dilation is not None else (1,) * nsp
  rhs_dil = tuple(rhs_dilation) if rhs_dilation is not None else (1,) * nsp
  if isinstance(padding, str):
    eff = [(k - 1) * d + 1 for k, d in zip(window, rhs_dil)]
    pads = lax.padtype_to_pads([lhs.shape[i] for i in dn.lhs_spec[2:]], eff, strides, padding)
  else:
    pads = [(int(lo), int(hi)) for lo, hi in padding]
  pads = [(int(lo), int(hi)) for lo, hi in pads]
  out_spatial = [out.shape[i] for i in dn.out_spec[2:]]
  prec = checks.matmul_precision(precision, lhs.dtype)
  if out_sharding is not None or _lax_only(lhs, rhs, out, nsp=nsp, precision=prec,
               preferred_element_type=preferred_element_type,
               batch_group_count=batch_group_count, lhs_dil=lhs_dil, strides=strides,
               pads=pads, window=window, rhs_dil=rhs_dil, out_spatial=out_spatial):
    return call(lhs, rhs)
  x, w = _transpose(lhs, lhs_perm), _transpose(rhs, rhs_perm)
  if any(d != 1 for d in lhs_dil):
    y = _transposed(x, w, pads, lhs_dil, rhs_dil, feature_group_count, prec, out_spatial)
  else:
    y = _forward(x, w, pads, strides, rhs_dil, feature_group_count, prec)
  # y [N, *spatial, K] -> the output's layout (out_spec: batch, feature, spatial...).
  canonical = (0, nsp + 1) + tuple(range(1, nsp + 1))
  perm = [0] * y.ndim
  for j, d in enumerate(dn.out_spec):
    perm[d] = canonical[j]
  return _transpose(y, perm)


# --- conv_transpose ------------------------------------------------------------------------


def _conv_transpose_padding(k, s, padding):
  """Before and after padding of one axis of a transposed convolution
  (lax.conv_transpose's rule)."""
  if padding == "SAME":
    pad_len = k + s - 2
    pad_a = k - 1 if s > k - 1 else int(np.ceil(pad_len / 2))
  elif padding == "VALID":
    pad_len = k + s - 2 + max(k - s, 0)
    pad_a = k - 1
  elif isinstance(padding, tuple):
    pads = tuple(k - p - 1 for p in padding)
    pad_a, pad_len = pads[0], sum(pads)
  else:
    raise ValueError(f"Invalid padding mode: {padding}")
  return pad_a, pad_len - pad_a


def conv_transpose(lhs, rhs, strides, padding, rhs_dilation=None, dimension_numbers=None,
                   transpose_kernel=False, precision=None, preferred_element_type=None,
                   use_consistent_padding=False) -> jax.Array:
  """jax.lax.conv_transpose on jax_dnn's kernels: the same arguments,
  defaults (TensorFlow's layouts, e.g. ("NHWC", "HWIO", "NHWC")) and
  results. Runs the data-gradient kernel (a strided convolution's
  transpose: at strides > 1 one stride-1 forward convolution per phase of
  the output, conv_phases.dgrad), never a forward over inserted zeros."""
  op = "conv_transpose"
  checks.check_array(op, "lhs", lhs)
  checks.check_array(op, "rhs", rhs)
  lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
  if lhs.ndim != rhs.ndim or lhs.ndim < 2:
    raise ValueError(f"{op}: lhs and rhs must have one rank >= 2; got shapes {tuple(lhs.shape)} "
                     f"and {tuple(rhs.shape)}")
  ndims = lhs.ndim
  # strides become lax's lhs dilation: lax's error would name dilations.
  _check_positive(op, "strides", strides, TypeError)
  _check_positive(op, "rhs_dilation", rhs_dilation, TypeError)
  if dimension_numbers is None:
    defaults = {2: ("NC", "IO", "NC"), 3: ("NHC", "HIO", "NHC"), 4: ("NHWC", "HWIO", "NHWC"),
                5: ("NHWDC", "HWDIO", "NHWDC")}
    if ndims not in defaults:
      raise ValueError("No 4+ dimensional dimension_number defaults.")
    dimension_numbers = defaults[ndims]
  dn = lax.conv_dimension_numbers(lhs.shape, rhs.shape, dimension_numbers)
  k_sdims = [rhs.shape[i] for i in dn.rhs_spec[2:]]
  if rhs_dilation is None:
    rhs_dilation = (1,) * (ndims - 2)
  if use_consistent_padding or (isinstance(padding, str) and padding in {"SAME", "VALID"}):
    eff = [(k - 1) * d + 1 for k, d in zip(k_sdims, rhs_dilation)]
    replicated = [padding] * len(strides) if isinstance(padding, str) else padding
    pads = tuple(_conv_transpose_padding(k, s, p) for k, s, p in zip(eff, strides, replicated))
  else:
    pads = padding
  if transpose_kernel:  # flip the window, swap the kernel's input and output channel axes
    rhs = jnp.flip(rhs, tuple(dn.rhs_spec[2:]))
    rhs = jnp.swapaxes(rhs, dn.rhs_spec[0], dn.rhs_spec[1])
  return conv_general_dilated(lhs, rhs, (1,) * (ndims - 2), pads, strides, rhs_dilation, dn,
                              precision=precision, preferred_element_type=preferred_element_type)


# --- conv: the fused form --------------------------------------------------------------------


def _spatial_arg(op, name, value, nsp) -> tuple[int, ...]:
  values = (value,) * nsp if _is_int(value) else tuple(value) if isinstance(
      value, (tuple, list)) else None
  if values is None or len(values) != nsp or not all(_is_int(v) for v in values):
    raise TypeError(f"{op}: {name} must be an int or {nsp} ints (one per spatial axis); "
                    f"got {value!r}")
  if any(v < 1 for v in values):
    raise ValueError(f"{op}: {name} must be >= 1; got {value!r}")
  return tuple(int(v) for v in values)


def _padding_arg(op, padding, spatial, eff, strides):
  if isinstance(padding, str):
    if padding.upper() not in ("SAME", "VALID", "SAME_LOWER"):
      raise ValueError(f"{op}: padding must be 'SAME', 'VALID', 'SAME_LOWER', an int or "
                       f"(low, high) pairs; got {padding!r}")
    return [tuple(p) for p in lax.padtype_to_pads(spatial, eff, strides, padding)]
  if _is_int(padding):
    return [(int(padding), int(padding))] * len(spatial)
  try:
    pads = [(p, p) if _is_int(p) else tuple(p) for p in padding]
    ok = len(pads) == len(spatial) and all(len(p) == 2 and all(map(_is_int, p)) for p in pads)
  except TypeError:
    ok = False
  if not ok:
    raise TypeError(f"{op}: padding must be 'SAME', 'VALID', an int, or one int or (low, high) "
                    f"pair per spatial axis ({len(spatial)}); got {padding!r}")
  for size, (lo, hi) in zip(spatial, pads):
    if size + lo + hi < 0:
      raise ValueError(f"{op}: negative padding {padding!r} is larger than the input's spatial "
                       f"extents {tuple(spatial)}")
  return [(int(lo), int(hi)) for lo, hi in pads]


def _operands(op, *named):
  """The operands as jax arrays (None stays None) and their promoted dtype."""
  for name, a in named:
    if a is not None:
      checks.check_array(op, name, a)
  arrays = [None if a is None else jnp.asarray(a) for _, a in named]
  return arrays, jnp.result_type(*[a for a in arrays if a is not None])


def _check_bias(op, bias, width, what):
  if tuple(bias.shape) != (width,):
    raise ValueError(f"{op}: bias must have shape ({width},) to match {what}; got "
                     f"{tuple(bias.shape)}")


def _lax_conv(x, kernel, bias, residual, activation, strides, pads, dilation, groups):
  """conv where the kernels take no form of it (dtypes other than
  fp32/bf16/fp16, empty operands or result): lax's convolution, then the
  bias, residual and activation, in the operands' promoted dtype."""
  sp = "DHW"[3 - (x.ndim - 2):]
  y = lax.conv_general_dilated(x, kernel, strides, pads, rhs_dilation=dilation,
                               dimension_numbers=(f"N{sp}C", f"{sp}IO", f"N{sp}C"),
                               feature_group_count=groups)
  if bias is not None:
    y = y + bias
  if residual is not None:
    y = y + residual
  return activation_lib.apply(y, activation)


def conv(x, kernel, bias=None, *, residual=None, activation=None, strides=1, padding="SAME",
         dilation=1, groups=1) -> jax.Array:
  """act(conv(x, kernel) + bias + residual) in one kernel call (an
  activation the kernels' plan does not fuse runs as jax_dnn's activation op
  after the kernel).

  Args:
    x: [N, *spatial, C], 1 to 3 spatial axes. Operands of other dtypes
      than float32, bfloat16 and float16 (integers, complex, float64) run
      lax's convolution.
    kernel: [*window, C / groups, K] (flax.nnx.Conv's layout).
    bias: [K], or None.
    residual: an array of the output's shape [N, *out_spatial, K], or None.
    activation: None or one of bias_act's ("relu", "gelu", "gelu_tanh",
      "silu", "sigmoid", "tanh").
    strides, dilation: an int or one per spatial axis (dilation: the
      kernel's).
    padding: "SAME", "VALID", "SAME_LOWER", an int, or one int or (low, high)
      pair per spatial axis (negative crops the input).
    groups: feature groups; divides C and K (groups = C: depthwise).
  Operands are promoted to one dtype (x's, kernel's, bias's and
  residual's); the result has it. Gradients flow to every operand: the
  backward forms g = dy * act'(.) once and runs the dgrad and wgrad kernels
  on it (dbias = sum g, dresidual = g).
  """
  op = "conv"
  (x, kernel, bias, residual), dtype = _operands(op, ("x", x), ("kernel", kernel),
                                                 ("bias", bias), ("residual", residual))
  if not 3 <= x.ndim <= 5:
    raise ValueError(f"{op}: x must be [N, *spatial, C] with 1 to 3 spatial axes; got shape "
                     f"{tuple(x.shape)}")
  nsp = x.ndim - 2
  if kernel.ndim != x.ndim:
    raise ValueError(f"{op}: kernel must be [*window, C / groups, K] of rank {x.ndim} (x's); got "
                     f"shape {tuple(kernel.shape)}")
  if not _is_int(groups) or groups < 1:
    raise ValueError(f"{op}: groups must be a positive int; got {groups!r}")
  c, cg, k = x.shape[-1], kernel.shape[-2], kernel.shape[-1]
  if c % groups or cg * groups != c:
    raise ValueError(f"{op}: x has {c} channels; with groups={groups} the kernel's input "
                     f"channels (kernel.shape[-2]) must be {c} / {groups}; got kernel shape "
                     f"{tuple(kernel.shape)}" if c % groups == 0 else
                     f"{op}: groups={groups} does not divide x's {c} channels")
  if k % groups:
    raise ValueError(f"{op}: groups={groups} does not divide the kernel's {k} output channels")
  strides = _spatial_arg(op, "strides", strides, nsp)
  dilation = _spatial_arg(op, "dilation", dilation, nsp)
  window = tuple(kernel.shape[:nsp])
  eff = [(w - 1) * d + 1 for w, d in zip(window, dilation)]
  pads = _padding_arg(op, padding, x.shape[1:-1], eff, strides)
  # A window past the padded input leaves no output (lax's extent 0).
  out_spatial = tuple(max(0, prims.output_extent(s, e, st, 1, lo, hi)) for s, e, st, (lo, hi)
                      in zip(x.shape[1:-1], eff, strides, pads))
  out_shape = (x.shape[0], *out_spatial, k)
  if bias is not None:
    _check_bias(op, bias, k, "the kernel's output channels")
    bias = bias.astype(dtype)
  if residual is not None and tuple(residual.shape) != out_shape:
    raise ValueError(f"{op}: residual must have the output's shape {out_shape}; got "
                     f"{tuple(residual.shape)}")
  activation = activation_lib.activation_arg(op, activation)
  if not checks.kernel_dtype(dtype) or _has_zero(x.shape) or _has_zero(kernel.shape) or _has_zero(
      out_shape):
    return _lax_conv(x.astype(dtype), kernel.astype(dtype), bias,
                     None if residual is None else residual.astype(dtype), activation, strides,
                     pads, dilation, groups)
  w = jnp.moveaxis(kernel.astype(dtype), -1, 0)  # [K, *window, C / groups]
  w = _transpose(w, (0,) + tuple(range(1, nsp + 1)) + (nsp + 1,))
  return _forward(x.astype(dtype), w, pads, strides, dilation, groups,
                  checks.matmul_precision(None, dtype), bias=bias,
                  residual=None if residual is None else residual.astype(dtype),
                  activation=activation)


def matmul(x, w, bias=None, *, activation=None) -> jax.Array:
  """act(x @ w + bias) for x [..., K], w [K, N], bias [N] (or None), on the
  convolution kernels (a 1x1 convolution: x's leading axes are its batch and
  spatial axes). activation: None or one of bias_act's. Operands are
  promoted to one dtype; gradients flow to each. Operands of other dtypes
  than float32, bfloat16 and float16 run jnp.matmul."""
  op = "matmul"
  (x, w, bias), dtype = _operands(op, ("x", x), ("w", w), ("bias", bias))
  if w.ndim != 2:
    raise ValueError(f"{op}: w must be [K, N]; got shape {tuple(w.shape)}")
  if x.ndim < 1 or x.shape[-1] != w.shape[0]:
    raise ValueError(f"{op}: x must be [..., K] with K = w.shape[0] = {w.shape[0]}; got shape "
                     f"{tuple(x.shape)}")
  if bias is not None:
    _check_bias(op, bias, w.shape[1], "w.shape[1]")
    bias = bias.astype(dtype)
  activation = activation_lib.activation_arg(op, activation)
  if not checks.kernel_dtype(dtype):
    y = jnp.matmul(x.astype(dtype), w.astype(dtype))
    return activation_lib.apply(y if bias is None else y + bias, activation)
  lead = tuple(x.shape[:-1])
  xc = x.astype(dtype)
  if xc.ndim == 1:
    xc = xc[None]
  elif xc.ndim > 5:
    xc = xc.reshape((-1,) + lead[-3:] + (w.shape[0],))
  if xc.ndim == 2:
    xc = xc[:, None]
  nsp = xc.ndim - 2
  wc = _transpose(w.astype(dtype), (1, 0)).reshape((w.shape[1],) + (1,) * nsp + (w.shape[0],))
  y = _forward(xc, wc, [(0, 0)] * nsp, (1,) * nsp, (1,) * nsp, 1,
               checks.matmul_precision(None, dtype), bias=bias, activation=activation)
  return y.reshape(lead + (w.shape[1],)) if y.shape[:-1] != lead else y


# --- conv_algorithms ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PhaseAlgorithm:
  """What runs a strided dgrad that no dgrad kernel takes: one stride-1
  forward convolution a phase (dx's residues modulo the stride;
  conv_primitives.py). Has the attributes of the extension's
  ConvAlgorithm; id -1 (no registry algorithm). workspace_bytes: the
  phases' together; deterministic: every phase's algorithm is."""
  workspace_bytes: int = 0
  deterministic: bool = True
  id: int = -1
  name: str = "strided_dgrad_phases"
  supported: bool = True
  reason: str = ""


@dataclasses.dataclass(frozen=True)
class ConvAlgorithms:
  """The algorithms of one of a convolution's kernels for one problem.

  op: "fwd", "dgrad" or "wgrad". problem: the kernel's view of it (channels
  last, spatial axes padded to 3 in (D, H, W) order). chosen: the
  ConvAlgorithm that runs (its name, id, workspace_bytes, deterministic),
  or None where the reference (XLA) runs: the heuristic's choice, or in
  benchmark mode, where the problem was timed, the fastest. A strided
  dgrad that runs as stride-1 forward convolutions has chosen a
  PhaseAlgorithm (also last in `algorithms`), and `phases`: per residue
  (D, H, W) of dx's index modulo the stride, the forward's ConvAlgorithms,
  or None where no tap reaches it (zeros).
  algorithms: every registered one, each with `supported` and, where not,
  its `reason`. times_ms: in benchmark mode, each timed candidate's
  milliseconds ("xla" for the reference); None where the heuristic chose.
  """
  op: str
  problem: dict
  chosen: Any
  algorithms: tuple
  times_ms: dict | None = None
  phases: tuple = ()

  def __str__(self) -> str:
    p = self.problem
    head = (f"{self.op}: {p['dtype']} n={p['n']} c={p['c']} k={p['k']} groups={p['groups']} "
            f"input={p['input']} window={p['window']} output={p['output']} "
            f"stride={p['stride']} dilation={p['dilation']} pad={p['pad_lo']}/{p['pad_hi']}")
    if self.phases:
      zeros = sum(sub is None for _, sub in self.phases)
      chosen = (f"  runs {self.chosen.name}: stride-1 forward convolutions, one per residue "
                f"of dx's index modulo the stride"
                + (f" ({zeros} no tap reaches: zeros)" if zeros else ""))
    elif self.times_ms is not None:
      timed = ", ".join(f"{n} {t:.3g} ms" for n, t in sorted(self.times_ms.items(),
                                                             key=lambda item: item[1]))
      name = self.chosen.name if self.chosen is not None else "the reference (XLA)"
      chosen = f"  runs {name}: the fastest in benchmark mode ({timed})"
    elif self.chosen is not None:
      chosen = f"  runs {self.chosen.name} (workspace {self.chosen.workspace_bytes} B)"
    else:
      chosen = "  runs the reference (XLA): the heuristic takes no algorithm for it"
    rows = [f"  {'+' if a.supported else '-'} {a.name}" + ("" if a.supported else f": {a.reason}")
            for a in self.algorithms]
    for residues, sub in self.phases:
      if sub is None:
        rows.append(f"    phase {residues}: zeros")
        continue
      q = sub.problem
      rows.append(f"    phase {residues}: window {q['window']} dilation {q['dilation']} "
                  f"pad {q['pad_lo']}/{q['pad_hi']} output {q['output']}: runs "
                  + (sub.chosen.name if sub.chosen is not None else "the reference (XLA)"))
    return "\n".join([head, chosen] + rows)


def _primitive_calls(jaxpr, found):
  """The conv primitives' calls in a jaxpr and its sub-jaxprs: (name, avals, params)."""
  names = {prims.conv_fwd_p: "fwd", prims.conv_dgrad_p: "dgrad", prims.conv_wgrad_p: "wgrad"}
  for eqn in jaxpr.eqns:
    if eqn.primitive in names:
      found.append((names[eqn.primitive], [v.aval for v in eqn.invars], dict(eqn.params)))
    for value in eqn.params.values():
      for sub in value if isinstance(value, (tuple, list)) else (value,):
        inner = getattr(sub, "jaxpr", sub)
        if hasattr(inner, "eqns"):
          _primitive_calls(inner, found)
  return found


def conv_algorithms(x, kernel, bias=None, *, residual=None, activation=None, strides=1,
                    padding="SAME", dilation=1, groups=1, deterministic=None, benchmark=None,
                    sm_count=None) -> dict[str, ConvAlgorithms]:
  """Which algorithm jax_dnn.conv's forward, dgrad and wgrad kernels run
  for these operands, and why the others do not.

  Takes jax_dnn.conv's arguments (arrays, or jax.ShapeDtypeStruct for
  shapes alone; bias and residual may be either, or None). deterministic:
  plan as under jax_dnn.config's deterministic setting (None: the current
  one). benchmark: report benchmark mode's choice and times where this
  process or the cache file has them for the current device (None:
  jax_dnn.config's setting; nothing is timed here: a problem not yet
  timed reports the heuristic's choice, times_ms None). sm_count: plan for
  a GPU of that many SMs (None: the current device's properties, all 0
  where no GPU is present; no benchmark results then). Returns
  {"fwd": ConvAlgorithms, "dgrad": ..., "wgrad": ...}; print one for a
  summary. The forward is the one inference runs (with a gelu or silu
  activation, training runs it without and applies the activation after).
  jax_dnn.conv_general_dilated's calls are the same problems in that
  layout. Needs the extension's algorithm registry (not the GPU).
  """
  if sm_count is not None and (not _is_int(sm_count) or sm_count < 1):
    raise ValueError(f"jax_dnn.conv_algorithms: sm_count must be None (the current device) or "
                     f"a positive int (a GPU's SM count); got {sm_count!r}")
  if not plans.has_conv_plans():
    raise RuntimeError("jax_dnn.conv_algorithms: the extension has no convolution plans "
                       "(jax_dnn is not built, or built without them)")
  spec = lambda a: None if a is None else jax.ShapeDtypeStruct(a.shape, a.dtype)
  args = (spec(x), spec(kernel), spec(bias), spec(residual))
  fn = lambda x, k, b, r: conv(x, k, b, residual=r, activation=activation, strides=strides,
                               padding=padding, dilation=dilation, groups=groups)

  def vjp(*a):
    y, back = jax.vjp(fn, *a)
    return back(y)

  det = config.deterministic if deterministic is None else bool(deterministic)
  use_benchmark = config.benchmark if benchmark is None else bool(benchmark)
  before = config.deterministic
  config.update("deterministic", det)
  try:
    calls = _primitive_calls(jax.make_jaxpr(fn)(*args).jaxpr, [])
    calls = [c for c in calls if c[0] == "fwd"][:1] + [
        c for c in _primitive_calls(jax.make_jaxpr(vjp)(*args).jaxpr, []) if c[0] != "fwd"]
  finally:
    config.update("deterministic", before)
  device = None if sm_count is None else plans.device_props(sm_count=sm_count)
  if not any(op == "dgrad" for op, _, _ in calls):
    # A strided dgrad that runs as phases (conv_phases.dgrad): report
    # the problem of the dgrad it computes.
    calls.append(("dgrad", *conv_phases.dgrad_operands(calls[0][1], calls[0][2])))

  def report(op, avals, params):
    key = prims.plan_key(op, avals, params)
    problem = prims.problem_of(key)
    algos = tuple(plans.conv_algorithms(problem, device))
    plan = plans.conv_plan(problem, deterministic=det, device=device)
    chosen, times = plan if plan.supported else None, None
    tuned = (conv_tuning.TUNER.lookup(key, det, params["precision"])
             if use_benchmark and sm_count is None else None)
    if tuned is not None:
      chosen = next((a for a in algos if a.id == tuned.algorithm_id and a.supported), None)
      times = dict(tuned.times_ms)
    return ConvAlgorithms(op, dataclasses.asdict(key), chosen, algos, times)

  result = {}
  for op, avals, params in calls:
    if op in result:
      continue
    result[op] = report(op, avals, params)
    phases = conv_phases.phases_planned(*avals, params) if op == "dgrad" else None
    if phases is not None:
      subs = tuple((ph.residues, None if ph.zero else report("fwd", ph.avals, ph.params))
                   for ph in phases)
      chosen = [s.chosen for _, s in subs if s is not None]
      algorithm = PhaseAlgorithm(
          workspace_bytes=sum(int(a.workspace_bytes) for a in chosen if a is not None),
          deterministic=all(a is not None and a.deterministic for a in chosen))
      result[op] = dataclasses.replace(result[op], chosen=algorithm, times_ms=None, phases=subs,
                                       algorithms=result[op].algorithms + (algorithm,))
  return {op: result[op] for op in ("fwd", "dgrad", "wgrad")}
