"""Every op of op_cases.py under JAX's transformations, against its reference:
jit, vmap over each axis of each argument (alone, all together, nested),
grad, vmap(grad), the vmapped backward with an unbatched cotangent, grad of
a vmapped loss, check_grads; and its CUDA lowering (text, on any machine
whose jax_dnn has the CUDA handlers): the op's kernels, batched too.

On the CPU these run the reference path through the primitives' rules; on a
GPU (marker gpu) the kernels."""

import jax
from jax.test_util import check_grads
import jax.numpy as jnp
import numpy as np
import pytest

import jax_dnn
from helpers import cuda_hlo
from op_cases import BY_NAME, NAMES, NOT_OPS, randn

V1, V2 = 3, 2  # vmapped sizes: distinct, so that a swapped axis shows


@pytest.fixture(autouse=True)
def _full_fp32_matmuls():
  """fp32 matmuls at full precision: on a GPU JAX's default is TF32 (about
  1e-3 relative), and the op (an fp32 case runs the reference path there)
  and its reference order their matmuls differently under vmap, which left
  attention's nested vmap 4e-4 apart. The kernels' bf16/f16 math is
  unaffected."""
  with jax.default_matmul_precision("highest"):
    yield


def _close(case, got, want, what):
  tol = dict(rtol=case.tol, atol=case.tol)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), err_msg=f"{case.name}: {what}", **tol)


def _stack(a, axis, size, key):
  """`a` with a new axis of `size` at `axis`: scaled copies, no two alike
  (in NumPy: no compilation for each shape)."""
  scales = 1.0 + 0.25 * np.asarray(randn(key, (size,), jnp.float32))
  copies = np.stack([np.asarray(a, np.float32) * s for s in scales], axis=axis)
  return jnp.asarray(copies.astype(a.dtype))


def _loss(case, fn):
  """A scalar loss of fn's result with a varied cotangent."""
  def loss(*args):
    y = fn(*args)
    w = jnp.cos(jnp.arange(y.size, dtype=jnp.float32)).reshape(y.shape)
    return jnp.sum(y * w)
  return loss


@pytest.mark.parametrize("name", NAMES)
def test_jit(device, name):
  del device
  case = BY_NAME[name]
  args = case.make_args()
  _close(case, jax.jit(case.fn)(*args), jax.jit(case.reference)(*args), "jit")


def _vmap_variants(case):
  """in_axes with one argument batched, along each of its axes (the others
  unbatched); every argument batched along axis 0; and, with three or more
  arguments, all but the leading one (along axis 0, and along 1) and all but
  the last (a shared input with per-example parameters; a shared bias)."""
  ndims = [len(a.shape(case.shape)) for a in case.args]
  n = len(ndims)
  variants = [tuple(axis if j == i else None for j in range(n))
              for i in range(n) for axis in range(ndims[i] + 1)]
  if n > 1:
    variants.append((0,) * n)
  if n > 2:
    variants += [(None,) + (0,) * (n - 1), (None,) + (1,) * (n - 1), (0,) * (n - 1) + (None,)]
  return variants


# Variants that fail today, each with its reason (strict: a fix shows as XPASS).
_KNOWN_FAILURES = {}  # (name, in_axes) -> reason: strict xfails while a fix is pending


def _axes_id(in_axes):
  return "in_axes=(" + ",".join("N" if a is None else str(a) for a in in_axes) + ")"


@pytest.mark.parametrize("name,in_axes", [
    pytest.param(n, ax, id=f"{n}-{_axes_id(ax)}",
                 marks=[pytest.mark.xfail(reason=_KNOWN_FAILURES[n, ax], strict=True)]
                 if (n, ax) in _KNOWN_FAILURES else [])
    for n in NAMES for ax in _vmap_variants(BY_NAME[n])])
def test_vmap(device, name, in_axes):
  """vmap with the arguments batched along the given axes (N: unbatched)."""
  del device
  case = BY_NAME[name]
  args = case.make_args()
  batched = [a if ax is None else _stack(a, ax, V1, 10 + i) for i, (a, ax) in
             enumerate(zip(args, in_axes))]
  got = jax.jit(jax.vmap(case.fn, in_axes=in_axes))(*batched)
  want = jax.jit(jax.vmap(case.reference, in_axes=in_axes))(*batched)
  _close(case, got, want, f"vmap in_axes={in_axes}")


