"""Runs a row op's forward or backward on the given shapes a few times, for
ncu (benchmarks/probes/ncu_stalls.sh):  python3 profile_rows.py OP:ROWSxWIDTH:DTYPE[:MODE] ...
OP: layer_norm, rms_norm or softmax; MODE: fwd or bwd (default bwd); e.g.
layer_norm:4096x131072:bfloat16 softmax:4096x131072:bfloat16:fwd."""

import sys

import jax
import jax.numpy as jnp

import jax_dnn

for spec in sys.argv[1:] or ["layer_norm:4096x131072:bfloat16"]:
  op, shape, dtype, *mode = spec.split(":")
  rows, width = map(int, shape.split("x"))
  dtype = jnp.dtype(dtype)
  x = jax.random.normal(jax.random.key(0), (rows, width), jnp.float32).astype(dtype)
  dy = jax.random.normal(jax.random.key(1), x.shape, jnp.float32).astype(dtype)
  w = jax.random.uniform(jax.random.key(2), (width,), jnp.float32, 0.5, 1.5)
  b = jax.random.normal(jax.random.key(3), (width,), jnp.float32)  # its own bytes, as in a model
  f = {"layer_norm": lambda v, s: jax_dnn.layer_norm(v, s, b),
       "rms_norm": lambda v, s: jax_dnn.rms_norm(v, s),
       "softmax": lambda v, s: jax_dnn.softmax(v)}[op]
  if (mode or ["bwd"])[0] == "fwd":
    run = jax.jit(lambda v, s, d: f(v, s))
  else:
    run = jax.jit(lambda v, s, d: jax.vjp(f, v, s)[1](d))
  for _ in range(2):
    jax.block_until_ready(run(x, w, dy))
print("profile_rows done")
