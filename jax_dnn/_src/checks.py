"""Argument checks shared by the public ops; each raises at trace time with a
message naming the argument, what it got and what is supported."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

SUPPORTED_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
_SUPPORTED_NAMES = "float32, bfloat16 or float16"


def check_array(op: str, name: str, x) -> None:
  if not hasattr(x, "shape") or not hasattr(x, "dtype"):
    raise TypeError(f"{op}: {name} must be an array, got {type(x).__name__}")


def check_float(op: str, name: str, x) -> None:
  check_array(op, name, x)
  if jnp.dtype(x.dtype) not in [jnp.dtype(d) for d in SUPPORTED_DTYPES]:
    raise TypeError(f"{op}: {name} has dtype {x.dtype}; supported: {_SUPPORTED_NAMES}")


def check_param(op: str, name: str, p, width: int) -> None:
  """A per-feature parameter: shape (width,), a floating dtype."""
  check_array(op, name, p)
  if tuple(p.shape) != (width,):
    raise ValueError(
        f"{op}: {name} must have shape ({width},) to match x.shape[-1]; got {tuple(p.shape)}"
    )
  if not jnp.issubdtype(p.dtype, jnp.floating):
    raise TypeError(f"{op}: {name} must be floating point; got {p.dtype}")


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
