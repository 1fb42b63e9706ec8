"""Test helpers: random inputs, fp64 references, the tolerance rule, output
poisoning, and inspection of the CUDA lowering."""

from __future__ import annotations

import collections
import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]

# Absolute floor of the tolerance rule, relative to max(1, |reference|): a few
# units of fp32 rounding for fp32, half an ulp of the output dtype otherwise
# (rounding the exact result to the output dtype alone costs that much).
FLOOR = {jnp.dtype(jnp.float32): 1e-6, jnp.dtype(jnp.bfloat16): 4e-3,
         jnp.dtype(jnp.float16): 5e-4}


def x64():
  """Context in which jax computes in float64 (for references)."""
  if hasattr(jax, "enable_x64"):
    return jax.enable_x64(True)
  from jax.experimental import enable_x64  # pylint: disable=g-import-not-at-top
  return enable_x64()


def randn(key, shape, dtype, scale=1.0, offset=0.0):
  """Random normal data (never zeros), rounded to dtype."""
  return (offset + scale * jax.random.normal(jax.random.key(key), shape, jnp.float32)).astype(dtype)


def f64(fn, *args):
  """Runs fn on the CPU in float64 on the given (low-precision) values."""
  cpu = jax.devices("cpu")[0]
  with x64():
    args = [jax.device_put(np.asarray(jnp.asarray(a, jnp.float32), np.float64), cpu) for a in args]
    with jax.default_device(cpu):
      out = fn(*args)
    return jax.tree.map(lambda o: np.asarray(o, np.float64), out)


def assert_rule(out, ref, same_dtype, dtype, what="output", extra_floor=0.0):
  """docs/design.md's tolerance rule: max error vs the fp64 reference is at most
  twice the error of the same computation done in the input dtype, plus a
  small floor."""
  out = np.asarray(jnp.asarray(out, jnp.float32), np.float64)
  same = np.asarray(jnp.asarray(same_dtype, jnp.float32), np.float64)
  ref = np.asarray(ref, np.float64)
  assert out.shape == ref.shape, (what, out.shape, ref.shape)
  assert np.all(np.isfinite(out)), f"{what}: non-finite values (unwritten or NaN)"
  if out.size == 0:
    return
  err = np.max(np.abs(out - ref))
  # A same-dtype baseline that broke down (overflow to inf/NaN) earns no
  # slack: then only the floor applies.
  base = np.nan_to_num(np.max(np.abs(same - ref)), nan=0.0, posinf=0.0)
  scale = max(1.0, float(np.max(np.abs(ref))))
  bound = 2 * base + (FLOOR[jnp.dtype(dtype)] + extra_floor) * scale
  assert err <= bound, f"{what}: max error {err:.3g} > bound {bound:.3g} (same-dtype error {base:.3g})"


def poisoned_call(fn, *args):
  """Runs jit(fn) on the current device so that its outputs land in buffers
  that were filled with NaN first (outputs of the kernel that are never
  written then show up as NaN).

  The poison is an extra argument of each output's shape and dtype, donated
  to the computation, so XLA hands its buffer to the output of the same
  shape. Returns (outputs, how many outputs reused a poisoned buffer).
  """
  out_shapes = jax.eval_shape(fn, *args)
  leaves, treedef = jax.tree.flatten(out_shapes)

  def wrapped(poison, *a):
    del poison
    return fn(*a)

  poison = [jnp.full(s.shape, jnp.nan, s.dtype) for s in leaves]
  ptrs = {p.unsafe_buffer_pointer() for p in poison if p.size}
  with _quiet_donation():
    out = jax.jit(wrapped, donate_argnums=0, keep_unused=True)(poison, *args)
  reused = sum(o.unsafe_buffer_pointer() in ptrs for o in jax.tree.leaves(out) if o.size)
  return out, reused


@contextlib.contextmanager
def _quiet_donation():
  import warnings  # pylint: disable=g-import-not-at-top
  with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message=".*donated buffers were not usable.*")
    yield


def cuda_hlo(fn, *args) -> str:
  """The StableHLO text of fn lowered for CUDA (works on a CPU-only machine)."""
  return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def on_gpu(device) -> bool:
  return device.platform == "gpu"


def check_fwd_bwd(device, ours, naive, args, dtype, *, key=0, poison=True, what=""):
  """Checks ours(*args) and its VJP against naive(*args) in fp64 with the
  tolerance rule; `naive` is an independent plain-jnp implementation (its
  same-dtype run is the rule's baseline). Returns how many outputs landed in
  poisoned buffers (GPU only)."""
  reused = 0
  if poison and on_gpu(device):
    out, reused = poisoned_call(ours, *args)
  else:
    out = jax.jit(ours)(*args)
  ref = f64(naive, *args)
  same = jax.jit(naive)(*args)
  assert_rule(out, ref, same, dtype, what=f"{what} forward")

  dy = randn(key + 1000, np.shape(out), dtype)
  vjp_ours = lambda *a: jax.vjp(ours, *a[:-1])[1](a[-1])
  vjp_naive = lambda *a: jax.vjp(naive, *a[:-1])[1](a[-1])
  grads = jax.jit(vjp_ours)(*args, dy)
  ref_g = f64(vjp_naive, *args, dy)
  same_g = jax.jit(vjp_naive)(*args, dy)
  for i, (g, r, s) in enumerate(zip(grads, ref_g, same_g)):
    assert g.dtype == args[i].dtype, (what, i, g.dtype, args[i].dtype)
    assert_rule(g, r, s, dtype, what=f"{what} grad of arg {i}")
  return reused


def require_kernels():
  """Fails (not skips) a GPU test when jax_dnn has no CUDA kernels: on a GPU
  machine that is an import of the source tree (pytest run from the
  repository root) or a build without CUDA, and every op would silently
  run its reference. Run the GPU tests from tests/ after `pip install .`."""
  import jax_dnn  # pylint: disable=g-import-not-at-top
  if not jax_dnn.has_cuda_kernels():
    pytest.fail(f"jax_dnn from {jax_dnn.__file__} has no CUDA kernels: install it "
                "(pip install .) and run the GPU tests from tests/")


def every_nth(items, every: int, offset: int = 0):
  """(kept, dropped) pytest items for conftest's --every: of each test
  function's cases, in order, those whose index is `offset` modulo `every`
  (a function with no such case keeps its first); the GPU cases all kept
  (they skip where no GPU is, and a GPU run wants all)."""
  cases = collections.defaultdict(list)
  for item in items:
    if item.get_closest_marker("gpu") is None:
      cases[(str(item.path), getattr(item.cls, "__name__", ""), item.originalname)].append(item)
  kept = set()
  for group in cases.values():
    chosen = group[offset % every::every] or group[:1]
    kept.update(map(id, chosen))
  keep, drop = [], []
  for item in items:
    gpu = item.get_closest_marker("gpu") is not None
    (keep if gpu or id(item) in kept else drop).append(item)
  return keep, drop
