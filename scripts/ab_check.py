"""Prints, for the norm backward on a few shapes, the largest difference of
dx, dscale and dbias from an fp64 reference, under whatever JAX_DNN_AB the
environment sets (a run-time variant switch: scripts/env_ab.sh). At 16 bits
dx's error is mostly the output's rounding; dscale and dbias tell variants
apart more finely."""
import numpy as np
import jax
import jax.numpy as jnp
import jax_dnn

jax.config.update("jax_enable_x64", True)


def ref(x, s, b, rms):
  m = 0.0 if rms else x.mean(-1, keepdims=True)
  v = ((x - m) ** 2).mean(-1, keepdims=True)
  y = (x - m) / jnp.sqrt(v + 1e-6) * s
  return y if rms else y + b


for rows, width, dt in [(64, 131072, jnp.bfloat16), (96, 40000, jnp.bfloat16), (64, 32768, jnp.float32),
                        (256, 4096, jnp.bfloat16), (128, 8192, jnp.float16), (300, 1024, jnp.float32)]:
  k = jax.random.split(jax.random.key(width), 4)
  x = (3.0 + 2.0 * jax.random.normal(k[0], (rows, width), jnp.float32)).astype(dt)
  dy = jax.random.normal(k[1], (rows, width), jnp.float32).astype(dt)
  s = jax.random.uniform(k[2], (width,), jnp.float32, 0.5, 1.5)
  b = jax.random.normal(k[3], (width,), jnp.float32)
  for rms in (False, True):
    f = (lambda v, s, b: jax_dnn.rms_norm(v, s, epsilon=1e-6)) if rms else (
        lambda v, s, b: jax_dnn.layer_norm(v, s, b, epsilon=1e-6))
    g = jax.jit(lambda v, s, b, d: jax.vjp(f, v, s, b)[1](d))(x, s, b, dy)
    x64, s64, b64, d64 = (np.asarray(a, np.float64) for a in (x, s, b, dy))
    gr = jax.vjp(lambda v, s, b: ref(v, s, b, rms), jnp.asarray(x64), jnp.asarray(s64),
                 jnp.asarray(b64))[1](jnp.asarray(d64))
    errs = [float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(r)) / (np.max(np.abs(np.asarray(r))) + 1e-30)))
            for a, r in zip(g, gr)]
    dbias = "-" if rms else f"{errs[2]:.2e}"  # RMS norm has no bias
    print(f"check {'rms' if rms else 'ln'} {rows}x{width} {jnp.dtype(dt).name} rel err dx {errs[0]:.2e} dscale {errs[1]:.2e} dbias {dbias}")
