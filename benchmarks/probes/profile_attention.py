"""Runs the attention forward and backward once at a benchmark shape (for ncu):
  ncu --clock-control none -k regex:Attention python3 benchmarks/probes/profile_attention.py [S] [D] [split] [causal] [fwd]
("split": the deterministic backward instead of the single pass; "causal":
is_causal=True; "fwd": the forward only)."""

import sys

import jax
import jax.numpy as jnp

import jax_dnn

s = int(sys.argv[1]) if len(sys.argv) > 1 else 8192
d = int(sys.argv[2]) if len(sys.argv) > 2 else 128
b, n = 16384 // s, 2048 // d
q, k, v = (jax.random.normal(jax.random.key(i), (b, s, n, d), jnp.bfloat16) for i in range(3))
split = "split" in sys.argv[3:]
causal = "causal" in sys.argv[3:]
fwd = jax.jit(lambda *a: jax_dnn.dot_product_attention(*a, is_causal=causal))
grad = jax.jit(jax.grad(lambda *a: jnp.sum(jax_dnn.dot_product_attention(
    *a, is_causal=causal, deterministic_backward=split).astype(jnp.float32)), (0, 1, 2)))
fwd_only = "fwd" in sys.argv[3:]
for _ in range(2):
  jax.block_until_ready(fwd(q, k, v))
  if not fwd_only:
    jax.block_until_ready(grad(q, k, v))
print("profile_attention: done")
