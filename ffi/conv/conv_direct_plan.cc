// The tiled direct convolution's plan: see conv_direct_plan.h. Host-only.
#include "ffi/conv/conv_direct_plan.h"

#include <algorithm>
#include <numeric>

namespace jax_dnn {
namespace {

constexpr int64_t kMaxExtent = (int64_t{1} << 31) - 1;
constexpr int64_t kMaxGridYZ = 65535;
constexpr int64_t kMaxTiles = int64_t{1} << 30;
// Threads a block the tiling aims at (the kernel's launch bound is 512 with
// two blocks an SM: 64 registers a thread). 256 threads of 2 x 7 outputs
// and 32 channel pairs are an 8 x 14 tile of 64 channels: 3-4 blocks an SM.
constexpr int kTargetThreads = 256;
constexpr int kMaxThreads = 512;
// A slice's channels: at most 128 bytes a pixel (one line a warp), and each
// further slice costs about 32 bytes a pixel of index math and halo
// bookkeeping: C = 144 at bf16 runs 3 slices of 48 (not 64 + 64 + 16).
constexpr int64_t kSliceBytes = 128;
constexpr int64_t kSliceOverheadBytes = 32;

int64_t Ceil(int64_t a, int64_t b) { return (a + b - 1) / b; }

int64_t ElementBytes(DType dtype) { return dtype == DType::kF32 ? 4 : 2; }

}  // namespace

ConvDirectPassShape ConvDirectPass(ConvOp op, const ConvShape& s) {
  ConvDirectPassShape p;
  p.n = s.n;
  p.groups = s.groups;
  p.dgrad = op == ConvOp::kDgrad;
  p.in_ch = p.dgrad ? s.k : s.c;
  p.out_ch = p.dgrad ? s.c : s.k;
  p.cg = s.groups > 0 ? p.in_ch / s.groups : 1;
  p.kg = s.groups > 0 ? p.out_ch / s.groups : 1;
  for (int d = 0; d < 3; ++d) {
    p.in_ext[d] = p.dgrad ? s.output[d] : s.input[d];
    p.out_ext[d] = p.dgrad ? s.input[d] : s.output[d];
    p.window[d] = s.window[d];
    p.dilation[d] = s.dilation[d];
    // dgrad runs at stride 1 only (the caller checks): dx[i] takes dy at
    // i + pad_lo - tap * dilation, i.e. the mirrored tap t' at
    // i + pad_lo - (window - 1) * dilation + t' * dilation.
    p.stride[d] = p.dgrad ? 1 : s.stride[d];
    p.tap0[d] = p.dgrad ? s.pad_lo[d] - (s.window[d] - 1) * s.dilation[d] : -s.pad_lo[d];
  }
  return p;
}

ConvDirectTiling ConvDirectTile(const ConvDirectPassShape& p, DType dtype) {
  ConvDirectTiling t;
  const int64_t esize = ElementBytes(dtype);
  t.vec = static_cast<int>(16 / esize);
  const bool depthwise = p.cg == 1 && p.kg == 1;
  // Depthwise: a thread 2 channels x 2 rows x 7 columns (28 accumulators; a
  // window row's weights, 2 x S, serve both rows). Grouped: kt output
  // channels of one group x 7 columns, each input read once for the kt.
  t.kt = depthwise ? 2 : (p.kg % 4 == 0 ? 4 : (p.kg % 2 == 0 ? 2 : 1));
  t.rows_t = depthwise ? 2 : 1;
  if (p.in_ch % t.vec != 0 || p.out_ch % t.vec != 0) {
    t.why = "channels must be multiples of " + std::to_string(t.vec) + " (16-byte rows)";
    return t;
  }
  // Groups a slice: a multiple of ng0 (so that a slice is whole 16-byte
  // copies), within 128 bytes a pixel where ng0's allow, the count that
  // wastes least (padded channels plus a slice's overhead), ties to the wider.
  const int64_t ng0 = t.vec / std::gcd<int64_t>(p.cg, t.vec);
  const int64_t max_ng = std::max(ng0, (kSliceBytes / esize) / p.cg / ng0 * ng0);
  const int64_t groups_up = Ceil(p.groups, ng0) * ng0;
  int64_t best_ng = ng0, best_cost = -1;
  for (int64_t ng = ng0; ng <= std::min(max_ng, groups_up); ng += ng0) {
    const int64_t cost = Ceil(p.groups, ng) * (ng * p.cg * esize + kSliceOverheadBytes);
    if (best_cost < 0 || cost <= best_cost) {
      best_cost = cost;
      best_ng = ng;
    }
  }
  t.slice_in = best_ng * p.cg;
  t.slice_out = best_ng * p.kg;
  t.slices = Ceil(p.groups, best_ng);
  t.lanes = static_cast<int>(std::min<int64_t>(t.slice_out / t.kt, kMaxThreads + 1));
  if (t.lanes > kMaxThreads) {
    t.why = "too many output channels a group (" + std::to_string(p.kg) + ")";
    return t;
  }
  if (t.slices > kMaxGridYZ) {
    t.why = "too many channels";
    return t;
  }
  const int64_t taps = p.window[0] * p.window[1] * p.window[2];
  t.table_bytes = Ceil(taps * t.slice_out * p.cg * 4, 16) * 16;
  // Spatial threads: a power of two up to kTargetThreads / lanes, split into
  // row x column threads for the least traffic an output (the input tile
  // with its halo, read from L2, plus the outputs the tile covers past the
  // edges), halved while the double buffer passes the budget.
  int sp = 1;
  while (sp * 2 * t.lanes <= kTargetThreads) sp *= 2;
  for (; sp >= 1; sp /= 2) {
    int64_t best = -1;
    for (int rt = 1; rt <= sp; rt *= 2) {
      const int ct = sp / rt;
      const int64_t th = int64_t{rt} * t.rows_t, tw = int64_t{ct} * t.cols_t;
      const int64_t rows_in = (th - 1) * p.stride[1] + (p.window[1] - 1) * p.dilation[1] + 1;
      const int64_t cols_in = (tw - 1) * p.stride[2] + (p.window[2] - 1) * p.dilation[2] + 1;
      const int64_t tiles_h = Ceil(p.out_ext[1], th), tiles_w = Ceil(p.out_ext[2], tw);
      const int64_t cost = tiles_h * tiles_w * (rows_in * cols_in + th * tw);
      const int64_t buffer = rows_in * cols_in * t.slice_in * esize;
      if (t.table_bytes + 2 * buffer > kConvDirectSmemBudget) continue;
      if (best < 0 || cost < best) {
        best = cost;
        t.row_threads = rt;
        t.col_threads = ct;
        t.tile_h = static_cast<int>(th);
        t.tile_w = static_cast<int>(tw);
        t.rows_in = static_cast<int>(rows_in);
        t.cols_in = static_cast<int>(cols_in);
        t.tiles_h = tiles_h;
        t.tiles_w = tiles_w;
        t.buffer_bytes = buffer;
      }
    }
    if (best >= 0) break;
  }
  if (t.tile_h == 0) {
    t.why = "the window and its slice of channels pass the shared memory budget (" +
            std::to_string(kConvDirectSmemBudget / 1024) + " KB a block)";
    return t;
  }
  t.threads = t.lanes * t.row_threads * t.col_threads;
  t.smem_bytes = t.table_bytes + 2 * t.buffer_bytes;
  t.tiles = p.n * p.out_ext[0] * t.tiles_h * t.tiles_w;
  // The kernel walks tiles in 32-bit (a tile index plus the grid stays below 2^31).
  if (t.tiles > kMaxTiles) {
    t.why = "more than 2^30 output tiles";
    return t;
  }
  if (depthwise && p.dilation[2] == 1 && (p.stride[2] == 1 || p.stride[2] == 2) &&
      (p.window[2] == 3 || p.window[2] == 5 || p.window[2] == 7)) {
    t.window_w = static_cast<int>(p.window[2]);
    t.stride_w = static_cast<int>(p.stride[2]);
  }
  t.ok = true;
  return t;
}

namespace {

// Extents the kernel indexes in 32 bits (offsets are 64-bit).
std::string ExtentError(const ConvShape& s) {
  if (s.n > kMaxExtent || s.c > kMaxExtent || s.k > kMaxExtent) return "extents past 2^31";
  for (int d = 0; d < 3; ++d)
    for (int64_t e : {s.input[d], s.output[d], s.window[d], s.stride[d], s.dilation[d],
                      s.pad_lo[d], s.pad_hi[d]})
      if (e > kMaxExtent / 4) return "spatial extents past 2^29";
  return "";
}

}  // namespace

bool ConvGroupedSupports(ConvOp op, const ConvShape& s, DType dtype, std::string* why) {
  auto no = [&](const std::string& reason) {
    if (why) *why = "grouped_direct: " + reason;
    return false;
  };
  if (s.groups <= 1) return no("needs groups > 1");
  if (s.c % s.groups != 0 || s.k % s.groups != 0) return no("groups must divide C and K");
  const int64_t cg = s.c / s.groups;
  if (cg == 1) return no("one channel a group is depthwise (depthwise_direct)");
  if (cg > kConvGroupedMaxChannels)
    return no(std::to_string(cg) + " input channels a group, past " +
              std::to_string(kConvGroupedMaxChannels) +
              " (groups that wide are dense enough for a GEMM: XLA runs them)");
  if (op == ConvOp::kWgrad) return no("no wgrad kernel (XLA runs it)");
  if (op == ConvOp::kDgrad)
    for (int d = 0; d < 3; ++d)
      if (s.stride[d] != 1) return no("strided dgrad (XLA runs it)");
  const std::string extent = ExtentError(s);
  if (!extent.empty()) return no(extent);
  const ConvDirectTiling t = ConvDirectTile(ConvDirectPass(op, s), dtype);
  if (!t.ok) return no(t.why);
  if (why) why->clear();
  return true;
}

bool ConvDepthwiseTiled(ConvOp op, const ConvShape& s, DType dtype, bool aligned) {
  if (op == ConvOp::kWgrad || !aligned || s.groups != s.c || s.k != s.c) return false;
  if (op == ConvOp::kDgrad)
    for (int d = 0; d < 3; ++d)
      if (s.stride[d] != 1) return false;
  if (!ExtentError(s).empty()) return false;
  return ConvDirectTile(ConvDirectPass(op, s), dtype).ok;
}

}  // namespace jax_dnn
