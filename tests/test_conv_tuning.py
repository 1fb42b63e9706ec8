"""Benchmark mode for the convolutions (jax_dnn/_src/conv/tuning.py): the
setting and its environment variable, the choice among timed candidates
(a stand-in timing function on the CPU), the caches in memory and on disk,
the fall-back to the heuristic, the progress lines, conv_algorithms'
report; on a GPU, a program tuned on the device."""

import ast
import json
import os
import subprocess
import sys
import types

import jax
from jax import lax
from jax.interpreters import mlir
import jax.numpy as jnp
import numpy as np
import pytest

import jax_dnn
from op_cases import randn
from jax_dnn._src.conv import api as conv_lib
from jax_dnn._src.conv import primitives as conv_primitives
from jax_dnn._src.conv import tuning as conv_tuning
from jax_dnn._src import extension
from jax_dnn._src import plans

pytestmark = pytest.mark.skipif(not plans.has_conv_plans(),
                                reason="the extension has no convolution plans")

DEVICE = "NVIDIA Test GPU sm_count=132 cc=9.0"
# pylint: disable=protected-access
_plan_for = conv_primitives.plan_for
_primitive_calls = conv_lib._primitive_calls
_ffi_params = conv_primitives._ffi_params
_reference_call = conv_primitives._reference_call
# pylint: enable=protected-access


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
  """Every test's cache file in a temporary directory, never the user's."""
  monkeypatch.setenv("JAX_DNN_CACHE_DIR", str(tmp_path))
  return tmp_path


@pytest.fixture
def restore():
  saved = jax_dnn.config.benchmark, jax_dnn.config.deterministic
  yield
  jax_dnn.config.update("benchmark", saved[0])
  jax_dnn.config.update("deterministic", saved[1])


class Stopwatch:
  """A stand-in measure(): the given times, counting its calls and what it got."""

  def __init__(self, times, seconds=0.0, clock=None):
    self.times, self.seconds, self.clock = times, seconds, clock
    self.calls = []

  def __call__(self, problem, algorithms, reference):
    self.calls.append(([a.name for a in algorithms], reference))
    if self.clock is not None:
      self.clock.now += self.seconds
    if isinstance(self.times, Exception):
      raise self.times
    return dict(self.times)


def tuner(measure, device=DEVICE, path=None):
  return conv_tuning.Tuner(measure=measure, device=lambda: device, path=path)


def key_of(op="fwd", n=8, c=64, k=64, hw=16, dtype="bfloat16"):
  """A plan_key: a 2D 3x3 SAME convolution."""
  return conv_primitives.ConvKey(op=op, dtype=dtype, n=n, c=c, k=k, groups=1, input=(1, hw, hw),
                                 window=(1, 3, 3), output=(1, hw, hw), stride=(1, 1, 1),
                                 dilation=(1, 1, 1), pad_lo=(0, 1, 1), pad_hi=(0, 1, 1), rank=2)


def choose(t, key, *, deterministic=False, algorithms=None, heuristic="heuristic's"):
  problem = conv_primitives.problem_of(key)
  algorithms = plans.conv_algorithms(problem) if algorithms is None else algorithms
  return t.choose(key, problem, deterministic=deterministic, precision="default",
                  algorithms=algorithms, heuristic=lambda: heuristic,
                  reference=lambda: "the reference")


def fake_algorithm(id_, name, deterministic=True, supported=True):
  return types.SimpleNamespace(id=id_, name=name, deterministic=deterministic,
                               supported=supported)


# --- the setting ---------------------------------------------------------------------------


def test_setting(restore):
  assert jax_dnn.config.benchmark is False
  jax_dnn.config.update("benchmark", True)
  assert jax_dnn.config.benchmark is True
  assert "benchmark=True" in repr(jax_dnn.config)
  with pytest.raises(TypeError, match="benchmark must be a bool"):
    jax_dnn.config.update("benchmark", "yes")


@pytest.mark.parametrize("value, want", [("1", "True"), ("on", "True"), ("0", "False")])
def test_environment_variable(value, want):
  env = dict(os.environ, JAX_DNN_BENCHMARK=value)
  out = subprocess.run([sys.executable, "-c", "import jax_dnn; print(jax_dnn.config.benchmark)"],
                       capture_output=True, text=True, env=env)
  assert out.returncode == 0, out.stderr
  assert out.stdout.strip() == want


