// The recurrence kernels' plan (rnn_plan.cc): whether the persistent kernels
// take a problem, with how many hidden units a block, whether the recurrent
// weights stay in shared memory or are streamed from a global copy, and the
// workspace and shared-memory bytes. Host-only plain C++, built in CPU-only
// builds too; Python asks it through ffi/registrations.cc
// (jax_dnn/_src/plans.py rnn_plan) and the launchers (rnn_fwd.cu,
// rnn_bwd.cu) size their launch with the same functions.
//
// Letters: T steps, B batch rows, H hidden units, G gates (LSTM 4, GRU 3,
// RNN 1), U hidden units a block, N = G * U gate rows a block.
#pragma once

#include <cstdint>
#include <string>

#include "ffi/common/device_props.h"
#include "ffi/common/dtype.h"

namespace jax_dnn {

enum class RnnKind { kLstm = 0, kGru = 1, kRnnTanh = 2, kRnnRelu = 3 };

inline int RnnGates(RnnKind kind) {
  return kind == RnnKind::kLstm ? 4 : kind == RnnKind::kGru ? 3 : 1;
}
// fp32 slots a step of `states` [T, B, S, H] holds (rnn.h).
inline int RnnStateSlots(RnnKind kind) {
  return kind == RnnKind::kLstm || kind == RnnKind::kGru ? 5 : 1;
}

// Threads a block: 8 warps, so a step's matmul splits into up to 8 items
// (16-row batch tiles x slices of K), one a warp.
constexpr int kRnnThreads = 256;
constexpr int kRnnWarps = kRnnThreads / 32;
// Batch rows a block's matmul covers at once (8 tiles of 16: one a warp);
// larger batches loop over chunks of this many rows.
constexpr int kRnnChunkRows = 128;
// Opt-in dynamic shared memory a block may use on sm_90 (227 KiB).
constexpr int64_t kRnnMaxSmemBytes = 227 * 1024;
// The largest batch the kernels run by default: every block reads the whole
// h [B, H] each step, so past small batches the scan's one large GEMM a step
// wins (LSTM bf16 on an H200, whole layer against the scan: fwd+bwd B=16
// H=768 4.4x, B=64 H=512 2.4x; at B=256 H=1024 T=128 the forward kernel
// alone takes 3.5 ms where the scan's whole forward took 2.0). Larger
// batches run the reference.
constexpr int64_t kRnnDefaultMaxBatch = 64;
// SMs assumed where no device is known (an H100 SXM's 132).
constexpr int kRnnDefaultSms = 132;

// A variant: the kernels' units a block, where the weights live and where
// the per-row fp32 state (c / h forward, dh and dc backward) lives.
struct RnnVariant {
  int units;          // U: 8, 16 or 32 hidden units a block
  bool streamed;      // weights read from a padded global copy each step
  bool global_state;  // per-row state in the workspace (large batches)
};
constexpr int kRnnVariantCount = 12;
// variant id -> RnnVariant, in the plan's order of preference: ids 0-2
// resident weights and state (U = 8, 16, 32), 3-5 resident weights and the
// state in the workspace, 6-8 streamed weights, 9-11 both in the workspace.
RnnVariant RnnVariantById(int id);

// Sizes derived from a problem and a variant, shared by the plan and the
// launchers so that nothing is restated.
struct RnnLayout {
  int64_t bp;        // B padded to 16 (mma rows)
  int64_t hp;        // H padded to 64 bytes (K of the forward's matmul)
  int64_t ghp;       // G * H padded to 64 bytes (K of the backward's matmul)
  int64_t blocks;    // ceil(H / U)
  int64_t fwd_pitch; // elements a row of the forward's weight slice [N, fwd_pitch]
  int64_t bwd_pitch; // elements a row of the backward's weight slice [U, bwd_pitch]
  int64_t fwd_smem_bytes, bwd_smem_bytes;
  int64_t fwd_workspace_bytes, bwd_workspace_bytes;
  // Byte offsets in the workspaces: the exchange buffers at 0, then (streamed)
  // the blocks' padded weight slices, then (global_state) the blocks' state,
  // then the grid barrier's counter.
  int64_t fwd_weights_offset, bwd_weights_offset;
  int64_t fwd_state_ws_offset, bwd_state_ws_offset;
  int64_t fwd_barrier_offset, bwd_barrier_offset;
  // Byte offsets in shared memory (weights at 0 unless streamed).
  int64_t fwd_red_offset, fwd_bias_offset, fwd_lens_offset, fwd_state_offset;
  int64_t bwd_red_offset, bwd_lens_offset, bwd_state_offset;
};
RnnLayout RnnLayoutFor(RnnKind kind, DType dtype, int64_t batch, int64_t hidden,
                       RnnVariant variant);
// Whether a layout runs `directions` recurrences side by side on a device
// of `sms` SMs: every block of every direction co-resident (one an SM) and
// both kernels' shared memory within the opt-in limit.
inline bool RnnLayoutFits(const RnnLayout& l, int64_t sms, int64_t directions = 1) {
  return l.blocks * directions <= sms && l.fwd_smem_bytes <= kRnnMaxSmemBytes &&
         l.bwd_smem_bytes <= kRnnMaxSmemBytes;
}

struct RnnPlan {
  bool supported = false;
  std::string reason;  // why not, where unsupported
  // The kernels run by default (else the reference's scan, faster there):
  // see kRnnDefaultMaxBatch.
  bool by_default = false;
  int variant = -1;    // RnnVariantById's id
  int units = 0;
  bool streamed = false;
  bool global_state = false;
  int64_t blocks = 0;          // a direction's; the launch has directions x blocks
  int64_t directions = 1;
  int64_t fwd_workspace_bytes = 0;  // all directions' (directions x the layout's)
  int64_t bwd_workspace_bytes = 0;
  int64_t fwd_smem_bytes = 0;
  int64_t bwd_smem_bytes = 0;
};

// The plan for one single-layer recurrence over `directions` directions (1,
// or 2: a bidirectional layer's forward and reverse recurrences in one
// launch, each on its own blocks with its own slice of the workspace and
// its own barrier counter, so that neither waits on the other's steps).
//
// Blocks: one a slice of U hidden units, all co-resident (one a SM: the
// kernels use one cooperative launch and a grid barrier a step), so
// ceil(H / U) <= SMs (device.sm_count; kRnnDefaultSms where unknown).
// The smallest U whose block count fits wins (more blocks: less matmul a
// block a step, and the step's latency is what counts), resident weights
// before streamed ones: H = 768 takes U = 8 (96 blocks); H = 2048 LSTM bf16
// takes U = 16 streamed (its 64 weight rows of 2080 bf16 need 260 KiB). Batches
// whose per-row fp32 state (Bp x U floats forward, twice that backward)
// does not fit next to the weights keep it in the workspace (read and
// written by the block that owns it, so ordered by its __syncthreads).
// Two directions need 2 ceil(H / U) <= SMs (H = 768 takes U = 16 there).
// Unsupported: empty problems, H past 32 * SMs / directions, directions
// other than 1 or 2.
RnnPlan PlanRnn(RnnKind kind, DType dtype, int64_t seq_len, int64_t batch, int64_t hidden,
                const DeviceProps& device, int64_t directions = 1);

}  // namespace jax_dnn
