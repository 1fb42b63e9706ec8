"""Convolutions: jax_dnn.conv_general_dilated against lax.conv_general_dilated
(XLA, which calls cuDNN) on the layers of common networks, in TFLOP/s of a
bf16 matmul; the fused conv + bias + ReLU + residual and matmul (+ bias +
GELU) against XLA's fusion of the same math written in jnp.

x [N, *spatial, C] bf16 channels-last, kernel [*window, C/G, K] (NHWC / HWIO),
y [N, *out, K], G groups, random normal with the kernel scaled by
1 / sqrt(fan-in). Modes: fwd; dgrad (dx from dy) and wgrad (dkernel from x
and dy), each the pullback alone with its residuals computed before the timed
calls; fwd+bwd (y, dx and dkernel in one call; the fused rows also dbias and
dresidual). FLOPs of one pass: 2 N prod(out) K (C/G) prod(window); fwd,
dgrad and wgrad are one pass each, fwd+bwd three. The transposed
convolution (jax_dnn.conv_transpose against lax.conv_transpose) counts the
passes of the forward convolution it transposes: 2 N prod(in) C K
prod(window). matmul [M, K] x [K, N]: 2 M N K a pass.
Strided data gradients (the dgrad mode of ResNet-50's stride-2 3x3 and 1x1
downsample layers, and the 4x4 stride-2 transposed convolution) run ours
as stride-1 forward convolutions, one per phase (jax_dnn/_src/conv/phases.py);
their FLOPs are the strided convolution's, which count no inserted zeros.

Depthwise layers (G = C = K) are memory-bound: their rows also give GB/s
and the fraction of the copy bandwidth, counting x and y once per pass they
touch (fwd: x, y; dgrad: dy, dx; wgrad: x, dy; fwd+bwd: x, dy read, y, dx
written).

Input sets per timed call: enough FLOPs (CALL_FLOPS) that a call outlasts
its dispatch, more bytes than L2 holds, and for depthwise layers the
memory-bound families' 1 GiB; at most `max_sets`, and no more than fit
SET_MEMORY next to each other (inputs, cotangents, outputs and gradients).
"""

from __future__ import annotations

import dataclasses
import math

import jax
from jax import lax
import jax.numpy as jnp

import jax_dnn
from jax_dnn.benchmark import harness

CONV_MODES = ("fwd", "dgrad", "wgrad", "fwd+bwd")
FUSED_MODES = ("fwd", "fwd+bwd")
PASSES = {"fwd": 1, "dgrad": 1, "wgrad": 1, "fwd+bwd": 3}
CALL_FLOPS = 1e12  # 2 ms at 500 TFLOP/s: a call, not its ~20 us dispatch, sets the time
SET_MEMORY = 16 << 30  # what a call's input sets and their results may hold on the GPU
DIMENSIONS = {1: ("NWC", "WIO", "NWC"), 2: ("NHWC", "HWIO", "NHWC"),
              3: ("NDHWC", "DHWIO", "NDHWC")}


def layer(net: str, n: int, spatial, c: int, k: int, window, *, stride: int = 1,
          groups: int = 1, op: str = "conv", modes=CONV_MODES, tag: str = "") -> harness.Case:
  """One convolution: x [n, *spatial, c] by a `window` kernel to k channels, SAME padding."""
  spatial, window = tuple(spatial), tuple(window)
  dims = "x".join(map(str, window)) if len(window) > 1 else f"k{window[0]}"
  extent = (f"{spatial[0]}^{len(spatial)}" if len(set(spatial)) == 1 and len(spatial) > 1
            else "x".join(map(str, spatial)))
  kind = ("dw " if groups == c == k and c > 1 else f"g{groups} " if groups > 1 else "") + dims
  label = (f"{tag}{net} {kind}{f' s{stride}' if stride > 1 else ''} {extent} "
           f"{c}{f'->{k}' if k != c else ''} N={n}")
  return harness.Case(op=op, shape=(n, *spatial, c), dtype="bfloat16", label=label,
                      options=(("net", net), ("out_channels", k), ("window", window),
                               ("stride", stride), ("groups", groups)), modes=modes)


def matmul_case(size: int, activation: str | None) -> harness.Case:
  op = "matmul+bias+gelu" if activation else "matmul"
  return harness.Case(op=op, shape=(size, size), dtype="bfloat16", label=f"{op} {size}^3",
                      options=(("net", "matmul"), ("out_channels", size)), modes=FUSED_MODES)


