"""Runs every kernel once (forward and backward, each dtype, awkward shapes)
so that compute-sanitizer can check them: see scripts/gpu_check.sh.
`python3 sanitize_ops.py [FAMILY ...]` runs the named families (FAMILIES
below: attention, conv, group_norm, pool, batch_norm, rnn, rows), all of
them without arguments.

The row ops come from the table of ops (tests/op_cases.py): each one with
`rows` set runs over SHAPES; attention's layouts, and the kernels' paths
that the table's options do not reach, are listed here."""

import functools
import os
import sys

import jax
import jax.numpy as jnp

import jax_dnn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "tests"))
from op_cases import CASES  # pylint: disable=g-import-not-at-top,wrong-import-position

# Widths reach every row-kernel shape: odd (scalar fallback), each register
# layout team (up to 12288 and 20000 bf16: padded 256- and 512-thread teams),
# and rows past it, split over clusters of blocks (20000 fp32: 2-3 blocks;
# 32776: shares of whole vectors; 131080: 5 blocks in the forwards and the
# softmax backward at bf16/f16, the fallbacks otherwise); odd row counts at
# widths where the 16-bit layer-norm forward takes two rows a team (3000,
# 24000) or 128-thread teams of 4 vectors (4000).
SHAPES = [(1, 1), (3, 7), (5, 4097), (64, 1024), (4, 2048), (3, 12288), (2, 20000), (7, 200),
          (33, 520), (6000, 264), (2, 65544), (3, 32776), (3, 131080), (5, 3000), (3, 24000),
          (5, 4000)]


def run(fn, x, *params):
  y, vjp = jax.vjp(fn, x, *params)
  grads = vjp(jnp.ones_like(y) * 0.5)
  jax.block_until_ready((y, grads))


