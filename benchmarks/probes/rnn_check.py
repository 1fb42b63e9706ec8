"""Checks and times the recurrence kernels (jax_dnn_rnn_fwd, jax_dnn_rnn_bwd)
on a GPU, calling the FFI targets directly through jax.ffi.ffi_call, so it
needs only the CUDA build of the extension (not the Python op).

  python benchmarks/probes/rnn_check.py [--skip-check] [--skip-time] [--quick] [--sweep]

Run from the repository root after building the CUDA extension in place
(bash build_ext.sh cuda, or pip install -e .). About a minute on an H200.
Exit status 0 only when every check passes; the last line says PASS or FAIL
(a run past --timeout seconds, e.g. a kernel that never returns, is killed
with a traceback and a nonzero status).

(a) Correctness, ffi/rnn/rnn.h's contract: every kind (LSTM, GRU, tanh and
relu RNN), bf16 / f16 / f32, reverse 0 / 1, ragged lengths (0, 1, T, above
T, negative), B = 1, odd B, a batch of more than one 128-row chunk, H not a
multiple of 8 or 64, the streamed and state-in-workspace variants, and each
of the 12 variants on one problem (run twice: bitwise equal). Every output
(forward: y, h_n, c_n, states; backward: dgx, dgh_n, dh0, dc0) lands in a
buffer poisoned first (NaN, 0xFF bytes for the workspace) and is checked
element by element against a pure-JAX reference of the recurrence written
here:
  - ref32: fp32 throughout, matmuls at HIGHEST precision;
  - refD:  the same recurrence as a model in the input dtype D runs it
    (h rounded to D before the matmul, fp32 accumulation; fp32 inputs with
    h and W rounded to TF32, as the kernels' mma does), outputs rounded to D.
  Backward references: jax.vjp of those forwards (the GRU's dgh_n as the
  gradient of a zero term added to hh's n slot).
  Rule (docs/design.md): max |ours - ref32| <= 2 max |refD - ref32| + floor,
  errors relative to max(1, max |ref32|); floor = 2 ulp(D) at 1 (bf16
  7.8e-3, f16 9.8e-4, f32: TF32's 9.8e-4). Outputs must be finite, and
  exactly zero at padded steps (y, states, dgx, dgh_n).

(b) Time (bf16): ours (forward kernel; backward kernel) against a jitted
lax.scan peer running the same recurrence in the same dtype (h in D, the
matmul in D with fp32 accumulation, cell in fp32), forward and
forward + backward (the peer's backward: jax.vjp), median over samples.
Excludes the input projection (both sides get gx).
"""

from __future__ import annotations

import argparse
import faulthandler
import functools
import statistics
import sys
import time
import warnings

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from jax_dnn._src import extension
from jax_dnn._src import plans

KINDS = {"lstm": 0, "gru": 1, "rnn_tanh": 2, "rnn_relu": 3}
GATES = {"lstm": 4, "gru": 3, "rnn_tanh": 1, "rnn_relu": 1}
SLOTS = {"lstm": 5, "gru": 5, "rnn_tanh": 1, "rnn_relu": 1}
FLOOR = {jnp.dtype(jnp.bfloat16): 2 * 2.0**-8, jnp.dtype(jnp.float16): 2 * 2.0**-11,
         jnp.dtype(jnp.float32): 2 * 2.0**-11}
HIGHEST = lax.Precision.HIGHEST


# --- the kernels through ffi_call --------------------------------------------------


def kernel_fwd(kind, reverse, variant, ws_bytes, gx, w, b, h0, c0, lens):
  t, bsz, _ = gx.shape
  h = w.shape[1]
  d = gx.dtype
  cell = (bsz, h) if kind == "lstm" else (0,)
  out = [jax.ShapeDtypeStruct((t, bsz, h), d), jax.ShapeDtypeStruct((bsz, h), d),
         jax.ShapeDtypeStruct(cell, d),
         jax.ShapeDtypeStruct((t, bsz, SLOTS[kind], h), jnp.float32),
         jax.ShapeDtypeStruct((ws_bytes,), jnp.uint8)]
  return jax.ffi.ffi_call("jax_dnn_rnn_fwd", out)(
      gx, w, b, h0, c0, lens, kind=np.int64(KINDS[kind]), reverse=np.int64(reverse),
      variant=np.int64(variant))


