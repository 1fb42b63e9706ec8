"""Pooling over the spatial axes of channels-last inputs: max_pool, avg_pool
(flax.linen's arguments and results), adaptive_max_pool and adaptive_avg_pool
(PyTorch's bins), 1D/2D/3D.

Layout: inputs [*batch, *spatial, C] (any number of batch axes, none
included, as flax.linen.pool). Inside the primitives every call is 3D:
x [N, D, H, W, C], the batch axes folded into N and a 1D/2D problem given
unit leading spatial axes; y [N, OD, OH, OW, C].

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
over the window's positions inside the input. Both backward passes are
gathers (each input position sums over the windows that cover it), hence
deterministic. The max pool's residuals are x and y: an input position is a
window's argmax iff it equals the window's max y and no earlier position of
the window does, so the kernel scans a window only from positions holding
its max (once a window for untied data) and stores no indices.
"""

from __future__ import annotations

from collections.abc import Sequence
import functools
import math

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from jax_dnn._src import checks
from jax_dnn._src import mesh_types
from jax_dnn._src import plans
from jax_dnn._src import sharding
from jax_dnn._src.batching import batch_size, merge_leading, move_to_front, split_leading
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


def _max_fwd_reference(x, **params):
  windows = _windows(params)
  inside = _outer([i for _, i, _ in windows])
  g = jnp.where(inside, _gather(x, windows), jnp.array(-jnp.inf, x.dtype))
  if params["adaptive"]:  # positions past a bin's end are no part of it
    g = jnp.where(_outer([s for _, _, s in windows]), g, jnp.array(-jnp.inf, x.dtype))
  return jnp.max(g, axis=(2, 4, 6))


def _max_argmax_onehot(x, windows):
  """[N, OD, KD, OH, KH, OW, KW, C] bool: each window's argmax (the gradient
  rule in the module docstring); all False where a padded position wins."""
  n, c = x.shape[0], x.shape[-1]
  inside = _outer([i for _, i, _ in windows])
  selectable = _outer([s for _, _, s in windows])
  g = jnp.where(inside, _gather(x, windows), -jnp.inf).astype(jnp.float32)
  g = jnp.where(selectable, g, -jnp.inf)
  m = jnp.max(g, axis=(2, 4, 6), keepdims=True)
  hit = selectable & ((g == m) | (jnp.isnan(g) & jnp.isnan(m)))
  # Row-major window order: move the K axes last, flatten them, take the first hit.
  perm = (0, 1, 3, 5, 7, 2, 4, 6)
  ks = tuple(p.shape[1] for p, _, _ in windows)
  outs = tuple(p.shape[0] for p, _, _ in windows)
  flat = jnp.transpose(hit, perm).reshape((n,) + outs + (c, math.prod(ks)))
  first = jnp.argmax(flat, axis=-1)
  onehot = (jnp.arange(math.prod(ks)) == first[..., None]) & jnp.any(flat, axis=-1, keepdims=True)
  onehot = onehot.reshape((n,) + outs + (c,) + ks)
  return jnp.transpose(onehot, (0, 1, 5, 2, 6, 3, 7, 4)) & inside


def _max_bwd_reference(dy, x, y, **params):
  del y  # the kernel's shortcut to the argmax; the reference recomputes it
  windows = _windows(params)
  onehot = _max_argmax_onehot(x, windows)
  dy5 = dy.astype(jnp.float32)[:, :, None, :, None, :, None, :]
  return _scatter_back(jnp.where(onehot, dy5, 0.0), windows, params["input"]).astype(x.dtype)


def _avg_fwd_reference(x, **params):
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


# --- primitives -----------------------------------------------------------------------
#
# Params (static, hashable): input, output, window, strides, pad_lo: 3 ints
# each (D, H, W); adaptive (bins instead of windows: window then holds each
# axis' largest bin, strides and pad_lo are unused); count_include_pad (avg
# pooling only; max pooling's is False).


def _y_shape(x_shape, output):
  return (x_shape[0],) + tuple(output) + (x_shape[-1],)


def _fwd_abstract(x, **params):
  return ShapedArray(_y_shape(x.shape, params["output"]), x.dtype)


def _max_bwd_abstract(dy, x, y, **params):
  del dy, y, params
  return ShapedArray(x.shape, x.dtype)


def _avg_bwd_abstract(dy, **params):
  return ShapedArray((dy.shape[0],) + tuple(params["input"]) + (dy.shape[-1],), dy.dtype)


def _fold_batch(prim, args, dims, params):
  """vmap's axis folded into N: every operand [B, N, ...] -> [B * N, ...]."""
  size = batch_size(args, dims)
  args = [merge_leading(move_to_front(a, d, size)) for a, d in zip(args, dims)]
  return split_leading(prim.bind(*args, **params), size), 0


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
  return (avals[0].dtype in [jnp.dtype(d) for d in checks.SUPPORTED_DTYPES]
          and min(params["input"]) > 0)


def _ffi_params(avals, *, input, output, window, strides, pad_lo, adaptive,
                count_include_pad):
  """The kernels' attributes: one int a dimension (D, H, W)."""
  del avals
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


def _define(name, fwd_reference, bwd_reference, bwd_abstract, fwd_workspace=None):
  fwd = define_primitive(
      f"{name}_fwd",
      abstract_eval=_fwd_abstract,
      batching_rule=lambda args, dims, **p: _fold_batch(fwd, args, dims, p),
      reference=fwd_reference,
      multiple_results=False,
      ffi_params=_ffi_params,
      supported=_kernel_takes,
      workspace=fwd_workspace,
      sharding=_sharding,
  )
  bwd = define_primitive(
      f"{name}_bwd",
      abstract_eval=bwd_abstract,
      batching_rule=lambda args, dims, **p: _fold_batch(bwd, args, dims, p),
      reference=bwd_reference,
      multiple_results=False,
      ffi_params=_ffi_params,
      supported=_kernel_takes,
      sharding=_sharding,
  )
  return fwd, bwd


