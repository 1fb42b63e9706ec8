"""The fusion patterns: one module a pattern, each with `NAME`, `ANCHORS`
(the primitives its match starts from: the equation where the replacement
runs, after every input it reads; equations after it, such as an
activation, may join the match) and `match(graph, index)`, which returns a `Match`, a `NearMiss`
(the equation looked like the pattern; the reason it was not fused) or None.
CONTRIBUTING.md has the checklist for adding one."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable


@dataclasses.dataclass
class Match:
  pattern: str
  eqns: frozenset  # graph indices the replacement computes
  inputs: tuple  # variables or literals, the replacement's arguments
  output: Any  # the one variable it produces (None: `outputs`)
  replace: Callable  # (*input values) -> output value (a list: `outputs`' values)
  op: str  # what it became, for explain
  index: int = -1  # the anchor, where the replacement runs
  outputs: tuple = ()  # the variables a match of several results produces

  def results(self) -> tuple:
    return self.outputs or (self.output,)


@dataclasses.dataclass
class NearMiss:
  pattern: str
  index: int
  reason: str


def registry():
  # pylint: disable=g-import-not-at-top
  from jax_dnn._src.fuse.patterns import attention, group_norm, lstm, norms, pooling, softmax
  # Attention first: its softmax must not be taken by the softmax pattern;
  # group norm before pooling: instance norm's spatial mean is no pooling.
  return {m.NAME: m for m in (attention, norms.LayerNorm, norms.RMSNorm, group_norm.GroupNorm,
                              softmax.Softmax, softmax.LogSoftmax, pooling.MaxPool,
                              pooling.AvgPool, lstm.LSTM)}