def kernel_bwd(kind, reverse, variant, ws_bytes, dy, dh_n, dc_n, w, h0, c0, lens, states):
  t, bsz, h = dy.shape
  g = GATES[kind]
  out = [jax.ShapeDtypeStruct((t, bsz, g * h), jnp.float32),
         jax.ShapeDtypeStruct((t, bsz, h) if kind == "gru" else (0,), jnp.float32),
         jax.ShapeDtypeStruct((bsz, h), jnp.float32),
         jax.ShapeDtypeStruct((bsz, h) if kind == "lstm" else (0,), jnp.float32),
         jax.ShapeDtypeStruct((ws_bytes,), jnp.uint8)]
  return jax.ffi.ffi_call("jax_dnn_rnn_bwd", out)(
      dy, dh_n, dc_n, w, h0, c0, lens, states, kind=np.int64(KINDS[kind]),
      reverse=np.int64(reverse), variant=np.int64(variant))


def poisoned(fn, *args):
  """jit(fn)(*args) with its outputs in buffers filled first with NaN (0xFF
  bytes for integer outputs: the workspace), donated so that XLA reuses
  them; returns (outputs without the workspace, how many landed in a
  poisoned buffer)."""
  leaves = jax.tree.leaves(jax.eval_shape(fn, *args))
  poison = [jnp.full(s.shape, jnp.nan if jnp.issubdtype(s.dtype, jnp.floating) else 255,
                     s.dtype) for s in leaves]
  ptrs = {p.unsafe_buffer_pointer() for p in poison if p.size}
  call = jax.jit(lambda poison, *a: fn(*a), donate_argnums=0, keep_unused=True)
  with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message=".*donated buffers were not usable.*")
    out = call(poison, *args)
  reused = sum(o.unsafe_buffer_pointer() in ptrs for o in out if o.size)
  return out[:-1], reused


# --- the reference recurrence (rnn.h), pure JAX ---------------------------------------


def reference(kind, reverse, gx, w, b, h0, c0, lens, e_n, matmul):
  """y [T, B, H], h_n, c_n, states [T, B, S, H] of rnn.h's recurrence, all
  fp32 arrays in; matmul(h) = h W^T (the caller's precision / rounding);
  e_n [T, B, H] is added to hh's n slot (GRU) so that its gradient is dgh_n."""
  t_len, bsz, _ = gx.shape
  h_dim = w.shape[1]
  lens = jnp.clip(lens, 0, t_len)
  rows = jnp.arange(bsz)

  def step(carry, s):
    h, c = carry
    active = s < lens
    t = jnp.where(active, lens - 1 - s if reverse else s, s)
    x = gx[t, rows]
    hh = matmul(h) + b
    if kind == "lstm":
      i, f, g, o = (x[:, k * h_dim:(k + 1) * h_dim] + hh[:, k * h_dim:(k + 1) * h_dim]
                    for k in range(4))
      i, f, g, o = jax.nn.sigmoid(i), jax.nn.sigmoid(f), jnp.tanh(g), jax.nn.sigmoid(o)
      c_new = f * c + i * g
      h_new = o * jnp.tanh(c_new)
      slots = [i, f, g, o, c_new]
    elif kind == "gru":
      hh_n = hh[:, 2 * h_dim:] + e_n[t, rows]
      r = jax.nn.sigmoid(x[:, :h_dim] + hh[:, :h_dim])
      u = jax.nn.sigmoid(x[:, h_dim:2 * h_dim] + hh[:, h_dim:2 * h_dim])
      n = jnp.tanh(x[:, 2 * h_dim:] + r * hh_n)
      h_new = (1 - u) * n + u * h
      c_new = c
      slots = [r, u, n, hh_n, h_new]
    else:
      a = x + hh
      h_new = jnp.tanh(a) if kind == "rnn_tanh" else jnp.maximum(a, 0)
      c_new = c
      slots = [h_new]
    m = active[:, None]
    out = (t, jnp.where(m, h_new, 0), jnp.stack([jnp.where(m, v, 0) for v in slots], 1))
    return (jnp.where(m, h_new, h), jnp.where(m, c_new, c)), out

  (h, c), (ts, ys, sts) = lax.scan(step, (h0, c0), jnp.arange(t_len))
  y = jnp.zeros_like(ys).at[ts, rows[None, :]].set(ys)
  states = jnp.zeros_like(sts).at[ts, rows[None, :]].set(sts)
  return y, h, c, states


