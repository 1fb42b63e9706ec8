"""Forward mode and second order, for every op of op_cases.py: jax.jvp,
jax.jacfwd and check_grads' default modes ("fwd", "rev"), and jax.grad of a
function that itself takes jax.grad through an op (gradient penalties,
meta-learning). An op's tangent is one linear equation (derivatives.py):
evaluated in forward mode, transposed to the backward kernels in reverse
mode; differentiating the backward's calls once more uses each primitive's
JVP, which takes the value from the kernel and the tangent from the
reference (primitive.py)."""

import jax
from jax.sharding import NamedSharding
from jax.test_util import check_grads
import jax.numpy as jnp
import numpy as np
import pytest

from op_cases import BY_NAME, NAMES, one_per_family

SECOND_ORDER = [n for n in NAMES if BY_NAME[n].second_order]


def _penalty(fn, argnums):
  """A gradient penalty: the squared norm of d sum(fn(args) * w) / d args."""
  def loss(*args):
    shape = jax.eval_shape(fn, *args).shape
    w = jnp.cos(jnp.arange(np.prod(shape), dtype=jnp.float32)).reshape(shape)
    grads = jax.grad(lambda *a: jnp.sum(fn(*a) * w), argnums=argnums)(*args)
    return sum(jnp.sum(g * g) for g in grads)
  return loss


@pytest.mark.parametrize("name", SECOND_ORDER)
def test_grad_of_grad_matches_reference(device, name):
  del device
  case = BY_NAME[name]
  args = case.make_args(key=60)
  grad2 = lambda fn: jax.jit(jax.value_and_grad(_penalty(fn, case.argnums), argnums=case.argnums))
  # fp32 matmuls in full precision: the convolutions' kernels run fp32 as TF32
  # by default, 2^-10 relative, past this test's tolerance.
  with jax.default_matmul_precision("highest"):
    got, want = grad2(case.fn)(*args), grad2(case.reference)(*args)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-3, atol=2e-4, err_msg=name)


@pytest.mark.parametrize("name", one_per_family(
    where=lambda c: c.second_order and c.check_grads))
def test_check_grads_second_order(device, name):
  del device
  case = BY_NAME[name]
  args = case.make_args(key=80, shape=case.check_shape)
  # fp32 matmuls in full precision: the reference's tangents go through XLA,
  # whose default on GPU (TF32) is too coarse for numerical differences.
  with jax.default_matmul_precision("highest"):
    check_grads(case.fn, args, order=2, modes=("rev",), atol=2e-2, rtol=2e-2, eps=case.check_eps)


@pytest.mark.parametrize("name", NAMES)
def test_forward_mode_matches_reference(device, name):
  """jax.jvp through the op gives the reference's value and tangent, with
  tangents for the differentiable arguments (the others' are zero)."""
  del device
  case = BY_NAME[name]
  args = case.make_args(key=70)
  tangents = case.make_args(key=170)
  jvp = lambda fn: jax.jit(lambda *a: jax.jvp(
      lambda *d: fn(*[d[case.argnums.index(i)] if i in case.argnums else x
                      for i, x in enumerate(a)]),
      tuple(a[i] for i in case.argnums), tuple(tangents[i] for i in case.argnums)))
  with jax.default_matmul_precision("highest"):
    got, want = jvp(case.fn)(*args), jvp(case.reference)(*args)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-3, atol=2e-4, err_msg=name)


@pytest.mark.parametrize("name", one_per_family(where=lambda c: c.check_grads))
def test_check_grads_both_modes(device, name):
  """check_grads' default modes, through order 2, as gradient-checked
  research runs it."""
  del device
  case = BY_NAME[name]
  args = case.make_args(key=90, shape=case.check_shape)
  fn = lambda *d: case.fn(*[d[case.argnums.index(i)] if i in case.argnums else x
                            for i, x in enumerate(args)])
  with jax.default_matmul_precision("highest"):
    check_grads(fn, tuple(args[i] for i in case.argnums), order=2, modes=("fwd", "rev"),
                atol=2e-2, rtol=2e-2, eps=case.check_eps)


@pytest.mark.parametrize("name", one_per_family(where=lambda c: c.second_order))
def test_grad_of_grad_under_explicit_mesh_axes(name):
  """Under explicit mesh axes (jax.make_mesh's default) the operands carry
  their shardings; the reference's tangent runs with XLA placing its
  intermediates (the references reshape freely), and comes out typed as the
  op's result. Same values as on one device."""
  devices = jax.devices("cpu")[:8]
  mesh = jax.sharding.Mesh(np.array(devices).reshape(4, 2), ("data", "model"),
                           axis_types=(jax.sharding.AxisType.Explicit,) * 2)
  case = BY_NAME[name]
  args = case.make_args(key=85)
  grad2 = jax.jit(jax.grad(_penalty(case.fn, case.argnums), argnums=case.argnums))
  with jax.default_device(devices[0]):
    want = grad2(*args)
  with jax.set_mesh(mesh):
    split = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, case.split_specs)]
    got = grad2(*split)
  for g, w in zip(got, want, strict=True):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-4, atol=2e-5, err_msg=name)
