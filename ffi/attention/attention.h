// Fused attention (flash-style) for Hopper: host-side parameters and launchers.
// Layout as jax.nn.dot_product_attention: q [B, T, N, H], k [B, S, K, H],
// v [B, S, K, Hv], o [B, T, N, Hv]; lse [B, N, T] (fp32, natural log).
// Kernels: attention_fwd.cuh (o, lse), attention_bwd.cuh (dq; dk, dv).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "ffi/attention/attention_plan.h"
#include "ffi/common/dtype.h"

namespace jax_dnn {

// Which positions a query may attend to, beyond the kernels' own bounds
// (key index < S). All pointers optional (nullptr = absent).
struct AttentionMask {
  bool causal = false;
  int64_t window_left = -1, window_right = -1;  // -1: unbounded on that side
  const int32_t* q_lens = nullptr;              // [B]
  const int32_t* kv_lens = nullptr;             // [B]
  const int32_t* q_seg = nullptr;               // [B, T]
  const int32_t* kv_seg = nullptr;              // [B, S]
  const bool* mask = nullptr;                   // [G, N|1, T, S]
  const float* bias = nullptr;                  // [G, N|1, T, S] (fp32)
  // bias / mask broadcast: G param_sets (dividing B; batch b uses b / (B / G)),
  // and N heads or 1.
  int64_t mask_sets = 1, bias_sets = 1;
  bool mask_per_head = false, bias_per_head = false;
};

struct AttentionFwdParams {
  DType dtype;
  AttentionShape shape;
  AttentionMask mask;
  float scale, softcap;  // softcap 0: off
  const void *q, *k, *v;
  void* o;
  float* lse;
  // Workspace of the split tail (nullptr: none): on the lean logits path
  // where every work tile has the same keys (no causal mask, window,
  // sequence lengths, bias, mask, segments or soft-cap), a persistent grid's
  // last round is shared out over the SMs by key tiles and its pieces are
  // merged from here. AttentionFwdWorkspaceElems sizes it for the device
  // the call was planned on; a smaller workspace (a device with more SMs)
  // keeps the plain schedule.
  float* ws;
  int64_t ws_elems;
};

struct AttentionBwdParams {
  DType dtype;
  AttentionShape shape;
  AttentionMask mask;
  float scale, softcap;
  const void *q, *k, *v, *o, *d_o;
  const float* lse;
  void *dq, *dk, *dv;
  float* dbias;   // [B, N, T, S] dlogits when a bias is given (else nullptr)
  float* delta;   // workspace [B, N, T]: rowsum(dO * O)
  // Workspace of the single-pass backward (nullptr: the split): the fp32 dQ
  // accumulator, AttentionDqAccElements(shape) floats.
  float* dq_acc;
  // Set by the launcher for each kernel (BwdGridTile): the grid's last
  // slices whose tiles go longest first (0: none).
  unsigned tail_slices;
};

// The plans' view of a call's mask and logits options.
inline AttentionOptions OptionsOf(const AttentionMask& m, float scale, float softcap) {
  AttentionOptions o;
  o.bias = m.bias != nullptr;
  o.mask = m.mask != nullptr;
  o.q_lens = m.q_lens != nullptr;
  o.kv_lens = m.kv_lens != nullptr;
  o.segments = m.q_seg != nullptr;
  o.causal = m.causal;
  o.window_left = m.window_left;
  o.window_right = m.window_right;
  o.scale = scale;
  o.softcap = softcap;
  return o;
}

cudaError_t LaunchAttentionFwd(const AttentionFwdParams& p, cudaStream_t stream);
cudaError_t LaunchAttentionBwd(const AttentionBwdParams& p, cudaStream_t stream);

}  // namespace jax_dnn
