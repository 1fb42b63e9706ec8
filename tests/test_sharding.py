"""Sharded operands under jit: each op runs on every device's shard (no
gather) where the op allows it, adds partial parameter gradients over the
devices, and stays correct where an operand arrives split along a dimension
it needs whole.

CPU: a mesh of 8 host devices (conftest), where the per-shard call is the
reference; the CUDA lowering of a sharded program is checked to hand the op
to the partitioner with its rule. GPU (marker gpu, >= 2 GPUs): the kernels,
split over a mesh of GPUs, against the same program on one GPU.
"""


import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import numpy as np
import pytest

import jax_dnn
from helpers import randn, require_kernels
from op_cases import BY_NAME, one_per_family

# The rules belong to the primitives: one op of each family (op_cases.py).
SHARDED = one_per_family()


def _cpu_mesh():
  devices = jax.devices("cpu")
  assert len(devices) >= 8, f"conftest asks for 8 CPU devices; JAX has {len(devices)}"
  return Mesh(np.array(devices[:8]).reshape(4, 2), ("data", "model"))


def _gpu_mesh(shape):
  try:
    gpus = jax.devices("gpu")
  except RuntimeError:
    gpus = []
  if len(gpus) < 2:
    pytest.skip(f"needs 2 or more CUDA devices (found {len(gpus)})")
  require_kernels()
  return Mesh(np.array(gpus[:2]).reshape(shape), ("data", "model"))


# Two GPUs make one axis of 2: each GPU case runs with either axis split.
@pytest.fixture(params=["cpu", pytest.param("gpu_data", marks=pytest.mark.gpu),
                        pytest.param("gpu_model", marks=pytest.mark.gpu)])
def mesh(request):
  if request.param == "cpu":
    return _cpu_mesh()
  return _gpu_mesh((2, 1) if request.param == "gpu_data" else (1, 2))


def _split(mesh, axis):
  return mesh.shape[axis] > 1


_COLLECTIVE = re.compile(
    r"\b(all-gather|all-reduce|all-to-all|collective-permute)(?:-start)?\(([^)]*)\)")


def _collectives(fn, args):
  """The compiled program's collectives, counted by the arrays they move: the
  GPU compiler combines several (one all-gather of q, k and v; one async
  all-reduce-start of two concatenated parameter gradients), the CPU one
  does not."""
  text = jax.jit(fn).lower(*args).compile().as_text()
  count = {op: 0 for op in ("all-gather", "all-reduce", "all-to-all", "collective-permute")}
  for op, operands in _COLLECTIVE.findall(text):
    count[op] += max(1, operands.count("%"))
  return count


def _on_one_device(mesh, fn, args):
  """jit(fn)(*args) on one device of the mesh's platform."""
  with jax.default_device(jax.devices(mesh.devices.flat[0].platform)[0]):
    return jax.jit(fn)(*args)


def _check(mesh, fn, args, specs, *, gathers=0, tol=1e-5):
  """fn on operands split per `specs` equals fn on one device; returns the
  compiled program's collectives (`gathers` all-gathers and no all-to-all
  or permute expected; None: not checked)."""
  want = _on_one_device(mesh, fn, args)
  split = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, specs)]
  got = jax.jit(fn)(*split)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), rtol=tol, atol=tol)
  coll = _collectives(fn, split)
  if gathers is not None:
    assert coll["all-gather"] == gathers, coll
    assert coll["all-to-all"] == 0 and coll["collective-permute"] == 0, coll
  return coll


def _tol(mesh):
  # GPU: bf16 kernels on the whole and on shards run the same tiles per row;
  # the psum of parameter gradients changes their fp32 summation order.
  return 1e-5 if mesh.devices.flat[0].platform == "cpu" else 2e-2


# --- every op of op_cases.py ----------------------------------------------------------


def _case_dtype(mesh, case):
  return jnp.float32 if mesh.devices.flat[0].platform == "cpu" else case.kernel_dtype


def _case_loss(case):
  return lambda *a: jnp.sum(jnp.sin(case.fn(*a).astype(jnp.float32)))


