"""relu, gelu (exact and tanh), silu, sigmoid, tanh, and the fused bias_act:
against fp64 references, under jit/vmap/grad, bad inputs, CUDA lowering."""

import functools

import jax
from jax.test_util import check_grads
import jax.numpy as jnp
import numpy as np
import pytest

import jax_dnn
from helpers import DTYPES, check_fwd_bwd, cuda_hlo, on_gpu, randn

UNARY = {
    "relu": (jax_dnn.relu, jax.nn.relu),
    "gelu": (functools.partial(jax_dnn.gelu, approximate=False),
             functools.partial(jax.nn.gelu, approximate=False)),
    "gelu_tanh": (jax_dnn.gelu, functools.partial(jax.nn.gelu, approximate=True)),
    "silu": (jax_dnn.silu, jax.nn.silu),
    "sigmoid": (jax_dnn.sigmoid, jax.nn.sigmoid),
    "tanh": (jax_dnn.tanh, jnp.tanh),
}
NAIVE = {name: naive for name, (_, naive) in UNARY.items()}

# Sizes that are / are not a multiple of the vector width, 1 element, empty.
SHAPES = [(1,), (7,), (3, 1000), (4, 257), (64, 1024), (0, 4)]


@pytest.mark.parametrize("name", UNARY)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_unary_against_reference(device, name, dtype, shape):
  ours, naive = UNARY[name]
  x = randn(1, shape, dtype, scale=3.0)
  reused = check_fwd_bwd(device, ours, naive, (x,), dtype, what=name)
  if on_gpu(device) and x.size:
    assert reused >= 1


def naive_bias_act(x, bias, activation):
  return NAIVE[activation](x + bias.astype(x.dtype)).astype(x.dtype)


@pytest.mark.parametrize("activation", UNARY)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", [(1, 1), (5, 7), (2, 3, 96), (300, 64), (64, 4096), (0, 8)],
                         ids=str)
def test_bias_act_against_reference(device, activation, dtype, shape):
  x = randn(2, shape, dtype, scale=2.0)
  bias = randn(3, shape[-1:], dtype)
  reused = check_fwd_bwd(device, functools.partial(jax_dnn.bias_act, activation=activation),
                         functools.partial(naive_bias_act, activation=activation), (x, bias),
                         dtype, what=f"bias_act {activation}")
  if on_gpu(device) and x.size:
    assert reused >= 1


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("width", [72, 35], ids=lambda w: f"width{w}")
def test_bias_act_grouped(device, dtype, width):
  """vmap over x and bias: each group of rows takes its own bias (the
  kernels' split of a flat index into row, column and group) across many
  blocks; width 35 takes the scalar path."""
  x = randn(9, (3, 700, width), dtype, scale=2.0)
  bias = randn(10, (3, width), dtype)
  act = functools.partial(jax_dnn.bias_act, activation="gelu")
  naive = functools.partial(naive_bias_act, activation="gelu")
  check_fwd_bwd(device, jax.vmap(act), jax.vmap(naive), (x, bias), dtype, what="grouped bias_act")


# Inputs large enough for the forward's wide layout (four 16-byte units a
# thread, over 8 blocks an SM: ~1.6-1.8 M units, past that on up to 200 SMs),
# where a thread's units share a bias column: blocks of 256, 128 and 32 units
# of columns (4096, 3072 and 11008 wide bf16; rows not a multiple of a
# block's rows), rows that divide 256 units (1024 wide; 4 wide on the scalar
# path), fp32 (4-element units); and where they do not (1000 wide bf16: 125
# units). The backward's two-row loop (GELU tanh, ReLU) and one-row loop
# (SiLU) see several rows a thread here.
WIDE = [((3458, 4096), jnp.bfloat16), ((4501, 3072), jnp.bfloat16), ((1201, 11008), jnp.bfloat16),
        ((13501, 1024), jnp.float16), ((450001, 4), jnp.bfloat16), ((3458, 4096), jnp.float32),
        ((13501, 1000), jnp.bfloat16)]


@pytest.mark.gpu
@pytest.mark.parametrize("shape,dtype", WIDE, ids=lambda a: str(a) if isinstance(a, tuple)
                         else jnp.dtype(a).name)
def test_bias_act_wide(gpu, shape, dtype):
  x = randn(11, shape, dtype, scale=2.0)
  bias = randn(12, shape[-1:], dtype)
  for activation in ("gelu_tanh", "relu", "silu"):
    reused = check_fwd_bwd(gpu, functools.partial(jax_dnn.bias_act, activation=activation),
                           functools.partial(naive_bias_act, activation=activation), (x, bias),
                           dtype, what=f"wide bias_act {activation}")
    assert reused >= 1