max_pool_fwd_p, max_pool_bwd_p = _define("max_pool", _max_fwd_reference, _max_bwd_reference,
                                         _max_bwd_abstract)
avg_pool_fwd_p, avg_pool_bwd_p = _define("avg_pool", _avg_fwd_reference, _avg_bwd_reference,
                                         _avg_bwd_abstract, fwd_workspace=_global_workspace)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _max_pool(params, x):
  return max_pool_fwd_p.bind(x, **dict(params))


def _max_pool_fwd(params, x):
  y = _max_pool(params, x)
  return y, (x, y)


def _max_pool_bwd(params, res, dy):
  x, y = res
  dx = max_pool_bwd_p.bind(dy.astype(x.dtype), x, y, **dict(params))
  return (mesh_types.like_primal(dx, x),)


_max_pool.defvjp(_max_pool_fwd, _max_pool_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _avg_pool(params, x):
  return avg_pool_fwd_p.bind(x, **dict(params))


def _avg_pool_fwd(params, x):
  # The backward reads dy only; x rides along for its type (dtype, and its
  # sharding under explicit mesh axes), which keeps no buffer alive.
  return _avg_pool(params, x), x


def _avg_pool_bwd(params, x, dy):
  dx = avg_pool_bwd_p.bind(dy.astype(x.dtype), **dict(params))
  return (mesh_types.like_primal(dx, x),)


_avg_pool.defvjp(_avg_pool_fwd, _avg_pool_bwd)


# --- public API -----------------------------------------------------------------------


def _ints(op, name, value, rank, minimum):
  """A sequence of `rank` ints >= minimum."""
  if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
    raise TypeError(f"{op}: {name} must be a tuple of {rank} ints, got {value!r}")
  if len(value) != rank:
    raise ValueError(f"{op}: {name} must have {rank} entries (one a spatial axis), got {value!r}")
  for v in value:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
      raise TypeError(f"{op}: {name} must hold ints, got {value!r}")
    if v < minimum:
      raise ValueError(f"{op}: {name} entries must be >= {minimum}, got {value!r}")
  return tuple(int(v) for v in value)


def _check_inputs(op, inputs, rank):
  checks.check_float(op, "inputs", inputs)
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


def _window_params(op, inputs, window_shape, strides, padding):
  window_shape = _ints(op, "window_shape", window_shape,
                       len(window_shape) if isinstance(window_shape, Sequence) else 0, 1)
  rank = len(window_shape)
  if not 1 <= rank <= 3:
    raise ValueError(f"{op}: window_shape must have 1, 2 or 3 entries, got {window_shape!r}")
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
    pads = [_ints(op, "padding", p, 2, 0) for p in padding]
  pads = [(int(lo), int(hi)) for lo, hi in pads]
  output = tuple(max(0, (s + lo + hi - k) // st + 1)
                 for s, (lo, hi), k, st in zip(spatial, pads, window_shape, strides))
  params = dict(input=_pad3(spatial, 1), output=_pad3(output, 1), window=_pad3(window_shape, 1),
                strides=_pad3(strides, 1), pad_lo=_pad3([lo for lo, _ in pads], 0),
                adaptive=False)
  return rank, params


def _bind(op_fn, x, rank, params):
  x5, back = _to_3d(x, rank)
  return back(op_fn(tuple(sorted(params.items())), x5))


def max_pool(inputs: jax.Array, window_shape: Sequence[int], strides: Sequence[int] | None = None,
             padding: str | Sequence[tuple[int, int]] = "VALID") -> jax.Array:
  """Max pooling, as flax.linen.max_pool.

  Args:
    inputs: [batch..., *spatial, features] (batch axes optional), float32,
      bfloat16 or float16; 1, 2 or 3 spatial axes (len(window_shape)).
    window_shape: the window, one int a spatial axis.
    strides: one int a spatial axis (default 1).
    padding: 'SAME', 'VALID' or (low, high) pairs, one a spatial axis;
      padded positions count as -inf.
  Returns the maximum of each window, in inputs' dtype. Its gradient goes to
  each window's first maximal position in row-major order, padding included
  (XLA's select_and_scatter_add; see the module docstring).
  """
  rank, params = _window_params("max_pool", inputs, window_shape, strides, padding)
  return _bind(_max_pool, inputs, rank, dict(params, count_include_pad=False))


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
  this returns inputs' dtype, and 0 there.)
  """
  if not isinstance(count_include_pad, (bool, np.bool_)):
    raise TypeError(f"avg_pool: count_include_pad must be a bool, got {count_include_pad!r}")
  rank, params = _window_params("avg_pool", inputs, window_shape, strides, padding)
  return _bind(_avg_pool, inputs, rank, dict(params, count_include_pad=bool(count_include_pad)))


def _adaptive_params(op, inputs, output_size):
  checks.check_array(op, "inputs", inputs)
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
  rank, params = _adaptive_params("adaptive_max_pool", inputs, output_size)
  return _bind(_max_pool, inputs, rank, dict(params, count_include_pad=False))


def adaptive_avg_pool(inputs: jax.Array, output_size: int | Sequence[int | None]) -> jax.Array:
  """Average pooling into a fixed output size, as PyTorch's
  AdaptiveAvgPool{1,2,3}d (channels-last); output_size 1 is global average
  pooling. Bins and arguments as adaptive_max_pool's; sums in fp32."""
  rank, params = _adaptive_params("adaptive_avg_pool", inputs, output_size)
  return _bind(_avg_pool, inputs, rank, dict(params, count_include_pad=False))
