// One single-layer recurrence (LSTM, GRU, tanh / relu RNN), one direction
// or a bidirectional layer's two, over a whole sequence, as persistent
// kernels: one cooperative launch, one grid barrier a step (rnn_fwd.cu,
// rnn_bwd.cu). Python does the rest (input projection gx = x W_ih^T + b_ih,
// layers, weight gradients).
//
// Letters: T steps, B batch rows, H hidden units, G gates (LSTM 4: i, f, g,
// o; GRU 3: r, z, n; RNN 1), S state slots (LSTM and GRU 5, RNN 1).
//
// Step of row b at time t, all in fp32 (hh = W_hh h_{t-1} + b_hh, the
// matmul on h_{t-1} rounded to the input dtype, fp32 accumulation; fp32
// inputs use TF32 tensor cores, JAX's default matmul precision):
//   LSTM: i, f, o = sigmoid, g = tanh of gx + hh; c_t = f c + i g;
//         h_t = o tanh(c_t).
//   GRU:  r = sigmoid(gx_r + hh_r), u = sigmoid(gx_z + hh_z),
//         n = tanh(gx_n + r hh_n), h_t = (1 - u) n + u h_{t-1}
//         (h_{t-1} here the fp32 carry: h0, then the previous h_t slot).
//   RNN:  h_t = tanh or relu of gx + hh.
// seq_lengths [B] (clamped to [0, T]): row b runs t = 0 .. len - 1, or with
// `reverse` t = len - 1 down to 0; steps t >= len give y = 0, zero states,
// zero gradients, and leave the state alone.
//
// states [T, B, S, H] fp32, the forward's residuals: LSTM (i, f, g, o, c_t);
// GRU (r, u, n, hh_n, h_t); RNN (h_t).
//
// Directions D (1, or 2: a bidirectional layer, direction 0 forward and 1
// reverse, `reverse` false) run side by side in one launch, packed along the
// features as the layer's input projection and output have them: gx and
// dgx [T, B, D, G * H], w_hh [D, G * H, H], b_hh [D, G * H], every [B, H]
// or [T, B, H] tensor [.., D, H], states [T, B, S, D, H]; the shapes below
// are D = 1's. Direction d runs on blocks [d nb, (d + 1) nb) with slice d of
// the workspace (nb = RnnLayout::blocks, the workspace D times the layout's).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "ffi/common/dtype.h"
#include "ffi/rnn/rnn_plan.h"

namespace jax_dnn {

struct RnnFwdParams {
  DType dtype;
  RnnKind kind;
  bool reverse;
  int variant;  // RnnVariantById
  int directions;
  int64_t seq_len, batch, hidden;
  const void* gx;               // [T, B, G * H]
  const void* w_hh;             // [G * H, H]
  const void* b_hh;             // [G * H]
  const void* h0;               // [B, H]
  const void* c0;               // [B, H] (LSTM)
  const int32_t* seq_lengths;   // [B]
  void* y;                      // [T, B, H]
  void* h_n;                    // [B, H]
  void* c_n;                    // [B, H] (LSTM)
  float* states;                // [T, B, S, H]
  void* workspace;              // RnnLayout::fwd_workspace_bytes
};

struct RnnBwdParams {
  DType dtype;
  RnnKind kind;
  bool reverse;
  int variant;
  int directions;
  int64_t seq_len, batch, hidden;
  const void* dy;               // [T, B, H]
  const void* dh_n;             // [B, H]
  const void* dc_n;             // [B, H] (LSTM)
  const void* w_hh;             // [G * H, H]
  const void* h0;               // [B, H]
  const void* c0;               // [B, H] (LSTM)
  const int32_t* seq_lengths;   // [B]
  const float* states;          // [T, B, S, H]
  float* dgx;                   // [T, B, G * H]
  float* dgh_n;                 // [T, B, H] (GRU): gradient of hh's n slot
  float* dh0;                   // [B, H]
  float* dc0;                   // [B, H] (LSTM)
  void* workspace;              // RnnLayout::bwd_workspace_bytes
};

cudaError_t LaunchRnnFwd(const RnnFwdParams& p, cudaStream_t stream);
cudaError_t LaunchRnnBwd(const RnnBwdParams& p, cudaStream_t stream);

}  // namespace jax_dnn
