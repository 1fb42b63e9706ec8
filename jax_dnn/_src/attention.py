"""dot_product_attention: the API, mask semantics, primitives and reference.

Shapes (the layout of jax.nn.dot_product_attention):
  query [B, T, N, H], key [B, S, K, H], value [B, S, K, Hv]; K divides N
  (grouped-query / multi-query attention); Hv may differ from H (as in MLA).
  bias [G, N|1, T, S] (any float dtype), mask [G, N|1, T, S] bool, where G
  divides B and batch b uses entry b // (B / G) (G is 1 or B for users; vmap
  folds its axis into B and G the same way, never looping).
  query_seq_lengths, key_value_seq_lengths [B] int; segment ids [B, T] / [B, S].
Math, per head n (kv head n // (N / K)), in fp32:
  s = scale * q k^T;  s = cap * tanh(s / cap) if logits_soft_cap;  s += bias
  s = -inf where masked (mask, causal, window, lengths, segments)
  o = softmax(s) v;   lse = logsumexp(s)
A fully masked query row gives o = 0 (and lse = -inf), with zero gradients:
never NaN. (jax.nn.dot_product_attention instead averages V over such rows,
except for rows beyond query_seq_lengths, which it also zeroes.)
Padding never reaches a result, even holding NaN or Inf (a KV-cache page not
yet written, a padded batch): a key position that no query of its batch and
kv head can attend to -- past key_value_seq_lengths, a column the mask
excludes for every query row of every head sharing the kv head, past the
causal or local window's reach from the query length, a segment id no query
has -- contributes nothing, and a query row that one of these alone leaves
without keys gives 0 and zero gradients (_zero_excluded: such rows of q, k
and v are zeroed before the kernels and the reference; a zero probability
times NaN would be NaN). NaN or Inf in a key or value that some query
attends to propagates as jax.nn propagates it.

On CUDA the primitives lower to the fused Hopper kernels (ffi/attention/)
for bfloat16/float16 with head dims that are multiples of 8 up to 256 (key and
value head dims padded to the same 64-multiple, or 192/128 as in MLA); memory
is O(T + S) per head. Every other case (float32, other head dims, empty
shapes, other platforms) lowers to the pure-JAX reference below, in fp32
(its matmuls at jax's default precision: TF32 on Hopper GPUs unless
jax.default_matmul_precision("highest") asks for full fp32):
it materializes the [T, S] scores of a call up to 2^28 of them, and past that
runs over blocks of up to 256 query rows, so that its memory too is linear in S
(_REF_BLOCK_ROWS). A bias is passed to the kernels as float32.
float64 inputs (jax_enable_x64) run the reference in float64; integer, bool
and complex ones run jax.nn.dot_product_attention itself (its dtype rules).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jax_dnn._src import checks
from jax_dnn._src import plans
from jax_dnn._src import sharding
from jax_dnn._src.batching import (NOT_MAPPED, batch_size, merge_leading, move_to_front,
                                   split_leading)
from jax_dnn._src.config import config
from jax_dnn._src.mesh_types import like_primal, same_manual_axes
from jax_dnn._src.derivatives import custom_vjp
from jax_dnn._src.primitive import ShapedArray, define_primitive

# Operand order after q, k, v; each present or absent (params record which).
_OPTIONAL = ("bias", "mask", "q_lens", "kv_lens", "q_seg", "kv_seg")


# --- the reference (pure JAX; what runs where the kernels do not) -------------


def _acc_dtype(dtype):
  """The dtype of the scores and statistics: float32, or float64 for float64
  inputs (jax.nn's logits dtype, promote_types(query's, float32))."""
  return jnp.promote_types(dtype, jnp.float32)


def _by_set(op, s, x):
  """op(s, x) for s [B, ...] and x [G, ...] with G dividing B (see above)."""
  g = x.shape[0]
  return op(s.reshape((g, -1) + s.shape[1:]), x[:, None]).reshape(s.shape)


def _logits_and_valid(q, k, ops, *, scale, softcap, is_causal, window, q0=0):
  """Scores [B, N, T, S] (fp32, fp64 for fp64 inputs) and the boolean mask of
  allowed positions, for query rows q0 .. q0 + T - 1 (a block of them: the
  row operands in `ops`, bias, mask and q_seg, hold those rows only)."""
  b, t, n, _ = q.shape
  s_len, kh = k.shape[1], k.shape[2]
  g = n // kh
  acc = _acc_dtype(q.dtype)
  kf = jnp.repeat(k.astype(acc), g, axis=2) if g > 1 else k.astype(acc)
  s = jnp.einsum("btnh,bsnh->bnts", q.astype(acc), kf) * scale
  if softcap:
    s = softcap * jnp.tanh(s / softcap)
  if ops.get("bias") is not None:
    s = _by_set(lambda a, c: a + c, s, ops["bias"].astype(acc))
  valid = jnp.ones((1, 1, t, s_len), bool)
  qi = q0 + jnp.arange(t)[:, None]
  kj = jnp.arange(s_len)[None, :]
  if is_causal:
    valid = valid & (kj <= qi)[None, None]
  if window is not None:
    left, right = window
    valid = valid & ((qi - kj <= left) & (kj - qi <= right))[None, None]
  valid = jnp.broadcast_to(valid, (b, n, t, s_len))
  if ops.get("mask") is not None:
    valid = _by_set(jnp.logical_and, valid, ops["mask"])
  if ops.get("q_lens") is not None:
    valid = valid & (q0 + jnp.arange(t)[None, :] < ops["q_lens"][:, None])[:, None, :, None]
  if ops.get("kv_lens") is not None:
    valid = valid & (jnp.arange(s_len)[None, :] < ops["kv_lens"][:, None])[:, None, None, :]
  if ops.get("q_seg") is not None:
    same = ops["q_seg"][:, :, None] == ops["kv_seg"][:, None, :]
    valid = valid & same[:, None]
  return s, jnp.broadcast_to(valid, (b, n, t, s_len))


# Query-row blocks of the reference: where a call's fp32 scores [B, N, T, S]
# would pass _REF_DENSE_SCORES (1 GiB a score matrix; the dense fwd+bwd holds
# about five), the reference runs over blocks of at most _REF_BLOCK_ROWS
# query rows (lax.map / lax.scan), fewer where B N S is large (a block's
# scores up to _REF_BLOCK_SCORES, from 8 rows), so that its memory is
# O(B N rows S) -- linear in S -- not O(T S): the path of float32 inputs and
# of head dims without a kernel on CUDA, and of every input on other
# platforms. (The bias gradient, [B, N, T, S] itself, stays whole.)
_REF_BLOCK_ROWS = 256
_REF_DENSE_SCORES = 1 << 28
_REF_BLOCK_SCORES = 1 << 24


def _ref_blocks(q, k):
  """(blocks, rows a block) of the reference's query rows ((1, T): dense).
  The rows are spread evenly over the blocks (multiples of 8), so that the
  last block is not mostly padding."""
  b, t, n, _ = q.shape
  dims = (b, t, n, k.shape[1])
  if not all(isinstance(d, int) for d in dims) or math.prod(dims) <= _REF_DENSE_SCORES:
    return 1, t  # (a symbolic shape: dense)
  cap = min(_REF_BLOCK_ROWS, max(8, _REF_BLOCK_SCORES // (b * n * k.shape[1]) // 8 * 8))
  if t <= cap:
    return 1, t
  blocks = -(-t // cap)
  return blocks, -(-(-(-t // blocks)) // 8) * 8


# The operands indexed by query row, and the axis of their rows.
_ROW_AXIS = {"bias": 2, "mask": 2, "q_seg": 1}


def _pad_rows(x, axis, rows):
  pad = [(0, 0)] * x.ndim
  pad[axis] = (0, rows - x.shape[axis])
  return jnp.pad(x, pad)


def _row_block(x, axis, i, rows):
  return jax.lax.dynamic_slice_in_dim(x, i * rows, rows, axis=axis)


def _blocked_rows(q, ops, blocks, rows):
  """q and the row operands padded to `blocks` whole blocks of `rows` query
  rows (padded rows: zero queries, bias and segment ids, mask False; their
  scores stay finite, their outputs are cut off, and with a zero output
  cotangent they add nothing to dK / dV), and a function of the block index
  giving that block's (q, ops, q0)."""
  tp = blocks * rows

  def by_row(name, x):  # indexed by query row (not broadcast over the rows)
    return name in _ROW_AXIS and x.shape[_ROW_AXIS[name]] > 1

  qp = _pad_rows(q, 1, tp)
  opsp = {name: _pad_rows(x, _ROW_AXIS[name], tp) if by_row(name, x) else x
          for name, x in ops.items()}

  def block(i):
    ops_i = {name: _row_block(x, _ROW_AXIS[name], i, rows) if by_row(name, x) else x
             for name, x in opsp.items()}
    return _row_block(qp, 1, i, rows), ops_i, i * rows

  return block


