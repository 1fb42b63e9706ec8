"""What every benchmark family shares: its declaration, the timing, the
measured ceilings, and the loop that runs a family and reports it.

Method, the same for every family:
- Modes. fwd: y = f(*args). bwd: the backward alone, as a training step runs
  it: each implementation's pullback (jax.vjp) applied to dy, its residuals
  computed before the timed calls and passed in as arguments. fwd+bwd: y and
  the gradients with respect to every argument, in one jitted call. A
  family may add dgrad and wgrad: the pullback with respect to the first
  (data) or the second (weights) argument alone, timed as bwd is.
- A timed call is one jitted program applying the mode to each of K input
  sets. Memory-bound families take K = ceil(1 GiB / the bytes of x), at least
  enough sets to cycle through more bytes than L2 holds, at most 32, so that
  the GPU sets the time and not the host's dispatch: with one application a
  call, ncu's 70 us softmax kernel timed as 80 us and XLA's 75 us one as 90 us.
  Compute-bound families take K = 1.
- Every implementation of a case and mode is compiled and warmed up (calls
  for at least `warmup_s`, so that the clocks have ramped up); then `rounds`
  rounds run each implementation in turn, `calls` back-to-back calls with one
  block_until_ready at the end (as many calls as fit `round_s`, within
  [min_calls, max_calls]). Time of one application: the median over the
  rounds, divided by K. Interleaving gives every implementation the same
  clock and temperature state: an H100's clocks drift by 10% and more over a
  run, which timing one implementation after the other put into the ratios.
- Rate: the case's bytes or FLOPs per application over that time; fraction:
  the rate over the ceiling measured in the same run (copy bandwidth or a
  bf16 matmul's rate). A compute-bound family's memory-bound cases (depthwise
  convolution) also give their bytes: their rows add GB/s and the fraction of
  the copy bandwidth. A family whose unit is a time (recurrent networks, whose
  cost is latency a step; whole training steps) reports that time as its
  rate, lower being faster, and measures no ceiling.
- Correctness, in the same run: each implementation's outputs for the first
  input set (those of its first call) against the family's reference
  implementation, as max |a - b| / (1 + max |b|) over every output array.
- A failure (cuDNN refusing a shape, XLA out of memory) is recorded with its
  reason and the run goes on.
- $JAX_DNN_BENCH_CASES, a regular expression, keeps the cases whose label it
  matches (re.search), e.g. "T131072" or "^gru": a long sweep split over runs.
"""

from __future__ import annotations

import dataclasses
import datetime
import gc
import importlib.metadata
import math
import os
import re
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

MODES = ("fwd", "bwd", "fwd+bwd")
CASES_ENV = "JAX_DNN_BENCH_CASES"  # a regular expression over case labels (module doc)
PARTIAL_MODES = {"dgrad": 0, "wgrad": 1}  # mode -> the one argument its pullback differentiates
UNIT_SCALE = {"GB/s": 1e9, "TFLOP/s": 1e12}  # unit -> bytes or FLOPs a second per unit
TIME_UNITS = {"ms": 1e-3}  # unit -> seconds per unit: the rate is the time itself


@dataclasses.dataclass(frozen=True)
class Settings:
  """How much a run moves and how long it times; the defaults are a GPU run's."""
  call_bytes: int = 1 << 30  # input bytes one timed call reads (memory-bound families)
  l2_bytes: int = 64 << 20  # cycle through more than L2 holds (50-60 MB on H100/H200)
  max_sets: int = 32  # input sets a call rotates through, at most (compile time)
  warmup_s: float = 0.3
  rounds: int = 5
  round_s: float = 0.25
  min_calls: int = 3
  max_calls: int = 20
  copy_bytes: int = 1 << 30  # array size of the copy-bandwidth ceiling
  matmul_size: int = 8192  # n of the n x n x n matmul ceiling


@dataclasses.dataclass(frozen=True)
class Case:
  """One problem of a family: an op at a shape and dtype, with its options."""
  op: str
  shape: tuple[int, ...]
  dtype: str
  label: str  # how tables and progress name it
  options: tuple[tuple[str, Any], ...] = ()  # e.g. (("causal", True),)
  modes: tuple[str, ...] = MODES

  def option(self, name: str) -> Any:
    return dict(self.options)[name]

  def fields(self) -> dict:
    return {"op": self.op, "shape": list(self.shape), "dtype": self.dtype, **dict(self.options)}


