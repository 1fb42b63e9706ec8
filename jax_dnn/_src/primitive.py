"""The one helper every op uses to define a primitive.

`define_primitive` returns a `jax.extend.core.Primitive` named
`jax_dnn_<name>` with:
  * an abstract eval,
  * a batching rule,
  * a CUDA lowering to the FFI target of the same name (our kernel), which
    appends the kernel's workspace to the call's results and drops it again
    (sized while lowering, by the kernels' plans: plans.py), and
  * on every other platform (and on CUDA when the kernels are unavailable or
    JAX_DNN_IMPL=reference), a lowering of the pure-JAX reference through
    `mlir.lower_fun`, and
  * the types JAX tracks on a mesh (mesh_types.py): inside `shard_map`
    (check_vma) results vary over the mesh axes their operands vary over;
    under explicit mesh axes, results carry the sharding the op's rule gives
    them, and
  * a sharding rule (jax_dnn/_src/sharding.py): under jit with operands split
    over several devices, each device runs the kernel on its shard. The
    lowerings above then belong to a per-shard primitive
    `jax_dnn_<name>_shard`, which the returned primitive's lowering calls
    through `custom_partitioning` (inlined on one device), or, under
    explicit mesh axes, through a `shard_map` built from the operands' types.
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
from jax.interpreters import ad
from jax.interpreters import batching
from jax.interpreters import mlir
import numpy as np

from jax_dnn._src import derivatives
from jax_dnn._src import extension
from jax_dnn._src import mesh_types
from jax_dnn._src import sharding as sharding_lib

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
    ffi_params: Callable[..., dict[str, Any]] | None = None,
    supported: Callable[..., bool] | None = None,
    workspace: Callable[..., tuple[ShapedArray, ...]] | None = None,
    sharding: Callable[..., sharding_lib.Rule],
) -> Primitive:
  """Defines primitive `jax_dnn_<name>`, lowered to the FFI target of that name.

  The hooks below run in the CUDA lowering of a registered kernel only, on
  the operands that kernel call gets (after vmap folded its axis, one
  device's shard), and may ask the kernels' plans (plans.py):
  supported(avals_in, **params) says whether the kernel takes these operands
  (default: always); where it does not, CUDA lowers the reference too.
  ffi_params(avals_in, **params) gives the FFI attributes (default: all
  params); use it to drop params that only the reference needs, or to add
  a plan's choice.
  workspace(avals_in, **params) gives the kernel's workspace arrays: extra
  results of the FFI call after the primitive's own, which the lowering
  drops. The abstract eval, reference, batching and sharding rules never see
  them.
  sharding(operand_shapes, result_shapes, **params) gives the op's
  sharding_lib.Rule: which dimensions may be split over devices.
  """
  target = f"jax_dnn_{name}"
  prim = Primitive(target)
  prim.multiple_results = multiple_results
  prim.def_impl(functools.partial(dispatch.apply_primitive, prim))
  prim.def_abstract_eval(mesh_types.typed(abstract_eval, target, sharding, explicit_types=True))
  batching.primitive_batchers[prim] = batching_rule

  # One shard's call: what custom_partitioning runs on each device.
  shard = Primitive(f"{target}_shard")
  shard.multiple_results = multiple_results
  shard.def_impl(functools.partial(dispatch.apply_primitive, shard))
  shard.def_abstract_eval(mesh_types.typed(abstract_eval, target, sharding, explicit_types=False))

  def partitioned(*args, **params):
    fn = sharding_lib.partitioned(shard, multiple_results, sharding, tuple(sorted(params.items())))
    return fn(*args)

  partitioned_lowering = mlir.lower_fun(partitioned, multiple_results=multiple_results)
  direct_lowering = mlir.lower_fun(shard.bind, multiple_results=multiple_results)

  def lowering(ctx, *args, **params):
    # Under explicit mesh axes the operands' shardings are in their types:
    # the rule is applied while tracing, through shard_map.
    mesh = sharding_lib.explicit_mesh(ctx)
    if mesh is not None:
      rule = sharding([a.shape for a in ctx.avals_in], [o.shape for o in ctx.avals_out], **params)
      call = sharding_lib.shard_mapped(shard, multiple_results, rule, ctx.avals_in, mesh, params)
      return mlir.lower_fun(call, multiple_results=multiple_results)(ctx, *args)
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
    attrs = ffi_params(ctx.avals_in, **params) if ffi_params else params
    extra = tuple(workspace(ctx.avals_in, **params)) if workspace else ()
    outs = kernel_lowering(ctx.replace(avals_out=[*ctx.avals_out, *extra]), *args,
                           **{k: _ffi_attr(v) for k, v in attrs.items()})
    return outs[:len(ctx.avals_out)]

  mlir.register_lowering(shard, reference_lowering)
  mlir.register_lowering(shard, cuda_lowering, platform="cuda")

  # Differentiating the primitive itself: forward mode through an op (its
  # tangent evaluates the op's function under jax.jvp, derivatives.py) and
  # higher orders (jax.grad of a function that takes jax.grad through an
  # op). The value is still the kernel's; the tangent is the reference's
  # (XLA), whose linear part JAX transposes.
  def jvp(primals, tangents, **params):
    tangents = tuple(ad.instantiate_zeros(t) for t in tangents)
    out = prim.bind(*primals, **params)

    def tangent(primals, tangents):
      t = jax.jvp(functools.partial(reference, **params), primals, tangents)[1]
      return tuple(t) if multiple_results else t

    mesh = sharding_lib.mesh_of(map(jax.typeof, primals))
    if mesh is not None and sharding_lib.is_explicit(mesh):
      # The references reshape freely; under explicit mesh axes XLA places
      # their intermediates, and the tangents come out typed as the results.
      out_sharding = tuple(jax.typeof(o).sharding for o in (out if multiple_results else [out]))
      tangent = jax.sharding.auto_axes(
          tangent, axes=tuple(mesh.explicit_axes),
          out_sharding=out_sharding if multiple_results else out_sharding[0])
    return out, tangent(tuple(primals), tangents)

  ad.primitive_jvps[prim] = jvp
  return prim


def vjp_op(fwd_p: Primitive, bwd_p: Primitive, bwd_argnums=None, saved: int = 0
           ) -> Callable[..., Any]:
  """The differentiable op over a forward/backward primitive pair.

  Every jax_dnn op follows one pattern: the output is fwd_p(*args, **params);
  the residuals are inputs (those at bwd_argnums; default all) followed by
  the forward's `saved` extra results (statistics the backward would
  otherwise recompute, e.g. layer norm's mean and rstd: fwd_p then returns
  (output, *saved)); and bwd_p(dy, *residuals, **params) gives the gradients
  with respect to the args. Params are static (hashable) keywords.
  """

  def forward(params, args):
    out = fwd_p.bind(*args, **dict(params))
    return (out[0], tuple(out[1:])) if saved else (out, ())

  @functools.partial(derivatives.custom_vjp, nondiff_argnums=(0,))
  def op(params, *args):
    return forward(params, args)[0]

  def fwd(params, *args):
    y, extra = forward(params, args)
    keep = args if bwd_argnums is None else tuple(args[i] for i in bwd_argnums)
    # All args ride along (only layer norm's bias is not in keep): their
    # types decide the cotangents' shardings under explicit mesh axes.
    return y, (keep + extra, args)

  def bwd(params, res, dy):
    keep, args = res
    outs = bwd_p.bind(dy.astype(keep[0].dtype), *keep, **dict(params))
    outs = outs if bwd_p.multiple_results else (outs,)
    return tuple(mesh_types.like_primal(ct, a) for ct, a in zip(outs, args))

  op.defvjp(fwd, bwd)
  return lambda *args, **params: op(tuple(sorted(params.items())),
                                    *mesh_types.same_manual_axes(*args))
