"""python -m jax_dnn.benchmark on the CPU: the CLI's refusal without a GPU,
its arguments, the table, JSON and plot, and one family run end to end on
tiny sizes through harness.run (the loop the CLI runs on a GPU)."""

from __future__ import annotations

import io
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

import jax_dnn
from jax_dnn import benchmark
from jax_dnn.benchmark import __main__ as cli
from jax_dnn.benchmark import attention, conv, harness, models, report, rnn, rowwise
from jax_dnn.benchmark.harness import Case, Settings

# Every call small and timed once: the plumbing, not the numbers.
TINY = Settings(call_bytes=1 << 14, l2_bytes=1 << 14, max_sets=2, warmup_s=0.0, rounds=2,
                round_s=0.0, min_calls=1, max_calls=1, copy_bytes=1 << 14, matmul_size=32)


def _plain():
  stream = io.StringIO()
  return report.Reporter(fancy=False, plots=False, stream=stream), stream


def test_cli_without_gpu_says_so_and_exits_cleanly(tmp_path):
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             PYTHONPATH=os.path.dirname(os.path.dirname(jax_dnn.__file__)))
  out = tmp_path / "out"
  proc = subprocess.run([sys.executable, "-m", "jax_dnn.benchmark", "--quick", "--out", str(out)],
                        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
                        check=False)
  assert proc.returncode == 0, proc.stderr
  assert "no CUDA device" in proc.stdout and "nothing to measure" in proc.stdout
  assert len(proc.stdout.strip().splitlines()) == 1
  assert not out.exists()


def test_cli_refuses_to_time_the_reference_as_ours(monkeypatch, capsys):
  cpu = jax.devices("cpu")
  monkeypatch.setattr(jax, "devices", lambda backend=None: cpu)  # as if a CUDA device were there
  monkeypatch.setattr(jax_dnn, "has_cuda_kernels", lambda: False)
  assert cli.main(["--quick"]) == 1
  assert "built without its CUDA kernels" in capsys.readouterr().err
  monkeypatch.setattr(jax_dnn, "has_cuda_kernels", lambda: True)
  monkeypatch.setenv("JAX_DNN_IMPL", "reference")
  assert cli.main(["norms"]) == 1
  assert "JAX_DNN_IMPL=reference" in capsys.readouterr().err


def test_help_lists_every_family(capsys):
  with pytest.raises(SystemExit) as e:
    cli.parse_args(["--help"])
  assert e.value.code == 0
  text = capsys.readouterr().out
  for name in ("activations", "softmax", "norms", "attention", "conv", "pooling", "batch_norm",
               "group_norm", "rnn", "models"):
    assert f"  {name} " in text
  assert "--quick" in text and "--out" in text


def test_family_names():
  assert benchmark.select([]) == list(benchmark.FAMILIES)
  assert benchmark.select(["norms", "softmax", "norms"]) == ["norms", "softmax"]
  with pytest.raises(ValueError, match="unknown benchmark family 'lstm'; choose from "
                                       "activations, softmax, norms, attention, conv, pooling, "
                                       "batch_norm, group_norm, rnn, models"):
    benchmark.select(["norms", "lstm"])


def test_unknown_family_is_a_usage_error(capsys):
  with pytest.raises(SystemExit) as e:
    cli.parse_args(["norms", "lstm"])
  assert e.value.code == 2
  assert "unknown benchmark family 'lstm'" in capsys.readouterr().err


def test_every_registered_family_declares_itself():
  for name in benchmark.FAMILIES:
    family = benchmark.load(name)
    assert family.name == name
    assert family.impls[0] == "ours" and set(family.reference) <= set(family.impls)
    if family.ceiling is None:  # a time: no ceiling
      assert family.unit in harness.TIME_UNITS
    else:
      assert harness.CEILINGS[family.ceiling][0] == family.unit
    full, quick = family.cases(False), family.cases(True)
    assert 0 < len(quick) < len(full)
    assert {c.label for c in quick} <= {c.label for c in full}
    assert len({c.label for c in full}) == len(full)


def test_row_sweep_has_the_odd_widths_and_moves_a_gib_a_call():
  odd = {1000, 4097, 12289, 65537}
  for name, op in (("norms", "layer_norm"), ("norms", "rms_norm"), ("softmax", "softmax"),
                   ("activations", "bias_act(gelu)")):
    widths = {c.shape[1] for c in benchmark.load(name).cases(False) if c.op == op}
    assert odd <= widths, (name, op)
    quick = benchmark.load(name).cases(True)
    assert any(c.shape == (16384, 4096) and c.dtype == "bfloat16" for c in quick)
    assert any(c.shape[1] % 8 for c in quick)
  gib = 1 << 30
  for (rows, width), dtype in rowwise.SHAPES:
    nbytes = rows * width * jnp.dtype(dtype).itemsize
    moved = harness.input_sets(nbytes, Settings()) * nbytes
    assert moved >= min(gib, 32 * nbytes) and moved >= 64 << 20
    if width in odd:
      assert moved >= gib


def test_attention_flops():
  assert attention.flops(2, 8192, 16, 128, False, "fwd") == 4 * 2 * 16 * 8192**2 * 128
  assert attention.flops(2, 8192, 16, 128, True, "fwd") == 2 * 2 * 16 * 8192**2 * 128
  assert attention.flops(1, 512, 4, 64, False, "bwd") == 2.5 * attention.flops(
      1, 512, 4, 64, False, "fwd")
  assert attention.flops(1, 512, 4, 64, True, "fwd+bwd") == 3.5 * attention.flops(
      1, 512, 4, 64, True, "fwd")
  c = attention.case(128, 2048, True)
  assert c.shape == (8, 2048, 16, 128) and c.option("causal")