@dataclasses.dataclass
class Workload:
  """A case made concrete: its input sets and one function per implementation."""
  fns: dict[str, Callable | str]  # impl -> f(*args), every arg differentiated; or why it is skipped
  args: list[tuple]  # the input sets a timed call applies its mode to
  cotangents: list  # dy for each set, shaped like f's output
  work: dict[str, float]  # mode -> bytes moved (GB/s) or FLOPs done (TFLOP/s) by one application
  tolerance: float  # largest correctness error accepted
  bytes: dict[str, float] | None = None  # mode -> bytes moved, where GB/s matter too


@dataclasses.dataclass(frozen=True)
class Family:
  """What a family module declares (as FAMILY) to plug into the benchmark."""
  name: str
  unit: str  # a key of UNIT_SCALE or TIME_UNITS
  ceiling: str | None  # a key of CEILINGS, in the same unit; None for a time unit
  impls: tuple[str, ...]  # "ours" first, then the peers
  reference: tuple[str, ...]  # implementations checked against, the first that ran
  cases: Callable[[bool], list[Case]]  # quick -> the cases to run
  workload: Callable[[Case, Settings], Workload] | None  # None with a runner
  plot_point: Callable[[dict], tuple[str, float, str] | None]  # row -> (panel, x, variant)
  plot_x: str  # the plot's x-axis label
  bandwidth: bool = False  # some workloads give bytes: measure the copy ceiling too
  annotate: Callable[[dict], dict] | None = None  # row -> fields added to it (e.g. us a step)
  columns: tuple[tuple[str, str, str, str], ...] = ()  # table: (header, impl, row key, format)
  # Times whole programs rather than ops: run_family's signature, returns the rows.
  runner: Callable[..., list[dict]] | None = None


def input_sets(nbytes: int, settings: Settings) -> int:
  """K, the input sets a memory-bound call rotates through (see the module doc)."""
  need = max(settings.l2_bytes, settings.call_bytes) / nbytes
  return max(1, min(settings.max_sets, math.ceil(need)))


def tolerance(dtype) -> float:
  """Catches a wrong result, not a rounding difference (tests/ check precision):
  5e-2 for 16-bit dtypes, ~13 bf16 ulps of the largest output; 1e-3 for fp32."""
  return 1e-3 if jnp.dtype(dtype) == jnp.float32 else 5e-2


# Timing.


def _warm_up(fn, inputs, settings: Settings):
  """Compiles and warms up fn; returns (its first output, calls per round)."""
  first = fn(inputs)
  jax.block_until_ready(first)
  t0, calls = time.perf_counter(), 0
  while calls < 1 or time.perf_counter() - t0 < settings.warmup_s:
    jax.block_until_ready(fn(inputs))
    calls += 1
  per_call = (time.perf_counter() - t0) / calls
  fit = int(settings.round_s / max(per_call, 1e-9))
  return first, max(settings.min_calls, min(settings.max_calls, fit))


def _time_calls(fn, inputs, calls: int) -> float:
  """Seconds a call over `calls` back-to-back calls, synchronized once at the end."""
  t0 = time.perf_counter()
  for _ in range(calls):
    out = fn(inputs)
  jax.block_until_ready(out)
  return (time.perf_counter() - t0) / calls


def _batched(apply):
  """One jitted call applying `apply` to every input set of a list."""
  return jax.jit(lambda sets: [apply(*s) for s in sets])


def _programs(fn, mode: str):
  """(prepare, apply) for a mode: prepare(args, dy) gives a set's inputs to
  apply (untimed); apply(*inputs) is what a timed call runs for that set."""
  if mode == "fwd":
    return (lambda args, dy: tuple(args)), fn
  if mode == "bwd":
    # The pullback comes back from jit as a pytree whose leaves are the residuals.
    residuals = jax.jit(lambda *args: jax.vjp(fn, *args)[1])
    return (lambda args, dy: (residuals(*args), dy)), (lambda pullback, dy: pullback(dy))
  if mode == "fwd+bwd":
    def fwd_bwd(*args_dy):
      y, pullback = jax.vjp(fn, *args_dy[:-1])
      return y, pullback(args_dy[-1])
    return (lambda args, dy: (*args, dy)), fwd_bwd
  if mode in PARTIAL_MODES:
    i = PARTIAL_MODES[mode]

    def partial_vjp(*args):
      return jax.vjp(lambda a: fn(*args[:i], a, *args[i + 1:]), args[i])[1]
    residuals = jax.jit(partial_vjp)
    return (lambda args, dy: (residuals(*args), dy)), (lambda pullback, dy: pullback(dy))
  raise ValueError(f"unknown mode {mode!r}; modes are {MODES + tuple(PARTIAL_MODES)}")


def rate_of(unit: str, work: float | None, seconds: float | None) -> float | None:
  """One application's rate in `unit`: work / seconds, or for a time unit the time."""
  if not seconds:
    return None
  if unit in TIME_UNITS:
    return seconds / TIME_UNITS[unit]
  return work / seconds / UNIT_SCALE[unit]