def to_tf32(x):
  """x rounded to TF32 (10 mantissa bits, to nearest, ties away: cvt.rna),
  with an identity gradient."""
  bits = lax.bitcast_convert_type(x, jnp.uint32)
  r = lax.bitcast_convert_type((bits + jnp.uint32(0x1000)) & jnp.uint32(0xFFFFE000),
                               jnp.float32)
  return x + lax.stop_gradient(r - x)


@functools.lru_cache(maxsize=None)
def make_reference(kind, reverse, dtype, exact):
  """(forward, forward + vjp) of the reference: exact = ref32 (dtype None),
  else refD. Cached: cases of one shape share the compilation."""
  d = jnp.dtype(dtype) if dtype is not None else None

  def matmul_for(w):
    if exact:
      return lambda h: jnp.dot(h, w.T, precision=HIGHEST)
    if d == jnp.float32:  # TF32 operands, as the kernels' mma (and XLA's default)
      wt = to_tf32(w)
      return lambda h: jnp.dot(to_tf32(h), wt.T, precision=HIGHEST)
    wd = w.astype(d)
    return lambda h: jnp.dot(h.astype(d), wd.T, preferred_element_type=jnp.float32)

  def fwd(gx, w, b, h0, c0, lens, e_n):
    y, h, c, st = reference(kind, reverse, gx, w, b, h0, c0, lens, e_n, matmul_for(w))
    if not exact:  # outputs stored in D, as the model would
      y, h, c = (v.astype(d).astype(jnp.float32) for v in (y, h, c))
    return y, h, c, st

  def grads(gx, w, b, h0, c0, lens, e_n, dy, dh_n, dc_n):
    f = lambda gx, h0, c0, e_n: fwd(gx, w, b, h0, c0, lens, e_n)[:3]
    _, vjp = jax.vjp(f, gx, h0, c0, e_n)
    return vjp((dy, dh_n, dc_n))  # dgx, dh0, dc0, dgh_n

  return jax.jit(fwd), jax.jit(grads)


# --- one correctness case ------------------------------------------------------------


def max_rel(got, want):
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  if got.size == 0:
    return 0.0
  return float(np.max(np.abs(got - want))) / max(1.0, float(np.max(np.abs(want))))