def _row(impl, case="op 8x8 bf16", mode="fwd", **kw):
  row = dict(op="op", shape=[8, 8], dtype="bfloat16", case=case, mode=mode, impl=impl, ms=1.0,
             rate=100.0, unit="GB/s", fraction=0.5, ratio={}, error=None, reference=None,
             ok=None, failure=None, applications=10)
  row.update(kw)
  return row


def _result(rows, unit="GB/s"):
  return dict(family="fake", unit=unit, ceiling="copy", device="test device", platform="cpu",
              jax="0", date="2026-01-01T00:00:00+00:00",
              ceilings={"copy": dict(value=200.0, unit="GB/s", what="copy")}, rows=rows)


def test_table_gives_ratios_fraction_and_error():
  rows = [_row("ours", rate=150.0, fraction=0.75, ratio={"xla": 1.5, "cudnn": 0.8}, error=2e-3,
               reference="xla", ok=True),
          _row("cudnn", rate=187.5), _row("xla", rate=100.0),
          _row("ours", mode="bwd", rate=50.0, fraction=0.25, ratio={"xla": 0.5}, error=0.2,
               reference="xla", ok=False),
          _row("cudnn", mode="bwd", ms=None, rate=None, fraction=None,
               failure="RuntimeError: no"),
          _row("xla", mode="bwd", rate=100.0)]
  title, headers, cells, notes = report.table(_result(rows))
  assert "fake" in title and "test device" in title and "200 GB/s" in title
  assert headers == ["case", "mode", "ours GB/s", "cudnn GB/s", "xla GB/s", "ours % copy",
                     "ours / cudnn", "ours / xla", "error"]
  assert cells[0] == ["op 8x8 bf16", "fwd", "150", "188", "100", "75", "0.80", "1.50", "2.0e-03"]
  assert cells[1] == ["op 8x8 bf16", "bwd", "50", "-", "100", "25", "-", "0.50", "2.0e-01 NO"]
  assert any("ref = xla" in n for n in notes)
  assert any(n.startswith("cudnn did not run (1x): RuntimeError: no [op 8x8 bf16 bwd]")
             for n in notes)
  text = report.plain_table(title, headers, cells, notes)
  assert "2.0e-01 NO" in text and text.splitlines()[0] == title


def test_rich_table(tmp_path):
  pytest.importorskip("rich")
  stream = io.StringIO()
  reporter = report.Reporter(fancy=True, plots=False, stream=stream)
  reporter.print_table(_result([_row("ours", ratio={"xla": 1.25}, error=1e-3, reference="xla",
                                     ok=True), _row("xla")]))
  text = stream.getvalue()
  assert "ours / xla" in text and "1.25" in text and "1.0e-03" in text


def test_json_is_written_one_row_a_line(tmp_path):
  result = _result([_row("ours", ratio={"xla": 1.5}), _row("xla")])
  path = report.write_json(result, tmp_path / "sub" / "fake.json")
  assert json.loads(path.read_text()) == result
  assert len(path.read_text().splitlines()) > len(result["rows"]) + len(result)


def test_plot_draws_each_panel(tmp_path):
  pytest.importorskip("matplotlib")
  family = benchmark.load("norms")
  rows = [_row(impl, case=f"layer_norm 8x{w} bf16", mode=mode, op="layer_norm", shape=[8, w],
               rate=float(w))
          for impl in ("ours", "xla") for mode in ("fwd", "bwd") for w in (1000, 1024, 4097)]
  rows.append(_row("ours", dtype="float32", rate=None))  # no point: no rate, not bf16
  path = report.plot(family, _result(rows), tmp_path / "norms.png")
  assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  assert report.plot(family, _result([_row("ours", dtype="float32")]), tmp_path / "x.png") is None
  assert not (tmp_path / "x.png").exists()


def test_without_the_bench_extra(tmp_path, monkeypatch):
  monkeypatch.setattr(report, "missing_extras", lambda: ["rich", "matplotlib"])
  assert report.extras_note() == ("rich and matplotlib not installed (plain-text tables, no "
                                  "plots); the bench extra adds them: pip install \".[bench]\" "
                                  "in the source tree")
  reporter = report.Reporter(stream=io.StringIO())
  assert not reporter.fancy and not reporter.plots
  family = benchmark.load("norms")
  rows = [_row("ours", case="layer_norm 8x8 bf16", op="layer_norm")]
  assert reporter.write(family, _result(rows), tmp_path) == [tmp_path / "norms.json"]
  reporter.print_table(_result(rows))
  assert "layer_norm 8x8 bf16" in reporter.stream.getvalue()
  monkeypatch.setattr(report, "missing_extras", lambda: ["matplotlib"])
  assert report.extras_note().startswith("matplotlib not installed (no plots); the bench extra")


def _fake_family(ours, peer_fails=False):
  """ours against a correct xla and a cudnn that raises (or is skipped)."""
  def xla(x, scale):
    return x * scale

  def cudnn(x, scale):
    raise RuntimeError("cuDNN refuses this shape")

  def workload(case, settings):
    x = jnp.arange(math.prod(case.shape), dtype=jnp.float32).reshape(case.shape) / 64
    scale = jnp.full(case.shape[-1:], 1.5)
    sets = harness.input_sets(x.nbytes, settings)
    return harness.Workload(
        fns={"ours": ours, "cudnn": cudnn if peer_fails else "skipped here", "xla": xla},
        args=[(x + i, scale) for i in range(sets)], cotangents=[x] * sets,
        work=dict(fwd=2 * x.nbytes, bwd=3 * x.nbytes), tolerance=1e-3)

  return harness.Family(
      name="fake", unit="GB/s", ceiling="copy", impls=("ours", "cudnn", "xla"),
      reference=("cudnn", "xla"), cases=lambda quick: [], workload=workload,
      plot_point=lambda row: None, plot_x="")


