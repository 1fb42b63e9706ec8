// The recurrence kernels' plan: see rnn_plan.h.
#include "ffi/rnn/rnn_plan.h"

#include <algorithm>

namespace jax_dnn {
namespace {

constexpr RnnVariant kVariants[kRnnVariantCount] = {
    {8, false, false}, {16, false, false}, {32, false, false},
    {8, false, true},  {16, false, true},  {32, false, true},
    {8, true, false},  {16, true, false},  {32, true, false},
    {8, true, true},   {16, true, true},   {32, true, true}};

int64_t RoundUp(int64_t v, int64_t m) { return (v + m - 1) / m * m; }
int64_t DTypeBytes(DType dtype) { return dtype == DType::kF32 ? 4 : 2; }

}  // namespace

RnnVariant RnnVariantById(int id) {
  return id >= 0 && id < kRnnVariantCount ? kVariants[id] : RnnVariant{0, false, false};
}

RnnLayout RnnLayoutFor(RnnKind kind, DType dtype, int64_t batch, int64_t hidden,
                       RnnVariant variant) {
  const int64_t g = RnnGates(kind);
  const int64_t u = variant.units;
  const int64_t n = g * u;
  const int64_t bytes = DTypeBytes(dtype);
  RnnLayout l{};
  l.bp = RoundUp(std::max<int64_t>(batch, 1), 16);
  // K in 64-byte granules: the matmul reads A and B rows in 16-byte vectors,
  // four lanes a 64-byte pair of k-steps (rnn_common.cuh ChunkMatmul).
  const int64_t granule = 64 / bytes;
  l.hp = RoundUp(std::max<int64_t>(hidden, 1), granule);
  l.ghp = RoundUp(std::max<int64_t>(g * hidden, 1), granule);
  l.blocks = (hidden + u - 1) / u;
  // Weight rows 64 bytes past a multiple of 128: a 16-byte B load's
  // quarter-warp reads two rows x 64 bytes, then in distinct banks.
  l.fwd_pitch = (RoundUp(l.hp * bytes, 128) + 64) / bytes;
  l.bwd_pitch = (RoundUp(l.ghp * bytes, 128) + 64) / bytes;
  const int64_t fwd_w = n * l.fwd_pitch * bytes;
  const int64_t bwd_w = u * l.bwd_pitch * bytes;
  // Partial sums of the matmul: kRnnChunkRows rows x (columns + 4) floats
  // (the 4: the C fragments' 8 rows land in different banks).
  const int64_t fwd_red = kRnnChunkRows * (n + 4) * 4;
  const int64_t bwd_red = kRnnChunkRows * (u + 4) * 4;
  // The rows' lengths, int32 [B], read every step (from global memory where
  // the state is in the workspace: B may be too large for shared memory).
  const int64_t lens = variant.global_state ? 0 : RoundUp(std::max<int64_t>(batch, 1) * 4, 16);
  l.fwd_red_offset = variant.streamed ? 0 : RoundUp(fwd_w, 16);
  l.fwd_bias_offset = l.fwd_red_offset + fwd_red;
  l.fwd_lens_offset = l.fwd_bias_offset + RoundUp(n * 4, 16);
  l.fwd_state_offset = l.fwd_lens_offset + lens;
  // Forward: c (LSTM) or h (GRU) in fp32 a row and unit.
  const int64_t fwd_state = l.bp * u * 4;
  l.fwd_smem_bytes = l.fwd_state_offset + (variant.global_state ? 0 : fwd_state);
  l.bwd_red_offset = variant.streamed ? 0 : RoundUp(bwd_w, 16);
  l.bwd_lens_offset = l.bwd_red_offset + bwd_red;
  l.bwd_state_offset = l.bwd_lens_offset + lens;
  // Backward: dh and (LSTM) dc or (GRU) the direct part u * dh, fp32.
  const int64_t bwd_state = 2 * l.bp * u * 4;
  l.bwd_smem_bytes = l.bwd_state_offset + (variant.global_state ? 0 : bwd_state);
  // Exchange buffers: two (double-buffered) of h [Bp, Hp] forward and of
  // the gate gradients [Bp, GHp] backward, in the input dtype.
  l.fwd_weights_offset = RoundUp(2 * l.bp * l.hp * bytes, 256);
  l.bwd_weights_offset = RoundUp(2 * l.bp * l.ghp * bytes, 256);
  l.fwd_state_ws_offset =
      l.fwd_weights_offset + RoundUp(variant.streamed ? l.blocks * fwd_w : 0, 256);
  l.bwd_state_ws_offset =
      l.bwd_weights_offset + RoundUp(variant.streamed ? l.blocks * bwd_w : 0, 256);
  // Last, the grid barrier's counter (8 bytes; 256 for alignment's sake).
  l.fwd_barrier_offset =
      RoundUp(l.fwd_state_ws_offset + (variant.global_state ? l.blocks * fwd_state : 0), 256);
  l.bwd_barrier_offset =
      RoundUp(l.bwd_state_ws_offset + (variant.global_state ? l.blocks * bwd_state : 0), 256);
  l.fwd_workspace_bytes = l.fwd_barrier_offset + 256;
  l.bwd_workspace_bytes = l.bwd_barrier_offset + 256;
  return l;
}

RnnPlan PlanRnn(RnnKind kind, DType dtype, int64_t seq_len, int64_t batch, int64_t hidden,
                const DeviceProps& device, int64_t directions) {
  RnnPlan plan;
  plan.directions = directions;
  if (directions != 1 && directions != 2) {
    plan.reason = "directions must be 1 or 2";
    return plan;
  }
  if (seq_len < 1 || batch < 1 || hidden < 1) {
    plan.reason = "empty (seq_len, batch and hidden must be positive)";
    return plan;
  }
  // T, B and H each fit 31 bits (the kernels' loop counters; products are 64-bit).
  if (seq_len > INT32_MAX || batch > INT32_MAX || hidden > INT32_MAX) {
    plan.reason = "seq_len, batch and hidden must be below 2^31";
    return plan;
  }
  const int64_t sms = device.sm_count > 0 ? device.sm_count : kRnnDefaultSms;
  for (int id = 0; id < kRnnVariantCount; ++id) {
    const RnnVariant v = kVariants[id];
    const RnnLayout l = RnnLayoutFor(kind, dtype, batch, hidden, v);
    if (!RnnLayoutFits(l, sms, directions)) continue;
    plan.supported = true;
    plan.by_default = batch <= kRnnDefaultMaxBatch;
    plan.variant = id;
    plan.units = v.units;
    plan.streamed = v.streamed;
    plan.global_state = v.global_state;
    plan.blocks = l.blocks;
    plan.fwd_workspace_bytes = directions * l.fwd_workspace_bytes;
    plan.bwd_workspace_bytes = directions * l.bwd_workspace_bytes;
    plan.fwd_smem_bytes = l.fwd_smem_bytes;
    plan.bwd_smem_bytes = l.bwd_smem_bytes;
    return plan;
  }
  // Streamed weights and state leave kRnnChunkRows x (N + 4) floats of
  // shared memory (66.5 KiB at most: N = 128), so only the grid can decline.
  plan.reason = "hidden " + std::to_string(hidden) + (directions == 2 ? " in two directions" : "") +
                " needs more than " + std::to_string(sms) + " blocks of 32 units (one a SM)";
  return plan;
}

}  // namespace jax_dnn
