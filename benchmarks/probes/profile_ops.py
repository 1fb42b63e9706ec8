"""Runs each memory-bound kernel (ours, then XLA's fusion of the same math)
a few times on 16384 x WIDTH bf16 (WIDTH from argv, default 4096), for ncu:
  ncu --clock-control none --metrics gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed \
      python3 benchmarks/probes/profile_ops.py [WIDTH]"""

import sys

import jax
import jax.numpy as jnp

import jax_dnn

width = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
x = jax.random.normal(jax.random.key(0), (16384, width), jnp.float32).astype(jnp.bfloat16)
dy = jax.random.normal(jax.random.key(1), x.shape, jnp.float32).astype(jnp.bfloat16)
w = jnp.ones(width, jnp.float32)


def xla_layer_norm(v):
  v32 = v.astype(jnp.float32)
  mean = v32.mean(-1, keepdims=True)
  var = jnp.square(v32 - mean).mean(-1, keepdims=True)
  return ((v32 - mean) * jax.lax.rsqrt(var + 1e-5) * w + w).astype(v.dtype)


ops = {
    "softmax": lambda v: jax_dnn.softmax(v),
    "layer_norm": lambda v: jax_dnn.layer_norm(v, w, w),
    "rms_norm": lambda v: jax_dnn.rms_norm(v, w),
    "xla_softmax": lambda v: jax.nn.softmax(v.astype(jnp.float32)).astype(v.dtype),
    "xla_layer_norm": xla_layer_norm,
}
for name, f in ops.items():
  fwd = jax.jit(f)
  bwd = jax.jit(lambda v, d, f=f: jax.vjp(f, v)[1](d))
  for _ in range(2):
    jax.block_until_ready(fwd(x))
    jax.block_until_ready(bwd(x, dy))
print("profile_ops done")
