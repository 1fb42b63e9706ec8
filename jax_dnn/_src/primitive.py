"""The one helper every op uses to define a primitive.

`define_primitive` returns a `jax.extend.core.Primitive` named
`jax_dnn_<name>` with:
  * an abstract eval,
  * a batching rule,
  * a CUDA lowering to the FFI target of the same name (our kernel), and
  * on every other platform (and on CUDA when the kernels are unavailable or
    JAX_DNN_IMPL=reference), a lowering of the pure-JAX reference through
    `mlir.lower_fun`, and
  * a sharding rule (jax_dnn/_src/sharding.py): under jit with operands split
    over several devices, each device runs the kernel on its shard. The
    lowerings above then belong to a per-shard primitive
    `jax_dnn_<name>_shard`, which the returned primitive's lowering calls
    through `custom_partitioning` (inlined on one device).
Primitive parameters become FFI attributes, converted to the fixed-width
types the handlers decode (int -> int64, float -> float32, bool -> pred).
"""

from __future__ import annotations

from collections.abc import Callable
import functools
from typing import Any

import jax
from jax._src import dispatch
from jax.extend.core import Primitive
from jax.interpreters import batching
from jax.interpreters import mlir
import numpy as np

from jax_dnn._src import extension
from jax_dnn._src import sharding as sharding_lib

# The batch dimension of an operand that vmap did not batch.
NOT_MAPPED = None

try:  # public in jax 0.10; fall back in case a later release moves it
  from jax.core import ShapedArray
except ImportError:  # pragma: no cover
  from jax._src.core import ShapedArray  # pylint: disable=g-bad-import-order


def _ffi_attr(value: Any) -> Any:
  if isinstance(value, (bool, np.bool_)):
    return np.bool_(value)
  if isinstance(value, (int, np.integer)):
    return np.int64(value)
  if isinstance(value, (float, np.floating)):
    return np.float32(value)
  return value


def define_primitive(
    name: str,
    *,
    abstract_eval: Callable[..., Any],
    batching_rule: Callable[..., Any],
    reference: Callable[..., Any],
    multiple_results: bool,
    ffi_params: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
    supported: Callable[..., bool] | None = None,
    sharding: Callable[..., sharding_lib.Rule],
) -> Primitive:
  """Defines primitive `jax_dnn_<name>`, lowered to the FFI target of that name.

  ffi_params maps the primitive's params to the FFI attributes (default: all
  params); use it to drop params that only the reference needs.
  supported(avals_in, **params) says whether the kernel takes these operands
  (default: always); where it does not, CUDA lowers the reference too.
  sharding(operand_shapes, result_shapes, **params) gives the op's
  sharding_lib.Rule: which dimensions may be split over devices.
  """
  target = f"jax_dnn_{name}"
  prim = Primitive(target)
  prim.multiple_results = multiple_results
  prim.def_impl(functools.partial(dispatch.apply_primitive, prim))
  prim.def_abstract_eval(abstract_eval)
  batching.primitive_batchers[prim] = batching_rule

  # One shard's call: what custom_partitioning runs on each device.
  shard = Primitive(f"{target}_shard")
  shard.multiple_results = multiple_results
  shard.def_impl(functools.partial(dispatch.apply_primitive, shard))
  shard.def_abstract_eval(abstract_eval)

  def partitioned(*args, **params):
    fn = sharding_lib.partitioned(shard, multiple_results, sharding, tuple(sorted(params.items())))
    return fn(*args)

  partitioned_lowering = mlir.lower_fun(partitioned, multiple_results=multiple_results)
  direct_lowering = mlir.lower_fun(shard.bind, multiple_results=multiple_results)

  def lowering(ctx, *args, **params):
    # Where custom_partitioning cannot go, the op is lowered as one call, as
    # XLA's partitioner then treats any custom call (gathered, correct):
    # see sharding_lib.use_custom_partitioning.
    if sharding_lib.use_custom_partitioning(ctx):
      return partitioned_lowering(ctx, *args, **params)
    return direct_lowering(ctx, *args, **params)

  mlir.register_lowering(prim, lowering)
  # custom_partitioning reads the device assignment while lowering; JAX
  # provides it only to programs whose primitives ask for it.
  dispatch.prim_requires_devices_during_lowering.add(prim)

  reference_lowering = mlir.lower_fun(reference, multiple_results=multiple_results)
  kernel_lowering = jax.ffi.ffi_lowering(target)

  def cuda_lowering(ctx, *args, **params):
    if not extension.use_kernel(target) or (supported and not supported(ctx.avals_in, **params)):
      return reference_lowering(ctx, *args, **params)
    attrs = ffi_params(params) if ffi_params else params
    return kernel_lowering(ctx, *args, **{k: _ffi_attr(v) for k, v in attrs.items()})

  mlir.register_lowering(shard, reference_lowering)
  mlir.register_lowering(shard, cuda_lowering, platform="cuda")
  return prim


def vjp_op(fwd_p: Primitive, bwd_p: Primitive, bwd_argnums=None) -> Callable[..., Any]:
  """The differentiable op over a forward/backward primitive pair.

  Every jax_dnn op follows one pattern: the output is fwd_p(*args, **params);
  the backward kernels recompute what they need from the inputs, so the
  residuals are inputs (those at bwd_argnums; default all); and the gradients
  with respect to the args are the first len(args) outputs of
  bwd_p(dy, *residuals, **params) (any further outputs are workspace).
  Params are static (hashable) keywords.
  """

  @functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
  def op(params, *args):
    return fwd_p.bind(*args, **dict(params))

  def fwd(params, *args):
    keep = args if bwd_argnums is None else tuple(args[i] for i in bwd_argnums)
    return fwd_p.bind(*args, **dict(params)), (keep, len(args))

  def bwd(params, res, dy):
    keep, nargs = res
    outs = bwd_p.bind(dy.astype(keep[0].dtype), *keep, **dict(params))
    outs = outs if bwd_p.multiple_results else (outs,)
    return tuple(outs[:nargs])

  op.defvjp(fwd, bwd)
  return lambda *args, **params: op(tuple(sorted(params.items())), *args)


# --- helpers shared by batching rules ---------------------------------------


def move_to_front(x, bdim, size):
  """Returns x with its batch axis first, broadcasting an unbatched x."""
  if bdim is NOT_MAPPED:
    return jax.numpy.broadcast_to(x, (size,) + x.shape)
  return jax.numpy.moveaxis(x, bdim, 0)


def batch_size(args, dims) -> int:
  for x, d in zip(args, dims):
    if d is not NOT_MAPPED:
      return x.shape[d]
  raise ValueError("batching rule called with no batched argument")


def fold_groups(params, bdim, size, *, shared_ok: bool):
  """Folds a vmapped axis into the group axis of a [groups, width] parameter.

  Row r of the kernel's input uses parameter group r // (rows / groups), and
  the batching rules put the vmapped axis of the input first, so the batched
  parameter becomes [size * groups, width] (broadcast when unbatched).
  With shared_ok (forward rules), an unbatched single-group parameter is left
  alone, since every row uses it anyway. Backward rules must fold: each batch
  element needs its own parameter gradient (vmap of grad is per example).
  """
  if bdim is NOT_MAPPED and shared_ok and params.shape[0] == 1:
    return params
  p = move_to_front(params, bdim, size)
  return p.reshape((size * p.shape[1], p.shape[2]))


def unbatched_shape(x, bdim) -> tuple[int, ...]:
  if bdim is NOT_MAPPED:
    return tuple(x.shape)
  return tuple(s for i, s in enumerate(x.shape) if i != bdim)
