"""The convolution's primitives: forward (with the fused bias, residual and
activation), data gradient (dgrad) and weight gradient (wgrad); their
references, batching and sharding rules, the kernels' plans, and the custom
VJPs (vjp.py) that the public ops (api.py) call.

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
convolutions, one per phase (phases.py), where the forward's kernels take
them.

Numerics: products accumulated in fp32, results in the operands' dtype. The
references (every platform but CUDA, and problems no algorithm takes) are
lax's convolution and its transposes (dgrad, wgrad: the VJP of the forward),
accumulating in fp32.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from jax_dnn._src import activation as activation_lib
from jax_dnn._src.activation import NO_ACTIVATION
from jax_dnn._src.conv import tuning as conv_tuning
from jax_dnn._src import plans
from jax_dnn._src import sharding
from jax_dnn._src.batching import NOT_MAPPED, batch_size, merge_leading, move_to_front, split_leading
from jax_dnn._src.mesh_types import same_manual_axes
from jax_dnn._src.primitive import ShapedArray, define_primitive

# Activations whose derivative is a function of their output: the forward
# fuses them and the backward reads act'(z) from y. The others (gelu,
# gelu_tanh, silu) need z: under differentiation the forward then runs the
# kernel without them and applies jax_dnn's activation op after it.
# x [N, D, H, W, C], w [K, T, R, S, C/G], y [N, O, P, Q, K] as lax sees them.
_PRECISION = {"default": lax.Precision.DEFAULT, "high": lax.Precision.HIGH,
              "highest": lax.Precision.HIGHEST}


def output_extent(size, window, stride, dilation, lo, hi):
  """One spatial extent of the forward's output."""
  return (size + lo + hi - (window - 1) * dilation - 1) // stride + 1


def groups_of(k, k_per_group) -> int:
  """The groups G of K output channels (k_per_group = K/G, 0: one group)."""
  return 1 if k_per_group == 0 else k // k_per_group


def present(a) -> bool:
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
  if not (present(bias) or present(residual) or activation != NO_ACTIVATION):
    return z
  z = z.astype(jnp.float32)
  if present(bias):
    z = z + bias.astype(jnp.float32)
  if present(residual):
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


def output_shape(x, w, *, stride, dilation, pad_lo, pad_hi, **unused):
  del unused
  out = tuple(output_extent(*a) for a in zip(x.shape[1:4], w.shape[1:4], stride, dilation,
                                               pad_lo, pad_hi))
  return (x.shape[0], *out, w.shape[0])


def _fwd_abstract(x, w, bias, residual, **params):
  del bias, residual
  return ShapedArray(output_shape(x, w, **params), x.dtype)


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
    y = output_shape(x, w, **params)
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
      bias=op == "fwd" and present(bias), residual=op == "fwd" and present(residual))


def _heuristic(key, deterministic):
  plan = _plan(key, deterministic)
  return plan if plan.supported else None


def _reference_call(op, avals, params):
  """XLA's candidate in benchmark mode: the reference with these params,
  and its operands' shapes."""
  reference = {"fwd": _fwd_reference, "dgrad": _dgrad_reference, "wgrad": _wgrad_reference}[op]
  return (functools.partial(reference, **params),
          [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals])


def plan_for(op, avals, params):
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
  return lambda avals, **params: plan_for(op, avals, params) is not None


def _workspace(op):
  def workspace(avals, **params):
    return (ShapedArray((int(plan_for(op, avals, params).workspace_bytes),), jnp.uint8),)
  return workspace


def _ffi_params(op):
  """Primitive params -> the handlers' attributes (ffi/conv: algo, groups,
  rank, stride, dilation, pad_lo, pad_hi; the forward's activation)."""
  def ffi_params(avals, **params):
    plan = plan_for(op, avals, params)
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
    if present(residual):
      residual = merge_leading(move_to_front(residual, dims[3], size))
    return split_leading(conv_fwd_p.bind(x, w, bias, residual, **params), size), 0
  x = _fold_channels(x, dims[0], size)
  w = _fold_rows(w, dims[1], size)
  if present(bias):
    bias = _fold_rows(bias, dims[2], size)
  if present(residual):
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
