"""How a primitive splits over a device mesh (jit with sharded operands).

A custom call is opaque to XLA's partitioner: without a rule it gathers every
operand onto every device and runs the whole op there, redundantly. Each
jax_dnn primitive therefore describes, with a `Rule`, which dimensions of its
operands and results may be split across devices (batch rows, heads, the
columns of an elementwise op) and which each kernel needs whole (a softmax
row, a normalized width, a sequence). `partitioned` wraps a primitive's
bind in `jax.experimental.custom_partitioning` with that rule: the
partitioner then runs the kernel on each device's shard, adds up partial
parameter gradients with a psum, and moves data only where an operand
arrives split along a dimension that must be whole.

On one device the wrapper is inlined: the program is the plain kernel call.
Works with both partitioners (Shardy, the default, through the rule string;
GSPMD through `infer_sharding_from_operands`). Under explicit mesh axes the
operands' shardings are in their types, and `shard_mapped` applies the same
rule while tracing instead.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Union

import jax
from jax._src import sharding_impls
from jax.experimental.custom_partitioning import custom_partitioning
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

# A dimension's factor: a name, or a compound (major, ..., minor) of names
# whose sizes multiply to the dimension (query heads = kv heads x group).
Factor = Union[str, tuple[str, ...]]


@dataclasses.dataclass(frozen=True)
class Rule:
  """Which dimensions of a primitive's arrays may be split over devices.

  operands, results: one factor per dimension of each array. Dimensions that
    share a factor are split alike.
  sizes: every factor's size.
  whole: factors the kernel needs whole (never split).
  sums: indices of results that are sums over rows (parameter gradients):
    each shard computes a partial sum; they are added (psum) over the mesh
    axes of every operand factor the result does not have.
  (A kernel's workspace is no result of the primitive: define_primitive
  appends it in the CUDA lowering of each shard.)
  """
  operands: tuple[tuple[Factor, ...], ...]
  results: tuple[tuple[Factor, ...], ...]
  sizes: dict[str, int]
  whole: frozenset[str] = frozenset()
  sums: frozenset[int] = frozenset()

  def names(self, factor: Factor) -> tuple[str, ...]:
    return factor if isinstance(factor, tuple) else (factor,)

  def split_name(self, factor: Factor) -> str | None:
    """The name a dimension splits along: the compound's first name of size
    > 1 (splitting a compound along a later name is a contiguous split only
    when the names before it have size 1), unless it must stay whole."""
    for name in self.names(factor):
      if self.sizes[name] > 1:
        return None if name in self.whole else name
    return None


class RuleBuilder:
  """Assembles a Rule array by array; factor names made unique where needed."""

  def __init__(self):
    self.operands, self.results = [], []
    self.sizes: dict[str, int] = {}
    self.whole: set[str] = set()
    self.sums: set[int] = set()
    self._count = 0

  def own(self, size: int, *, whole: bool = True) -> str:
    """A factor of this dimension alone (whole by default)."""
    self._count += 1
    name = f"u{self._count}"
    self.sizes[name] = size
    if whole:
      self.whole.add(name)
    return name

  def factor(self, name: str, size: int, *, whole: bool = False) -> str:
    if self.sizes.setdefault(name, size) != size:
      raise ValueError(f"sharding rule: factor {name} has sizes {self.sizes[name]} and {size}")
    if whole:
      self.whole.add(name)
    return name

  def operand(self, *factors: Factor):
    self.operands.append(tuple(factors))

  def result(self, *factors: Factor, sum_: bool = False):
    if sum_:
      self.sums.add(len(self.results))
    self.results.append(tuple(factors))

  def build(self) -> Rule:
    return Rule(tuple(self.operands), tuple(self.results), dict(self.sizes), frozenset(self.whole),
                frozenset(self.sums))


def rows_then(builder: RuleBuilder, shape, last: Factor | None = None) -> tuple[Factor, ...]:
  """Factors r0, r1, ... (splittable) for the leading dimensions of `shape`,
  then `last` for its last dimension (None: every dimension is a row)."""
  n = len(shape) if last is None else len(shape) - 1
  rows = tuple(builder.factor(f"r{i}", s) for i, s in enumerate(shape[:n]))
  return rows if last is None else rows + (last,)


def same_shape(shape, operands: int, whole_axis: int | None = None) -> Rule:
  """`operands` arrays and one result, all of `shape`, split alike along
  every dimension but `whole_axis` (elementwise ops, softmax)."""
  builder = RuleBuilder()
  x = list(rows_then(builder, shape))
  if whole_axis is not None:
    x[whole_axis] = builder.own(shape[whole_axis])
  for _ in range(operands):
    builder.operand(*x)
  builder.result(*x)
  return builder.build()


def param_set_rows(builder: RuleBuilder, shape, param_sets: int, last: Factor):
  """Factors of x [..., W] whose rows use parameter set r // (rows / G)
  (G > 1 where vmap batched the parameters), and the factor of G.

  Rows split freely under one parameter set. Under G sets they split only along
  a first dimension of size G (vmap's axis, the parameters split alike, so
  each shard's rows still find their param_sets); otherwise they stay whole.
  """
  if param_sets == 1:
    return rows_then(builder, shape, last), builder.own(1)
  if len(shape) >= 2 and shape[0] == param_sets:
    x = rows_then(builder, shape, last)
    return x, x[0]
  x = tuple(builder.own(s) for s in shape[:-1]) + (last,)
  return x, builder.own(param_sets)


# --- the partitioner's callbacks ------------------------------------------------


def _entries(mesh, sharding, ndim):
  """The mesh axes splitting each dimension, or None where the sharding is
  not one a PartitionSpec of this mesh expresses (mesh sub-axes, from a
  reshape upstream): that operand then counts as unsplit, and the
  partitioner reshards it to what `partition` asks for."""
  if len(sharding.device_set) != mesh.size:  # not over this mesh's devices
    return None
  try:
    hlo = sharding._to_xla_hlo_sharding(ndim)  # pylint: disable=protected-access
    spec = sharding_impls.parse_flatten_op_sharding(hlo, mesh)[0]
  except Exception:  # pylint: disable=broad-except
    return None
  return _spec_entries(spec, ndim)


def _assign(rule: Rule, mesh, arg_shapes) -> dict[str, tuple[str, ...]]:
  """Mesh axes of each factor, from the operands' shardings."""
  return _assign_entries(rule, mesh.shape, [
      _entries(mesh, arg.sharding, arg.ndim) or () for arg in arg_shapes])


def _assign_entries(rule: Rule, mesh_shape, entries) -> dict[str, tuple[str, ...]]:
  """Mesh axes of each factor: taken from the first operand dimension split
  along it, where the axes are free and divide the factor's size.
  entries: for each operand, the mesh axes splitting each dimension."""
  axes: dict[str, tuple[str, ...]] = {}
  used: set[str] = set()
  for factors, arg_entries in zip(rule.operands, entries):
    for factor, entry in zip(factors, arg_entries):
      name = rule.split_name(factor)
      if not entry or name is None or name in axes or used & set(entry):
        continue
      if rule.sizes[name] % math.prod(mesh_shape[a] for a in entry):
        continue
      axes[name] = entry
      used |= set(entry)
  return axes


def axis_names(entry) -> tuple[str, ...]:
  """A PartitionSpec entry as the tuple of mesh axes it names."""
  return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def spec_entry(names):
  """Mesh axes as a PartitionSpec entry (None, one name, or a tuple)."""
  return None if not names else names[0] if len(names) == 1 else tuple(names)


def is_explicit(mesh) -> bool:
  """Whether arrays on `mesh` carry their sharding in their types."""
  return not mesh.empty and bool(getattr(mesh, "explicit_axes", ()))


def explicit_spec(x):
  """x's PartitionSpec, one entry a dimension, under explicit mesh axes;
  None elsewhere (where a reshape needs no sharding of its own)."""
  aval = jax.typeof(x)
  if not is_explicit(aval.sharding.mesh):
    return None
  spec = tuple(aval.sharding.spec)
  return spec + (None,) * (aval.ndim - len(spec))


def _spec_entries(spec, ndim):
  spec = tuple(spec) + (None,) * (ndim - len(spec))
  return [axis_names(e) for e in spec]


def typed_result_specs(rule: Rule, avals_in, mesh) -> list[PartitionSpec]:
  """Under explicit mesh axes (jax.sharding.AxisType.Explicit) every array's
  type carries its sharding: the results' PartitionSpecs, read from the
  operands' by the rule, as `partition` splits them (a dimension the kernel
  needs whole, or a parameter gradient summed over the devices, is
  unsplit)."""
  axes = _typed_axes(rule, avals_in, mesh)
  return [_sharding(rule, mesh, axes, factors).spec for factors in rule.results]


def _typed_axes(rule: Rule, avals_in, mesh) -> dict[str, tuple[str, ...]]:
  """Mesh axes of each factor, from the shardings in the operands' types."""
  return _assign_entries(rule, mesh.shape, [
      _spec_entries(a.sharding.spec, a.ndim) for a in avals_in])


def mesh_of(avals):
  """The mesh of the first of `avals` placed on one (None if none is)."""
  return next((a.sharding.mesh for a in avals if not a.sharding.mesh.empty), None)


def _sharding(rule: Rule, mesh, axes, factors) -> NamedSharding:
  spec = [spec_entry(axes.get(rule.split_name(factor), ())) for factor in factors]
  return NamedSharding(mesh, PartitionSpec(*spec))


def _summed_axes(rule: Rule, axes, index) -> tuple[str, ...]:
  """Mesh axes a sum result is added over: those of operand factors it lacks."""
  have = {n for f in rule.results[index] for n in rule.names(f)}
  out = []
  for factors in rule.operands:
    for f in factors:
      name = rule.split_name(f)
      if name in axes and name not in have:
        out += [a for a in axes[name] if a not in out]
  return tuple(out)


def _as_tuple(x):
  return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def _per_device(prim, params, rule: Rule, axes):
  """One device's program: prim on its blocks, each sum result added over
  the mesh axes of the operand factors it lacks (in fp32: bf16 dk, dv of
  multi-query attention). Returns a tuple."""
  sums = {i: _summed_axes(rule, axes, i) for i in rule.sums}

  def body(*args):
    outs = list(_as_tuple(prim.bind(*args, **params)))
    for i, names in sums.items():
      if names:
        outs[i] = jax.lax.psum(outs[i].astype(jnp.float32), names).astype(outs[i].dtype)
    return tuple(outs)

  return body


def explicit_mesh(ctx):
  """The mesh of a lowering whose operands carry explicit sharding types
  (jax.sharding.AxisType.Explicit) over several devices, else None."""
  axis_context = ctx.module_context.axis_context
  if isinstance(axis_context, sharding_impls.SPMDAxisContext) and axis_context.manual_axes:
    return None  # inside shard_map: per-device operands already
  mesh = mesh_of(ctx.avals_in)
  if mesh is None or not is_explicit(mesh) or mesh.size == 1:
    return None
  return mesh


def shard_mapped(prim, multiple_results: bool, rule: Rule, avals_in, mesh, params):
  """prim.bind(*args, **params) as a shard_map over `mesh`, for operands
  whose types carry their sharding (explicit mesh axes; avals_in).

  There the shardings are known while tracing, so the rule is applied then:
  operands are resharded to what the rule takes (a dimension the kernel
  needs whole is gathered), each device calls prim on its blocks, sums are
  added with a psum, and the results come out typed as typed_result_specs
  says. (custom_partitioning, the path of the other meshes, traces its
  per-device program under the caller's mesh: under explicit axes that
  program kept sharding annotations that XLA could not run on jax 0.11.2.)
  Every mesh axis is manual in the body: axes of a mixed mesh that are not
  explicit carry no sharding in the types and count as replicated.
  """
  axes = _typed_axes(rule, avals_in, mesh)
  in_specs = tuple(_sharding(rule, mesh, axes, f).spec for f in rule.operands)
  out_specs = [_sharding(rule, mesh, axes, f).spec for f in rule.results]
  body = _per_device(prim, params, rule, axes)

  def call(*args):
    args = [a if _spec_entries(jax.typeof(a).sharding.spec, a.ndim) == _spec_entries(sp, a.ndim)
            else jax.sharding.reshard(a, NamedSharding(mesh, sp)) for a, sp in zip(args, in_specs)]
    outs = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=tuple(out_specs),
                         check_vma=False)(*args)
    return list(outs) if multiple_results else outs[0]

  return call


