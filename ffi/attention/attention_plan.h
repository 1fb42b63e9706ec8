// The attention kernels' plans (attention_plan.cc): what they take, which
// kernel a call runs and how much workspace it needs. Host-only plain C++,
// built in CPU-only builds too: the launchers (attention_*_launch.cuh), the
// handlers (attention_ffi.cc) and Python (jax_dnn/_src/plans.py, through
// ffi/registrations.cc) ask the same functions.
// Shapes as in attention.h: q [B, T, N, H], k [B, S, K, H], v [B, S, K, Hv].
#pragma once

#include <cstddef>
#include <cstdint>

#include "ffi/common/device_props.h"
#include "ffi/common/dtype.h"

namespace jax_dnn {

struct AttentionShape {
  int64_t b, t, s, n, kh, h, hv;  // kh: key/value heads (divides n)
};

// What a call asks beyond its shape: which optional operands it has
// (AttentionMask holds their pointers) and the logits' options.
struct AttentionOptions {
  bool bias = false, mask = false, q_lens = false, kv_lens = false, segments = false;
  bool causal = false;
  int64_t window_left = -1, window_right = -1;  // -1: unbounded on that side
  float scale = 1.f, softcap = 0.f;             // softcap 0: off
};

namespace attention {

// Head dims padded to the kernels' 64-column slabs.
constexpr int PadDim(int64_t h) { return static_cast<int>((h + 63) / 64 * 64); }

// The padded (D, Dv) pairs the kernels are built for (DispatchHeadDims
// instantiates each; attention_tma.h).
struct HeadDims {
  int d, dv;
};
inline constexpr HeadDims kHeadDims[] = {{64, 64}, {128, 128}, {192, 192}, {256, 256},
                                         {192, 128} /*MLA-style*/};
inline constexpr size_t kNumHeadDims = sizeof(kHeadDims) / sizeof(kHeadDims[0]);

// The single-pass backward's query tile at padded head dim d: 128 queries at
// 64, 64 at 128 (see AttentionDkvKernel's kDq in attention_bwd.cuh).
constexpr int DqTileRows(int64_t d) { return d <= 64 ? 128 : 64; }

// The general logits path (Logits in attention_common.cuh): soft-cap, bias,
// mask or segments.
bool NeedsGeneral(const AttentionOptions& o);
// The forward's lean path takes the row max over unscaled scores, which is
// the max of the logits only for a positive scale.
bool FwdNeedsGeneral(const AttentionOptions& o);
// Whether every query tile attends to the same key tiles (KeyTiles): no
// causal mask, window or sequence lengths. The forward's split tail needs it.
bool FwdUniformKeys(const AttentionOptions& o);

// The forward kernel a call runs (LaunchFwdDims dispatches on it).
struct FwdKernel {
  int rows;      // query rows a work tile: 128, or 192 (AttentionFwdWideKernel)
  int key_tile;  // keys a tile: 64, 128 or 176
  bool general;  // the general logits path
};
FwdKernel ChooseFwdKernel(const AttentionShape& s, const AttentionOptions& o);

// Whether the split tail can pay for its fixed costs at Hv padded to dv with
// key_tiles key tiles a work tile (FwdPlan takes it only then).
bool FwdSplitPays(int dv, int64_t key_tiles);
// The split tail's workspace for `sms` SMs: 2 slots a CTA (one CTA an SM) of
// a work tile's rows x (dv + 1) floats (o, then lse).
constexpr int64_t FwdSplitElems(int64_t sms, int rows, int dv) {
  return 2 * sms * rows * (dv + 1);
}

}  // namespace attention

// Why the kernels do not take a call of this dtype and shape (a sentence for
// the handler's error), or nullptr when they do: bfloat16/float16, head dims
// that are multiples of 8 whose padded pair is in kHeadDims, no empty
// dimension, sequences shorter than 2^31 - 256 (the kernels' 32-bit
// positions).
const char* AttentionUnsupported(DType dtype, const AttentionShape& s);

// Floats of the forward's split-tail workspace (AttentionFwdParams::ws): the
// most the launcher can take on `device`, or 0 where the split cannot happen
// (the general path, a mask that gives tiles different keys, Hv past 128,
// fewer than 32 key tiles a work tile, no more work tiles than SMs). With no
// device known (device.sm_count 0) it is 0: the launcher then keeps the
// plain persistent schedule, as it does on a device with more SMs than the
// workspace was sized for.
int64_t AttentionFwdWorkspaceElems(const AttentionShape& s, const AttentionOptions& o,
                                   const DeviceProps& device);

// Whether the single-pass backward (dQ added in fp32 from the dK/dV kernel)
// takes the call: head dims padding to 64/64 or 128/128, without bias,
// soft-cap, mask or segments (the general logits path).
bool AttentionFusedDqSupported(const AttentionShape& s, const AttentionOptions& o);
// Whether the backward runs the single pass: wherever it is supported, unless
// the caller asks for bitwise-reproducible gradients (`deterministic`: the
// split writes every gradient exactly once; the single pass's fp32 adds
// come in varying order). The single pass runs fewer GEMMs (five a key tile
// instead of seven): 0.81-0.87 of the split's time on an H100 (B*S = 16384,
// 32 heads, S = 1024 ... 16384, no mask).
bool AttentionBwdFusedDq(const AttentionShape& s, const AttentionOptions& o, bool deterministic);
// The single pass's fp32 dQ accumulator (AttentionBwdParams::dq_acc): B * N
// slices of AttentionDqAccHeadElements(T, H) floats, each the query rows
// padded to DqTileRows x H padded to 64.
int64_t AttentionDqAccHeadElements(int64_t t, int64_t h);
int64_t AttentionDqAccElements(const AttentionShape& s);

}  // namespace jax_dnn
