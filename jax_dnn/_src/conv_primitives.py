"""The convolution's primitives: forward (with the fused bias, residual and
activation), data gradient (dgrad) and weight gradient (wgrad); their
references, batching and sharding rules, the kernels' plans, and the custom
VJPs that the public ops (conv.py) call.

Layout (channels last, every spatial rank padded to 3 with leading extent-1
axes, as the FFI targets take it: ffi/conv/conv.h):
  x [N, D, H, W, C]   w [K, T, R, S, C/G]   y, dy, residual [N, O, P, Q, K]
  bias [K]. An absent bias or residual is an empty [0] array.
Output channel k belongs to group k // (K/G), which reads input channels
[g C/G, (g+1) C/G).

Params (static): k_per_group (K/G; 0: one group. G is K / k_per_group: a
device's shard of whole groups, or of one group's channels, keeps the
params), rank (the caller's spatial rank, 1-3), stride,
dilation, pad_lo, pad_hi (3-tuples in (D, H, W) order; padding >= 0: the
public ops crop negative padding), deterministic and benchmark
(jax_dnn.config's, read at trace time), precision ("default" | "high" |
"highest": what fp32 operands asked for; the kernels run fp32 as TF32, so
"highest" takes the reference); the
forward's activation (bias_act's id, -1 none); dgrad's input (D, H, W) and
wgrad's window (T, R, S), which dy and w alone do not determine.

A strided dgrad that no dgrad kernel takes runs as stride-1 forward
convolutions, one per phase (dgrad, below), where the forward's kernels take
them.

Numerics: products accumulated in fp32, results in the operands' dtype. The
references (every platform but CUDA, and problems no algorithm takes) are
lax's convolution and its transposes (dgrad, wgrad: the VJP of the forward),
accumulating in fp32.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import os

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from jax_dnn._src import activation as activation_lib
from jax_dnn._src.activation import NO_ACTIVATION
from jax_dnn._src import conv_tuning
from jax_dnn._src import plans
from jax_dnn._src import sharding
from jax_dnn._src.batching import (NOT_MAPPED, batch_size, merge_leading, move_to_front,
                                   split_leading)
from jax_dnn._src.mesh_types import like_primal, same_manual_axes
from jax_dnn._src.derivatives import custom_vjp
from jax_dnn._src.primitive import ShapedArray, define_primitive

# Activations whose derivative is a function of their output: the forward
# fuses them and the backward reads act'(z) from y. The others (gelu,
# gelu_tanh, silu) need z: under differentiation the forward then runs the
# kernel without them and applies jax_dnn's activation op after it.
_FROM_OUTPUT = frozenset(activation_lib.ACTIVATIONS[n] for n in ("relu", "sigmoid", "tanh"))

# x [N, D, H, W, C], w [K, T, R, S, C/G], y [N, O, P, Q, K] as lax sees them.
_PRECISION = {"default": lax.Precision.DEFAULT, "high": lax.Precision.HIGH,
              "highest": lax.Precision.HIGHEST}


def output_extent(size, window, stride, dilation, lo, hi):
  """One spatial extent of the forward's output."""
  return (size + lo + hi - (window - 1) * dilation - 1) // stride + 1


def groups_of(k, k_per_group) -> int:
  """The groups G of K output channels (k_per_group = K/G, 0: one group)."""
  return 1 if k_per_group == 0 else k // k_per_group


def _present(a) -> bool:
  """Whether an optional operand (bias [K], residual [N, O, P, Q, K]) is given."""
  return a.ndim == 5 or a.shape[0] != 0


# --- references (pure JAX; what runs where the kernels do not) -----------------


def _lax_conv(x, w, *, k_per_group, stride, dilation, pad_lo, pad_hi, precision, rank, **unused):
  """lax's convolution of the caller's rank (the padded leading axes dropped:
  XLA lays out 3D convolutions channels-first, with transposes around them),
  in the operands' dtype (cuDNN accumulates in fp32), as lax.conv would run."""
  del unused
  groups = groups_of(w.shape[0], k_per_group)
  lead = 3 - rank
  xs = x.reshape(x.shape[:1] + x.shape[1 + lead:])
  ws = w.reshape(w.shape[:1] + w.shape[1 + lead:])
  axes = tuple(range(rank + 2))
  nums = lax.ConvDimensionNumbers((0, rank + 1) + axes[1:-1], (0, rank + 1) + axes[1:-1],
                                  (0, rank + 1) + axes[1:-1])
  y = lax.conv_general_dilated(
      xs, ws, stride[lead:], tuple(zip(pad_lo, pad_hi))[lead:], rhs_dilation=dilation[lead:],
      dimension_numbers=nums, feature_group_count=groups, precision=_PRECISION[precision])
  return y.reshape(y.shape[:1] + (1,) * lead + y.shape[1:])