def test_setting_reaches_every_primitive(restore):
  """Read at trace time, a static param of forward, dgrad and wgrad."""
  x, w = randn(1, (2, 6, 6, 8), jnp.float32), randn(2, (3, 3, 8, 8), jnp.float32)
  grad = lambda: jax.grad(lambda x, w: jnp.sum(jax_dnn.conv(x, w) ** 2), (0, 1))
  assert "benchmark=True" not in str(jax.make_jaxpr(grad())(x, w))
  jax_dnn.config.update("benchmark", True)
  text = str(jax.make_jaxpr(grad())(x, w))
  assert text.count("benchmark=True") == 3 and "benchmark=False" not in text
  # The reference path (here, on the CPU) computes the same.
  np.testing.assert_allclose(grad()(x, w)[1], jax.grad(
      lambda x, w: jnp.sum(lax.conv_general_dilated(
          x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"),
          precision=lax.Precision.HIGHEST) ** 2), (0, 1))(x, w)[1], rtol=1e-4, atol=1e-4)


# --- choosing ------------------------------------------------------------------------------


def test_fastest_algorithm_wins_and_is_cached_in_memory():
  watch = Stopwatch({"implicit_gemm_128x128": 0.30, "implicit_gemm_128x64": 0.21, "xla": 0.25})
  t = tuner(watch)
  got = choose(t, key_of())
  assert got.name == "implicit_gemm_128x64" and got.id == 1
  # Every supported algorithm, and XLA's reference, were timed.
  assert watch.calls == [(["implicit_gemm_128x128", "implicit_gemm_128x64"], "the reference")]
  assert choose(t, key_of()).name == "implicit_gemm_128x64"
  assert len(watch.calls) == 1  # the second time, from memory
  choose(t, key_of(n=16))
  assert len(watch.calls) == 2  # another problem: timed


def test_xla_wins_runs_the_reference():
  t = tuner(Stopwatch({"implicit_gemm_128x128": 0.30, "implicit_gemm_128x64": 0.21, "xla": 0.2}))
  assert choose(t, key_of()) is None


def test_deterministic_times_deterministic_algorithms_only():
  algorithms = [fake_algorithm(0, "fixed_order"), fake_algorithm(5, "atomics", False),
                fake_algorithm(6, "fixed_order_b"), fake_algorithm(7, "none", supported=False)]
  times = {"fixed_order": 0.5, "atomics": 0.1, "fixed_order_b": 0.4, "xla": 0.05}
  watch = Stopwatch(times)
  t = tuner(watch)
  assert choose(t, key_of(), deterministic=True, algorithms=algorithms).name == "fixed_order_b"
  assert watch.calls == [(["fixed_order", "fixed_order_b"], None)]  # no XLA candidate
  # Not deterministic: every supported one, and XLA, which wins here.
  assert choose(t, key_of(), algorithms=algorithms) is None
  assert watch.calls[1] == (["fixed_order", "atomics", "fixed_order_b"], "the reference")


def test_nothing_to_choose_times_nothing():
  watch = Stopwatch({})
  t = tuner(watch)
  one = [fake_algorithm(0, "only"), fake_algorithm(5, "racy", False)]
  assert choose(t, key_of(), deterministic=True, algorithms=one).name == "only"
  assert choose(t, key_of(), algorithms=[fake_algorithm(0, "x", supported=False)]) is None
  assert watch.calls == []


# --- the cache file ------------------------------------------------------------------------


def test_file_is_written_and_read_by_a_fresh_process(cache_dir):
  times = {"implicit_gemm_128x128": 0.30, "implicit_gemm_128x64": 0.21, "xla": 0.25}
  choose(tuner(Stopwatch(times)), key_of())
  path = cache_dir / conv_tuning.CACHE_FILE
  entries = json.loads(path.read_text())["entries"]
  (key, entry), = entries.items()
  assert entry == {"choice": "implicit_gemm_128x64", "id": 1, "times_ms": times}
  # The key names the device, the versions and the problem.
  assert DEVICE in key and f"jax_dnn {jax_dnn.__version__}" in key
  assert "jaxlib " in key and repr(key_of()) in key and "deterministic=False" in key
  # A fresh cache (as in the next process) reads it and times nothing.
  never = Stopwatch(AssertionError("timed a cached problem"))
  fresh = tuner(never)
  assert choose(fresh, key_of()).name == "implicit_gemm_128x64"
  assert never.calls == []
  # Deterministic is another entry.
  choose(tuner(Stopwatch(times)), key_of(), deterministic=True)
  entries = json.loads(path.read_text())["entries"]
  assert len(entries) == 2 and any("deterministic=True" in k for k in entries)