def use_custom_partitioning(ctx) -> bool:
  """Whether a lowering may go through custom_partitioning:
    - not inside shard_map: a manual axis context has per-device operands
      already (custom_partitioning inlines a wholly manual one itself, but a
      partly manual one aborts XLA's partitioner);
    - not for jax.export: custom_partitioning's Python callbacks cannot be
      serialized;
    - not with jax_remove_custom_partitioning_ptr_from_cache_key: the op's
      parameters (epsilon, is_causal, ...) live only in those callbacks, so
      two programs differing in one would share a compilation cache entry.
  """
  axis_context = ctx.module_context.axis_context
  if isinstance(axis_context, sharding_impls.SPMDAxisContext) and axis_context.manual_axes:
    return False
  if ctx.module_context.lowering_parameters.for_export:
    return False
  return not jax.config.jax_remove_custom_partitioning_ptr_from_cache_key


# Bounded: one entry per primitive and distinct parameters (scale, epsilon
# are floats); a compiled program keeps its own callbacks alive.
@functools.lru_cache(maxsize=1024)
def partitioned(prim, multiple_results: bool, rule_fn, params_items):
  """prim.bind(*args, **params) as a custom_partitioning function.

  rule_fn(operand_shapes, result_shapes, **params) -> Rule (shapes only: it
  also runs on Shardy's types, which carry no JAX dtype)."""
  params = dict(params_items)

  def call(*args):
    return prim.bind(*args, **params)

  fn = custom_partitioning(call)

  def rule_of(arg_shapes, results):
    return rule_fn([tuple(a.shape) for a in arg_shapes], [tuple(r.shape) for r in results], **params)

  def infer(mesh, arg_shapes, result_shape):  # GSPMD's propagation
    rule = rule_of(arg_shapes, _as_tuple(result_shape))
    axes = _assign(rule, mesh, arg_shapes)
    out = [_sharding(rule, mesh, axes, f) for f in rule.results]
    return out if multiple_results else out[0]

  def partition(mesh, arg_shapes, result_shape):
    results = _as_tuple(result_shape)
    rule = rule_of(arg_shapes, results)
    axes = _assign(rule, mesh, arg_shapes)
    arg_sh = tuple(_sharding(rule, mesh, axes, f) for f in rule.operands)
    res_sh = [_sharding(rule, mesh, axes, f) for f in rule.results]
    body = _per_device(prim, params, rule, axes)

    def lower(*args):
      outs = body(*args)
      return list(outs) if multiple_results else outs[0]

    return mesh, lower, res_sh if multiple_results else res_sh[0], arg_sh

  def sdy_rule(mesh, operand_types, result_types):
    del mesh
    rule = rule_fn([tuple(t.shape) for t in operand_types], [tuple(t.shape) for t in result_types],
                   **params)
    return sdy_string(rule), sdy_options(rule)

  # decode_shardings=False: the operands' shardings arrive as they are and
  # _entries reads them, so that one no PartitionSpec expresses cannot fail
  # inside JAX before `partition` sees it.
  fn.def_partition(partition, infer_sharding_from_operands=infer, sharding_rule=sdy_rule,
                   decode_shardings=False)
  return fn


# --- Shardy's rule string ------------------------------------------------------------
# A compound dimension is one factor here: Shardy would split it along mesh
# sub-axes (2 of a 4-device axis for K = 2 kv heads, the rest for the
# group), shardings that no PartitionSpec expresses. So Shardy only learns
# which dimensions may split; `partition` ties query heads to kv heads.


def _sdy_name(factor: Factor) -> str:
  return "_".join(factor) if isinstance(factor, tuple) else factor


def sdy_string(rule: Rule) -> str:
  def arrays(xs):
    return ", ".join(" ".join(_sdy_name(f) for f in fs) for fs in xs)
  return f"{arrays(rule.operands)} -> {arrays(rule.results)}"


def sdy_options(rule: Rule) -> dict[str, Any]:
  """The factors kept whole, in the order the rule names them (Shardy's)."""
  dims = [f for fs in rule.operands + rule.results for f in fs]
  whole = [_sdy_name(f) for f in dims if rule.split_name(f) is None and not _size1(rule, f)]
  whole = list(dict.fromkeys(whole))
  return {"need_replication_factors": tuple(whole)} if whole else {}


def _size1(rule: Rule, factor: Factor) -> bool:
  return all(rule.sizes[n] == 1 for n in rule.names(factor))
