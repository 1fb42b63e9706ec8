"""Where a benchmark call's time goes beyond its kernels: the compiled
program of bench_ops.py's batched call (K = 8 applications of one op to
16384 x 4096 bf16) -- which instructions XLA runs around our custom calls --
and its time a call against K times the kernel alone.
  python3 scripts/call_overhead.py            # HLO summary and timings
  ncu --clock-control none --metrics gpu__time_duration.sum python3 scripts/call_overhead.py ncu
"""
import re
import statistics
import sys
import time

import jax
import jax.numpy as jnp

import jax_dnn

K = 8
shape = (16384, 4096)
xs = [jax.random.normal(jax.random.key(i), shape, jnp.float32).astype(jnp.bfloat16) for i in range(K)]
w = 1.0 + 0.1 * jax.random.normal(jax.random.key(99), (shape[1],), jnp.float32)
ops = {
    "softmax": lambda v: jax_dnn.softmax(v),
    "layer_norm": lambda v: jax_dnn.layer_norm(v, w, w),
    "copy": lambda v: v * 2,
}
ncu = len(sys.argv) > 1 and sys.argv[1] == "ncu"
for name, f in ops.items():
  fn = jax.jit(lambda ins, f=f: [f(x) for x in ins])
  compiled = fn.lower(xs).compile()
  text = compiled.as_text()
  entry = text[text.rfind("ENTRY"):]
  kinds = {}
  for line in entry.splitlines()[1:]:
    m = re.search(r"= \S+ (\S+?)\(", line)
    if m:
      kinds[m.group(1)] = kinds.get(m.group(1), 0) + 1
  jax.block_until_ready(fn(xs))
  if ncu:
    jax.block_until_ready(fn(xs))
    continue
  samples = []
  for _ in range(7):
    t0 = time.perf_counter()
    for _ in range(20):
      out = fn(xs)
    jax.block_until_ready(out)
    samples.append((time.perf_counter() - t0) / 20 / K * 1e6)
  print(f"{name:12s} entry ops {kinds}  {statistics.median(samples):.1f} us an application")
