"""Runs each memory-bound kernel a few times on 16384 x 4096 bf16, for ncu:
  ncu --clock-control none -k regex:Kernel --set basic python3 scripts/profile_ops.py"""

import jax
import jax.numpy as jnp

import jax_dnn

x = jax.random.normal(jax.random.key(0), (16384, 4096), jnp.float32).astype(jnp.bfloat16)
dy = jax.random.normal(jax.random.key(1), x.shape, jnp.float32).astype(jnp.bfloat16)
w = jnp.ones(4096, jnp.float32)
ops = {
    "softmax": lambda v: jax_dnn.softmax(v),
    "layer_norm": lambda v: jax_dnn.layer_norm(v, w, w),
    "rms_norm": lambda v: jax_dnn.rms_norm(v, w),
}
for name, f in ops.items():
  fwd = jax.jit(f)
  bwd = jax.jit(lambda v, d, f=f: jax.vjp(f, v)[1](d))
  for _ in range(2):
    jax.block_until_ready(fwd(x))
    jax.block_until_ready(bwd(x, dy))
print("profile_ops done")