def _resnet50(n: int = 128) -> list[harness.Case]:
  """ResNet-50 (v1.5: the stride in the 3x3) at N = n: the stem, then per
  stage the 3x3, the 1x1 reduce and expand, the first block's 1x1 reduce from
  the previous stage, its strided 3x3 and strided 1x1 downsample."""
  cases = [layer("resnet50", n, (224, 224), 3, 64, (7, 7), stride=2)]
  previous = 64
  for size, width in ((56, 64), (28, 128), (14, 256), (7, 512)):
    wide = 4 * width
    stride = 1 if size == 56 else 2
    cases.append(layer("resnet50", n, (size * stride,) * 2, previous, width, (1, 1)))
    if stride > 1:
      cases.append(layer("resnet50", n, (size * 2,) * 2, width, width, (3, 3), stride=2))
    cases.append(layer("resnet50", n, (size,) * 2, width, width, (3, 3)))
    cases.append(layer("resnet50", n, (size,) * 2, width, wide, (1, 1)))
    cases.append(layer("resnet50", n, (size,) * 2, wide, width, (1, 1)))
    if stride > 1:
      cases.append(layer("resnet50", n, (size * 2,) * 2, previous, wide, (1, 1), stride=2))
    previous = wide
  return cases


def _fused_resnet50(n: int = 128) -> list[harness.Case]:
  """conv + bias + ReLU + residual on ResNet-50's 3x3 and 1x1 expand layers."""
  return [layer("resnet50", n, (size, size), c, k, window, op="conv+bias+relu+residual",
                modes=FUSED_MODES, tag="fused ")
          for size, width in ((56, 64), (28, 128), (14, 256), (7, 512))
          for c, k, window in ((width, width, (3, 3)), (width, 4 * width, (1, 1)))]


def all_cases() -> list[harness.Case]:
  cases = _resnet50()
  cases += [layer("sd-unet", 8, (s, s), c, c, (3, 3)) for s, c in ((64, 320), (32, 640),
                                                                    (128, 128))]
  cases.append(layer("1d", 32, (16000,), 256, 256, (3,)))
  cases += [layer("3d", n, (s,) * 3, c, c, (3, 3, 3)) for n, s, c in ((2, 64, 32), (2, 32, 64),
                                                                      (1, 128, 16))]
  cases += [layer("convnext", 64, (s, s), c, c, (7, 7), groups=c) for s, c in ((56, 128),
                                                                               (28, 256))]
  cases += [layer("mobilenet", 128, (s, s), c, c, (3, 3), groups=c) for s, c in ((112, 32),
                                                                                 (56, 144))]
  cases.append(layer("resnext", 128, (56, 56), 128, 128, (3, 3), groups=32))
  cases.append(layer("transposed", 16, (32, 32), 512, 256, (4, 4), stride=2,
                     op="conv_transpose"))
  cases += _fused_resnet50()
  cases += [matmul_case(size, act) for size in (4096, 8192) for act in ("gelu", None)]
  return cases


# --quick: a deep 3x3, a 1x1, a depthwise and a fused layer, one matmul + bias + GELU.
QUICK = ("resnet50 3x3 28^2 128 N=128", "resnet50 1x1 56^2 64->256 N=128",
         "convnext dw 7x7 56^2 128 N=64", "fused resnet50 3x3 28^2 128 N=128",
         "matmul+bias+gelu 4096^3")


def cases(quick: bool) -> list[harness.Case]:
  full = all_cases()
  if not quick:
    return full
  by_label = {c.label: c for c in full}
  return [dataclasses.replace(by_label[label], modes=FUSED_MODES) for label in QUICK]


# One case's shapes, work and functions.


