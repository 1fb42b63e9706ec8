"""Times jax_dnn's memory-bound ops (ours only) as bench_ops.py does, for an
A/B of two builds run as separate processes (scripts/ops_ab.sh). Prints one
line a case: `op shape dtype mode us_per_application`.
  python3 scripts/ops_ab.py [--cases 16384x4096:bfloat16,...] [--ops softmax,...] [--modes fwd,...]
"""
import argparse
import functools
import math
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import bench_ops  # noqa: E402
import jax_dnn  # noqa: E402

# Ops timed here beyond bench_ops.py's: (ours, unused, number of parameters).
EXTRA_OPS = {
    "silu": (jax_dnn.silu, None, 0),
    "sigmoid": (jax_dnn.sigmoid, None, 0),
    "bias_act(silu)": (functools.partial(jax_dnn.bias_act, activation="silu"), None, 1),
}
OPS = {**bench_ops.OPS, **EXTRA_OPS}


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--cases", default="16384x4096:bfloat16,16384x1024:bfloat16,16384x4096:float32")
  ap.add_argument("--ops", default=",".join(bench_ops.OPS),
                  help="names from bench_ops.OPS or EXTRA_OPS")
  ap.add_argument("--modes", default="fwd,bwd,fwd+bwd")
  args = ap.parse_args()
  for case in args.cases.split(","):
    dims, dtype = case.split(":")
    shape = tuple(int(d) for d in dims.split("x"))
    dtype = jnp.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    sets = max(1, min(32, math.ceil(max(bench_ops.L2_BYTES, bench_ops.CALL_BYTES) / nbytes)))
    for name in args.ops.split(","):
      ours, _, nparams = OPS[name]
      k = jax.random.split(jax.random.key(0), 3)
      ins = [(jax.random.normal(jax.random.fold_in(k[0], i), shape, jnp.float32).astype(dtype),
              jax.random.normal(jax.random.fold_in(k[1], i), shape, jnp.float32).astype(dtype))
             for i in range(sets)]
      params = [1.0 + 0.1 * jax.random.normal(jax.random.fold_in(k[2], i), (shape[1],))
                for i in range(nparams)]
      for mode, (prepare, apply, _) in bench_ops.make_modes(ours, params).items():
        if mode not in args.modes.split(","):
          continue
        sets_args = [prepare(x, dy) for x, dy in ins]
        t = bench_ops.time_fn(bench_ops.batched_call(apply), sets_args)
        del sets_args
        print(f"{name} {dims} {dtype.name} {mode} {t * 1e6:.2f}", flush=True)
      del ins


if __name__ == "__main__":
  main()
