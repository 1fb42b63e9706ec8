"""Strided dgrad as stride-1 forward convolutions, one per phase."""

from __future__ import annotations

import dataclasses
import itertools
import os

import jax
from jax import lax
import jax.numpy as jnp

from jax_dnn._src.activation import NO_ACTIVATION
from jax_dnn._src import plans
from jax_dnn._src import sharding
from jax_dnn._src.mesh_types import same_manual_axes
from jax_dnn._src.primitive import ShapedArray
from jax_dnn._src.conv.primitives import conv_dgrad_p, conv_fwd_p, groups_of, output_shape, plan_for


# --- strided dgrad: stride-1 forward convolutions, one per phase -------------------------
#
# The implicit-GEMM dgrad kernels take stride 1 only (CUTLASS's sm90 conv has
# no strided dgrad). A strided dgrad splits into prod(stride) stride-1
# forward convolutions of dy, one per residue class ("phase") of dx's index
# modulo the stride, none of which multiplies an inserted zero. Per spatial
# axis (stride s, dilation d, window k, padding lo; dx extent I, dy extent O):
#   dx[i] = sum_{o, r: s o - lo + d r = i} dy[o] w[r].
# For i = s m + p, the taps r with (d r - lo) mod s = p reach dx[i], from
# o = m + (p + lo - d r) / s. Those taps step by q = s / gcd(s, d) and o by
# e = d / gcd(s, d), so with the phase's taps r_0 < ... < r_{J-1}
#   dx[s m + p] = sum_j dy[m - lo_p + e j] w[r_{J-1-j}],   m < M_p = ceil((I - p) / s),
# a stride-1 correlation with dilation e of dy with those taps flipped (and,
# as in every dgrad, input and output channels swapped within each group),
# padding lo_p = (d r_{J-1} - lo - p) / s before and whatever makes M_p
# outputs after; negative padding crops dy. A residue no tap reaches (stride
# past the window's span, a dilation sharing a factor with the stride) or
# whose taps reach only dy's padding is zero. dx interleaves the phases.
#
# This lives here, over the forward primitive, rather than as a C++ plan:
# a plan chooses one kernel launch per primitive, and the decomposition is
# several launches plus crops of dy, slices of w and the interleave, which
# are XLA ops (one fusion writes the phases into dx); each phase is then
# planned, tuned in benchmark mode, batched and sharded as any forward
# convolution. It runs only where no dgrad kernel takes the strided problem
# and a forward kernel takes every phase (the heuristic's choice); otherwise
# the dgrad primitive runs as before (XLA where no kernel takes it).


@dataclasses.dataclass(frozen=True)
class AxisPhase:
  """One residue p of one spatial axis: dx[s m + p] for m < extent, a
  stride-1 correlation of dy with the window taps `taps` (ascending; the
  phase's kernel flips them) at dilation `dilation`, padding pad_lo/pad_hi
  (negative: dy cropped)."""
  residue: int
  extent: int
  taps: tuple[int, ...]
  dilation: int
  pad_lo: int
  pad_hi: int


