"""Layer norm and RMS norm over the last axis, as Flax and jnp spell them:
  mean = sum(x) / W;  var = max(0, mean(x^2) - mean^2)  or  mean((x - mean)^2)
  y = (x - mean) * (rsqrt(var + eps) [* scale]) [+ bias]       (layer norm)
  y = x * (rsqrt(mean(x^2) + eps) [* scale])                   (RMS norm;
      Flax subtracts a zero mean first)
with the statistics broadcast back by reshape or broadcast_in_dim.
-> jax_dnn.layer_norm / rms_norm. A float32 computation of a bf16/f16 x
whose result is converted back fuses with the converts (the kernels keep
fp32 statistics)."""

from __future__ import annotations

import types

import numpy as np

from jax_dnn._src.fuse.patterns import Match, NearMiss

_STRIP = ("reshape", "broadcast_in_dim", "convert_element_type")


def _mean(g, v, width):
  """v = reduce_sum(x, last) / width: (x, eqns) or None."""
  hit = g.eqn_of(v, "div", "mul")
  if hit is None:
    return None
  i, eqn = hit
  split = g.split_constant(eqn)
  if split is None or split[1].size != 1 or (eqn.primitive.name == "div" and split[2] != 1):
    return None
  s, cval = split[:2]
  want = width if eqn.primitive.name == "div" else 1.0 / width
  if not np.isclose(float(cval), want, rtol=1e-6):
    return None
  rs = g.eqn_of(s, "reduce_sum")
  if rs is None:
    return None
  x = rs[1].invars[0]
  if tuple(rs[1].params["axes"]) != (x.aval.ndim - 1,):
    return None
  return x, [i, rs[0]]


def _back(g, v):
  """v with the broadcasts, reshapes and converts (of the statistics, the
  parameters) stripped."""
  return g.through(v, *_STRIP)


def _same(g, a, b):
  """a and b are one value: the same variable, or one variable converted
  to one dtype twice (Flax converts x for the statistics and for the
  normalization separately)."""
  if a is b:
    return True
  ca, cb = g.eqn_of(a, "convert_element_type"), g.eqn_of(b, "convert_element_type")
  return bool(ca and cb and ca[1].invars[0] is cb[1].invars[0] and
              a.aval.dtype == b.aval.dtype)


def _square(g, v):
  hit = g.eqn_of(v, "square", "integer_pow", "mul")
  if hit is None:
    return None
  eqn = hit[1]
  if eqn.primitive.name == "integer_pow" and eqn.params["y"] != 2:
    return None
  if eqn.primitive.name == "mul" and eqn.invars[0] is not eqn.invars[1]:
    return None
  return eqn.invars[0], [hit[0]]


def _mean_square(g, v, width):
  m = _mean(g, v, width)
  if m is None:
    return None
  sq = _square(g, m[0])
  return (sq[0], m[1] + sq[1]) if sq else None


def _variance(g, v, x, mean, width):
  """v = var(x) in one of its spellings, given x and its mean: eqns or None."""
  hit = g.eqn_of(v, "max")
  eqns = []
  if hit is not None:
    split = g.split_constant(hit[1])
    if split is None or np.any(split[1] != 0):
      return None
    eqns, v = [hit[0]], split[0]
  sub = g.eqn_of(v, "sub")
  if sub is not None:  # mean(x^2) - mean^2
    ms = _mean_square(g, sub[1].invars[0], width)
    sq = _square(g, sub[1].invars[1])
    if ms and _same(g, ms[0], x) and sq and sq[0] is mean:
      return eqns + [sub[0]] + ms[1] + sq[1]
  ms = _mean_square(g, v, width)  # mean((x - mean)^2)
  if ms is not None:
    d = g.eqn_of(ms[0], "sub")
    if d is not None and _same(g, d[1].invars[0], x) and _back(g, d[1].invars[1])[0] is mean:
      return eqns + ms[1] + [d[0]] + _back(g, d[1].invars[1])[1]
  return None


def _param(g, v, width):
  """v = a [W] parameter reshaped/broadcast to x's rank: (param, eqns)."""
  p, eqns = _back(g, v)
  if p.aval.ndim != 1 or p.aval.shape[0] != width:
    return None
  return p, eqns


