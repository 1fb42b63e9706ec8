"""Whole models: one training step (forward, backward, optimizer update) of
each program in examples/, with jax_dnn's layers and with their Flax/XLA
namesakes, on one device and on every visible device, in ms a step.

Each example exposes `make_step(backend, size, *, global_batch, mesh, ...)
-> (step, state, batch)` (the examples' contract; backend "jax_dnn" is
"ours" here, "xla" the plain Flax/JAX program). An example whose BACKENDS
tuple lists "cudnn" (the LSTM LM: its LSTM layers as
jax.experimental.rnn.lstm, fp32) is timed with that backend too. A model is timed as a user
trains it: `state, loss = step(state, batch)` back to back, each step on the
state the previous one returned; the first step compiles (and tunes), steps
for `warmup_s` warm up, then `rounds` rounds of as many steps as fit
`round_s` (within [min_calls, max_calls]), each round synchronized once at
its end; the step time is the median over the rounds. The two backends run
one after the other (not interleaved, as the op families are), so that only
one model's state and buffers occupy the devices at a time; a step is
hundreds of ms, long enough that clock drift within a round does not count.

Scaling is weak: at n devices the global batch is the per-device batch times
n (a 1-D mesh with axis "data", the batch split over it, parameters
replicated); one device runs with mesh=None, the program a user runs on one
GPU. Scaling efficiency = t(first count) / t(n): 1.0 when n devices take a
step n times larger in the same time.

Correctness in the same run: both backends build their model and batch from
the same seed, so the first step's loss (the loss at the initial parameters)
must agree: error = |loss_ours - loss_xla| / (1 + |loss_xla|).

Selection, by environment (the CLI's flags are the op families'):
  JAX_DNN_BENCH_MODELS       comma-separated names of MODELS (default: all)
  JAX_DNN_BENCH_MODEL_SIZE   tiny | small | realistic (default: realistic)
  JAX_DNN_BENCH_DEVICES      device counts, e.g. "1,2,4" (default: 1 and all)
  JAX_DNN_EXAMPLES           the examples directory (default: examples/ beside
                             the jax_dnn package in a source checkout; never
                             one found from the current directory, whose
                             programs this would run unasked)
The sweep runs every model at its size's batch, and the CNN once more at 64
images a device (its weak scaling over the device counts). --quick: the CNN
at 64 images a device and the Transformer.
"""

from __future__ import annotations

import gc
import importlib.util
import math
import os
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jax_dnn.benchmark import harness

# name -> (file in examples/, what a step's batch counts)
MODELS = {
    "cnn": ("train_cnn.py", "images"),
    "unet": ("train_unet.py", "images"),
    "lstm_lm": ("train_lstm_lm.py", "tokens"),
    "transformer": ("train_transformer.py", "tokens"),
}
# (name, batch a device; None: the size's own) of the sweep and of --quick.
FULL = tuple((name, None) for name in MODELS) + (("cnn", 64),)
QUICK = (("cnn", 64), ("transformer", None))
BACKENDS = {"ours": "jax_dnn", "xla": "xla", "cudnn": "cudnn"}  # impl -> make_step's backend
DEFAULT_BACKENDS = ("jax_dnn", "xla")  # an example without a BACKENDS tuple
SIZES = ("tiny", "small", "realistic")
ENV_MODELS, ENV_SIZE = "JAX_DNN_BENCH_MODELS", "JAX_DNN_BENCH_MODEL_SIZE"
ENV_DEVICES, ENV_EXAMPLES = "JAX_DNN_BENCH_DEVICES", "JAX_DNN_EXAMPLES"
CHECKOUT = Path(__file__).resolve().parents[2] / "examples"  # in a source checkout


# Which models, sizes and device counts.


def selected(quick: bool, environ=None) -> list[tuple[str, int | None]]:
  """(name, batch a device; None: the size's own) pairs, from --quick and
  JAX_DNN_BENCH_MODELS (in its order; a name the selection lacks runs at its
  size's batch). Raises ValueError naming an unknown model."""
  environ = os.environ if environ is None else environ
  names = [n.strip() for n in environ.get(ENV_MODELS, "").split(",") if n.strip()]
  unknown = [n for n in names if n not in MODELS]
  if unknown:
    raise ValueError(f"{ENV_MODELS}: unknown model{'s' if len(unknown) > 1 else ''} "
                     f"{', '.join(map(repr, unknown))}; choose from {', '.join(MODELS)}")
  base = QUICK if quick else FULL
  if not names:
    return list(base)
  return [pair for n in names for pair in ([p for p in base if p[0] == n] or [(n, None)])]


def model_size(environ=None) -> str:
  environ = os.environ if environ is None else environ
  size = environ.get(ENV_SIZE, "realistic")
  if size not in SIZES:
    raise ValueError(f"{ENV_SIZE}={size!r}; choose from {', '.join(SIZES)}")
  return size


