// What the direct depthwise kernels (conv_depthwise.cu) take, host-only (the
// plans build without CUDA): groups == C, K == C * multiplier, w [K, T, R, S, 1].
//
// Taken: any N (0 too), rank 1-3, stride >= 1, dilation >= 1, padding >= 0
// (also past the window), any C and multiplier, bf16 / fp16 / fp32, buffers
// of any alignment (the vector path needs C % 4 == 0, multiplier 1 and
// 8-byte (16-bit types) or 16-byte (fp32) aligned buffers; the rest runs a
// thread per channel). Rejected, with the reason: windows of more than
// kConvDepthwiseMaxTaps taps (a direct kernel does `taps` FMAs an output
// element; past 7x7x7 the implicit GEMM is the better algorithm), dgrad on
// the scalar path with multiplier x taps past a block's shared-memory window
// table (12288 floats), and extents past 2^31 or the grid.
//
// Which kernel runs: the shared-memory tiled one (conv_direct.h) where
// ConvDepthwiseTiled holds (multiplier 1, C a multiple of 16 bytes, aligned
// buffers; fprop, stride-1 dgrad, and wgrad of 1D/2D windows 3, 5 or 7 wide);
// the rest conv_depthwise.cu's and conv_depthwise_wgrad.cu's kernels, whose
// tiling ConvDepthwiseTile below is.
#pragma once

#include <cstdint>
#include <string>

#include "ffi/conv/conv.h"

namespace jax_dnn {

// True when the depthwise kernel runs `op` on `shape`; otherwise false with
// the reason in *why (one line a user can read).
bool ConvDepthwiseSupports(ConvOp op, const ConvShape& shape, DType dtype, std::string* why);

// Workspace bytes the depthwise kernel needs for `op` (0 when none), for a
// device with `sm_count` SMs (0: unknown; then an upper bound).
int64_t ConvDepthwiseWorkspaceBytes(ConvOp op, const ConvShape& shape, DType dtype, int sm_count);

constexpr int64_t kConvDepthwiseMaxTaps = 343;  // 7x7x7; 2D up to 18x18, 1D up to 343
// Threads a block, at most (the kernels' launch bound). The unrolled kernels
// take 100-160 registers a thread (a 14-output tile of 4 channels is 56
// accumulators), so blocks of 128 fit 3-4 an SM where blocks of 256 fit one.
constexpr int kConvDepthwiseThreads = 128;

// How the kernels tile one problem: the one place of their tuning choices,
// asked by the launcher (with the device's SM count) and by the workspace size.
struct ConvDepthwiseTiling {
  int vec = 1;        // channels a thread: 4 (one 8- or 16-byte access) or 1 (any C, multiplier)
  int window_w = 0;   // the window width the kernel unrolls (3, 5, 7), 0: a runtime tap loop
  int stride_w = 0;   // the stride along W the kernel unrolls (1, 2), 0: runtime (any, dilated)
  int tile_w = 4;     // outputs a thread along W (fprop/dgrad; wgrad: dy positions a step)
  int block_vecs = 1;  // channel vectors a block
  int block_threads = kConvDepthwiseThreads;
  // fprop/dgrad: a thread a tile of tile_w outputs along W of one output row
  // at a time; a block (block_vecs x tile lanes) a run of consecutive tiles;
  // grid (runs, channel blocks), as many blocks as fit on the device.
  int64_t tiles = 0;
  // wgrad: a thread (channel vector, tap row, lane); a block a share of the (n, o, p)
  // rows ("part"); grid (parts, channel blocks, tap blocks).
  int tap_rows = 1;          // (t, r) pairs, or all taps on the runtime path
  int tap_rows_block = 1;    // of them a block
  int lanes = 1;             // row lanes a block
  int64_t parts = 1;
  int64_t channel_blocks = 1;
  int64_t tap_blocks = 1;
};

// `vector_ok`: the buffers are aligned for the vector path (XLA's are).
ConvDepthwiseTiling ConvDepthwiseTile(ConvOp op, const ConvShape& shape, DType dtype, int sm_count,
                                      bool vector_ok = true);

// wgrad's workspace: first the fp32 sum [K * taps] of the parts (none when dw
// is fp32: the sum goes straight to dw), this many bytes (a multiple of 256),
// then the per-part fp32 partials [parts, K * taps], summed in a fixed order
// (ffi/common/column_sum.h): deterministic.
int64_t ConvDepthwiseWgradSumBytes(const ConvShape& shape, DType dtype);

}  // namespace jax_dnn
