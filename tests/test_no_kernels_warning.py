"""A jax_dnn without its kernels says so, once, when an op is lowered for CUDA."""

import warnings

import jax
import jax.numpy as jnp
import pytest

import jax_dnn
from jax_dnn._src import extension


@pytest.fixture
def no_kernels(monkeypatch):
  """The extension as a build without CUDA presents it: no registered targets."""
  monkeypatch.setattr(extension, "registered_targets", frozenset)
  monkeypatch.setattr(extension, "_warned", False)
  monkeypatch.delenv("JAX_DNN_IMPL", raising=False)


def _lower_for_cuda(fn, *args):
  return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def test_warns_once_when_lowering_for_cuda_without_kernels(no_kernels):
  x = jnp.ones((4, 8), jnp.float32)
  with pytest.warns(extension.NoKernelsWarning, match="JAX_DNN_CUDA=ON pip install"):
    hlo = _lower_for_cuda(lambda x: jax_dnn.layer_norm(x), x)
  assert "jax_dnn_layer_norm_fwd" not in hlo  # the reference path ran
  with warnings.catch_warnings():
    warnings.simplefilter("error", extension.NoKernelsWarning)
    _lower_for_cuda(lambda x: jax_dnn.softmax(x, axis=-1), x)  # once a process


def test_no_warning_when_the_reference_is_asked_for(no_kernels, monkeypatch):
  monkeypatch.setenv("JAX_DNN_IMPL", "reference")
  with warnings.catch_warnings():
    warnings.simplefilter("error", extension.NoKernelsWarning)
    _lower_for_cuda(lambda x: jax_dnn.gelu(x), jnp.ones((4, 8), jnp.float32))


def test_no_warning_on_cpu(no_kernels):
  with warnings.catch_warnings():
    warnings.simplefilter("error", extension.NoKernelsWarning)
    jax.jit(jax_dnn.relu).lower(jnp.ones((4, 8), jnp.float32)).as_text()