def _fwd_reference(q, k, v, *operands, present, deterministic=False, **params):
  del deterministic  # a backward option
  ops = dict(zip(present, operands))
  blocks, rows = _ref_blocks(q, k)
  if blocks == 1:
    return _fwd_dense(q, k, v, ops, **params)
  block = _blocked_rows(q, ops, blocks, rows)

  def one(i):
    q_i, ops_i, q0 = block(i)
    return _fwd_dense(q_i, k, v, ops_i, q0=q0, **params)

  o, lse = jax.lax.map(one, jnp.arange(blocks))  # [C, B, rows, N, Hv], [C, B, N, rows]
  b, t, n, _ = q.shape
  o = jnp.moveaxis(o, 0, 1).reshape((b, -1) + o.shape[3:])[:, :t]
  lse = jnp.moveaxis(lse, 0, 2).reshape(b, n, -1)[:, :, :t]
  return o, lse


def _fwd_dense(q, k, v, ops, *, q0=0, **params):
  """o [B, T, N, Hv] in q's dtype and lse [B, N, T] for query rows q0 + ..."""
  s, valid = _logits_and_valid(q, k, ops, q0=q0, **params)
  s = jnp.where(valid, s, -jnp.inf)
  m = jnp.max(s, axis=-1, keepdims=True, initial=-jnp.inf)  # initial: S = 0
  m_safe = jnp.where(jnp.isfinite(m), m, 0.0)  # fully masked rows: no -inf - -inf
  p = jnp.where(valid, jnp.exp(s - m_safe), 0.0)
  l = jnp.sum(p, axis=-1, keepdims=True)
  g = q.shape[2] // k.shape[2]
  vf = v.astype(s.dtype)
  vf = jnp.repeat(vf, g, axis=2) if g > 1 else vf
  o = jnp.einsum("bnts,bsnh->btnh", p / jnp.where(l > 0, l, 1.0), vf)
  lse = jnp.where(l[..., 0] > 0, m_safe[..., 0] + jnp.log(jnp.where(l > 0, l, 1.0))[..., 0],
                  -jnp.inf)
  return o.astype(q.dtype), lse


