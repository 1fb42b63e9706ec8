// Layer norm and RMS norm over the last axis of a [rows, width] view.
//
//   layer norm: y = (x - mean) * rstd * scale + bias,  rstd = 1/sqrt(var + eps)
//   RMS norm:   y = x * rstd * scale,                  rstd = 1/sqrt(mean(x^2) + eps)
//
// x, y, dy, dx are T (fp32/bf16/fp16); scale, bias and the parameter gradients
// are fp32 (the Python layer casts). Statistics are fp32. The layer norm's
// forward writes each row's (mean, rstd) to `stats` and its backward reads
// them: recomputing them there took a second team reduction a row and a pass
// over the row's registers. The RMS norm's backward recomputes rstd, whose
// sum of squares rides in the one reduction it needs anyway (sum g * x).
// scale/bias are [param_sets, width]: row r uses set r / (rows / param_sets). param_sets
// is 1 unless vmap batched the parameters, which folds into the kernel this way.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "ffi/common/dtype.h"
#include "ffi/layer_norm/layer_norm_plan.h"

namespace jax_dnn {

struct LayerNormFwdParams {
  DType dtype;
  bool rms;
  const void* x;       // [rows, width]
  const float* scale;  // [param_sets, width]
  const float* bias;   // [param_sets, width]; null for RMS norm
  void* y;             // [rows, width]
  float* stats;        // [rows, 2]: (mean, rstd) of each row; null for RMS norm
  int64_t rows;
  int64_t width;
  int64_t param_sets;
  float epsilon;
};

struct LayerNormBwdParams {
  DType dtype;
  bool rms;
  const void* dy;      // [rows, width]
  const void* x;       // [rows, width]
  const float* scale;  // [param_sets, width]
  const float* stats;  // [rows, 2]: the forward's (mean, rstd); null for RMS norm
  void* dx;            // [rows, width]
  float* partials;     // workspace [param_sets, parts, sums, width]; sums = 2 (1 for RMS);
                       // parts sized by LayerNormBwdParts (layer_norm_plan.h)
  float* dscale;       // [param_sets, width]
  float* dbias;        // [param_sets, width]; null for RMS norm
  int64_t rows;
  int64_t width;
  int64_t param_sets;
  int64_t parts;  // blocks (cluster path: clusters) per param_set; each writes one
                  // row of partial sums (a cluster's blocks their columns of it)
  float epsilon;
};

cudaError_t LaunchLayerNormFwd(const LayerNormFwdParams& p, cudaStream_t stream);
// The forward's streamed cluster form (layer_norm_fwd_stream.cu), for aligned
// rows wider than the register-row kernels and up to
// LayerNormStreamFwdMaxWidth.
int64_t LayerNormStreamFwdMaxWidth(int dtype_bytes);
cudaError_t LaunchLayerNormStreamFwd(const LayerNormFwdParams& p, cudaStream_t stream);
cudaError_t LaunchLayerNormBwd(const LayerNormBwdParams& p, cudaStream_t stream);

// The backward's register rows hold up to this many 16-byte vectors of x and
// of dy a thread: teams of up to 128 threads in the register-row kernel, of
// 256 or 512 (one a block) in the streamed one, and rows wider still (up to
// 8 times) split over the blocks of a cluster.
constexpr int kNormBwdVecs = 4;
// The streamed form (layer_norm_bwd_stream.cu), for aligned rows wider than
// the register-row kernel's and up to LayerNormStreamBwdMaxWidth: sets
// p.parts to the blocks (clusters) a param_set used, whose partial sums the
// caller adds.
int64_t LayerNormStreamBwdMaxWidth(int dtype_bytes);
cudaError_t LaunchLayerNormStreamBwd(LayerNormBwdParams& p, cudaStream_t stream);

// Parts a param_set for the persistent norm kernels (the streamed forward, the
// backwards): as many units (blocks, or clusters) as fit on the device at
// once (`resident`, all param_sets together; at least one a param_set), at most
// `max_parts`, trimmed to the fewest that keep the most rows a part visits
// (parts visit at most one row fewer than that). team_rows >= 1.
inline int64_t GroupParts(int64_t team_rows, int64_t param_sets, int64_t resident, int64_t max_parts) {
  int64_t parts = resident / param_sets > 1 ? resident / param_sets : 1;
  if (parts > max_parts) parts = max_parts;
  if (parts > team_rows) parts = team_rows;
  const int64_t per_part = (team_rows + parts - 1) / parts;
  return (team_rows + per_part - 1) / per_part;
}
// The backwards' parts: at most the workspace's p.parts; a unit holds `teams`
// teams, each taking its own rows.
inline int64_t BwdParts(const LayerNormBwdParams& p, int64_t resident, int64_t teams = 1) {
  return GroupParts((p.rows / p.param_sets + teams - 1) / teams, p.param_sets, resident, p.parts);
}

}  // namespace jax_dnn