def test_entries_accumulate_and_no_temporary_files_stay(cache_dir):
  times = {"implicit_gemm_128x128": 0.30, "implicit_gemm_128x64": 0.21, "xla": 0.25}
  choose(tuner(Stopwatch(times)), key_of())
  choose(tuner(Stopwatch(times)), key_of(n=4))  # another process: merges
  choose(tuner(Stopwatch(times)), key_of(op="dgrad"))
  assert len(json.loads((cache_dir / conv_tuning.CACHE_FILE).read_text())["entries"]) == 3
  assert os.listdir(cache_dir) == [conv_tuning.CACHE_FILE]


@pytest.mark.parametrize("content", ["{not json", "[]", '{"format": 1, "entries": 3}',
                                     '{"format": 1, "entries": {"k": {"choice": 1}}}'])
def test_corrupt_file_is_ignored_and_rewritten(cache_dir, content):
  path = cache_dir / conv_tuning.CACHE_FILE
  path.write_text(content)
  watch = Stopwatch({"implicit_gemm_128x128": 0.1, "implicit_gemm_128x64": 0.2, "xla": 0.3})
  assert choose(tuner(watch), key_of()).name == "implicit_gemm_128x128"
  assert len(watch.calls) == 1
  assert len(json.loads(path.read_text())["entries"]) == 1


def test_key_includes_device_and_versions(monkeypatch):
  times = {"implicit_gemm_128x128": 0.30, "implicit_gemm_128x64": 0.21, "xla": 0.25}
  choose(tuner(Stopwatch(times)), key_of())
  other_gpu = Stopwatch(times)
  choose(tuner(other_gpu, device="NVIDIA Other sm_count=114 cc=9.0"), key_of())
  assert len(other_gpu.calls) == 1
  monkeypatch.setattr(conv_tuning, "versions_key", lambda: "jax_dnn 9.9 jaxlib 9.9")
  other_version = Stopwatch(times)
  choose(tuner(other_version), key_of())
  assert len(other_version.calls) == 1


def test_a_cached_choice_no_longer_supported_is_timed_again():
  choose(tuner(Stopwatch({"implicit_gemm_128x128": 0.1, "implicit_gemm_128x64": 0.2})),
         key_of())
  watch = Stopwatch({"implicit_gemm_128x64": 0.2, "xla": 0.3})
  gone = [fake_algorithm(0, "implicit_gemm_128x128", supported=False),
          fake_algorithm(1, "implicit_gemm_128x64")]
  assert choose(tuner(watch), key_of(), algorithms=gone).name == "implicit_gemm_128x64"
  assert len(watch.calls) == 1


def test_default_path(monkeypatch, tmp_path):
  monkeypatch.delenv("JAX_DNN_CACHE_DIR")
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
  assert conv_tuning.cache_path() == str(tmp_path / "xdg" / "jax_dnn" / "conv_benchmark.json")
  monkeypatch.delenv("XDG_CACHE_HOME")
  monkeypatch.setenv("HOME", str(tmp_path / "home"))
  assert conv_tuning.cache_path() == str(tmp_path / "home" / ".cache" / "jax_dnn" /
                                         "conv_benchmark.json")


def test_unwritable_cache_keeps_results_in_memory(monkeypatch, tmp_path):
  blocker = tmp_path / "a_file"
  blocker.write_text("")
  monkeypatch.setenv("JAX_DNN_CACHE_DIR", str(blocker / "sub"))  # below a file: cannot exist
  watch = Stopwatch({"implicit_gemm_128x128": 0.1, "implicit_gemm_128x64": 0.2})
  t = tuner(watch)
  with pytest.warns(RuntimeWarning, match="could not write the benchmark cache"):
    assert choose(t, key_of()).name == "implicit_gemm_128x128"
  assert choose(t, key_of()).name == "implicit_gemm_128x128"
  assert len(watch.calls) == 1


# --- failures ------------------------------------------------------------------------------