def check_case(name, kind, dtype, t, bsz, h, lens, reverse, variant=None, seed=0):
  """One problem through both kernels; returns (passed, a line to print).
  Where a variant is named, the kernels also run a second time and must
  give bitwise the same outputs (fixed reduction order: no atomics)."""
  d = jnp.dtype(dtype)
  g = GATES[kind]
  plan = plans.rnn_plan(kind, d.name, t, bsz, h)
  variant_named = variant is not None
  if variant is None:
    if not plan.supported:
      return False, f"{name}: plan declines: {plan.reason}"
    variant = plan.variant
  fwd_ws, bwd_ws = plans.rnn_variant_workspace_bytes(kind, d.name, bsz, h, variant)
  rng = np.random.default_rng(seed)
  scale = 1.0 / np.sqrt(h)
  f32 = lambda *s, sc=1.0: (rng.standard_normal(s) * sc).astype(np.float32)
  # Inputs in D; the references see the same (rounded) values in fp32.
  gx = jnp.asarray(f32(t, bsz, g * h), d)
  # W_hh at 2 / sqrt(H) for the gated cells (saturating: a spectral radius
  # of about 2 stays bounded), 1 / sqrt(H) for the plain RNN (relu would
  # grow about 2x a step, past fp16's range in 25 steps).
  w = jnp.asarray(f32(g * h, h, sc=(1 if g == 1 else 2) * scale), d)
  b = jnp.asarray(f32(g * h, sc=0.1), d)
  h0 = jnp.asarray(f32(bsz, h, sc=0.5), d)
  c0 = jnp.asarray(f32(bsz, h, sc=0.5), d) if kind == "lstm" else jnp.zeros((0,), d)
  lens = jnp.asarray(np.resize(np.asarray(lens, np.int32), bsz))
  dy = jnp.asarray(f32(t, bsz, h), d)
  dh_n = jnp.asarray(f32(bsz, h), d)
  dc_n = jnp.asarray(f32(bsz, h), d) if kind == "lstm" else jnp.zeros((0,), d)

  (y, hn, cn, st), reused_f = poisoned(
      lambda *a: kernel_fwd(kind, reverse, variant, fwd_ws, *a), gx, w, b, h0, c0, lens)
  (dgx, dghn, dh0, dc0), reused_b = poisoned(
      lambda *a: kernel_bwd(kind, reverse, variant, bwd_ws, *a), dy, dh_n, dc_n, w, h0, c0,
      lens, st)

  problems, errs = [], []
  if variant_named:
    again_f, _ = poisoned(
        lambda *a: kernel_fwd(kind, reverse, variant, fwd_ws, *a), gx, w, b, h0, c0, lens)
    again_b, _ = poisoned(
        lambda *a: kernel_bwd(kind, reverse, variant, bwd_ws, *a), dy, dh_n, dc_n, w, h0, c0,
        lens, st)
    for got, again in zip((y, hn, cn, st, dgx, dghn, dh0, dc0), (*again_f, *again_b)):
      if np.asarray(got).tobytes() != np.asarray(again).tobytes():
        problems.append("a second run differs bitwise")
        break

  up = lambda v: v.astype(jnp.float32)
  c0_ref = up(c0) if kind == "lstm" else jnp.zeros((bsz, h), jnp.float32)
  dc_ref = up(dc_n) if kind == "lstm" else jnp.zeros((bsz, h), jnp.float32)
  e_n = jnp.zeros((t, bsz, h), jnp.float32)
  args = (up(gx), up(w), up(b), up(h0), c0_ref, lens, e_n)
  results = {}
  for exact in (True, False):
    ref_f, ref_g = make_reference(kind, reverse, None if exact else d.name, exact)
    y_r, h_r, c_r, st_r = ref_f(*args)
    dgx_r, dh0_r, dc0_r, dghn_r = ref_g(*args, up(dy), up(dh_n), dc_ref)
    results[exact] = dict(y=y_r, h_n=h_r, c_n=c_r, states=st_r, dgx=dgx_r, dh0=dh0_r,
                          dc0=dc0_r, dgh_n=dghn_r)
  ours = dict(y=y, h_n=hn, states=st, dgx=dgx, dh0=dh0)
  if kind == "lstm":
    ours.update(c_n=cn, dc0=dc0)
  if kind == "gru":
    ours["dgh_n"] = dghn

  floor = FLOOR[d]
  for key, got in ours.items():
    got = np.asarray(got.astype(jnp.float32))
    if not np.all(np.isfinite(got)):
      problems.append(f"{key}: {int(np.sum(~np.isfinite(got)))} non-finite")
      continue
    e_ours = max_rel(got, results[True][key])
    e_ref = max_rel(results[False][key], results[True][key])
    tol = 2 * e_ref + floor
    errs.append(f"{key} {e_ours:.1e}/{tol:.1e}")
    if e_ours > tol:
      problems.append(f"{key}: error {e_ours:.2e} > {tol:.2e} (refD {e_ref:.2e})")
  # Padded steps: exactly zero.
  n_len = np.clip(np.asarray(lens), 0, t)
  pad = np.arange(t)[:, None] >= n_len[None, :]  # [T, B]
  for key in ("y", "states", "dgx", "dgh_n"):
    if key in ours:
      v = np.asarray(ours[key].astype(jnp.float32))
      if np.any(v[pad] != 0):
        problems.append(f"{key}: nonzero at padded steps")
  if reused_f + reused_b == 0:
    problems.append("no output landed in a poisoned buffer")
  status = "ok" if not problems else "FAIL: " + "; ".join(problems)
  line = (f"{name:34s} {d.name:8s} v{variant:<2d} rev={reverse} " + status +
          ("" if problems else "  [" + ", ".join(errs) + "]"))
  return not problems, line


