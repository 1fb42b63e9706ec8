"""Attention for Flax NNX: `dot_product_attention` with the signature Flax
passes to `attention_fn`, and `MultiHeadAttention` using it.

    flax.nnx.MultiHeadAttention(..., attention_fn=jax_dnn.nn.dot_product_attention)

Flax's extra leading batch dimensions are folded into one batch axis. Dropout
on the attention weights and sowing them (`module=`) need the probability
matrix, which a fused kernel never forms: both raise a ValueError (use
dropout_rate=0 or deterministic=True).
"""

from __future__ import annotations

import math

from flax import nnx
from flax.nnx.nn import dtypes as nn_dtypes
import jax.numpy as jnp

from jax_dnn._src.attention import dot_product_attention as _attention


_OP = "jax_dnn.nn.dot_product_attention"


def _fold_logits_operand(name, x, batch_shape, n, t, s):
  """[batch..., N|1, T, S] (broadcastable) -> [B, N|1, T, S]. A shape that
  does not broadcast is a TypeError, as jax's broadcasting raises in Flax's."""
  if x is None:
    return None
  x = jnp.asarray(x)
  full = batch_shape + (n, t, s)
  if x.ndim > len(full):  # a ValueError, as jax.nn raises for a bias of rank above 4
    raise ValueError(f"{_OP}: {name} of shape {tuple(x.shape)} has more dims than "
                     f"[batch..., N, T, S] = {list(full)}")
  if any(d not in (1, f) for d, f in zip(x.shape[::-1], full[::-1])):
    raise TypeError(f"{_OP}: {name} of shape {tuple(x.shape)} does not broadcast to "
                    f"[batch..., N, T, S] = {list(full)}")
  heads = x.shape[-3] if x.ndim >= 3 else 1
  x = jnp.broadcast_to(x, batch_shape + (heads, t, s))
  return x.reshape((math.prod(batch_shape), heads, t, s))


def _check_qkv(query, key, value):
  """One rank (at least 3) and one set of batch dims, as Flax requires (the
  batch dims are folded into one, which would pair mismatched batches)."""
  shapes = ", ".join(str(tuple(x.shape)) for x in (query, key, value))
  if not query.ndim == key.ndim == value.ndim:
    raise ValueError(f"{_OP}: query, key and value must have the same rank; got shapes {shapes}")
  if query.ndim < 3:
    raise ValueError(f"{_OP}: query, key and value must have rank >= 3 ([batch..., length, "
                     f"heads, head_dim]); got shapes {shapes}")
  if not query.shape[:-3] == key.shape[:-3] == value.shape[:-3]:
    raise ValueError(f"{_OP}: query, key and value must have the same batch dims; got shapes "
                     f"{shapes}")


def dot_product_attention(query, key, value, bias=None, mask=None, broadcast_dropout=True,
                          dropout_rng=None, dropout_rate=0.0, deterministic=False, dtype=None,
                          precision=None, module=None, promote_dtype=nn_dtypes.promote_dtype,
                          is_causal=False):
  """Drop-in for flax.nnx.dot_product_attention, computed by jax_dnn.

  query [batch..., T, N, H], key/value [batch..., S, K, H]; mask/bias
  broadcastable to [batch..., N, T, S] (mask: nonzero/True = attend, as Flax's
  float masks from make_causal_mask / make_attention_mask).
  """
  del broadcast_dropout, dropout_rng, precision
  if dropout_rate > 0.0 and not deterministic:
    raise ValueError(f"{_OP}: attention dropout is not supported (dropout_rate={dropout_rate}); "
                     "use dropout_rate=0 or deterministic=True")
  if module is not None:
    raise ValueError(f"{_OP}: sowing attention weights (module=...) is not supported: the fused "
                     "kernel never forms them")
  query, key, value = promote_dtype((query, key, value), dtype=dtype)
  _check_qkv(query, key, value)
  batch_shape = tuple(query.shape[:-3])
  t, n, s = query.shape[-3], query.shape[-2], key.shape[-3]
  b = math.prod(batch_shape)
  q = query.reshape((b,) + query.shape[-3:])
  k = key.reshape((b,) + key.shape[-3:])
  v = value.reshape((b,) + value.shape[-3:])
  if mask is not None:
    mask = jnp.asarray(mask).astype(bool)
  out = _attention(q, k, v, bias=_fold_logits_operand("bias", bias, batch_shape, n, t, s),
                   mask=_fold_logits_operand("mask", mask, batch_shape, n, t, s),
                   is_causal=is_causal)
  return out.reshape(batch_shape + out.shape[1:])


class MultiHeadAttention(nnx.MultiHeadAttention):
  """flax.nnx.MultiHeadAttention whose attention is jax_dnn's."""

  def __init__(self, *args, attention_fn=dot_product_attention, **kwargs):
    super().__init__(*args, attention_fn=attention_fn, **kwargs)
