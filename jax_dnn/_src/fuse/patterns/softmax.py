"""softmax / log_softmax over one axis, as jax.nn spells them:
  m = stop_gradient(broadcast(max(-inf, reduce_max(x, axis))))
  e = exp(x - m);  s = broadcast(reduce_sum(e, axis))   (converts allowed)
  softmax = e / s;  log_softmax = (x - m) - log(s)
-> jax_dnn.softmax / log_softmax (fp32 statistics, x's dtype out)."""

from __future__ import annotations

import types

import numpy as np

from jax_dnn._src.fuse.patterns import Match, NearMiss

_CONV = ("convert_element_type",)


def _max_shift(g, v):
  """v = stop_gradient(broadcast(max(-inf, reduce_max(x)))): (x, axes, eqns)."""
  sg = g.eqn_of(v, "stop_gradient")
  if sg is None:
    return None
  b = g.eqn_of(sg[1].invars[0], "broadcast_in_dim")
  if b is None:
    return None
  mx = g.eqn_of(b[1].invars[0], "max")
  if mx is None:
    return None
  split = g.split_constant(mx[1])
  if split is None or not np.all(np.isneginf(split[1])):
    return None
  arg = split[0]
  rm = g.eqn_of(arg, "reduce_max")
  if rm is None:
    return None
  return rm[1].invars[0], tuple(rm[1].params["axes"]), [sg[0], b[0], mx[0], rm[0]]


def _shifted(g, v):
  """v = x - max_shift(x): (x, axes, eqns)."""
  sub = g.eqn_of(v, "sub")
  if sub is None:
    return None
  x, m = sub[1].invars
  shift = _max_shift(g, m)
  if shift is None or shift[0] is not x:
    return None
  return x, shift[1], [sub[0], *shift[2]]


def _sum_of(g, v, e):
  """v = convert(broadcast(convert(reduce_sum(convert(e))))): eqns, or None."""
  v, passed = g.through(v, *_CONV)
  b = g.eqn_of(v, "broadcast_in_dim")
  if b is None:
    return None
  inner, passed2 = g.through(b[1].invars[0], *_CONV)
  rs = g.eqn_of(inner, "reduce_sum")
  if rs is None:
    return None
  src, passed3 = g.through(rs[1].invars[0], *_CONV)
  if src is not e:
    return None
  return tuple(rs[1].params["axes"]), [*passed, b[0], *passed2, rs[0], *passed3]


def parts(g, v):
  """v = softmax(x) as jax.nn spells it: (x, axis, eqn indices) or None."""
  div = g.eqn_of(v, "div")
  if div is None:
    return None
  e, s = div[1].invars
  ex = g.eqn_of(e, "exp")
  if ex is None:
    return None
  shifted = _shifted(g, ex[1].invars[0])
  summed = _sum_of(g, s, e)
  if shifted is None or summed is None or summed[0] != shifted[1] or len(shifted[1]) != 1:
    return None
  x, axes, eqns = shifted
  return x, axes[0], [div[0], ex[0], *eqns, *summed[1]]


def _softmax(graph, i):
  from jax_dnn._src import softmax as ops  # pylint: disable=g-import-not-at-top
  found = parts(graph, graph.eqns[i].outvars[0])
  if found is None:
    return None
  x, axis, eqns = found
  if x.aval.dtype != graph.eqns[i].outvars[0].aval.dtype:
    return NearMiss("softmax", i, f"x is {x.aval.dtype}, the result "
                    f"{graph.eqns[i].outvars[0].aval.dtype}")
  return Match("softmax", frozenset(eqns), (x,), graph.eqns[i].outvars[0],
               lambda x: ops.softmax(x, axis=axis), f"jax_dnn.softmax(axis={axis})")


def _log_softmax(graph, i):
  from jax_dnn._src import softmax as ops  # pylint: disable=g-import-not-at-top
  sub = graph.eqns[i]
  shifted = _shifted(graph, sub.invars[0])
  lg = graph.eqn_of(sub.invars[1], "log")
  if shifted is None or lg is None:
    return None
  x, axes, eqns = shifted
  ex = [j for j in graph.users[sub.invars[0]] if graph.eqns[j].primitive.name == "exp"]
  if len(axes) != 1 or not ex:
    return None
  summed = _sum_of(graph, lg[1].invars[0], graph.eqns[ex[0]].outvars[0])
  if summed is None or summed[0] != axes:
    return None
  if x.aval.dtype != sub.outvars[0].aval.dtype:
    return NearMiss("log_softmax", i, f"x is {x.aval.dtype}, the result {sub.outvars[0].aval.dtype}")
  return Match("log_softmax", frozenset([i, lg[0], ex[0], *eqns, *summed[1]]), (x,),
               sub.outvars[0], lambda x: ops.log_softmax(x, axis=axes[0]),
               f"jax_dnn.log_softmax(axis={axes[0]})")


Softmax = types.SimpleNamespace(NAME="softmax", ANCHORS=("div",), match=_softmax)
LogSoftmax = types.SimpleNamespace(NAME="log_softmax", ANCHORS=("sub",), match=_log_softmax)