@pytest.mark.parametrize("name", NAMES)
def test_nested_vmap(device, name):
  """Two levels of vmap: the leading argument batched at both (the outer
  along its axis 1), the others at one of them."""
  del device
  case = BY_NAME[name]
  args = case.make_args()
  n = len(args)
  rest_inner = lambda fn: jax.vmap(jax.vmap(fn, in_axes=(0,) + (None,) * (n - 1)),
                                   in_axes=(1,) + (0,) * (n - 1))
  rest_outer = lambda fn: jax.vmap(jax.vmap(fn, in_axes=(0,) * n),
                                   in_axes=(0,) + (None,) * (n - 1))
  x = _stack(_stack(args[0], 0, V2, 20), 1, V1, 21)  # [V2, V1, ...]: inner V2, outer V1
  rest = [_stack(a, 0, V1, 22 + i) for i, a in enumerate(args[1:])]
  _close(case, jax.jit(rest_inner(case.fn))(x, *rest),
         jax.jit(rest_inner(case.reference))(x, *rest),
         "vmap(vmap(in_axes=(0, None..)), in_axes=(1, 0..))")
  x = _stack(_stack(args[0], 0, V2, 30), 0, V1, 31)  # [V1, V2, ...]
  rest = [_stack(a, 0, V2, 32 + i) for i, a in enumerate(args[1:])]
  _close(case, jax.jit(rest_outer(case.fn))(x, *rest),
         jax.jit(rest_outer(case.reference))(x, *rest),
         "vmap(vmap(in_axes=(0, 0..)), in_axes=(0, None..))")


@pytest.mark.parametrize("name", NAMES)
def test_grad_and_vmap_of_grad(device, name):
  """grad; per-example gradients (vmap of grad) with the other arguments
  shared, batched, and all but the last batched; the vmapped backward with
  an unbatched cotangent; grad of a vmapped loss (shared arguments'
  gradients sum over the batch)."""
  del device
  case = BY_NAME[name]
  args = case.make_args()
  n, argnums = len(args), case.argnums
  grad = lambda fn: jax.jit(jax.grad(_loss(case, fn), argnums))
  _close(case, grad(case.fn)(*args), grad(case.reference)(*args), "grad")
  batched = [_stack(a, 0, V1, 40 + i) for i, a in enumerate(args)]
  vgrad_axes = [(0,) + (None,) * (n - 1), (0,) * n] + ([(0,) * (n - 1) + (None,)] if n > 2 else [])
  for in_axes in vgrad_axes:
    call = [b if ax == 0 else a for a, b, ax in zip(args, batched, in_axes)]
    vgrad = lambda fn, in_axes=in_axes: jax.jit(jax.vmap(grad(fn), in_axes=in_axes))
    _close(case, vgrad(case.fn)(*call), vgrad(case.reference)(*call),
           f"vmap(grad) in_axes={in_axes}")
  dy = randn(50, jax.eval_shape(case.fn, *args).shape, jnp.float32)
  vjp = lambda fn: jax.jit(jax.vmap(lambda *a: jax.vjp(fn, *a)[1](dy)))
  _close(case, vjp(case.fn)(*batched), vjp(case.reference)(*batched),
         "vmap(vjp) with an unbatched cotangent")
  shared = (0,) + (None,) * (n - 1)
  vloss = lambda fn: jax.jit(jax.grad(
      lambda *a: jnp.sum(jax.vmap(_loss(case, fn), in_axes=shared)(*a)), argnums))
  call = [batched[0]] + args[1:]
  _close(case, vloss(case.fn)(*call), vloss(case.reference)(*call), "grad of a vmapped loss")


@pytest.mark.parametrize("name", [n for n in NAMES if BY_NAME[n].check_grads])
def test_check_grads(device, name):
  del device
  case = BY_NAME[name]
  args = case.make_args(key=60, shape=case.check_shape)
  fn = lambda *d: case.fn(*[d[case.argnums.index(i)] if i in case.argnums else a
                             for i, a in enumerate(args)])
  # fp32 matmuls in full precision (a GPU's default TF32 is too coarse for
  # numerical differences).
  with jax.default_matmul_precision("highest"):
    check_grads(fn, [args[i] for i in case.argnums], order=1, modes=("rev",), atol=1e-2,
                rtol=1e-2)