def _bwd_reference(do, q, k, v, o, lse, *operands, present, **params):
  """(dq, dk, dv), and with a bias dlogits [B, N, T, S] (fp32; fp64 for fp64)."""
  del o, lse  # the reference recomputes
  b, t, n, _ = q.shape
  s_len = k.shape[1]
  has_bias = "bias" in present
  rest = operands[1:] if has_bias else operands
  diff = [q, k, v]
  acc = _acc_dtype(q.dtype)
  if has_bias:  # differentiate w.r.t. a full-shaped bias: dlogits, as the kernel returns
    diff.append(jnp.broadcast_to(_by_set(lambda a, c: a + c, jnp.zeros((b, n, t, s_len), acc),
                                          operands[0].astype(acc)), (b, n, t, s_len)))

  params.pop("deterministic", None)  # a kernel option
  blocks, rows = _ref_blocks(q, k)
  if blocks == 1:
    def f(*d):
      ops = dict(zip(present, (d[3],) + tuple(rest) if has_bias else tuple(rest)))
      return _fwd_dense(d[0], d[1], d[2], ops, **params)[0]

    return tuple(jax.vjp(f, *diff)[1](do.astype(q.dtype)))

  # Blocks of query rows: each block's vjp gives its dQ rows and dlogits
  # rows, and adds to dK and dV, accumulated in fp32 over the blocks (the
  # block's math is fp32 whatever the input dtype, as in the dense form;
  # fp64 for fp64 inputs).
  ops = dict(zip(present, operands))
  if has_bias:  # the full-shaped bias of the dense form, [B, N, T, S]
    ops["bias"] = diff[3]
  block = _blocked_rows(q, ops, blocks, rows)
  dop = _pad_rows(do.astype(q.dtype).astype(acc), 1, blocks * rows)
  kf, vf = k.astype(acc), v.astype(acc)

  def one(carry, i):
    q_i, ops_i, q0 = block(i)
    bias_i = ops_i.pop("bias", None)

    def f(qb, kb, vb, *bias):
      return _fwd_dense(qb, kb, vb, dict(ops_i, **({"bias": bias[0]} if bias else {})),
                        q0=q0, **params)[0]

    primals = (q_i.astype(acc), kf, vf) + ((bias_i,) if has_bias else ())
    g = jax.vjp(f, *primals)[1](_row_block(dop, 1, i, rows))
    dk, dv = carry
    return (dk + g[1], dv + g[2]), (g[0], g[3] if has_bias else None)

  (dk, dv), (dq, ds) = jax.lax.scan(one, (jnp.zeros_like(kf), jnp.zeros_like(vf)),
                                    jnp.arange(blocks))
  t = q.shape[1]
  dq = jnp.moveaxis(dq, 0, 1).reshape((b, -1) + q.shape[2:])[:, :t].astype(q.dtype)
  grads = (dq, dk.astype(k.dtype), dv.astype(v.dtype))
  if not has_bias:
    return grads
  # [C, B, N, rows, S] -> [B, N, T, S]
  return (*grads, jnp.moveaxis(ds, 0, 2).reshape(b, n, -1, s_len)[:, :, :t])


# --- primitives ---------------------------------------------------------------


def _fwd_abstract(q, k, v, *operands, present, **params):
  """o [B, T, N, Hv] in q's dtype, lse [B, N, T] fp32 (fp64 for fp64 inputs)."""
  b, t, n, _ = q.shape
  return (ShapedArray((b, t, n, v.shape[-1]), q.dtype),
          ShapedArray((b, n, t), _acc_dtype(q.dtype)))


def _bwd_abstract(do, q, k, v, o, lse, *operands, present, **params):
  """dq, dk, dv; with a bias, dlogits: the bias gradient before reduction
  over its broadcast, [B, N, T, S] fp32 (fp64 for fp64 inputs)."""
  out = [ShapedArray(a.shape, a.dtype) for a in (q, k, v)]
  if "bias" in present:
    b, t, n, _ = q.shape
    out.append(ShapedArray((b, n, t, k.shape[1]), _acc_dtype(q.dtype)))
  return tuple(out)


# --- what the kernels take, and their workspace (attention_plan.h) ------------