def attention(key):
  """Each head-dim pair, ragged lengths, masks that skip tiles, bias (dbias);
  at head dims padding to 64 and 128 both backward paths (single pass, split)."""
  dims = [(64, 64), (128, 128), (96, 96), (192, 192), (256, 256), (192, 128)]
  for dtype in (jnp.bfloat16, jnp.float16):
    for h, hv in dims:
      for det in (False, True) if h in (64, 96, 128) else (False,):
        for t, s, causal in ((130, 77, True), (65, 200, False)):
          q = jax.random.normal(key, (2, t, 4, h), dtype)
          k = jax.random.normal(key, (2, s, 2, h), dtype)
          v = jax.random.normal(key, (2, s, 2, hv), dtype)
          fn = functools.partial(jax_dnn.dot_product_attention, is_causal=causal,
                                 deterministic_backward=det)
          y, vjp = jax.vjp(jax.jit(fn), q, k, v)
          jax.block_until_ready((y, vjp(jnp.ones_like(y))))
  q = jax.random.normal(key, (2, 100, 2, 64), jnp.bfloat16)
  mask = jax.random.bernoulli(key, 0.7, (2, 2, 100, 100))
  fn = functools.partial(jax_dnn.dot_product_attention, mask=mask, logits_soft_cap=4.0)
  y, vjp = jax.vjp(jax.jit(fn), q, q, q)  # the general logits path without bias
  jax.block_until_ready((y, vjp(jnp.ones_like(y))))
  bias = jax.random.normal(key, (2, 1, 100, 100), jnp.float32)
  seg = jnp.repeat(jnp.arange(4), 25)[None].repeat(2, 0)
  fn = functools.partial(jax_dnn.dot_product_attention, q_segment_ids=seg, kv_segment_ids=seg,
                         local_window_size=(30, 3), query_seq_lengths=jnp.array([100, 60]),
                         logits_soft_cap=4.0)
  y, vjp = jax.vjp(jax.jit(fn), q, q, q, bias)
  jax.block_until_ready((y, vjp(jnp.ones_like(y))))
  # Causal backward grids whose last 33 of 40 (head, batch) slices take
  # their tiles longest first (BwdGridTile, on a 132-SM GPU): the single
  # pass and the split at head dims 64 and 128, two dK/dV kernels at 256.
  for h in (64, 128, 256):
    for det in (False, True) if h in (64, 128) else (False,):
      q = jax.random.normal(key, (5, 1000, 8, h), jnp.bfloat16)
      fn = functools.partial(jax_dnn.dot_product_attention, is_causal=True,
                             deterministic_backward=det)
      y, vjp = jax.vjp(jax.jit(fn), q, q, q)
      jax.block_until_ready((y, vjp(jnp.ones_like(y))))
  # The persistent forward: more work tiles than SMs (several a CTA), with
  # tiles past a query length (no keys) between ones with keys.
  for causal in (False, True):
    q = jax.random.normal(key, (3, 700, 16, 128), jnp.bfloat16)
    k = jax.random.normal(key, (3, 700, 4, 128), jnp.bfloat16)
    fn = functools.partial(jax_dnn.dot_product_attention, is_causal=causal,
                           query_seq_lengths=jnp.array([700, 100, 500]))
    jax.block_until_ready(jax.jit(fn)(q, k, k))
  # Past 4096 keys the forward takes 176-key tiles (a ragged last one here;
  # at head dim 64 below 512 queries, else the 192-row kernel).
  q = jax.random.normal(key, (1, 300, 2, 64), jnp.bfloat16)
  k = jax.random.normal(key, (1, 4200, 2, 64), jnp.bfloat16)
  y, vjp = jax.vjp(jax.jit(jax_dnn.dot_product_attention), q, k, k)
  jax.block_until_ready((y, vjp(jnp.ones_like(y))))
  # The 192-row kernel at head dim 64 with its backward (ragged rows and keys).
  q = jax.random.normal(key, (1, 700, 2, 64), jnp.bfloat16)
  k = jax.random.normal(key, (1, 1000, 2, 64), jnp.bfloat16)
  y, vjp = jax.vjp(jax.jit(jax_dnn.dot_product_attention), q, k, k)
  jax.block_until_ready((y, vjp(jnp.ones_like(y))))
  # The split tail (FwdSchedule), pieces merged by the combine kernel; 6000
  # keys, a ragged last key tile. At head dim 64 below 512 queries the
  # 128-row kernel's 176-key tiles: 135 work tiles (3 a head, single CTAs;
  # ragged rows), then 192 (4 a head: clusters of two CTAs sharing K and V,
  # 96 units on 66 clusters). The 192-row kernel: at head dim 64, 161 work
  # tiles (23 a head: single CTAs), then 144 (24 a head: 72 units on 66
  # clusters); at head dim 128 175 (25 a head; the last tile's third
  # consumer has no rows), then 144, and from 2048 queries 91 (13 a head:
  # single CTAs).
  for t, n, h in ((380, 45, 64), (500, 48, 64), (4400, 7, 64), (4608, 6, 64), (4700, 7, 128),
                  (4608, 6, 128), (2432, 7, 128)):
    q = jax.random.normal(key, (1, t, n, h), jnp.bfloat16)
    k = jax.random.normal(key, (1, 6000, n, h), jnp.bfloat16)
    jax.block_until_ready(jax.jit(jax_dnn.dot_product_attention)(q, k, k))