def _require_cuda_handlers():
  if not jax_dnn.has_cuda_kernels():
    pytest.skip("jax_dnn was built without CUDA kernels: the CUDA lowering is the reference")


@pytest.mark.parametrize("name", NAMES)
def test_cuda_lowering_calls_kernels(name):
  """The forward, the backward and the vmapped forward lower to the op's
  FFI targets (the batching rule folds vmap into the kernel's batch)."""
  _require_cuda_handlers()
  case = BY_NAME[name]
  if not case.lowering_here:
    pytest.skip(f"{name}: its own test file lowers the shapes its kernels take")
  args = case.make_args(case.kernel_dtype)
  fwd, *bwd = case.targets
  assert f"custom_call @{fwd}(" in cuda_hlo(case.fn, *args)
  loss = lambda *a: jnp.sum(case.fn(*a).astype(jnp.float32))
  text = cuda_hlo(jax.grad(loss, case.argnums), *args)
  for target in bwd:
    assert f"custom_call @{target}(" in text, target
  if case.vmap_all_kernels:
    batched = [_stack(a, 0, 2, 70 + i) for i, a in enumerate(args)]
    assert f"custom_call @{fwd}(" in cuda_hlo(jax.vmap(case.fn), *batched)
  else:
    axes = (0,) + (None,) * (len(args) - 1)
    mapped = jax.vmap(case.fn, in_axes=axes)
    assert f"custom_call @{fwd}(" in cuda_hlo(mapped, _stack(args[0], 0, 2, 70), *args[1:])


@pytest.mark.parametrize("name", NAMES)
def test_cuda_lowering_of_grad_of_vmap_and_jvp(name):
  """grad of a vmapped op still transposes to the backward kernels (the
  tangent equation's batching rule keeps it one equation), and forward
  mode's primal value is the forward kernel's."""
  _require_cuda_handlers()
  case = BY_NAME[name]
  if not case.lowering_here:
    pytest.skip(f"{name}: its own test file lowers the shapes its kernels take")
  args = case.make_args(case.kernel_dtype)
  fwd, *bwd = case.targets
  axes = (0,) + (None,) * (len(args) - 1)
  loss = lambda *a: jnp.sum(jax.vmap(case.fn, in_axes=axes)(*a).astype(jnp.float32))
  text = cuda_hlo(jax.grad(loss, case.argnums), _stack(args[0], 0, 2, 75), *args[1:])
  for target in bwd:
    assert f"custom_call @{target}(" in text, target
  jvp = lambda *a: jax.jvp(case.fn, a, a)
  assert f"custom_call @{fwd}(" in cuda_hlo(jvp, *args)


def _public_ops():
  """The public functions of the op modules (jax_dnn/_src/<op>.py), but
  those that run nothing (op_cases.NOT_OPS)."""
  ops = set()
  for name in set(jax_dnn.__all__) - NOT_OPS:
    obj = getattr(jax_dnn, name)
    module = getattr(obj, "__module__", None) or ""
    if callable(obj) and module.startswith("jax_dnn._src.") and module != "jax_dnn._src.extension":
      ops.add(name)
  return ops


def test_every_public_op_has_a_case():
  """A new op registers in op_cases.py, or this fails."""
  assert "layer_norm" in _public_ops() and "has_cuda_kernels" not in _public_ops()
  missing = sorted(_public_ops() - set(NAMES))
  assert not missing, f"public ops without an entry in tests/op_cases.py: {missing}"


def test_every_kernel_target_has_a_case():
  """Every FFI target the extension registers is called by a case of the
  table (so the CUDA-lowering, export and sanitizer runs reach it)."""
  _require_cuda_handlers()
  registered = jax_dnn._extension.registered_targets()  # pylint: disable=protected-access
  covered = {t for name in NAMES for t in BY_NAME[name].targets}
  assert registered == covered, (sorted(registered - covered), sorted(covered - registered))