def _plan_shape(q, k, v):
  """The kernels' view of q, k, v for the plans, or None where a dimension
  other than the batch is symbolic (jax.export): the kernels' workspaces
  need concrete sequence lengths and heads, so such calls take the
  reference. A symbolic batch is passed as plans.LARGE: the plans only
  require it to be positive, and the forward's workspace is an upper bound
  (more work tiles than SMs) whatever the batch."""
  b, t, n, h = q.shape
  s_len, kh = k.shape[1], k.shape[2]
  if not plans.is_static(t, n, h, s_len, kh, v.shape[-1]):
    return None
  return plans.attention_shape(b=plans.static_dim(b, plans.LARGE), t=t, s=s_len, n=n, kh=kh,
                               h=h, hv=v.shape[-1])


def _plan_options(params):
  present, window = params["present"], params["window"]
  return plans.attention_options(
      bias="bias" in present, mask="mask" in present, q_lens="q_lens" in present,
      kv_lens="kv_lens" in present, segments="q_seg" in present, causal=params["is_causal"],
      window_left=-1 if window is None else window[0],
      window_right=-1 if window is None else window[1], scale=params["scale"],
      softcap=params["softcap"])


def _kernel_supported(q, k, v):
  """Whether the CUDA kernels take these operands (else: the reference)."""
  shape = _plan_shape(q, k, v)
  return shape is not None and plans.attention_unsupported(jnp.dtype(q.dtype).name, shape) is None


def _fwd_supported(avals, **params):
  del params
  return _kernel_supported(*avals[:3])


def _bwd_supported(avals, **params):
  del params
  return _kernel_supported(*avals[1:4])


def _fwd_workspace(avals, **params):
  """The split tail's workspace (AttentionFwdWorkspaceElems; [0]: none)."""
  q, k, v = avals[:3]
  elems = plans.attention_fwd_workspace_elems(_plan_shape(q, k, v), _plan_options(params))
  return (ShapedArray((elems,), jnp.float32),)


def _fused_dq(avals, params):
  """Whether the backward runs the single pass (AttentionBwdFusedDq)."""
  q, k, v = avals[1:4]
  return plans.attention_bwd_fused_dq(_plan_shape(q, k, v), _plan_options(params),
                                      params["deterministic"])


def _bwd_workspace(avals, **params):
  """The handler's results past the primitive's: dlogits where there is no
  bias (empty), delta = rowsum(do * o) [B, N, T], and the single pass's fp32
  dQ accumulator [B, N, AttentionDqAccHeadElements] (empty for the split)."""
  q = avals[1]
  b, t, n, h = q.shape
  empty = ShapedArray((0,), jnp.float32)
  acc = (ShapedArray((b, n, plans.attention_dq_acc_head_elements(t, h)), jnp.float32)
         if _fused_dq(avals, params) else empty)
  return ((empty,) if "bias" not in params["present"] else ()) + (
      ShapedArray((b, n, t), jnp.float32), acc)


def _ffi_params(avals, **params):
  """Primitive params -> the handlers' attributes."""
  del avals
  present = params["present"]
  window = params["window"]
  return dict(has_bias="bias" in present, has_mask="mask" in present,
              has_q_lens="q_lens" in present, has_kv_lens="kv_lens" in present,
              has_seg="q_seg" in present, is_causal=params["is_causal"],
              window_left=-1 if window is None else window[0],
              window_right=-1 if window is None else window[1],
              scale=params["scale"], softcap=params["softcap"])


def _bwd_ffi_params(avals, **params):
  return dict(_ffi_params(avals, **params), fused_dq=_fused_dq(avals, params))


def _batch_rule(prim, n_main, args, dims, *, keep_shared, **params):
  """Folds the vmapped axis into the attention batch B of every operand.

  The first n_main operands are [B, ...]; bias and mask are [G, ...] with G
  dividing B, so folding them keeps the b -> b // (B / G) correspondence.
  With keep_shared (forward), an unbatched G = 1 bias/mask stays as is; the
  backward folds it, since dbias must be per example under vmap.
  """
  size = batch_size(args, dims)
  grouped = {n_main + i for i, name in enumerate(params["present"]) if name in ("bias", "mask")}
  folded = []
  for i, (a, d) in enumerate(zip(args, dims)):
    if keep_shared and i in grouped and d is NOT_MAPPED and a.shape[0] == 1:
      folded.append(a)
      continue
    folded.append(merge_leading(move_to_front(a, d, size)))
  outs = prim.bind(*folded, **params)
  return [split_leading(o, size) for o in outs], [0] * len(outs)


def _fwd_batch(args, dims, **params):
  return _batch_rule(attention_fwd_p, 3, args, dims, keep_shared=True, **params)


def _bwd_batch(args, dims, **params):
  return _batch_rule(attention_bwd_p, 6, args, dims, keep_shared=False, **params)