def short_reason(e: Exception) -> str:
  lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
  return f"{type(e).__name__}: {lines[0][:160] if lines else ''}"


def _error(out, ref) -> float:
  """max |out - ref| / (1 + max |ref|) over every output array."""
  a, b = jax.tree.leaves(out), jax.tree.leaves(ref)
  if len(a) != len(b) or any(u.shape != v.shape for u, v in zip(a, b)):
    raise ValueError("outputs differ in structure from the reference's")
  err = 0.0
  for u, v in zip(a, b):
    u, v = u.astype(jnp.float32), v.astype(jnp.float32)
    err = max(err, float(jnp.max(jnp.abs(u - v))) / (1.0 + float(jnp.max(jnp.abs(v)))))
  return err


def run_mode(family: Family, case: Case, work: Workload, mode: str,
             settings: Settings, ceiling: float, copy: float | None = None) -> list[dict]:
  """Times every implementation of one case in one mode; one row each.
  `copy`: the copy bandwidth (GB/s), for a bandwidth family's rows."""
  timed, outputs, failures = {}, {}, {}
  for impl in family.impls:
    fn = work.fns.get(impl, "not run for this case")
    if isinstance(fn, str):
      failures[impl] = fn
      continue
    try:
      prepare, apply = _programs(fn, mode)
      inputs = [prepare(args, dy) for args, dy in zip(work.args, work.cotangents)]
      batched = _batched(apply)
      first, calls = _warm_up(batched, inputs, settings)
      outputs[impl] = first[0]
      del first
      timed[impl] = (batched, inputs, calls)
    except Exception as e:  # noqa: BLE001 - recorded; the run goes on
      failures[impl] = short_reason(e)
  samples = {impl: [] for impl in timed}
  for _ in range(settings.rounds):
    for impl in list(timed):
      fn, inputs, calls = timed[impl]
      try:
        samples[impl].append(_time_calls(fn, inputs, calls))
      except Exception as e:  # noqa: BLE001
        failures[impl] = short_reason(e)
        del timed[impl], samples[impl], outputs[impl]
  seconds = {impl: statistics.median(s) / len(work.args) for impl, s in samples.items()}
  calls = {impl: timed[impl][2] * settings.rounds * len(work.args) for impl in timed}
  del timed

  reference = next((r for r in family.reference if r in outputs), None)
  rows = []
  for impl in family.impls:
    error = None
    if impl in outputs and reference is not None and impl != reference:
      try:
        error = _error(outputs[impl], outputs[reference])
      except Exception as e:  # noqa: BLE001
        failures.setdefault(impl, short_reason(e))
    t = seconds.get(impl)
    rate = rate_of(family.unit, work.work.get(mode), t)
    rows.append(dict(
        case.fields(), case=case.label, mode=mode, impl=impl,
        ms=t * 1e3 if t else None, rate=rate, unit=family.unit,
        fraction=rate / ceiling if rate and ceiling else None,
        # this implementation's rate over each peer's (> 1: this one is faster)
        ratio={p: s / t for p, s in seconds.items() if p != impl} if t else {},
        error=error, reference=reference if error is not None else None,
        ok=error <= work.tolerance if error is not None else None,
        failure=failures.get(impl), applications=calls.get(impl, 0)))
    if family.bandwidth:
      gbps = work.bytes[mode] / t / 1e9 if t and work.bytes else None
      rows[-1].update(gbps=gbps, copy_fraction=gbps / copy if gbps and copy else None)
    if family.annotate is not None:
      rows[-1].update(family.annotate(rows[-1]))
  return rows


def run_family(family: Family, cases: list[Case], settings: Settings, ceiling: float,
               progress, copy: float | None = None) -> list[dict]:
  rows = []
  for case in cases:
    work = family.workload(case, settings)
    for mode in case.modes:
      progress.start(family.name, f"{case.label} {mode}")
      mode_rows = run_mode(family, case, work, mode, settings, ceiling, copy)
      progress.done(family.name, mode_rows)
      rows.extend(mode_rows)
    del work
    gc.collect()
    jax.clear_caches()  # compiled programs hold device memory
  return rows


# Ceilings: what the hardware reaches on the simplest kernels, measured in the same run.


def _time_alone(fn, inputs, settings: Settings) -> float:
  _, calls = _warm_up(fn, inputs, settings)
  return statistics.median(_time_calls(fn, inputs, calls) for _ in range(settings.rounds))


