"""jax_dnn's settings, in JAX's style: `jax_dnn.config.update(name, value)`,
or an environment variable read when jax_dnn is imported.

  deterministic  (JAX_DNN_DETERMINISTIC=1): every op runs bitwise-
                 reproducible algorithms only: attention's backward (whose
                 default single pass adds dQ in fp32 in a varying order) and
                 the convolutions (their deterministic algorithms; XLA's
                 convolution only where none takes a problem).
  benchmark      (JAX_DNN_BENCHMARK=1), as torch.backends.cudnn.benchmark: a
                 convolution problem new to the process is timed when it is
                 compiled for a GPU -- each algorithm that takes it and XLA's
                 convolution, on the device -- and the fastest runs. Results
                 are cached in memory and on disk, in
                 ${JAX_DNN_CACHE_DIR:-${XDG_CACHE_HOME:-~/.cache}/jax_dnn}/
                 conv_benchmark.json, so a later process compiles without
                 timing (jax_dnn/_src/conv/tuning.py). Off: a heuristic
                 picks instantly. jax_dnn.conv_algorithms shows the choice.

A setting is read when an op is traced, and what it chooses is passed to the
kernels as a static attribute: a compiled program keeps the behaviour it was
compiled with, whatever the setting is later.
"""

from __future__ import annotations

import os

# name -> (environment variable, default)
_SETTINGS = {
    "benchmark": ("JAX_DNN_BENCHMARK", False),
    "deterministic": ("JAX_DNN_DETERMINISTIC", False),
}
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")


def _from_env(var: str, default: bool) -> bool:
  raw = os.environ.get(var)
  if raw is None:
    return default
  if raw.strip().lower() in _TRUE:
    return True
  if raw.strip().lower() in _FALSE:
    return False
  raise ValueError(f"jax_dnn: {var}={raw!r} is not a boolean (use 1/0, true/false, yes/no, on/off)")


class Config:
  """The settings; read them as attributes (`jax_dnn.config.deterministic`)."""

  def __init__(self):
    self._values = {name: _from_env(var, default) for name, (var, default) in _SETTINGS.items()}

  def update(self, name: str, value) -> None:
    """Sets a setting for the ops traced from now on."""
    if name not in _SETTINGS:
      raise ValueError(f"jax_dnn.config: unknown setting {name!r}; settings: "
                       f"{', '.join(sorted(_SETTINGS))}")
    if not isinstance(value, bool):
      raise TypeError(f"jax_dnn.config: {name} must be a bool, got {value!r}")
    self._values[name] = value

  def __getattr__(self, name: str):
    values = self.__dict__.get("_values", {})
    if name in values:
      return values[name]
    raise AttributeError(f"jax_dnn.config has no setting {name!r}; settings: "
                         f"{', '.join(sorted(_SETTINGS))}")

  def __repr__(self) -> str:
    return "jax_dnn.config(" + ", ".join(f"{k}={v}" for k, v in sorted(self._values.items())) + ")"


config = Config()