@pytest.mark.parametrize("name", SHARDED)
def test_split_operands_run_per_shard(mesh, name):
  """Operands split as the table's Arg.split: no gather, and a parameter
  gradient is summed over the devices (an all-reduce) where its operand is
  not split along a mesh axis that the leading operand is split along."""
  case = BY_NAME[name]
  args = case.make_args(_case_dtype(mesh, case))
  fn = jax.value_and_grad(_case_loss(case), argnums=case.argnums)
  coll = _check(mesh, fn, args, case.split_specs, tol=_tol(mesh))
  leading = {ax for ax in case.args[0].split if ax is not None and _split(mesh, ax)}
  summed = [i for i in case.argnums if leading - set(case.args[i].split)]
  assert coll["all-reduce"] >= bool(summed), (coll, summed)


@pytest.mark.parametrize("name", [n for n in SHARDED if any(a.whole for a in BY_NAME[n].args)])
def test_split_along_a_whole_dimension_is_gathered(mesh, name):
  """Split along a dimension the op needs whole (a softmax's axis, a norm's
  width, attention's sequences): each such operand is gathered, and the
  result is still right."""
  case = BY_NAME[name]
  args = case.make_args(_case_dtype(mesh, case))
  specs = [P(*[None] * a.whole[0], "model") if a.whole else P() for a in case.args]
  gathers = sum(bool(a.whole) for a in case.args) * _split(mesh, "model")
  _check(mesh, case.fn, args, specs, gathers=gathers, tol=_tol(mesh))


@pytest.mark.parametrize("name", SHARDED)
def test_vmapped_axis_split(mesh, name):
  """vmap over every operand, split along the vmapped axis: each device's
  rows carry their own parameter copies, with no gather (where the case
  says so: OpCase.vmap_split_gathers)."""
  case = BY_NAME[name]
  args = [jnp.stack([a, a * 0.5, a * -0.25, a * 2])
          for a in case.make_args(_case_dtype(mesh, case))]
  fn = jax.value_and_grad(lambda *a: jnp.sum(jax.vmap(_case_loss(case))(*a)),
                          argnums=case.argnums)
  gathers = 0 if case.vmap_split_gathers else None
  _check(mesh, fn, args, [P("data")] * len(args), gathers=gathers, tol=max(_tol(mesh), 1e-4))


# --- attention -----------------------------------------------------------------------

B, T, S, N, H = 4, 16, 24, 8, 32


def _qkv(kv_heads, dtype):
  return (randn(20, (B, T, N, H), dtype), randn(21, (B, S, kv_heads, H), dtype),
          randn(22, (B, S, kv_heads, H), dtype))


def _attn_grad(**kw):
  def loss(q, k, v, *extra):
    kwargs = dict(kw)
    if extra:
      kwargs["bias"] = extra[0]
    o = jax_dnn.dot_product_attention(q, k, v, **kwargs)
    return jnp.sum(o.astype(jnp.float32) * jnp.sin(q.astype(jnp.float32)))
  return loss


def _attn_dtype(mesh):
  return jnp.float32 if mesh.devices.flat[0].platform == "cpu" else jnp.bfloat16


# Grouped-query heads, and a bias of the batch's size, are the table's case
# (test_split_operands_run_per_shard); here multi-head, multi-query and a
# bias broadcast over the batch.
@pytest.mark.parametrize("kv_heads,specs", [
    (N, [P("data", None, "model")] * 3),       # batch and heads
    (1, [P(None, None, "model"), P(), P()]),   # multi-query: dk, dv summed over head shards
], ids=["mha", "mqa"])
def test_attention_batch_and_heads(mesh, kv_heads, specs):
  args = _qkv(kv_heads, _attn_dtype(mesh))
  fn = jax.value_and_grad(_attn_grad(is_causal=True), argnums=(0, 1, 2))
  _check(mesh, fn, args, specs, tol=_tol(mesh))


def test_attention_bias_broadcast_over_the_batch(mesh):
  q, k, v = _qkv(N, _attn_dtype(mesh))
  bias = randn(23, (1, N, T, S), jnp.float32)
  fn = jax.grad(_attn_grad(), argnums=(0, 1, 2, 3))
  specs = [P("data", None, "model")] * 3 + [P(None, "model")]
  _check(mesh, fn, [q, k, v, bias], specs, tol=_tol(mesh))


