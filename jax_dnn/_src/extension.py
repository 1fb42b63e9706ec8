"""Loads the compiled extension and registers its FFI targets with JAX.

The extension is optional at run time: without it (or when it was built
without CUDA) every op lowers to its pure-JAX reference on every platform.
"""

from __future__ import annotations

import functools
import os
import warnings

import jax


@functools.lru_cache(maxsize=None)
def module():
  """The compiled extension (jax_dnn._jax_dnn), or None where it is not built."""
  try:
    from jax_dnn import _jax_dnn  # pylint: disable=g-import-not-at-top
  except ImportError:
    return None
  return _jax_dnn


@functools.lru_cache(maxsize=None)
def registered_targets() -> frozenset[str]:
  """Registers every CUDA handler of the extension once; returns their names."""
  ext = module()
  if ext is None:
    return frozenset()
  names = []
  for name, capsule in ext.registrations().items():
    jax.ffi.register_ffi_target(name, capsule, platform="CUDA")
    names.append(name)
  return frozenset(names)


def export_disabled_checks() -> list:
  """What `jax.export` needs to serialize a program that calls our kernels.

  jax.export refuses custom-call targets it has no compatibility guarantee
  for, which ours are not in its list of. Passing these as
  `disabled_checks=` accepts them; the exported program then needs jax_dnn
  (the same version) imported where it is deserialized and run.
  """
  return [jax.export.DisabledSafetyCheck.custom_call(name) for name in sorted(registered_targets())]


def use_kernel(target: str) -> bool:
  """Whether a CUDA lowering should call `target` rather than the reference.

  JAX_DNN_IMPL=reference forces the reference path everywhere (for debugging
  and for comparing against XLA's own lowering). A jax_dnn without its
  kernels warns the first time an op is lowered for CUDA (warn_no_kernels).
  """
  if os.environ.get("JAX_DNN_IMPL", "auto").lower() == "reference":
    return False
  if target in registered_targets():
    return True
  warn_no_kernels()
  return False


class NoKernelsWarning(RuntimeWarning):
  """jax_dnn runs an op for CUDA through its reference path: it was built
  without its kernels."""


_warned = False


def warn_no_kernels() -> None:
  """Once a process, when an op is lowered for CUDA by a jax_dnn that has no
  kernels (installed where no nvcc was found, or the source tree imported
  without its built extension): every op then runs its pure-JAX reference,
  correct but 5-30x slower than the kernels, which a user would not notice."""
  global _warned
  if _warned or registered_targets():
    return
  _warned = True
  where = "has no compiled extension" if module() is None else "was built without CUDA kernels"
  warnings.warn(
      f"jax_dnn {where}: its ops run on the GPU through the pure-JAX reference path, "
      "5-30x slower than its kernels. Rebuild with the kernels (needs nvcc): "
      "`JAX_DNN_CUDA=ON pip install .` (see the README).", NoKernelsWarning, stacklevel=2)


def has_cuda_kernels() -> bool:
  ext = module()
  return ext is not None and bool(ext.has_cuda())
