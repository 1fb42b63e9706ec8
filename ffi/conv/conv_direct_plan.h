// The shared-memory tiled direct convolution (conv_direct.cu), host-only (the
// plans build without CUDA): the fprop and stride-1 dgrad of depthwise
// convolutions (groups == C == K) and of grouped ones with few channels a
// group (grouped_direct: C / groups <= kConvGroupedMaxChannels), and the
// depthwise wgrad's partial sums (its tiles as fprop's, dy's tile beside x's).
//
// One pass computes out[n, o, k] = sum over the group's input channels and
// the window of in[n, o * stride + tap0 + tap * dilation, c] * table[tap, k, c]:
//   fprop: in = x, out = y, the window as given (tap0 = -pad_lo);
//   dgrad (stride 1): in = dy, out = dx, the window mirrored and, within a
//     group, transposed (dx's channel c sums dy's channels of its group),
//     tap0 = pad_lo - (window - 1) * dilation.
// A block owns a tile of outputs (tile_h rows x tile_w columns of one output
// depth slice) and a slice of whole groups (slice_in input channels, at most
// 128 bytes a pixel, so that a warp reads whole lines); it copies the tile's
// input plus halo into shared memory with 16-byte cp.async (zero-filled in
// the padding), one window depth plane at a time, double-buffered: a
// persistent block walks its tiles and loads the next plane while it computes
// this one. The window of its slice sits in shared memory as fp32.
#pragma once

#include <cstdint>
#include <string>

#include "ffi/conv/conv.h"

namespace jax_dnn {

// grouped_direct takes C / groups up to this many input channels a group
// (ResNeXt's 4, up to 16); groups of more channels are dense enough for a
// GEMM and stay with XLA.
constexpr int64_t kConvGroupedMaxChannels = 16;
// Outputs a thread computes along W (7: the W extents of ResNet, ConvNeXt
// and MobileNet layers are 7 * 2^j, so no thread tile is partial there).
constexpr int kConvDirectColsPerThread = 7;
// Shared memory a block at most (input double buffer plus window table):
// two blocks fit an SM (228 KB on Hopper).
constexpr int64_t kConvDirectSmemBudget = 110 * 1024;

// One pass's geometry (see the file comment): channels, extents and window
// of the input it reads and the output it writes.
struct ConvDirectPassShape {
  int64_t n = 0;
  int64_t in_ch = 0, out_ch = 0;
  int64_t groups = 1;
  int64_t cg = 1, kg = 1;  // input / output channels a group
  int64_t in_ext[3] = {1, 1, 1}, out_ext[3] = {1, 1, 1};
  int64_t window[3] = {1, 1, 1};
  int64_t stride[3] = {1, 1, 1}, dilation[3] = {1, 1, 1};
  int64_t tap0[3] = {0, 0, 0};  // input position of tap 0 for output 0
  bool dgrad = false;            // the window mirrored and transposed in its group
  bool wgrad = false;            // depthwise wgrad: fprop's geometry, dy tiles beside x's
};

ConvDirectPassShape ConvDirectPass(ConvOp op, const ConvShape& shape);

// How the kernel tiles one pass: the one place of its tuning choices, asked
// by the launcher and by the plans (whether it fits).
struct ConvDirectTiling {
  bool ok = false;
  std::string why;     // when !ok
  int vec = 8;         // elements a 16-byte copy
  int kt = 2;          // output channels a thread (depthwise: a bf16x2 / half2 / float2 pair)
  int rows_t = 2;      // output rows a thread (depthwise 2, grouped 1)
  int cols_t = kConvDirectColsPerThread;
  int64_t slice_in = 0, slice_out = 0;  // channels a block (whole groups)
  int64_t slices = 0;
  int lanes = 0;               // threads across a slice's output channels
  int row_threads = 1, col_threads = 1;
  int threads = 0;
  int tile_h = 0, tile_w = 0;  // outputs a block tile
  int rows_in = 0, cols_in = 0;  // its input tile, halo included
  int64_t tiles_h = 0, tiles_w = 0;
  int64_t tiles = 0;           // n * out depth * tiles_h * tiles_w
  int64_t table_bytes = 0, buffer_bytes = 0, smem_bytes = 0;
  int window_w = 0;            // depthwise: the W window unrolled (3, 5, 7), 0 runtime
  int stride_w = 0;            // and its W stride (1, 2)
  // wgrad: a thread (channel pair, its share of the window, segment) sums
  // over the tile's (output row, 7 columns) units seg, seg + segments, ...;
  // depthwise: a window row's S taps, grouped: one tap's cg input channels.
  int segments = 1;
};

ConvDirectTiling ConvDirectTile(const ConvDirectPassShape& pass, DType dtype);

// grouped_direct's rules: true when it runs `op` on `shape`; otherwise false
// with the reason in *why. wgrad: 1D/2D windows, 2, 4, 8 or 16 input
// channels a group, an even K / groups.
bool ConvGroupedSupports(ConvOp op, const ConvShape& shape, DType dtype, std::string* why);

// grouped_direct's workspace (wgrad: the fp32 sum unless dw is fp32, then
// the parts' partials [parts, K * taps * C / groups]; fprop, dgrad: 0) on a
// device of `sm_count` SMs (0: unknown, an upper bound).
int64_t ConvGroupedWorkspaceBytes(ConvOp op, const ConvShape& shape, DType dtype, int sm_count);

// The direct wgrads' reduction: dw's elements (K * taps * C / groups), the
// bytes of its fp32 sum at the workspace's start (0 for fp32: dw itself),
// and the parts (blocks a slice) at most.
int64_t ConvDirectWgradWidth(const ConvShape& shape);
int64_t ConvDirectWgradSumBytes(const ConvShape& shape, DType dtype);
int64_t ConvDirectWgradParts(const ConvDirectTiling& tiling, int sm_count);

// Whether the tiled kernel runs a depthwise `op` (its rules are
// ConvDepthwiseSupports'; the rest run conv_depthwise.cu's kernels): fprop
// and stride-1 dgrad, multiplier 1, C a multiple of 16 bytes, buffers
// 16-byte aligned (`aligned`), and a tile within the shared memory budget;
// wgrad also needs a 2D or 1D window (T = 1) of width 3, 5 or 7 at W stride
// 1 or 2, undilated along W.
bool ConvDepthwiseTiled(ConvOp op, const ConvShape& shape, DType dtype, bool aligned);

// The tiled depthwise wgrad's blocks a channel slice at most on a device of
// `sm_count` SMs (0: unknown, an upper bound): its partials [parts, K * taps]
// (the fixed-order reduction's input; see conv_depthwise_wgrad.cu).
int64_t ConvDepthwiseTiledWgradParts(const ConvShape& shape, DType dtype, int sm_count);

}  // namespace jax_dnn
