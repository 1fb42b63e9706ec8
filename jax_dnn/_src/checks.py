"""Argument checks shared by the public ops; each raises at trace time with a
message naming the argument, what it got and what is supported."""

from __future__ import annotations

import numbers

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

try:
  from jax._src.lax.lax import canonicalize_precision as _canonicalize_precision
except ImportError:  # pragma: no cover
  _canonicalize_precision = None

SUPPORTED_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
_SUPPORTED_NAMES = "float32, bfloat16 or float16"


def check_array(op: str, name: str, x) -> None:
  if not hasattr(x, "shape") or not hasattr(x, "dtype"):
    raise TypeError(f"{op}: {name} must be an array, got {type(x).__name__}")


def check_float(op: str, name: str, x) -> None:
  check_array(op, name, x)
  if not kernel_dtype(x.dtype):
    raise TypeError(f"{op}: {name} has dtype {x.dtype}; supported: {_SUPPORTED_NAMES}")


def kernel_dtype(dtype) -> bool:
  """Whether the kernels take arrays of this dtype (fp32, bf16, fp16)."""
  return jnp.dtype(dtype) in [jnp.dtype(d) for d in SUPPORTED_DTYPES]


def kernels_take(x) -> bool:
  """Whether an op runs x on its kernels: an array whose dtype, as JAX holds
  it, is float32, bfloat16 or float16, and not weakly typed (a Python scalar,
  or a value computed from one only: the peer's result is weakly typed too).
  On anything else the op runs its peer's function, or its reference in x's
  dtype, with the peer's dtype rules and errors."""
  if not hasattr(x, "shape") or not hasattr(x, "dtype"):
    return False
  aval = jax.typeof(x)
  return kernel_dtype(aval.dtype) and not aval.weak_type


def check_param_shape(op: str, name: str, p, width: int) -> None:
  """A per-feature parameter: an array of shape (width,)."""
  check_array(op, name, p)
  if tuple(p.shape) != (width,):
    raise ValueError(
        f"{op}: {name} must have shape ({width},) to match x.shape[-1]; got {tuple(p.shape)}"
    )


def check_param(op: str, name: str, p, width: int) -> None:
  """A per-feature parameter: shape (width,), a floating dtype."""
  check_param_shape(op, name, p, width)
  if not jnp.issubdtype(p.dtype, jnp.floating):
    raise TypeError(f"{op}: {name} must be floating point; got {p.dtype}")


def check_positive_int(op: str, name: str, v, minimum: int = 1) -> int:
  if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < minimum:
    raise ValueError(f"{op}: {name} must be an int >= {minimum}; got {v!r}")
  return int(v)


def normalize_axis(op: str, axis, ndim: int) -> int:
  if not isinstance(axis, (int, np.integer)) or isinstance(axis, bool):
    raise TypeError(f"{op}: axis must be an int, got {axis!r}")
  if not -ndim <= axis < ndim:
    raise ValueError(f"{op}: axis {axis} is out of range for an array of rank {ndim}")
  return int(axis) % ndim


def check_epsilon(op: str, epsilon) -> float:
  if isinstance(epsilon, bool) or not isinstance(epsilon, (int, float, np.floating, np.integer)):
    raise TypeError(f"{op}: epsilon must be a Python float, got {epsilon!r}")
  if not epsilon > 0:
    raise ValueError(f"{op}: epsilon must be > 0, got {epsilon}")
  return float(epsilon)


def matmul_precision(precision, dtype) -> str | None:
  """The kernels' precision param for `precision` (or, where None,
  jax.default_matmul_precision); None where only lax takes it (a dot
  algorithm). Only fp32 operands care: bf16 and fp16 products are exact."""
  canon = _canonicalize_precision(precision) if _canonicalize_precision else precision
  if canon is None:
    default = jax.config.jax_default_matmul_precision
    if default is not None and _canonicalize_precision:
      canon = _canonicalize_precision(default)
  if canon is None:
    return "default"
  pair = canon if isinstance(canon, tuple) else (canon,)
  if not all(isinstance(p, lax.Precision) for p in pair):
    return None
  if jnp.dtype(dtype) != jnp.float32:
    return "default"
  if lax.Precision.HIGHEST in pair:
    return "highest"
  return "high" if lax.Precision.HIGH in pair else "default"
