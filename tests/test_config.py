"""jax_dnn.config: the settings a user expects from cuDNN, in JAX's style."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

import jax_dnn
from helpers import cuda_hlo


@pytest.fixture
def restore():
  saved = jax_dnn.config.deterministic
  yield
  jax_dnn.config.update("deterministic", saved)


def test_update_and_read(restore):
  jax_dnn.config.update("deterministic", True)
  assert jax_dnn.config.deterministic is True
  jax_dnn.config.update("deterministic", False)
  assert jax_dnn.config.deterministic is False
  assert "deterministic=False" in repr(jax_dnn.config)


def test_bad_updates():
  with pytest.raises(ValueError,
                     match="unknown setting 'determinstic'; settings: benchmark, deterministic"):
    jax_dnn.config.update("determinstic", True)
  with pytest.raises(TypeError, match="deterministic must be a bool"):
    jax_dnn.config.update("deterministic", 1)
  with pytest.raises(AttributeError, match="no setting 'benchmarks'"):
    jax_dnn.config.benchmarks  # pylint: disable=pointless-statement


def _read_in_fresh_process(env_value):
  env = dict(os.environ, JAX_DNN_DETERMINISTIC=env_value)
  return subprocess.run([sys.executable, "-c", "import jax_dnn; print(jax_dnn.config.deterministic)"],
                        capture_output=True, text=True, env=env)


@pytest.mark.parametrize("value, want", [("1", "True"), ("true", "True"), ("0", "False"),
                                         ("off", "False")])
def test_environment_variable(value, want):
  out = _read_in_fresh_process(value)
  assert out.returncode == 0, out.stderr
  assert out.stdout.strip() == want


def test_bad_environment_variable():
  out = _read_in_fresh_process("maybe")
  assert out.returncode != 0
  assert "JAX_DNN_DETERMINISTIC='maybe' is not a boolean" in out.stderr


def _attention_backward_hlo(**kwargs):
  q = jnp.ones((2, 16, 4, 64), jnp.bfloat16)
  loss = lambda q, k, v: jnp.sum(jax_dnn.dot_product_attention(q, k, v, **kwargs)
                                 .astype(jnp.float32))
  return cuda_hlo(jax.grad(loss, (0, 1, 2)), q, q, q)


def test_cuda_lowering_deterministic_setting(restore):
  """The setting picks attention's split backward (written once, no fp32
  adds in a varying order) for calls traced while it is on, whatever the
  call's own argument says; off, the argument decides."""
  if "jax_dnn_attention_bwd" not in jax_dnn._extension.registered_targets():  # pylint: disable=protected-access
    pytest.skip("jax_dnn was built without CUDA kernels: the CUDA lowering is the reference")
  assert "fused_dq = true" in _attention_backward_hlo()
  assert "fused_dq = false" in _attention_backward_hlo(deterministic_backward=True)
  jax_dnn.config.update("deterministic", True)
  assert "fused_dq = false" in _attention_backward_hlo()
  assert "fused_dq = false" in _attention_backward_hlo(deterministic_backward=False)