def conv(key):
  """The convolutions of the table (forward, dgrad, wgrad) in each dtype, and
  the kernels' other paths: depthwise 3x3 and 7x7 (strided), grouped, 1D
  strided and dilated, 3D, channels that are not a multiple of 8, odd
  spatial sizes, a 1x1 strided downsample, the transposed 4x4 stride 2, the
  fused epilogue with each activation, deterministic wgrad."""
  for case in CASES:
    if not case.rows and case.family.startswith("conv"):
      for dtype in (jnp.float32, jnp.bfloat16, jnp.float16):
        run(jax.jit(case.fn), *case.make_args(dtype))
  layers = [  # x [N, *spatial, C], kernel [*window, C / groups, K], options
      ((4, 17, 19, 32), (3, 3, 1, 32), dict(groups=32)),
      ((2, 23, 21, 48), (7, 7, 1, 48), dict(groups=48, strides=2)),
      ((2, 15, 15, 64), (3, 3, 16, 64), dict(groups=4)),
      ((3, 101, 20), (3, 20, 36), dict(strides=2, dilation=2)),
      ((1, 9, 10, 11, 12), (3, 3, 3, 12, 16), dict()),
      ((2, 13, 11, 13), (3, 3, 13, 21), dict(padding="VALID")),
      ((2, 14, 14, 64), (1, 1, 64, 128), dict(strides=2)),
  ]
  # Deterministic too: it takes the direct depthwise kernels and the small
  # wgrads, which the default leaves to XLA.
  for deterministic in (False, True):
    jax_dnn.config.update("deterministic", deterministic)
    try:
      for dtype in (jnp.bfloat16, jnp.float16, jnp.float32):
        for x_shape, k_shape, opts in layers:
          x = jax.random.normal(key, x_shape, jnp.float32).astype(dtype)
          k = (0.2 * jax.random.normal(key, k_shape, jnp.float32)).astype(dtype)
          run(jax.jit(functools.partial(jax_dnn.conv, **opts)), x, k)
    finally:
      jax_dnn.config.update("deterministic", False)
    x = jax.random.normal(key, (2, 9, 11, 24), jnp.float32).astype(dtype)
    k = (0.2 * jax.random.normal(key, (4, 4, 24, 16), jnp.float32)).astype(dtype)
    run(jax.jit(functools.partial(jax_dnn.conv_transpose, strides=(2, 2), padding="SAME")), x, k)
  x = jax.random.normal(key, (2, 12, 12, 40), jnp.bfloat16)
  k = (0.2 * jax.random.normal(key, (3, 3, 40, 24), jnp.float32)).astype(jnp.bfloat16)
  bias = jnp.linspace(-1, 1, 24, dtype=jnp.bfloat16)
  residual = jax.random.normal(key, (2, 12, 12, 24), jnp.bfloat16)
  for act in ("relu", "gelu", "gelu_tanh", "silu", "sigmoid", "tanh"):
    fn = functools.partial(jax_dnn.conv, activation=act)
    run(jax.jit(lambda x, k, b, r, fn=fn: fn(x, k, b, residual=r)), x, k, bias, residual)
  jax_dnn.config.update("deterministic", True)
  try:
    run(jax.jit(jax_dnn.conv), x, k)
  finally:
    jax_dnn.config.update("deterministic", False)


def group_norm(key):
  """Group and instance norm: the table's cases in each dtype, then every
  activation, several statistics blocks a sample with a ragged last one,
  the one-element path (channels no multiple of 16 bytes), one position,
  per-example parameters (vmap) and the widest channels the kernels take."""
  for case in CASES:
    if case.family == "group_norm":
      for dtype in (jnp.float32, jnp.bfloat16, jnp.float16):
        run(jax.jit(case.fn), *case.make_args(dtype))
  layers = [((2, 37, 41, 320), 32), ((3, 50, 7), 7), ((2, 1, 1, 64), 32), ((1, 9, 4096), 1),
            ((2, 5, 6, 7, 24), 24)]
  for dtype in (jnp.bfloat16, jnp.float16, jnp.float32):
    for shape, groups in layers:
      x = jax.random.normal(key, shape, jnp.float32).astype(dtype)
      p = jnp.linspace(0.5, 1.5, shape[-1], dtype=jnp.float32)
      for act in (None, "silu"):
        fn = functools.partial(jax_dnn.group_norm, num_groups=groups, activation=act)
        run(jax.jit(fn), x, p, p)
  x = jax.random.normal(key, (2, 3, 16, 16, 64), jnp.bfloat16)
  p = jnp.ones((2, 64), jnp.float32)
  for act in ("relu", "gelu", "gelu_tanh", "silu", "sigmoid", "tanh"):
    fn = functools.partial(jax_dnn.group_norm, num_groups=8, activation=act)
    run(jax.jit(jax.vmap(fn)), x, p, p)