def copy_bandwidth(settings: Settings) -> float:
  """GB/s (bytes read + written) of the best plain streaming kernel (x * 2, -x)
  over `copy_bytes` of bf16 and of fp32."""
  best = 0.0
  for dtype in (jnp.bfloat16, jnp.float32):
    x = jax.random.normal(jax.random.key(0), (settings.copy_bytes // jnp.dtype(dtype).itemsize,),
                          dtype)
    for op in (lambda v: v * 2, lambda v: -v):
      t = _time_alone(_batched(op), [(x,)], settings)
      best = max(best, 2 * x.nbytes / t / 1e9)
    del x
  return best


def matmul_rate(settings: Settings) -> float:
  """TFLOP/s of a bf16 n x n by n x n matmul (jnp.dot), 2 n^3 FLOPs."""
  n = settings.matmul_size
  a, b = (jax.random.normal(k, (n, n), jnp.bfloat16) for k in jax.random.split(jax.random.key(0)))
  t = _time_alone(_batched(jnp.dot), [(a, b)], settings)
  return 2 * n**3 / t / 1e12


# name -> (unit, how it is measured, what it is)
CEILINGS = {
    "copy": ("GB/s", copy_bandwidth,
             lambda s: f"copy bandwidth: best of x * 2 and -x over {s.copy_bytes / 2**20:g} "
                       "MiB, bytes read + written"),
    "matmul": ("TFLOP/s", matmul_rate,
               lambda s: f"bf16 {s.matmul_size}^3 matmul (jnp.dot), 2 n^3 FLOPs"),
}


def measure_ceiling(name: str, settings: Settings) -> dict:
  unit, measure, what = CEILINGS[name]
  return dict(value=measure(settings), unit=unit, what=what(settings))


# The run.


def _version(package: str) -> str | None:
  try:
    return importlib.metadata.version(package)
  except importlib.metadata.PackageNotFoundError:
    return None


def _cudnn_version():
  try:  # private; only for the record
    from jax._src.lib import cuda_versions  # pylint: disable=g-import-not-at-top
    return cuda_versions.cudnn_get_version() if cuda_versions else None
  except Exception:  # noqa: BLE001
    return None


def environment(quick: bool, settings: Settings) -> dict:
  import jax_dnn  # pylint: disable=g-import-not-at-top
  device = jax.devices()[0]
  return dict(device=device.device_kind, platform=device.platform, jax=jax.__version__,
              jaxlib=_version("jaxlib"), jax_dnn=jax_dnn.__version__,
              kernels=bool(jax_dnn.has_cuda_kernels()), cudnn=_cudnn_version(),
              date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              quick=quick, settings=dataclasses.asdict(settings))


def run(names, *, quick: bool = False, out=None, settings: Settings = Settings(),
        cases: dict[str, list[Case]] | None = None, reporter=None) -> int:
  """Runs the named families on the default device: prints each one's table
  and writes `out`/<family>.json and .png (when `out` is given).

  `cases` replaces a family's own (tests run tiny ones on the CPU). Returns
  the exit status: 1 when one of ours failed or disagreed with the reference.
  """
  from jax_dnn import benchmark  # pylint: disable=g-import-not-at-top
  from jax_dnn.benchmark import report  # pylint: disable=g-import-not-at-top
  reporter = reporter or report.Reporter()
  families = [benchmark.load(name) for name in names]
  plan = [(f, list(cases[f.name]) if cases and f.name in cases else f.cases(quick))
          for f in families]
  if os.environ.get(CASES_ENV):
    pattern = re.compile(os.environ[CASES_ENV])
    plan = [(f, [c for c in cs if pattern.search(c.label)]) for f, cs in plan]
  env = environment(quick, settings)
  reporter.header(env)
  ceilings, bad, written = {}, [], []
  with reporter.progress([(f.name, sum(len(c.modes) for c in cs)) for f, cs in plan]) as progress:
    for family, family_cases in plan:
      for name in [c for c in (family.ceiling,) if c] + (["copy"] if family.bandwidth else []):
        if name not in ceilings:
          progress.note(f"measuring the {name} ceiling")
          ceilings[name] = measure_ceiling(name, settings)
          progress.note(f"{name} ceiling: {ceilings[name]['value']:.0f} {ceilings[name]['unit']}")
      runner = family.runner or run_family
      rows = runner(family, family_cases, settings,
                    ceilings[family.ceiling]["value"] if family.ceiling else None,
                    progress, ceilings["copy"]["value"] if family.bandwidth else None)
      result = dict(family=family.name, unit=family.unit, ceiling=family.ceiling, **env,
                    ceilings=dict(ceilings), rows=rows)
      progress.table(family, result)
      if out is not None:
        written += reporter.write(family, result, out)
      bad += [r for r in rows if r["impl"] == "ours" and (r["failure"] or r["ok"] is False)]
  reporter.summary(bad, written)
  return 1 if bad else 0