def test_failure_falls_back_to_the_heuristic_with_one_warning(recwarn):
  watch = Stopwatch(RuntimeError("conv_benchmark: allocating 123 bytes: out of memory"))
  t = tuner(watch)
  assert choose(t, key_of(), heuristic="plan") == "plan"
  assert choose(t, key_of(), heuristic="plan") == "plan"
  assert choose(t, key_of(n=3), heuristic="plan") == "plan"
  warned = [w for w in recwarn if issubclass(w.category, RuntimeWarning)]
  assert len(warned) == 1 and "out of memory" in str(warned[0].message)
  assert "conv fwd bf16 N=8 16x16 64->64 3x3" in str(warned[0].message)
  assert len(watch.calls) == 2  # a failed problem is not timed again in this process
  assert not os.path.exists(conv_tuning.cache_path())


def test_no_finite_time_falls_back():
  t = tuner(Stopwatch({"implicit_gemm_128x128": float("nan"), "unknown": 0.1}))
  with pytest.warns(RuntimeWarning, match="no candidate could be timed"):
    assert choose(t, key_of(), heuristic="plan") == "plan"


def test_unknown_device_falls_back():
  def no_gpu():
    raise RuntimeError("Unknown backend: 'gpu' requested")

  t = conv_tuning.Tuner(measure=Stopwatch({}), device=no_gpu)
  with pytest.warns(RuntimeWarning, match="Unknown backend"):
    assert choose(t, key_of(), heuristic="plan") == "plan"
  assert t.lookup(key_of(), False, "default") is None


@pytest.mark.skipif(hasattr(extension.module(), "conv_benchmark"),
                    reason="the extension has its kernels (a CUDA build)")
def test_cpu_only_build_falls_back():
  """The default measure in a build without kernels: the heuristic, warned."""
  t = conv_tuning.Tuner(device=lambda: DEVICE)
  with pytest.warns(RuntimeWarning, match="no kernels to time"):
    assert choose(t, key_of(), heuristic="plan") == "plan"


# --- progress ------------------------------------------------------------------------------


def test_progress_lines_after_a_second(monkeypatch, capsys):
  clock = types.SimpleNamespace(now=0.0)
  monkeypatch.setattr(conv_tuning, "time", types.SimpleNamespace(perf_counter=lambda: clock.now))
  times = {"implicit_gemm_128x128": 0.30, "implicit_gemm_128x64": 0.21, "xla": 0.25}
  t = tuner(Stopwatch(times, seconds=0.4, clock=clock))
  choose(t, key_of())
  choose(t, key_of(n=16))
  assert capsys.readouterr().err == ""  # 0.8 s: quiet
  choose(t, key_of(n=128, hw=56))  # 1.2 s: the lines so far, then one per problem
  lines = capsys.readouterr().err.splitlines()
  assert len(lines) == 3
  assert lines[0] == ("jax_dnn: tuned conv fwd bf16 N=8 16x16 64->64 3x3: implicit_gemm_128x64 "
                      "0.21 ms (xla 0.25 ms, implicit_gemm_128x128 0.3 ms) [1 problem, 0.4 s]")
  assert lines[2].startswith("jax_dnn: tuned conv fwd bf16 N=128 56x56 64->64 3x3: ")
  assert lines[2].endswith("[3 problems, 1.2 s]")
  choose(t, key_of(op="wgrad"))
  assert capsys.readouterr().err.startswith("jax_dnn: tuned conv wgrad bf16")
  choose(t, key_of(op="wgrad"))  # cached: nothing new
  assert capsys.readouterr().err == ""


def test_describe():
  key = conv_primitives.ConvKey(op="fwd", dtype="float32", n=4, c=6, k=8, groups=2,
                                input=(5, 7, 9), window=(3, 3, 3), output=(3, 4, 9),
                                stride=(1, 2, 1), dilation=(2, 1, 1), pad_lo=(0, 1, 1),
                                pad_hi=(0, 1, 1), rank=3)
  assert conv_tuning.describe(key) == ("conv fwd f32 N=4 5x7x9 6->8 3x3x3 stride 1x2x1 "
                                       "dilation 2x1x1 groups 2")


# --- through the primitives ------------------------------------------------------------------


def _calls(fn, *args):
  """The conv primitives' calls of fn(*args), traced anew (a traced function
  keeps the settings it was traced with)."""
  fresh = lambda *a: fn(*a)
  return _primitive_calls(jax.make_jaxpr(fresh)(*args).jaxpr, [])


