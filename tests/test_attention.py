"""dot_product_attention: against jax.nn.dot_product_attention and an
independent naive reference, its options, bad inputs, Flax glue. jit/vmap/
grad, check_grads and the CUDA lowering's kernel calls:
tests/test_transforms.py (the table in tests/op_cases.py).

On a CPU machine these run the reference path; the CUDA lowering (checked
here as text) holds the kernels' custom calls. tests/test_attention_kernels.py
runs the kernels themselves."""

import functools

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_dnn
from jax_dnn._src import attention as attention_src
from jax_dnn._src import plans
import jax_dnn.nn
from helpers import check_fwd_bwd, cuda_hlo, randn, x64


def naive_attention(q, k, v, bias=None, valid=None, *, scale=None, softcap=None):
  """Independent reference: plain einsums, masked positions excluded, fully
  masked rows -> 0. valid: bool broadcastable to [B, N, T, S]."""
  n, kh = q.shape[2], k.shape[2]
  k = jnp.repeat(k, n // kh, axis=2)
  v = jnp.repeat(v, n // kh, axis=2)
  scale = 1.0 / np.sqrt(q.shape[-1]) if scale is None else scale
  s = jnp.einsum("btnh,bsnh->bnts", q, k) * scale
  if softcap:
    s = softcap * jnp.tanh(s / softcap)
  if bias is not None:
    s = s + bias
  if valid is None:
    valid = jnp.ones(s.shape, bool)
  valid = jnp.broadcast_to(valid, s.shape)
  s = jnp.where(valid, s, -1e30)
  p = jnp.exp(s - jnp.max(s, axis=-1, keepdims=True)) * valid
  denom = jnp.sum(p, axis=-1, keepdims=True)
  p = p / jnp.where(denom > 0, denom, 1)
  return jnp.einsum("bnts,bsnh->btnh", p, v).astype(q.dtype)


def qkv(key, b, t, s, n, k, h, dtype, hv=None):
  return (randn(key, (b, t, n, h), dtype), randn(key + 1, (b, s, k, h), dtype),
          randn(key + 2, (b, s, k, hv or h), dtype))


SHAPES = [  # B, T, S, N, K, H
    (1, 1, 1, 1, 1, 32),
    (2, 7, 9, 4, 2, 16),
    (2, 17, 17, 4, 4, 64),
    (1, 33, 20, 8, 1, 128),
    (1, 5, 12, 2, 2, 256),
]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_matches_jax_nn(device, shape, causal, dtype):
  q, k, v = qkv(1, *shape, dtype)
  ours = functools.partial(jax_dnn.dot_product_attention, is_causal=causal)
  if dtype == jnp.float32:
    theirs = functools.partial(jax.nn.dot_product_attention, is_causal=causal)
  else:  # XLA:CPU cannot run jax.nn's bf16 x bf16 -> f32 dot algorithm
    valid = jnp.tril(jnp.ones(shape[1:3], bool)) if causal else None
    theirs = functools.partial(naive_attention, valid=valid)
  check_fwd_bwd(device, ours, theirs, (q, k, v), dtype, poison=False, what="attention")


def _options(b, t, s, n):
  rng = np.random.default_rng(0)
  mask = rng.random((b, n, t, s)) < 0.7
  mask[..., :, 0] = True  # no fully masked rows (jax.nn averages those)
  return {
      "bias": dict(bias=randn(5, (b, n, t, s), jnp.float32)),
      "bias_bcast_batch": dict(bias=randn(5, (1, n, t, s), jnp.float32)),
      "bias_bcast_heads": dict(bias=randn(5, (b, 1, t, s), jnp.float32)),
      "mask": dict(mask=jnp.asarray(mask)),
      "lengths": dict(query_seq_lengths=jnp.array([t, t - 2]),
                      key_value_seq_lengths=jnp.array([s - 3, 1])),
      "window": dict(local_window_size=(2, 1)),
      "window_causal": dict(local_window_size=3, is_causal=True),
      "scale": dict(scale=0.3),
      # Shapes that broadcast over T or S, as jax.nn takes them.
      "mask_key_padding": dict(mask=jnp.asarray(mask[:, :1, :1])),
      "mask_rank1": dict(mask=jnp.asarray(mask[0, 0, 0])),
      "bias_bcast_rows": dict(bias=randn(6, (b, 1, 1, s), jnp.float32)),
      "bias_bcast_cols": dict(bias=randn(6, (1, n, t, 1), jnp.float32)),
  }


@pytest.mark.parametrize("option", list(_options(2, 6, 8, 4)))
def test_options_match_jax_nn(device, option):
  # Full fp32 matmuls: on a GPU XLA's default for float32 is TF32, whose
  # rounding differs between the two programs' fusions.
  with jax.default_matmul_precision("highest"):
    _options_match_jax_nn(option)


def _options_match_jax_nn(option):
  b, t, s, n, kh, h = 2, 6, 8, 4, 2, 32
  q, k, v = qkv(2, b, t, s, n, kh, h, jnp.float32)
  kwargs = _options(b, t, s, n)[option]
  ours = functools.partial(jax_dnn.dot_product_attention, **kwargs)
  theirs = functools.partial(jax.nn.dot_product_attention, **kwargs)
  np.testing.assert_allclose(ours(q, k, v), theirs(q, k, v), rtol=1e-5, atol=1e-5)
  loss = lambda f: (lambda *a: jnp.sum(f(*a) ** 2))
  g_ours = jax.grad(loss(ours), (0, 1, 2))(q, k, v)
  g_theirs = jax.grad(loss(theirs), (0, 1, 2))(q, k, v)
  jax.tree.map(lambda a, c: np.testing.assert_allclose(a, c, rtol=1e-4, atol=1e-5), g_ours, g_theirs)
  if "bias" in kwargs:
    bias = kwargs["bias"]
    db_ours = jax.grad(lambda c: jnp.sum(jax_dnn.dot_product_attention(q, k, v, c) ** 2))(bias)
    db_theirs = jax.grad(lambda c: jnp.sum(jax.nn.dot_product_attention(q, k, v, c) ** 2))(bias)
    np.testing.assert_allclose(db_ours, db_theirs, rtol=1e-4, atol=1e-5)


def test_return_residual_matches_jax_nn(device):
  q, k, v = qkv(3, 2, 5, 7, 2, 2, 16, jnp.float32)
  o, lse = jax_dnn.dot_product_attention(q, k, v, is_causal=True, return_residual=True)
  o2, lse2 = jax.nn.dot_product_attention(q, k, v, is_causal=True, return_residual=True)
  np.testing.assert_allclose(o, o2, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(lse, lse2, rtol=1e-5, atol=1e-5)


def test_unbatched_inputs_match_jax_nn(device):
  """[T, N, H] inputs (jax.nn's TNH form): a batch of one, the same outputs,
  gradients and [T, N] residual as jax.nn; bias/mask [N|1, T, S]."""
  q, k, v = (x[0] for x in qkv(11, 1, 6, 9, 4, 2, 32, jnp.float32))
  bias = randn(12, (4, 6, 9), jnp.float32)
  mask = jnp.asarray(np.random.default_rng(1).random((1, 6, 9)) < 0.7).at[..., 0].set(True)
  kw = dict(is_causal=False, local_window_size=(3, 2), return_residual=True)
  o, lse = jax_dnn.dot_product_attention(q, k, v, bias, mask, **kw)
  o2, lse2 = jax.nn.dot_product_attention(q, k, v, bias, mask, **kw)
  assert o.shape == (6, 4, 32) and lse.shape == (6, 4)
  np.testing.assert_allclose(o, o2, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(lse, lse2, rtol=1e-5, atol=1e-5)
  loss = lambda f: (lambda *a: jnp.sum(f(*a, bias, mask, is_causal=True) ** 2))
  g = jax.grad(loss(jax_dnn.dot_product_attention), (0, 1, 2))(q, k, v)
  g2 = jax.grad(loss(jax.nn.dot_product_attention), (0, 1, 2))(q, k, v)
  jax.tree.map(lambda a, c: np.testing.assert_allclose(a, c, rtol=1e-4, atol=1e-5), g, g2)
  seg = jnp.array([0, 0, 0, 1, 1, 1])
  o = jax_dnn.dot_product_attention(q, q, q, q_segment_ids=seg, kv_segment_ids=seg)
  want = naive_attention(q[None], q[None], q[None],
                         valid=(seg[:, None] == seg[None, :])[None, None])[0]
  np.testing.assert_allclose(o, want, rtol=1e-5, atol=1e-5)


def test_array_scale():
  """A concrete scalar array is a static scale; a traced one (a learned
  temperature) is folded into the query, and its gradient matches jax.nn's.
  Full fp32 matmuls (a GPU's default TF32 would round q * scale)."""
  with jax.default_matmul_precision("highest"):
    _array_scale()


def _array_scale():
  q, k, v = qkv(13, 1, 4, 5, 2, 2, 16, jnp.float32)
  want = jax_dnn.dot_product_attention(q, k, v, scale=0.3)
  np.testing.assert_allclose(jax_dnn.dot_product_attention(q, k, v, scale=jnp.float32(0.3)),
                             want, rtol=1e-6)
  traced = jax.jit(lambda s: jax_dnn.dot_product_attention(q, k, v, scale=s))
  np.testing.assert_allclose(traced(jnp.float32(0.3)), want, rtol=1e-5, atol=1e-6)
  loss = lambda f: jax.grad(lambda s: jnp.sum(f(q, k, v, scale=s, is_causal=True) ** 2))
  np.testing.assert_allclose(loss(jax_dnn.dot_product_attention)(0.3),
                             loss(jax.nn.dot_product_attention)(0.3), rtol=1e-4)
  with pytest.raises(TypeError, match="scale must be a float scalar"):
    jax_dnn.dot_product_attention(q, k, v, scale=jnp.ones(2))


def test_jax_nn_argument_forms():
  """What jax.nn.dot_product_attention takes beyond arrays and bools:
  implementation="xla" (passed to jax.nn), numpy scalars, lists of lengths,
  and an empty key sequence."""
  q, k, v = qkv(14, 2, 5, 6, 2, 1, 16, jnp.float32)
  dpa = jax_dnn.dot_product_attention
  kw = dict(is_causal=True, key_value_seq_lengths=jnp.array([6, 3], jnp.int32))
  np.testing.assert_allclose(dpa(q, k, v, implementation="xla", **kw),
                             jax.nn.dot_product_attention(q, k, v, **kw), rtol=1e-6)
  with pytest.raises(ValueError, match="does not take logits_soft_cap"):
    dpa(q, k, v, implementation="xla", logits_soft_cap=2.0)
  want = dpa(q, k, v, is_causal=True, query_seq_lengths=jnp.array([5, 2]), logits_soft_cap=3.0)
  got = dpa(q, k, v, is_causal=np.bool_(True), query_seq_lengths=[5, 2],
            logits_soft_cap=np.float32(3.0))
  np.testing.assert_array_equal(got, want)
  with pytest.raises(TypeError, match="logits_soft_cap must be a float"):
    dpa(q, k, v, logits_soft_cap="3")
  # S = 0: every row is fully masked, so zeros (and zero gradients).
  o, lse = dpa(q, k[:, :0], v[:, :0], return_residual=True)
  assert o.shape == q.shape and lse.shape == (2, 5, 2)
  np.testing.assert_array_equal(o, 0.0)
  assert np.all(np.isneginf(lse))
  dq = jax.jit(jax.grad(lambda a: jnp.sum(dpa(a, k[:, :0], v[:, :0]) ** 2)))(q)
  np.testing.assert_array_equal(dq, 0.0)


def test_segments_softcap_and_value_head_dim(device):
  b, t, n, kh, h, hv = 2, 9, 4, 2, 32, 48
  q, k, v = qkv(4, b, t, t, n, kh, h, jnp.float32, hv=hv)
  seg = jnp.array([[0, 0, 0, 1, 1, 2, 2, 2, 2], [0, 1, 1, 1, 1, 1, 1, 3, 3]])
  valid = (seg[:, :, None] == seg[:, None, :])[:, None]
  ours = lambda *a: jax_dnn.dot_product_attention(*a, q_segment_ids=seg, kv_segment_ids=seg,
                                                  logits_soft_cap=5.0)
  naive = lambda *a: naive_attention(*a, valid=valid, softcap=5.0)
  check_fwd_bwd(jax.devices()[0], ours, naive, (q, k, v), jnp.float32, poison=False,
                what="segments+softcap")
  assert ours(q, k, v).shape == (b, t, n, hv)


def test_fully_masked_rows_give_zeros_and_zero_grads(device):
  q, k, v = qkv(5, 2, 4, 6, 2, 1, 16, jnp.float32)
  mask = jnp.ones((2, 1, 4, 6), bool).at[1, :, 2, :].set(False)  # batch 1, query row 2
  f = lambda a, c, d: jax_dnn.dot_product_attention(a, c, d, mask=mask)
  o = f(q, k, v)
  assert np.all(np.isfinite(o))
  np.testing.assert_array_equal(o[1, 2], 0.0)
  dq, dk, dv = jax.grad(lambda *a: jnp.sum(f(*a) ** 2), (0, 1, 2))(q, k, v)
  for g in (dq, dk, dv):
    assert np.all(np.isfinite(g))
  np.testing.assert_array_equal(dq[1, 2], 0.0)
  # kv length 0: every row of that batch is masked.
  o = jax_dnn.dot_product_attention(q, k, v, key_value_seq_lengths=jnp.array([6, 0]))
  np.testing.assert_array_equal(o[1], 0.0)
  _, lse = jax_dnn.dot_product_attention(q, k, v, key_value_seq_lengths=jnp.array([6, 0]),
                                         return_residual=True)
  assert np.all(np.isneginf(lse[1])) and np.all(np.isfinite(lse[0]))


def test_bad_inputs():
  q, k, v = qkv(8, 1, 4, 4, 4, 2, 16, jnp.float32)
  dpa = jax_dnn.dot_product_attention
  with pytest.raises(ValueError, match="must divide the number of query heads"):
    dpa(q, k[:, :, :1].repeat(3, axis=2), v[:, :, :1].repeat(3, axis=2))
  with pytest.raises(ValueError, match="key head dim 8 must equal query head dim 16"):
    dpa(q, k[..., :8], v)
  with pytest.raises(ValueError, match="query must have rank 4 .* or less"):
    dpa(q[None], k, v)
  with pytest.raises(ValueError, match=r"share the batch size; got shapes \(2, 4, 4, 16\)"):
    dpa(jnp.concatenate([q, q]), k, v)
  # Where jax.nn raises, the same exception type: TypeError for a shape that
  # does not broadcast (jax's broadcasting), ValueError for dtypes.
  with pytest.raises(TypeError, match="mask must broadcast"):
    dpa(q, k, v, mask=jnp.ones((1, 1, 4, 5), bool))
  with pytest.raises(ValueError, match="mask must be boolean"):
    dpa(q, k, v, mask=jnp.ones((4, 4), jnp.float32))
  with pytest.raises(ValueError, match="share one dtype"):
    dpa(q.astype(jnp.bfloat16), k, v)
  with pytest.raises(ValueError, match="given together"):
    dpa(q, k, v, q_segment_ids=jnp.zeros((1, 4), jnp.int32))
  with pytest.raises(ValueError, match="logits_soft_cap"):
    dpa(q, k, v, logits_soft_cap=-1.0)
  with pytest.raises(ValueError, match="implementation"):
    dpa(q, k, v, implementation="flash")
  with pytest.raises(TypeError, match="bias must broadcast to"):
    dpa(q, k, v, randn(1, (2, 4, 4), jnp.float32))
  with pytest.raises(ValueError, match="bias must have rank at most 4"):
    dpa(q, k, v, randn(1, (1, 1, 4, 4, 4), jnp.float32))
  with pytest.raises(TypeError, match="local_window_size"):
    dpa(q, k, v, local_window_size="wide")
  with pytest.raises(TypeError, match="deterministic_backward must be a bool"):
    dpa(q, k, v, deterministic_backward="yes")


def test_cuda_lowering_without_a_kernel_is_the_reference():
  """fp32 and head dims without a kernel lower to the reference (the
  kernels' calls: tests/test_transforms.py)."""
  q, k, v = qkv(20, 2, 16, 24, 4, 2, 64, jnp.bfloat16)
  q32, k32, v32 = (x.astype(jnp.float32) for x in (q, k, v))
  assert "jax_dnn_attention" not in cuda_hlo(jax_dnn.dot_product_attention, q32, k32, v32)
  assert "jax_dnn_attention" not in cuda_hlo(jax_dnn.dot_product_attention, q[..., :60],
                                             k[..., :60], v[..., :60])


@pytest.mark.parametrize("h, kwargs, fused", [
    (128, {}, True),
    (96, dict(is_causal=True, local_window_size=(9, 3)), True),
    (128, dict(query_seq_lengths=jnp.array([16, 9])), True),
    (64, dict(is_causal=True), True),
    (32, dict(is_causal=True, query_seq_lengths=jnp.array([16, 9])), True),
    (64, {}, True),
    (64, dict(local_window_size=(9, 3)), True),
    (256, {}, False),  # the split at other head dims and on the general path
    (128, dict(logits_soft_cap=2.0), False),  # and on the general logits path
    (128, dict(q_segment_ids=jnp.zeros((2, 16), jnp.int32),
               kv_segment_ids=jnp.zeros((2, 24), jnp.int32)), False),
    (128, dict(bias=jnp.ones((16, 24))), False),
    (128, dict(deterministic_backward=True), False),
    (192, {}, False),
])
def test_cuda_lowering_backward_path(h, kwargs, fused):
  """Which backward the handler is asked for (single pass or split), and the
  workspace it gets after the gradients (delta, then the fp32 dQ
  accumulator); the handler re-checks (AttentionFusedDqSupported)."""
  q, k, v = qkv(21, 2, 16, 24, 4, 2, h, jnp.bfloat16)
  kwargs = dict(kwargs)
  bias = kwargs.pop("bias", None)
  loss = lambda q, k, v: jnp.sum(jax_dnn.dot_product_attention(
      q, k, v, bias, **kwargs).astype(jnp.float32))
  hlo = cuda_hlo(jax.grad(loss, (0, 1, 2)), q, k, v)
  assert f"fused_dq = {str(fused).lower()}" in hlo
  d = 64 * -(-h // 64)
  rows = 128 if d == 64 else 64  # the query tile (DqTileRows): T = 16 pads to one
  acc = f"tensor<2x4x{rows * d}xf32>" if fused else "tensor<0xf32>"
  assert _call_results(hlo, "jax_dnn_attention_bwd").endswith(f", tensor<2x4x16xf32>, {acc})")


def _call_results(hlo, target):
  """The result types of the first custom call to `target`."""
  line = next(l for l in hlo.splitlines() if f"custom_call @{target}(" in l)
  return line.rsplit("-> ", 1)[1]


# The forward's split-tail workspace, the forward call's last result, as the
# plan sizes it for this machine's device (AttentionFwdWorkspaceElems: none
# where no device is known) for the launcher's kernel (ChooseFwdKernel): 192
# rows a work tile at head dims 64 from 512 keys and queries and at 128 from
# 2048, else 128; none under a causal mask. More work tiles than a 132-SM
# GPU's SMs in each case (tests/test_plans.py checks the plan's rules).
@pytest.mark.parametrize("t, s, n, h, rows", [
    (900, 4096, 27, 64, 192),   # 135 work tiles of 192 rows
    (380, 6000, 48, 64, 128),   # below 512 queries: 144 of 128 rows (176 keys)
    (4097, 4097, 7, 128, 192),  # 154 of 192 rows
    (4096, 4096, 7, 128, 192),  # 154 of 192 rows (128 keys: 32 key tiles)
    (2000, 8192, 11, 128, 128),  # below 2048 queries: 176 of 128 rows (176 keys)
])
def test_cuda_lowering_forward_workspace(t, s, n, h, rows):
  q = jax.ShapeDtypeStruct((1, t, n, h), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((1, s, n, h), jnp.bfloat16)
  shape = plans.attention_shape(b=1, t=t, s=s, n=n, kh=n, h=h, hv=h)
  options = plans.attention_options(scale=h ** -0.5)
  assert plans.attention_fwd_kernel(shape, options)[0] == rows
  elems = plans.attention_fwd_workspace_elems(shape, options)
  if plans.current_device().sm_count == 132:
    assert elems == 2 * 132 * rows * (h + 1)
  hlo = cuda_hlo(jax_dnn.dot_product_attention, q, kv, kv)
  assert _call_results(hlo, "jax_dnn_attention_fwd").endswith(f", tensor<{elems}xf32>)")
  causal = functools.partial(jax_dnn.dot_product_attention, is_causal=True)
  hlo = cuda_hlo(causal, q, kv, kv)
  assert _call_results(hlo, "jax_dnn_attention_fwd").endswith(", tensor<0xf32>)")


def test_flax_multi_head_attention(device):
  x = randn(9, (2, 3, 5, 32), jnp.float32)
  mask = nnx.make_causal_mask(jnp.ones((2, 3, 5)))
  ours = jax_dnn.nn.MultiHeadAttention(4, 32, decode=False, rngs=nnx.Rngs(0))
  theirs = nnx.MultiHeadAttention(4, 32, decode=False, rngs=nnx.Rngs(0))
  np.testing.assert_allclose(ours(x, mask=mask), theirs(x, mask=mask), rtol=1e-5, atol=1e-5)
  plain = nnx.MultiHeadAttention(4, 32, decode=False, rngs=nnx.Rngs(0),
                                 attention_fn=jax_dnn.nn.dot_product_attention)
  np.testing.assert_allclose(plain(x), theirs(x), rtol=1e-5, atol=1e-5)
  dropping = jax_dnn.nn.MultiHeadAttention(4, 32, decode=False, dropout_rate=0.1,
                                           rngs=nnx.Rngs(0, dropout=1))
  with pytest.raises(ValueError, match="dropout is not supported"):
    dropping(x, deterministic=False)
  np.testing.assert_allclose(dropping(x, deterministic=True), theirs(x), rtol=1e-5, atol=1e-5)


def test_vjp_of_jitted_function(device):
  """jax.vjp straight over a jitted call (the custom VJP's output structure)."""
  q, k, v = qkv(10, 2, 5, 6, 2, 1, 16, jnp.float32)
  y, vjp = jax.vjp(jax.jit(jax_dnn.dot_product_attention), q, k, v)
  grads = vjp(jnp.ones_like(y))
  assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]


# The reference's query-row blocks (the path of float32 inputs and of head
# dims without a kernel on CUDA, of every input elsewhere): past a size it
# runs over blocks of _REF_BLOCK_ROWS query rows, so that its memory is linear
# in S. Here the blocks are forced (16 rows, from any size) and the result
# compared with the dense form's; the value head dim 12 has no kernel, so the
# GPU variant runs the reference there too. T = 70: 5 blocks, the last one
# ragged.
def _block_options(b, t, s, n):
  rng = np.random.default_rng(3)
  return {
      "bias_mask_lengths_causal": dict(
          bias=randn(7, (b, n, t, s), jnp.float32),
          mask=jnp.asarray(rng.random((b, 1, t, s)) < 0.8),
          query_seq_lengths=jnp.array([t, 33]), key_value_seq_lengths=jnp.array([s, 20]),
          is_causal=True),
      "segments_window_softcap": dict(
          q_segment_ids=jnp.asarray(rng.integers(0, 2, (b, t)), jnp.int32),
          kv_segment_ids=jnp.asarray(rng.integers(0, 2, (b, s)), jnp.int32),
          local_window_size=(10, 3), logits_soft_cap=2.0),
      "bias_broadcast_heads": dict(bias=randn(8, (b, 1, t, s), jnp.float32)),
      "bias_broadcast_batch": dict(bias=randn(9, (1, n, t, s), jnp.float32), is_causal=True),
  }


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("option", list(_block_options(2, 70, 50, 4)))
def test_reference_blocks_match_dense(device, monkeypatch, option, dtype):
  b, t, s, n = 2, 70, 50, 4
  q, k, v = qkv(30, b, t, s, n, 2, 16, dtype, hv=12)
  kwargs = _block_options(b, t, s, n)[option]
  bias = kwargs.pop("bias", None)

  def f(q, k, v, bias):
    o, lse = jax_dnn.dot_product_attention(q, k, v, bias, return_residual=True, **kwargs)
    w = jnp.cos(jnp.arange(o.size, dtype=jnp.float32)).reshape(o.shape)  # a varied cotangent
    return jnp.sum(o.astype(jnp.float32) * w), (o, lse)

  def run():  # a fresh jit each time: the reference is traced anew
    fn = jax.jit(jax.grad(f, (0, 1, 2, 3) if bias is not None else (0, 1, 2), has_aux=True))
    return fn.lower(q, k, v, bias).as_text(), fn(q, k, v, bias)

  hlo_dense, (g_dense, (o_dense, lse_dense)) = run()
  monkeypatch.setattr(attention_src, "_REF_BLOCK_ROWS", 16)
  monkeypatch.setattr(attention_src, "_REF_DENSE_SCORES", 0)
  hlo_blocked, (g_blocked, (o_blocked, lse_blocked)) = run()
  assert "while" not in hlo_dense and "while" in hlo_blocked  # the blocks ran (lax.map / scan)
  tol = dict(rtol=1e-5, atol=1e-5) if dtype == jnp.float32 else dict(rtol=2e-2, atol=2e-2)
  for name, x, y in [("o", o_blocked, o_dense), ("lse", lse_blocked, lse_dense)] + [
      (f"grad {i}", x, y) for i, (x, y) in enumerate(zip(g_blocked, g_dense))]:
    x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
    assert not np.isnan(x).any(), name
    np.testing.assert_allclose(x, y, err_msg=name, **tol)


def test_reference_memory_is_linear_in_s():
  """fwd+bwd through the reference (float32) at S = 32k, 64k and 128k: the
  compiled program's scratch is a few score blocks (at most _REF_BLOCK_SCORES
  fp32 each, the row count shrinking as S grows) plus O(S) arrays, where one
  dense fp32 score matrix alone would be 4, 16 and 64 GiB. (How many blocks
  are live at once is XLA's choice: 3 to 4 on GPU, where the scratch is
  104 / 288 / 240 MiB on an H200 with jax 0.11.2, 168 / 336 / 352 MiB on
  CPU with jax 0.10.2.)"""
  temp, bound = {}, {}
  for s in (32768, 65536, 131072):
    x = jax.ShapeDtypeStruct((1, s, 1, 64), jnp.float32)
    loss = lambda q, k, v: jnp.sum(jax_dnn.dot_product_attention(q, k, v, is_causal=True))
    compiled = jax.jit(jax.grad(loss, (0, 1, 2))).lower(x, x, x).compile()
    temp[s] = compiled.memory_analysis().temp_size_in_bytes
    _, rows = attention_src._ref_blocks(x, x)
    score_block = 4 * rows * s
    bound[s] = 6 * score_block + 32 * (4 * s * 64)  # 6 blocks, 32 [S, 64] fp32 arrays
    assert temp[s] < min(bound[s], 4 * s * s // 8), (s, temp, bound)  # and < dense / 8
  assert temp[131072] < 4 * temp[32768], temp  # 4x S: linear <= 4x, quadratic 16x


# Padding holding NaN or Inf (a KV-cache page not yet written, a padded batch)
# never reaches a result: each option excludes some key rows [b, s, kv head]
# from every query of their batch and head group, and some query rows
# [b, t, n] from every key; those rows of k, v and q are poisoned. B, T, S,
# N, K, H = 2, 5, 9, 4, 2, 16 (bfloat16: the kernels' case on a GPU).
def _padding_options():
  b, t, s, n, kh = 2, 5, 9, 4, 2
  dead_k, dead_q = np.zeros((b, s, kh), bool), np.zeros((b, t, n), bool)
  opts = {}

  def add(name, kwargs, keys=(), rows=()):
    k_, q_ = dead_k.copy(), dead_q.copy()
    for i in keys:
      k_[i] = True
    for i in rows:
      q_[i] = True
    opts[name] = (kwargs, k_, q_)

  add("kv_lengths", dict(key_value_seq_lengths=jnp.array([9, 4])), [(1, slice(4, None))])
  add("causal_t_below_s", dict(is_causal=True), [(slice(None), slice(5, None))])  # T < S
  add("window", dict(local_window_size=(1, 2)), [(slice(None), slice(7, None))])  # s > T-1+2
  add("query_lengths_causal", dict(query_seq_lengths=jnp.array([5, 2]), is_causal=True),
      [(0, slice(5, None)), (1, slice(2, None))], [(1, slice(2, None))])
  # Key 3 of batch 0 is masked for query heads 0 and 1 (kv head 0's group)
  # alone: live for kv head 1. Key 6 of batch 1 is masked for every head;
  # query row 2 of batch 1, head 1 sees no key.
  mask = np.random.default_rng(4).random((b, n, t, s)) < 0.7
  mask[..., 0] = True
  mask[0, :2, :, 3] = False
  mask[0, 2:, :, 3] = True
  mask[1, :, :, 6] = False
  mask[1, 1, 2, :] = False
  add("mask_grouped_heads", dict(mask=jnp.asarray(mask)), [(0, 3, 0), (1, 6)], [(1, 2, 1)])
  # Segments no query (key) of the batch has; query row 4 of batch 1 too.
  q_seg = jnp.array([[0, 0, 1, 1, 1], [2, 2, 2, 2, 7]])
  kv_seg = jnp.array([[0, 0, 1, 1, 3, 3, 3, 3, 3], [2, 2, 2, 2, 2, 2, 5, 5, 5]])
  add("segments", dict(q_segment_ids=q_seg, kv_segment_ids=kv_seg),
      [(0, slice(4, None)), (1, slice(6, None))], [(1, 4)])
  return opts


def _poisoned(q, k, v, dead_k, dead_q, value):
  k_ = jnp.where(dead_k[..., None], value, k)
  v_ = jnp.where(dead_k[..., None], value, v)
  return jnp.where(dead_q[..., None], value, q), k_, v_


@pytest.mark.parametrize("value", [np.nan, np.inf], ids=["nan", "inf"])
@pytest.mark.parametrize("option", list(_padding_options()))
def test_padding_holding_nan_never_reaches_a_result(device, option, value):
  kwargs, dead_k, dead_q = _padding_options()[option]
  q, k, v = qkv(40, 2, 5, 9, 4, 2, 16, jnp.bfloat16)
  w = jnp.cos(jnp.arange(q.size, dtype=jnp.float32)).reshape(q.shape)  # a varied cotangent

  def loss(*a):
    o = jax_dnn.dot_product_attention(*a, **kwargs).astype(jnp.float32)
    return jnp.sum(o * w), o

  f = jax.jit(jax.grad(loss, (0, 1, 2), has_aux=True))
  g_clean, o_clean = f(q, k, v)
  g, o = f(*_poisoned(q, k, v, dead_k, dead_q, value))
  # The same values as from clean inputs, up to one bfloat16 rounding (the
  # kernels' single-pass backward adds dQ in an order that varies).
  tol = dict(rtol=1e-2, atol=1e-2)
  assert np.isfinite(o).all()
  np.testing.assert_allclose(o, o_clean, **tol)
  for name, x, y, dead in zip("qkv", g, g_clean, (dead_q, dead_k, dead_k)):
    x = np.asarray(x, np.float32)
    assert np.isfinite(x).all(), f"d{name}"
    np.testing.assert_array_equal(x[dead], 0.0, err_msg=f"d{name} at the padding")
    np.testing.assert_allclose(x, np.asarray(y, np.float32), err_msg=f"d{name}", **tol)


def test_padding_holding_nan_under_vmap(device):
  """The same under vmap (lengths and mask batched): grad of vmap and vmap
  of grad, jitted."""
  q, k, v = qkv(41, 3, 4, 8, 2, 1, 16, jnp.bfloat16)
  lens = jnp.array([8, 5, 2])
  mask = jnp.ones((3, 1, 4, 8), bool).at[1, :, :, 1].set(False)
  dead = (jnp.arange(8)[None] >= lens[:, None]) | ~mask[:, 0, 0]  # [B, S]
  k_, v_ = (jnp.where(dead[:, :, None, None], jnp.nan, x) for x in (k, v))

  def one(q, k, v, lens, mask):  # one example: [T, N, H]
    return jax_dnn.dot_product_attention(q, k, v, mask=mask, key_value_seq_lengths=lens[None])

  batched = jax.vmap(one)
  loss = lambda *a: jnp.sum(batched(*a, lens, mask).astype(jnp.float32) ** 2)
  o = jax.jit(batched)(q, k_, v_, lens, mask)
  np.testing.assert_allclose(np.asarray(o, np.float32),
                             np.asarray(batched(q, k, v, lens, mask), np.float32), rtol=1e-2,
                             atol=1e-2)  # one bfloat16 rounding
  for g in jax.jit(jax.grad(loss, (0, 1, 2)))(q, k_, v_):
    assert np.isfinite(np.asarray(g, np.float32)).all()
  per_example = jax.jit(jax.vmap(jax.grad(
      lambda *a: jnp.sum(one(*a).astype(jnp.float32) ** 2), (0, 1, 2))))
  for g in per_example(q, k_, v_, lens, mask):
    assert np.isfinite(np.asarray(g, np.float32)).all()


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
def test_nan_in_an_attended_position_propagates_as_jax_nn(device, dtype):
  """NaN in valid data is never hidden: a value that every query of its
  head group attends to (key 0 under a causal mask), and a query element,
  give NaN exactly where jax.nn gives it, padding elsewhere set to NaN."""
  q, k, v = qkv(42, 2, 5, 9, 4, 2, 16, dtype)
  lens = jnp.array([9, 6])
  v = v.at[0, 0, 1, 3].set(jnp.nan).at[1, 6:].set(jnp.nan)  # batch 1: 6.. is padding
  q = q.at[1, 2, 0, 5].set(jnp.nan)
  kw = dict(is_causal=True, key_value_seq_lengths=lens)
  ours = np.asarray(jax_dnn.dot_product_attention(q, k, v, **kw), np.float32)
  f32 = [x.astype(jnp.float32).at[1, 6:].set(0.0) if i == 2 else x.astype(jnp.float32)
         for i, x in enumerate((q, k, v))]  # jax.nn's own padding is poisoned by NaN
  theirs = np.asarray(jax.nn.dot_product_attention(*f32, **kw))
  want = np.zeros(theirs.shape, bool)
  want[0, :, 2:, 3] = True  # query heads 2, 3 share kv head 1
  want[1, 2, 0, :] = True
  np.testing.assert_array_equal(np.isnan(theirs), want)
  np.testing.assert_array_equal(np.isnan(ours), want)


def test_inputs_jax_nn_takes():
  """Inputs jax.nn.dot_product_attention accepts are accepted, with its
  results: integer and bool inputs (jax.nn's own dtype rules), lists,
  integer and scalar biases, lower ranks (left-padded with ones), a traced
  integer scale, head dim 0, and float64 under jax_enable_x64."""
  dpa = jax_dnn.dot_product_attention
  q, k, v = qkv(43, 2, 4, 6, 2, 1, 8, jnp.float32)
  close = functools.partial(np.testing.assert_allclose, rtol=1e-5, atol=1e-6)
  ints = [jnp.round(4 * x).astype(jnp.int32) for x in (q, k, v)]
  np.testing.assert_array_equal(dpa(*ints), jax.nn.dot_product_attention(*ints))
  bools = [x > 0 for x in (q, k, v)]
  np.testing.assert_array_equal(dpa(*bools, is_causal=True),
                                jax.nn.dot_product_attention(*bools, is_causal=True))
  close(dpa(*(np.asarray(x).tolist() for x in (q, k, v))), dpa(q, k, v))
  for bias in (jnp.arange(6, dtype=jnp.int32) % 3, 0.5):
    close(dpa(q, k, v, bias), jax.nn.dot_product_attention(q, k, v, bias))
  # Rank 2: [heads, head_dim] (T = S = 1); ranks 3 and 4 (a batch of one).
  for args in ((q[0, :, 0], k[0, :2, 0], v[0, :2, 0]), (q[0], k[:1], v[:1])):
    close(dpa(*args), jax.nn.dot_product_attention(*args))
  traced = jax.jit(lambda s: dpa(q, k, v, scale=s))
  close(traced(2), jax.nn.dot_product_attention(q, k, v, scale=2))
  # Head dim 0: every logit is 0 (uniform attention), whatever the scale.
  assert dpa(q[..., :0], k[..., :0], v[..., :0]).shape == (2, 4, 2, 0)
  close(dpa(q[..., :0], k[..., :0], v), jnp.broadcast_to(
      jnp.mean(v, axis=1, keepdims=True), (2, 4, 2, 8)))
  with x64():
    q64, k64, v64 = (x.astype(jnp.float64) for x in (q, k, v))
    bias = randn(44, (2, 1, 4, 6), jnp.float32)
    kw = dict(is_causal=True, key_value_seq_lengths=jnp.array([6, 3], jnp.int32))
    o = dpa(q64, k64, v64, bias, **kw)
    assert o.dtype == jnp.float64
    close(o, jax.nn.dot_product_attention(q64, k64, v64, bias, **kw))  # jax.nn's softmax: fp32
    loss = lambda f, *a: jnp.sum(f(*a, **kw) ** 2)
    g = jax.grad(functools.partial(loss, dpa), (0, 1, 2, 3))(q64, k64, v64, bias)
    assert [x.dtype for x in g] == [jnp.float64] * 3 + [jnp.float32]
    g2 = jax.grad(functools.partial(loss, jax.nn.dot_product_attention), (0, 1, 2, 3))(
        q64, k64, v64, bias)
    jax.tree.map(close, g, g2)
    # float32 inputs under x64: float32 throughout, the bias's gradient too.
    g = jax.grad(functools.partial(loss, dpa), (0, 1, 2, 3))(q, k, v, bias)
    assert [x.dtype for x in g] == [jnp.float32] * 4


@pytest.mark.parametrize("case", [
    "rank_4_and_5", "batch_dims_swapped", "batch_dims_flattened", "kv_batch_differs",
    "mask_does_not_broadcast", "bias_does_not_broadcast"])
def test_nn_bad_shapes_raise_as_flax_does(case):
  """jax_dnn.nn.dot_product_attention folds the batch dims into one: query
  and key/value batch dims that differ would pair mismatched batches. The
  same exception type as flax.nnx.dot_product_attention, naming the
  argument."""
  t, s, n, h = 4, 5, 2, 8
  x = lambda batch, length: randn(45, batch + (length, n, h), jnp.float32)
  q4, kv4 = x((2,), t), x((2,), s)
  args, kwargs, error, match = {
      "rank_4_and_5": ((q4, x((1, 2), s), x((1, 2), s)), {}, ValueError, "same rank"),
      "batch_dims_swapped": ((x((2, 3), t), x((3, 2), s), x((3, 2), s)), {}, ValueError,
                             "same batch dims"),
      "batch_dims_flattened": ((x((6,), t), x((2, 3), s), x((2, 3), s)), {}, ValueError,
                               "same rank"),
      "kv_batch_differs": ((q4, x((1,), s), x((1,), s)), {}, ValueError, "same batch dims"),
      "mask_does_not_broadcast": ((q4, kv4, kv4), dict(mask=jnp.ones((2, n, t, s + 1), bool)),
                                  TypeError, r"mask of shape \(2, 2, 4, 6\) does not broadcast"),
      "bias_does_not_broadcast": ((q4, kv4, kv4), dict(bias=jnp.ones((3, n, t, s))),
                                  TypeError, r"bias of shape \(3, 2, 4, 5\) does not broadcast"),
  }[case]
  with pytest.raises(error, match=match):
    jax_dnn.nn.dot_product_attention(*args, **kwargs)
  with pytest.raises(error):
    nnx.dot_product_attention(*args, **kwargs)
