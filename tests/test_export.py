"""jax.export of programs that call our kernels, for every op of op_cases.py:
refused by JAX's custom-call safety check unless the caller accepts our
targets with `jax_dnn.export_disabled_checks()`; the exported program then
runs the same kernels. With a symbolic batch size, the exported program
equals the jitted one at any size."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_dnn
from op_cases import BY_NAME, NAMES


def _export_for_cuda(fn, args, **kw):
  return jax.export.export(jax.jit(fn), platforms=("cuda",), **kw)(*args)


def _value_and_grad(case):
  loss = lambda *a: jnp.sum(jnp.sin(case.fn(*a).astype(jnp.float32)))
  return jax.value_and_grad(loss, argnums=case.argnums)


def _require_cuda_handlers():
  if not jax_dnn.has_cuda_kernels():
    pytest.skip("jax_dnn was built without CUDA kernels: the CUDA lowering is the reference")


@pytest.mark.parametrize("name", NAMES)
def test_cuda_export_needs_the_disabled_checks(name):
  _require_cuda_handlers()
  case = BY_NAME[name]
  if not case.lowering_here:
    pytest.skip(f"{name}: its own test file exports the shapes its kernels take")
  args = case.make_args(case.kernel_dtype)
  fn = _value_and_grad(case)
  with pytest.raises(ValueError, match="custom calls whose targets have no compatibility"):
    _export_for_cuda(fn, args)
  text = _export_for_cuda(fn, args, disabled_checks=jax_dnn.export_disabled_checks()).mlir_module()
  for target in case.targets:
    assert f"custom_call @{target}(" in text, target


def test_no_kernels_no_checks_needed():
  """Without the extension there is nothing to accept (the list is empty
  exactly when no target is registered)."""
  assert bool(jax_dnn.export_disabled_checks()) == bool(
      jax_dnn._extension.registered_targets())  # pylint: disable=protected-access


@pytest.mark.gpu
@pytest.mark.parametrize("name", NAMES)
def test_exported_program_runs_the_kernels(gpu, name):
  """The exported value and gradients equal the jitted ones on the GPU."""
  del gpu
  case = BY_NAME[name]
  args = case.make_args(case.kernel_dtype)
  fn = _value_and_grad(case)
  exported = _export_for_cuda(fn, args, disabled_checks=jax_dnn.export_disabled_checks())
  got, want = exported.call(*args), jax.jit(fn)(*args)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))


def _symbolic_specs(case, dtype):
  """The arguments' shapes with "b" for their batch dimensions (Arg.batch),
  which the table derives from the leading argument's dimension 0."""
  b, = jax.export.symbolic_shape("b")
  specs = []
  for a in case.args:
    shape = list(a.shape(case.shape))
    if a.batch is not None:
      assert shape[a.batch] == case.shape[0], (case.name, a)
      shape[a.batch] = b
    specs.append(jax.ShapeDtypeStruct(tuple(shape), dtype if a.dtype is None else a.dtype))
  return specs


@pytest.mark.parametrize("name", NAMES)
def test_export_with_a_symbolic_batch(name):
  """jax.export with a shape-polymorphic batch: the exported program, called
  at two sizes, equals the jitted one. (CPU, the reference path, which has
  no workspace; the CUDA lowering sizes the kernels' workspaces for a
  symbolic batch from the plans' upper bounds:
  test_cuda_export_with_a_symbolic_batch.)"""
  case = BY_NAME[name]
  fn = _value_and_grad(case)
  exported = jax.export.export(jax.jit(fn), platforms=("cpu",),
                               disabled_checks=jax_dnn.export_disabled_checks())(
                                   *_symbolic_specs(case, jnp.float32))
  for size in (3, 5):
    args = case.make_args(key=90, shape=(size,) + case.shape[1:])
    with jax.default_device(jax.devices("cpu")[0]):
      got, want = exported.call(*args), jax.jit(fn)(*args)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
      np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("name", NAMES)
def test_cuda_export_with_a_symbolic_batch(name):
  """The CUDA lowering under a symbolic batch calls the kernels. Lowering
  only: such a program has not been run on a GPU."""
  _require_cuda_handlers()
  case = BY_NAME[name]
  if not case.lowering_here:
    pytest.skip(f"{name}: its own test file exports the shapes its kernels take")
  if not case.symbolic_batch:
    pytest.skip(f"{name}: its plan needs the batch; a symbolic one runs the reference")
  text = _export_for_cuda(_value_and_grad(case), _symbolic_specs(case, case.kernel_dtype),
                          disabled_checks=jax_dnn.export_disabled_checks()).mlir_module()
  for target in case.targets:
    assert f"custom_call @{target}(" in text, target
