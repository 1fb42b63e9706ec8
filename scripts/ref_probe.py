"""Times the float32 reference path of jax_dnn.dot_product_attention (XLA,
query-row blocks past 2^28 scores) at long S on the GPU, and reports the
compiled scratch and the device's peak memory, to show memory linear in S.

  python3 scripts/ref_probe.py [--seqlens 8192,16384,32768] [--heads 8] [--head-dim 128]
"""
import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_dnn


def median_ms(fn, *args, reps=5):
  jax.block_until_ready(fn(*args))
  ts = []
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    ts.append(time.perf_counter() - t0)
  return 1e3 * float(np.median(ts))


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--seqlens", default="8192,16384,32768")
  ap.add_argument("--heads", type=int, default=8)
  ap.add_argument("--head-dim", type=int, default=128)
  args = ap.parse_args()
  n, d = args.heads, args.head_dim
  print(f"{'S':>6} {'causal':>6} {'fwd ms':>8} {'fwd+bwd ms':>10} {'scratch MiB':>11} "
        f"{'peak MiB':>9} {'fwd TF/s':>8}")
  for s in map(int, args.seqlens.split(",")):
    keys = jax.random.split(jax.random.key(s), 3)
    q, k, v = (jax.random.normal(kk, (1, s, n, d), jnp.float32) for kk in keys)
    for causal in (False, True):
      fwd = jax.jit(lambda q, k, v: jax_dnn.dot_product_attention(q, k, v, is_causal=causal))
      loss = lambda q, k, v: jnp.sum(jax_dnn.dot_product_attention(q, k, v, is_causal=causal))
      step = jax.jit(jax.value_and_grad(loss, (0, 1, 2)))
      scratch = step.lower(q, k, v).compile().memory_analysis().temp_size_in_bytes
      t_f = median_ms(fwd, q, k, v)
      t_fb = median_ms(step, q, k, v)
      stats = jax.devices()[0].memory_stats() or {}
      peak = stats.get("peak_bytes_in_use", 0)
      o = fwd(q, k, v)
      assert not bool(jnp.isnan(o).any())
      flops = 4.0 * s * s * d * n * (0.5 if causal else 1.0)
      print(f"{s:>6} {str(causal):>6} {t_f:8.2f} {t_fb:10.2f} {scratch / 2**20:11.1f} "
            f"{peak / 2**20:9.1f} {flops / t_f / 1e9:8.1f}", flush=True)


if __name__ == "__main__":
  main()
