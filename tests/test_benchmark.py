"""python -m jax_dnn.benchmark on the CPU: the CLI's refusal without a GPU,
its arguments, the table, JSON and plot, and one family run end to end on
tiny sizes through harness.run (the loop the CLI runs on a GPU)."""

from __future__ import annotations

import io
import json
import math
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

import jax_dnn
from jax_dnn import benchmark
from jax_dnn.benchmark import __main__ as cli
from jax_dnn.benchmark import attention, harness, report, rowwise
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
  for name in ("activations", "softmax", "norms", "attention"):
    assert f"  {name} " in text
  assert "--quick" in text and "--out" in text


def test_family_names():
  assert benchmark.select([]) == list(benchmark.FAMILIES)
  assert benchmark.select(["norms", "softmax", "norms"]) == ["norms", "softmax"]
  with pytest.raises(ValueError, match="unknown benchmark family 'conv'; choose from "
                                       "activations, softmax, norms, attention"):
    benchmark.select(["norms", "conv"])


def test_unknown_family_is_a_usage_error(capsys):
  with pytest.raises(SystemExit) as e:
    cli.parse_args(["norms", "pooling"])
  assert e.value.code == 2
  assert "unknown benchmark family 'pooling'" in capsys.readouterr().err


def test_every_registered_family_declares_itself():
  for name in benchmark.FAMILIES:
    family = benchmark.load(name)
    assert family.name == name
    assert family.impls[0] == "ours" and set(family.reference) <= set(family.impls)
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
