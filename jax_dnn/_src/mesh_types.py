"""The types JAX gives arrays on a device mesh beyond shape and dtype, as
jax_dnn's primitives take and give them.

  * Inside shard_map (check_vma), an array's manual-axis type says which
    mesh axes it varies over: a primitive's results vary over the axes its
    operands vary over (`same_manual_axes` first makes the operands agree).
  * Under explicit mesh axes (jax.sharding.AxisType.Explicit) an array's
    type carries its sharding: a primitive's results carry the sharding the
    op's rule gives them (sharding.typed_result_specs), and the custom VJPs'
    cotangents their primals' (`like_primal`).
"""

from __future__ import annotations

import jax

from jax_dnn._src import sharding as sharding_lib


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


def typed(abstract_eval, prim_name, rule_fn, *, explicit_types: bool):
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
    typed_outs = [o.update(sharding=jax.sharding.NamedSharding(mesh, spec), manual_axis_type=mat)
                  for o, spec in zip(out_list, specs)]
    return typed_outs if multiple else typed_outs[0]

  return rule


def like_primal(ct, primal):
  """A cotangent resharded to its primal's type under explicit mesh axes
  (JAX requires the custom VJP's cotangents to have the primals' types;
  the op's rule may split a gradient differently, e.g. dK as Q's batch)."""
  want = sharding_lib.explicit_spec(primal)
  if want is None or sharding_lib.explicit_spec(ct) == want:
    return ct
  return jax.sharding.reshard(ct, jax.sharding.PartitionSpec(*want))
