"""The one helper every op uses to define a primitive.

`define_primitive` returns a `jax.extend.core.Primitive` named
`jax_dnn_<name>` with:
  * an abstract eval,
  * a batching rule,
  * a CUDA lowering to the FFI target of the same name (our kernel), and
  * on every other platform (and on CUDA when the kernels are unavailable or
    JAX_DNN_IMPL=reference), a lowering of the pure-JAX reference through
    `mlir.lower_fun`, and
  * manual-axis types inside `shard_map` (check_vma): results vary over the
    mesh axes their operands vary over (`same_manual_axes` first makes the
    operands agree); under explicit mesh axes, results typed with the
    sharding the op's rule gives them, and
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


def _varying(aval) -> frozenset:
  mat = getattr(aval, "manual_axis_type", None)
  return frozenset(mat.varying) if mat is not None else frozenset()


def same_manual_axes(*args):
  """args, each cast to vary over every manual mesh axis that any of them
  varies over (inside shard_map with check_vma; elsewhere args unchanged).

  Our primitives take operands of one type: an x that varies over "data"
  with a scale that does not gives a result (and a dscale) that varies. The
  cast is outside the custom VJP, so JAX transposes it into the psum that
  the gradient of a parameter shared by every device needs.
  """
  varying = [_varying(jax.typeof(a)) for a in args]
  union = frozenset().union(*varying)
  if not union:
    return args
  return tuple(jax.lax.pcast(a, tuple(sorted(union - v, key=str)), to="varying") if union - v
               else a for a, v in zip(args, varying))


def _typed(abstract_eval, prim_name, rule_fn, *, explicit_types: bool):
  """abstract_eval whose results carry the types JAX tracks beyond shape and
  dtype, where it tracks them:
    - inside shard_map (check_vma): the operands' manual-axis type;
    - under explicit mesh axes: the sharding the op's rule gives each result.
  Elsewhere the results are abstract_eval's, unchanged. The per-shard
  primitive takes no explicit types (explicit_types=False): it only runs on
  one device's blocks (inside custom_partitioning or shard_map)."""

  def rule(*avals, **params):
    outs = abstract_eval(*avals, **params)
    varying = [_varying(a) for a in avals]
    mesh = sharding_lib.mesh_of(avals)
    explicit = explicit_types and mesh is not None and sharding_lib.is_explicit(mesh)
    if not any(varying) and not explicit:
      return outs
    if any(v != varying[0] for v in varying):
      raise ValueError(f"{prim_name}: operands vary over different manual mesh axes "
                       f"{[sorted(v, key=str) for v in varying]} (cast them with "
                       "jax.lax.pcast(..., to='varying'))")
    mat = avals[0].manual_axis_type
    if mat.unreduced or mat.reduced:
      raise ValueError(f"{prim_name}: unreduced or reduced operands are not supported; "
                       "reduce them first")
    multiple = isinstance(outs, (list, tuple))
    out_list = list(outs) if multiple else [outs]
    if explicit:
      op_rule = rule_fn([a.shape for a in avals], [o.shape for o in out_list], **params)
      specs = sharding_lib.typed_result_specs(op_rule, avals, mesh)
    else:
      specs = [jax.sharding.PartitionSpec()] * len(out_list)
    typed = [o.update(sharding=jax.sharding.NamedSharding(mesh, spec), manual_axis_type=mat)
             for o, spec in zip(out_list, specs)]
    return typed if multiple else typed[0]

  return rule


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
  prim.def_abstract_eval(_typed(abstract_eval, target, sharding, explicit_types=True))
  batching.primitive_batchers[prim] = batching_rule

  # One shard's call: what custom_partitioning runs on each device.
  shard = Primitive(f"{target}_shard")
  shard.multiple_results = multiple_results
  shard.def_impl(functools.partial(dispatch.apply_primitive, shard))
  shard.def_abstract_eval(_typed(abstract_eval, target, sharding, explicit_types=False))

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
      call = sharding_lib.shard_mapped(shard, multiple_results, rule, ctx.avals_in, ctx.avals_out,
                                       mesh, params)
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
    attrs = ffi_params(params) if ffi_params else params
    return kernel_lowering(ctx, *args, **{k: _ffi_attr(v) for k, v in attrs.items()})

  mlir.register_lowering(shard, reference_lowering)
  mlir.register_lowering(shard, cuda_lowering, platform="cuda")

  # Differentiating the primitive itself (not the op, whose custom VJP calls
  # the kernels) happens only in higher-order reverse mode -- jax.grad of a
  # function that takes jax.grad through an op, jax.hessian's reverse parts
  # aside (forward mode stops at the op's custom_vjp). The value is still the
  # kernel's; the tangent is the reference's (XLA), whose linear part JAX
  # transposes.
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
  (output, *saved)); and the gradients with respect to the args are the
  first len(args) outputs of bwd_p(dy, *residuals, **params) (any further
  outputs are workspace). Params are static (hashable) keywords.
  """

  def forward(params, args):
    out = fwd_p.bind(*args, **dict(params))
    return (out[0], tuple(out[1:])) if saved else (out, ())

  @functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
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
    return tuple(like_primal(ct, a) for ct, a in zip(outs[:len(args)], args))

  op.defvjp(fwd, bwd)
  return lambda *args, **params: op(tuple(sorted(params.items())), *same_manual_axes(*args))


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
  return merge_leading(move_to_front(params, bdim, size))


def _explicit_spec(x):
  """x's PartitionSpec, one entry a dimension, under explicit mesh axes;
  None elsewhere (where a reshape needs no sharding of its own)."""
  aval = jax.typeof(x)
  if not sharding_lib.is_explicit(aval.sharding.mesh):
    return None
  spec = tuple(aval.sharding.spec)
  return spec + (None,) * (aval.ndim - len(spec))


def merge_leading(x):
  """[m, n, ...] -> [m * n, ...]: vmap's axis folded into a batch as its
  major part. Under explicit mesh axes the merged dimension is split by m's
  mesh axes then n's; a split of n alone (no contiguous split of the merged
  dimension) is gathered first."""
  shape = (x.shape[0] * x.shape[1],) + tuple(x.shape[2:])
  spec = _explicit_spec(x)
  if spec is None:
    return x.reshape(shape)
  P = jax.sharding.PartitionSpec  # pylint: disable=invalid-name
  if spec[0] is None and spec[1] is not None and x.shape[0] > 1:
    x, spec = jax.sharding.reshard(x, P(None, None, *spec[2:])), (None, None) + spec[2:]
  names = sharding_lib.axis_names(spec[0]) + sharding_lib.axis_names(spec[1])
  merged = sharding_lib.spec_entry(names)
  return jax.lax.reshape(x, shape, out_sharding=P(merged, *spec[2:]))


def split_leading(x, size):
  """[size * n, ...] -> [size, n, ...], the inverse of merge_leading. Under
  explicit mesh axes the mesh axes splitting the merged dimension go to
  `size` as far as they divide it, the rest to n (gathered where they do
  not divide it)."""
  shape = (size, x.shape[0] // size) + tuple(x.shape[1:])
  spec = _explicit_spec(x)
  if spec is None:
    return x.reshape(shape)
  P = jax.sharding.PartitionSpec  # pylint: disable=invalid-name
  mesh = jax.typeof(x).sharding.mesh
  names = sharding_lib.axis_names(spec[0])
  k = 0
  while k < len(names) and size % int(np.prod([mesh.shape[a] for a in names[:k + 1]])) == 0:
    k += 1
  if shape[1] % int(np.prod([mesh.shape[a] for a in names[k:]])):
    x, names = jax.sharding.reshard(x, P(None, *spec[1:])), ()
  return jax.lax.reshape(x, shape, out_sharding=P(sharding_lib.spec_entry(names[:k]),
                                                  sharding_lib.spec_entry(names[k:]), *spec[1:]))


def like_primal(ct, primal):
  """A cotangent resharded to its primal's type under explicit mesh axes
  (JAX requires the custom VJP's cotangents to have the primals' types;
  the op's rule may split a gradient differently, e.g. dK as Q's batch)."""
  want = _explicit_spec(primal)
  if want is None or _explicit_spec(ct) == want:
    return ct
  return jax.sharding.reshard(ct, jax.sharding.PartitionSpec(*want))


def unbatched_shape(x, bdim) -> tuple[int, ...]:
  if bdim is NOT_MAPPED:
    return tuple(x.shape)
  return tuple(s for i, s in enumerate(x.shape) if i != bdim)
