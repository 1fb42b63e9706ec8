"""The kernels' plans (ffi/<op>/<op>_plan.h), asked through jax_dnn._src.plans
as the CUDA lowering asks them. Each case checks an answer against the rule
the plan's C++ comment states, for a device given here (the plans take its
SM count) or for none. CPU: the plans are built in every build."""

import pytest

from jax_dnn._src import extension
from jax_dnn._src import plans

if extension.module() is None:
  pytest.skip("jax_dnn's extension is not built: no plans", allow_module_level=True)

H100 = dict(sm_count=132)


def _shape(b=1, t=1024, s=1024, n=8, kh=None, h=128, hv=None):
  return plans.attention_shape(b=b, t=t, s=s, n=n, kh=n if kh is None else kh, h=h,
                               hv=h if hv is None else hv)


def test_no_device_in_a_cpu_build():
  props = plans.current_device()
  assert props.sm_count >= 0
  if not extension.has_cuda_kernels():
    assert props.sm_count == 0


@pytest.mark.parametrize("dtype, kw, takes", [
    ("bfloat16", dict(h=64), True),
    ("float16", dict(h=128), True),
    ("bfloat16", dict(h=192, hv=128), True),  # MLA-style
    ("bfloat16", dict(h=96), True),  # pads to 128
    ("bfloat16", dict(h=256), True),
    ("float32", dict(h=128), False),  # bf16 / fp16 only
    ("float64", dict(h=128), False),
    ("bfloat16", dict(h=60), False),  # not a multiple of 8
    ("bfloat16", dict(h=320), False),  # pads past 256
    ("bfloat16", dict(h=128, hv=64), False),  # a pair without a kernel
    ("bfloat16", dict(b=0), False),  # empty
    ("bfloat16", dict(s=0), False),
    ("bfloat16", dict(t=2**31 - 256), False),  # the kernels' 32-bit positions
    ("bfloat16", dict(t=2**31 - 257), True),
])
def test_attention_unsupported(dtype, kw, takes):
  why = plans.attention_unsupported(dtype, _shape(**kw))
  assert (why is None) == takes, why


@pytest.mark.parametrize("kw, opts, kernel", [
    # 192-row tiles at head dims 128 from 2048 keys and queries, 64 from 512.
    (dict(t=2048, s=2048), {}, (192, 128, False)),
    (dict(t=2047, s=4096), {}, (128, 128, False)),
    (dict(t=512, s=512, h=64), {}, (192, 128, False)),
    (dict(t=511, s=8192, h=64), {}, (128, 176, False)),
    # 128-key tiles up to S = 4096, 176 beyond; 128 under a causal mask or window.
    (dict(t=1000, s=4096), {}, (128, 128, False)),
    (dict(t=1000, s=4097), {}, (128, 176, False)),
    (dict(t=8192, s=8192), dict(causal=True), (128, 128, False)),
    (dict(t=8192, s=8192), dict(window_left=64), (128, 128, False)),
    # Sequence lengths give tiles different keys: no 192-row tiles.
    (dict(t=4096, s=4096), dict(kv_lens=True), (128, 128, False)),
    # The general logits path: soft-cap, bias, mask, segments, scale <= 0.
    (dict(t=4096, s=4096), dict(softcap=30.0), (128, 128, True)),
    (dict(t=4096, s=4096), dict(mask=True), (128, 128, True)),
    (dict(t=4096, s=4096), dict(scale=-1.0), (128, 128, True)),
    # 64-key tiles past head dims 128.
    (dict(t=4096, s=4096, h=256), {}, (128, 64, False)),
    (dict(t=4096, s=4096, h=192, hv=128), dict(segments=True), (128, 64, True)),
])
def test_attention_fwd_kernel(kw, opts, kernel):
  assert plans.attention_fwd_kernel(_shape(**kw), plans.attention_options(**opts)) == kernel


