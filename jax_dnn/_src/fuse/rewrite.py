"""jax_dnn.fuse: trace a function to a jaxpr, replace the patterns it holds
by jax_dnn ops, and evaluate the result under whatever transformation calls
it (jit, grad, vmap, checkpoint, export): the rewrite is an interpreter of
the jaxpr, so the fused ops' own batching rules and VJPs apply.

The jaxpr is traced from the arguments' shapes and dtypes and cached per
signature; nested jit calls are inlined (graph.flatten); the bodies of
scan, cond, while and remat are rewritten in turn and called through their
public APIs. The rules of custom_jvp / custom_vjp functions stay as they
are (their derivatives refer to the original computation)."""

from __future__ import annotations

import dataclasses
import functools
import os

import jax
import numpy as np
from jax import lax
from jax.extend import core

from jax_dnn._src.fuse import graph as graph_lib
from jax_dnn._src.fuse.patterns import Match, NearMiss, registry


@dataclasses.dataclass
class Report:
  """What fuse did to one program: the matches (what each became) and the
  near-misses (why a look-alike was left to XLA)."""
  fused: list  # dicts: pattern, op, source
  missed: list  # dicts: pattern, reason, source

  def __str__(self):
    lines = [f"jax_dnn.fuse: {len(self.fused)} fused, {len(self.missed)} left to XLA"]
    lines += [f"  fused   {m['pattern']:<12} -> {m['op']}  {m['source']}" for m in self.fused]
    lines += [f"  skipped {m['pattern']:<12}: {m['reason']}  {m['source']}" for m in self.missed]
    return "\n".join(lines)


def find(graph, patterns, where):
  """The matches in `graph` (no equation in two), the near-misses
  appended to `where.missed`."""
  taken, matches = set(), []
  for pattern in patterns:
    for i, eqn in enumerate(graph.eqns):
      if eqn.primitive.name not in pattern.ANCHORS or i in taken:
        continue
      found = pattern.match(graph, i)
      if isinstance(found, Match):
        found.index = i
        found = _check_uses(graph, found)
      if isinstance(found, NearMiss):
        where.missed.append(dict(pattern=found.pattern, reason=found.reason,
                                 source=graph.source(found.index)))
      elif found is not None and not found.eqns & taken:
        taken |= found.eqns
        matches.append(found)
        where.fused.append(dict(pattern=found.pattern, op=found.op, source=graph.source(i)))
  return matches


def _check_uses(graph, m):
  """A match replaces its equations: a value they make on the way (not
  its output) that something else uses makes it a near-miss."""
  results = m.results()
  for j in m.eqns:
    for v in graph.eqns[j].outvars:
      if any(v is r for r in results):
        continue
      if v in graph.outputs or any(u not in m.eqns for u in graph.users.get(v, ())):
        return NearMiss(m.pattern, m.index, f"its intermediate {v} ({v.aval.str_short()}) is "
                        "used elsewhere")
  return m


