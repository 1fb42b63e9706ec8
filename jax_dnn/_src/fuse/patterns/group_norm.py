"""Group norm and instance norm of channels-last x, as flax.nnx.GroupNorm
and InstanceNorm write them (either variance form), with the activation
after them (activation.py):
  gx = [convert](reshape(x, [N, *spatial, G, C / G]))   (instance norm: x)
  mean = sum(gx, spatial + in-group axes) / count;  var likewise
  y = act((x - bcast(mean)) * (rsqrt(bcast(var) + eps) [* scale]) [+ bias])
-> jax_dnn.group_norm / instance_norm (fp32 statistics, x's dtype out)."""

from __future__ import annotations

import types

import numpy as np

from jax_dnn._src.fuse.patterns import Match, NearMiss
from jax_dnn._src.fuse.patterns import activation as act_lib
from jax_dnn._src.fuse.patterns import norms

_CONV = ("convert_element_type",)


def _stat_mean(g, v):
  """v = reduce_sum(gx, axes) / prod(those axes): (gx, axes, eqns) or None."""
  div = g.eqn_of(v, "div")
  if div is None:
    return None
  rs = g.eqn_of(div[1].invars[0], "reduce_sum")
  count = g.constant(div[1].invars[1])
  if rs is None or count is None or count.size != 1:
    return None
  gx, axes = rs[1].invars[0], tuple(sorted(rs[1].params["axes"]))
  if not np.isclose(float(count.reshape(())), np.prod([gx.aval.shape[a] for a in axes])):
    return None
  return gx, axes, [div[0], rs[0]]


def _grouping(g, gx, axes, x):
  """The groups of the reduction of gx over axes, gx a view of x: G, the
  equations of the view, or None."""
  src, passed = g.through(gx, "convert_element_type", "reshape")
  if src is not x:
    return None
  n, c = x.aval.ndim, x.aval.shape[-1]
  spatial = tuple(range(1, n - 1))
  if gx.aval.shape == x.aval.shape and axes == spatial:
    return c, passed  # instance norm
  shape = gx.aval.shape
  if (len(shape) == n + 1 and shape[:n - 1] == x.aval.shape[:n - 1] and
      shape[-2] * shape[-1] == c and axes == spatial + (n,)):
    return shape[-2], passed
  return None


