"""`custom_vjp`: jax.custom_vjp's interface, differentiable in forward mode too.

An op's backward runs our backward kernels; jax.custom_vjp alone refuses
forward mode (jax.jvp, jax.jacfwd, jax.hessian, check_grads' default
modes). Here the op is a jax.custom_jvp whose tangent is one `tangent_p`
equation, linear in the inputs' tangents:
  * evaluated (forward mode), it is the JVP of the op's own function, whose
    primitives' JVPs take their tangents from the references (primitive.py);
  * transposed (reverse mode: grad, vjp), it is the op's backward, `bwd`,
    on the residuals `fwd` saved: the backward kernels, as under
    jax.custom_vjp;
  * batched, it stays one equation over vmapped functions, so that a grad
    of a vmap still transposes to the (batched) backward kernels;
  * differentiated again (forward over anything), it is the JVP of its
    evaluation.
Only the tangents that are not symbolic zeros are linear operands: the
backward is asked for the cotangents of those alone.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
import functools
from typing import Any

import jax
from jax.custom_derivatives import SymbolicZero
from jax.extend.core import Primitive
from jax.interpreters import ad
from jax.interpreters import batching
from jax.interpreters import mlir
import numpy as np

from jax_dnn._src.batching import batch_size, move_to_front

try:  # public in jax 0.10; fall back in case a later release moves it
  from jax.core import ShapedArray
except ImportError:  # pragma: no cover
  from jax._src.core import ShapedArray  # pylint: disable=g-bad-import-order

# --- the linear equation ------------------------------------------------------------
#
# tangent_p(*residuals, *linear; fun, transpose, num_residuals, out_avals):
#   fun(residuals, linear) -> outputs (linear in `linear`),
#   transpose(residuals, cotangents) -> the cotangents of `linear`,
# both over flat lists of arrays; out_avals: the outputs' types.

tangent_p = Primitive("jax_dnn_tangent")
tangent_p.multiple_results = True


def _split(args, num_residuals):
  return list(args[:num_residuals]), list(args[num_residuals:])


def _evaluate(*args, fun, transpose, num_residuals, out_avals):
  del transpose
  outs = fun(*_split(args, num_residuals))
  return [o.astype(a.dtype) for o, a in zip(outs, out_avals)]


tangent_p.def_impl(_evaluate)
tangent_p.def_abstract_eval(lambda *args, out_avals, **_: list(out_avals))
mlir.register_lowering(tangent_p, mlir.lower_fun(_evaluate, multiple_results=True))


def _transpose_rule(cts, *args, fun, transpose, num_residuals, out_avals):
  del fun
  residuals, linear = _split(args, num_residuals)
  if any(ad.is_undefined_primal(r) for r in residuals):
    raise ValueError("jax_dnn: an op's tangent is linear in its inputs' tangents only")
  cts = [ad.instantiate_zeros(ct) if type(ct) is ad.Zero else ct for ct in cts]  # pylint: disable=unidiomatic-typecheck
  cts = [ct.astype(a.dtype) for ct, a in zip(cts, out_avals)]
  lin_cts = transpose(residuals, cts)
  return [None] * num_residuals + [ct if ad.is_undefined_primal(x) else None
                                   for ct, x in zip(lin_cts, linear)]


ad.primitive_transposes[tangent_p] = _transpose_rule


def _jvp_rule(primals, tangents, *, fun, transpose, num_residuals, out_avals):
  res_t, lin_t = _split(tangents, num_residuals)
  params = dict(fun=fun, transpose=transpose, num_residuals=num_residuals, out_avals=out_avals)
  outs = tangent_p.bind(*primals, **params)
  if all(type(t) is ad.Zero for t in res_t):  # pylint: disable=unidiomatic-typecheck
    # Linear in what varies: the tangent is the same equation (and so it
    # still transposes to the backward).
    lin_t = [ad.instantiate_zeros(t) for t in lin_t]
    return outs, tangent_p.bind(*primals[:num_residuals], *lin_t, **params)
  tangents = [ad.instantiate_zeros(t) for t in tangents]
  evaluate = lambda *a: _evaluate(*a, **params)
  return outs, list(jax.jvp(evaluate, tuple(primals), tuple(tangents))[1])


ad.primitive_jvps[tangent_p] = _jvp_rule


def _batch_rule(args, dims, *, fun, transpose, num_residuals, out_avals):
  size = batch_size(args, dims)
  residuals, linear = _split(args, num_residuals)
  res_dims, lin_dims = _split(dims, num_residuals)
  # Linear operands all batched (tangents of unbatched inputs broadcast, and
  # their cotangents summed by the broadcast's transpose, as vmap does for
  # jax.custom_vjp); residuals keep their dims, so unbatched weights stay
  # unbatched for the backward kernels' batching rules.
  linear = [move_to_front(x, d, size) for x, d in zip(linear, lin_dims)]
  res_axes = list(res_dims)
  vfun = jax.vmap(lambda r, l: fun(r, l), in_axes=(res_axes, 0), out_axes=0)
  vtranspose = jax.vmap(lambda r, c: transpose(r, c), in_axes=(res_axes, 0), out_axes=0)
  # The mapped outputs keep their manual-axis types (vmap inside shard_map);
  # shape and dtype come from the vmapped function.
  shapes = jax.eval_shape(vfun, residuals, linear)
  avals = tuple(_mapped(a, o) for a, o in zip(out_avals, shapes))
  outs = tangent_p.bind(*residuals, *linear, fun=vfun, transpose=vtranspose,
                        num_residuals=num_residuals, out_avals=avals)
  return outs, [0] * len(outs)


batching.primitive_batchers[tangent_p] = _batch_rule


def _mapped(aval, shape):
  """aval with the vmapped axis in front: its other types (sharding,
  manual axes) kept, the new axis unsplit."""
  sharding = getattr(aval, "sharding", None)
  spec = getattr(sharding, "spec", None)
  if spec is None:
    return ShapedArray(shape.shape, shape.dtype)
  spec = jax.sharding.PartitionSpec(None, *spec, *(None,) * (len(aval.shape) - len(spec)))
  return aval.update(shape=shape.shape, dtype=shape.dtype, sharding=sharding.update(spec=spec))


# --- custom_vjp ----------------------------------------------------------------------


def _is_array(x) -> bool:
  return isinstance(x, (jax.Array, np.ndarray, np.generic)) or hasattr(x, "aval")


def _tangent_aval(x) -> ShapedArray:
  aval = jax.typeof(x)
  to_tangent = getattr(aval, "to_tangent_aval", None)
  return to_tangent() if to_tangent is not None else aval.at_least_vspace()


class custom_vjp:  # pylint: disable=invalid-name
  """As jax.custom_vjp(fun, nondiff_argnums): `op.defvjp(fwd, bwd)`, with
  fwd(*args) -> (out, residuals) and bwd(*nondiff, residuals, cotangents)
  -> one cotangent (or None) a differentiable argument. Differentiable in
  forward mode too (the module's header says how)."""

  def __init__(self, fun: Callable[..., Any], nondiff_argnums: Sequence[int] = ()):
    self.fun = fun
    self.nondiff_argnums = tuple(nondiff_argnums)
    functools.update_wrapper(self, fun)
    self._op = None

  def defvjp(self, fwd: Callable[..., Any], bwd: Callable[..., Any]) -> None:
    op = jax.custom_jvp(self.fun, nondiff_argnums=self.nondiff_argnums)
    nondiff = self.nondiff_argnums

    def jvp(*args):
      static, (primals, tangents) = args[:len(nondiff)], args[len(nondiff):]
      out, residuals = fwd(*_merge(nondiff, static, primals))
      out_leaves, out_tree = jax.tree.flatten(out)
      live = [i for i, t in enumerate(tangents) if not isinstance(t, SymbolicZero)]
      if not live:
        return out, jax.tree.unflatten(out_tree, [SymbolicZero(_tangent_aval(o))
                                                  for o in out_leaves])
      # Residuals: what fwd saved, then the primals (the forward-mode
      # tangent's inputs). Leaves that are no arrays stay in the closures.
      res_leaves, res_tree = jax.tree.flatten((residuals, tuple(primals)))
      arrays = [i for i, r in enumerate(res_leaves) if _is_array(r)]

      def unpack(res_arrays):
        leaves = list(res_leaves)
        for i, r in zip(arrays, res_arrays):
          leaves[i] = r
        return jax.tree.unflatten(res_tree, leaves)

      def evaluate(res_arrays, lin):
        _, prims = unpack(res_arrays)
        full = [jax.numpy.zeros_like(p) if isinstance(t, SymbolicZero) else None
                for p, t in zip(prims, tangents)]
        for i, t in zip(live, lin):
          full[i] = t
        full = [np.zeros(np.shape(p), jax.dtypes.float0) if _is_int(p) else t
                for p, t in zip(prims, full)]
        f = lambda *p: self.fun(*_merge(nondiff, static, p))
        return jax.tree.leaves(jax.jvp(f, tuple(prims), tuple(full))[1])

      def transpose(res_arrays, cts):
        saved, prims = unpack(res_arrays)
        grads = bwd(*static, saved, jax.tree.unflatten(out_tree, cts))
        return [jax.numpy.zeros_like(prims[i]) if grads[i] is None else grads[i]
                for i in live]

      avals = tuple(_tangent_aval(o) for o in out_leaves)
      outs = tangent_p.bind(*(res_leaves[i] for i in arrays), *(tangents[i] for i in live),
                            fun=evaluate, transpose=transpose, num_residuals=len(arrays),
                            out_avals=avals)
      return out, jax.tree.unflatten(out_tree, outs)

    op.defjvp(jvp, symbolic_zeros=True)
    self._op = op

  def __call__(self, *args):
    if self._op is None:
      raise AttributeError(f"{self.fun.__name__}: defvjp was not called")
    return self._op(*args)


def _is_int(x) -> bool:
  return not jax.numpy.issubdtype(jax.numpy.result_type(x), jax.numpy.inexact)


def _merge(nondiff, static, primals):
  """The full argument list from the static and the differentiable ones."""
  args, static, primals = [], list(static), list(primals)
  for i in range(len(static) + len(primals)):
    args.append(static.pop(0) if i in nondiff else primals.pop(0))
  return args
