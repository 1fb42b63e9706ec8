"""Side-by-side attention benchmark: jax_dnn vs cuDNN vs XLA.

For each head dim D, sequence length S and causal setting it times, in one
process and on the same inputs (layout [B, S, N, D], bf16 or f16):
  ours   - jax_dnn.dot_product_attention(q, k, v, is_causal=c)
  cudnn  - jax.nn.dot_product_attention(..., implementation="cudnn")
  xla    - jax.nn.dot_product_attention(..., implementation="xla")
Shapes keep the work per token fixed: B * S = 16384 tokens, N * D = 2048
hidden, so N = 2048 // D heads and B = 16384 // S.

Modes and FLOPs (the usual flash-attention accounting; causal halves each):
  fwd      o = attn(q, k, v)                           4 * B * N * S^2 * D
  bwd      dq, dk, dv of sum(o * do)                   2.5 x fwd
  fwd+bwd  o and dq, dk, dv in one jitted call         3.5 x fwd
TFLOP/s is those FLOPs over the median time.

How bwd is timed: it is not timed on its own. fwd is one jitted call
returning o; fwd+bwd is one jitted call doing jax.vjp and applying it to a
fixed random cotangent do (returns o, dq, dk, dv). bwd time is defined as
median(fwd+bwd) - median(fwd): what the backward adds to a training step,
including whatever it costs to keep the forward's residuals. (Timing a
jitted vjp alone would recompute the forward inside it anyway.) When that
difference is not positive (noise on tiny shapes) bwd is reported as missing.

Timing: per config, every (impl, mode) function is compiled and warmed up
(calls for at least WARMUP_S, so that the GPU's clocks have ramped up), then
ROUNDS rounds run each of them in turn -- ours, cudnn, xla, ours, ... -- so
that all implementations see the same clock and temperature state (an H100's
clocks drift by 10% and more over a run: timing one implementation after the
other made the ratios move by that much). In a round a function runs --iters
calls back to back (fewer, but at least 3, for a slow one) with one
block_until_ready at the end, timed with time.perf_counter; the time per call
is the median over the rounds. Inputs are random
normal from a fixed key. Every (impl, config, mode) runs under try/except: a
failure (cuDNN refusing a shape, XLA running out of memory on the [S, S]
scores) is recorded as None with a short reason and the run goes on. xla is
skipped above --xla-max-seq (its memory grows as S^2). "maxdiff" is the max
abs difference of ours' forward output against cudnn's (against xla's,
marked *, where cudnn failed).

Output: a table on the terminal, a JSON file (--json) with every field, and
a plot of TFLOP/s against S (--plot, needs matplotlib).

Usage: python benchmarks/bench_attention.py [--quick] [--json out.json] [--plot out.png]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time

import jax
import jax.numpy as jnp

import jax_dnn

TOKENS = 16384  # B * S
HIDDEN = 2048  # N * D
IMPLS = ("ours", "cudnn", "xla")
MODES = ("fwd", "bwd", "fwd+bwd")
FLOP_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwd+bwd": 3.5}
WARMUP_S = 0.3  # per (impl, config, mode), after compiling
ROUNDS = 5
ROUND_S = 0.5  # at most this long per function per round (slow functions run fewer calls)
MIN_ITERS = 3

# Presets: full (default), --quick and --cpu-smoke (tiny shapes, CPU, no cudnn).
PRESETS = {
    "full": dict(head_dims=(64, 128, 256), seqlens=(512, 1024, 2048, 4096, 8192, 16384),
                 modes=MODES, tokens=TOKENS, hidden=HIDDEN, iters=10),
    "quick": dict(head_dims=(128,), seqlens=(512, 2048, 8192), modes=("fwd", "fwd+bwd"),
                  tokens=TOKENS, hidden=HIDDEN, iters=10),
    "cpu_smoke": dict(head_dims=(32, 64), seqlens=(64, 128), modes=MODES, tokens=256,
                      hidden=128, iters=3),
}


def attention_flops(batch, heads, seqlen, head_dim, causal, mode):
  """Standard attention FLOPs: 4 B N S^2 D forward, halved when causal."""
  fwd = 4.0 * batch * heads * seqlen * seqlen * head_dim
  if causal:
    fwd /= 2
  return fwd * FLOP_FACTOR[mode]


def attention_fn(impl, causal):
  if impl == "ours":
    return lambda q, k, v: jax_dnn.dot_product_attention(q, k, v, is_causal=causal)
  return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal,
                                                      implementation=impl)


def mode_fn(attn, mode):
  """The jitted function timed for a measured mode (fwd or fwd+bwd)."""
  if mode == "fwd":
    def fwd(q, k, v, do):
      del do
      return attn(q, k, v)
    return jax.jit(fwd)

  def fwd_bwd(q, k, v, do):
    o, vjp = jax.vjp(attn, q, k, v)
    return o, vjp(do)
  return jax.jit(fwd_bwd)


def warm_up(fn, args, iters):
  """Compiles and warms up fn; returns (calls per round, output of the first call)."""
  first = fn(*args)  # compiles
  jax.block_until_ready(first)
  t0 = time.perf_counter()
  calls = 0
  while calls < 2 or time.perf_counter() - t0 < WARMUP_S:
    jax.block_until_ready(fn(*args))
    calls += 1
  per_call = (time.perf_counter() - t0) / calls
  return max(MIN_ITERS, min(iters, int(ROUND_S / max(per_call, 1e-9)))), first


def time_batch(fn, args, n):
  """Seconds per call over n back-to-back calls, synchronized once at the end."""
  t0 = time.perf_counter()
  for _ in range(n):
    out = fn(*args)
  jax.block_until_ready(out)
  return (time.perf_counter() - t0) / n


def short_reason(e):
  lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
  msg = lines[0] if lines else ""
  return f"{type(e).__name__}: {msg[:160]}"


def max_abs_diff(a, b):
  return float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))


def bench_config(head_dim, seqlen, causal, *, dtype, tokens, hidden, impls, modes, iters,
                 xla_max_seq, smoke):
  """Records (one per requested mode) for one (D, S, causal)."""
  heads, batch = hidden // head_dim, tokens // seqlen
  shape = (batch, seqlen, heads, head_dim)
  kq, kk, kv, kd = jax.random.split(jax.random.key(0), 4)
  q, k, v, do = (jax.random.normal(key, shape, dtype) for key in (kq, kk, kv, kd))
  measured = [m for m in ("fwd", "fwd+bwd") if m in modes or "bwd" in modes]
  # times[impl][mode] = (seconds, calls) or None; errors[impl][mode] = reason
  times = {impl: {} for impl in IMPLS}
  errors = {impl: {} for impl in IMPLS}
  fwd_out = {}
  fns, calls = {}, {}  # (impl, mode) -> jitted function, calls per round
  for impl in IMPLS:
    skip = None
    if impl not in impls:
      skip = "skipped (--cpu-smoke)" if smoke and impl == "cudnn" else "skipped (--impls)"
    elif impl == "xla" and seqlen > xla_max_seq:
      skip = f"skipped (S > --xla-max-seq {xla_max_seq})"
    for mode in measured:
      times[impl][mode] = None
      if skip:
        errors[impl][mode] = skip
        continue
      try:
        fn = mode_fn(attention_fn(impl, causal), mode)
        calls[impl, mode], first = warm_up(fn, (q, k, v, do), iters)
        fns[impl, mode] = fn
        if mode == "fwd":
          fwd_out[impl] = first
        del first
      except Exception as e:  # noqa: BLE001 - any failure is recorded, the run goes on
        errors[impl][mode] = short_reason(e)
  samples = {key: [] for key in fns}
  for _ in range(ROUNDS):  # interleaved: every implementation sees the same GPU state
    for key, fn in list(fns.items()):
      try:
        samples[key].append(time_batch(fn, (q, k, v, do), calls[key]))
      except Exception as e:  # noqa: BLE001
        errors[key[0]][key[1]] = short_reason(e)
        del fns[key], samples[key]
  for (impl, mode), ts in samples.items():
    times[impl][mode] = (statistics.median(ts), calls[impl, mode] * len(ts))
  fns.clear()
  for impl in IMPLS:
    if "bwd" in modes:  # derived: median(fwd+bwd) - median(fwd)
      f, fb = times[impl].get("fwd"), times[impl].get("fwd+bwd")
      if f and fb:
        if fb[0] > f[0]:
          times[impl]["bwd"] = (fb[0] - f[0], min(f[1], fb[1]))
        else:
          times[impl]["bwd"], errors[impl]["bwd"] = None, "fwd+bwd - fwd <= 0 (noise)"
      else:
        times[impl]["bwd"] = None
        why = errors[impl].get("fwd") or errors[impl].get("fwd+bwd") or "?"
        errors[impl]["bwd"] = why if why.startswith("skipped") else "needs fwd and fwd+bwd: " + why

  # Correctness spot check: ours' forward against cudnn's (or xla's).
  maxdiff, maxdiff_ref = None, None
  if "ours" in fwd_out:
    for ref in ("cudnn", "xla"):
      if ref in fwd_out:
        try:
          maxdiff, maxdiff_ref = max_abs_diff(fwd_out["ours"], fwd_out[ref]), ref
        except Exception:  # noqa: BLE001
          pass
        break
  del q, k, v, do, fwd_out

  records = []
  for mode in modes:
    flops = attention_flops(batch, heads, seqlen, head_dim, causal, mode)
    rec = dict(head_dim=head_dim, seqlen=seqlen, batch=batch, heads=heads, causal=causal,
               mode=mode, dtype=jnp.dtype(dtype).name, flops=flops)
    for impl in IMPLS:
      tn = times[impl].get(mode)
      rec[f"{impl}_ms"] = tn[0] * 1e3 if tn else None
      rec[f"{impl}_tflops"] = flops / tn[0] / 1e12 if tn else None
      rec[f"{impl}_iters"] = tn[1] if tn else None
      rec[f"{impl}_error"] = errors[impl].get(mode)
    rec["ours_over_cudnn"] = (rec["ours_tflops"] / rec["cudnn_tflops"]
                              if rec["ours_tflops"] and rec["cudnn_tflops"] else None)
    rec["maxdiff"], rec["maxdiff_ref"] = maxdiff, maxdiff_ref
    records.append(rec)
  return records


def fmt(x, spec, width):
  return f"{'-':>{width}s}" if x is None else f"{x:{width}{spec}}"


def format_table(records):
  lines = [f"{'D':>4s} {'S':>6s} {'causal':6s} {'mode':8s} {'ours':>7s} {'cudnn':>7s} "
           f"{'xla':>7s} {'ours/cudnn':>10s} {'maxdiff':>9s}",
           f"{'':4s} {'':6s} {'':6s} {'':8s} {'TFLOP/s':>7s} {'TFLOP/s':>7s} {'TFLOP/s':>7s}"]
  for r in records:
    md = fmt(r["maxdiff"], ".1e", 8) + ("*" if r["maxdiff_ref"] == "xla" else " ")
    lines.append(f"{r['head_dim']:4d} {r['seqlen']:6d} {'yes' if r['causal'] else 'no':6s} "
                 f"{r['mode']:8s} {fmt(r['ours_tflops'], '.1f', 7)} "
                 f"{fmt(r['cudnn_tflops'], '.1f', 7)} {fmt(r['xla_tflops'], '.1f', 7)} "
                 f"{fmt(r['ours_over_cudnn'], '.2f', 10)} {md}")
  if any(r["maxdiff_ref"] == "xla" for r in records):
    lines.append("* maxdiff against xla (no cudnn output)")
  return "\n".join(lines)


def format_notes(records):
  """Failures grouped by (impl, reason), with the configs they hit."""
  groups = {}
  for r in records:
    for impl in IMPLS:
      if r[f"{impl}_error"]:
        tag = f"D{r['head_dim']}/S{r['seqlen']}/{'c' if r['causal'] else 'nc'}/{r['mode']}"
        groups.setdefault((impl, r[f"{impl}_error"]), []).append(tag)
  lines = []
  for (impl, reason), tags in groups.items():
    shown = " ".join(tags[:6]) + (f" (+{len(tags) - 6} more)" if len(tags) > 6 else "")
    lines.append(f"  {impl}: {reason}\n      {len(tags)}x: {shown}")
  return "\n".join(lines)


def plot(records, path, title):
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    print(f"matplotlib is not installed: no plot written to {path}", flush=True)
    return
  dims = sorted({r["head_dim"] for r in records})
  modes = [m for m in MODES if any(r["mode"] == m for r in records)]
  fig, axes = plt.subplots(len(dims), len(modes), figsize=(4.6 * len(modes), 3.4 * len(dims)),
                           squeeze=False)
  colors = {"ours": "C0", "cudnn": "C1", "xla": "C2"}
  for i, d in enumerate(dims):
    for j, mode in enumerate(modes):
      ax = axes[i][j]
      rows = [r for r in records if r["head_dim"] == d and r["mode"] == mode]
      for impl in IMPLS:
        for causal in (False, True):
          pts = sorted((r["seqlen"], r[f"{impl}_tflops"]) for r in rows
                       if r["causal"] == causal and r[f"{impl}_tflops"] is not None)
          if pts:
            ax.plot(*zip(*pts), color=colors[impl], linestyle="--" if causal else "-",
                    marker="o", markersize=3,
                    label=f"{impl}{' causal' if causal else ''}")
      seqlens = sorted({r["seqlen"] for r in rows})
      ax.set_xscale("log", base=2)
      if seqlens:
        ax.set_xticks(seqlens)
        ax.set_xticklabels([str(s) for s in seqlens], fontsize=7)
      ax.set_ylim(bottom=0)
      ax.grid(alpha=0.3)
      ax.set_title(f"D={d}, {mode}", fontsize=10)
      ax.set_xlabel("S (B*S fixed)", fontsize=8)
      ax.set_ylabel("TFLOP/s", fontsize=8)
  handles, labels = {}, []
  for ax in axes.flat:
    for h, lab in zip(*ax.get_legend_handles_labels()):
      handles.setdefault(lab, h)
  labels = [f"{impl}{c}" for impl in IMPLS for c in ("", " causal") if f"{impl}{c}" in handles]
  fig.legend([handles[lab] for lab in labels], labels, loc="lower center", ncol=len(labels),
             fontsize=8, frameon=False)
  fig.suptitle(title, fontsize=11)
  fig.tight_layout(rect=(0, 0.05, 1, 0.96))
  fig.savefig(path, dpi=120)
  plt.close(fig)
  print(f"plot written to {path}", flush=True)


def int_list(s):
  return tuple(int(x) for x in s.split(",") if x)


def str_list(choices):
  def parse(s):
    items = tuple(x for x in s.split(",") if x)
    bad = [x for x in items if x not in choices]
    if bad:
      raise argparse.ArgumentTypeError(f"unknown {bad}; choose from {','.join(choices)}")
    return items
  return parse


def bool_list(s):
  vals = {"no": False, "false": False, "0": False, "yes": True, "true": True, "1": True}
  try:
    return tuple(vals[x.lower()] for x in s.split(",") if x)
  except KeyError as e:
    raise argparse.ArgumentTypeError(f"causal values are no/yes (or false/true); got {e}") from e


def parse_args(argv=None):
  ap = argparse.ArgumentParser(
      description="Attention TFLOP/s: jax_dnn vs cuDNN vs XLA (B*S = 16384, N*D = 2048).")
  ap.add_argument("--quick", action="store_true",
                  help="D=128, S in 512,2048,8192, modes fwd,fwd+bwd, both causal settings")
  ap.add_argument("--head-dims", type=int_list, help="comma list (default 64,128,256)")
  ap.add_argument("--seqlens", type=int_list,
                  help="comma list (default 512,1024,2048,4096,8192,16384)")
  ap.add_argument("--causal", type=bool_list, default=(False, True),
                  help="comma list of no/yes (default no,yes)")
  ap.add_argument("--modes", type=str_list(MODES), help="comma list of fwd,bwd,fwd+bwd (all)")
  ap.add_argument("--impls", type=str_list(IMPLS), default=IMPLS,
                  help="comma list of ours,cudnn,xla (default all)")
  ap.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
  ap.add_argument("--iters", type=int, help="calls per function per timing round (default 10)")
  ap.add_argument("--xla-max-seq", type=int, default=8192,
                  help="skip xla for S above this (default 8192; its memory is O(S^2))")
  ap.add_argument("--json", default="bench_attention.json", help="output JSON path")
  ap.add_argument("--plot", default=None, help="output PNG path (needs matplotlib)")
  ap.add_argument("--cpu-smoke", action="store_true", help=argparse.SUPPRESS)
  args = ap.parse_args(argv)
  preset = PRESETS["cpu_smoke" if args.cpu_smoke else "quick" if args.quick else "full"]
  for name in ("head_dims", "seqlens", "modes", "iters"):
    if getattr(args, name) is None:
      setattr(args, name, preset[name])
  args.tokens, args.hidden = preset["tokens"], preset["hidden"]
  if args.cpu_smoke:
    args.impls = tuple(i for i in args.impls if i != "cudnn")
  args.modes = tuple(m for m in MODES if m in args.modes)  # canonical order
  return args


def main(argv=None):
  args = parse_args(argv)
  if args.cpu_smoke:
    jax.config.update("jax_platforms", "cpu")
  dtype = jnp.dtype(args.dtype)
  dev = jax.devices()[0]
  cudnn_version = None
  try:
    from jax._src.lib import cuda_versions  # private; only for the record
    cudnn_version = cuda_versions.cudnn_get_version() if cuda_versions else None
  except Exception:  # noqa: BLE001
    pass
  print(f"device: {dev.device_kind}; jax {jax.__version__}; cudnn {cudnn_version}; "
        f"kernels: {jax_dnn.has_cuda_kernels()}; {args.dtype}; "
        f"B*S={args.tokens}, N*D={args.hidden}", flush=True)

  configs = []
  for d in args.head_dims:
    for s in args.seqlens:
      if args.hidden % d or s > args.tokens:
        print(f"  skipping D={d} S={s}: N*D={args.hidden} must divide and S <= B*S={args.tokens}",
              flush=True)
        continue
      if args.tokens % s:  # a ragged length (S % 128 != 0, say): B = floor(tokens / S)
        print(f"  D={d} S={s}: B={args.tokens // s}, B*S={args.tokens // s * s}", flush=True)
      configs.extend((d, s, c) for c in args.causal)

  t_start = time.perf_counter()
  records = []
  for i, (d, s, c) in enumerate(configs):
    t0 = time.perf_counter()
    recs = bench_config(d, s, c, dtype=dtype, tokens=args.tokens, hidden=args.hidden,
                        impls=args.impls, modes=args.modes, iters=args.iters,
                        xla_max_seq=args.xla_max_seq, smoke=args.cpu_smoke)
    records.extend(recs)
    gc.collect()
    jax.clear_caches()
    summary = "  ".join(
        f"{r['mode']} " + "/".join(fmt(r[f"{impl}_tflops"], ".0f", 1) for impl in IMPLS)
        for r in recs)
    md = recs[0]["maxdiff"] if recs else None
    print(f"[{i + 1}/{len(configs)}] D={d} S={s} causal={'yes' if c else 'no'} "
          f"({time.perf_counter() - t0:.1f} s)  TFLOP/s ours/cudnn/xla: {summary}  "
          f"maxdiff {fmt(md, '.1e', 1)}", flush=True)

  meta = dict(device=dev.device_kind, platform=dev.platform, jax=jax.__version__,
              jax_dnn=jax_dnn.__version__, kernels=bool(jax_dnn.has_cuda_kernels()),
              cudnn=cudnn_version, date=time.strftime("%Y-%m-%d %H:%M:%S"), dtype=args.dtype,
              tokens=args.tokens, hidden=args.hidden, warmup_s=WARMUP_S, rounds=ROUNDS, iters=args.iters,
              xla_max_seq=args.xla_max_seq, elapsed_s=time.perf_counter() - t_start,
              bwd_timing="median(fwd+bwd) - median(fwd), each a separate jitted call",
              flops="fwd 4*B*N*S^2*D (halved if causal); bwd 2.5x; fwd+bwd 3.5x")
  with open(args.json, "w") as f:
    json.dump(dict(meta=meta, results=records), f, indent=1)

  print(f"\n{format_table(records)}")
  notes = format_notes(records)
  if notes:
    print(f"\nmissing entries:\n{notes}")
  print(f"\n{len(configs)} configs in {meta['elapsed_s']:.0f} s; JSON written to {args.json}",
        flush=True)
  if args.plot:
    plot(records, args.plot, f"{dev.device_kind}, {args.dtype}, B*S={args.tokens}, "
         f"N*D={args.hidden}, jax {jax.__version__}")


if __name__ == "__main__":
  main()
