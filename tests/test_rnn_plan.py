"""The recurrence kernels' plan (ffi/rnn/rnn_plan.h) through
jax_dnn._src.plans.rnn_plan, as the CUDA lowering asks it: which variant a
problem takes (units a block, streamed weights, state in the workspace), the
reasons it declines, and the workspace sizes, checked against the rules the
plan's C++ comments state. CPU: the plans are built in every build."""

import pytest

from jax_dnn._src import extension
from jax_dnn._src import plans

if extension.module() is None or not hasattr(extension.module(), "rnn_plan"):
  pytest.skip("jax_dnn's extension is not built (or predates rnn_plan): no plans",
              allow_module_level=True)

GATES = {"lstm": 4, "gru": 3, "rnn_tanh": 1, "rnn_relu": 1}
BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
MAX_SMEM = 227 * 1024


def _plan(kind, dtype, t, b, h, sms=132):
  return plans.rnn_plan(kind, dtype, t, b, h, plans.device_props(sm_count=sms))


def _up(v, m):
  return -(-v // m) * m


def _workspaces(kind, dtype, b, h, units, streamed, global_state):
  """rnn_plan.h's layout: two exchange buffers (h [Bp, Hp] forward, the gate
  gradients [Bp, GHp] backward, input dtype; Hp and GHp: H and G H padded to
  64 bytes) rounded to 256 bytes; then, when streamed, each block's padded
  weight slice (forward N rows, backward U rows, each row 64 bytes past a
  multiple of 128) rounded to 256; then, with the state in the workspace,
  Bp x U floats a block forward and twice that backward; then 256 bytes for
  the grid barrier's counter."""
  g, e = GATES[kind], BYTES[dtype]
  bp, blocks = _up(b, 16), -(-h // units)
  hp, ghp = _up(h, 64 // e), _up(g * h, 64 // e)
  fwd = _up(2 * bp * hp * e, 256)
  bwd = _up(2 * bp * ghp * e, 256)
  if streamed:
    fwd += _up(blocks * g * units * (_up(hp * e, 128) + 64), 256)
    bwd += _up(blocks * units * (_up(ghp * e, 128) + 64), 256)
  if global_state:
    fwd += blocks * bp * units * 4
    bwd += blocks * 2 * bp * units * 4
  # Last, the grid barrier's counter, at a 256-byte boundary.
  return _up(fwd, 256) + 256, _up(bwd, 256) + 256


@pytest.mark.parametrize("kind, dtype, t, b, h, sms, want", [
    # (units, streamed, global_state, blocks): the smallest U whose
    # ceil(H / U) blocks fit one a SM, weights and state in shared memory first.
    ("lstm", "bfloat16", 1024, 16, 768, 132, (8, False, False, 96)),
    ("lstm", "bfloat16", 256, 64, 512, 132, (8, False, False, 64)),
    ("lstm", "bfloat16", 128, 256, 1024, 132, (8, False, False, 128)),
    ("lstm", "float32", 128, 256, 1024, 132, (8, False, False, 128)),  # 133 KiB of fp32 rows
    ("gru", "bfloat16", 1024, 16, 768, 132, (8, False, False, 96)),
    ("rnn_tanh", "float16", 1000, 8, 64, 132, (8, False, False, 8)),
    ("rnn_relu", "bfloat16", 131072, 2, 128, 132, (8, False, False, 16)),
    ("lstm", "bfloat16", 10, 3, 33, 132, (8, False, False, 5)),  # H not a multiple of 8
    ("lstm", "bfloat16", 10, 1, 1, 132, (8, False, False, 1)),
    # Past 132 blocks of 8: 16 units a block.
    ("lstm", "bfloat16", 10, 16, 1100, 132, (16, False, False, 69)),
    ("gru", "bfloat16", 10, 16, 1100, 100, (16, False, False, 69)),
    ("lstm", "bfloat16", 10, 16, 1100, 0, (16, False, False, 69)),  # no device: 132 SMs
    ("lstm", "bfloat16", 10, 16, 1100, 160, (8, False, False, 138)),
    # H = 2048 LSTM bf16: 64 rows of 2080 elements (260 KiB) do not fit: streamed.
    ("lstm", "bfloat16", 10, 16, 2048, 132, (16, True, False, 128)),
    ("lstm", "float32", 10, 16, 2048, 132, (16, True, False, 128)),
    ("rnn_tanh", "bfloat16", 10, 16, 2048, 132, (16, False, False, 128)),
    # Large batches: the per-row state moves to the workspace, weights stay.
    ("lstm", "bfloat16", 10, 5000, 512, 132, (8, False, True, 64)),
    ("gru", "float32", 10, 100000, 256, 132, (8, False, True, 32)),
])
def test_plan_takes(kind, dtype, t, b, h, sms, want):
  plan = _plan(kind, dtype, t, b, h, sms)
  assert plan.supported and plan.reason == "", plan.reason
  assert (plan.units, plan.streamed, plan.global_state, plan.blocks) == want
  assert plan.fwd_smem_bytes <= MAX_SMEM and plan.bwd_smem_bytes <= MAX_SMEM
  assert (plan.fwd_workspace_bytes, plan.bwd_workspace_bytes) == _workspaces(
      kind, dtype, b, h, *want[:3])
  # The variant id: rnn_plan.h's table (U = 8, 16, 32 within each of resident,
  # resident + state in the workspace, streamed, streamed + state).
  units, streamed, global_state, _ = want
  assert plan.variant == 6 * streamed + 3 * global_state + {8: 0, 16: 1, 32: 2}[units]
  assert plans.rnn_variant_workspace_bytes(kind, dtype, b, h, plan.variant) == (
      plan.fwd_workspace_bytes, plan.bwd_workspace_bytes)


@pytest.mark.parametrize("variant", range(12))
def test_variant_workspaces(variant):
  """Every variant's workspaces follow the layout, whichever the plan picks."""
  units = (8, 16, 32)[variant % 3]
  streamed, global_state = variant >= 6, variant % 6 >= 3
  got = plans.rnn_variant_workspace_bytes("gru", "float16", 37, 100, variant)
  assert got == _workspaces("gru", "float16", 37, 100, units, streamed, global_state)


def test_variant_out_of_range():
  with pytest.raises(ValueError, match="no such variant"):
    plans.rnn_variant_workspace_bytes("lstm", "bfloat16", 4, 64, 12)


def test_workspace_grows_with_batch_not_steps():
  """The workspaces hold per-step buffers only: T does not enter."""
  a, b = _plan("lstm", "bfloat16", 10, 16, 768), _plan("lstm", "bfloat16", 300000, 16, 768)
  assert (a.fwd_workspace_bytes, a.bwd_workspace_bytes) == (b.fwd_workspace_bytes,
                                                            b.bwd_workspace_bytes)
  c = _plan("lstm", "bfloat16", 10, 17, 768)
  # 17 rows pad to 32: twice the exchange buffers, the same barrier counter.
  assert c.fwd_workspace_bytes - 256 == 2 * (a.fwd_workspace_bytes - 256)


@pytest.mark.parametrize("kind, dtype, t, b, h, sms, why", [
    ("lstm", "bfloat16", 0, 4, 64, 132, "empty"),
    ("lstm", "bfloat16", 4, 0, 64, 132, "empty"),
    ("gru", "bfloat16", 4, 4, 0, 132, "empty"),
    ("lstm", "float64", 4, 4, 64, 132, "float64"),
    ("lstm", "int8", 4, 4, 64, 132, "int8"),
    ("lstm", "bfloat16", 4, 4, 4225, 132, "more than 132 blocks of 32 units"),
    ("rnn_tanh", "bfloat16", 4, 4, 1025, 32, "more than 32 blocks of 32 units"),
    ("lstm", "bfloat16", 2**31, 4, 64, 132, "below 2^31"),
])
def test_plan_declines(kind, dtype, t, b, h, sms, why):
  plan = _plan(kind, dtype, t, b, h, sms)
  assert not plan.supported and why in plan.reason, plan.reason
  assert plan.variant == -1


def test_by_default_up_to_batch_64():
  """Past 64 rows the kernels still take a problem (the plan's variant runs
  when asked) but the op runs the scan by default."""
  assert _plan("lstm", "bfloat16", 8, 64, 512).by_default
  big = _plan("lstm", "bfloat16", 8, 65, 512)
  assert big.supported and not big.by_default
  assert not _plan("lstm", "bfloat16", 0, 4, 64).by_default


def test_plan_bounds():
  """32 units a block at 132 SMs reach H = 4224; one more unit declines."""
  assert _plan("rnn_tanh", "bfloat16", 4, 4, 4224).supported
  assert not _plan("rnn_tanh", "bfloat16", 4, 4, 4225).supported


def test_unknown_kind_raises():
  with pytest.raises(ValueError, match="kind must be 'lstm', 'gru', 'rnn_tanh' or 'rnn_relu'"):
    _plan("mgu", "bfloat16", 4, 4, 64)


def test_current_device_default():
  """Without a device argument the plan takes the current device's SMs (132
  assumed where none is known, as in a CPU-only build)."""
  plan = plans.rnn_plan("lstm", "bfloat16", 16, 16, 1100)
  assert plan.supported
  if plans.current_device().sm_count == 0:
    assert plan.units == 16


@pytest.mark.skipif(not extension.has_cuda_kernels(), reason="no CUDA kernels in this build")
def test_targets_registered():
  assert {"jax_dnn_rnn_fwd", "jax_dnn_rnn_bwd"} <= set(extension.registered_targets())


@pytest.mark.parametrize("kind, dtype, h, units, blocks", [
    # One direction takes U = 8 (96 blocks); two need 2 x 48 blocks of 16.
    ("lstm", "bfloat16", 768, 16, 48),
    ("lstm", "bfloat16", 1024, 16, 64),
    ("gru", "float32", 24, 8, 3),
])
def test_two_directions(kind, dtype, h, units, blocks):
  """Both directions of a bidirectional layer side by side: 2 x blocks <= the
  SMs, the smallest U that fits, a workspace slice a direction."""
  two = plans.rnn_plan(kind, dtype, 10, 16, h, plans.device_props(sm_count=132), directions=2)
  assert two.supported and two.directions == 2, two.reason
  assert (two.units, two.blocks) == (units, blocks)
  one = plans.rnn_variant_workspace_bytes(kind, dtype, 16, h, two.variant)
  assert (two.fwd_workspace_bytes, two.bwd_workspace_bytes) == (2 * one[0], 2 * one[1])
  assert _plan(kind, dtype, 10, 16, h).directions == 1


def test_two_directions_decline():
  """H = 4224 fits one direction (132 blocks of 32), not two; three
  directions are no layer's."""
  device = plans.device_props(sm_count=132)
  assert _plan("rnn_tanh", "bfloat16", 4, 4, 4224).supported
  two = plans.rnn_plan("rnn_tanh", "bfloat16", 4, 4, 4224, device, directions=2)
  assert not two.supported and "in two directions" in two.reason, two.reason
  three = plans.rnn_plan("lstm", "bfloat16", 4, 4, 64, device, directions=3)
  assert not three.supported and "directions must be 1 or 2" in three.reason
