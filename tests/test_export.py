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