def test_attention_masks_lengths_segments(mesh):
  q, k, v = _qkv(N, _attn_dtype(mesh))
  mask = jax.random.bernoulli(jax.random.key(24), 0.8, (B, 1, T, S))
  lens = jnp.array([3, 24, 10, 17], jnp.int32)
  q_seg = jnp.repeat(jnp.arange(4)[None], B, 0).repeat(T // 4, 1)
  kv_seg = jnp.repeat(jnp.arange(4)[None], B, 0).repeat(S // 4, 1)

  def fn(q, k, v, mask, lens, q_seg, kv_seg):
    o, lse = jax_dnn.dot_product_attention(q, k, v, mask=mask, key_value_seq_lengths=lens,
                                           q_segment_ids=q_seg, kv_segment_ids=kv_seg,
                                           local_window_size=(6, 2), return_residual=True)
    return o, jnp.where(jnp.isfinite(lse), lse, 0.0)

  heads = P("data", None, "model")
  _check(mesh, fn, [q, k, v, mask, lens, q_seg, kv_seg],
         [heads] * 3 + [P("data"), P("data"), P("data"), P("data")], tol=_tol(mesh))


def test_attention_after_a_reshape_with_mesh_sub_axes(mesh):
  """[B, T, N*H] split 4 ways along its last axis, reshaped to N = 2 heads:
  the heads then carry part of a mesh axis, which no PartitionSpec names. The
  op takes such operands whole."""
  x = randn(25, (B, T, 2 * H), _attn_dtype(mesh))

  def fn(x):
    q = x.reshape(B, T, 2, H)
    return jnp.sum(jax_dnn.dot_product_attention(q, q, q).astype(jnp.float32) ** 2)

  spec = P(None, None, "data")
  _check(mesh, jax.value_and_grad(fn), [x], [spec], gathers=None, tol=_tol(mesh))


@pytest.mark.parametrize("spec,gathers", [
    (P("model", "data"), 0),
    # The batching rule folds the vmapped axis into B as its major part: a
    # split of the inner B alone is then no contiguous split of the folded
    # batch, and the partitioner gathers (correct, not parallel).
    (P(None, "data", None, "model"), None),
], ids=["vmapped_axis_split", "inner_batch_split"])
def test_vmap_of_sharded_attention(mesh, spec, gathers):
  q, k, v = (jnp.stack([a, a * 0.5]) for a in _qkv(N, _attn_dtype(mesh)))
  fn = jax.vmap(lambda q, k, v: jax_dnn.dot_product_attention(q, k, v, is_causal=True))
  if spec[0] == "model" and not _split(mesh, "model") and _split(mesh, "data"):
    gathers = None  # the vmapped axis whole, B split: the inner batch split
  _check(mesh, fn, [q, k, v], [spec] * 3, gathers=gathers, tol=_tol(mesh))


@pytest.mark.parametrize("shardy", [True, False], ids=["shardy", "gspmd"])
def test_both_partitioners(shardy):
  """Shardy (JAX's default) reads the rule string; GSPMD asks
  infer_sharding_from_operands."""
  mesh = _cpu_mesh()
  before = jax.config.jax_use_shardy_partitioner
  jax.config.update("jax_use_shardy_partitioner", shardy)
  try:
    q, k, v = _qkv(1, jnp.float32)
    fn = jax.grad(_attn_grad(is_causal=True), argnums=(0, 1, 2))
    coll = _check(mesh, fn, [q, k, v], [P("data", None, "model"), P("data"), P("data")])
    assert coll["all-reduce"] >= 1, coll  # multi-query dk, dv
    x, scale = randn(30, (8, 4, 32), jnp.float32), randn(31, (32,), jnp.float32)
    fn = jax.grad(lambda x, s: jnp.sum(jax_dnn.rms_norm(x, s) * x), argnums=(0, 1))
    _check(mesh, fn, [x, scale], [P("data", "model"), P()])
  finally:
    jax.config.update("jax_use_shardy_partitioner", before)


def test_vmap_with_a_bias_of_fewer_batch_groups(mesh):
  """vmap folds [V, 1, N, T, S] biases into G = V param_sets of a V*B batch
  (1 < G < B): the batch then stays whole, and the result is still right."""
  q, k, v = (jnp.stack([a, a * 0.5]) for a in _qkv(N, _attn_dtype(mesh)))
  bias = randn(26, (2, 1, N, T, S), jnp.float32)
  fn = jax.vmap(jax.grad(_attn_grad(), argnums=(0, 3)))
  _check(mesh, fn, [q, k, v, bias], [P("model", "data")] * 3 + [P("model")], gathers=None,
         tol=_tol(mesh))


# --- inside shard_map: each device calls the op on its block --------------------------


def _extra_shard_map_cases(dtype):
  """Attention's layouts beyond the table's: (name, fn, args, specs, result spec)."""
  mha = P("data", None, "model")
  qm, km, vm = _qkv(1, dtype)
  # Multi-query: K/V the same on every device; their gradients are summed.
  yield "attention_mqa", lambda q, k, v: jax_dnn.dot_product_attention(q, k, v), [qm, km, vm], [
      mha, P("data"), P("data")], mha
  q, k, v = _qkv(N, dtype)
  bias = randn(43, (1, N, T, S), jnp.float32)
  yield "attention_bias", lambda q, k, v, bias: jax_dnn.dot_product_attention(q, k, v, bias), [
      q, k, v, bias], [mha] * 3 + [P(None, "model")], mha


BLOCK_CASES = SHARDED + ["attention_mqa", "attention_bias"]


def _block_case(mesh, name, vmapped):
  """A case of the table (or of _extra_shard_map_cases), split as its specs
  say (vmapped: over a new leading axis of every operand): its fn, args,
  specs, the argnums of its float operands, its loss, and its result's spec
  under explicit mesh axes."""
  if name in BY_NAME:
    case = BY_NAME[name]
    fn, args, specs = case.fn, case.make_args(_case_dtype(mesh, case)), case.split_specs
    want_spec, keeps_batch_split = case.result_spec, case.vmap_keeps_batch_split
  else:
    _, fn, args, specs, want_spec = next(
        c for c in _extra_shard_map_cases(_attn_dtype(mesh)) if c[0] == name)
    keeps_batch_split = False
  if vmapped:
    args = [jnp.stack([a, a * 0.5]) for a in args]
    specs = [P(None, *spec) for spec in specs]
    fn = jax.vmap(fn)
    # Where the batching rule folds the vmapped axis into the batch as its
    # major part, a split of the inner batch alone is gathered for the op
    # (README, limits).
    want_spec = P(None, *want_spec) if keeps_batch_split else P(None, None, *want_spec[1:])
    if name in BY_NAME and BY_NAME[name].vmap_out_split is not None:
      want_spec = P(*BY_NAME[name].vmap_out_split)
  argnums = tuple(i for i, a in enumerate(args) if jnp.issubdtype(a.dtype, jnp.floating))
  loss = lambda f: (lambda *a: jnp.sum(jnp.sin(f(*a).astype(jnp.float32))))
  return fn, args, specs, argnums, loss, want_spec


def _assert_close(mesh, got, want, name):
  # The loss and summed gradients add per-device partials in another order.
  tol = max(_tol(mesh), 1e-4)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32),
                               rtol=tol, atol=tol, err_msg=name)