def _sharding(operands, results, *, present, **params):
  """Batch and heads split (query heads with their kv heads: n // (N / K)
  stays on the device of kv head n // (N / K)); sequences and head dims stay
  whole (the causal, window and length masks count positions from 0)."""
  del results, params
  backward = len(operands) == 6 + len(present)  # do, q, k, v, o, lse, optional operands
  q_shape, k_shape, v_shape = operands[1:4] if backward else operands[:3]
  bsz, t, n, h = q_shape
  s_len, kh = k_shape[1], k_shape[2]
  extra = list(zip(present, operands[len(operands) - len(present):]))
  b = sharding.RuleBuilder()
  t_, s_ = b.own(t), b.own(s_len)
  # bias/mask [G, N|1, T, S] with G dividing B: B splits when G is 1 or B.
  batch = b.factor("b", bsz, whole=any(name in ("bias", "mask") and shape[0] not in (1, bsz)
                                       for name, shape in extra))
  if n == kh:  # multi-head
    heads = kv = b.factor("k", kh)
  elif kh == 1:  # multi-query: query heads split, K and V go to every device
    heads, kv = b.factor("g", n), b.own(1, whole=False)
  else:  # grouped: query head n stays on the device of kv head n // (N / K)
    kv = b.factor("k", kh)
    heads = (kv, b.factor("g", n // kh))
  q = (batch, t_, heads, b.own(h))
  o = (batch, t_, heads, b.own(v_shape[-1]))
  k = (batch, s_, kv, b.own(h))
  v = (batch, s_, kv, b.own(v_shape[-1]))
  lse = (batch, heads, t_)
  if backward:
    for x in (o, q, k, v, o, lse):
      b.operand(*x)
  else:
    for x in (q, k, v):
      b.operand(*x)
  for name, shape in extra:
    if name in ("bias", "mask"):
      b.operand(batch if shape[0] == bsz else b.own(shape[0]),
                heads if shape[1] == n else b.own(shape[1]), t_, s_)
    elif name in ("q_lens", "kv_lens"):
      b.operand(batch)
    else:
      b.operand(batch, t_ if name == "q_seg" else s_)
  if backward:  # dq, dk, dv[, dlogits]
    b.result(*q)
    # Multi-query: each device holds some query heads, so its dk, dv are a
    # part of the sum over heads (a no-op where kv heads split with them).
    b.result(*k, sum_=True)
    b.result(*v, sum_=True)
    if "bias" in present:
      b.result(batch, heads, t_, s_)
  else:  # o, lse
    b.result(*o)
    b.result(*lse)
  return b.build()


attention_fwd_p = define_primitive(
    "attention_fwd",
    abstract_eval=_fwd_abstract,
    batching_rule=_fwd_batch,
    reference=_fwd_reference,
    multiple_results=True,
    ffi_params=_ffi_params,
    supported=_fwd_supported,
    workspace=_fwd_workspace,
    sharding=_sharding,
)
attention_bwd_p = define_primitive(
    "attention_bwd",
    abstract_eval=_bwd_abstract,
    batching_rule=_bwd_batch,
    reference=_bwd_reference,
    multiple_results=True,
    ffi_params=_bwd_ffi_params,
    supported=_bwd_supported,
    workspace=_bwd_workspace,
    sharding=_sharding,
)


# --- custom VJP ----------------------------------------------------------------


@functools.partial(custom_vjp, nondiff_argnums=(0,))
def _attention(params, q, k, v, *operands):
  o, lse = attention_fwd_p.bind(q, k, v, *operands, **dict(params))
  return o, lse  # a tuple, as the fwd rule returns (bind gives a list)


def _attention_fwd(params, q, k, v, *operands):
  o, lse = attention_fwd_p.bind(q, k, v, *operands, **dict(params))
  return (o, lse), (q, k, v, o, lse, operands)


def _attention_bwd(params, res, cts):
  q, k, v, o, lse, operands = res
  do, _ = cts  # lse is returned without gradient (like jax's return_residual)
  grads = attention_bwd_p.bind(do.astype(o.dtype), q, k, v, o, lse, *operands, **dict(params))
  present = dict(params)["present"]
  dops = []
  for name, x in zip(present, operands):
    if name == "bias":  # reduce dlogits [B, N, T, S] over the bias's broadcast [G, N|1, T, S]
      ds = grads[3]
      ds = ds.reshape((x.shape[0], -1) + ds.shape[1:]).sum(axis=1)
      if x.shape[1] == 1:
        ds = ds.sum(axis=1, keepdims=True)
      dops.append(ds.astype(x.dtype))
    elif jnp.issubdtype(x.dtype, jnp.floating):
      dops.append(jnp.zeros_like(x))
    else:  # integer / bool operands take float0 cotangents
      dops.append(np.zeros(x.shape, jax.dtypes.float0))
  return tuple(like_primal(ct, a) for ct, a in zip((*grads[:3], *dops), (q, k, v, *operands)))


_attention.defvjp(_attention_fwd, _attention_bwd)


# --- public API -------------------------------------------------------------------

_OP = "dot_product_attention"


def _array(name, x):
  """x as jax.nn takes it: anything jnp.asarray takes (arrays, lists, scalars)."""
  try:
    return jnp.asarray(x)
  except (TypeError, ValueError) as e:  # jnp.asarray's exception type, as jax.nn raises it
    raise type(e)(f"{_OP}: {name} must be an array; got {type(x).__name__} ({e})") from None


def _as_4d(name, x):
  """x [B, T|S, heads, head_dim]; a lower rank is left-padded with ones, as
  jax.nn takes it ([T, N, H]: a batch of one)."""
  if x.ndim > 4:
    raise ValueError(f"{_OP}: {name} must have rank 4 ([B, T|S, heads, head_dim]) or less "
                     f"(left-padded with ones: [T|S, heads, head_dim] is a batch of one); got "
                     f"shape {tuple(x.shape)}")
  return x.reshape((1,) * (4 - x.ndim) + x.shape)


def _check_logits_operand(name, x, b, n, t, s_len):
  """bias / mask: any shape that broadcasts to [B, N, T, S] (as jax.nn takes
  them: rank 0-4, left-padded with ones). Returned as [B|1, N|1, T, S]: the
  kernels read a batch or head dim of one as broadcast; T and S are
  broadcast here (a key-padding mask [B, 1, 1, S] becomes [B, 1, T, S]; the
  bias's gradient is reduced back by broadcast_to's transpose). A shape that
  does not broadcast is a TypeError, as jax's broadcasting raises for it."""
  x = _array(name, x)
  full, given = (b, n, t, s_len), tuple(x.shape)
  if x.ndim > 4:
    raise ValueError(f"{_OP}: {name} must have rank at most 4 (broadcasting to [B, N, T, S] = "
                     f"{list(full)}); got shape {given}")
  x = x.reshape((1,) * (4 - x.ndim) + x.shape)
  if any(d not in (1, f) for d, f in zip(x.shape, full)):
    raise TypeError(f"{_OP}: {name} must broadcast to [B, N, T, S] = {list(full)}; got shape "
                    f"{given}")
  if x.shape[2:] != (t, s_len):
    x = jnp.broadcast_to(x, x.shape[:2] + (t, s_len))
  return x


def _check_ids(name, x, shape):
  if isinstance(x, (list, tuple)):
    x = np.asarray(x)  # as jax.nn takes them (jnp.asarray)
  checks.check_array(_OP, name, x)
  x = jnp.asarray(x)
  if tuple(x.shape) != shape or not jnp.issubdtype(x.dtype, jnp.integer):
    raise ValueError(f"{_OP}: {name} must be an integer array of shape {shape}; got "
                     f"{x.dtype}{tuple(x.shape)}")
  return x.astype(jnp.int32)


def _window(local_window_size):
  if local_window_size is None:
    return None
  if isinstance(local_window_size, (int, np.integer)) and not isinstance(local_window_size, bool):
    w = (int(local_window_size), int(local_window_size))
  elif (isinstance(local_window_size, (tuple, list)) and len(local_window_size) == 2
        and all(isinstance(v, (int, np.integer)) for v in local_window_size)):
    w = (int(local_window_size[0]), int(local_window_size[1]))
  else:
    raise TypeError(f"{_OP}: local_window_size must be an int or a (left, right) pair of ints; "
                    f"got {local_window_size!r}")
  if w[0] < 0 or w[1] < 0:
    raise ValueError(f"{_OP}: local_window_size must be non-negative; got {local_window_size!r}")
  return w


def _concrete(x):
  """A concrete scalar array as its Python value (as jax.nn takes numpy and
  jax scalars); anything else (a tracer, a Python number) as it is."""
  if isinstance(x, (jax.Array, np.ndarray)) and x.shape == () and not isinstance(
      x, jax.core.Tracer):
    return x.item()
  return x


def _static_bool(name, x):
  if not isinstance(x, (bool, np.bool_)):
    raise TypeError(f"{_OP}: {name} must be a bool; got {x!r}")
  return bool(x)


def _is_static_float(x):
  return isinstance(x, (int, float, np.floating, np.integer)) and not isinstance(x, bool)


def _reach(length, other, other_lens, far):
  """[B|1, length]: whether position p of one side (queries or keys) has a
  position o on the other, o < `other` (or other_lens[b]), with p <= o + far
  (far None: any o). None where every position has one (known statically)."""
  if other_lens is None:
    if far is None or plans.is_static(length, other) and length <= other + far:
      return None
    return jnp.arange(length)[None] < other + far
  count = other_lens[:, None]
  return (count > 0) if far is None else (count > 0) & (jnp.arange(length)[None] < count + far)


def _zero_excluded(q, k, v, ops, *, is_causal, window):
  """q, k, v with zeros in the rows no score uses: the key rows [b, s, kv
  head] that no query of their batch and head group attends to, and the
  query rows [b, t, n] that attend to no key, as each mask alone decides
  (a length; the mask's column (row) over every row (column) of the heads
  sharing a kv head; the causal / local window's reach from the other
  side's length; a segment id the other side lacks). Such a row is padding
  (a KV-cache page not yet written, a padded batch) and may hold NaN or Inf:
  a zero probability times NaN is NaN in P V, dS K and dS^T Q, so it is
  zeroed here, before the kernels and the reference, and its gradient is
  zero. Nothing runs where no mask can exclude a row."""
  t, s_len, kh = q.shape[1], k.shape[1], k.shape[2]
  left, right = (None, None) if window is None else window
  if is_causal:
    right = 0  # key s <= query t
  q_lens, kv_lens = ops.get("q_lens"), ops.get("kv_lens")
  # Factors of the live rows, each broadcasting to [B, T, N] / [B, S, K].
  q_live = [_reach(t, s_len, kv_lens, left)]
  k_live = [_reach(s_len, t, q_lens, right)]
  if q_lens is not None:
    q_live.append(jnp.arange(t)[None] < q_lens[:, None])
  if kv_lens is not None:
    k_live.append(jnp.arange(s_len)[None] < kv_lens[:, None])
  if "q_seg" in ops:
    isin = jax.vmap(functools.partial(jnp.isin, method="sort"))  # O(S + T) memory, no loop
    q_live.append(isin(ops["q_seg"], ops["kv_seg"]))
    k_live.append(isin(ops["kv_seg"], ops["q_seg"]))
  mask = ops.get("mask")  # [B|1, N|1, T, S]
  if mask is not None:
    q_live.append(jnp.moveaxis(mask.any(axis=3), 1, 2))
    cols = mask.any(axis=2)  # [B|1, N|1, S]
    if cols.shape[1] not in (1, kh):  # N heads on K kv heads: any head of the group
      cols = cols.reshape(cols.shape[0], kh, -1, s_len).any(axis=2)
    k_live.append(jnp.moveaxis(cols, 1, 2))

  def zeroed(x, live):
    live = [f if f.ndim == 3 else f[..., None] for f in live if f is not None]
    if not live:
      return x
    return jnp.where(functools.reduce(jnp.logical_and, live)[..., None], x, 0)

  return zeroed(q, q_live), zeroed(k, k_live), zeroed(v, k_live)


def dot_product_attention(query, key, value, bias=None, mask=None, *, scale=None,
                          is_causal=False, query_seq_lengths=None, key_value_seq_lengths=None,
                          local_window_size=None, implementation=None, return_residual=False,
                          q_segment_ids=None, kv_segment_ids=None, logits_soft_cap=None,
                          deterministic_backward=None):
  """Scaled dot-product attention, drop-in for jax.nn.dot_product_attention.

  Same arguments, layout ([B, T, N, H]; lower ranks left-padded with ones,
  as [T, N, H] without the batch) and semantics as
  jax.nn.dot_product_attention (see the module docstring for the
  differences: fully masked query rows give zeros, padding holding NaN
  never reaches a result). Beyond it:
    q_segment_ids [B, T], kv_segment_ids [B, S] ([T], [S] for rank-3
      inputs): packed sequences; a query
      attends only to keys with the same segment id.
    logits_soft_cap: c > 0 applies c * tanh(logits / c) to the scaled logits
      (before bias and masks).
    key/value may have fewer heads than query (K divides N) and value's head
      dim may differ from query/key's.
    return_residual: also return the logsumexp [B, T, N] ([T, N] for rank-3
      inputs; fp32, fp64 for float64 inputs; no gradient).
    deterministic_backward: gradients bitwise reproducible from run to run.
      By default the kernels' backward adds dQ in fp32 from every key tile
      (one pass, five GEMMs per tile instead of seven) where it can (head
      dims padding to 64 or 128; without bias, soft-cap, mask or
      segments), and
      the order of those adds varies; True takes the split backward, which
      writes every gradient exactly once (the only path elsewhere). None
      (the default) follows jax_dnn.config.deterministic (False unless
      set); that setting, when True, makes every call deterministic.
    scale may be traced (e.g. a learned temperature): then the query is
      multiplied by it (in its own dtype) before the kernels, which take a
      static scale.
  implementation: None or "jax_dnn" (this library); "xla" or "cudnn" pass
  the call to jax.nn.dot_product_attention with that implementation (its
  semantics, e.g. for fully masked rows; the options above that jax.nn
  lacks are refused there).
  """
  given = dict(query=_array("query", query), key=_array("key", key),
               value=_array("value", value))
  query, key, value = (_as_4d(name, x) for name, x in given.items())
  if given["query"].ndim < 4:  # [T], [S] segment ids of unbatched inputs
    q_segment_ids, kv_segment_ids = (x if x is None or np.ndim(x) != 1 else jnp.asarray(x)[None]
                                     for x in (q_segment_ids, kv_segment_ids))
  b, t, n, h = query.shape
  kb, s_len, kh, kd = key.shape
  if kb != b or value.shape[0] != b:
    raise ValueError(f"{_OP}: query, key and value must share the batch size; got shapes "
                     f"{', '.join(str(tuple(x.shape)) for x in given.values())}")
  if kd != h:
    raise ValueError(f"{_OP}: key head dim {kd} must equal query head dim {h}")
  if value.shape[1] != s_len or value.shape[2] != kh:
    raise ValueError(f"{_OP}: value must be [B, S, K, Hv] = [{b}, {s_len}, {kh}, Hv]; got "
                     f"{tuple(value.shape)}")
  if kh == 0 or n % kh != 0:
    raise ValueError(f"{_OP}: the number of key/value heads ({kh}) must divide the number of "
                     f"query heads ({n})")
  if not (query.dtype == key.dtype == value.dtype):  # a ValueError, as jax.nn raises
    raise ValueError(f"{_OP}: query, key and value must share one dtype; got {query.dtype}, "
                     f"{key.dtype}, {value.dtype}")
  # Integer, bool and complex inputs are jax.nn's alone (its dtype rules: the
  # probabilities cast to the inputs' dtype); floating ones run here, on the
  # kernels or the reference (float64: in float64).
  by_dtype = not jnp.issubdtype(query.dtype, jnp.floating)
  if implementation in ("xla", "cudnn") or by_dtype:
    extra = dict(q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
                 logits_soft_cap=logits_soft_cap, deterministic_backward=deterministic_backward
                 or None, value_head_dim=None if value.shape[3] == h else value.shape[3])
    named = [name for name, x in extra.items() if x is not None]
    if named:
      why = (f"{query.dtype} inputs run jax.nn.dot_product_attention" if by_dtype else
             f"implementation={implementation!r} is jax.nn's")
      raise ValueError(f"{_OP}: {why}, which does not take {', '.join(named)}; use "
                       + ("floating-point inputs" if by_dtype else "implementation=None (jax_dnn)"))
    return jax.nn.dot_product_attention(
        *given.values(), bias, mask, scale=scale, is_causal=is_causal,
        query_seq_lengths=query_seq_lengths, key_value_seq_lengths=key_value_seq_lengths,
        local_window_size=local_window_size, implementation=implementation,
        return_residual=return_residual)
  if implementation not in (None, "jax_dnn"):
    raise ValueError(f"{_OP}: implementation must be None or 'jax_dnn' (or jax.nn's 'xla' / "
                     f"'cudnn'); got {implementation!r}")
  # Head dim 0: every logit is 0, whatever the scale.
  scale = (1.0 / math.sqrt(h) if h else 1.0) if scale is None else _concrete(scale)
  if isinstance(scale, jax.core.Tracer) and scale.shape == () and (
      jnp.issubdtype(scale.dtype, jnp.floating) or jnp.issubdtype(scale.dtype, jnp.integer)):
    # The kernels take a static scale: fold a traced one into the query.
    query = (query.astype(_acc_dtype(query.dtype)) * scale).astype(query.dtype)
    scale = 1.0
  if not _is_static_float(scale):
    raise TypeError(f"{_OP}: scale must be a float scalar; got {scale!r}")
  is_causal = _static_bool("is_causal", is_causal)
  # jax_dnn.config's deterministic setting makes every backward deterministic;
  # the argument asks it of this call alone.
  deterministic_backward = (config.deterministic if deterministic_backward is None else
                            _static_bool("deterministic_backward", deterministic_backward)
                            or config.deterministic)
  softcap = 0.0
  if logits_soft_cap is not None:
    cap = _concrete(logits_soft_cap)
    if not _is_static_float(cap):
      raise TypeError(f"{_OP}: logits_soft_cap must be a float (static); got {logits_soft_cap!r}")
    if not cap > 0:
      raise ValueError(f"{_OP}: logits_soft_cap must be positive; got {logits_soft_cap!r}")
    softcap = float(cap)

  ops = {}
  if bias is not None:
    # Any real dtype, added to the logits as jax.nn adds it; float32 is what
    # the kernels read (gradients flow back through the cast).
    ops["bias"] = _check_logits_operand("bias", bias, b, n, t, s_len).astype(
        _acc_dtype(query.dtype))
  if mask is not None:
    ops["mask"] = _check_logits_operand("mask", mask, b, n, t, s_len)
    if ops["mask"].dtype != jnp.bool_:  # a ValueError, as jax.nn raises
      raise ValueError(f"{_OP}: mask must be boolean (True = attend); got {ops['mask'].dtype}")
  if query_seq_lengths is not None:
    ops["q_lens"] = _check_ids("query_seq_lengths", query_seq_lengths, (b,))
  if key_value_seq_lengths is not None:
    ops["kv_lens"] = _check_ids("key_value_seq_lengths", key_value_seq_lengths, (b,))
  if (q_segment_ids is None) != (kv_segment_ids is None):
    raise ValueError(f"{_OP}: q_segment_ids and kv_segment_ids must be given together")
  if q_segment_ids is not None:
    ops["q_seg"] = _check_ids("q_segment_ids", q_segment_ids, (b, t))
    ops["kv_seg"] = _check_ids("kv_segment_ids", kv_segment_ids, (b, s_len))

  present = tuple(name for name in _OPTIONAL if name in ops)
  window = _window(local_window_size)
  params = dict(present=present, scale=float(scale), softcap=softcap, is_causal=is_causal,
                window=window, deterministic=deterministic_backward)
  query, key, value = _zero_excluded(query, key, value, ops, is_causal=is_causal, window=window)
  o, lse = _attention(tuple(sorted(params.items())),
                      *same_manual_axes(query, key, value, *[ops[name] for name in present]))
  lse = jnp.transpose(jax.lax.stop_gradient(lse), (0, 2, 1))
  rows = given["query"].shape[:-1]  # the query's own rank, as jax.nn returns it
  o, lse = o.reshape(rows + o.shape[-1:]), lse.reshape(rows)
  return (o, lse) if return_residual else o