def cases(quick):
  ragged = [0, 1, 1000, -3, 7, 24, 25]  # 0, 1, > T, negative, mid, T - 1, T (T = 25)
  out = []
  # bf16 in both orders, f16 reversed, f32 forward (each kind).
  for kind in ("lstm", "gru", "rnn_tanh", "rnn_relu"):
    for dtype, reverse in ((jnp.bfloat16, 0), (jnp.bfloat16, 1), (jnp.float16, 1),
                           (jnp.float32, 0)):
      if quick and (dtype != jnp.bfloat16 or reverse):
        continue
      out.append((f"{kind} T25 B7 H40 ragged", kind, dtype, 25, 7, 40, ragged, reverse))
  out += [
      ("lstm B1 H130", "lstm", jnp.bfloat16, 33, 1, 130, [33], 0),
      ("gru B1 H72 len 0", "gru", jnp.float16, 9, 1, 72, [0], 1),
      ("lstm B133 (2 chunks) H96", "lstm", jnp.bfloat16, 12, 133, 96, [12, 3, 0, 20, 11], 1),
      ("gru B133 (2 chunks) H24 f32", "gru", jnp.float32, 12, 133, 24, [12, 5, 0], 0),
      ("rnn_tanh H1 B3", "rnn_tanh", jnp.float32, 10, 3, 1, [10, 4, 0], 0),
      ("lstm H2048 (streamed)", "lstm", jnp.bfloat16, 6, 5, 2048, [6, 2, 0, 9, 5], 1),
      ("gru B4000 (state in workspace)", "gru", jnp.bfloat16, 5, 4000, 64, [5, 0, 3, 7], 0),
      ("lstm T3000 (long)", "lstm", jnp.bfloat16, 3000, 4, 64, [3000, 1500, 0, 2999], 0),
  ]
  # Each variant (U = 8, 16, 32; resident / streamed weights; state in
  # shared memory / the workspace) on one problem.
  for variant in range(12):
    if quick and variant % 3:
      continue
    out.append(("lstm T17 B19 H72 variant", "lstm", jnp.bfloat16, 17, 19, 72,
                [17, 0, 9, 40, 1], variant % 2, variant))
  return out


# --- timing --------------------------------------------------------------------------


def median_ms(fn, *args, samples=15):
  jax.block_until_ready(fn(*args))
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(samples):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append((time.perf_counter() - t0) * 1e3)
  return statistics.median(times)


def scan_peer(kind, gx, w, b, h0, c0):
  """The recurrence as a model in D runs it: h in D, h W^T in D with fp32
  accumulation, the cell in fp32; returns (y, h_n, c_n)."""
  d = gx.dtype
  h_dim = w.shape[1]

  def step(carry, x):
    h, c = carry
    hh = jnp.dot(h, w.T, preferred_element_type=jnp.float32) + b.astype(jnp.float32)
    xf = x.astype(jnp.float32)
    if kind == "lstm":
      i, f, g, o = (xf[:, k * h_dim:(k + 1) * h_dim] + hh[:, k * h_dim:(k + 1) * h_dim]
                    for k in range(4))
      c = jax.nn.sigmoid(f) * c + jax.nn.sigmoid(i) * jnp.tanh(g)
      h_new = jax.nn.sigmoid(o) * jnp.tanh(c)
    else:  # gru: hh's n slot inside r * ()
      r = jax.nn.sigmoid(xf[:, :h_dim] + hh[:, :h_dim])
      u = jax.nn.sigmoid(xf[:, h_dim:2 * h_dim] + hh[:, h_dim:2 * h_dim])
      n = jnp.tanh(xf[:, 2 * h_dim:] + r * hh[:, 2 * h_dim:])
      h_new = (1 - u) * n + u * h.astype(jnp.float32)
    h_new = h_new.astype(d)
    return (h_new, c), h_new

  (h, c), y = lax.scan(step, (h0, c0), gx)
  return y, h, c