@pytest.mark.parametrize("vmapped", [False, True], ids=["plain", "vmap"])
@pytest.mark.parametrize("name", BLOCK_CASES)
def test_inside_shard_map_with_check_vma(mesh, name, vmapped):
  """shard_map with JAX's default check_vma: results vary over the axes their
  operands vary over, and gradients of operands the devices share (norm
  scales, a bias, multi-query K/V) are summed over the devices by JAX (the
  transpose of the cast that makes the operands agree)."""
  fn, args, specs, argnums, loss, _ = _block_case(mesh, name, vmapped)
  # Each device's block of the result (split as the leading operand, or as
  # the case says: a convolution's output channels split with its kernel).
  out_spec = specs[0]
  if name in BY_NAME:
    out_spec = P(*((None,) if vmapped else ()), *BY_NAME[name].result_spec)
  mapped = jax.shard_map(fn, mesh=mesh, in_specs=tuple(specs), out_specs=out_spec)
  got = jax.jit(jax.value_and_grad(loss(mapped), argnums=argnums))(*args)
  want = _on_one_device(mesh, jax.value_and_grad(loss(fn), argnums=argnums), args)
  _assert_close(mesh, got, want, name)


def _full(spec, ndim):
  return tuple(spec) + (None,) * (ndim - len(spec))