def test_run_mode_times_checks_and_records_failures():
  case = Case("fake", (4, 16), "float32", "fake 4x16", modes=("fwd", "bwd"))
  family = _fake_family(lambda x, scale: x * scale + 1e-6, peer_fails=True)
  work = family.workload(case, TINY)
  assert len(work.args) == 2  # rotated: 256 bytes a set, 16 KiB wanted, at most 2 sets
  rows = harness.run_mode(family, case, work, "bwd", TINY, ceiling=10.0)
  ours, cudnn, xla = rows
  assert [r["impl"] for r in rows] == ["ours", "cudnn", "xla"]
  assert cudnn["failure"] == "RuntimeError: cuDNN refuses this shape" and cudnn["rate"] is None
  assert ours["reference"] == "xla" and ours["ok"] and ours["error"] < 1e-5
  assert ours["rate"] == pytest.approx(3 * 256 / (ours["ms"] * 1e-3) / 1e9)
  assert ours["fraction"] == pytest.approx(ours["rate"] / 10.0)
  assert ours["ratio"] == {"xla": pytest.approx(xla["ms"] / ours["ms"])}
  assert xla["ratio"] == {"ours": pytest.approx(ours["ms"] / xla["ms"])}
  assert ours["applications"] == TINY.rounds * 2 * TINY.min_calls

  wrong = _fake_family(lambda x, scale: x * scale * 1.1)
  rows = harness.run_mode(wrong, case, wrong.workload(case, TINY), "fwd", TINY, ceiling=10.0)
  assert rows[0]["ok"] is False and rows[0]["error"] > 0.05
  assert rows[1]["failure"] == "skipped here"


def test_run_exits_nonzero_when_ours_is_wrong(tmp_path, monkeypatch):
  wrong = _fake_family(lambda x, scale: x * scale * 1.1)
  monkeypatch.setattr(benchmark, "load", lambda name: wrong)
  reporter, stream = _plain()
  case = Case("fake", (4, 16), "float32", "fake 4x16", modes=("fwd",))
  assert harness.run(["fake"], out=tmp_path, settings=TINY, cases={"fake": [case]},
                     reporter=reporter) == 1
  assert "FAILED: ours, fake 4x16 fwd: error" in stream.getvalue()


def test_norms_end_to_end_on_cpu(tmp_path):
  cases = {"norms": [Case("layer_norm", (8, 100), "bfloat16", "layer_norm 8x100 bf16")]}
  reporter, stream = _plain()
  assert harness.run(["norms"], out=tmp_path, settings=TINY, cases=cases, reporter=reporter) == 0
  data = json.loads((tmp_path / "norms.json").read_text())
  assert not (tmp_path / "norms.png").exists()  # plots off
  assert data["family"] == "norms" and data["unit"] == "GB/s" and data["platform"] == "cpu"
  assert data["ceilings"]["copy"]["value"] > 0 and data["jax"] and data["date"]
  assert [(r["case"], r["mode"], r["impl"]) for r in data["rows"]] == [
      (c.label, m, i) for c in cases["norms"] for m in harness.MODES for i in ("ours", "xla")]
  for r in data["rows"]:
    assert r["failure"] is None and r["rate"] > 0 and r["ms"] > 0
    if r["impl"] == "ours":
      assert r["ok"] and r["reference"] == "xla" and r["ratio"]["xla"] > 0
  text = stream.getvalue()
  assert "[norms 3/3] layer_norm 8x100 bf16 fwd+bwd: ours" in text
  assert "ours / xla" in text and "norms.json" in text


# The conv family.


def test_partial_modes_differentiate_one_argument():
  """dgrad / wgrad: the pullback with respect to the first / second argument alone."""
  x, w = jnp.arange(6.0).reshape(2, 3), jnp.arange(3.0, 12.0).reshape(3, 3) / 7
  dy = jnp.linspace(-1.0, 1.0, 6).reshape(2, 3)
  f = lambda x, w: jnp.tanh(x @ w)
  _, pullback = jax.vjp(f, x, w)
  for mode, expected in zip(("dgrad", "wgrad"), pullback(dy)):
    prepare, apply = harness._programs(f, mode)  # pylint: disable=protected-access
    (got,) = apply(*prepare((x, w), dy))
    assert got.shape == expected.shape
    assert jnp.allclose(got, expected, rtol=1e-6, atol=1e-6), mode
  with pytest.raises(ValueError, match="unknown mode 'xgrad'"):
    harness._programs(f, "xgrad")  # pylint: disable=protected-access