def time_shape(kind, t, bsz, h, dtype=jnp.bfloat16):
  d = jnp.dtype(dtype)
  g = GATES[kind]
  plan = plans.rnn_plan(kind, d.name, t, bsz, h)
  if not plan.supported:
    return f"{kind} B{bsz} T{t} H{h}: plan declines: {plan.reason}", None
  rng = np.random.default_rng(1)
  gx = jnp.asarray(rng.standard_normal((t, bsz, g * h)), d)
  w = jnp.asarray(rng.standard_normal((g * h, h)) / np.sqrt(h), d)
  b = jnp.asarray(rng.standard_normal(g * h) * 0.1, d)
  h0 = jnp.zeros((bsz, h), d)
  c0 = jnp.zeros((bsz, h), d) if kind == "lstm" else jnp.zeros((0,), d)
  lens = jnp.full((bsz,), t, jnp.int32)
  dy = jnp.asarray(rng.standard_normal((t, bsz, h)), d)
  dh_n = jnp.zeros((bsz, h), d)
  fwd = jax.jit(lambda *a: kernel_fwd(kind, 0, plan.variant, plan.fwd_workspace_bytes, *a))
  bwd = jax.jit(lambda *a: kernel_bwd(kind, 0, plan.variant, plan.bwd_workspace_bytes, *a))
  states = fwd(gx, w, b, h0, c0, lens)[3]
  ours_f = median_ms(fwd, gx, w, b, h0, c0, lens)
  ours_b = median_ms(bwd, dy, dh_n, c0, w, h0, c0, lens, states)

  c0_peer = jnp.zeros((bsz, h), jnp.float32)
  peer_f = jax.jit(lambda gx, w, b, h0: scan_peer(kind, gx, w, b, h0, c0_peer)[0])

  @jax.jit
  def peer_fb(gx, w, b, h0, dy):
    y, vjp = jax.vjp(lambda gx, w, b, h0: scan_peer(kind, gx, w, b, h0, c0_peer)[0],
                     gx, w, b, h0)
    return vjp(dy)

  scan_f = median_ms(peer_f, gx, w, b, h0)
  scan_fb = median_ms(peer_fb, gx, w, b, h0, dy)
  row = (f"{kind:5s} B{bsz:<4d} T{t:<5d} H{h:<5d} v{plan.variant:<2d}|"
         f" {ours_f:7.3f} {ours_f * 1e3 / t:6.2f} | {scan_f:7.3f} {scan_f * 1e3 / t:6.2f} |"
         f" {ours_b:7.3f} | {ours_f + ours_b:7.3f} {(ours_f + ours_b) * 1e3 / t:6.2f} |"
         f" {scan_fb:7.3f} {scan_fb * 1e3 / t:6.2f} | {scan_f / ours_f:5.1f}x"
         f" {scan_fb / (ours_f + ours_b):5.1f}x")
  return row, (ours_f, ours_b, scan_f, scan_fb)