def pool(key):
  """The pooling kernels forward and backward in each dtype: 16-byte channel
  vectors and scalar channels (C 5), 1D/2D/3D windows with padding and
  overlap, windows past the input (all padding), adaptive bins (overlapping,
  output larger than the input), global average pooling unsplit (N * C
  large) and split over blocks (workspace partials), ties (a constant
  input: every position scans its windows)."""
  calls = [
      ((4, 17, 19, 64), lambda x: jax_dnn.max_pool(x, (3, 3), (2, 2), "SAME")),
      ((3, 9, 11, 5), lambda x: jax_dnn.max_pool(x, (3, 3), (1, 1), ((1, 2), (2, 1)))),
      ((3, 9, 11, 5), lambda x: jax_dnn.avg_pool(x, (2, 3), (2, 1), ((3, 3), (0, 1)),
                                                 count_include_pad=False)),
      ((2, 5, 6, 7, 16), lambda x: jax_dnn.avg_pool(x, (2, 2, 2), (2, 2, 2), "SAME")),
      ((2, 31, 24), lambda x: jax_dnn.max_pool(x, (4,), (3,), ((2, 5),))),
      ((2, 7, 9, 64), lambda x: jax_dnn.adaptive_max_pool(x, (3, 13))),
      ((2, 7, 9, 5), lambda x: jax_dnn.adaptive_avg_pool(x, (4, 4))),
      ((16, 7, 7, 2048), lambda x: jax_dnn.adaptive_avg_pool(x, 1)),
      ((1, 96, 96, 64), lambda x: jax_dnn.adaptive_avg_pool(x, 1)),
      ((2, 33, 17, 3), lambda x: jax_dnn.adaptive_avg_pool(x, 1)),
      ((2, 12, 12, 8), lambda x: jax_dnn.adaptive_max_pool(x, 1)),
  ]
  for dtype in (jnp.float32, jnp.bfloat16, jnp.float16):
    for shape, fn in calls:
      run(jax.jit(fn), jax.random.normal(key, shape, jnp.float32).astype(dtype))
      run(jax.jit(fn), jnp.ones(shape, dtype))


def batch_norm(key):
  """Batch norm's four kernels beyond the table's sweep: each activation with
  and without a residual, 16-byte and scalar channels (C not a multiple of
  the vector), several channel tiles (C = 1030) and row parts, 1D/3D, batch
  1, vmapped statistics (G > 1), the two-pass variance, inference mode."""
  shapes = [(2, 9, 7, 64), (1, 5, 3, 1030), (3, 11, 13), (2, 3, 4, 5, 24), (64, 56, 56, 32),
            (4000, 3)]
  for dtype in (jnp.float32, jnp.bfloat16, jnp.float16):
    for shape in shapes:
      x = jax.random.normal(key, shape, jnp.float32).astype(dtype)
      p = jnp.linspace(0.5, 1.5, shape[-1], dtype=jnp.float32)
      for act in (None, "relu", "gelu", "gelu_tanh", "silu", "sigmoid", "tanh"):
        fn = functools.partial(jax_dnn.batch_norm, activation=act)
        run(jax.jit(lambda x, s, b, r, fn=fn: fn(x, s, b, residual=r)[0]), x, p, p, x)
      run(jax.jit(lambda x, s: jax_dnn.batch_norm(x, s, use_fast_variance=False)[0]), x, p)
      run(jax.jit(lambda x, m, v: jax_dnn.batch_norm_inference(x, m, v, activation="relu")), x,
          p, p)
      run(jax.jit(jax.vmap(lambda x, s: jax_dnn.batch_norm(x, s)[0])), jnp.stack([x, x * 2]),
          jnp.stack([p, p]))