@pytest.mark.parametrize("vmapped", [False, True], ids=["plain", "vmap"])
@pytest.mark.parametrize("name", BLOCK_CASES)
def test_explicit_mesh_axes(mesh, name, vmapped):
  """Under explicit mesh axes (jax.make_mesh's default) every array's type
  carries its sharding: each op's result is typed split as its rule splits
  it (so what follows it stays split), and gradients are typed as their
  primals."""
  fn, args, specs, argnums, loss, want_spec = _block_case(mesh, name, vmapped)
  explicit = Mesh(mesh.devices, mesh.axis_names,
                  axis_types=(jax.sharding.AxisType.Explicit,) * len(mesh.axis_names))
  want = _on_one_device(mesh, jax.value_and_grad(loss(fn), argnums=argnums), args)
  with jax.set_mesh(explicit):
    split = [jax.device_put(a, NamedSharding(explicit, sp)) for a, sp in zip(args, specs)]
    out = jax.jit(lambda *a: fn(*a) * 2)(*split)  # the product is typed from the op's result
    got = jax.jit(jax.value_and_grad(loss(fn), argnums=argnums))(*split)
  assert _full(out.sharding.spec, out.ndim) == _full(want_spec, out.ndim)
  for g, i in zip(got[1], argnums):
    assert _full(g.sharding.spec, g.ndim) == _full(split[i].sharding.spec, g.ndim), i
  _assert_close(mesh, got, want, name)


def test_shard_map_operands_of_different_manual_types_raise():
  """The primitives themselves take operands of one type (the public ops
  cast them); binding one directly with mixed types is a clear error."""
  from jax_dnn._src import softmax as softmax_lib  # pylint: disable=g-import-not-at-top
  mesh = _cpu_mesh()
  x = randn(44, (8, 16), jnp.float32)

  def inner(x, dy):
    return softmax_lib.softmax_bwd_p.bind(dy, x, axis=1, log=False)

  f = jax.shard_map(inner, mesh=mesh, in_specs=(P("data"), P()), out_specs=P("data"))
  with pytest.raises(ValueError, match="vary over different manual mesh axes"):
    jax.jit(f).trace(x, x[:2])


# --- where the op is lowered as one call (XLA then gathers; correct) ---------------------


_PARTLY_MANUAL = """
import jax
jax.config.update("jax_num_cpu_devices", 8)
import jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, PartitionSpec as P
import jax_dnn
mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
x = jax.random.normal(jax.random.key(1), (8, 16))
def inner(x):
  x = jax.lax.with_sharding_constraint(x, P(None, "model"))
  return jax_dnn.softmax(x, axis=0)
f = jax.jit(jax.shard_map(inner, mesh=mesh, in_specs=P("data"), out_specs=P("data"),
                          axis_names={"data"}))
want = jnp.concatenate([jax.nn.softmax(c, axis=0) for c in jnp.split(x, 4)])
if WITH_MESH:  # the legacy mesh context: custom_partitioning then sees the whole mesh
  with mesh:
    y = f(x)
else:
  y = f(x)
np.testing.assert_allclose(y, want, rtol=1e-6, atol=1e-6)
print("partly manual: ok")
"""


@pytest.mark.parametrize("shardy,with_mesh", [(True, False), (True, True), (False, False)],
                         ids=["shardy", "shardy_with_mesh", "gspmd"])
def test_inside_a_partly_manual_shard_map(shardy, with_mesh):
  """Manual over "data", "model" left to the partitioner: the op, already
  on per-device operands, is one call. (custom_partitioning there made XLA
  abort the process, hence a subprocess.)"""
  code = _PARTLY_MANUAL.replace("import jax\n", f"import jax\njax.config.update("
                                f"'jax_use_shardy_partitioner', {shardy})\nWITH_MESH = {with_mesh}\n", 1)
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       cwd=os.path.dirname(os.path.dirname(jax_dnn.__file__)), env=env, check=False)
  assert run.returncode == 0 and "partly manual: ok" in run.stdout, run.stderr[-3000:]


