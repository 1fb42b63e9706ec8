"""What a bug report needs: `python -m jax_dnn.doctor`.

Prints the versions, how the extension was built (whether it has its CUDA
kernels, for which architectures, with which nvcc), the devices JAX sees,
the settings in force and the cache directory. `info()` returns the same as
a dict.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import sys

import jax

import jax_dnn
from jax_dnn._src import extension
from jax_dnn._src.conv import tuning as conv_tuning

# The packages whose versions change what jax_dnn does.
_PACKAGES = ("jax", "jaxlib", "flax", "optax", "nvidia-cutlass")


def _version(package: str) -> str:
  try:
    return importlib.metadata.version(package)
  except importlib.metadata.PackageNotFoundError:
    return "not installed"


def _devices() -> list[str]:
  out = []
  for dev in jax.devices():
    line = f"{dev.platform}:{dev.id} {dev.device_kind}"
    capability = getattr(dev, "compute_capability", None)
    if capability:
      line += f" (sm_{capability.replace('.', '')})"
    out.append(line)
  return out


def info() -> dict:
  """Versions, build, devices, settings and cache directory, as strings."""
  ext = extension.module()
  if ext is None:
    build = {"extension": "not built: every op runs its pure-JAX reference"}
  else:
    build = {"extension": "built", **{k: str(v) for k, v in ext.build_info().items()}}
    build["ffi_targets"] = str(len(extension.registered_targets()))
  return {
      "jax_dnn": jax_dnn.__version__,
      "python": sys.version.split()[0],
      "platform": platform.platform(),
      **{name: _version(name) for name in _PACKAGES},
      **build,
      "devices": ", ".join(_devices()),
      "config": repr(jax_dnn.config),
      "JAX_DNN_IMPL": os.environ.get("JAX_DNN_IMPL", "auto"),
      "cache_dir": conv_tuning.cache_dir(),
  }


def main() -> None:
  entries = info()
  width = max(map(len, entries))
  for key, value in entries.items():
    print(f"{key:<{width}}  {value}")


if __name__ == "__main__":
  main()