def test_conv_layer_set():
  """The issue's layers, bf16 channels-last, each with the modes it runs."""
  full = conv.cases(False)
  by_net = {}
  for c in full:
    assert c.dtype == "bfloat16"
    by_net.setdefault(c.option("net"), []).append(c)
  resnet = [c for c in by_net["resnet50"] if c.op == "conv"]
  assert all(c.shape[0] == 128 and c.modes == ("fwd", "dgrad", "wgrad", "fwd+bwd")
             for c in resnet)
  stem = resnet[0]
  assert (stem.shape, conv.kernel_shape(stem), stem.option("stride")) == (
      (128, 224, 224, 3), (7, 7, 3, 64), 2)
  for size, width in ((56, 64), (28, 128), (14, 256), (7, 512)):
    shapes = {(c.shape[1:], conv.kernel_shape(c), c.option("stride")) for c in resnet}
    assert ((size, size, width), (3, 3, width, width), 1) in shapes
    assert ((size, size, width), (1, 1, width, 4 * width), 1) in shapes
    assert ((size, size, 4 * width), (1, 1, 4 * width, width), 1) in shapes
    if size < 56:  # the strided 3x3 and 1x1 downsample into this stage
      assert ((2 * size, 2 * size, width), (3, 3, width, width), 2) in shapes
      assert ((2 * size, 2 * size, 2 * width), (1, 1, 2 * width, 4 * width), 2) in shapes
  assert len(resnet) == 23
  assert {(c.shape, c.option("out_channels")) for c in by_net["sd-unet"]} == {
      ((8, 64, 64, 320), 320), ((8, 32, 32, 640), 640), ((8, 128, 128, 128), 128)}
  assert [(c.shape, conv.kernel_shape(c)) for c in by_net["1d"]] == [
      ((32, 16000, 256), (3, 256, 256))]
  assert {c.shape for c in by_net["3d"]} == {(2, 64, 64, 64, 32), (2, 32, 32, 32, 64),
                                             (1, 128, 128, 128, 16)}
  assert all(conv.kernel_shape(c)[:3] == (3, 3, 3) for c in by_net["3d"])
  depthwise = by_net["convnext"] + by_net["mobilenet"]
  assert {(c.shape, c.option("window")) for c in depthwise} == {
      ((64, 56, 56, 128), (7, 7)), ((64, 28, 28, 256), (7, 7)),
      ((128, 112, 112, 32), (3, 3)), ((128, 56, 56, 144), (3, 3))}
  assert all(conv.depthwise(c) for c in depthwise)
  assert [c for c in full if conv.depthwise(c)] == depthwise
  (grouped,) = by_net["resnext"]
  assert (grouped.shape, conv.kernel_shape(grouped), grouped.option("groups")) == (
      (128, 56, 56, 128), (3, 3, 4, 128), 32)
  (transposed,) = by_net["transposed"]
  assert transposed.op == "conv_transpose" and transposed.shape == (16, 32, 32, 512)
  assert conv.kernel_shape(transposed) == (4, 4, 512, 256) and conv.output_shape(transposed) == (
      16, 64, 64, 256)
  fused = [c for c in by_net["resnet50"] if c.op == "conv+bias+relu+residual"]
  assert {conv.kernel_shape(c)[:2] for c in fused} == {(3, 3), (1, 1)} and len(fused) == 8
  assert {(c.op, c.shape) for c in by_net["matmul"]} == {
      (op, (n, n)) for op in ("matmul", "matmul+bias+gelu") for n in (4096, 8192)}
  assert all(c.modes == ("fwd", "fwd+bwd") for c in fused + by_net["matmul"])
  quick = conv.cases(True)
  assert 4 <= len(quick) <= 6 and all(c.modes == ("fwd", "fwd+bwd") for c in quick)
  assert any(conv.depthwise(c) for c in quick)


def test_conv_flops_and_bytes():
  by_label = {c.label: c for c in conv.cases(False)}
  c = by_label["resnet50 3x3 56^2 64 N=128"]
  assert conv.flops(c, "fwd") == 2 * 128 * 56 * 56 * 64 * 64 * 9
  assert conv.flops(c, "dgrad") == conv.flops(c, "wgrad") == conv.flops(c, "fwd")
  assert conv.flops(c, "fwd+bwd") == 3 * conv.flops(c, "fwd")
  c = by_label["resnet50 3x3 s2 56^2 128 N=128"]  # 56^2 in, 28^2 out
  assert conv.output_shape(c) == (128, 28, 28, 128)
  assert conv.flops(c, "fwd") == 2 * 128 * 28 * 28 * 128 * 128 * 9
  c = by_label["resnet50 7x7 s2 224^2 3->64 N=128"]
  assert conv.flops(c, "fwd") == 2 * 128 * 112 * 112 * 64 * 3 * 49
  c = by_label["resnext g32 3x3 56^2 128 N=128"]
  assert conv.flops(c, "fwd") == 2 * 128 * 56 * 56 * 128 * 4 * 9
  c = by_label["transposed 4x4 s2 32^2 512->256 N=16"]  # the passes of the conv it transposes
  assert conv.flops(c, "fwd") == 2 * 16 * 32 * 32 * 512 * 256 * 16
  c = by_label["mobilenet dw 3x3 112^2 32 N=128"]
  x = 128 * 112 * 112 * 32 * 2
  assert conv.flops(c, "fwd") == 2 * 128 * 112 * 112 * 32 * 9
  assert conv.moved_bytes(c) == {"fwd": 2 * x, "dgrad": 2 * x, "wgrad": 2 * x, "fwd+bwd": 4 * x}
  c = by_label["matmul 8192^3"]
  assert conv.flops(c, "fwd") == 2 * 8192**3 and conv.flops(c, "fwd+bwd") == 6 * 8192**3


def test_conv_input_sets_fill_a_call_within_memory():
  settings = Settings()
  for c in conv.cases(False):
    sets = conv.input_sets(c, settings)
    nbytes = conv.set_bytes(c)
    assert 1 <= sets <= settings.max_sets
    assert sets == 1 or 2 * sets * nbytes <= conv.SET_MEMORY, c.label
    capped = sets == settings.max_sets or 2 * (sets + 1) * nbytes > conv.SET_MEMORY
    assert capped or sets * conv.flops(c, "fwd") >= conv.CALL_FLOPS, c.label
    assert capped or sets * nbytes >= settings.l2_bytes, c.label
    if conv.depthwise(c):  # memory-bound: as the row families, a GiB of x a call
      assert capped or sets * math.prod(c.shape) * 2 >= 1 << 30, c.label
  small = next(c for c in conv.cases(False) if c.label == "resnet50 3x3 7^2 512 N=128")
  assert conv.input_sets(small, settings) > 1


