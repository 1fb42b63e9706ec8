"""Attention: jax_dnn.dot_product_attention against jax.nn's with
implementation="cudnn" and implementation="xla", in TFLOP/s of a bf16 matmul.

q, k, v, dy: [B, S, N, D] bf16, random normal. The shapes keep the work per
token fixed: B * S = 16384 tokens and N * D = 2048 hidden, so B = 16384 / S
and N = 2048 / D. FLOPs (the usual flash-attention accounting; causal
halves each):
  fwd      o = attention(q, k, v)           4 B N S^2 D
  bwd      dq, dk, dv from do               2.5 x fwd
  fwd+bwd  o, dq, dk, dv                    3.5 x fwd
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

import jax_dnn
from jax_dnn.benchmark import harness

TOKENS = 16384  # B * S
HIDDEN = 2048  # N * D
HEAD_DIMS = (64, 128, 256)
SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
QUICK = dict(head_dims=(128,), seqlens=(2048, 8192))
XLA_MAX_SEQ = 8192  # XLA materializes the [B, N, S, S] scores: 17 GB at S = 16384, D = 128
FLOP_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwd+bwd": 3.5}


def flops(batch: int, seqlen: int, heads: int, head_dim: int, causal: bool, mode: str) -> float:
  fwd = 4.0 * batch * heads * seqlen * seqlen * head_dim
  return fwd / (2 if causal else 1) * FLOP_FACTOR[mode]


def case(head_dim: int, seqlen: int, causal: bool, *, tokens: int = TOKENS, hidden: int = HIDDEN,
         dtype: str = "bfloat16") -> harness.Case:
  shape = (tokens // seqlen, seqlen, hidden // head_dim, head_dim)
  return harness.Case(op="attention", shape=shape, dtype=dtype,
                      label=f"D={head_dim} S={seqlen}{' causal' if causal else ''}",
                      options=(("causal", causal),))


def cases(quick: bool) -> list[harness.Case]:
  head_dims, seqlens = (QUICK["head_dims"], QUICK["seqlens"]) if quick else (HEAD_DIMS, SEQLENS)
  return [case(d, s, c) for d in head_dims for s in seqlens for c in (False, True)]


def workload(c: harness.Case, settings: harness.Settings) -> harness.Workload:
  del settings  # compute-bound: one input set
  causal = c.option("causal")
  batch, seqlen, heads, head_dim = c.shape
  q, k, v, dy = (jax.random.normal(key, c.shape, jnp.dtype(c.dtype))
                 for key in jax.random.split(jax.random.key(0), 4))

  def peer(implementation):
    return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal,
                                                        implementation=implementation)
  fns = {"ours": lambda q, k, v: jax_dnn.dot_product_attention(q, k, v, is_causal=causal),
         "cudnn": peer("cudnn"), "xla": peer("xla")}
  if seqlen > XLA_MAX_SEQ:
    fns["xla"] = f"skipped: S > {XLA_MAX_SEQ} (XLA's memory grows as S^2)"
  return harness.Workload(
      fns=fns, args=[(q, k, v)], cotangents=[dy],
      work={m: flops(batch, seqlen, heads, head_dim, causal, m) for m in FLOP_FACTOR},
      tolerance=harness.tolerance(c.dtype))


def plot_point(row: dict):
  """Panel per head dim and mode, x = S; causal dashed."""
  return f"D={row['shape'][3]}, {row['mode']}", row["shape"][1], "causal" if row["causal"] else ""


FAMILY = harness.Family(
    name="attention", unit="TFLOP/s", ceiling="matmul", impls=("ours", "cudnn", "xla"),
    reference=("cudnn", "xla"), cases=cases, workload=workload, plot_point=plot_point,
    plot_x=f"S (B * S = {TOKENS}, N * D = {HIDDEN})")