def _fwd_reference(x, w, bias, residual, *, activation, **params):
  z = _lax_conv(x, w, **params)
  if not (_present(bias) or _present(residual) or activation != NO_ACTIVATION):
    return z
  z = z.astype(jnp.float32)
  if _present(bias):
    z = z + bias.astype(jnp.float32)
  if _present(residual):
    z = z + residual.astype(jnp.float32)
  z = activation_lib.apply(z, activation)
  return z.astype(x.dtype)


def _dgrad_reference(dy, w, *, input, **params):  # pylint: disable=redefined-builtin
  x0 = jnp.zeros((dy.shape[0], *input, w.shape[-1] * groups_of(w.shape[0], params["k_per_group"])),
                 dy.dtype)
  # x0 varies over dy's manual mesh axes (inside shard_map): JAX would
  # otherwise cast it, and the VJP would add up dx over the devices (the
  # cast's transpose), which the op's own cast does once more.
  x0 = same_manual_axes(x0, dy)[0]
  _, vjp = jax.vjp(lambda x: _lax_conv(x, w, **params), x0)
  return vjp(dy)[0]


def _wgrad_reference(x, dy, *, window, **params):
  groups = groups_of(dy.shape[-1], params["k_per_group"])
  w0 = jnp.zeros((dy.shape[-1], *window, x.shape[-1] // groups),
                 x.dtype)
  w0 = same_manual_axes(w0, x)[0]  # as in _dgrad_reference
  _, vjp = jax.vjp(lambda w: _lax_conv(x, w, **params), w0)
  return vjp(dy)[0]


# --- abstract evaluation -----------------------------------------------------------


def _output_shape(x, w, *, stride, dilation, pad_lo, pad_hi, **unused):
  del unused
  out = tuple(output_extent(*a) for a in zip(x.shape[1:4], w.shape[1:4], stride, dilation,
                                               pad_lo, pad_hi))
  return (x.shape[0], *out, w.shape[0])


def _fwd_abstract(x, w, bias, residual, **params):
  del bias, residual
  return ShapedArray(_output_shape(x, w, **params), x.dtype)


def _dgrad_abstract(dy, w, *, input, k_per_group, **params):  # pylint: disable=redefined-builtin
  del params
  c = w.shape[-1] * groups_of(w.shape[0], k_per_group)
  return ShapedArray((dy.shape[0], *input, c), dy.dtype)


def _wgrad_abstract(x, dy, *, window, k_per_group, **params):
  del params
  return ShapedArray((dy.shape[-1], *window, x.shape[-1] // groups_of(dy.shape[-1], k_per_group)),
                     x.dtype)


# --- the kernels' plans (ffi/conv/conv_plan.h) ---------------------------------------


@dataclasses.dataclass(frozen=True)
class ConvKey:
  """The problem a primitive's operands pose, hashable: plans.conv_problem's
  arguments (the batch n planned as plans.LARGE where it is symbolic)."""
  op: str
  dtype: str
  n: int
  c: int
  k: int
  groups: int
  input: tuple[int, int, int]
  window: tuple[int, int, int]
  output: tuple[int, int, int]
  stride: tuple[int, int, int]
  dilation: tuple[int, int, int]
  pad_lo: tuple[int, int, int]
  pad_hi: tuple[int, int, int]
  rank: int
  activation: int = NO_ACTIVATION
  bias: bool = False
  residual: bool = False


def problem_of(key: ConvKey):
  """plans.conv_problem of a plan_key."""
  return plans.conv_problem(**{f.name: getattr(key, f.name) for f in dataclasses.fields(key)})


@functools.lru_cache(maxsize=4096)
def _plan(key, deterministic):
  return plans.conv_plan(problem_of(key), deterministic=deterministic)


def plan_key(op, avals, params) -> ConvKey | None:
  """The problem a primitive's operands pose, or None where a dimension other
  than the batch is symbolic (jax.export; a symbolic batch is planned as
  plans.LARGE, an upper bound of the workspace)."""
  bias = residual = None
  if op == "fwd":
    x, w, bias, residual = avals
    y = _output_shape(x, w, **params)
  elif op == "dgrad":
    dy, w = avals
    x, y = _dgrad_abstract(dy, w, **params), dy.shape
  else:
    x, dy = avals
    w, y = _wgrad_abstract(x, dy, **params), dy.shape
  if not plans.is_static(*x.shape[1:], *w.shape, *y[1:]):
    return None
  return ConvKey(
      op=op, dtype=jnp.dtype(x.dtype).name, n=plans.static_dim(x.shape[0], plans.LARGE),
      c=x.shape[-1], k=w.shape[0], groups=groups_of(w.shape[0], params["k_per_group"]),
      input=tuple(x.shape[1:4]), window=tuple(w.shape[1:4]), output=tuple(y[1:4]),
      stride=params["stride"], dilation=params["dilation"], pad_lo=params["pad_lo"],
      pad_hi=params["pad_hi"], rank=params["rank"],
      activation=params.get("activation", NO_ACTIVATION),
      bias=op == "fwd" and _present(bias), residual=op == "fwd" and _present(residual))


def _heuristic(key, deterministic):
  plan = _plan(key, deterministic)
  return plan if plan.supported else None


def _reference_call(op, avals, params):
  """XLA's candidate in benchmark mode: the reference with these params,
  and its operands' shapes."""
  reference = {"fwd": _fwd_reference, "dgrad": _dgrad_reference, "wgrad": _wgrad_reference}[op]
  return (functools.partial(reference, **params),
          [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals])


def _plan_for(op, avals, params):
  """The algorithm to run for these operands, or None where the reference
  (XLA) runs: where the kernels cannot take them (no registry in the
  extension, fp32 at HIGHEST precision -- exact fp32, beyond TF32 -- a
  symbolic dimension other than the batch, no algorithm supports the
  problem), and where the heuristic leaves the problem to XLA or, in
  benchmark mode, XLA timed fastest (conv_tuning.py; a symbolic batch is
  not timed: the heuristic picks)."""
  if not plans.has_conv_plans():
    return None
  if jnp.dtype(avals[0].dtype) == jnp.float32 and params["precision"] == "highest":
    return None
  key = plan_key(op, avals, params)
  if key is None:
    return None
  deterministic = bool(params["deterministic"])
  if params["benchmark"] and plans.is_static(avals[0].shape[0]):
    problem = problem_of(key)
    return conv_tuning.TUNER.choose(
        key, problem, deterministic=deterministic, precision=params["precision"],
        algorithms=plans.conv_algorithms(problem),
        heuristic=lambda: _heuristic(key, deterministic),
        reference=lambda: _reference_call(op, avals, params))
  return _heuristic(key, deterministic)


def _supported(op):
  return lambda avals, **params: _plan_for(op, avals, params) is not None


def _workspace(op):
  def workspace(avals, **params):
    return (ShapedArray((int(_plan_for(op, avals, params).workspace_bytes),), jnp.uint8),)
  return workspace


def _ffi_params(op):
  """Primitive params -> the handlers' attributes (ffi/conv: algo, groups,
  rank, stride, dilation, pad_lo, pad_hi; the forward's activation)."""
  def ffi_params(avals, **params):
    plan = _plan_for(op, avals, params)
    k = avals[0].shape[-1] if op == "dgrad" else avals[1].shape[0 if op == "fwd" else -1]
    attrs = dict(algo=int(plan.id), groups=groups_of(k, params["k_per_group"]), rank=params["rank"])
    for name in ("stride", "dilation", "pad_lo", "pad_hi"):
      attrs[name] = np.asarray(params[name], np.int64)
    if op == "fwd":
      attrs["activation"] = params["activation"]
    return attrs
  return ffi_params


# --- batching: vmap folds into the batch N, or, where the kernels (or bias)
# differ per example, into the channel groups (never a loop) -------------------------


def _fold_channels(a, bdim, size):
  """[..., C] with a vmapped axis -> [..., size * C]: copy v's channels are
  [v C, (v+1) C), so that with size * G groups, group v * G + g is copy v's g.
  (Through merge_leading: under explicit mesh axes the split carries over.)"""
  a = jnp.moveaxis(move_to_front(a, bdim, size), -1, 1)  # [size, C, N, ...]
  return jnp.moveaxis(merge_leading(a), 0, -1)


def _unfold_channels(a, size):
  """The inverse of _fold_channels, the vmapped axis in front."""
  return jnp.moveaxis(split_leading(jnp.moveaxis(a, -1, 0), size), 1, -1)


def _fold_rows(a, bdim, size):
  """[K, ...] with a vmapped axis -> [size * K, ...] (weights and biases of
  size * G groups)."""
  return merge_leading(move_to_front(a, bdim, size))


def _copy_groups(params, k):
  """Params for the copies folded into groups: one group of K channels
  becomes groups of K channels each."""
  return dict(params, k_per_group=params["k_per_group"] or k)


def _fwd_batch(args, dims, **params):
  x, w, bias, residual = args
  size = batch_size(args, dims)
  if dims[1] is NOT_MAPPED and dims[2] is NOT_MAPPED:
    x = merge_leading(move_to_front(x, dims[0], size))
    if _present(residual):
      residual = merge_leading(move_to_front(residual, dims[3], size))
    return split_leading(conv_fwd_p.bind(x, w, bias, residual, **params), size), 0
  x = _fold_channels(x, dims[0], size)
  w = _fold_rows(w, dims[1], size)
  if _present(bias):
    bias = _fold_rows(bias, dims[2], size)
  if _present(residual):
    residual = _fold_channels(residual, dims[3], size)
  params = _copy_groups(params, w.shape[0] // size)
  return _unfold_channels(conv_fwd_p.bind(x, w, bias, residual, **params), size), 0


def _dgrad_batch(args, dims, **params):
  dy, w = args
  size = batch_size(args, dims)
  if dims[1] is NOT_MAPPED:
    dx = conv_dgrad_p.bind(merge_leading(move_to_front(dy, dims[0], size)), w, **params)
    return split_leading(dx, size), 0
  w = _fold_rows(w, dims[1], size)
  params = _copy_groups(params, w.shape[0] // size)
  return _unfold_channels(conv_dgrad_p.bind(_fold_channels(dy, dims[0], size), w, **params),
                          size), 0


def _wgrad_batch(args, dims, **params):
  """Per-example weight gradients: one grouped wgrad of size * G groups."""
  x, dy = args
  size = batch_size(args, dims)
  dy = _fold_channels(dy, dims[1], size)
  params = _copy_groups(params, dy.shape[-1] // size)
  dw = conv_wgrad_p.bind(_fold_channels(x, dims[0], size), dy, **params)
  return split_leading(dw, size), 0


# --- sharding: the batch splits; with one group, output channels split with
# the kernel (forward, wgrad; dgrad then adds its partial sums) and input
# channels with it (dgrad, wgrad; a forward without bias, residual or
# activation adds its partial sums). Spatial axes stay whole (windows cross
# shard edges). ------------------------------------------------------------------------


def _dims(b, shape):
  return [b.own(s) for s in shape]


def _optional(b, shape, factors):
  return factors if len(shape) == len(factors) and shape[0] != 0 else (b.own(shape[0]),)


def _channels(b, k, c, groups):
  """The factors of K, of C and of the kernel's C/G. With groups, K and C
  are (g, K/G) and (g, C/G), which split along g only: each device runs
  whole groups."""
  if groups == 1:
    return b.factor("k", k), b.factor("c", c), "c"
  g = b.factor("g", groups)
  cg = b.factor("c", c // groups, whole=True)
  return (g, b.factor("k", k // groups, whole=True)), (g, cg), cg


def _fwd_sharding(operands, results, *, k_per_group, activation, **params):
  """x, w, bias, residual -> y. Without bias, residual and activation (the
  data gradient's transpose, a transposed convolution's backward) the input
  channels may split too: each device's y is then a partial sum, added over
  them."""
  del params
  x, w, bias, residual = operands
  linear = activation == NO_ACTIVATION and bias[0] == 0 and len(residual) == 1
  b = sharding.RuleBuilder()
  n = b.factor("n", x[0])
  k, c, cg = _channels(b, w[0], x[-1], groups_of(w[0], k_per_group))
  if not linear:
    b.whole.add(cg)
  out = (n, *_dims(b, results[0][1:4]), k)
  b.operand(n, *_dims(b, x[1:4]), c)
  b.operand(k, *_dims(b, w[1:4]), cg)
  b.operand(*_optional(b, bias, (k,)))
  b.operand(*_optional(b, residual, out))
  b.result(*out, sum_=linear)
  return b.build()


def _dgrad_sharding(operands, results, *, k_per_group, **params):
  """dy, w -> dx: dx's channels split with the kernel's input channels; with
  dy's channels split (with the kernel's output channels, as the forward
  splits them), each device's dx is a partial sum, added over them."""
  del params
  dy, w = operands
  b = sharding.RuleBuilder()
  n = b.factor("n", dy[0])
  k, c, cg = _channels(b, w[0], results[0][-1], groups_of(w[0], k_per_group))
  b.operand(n, *_dims(b, dy[1:4]), k)
  b.operand(k, *_dims(b, w[1:4]), cg)
  b.result(n, *_dims(b, results[0][1:4]), c, sum_=True)
  return b.build()


def _wgrad_sharding(operands, results, *, k_per_group, **params):
  """x, dy -> dw, summed over the devices holding batch rows."""
  del params
  x, dy = operands
  b = sharding.RuleBuilder()
  n = b.factor("n", x[0])
  k, c, cg = _channels(b, dy[-1], x[-1], groups_of(dy[-1], k_per_group))
  b.operand(n, *_dims(b, x[1:4]), c)
  b.operand(n, *_dims(b, dy[1:4]), k)
  b.result(k, *_dims(b, results[0][1:4]), cg, sum_=True)
  return b.build()


def _define(op, abstract_eval, batching_rule, reference, sharding_rule):
  """Primitive jax_dnn_conv_<op>, its kernel planned by conv_plan for `op`."""
  return define_primitive(
      f"conv_{op}",
      abstract_eval=abstract_eval,
      batching_rule=batching_rule,
      reference=reference,
      multiple_results=False,
      ffi_params=_ffi_params(op),
      supported=_supported(op),
      workspace=_workspace(op),
      sharding=sharding_rule,
  )


conv_fwd_p = _define("fwd", _fwd_abstract, _fwd_batch, _fwd_reference, _fwd_sharding)
conv_dgrad_p = _define("dgrad", _dgrad_abstract, _dgrad_batch, _dgrad_reference, _dgrad_sharding)
conv_wgrad_p = _define("wgrad", _wgrad_abstract, _wgrad_batch, _wgrad_reference, _wgrad_sharding)


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
  if _plan_for("dgrad", avals, heuristic) is not None:
    return None
  phases = dgrad_phases(dy, w, params)
  for ph in phases:
    if not ph.zero and _plan_for("fwd", ph.avals, dict(ph.params, benchmark=False)) is None:
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
  dy = ShapedArray(_output_shape(x, w, **params), x.dtype)
  return [dy, ShapedArray(w.shape, w.dtype)], dict(params, input=tuple(x.shape[1:4]))


def dgrad(dy, w, **params):
  """The data gradient conv_dgrad_p computes: by phases where
  phases_planned says, else the primitive."""
  phases = phases_planned(dy, w, params)
  if phases is None:
    return conv_dgrad_p.bind(dy, w, **params)
  return dgrad_by_phases(dy, w, phases, **params)


# --- custom VJPs ----------------------------------------------------------------------


def _geometry(params):
  """The params dgrad and wgrad share with the forward (all but activation)."""
  return {k: v for k, v in params.items() if k != "activation"}


def _act_backward(dy, saved, activation):
  """g = dy * act'(z), from y (relu, sigmoid, tanh) or from z (the others)."""
  if activation == NO_ACTIVATION:
    return dy
  if activation not in _FROM_OUTPUT:
    return activation_lib.activation_bwd_p.bind(dy, saved, activation=activation)
  y, g = saved.astype(jnp.float32), dy.astype(jnp.float32)
  name = activation_lib.NAMES[activation]
  if name == "relu":
    g = jnp.where(y > 0, g, 0.0)
  elif name == "sigmoid":
    g = g * y * (1.0 - y)
  else:  # tanh
    g = g * (1.0 - y * y)
  return g.astype(dy.dtype)


def _kernel_fuses(operands, params) -> bool:
  """Whether the forward kernel takes the activation fused: False only
  where the plan takes the problem without it but not with it (the
  kernels fuse some activations). Asked while tracing, of the heuristic
  (nothing is timed at trace time: in benchmark mode the lowering times
  the form chosen here); elsewhere both forms compute the same."""
  if params["activation"] == NO_ACTIVATION or not plans.has_conv_plans():
    return True
  params = dict(params, benchmark=False)
  if _plan_for("fwd", operands, params) is not None:
    return True
  return _plan_for("fwd", operands, dict(params, activation=NO_ACTIVATION)) is None


def _fused_forward(x, w, bias, residual, params):
  """act(conv + bias + residual): in one kernel where it fuses the
  activation, else the kernel and jax_dnn's activation op after it."""
  if _kernel_fuses((x, w, bias, residual), params):
    return conv_fwd_p.bind(x, w, bias, residual, **params)
  z = conv_fwd_p.bind(x, w, bias, residual, **dict(params, activation=NO_ACTIVATION))
  return activation_lib.activation_fwd_p.bind(z, activation=params["activation"])


@functools.partial(custom_vjp, nondiff_argnums=(0,))
def _conv(params, x, w, bias, residual):
  return _fused_forward(x, w, bias, residual, dict(params))


def _conv_fwd(params, x, w, bias, residual):
  p = dict(params)
  act = p["activation"]
  if act == NO_ACTIVATION or act in _FROM_OUTPUT:
    y = _fused_forward(x, w, bias, residual, p)
    saved = y
  else:
    saved = conv_fwd_p.bind(x, w, bias, residual, **dict(p, activation=NO_ACTIVATION))
    y = activation_lib.activation_fwd_p.bind(saved, activation=act)
  return y, (x, w, bias, residual, saved)


def _conv_bwd(params, res, dy):
  x, w, bias, residual, saved = res
  p = dict(params)
  geo = _geometry(p)
  g = _act_backward(dy.astype(x.dtype), saved, p["activation"])
  dx = dgrad(g, w, input=tuple(x.shape[1:4]), **geo)
  dw = conv_wgrad_p.bind(x, g, window=tuple(w.shape[1:4]), **geo)
  dbias = (jnp.sum(g.astype(jnp.float32), axis=(0, 1, 2, 3)).astype(bias.dtype)
           if _present(bias) else jnp.zeros_like(bias))
  dres = g.astype(residual.dtype) if _present(residual) else jnp.zeros_like(residual)
  return tuple(like_primal(ct, a) for ct, a in zip((dx, dw, dbias, dres),
                                                    (x, w, bias, residual)))


_conv.defvjp(_conv_fwd, _conv_bwd)


@functools.partial(custom_vjp, nondiff_argnums=(0,))
def _dgrad(params, dy, w):
  return dgrad(dy, w, **dict(params))


def _dgrad_fwd(params, dy, w):
  return _dgrad(params, dy, w), (dy, w)


def _dgrad_bwd(params, res, g):
  """dgrad is linear in dy and w: <dgrad(dy, w), g> = <dy, fwd(g, w)>."""
  dy, w = res
  geo = {k: v for k, v in dict(params).items() if k != "input"}
  empty = jnp.zeros((0,), dy.dtype)
  g, w, bias, residual = same_manual_axes(g.astype(dy.dtype), w, empty, empty)
  ddy = conv_fwd_p.bind(g, w, bias, residual, activation=NO_ACTIVATION, **geo)
  dw = conv_wgrad_p.bind(g, dy, window=tuple(w.shape[1:4]), **geo)
  return like_primal(ddy, dy), like_primal(dw, w)


_dgrad.defvjp(_dgrad_fwd, _dgrad_bwd)


def conv(x, w, bias, residual, **params):
  """act(conv(x, w) + bias + residual) over the canonical layout (see the
  file header); bias and residual [0] when absent. Differentiable."""
  return _conv(tuple(sorted(params.items())), *same_manual_axes(x, w, bias, residual))


def conv_dgrad(dy, w, **params):
  """The data gradient of conv(x, w) (no bias or activation) for x of
  spatial extents params["input"]: the transposed convolution.
  Differentiable."""
  return _dgrad(tuple(sorted(params.items())), *same_manual_axes(dy, w))