class _Rewriter:
  def __init__(self, patterns, report):
    self.patterns, self.report = patterns, report
    self._subs = {}  # id(body) -> its rewrite (or None), made once

  def closed(self, closed):
    """A function evaluating `closed` (a ClosedJaxpr) rewritten."""
    flat = graph_lib.flatten(closed)
    g = graph_lib.Graph(flat.jaxpr, dict(zip(flat.jaxpr.constvars, flat.consts)))
    matches = {m.index: m for m in find(g, self.patterns, self.report)}
    skip = set().union(*(m.eqns for m in matches.values())) if matches else set()
    return functools.partial(self._eval, g, flat.consts, matches, skip)

  def _eval(self, g, consts, matches, skip, *args):
    env = dict(zip(g.jaxpr.constvars, consts))
    env.update(zip(g.jaxpr.invars, args))
    read = lambda v: None if v is None else v.val if isinstance(v, core.Literal) else env[v]
    for i, eqn in enumerate(g.eqns):
      if i in matches:
        m = matches[i]
        outs = m.replace(*(read(v) for v in m.inputs))
        env.update(zip(m.results(), outs if m.outputs else [outs]))
        continue
      if i in skip:
        continue
      vals = [read(v) for v in eqn.invars]
      outs = self._control(eqn, vals)
      env.update(zip(eqn.outvars, outs if outs is not None else graph_lib.bind(eqn, vals)))
    return [read(v) for v in g.jaxpr.outvars]

  def _sub(self, closed):
    """closed's rewrite, or None when it fuses nothing (the original is kept)."""
    if id(closed) not in self._subs:
      before = len(self.report.fused)
      fn = self.closed(closed if hasattr(closed, "consts") else core.ClosedJaxpr(closed, ()))
      self._subs[id(closed)] = (closed, fn if len(self.report.fused) > before else None)
    return self._subs[id(closed)][1]

  def _control(self, eqn, vals):
    """Control flow and remat with rewritten bodies, through the public
    APIs; None where nothing inside fuses."""
    name, p = eqn.primitive.name, eqn.params
    if name == "scan":
      body = self._sub(p["jaxpr"])
      if body is None:
        return None
      # The body's rewrite traced at its own operand types, bound in its place
      # (scan's parameters differ between jax versions; the body's types do not).
      old = p["jaxpr"]
      avals = [jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=a.weak_type)
               for a in old.in_avals]
      new = jax.make_jaxpr(body)(*avals)
      if [a.strip_weak_type() for a in new.out_avals] != [
          a.strip_weak_type() for a in old.out_avals]:
        return None
      return eqn.primitive.bind(*vals, **dict(p, jaxpr=new))
    if name == "cond":
      fns = [self._sub(b) for b in p["branches"]]
      if all(f is None for f in fns):
        return None
      fns = [f or core.jaxpr_as_fun(b) for f, b in zip(fns, p["branches"])]
      return lax.switch(vals[0], fns, *vals[1:])
    if name == "while":
      cond_fn, body_fn = self._sub(p["cond_jaxpr"]), self._sub(p["body_jaxpr"])
      if cond_fn is None and body_fn is None:
        return None
      cond_fn = cond_fn or core.jaxpr_as_fun(p["cond_jaxpr"])
      body_fn = body_fn or core.jaxpr_as_fun(p["body_jaxpr"])
      cn, bn = p["cond_nconsts"], p["body_nconsts"]
      cc, bc, init = vals[:cn], vals[cn:cn + bn], vals[cn + bn:]
      return lax.while_loop(lambda c: cond_fn(*cc, *c)[0], lambda c: body_fn(*bc, *c), init)
    if name in ("remat", "checkpoint", "remat2"):
      body = self._sub(p["jaxpr"])
      if body is None:
        return None
      return jax.checkpoint(body, prevent_cse=p["prevent_cse"], policy=p["policy"])(*vals)
    return None


def _select(patterns):
  known = registry()
  if patterns is None:
    return list(known.values())
  unknown = [p for p in patterns if p not in known]
  if unknown:
    raise ValueError(f"jax_dnn.fuse: unknown patterns {unknown}; known: {sorted(known)}")
  return [known[p] for p in patterns]


class Fused:
  """fun with its patterns on jax_dnn's ops; see `fuse`."""

  def __init__(self, fun, patterns):
    if not callable(fun):
      raise TypeError(f"jax_dnn.fuse: fun must be callable; got {type(fun).__name__}")
    self._fun, self._patterns = fun, _select(patterns)
    self._cache = {}
    functools.update_wrapper(self, fun)

  def _trace(self, args, kwargs):
    flat, tree = jax.tree.flatten((args, kwargs))
    avals = tuple(jax.ShapeDtypeStruct(np.shape(x), jax.dtypes.result_type(x)) for x in flat)
    key = (tree, avals)
    if key not in self._cache:
      def flat_fun(*leaves):
        a, k = jax.tree.unflatten(tree, leaves)
        return self._fun(*a, **k)
      closed, out_shape = jax.make_jaxpr(flat_fun, return_shape=True)(*avals)
      report = Report([], [])
      run = _Rewriter(self._patterns, report).closed(closed)
      jax.eval_shape(run, *avals)  # rewrites the bodies of control flow once, for the report
      self._cache[key] = (run, jax.tree.structure(out_shape), report)
      if os.environ.get("JAX_DNN_FUSE_LOG", "") not in ("", "0"):
        print(report)
    return flat, self._cache[key]

  def __call__(self, *args, **kwargs):
    flat, (run, out_tree, _) = self._trace(args, kwargs)
    return jax.tree.unflatten(out_tree, run(*flat))

  def explain(self, *args, **kwargs) -> Report:
    """What fuse does to fun on these arguments (printed and returned)."""
    report = self._trace(args, kwargs)[1][2]
    print(report)
    return report


def fuse(fun, *, patterns=None) -> Fused:
  """`fun` with the patterns it computes replaced by jax_dnn ops.

  Traces fun (per argument shapes and dtypes) to a jaxpr, replaces each
  pattern of `patterns` (names, default all: attention, layer_norm,
  rms_norm, softmax, log_softmax) by the op computing it, and evaluates the
  rest as written. Composes with jit, grad, vmap, checkpoint and export
  like any JAX function; `fuse(fun).explain(*args)` tells what was fused
  and what was left to XLA, and why. Setting JAX_DNN_FUSE_LOG=1 prints it
  whenever a new signature is traced.

  Results equal fun's within the ops' tolerance; where they differ by
  design: attention rows whose keys are all masked give zeros (XLA's
  softmax gives NaN for a -inf fill, the values' mean for a finite one).
  """
  return Fused(fun, patterns)
