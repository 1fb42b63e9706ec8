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
