"""Pooling as flax (linen and nnx) and jnp spell it:
  max_pool = reduce_window_max(x)            (Flax's -inf init)
  avg_pool = reduce_window_sum(x) / prod(window)                (count_include_pad)
           = reduce_window_sum(x) / reduce_window_sum(ones)     (not)
  global average = [convert](reduce_sum(convert(x), spatial) / count)
over the spatial axes between the batch axes and the last (feature) one
-> jax_dnn.max_pool / avg_pool / adaptive_avg_pool. Only where the
kernels run (float32, bfloat16, float16; 1 to 3 spatial axes): elsewhere
the pooling ops would run the same XLA reduction. A spatial mean that
centers its input (x - mean(x): instance norm's statistics) is left alone."""

from __future__ import annotations

import types

import jax
import numpy as np
from jax import lax

from jax_dnn._src import checks
from jax_dnn._src.fuse.patterns import Match, NearMiss

_CONV = ("convert_element_type",)


def _spatial(name, i, x, params):
  """The pooled axes of a reduce_window's params as (window, strides, pads)
  over x's axes lo..ndim-2, or a NearMiss / None."""
  window, strides = params["window_dimensions"], params["window_strides"]
  pads = params["padding"]
  if any(d != 1 for d in (*params["base_dilation"], *params["window_dilation"])):
    return NearMiss(name, i, "a dilated window (the kernels take dense windows)")
  pooled = [a for a in range(x.aval.ndim)
            if window[a] != 1 or strides[a] != 1 or tuple(pads[a]) != (0, 0)]
  if not pooled:
    return None
  if pooled[-1] == x.aval.ndim - 1:
    return NearMiss(name, i, "it pools the last (feature) axis; the kernels pool the axes "
                    "before it")
  lo = pooled[0]
  if x.aval.ndim - 1 - lo > 3:
    return NearMiss(name, i, f"{x.aval.ndim - 1 - lo} spatial axes (the kernels take 1 to 3)")
  axes = range(lo, x.aval.ndim - 1)
  return (tuple(window[a] for a in axes), tuple(strides[a] for a in axes),
          tuple(tuple(int(p) for p in pads[a]) for a in axes))


def _max_pool(graph, i):
  from jax_dnn._src import pooling  # pylint: disable=g-import-not-at-top
  eqn = graph.eqns[i]
  x = eqn.invars[0]
  if not checks.kernel_dtype(x.aval.dtype):
    return None
  found = _spatial("max_pool", i, x, eqn.params)
  if not isinstance(found, tuple):
    return found
  window, strides, pads = found
  return Match("max_pool", frozenset([i]), (x,), eqn.outvars[0],
               lambda x: pooling.max_pool(x, window, strides, pads),
               f"jax_dnn.max_pool(window={window}, strides={strides})")


def _window_count(x_aval, params):
  """Each output's count of window positions inside the input."""
  ones = np.ones([1] + list(x_aval.shape[1:]), np.float32)
  with jax.ensure_compile_time_eval():
    return np.asarray(lax.reduce_window(ones, 0.0, lax.add, params["window_dimensions"],
                                        params["window_strides"], params["padding"]))


def _avg_pool(graph, div_i):
  """div at div_i = reduce_window_sum(x) / count: the Match, NearMiss or None."""
  from jax_dnn._src import pooling  # pylint: disable=g-import-not-at-top
  div = graph.eqns[div_i]
  total, passed = graph.through(div.invars[0], *_CONV)  # Flax's fp32 divide of a bf16 sum
  rw = graph.eqn_of(total, "reduce_window_sum")
  if rw is None:
    return None
  x = rw[1].invars[0]
  if not checks.kernel_dtype(x.aval.dtype):
    return None
  count = graph.constant(div.invars[1])
  found = _spatial("avg_pool", div_i, x, rw[1].params)
  if count is None or not isinstance(found, tuple):
    return found if count is not None else None
  window, strides, pads = found
  if count.size == 1 and np.isclose(float(count.reshape(())), np.prod(window)):
    include = True
  else:
    inside = _window_count(x.aval, rw[1].params)
    try:
      if not np.array_equal(np.broadcast_to(count, inside.shape), inside):
        return None
    except ValueError:  # a divisor of another shape
      return None
    if not inside.all():
      return NearMiss("avg_pool", div_i, "a window wholly in the padding (0 / 0 in the "
                      "unfused program)")
    include = False
  return (x, [rw[0], *passed], lambda x: pooling.avg_pool(x, window, strides, pads, include),
          f"jax_dnn.avg_pool(window={window}, strides={strides}, count_include_pad={include})")


def _global_mean(graph, div_i):
  """div at div_i = reduce_sum(convert(x), spatial axes) / their size."""
  from jax_dnn._src import pooling  # pylint: disable=g-import-not-at-top
  div = graph.eqns[div_i]
  rs = graph.eqn_of(div.invars[0], "reduce_sum")
  if rs is None:
    return None
  x, passed = graph.through(rs[1].invars[0], *_CONV)
  axes = tuple(sorted(rs[1].params["axes"]))
  n = x.aval.ndim
  if (not checks.kernel_dtype(x.aval.dtype) or not axes or axes[0] < 1 or axes[-1] != n - 2
      or axes != tuple(range(axes[0], n - 1)) or len(axes) > 3):
    return None
  count = graph.constant(div.invars[1])
  if count is None or count.size != 1 or not np.isclose(
      float(count.reshape(())), np.prod([x.aval.shape[a] for a in axes])):
    return None
  if _centers(graph, div.outvars[0], rs[1].invars[0]):
    return None
  sizes = (1,) * len(axes)
  return (x, [rs[0], *passed], lambda x: pooling.adaptive_avg_pool(x, sizes),
          "jax_dnn.adaptive_avg_pool(1)")


def _centers(graph, mean, x):
  """Whether `mean` (through broadcasts and converts) is subtracted from x:
  a normalization's statistic, not a pooling."""
  pending, seen = [mean], set()
  while pending:
    v = pending.pop()
    for j in graph.users.get(v, ()):
      if j in seen:
        continue
      seen.add(j)
      use = graph.eqns[j]
      if use.primitive.name == "sub" and graph.through(use.invars[0], *_CONV)[0] is \
          graph.through(x, *_CONV)[0]:
        return True
      if use.primitive.name in ("broadcast_in_dim", "reshape", "convert_element_type"):
        pending.append(use.outvars[0])
  return False


def _avg(graph, i):
  """Anchored at the div, or at the convert back to x's dtype after it."""
  eqn = graph.eqns[i]
  div_i, out = i, eqn.outvars[0]
  if eqn.primitive.name == "convert_element_type":
    hit = graph.eqn_of(eqn.invars[0], "div")
    if hit is None:
      return None
    div_i = hit[0]
  elif [graph.eqns[j].primitive.name for j in graph.users.get(out, ())] == [
      "convert_element_type"] and out not in graph.outputs:
    return None  # the convert after it anchors the match
  found = _avg_pool(graph, div_i) or _global_mean(graph, div_i)
  if not isinstance(found, tuple):
    return found
  x, eqns, fn, op = found
  eqns = frozenset([i, div_i, *eqns])
  shape, dtype = out.aval.shape, out.aval.dtype
  return Match("avg_pool", eqns, (x,), out, lambda x: fn(x).reshape(shape).astype(dtype), op)


MaxPool = types.SimpleNamespace(NAME="max_pool", ANCHORS=("reduce_window_max",), match=_max_pool)
AvgPool = types.SimpleNamespace(NAME="avg_pool", ANCHORS=("div", "convert_element_type"),
                                match=_avg)
