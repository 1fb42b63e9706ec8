"""A flat jaxpr as a dataflow graph: who produces a variable, who uses it,
which values are constants. Patterns (patterns/) match over it.

`flatten` inlines nested `jit` calls (they do not change what a program
computes), so that `jax.nn.silu` or Flax's `_where` inside a jit reads as
their operations; control flow, remat and custom derivative rules stay
whole equations (rewrite.py recurses into their bodies)."""

from __future__ import annotations

import collections
import dataclasses
import functools
import importlib.util
import os
from typing import Any

import jax
import numpy as np
from jax.extend import core

_INLINED = ("jit", "pjit", "closed_call", "core_call")
_LIBRARIES = ("flax", "optax", "jax_dnn")


@functools.lru_cache(maxsize=None)
def _library_dirs() -> tuple[str, ...]:
  dirs = []
  for name in _LIBRARIES:
    spec = importlib.util.find_spec(name)
    if spec is not None and spec.origin:
      dirs.append(os.path.dirname(spec.origin) + os.sep)
  return tuple(dirs)


def _read(env, v):
  return v.val if isinstance(v, core.Literal) else env[v]


def bind(eqn, vals):
  """eqn's primitive applied to vals, under eqn's source info (so that a
  rewritten program still names the user's lines)."""
  from jax._src import source_info_util  # pylint: disable=g-import-not-at-top
  bound = eqn.primitive.get_bind_params(eqn.params)
  subfuns, params = bound if isinstance(bound, tuple) else ((), bound)  # jax 0.10: a pair
  with source_info_util.user_context(eqn.source_info.traceback,
                                     name_stack=eqn.source_info.name_stack), eqn.ctx.manager:
    outs = eqn.primitive.bind(*subfuns, *vals, **params)
  return list(outs) if eqn.primitive.multiple_results else [outs]


def inline_eval(jaxpr, consts, *args):
  """Evaluates `jaxpr`, running the bodies of nested jit calls in place."""
  env = dict(zip(jaxpr.constvars, consts))
  env.update(zip(jaxpr.invars, args))
  for eqn in jaxpr.eqns:
    vals = [_read(env, v) for v in eqn.invars]
    if eqn.primitive.name in _INLINED:
      inner = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
      closed = inner if hasattr(inner, "consts") else core.ClosedJaxpr(inner, ())
      outs = inline_eval(closed.jaxpr, closed.consts, *vals)
    else:
      outs = bind(eqn, vals)
    env.update(zip(eqn.outvars, outs))
  return [_read(env, v) for v in jaxpr.outvars]


def flatten(closed) -> core.ClosedJaxpr:
  avals = [v.aval for v in closed.jaxpr.invars]
  return jax.make_jaxpr(lambda *a: inline_eval(closed.jaxpr, closed.consts, *a))(*avals)


@dataclasses.dataclass
class Graph:
  jaxpr: Any
  consts: dict  # constvar -> value

  def __post_init__(self):
    self.eqns = list(self.jaxpr.eqns)
    self.producer = {}
    self.users = collections.defaultdict(list)
    for i, eqn in enumerate(self.eqns):
      for v in eqn.outvars:
        self.producer[v] = i
      for v in eqn.invars:
        if not isinstance(v, core.Literal):
          self.users[v].append(i)
    self.outputs = {v for v in self.jaxpr.outvars if not isinstance(v, core.Literal)}

  def eqn_of(self, v, *prims):
    """(index, equation) producing v when it is one of `prims` (any, if none)."""
    if isinstance(v, core.Literal) or v not in self.producer:
      return None
    i = self.producer[v]
    eqn = self.eqns[i]
    if prims and eqn.primitive.name not in prims:
      return None
    return i, eqn

  def through(self, v, *prims):
    """Follows v back through the shape-preserving `prims` (e.g. converts):
    the variable they start from, and the equations passed."""
    passed = []
    while True:
      hit = self.eqn_of(v, *prims)
      if hit is None:
        return v, passed
      passed.append(hit[0])
      v = hit[1].invars[0]

  def constant(self, v, depth=12):
    """v's value when it depends on literals and constants alone (a mask
    built from iota, a scale from sqrt(d)), else None."""
    if isinstance(v, core.Literal):
      return np.asarray(v.val)
    if v in self.consts:
      return np.asarray(self.consts[v])
    hit = self.eqn_of(v)
    if hit is None or depth == 0:
      return None
    eqn = hit[1]
    if eqn.primitive.name in ("custom_jvp_call", "custom_vjp_call", "scan", "while", "cond"):
      return None
    vals = [self.constant(x, depth - 1) for x in eqn.invars]
    if any(x is None for x in vals):
      return None
    with jax.ensure_compile_time_eval():
      outs = bind(eqn, vals)
    return np.asarray(outs[eqn.outvars.index(v)])

  def split_constant(self, eqn):
    """A binary equation's (variable operand, constant operand's value,
    the constant's position), the constant taken second where both are;
    None when neither is constant."""
    for pos in (1, 0):
      value = self.constant(eqn.invars[pos])
      if value is not None:
        return eqn.invars[1 - pos], value, pos
    return None

  def source(self, i) -> str:
    """file:line of the user's code that made equation i: the innermost
    frame outside jax and the libraries a model calls through (Flax's
    pooling is not the line to look at)."""
    try:
      from jax._src import source_info_util  # pylint: disable=g-import-not-at-top
      frames = list(source_info_util.user_frames(self.eqns[i].source_info.traceback))
      mine = [f for f in frames if not f.file_name.startswith(_library_dirs())]
      frame = (mine or frames or [None])[0]
      return f"{frame.file_name}:{frame.start_line}" if frame else ""
    except Exception:  # pylint: disable=broad-except
      return ""
