"""jax.export of programs that call our kernels: refused by JAX's custom-call
safety check unless the caller accepts our targets with
`jax_dnn.export_disabled_checks()`; the exported program then runs the same
kernels."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_dnn
from helpers import randn


def _loss(q, k, v, x, scale):
  o = jax_dnn.dot_product_attention(q, k, v, is_causal=True)
  y = jax_dnn.layer_norm(x, scale, scale)
  return jnp.sum(o.astype(jnp.float32) ** 2) + jnp.sum(y.astype(jnp.float32) ** 2)


def _args(dtype):
  q, k, v = (randn(i, (2, 64, 4, 64), dtype) for i in range(3))
  return q, k, v, randn(3, (16, 96), dtype), randn(4, (96,), jnp.float32, offset=1.0)


def _export_for_cuda(fn, args, **kw):
  return jax.export.export(jax.jit(fn), platforms=("cuda",), **kw)(*args)


def test_cuda_export_needs_the_disabled_checks():
  if not jax_dnn.has_cuda_kernels():
    pytest.skip("jax_dnn was built without CUDA kernels: the CUDA lowering is the reference")
  args = _args(jnp.bfloat16)
  fn = jax.grad(_loss, argnums=(0, 1, 2, 3, 4))
  with pytest.raises(ValueError, match="custom calls whose targets have no compatibility"):
    _export_for_cuda(fn, args)
  text = _export_for_cuda(fn, args, disabled_checks=jax_dnn.export_disabled_checks()).mlir_module()
  for target in ("jax_dnn_attention_fwd", "jax_dnn_attention_bwd", "jax_dnn_layer_norm_fwd",
                 "jax_dnn_layer_norm_bwd"):
    assert f"custom_call @{target}(" in text, target


def test_no_kernels_no_checks_needed():
  """Without the extension there is nothing to accept (the list is empty
  exactly when no target is registered)."""
  assert bool(jax_dnn.export_disabled_checks()) == bool(
      jax_dnn._extension.registered_targets())  # pylint: disable=protected-access


@pytest.mark.gpu
def test_exported_program_runs_the_kernels(gpu):
  """The exported value and gradients equal the jitted ones on the GPU."""
  del gpu
  args = _args(jnp.bfloat16)
  fn = jax.value_and_grad(_loss, argnums=(0, 1, 2, 3, 4))
  exported = _export_for_cuda(fn, args, disabled_checks=jax_dnn.export_disabled_checks())
  got, want = exported.call(*args), jax.jit(fn)(*args)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))


# Every op, its value and gradient, for export with a symbolic leading
# dimension ("b"): (fn, argument shapes with "b" for the symbolic one).
_POLY_CASES = {
    "gelu": (jax_dnn.gelu, [("b", 16)]),
    "bias_act": (lambda x, s: jax_dnn.bias_act(x, s, "gelu"), [("b", 16), (16,)]),
    "softmax": (lambda x: jax_dnn.softmax(x, axis=0), [("b", 16)]),
    "layer_norm": (jax_dnn.layer_norm, [("b", 3, 16), (16,), (16,)]),
    "rms_norm": (jax_dnn.rms_norm, [("b", 16), (16,)]),
    "attention": (lambda q: jax_dnn.dot_product_attention(q, q, q, is_causal=True),
                  [("b", 8, 2, 32)]),
}


@pytest.mark.parametrize("name", _POLY_CASES)
def test_export_with_a_symbolic_batch(name):
  """jax.export with a shape-polymorphic leading dimension: the exported
  program, called at two sizes, equals the jitted one. (CPU, the reference
  path, which has no workspace; the CUDA lowering sizes the kernels'
  workspaces for a symbolic batch from the plans' upper bounds:
  test_cuda_export_with_a_symbolic_batch.)"""
  fn, shapes = _POLY_CASES[name]
  argnums = tuple(range(len(shapes)))
  loss = jax.value_and_grad(lambda *a: jnp.sum(jnp.sin(fn(*a))), argnums=argnums)
  b, = jax.export.symbolic_shape("b")
  specs = [jax.ShapeDtypeStruct(tuple(b if d == "b" else d for d in s), jnp.float32)
           for s in shapes]
  exported = jax.export.export(jax.jit(loss), platforms=("cpu",),
                               disabled_checks=jax_dnn.export_disabled_checks())(*specs)
  for size in (3, 5):
    args = [randn(90 + i, tuple(size if d == "b" else d for d in s), jnp.float32)
            for i, s in enumerate(shapes)]
    with jax.default_device(jax.devices("cpu")[0]):
      got, want = exported.call(*args), jax.jit(loss)(*args)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6, err_msg=name)


def test_cuda_export_with_a_symbolic_batch():
  """The CUDA lowering under a symbolic leading dimension calls the kernels
  (bf16, so that attention takes its kernel too). Lowering only: such a
  program has not been run on a GPU."""
  if not jax_dnn.has_cuda_kernels():
    pytest.skip("jax_dnn was built without CUDA kernels: the CUDA lowering is the reference")
  b, = jax.export.symbolic_shape("b")
  for name, (fn, shapes) in _POLY_CASES.items():
    loss = jax.grad(lambda *a, fn=fn: jnp.sum(fn(*a).astype(jnp.float32)))
    specs = [jax.ShapeDtypeStruct(tuple(b if d == "b" else d for d in s),
                                  jnp.bfloat16 if i == 0 else jnp.float32)
             for i, s in enumerate(shapes)]
    text = _export_for_cuda(loss, specs,
                            disabled_checks=jax_dnn.export_disabled_checks()).mlir_module()
    assert "stablehlo.custom_call @jax_dnn_" in text, name
