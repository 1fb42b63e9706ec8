"""The activation applied to a value, however jax.nn, Flax or jnp spell it:
the fused ops' epilogues (group norm + SiLU, ...) take it with them.

An activation is the smallest run of elementwise equations after v whose
only value used past it is one result (silu: logistic(v) and v * that;
gelu: six or eight equations); which activation it is is decided by
evaluating that run on a grid of points (in float32) against each of the
kernels' activations, and between the two GELUs by the primitive each
needs (tanh or erf). relu arrives as jax.nn.relu's custom_jvp (its body a
max with 0) or as a max with 0 itself."""

from __future__ import annotations

import jax
import numpy as np
from jax.extend import core

from jax_dnn._src.fuse import graph as graph_lib

_ELEMENTWISE = frozenset({
    "add", "sub", "mul", "div", "max", "min", "neg", "exp", "exp2", "log", "log1p", "logistic",
    "tanh", "erf", "erfc", "integer_pow", "pow", "sqrt", "rsqrt", "copy", "copy_p",
    "convert_element_type", "custom_jvp_call", "abs", "sign"})
_LONGEST = 12  # equations: the tanh GELU takes 8
_POINTS = np.linspace(-6.0, 6.0, 97, dtype=np.float32)


def _reference(name, x):
  from jax_dnn._src import activation  # pylint: disable=g-import-not-at-top
  with jax.ensure_compile_time_eval():  # also where a body is being traced
    return np.asarray(activation.apply(x, activation.ACTIVATIONS[name]))


def _relu_body(eqn) -> bool:
  """A custom_jvp_call whose body is max(w, 0) (jax.nn.relu)."""
  inner = eqn.params.get("call_jaxpr")
  if inner is None:
    return False
  closed = inner if hasattr(inner, "consts") else core.ClosedJaxpr(inner, ())
  flat = graph_lib.flatten(closed).jaxpr
  if len(flat.eqns) != 1 or flat.eqns[0].primitive.name != "max":
    return False
  lits = [v for v in flat.eqns[0].invars if isinstance(v, core.Literal)]
  return len(lits) == 1 and float(np.asarray(lits[0].val)) == 0.0


def _evaluate(graph, run, v, out):
  """The run of equations as a function of v, on _POINTS (float32); None
  where an equation is no scalar-operand elementwise one."""
  env = {v: _POINTS}
  with jax.ensure_compile_time_eval():
    for j in run:
      eqn = graph.eqns[j]
      vals = []
      for x in eqn.invars:
        if not isinstance(x, core.Literal) and x in env:
          vals.append(env[x])
          continue
        c = graph.constant(x)
        if c is None or c.size != 1:
          return None
        vals.append(np.float32(c.reshape(())))
      name = eqn.primitive.name
      if name == "convert_element_type":
        outs = [vals[0]]
      elif name == "custom_jvp_call":
        if not _relu_body(eqn):
          return None
        outs = [np.maximum(vals[0], 0)]
      else:
        try:
          outs = graph_lib.bind(eqn, [jax.numpy.asarray(a, jax.numpy.float32) for a in vals])
        except Exception:  # pylint: disable=broad-except  # params tied to other dtypes
          return None
      env.update(zip(eqn.outvars, [np.asarray(o, np.float32) for o in outs]))
  return env[out]


def _identify(graph, run, values):
  prims = {graph.eqns[j].primitive.name for j in run}
  for name in ("relu", "sigmoid", "tanh", "silu", "gelu", "gelu_tanh"):
    if name == "gelu" and not prims & {"erf", "erfc"}:
      continue
    if name == "gelu_tanh" and "tanh" not in prims:
      continue
    if np.allclose(values, _reference(name, _POINTS), rtol=1e-2, atol=1e-3):
      return name
  return None


def _through_copies(graph, out, run):
  """jax.nn.gelu ends in a copy: the run takes the copies after it."""
  while True:
    users = graph.users.get(out, [])
    if (len(users) != 1 or out in graph.outputs or
        graph.eqns[users[0]].primitive.name not in ("copy", "copy_p")):
      return out, run
    run = run + [users[0]]
    out = graph.eqns[users[0]].outvars[0]


def after(graph, v):
  """The activation applied to v alone: (name, its result, equations), or
  None. v's other uses (v itself used past the run) make it None."""
  produced = {v}
  run = []
  for j in sorted(graph.users.get(v, ())):
    start = j
    break
  else:
    return None
  for j in range(start, min(len(graph.eqns), start + 4 * _LONGEST)):
    eqn = graph.eqns[j]
    ins = [x for x in eqn.invars if not isinstance(x, core.Literal)]
    if not any(x in produced for x in ins):
      continue
    if (eqn.primitive.name not in _ELEMENTWISE or len(eqn.outvars) != 1 or
        eqn.outvars[0].aval.shape != v.aval.shape or
        any(x not in produced and (x.aval.size != 1 or graph.constant(x) is None)
            for x in ins)):
      return None
    run.append(j)
    produced.add(eqn.outvars[0])
    if len(run) > _LONGEST:
      return None
    used_past = [x for x in produced
                 if x in graph.outputs or any(u not in run for u in graph.users.get(x, ()))]
    if len(used_past) == 1 and used_past[0] is eqn.outvars[0]:
      out = eqn.outvars[0]
      if out.aval.dtype != v.aval.dtype:
        return None
      values = _evaluate(graph, run, v, out)
      name = None if values is None else _identify(graph, run, values)
      if name is not None:
        return (name, *_through_copies(graph, out, run))
  return None