def test_jit_vmap_grad(device):
  tol = dict(rtol=2e-5, atol=2e-5)
  close = lambda a, b: jax.tree.map(lambda u, v: np.testing.assert_allclose(u, v, **tol), a, b)
  x = randn(4, (3, 5, 24), jnp.float32)
  bias = randn(5, (24,), jnp.float32)
  bb = randn(6, (3, 24), jnp.float32)
  ours = functools.partial(jax_dnn.bias_act, activation="silu")
  naive = functools.partial(naive_bias_act, activation="silu")
  for in_axis in (0, 1, 2):
    close(jax.vmap(jax_dnn.gelu, in_axes=in_axis)(x), jax.vmap(jax.nn.gelu, in_axes=in_axis)(x))
  close(jax.jit(ours)(x, bias), naive(x, bias))
  for axes in [(0, None), (1, None), (0, 0), (None, 0)]:
    xa = x if axes[0] is not None else x[0]
    ba = bb if axes[1] is not None else bias
    close(jax.vmap(ours, in_axes=axes)(xa, ba), jax.vmap(naive, in_axes=axes)(xa, ba))
  nested = lambda fn: jax.vmap(jax.vmap(fn, in_axes=(0, None)), in_axes=(1, 0))
  close(nested(ours)(x, bb[:1].repeat(5, 0)), nested(naive)(x, bb[:1].repeat(5, 0)))
  loss = lambda fn: (lambda a, b: jnp.sum(fn(a, b) ** 2))
  close(jax.grad(loss(ours), (0, 1))(x, bias), jax.grad(loss(naive), (0, 1))(x, bias))
  for axes in [(0, None), (0, 0)]:
    ba = bb if axes[1] is not None else bias
    close(jax.vmap(jax.grad(loss(ours), (0, 1)), in_axes=axes)(x, ba),
          jax.vmap(jax.grad(loss(naive), (0, 1)), in_axes=axes)(x, ba))
  uloss = lambda fn: (lambda a: jnp.sum(fn(a) ** 2))
  close(jax.vmap(jax.grad(uloss(jax_dnn.tanh)))(x), jax.vmap(jax.grad(uloss(jnp.tanh)))(x))


@pytest.mark.parametrize("name", [n for n in UNARY if n != "relu"])
def test_check_grads(device, name):
  ours, _ = UNARY[name]
  x = randn(7, (4, 5), jnp.float32)
  check_grads(ours, (x,), order=1, modes=("rev",), atol=1e-2, rtol=1e-2)
  check_grads(functools.partial(jax_dnn.bias_act, activation=name), (x, randn(8, (5,), jnp.float32)),
              order=1, modes=("rev",), atol=1e-2, rtol=1e-2)


def test_relu_grad_at_zero_matches_jax(device):
  x = jnp.array([-1.0, 0.0, 2.0], jnp.float32)
  np.testing.assert_array_equal(jax.grad(lambda v: jax_dnn.relu(v).sum())(x),
                                jax.grad(lambda v: jax.nn.relu(v).sum())(x))


def test_bad_inputs():
  x = jnp.ones((2, 8), jnp.float32)
  with pytest.raises(TypeError, match="relu: x has dtype int32"):
    jax_dnn.relu(jnp.ones(3, jnp.int32))
  with pytest.raises(ValueError, match="activation must be one of"):
    jax_dnn.bias_act(x, jnp.ones(8), activation="swish")
  with pytest.raises(ValueError, match=r"bias must have shape \(8,\)"):
    jax_dnn.bias_act(x, jnp.ones(3))
  with pytest.raises(TypeError, match="approximate must be a bool"):
    jax_dnn.gelu(x, approximate="yes")


def test_cuda_lowering_calls_kernels():
  x = jnp.ones((4, 64), jnp.bfloat16)
  b = jnp.ones(64, jnp.bfloat16)
  assert "jax_dnn_activation_fwd" in cuda_hlo(jax_dnn.silu, x)
  assert "jax_dnn_activation_bwd" in cuda_hlo(
      jax.grad(lambda v: jax_dnn.silu(v).astype(jnp.float32).sum()), x)
  assert "jax_dnn_bias_act_fwd" in cuda_hlo(jax_dnn.bias_act, x, b)
  assert "jax_dnn_bias_act_bwd" in cuda_hlo(
      jax.grad(lambda v, c: jax_dnn.bias_act(v, c).astype(jnp.float32).sum(), (0, 1)), x, b)