def test_conv_end_to_end_on_cpu(tmp_path):
  """Every kind of case on tiny shapes: the ops, their modes, GB/s for depthwise."""
  cases = [conv.layer("resnet50", 2, (9, 8), 8, 16, (3, 3), stride=2),
           conv.layer("mobilenet", 2, (6, 6), 8, 8, (3, 3), groups=8),
           conv.layer("resnext", 1, (7,), 8, 8, (3,), groups=4),
           conv.layer("3d", 1, (4, 5, 3), 3, 5, (3, 3, 3)),
           conv.layer("transposed", 2, (4, 4), 8, 4, (4, 4), stride=2, op="conv_transpose"),
           conv.layer("resnet50", 2, (5, 5), 8, 8, (3, 3), op="conv+bias+relu+residual",
                      modes=conv.FUSED_MODES, tag="fused "),
           conv.matmul_case(24, "gelu"), conv.matmul_case(16, None)]
  reporter, stream = _plain()
  assert harness.run(["conv"], out=tmp_path, settings=TINY, cases={"conv": cases},
                     reporter=reporter) == 0
  data = json.loads((tmp_path / "conv.json").read_text())
  assert data["family"] == "conv" and data["unit"] == "TFLOP/s"
  assert set(data["ceilings"]) == {"matmul", "copy"}
  assert [(r["case"], r["mode"], r["impl"]) for r in data["rows"]] == [
      (c.label, m, i) for c in cases for m in c.modes for i in ("ours", "xla")]
  for r in data["rows"]:
    assert r["failure"] is None and r["rate"] > 0, (r["case"], r["mode"], r["failure"])
    if r["impl"] == "ours":
      assert r["ok"] and r["reference"] == "xla" and r["ratio"]["xla"] > 0
    if r["op"] == "conv" and r["groups"] == 8:  # depthwise
      assert r["gbps"] > 0 and r["copy_fraction"] > 0
    else:
      assert r["gbps"] is None and r["copy_fraction"] is None
  text = stream.getvalue()
  assert "ours GB/s" in text and "ours % copy" in text and "conv.json" in text
  assert "resnet50 3x3 s2 9x8 8->16 N=2 wgrad: ours" in text


# The rnn family.


def test_rnn_sweep_has_the_issues_networks():
  full = rnn.cases(False)
  nets = {(c.op, c.shape, c.option("layers"), c.option("bidirectional"), c.option("ragged"))
          for c in full}
  expected = {("lstm", s, 1, False, False) for s in ((16, 1024, 768), (64, 256, 512),
                                                     (256, 128, 1024), (2, 131072, 128))}
  expected.add(("lstm", (64, 256, 512), 2, False, False))
  expected |= {("lstm", (b, 1000, h), 1, False, False) for h in (64, 128, 256)
               for b in (8, 64, 256)}
  expected.add(("lstm", (32, rnn.RAGGED_T, 1024), 3, True, True))
  expected |= {(op, s, 1, False, False) for op in ("gru", "rnn_tanh")
               for s in ((16, 1024, 768), (64, 256, 512))}
  assert nets == expected
  assert len(full) == 2 * len(expected)  # each network in bf16 and fp32
  assert all(c.modes == ("fwd", "fwd+bwd") for c in full)
  assert {(c.op, c.shape, c.dtype) for c in full} >= {("gru", (16, 1024, 768), "float32")}
  (quick,) = rnn.cases(True)
  assert (quick.op, quick.shape, quick.dtype) == ("lstm", (16, 1024, 768), "bfloat16")
  assert quick.label == "lstm B16 T1024 H768 bf16"
  ragged = next(c for c in full if c.option("ragged"))
  lens = rnn.lengths(ragged)
  assert lens.shape == (32,) and int(lens[0]) == rnn.RAGGED_T
  assert int(lens.min()) >= rnn.RAGGED_T // 8 and len(set(lens.tolist())) > 8


def test_rnn_scan_is_the_same_network():
  """The scan against jax.experimental.rnn's own reference (LSTM, two ragged
  bidirectional layers) and against jax_dnn's values and gradients (GRU, tanh
  RNN, one ragged bidirectional layer; jax_dnn's reference path here)."""
  from jax.experimental import rnn as jax_rnn  # pylint: disable=g-import-not-at-top
  case = rnn.network("lstm", 3, 6, 8, "float32", layers=2, bidirectional=True, ragged=True)
  (args,) = rnn.workload(case, TINY).args
  lens = rnn.lengths(case)
  assert int(lens.min()) < 6  # ragged
  weights = jax_dnn.unpack_lstm_weights(args[3], 8, 8, 2, True)
  ref = jax.jit(lambda *a: jax_rnn.lstm_ref(*a[:3], *weights, lens, 8, 8, 2, 0.0, True))(*args)
  scan = jax.jit(lambda *a: rnn.scan_network("lstm", *a, lens, layers=2, bidirectional=True))(
      *args)
  for a, b in zip(scan, ref):
    assert a.shape == b.shape and jnp.allclose(a, b, atol=1e-5)
  work = rnn.workload(rnn.network("gru", 3, 6, 8, "float32", bidirectional=True, ragged=True),
                      TINY)
  (args,), (dy,) = work.args, work.cotangents

  def value_and_grads(f):
    return jax.jit(lambda *a: jax.vjp(f, *a)[1](dy) + (f(*a),))(*args)

  for a, b in zip(value_and_grads(work.fns["ours"]), value_and_grads(work.fns["scan"])):
    assert jnp.allclose(a, b, atol=1e-4)
  work = rnn.workload(rnn.network("rnn_tanh", 3, 6, 8, "float32", ragged=True), TINY)
  assert jnp.allclose(jax.jit(work.fns["ours"])(*work.args[0]),
                      jax.jit(work.fns["scan"])(*work.args[0]), atol=1e-5)


