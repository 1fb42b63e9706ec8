"""How the attention backward's time follows its number of key tiles.

The single-pass dK/dV kernel runs one CTA a 128-key tile and one CTA an SM,
so the 2048 tiles of the benchmark's shapes (16384 tokens x 16 heads) are
15.5 rounds of a 132-SM grid. This times our attention's backward alone (the
custom VJP's backward on the forward's residuals) at shapes whose tile counts
fall on both sides of a round boundary and prints the time per tile: where
the last round's idle SMs cost its full length, shapes in the same number of
rounds take the same time. (They differ in batch and heads too, so this
is a hint, not a measurement of the tail: on an H200, 2026-11-23, 2112 tiles
took 2.74 ms where 2048 took 2.80 at S = 4096, but cutting the 2048's tail
into pieces over every SM, commit 5a6169f, gained 1% at most; see
benchmarks/RESULTS.md.)

  python3 scripts/bwd_waves.py [--seq 4096 8192] [--shapes 4x16,6x11]
  python3 scripts/bwd_waves.py --ab [...]   # "case microseconds" lines (scripts/ops_ab.sh)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import jax
import jax.numpy as jnp

from jax_dnn._src import attention as attention_src

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import bench_attention  # noqa: E402


def time_call(fn, args, rounds=7):
  """Median seconds a call, timed as bench_attention.py times a function."""
  n, _ = bench_attention.warm_up(fn, args, iters=10)
  return statistics.median(bench_attention.time_batch(fn, args, n) for _ in range(rounds))


def backward(b, s, n, d, causal, dtype=jnp.bfloat16):
  """A jitted backward (dq, dk, dv from do and the forward's residuals) and its arguments."""
  kq, kk, kv, kd = jax.random.split(jax.random.PRNGKey(0), 4)
  q, k, v, do = (jax.random.normal(x, (b, s, n, d), dtype) for x in (kq, kk, kv, kd))
  params = tuple(sorted(dict(present=(), scale=float(d) ** -0.5, softcap=0.0, is_causal=causal,
                             window=None, deterministic=False).items()))
  (_, lse), res = jax.jit(lambda q, k, v: attention_src._attention_fwd(params, q, k, v))(q, k, v)
  del lse
  fn = jax.jit(lambda res, do: attention_src._attention_bwd(params, res, (do, None)))
  return fn, (res, do)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--seq", type=int, nargs="+", default=[4096])
  ap.add_argument("--causal", action="store_true")
  ap.add_argument("--head-dim", type=int, default=128)
  ap.add_argument("--shapes", default="4x16,6x11,1x62,1x61,1x66,4x15,4x17",
                  help="BxN pairs at S = 4096; B scaled by 4096 / S where that divides")
  ap.add_argument("--cases", default="",
                  help="D:S:BxN[:causal],... (instead of --seq/--shapes/--head-dim/--causal)")
  ap.add_argument("--ab", action="store_true", help="print 'case microseconds' lines only")
  args = ap.parse_args()
  cases = []
  for c in filter(None, args.cases.split(",")):
    d, s, bn, *causal = c.split(":")
    b, n = bn.split("x")
    cases.append((int(d), int(s), int(b), int(n), causal == ["causal"]))
  for s in [] if cases else args.seq:
    for pair in args.shapes.split(","):
      b, n = (int(x) for x in pair.split("x"))
      if s != 4096 and b * 4096 % s == 0:
        b = b * 4096 // s
      cases.append((args.head_dim, s, b, n, args.causal))
  if not args.ab:
    print(jax.devices()[0].device_kind)
    print(f"{'D':>4} {'S':>6} {'B':>3} {'N':>3} {'causal':>6} {'tiles':>6} {'rounds':>7} "
          f"{'bwd ms':>8} {'us/tile':>8} {'TFLOP/s':>8}")
  for d, s, b, n, causal in cases:
    fn, fargs = backward(b, s, n, d, causal)
    t = time_call(fn, fargs)
    tiles = b * n * -(-s // 128)
    if args.ab:
      print(f"bwd D{d} S{s} B{b} N{n}{' causal' if causal else ''} {t * 1e6:.1f}")
      continue
    flops = 2.5 * 4 * b * n * s * s * d * (0.5 if causal else 1.0)
    print(f"{d:4d} {s:6d} {b:3d} {n:3d} {str(causal):>6} {tiles:6d} {tiles / 132:7.2f} "
          f"{t * 1e3:8.3f} {t / tiles * 1e6:8.3f} {flops / t / 1e12:8.1f}")


if __name__ == "__main__":
  main()