def device_counts(visible: int, environ=None) -> tuple[int, ...]:
  """JAX_DNN_BENCH_DEVICES's counts (increasing, each at most `visible`), or 1 and all."""
  environ = os.environ if environ is None else environ
  text = environ.get(ENV_DEVICES, "").strip()
  if not text:
    return (1, visible) if visible > 1 else (1,)
  try:
    counts = sorted({int(n) for n in text.split(",") if n.strip()})
  except ValueError:
    counts = []
  if not counts or counts[0] < 1 or counts[-1] > visible:
    raise ValueError(f"{ENV_DEVICES}={text!r}: comma-separated device counts from 1 to "
                     f"{visible} (the devices visible)")
  return tuple(counts)


def mode_name(devices: int) -> str:
  return f"{devices} device{'s' if devices > 1 else ''}"


def cases(quick: bool) -> list[harness.Case]:
  """One case per model; its modes are the device counts."""
  size, counts = model_size(), device_counts(len(jax.devices()))
  return [harness.Case(op=name, shape=(batch or 0,), dtype="bfloat16",
                       label=(f"{name} {size} ({MODELS[name][1]})" if batch is None else
                              f"{name} {size}, {batch} {MODELS[name][1]} a device"),
                       options=(("file", MODELS[name][0]), ("size", size), ("batch", batch),
                                ("devices", counts)),
                       modes=tuple(mode_name(n) for n in counts))
          for name, batch in selected(quick)]


# Finding and loading the examples.


def _has_examples(directory: Path) -> bool:
  return directory.is_dir() and any((directory / f).is_file() for f, _ in MODELS.values())


def find_examples(environ=None) -> tuple[Path | None, str]:
  """(the examples directory, how it was found) or (None, why none was)."""
  environ = os.environ if environ is None else environ
  explicit = environ.get(ENV_EXAMPLES)
  if explicit:
    path = Path(explicit)
    if path.is_dir():
      return path, f"{ENV_EXAMPLES}={explicit}"
    return None, f"{ENV_EXAMPLES}={explicit} is not a directory"
  if _has_examples(CHECKOUT):
    return CHECKOUT, "beside the jax_dnn package"
  files = ", ".join(f for f, _ in MODELS.values())
  return None, (f"no examples/ directory with {files} beside the jax_dnn package (an "
                f"installed jax_dnn has none): set {ENV_EXAMPLES}=DIR, e.g. a source "
                f"checkout's examples/")


def load_example(path: Path):
  """The example module at `path`, or a string saying why it cannot be timed."""
  if not path.is_file():
    return f"{path} does not exist"
  name = f"_jax_dnn_example_{path.stem}"
  spec = importlib.util.spec_from_file_location(name, path)
  module = importlib.util.module_from_spec(spec)
  sys.modules[name] = module  # dataclasses and pickling look a module up by name
  try:
    spec.loader.exec_module(module)
  except Exception as e:  # noqa: BLE001 - reported; the other models still run
    del sys.modules[name]
    return f"importing {path} failed: {harness.short_reason(e)}"
  if not callable(getattr(module, "make_step", None)):
    return f"{path} has no make_step(backend, size, *, global_batch, mesh) to time"
  return module


# A step's items and the timing.


def batch_size(batch) -> int:
  """The leading dimension of the batch's arrays."""
  return next(leaf.shape[0] for leaf in jax.tree.leaves(batch) if leaf.ndim)


def items_per_step(batch, item: str) -> int:
  """Images (the batch size) or tokens (B x T of the first integer array of
  rank 2 or more: the token ids, padding included) in one step's batch."""
  if item == "tokens":
    for leaf in jax.tree.leaves(batch):
      if leaf.ndim >= 2 and jnp.issubdtype(leaf.dtype, jnp.integer):
        return math.prod(leaf.shape[:2])
  return batch_size(batch)


def _mesh(devices: int):
  if devices == 1:
    return None
  return jax.sharding.Mesh(np.array(jax.devices()[:devices]), ("data",))


def time_step(step, state, batch, settings: harness.Settings):
  """(seconds a step, steps timed, first loss, last loss, state) of `step` (module doc)."""
  state, loss = step(state, batch)
  jax.block_until_ready((state, loss))
  first = float(loss)
  t0, calls = time.perf_counter(), 0
  while calls < 1 or time.perf_counter() - t0 < settings.warmup_s:
    state, loss = step(state, batch)
    jax.block_until_ready((state, loss))
    calls += 1
  fit = int(settings.round_s / max((time.perf_counter() - t0) / calls, 1e-9))
  calls = max(settings.min_calls, min(settings.max_calls, fit))
  samples = []
  for _ in range(settings.rounds):
    t0 = time.perf_counter()
    for _ in range(calls):
      state, loss = step(state, batch)
    jax.block_until_ready((state, loss))
    samples.append((time.perf_counter() - t0) / calls)
  return statistics.median(samples), calls * settings.rounds, first, float(loss), state


