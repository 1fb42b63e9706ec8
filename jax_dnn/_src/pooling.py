"""Pooling over the spatial axes of channels-last inputs: max_pool, avg_pool
(flax.linen's arguments and results), adaptive_max_pool and adaptive_avg_pool
(PyTorch's bins), 1D/2D/3D.

Layout: inputs [*batch, *spatial, C] (any number of batch axes, none
included, as flax.linen.pool). Negative padding crops the input first (as
lax pads); dtypes other than fp32/bf16/fp16 and more than 3 spatial axes
run flax.linen's computation (_flax_pool), with its dtype rules. Inside
the primitives every call is 3D: x [N, D, H, W, C], the batch axes folded
into N and a 1D/2D problem given unit leading spatial axes;
y [N, OD, OH, OW, C].

Windows. Along each spatial axis a of length L, output o reads the positions
  pooling:  o * stride - pad_lo + j, j < window (positions outside [0, L) are
            padding: -inf for max, 0 for avg);
  adaptive: start = floor(o * L / out) up to end = ceil((o + 1) * L / out)
            (PyTorch's bins; a bin never reaches padding).
Average pooling divides by prod(window) (count_include_pad, flax's default)
or by the window's positions inside the input (count_include_pad=False, and
adaptive bins).

Numerics: max is exact in the input dtype, and a NaN in a window gives NaN
(lax.max's rule); averages sum in fp32 and round once to the input dtype.

Gradients. Max pooling's goes to each window's argmax as XLA's
select_and_scatter_add (jax.grad of lax.reduce_window max; XLA:CPU,
tests/test_pooling.py test_max_pool_ties_as_xla) places it: the
window is scanned in row-major order with its padding taking part as -inf,
and the first maximal position wins a tie; so where a window's maximum is
-inf and a padded position precedes the first real -inf, that window's
gradient is dropped, as in XLA. Adaptive bins hold no padding: their first
maximal position wins (PyTorch's choice). A NaN counts as the largest value
(its first occurrence wins). Average pooling's gradient spreads dy / divisor
over the window's positions inside the input. Backward passes are gathers
(each input position sums over the windows that cover it) or, where the
windows tile the input, broadcasts; all deterministic. Max pooling's
residual under grad is each window's argmax as a uint8 offset into the
window [KD, KH, KW] (row-major; NO_ARGMAX where a padded position wins), the
same array on every platform, so the backward reads dy and one byte an
output; windows of more than MAX_ARGMAX positions keep x and y instead (an
input position is a window's argmax iff it equals the window's max y and no
earlier position of the window does). Which computation runs each pass:
pool_plan.
"""

from __future__ import annotations

from collections.abc import Sequence
import functools
import math
from typing import NamedTuple

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from jax_dnn._src import checks
from jax_dnn._src import mesh_types
from jax_dnn._src import plans
from jax_dnn._src import sharding
from jax_dnn._src.config import config
from jax_dnn._src.batching import batch_size, merge_leading, move_to_front, split_leading
from jax_dnn._src.derivatives import custom_vjp
from jax_dnn._src.primitive import ShapedArray, define_primitive

# --- geometry (static: Python ints) --------------------------------------------------