@pytest.fixture
def fake_tuner(monkeypatch):
  watch = Stopwatch({"implicit_gemm_128x128": 0.30, "implicit_gemm_128x64": 0.5, "xla": 0.4})
  t = tuner(watch)
  monkeypatch.setattr(conv_tuning, "TUNER", t)
  return watch


def test_plan_for_asks_the_tuner_in_benchmark_mode(restore, fake_tuner):
  x, w = jnp.zeros((8, 16, 16, 64), jnp.bfloat16), jnp.zeros((3, 3, 64, 64), jnp.bfloat16)
  (op, avals, params), = _calls(jax_dnn.conv, x, w)
  assert params["benchmark"] is False
  assert _plan_for(op, avals, params).name == "implicit_gemm_128x64"
  assert fake_tuner.calls == []
  jax_dnn.config.update("benchmark", True)
  (op, avals, params), = _calls(jax_dnn.conv, x, w)
  plan = _plan_for(op, avals, params)
  assert plan.name == "implicit_gemm_128x128"
  assert _ffi_params(op)(avals, **params)["algo"] == plan.id
  (names, (fn, specs)), = fake_tuner.calls
  assert names == ["implicit_gemm_128x128", "implicit_gemm_128x64"]
  # XLA's candidate: the reference on operands of the call's shapes.
  assert [s.shape for s in specs] == [a.shape for a in avals]
  got = jax.jit(fn)(*[randn(i, s.shape, s.dtype) for i, s in enumerate(specs)])
  assert got.shape == (8, 1, 16, 16, 64)
  # A symbolic batch (jax.export): the heuristic's, nothing timed.
  fake_tuner.calls.clear()
  b, = jax.export.symbolic_shape("b")
  sym = [jax.core.ShapedArray((b,) + tuple(avals[0].shape[1:]), avals[0].dtype)] + list(avals[1:])
  assert _plan_for(op, sym, params).name == "implicit_gemm_128x64"
  assert fake_tuner.calls == []


def test_trace_time_fusion_question_times_nothing(restore, fake_tuner):
  jax_dnn.config.update("benchmark", True)
  x, w = jnp.zeros((8, 16, 16, 64), jnp.bfloat16), jnp.zeros((3, 3, 64, 64), jnp.bfloat16)
  jax.make_jaxpr(lambda x, w: jax_dnn.conv(x, w, activation="relu"))(x, w)
  assert fake_tuner.calls == []


def test_conv_algorithms_reports_the_benchmark(restore, fake_tuner):
  x = jax.ShapeDtypeStruct((8, 16, 16, 64), jnp.bfloat16)
  w = jax.ShapeDtypeStruct((3, 3, 64, 64), jnp.bfloat16)
  before = jax_dnn.conv_algorithms(x, w, benchmark=True)
  assert before["fwd"].chosen.name == "implicit_gemm_128x64" and before["fwd"].times_ms is None
  jax_dnn.config.update("benchmark", True)
  (op, avals, params), = _calls(jax_dnn.conv, x, w)
  _plan_for(op, avals, params)  # tunes fwd
  assert len(fake_tuner.calls) == 1
  got = jax_dnn.conv_algorithms(x, w)
  assert got["fwd"].chosen.name == "implicit_gemm_128x128"
  assert got["fwd"].times_ms == {"implicit_gemm_128x128": 0.30, "implicit_gemm_128x64": 0.5,
                                 "xla": 0.4}
  assert "runs implicit_gemm_128x128: the fastest in benchmark mode (implicit_gemm_128x128 " \
         "0.3 ms, xla 0.4 ms, implicit_gemm_128x64 0.5 ms)" in str(got["fwd"])
  assert got["dgrad"].times_ms is None  # not tuned yet: the heuristic's
  assert len(fake_tuner.calls) == 1  # conv_algorithms times nothing
  off = jax_dnn.conv_algorithms(x, w, benchmark=False)
  assert off["fwd"].chosen.name == "implicit_gemm_128x64" and off["fwd"].times_ms is None