def test_rnn_cudnn_only_where_it_applies(monkeypatch):
  lstm32 = rnn.network("lstm", 2, 4, 8, "float32")
  assert "CUDA GPUs only" in rnn.workload(lstm32, TINY).fns["cudnn"]  # the CPU
  calls = []
  monkeypatch.setattr(rnn, "_cudnn_lstm", lambda: lambda *a: calls.append(a[5:]) or (a[0],))
  work = rnn.workload(lstm32, TINY)
  work.fns["cudnn"](*work.args[0])
  assert calls == [(8, 8, 1, 0.0, False)]  # input_size, hidden_size, layers, dropout, bidir
  assert "fp32 only" in rnn.workload(rnn.network("lstm", 2, 4, 8, "bfloat16"), TINY).fns["cudnn"]
  assert "LSTM only" in rnn.workload(rnn.network("gru", 2, 4, 8, "float32"), TINY).fns["cudnn"]
  assert rnn.tolerance("float32") == 1e-2 and rnn.tolerance("bfloat16") == 5e-2


def test_rnn_end_to_end_on_cpu(tmp_path):
  """ms and us a step, no ceiling, the peer's time over ours, the scan as reference."""
  pytest.importorskip("matplotlib")
  cases = [rnn.network("lstm", 3, 5, 8, "bfloat16", bidirectional=True, ragged=True)]
  stream = io.StringIO()
  reporter = report.Reporter(fancy=False, plots=True, stream=stream)
  assert harness.run(["rnn"], out=tmp_path, settings=TINY, cases={"rnn": cases},
                     reporter=reporter) == 0
  data = json.loads((tmp_path / "rnn.json").read_text())
  assert data["unit"] == "ms" and data["ceiling"] is None and data["ceilings"] == {}
  assert [(r["case"], r["mode"], r["impl"]) for r in data["rows"]] == [
      (c.label, m, i) for c in cases for m in c.modes for i in ("ours", "cudnn", "scan")]
  for r in data["rows"]:
    if r["impl"] == "cudnn":
      assert r["ms"] is None and r["failure"]
      continue
    assert r["failure"] is None and r["rate"] == r["ms"] > 0 and r["fraction"] is None
    assert r["us_step"] == pytest.approx(r["ms"] * 1e3 / r["shape"][1])
    if r["impl"] == "ours":
      assert r["ok"] and r["reference"] == "scan"
      assert r["ratio"] == {"scan": pytest.approx(
          next(s["ms"] for s in data["rows"] if s["impl"] == "scan" and s["case"] == r["case"]
               and s["mode"] == r["mode"]) / r["ms"])}
  text = stream.getvalue()
  assert "ours us/step" in text and "scan / ours" in text and "cudnn / ours" in text
  assert "% " not in text.split("ours us/step")[0].splitlines()[-1]  # no ceiling column
  assert "X / ours: X's time over ours'" in text
  assert "cudnn did not run" in text and "CUDA GPUs only" in text
  assert not (tmp_path / "rnn.png").exists()  # these networks are not in the sweep's plot
  for r in data["rows"]:  # as the sweep's first network
    r["case"] = f"{rnn.all_cases()[0].label.rsplit(' ', 1)[0]} {r['case'].rsplit(' ', 1)[1]}"
  assert report.plot(rnn.FAMILY, data, tmp_path / "x.png").read_bytes()[:8] == (
      b"\x89PNG\r\n\x1a\n")


# The models family (examples/ are other programs: a fake one stands in).

FAKE = Path(__file__).parent / "data" / "fake_example.py"


def _examples(tmp_path, **files) -> Path:
  """tmp_path/examples with the fake as each named model's file, or the given text."""
  directory = tmp_path / "examples"
  directory.mkdir(parents=True, exist_ok=True)
  for name, text in files.items():
    target = directory / models.MODELS[name][0]
    if text is None:
      shutil.copy(FAKE, target)
    else:
      target.write_text(text.replace("FAKE", str(FAKE)))
  return directory


_WRAPPED = '''
import importlib.util
_spec = importlib.util.spec_from_file_location("_fake_base", r"FAKE")
_base = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_base)

def make_step(backend, size="tiny", **kw):
  {body}
  return _base.make_step(backend, size, **kw)
'''


def test_models_selection():
  assert models.selected(False, {}) == [(n, None) for n in models.MODELS] + [("cnn", 64)]
  assert models.selected(True, {}) == [("cnn", 64), ("transformer", None)]
  assert models.selected(False, {models.ENV_MODELS: "transformer, cnn"}) == [
      ("transformer", None), ("cnn", None), ("cnn", 64)]
  assert models.selected(True, {models.ENV_MODELS: "cnn,unet"}) == [("cnn", 64), ("unet", None)]
  with pytest.raises(ValueError, match="unknown model 'resnet'; choose from cnn, unet"):
    models.selected(False, {models.ENV_MODELS: "cnn,resnet"})
  assert models.model_size({}) == "realistic"
  with pytest.raises(ValueError, match="choose from tiny, small, realistic"):
    models.model_size({models.ENV_SIZE: "huge"})
  assert models.device_counts(1, {}) == (1,) and models.device_counts(8, {}) == (1, 8)
  assert models.device_counts(8, {models.ENV_DEVICES: "4,1,2"}) == (1, 2, 4)
  for bad in ("16", "0,2", "two"):
    with pytest.raises(ValueError, match="device counts from 1 to 8"):
      models.device_counts(8, {models.ENV_DEVICES: bad})


