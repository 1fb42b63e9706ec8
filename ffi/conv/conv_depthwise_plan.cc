// The depthwise kernels' plan: see conv_depthwise_plan.h. Host-only.
#include "ffi/conv/conv_depthwise_plan.h"

#include <algorithm>

#include "ffi/conv/conv_direct_plan.h"

namespace jax_dnn {
namespace {

constexpr int kThreads = kConvDepthwiseThreads;
constexpr int64_t kTableBytes = 48 * 1024;  // a block's window table: no opt-in shared memory
constexpr int64_t kMaxGridX = (int64_t{1} << 31) - 1;
constexpr int64_t kMaxGridYZ = 65535;
constexpr int64_t kMaxExtent = (int64_t{1} << 31) - 1;
// wgrad: the blocks that fit an SM at once (3-4 at 100-140 registers); more
// parts only add partials (parts x K x taps fp32, written and read back once).
constexpr int64_t kWgradBlocksPerSm = 4;
// SMs the parts count with at most, and where no device is known: the
// workspace for sm_count = 0 is then an upper bound for every device (H200: 132).
constexpr int kSmCountBound = 256;
constexpr int64_t kWgradMaxParts = 4096;

int64_t Ceil(int64_t a, int64_t b) { return (a + b - 1) / b; }

int64_t Taps(const ConvShape& s) { return s.window[0] * s.window[1] * s.window[2]; }

// The unrolled W window and stride for fprop / wgrad (`stride` and `dilation`
// of W), or {0, 0} for the runtime loop. Stride 2 only for 3 and 5: a
// 7-wide stride-2 tile would read 19 inputs a row into registers.
void FastWindow(int64_t width, int64_t stride, int64_t dilation, int* window_w, int* stride_w) {
  *window_w = 0;
  *stride_w = 0;
  if (dilation != 1) return;
  const bool fast_width = width == 3 || width == 5 || width == 7;
  if (fast_width && (stride == 1 || (stride == 2 && width <= 5))) {
    *window_w = static_cast<int>(width);
    *stride_w = static_cast<int>(stride);
  }
}

// The channel vectors of a block for fprop/dgrad: all of them up to 16, else
// a divisor of their count in [8, 16] (no idle lanes), else 8. Few channels
// a block, so that a block's input rows stay in L1 while it walks down the
// output rows (see conv_depthwise.cu): at 8 vectors of bf16, a 7x7 window's
// 10 input rows of 62 positions are 40 KB a block.
int BlockVecs(int64_t vecs) {
  if (vecs <= 16) return static_cast<int>(vecs);
  for (int d = 16; d >= 8; --d) {
    if (vecs % d == 0) return d;
  }
  return 8;
}

}  // namespace

ConvDepthwiseTiling ConvDepthwiseTile(ConvOp op, const ConvShape& s, DType /*dtype*/, int sm_count,
                                      bool vector_ok) {
  ConvDepthwiseTiling t;
  const int64_t mult = s.c > 0 ? s.k / s.c : 1;
  const int64_t taps = Taps(s);
  // 4 channels a thread: 8 bytes (bf16/fp16) or 16 (fp32) an access. The
  // multiplier > 1 and C % 4 != 0 take the scalar path.
  t.vec = (vector_ok && mult == 1 && s.c % 4 == 0) ? 4 : 1;
  if (op == ConvOp::kWgrad) {
    if (t.vec == 4) FastWindow(s.window[2], s.stride[2], s.dilation[2], &t.window_w, &t.stride_w);
    t.tile_w = t.stride_w == 1 ? 14 : (t.stride_w == 2 ? 7 : 4);
    t.tap_rows = static_cast<int>(t.window_w > 0 ? s.window[0] * s.window[1] : taps);
    const int64_t vecs = Ceil(s.k, t.vec);
    // 8 vectors (32 channels) a block: the partials are parts x K x taps, so a
    // block covers few channels and the grid many parts of the rows (a
    // warp still reads 64 contiguous bytes at bf16).
    t.block_vecs = static_cast<int>(std::min<int64_t>(vecs, t.vec == 4 ? 8 : 32));
    t.tap_rows_block = std::min(t.tap_rows, kThreads / t.block_vecs);
    t.lanes = std::max(1, kThreads / (t.block_vecs * t.tap_rows_block));
    t.block_threads = t.block_vecs * t.tap_rows_block * t.lanes;
    t.channel_blocks = Ceil(vecs, t.block_vecs);
    t.tap_blocks = Ceil(t.tap_rows, t.tap_rows_block);
    const int64_t rows = s.n * s.output[0] * s.output[1];
    const int64_t sms = sm_count > 0 ? std::min(sm_count, kSmCountBound) : kSmCountBound;
    int64_t parts = Ceil(kWgradBlocksPerSm * sms, t.channel_blocks * t.tap_blocks);
    parts = std::min(parts, Ceil(rows, t.lanes));
    t.parts = std::max<int64_t>(1, std::min(parts, kWgradMaxParts));
    return t;
  }
  const bool dgrad = op == ConvOp::kDgrad;
  // dgrad with stride 1 is a forward pass of dy with the mirrored window, so
  // it takes the unrolled kernel too; with stride > 1 it gathers on the runtime path.
  const bool unit_stride = s.stride[0] == 1 && s.stride[1] == 1 && s.stride[2] == 1;
  if (t.vec == 4 && (!dgrad || unit_stride)) {
    FastWindow(s.window[2], s.stride[2], s.dilation[2], &t.window_w, &t.stride_w);
  }
  // A tile of 14 outputs along W (7 at stride 2): the W extents of ConvNeXt /
  // MobileNet / ResNet layers are 7 * 2^j, so no tile is partial there; a
  // 7-wide row of weights (28 floats) then serves 14 outputs, and its 20
  // inputs each take 7 FMAs: 0.6 bytes from L1 / shared memory an FMA.
  t.tile_w = t.stride_w == 1 ? 14 : (t.stride_w == 2 ? 7 : 4);
  const int64_t out_ch = dgrad ? s.c : s.k;
  const int64_t* out_ext = dgrad ? s.input : s.output;
  const int64_t terms = (dgrad && t.vec == 1) ? mult : 1;
  int cb = BlockVecs(Ceil(out_ch, t.vec));
  while (cb > 1 && taps * cb * t.vec * terms * 4 > kTableBytes) cb = (cb + 1) / 2;
  t.block_vecs = cb;
  t.block_threads = cb * (kThreads / cb);
  t.tiles = s.n * out_ext[0] * out_ext[1] * Ceil(out_ext[2], t.tile_w);
  t.channel_blocks = Ceil(Ceil(out_ch, t.vec), cb);
  return t;
}

bool ConvDepthwiseSupports(ConvOp op, const ConvShape& s, DType dtype, std::string* why) {
  auto no = [&](const std::string& reason) {
    if (why) *why = "depthwise: " + reason;
    return false;
  };
  if (s.c < 1 || s.groups != s.c) return no("needs groups == C (a depthwise convolution)");
  if (s.k < s.c || s.k % s.c != 0) return no("needs K a multiple of C (K = C * multiplier)");
  if (s.rank < 1 || s.rank > 3) return no("needs spatial rank 1, 2 or 3");
  if (s.n < 0) return no("negative batch");
  if (s.c > kMaxExtent || s.k > kMaxExtent) return no("channels past 2^31");
  for (int d = 0; d < 3; ++d) {
    if (s.stride[d] < 1 || s.dilation[d] < 1) return no("needs stride and dilation >= 1");
    if (s.pad_lo[d] < 0 || s.pad_hi[d] < 0) return no("needs non-negative padding");
    if (s.window[d] < 1 || s.input[d] < 1) return no("needs window and input extents >= 1");
    if (s.input[d] > kMaxExtent || s.output[d] > kMaxExtent || s.window[d] > kMaxExtent ||
        s.pad_lo[d] > kMaxExtent || s.pad_hi[d] > kMaxExtent) {
      return no("spatial extents past 2^31");
    }
    const int64_t span = s.dilation[d] * (s.window[d] - 1) + 1;
    const int64_t padded = s.input[d] + s.pad_lo[d] + s.pad_hi[d];
    const int64_t out = padded < span ? 0 : (padded - span) / s.stride[d] + 1;
    if (out != s.output[d]) {
      return no("output extents do not match input, window, stride and padding");
    }
  }
  if (Taps(s) > kConvDepthwiseMaxTaps) {
    return no("window of " + std::to_string(Taps(s)) + " taps, past " +
              std::to_string(kConvDepthwiseMaxTaps) + " (a direct kernel's FMAs an output)");
  }
  const ConvDepthwiseTiling t = ConvDepthwiseTile(op, s, dtype, 0);
  if (op == ConvOp::kWgrad) {
    if (t.channel_blocks > kMaxGridYZ || t.tap_blocks > kMaxGridYZ) return no("too many channels");
  } else {
    const int64_t mult = s.k / s.c;
    if (op == ConvOp::kDgrad && t.vec == 1 && Taps(s) * mult * 4 > kTableBytes) {
      return no("multiplier x taps past " + std::to_string(kTableBytes / 4) +
                " (a block's window table in shared memory)");
    }
    if (t.channel_blocks > kMaxGridYZ) return no("too many channels");
    if (Ceil(t.tiles, t.block_threads / t.block_vecs) > kMaxGridX) return no("too many outputs");
  }
  if (why) why->clear();
  return true;
}

int64_t ConvDepthwiseWgradSumBytes(const ConvShape& s, DType dtype) {
  return dtype == DType::kF32 ? 0 : Ceil(s.k * Taps(s) * 4, 256) * 256;
}

int64_t ConvDepthwiseWorkspaceBytes(ConvOp op, const ConvShape& s, DType dtype, int sm_count) {
  if (op != ConvOp::kWgrad) return 0;
  const ConvDepthwiseTiling t = ConvDepthwiseTile(op, s, dtype, sm_count);
  // Room for the parts of whichever kernel runs (the tiled one needs
  // 16-byte aligned buffers, which XLA's are).
  int64_t parts = t.parts;
  if (ConvDepthwiseTiled(op, s, dtype, true))
    parts = std::max(parts, ConvDepthwiseTiledWgradParts(s, dtype, sm_count));
  return ConvDepthwiseWgradSumBytes(s, dtype) + parts * s.k * Taps(s) * 4;
}

}  // namespace jax_dnn