def out_spatial(case: harness.Case) -> tuple[int, ...]:
  """SAME padding: ceil(in / stride); a transposed convolution: in * stride."""
  spatial, stride = case.shape[1:-1], case.option("stride")
  if case.op == "conv_transpose":
    return tuple(s * stride for s in spatial)
  return tuple(-(-s // stride) for s in spatial)


def kernel_shape(case: harness.Case) -> tuple[int, ...]:
  c, k, groups = case.shape[-1], case.option("out_channels"), case.option("groups")
  return (*case.option("window"), c // groups, k)


def flops(case: harness.Case, mode: str) -> float:
  """One application's FLOPs (see the module doc)."""
  if case.op.startswith("matmul"):
    m, kk = case.shape
    return 2.0 * m * kk * case.option("out_channels") * PASSES[mode]
  n, c = case.shape[0], case.shape[-1]
  k, groups = case.option("out_channels"), case.option("groups")
  # A transposed convolution is the data gradient of the convolution from its
  # output to its input: that convolution's output extent is this one's input.
  spatial = case.shape[1:-1] if case.op == "conv_transpose" else out_spatial(case)
  return (2.0 * n * math.prod(spatial) * k * (c // groups) * math.prod(case.option("window"))
          * PASSES[mode])


def depthwise(case: harness.Case) -> bool:
  return (not case.op.startswith("matmul")
          and case.option("groups") == case.shape[-1] == case.option("out_channels") > 1)


def moved_bytes(case: harness.Case) -> dict[str, float]:
  """Bytes of one application of a depthwise layer (see the module doc)."""
  item = jnp.dtype(case.dtype).itemsize
  x = math.prod(case.shape) * item
  y = case.shape[0] * math.prod(out_spatial(case)) * case.option("out_channels") * item
  return {"fwd": x + y, "dgrad": x + y, "wgrad": x + y, "fwd+bwd": 2 * (x + y)}


def functions(case: harness.Case) -> dict:
  """impl -> f(*args) for a case: "ours" and "xla"."""
  if case.op.startswith("matmul"):
    if case.op == "matmul":
      return {"ours": jax_dnn.matmul, "xla": jnp.dot}
    return {"ours": lambda x, w, b: jax_dnn.matmul(x, w, b, activation="gelu_tanh"),
            "xla": lambda x, w, b: jax.nn.gelu(jnp.dot(x, w) + b, approximate=True)}
  rank = len(case.shape) - 2
  strides = (case.option("stride"),) * rank
  dn = DIMENSIONS[rank]
  groups = case.option("groups")
  if case.op == "conv_transpose":
    def transposed(impl):
      return lambda x, w: impl(x, w, strides, "SAME", dimension_numbers=dn)
    return {"ours": transposed(jax_dnn.conv_transpose), "xla": transposed(lax.conv_transpose)}

  def general(impl):
    return lambda x, w: impl(x, w, strides, "SAME", dimension_numbers=dn,
                             feature_group_count=groups)
  if case.op == "conv":
    return {"ours": general(jax_dnn.conv_general_dilated),
            "xla": general(lax.conv_general_dilated)}
  if case.op == "conv+bias+relu+residual":
    xla_conv = general(lax.conv_general_dilated)
    return {"ours": lambda x, w, b, r: jax_dnn.conv(x, w, b, residual=r, activation="relu",
                                                    strides=strides, padding="SAME",
                                                    groups=groups),
            "xla": lambda x, w, b, r: jax.nn.relu(xla_conv(x, w) + b + r)}
  raise ValueError(f"unknown conv benchmark op {case.op!r}")


def output_shape(case: harness.Case) -> tuple[int, ...]:
  if case.op.startswith("matmul"):
    return (case.shape[0], case.option("out_channels"))
  return (case.shape[0], *out_spatial(case), case.option("out_channels"))


def set_bytes(case: harness.Case) -> int:
  """Bytes of one input set's activations: x, dy, the residual where fused."""
  outputs = 3 if case.op == "conv+bias+relu+residual" else 2
  return (math.prod(case.shape) + outputs * math.prod(output_shape(case))) * jnp.dtype(
      case.dtype).itemsize


def input_sets(case: harness.Case, settings: harness.Settings) -> int:
  """K for a case (see the module doc)."""
  nbytes = set_bytes(case)
  want = max(math.ceil(CALL_FLOPS / flops(case, "fwd")), math.ceil(settings.l2_bytes / nbytes))
  if depthwise(case):
    want = max(want, harness.input_sets(math.prod(case.shape) * jnp.dtype(case.dtype).itemsize,
                                        settings))
  fit = SET_MEMORY // (2 * nbytes)  # the sets, then as much again of outputs and gradients
  return max(1, min(want, settings.max_sets, fit))


def workload(case: harness.Case, settings: harness.Settings) -> harness.Workload:
  dtype = jnp.dtype(case.dtype)
  kx, kw, kb, kdy = jax.random.split(jax.random.key(0), 4)

  def normal(key, i, shape, scale=1.0):
    return (scale * jax.random.normal(jax.random.fold_in(key, i), shape, jnp.float32)
            ).astype(dtype)

  k, y_shape = case.option("out_channels"), output_shape(case)
  w_shape = (case.shape[-1], k) if case.op.startswith("matmul") else kernel_shape(case)
  fan_in = math.prod(w_shape[:-1])
  if case.op == "conv_transpose":  # each output sums window / stride^rank taps of C channels
    fan_in = math.prod(w_shape[:-2]) * w_shape[-2] // case.option("stride") ** (len(w_shape) - 2)
  w = normal(kw, 0, w_shape, 1.0 / math.sqrt(fan_in))
  sets = input_sets(case, settings)
  args = []
  for i in range(sets):
    x = normal(kx, i, case.shape)
    if case.op == "matmul+bias+gelu":
      args.append((x, w, normal(kb, 0, (k,))))
    elif case.op == "conv+bias+relu+residual":
      args.append((x, w, normal(kb, 0, (k,)), normal(kb, i + 1, y_shape)))
    else:
      args.append((x, w))
  return harness.Workload(
      fns=functions(case), args=args,
      cotangents=[normal(kdy, i, y_shape) for i in range(sets)],
      work={mode: flops(case, mode) for mode in case.modes},
      tolerance=harness.tolerance(dtype),
      bytes=moved_bytes(case) if depthwise(case) else None)


def plot_point(row: dict):
  """Panel per mode; x = the case's place in the full list (the table's order)."""
  index = _INDEX.get(row["case"])
  return None if index is None else (row["mode"], index, "")


_INDEX = {c.label: i for i, c in enumerate(all_cases())}

FAMILY = harness.Family(
    name="conv", unit="TFLOP/s", ceiling="matmul", impls=("ours", "xla"), reference=("xla",),
    cases=cases, workload=workload, plot_point=plot_point,
    plot_x="layer, in the table's order",
    bandwidth=True)