def _broadcast_ok(g, mean_b, stat, groups, c):
  """The chain from the [N, G] statistic to x's rank gives channel j the
  statistic of group j // (C / G) (Flax's broadcast over the group's
  channels, then reshapes)."""
  _, passed = norms._back(g, mean_b)  # pylint: disable=protected-access
  for j in passed:
    eqn = g.eqns[j]
    if eqn.primitive.name == "broadcast_in_dim" and eqn.invars[0] is stat:
      want = (stat.aval.shape[0], groups, c // groups)
      return (tuple(eqn.outvars[0].aval.shape) == want and
              tuple(eqn.params["broadcast_dimensions"]) == (0, 1))
  return groups == c and stat.aval.shape == (mean_b.aval.shape[0], c)


def _variance(g, v, gx, mean):
  """v = var over the group, from gx and its mean: eqns or None."""
  hit = g.eqn_of(v, "max")
  eqns = []
  if hit is not None:
    split = g.split_constant(hit[1])
    if split is None or np.any(split[1] != 0):
      return None
    eqns, v = [hit[0]], split[0]
  sub = g.eqn_of(v, "sub")
  if sub is not None:  # mean(gx^2) - mean^2
    ms = _stat_mean(g, sub[1].invars[0])
    sq = norms._square(g, sub[1].invars[1])  # pylint: disable=protected-access
    if ms and sq and sq[0] is mean:
      sq_x = norms._square(g, ms[0])  # pylint: disable=protected-access
      if sq_x and norms._same(g, sq_x[0], gx):  # pylint: disable=protected-access
        return eqns + [sub[0]] + ms[2] + sq[1] + sq_x[1]
  ms = _stat_mean(g, v)  # mean((gx - mean)^2)
  if ms is not None:
    sq_x = norms._square(g, ms[0])  # pylint: disable=protected-access
    d = g.eqn_of(sq_x[0], "sub") if sq_x else None
    if d is not None and norms._same(g, d[1].invars[0], gx):  # pylint: disable=protected-access
      back = norms._back(g, d[1].invars[1])  # pylint: disable=protected-access
      if back[0] is mean:
        return eqns + ms[2] + sq_x[1] + [d[0]] + back[1]
  return None


def _normalized(g, t):
  """t = (xc - bcast(mean)) * factor: (x, groups, eps, scale, eqns) or None."""
  hit = g.eqn_of(t, "mul")
  if hit is None or not t.aval.ndim:
    return None
  c = t.aval.shape[-1]
  for w, f in (hit[1].invars, hit[1].invars[::-1]):
    fac = norms._factor(g, f, c)  # pylint: disable=protected-access
    sub = g.eqn_of(w, "sub")
    if fac is None or sub is None:
      continue
    var, eps, scale, f_eqns = fac
    xc, mean_b = sub[1].invars
    x, x_conv = g.through(xc, *_CONV)
    mean, back = norms._back(g, mean_b)  # pylint: disable=protected-access
    m = _stat_mean(g, mean)
    if m is None:
      continue
    grouping = _grouping(g, m[0], m[1], x)
    if grouping is None or not _broadcast_ok(g, mean_b, mean, grouping[0], c):
      continue
    v_eqns = _variance(g, var, m[0], mean)
    if v_eqns is None:
      continue
    eqns = [hit[0], *f_eqns, sub[0], *x_conv, *back, *m[2], *grouping[1], *v_eqns]
    return x, grouping[0], eps, scale, eqns
  return None


def _biased(graph, t):
  """t's one use adds a [C] parameter to it."""
  users = graph.users.get(t, [])
  if len(users) != 1 or t in graph.outputs or graph.eqns[users[0]].primitive.name != "add":
    return False
  other = [v for v in graph.eqns[users[0]].invars if v is not t]
  return bool(other) and norms._param(graph, other[0], t.aval.shape[-1]) is not None  # pylint: disable=protected-access


def _match(graph, i):
  from jax_dnn._src import group_norm as ops  # pylint: disable=g-import-not-at-top
  eqn = graph.eqns[i]
  out, bias, extra, t = eqn.outvars[0], None, [], eqn.outvars[0]
  if eqn.primitive.name == "add":
    for a, b in (eqn.invars, eqn.invars[::-1]):
      if a.aval.ndim and graph.eqn_of(a, "mul") and norms._param(  # pylint: disable=protected-access
          graph, b, a.aval.shape[-1]):
        bias, back = norms._param(graph, b, a.aval.shape[-1])  # pylint: disable=protected-access
        t, extra = a, back
        break
    else:
      return None
  elif _biased(graph, out):
    return None  # the bias add after it anchors the match
  found = _normalized(graph, t)
  if found is None:
    return None
  x, groups, eps, scale, eqns = found
  name = "instance_norm" if groups == x.aval.shape[-1] else "group_norm"
  eqns = set(eqns + extra + [i])
  users = graph.users.get(out, [])
  if len(users) == 1 and out not in graph.outputs:
    back = graph.eqns[users[0]]
    if (back.primitive.name == "convert_element_type" and
        back.outvars[0].aval.dtype == x.aval.dtype):
      out = back.outvars[0]
      eqns.add(users[0])
  if out.aval.dtype != x.aval.dtype:
    return NearMiss("group_norm", i, f"x is {x.aval.dtype} and the result {out.aval.dtype}: fusing "
                    "would add a conversion pass")
  activation = act_lib.after(graph, out)
  if activation is not None:
    activation, out, act_eqns = activation
    eqns |= set(act_eqns)
  opts = dict(epsilon=eps, activation=activation)
  if name == "group_norm":
    opts["num_groups"] = groups
  fn = getattr(ops, name)
  label = ", ".join(f"{k}={v:g}" if k == "epsilon" else f"{k}={v}"
                    for k, v in opts.items() if v is not None)
  return Match("group_norm", frozenset(eqns), (x, scale, bias), out,
               lambda x, scale, bias: fn(x, scale, bias, **opts), f"jax_dnn.{name}({label})")


GroupNorm = types.SimpleNamespace(NAME="group_norm", ANCHORS=("add", "mul"), match=_match)