def loss_tolerance(dtype) -> float:
  """The first losses of the two backends: bf16 compute rounds each layer's
  output to 8 bits; fp32 runs TF32 matmuls on GPUs."""
  return 5e-2 if jnp.dtype(dtype) != jnp.float32 else 1e-2


def run_devices(family: harness.Family, case: harness.Case, module, devices: int,
                global_batch: int | None, settings: harness.Settings) -> list[dict]:
  """Each backend's step of one model on `devices` devices; one row each."""
  item = MODELS[case.op][1]
  offered = getattr(module, "BACKENDS", DEFAULT_BACKENDS)
  impls = [impl for impl in family.impls if BACKENDS[impl] in offered]
  measured, failures = {}, {}
  for impl in impls:
    try:
      step, state, batch = module.make_step(BACKENDS[impl], case.option("size"),
                                            global_batch=global_batch, mesh=_mesh(devices),
                                            seed=0)
      seconds, steps, first, last, state = time_step(step, state, batch, settings)
      if not math.isfinite(last):
        failures[impl] = f"the loss is {last} after {steps} steps"
      measured[impl] = dict(seconds=seconds, steps=steps, first=first, last=last,
                            batch=batch_size(batch), items=items_per_step(batch, item))
      del step, state, batch
    except Exception as e:  # noqa: BLE001 - recorded; the run goes on
      failures[impl] = harness.short_reason(e)
    gc.collect()
    jax.clear_caches()  # compiled steps hold device memory
  tolerance = loss_tolerance(case.dtype)
  reference = "xla" if "xla" in measured else None
  rows = []
  for impl in impls:
    m = measured.get(impl)
    t = m["seconds"] if m else None
    error = None
    if m and reference and impl != reference:
      ref = measured[reference]["first"]
      error = abs(m["first"] - ref) / (1.0 + abs(ref))
    rows.append(dict(
        case.fields(), case=case.label, mode=mode_name(devices), impl=impl,
        ms=t * 1e3 if t else None, rate=harness.rate_of(family.unit, None, t),
        unit=family.unit, fraction=None,
        ratio={p: v["seconds"] / t for p, v in measured.items() if p != impl} if t else {},
        error=error, reference=reference if error is not None else None,
        ok=error <= tolerance if error is not None else None,
        failure=failures.get(impl), applications=m["steps"] if m else 0,
        devices=devices, global_batch=m["batch"] if m else global_batch, item=item,
        items=m["items"] if m else None, throughput=m["items"] / t if t else None,
        efficiency=None, loss_first=m["first"] if m else None,
        loss_last=m["last"] if m else None))
  return rows


def run_models(family: harness.Family, cases_: list[harness.Case], settings: harness.Settings,
               ceiling=None, progress=None, copy=None) -> list[dict]:
  """The family's runner (harness.Family.runner): every model at every device count."""
  del ceiling, copy  # a time: no ceiling
  directory, how = find_examples()
  if directory is None:
    progress.note(f"models: {how}; nothing to time")
    return []
  progress.note(f"models: examples from {directory} ({how})")
  rows = []
  for case in cases_:
    module = load_example(directory / case.option("file"))
    if isinstance(module, str):
      progress.note(f"models: skipping {case.op}: {module}")
      for mode in case.modes:  # the progress counts every mode
        progress.start(family.name, f"{case.label} {mode}")
        progress.done(family.name, [])
      continue
    counts = case.option("devices")
    per_device, base = case.option("batch"), {}
    for devices, mode in zip(counts, case.modes):
      progress.start(family.name, f"{case.label} {mode}")
      # The first count runs the given batch a device (or the size's own);
      # later counts scale that batch with the devices (weak scaling).
      global_batch = None if per_device is None else per_device * devices
      if devices != counts[0]:
        known = [r["global_batch"] for r in base.values() if r["global_batch"]]
        if per_device is None and known:
          global_batch = known[0] // counts[0] * devices
      mode_rows = run_devices(family, case, module, devices, global_batch, settings)
      for r in mode_rows:
        if devices == counts[0]:
          base[r["impl"]] = r
        elif r["ms"] and base.get(r["impl"], {}).get("ms"):
          r["efficiency"] = base[r["impl"]]["ms"] / r["ms"]
      progress.done(family.name, mode_rows)
      rows.extend(mode_rows)
  return rows


def plot_point(row: dict):
  """Panel per model; x = devices. Weak scaling: a flat line is perfect."""
  return row["case"], row["devices"], ""


FAMILY = harness.Family(
    name="models", unit="ms", ceiling=None, impls=("ours", "xla", "cudnn"), reference=("xla",),
    cases=cases, workload=None, plot_point=plot_point, plot_x="devices (batch a device fixed)",
    runner=run_models,
    columns=(("global batch", "ours", "global_batch", "d"),
             ("ours items/s", "ours", "throughput", ",.0f"),
             ("xla items/s", "xla", "throughput", ",.0f"),
             ("ours scaling", "ours", "efficiency", ".0%"),
             ("xla scaling", "xla", "efficiency", ".0%")))