def _factor(g, v, width):
  """v = rsqrt(stat + eps) [* scale]: (stat, eps, scale or None, eqns)."""
  hit = g.eqn_of(v, "mul")
  scale, eqns = None, []
  if hit is not None:
    for r, s in (hit[1].invars, hit[1].invars[::-1]):
      if g.eqn_of(r, "rsqrt") and _param(g, s, width):
        scale, extra = _param(g, s, width)
        eqns, v = [hit[0]] + extra, r
        break
    else:
      return None
  rs = g.eqn_of(v, "rsqrt")
  if rs is None:
    return None
  add = g.eqn_of(rs[1].invars[0], "add")
  if add is None:
    return None
  split = g.split_constant(add[1])
  if split is None or split[1].size != 1:
    return None
  stat, eps_val = split[:2]
  stat, back = _back(g, stat)
  return stat, float(eps_val), scale, eqns + [rs[0], add[0]] + back


def _normalized(g, v, rms):
  """v = centered(x) * factor: (x, eps, scale, eqns) or None."""
  hit = g.eqn_of(v, "mul")
  if hit is None:
    return None
  for c, f in (hit[1].invars, hit[1].invars[::-1]):
    width = c.aval.shape[-1] if c.aval.ndim else 0
    fac = _factor(g, f, width) if width else None
    if fac is None:
      continue
    stat, eps, scale, eqns = fac
    sub = g.eqn_of(c, "sub")
    if rms:
      x, extra = c, []
      if sub is not None:  # Flax's RMSNorm subtracts a zero mean
        zero = g.constant(sub[1].invars[1])
        if zero is not None and np.all(zero == 0):
          x, extra = sub[1].invars[0], [sub[0]]
      ms = _mean_square(g, stat, width)
      if ms and _same(g, ms[0], x):
        return x, eps, scale, [hit[0], *eqns, *extra, *ms[1]]
    elif sub is not None:
      x = sub[1].invars[0]
      mean, back = _back(g, sub[1].invars[1])
      m = _mean(g, mean, width)
      var = _variance(g, stat, x, mean, width) if m and _same(g, m[0], x) else None
      if var is not None:
        return x, eps, scale, [hit[0], *eqns, sub[0], *back, *m[1], *var]
  return None


def _match(graph, i, rms):
  from jax_dnn._src import layer_norm as ops  # pylint: disable=g-import-not-at-top
  name = "rms_norm" if rms else "layer_norm"
  eqn = graph.eqns[i]
  out, bias, extra = eqn.outvars[0], None, []
  body = out
  if not rms and eqn.primitive.name == "add":
    for t, b in (eqn.invars, eqn.invars[::-1]):
      if t.aval.ndim and graph.eqn_of(t, "mul") and _param(graph, b, t.aval.shape[-1]):
        bias, back = _param(graph, b, t.aval.shape[-1])
        body, extra = t, [i] + back
        break
    else:
      return None
  elif eqn.primitive.name != "mul":
    return None
  found = _normalized(graph, body, rms)
  if found is None:
    return None
  x, eps, scale, eqns = found
  eqns = frozenset(eqns + extra + [i])
  # A float32 body on a converted 16-bit x, converted back: one op in x's dtype.
  src = graph.eqn_of(x, "convert_element_type")
  users = graph.users.get(out, [])
  if src is not None and len(users) == 1 and out not in graph.outputs:
    back = graph.eqns[users[0]]
    if (back.primitive.name == "convert_element_type" and
        back.outvars[0].aval.dtype == src[1].invars[0].aval.dtype):
      x, out, eqns = src[1].invars[0], back.outvars[0], eqns | {users[0]}
  if src is not None and x is not src[1].invars[0] and np.dtype(
      src[1].invars[0].aval.dtype).itemsize < np.dtype(x.aval.dtype).itemsize:
    return NearMiss(name, i, f"x is {src[1].invars[0].aval.dtype} computed in {x.aval.dtype} "
                    f"to a {out.aval.dtype} result: fusing would add a conversion pass")
  if x.aval.dtype != out.aval.dtype:
    return NearMiss(name, i, f"x is {x.aval.dtype} and the result {out.aval.dtype}: fusing "
                    "would add a conversion pass")
  inputs = (x, scale, bias)
  fn = ops.rms_norm if rms else ops.layer_norm

  def replace(x, scale, bias):
    return fn(x, scale, epsilon=eps) if rms else fn(x, scale, bias, epsilon=eps)
  return Match(name, eqns, inputs, out, replace, f"jax_dnn.{name}(epsilon={eps:g})")


LayerNorm = types.SimpleNamespace(NAME="layer_norm", ANCHORS=("add", "mul"),
                                  match=lambda g, i: _match(g, i, False))
RMSNorm = types.SimpleNamespace(NAME="rms_norm", ANCHORS=("mul",),
                                match=lambda g, i: _match(g, i, True))