def axis_phases(size, window, stride, dilation, pad_lo, out) -> list[AxisPhase | None]:
  """The phases of one axis (dx extent `size`, dy extent `out`), one per
  residue 0..stride-1; None where the phase is zero."""
  phases = []
  for p in range(stride):
    extent = -(-(size - p) // stride)
    taps = tuple(r for r in range(window) if (r * dilation - pad_lo) % stride == p)
    if extent < 1 or not taps:
      phases.append(None)
      continue
    e = (taps[1] - taps[0]) * dilation // stride if len(taps) > 1 else 1
    lo = (taps[-1] * dilation - pad_lo - p) // stride  # exact: (d r - lo) = p (mod s)
    last = extent - 1 - lo + e * (len(taps) - 1)  # the last dy index it reads
    if -lo >= out or last < 0:  # reads only dy's padding
      phases.append(None)
      continue
    phases.append(AxisPhase(p, extent, taps, e, lo, last - (out - 1)))
  return phases


def _swap_channels(w, groups):
  """w [K, T, R, S, C/G] -> [C, T, R, S, K/G]: input and output channels
  swap within each group (the dgrad's kernel as a forward's)."""
  k, cg = w.shape[0], w.shape[-1]
  wt = w.reshape((groups, k // groups) + tuple(w.shape[1:4]) + (cg,))
  wt = jnp.transpose(wt, (0, 5, 2, 3, 4, 1))
  return wt.reshape((groups * cg,) + tuple(w.shape[1:4]) + (k // groups,))


@dataclasses.dataclass(frozen=True)
class Phase:
  """One phase of a strided dgrad: dx at `residues` (D, H, W) modulo the
  stride. zero: no tap reaches it. Otherwise a forward convolution of dy
  cropped by `crop` ((lo, hi) per axis) with the kernel's `taps` (slices
  per axis of the channel-swapped kernel, then flipped): operands `avals`
  (x, w, bias, residual, as the forward primitive takes them) and `params`
  (the forward's)."""
  residues: tuple[int, int, int]
  extents: tuple[int, int, int]
  zero: bool
  crop: tuple = ()
  taps: tuple = ()
  avals: tuple = ()
  params: dict = dataclasses.field(default_factory=dict)


def dgrad_phases(dy, w, params) -> list[Phase]:
  """The phases of conv_dgrad_p(dy, w, **params) (dy, w: anything with
  shape and dtype), D's residue outermost, W's innermost; an axis of
  stride 1 has one."""
  groups = groups_of(w.shape[0], params["k_per_group"])
  c = w.shape[-1] * groups
  per_axis = [axis_phases(*a) for a in zip(params["input"], w.shape[1:4], params["stride"],
                                             params["dilation"], params["pad_lo"],
                                             dy.shape[1:4])]
  fwd = {k: v for k, v in params.items() if k != "input"}
  fwd["activation"] = NO_ACTIVATION
  fwd["k_per_group"] = 0 if groups == 1 else c // groups
  fwd["stride"] = (1, 1, 1)
  phases = []
  for combo in itertools.product(*[range(s) for s in params["stride"]]):
    axes = [per_axis[i][p] for i, p in enumerate(combo)]
    extents = tuple(-(-(size - p) // s) for size, p, s in zip(params["input"], combo,
                                                             params["stride"]))
    if any(a is None for a in axes):
      phases.append(Phase(combo, extents, True))
      continue
    crop = tuple((max(-a.pad_lo, 0), max(-a.pad_hi, 0)) for a in axes)
    taps = tuple(slice(a.taps[0], a.taps[-1] + 1, a.taps[1] - a.taps[0] if len(a.taps) > 1 else 1)
                 for a in axes)
    spatial = tuple(o - lo - hi for o, (lo, hi) in zip(dy.shape[1:4], crop))
    avals = (ShapedArray((dy.shape[0], *spatial, dy.shape[-1]), dy.dtype),
             ShapedArray((c, *(len(a.taps) for a in axes), w.shape[0] // groups), w.dtype),
             ShapedArray((0,), dy.dtype), ShapedArray((0,), dy.dtype))
    p = dict(fwd, dilation=tuple(a.dilation for a in axes),
             pad_lo=tuple(max(a.pad_lo, 0) for a in axes),
             pad_hi=tuple(max(a.pad_hi, 0) for a in axes))
    phases.append(Phase(combo, extents, False, crop, taps, avals, p))
  return phases


def phases_planned(dy, w, params) -> list[Phase] | None:
  """The phases where a strided dgrad runs as them: deterministic mode,
  stride > 1, no dgrad algorithm takes the problem and a forward algorithm
  takes every phase (the heuristics' choices: benchmark mode then times
  each phase's forward against XLA's as it lowers); else None (the dgrad
  primitive). JAX_DNN_IMPL=reference (extension.use_kernel) keeps the
  primitive: its reference is XLA's own strided dgrad.

  Deterministic only: XLA's strided dgrad beats the phases and their
  interleave on every layer measured (H200, bf16: ResNet-50's stride-2
  3x3 and 1x1 layers 0.60-0.92x, the 4x4 stride-2 transposed conv 0.95x)."""
  if all(s == 1 for s in params["stride"]) or not plans.has_conv_plans():
    return None
  if not params["deterministic"]:
    return None
  if os.environ.get("JAX_DNN_IMPL", "auto").lower() == "reference":
    return None
  heuristic = dict(params, benchmark=False)
  avals = [ShapedArray(dy.shape, dy.dtype), ShapedArray(w.shape, w.dtype)]
  if plan_for("dgrad", avals, heuristic) is not None:
    return None
  phases = dgrad_phases(dy, w, params)
  for ph in phases:
    if not ph.zero and plan_for("fwd", ph.avals, dict(ph.params, benchmark=False)) is None:
      return None
  return phases


def dgrad_by_phases(dy, w, phases=None, **params):
  """conv_dgrad_p(dy, w, **params) as its phases' forward convolutions (any
  stride; `phases`: dgrad_phases's, computed where None), interleaved."""
  phases = dgrad_phases(dy, w, params) if phases is None else phases
  groups = groups_of(w.shape[0], params["k_per_group"])
  c = w.shape[-1] * groups
  s, size = params["stride"], params["input"]
  m = phases[0].extents  # residue 0 has the most rows: ceil(I / s)
  if all(ph.zero for ph in phases):
    return same_manual_axes(jnp.zeros((dy.shape[0], *size, c), dy.dtype), dy)[0]
  wt = _swap_channels(w, groups)
  outs = {}
  for ph in phases:
    if ph.zero:
      continue
    x = dy[(slice(None),) + tuple(slice(lo, o - hi) for o, (lo, hi) in zip(dy.shape[1:4],
                                                                           ph.crop))]
    k = lax.rev(wt[(slice(None),) + ph.taps], (1, 2, 3))
    empty = jnp.zeros((0,), dy.dtype)
    y = conv_fwd_p.bind(*same_manual_axes(x, k, empty, empty), **ph.params)
    if ph.extents != m:
      y = jnp.pad(y, [(0, 0)] + [(0, a - b) for a, b in zip(m, ph.extents)] + [(0, 0)])
    outs[ph.residues] = y
  first = next(iter(outs.values()))
  # Zero phases: zeros_like keeps the others' type (manual axes, sharding).
  ys = [outs.get(ph.residues) if not ph.zero else jnp.zeros_like(first) for ph in phases]
  if len(ys) == 1:
    return ys[0][:, :size[0], :size[1], :size[2]]
  # Under explicit mesh axes each reshape states its result's sharding: the
  # batch's and the channels' mesh axes (the forward's rule keeps the
  # spatial axes whole).
  spec = sharding.explicit_spec(first)
  reshape = lambda a, shape, *entries: (a.reshape(shape) if spec is None else lax.reshape(
      a, shape, out_sharding=jax.sharding.PartitionSpec(*entries)))
  n_spec, c_spec = (None, None) if spec is None else (spec[0], spec[-1])
  # [sD sH sW, N, MD, MH, MW, C] -> [N, MD, sD, MH, sH, MW, sW, C] -> dx.
  dx = reshape(jnp.stack(ys), tuple(s) + first.shape, None, None, None, n_spec, None, None,
               None, c_spec)
  dx = jnp.transpose(dx, (3, 4, 0, 5, 1, 6, 2, 7))
  dx = reshape(dx, (dx.shape[0], m[0] * s[0], m[1] * s[1], m[2] * s[2], c), n_spec, None, None,
               None, c_spec)
  return dx[:, :size[0], :size[1], :size[2]]


def dgrad_operands(fwd_avals, fwd_params):
  """The operands (dy, w) and params of the dgrad of a forward call."""
  x, w = fwd_avals[:2]
  params = {k: v for k, v in fwd_params.items() if k != "activation"}
  dy = ShapedArray(output_shape(x, w, **params), x.dtype)
  return [dy, ShapedArray(w.shape, w.dtype)], dict(params, input=tuple(x.shape[1:4]))


def dgrad(dy, w, **params):
  """The data gradient conv_dgrad_p computes: by phases where
  phases_planned says, else the primitive."""
  phases = phases_planned(dy, w, params)
  if phases is None:
    return conv_dgrad_p.bind(dy, w, **params)
  return dgrad_by_phases(dy, w, phases, **params)