def test_xla_is_timed_from_inside_a_lowering_rule():
  """XLA's candidate is compiled and run while a program is being lowered
  (here on the CPU, from a CPU lowering rule): in a worker thread, so the
  outer trace is untouched."""
  x, w = jnp.zeros((2, 6, 6, 8), jnp.float32), jnp.zeros((3, 3, 8, 8), jnp.float32)
  (op, avals, params), = _calls(jax_dnn.conv, x, w)
  reference = _reference_call(op, avals, params)
  timed = []
  probe = jax.extend.core.Primitive("jax_dnn_test_tuning_probe")
  probe.def_abstract_eval(lambda a: a)

  def lowering(ctx, a):
    timed.append(conv_tuning.time_xla(reference, device=jax.devices("cpu")[0]))
    return [a]

  mlir.register_lowering(probe, lowering)
  out = jax.jit(lambda a: probe.bind(a) * 2)(jnp.ones(3))
  np.testing.assert_array_equal(out, 2 * np.ones(3))
  assert len(timed) == 1 and 0 < timed[0] < 10_000


# --- on the GPU ----------------------------------------------------------------------------


@pytest.mark.gpu
def test_benchmark_mode_on_the_device(gpu, restore, monkeypatch, cache_dir):
  """A conv's forward and backward, tuned on the device: results as lax's,
  the cache file holds the problems, each choice one of its candidates."""
  del gpu
  live = conv_tuning.Tuner()
  monkeypatch.setattr(conv_tuning, "TUNER", live)
  x = randn(61, (8, 28, 28, 64), jnp.bfloat16)
  w = randn(62, (3, 3, 64, 64), jnp.bfloat16, scale=0.1)
  dy = randn(63, (8, 28, 28, 64), jnp.bfloat16)
  jax_dnn.config.update("benchmark", True)
  # The forward's output is returned too: unused, jit would drop its kernel.
  vjp = lambda conv: jax.jit(lambda x, w, dy: (lambda y, f: (y, *f(dy)))(*jax.vjp(conv, x, w)))
  y, *got = vjp(jax_dnn.conv)(x, w, dy)
  jax_dnn.config.update("benchmark", False)
  naive = lambda x, w: lax.conv_general_dilated(
      x.astype(jnp.float32), w.astype(jnp.float32), (1, 1), "SAME",
      dimension_numbers=("NHWC", "HWIO", "NHWC"), precision=lax.Precision.HIGHEST)
  y_want, *want = vjp(naive)(x, w, dy.astype(jnp.float32))
  for g, r, name in zip([y, *got], [y_want, *want], ("y", "dx", "dw")):
    r = np.asarray(r)
    # bf16 results of fp32 sums over 576 (dx) or 6272 (dw) products: within
    # a few bf16 roundings of the largest value.
    np.testing.assert_allclose(np.asarray(g, np.float32), r, atol=0.02 * np.abs(r).max(),
                               err_msg=name)
  entries = json.loads((cache_dir / conv_tuning.CACHE_FILE).read_text())["entries"]
  assert len(entries) == 3, list(entries)  # fwd, dgrad, wgrad: each has 2+ candidates
  assert live.tuned == 3 and live.seconds / 3 < 1.0, live.seconds  # well under 1 s each
  report = jax_dnn.conv_algorithms(x, w, benchmark=True)
  for op, info in report.items():
    candidates = {a.name for a in info.algorithms if a.supported} | {"xla"}
    assert info.times_ms is not None, str(info)
    assert set(info.times_ms) <= candidates and len(info.times_ms) >= 2, str(info)
    best = min(info.times_ms, key=info.times_ms.get)
    assert (info.chosen.name if info.chosen is not None else "xla") == best, str(info)
  for entry in entries.values():
    assert entry["choice"] == min(entry["times_ms"], key=entry["times_ms"].get)
  # The next process compiles the same program from the file, timing nothing.
  program = "\n".join([
      "import jax, jax.numpy as jnp, jax_dnn",
      "from jax_dnn._src.conv import tuning as conv_tuning",
      "x = jnp.ones((8, 28, 28, 64), jnp.bfloat16); w = jnp.ones((3, 3, 64, 64), jnp.bfloat16)",
      "jax.jit(lambda x, w, dy: jax.vjp(jax_dnn.conv, x, w)[1](dy))(x, w, x)",
      "print(conv_tuning.TUNER.tuned, jax_dnn.conv_algorithms(x, w)['wgrad'].times_ms)"])
  env = dict(os.environ, JAX_DNN_BENCHMARK="1", JAX_DNN_CACHE_DIR=str(cache_dir))
  out = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, env=env)
  assert out.returncode == 0, out.stderr
  tuned, times = out.stdout.split(" ", 1)
  assert tuned == "0" and ast.literal_eval(times) == report["wgrad"].times_ms, out.stdout
