"""Benchmark mode for the convolutions (jax_dnn.config's `benchmark`), as
torch.backends.cudnn.benchmark is to PyTorch.

When a convolution primitive is lowered for CUDA with the mode on
(primitives.plan_for, on the operands that kernel call gets: after
vmap folded its axis, one device's shard), its problem is timed once on the
device and the fastest candidate runs. The candidates: every algorithm the
registry (ffi/conv/conv_plan.h) says takes the problem, and "xla", the
reference path (lax's convolution, which XLA runs on cuDNN). Under
`deterministic` only deterministic algorithms compete, and XLA does not.

Timing:
  - our algorithms: the extension's conv_benchmark (ffi/conv/conv_benchmark.h)
    allocates the operands outside XLA's memory pool, fills them with
    uniform random values in [-1, 1], and runs each algorithm through the
    handlers' launch path: 2 untimed runs, then the median of up to 10
    runs between CUDA events (fewer for slow candidates).
  - XLA: the primitive's reference, jitted on random operands of the same
    shapes on the first GPU, 2 untimed calls, then up to 10 calls back to
    back: wall time over calls after block_until_ready (it includes
    dispatch, a few microseconds a call, that the events leave out). It
    runs in a worker thread: JAX's trace state is thread-local, and this
    is called from inside a lowering rule.
A problem takes one compilation of XLA's convolution plus at most ~50 ms of
timed runs a candidate: well under a second.

Where timing fails (no GPU, out of memory -- XLA preallocates most of the
device's memory, and the operands must fit in the rest -- a CPU-only build),
the heuristic's choice runs, with one warning per process; a failed XLA
candidate alone is left out. Nothing raises into the user's program.

Cache: in memory, and on disk in a JSON file,
${JAX_DNN_CACHE_DIR:-${XDG_CACHE_HOME:-~/.cache}/jax_dnn}/conv_benchmark.json,
keyed by the device (its kind, SM count and compute capability), jax_dnn's
and jaxlib's versions and the problem (primitives.plan_key, the
deterministic setting and the fp32 precision). Each entry holds the chosen
candidate and the times of all of them. The next process reads the file and
times nothing. Writes replace the file atomically (a temporary file and
os.replace), merging what other processes wrote; a corrupt or unreadable
file is ignored and rewritten; concurrent processes at worst tune a problem
twice.

Progress: once the problems tuned in this process took more than a second
in all, each one tuned is printed to stderr (those before it at that point),
e.g.
  jax_dnn: tuned conv fwd bf16 N=128 56x56 64->64 3x3: implicit_gemm_128x64
  0.21 ms (xla 0.25 ms) [3 problems, 1.4 s]
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import json
import math
import os
import sys
import tempfile
import threading
import time
from typing import Any, Callable
import warnings

import jax
import jax.numpy as jnp
import jaxlib

from jax_dnn._src import extension
from jax_dnn._src import plans
from jax_dnn._src import version

XLA = "xla"
CACHE_FILE = "conv_benchmark.json"
_FORMAT = 1
_REPEATS = 10
_WARMUPS = 2
# Timed calls of XLA's candidate: at most this many milliseconds of them
# (as the kernels' budget, ffi/conv/conv_benchmark.h).
_XLA_BUDGET_MS = 50.0
_PROGRESS_AFTER_S = 1.0
_DTYPES = {"bfloat16": "bf16", "float16": "f16", "float32": "f32"}


def cache_dir() -> str:
  """${JAX_DNN_CACHE_DIR:-${XDG_CACHE_HOME:-~/.cache}/jax_dnn}, read now."""
  if os.environ.get("JAX_DNN_CACHE_DIR"):
    return os.environ["JAX_DNN_CACHE_DIR"]
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(base, "jax_dnn")


def cache_path() -> str:
  return os.path.join(cache_dir(), CACHE_FILE)


@dataclasses.dataclass(frozen=True)
class Result:
  """One problem's benchmark: the chosen candidate (an algorithm's name, or
  "xla") and its registry id (-1 for xla), and every timed candidate's
  median milliseconds (those that failed are absent)."""
  choice: str
  algorithm_id: int
  times_ms: dict

  def to_json(self) -> dict:
    return {"choice": self.choice, "id": self.algorithm_id, "times_ms": dict(self.times_ms)}

  @staticmethod
  def from_json(entry) -> Result | None:
    try:
      times = {str(k): float(v) for k, v in entry["times_ms"].items()}
      return Result(str(entry["choice"]), int(entry["id"]), times)
    except (KeyError, TypeError, ValueError, AttributeError):
      return None


# --- the device's measurements -----------------------------------------------------------


def _gpu():
  return jax.local_devices(backend="gpu")[0]


@functools.lru_cache(maxsize=None)
def device_key() -> str:
  """The device results are valid for: JAX's first GPU (the kind, e.g.
  "NVIDIA H100 80GB HBM3", and compute capability), with the SM count the
  plans see. Raises where there is no GPU."""
  dev = _gpu()
  sms = plans.current_device().sm_count
  return f"{dev.device_kind} sm_count={sms} cc={getattr(dev, 'compute_capability', '?')}"


def versions_key() -> str:
  return f"jax_dnn {version.__version__} jaxlib {jaxlib.__version__}"


def time_xla(reference, device=None) -> float:
  """Milliseconds a call of reference = (fn, operand specs) takes on
  `device` (default: the first GPU), jitted, in a worker thread."""
  fn, specs = reference

  def work():
    dev = device if device is not None else _gpu()
    keys = jax.random.split(jax.random.key(0), len(specs))
    with jax.default_device(dev):
      args = [jax.random.uniform(k, s.shape, jnp.float32, -1.0, 1.0).astype(s.dtype)
              for k, s in zip(keys, specs)]
      compiled = jax.jit(fn).lower(*args).compile()
      for _ in range(_WARMUPS - 1):
        jax.block_until_ready(compiled(*args))
      start = time.perf_counter()
      jax.block_until_ready(compiled(*args))
      once = (time.perf_counter() - start) * 1e3
      calls = int(min(max(_XLA_BUDGET_MS / max(once, 1e-3), 1), _REPEATS))
      start = time.perf_counter()
      out = None
      for _ in range(calls):
        out = compiled(*args)
      jax.block_until_ready(out)
      return (time.perf_counter() - start) * 1e3 / calls

  with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
    return pool.submit(work).result()


def measure_on_device(problem, algorithms, reference) -> dict:
  """{candidate: median ms} on the current device: each of `algorithms`
  (ConvAlgorithm, supported) by the extension's conv_benchmark, and XLA's
  (reference: (fn, operand specs), or None to leave it out). Raises where
  the kernels cannot be timed; a failed algorithm or XLA is left out."""
  ext = extension.module()
  if ext is None or not hasattr(ext, "conv_benchmark"):
    raise RuntimeError("the extension has no kernels to time (built without CUDA)")
  times, failures = {}, []
  got = ext.conv_benchmark(problem, [int(a.id) for a in algorithms], _REPEATS)
  for algorithm, value in zip(algorithms, got):
    if isinstance(value, float) and math.isfinite(value):
      times[algorithm.name] = value
    else:
      failures.append(str(value))
  if reference is not None:
    try:
      times[XLA] = time_xla(reference)
    except Exception as e:  # pylint: disable=broad-except
      failures.append(f"xla: {type(e).__name__}: {e}")
  if not times:
    raise RuntimeError("no candidate ran: " + "; ".join(failures))
  return times


# --- the tuner -----------------------------------------------------------------------------


def describe(key) -> str:
  """A problem (a plan_key) in a line: conv fwd bf16 N=128 56x56 64->64 3x3."""
  dims = lambda v: "x".join(str(d) for d in v[3 - key.rank:])
  text = (f"conv {key.op} {_DTYPES.get(key.dtype, key.dtype)} N={key.n} {dims(key.input)} "
          f"{key.c}->{key.k} {dims(key.window)}")
  if any(s != 1 for s in key.stride):
    text += f" stride {dims(key.stride)}"
  if any(d != 1 for d in key.dilation):
    text += f" dilation {dims(key.dilation)}"
  if key.groups != 1:
    text += f" groups {key.groups}"
  return text


class Tuner:
  """The benchmark's caches and its timing. measure(problem, algorithms,
  reference) -> {candidate: ms} (default: measure_on_device); path: the
  cache file (default: cache_path(), read at each use); device: the
  device key (default: device_key())."""

  def __init__(self, measure: Callable[..., dict] | None = None, path: str | None = None,
               device: Callable[[], str] | None = None):
    self._measure = measure or measure_on_device
    self._path = path
    self._device = device or device_key
    self._lock = threading.RLock()
    self._memory: dict[str, dict[str, Result]] = {}  # cache file -> key -> result
    self._failed: set[str] = set()  # keys whose timing failed: the heuristic's, silently
    self._warned: set[str] = set()
    self.tuned = 0  # problems timed in this process
    self.seconds = 0.0  # and the time that took
    self._pending: list[str] = []  # progress lines not printed yet

  def path(self) -> str:
    return self._path or cache_path()

  def key(self, problem_key, deterministic: bool, precision: str) -> str:
    """The cache's key (raises where the device is unknown)."""
    return (f"{self._device()} | {versions_key()} | {problem_key!r} "
            f"deterministic={bool(deterministic)} precision={precision}")

  # -- disk --

  def _read(self, path) -> dict[str, Result]:
    try:
      with open(path, encoding="utf-8") as f:
        data = json.load(f)
      entries = data["entries"] if data.get("format") == _FORMAT else {}
    except (OSError, ValueError, AttributeError, KeyError, TypeError):
      return {}
    out = {}
    for k, v in (entries.items() if isinstance(entries, dict) else ()):
      result = Result.from_json(v)
      if result is not None:
        out[k] = result
    return out

  def _write(self, path, key, result) -> None:
    """Adds one entry to the file: read, merged, replaced atomically."""
    try:
      entries = self._read(path)
      entries[key] = result
      os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
      fd, tmp = tempfile.mkstemp(prefix=".conv_benchmark.", dir=os.path.dirname(path) or ".")
      try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
          json.dump({"format": _FORMAT, "entries": {k: v.to_json() for k, v in entries.items()}},
                    f, indent=1, sort_keys=True)
        os.replace(tmp, path)
      except BaseException:
        os.unlink(tmp)
        raise
    except OSError as e:
      self._warn_once("write", f"jax_dnn: could not write the benchmark cache {path} ({e}); "
                      "results stay in memory")

  def _entries(self) -> dict[str, Result]:
    path = self.path()
    if path not in self._memory:
      self._memory[path] = self._read(path)
    return self._memory[path]

  # -- lookup and tuning --

  def lookup(self, problem_key, deterministic: bool, precision: str) -> Result | None:
    """A cached result (memory, then the file), timing nothing; None where
    there is none or the device is unknown."""
    with self._lock:
      try:
        key = self.key(problem_key, deterministic, precision)
      except Exception:  # pylint: disable=broad-except
        return None
      return self._entries().get(key)

  def choose(self, problem_key, problem, *, deterministic: bool, precision: str, algorithms,
             heuristic: Callable[[], Any], reference: Callable[[], Any]):
    """The algorithm (a ConvAlgorithm of `algorithms`) to run for the
    problem, or None for XLA's convolution: the fastest candidate, cached or
    timed now. algorithms: the registry's answers for the problem;
    heuristic(): the choice where timing fails; reference(): (fn, operand
    specs) of XLA's candidate."""
    candidates = [a for a in algorithms if a.supported and (a.deterministic or not deterministic)]
    if len(candidates) + (0 if deterministic else 1) <= 1:
      return candidates[0] if candidates else None  # nothing to choose from
    with self._lock:
      try:
        key = self.key(problem_key, deterministic, precision)
      except Exception as e:  # pylint: disable=broad-except
        return self._fall_back(None, problem_key, e, heuristic)
      names = {a.name: a for a in candidates}
      result = self._entries().get(key)
      if result is not None and (result.choice == XLA and not deterministic or
                                 result.choice in names and
                                 names[result.choice].id == result.algorithm_id):
        return names.get(result.choice)
      if key in self._failed:
        return heuristic()
      start = time.perf_counter()
      try:
        times = self._measure(problem, candidates, None if deterministic else reference())
        times = {n: float(t) for n, t in times.items()
                 if (n in names or n == XLA and not deterministic) and math.isfinite(float(t))}
        if not times:
          raise RuntimeError("no candidate could be timed")
      except Exception as e:  # pylint: disable=broad-except
        return self._fall_back(key, problem_key, e, heuristic)
      choice = min(times, key=times.get)
      result = Result(choice, names[choice].id if choice in names else -1, times)
      self._entries()[key] = result
      self._write(self.path(), key, result)
      self._progress(problem_key, result, time.perf_counter() - start)
      return names.get(choice)

  def _fall_back(self, key, problem_key, error, heuristic):
    if key is not None:
      self._failed.add(key)
    self._warn_once("timing", f"jax_dnn: benchmark mode could not time {describe(problem_key)} "
                    f"({type(error).__name__}: {error}); the heuristic's algorithms run where "
                    "timing fails (this warning is shown once)")
    return heuristic()

  def _warn_once(self, what, message):
    if what not in self._warned:
      self._warned.add(what)
      warnings.warn(message, RuntimeWarning, stacklevel=3)

  def _progress(self, problem_key, result, seconds):
    self.tuned += 1
    self.seconds += seconds
    others = ", ".join(f"{n} {t:.3g} ms" for n, t in sorted(result.times_ms.items(),
                                                            key=lambda item: item[1])
                       if n != result.choice)
    self._pending.append(
        f"jax_dnn: tuned {describe(problem_key)}: {result.choice} "
        f"{result.times_ms[result.choice]:.3g} ms" + (f" ({others})" if others else "") +
        f" [{self.tuned} problem{'s' if self.tuned > 1 else ''}, {self.seconds:.1f} s]")
    if self.seconds > _PROGRESS_AFTER_S:
      for line in self._pending:
        print(line, file=sys.stderr, flush=True)
      self._pending.clear()


TUNER = Tuner()
