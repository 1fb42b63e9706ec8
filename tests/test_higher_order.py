"""Second-order reverse mode: jax.grad of a function that itself takes
jax.grad through an op (gradient penalties, meta-learning). The op's custom
VJP calls the kernels; differentiating those calls once more uses each
primitive's JVP, which takes the value from the kernel and the tangent from
the reference (primitive.py). Forward mode stops at the op's custom_vjp, as
for any custom_vjp function in JAX."""

import jax
from jax.test_util import check_grads
import jax.numpy as jnp
import numpy as np
import pytest

import jax_dnn
from helpers import randn


def _ln(x, s, b, rms=False):
  mean = 0.0 if rms else x.mean(-1, keepdims=True)
  var = jnp.square(x - mean).mean(-1, keepdims=True)
  y = (x - mean) * jax.lax.rsqrt(var + 1e-6) * s
  return y if rms else y + b


# name: (ours, JAX's own, argument shapes)
CASES = {
    "gelu": (jax_dnn.gelu, jax.nn.gelu, [(4, 16)]),
    "silu": (jax_dnn.silu, jax.nn.silu, [(4, 16)]),
    "bias_act": (lambda x, b: jax_dnn.bias_act(x, b, "gelu"),
                 lambda x, b: jax.nn.gelu(x + b, approximate=False), [(4, 16), (16,)]),
    "softmax": (jax_dnn.softmax, jax.nn.softmax, [(4, 16)]),
    "log_softmax": (jax_dnn.log_softmax, jax.nn.log_softmax, [(4, 16)]),
    "layer_norm": (lambda x, s, b: jax_dnn.layer_norm(x, s, b, epsilon=1e-6), _ln,
                   [(4, 16), (16,), (16,)]),
    "rms_norm": (lambda x, s: jax_dnn.rms_norm(x, s, epsilon=1e-6),
                 lambda x, s: _ln(x, s, None, rms=True), [(4, 16), (16,)]),
    "attention": (lambda q, k, v: jax_dnn.dot_product_attention(q, k, v, is_causal=True),
                  lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True),
                  [(2, 8, 2, 32)] * 3),
}


def _args(name):
  return [randn(60 + i, shape, jnp.float32, scale=0.5) for i, shape in enumerate(CASES[name][2])]


def _penalty(fn):
  """A gradient penalty: the squared norm of d sum(fn(args) * w) / d args."""
  def loss(*args):
    w = jnp.cos(jnp.arange(fn(*args).size, dtype=jnp.float32)).reshape(fn(*args).shape)
    grads = jax.grad(lambda *a: jnp.sum(fn(*a) * w), argnums=tuple(range(len(args))))(*args)
    return sum(jnp.sum(g * g) for g in grads)
  return loss


@pytest.mark.parametrize("name", CASES)
def test_grad_of_grad_matches_jax(device, name):
  ours, theirs, _ = CASES[name]
  args = _args(name)
  argnums = tuple(range(len(args)))
  got = jax.jit(jax.value_and_grad(_penalty(ours), argnums=argnums))(*args)
  want = jax.jit(jax.value_and_grad(_penalty(theirs), argnums=argnums))(*args)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-3, atol=2e-4, err_msg=name)


@pytest.mark.parametrize("name", ["gelu", "softmax", "layer_norm", "attention"])
def test_check_grads_second_order(device, name):
  ours, _, _ = CASES[name]
  args = _args(name)
  if name == "attention":  # small, as test_attention's check_grads
    args = [randn(80, (1, 3, 2, 8), jnp.float32)] + [
        randn(81 + i, (1, 4, 2, 8), jnp.float32) for i in range(2)]
  # fp32 matmuls in full precision: the reference's tangents go through XLA,
  # whose default on GPU (TF32) is too coarse for numerical differences.
  with jax.default_matmul_precision("highest"):
    check_grads(ours, args, order=2, modes=("rev",), atol=2e-2, rtol=2e-2)


def test_forward_mode_is_refused():
  x = randn(70, (4, 16), jnp.float32)
  with pytest.raises(TypeError, match="forward-mode"):
    jax.jvp(jax_dnn.softmax, (x,), (x,))


@pytest.mark.parametrize("name", ["gelu", "layer_norm", "rms_norm", "attention"])
def test_grad_of_grad_under_explicit_mesh_axes(name):
  """Under explicit mesh axes (jax.make_mesh's default) the operands carry
  their shardings; the reference's tangent runs with XLA placing its
  intermediates (the references reshape freely), and comes out typed as the
  op's result. Same values as on one device."""
  from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top
  devices = jax.devices("cpu")[:8]
  mesh = jax.sharding.Mesh(np.array(devices).reshape(4, 2), ("data", "model"),
                           axis_types=(jax.sharding.AxisType.Explicit,) * 2)
  ours, _, _ = CASES[name]
  args = _args(name)
  if name in ("layer_norm", "rms_norm"):
    args[0] = randn(85, (8, 4, 16), jnp.float32, scale=0.5)
  if name == "attention":  # a batch of 4 for the 4 devices of "data"
    args = [randn(86 + i, (4, 8, 2, 32), jnp.float32, scale=0.5) for i in range(3)]
  spec = P("data", None, "model") if name == "attention" else P("data", "model")
  argnums = tuple(range(len(args)))
  grad2 = jax.jit(jax.grad(_penalty(ours), argnums=argnums))
  with jax.default_device(devices[0]):
    want = grad2(*args)
  with jax.set_mesh(mesh):
    split = [jax.device_put(a, NamedSharding(mesh, spec if i == 0 or name == "attention" else P()))
             for i, a in enumerate(args)]
    got = grad2(*split)
  for g, w in zip(got, want):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-4, atol=2e-5, err_msg=name)