def test_models_cases(monkeypatch):
  monkeypatch.delenv(models.ENV_MODELS, raising=False)
  monkeypatch.delenv(models.ENV_SIZE, raising=False)
  monkeypatch.delenv(models.ENV_DEVICES, raising=False)
  full, quick = models.cases(False), models.cases(True)
  assert [c.label for c in full] == ["cnn realistic (images)", "unet realistic (images)",
                                     "lstm_lm realistic (tokens)",
                                     "transformer realistic (tokens)",
                                     "cnn realistic, 64 images a device"]
  visible = len(jax.devices())  # conftest: 8 host devices
  counts = (1, visible) if visible > 1 else (1,)
  assert all(c.option("devices") == counts and c.modes == tuple(map(models.mode_name, counts))
             for c in full)
  assert models.mode_name(1) == "1 device" and models.mode_name(4) == "4 devices"
  assert [(c.op, c.option("batch")) for c in quick] == [("cnn", 64), ("transformer", None)]
  monkeypatch.setenv(models.ENV_SIZE, "tiny")
  assert models.cases(True)[0].label == "cnn tiny, 64 images a device"


def test_models_find_and_load_examples(tmp_path, monkeypatch):
  monkeypatch.setattr(models, "CHECKOUT", tmp_path / "nowhere")
  examples = _examples(tmp_path, cnn=None, unet="SIZES = {}\n", lstm_lm="import no_such_module\n")
  # An examples/ directory under the current one is never picked up: its
  # programs would run unasked.
  monkeypatch.chdir(tmp_path)
  directory, why = models.find_examples({})
  assert directory is None and "JAX_DNN_EXAMPLES=DIR" in why and "train_cnn.py" in why
  assert models.find_examples({models.ENV_EXAMPLES: str(examples)}) == (
      examples, f"{models.ENV_EXAMPLES}={examples}")
  assert "is not a directory" in models.find_examples(
      {models.ENV_EXAMPLES: str(tmp_path / "missing")})[1]
  monkeypatch.setattr(models, "CHECKOUT", examples)
  assert models.find_examples({}) == (examples, "beside the jax_dnn package")
  assert callable(models.load_example(examples / "train_cnn.py").make_step)
  assert "has no make_step" in models.load_example(examples / "train_unet.py")
  assert "importing" in models.load_example(examples / "train_lstm_lm.py") and (
      "no_such_module" in models.load_example(examples / "train_lstm_lm.py"))
  assert "does not exist" in models.load_example(examples / "train_transformer.py")


def test_models_items_per_step():
  images = {"image": jnp.zeros((6, 8, 8, 3)), "label": jnp.zeros((6,), jnp.int32)}
  tokens = {"lengths": jnp.zeros((4,), jnp.int32), "tokens": jnp.zeros((4, 9), jnp.int32),
            "weights": jnp.zeros((4, 9))}
  assert models.items_per_step(images, "images") == models.batch_size(images) == 6
  assert models.items_per_step(tokens, "tokens") == 36 and models.batch_size(tokens) == 4