def _axis_windows(length, out, window, stride, pad_lo, adaptive):
  """One spatial axis' windows as numpy arrays [out, K]: the positions each
  output reads, whether each is inside the input, and whether it may be a
  max's argmax (pooling: the whole window, padding too; adaptive: the bin)."""
  o = np.arange(out)[:, None]
  j = np.arange(window)[None, :]
  if adaptive:
    start = (o * length) // out
    end = -((-(o + 1) * length) // out)
    pos = start + j
    inside = pos < end
    return pos, inside, inside
  pos = o * stride - pad_lo + j
  inside = (pos >= 0) & (pos < length)
  return pos, inside, np.ones_like(inside)


def _windows(params):
  """The three axes' windows (_axis_windows) of a primitive's params."""
  return [_axis_windows(params["input"][a], params["output"][a], params["window"][a],
                        params["strides"][a], params["pad_lo"][a], params["adaptive"])
          for a in range(3)]


def _outer(masks):
  """[OD, KD], [OH, KH], [OW, KW] -> [1, OD, KD, OH, KH, OW, KW, 1]."""
  d, h, w = masks
  m = (d[:, :, None, None, None, None] & h[None, None, :, :, None, None]
       & w[None, None, None, None, :, :])
  return m[None, ..., None]


def _gather(x, windows):
  """x [N, D, H, W, C] -> [N, OD, KD, OH, KH, OW, KW, C]: each window's
  positions (clamped into the input; the callers mask the others)."""
  for a, (pos, _, _) in enumerate(windows):
    axis = 1 + 2 * a
    x = jnp.take(x, np.clip(pos, 0, x.shape[axis] - 1).reshape(-1), axis=axis)
    x = x.reshape(x.shape[:axis] + pos.shape + x.shape[axis + 1:])
  return x


def _divisor(params, windows):
  """Average pooling's divisor of each output [1, OD, 1, OH, 1, OW, 1, 1] (fp32)."""
  if params["count_include_pad"] and not params["adaptive"]:
    return np.float32(math.prod(params["window"]))
  count = _outer([inside for _, inside, _ in windows]).sum(axis=(2, 4, 6), keepdims=True)
  return np.maximum(count, 1).astype(np.float32)


def _scatter_back(contrib, windows, input_shape):
  """The transpose of _gather: contrib [N, OD, KD, OH, KH, OW, KW, C] (fp32,
  zero outside the input) summed into x's positions [N, D, H, W, C]
  (input_shape: D, H, W). One axis at a time, a scatter-add over that axis'
  (output, offset) pairs: linear in the sizes (a 0/1 matrix [O, K, L] would
  be quadratic in L, e.g. for global pooling)."""
  for a, ((pos, _, _), length) in enumerate(zip(windows, input_shape)):
    idx = np.clip(pos, 0, length - 1).reshape(-1)
    front = jnp.moveaxis(contrib, (1 + a, 2 + a), (0, 1))
    front = front.reshape((idx.size,) + front.shape[2:])
    # zeros_like keeps contrib's type (its mesh axes inside shard_map).
    total = jnp.zeros_like(front, shape=(length,) + front.shape[1:]).at[idx].add(front)
    contrib = jnp.moveaxis(total, 0, 1 + a)
  return contrib


# --- references (pure JAX; what non-CUDA platforms run) -------------------------------
#
# Where XLA has a native form (reduce_window for pooling windows, a reshape
# and a reduction for adaptive bins that tile the input) the forward
# references use it: they are also what the CUDA lowering runs where the
# kernels are not the default (_plan). Other adaptive bins gather.


def _pad_hi(params):
  """The high padding each axis' last window reaches (>= 0)."""
  return tuple(max(0, (o - 1) * s + k - i - lo) for i, o, k, s, lo in zip(
      params["input"], params["output"], params["window"], params["strides"], params["pad_lo"]))


def _tiles(params):
  """Whether the windows tile the input without overlap or padding: pooling
  with stride == window and no padding reached, or adaptive bins of equal
  size (L a multiple of the output). Inputs past the last window (VALID's
  remainder) take no part. Such forwards are reshapes and reductions, and
  their backwards broadcasts."""
  if params["adaptive"]:
    return all(i % o == 0 for i, o in zip(params["input"], params["output"]))
  return (tuple(params["strides"]) == tuple(params["window"]) and not any(params["pad_lo"])
          and not any(_pad_hi(params)))


def _global(params):
  return params["adaptive"] and tuple(params["output"]) == (1, 1, 1)


def _tiled_view(x, params):
  """x [N, D, H, W, C] -> [N, OD, KD, OH, KH, OW, KW, C] (tiling windows:
  _tiles), the positions past the last window cut off."""
  k, o = params["window"], params["output"]
  x = x[:, :o[0] * k[0], :o[1] * k[1], :o[2] * k[2]]
  return x.reshape((x.shape[0], o[0], k[0], o[1], k[1], o[2], k[2], x.shape[-1]))


def _untile(dx8, params):
  """The transpose of _tiled_view: [N, OD, KD, OH, KH, OW, KW, C] -> x's
  shape, zeros past the last window."""
  n, c = dx8.shape[0], dx8.shape[-1]
  k, o, i = params["window"], params["output"], params["input"]
  dx = dx8.reshape((n, o[0] * k[0], o[1] * k[1], o[2] * k[2], c))
  pad = [(0, 0)] + [(0, i[a] - o[a] * k[a]) for a in range(3)] + [(0, 0)]
  return jnp.pad(dx, pad) if any(hi for _, hi in pad) else dx


def _reduce_window(x, init, op, params):
  return lax.reduce_window(
      x, init, op, (1,) + tuple(params["window"]) + (1,), (1,) + tuple(params["strides"]) + (1,),
      [(0, 0)] + list(zip(params["pad_lo"], _pad_hi(params))) + [(0, 0)])


def _max_fwd_reference(x, **params):
  if not params["adaptive"]:  # flax.linen.max_pool's computation
    return _reduce_window(x, jnp.array(-jnp.inf, x.dtype), lax.max, params)
  if _tiles(params):
    return jnp.max(_tiled_view(x, params), axis=(2, 4, 6))
  windows = _windows(params)
  g = jnp.where(_outer([s for _, _, s in windows]) & _outer([i for _, i, _ in windows]),
                _gather(x, windows), jnp.array(-jnp.inf, x.dtype))
  return jnp.max(g, axis=(2, 4, 6))


def _first_max(x, windows):
  """Each window's first maximal position in row-major window order, its
  padding taking part as -inf (adaptive bins: positions past the bin's end
  take no part), NaN the largest: (offset [N, OD, OH, OW, C] int32 into the
  window [KD, KH, KW], whether that position is inside the input)."""
  n, c = x.shape[0], x.shape[-1]
  inside = _outer([i for _, i, _ in windows])
  selectable = _outer([s for _, _, s in windows])
  g = jnp.where(inside, _gather(x, windows), -jnp.inf).astype(jnp.float32)
  g = jnp.where(selectable, g, -jnp.inf)
  # NaN the largest, whatever the backend's reduction does with it.
  nan = jnp.isnan(g)
  m = jnp.max(jnp.where(nan, -jnp.inf, g), axis=(2, 4, 6), keepdims=True)
  hit = selectable & jnp.where(jnp.any(nan, axis=(2, 4, 6), keepdims=True), nan, g == m)
  # Row-major window order: move the K axes last, flatten them, take the first hit.
  perm = (0, 1, 3, 5, 7, 2, 4, 6)
  ks = tuple(p.shape[1] for p, _, _ in windows)
  outs = tuple(p.shape[0] for p, _, _ in windows)
  first = jnp.argmax(jnp.transpose(hit, perm).reshape((n,) + outs + (c, math.prod(ks))),
                     axis=-1).astype(jnp.int32)
  there = jnp.any(_onehot(first, ks) & inside, axis=(2, 4, 6))
  return first, there


def _onehot(offset, ks):
  """offset [N, OD, OH, OW, C] -> [N, OD, KD, OH, KH, OW, KW, C] bool: the
  window position each offset names (none for offsets past the window)."""
  j = np.arange(math.prod(ks)).reshape(ks)[None, None, :, None, :, None, :, None]
  return offset[:, :, None, :, None, :, None, :] == j


def _max_argmax_onehot(x, windows):
  """[N, OD, KD, OH, KH, OW, KW, C] bool: each window's argmax (the gradient
  rule in the module docstring); all False where a padded position wins."""
  first, there = _first_max(x, windows)
  ks = tuple(p.shape[1] for p, _, _ in windows)
  return _onehot(jnp.where(there, first, -1), ks)


def _max_bwd_reference(dy, x, y, **params):
  del y  # the kernel's shortcut to the argmax; the reference recomputes it
  windows = _windows(params)
  onehot = _max_argmax_onehot(x, windows)
  dy5 = dy.astype(jnp.float32)[:, :, None, :, None, :, None, :]
  return _scatter_back(jnp.where(onehot, dy5, 0.0), windows, params["input"]).astype(x.dtype)


def _max_idx_fwd_reference(x, **params):
  """y and the argmax offsets (uint8; NO_ARGMAX where a padded position wins)."""
  first, there = _first_max(x, _windows(params))
  idx = jnp.where(there, first, NO_ARGMAX).astype(jnp.uint8)
  return _max_fwd_reference(x, **params), idx


def _max_idx_bwd_reference(dy, idx, **params):
  windows = _windows(params)
  ks = tuple(params["window"])
  dy8 = dy[:, :, None, :, None, :, None, :]
  contrib = jnp.where(_onehot(idx.astype(jnp.int32), ks), dy8, jnp.zeros((), dy.dtype))
  return _scatter_back(contrib.astype(jnp.float32), windows, params["input"]).astype(dy.dtype)


def _max_bwd_tiled(dy, idx, params):
  """Max pooling's gradient where the windows tile the input (_tiles): each
  output's dy placed at the position its offset names, a broadcast that XLA
  fuses into one pass (reads dy and idx, writes dx)."""
  ks = tuple(params["window"])
  dy8 = dy[:, :, None, :, None, :, None, :]
  dx8 = jnp.where(_onehot(idx.astype(jnp.int32), ks), dy8, jnp.zeros((), dy.dtype))
  return _untile(dx8, params)


def _avg_fwd_reference(x, **params):
  if not params["adaptive"]:
    total = _reduce_window(x.astype(jnp.float32), jnp.array(0.0, jnp.float32), lax.add, params)
    div = _divisor(params, _windows(params))
    div = div if np.ndim(div) == 0 else div.squeeze((2, 4, 6))
    return (total / div).astype(x.dtype)
  if _tiles(params):
    return jnp.mean(_tiled_view(x, params).astype(jnp.float32), axis=(2, 4, 6)).astype(x.dtype)
  windows = _windows(params)
  inside = _outer([i for _, i, _ in windows])
  total = jnp.sum(jnp.where(inside, _gather(x, windows).astype(jnp.float32), 0.0),
                  axis=(2, 4, 6), keepdims=True)
  return (total / _divisor(params, windows)).squeeze((2, 4, 6)).astype(x.dtype)


def _avg_bwd_reference(dy, **params):
  windows = _windows(params)
  inside = _outer([i for _, i, _ in windows])
  g = dy.astype(jnp.float32)[:, :, None, :, None, :, None, :] / _divisor(params, windows)
  contrib = jnp.where(inside, g, 0.0)
  return _scatter_back(contrib, windows, params["input"]).astype(dy.dtype)


def _avg_bwd_tiled(dy, params):
  """Average pooling's gradient where the windows tile the input (_tiles;
  global pooling included): dy / prod(window) broadcast over each window,
  which XLA fuses into the consumer."""
  g = dy.astype(jnp.float32) / np.float32(math.prod(params["window"]))
  g8 = jnp.broadcast_to(g[:, :, None, :, None, :, None, :],
                        (dy.shape[0],) + sum(((o, k) for o, k in zip(params["output"],
                                                                    params["window"])), ())
                        + (dy.shape[-1],))
  return _untile(g8.astype(dy.dtype), params)


# --- the plan: which computation runs each pass -----------------------------------
#
# Every path gives the same results on every platform; the plan picks, from
# the static params alone, which one runs (on the GPU; elsewhere the
# references run what the kernels would).

NO_ARGMAX = 255  # ffi/pooling/pooling_plan.h kPoolNoArgmax
MAX_ARGMAX = 255  # kPoolMaxArgmax: windows of at most this many positions keep offsets


class PoolPlan(NamedTuple):
  """What runs each pass of one pooling call (pool_plan).

  forward: "kernel" (jax_dnn's forward kernel) or "xla" (the reference:
    reduce_window, or a reshape and a reduction), for a call whose gradient
    is not taken, and for average pooling's training forward.
  residuals: max pooling under grad: "argmax" (the forward kernel also
    writes each window's argmax offset, uint8, and the backward reads dy and
    the offsets), or "x_y" (windows of more than MAX_ARGMAX positions: the
    backward reads x, y and dy); "none" for average pooling.
  backward: "kernel" (a gather kernel) or "broadcast" (the windows tile the
    input: dy broadcast over each window, in JAX, fused by XLA).
  reason: why, in words.
  """
  forward: str
  residuals: str
  backward: str
  reason: str


def _plan(params, deterministic, max_pool):
  """The choice for a call's params (see PoolPlan). Measured on an H200
  (bf16 unless said, against flax.linen / XLA): the tiling forwards
  (avg 2x2 s2, adaptive 7x7 of 14x14, max 2x2x2 s2) 0.55-0.72x (XLA at
  the copy bandwidth); max 3x3 s2 forward alone 0.77x, f32 0.62x, but
  forward + backward 2.2x (the argmax offsets); global average pooling
  forward 1.6-2.4x. Hence:
    - windows that tile the input (_tiles) forward through XLA, whose
      reduce_window or reshape-reduce streams them at copy bandwidth, unless
      deterministic (the kernels stay reachable); their backwards are
      broadcasts (max: from the argmax offsets);
    - max pooling's forward alone over overlapping windows runs XLA's
      reduce_window unless deterministic; under grad the kernel runs (it
      writes the argmax offsets);
    - global average pooling, overlapping average windows and adaptive bins
      that do not tile run the kernels (XLA would gather them);
    - max pooling's backward from x and y (windows of more than MAX_ARGMAX
      positions) is the kernel's whatever the windows.
  """
  tiles = _tiles(params)
  if _global(params) and not max_pool:
    forward, why = "kernel", "global average pooling runs its reduction kernel (2.25x XLA)"
  elif tiles and not deterministic:
    forward, why = "xla", ("the windows tile the input: XLA's reduce_window / reshape-reduce "
                           "streams them at copy bandwidth (the kernel ran 0.61-0.72x); "
                           "deterministic takes the kernel")
  elif max_pool and not params["adaptive"] and not deterministic:
    forward, why = "xla", ("max pooling's forward alone (no gradient): XLA's reduce_window "
                           "(the kernel ran 0.77x bf16, 0.62x f32 at 3x3 s2); under grad the "
                           "kernel writes the argmax offsets; deterministic takes the kernel")
  else:
    forward, why = "kernel", "overlapping windows or uneven bins: the gather kernels"
  if not max_pool:
    residuals = "none"
  else:
    residuals = "argmax" if math.prod(params["window"]) <= MAX_ARGMAX else "x_y"
  backward = "broadcast" if tiles and residuals != "x_y" else "kernel"
  return PoolPlan(forward, residuals, backward, why)


def pool_plan(op: str, inputs_shape: Sequence[int], window_shape=None, strides=None,
              padding="VALID", *, output_size=None, deterministic: bool | None = None) -> PoolPlan:
  """What runs a pooling call (PoolPlan): op "max_pool", "avg_pool",
  "adaptive_max_pool" or "adaptive_avg_pool" with that op's arguments
  (window_shape/strides/padding, or output_size) on inputs of this shape;
  deterministic as jax_dnn.config's setting (None: the current one).
  residuals is "none" for average pooling."""
  x = jax.ShapeDtypeStruct(tuple(inputs_shape), jnp.float32)
  if op in ("max_pool", "avg_pool"):
    window_shape, strides, pads = _window_args(op, x, window_shape, strides, padding)
    if not 1 <= len(window_shape) <= 3:
      raise ValueError(f"pool_plan: {op} over {len(window_shape)} spatial axes runs flax's "
                       "computation, not the kernels: it has no plan")
    kept, pads = _crop(x.shape[x.ndim - len(window_shape) - 1:-1], pads)
    params = _window_params([stop - start for start, stop in kept], window_shape, strides, pads)
    params["count_include_pad"] = op == "avg_pool"
  elif op in ("adaptive_max_pool", "adaptive_avg_pool"):
    _, params = _adaptive_params(op, x, output_size)
    params["count_include_pad"] = False
  else:
    raise ValueError(f"pool_plan: unknown op {op!r}")
  det = config.deterministic if deterministic is None else bool(deterministic)
  return _plan(params, det, op.endswith("max_pool"))


# --- primitives -----------------------------------------------------------------------
#
# Params (static, hashable): input, output, window, strides, pad_lo: 3 ints
# each (D, H, W); adaptive (bins instead of windows: window then holds each
# axis' largest bin, strides and pad_lo are unused); count_include_pad (avg
# pooling only; max pooling's is False); deterministic (jax_dnn.config's
# setting when traced: the plan's choice, never an attribute of the kernels).


def _y_shape(x_shape, output):
  return (x_shape[0],) + tuple(output) + (x_shape[-1],)


def _fwd_abstract(x, **params):
  return ShapedArray(_y_shape(x.shape, params["output"]), x.dtype)


def _idx_fwd_abstract(x, **params):
  shape = _y_shape(x.shape, params["output"])
  return ShapedArray(shape, x.dtype), ShapedArray(shape, jnp.uint8)


def _max_bwd_abstract(dy, x, y, **params):
  del dy, y, params
  return ShapedArray(x.shape, x.dtype)


def _dx_abstract(dy, *rest, **params):
  del rest
  return ShapedArray((dy.shape[0],) + tuple(params["input"]) + (dy.shape[-1],), dy.dtype)


def _fold_batch(prim, args, dims, params):
  """vmap's axis folded into N: every operand [B, N, ...] -> [B * N, ...]."""
  size = batch_size(args, dims)
  args = [merge_leading(move_to_front(a, d, size)) for a, d in zip(args, dims)]
  out = prim.bind(*args, **params)
  if prim.multiple_results:
    return [split_leading(o, size) for o in out], [0] * len(out)
  return split_leading(out, size), 0


def _sharding(operands, results, **params):
  """N and C split; the spatial axes stay whole (windows cross any split)."""
  del params
  b = sharding.RuleBuilder()
  n, c = b.factor("n", operands[0][0]), b.factor("c", operands[0][-1])
  for shape in operands:
    b.operand(n, *(b.own(s) for s in shape[1:-1]), c)
  for shape in results:
    b.result(n, *(b.own(s) for s in shape[1:-1]), c)
  return b.build()


def _kernel_takes(avals, **params):
  """The kernels take fp32/bf16/fp16 and non-empty spatial axes (the
  reference runs the rest)."""
  return checks.kernel_dtype(avals[0].dtype) and min(params["input"]) > 0


def _forward_takes(avals, *, max_pool, **params):
  """The plain forwards: where the plan takes the kernel."""
  return (_kernel_takes(avals, **params)
          and _plan(params, params["deterministic"], max_pool).forward == "kernel")


def _ffi_params(avals, *, input, output, window, strides, pad_lo, adaptive,
                count_include_pad, deterministic):
  """The kernels' attributes: one int a dimension (D, H, W)."""
  del avals, deterministic
  attrs = dict(adaptive=adaptive, count_include_pad=count_include_pad)
  for name, v in (("in", input), ("out", output), ("window", window), ("stride", strides),
                  ("pad", pad_lo)):
    attrs.update({f"{name}_{a}": int(n) for a, n in zip("dhw", v)})
  return attrs


def _global_workspace(avals, **params):
  """Global average pooling's partial sums [N, parts, C] fp32 (the plan's
  split of the spatial axes); a 1-float placeholder where it runs no split,
  and under a symbolic batch (jax.export: the parts depend on N), where the
  kernel then takes one block a (batch, channel strip)."""
  x = avals[0]
  placeholder = (ShapedArray((1,), jnp.float32),)
  if not plans.is_static(*x.shape):
    return placeholder
  n, c = int(x.shape[0]), int(x.shape[-1])
  parts = plans.pool_global_parts(n, c, math.prod(params["input"]), math.prod(params["output"]),
                                  bool(params["adaptive"]), jnp.dtype(x.dtype).name)
  return placeholder if parts <= 1 else (ShapedArray((n, parts, c), jnp.float32),)


def _define(name, abstract_eval, reference, *, supported=_kernel_takes, workspace=None,
            multiple_results=False):
  prim = define_primitive(
      name,
      abstract_eval=abstract_eval,
      batching_rule=lambda args, dims, **p: _fold_batch(prim, args, dims, p),
      reference=reference,
      multiple_results=multiple_results,
      ffi_params=_ffi_params,
      supported=supported,
      workspace=workspace,
      sharding=_sharding,
  )
  return prim


max_pool_fwd_p = _define("max_pool_fwd", _fwd_abstract, _max_fwd_reference,
                         supported=functools.partial(_forward_takes, max_pool=True))
max_pool_bwd_p = _define("max_pool_bwd", _max_bwd_abstract, _max_bwd_reference)
max_pool_idx_fwd_p = _define("max_pool_idx_fwd", _idx_fwd_abstract, _max_idx_fwd_reference,
                             multiple_results=True)
max_pool_idx_bwd_p = _define("max_pool_idx_bwd", _dx_abstract, _max_idx_bwd_reference)
avg_pool_fwd_p = _define("avg_pool_fwd", _fwd_abstract, _avg_fwd_reference,
                         supported=functools.partial(_forward_takes, max_pool=False),
                         workspace=_global_workspace)
avg_pool_bwd_p = _define("avg_pool_bwd", _dx_abstract, _avg_bwd_reference)


@functools.partial(custom_vjp, nondiff_argnums=(0,))
def _max_pool(params, x):
  return max_pool_fwd_p.bind(x, **dict(params))


def _max_pool_fwd(params, x):
  p = dict(params)
  if _plan(p, p["deterministic"], True).residuals == "argmax":
    y, idx = max_pool_idx_fwd_p.bind(x, **p)
    # x rides along for its type (as in _avg_pool_fwd): the backward reads
    # dy and the offsets only.
    return y, (idx, x, None)
  y = _max_pool(params, x)
  return y, (None, x, y)


def _max_pool_bwd(params, res, dy):
  idx, x, y = res
  p = dict(params)
  dy = dy.astype(x.dtype)
  if idx is None:
    dx = max_pool_bwd_p.bind(dy, x, y, **p)
  elif _plan(p, p["deterministic"], True).backward == "broadcast":
    dx = _max_bwd_tiled(dy, idx, p)
  else:
    dx = max_pool_idx_bwd_p.bind(dy, idx, **p)
  return (mesh_types.like_primal(dx, x),)


_max_pool.defvjp(_max_pool_fwd, _max_pool_bwd)


@functools.partial(custom_vjp, nondiff_argnums=(0,))
def _avg_pool(params, x):
  return avg_pool_fwd_p.bind(x, **dict(params))


def _avg_pool_fwd(params, x):
  # The backward reads dy only; x rides along for its type (dtype, and its
  # sharding under explicit mesh axes), which keeps no buffer alive.
  return _avg_pool(params, x), x


def _avg_pool_bwd(params, x, dy):
  p = dict(params)
  dy = dy.astype(x.dtype)
  if _plan(p, p["deterministic"], False).backward == "broadcast":
    dx = _avg_bwd_tiled(dy, p)
  else:
    dx = avg_pool_bwd_p.bind(dy, **p)
  return (mesh_types.like_primal(dx, x),)


_avg_pool.defvjp(_avg_pool_fwd, _avg_pool_bwd)


# --- public API -----------------------------------------------------------------------


def _ints(op, name, value, rank, minimum=None):
  """A sequence of `rank` ints (each >= minimum, where given)."""
  if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
    raise TypeError(f"{op}: {name} must be a tuple of {rank} ints, got {value!r}")
  if len(value) != rank:
    raise ValueError(f"{op}: {name} must have {rank} entries (one a spatial axis), got {value!r}")
  for v in value:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
      raise TypeError(f"{op}: {name} must hold ints, got {value!r}")
    if minimum is not None and v < minimum:
      raise ValueError(f"{op}: {name} entries must be >= {minimum}, got {value!r}")
  return tuple(int(v) for v in value)



def _as_array(op, inputs):
  """inputs as a jax array (NumPy arrays too, as flax.linen.pool takes them)."""
  checks.check_array(op, "inputs", inputs)
  return jnp.asarray(inputs)


def _check_inputs(op, inputs, rank):
  if inputs.ndim < rank + 1:
    raise ValueError(f"{op}: inputs must be [batch..., spatial ({rank} axes), features], "
                     f"rank >= {rank + 1}; got shape {tuple(inputs.shape)}")


def _to_3d(x, rank):
  """[*batch, *spatial, C] -> [N, D, H, W, C]; and how to undo it."""
  batch = x.shape[:x.ndim - rank - 1]
  spatial = x.shape[x.ndim - rank - 1:-1]
  n = math.prod(batch)
  x5 = x.reshape((n,) + (1,) * (3 - rank) + tuple(spatial) + (x.shape[-1],))
  return x5, lambda y: y.reshape(tuple(batch) + y.shape[4 - rank:4] + (y.shape[-1],))


def _pad3(v, fill):
  return (fill,) * (3 - len(v)) + tuple(v)


def _window_args(op, inputs, window_shape, strides, padding):
  """window_shape, strides and (low, high) pads, checked and read as
  flax.linen.pool reads them (negative padding crops)."""
  window_shape = _ints(op, "window_shape", window_shape,
                       len(window_shape) if isinstance(window_shape, Sequence) else 0, 1)
  rank = len(window_shape)
  _check_inputs(op, inputs, rank)
  strides = (1,) * rank if strides is None else _ints(op, "strides", strides, rank, 1)
  spatial = tuple(inputs.shape[inputs.ndim - rank - 1:-1])
  if isinstance(padding, str):
    if padding.upper() not in ("SAME", "VALID"):
      raise ValueError(f"{op}: padding must be 'SAME', 'VALID' or (low, high) pairs, "
                       f"got {padding!r}")
    pads = lax.padtype_to_pads(spatial, window_shape, strides, padding.upper())
  else:
    if not isinstance(padding, Sequence) or len(padding) != rank or not all(
        isinstance(p, Sequence) and len(p) == 2 for p in padding):
      raise ValueError(f"{op}: padding must be 'SAME', 'VALID' or {rank} (low, high) pairs, "
                       f"got {padding!r}")
    pads = [_ints(op, "padding", p, 2) for p in padding]
  return window_shape, strides, [(int(lo), int(hi)) for lo, hi in pads]


def _crop(spatial, pads):
  """Negative padding as lax's pad (and so flax.linen.pool) applies it: each
  axis' (start, stop) that remains and the padding left (>= 0). Where the
  crops pass each other the axis keeps nothing and its padded extent stays
  lax's L + lo + hi: windows of padding alone."""
  kept, left = [], []
  for length, (lo, hi) in zip(spatial, pads):
    start = min(max(-lo, 0), length)
    stop = max(length - max(-hi, 0), start)
    extent = max(length + lo + hi, 0) - (stop - start)
    lo_left = min(max(lo, 0), extent)
    kept.append((start, stop))
    left.append((lo_left, extent - lo_left))
  return kept, left


def _window_params(spatial, window_shape, strides, pads):
  """The primitives' params for 1-3 spatial axes and padding >= 0."""
  output = tuple(max(0, (s + lo + hi - k) // st + 1)
                 for s, (lo, hi), k, st in zip(spatial, pads, window_shape, strides))
  return dict(input=_pad3(spatial, 1), output=_pad3(output, 1), window=_pad3(window_shape, 1),
              strides=_pad3(strides, 1), pad_lo=_pad3([lo for lo, _ in pads], 0),
              adaptive=False)


def _flax_pool(op, x, window_shape, strides, pads, count_include_pad):
  """flax.linen.max_pool / avg_pool's computation (lax.reduce_window), with
  flax's dtype rules (the average of integers is float32): what runs the
  inputs the primitives do not take (integer, bool, complex, float64; more
  than 3 spatial axes)."""
  batch = (1,) * (x.ndim - len(window_shape) - 1)
  dims, steps = batch + window_shape + (1,), batch + strides + (1,)
  pads = [(0, 0)] * len(batch) + list(pads) + [(0, 0)]
  if op == "max_pool":
    return lax.reduce_window(x, -jnp.inf, lax.max, dims, steps, pads)
  y = lax.reduce_window(x, 0.0, lax.add, dims, steps, pads)
  if count_include_pad:
    return y / np.prod(window_shape)
  ones = jnp.ones(batch + x.shape[len(batch):-1] + (1,))
  return y / lax.reduce_window(ones, 0.0, lax.add, dims, steps, pads)


def _bind(op_fn, x, rank, params):
  x5, back = _to_3d(x, rank)
  params = dict(params, deterministic=bool(config.deterministic))
  return back(op_fn(tuple(sorted(params.items())), x5))


def _pool(op, op_fn, inputs, window_shape, strides, padding, count_include_pad):
  """max_pool / avg_pool: flax's computation for what the primitives do not
  take; else negative padding cropped, and op_fn (_max_pool / _avg_pool)."""
  inputs = _as_array(op, inputs)
  window_shape, strides, pads = _window_args(op, inputs, window_shape, strides, padding)
  rank = len(window_shape)
  if not (checks.kernel_dtype(inputs.dtype) and 1 <= rank <= 3):
    return _flax_pool(op, inputs, window_shape, strides, pads, count_include_pad)
  first = inputs.ndim - rank - 1
  kept, pads = _crop(inputs.shape[first:-1], pads)
  if kept != [(0, n) for n in inputs.shape[first:-1]]:
    inputs = inputs[(slice(None),) * first + tuple(slice(*k) for k in kept)]
  params = _window_params(inputs.shape[first:-1], window_shape, strides, pads)
  if 0 in inputs.shape[first:-1]:  # every window reads padding alone (-inf, or 0)
    rank_output = params["output"][3 - rank:]
    return jnp.full(inputs.shape[:first] + rank_output + inputs.shape[-1:],
                    -jnp.inf if op == "max_pool" else 0, inputs.dtype)
  return _bind(op_fn, inputs, rank, dict(params, count_include_pad=count_include_pad))


def max_pool(inputs: jax.Array, window_shape: Sequence[int], strides: Sequence[int] | None = None,
             padding: str | Sequence[tuple[int, int]] = "VALID") -> jax.Array:
  """Max pooling, as flax.linen.max_pool.

  Args:
    inputs: [batch..., *spatial, features] (batch axes optional); float32,
      bfloat16 and float16 with 1, 2 or 3 spatial axes (len(window_shape))
      run the kernels, other dtypes and ranks flax's computation.
    window_shape: the window, one int a spatial axis.
    strides: one int a spatial axis (default 1).
    padding: 'SAME', 'VALID' or (low, high) pairs, one a spatial axis;
      padded positions count as -inf, negative padding crops.
  Returns the maximum of each window, in inputs' dtype. Its gradient goes to
  each window's first maximal position in row-major order, padding included
  (XLA's select_and_scatter_add; see the module docstring).
  """
  return _pool("max_pool", _max_pool, inputs, window_shape, strides, padding, False)


def avg_pool(inputs: jax.Array, window_shape: Sequence[int], strides: Sequence[int] | None = None,
             padding: str | Sequence[tuple[int, int]] = "VALID",
             count_include_pad: bool = True) -> jax.Array:
  """Average pooling, as flax.linen.avg_pool.

  Args: as max_pool's; padded positions count as 0, and count_include_pad
    says whether they count in the divisor (prod(window_shape)) or not (the
    window's positions inside the input).
  Returns the averages in inputs' dtype, summed in fp32. (flax's
  count_include_pad=False divides by an fp32 count and so returns fp32 for
  bf16/fp16 inputs, and NaN (0 / 0) for a window wholly in the padding;
  this returns inputs' dtype, and 0 there.) Inputs the kernels do not take
  get flax's result and dtype (float32 for integers).
  """
  if not isinstance(count_include_pad, (bool, np.bool_)):
    raise TypeError(f"avg_pool: count_include_pad must be a bool, got {count_include_pad!r}")
  return _pool("avg_pool", _avg_pool, inputs, window_shape, strides, padding,
               bool(count_include_pad))


def _adaptive_params(op, inputs, output_size):
  checks.check_float(op, "inputs", inputs)
  if isinstance(output_size, (int, np.integer)) and not isinstance(output_size, bool):
    rank = inputs.ndim - 2
    if not 1 <= rank <= 3:
      raise ValueError(f"{op}: an int output_size needs inputs [N, *spatial, C] with 1-3 "
                       f"spatial axes, got shape {tuple(inputs.shape)}; pass a tuple (one "
                       "entry a spatial axis) for other layouts")
    output_size = (int(output_size),) * rank
  if isinstance(output_size, (str, bytes)) or not isinstance(output_size, Sequence):
    raise TypeError(f"{op}: output_size must be an int or a tuple of ints, got {output_size!r}")
  rank = len(output_size)
  if not 1 <= rank <= 3:
    raise ValueError(f"{op}: output_size must have 1, 2 or 3 entries, got {output_size!r}")
  _check_inputs(op, inputs, rank)
  spatial = tuple(inputs.shape[inputs.ndim - rank - 1:-1])
  output = _ints(op, "output_size", [s if o is None else o for o, s in zip(output_size, spatial)],
                 rank, 1)
  for s in spatial:
    if s < 1:
      raise ValueError(f"{op}: spatial axes must be non-empty, got shape {tuple(inputs.shape)}")
  # The largest bin of each axis: the windows the reference gathers.
  window = tuple(int(np.max(-((-(np.arange(o) + 1) * s) // o) - (np.arange(o) * s) // o))
                 for s, o in zip(spatial, output))
  params = dict(input=_pad3(spatial, 1), output=_pad3(output, 1), window=_pad3(window, 1),
                strides=(1, 1, 1), pad_lo=(0, 0, 0), adaptive=True)
  return rank, params


def adaptive_max_pool(inputs: jax.Array, output_size: int | Sequence[int | None]) -> jax.Array:
  """Max pooling into a fixed output size, as PyTorch's AdaptiveMaxPool{1,2,3}d
  (channels-last). Output o of an axis of length L takes the bin
  [floor(o * L / out), ceil((o + 1) * L / out)).

  Args:
    inputs: [batch..., *spatial, features], float32, bfloat16 or float16.
    output_size: one int a spatial axis (None keeps that axis' size); a
      single int means inputs are [N, *spatial, C] and applies to each axis.
  Gradients go to each bin's first maximal position (row-major).
  """
  inputs = _as_array("adaptive_max_pool", inputs)
  rank, params = _adaptive_params("adaptive_max_pool", inputs, output_size)
  return _bind(_max_pool, inputs, rank, dict(params, count_include_pad=False))


def adaptive_avg_pool(inputs: jax.Array, output_size: int | Sequence[int | None]) -> jax.Array:
  """Average pooling into a fixed output size, as PyTorch's
  AdaptiveAvgPool{1,2,3}d (channels-last); output_size 1 is global average
  pooling. Bins and arguments as adaptive_max_pool's; sums in fp32."""
  inputs = _as_array("adaptive_avg_pool", inputs)
  rank, params = _adaptive_params("adaptive_avg_pool", inputs, output_size)
  return _bind(_avg_pool, inputs, rank, dict(params, count_include_pad=False))
