// Fused attention (flash-style) for Hopper: host-side parameters and launchers.
// Layout as jax.nn.dot_product_attention: q [B, T, N, H], k [B, S, K, H],
// v [B, S, K, Hv], o [B, T, N, Hv]; lse [B, N, T] (fp32, natural log).
// Kernels: attention_fwd.cuh (o, lse), attention_bwd.cuh (dq; dk, dv).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

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
  // bias / mask broadcast: G groups (dividing B; batch b uses b / (B / G)),
  // and N heads or 1.
  int64_t mask_groups = 1, bias_groups = 1;
  bool mask_per_head = false, bias_per_head = false;
};

struct AttentionShape {
  int64_t b, t, s, n, kh, h, hv;  // kh: key/value heads (divides n)
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
  // merged from here. It takes 2 slots of 128 x (Hv padded + 1) floats for
  // each SM; _src/attention.py sizes it for 132 SMs (H100/H200 SXM). A GPU
  // with more SMs, or a smaller workspace, keeps the plain schedule.
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
  // Workspace of the single-pass backward (nullptr: the deterministic split):
  // fp32 dQ accumulator, AttentionDqAccElements(shape) floats.
  float* dq_acc;
  // Set by the launcher for each kernel (BwdGridTile): the grid's last
  // slices whose tiles go longest first (0: none).
  unsigned tail_slices;
};

// Whether the single-pass backward (dQ added from the dK/dV kernel) takes
// these parameters: head dims padding to 64/64 or 128/128, without bias,
// soft-cap, mask or segments (the general logits path). _src/attention.py
// (_fused_dq) asks for it wherever it takes them (the faster path there).
bool AttentionFusedDqSupported(const AttentionBwdParams& p);
int64_t AttentionDqAccElements(const AttentionShape& s);

// The head dims the kernels take (each padded up to a multiple of 64, at most
// 256, and a multiple of 8 for TMA's 16-byte strides); other shapes use the
// reference path (decided in Python, see _src/attention.py).
bool AttentionSupported(DType dtype, int64_t h, int64_t hv);

cudaError_t LaunchAttentionFwd(const AttentionFwdParams& p, cudaStream_t stream);
cudaError_t LaunchAttentionBwd(const AttentionBwdParams& p, cudaStream_t stream);

}  // namespace jax_dnn
