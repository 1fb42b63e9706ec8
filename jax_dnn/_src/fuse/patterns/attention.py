"""softmax(q kᵀ [* scale] [+ bias] [masked]) v as einsum, jnp.matmul or
jax.nn.dot_product_attention(implementation="xla") spell it:
  s = dot_general(q, k)        one contracted (head) axis, one free axis each,
                               1 or 2 batch axes (batch, heads)
  s = s * c | s / c            scalars, constant or traced
  s = s + bias                 any array broadcast to s
  s = where(mask, s, fill)     fill -inf or <= -1e9; a constant lower-
                               triangular mask is is_causal
  p = softmax(s) over the key axis (converts around it allowed)
  o = dot_general(p, v)        contracting the key axis, the same batch axes
-> jax_dnn.dot_product_attention on [B, T, N, H] views (transposes XLA folds
into its neighbours). Fully masked query rows give zeros (XLA: NaN or the
values' mean)."""

from __future__ import annotations

import numpy as np
import jax.numpy as jnp

from jax_dnn._src.fuse.patterns import Match, NearMiss
from jax_dnn._src.fuse.patterns import softmax as softmax_lib

NAME = "attention"
ANCHORS = ("dot_general",)
_CONV = ("convert_element_type",)


def _dims(eqn):
  (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
  return tuple(lc), tuple(rc), tuple(lb), tuple(rb)


def _free(ndim, *used):
  return [d for d in range(ndim) if all(d not in u for u in used)]


def _expanded(g, v, shape):
  """v (broadcast to `shape`) as an array of shape's rank with 1 where it
  broadcasts: (variable, reshape target) so that the op gets the small one."""
  hit = g.eqn_of(v, "broadcast_in_dim")
  if hit is None:
    return v, tuple(v.aval.shape)
  src = hit[1].invars[0]
  bd = tuple(hit[1].params["broadcast_dimensions"])
  if list(bd) != sorted(bd):
    return v, tuple(v.aval.shape)
  target = [1] * len(shape)
  for d, n in zip(bd, src.aval.shape):
    target[d] = n
  return src, tuple(target)


def match(g, i):  # pylint: disable=too-many-return-statements,too-many-branches
  from jax_dnn._src import attention as ops  # pylint: disable=g-import-not-at-top
  e2 = g.eqns[i]
  lc, rc, lb, rb = _dims(e2)
  for side in (0, 1):  # which operand of the second dot is the probabilities
    pv, _ = g.through(e2.invars[side], *_CONV)
    sm = softmax_lib.parts(g, pv)
    if sm is not None:
      break
  else:
    return None
  p_pass = g.through(e2.invars[side], *_CONV)[1]
  s_var, s_pass = g.through(sm[0], *_CONV)
  key_axis = sm[1]
  v = e2.invars[1 - side]
  pc, vc = (lc, rc) if side == 0 else (rc, lc)
  pb, vb = (lb, rb) if side == 0 else (rb, lb)
  eqns = [i, *p_pass, *sm[2], *s_pass]
  if pc != (key_axis,) or len(vc) != 1 or len(_free(v.aval.ndim, vc, vb)) != 1:
    return NearMiss(NAME, i, "the second product does not contract the softmax's axis with "
                    "one axis of the values")
  # Back from the softmax's input to the scores' product: masks, bias, scales.
  scale, factors, mask, bias, causal = 1.0, [], None, None, False
  cur = s_var
  while True:
    hit = g.eqn_of(cur, "mul", "div", "add", "select_n", "dot_general", *_CONV)
    if hit is None:
      return None
    j, eqn = hit
    name = eqn.primitive.name
    if name == "dot_general":
      break
    eqns.append(j)
    if name in _CONV:
      cur = eqn.invars[0]
    elif name in ("mul", "div"):
      a, b = eqn.invars
      if name == "mul" and b.aval.ndim and not a.aval.ndim:
        a, b = b, a
      if b.aval.ndim:
        return NearMiss(NAME, i, "the scores are scaled by an array, not a scalar")
      c = g.constant(b)
      if c is not None:
        scale *= float(c) if name == "mul" else 1.0 / float(c)
      else:
        factors.append((b, name))
      cur = a
    elif name == "add":
      a, b = eqn.invars
      if g.eqn_of(b, "dot_general", "mul", "div", *_CONV) and not g.eqn_of(a, "dot_general"):
        a, b = b, a
      if bias is not None:
        return NearMiss(NAME, i, "two biases are added to the scores")
      bias, cur = b, a
    else:  # select_n(pred, false_case, true_case)
      pred, f_case, t_case = eqn.invars
      fill_t, fill_f = g.constant(t_case), g.constant(f_case)
      for fill, keep, keep_when in ((fill_f, t_case, True), (fill_t, f_case, False)):
        if fill is not None and fill.size >= 1 and np.all(fill <= -1e9):
          break
      else:
        return NearMiss(NAME, i, "the scores are selected with a fill that is not -inf or "
                        "<= -1e9")
      if mask is not None:
        return NearMiss(NAME, i, "two masks are applied to the scores")
      mask, cur = (pred, keep_when), keep
  e1 = g.eqns[j]
  eqns.append(j)
  lc1, rc1, lb1, rb1 = _dims(e1)
  q, k = e1.invars
  nb = len(lb1)
  s_shape = e1.outvars[0].aval.shape
  if len(lc1) != 1 or len(_free(q.aval.ndim, lc1, lb1)) != 1 or len(
      _free(k.aval.ndim, rc1, rb1)) != 1:
    return NearMiss(NAME, i, "the scores' product contracts more than one axis or keeps more "
                    "than one free axis an operand")
  if key_axis == nb:  # keys on the lhs: swap the roles
    q, k, lc1, rc1, lb1, rb1 = k, q, rc1, lc1, rb1, lb1
  elif key_axis != nb + 1:
    return NearMiss(NAME, i, "the softmax runs over a batch axis of the scores")
  if not 1 <= nb <= 2:
    return NearMiss(NAME, i, f"{nb} batch axes; the op takes batch and heads")
  if sorted(pb) != list(range(nb)):
    return NearMiss(NAME, i, "the values' product batches other axes than the scores'")
  for x in (q, k, v):
    if x.aval.dtype not in (jnp.bfloat16, jnp.float16):
      return NearMiss(NAME, i, f"operands are {x.aval.dtype}: the flash kernels take bfloat16 "
                      "and float16")
  if not (q.aval.dtype == k.aval.dtype == v.aval.dtype):
    return NearMiss(NAME, i, "query, key and value dtypes differ")
  head, vhead = q.aval.shape[lc1[0]], v.aval.shape[_free(v.aval.ndim, vc, vb)[0]]
  if head % 8 or vhead % 8 or max(head, vhead) > 256:
    return NearMiss(NAME, i, f"head dims {head}, {vhead}: the kernels take multiples of 8 up "
                    "to 256")
  t_axis = nb if key_axis == nb + 1 else nb + 1
  t_len, s_len = s_shape[t_axis], s_shape[key_axis]
  # Each operand as [B, T|S, N, H]: its batch axes, its free axis, its head axis.
  def perm(bax, free, head_ax):
    b = list(bax) + [None] * (2 - nb)
    return b[0], free, b[1], head_ax
  q_perm = perm(lb1, _free(q.aval.ndim, lc1, lb1)[0], lc1[0])
  k_perm = perm(rb1, _free(k.aval.ndim, rc1, rb1)[0], rc1[0])
  v_b = [vb[pb.index(d)] for d in range(nb)]
  v_perm = perm(v_b, vc[0], _free(v.aval.ndim, vc, vb)[0])
  # The scores' axes in [B, N, T, S] order, for the mask and bias.
  s_perm = (0, 1 if nb == 2 else None, t_axis, key_axis)
  # A mask depending on the inputs is an operand (its broadcast stripped); a
  # constant one is is_causal where it is the lower triangle, else a constant.
  mask_var = const_mask = None
  if mask is not None:
    pred, keep_when = mask
    cval = g.constant(pred)
    if cval is None:
      mask_var = (*_expanded(g, pred, s_shape), keep_when)
    else:
      keep = np.moveaxis(np.broadcast_to(cval == keep_when, s_shape), (t_axis, key_axis),
                         (-2, -1))
      tril = np.tril(np.ones((t_len, s_len), bool))
      if t_len <= s_len and np.array_equal(keep, np.broadcast_to(tril, keep.shape)):
        causal = True
      else:
        const_mask = keep if nb == 2 else keep[:, None]
  bias_in = _expanded(g, bias, s_shape) if bias is not None else None
  out_axes = [f"b{pb[d]}" for d in range(nb)] + (["T", "D"] if side == 0 else ["D", "T"])
  inputs = [q, k, v] + [x[0] for x in (mask_var, bias_in) if x is not None]
  inputs += [f for f, _ in factors]
  n_mask, n_bias = int(mask_var is not None), int(bias_in is not None)

  def to4(x, p):
    axes = [a for a in p if a is not None]
    x = jnp.transpose(x, axes)
    return x if nb == 2 else jnp.expand_dims(x, 2)

  def scores4(x, shape):
    x = x.reshape(shape)
    axes = [a for a in s_perm if a is not None]
    x = jnp.transpose(x, axes)
    return x if nb == 2 else jnp.expand_dims(x, 1)

  def replace(q, k, v, *rest):
    m = const_mask
    if n_mask:
      m = scores4(rest[0], mask_var[1])
      m = m if mask_var[2] else jnp.logical_not(m)
    b = scores4(rest[n_mask], bias_in[1]) if n_bias else None
    sc = scale
    for f, (_, kind) in zip(rest[n_mask + n_bias:], factors):
      sc = sc * f if kind == "mul" else sc / f
    o = ops.dot_product_attention(to4(q, q_perm), to4(k, k_perm), to4(v, v_perm), bias=b,
                                  mask=m, scale=sc, is_causal=causal)
    o = o if nb == 2 else o[:, :, 0]
    have = ["b0", "T"] + (["b1"] if nb == 2 else []) + ["D"]
    return jnp.transpose(o, [have.index(a) for a in out_axes])

  what = ", ".join(x for x in ("is_causal" if causal else "", "mask" if n_mask or const_mask is not None else "",
                               "bias" if bias_in else "") if x)
  return Match(NAME, frozenset(eqns), tuple(inputs), e2.outvars[0], replace,
               f"jax_dnn.dot_product_attention(T={t_len}, S={s_len}, H={head}"
               f"{', ' + what if what else ''})")
