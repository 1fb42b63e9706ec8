"""Prints the CUDA lowering (StableHLO, locations stripped) of a fixed set of
programs over every op, forward and backward, with vmap and options, on a
machine without a GPU. Diffing its output at two commits shows whether a
Python-side change altered what the GPU runs (needs the extension built with
CUDA, e.g. from `pip install .`, so that the kernels' targets are registered):

    python3 scripts/cuda_lowering.py > before.txt   # at one commit
    python3 scripts/cuda_lowering.py > after.txt    # at another
    diff before.txt after.txt
"""

import re

import jax
import jax.numpy as jnp

import jax_dnn

F32 = jnp.float32


def programs():
  x = jnp.ones((4, 8, 64), jnp.bfloat16)
  s = jnp.ones((64,), F32)
  q = jnp.ones((2, 128, 8, 64), jnp.bfloat16)
  kv = jnp.ones((2, 160, 2, 64), jnp.bfloat16)
  bias = jnp.ones((1, 8, 128, 160), F32)
  sq = lambda y: jnp.sum(y.astype(F32) ** 2)
  yield "gelu", jax.value_and_grad(lambda x: sq(jax_dnn.gelu(x))), (x,)
  yield "bias_act", jax.grad(lambda x, b: sq(jax_dnn.bias_act(x, b)), (0, 1)), (x, s)
  yield "log_softmax", jax.grad(lambda x: sq(jax_dnn.log_softmax(x, axis=1))), (x,)
  yield "layer_norm", jax.grad(lambda x, s: sq(jax_dnn.layer_norm(x, s, s)), (0, 1)), (x, s)
  yield "rms_norm_vmap", jax.vmap(jax.grad(lambda x, s: sq(jax_dnn.rms_norm(x, s)), (0, 1))), (
      x, jnp.ones((4, 64), F32))
  yield "attention", jax.grad(
      lambda q, k, v, b: sq(jax_dnn.dot_product_attention(q, k, v, b, is_causal=True)),
      (0, 1, 2, 3)), (q, kv, kv, bias)
  yield "attention_residual", lambda q, k, v: jax_dnn.dot_product_attention(
      q, k, v, return_residual=True, local_window_size=(32, 0)), (q, kv, kv)


def main():
  if not jax_dnn.has_cuda_kernels():
    raise SystemExit("jax_dnn has no CUDA kernels here: the CUDA lowering would be the reference")
  for name, fn, args in programs():
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    text = re.sub(r"#?loc\d*(\([^\n]*)?", "", text)
    print(f"===== {name}\n{text}")


if __name__ == "__main__":
  main()