def rnn(key):
  """The recurrence kernels through lstm / gru / rnn: each kind and dtype,
  two bidirectional layers (forward and reverse kernels), ragged lengths
  with a 0, a length past T and full ones, B = 1, a hidden size that is
  no multiple of 8, and vmap (folded into the batch)."""
  b, t, i = 5, 9, 12
  lengths = jnp.array([9, 0, 4, 12, 1], jnp.int32)
  for dtype in (jnp.bfloat16, jnp.float16, jnp.float32):
    for hidden in (24, 37):
      x = jax.random.normal(key, (b, t, i), jnp.float32).astype(dtype)
      h0 = (0.5 * jax.random.normal(key, (4, b, hidden), jnp.float32)).astype(dtype)
      for name, init in (("lstm", jax_dnn.init_lstm_weight), ("gru", jax_dnn.init_gru_weight),
                         ("rnn", jax_dnn.init_rnn_weight)):
        w = init(key, i, hidden, 2, True).astype(dtype)
        opts = dict(input_size=i, hidden_size=hidden, num_layers=2, dropout=0.0,
                    bidirectional=True)
        if name == "lstm":
          fn = lambda x, h, w: jax_dnn.lstm(x, h, h, w, lengths, **opts)[0]
        else:
          fn = lambda x, h, w, f=getattr(jax_dnn, name): f(x, h, w, lengths, **opts)[0]
        run(jax.jit(fn), x, h0, w)
  x = jax.random.normal(key, (2, 1, 6, i), jnp.float32).astype(jnp.bfloat16)
  h0 = jnp.zeros((2, 1, 1, 32), jnp.bfloat16) + 0.1
  w = jax_dnn.init_gru_weight(key, i, 32, 1, False).astype(jnp.bfloat16)
  fn = lambda x, h: jax_dnn.gru(x, h, w, jnp.array([6], jnp.int32), i, 32, 1, 0.0, False)[0]
  run(jax.jit(jax.vmap(fn)), x, h0)