def test_export_of_a_sharded_program():
  """jax.export cannot serialize custom_partitioning's callbacks. Exported
  for the CPU mesh's platform: on a GPU machine the default would be CUDA,
  whose custom call jax.export refuses unless the caller disables its
  safety check for our target."""
  mesh = _cpu_mesh()
  x = jax.device_put(randn(33, (8, 16), jnp.float32), NamedSharding(mesh, P("data")))
  exported = jax.export.export(jax.jit(jax_dnn.softmax), platforms=("cpu",))(x)
  np.testing.assert_allclose(exported.call(x), jax.nn.softmax(x), rtol=1e-6, atol=1e-6)


def test_cache_key_without_the_partitioner_pointer():
  """With jax_remove_custom_partitioning_ptr_from_cache_key, programs that
  differ only in an op's parameter would share a cache entry: no
  custom_partitioning then."""
  mesh = _cpu_mesh()
  x = jax.device_put(randn(34, (8, 16), jnp.float32), NamedSharding(mesh, P("data")))
  fn = lambda: (lambda x: jax_dnn.layer_norm(x, epsilon=0.5))  # new each time: no cached lowering
  assert "CustomSPMDPartitioning" in jax.jit(fn()).lower(x).as_text()
  jax.config.update("jax_remove_custom_partitioning_ptr_from_cache_key", True)
  try:
    assert "CustomSPMDPartitioning" not in jax.jit(fn()).lower(x).as_text()
  finally:
    jax.config.update("jax_remove_custom_partitioning_ptr_from_cache_key", False)


# --- the CUDA lowering -------------------------------------------------------------------


def _cuda_text(fn, *args):
  return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def test_one_device_lowering_is_the_plain_kernel_call():
  if not jax_dnn.has_cuda_kernels():
    pytest.skip("jax_dnn was built without CUDA kernels: the CUDA lowering is the reference")
  x = jnp.ones((4, 8), jnp.bfloat16)
  text = _cuda_text(jax_dnn.softmax, x)
  assert "custom_call @jax_dnn_softmax_fwd(" in text
  assert "CustomSPMDPartitioning" not in text


def test_sharded_lowering_hands_the_op_to_the_partitioner():
  """On several devices the op goes to XLA's partitioner with its rule (the
  kernel call is made per shard when XLA compiles for the GPUs)."""
  mesh = _cpu_mesh()
  q = jax.device_put(jnp.ones((4, 128, 8, 64), jnp.bfloat16),
                     NamedSharding(mesh, P("data", None, "model")))
  loss = lambda q: jax_dnn.dot_product_attention(q, q, q).astype(jnp.float32).sum()
  text = _cuda_text(jax.grad(loss), q)
  calls = [l for l in text.splitlines() if "custom_call @CustomSPMDPartitioning" in l]
  assert len(calls) == 2, calls  # forward and backward
  assert all("sdy.sharding_rule" in c for c in calls), calls
  assert "jax_dnn_attention_fwd" not in text.replace("CustomSPMDPartitioning", "")


def test_explicit_axes_call_the_op_per_shard():
  """Under explicit mesh axes the op is a shard_map of the per-shard call:
  each device's kernel takes its block (batch and heads split here), and
  the compiled program moves no data for the op or its gradient."""
  mesh = _cpu_mesh()
  explicit = Mesh(mesh.devices, mesh.axis_names,
                  axis_types=(jax.sharding.AxisType.Explicit,) * len(mesh.axis_names))
  loss = lambda q: jax_dnn.dot_product_attention(q, q, q).astype(jnp.float32).sum()
  with jax.set_mesh(explicit):
    q = jax.device_put(randn(45, (4, 128, 8, 64), jnp.bfloat16),
                       NamedSharding(explicit, P("data", None, "model")))
    compiled = jax.jit(jax.grad(loss)).lower(q).compile().as_text()
    text = _cuda_text(jax.grad(loss), q) if jax_dnn.has_cuda_kernels() else None
  for collective in ("all-gather", "all-to-all", "collective-permute", "all-reduce"):
    assert collective not in compiled, collective
  if text is not None:  # the kernels' calls, on one device's block [1, 128, 4, 64]
    for target in ("jax_dnn_attention_fwd", "jax_dnn_attention_bwd"):
      calls = [l for l in text.splitlines() if f"custom_call @{target}(" in l]
      assert calls and all("tensor<1x128x4x64xbf16>" in c for c in calls), (target, calls)
    assert "CustomSPMDPartitioning" not in text



