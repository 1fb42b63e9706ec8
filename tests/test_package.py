"""The package as a new user meets it: what `import jax_dnn` makes reachable."""

import subprocess
import sys


def _run(code: str) -> str:
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
  return out.stdout.strip()


def test_nn_is_reachable_after_import_jax_dnn():
  # A fresh interpreter: nothing else has imported jax_dnn.nn or Flax yet.
  assert _run("import sys, jax_dnn; print('flax' in sys.modules)") == "False"
  assert _run("import jax_dnn; print(jax_dnn.nn.LayerNorm.__name__)") == "LayerNorm"
  assert _run("import jax_dnn; print('nn' in dir(jax_dnn))") == "True"


def test_unknown_attribute_raises_attribute_error():
  code = ("import jax_dnn\ntry:\n  jax_dnn.no_such_op\nexcept AttributeError as e:\n"
          "  print('no_such_op' in str(e))")
  assert _run(code) == "True"


def test_doctor_reports_what_a_bug_report_needs():
  # A fresh interpreter, as a user runs it.
  out = subprocess.run([sys.executable, "-m", "jax_dnn.doctor"], capture_output=True, text=True,
                       check=True).stdout
  keys = {line.split()[0] for line in out.splitlines() if line.strip()}
  assert {"jax_dnn", "jax", "jaxlib", "extension", "devices", "config", "cache_dir"} <= keys


def test_doctor_says_how_the_extension_was_built():
  from jax_dnn import doctor  # pylint: disable=g-import-not-at-top
  from jax_dnn._src import extension  # pylint: disable=g-import-not-at-top
  entries = doctor.info()
  if extension.module() is None:
    assert entries["extension"].startswith("not built")
  else:
    assert entries["cuda"] == str(extension.has_cuda_kernels())
    if extension.has_cuda_kernels():
      assert entries["cuda_architectures"] and entries["nvcc"]
      assert int(entries["ffi_targets"]) > 0