def rows(key):
  """The row ops of the table (softmax, the norms, the activations, bias +
  activation) over SHAPES in each dtype, and the layouts the table's
  options do not reach."""
  row_ops = [case for case in CASES if case.rows]
  for dtype in (jnp.float32, jnp.bfloat16, jnp.float16):
    for shape in SHAPES:
      for case in row_ops:
        run(jax.jit(case.fn), *case.make_args(dtype, shape=shape))
      # Beyond the table: norm parameters in x's dtype, softmax along the
      # leading axis, bias_act's erf GELU (its one-row backward loop), and
      # vmapped parameters (several parameter copies).
      x = jax.random.normal(key, shape, jnp.float32).astype(dtype)
      p = jnp.linspace(0.5, 1.5, shape[-1], dtype=dtype)
      run(jax.jit(jax_dnn.layer_norm), x, p, p)
      run(jax.jit(jax_dnn.rms_norm), x, p)
      run(jax.jit(functools.partial(jax_dnn.softmax, axis=0)), x)
      run(jax.jit(functools.partial(jax_dnn.bias_act, activation="gelu")), x, p)
      xb = jnp.stack([x, x])
      run(jax.jit(jax.vmap(jax_dnn.layer_norm)), xb, jnp.stack([p, p]), jnp.stack([p, p]))
  # Softmax rows split over clusters, more rows than clusters fit at once: the
  # persistent clusters stream several rows each (RowFeed).
  for dtype in (jnp.float32, jnp.bfloat16):
    x = jax.random.normal(key, (300, 50000), jnp.float32).astype(dtype)
    run(jax.jit(jax_dnn.softmax), x)
    run(jax.jit(jax_dnn.log_softmax), x)
  # The norms' clusters (forward and backward) streaming several rows each,
  # with shared and with per-group parameters.
  x = jax.random.normal(key, (300, 50000), jnp.float32).astype(jnp.bfloat16)
  p = jnp.linspace(0.5, 1.5, 50000, dtype=jnp.bfloat16)
  run(jax.jit(jax_dnn.layer_norm), x, p, p)
  run(jax.jit(jax_dnn.rms_norm), x, p)
  x = jax.random.normal(key, (3, 100, 20000), jnp.float32)
  p = jnp.ones((3, 20000), jnp.float32)
  run(jax.jit(jax.vmap(jax_dnn.layer_norm)), x, p, p)
  # The register-row norm backward's 128-thread teams (rows of 2049-4096 at
  # 16 bits, 1025-2048 fp32), each visiting three rows or more: the L2
  # prefetch of the row after next.
  for shape, dtype in (((1500, 3000), jnp.bfloat16), ((1500, 3000), jnp.float16),
                       ((1500, 2000), jnp.float32)):
    x = jax.random.normal(key, shape, jnp.float32).astype(dtype)
    p = jnp.linspace(0.5, 1.5, shape[-1], dtype=dtype)
    run(jax.jit(jax_dnn.layer_norm), x, p, p)
    run(jax.jit(jax_dnn.rms_norm), x, p)
  # The norm backward's one-block streamed rows (256-thread blocks at 6000
  # bf16 and 3000 fp32, 512 at 12000 bf16 and 6000 fp32), each block several
  # rows.
  for shape, dtype in (((700, 6000), jnp.bfloat16), ((700, 3000), jnp.float32),
                       ((300, 12000), jnp.bfloat16), ((300, 6000), jnp.float32)):
    x = jax.random.normal(key, shape, jnp.float32).astype(dtype)
    p = jnp.linspace(0.5, 1.5, shape[-1], dtype=dtype)
    run(jax.jit(jax_dnn.layer_norm), x, p, p)
    run(jax.jit(jax_dnn.rms_norm), x, p)
  # More param_sets than blocks fit at once: one part a group in the norm
  # backward (the register-row kernel, the streamed one).
  for width in (1024, 6000):
    x = jax.random.normal(key, (300, 8, width), jnp.bfloat16)
    p = jnp.ones((300, width), jnp.bfloat16)
    run(jax.jit(jax.vmap(jax_dnn.layer_norm)), x, p, p)
    run(jax.jit(jax.vmap(jax_dnn.rms_norm)), x, p)
  # The bias + activation forward's wide layouts (over 8 blocks an SM): 2-D
  # tiles of 256 and 32 units of columns with partial last bands (2 of 4 rows,
  # 17 of 32), the flat layout, the scalar path; the backward's two-row loop.
  for shape, dtype in (((3458, 4096), jnp.bfloat16), ((1201, 11008), jnp.bfloat16),
                       ((13501, 1024), jnp.bfloat16), ((450001, 4), jnp.bfloat16),
                       ((3458, 4096), jnp.float32)):
    x = jax.random.normal(key, shape, jnp.float32).astype(dtype)
    p = jnp.linspace(0.5, 1.5, shape[-1], dtype=dtype)
    run(jax.jit(functools.partial(jax_dnn.bias_act, activation="gelu_tanh")), x, p)


# One family a process: compute-sanitizer runs each alone (scripts/gpu_check.sh),
# so that a crash of the tool in one family leaves the others' summaries.
FAMILIES = {"attention": attention, "conv": conv, "group_norm": group_norm, "pool": pool,
            "batch_norm": batch_norm, "rnn": rnn, "rows": rows}


def main():
  names = sys.argv[1:] or list(FAMILIES)
  unknown = [name for name in names if name not in FAMILIES]
  if unknown:
    sys.exit(f"sanitize_ops: unknown families {unknown}; known: {' '.join(FAMILIES)}")
  key = jax.random.key(0)
  for name in names:
    FAMILIES[name](key)
    print(f"sanitize_ops: {name} kernels ran", flush=True)


if __name__ == "__main__":
  main()