def test_explicit_axes_results_keep_their_shapes():
  """Every result of a primitive under explicit axes has the shape its
  abstract eval gives (the kernels' workspace is no result: define_primitive
  adds it in each shard's CUDA lowering only)."""
  from jax_dnn._src import layer_norm as layer_norm_lib  # pylint: disable=g-import-not-at-top
  mesh = _cpu_mesh()
  explicit = Mesh(mesh.devices, mesh.axis_names,
                  axis_types=(jax.sharding.AxisType.Explicit,) * len(mesh.axis_names))
  x = randn(48, (64, 32), jnp.float32)
  scale = jnp.ones((1, 32), jnp.float32)
  stats = jnp.ones((64, 2), jnp.float32)  # the forward's (mean, rstd) a row
  bind = lambda dy, x, s, st: layer_norm_lib.layer_norm_bwd_p.bind(dy, x, s, st, epsilon=1e-6)
  want = [o.shape for o in jax.eval_shape(bind, x, x, scale, stats)]
  with jax.set_mesh(explicit):
    xs = jax.device_put(x, NamedSharding(explicit, P("data")))
    sts = jax.device_put(stats, NamedSharding(explicit, P("data")))
    got = jax.jit(bind)(xs, xs, scale, sts)
  assert [g.shape for g in got] == want

def test_mixed_explicit_and_auto_axes():
  """A mesh with one explicit and one auto axis: the op splits along the
  explicit axis its operands' types carry, and the auto axis (absent from
  the types) is replicated for it; values as on one device."""
  mesh = _cpu_mesh()
  mixed = Mesh(mesh.devices, mesh.axis_names,
               axis_types=(jax.sharding.AxisType.Explicit, jax.sharding.AxisType.Auto))
  x = randn(46, (8, 16, 32), jnp.float32)
  scale = randn(47, (32,), jnp.float32)
  loss = lambda x, s: jnp.sum(jax_dnn.layer_norm(x, s) ** 2)
  want = _on_one_device(mesh, jax.value_and_grad(loss, argnums=(0, 1)), (x, scale))
  with jax.set_mesh(mixed):
    xs = jax.device_put(x, NamedSharding(mixed, P("data", None, "model")))
    got = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(xs, scale)
    y = jax.jit(lambda a: jax_dnn.softmax(a) * 2)(xs)
  assert _full(y.sharding.spec, 3) == _full(P("data"), 3)
  assert _full(got[1][0].sharding.spec, 3) == _full(P("data"), 3)
  _assert_close(mesh, got, want, "layer_norm")

def test_rules_split_what_they_should():
  """The rules themselves: which factors may split."""
  from jax_dnn._src import attention, layer_norm, softmax  # pylint: disable=g-import-not-at-top
  from jax_dnn._src import sharding  # pylint: disable=g-import-not-at-top

  def splittable(rule, array):
    return [rule.split_name(f) is not None for f in array]

  r = softmax._sharding([(4, 6, 8)], [(4, 6, 8)], axis=1, log=False)
  assert splittable(r, r.operands[0]) == [True, False, True]
  r = layer_norm._sharding([(4, 6, 8), (1, 8), (1, 8)], [(4, 6, 8), (4, 6, 2)], epsilon=1e-6,
                           rms=False)
  assert splittable(r, r.operands[0]) == [True, True, False]
  assert splittable(r, r.results[1]) == [True, True, False]  # stats split with their rows
  params = dict(present=(), scale=1.0, softcap=0.0, is_causal=False, window=None,
                deterministic=False)
  r = attention._sharding([(2, 16, 8, 64), (2, 24, 2, 64), (2, 24, 2, 32)],
                          [(2, 16, 8, 32), (2, 8, 16), (0,)], **params)
  assert splittable(r, r.operands[0]) == [True, False, True, False]
  assert r.split_name(r.operands[0][2]) == r.split_name(r.operands[1][2]) == "k"
  assert "need_replication_factors" in sharding.sdy_options(r)