def sweep_variants(kind, t, bsz, h, dtype=jnp.bfloat16):
  """ms of the forward and backward kernels for every variant id at one
  shape (those that do not launch, e.g. past the SMs or the shared memory,
  print their error), for tuning the plan's choice."""
  d = jnp.dtype(dtype)
  g = GATES[kind]
  rng = np.random.default_rng(1)
  gx = jnp.asarray(rng.standard_normal((t, bsz, g * h)), d)
  w = jnp.asarray(rng.standard_normal((g * h, h)) / np.sqrt(h), d)
  b = jnp.zeros((g * h,), d)
  h0 = jnp.zeros((bsz, h), d)
  c0 = jnp.zeros((bsz, h), d) if kind == "lstm" else jnp.zeros((0,), d)
  lens = jnp.full((bsz,), t, jnp.int32)
  dy = jnp.asarray(rng.standard_normal((t, bsz, h)), d)
  chosen = plans.rnn_plan(kind, d.name, t, bsz, h).variant
  for variant in range(12):
    fwd_ws, bwd_ws = plans.rnn_variant_workspace_bytes(kind, d.name, bsz, h, variant)
    try:
      fwd = jax.jit(lambda *a: kernel_fwd(kind, 0, variant, fwd_ws, *a))
      bwd = jax.jit(lambda *a: kernel_bwd(kind, 0, variant, bwd_ws, *a))
      states = fwd(gx, w, b, h0, c0, lens)[3]
      f_ms = median_ms(fwd, gx, w, b, h0, c0, lens, samples=7)
      b_ms = median_ms(bwd, dy, h0, c0, w, h0, c0, lens, states, samples=7)
      row = f"fwd {f_ms:7.3f} ms  bwd {b_ms:7.3f} ms"
    except Exception as e:  # pylint: disable=broad-except
      row = f"{type(e).__name__}: {str(e).splitlines()[0][:80]}"
    mark = " <- plan" if variant == chosen else ""
    print(f"  {kind} B{bsz} T{t} H{h} variant {variant:2d}: {row}{mark}", flush=True)


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--skip-check", action="store_true")
  ap.add_argument("--skip-time", action="store_true")
  ap.add_argument("--quick", action="store_true", help="bf16 / forward-order cases only")
  ap.add_argument("--sweep", action="store_true",
                  help="also time every variant at the timing shapes (tuning the plan)")
  ap.add_argument("--timeout", type=float, default=400,
                  help="seconds before the run is killed (a kernel that never returns)")
  args = ap.parse_args()
  # A hung kernel blocks inside the runtime, where Python signals never run:
  # faulthandler's watchdog thread prints the stack and exits instead.
  faulthandler.dump_traceback_later(args.timeout, exit=True)
  targets = extension.registered_targets()
  missing = {"jax_dnn_rnn_fwd", "jax_dnn_rnn_bwd"} - set(targets)
  if missing or jax.default_backend() != "gpu":
    print(f"needs a GPU and the CUDA build of the extension (missing: {sorted(missing)}, "
          f"backend {jax.default_backend()})\nFAIL")
    return 2
  print(f"device: {jax.devices()[0].device_kind}, SMs {plans.current_device().sm_count}")
  ok = True
  t0 = time.perf_counter()
  if not args.skip_check:
    print("\n(a) correctness: error/tolerance per output, relative to max(1, max|ref32|)")
    for case in cases(args.quick):
      try:
        passed, line = check_case(*case)
      except Exception as e:  # a launch error is a failed case, not the end of the run
        passed, line = False, f"{case[0]}: {type(e).__name__}: {e}"
      ok &= passed
      print(line, flush=True)
    print(f"checks took {time.perf_counter() - t0:.0f} s")
  if not args.skip_time:
    print("\n(b) time, bf16, ms and us/step (ours: fwd kernel, bwd kernel; scan peer: jitted"
          " lax.scan, bwd by jax.vjp)")
    print(f"{'shape':32s}| ours fwd  us/st | scan fwd  us/st | ours bwd| ours f+b us/st |"
          f" scan f+b us/st | fwd   f+b")
    for shape in (("lstm", 1024, 16, 768), ("lstm", 256, 64, 512), ("lstm", 128, 256, 1024),
                  ("gru", 1024, 16, 768)):
      try:
        row, _ = time_shape(*shape)
      except Exception as e:
        ok, row = False, f"{shape}: {type(e).__name__}: {e}"
      print(row, flush=True)
  if args.sweep:
    print("\n(c) every variant, bf16")
    for shape in (("lstm", 1024, 16, 768), ("lstm", 256, 64, 512), ("lstm", 128, 256, 1024)):
      sweep_variants(*shape)
  print(f"total {time.perf_counter() - t0:.0f} s")
  print("PASS" if ok else "FAIL")
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
