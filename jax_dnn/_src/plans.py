"""The kernels' plans, asked of C++ (ffi/<op>/<op>_plan.h, through the
extension): what the kernels take, which variant a call runs and how much
workspace it needs. The launchers ask the same functions, so nothing here
restates a kernel's rules.

Only the CUDA lowering of a primitive whose kernel is registered asks them
(define_primitive's `supported`, `workspace` and `ffi_params` hooks): where
the extension is absent or has no kernels, the reference path needs no plan.

A plan is made for a device (DeviceProps: its SM count): the current CUDA
device as the extension reads it, unless `device` is given. Where no device
is known (no GPU on this machine, e.g. lowering for jax.export there) its
properties are 0 and each plan says in its C++ comment what it assumes.

Plans take concrete sizes. jax.export may leave a dimension symbolic (a
polymorphic batch): `static_dim` passes such a dimension as a bound, chosen
by the op for each plan it asks (and said why there).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jax_dnn._src import extension

# A symbolic dimension where a plan's answer only grows with it (workspace
# upper bounds): past every threshold a plan compares a size against (more
# work tiles than any GPU has SMs, more rows than a workspace has parts),
# while a product of three such sizes stays far within int64.
LARGE = 1 << 20


def static_dim(d, symbolic: int) -> int:
  """d as a Python int; a symbolic dimension (jax.export) as `symbolic`."""
  return int(d) if isinstance(d, (int, np.integer)) else symbolic


def is_static(*dims) -> bool:
  return all(isinstance(d, (int, np.integer)) for d in dims)


def _ext():
  module = extension.module()
  if module is None:
    raise RuntimeError("jax_dnn's extension is not built: there are no kernel plans "
                       "(the reference path needs none)")
  return module


def _device(device):
  return device if device is not None else _ext().current_device()


def device_props(*, sm_count: int) -> Any:
  """A DeviceProps to plan for (e.g. a GPU other than this machine's)."""
  return _ext().DeviceProps(sm_count=sm_count)


def current_device() -> Any:
  """The current CUDA device's DeviceProps (all 0 where none is known)."""
  return _ext().current_device()


# --- attention (ffi/attention/attention_plan.h) ----------------------------------


def attention_shape(*, b: int, t: int, s: int, n: int, kh: int, h: int, hv: int) -> Any:
  """q [b, t, n, h], k [b, s, kh, h], v [b, s, kh, hv]."""
  return _ext().AttentionShape(b=b, t=t, s=s, n=n, kh=kh, h=h, hv=hv)


def attention_options(*, bias: bool = False, mask: bool = False, q_lens: bool = False,
                      kv_lens: bool = False, segments: bool = False, causal: bool = False,
                      window_left: int = -1, window_right: int = -1, scale: float = 1.0,
                      softcap: float = 0.0) -> Any:
  """Which optional operands a call has, and its logits' options."""
  return _ext().AttentionOptions(bias=bias, mask=mask, q_lens=q_lens, kv_lens=kv_lens,
                                 segments=segments, causal=causal, window_left=window_left,
                                 window_right=window_right, scale=scale, softcap=softcap)


def attention_unsupported(dtype: str, shape) -> str | None:
  """Why the kernels do not take this dtype and shape; None when they do."""
  return _ext().attention_unsupported(dtype, shape)


def attention_fwd_kernel(shape, options) -> tuple[int, int, bool]:
  """The forward kernel a call runs: (query rows a work tile, keys a tile,
  general logits path)."""
  return tuple(_ext().attention_fwd_kernel(shape, options))


def attention_fwd_workspace_elems(shape, options, device=None) -> int:
  """Floats of the forward's split-tail workspace (0: none)."""
  return _ext().attention_fwd_workspace_elems(shape, options, _device(device))


def attention_bwd_fused_dq(shape, options, deterministic: bool) -> bool:
  """Whether the backward runs the single pass (dQ added in fp32)."""
  return _ext().attention_bwd_fused_dq(shape, options, deterministic)


def attention_dq_acc_head_elements(t: int, h: int) -> int:
  """Floats of the single pass's dQ accumulator for one (batch, head)."""
  return _ext().attention_dq_acc_head_elements(t, h)


# --- norms and bias_act (ffi/layer_norm/layer_norm_plan.h, ffi/activation/activation_plan.h)


def layer_norm_bwd_parts(rows: int, param_sets: int, width: int, rms: bool, device=None) -> int:
  """Row parts of the norms' backward workspace [param_sets, parts, sums, width]."""
  return _ext().layer_norm_bwd_parts(rows, param_sets, width, rms, _device(device))


def bias_act_bwd_parts(rows: int, param_sets: int, width: int, dtype: str, device=None) -> int:
  """Row parts of the bias backward's workspace [param_sets, parts, 1, width]."""
  return _ext().bias_act_bwd_parts(rows, param_sets, width, dtype, _device(device))


# --- group norm (ffi/group_norm/group_norm_plan.h) ---------------------------------


def group_norm_plan(n: int, spatial: int, channels: int, groups: int, dtype: str,
                    device=None) -> Any:
  """The group norm kernels' plan for x [n, spatial, channels] (GroupNormPlan:
  supported, reason, vec, threads_x, threads_y, splits, apply_rows, chunk_samples)."""
  return _ext().group_norm_plan(n, spatial, channels, groups, dtype, _device(device))


# --- batch norm (ffi/batch_norm/batch_norm_plan.h) ---------------------------------


def batch_norm_parts(rows: int, param_sets: int, width: int, dtype: str, device=None) -> int:
  """Row parts of batch norm's reductions' workspace [param_sets, parts, 2, width]."""
  return _ext().batch_norm_parts(rows, param_sets, width, dtype, _device(device))


# --- convolution (ffi/conv/conv_plan.h: the algorithm registry) -------------------


def has_conv_plans() -> bool:
  """Whether the extension has the convolution's algorithm registry."""
  module = extension.module()
  return module is not None and hasattr(module, "conv_plan")


def conv_problem(*, op: str, dtype: str, n: int, c: int, k: int, groups: int, input, window,
                 output, stride, dilation, pad_lo, pad_hi, rank: int, activation: int = -1,
                 bias: bool = False, residual: bool = False) -> Any:
  """One convolution problem as the kernels see it (ffi/conv/conv.h ConvShape):
  op "fwd" | "dgrad" | "wgrad"; dtype "bfloat16" | "float16" | "float32";
  x [n, *input, c], w [k, *window, c / groups], y [n, *output, k]; each
  spatial argument 3 ints (D, H, W), rank the caller's spatial rank (1-3);
  activation bias_act's id (-1: none); bias and residual present or not."""
  i3 = lambda v: [int(a) for a in v]
  return _ext().ConvProblem(op, dtype, int(n), int(c), int(k), int(groups), i3(input),
                            i3(window), i3(output), i3(stride), i3(dilation), i3(pad_lo),
                            i3(pad_hi), int(rank), activation=int(activation), bias=bool(bias),
                            residual=bool(residual))


def conv_algorithms(problem, device=None) -> list:
  """Every registered algorithm for the problem's op (ConvAlgorithm: id,
  name, supported, reason (why not), workspace_bytes, deterministic)."""
  return list(_ext().conv_algorithms(problem, _device(device)))


def conv_plan(problem, deterministic: bool = False, device=None) -> Any:
  """The heuristic's algorithm for the problem (deterministic ones only when
  asked); supported=False and id=-1 when none takes it, with the reasons."""
  return _ext().conv_plan(problem, bool(deterministic), _device(device))


# --- pooling (ffi/pooling/pooling_plan.h) -----------------------------------------


def pool_global_parts(n: int, c: int, spatial: int, outputs: int, adaptive: bool,
                      dtype: str, device=None) -> int:
  """Blocks a (batch, channel-vector) column of global average pooling splits
  its spatial positions over (1: no split, no workspace); outputs is the
  product of the output's spatial sizes (the split needs 1, adaptive)."""
  return _ext().pool_global_parts(n, c, spatial, outputs, adaptive, dtype, _device(device))


# --- recurrence (ffi/rnn/rnn_plan.h) ------------------------------------------------


def rnn_plan(kind: str, dtype: str, seq_len: int, batch: int, hidden: int,
             device=None, directions: int = 1) -> Any:
  """The persistent recurrence kernels' plan for one layer over `directions`
  (1, or 2: a bidirectional layer's two recurrences in one launch): kind
  "lstm" | "gru" | "rnn_tanh" | "rnn_relu", gx [seq_len, batch, directions *
  G * hidden] of dtype (RnnPlan: supported, reason, by_default, variant (the
  FFI targets' `variant` attribute), units, streamed, global_state, blocks
  (a direction's), directions, fwd_workspace_bytes, bwd_workspace_bytes (all
  directions'), fwd_smem_bytes, bwd_smem_bytes). A dtype the kernels do not
  take gives supported=False with the reason; an unknown kind raises
  ValueError."""
  return _ext().rnn_plan(kind, dtype, int(seq_len), int(batch), int(hidden), _device(device),
                         int(directions))


def rnn_variant_workspace_bytes(kind: str, dtype: str, batch: int, hidden: int,
                                variant: int) -> tuple[int, int]:
  """(fwd, bwd) workspace bytes of any variant id (not only the plan's
  choice), for checks that run every variant."""
  return tuple(_ext().rnn_variant_workspace_bytes(kind, dtype, int(batch), int(hidden),
                                                  int(variant)))
