"""Runs every kernel once (forward and backward, each dtype, awkward shapes)
so that compute-sanitizer can check them: see scripts/gpu_check.sh."""

import functools

import jax
import jax.numpy as jnp

import jax_dnn

SHAPES = [(1, 1), (3, 7), (5, 4097), (64, 1024), (3, 12288), (2, 20000)]


def run(fn, x, *params):
  y, vjp = jax.vjp(fn, x, *params)
  grads = vjp(jnp.ones_like(y) * 0.5)
  jax.block_until_ready((y, grads))


def main():
  key = jax.random.key(0)
  for dtype in (jnp.float32, jnp.bfloat16, jnp.float16):
    for shape in SHAPES:
      x = jax.random.normal(key, shape, jnp.float32).astype(dtype)
      p = jnp.linspace(0.5, 1.5, shape[-1], dtype=dtype)
      run(jax.jit(jax_dnn.layer_norm), x, p, p)
      run(jax.jit(jax_dnn.rms_norm), x, p)
      run(jax.jit(jax_dnn.softmax), x)
      run(jax.jit(jax_dnn.log_softmax), x)
      run(jax.jit(functools.partial(jax_dnn.softmax, axis=0)), x)
      run(jax.jit(jax_dnn.gelu), x)
      run(jax.jit(functools.partial(jax_dnn.bias_act, activation="silu")), x, p)
      # vmapped parameters (groups > 1)
      xb = jnp.stack([x, x])
      run(jax.jit(jax.vmap(jax_dnn.layer_norm)), xb, jnp.stack([p, p]), jnp.stack([p, p]))
  print("sanitize_ops: all kernels ran")


if __name__ == "__main__":
  main()
