"""The convolution's algorithm registry (ffi/conv/conv_plan.h), asked of the
extension as Python's plans ask it: each case checks an answer against the
rule conv_plan.h states. CPU: the plans are built in every build, and answer
for the kernels a CUDA build has."""

import pytest

from jax_dnn._src import extension

ext = extension.module()
if ext is None:
  pytest.skip("jax_dnn's extension is not built: no plans", allow_module_level=True)

H100 = 132
IGEMM_128 = "implicit_gemm_128x128"
IGEMM_64 = "implicit_gemm_128x64"
GEMM_1X1 = "gemm_1x1"
DEPTHWISE = "depthwise_direct"
GROUPED = "grouped_direct"
ALL = [IGEMM_128, IGEMM_64, GEMM_1X1, DEPTHWISE, GROUPED]


def _out(i, w, s, d, lo, hi):
  return (i + lo + hi - (w - 1) * d - 1) // s + 1


def problem(op="fwd", dtype="bfloat16", *, n=8, c=64, k=64, groups=1, spatial=(56, 56),
            window=(3, 3), stride=1, dilation=1, pad=None, output=None, **kw):
  """A ConvProblem of rank len(spatial) (an int applies to every spatial axis);
  padding (both sides) defaults to (window - 1) * dilation // 2."""
  rank = len(spatial)
  lead = 3 - rank
  expand = lambda v, fill=1: [fill] * lead + list(v if isinstance(v, (tuple, list)) else [v] * rank)
  inp, win = expand(spatial), expand(window)
  st, dil = expand(stride), expand(dilation)
  if pad is None:
    pad = [((w - 1) * d) // 2 for w, d in zip(win[lead:], dil[lead:])]
  lo = expand(pad, 0)
  hi = list(lo)
  if output is None:
    output = [_out(*a) for a in zip(inp, win, st, dil, lo, hi)]
  return ext.ConvProblem(op, dtype, n, c, k, groups, inp, win, output, st, dil, lo, hi, rank, **kw)


def dev(sm_count=H100):
  return ext.DeviceProps(sm_count=sm_count)


def algorithms(p, sm_count=H100):
  return {a.name: a for a in ext.conv_algorithms(p, dev(sm_count))}


def test_every_algorithm_answers():
  for op in ("fwd", "dgrad", "wgrad"):
    algos = ext.conv_algorithms(problem(op), dev())
    assert [a.name for a in algos] == ALL
    assert len({a.id for a in algos}) == len(ALL)
    for a in algos:
      assert a.workspace_bytes >= 0
      assert a.supported == (a.reason == ""), a


@pytest.mark.parametrize("op, k, c, tile", [
    # The 128 x 64 tile where the GEMM's N (fprop's K, dgrad's C) is <= 64.
    ("fwd", 64, 64, IGEMM_64),
    ("fwd", 64, 256, IGEMM_64),
    ("fwd", 128, 64, IGEMM_128),
    ("fwd", 256, 256, IGEMM_128),
    ("dgrad", 256, 64, IGEMM_64),
    ("dgrad", 64, 128, IGEMM_128),
])
def test_tile_choice(op, k, c, tile):
  plan = ext.conv_plan(problem(op, c=c, k=k), False, dev())
  assert plan.supported and plan.name == tile, plan
  assert plan.deterministic


@pytest.mark.parametrize("op, dtype, kw, name", [
    # A 1x1 convolution (window 1, stride 1, no padding) runs as a plain GEMM
    # where one is built (bf16 fprop and dgrad, any rank), with any channels.
    ("fwd", "bfloat16", dict(c=64, k=256), GEMM_1X1),
    ("dgrad", "bfloat16", dict(c=1024, k=256), GEMM_1X1),
    ("fwd", "bfloat16", dict(spatial=(8, 8, 8), window=(1, 1, 1)), GEMM_1X1),
    ("fwd", "bfloat16", dict(spatial=(1000,), window=(1,)), GEMM_1X1),
    ("fwd", "bfloat16", dict(c=64, k=256, activation=0, bias=True, residual=True), GEMM_1X1),
    ("fwd", "float16", dict(c=64, k=256), IGEMM_128),  # no fp16 GEMM built
    ("fwd", "bfloat16", dict(c=256, k=512, stride=2), IGEMM_128),  # strided: implicit GEMM
    ("fwd", "bfloat16", dict(c=64, k=64, pad=1), IGEMM_64),  # padded
    ("fwd", "bfloat16", dict(c=64, k=256, activation=1), None),  # gelu: fused by neither
])
def test_gemm_1x1(op, dtype, kw, name):
  kw = dict(kw)
  kw.setdefault("window", (1,) * len(kw.get("spatial", (56, 56))))
  kw.setdefault("pad", 0)
  plan = ext.conv_plan(problem(op, dtype, **kw), False, dev())
  assert plan.name == (name or "none"), plan
  if name:
    assert plan.deterministic and plan.workspace_bytes == 0
  wgrad = algorithms(problem("wgrad", "float16", window=(1, 1), pad=0))[GEMM_1X1]
  assert not wgrad.supported and "built" in wgrad.reason


def _wgrad_1x1(**kw):
  return problem("wgrad", window=(1, 1), pad=0, **kw)


@pytest.mark.parametrize("kw, sm_count, splits", [
    # ceil(SMs / output tiles) splits, each >= 8 K tiles of 64 pixels, <= 32.
    (dict(n=8, c=64, k=256), 132, 32),  # 2 tiles, 392 K tiles: 66 capped at 32
    (dict(n=8, c=256, k=256), 132, 32),  # 4 tiles: ceil(132 / 4) = 33, capped at 32
    (dict(n=2, spatial=(16, 16), c=64, k=64), 132, 1),  # 8 K tiles: one split of 8
    (dict(n=1, spatial=(8, 8), c=64, k=64), 132, 1),  # 1 K tile: no split
    (dict(n=8, c=2048, k=2048), 132, 1),  # 256 tiles fill the SMs
    (dict(n=8, c=1024, k=1024), 32, 1),  # 64 tiles >= 32 SMs
    (dict(n=8, c=1024, k=1024), 0, 3),  # no device: 132 SMs assumed, ceil(132 / 64)
])
def test_gemm_1x1_wgrad_splits(kw, sm_count, splits):
  """The splits show in the workspace: none for one split, else CUTLASS's
  split-K reduction space for every output tile."""
  p = _wgrad_1x1(**kw)
  plan = ext.conv_plan(p, False, dev(sm_count))
  assert plan.name == GEMM_1X1 and plan.deterministic, plan
  tiles = -(-p.k // 128) * -(-p.c // 128)
  k_tiles = -(-p.n * p.input[1] * p.input[2] // 64)
  sms = sm_count or 132
  assert splits == max(1, min(-(-sms // tiles), k_tiles // 8, 32))
  if splits == 1:
    assert plan.workspace_bytes == 0
  else:
    # An fp32 128 x 128 tile an output tile, and barrier words, 1 KiB-aligned.
    assert tiles * 128 * 128 * 4 < plan.workspace_bytes <= tiles * 128 * 128 * 4 + 2048


def test_tile_falls_back_where_one_is_not_built():
  # No 128 x 64 kernel in 3D or for float32: K = 64 runs on 128 x 128.
  p = problem(spatial=(16, 16, 16), window=(3, 3, 3), c=64, k=64)
  assert not algorithms(p)[IGEMM_64].supported
  assert ext.conv_plan(p, False, dev()).name == IGEMM_128
  p = problem(dtype="float32", c=64, k=64)
  assert "built" in algorithms(p)[IGEMM_64].reason
  assert ext.conv_plan(p, False, dev()).name == IGEMM_128


@pytest.mark.parametrize("op, dtype, rank, takes", [
    ("fwd", "bfloat16", 2, True), ("fwd", "float16", 2, True), ("fwd", "float32", 2, True),
    ("fwd", "bfloat16", 3, True), ("fwd", "float16", 3, False), ("fwd", "float32", 3, False),
    ("dgrad", "bfloat16", 2, True), ("dgrad", "float16", 2, True), ("dgrad", "float32", 2, False),
    ("dgrad", "bfloat16", 3, True), ("dgrad", "float16", 3, False),
    ("wgrad", "bfloat16", 2, True), ("wgrad", "float16", 2, True), ("wgrad", "float32", 2, False),
    ("wgrad", "bfloat16", 3, True), ("wgrad", "float16", 3, False),
    ("fwd", "bfloat16", 1, True), ("wgrad", "float16", 1, True),  # 1D on the 2D kernels
])
def test_built_kernels(op, dtype, rank, takes):
  spatial = {1: (4096,), 2: (56, 56), 3: (16, 16, 16)}[rank]
  p = problem(op, dtype, spatial=spatial, window=(3,) * rank, c=512, k=512)
  a = algorithms(p)[IGEMM_128]
  assert a.supported == takes, a.reason
  if not takes:
    assert "built" in a.reason
  if dtype == "float32" and op != "fwd":
    assert "TF32" in a.reason


def test_float32_gradients_have_no_kernel():
  plan = ext.conv_plan(problem("dgrad", "float32"), False, dev())
  assert not plan.supported and plan.id == -1
  for name in ALL:
    assert name + ":" in plan.reason


@pytest.mark.parametrize("dtype, c, k, takes", [
    ("bfloat16", 64, 64, True),
    ("bfloat16", 3, 64, False),  # the ResNet stem: 16-byte TMA rows need C % 8 == 0
    ("float16", 64, 60, False),
    ("float16", 24, 40, True),
    ("float32", 4, 12, True),  # 16 bytes = 4 floats
    ("float32", 6, 12, False),
])
def test_channel_alignment(dtype, c, k, takes):
  a = algorithms(problem(dtype=dtype, c=c, k=k))[IGEMM_128]
  assert a.supported == takes, a.reason
  if not takes:
    assert "multiples of" in a.reason


def test_groups_take_the_direct_kernels_when_deterministic():
  grouped = algorithms(problem(c=128, k=128, groups=32))
  assert not grouped[IGEMM_128].supported and "groups" in grouped[IGEMM_128].reason
  # Depthwise (groups == C): the depthwise kernel's own rules decide;
  # grouped (2-16 channels a group): grouped_direct's. The heuristic
  # (DirectByDefault) leaves 3x3 windows to XLA unless deterministic.
  for p, name in ((problem(c=64, k=64, groups=64), DEPTHWISE),
                  (problem(c=128, k=128, groups=32), GROUPED)):
    a = algorithms(p)[name]
    assert a.supported and a.deterministic and a.workspace_bytes >= 0, a
    plan = ext.conv_plan(p, False, dev())
    assert not plan.supported and "DirectByDefault" in plan.reason, plan
    plan = ext.conv_plan(p, True, dev())
    assert plan.name == name and plan.workspace_bytes == a.workspace_bytes
  # Depthwise 7x7 at stride 1 in 16-bit types runs the direct kernel by
  # default (fprop, dgrad), not at stride 2, in fp32, or for wgrad.
  big = dict(c=128, k=128, groups=128, window=(7, 7))
  for op, dtype, stride, takes in (("fwd", "bfloat16", 1, True), ("dgrad", "float16", 1, True),
                                   ("wgrad", "bfloat16", 1, False), ("fwd", "float32", 1, False),
                                   ("fwd", "bfloat16", 2, False)):
    p = problem(op=op, dtype=dtype, stride=stride, **big)
    assert algorithms(p)[DEPTHWISE].supported, (op, dtype, stride)
    assert (ext.conv_plan(p, False, dev()).name == DEPTHWISE) == takes, (op, dtype, stride)
  # Each takes only its own kind of groups.
  assert not algorithms(problem(c=64, k=64, groups=64))[GROUPED].supported
  assert not algorithms(problem(c=128, k=128, groups=32))[DEPTHWISE].supported
  assert not algorithms(problem(c=64, k=64))[GROUPED].supported


@pytest.mark.parametrize("op, dtype, kw, words", [
    # ResNeXt 32x4d's 3x3 (4 channels a group), its strided variant, other
    # group widths, ranks and dtypes; None: taken.
    ("fwd", "bfloat16", dict(c=128, k=128, groups=32), None),
    ("dgrad", "bfloat16", dict(c=128, k=128, groups=32), None),
    ("fwd", "bfloat16", dict(c=256, k=256, groups=32, stride=2), None),
    ("fwd", "float16", dict(c=64, k=128, groups=16, activation=3, bias=True, residual=True), None),
    ("fwd", "float32", dict(c=48, k=48, groups=4), None),  # 12 channels a group
    ("fwd", "bfloat16", dict(c=48, k=24, groups=8), None),  # 6 in, 3 out a group
    ("dgrad", "bfloat16", dict(c=48, k=24, groups=8, dilation=2), None),
    ("fwd", "bfloat16", dict(c=256, k=256, groups=16, window=(7, 7)), None),  # 16 a group
    ("fwd", "bfloat16", dict(c=64, k=64, groups=8, spatial=(9, 10, 11), window=(3, 3, 3)), None),
    ("fwd", "bfloat16", dict(c=64, k=64, groups=8, spatial=(1000,), window=(5,)), None),
    ("fwd", "bfloat16", dict(c=64, k=64, groups=8, pad=4), None),  # padding past the window
    # wgrad: 1D/2D windows, 2, 4, 8 or 16 channels a group, K / groups even.
    ("wgrad", "bfloat16", dict(c=128, k=128, groups=32), None),
    ("wgrad", "float32", dict(c=256, k=256, groups=32, stride=2), None),
    ("wgrad", "float16", dict(c=32, k=64, groups=2, window=(5, 5)), None),
    ("wgrad", "bfloat16", dict(c=64, k=64, groups=8, spatial=(1000,), window=(7,)), None),
    # Not taken.
    ("fwd", "bfloat16", dict(c=256, k=256, groups=8), "past 16"),  # 32 a group: XLA
    ("wgrad", "bfloat16", dict(c=64, k=64, groups=8, spatial=(9, 10, 11), window=(3, 3, 3)),
     "3D windows"),
    ("wgrad", "bfloat16", dict(c=48, k=48, groups=8), "2, 4, 8 or 16"),
    ("wgrad", "bfloat16", dict(c=48, k=24, groups=8), "2, 4, 8 or 16"),
    ("wgrad", "bfloat16", dict(c=64, k=24, groups=8), "even K / groups"),
    ("dgrad", "bfloat16", dict(c=128, k=128, groups=32, stride=2), "strided dgrad"),
    ("fwd", "bfloat16", dict(c=12, k=12, groups=3), "multiples of 8"),  # 16-byte rows
    ("fwd", "bfloat16", dict(c=64, k=64, groups=64), "depthwise"),
    ("fwd", "bfloat16", dict(c=64, k=64, groups=4, window=(41, 41), pad=20), "shared memory"),
])
def test_grouped_direct_rules(op, dtype, kw, words):
  a = algorithms(problem(op, dtype, **kw))[GROUPED]
  if words is None:
    assert a.supported and a.deterministic, a.reason
    if op == "wgrad":
      # Partials of K * taps * C/G floats a part, and the fp32 sum unless dw is fp32.
      p = problem(op, dtype, **kw)
      width = p.k * p.window[0] * p.window[1] * p.window[2] * (p.c // p.groups) * 4
      assert a.workspace_bytes >= width * (1 if dtype == "float32" else 2), a
      assert a.workspace_bytes <= algorithms(p, sm_count=0)[GROUPED].workspace_bytes
    else:
      assert a.workspace_bytes == 0
    assert ext.conv_plan(problem(op, dtype, **kw), True, dev()).name == GROUPED
  else:
    assert not a.supported and a.reason.startswith(GROUPED + ":") and words in a.reason, a.reason


def test_depthwise_direct_still_takes_what_the_tiled_kernel_does_not():
  # The tiled kernel runs fprop and stride-1 dgrad with channels a multiple
  # of 16 bytes; the rest (multiplier, odd channels, strided dgrad) runs the
  # other direct kernels: depthwise_direct takes them all.
  for op, kw in (("fwd", dict(c=12, k=12, groups=12)), ("fwd", dict(c=16, k=48, groups=16)),
                 ("dgrad", dict(c=64, k=64, groups=64, stride=2)),
                 ("dgrad", dict(c=10, k=20, groups=10, window=(5, 5))),
                 ("wgrad", dict(c=64, k=64, groups=64, window=(7, 7)))):
    a = algorithms(problem(op, **kw))[DEPTHWISE]
    assert a.supported and a.deterministic, (op, kw, a.reason)


@pytest.mark.parametrize("activation, takes", [(-1, True), (0, True), (1, False), (3, False)])
def test_fused_activations(activation, takes):
  p = problem(activation=activation, bias=True, residual=True)
  a = algorithms(p)[IGEMM_128]
  assert a.supported == takes, a.reason
  if not takes:
    assert "activation" in a.reason
  # Only fprop has an epilogue to fuse into.
  assert algorithms(problem("dgrad", activation=activation))[IGEMM_128].supported


@pytest.mark.parametrize("op, stride, takes", [
    ("fwd", 2, True), ("wgrad", 2, True), ("dgrad", 1, True),
    ("dgrad", 2, False),  # CUTLASS's sm90 dgrad has no strided kernel
    ("fwd", 8, True), ("fwd", 9, False),  # the im2col TMA's traversal stride
])
def test_strides(op, stride, takes):
  p = problem(op, stride=stride, spatial=(64, 64), c=256, k=256)
  a = algorithms(p)[IGEMM_128]
  assert a.supported == takes, a.reason
  if op == "dgrad" and not takes:
    assert "strided dgrad" in a.reason


def test_dilated_dgrad():
  assert algorithms(problem("dgrad", dilation=2, c=128, k=128))[IGEMM_128].supported


@pytest.mark.parametrize("rank, window, dilation, pad, takes", [
    # 2D: corners in [-128, 127], padding <= 256, (R - 1) * dilation < 255.
    (2, 3, 1, 128, True),
    (2, 3, 1, 129, False),
    (2, 3, 127, 127, True),
    (2, 3, 128, 127, False),  # filter offset 256
    # 3D: corners in [-16, 15], (T - 1) * dilation < 31.
    (3, 3, 1, 16, True),
    (3, 3, 1, 17, False),
    (3, 3, 15, 15, True),
    (3, 3, 16, 15, False),
])
def test_im2col_limits(rank, window, dilation, pad, takes):
  spatial = (300, 300) if rank == 2 else (40, 40, 40)
  p = problem(spatial=spatial, window=(window,) * rank, dilation=dilation, pad=pad, c=64, k=128)
  a = algorithms(p)[IGEMM_128]
  assert a.supported == takes, a.reason
  if not takes:
    assert "im2col" in a.reason


def test_wgrad_needs_output_tiles_for_the_sms():
  # 3x3 64 -> 64: 1 x 5 tiles of 128 x 128, each reducing N*P*Q: declined on
  # 132 SMs (XLA runs it) unless deterministic, which takes it.
  small = problem("wgrad", n=128, c=64, k=64)
  assert algorithms(small)[IGEMM_128].supported
  plan = ext.conv_plan(small, False, dev())
  assert not plan.supported and "tiles" in plan.reason
  plan = ext.conv_plan(small, True, dev())
  assert plan.supported and plan.name == IGEMM_128 and plan.deterministic
  # 3x3 512 -> 512: 4 x 36 = 144 tiles.
  assert ext.conv_plan(problem("wgrad", c=512, k=512, spatial=(7, 7)), False, dev()).supported
  # 3x3 256 -> 256: 2 x 18 = 36 tiles: enough for 36 SMs, not for 37 or 132.
  mid = problem("wgrad", c=256, k=256, spatial=(14, 14))
  assert ext.conv_plan(mid, False, dev(36)).supported
  assert not ext.conv_plan(mid, False, dev(37)).supported
  assert not ext.conv_plan(mid, False, dev(132)).supported
  # No device known: 132 SMs assumed.
  assert not ext.conv_plan(mid, False, dev(0)).supported


def test_deterministic_choices_are_deterministic():
  for op in ("fwd", "dgrad", "wgrad"):
    for c, k in ((64, 64), (256, 512)):
      plan = ext.conv_plan(problem(op, c=c, k=k), True, dev())
      assert plan.supported and plan.deterministic, plan


@pytest.mark.parametrize("kw, words", [
    (dict(output=[1, 50, 56]), "do not follow"),
    (dict(c=64, k=64, groups=3), "groups"),
    (dict(n=0), "empty"),
    (dict(pad=-1), "non-negative"),
])
def test_malformed_problems(kw, words):
  for a in ext.conv_algorithms(problem(**kw), dev()):
    assert not a.supported and words in a.reason, a


def test_leading_axes_of_a_lower_rank():
  p = ext.ConvProblem("fwd", "bfloat16", 1, 64, 64, 1, [1, 2, 100], [1, 1, 3], [1, 2, 100],
                      [1, 1, 1], [1, 1, 1], [0, 0, 1], [0, 0, 1], 1)
  a = ext.conv_algorithms(p, dev())[0]
  assert not a.supported and "extent 1" in a.reason


def test_rows_past_int32():
  # N * O * P * Q past 2^31 - 1: CUTLASS's GEMM M is int32.
  p = problem(n=1024, spatial=(1500, 1500), window=(1, 1), c=64, k=64)
  a = algorithms(p)[IGEMM_128]
  assert not a.supported and "2^31" in a.reason


@pytest.mark.parametrize("args, words", [
    (dict(op="forward"), "op"),
    (dict(dtype="float64"), "float64"),
])
def test_bad_problem_arguments(args, words):
  base = dict(op="fwd", dtype="bfloat16")
  base.update(args)
  with pytest.raises(ValueError, match=words):
    ext.ConvProblem(base["op"], base["dtype"], 1, 8, 8, 1, [1, 4, 4], [1, 1, 1], [1, 4, 4],
                    [1, 1, 1], [1, 1, 1], [0, 0, 0], [0, 0, 0], 2)
  with pytest.raises(ValueError, match="3 entries"):
    ext.ConvProblem("fwd", "bfloat16", 1, 8, 8, 1, [4, 4], [1, 1, 1], [1, 4, 4], [1, 1, 1],
                    [1, 1, 1], [0, 0, 0], [0, 0, 0], 2)


def test_problem_reads_back():
  p = problem("wgrad", n=2, c=16, k=32, spatial=(9, 11), stride=2, activation=-1)
  assert (p.op, p.n, p.c, p.k, p.groups, p.rank) == ("wgrad", 2, 16, 32, 1, 2)
  assert p.input == [1, 9, 11] and p.stride == [1, 2, 2] and p.output == [1, 5, 6]