def _split_elems(sms, rows, hv):
  """The split tail's workspace: 2 slots a CTA (one CTA an SM) of a work
  tile's rows x (Hv padded to 64, + 1) floats."""
  return 2 * sms * rows * (-(-hv // 64) * 64 + 1)


@pytest.mark.parametrize("kw, opts, sms, splits", [
    (dict(t=4096, s=4096, n=7), {}, 132, True),  # 22 x 7 = 154 work tiles of 192 rows
    (dict(t=4096, s=4096, n=7), {}, 160, False),  # no more tiles than SMs
    (dict(t=4096, s=4096, n=7), {}, 0, False),  # no device known: no split
    (dict(t=900, s=4096, n=27, h=64), {}, 132, True),  # 5 x 27 = 135 of 192 rows
    (dict(t=2000, s=8192, n=11), {}, 132, True),  # 16 x 11 = 176 of 128 rows, 176 keys
    (dict(t=2048, s=2048, n=64), {}, 132, False),  # 16 key tiles: the split does not pay
    (dict(t=4096, s=4096, n=7), dict(causal=True), 132, False),  # tiles see different keys
    (dict(t=4096, s=4096, n=7), dict(q_lens=True), 132, False),
    (dict(t=4096, s=4096, n=7), dict(bias=True), 132, False),  # the general path
    (dict(t=4096, s=8192, n=7, h=256), {}, 132, False),  # Hv past 128
    (dict(t=4096, s=8192, n=40, h=192, hv=128), {}, 132, True),  # 64-key tiles, Hv 128
])
def test_attention_fwd_workspace(kw, opts, sms, splits):
  shape, options = _shape(**kw), plans.attention_options(**opts)
  elems = plans.attention_fwd_workspace_elems(shape, options, plans.device_props(sm_count=sms))
  rows = plans.attention_fwd_kernel(shape, options)[0]
  assert elems == (_split_elems(sms, rows, shape.hv) if splits else 0)


@pytest.mark.parametrize("kw, opts, deterministic, fused", [
    (dict(h=128), {}, False, True),
    (dict(h=64), dict(causal=True, q_lens=True, window_left=3), False, True),
    (dict(h=96), {}, False, True),  # pads to 128
    (dict(h=128), {}, True, False),  # bitwise reproducible: the split
    (dict(h=128), dict(bias=True), False, False),
    (dict(h=128), dict(mask=True), False, False),
    (dict(h=128), dict(segments=True), False, False),
    (dict(h=128), dict(softcap=5.0), False, False),
    (dict(h=192), {}, False, False),
    (dict(h=128, hv=64), {}, False, False),
])
def test_attention_bwd_fused_dq(kw, opts, deterministic, fused):
  assert plans.attention_bwd_fused_dq(_shape(**kw), plans.attention_options(**opts),
                                      deterministic) == fused


@pytest.mark.parametrize("t, h, rows", [(16, 128, 64), (16, 64, 128), (130, 64, 128),
                                        (129, 96, 64), (64, 128, 64)])
def test_attention_dq_acc(t, h, rows):
  """Query rows padded to the single pass's query tile (128 at head dim 64,
  64 at 128) x the head dim padded to 64."""
  d = -(-h // 64) * 64
  assert plans.attention_dq_acc_head_elements(t, h) == -(-t // rows) * rows * d


@pytest.mark.parametrize("rows, param_sets, width, rms, sms, parts", [
    (1 << 20, 1, 1024, False, 132, 320),  # at least 320 in all
    (1 << 20, 1, 1024, False, 0, 320),  # no device known
    (1 << 20, 1, 1024, True, 200, 400),  # two an SM past 160 SMs
    (1 << 20, 3, 1024, False, 132, 107),  # 320 over the param_sets
    (50, 1, 1024, False, 132, 50),  # no more than a group's rows
    (0, 1, 1024, False, 132, 1),  # at least one
    (1 << 20, 1, 1 << 20, False, 132, 32),  # 256 MiB: 2^26 floats / (2 sums x 2^20)
    (1 << 20, 1, 1 << 20, True, 132, 64),
])
def test_layer_norm_bwd_parts(rows, param_sets, width, rms, sms, parts):
  device = plans.device_props(sm_count=sms)
  assert plans.layer_norm_bwd_parts(rows, param_sets, width, rms, device) == parts


@pytest.mark.parametrize("rows, param_sets, width, dtype, sms, parts", [
    # 8 blocks an SM (1056 on 132 SMs) over the column blocks of 32 lanes,
    # each 16 bytes of x where the width allows.
    (1 << 20, 1, 4096, "bfloat16", 132, 66),  # 256 columns a block: 16 blocks
    (1 << 20, 1, 4096, "float32", 132, 33),  # 128 columns a block: 32 blocks
    (1 << 20, 1, 4097, "bfloat16", 132, 9),  # unaligned: 32 columns, 129 blocks
    (1 << 20, 1, 4096, "bfloat16", 0, 64),  # no device known: 1024 blocks
    (1 << 20, 2, 4096, "float16", 132, 33),
    (80, 1, 4096, "bfloat16", 132, 10),  # no more than a group's 8-row steps
    (1 << 20, 2, 8, "bfloat16", 10**5, 32767),  # gridDim.y: param_sets x parts <= 65535
])
def test_bias_act_bwd_parts(rows, param_sets, width, dtype, sms, parts):
  device = plans.device_props(sm_count=sms)
  assert plans.bias_act_bwd_parts(rows, param_sets, width, dtype, device) == parts