def test_models_end_to_end_on_cpu(tmp_path, monkeypatch):
  """A fake model timed with both backends on 1 and 2 host devices (weak
  scaling: the batch a device fixed), one without make_step and two missing
  skipped with a message; table, JSON and plot."""
  pytest.importorskip("matplotlib")
  if len(jax.devices()) < 2:
    pytest.skip("needs 2 devices (conftest gives 8 host devices)")
  monkeypatch.setenv(models.ENV_EXAMPLES, str(_examples(tmp_path, transformer=None,
                                                        unet="SIZES = {}\n")))
  monkeypatch.setenv(models.ENV_SIZE, "tiny")
  monkeypatch.setenv(models.ENV_DEVICES, "1,2")
  monkeypatch.delenv(models.ENV_MODELS, raising=False)
  stream = io.StringIO()
  reporter = report.Reporter(fancy=False, plots=True, stream=stream)
  assert harness.run(["models"], out=tmp_path / "out", settings=TINY, reporter=reporter) == 0
  data = json.loads((tmp_path / "out" / "models.json").read_text())
  assert data["unit"] == "ms" and data["ceilings"] == {}
  assert [(r["case"], r["mode"], r["impl"]) for r in data["rows"]] == [
      ("transformer tiny (tokens)", mode, impl)
      for mode in ("1 device", "2 devices") for impl in ("ours", "xla")]
  by = {(r["op"], r["devices"], r["impl"]): r for r in data["rows"]}
  for r in data["rows"]:
    assert r["failure"] is None and r["ms"] > 0 and r["rate"] == r["ms"]
    assert r["global_batch"] == 4 * r["devices"]  # the fake's tiny batch, 4 a device
    assert r["items"] == r["global_batch"] * 9  # tokens: the [B, 9] ids
    assert r["throughput"] == pytest.approx(r["items"] / (r["ms"] * 1e-3))
    assert r["loss_last"] < r["loss_first"]  # the fake learns: steps ran on the returned state
    assert r["applications"] == TINY.rounds * TINY.min_calls
    if r["devices"] == 1:
      assert r["efficiency"] is None
    else:
      assert r["efficiency"] == pytest.approx(by[(r["op"], 1, r["impl"])]["ms"] / r["ms"])
    if r["impl"] == "ours":
      assert r["ok"] and r["reference"] == "xla" and r["error"] < 1e-2
      assert set(r["ratio"]) == {"xla"}
  text = stream.getvalue()
  assert "skipping unet" in text and "has no make_step" in text
  assert "skipping lstm_lm" in text and "does not exist" in text
  assert "[models  4/10] unet tiny (images) 2 devices: not run" in text
  assert "[models  8/10] transformer tiny (tokens) 2 devices: ours" in text
  assert "[models 10/10] cnn tiny, 64 images a device 2 devices: not run" in text
  assert "ours items/s" in text and "xla / ours" in text and "ours scaling" in text
  assert (tmp_path / "out" / "models.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_models_failures_are_recorded(tmp_path, monkeypatch):
  """A peer that fails is noted; ours disagreeing with the peer's first loss fails the run."""
  monkeypatch.setenv(models.ENV_SIZE, "tiny")
  monkeypatch.setenv(models.ENV_MODELS, "cnn")
  monkeypatch.setenv(models.ENV_DEVICES, "1")
  xla_fails = _WRAPPED.format(body='if backend == "xla": raise RuntimeError("no xla here")')
  monkeypatch.setenv(models.ENV_EXAMPLES, str(_examples(tmp_path / "a", cnn=xla_fails)))
  reporter, stream = _plain()
  assert harness.run(["models"], settings=TINY, reporter=reporter) == 0
  # The CNN runs twice: at its size's batch and at 64 images a device.
  assert "xla did not run (2x): RuntimeError: no xla here" in stream.getvalue()
  other_seed = _WRAPPED.format(body='kw["seed"] = 1 if backend == "jax_dnn" else 0')
  monkeypatch.setenv(models.ENV_EXAMPLES, str(_examples(tmp_path / "b", cnn=other_seed)))
  reporter, stream = _plain()
  assert harness.run(["models"], settings=TINY, reporter=reporter) == 1
  assert "FAILED: ours, cnn tiny (images) 1 device: error" in stream.getvalue()


def test_models_time_the_backends_an_example_offers(tmp_path, monkeypatch):
  """An example whose BACKENDS lists "cudnn" gets a cudnn row, compared with
  xla's first loss like ours; one without the tuple gets ours and xla only."""
  monkeypatch.setenv(models.ENV_SIZE, "tiny")
  monkeypatch.setenv(models.ENV_MODELS, "lstm_lm,transformer")
  monkeypatch.setenv(models.ENV_DEVICES, "1")
  offers_cudnn = _WRAPPED.format(body='backend = "xla" if backend == "cudnn" else backend') + (
      '\nBACKENDS = ("jax_dnn", "xla", "cudnn")\n')
  monkeypatch.setenv(models.ENV_EXAMPLES,
                     str(_examples(tmp_path, lstm_lm=offers_cudnn, transformer=None)))
  reporter, stream = _plain()
  assert harness.run(["models"], settings=TINY, reporter=reporter) == 0, stream.getvalue()
  text = stream.getvalue()
  assert "lstm_lm tiny (tokens) 1 device: ours" in text and ", cudnn " in text
  timed = [line.split(": ", 1)[1] for line in text.splitlines() if "[models" in line]
  assert "cudnn" in timed[0] and "cudnn" not in timed[1], timed


def test_models_weak_scaling(monkeypatch):
  """The global batch grows with the devices from the first count's; efficiency = t1 / tn."""
  seen = []

  def fake_run(family, case, module, devices, global_batch, settings):
    seen.append((devices, global_batch))
    batch = global_batch or 32
    return [dict(impl=impl, ms=10.0 * (1 + 0.1 * (devices > 1)) * (2 if impl == "xla" else 1),
                 global_batch=batch, efficiency=None) for impl in ("ours", "xla")]

  class Progress:
    def note(self, text):
      pass

    def start(self, family, what):
      pass

    def done(self, family, rows):
      pass

  monkeypatch.setattr(models, "run_devices", fake_run)
  monkeypatch.setattr(models, "find_examples", lambda: (FAKE.parent, "here"))
  monkeypatch.setattr(models, "load_example", lambda path: object())
  case = Case("cnn", (0,), "bfloat16", "cnn", options=(
      ("file", "fake_example.py"), ("size", "tiny"), ("batch", None), ("devices", (1, 2, 4))),
      modes=("1 device", "2 devices", "4 devices"))
  rows = models.run_models(models.FAMILY, [case], TINY, progress=Progress())
  assert seen == [(1, None), (2, 64), (4, 128)]
  assert [r["efficiency"] for r in rows] == [None, None] + [pytest.approx(1 / 1.1)] * 4
  seen.clear()
  case = Case("cnn", (16,), "bfloat16", "cnn", options=(
      ("file", "fake_example.py"), ("size", "tiny"), ("batch", 16), ("devices", (2, 4))),
      modes=("2 devices", "4 devices"))
  models.run_models(models.FAMILY, [case], TINY, progress=Progress())
  assert seen == [(2, 32), (4, 64)]


def test_cases_env_keeps_the_matching_labels(tmp_path, monkeypatch):
  cases = {"norms": [Case("layer_norm", (8, 100), "bfloat16", "layer_norm 8x100 bf16"),
                     Case("rms_norm", (8, 64), "bfloat16", "rms_norm 8x64 bf16", modes=("fwd",))]}
  monkeypatch.setenv(harness.CASES_ENV, "^rms")
  reporter, _ = _plain()
  assert harness.run(["norms"], out=tmp_path, settings=TINY, cases=cases, reporter=reporter) == 0
  rows = json.loads((tmp_path / "norms.json").read_text())["rows"]
  assert {(r["case"], r["mode"]) for r in rows} == {("rms_norm 8x64 bf16", "fwd")}
