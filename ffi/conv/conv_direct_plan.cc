// The tiled direct convolution's plan: see conv_direct_plan.h. Host-only.
#include "ffi/conv/conv_direct_plan.h"

#include <algorithm>
#include <array>
#include <cstdlib>
#include <numeric>
#include <vector>

namespace jax_dnn {
namespace {

constexpr int64_t kMaxExtent = (int64_t{1} << 31) - 1;
constexpr int64_t kMaxGridYZ = 65535;
constexpr int64_t kMaxTiles = int64_t{1} << 30;
// Threads a block the tiling aims at, at most (the kernels' launch bounds
// hold them to 64 registers a thread). 256 threads of 2 x 7 outputs and 32
// channel pairs are an 8 x 14 tile of 64 channels: 3-4 blocks an SM.
constexpr int kTargetThreads = 256;
constexpr int kMaxThreads = 512;
// A slice's channels: at most 128 bytes a pixel (one line a warp), and each
// further slice costs about 32 bytes a pixel of index math and halo
// bookkeeping: C = 144 at bf16 runs 3 slices of 48 (not 64 + 64 + 16).
constexpr int64_t kSliceBytes = 128;
constexpr int64_t kSliceOverheadBytes = 32;
constexpr int64_t kMinSliceBytes = 64;
// The tiled wgrad's parts: at most this many blocks an SM (the occupancy the
// launcher finds is below it), SMs counted up to kSmCountBound (where none
// is known, the workspace is then an upper bound for every device).
constexpr int64_t kWgradBlocksPerSm = 8;
constexpr int kSmCountBound = 256;
constexpr int kWgradUnits = 16;
// Shared memory a block that three fit an SM (228 KB less 1 KB a block).
constexpr int64_t kPreferredSmem = 72 * 1024;

int64_t Ceil(int64_t a, int64_t b) { return (a + b - 1) / b; }

int64_t ElementBytes(DType dtype) { return dtype == DType::kF32 ? 4 : 2; }

}  // namespace

ConvDirectPassShape ConvDirectPass(ConvOp op, const ConvShape& s) {
  ConvDirectPassShape p;
  p.n = s.n;
  p.groups = s.groups;
  p.dgrad = op == ConvOp::kDgrad;
  p.wgrad = op == ConvOp::kWgrad;
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
  t.kt = depthwise || p.wgrad ? 2 : (p.kg % 4 == 0 ? 4 : (p.kg % 2 == 0 ? 2 : 1));
  t.rows_t = depthwise && !p.wgrad ? 2 : 1;
  if (p.in_ch % t.vec != 0 || p.out_ch % t.vec != 0) {
    t.why = "channels must be multiples of " + std::to_string(t.vec) + " (16-byte rows)";
    return t;
  }
  // Groups a slice (ng): a multiple of ng0, so that a slice is whole 16-byte
  // copies; within 128 bytes a pixel (a warp's line) where ng0 allows, and
  // at least 64 (two 32-byte sectors) where the channels allow. Ranked by
  // waste: twice the padded channels' bytes (they cost FMAs and stores) plus
  // each slice's overhead; ties to the less padded, then the wider.
  // wgrad copies dy's slice too: whole 16-byte copies of its channels.
  int64_t ng0 = t.vec / std::gcd<int64_t>(p.cg, t.vec);
  if (p.wgrad) ng0 = std::lcm<int64_t>(ng0, t.vec / std::gcd<int64_t>(p.kg, t.vec));
  const int64_t max_ng = std::max(ng0, (kSliceBytes / esize) / p.cg / ng0 * ng0);
  const int64_t groups_up = Ceil(p.groups, ng0) * ng0;
  const int64_t min_bytes = std::min(kMinSliceBytes, groups_up * p.cg * esize);
  std::vector<std::array<int64_t, 3>> ranked;  // (cost, padded bytes, -ng)
  for (int64_t ng = ng0; ng <= std::min(max_ng, groups_up); ng += ng0) {
    if (ng * p.cg * esize < min_bytes) continue;
    const int64_t padded = Ceil(p.groups, ng) * ng * p.cg * esize;
    ranked.push_back({2 * padded + Ceil(p.groups, ng) * kSliceOverheadBytes, padded, -ng});
  }
  if (ranked.empty()) ranked.push_back({0, 0, -ng0});  // ng0 alone passes 128 bytes
  std::sort(ranked.begin(), ranked.end());
  const int64_t taps = p.window[0] * p.window[1] * p.window[2];

  // For one slice and up to `sp` spatial threads (a power of two): the count
  // and split into row x column threads with the least traffic (the input
  // tiles with their halo, read from L2, plus the outputs the tiles cover
  // past the edges: small images take fewer threads). `strict`: that best
  // one, if its table and double buffer fit `budget`; else the best split of
  // `sp` threads that fits. False if none.
  // wgrad: a thread's share of the window (depthwise: a window row; grouped:
  // a tap) and its sums an output channel (S taps; the group's cg channels).
  const int wgrad_rows = static_cast<int>(depthwise ? p.window[1] : p.window[1] * p.window[2]);
  const int64_t wgrad_sums = depthwise ? p.window[2] : p.cg;
  auto try_tiling = [&](int64_t ng, int sp, int64_t budget, bool strict) {
    const int min_units = strict ? 1 : sp;
    const int64_t slice_in = ng * p.cg, slice_out = ng * p.kg;
    const int lanes = static_cast<int>(slice_out / t.kt);
    // wgrad: no window table; the threads' sums (S x 2 floats each) for the
    // block's fixed-order reduction.
    if (p.wgrad && lanes * wgrad_rows > kMaxThreads) return false;
    const int segments = p.wgrad ? std::max<int>(1, kTargetThreads / (lanes * wgrad_rows)) : 1;
    const int64_t table =
        p.wgrad ? Ceil(int64_t{lanes} * wgrad_rows * segments * wgrad_sums * 2 * 4, 16) * 16
                : Ceil(taps * slice_out * p.cg * 4, 16) * 16;
    int64_t best = -1;
    bool ok = false;
    for (int units = sp; units >= min_units; units /= 2)
    for (int rt = 1; rt <= units; rt *= 2) {
      const int ct = units / rt;
      const int64_t th = int64_t{rt} * t.rows_t, tw = int64_t{ct} * t.cols_t;
      const int64_t rows_in = (th - 1) * p.stride[1] + (p.window[1] - 1) * p.dilation[1] + 1;
      const int64_t cols_in = (tw - 1) * p.stride[2] + (p.window[2] - 1) * p.dilation[2] + 1;
      const int64_t tiles_h = Ceil(p.out_ext[1], th), tiles_w = Ceil(p.out_ext[2], tw);
      const int64_t cost = tiles_h * tiles_w * (rows_in * cols_in + th * tw);
      const int64_t buffer =
          (rows_in * cols_in * slice_in + (p.wgrad ? th * tw * slice_out : 0)) * esize;
      const bool fits = table + 2 * buffer <= budget;
      if (!fits && !strict) continue;
      if (best < 0 || cost < best) {
        ok = fits;
        best = cost;
        t.slice_in = slice_in;
        t.slice_out = slice_out;
        t.slices = Ceil(p.groups, ng);
        t.lanes = lanes;
        t.table_bytes = table;
        t.row_threads = rt;
        t.col_threads = ct;
        t.tile_h = static_cast<int>(th);
        t.tile_w = static_cast<int>(tw);
        t.rows_in = static_cast<int>(rows_in);
        t.cols_in = static_cast<int>(cols_in);
        t.tiles_h = tiles_h;
        t.tiles_w = tiles_w;
        t.buffer_bytes = buffer;
        t.segments = segments;
      }
    }
    return best >= 0 && ok;
  };
  // Spatial threads: a power of two up to kTargetThreads / lanes. wgrad's
  // threads split the window rows instead; its tile is 16 units of 7
  // outputs (8 x 14 at 64 bytes a pixel: 25 KB of x and dy a stage).
  auto full_sp = [&](int64_t ng) {
    if (p.wgrad) return kWgradUnits;
    int sp = 1;
    while (sp * 2 * (ng * p.kg / t.kt) <= kTargetThreads) sp *= 2;
    return sp;
  };
  if (ranked.front()[2] * -1 * p.kg / t.kt > kMaxThreads) {
    t.why = "too many output channels a group (" + std::to_string(p.kg) + ")";
    return t;
  }
  // The first that fits: full blocks within the preferred budget (three
  // blocks of 256 threads an SM: 24 warps), the slices in rank order (a
  // 7x7 window at bf16 takes 32 channels in a 16 x 14 tile, 62 KB, over 64
  // in an 8 x 14 one, 84 KB: 2 blocks an SM); then within the budget; then
  // fewer threads a block.
  bool found = false;
  for (int64_t budget : {kPreferredSmem, kConvDirectSmemBudget}) {
    for (const auto& r : ranked) {
      if (-r[2] * p.kg / t.kt > kMaxThreads) continue;
      if ((found = try_tiling(-r[2], full_sp(-r[2]), budget, true))) break;
    }
    if (found) break;
  }
  // Last, slices narrower than 64 bytes (a wide window's table or a
  // strided, dilated tile), then fewer threads a block.
  std::vector<int64_t> last;
  for (const auto& r : ranked) last.push_back(-r[2]);
  for (int64_t ng = std::min(max_ng, groups_up); ng >= ng0; ng -= ng0)
    if (ng * p.cg * esize < min_bytes) last.push_back(ng);
  for (int halve = 0; !found && halve < 10; ++halve) {
    for (int64_t ng : last) {
      const int sp = full_sp(ng) >> halve;
      if (ng * p.kg / t.kt > kMaxThreads || sp < 1) continue;
      if ((found = try_tiling(ng, sp, kConvDirectSmemBudget, false))) break;
    }
  }
  if (!found) {
    t.why = "the window and its slice of channels pass the shared memory budget (" +
            std::to_string(kConvDirectSmemBudget / 1024) + " KB a block)";
    return t;
  }
  if (t.slices > kMaxGridYZ) {
    t.why = "too many channels";
    return t;
  }
  t.threads = p.wgrad ? t.lanes * wgrad_rows * t.segments
                      : t.lanes * t.row_threads * t.col_threads;
  t.smem_bytes = t.table_bytes + 2 * t.buffer_bytes;
  t.tiles = p.n * p.out_ext[0] * t.tiles_h * t.tiles_w;
  // The kernel walks tiles in 32-bit (a tile index plus the grid stays below
  // 2^31) and input positions too: the last tile's reach must stay below 2^31.
  if (t.tiles > kMaxTiles) {
    t.why = "more than 2^30 output tiles";
    return t;
  }
  const int64_t covered[3] = {p.out_ext[0], t.tiles_h * t.tile_h, t.tiles_w * t.tile_w};
  for (int d = 0; d < 3; ++d) {
    const int64_t reach = (covered[d] - 1) * p.stride[d] + (p.window[d] - 1) * p.dilation[d] +
                          1 + std::abs(p.tap0[d]);
    if (reach > kMaxExtent) {
      t.why = "input positions past 2^31";
      return t;
    }
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
  if (op == ConvOp::kWgrad) {
    if (s.window[0] != 1) return no("wgrad of 3D windows (XLA runs it)");
    if (cg != 2 && cg != 4 && cg != 8 && cg != 16)
      return no("wgrad needs 2, 4, 8 or 16 input channels a group (XLA runs it)");
    if ((s.k / s.groups) % 2 != 0) return no("wgrad needs an even K / groups (XLA runs it)");
  }
  if (op == ConvOp::kDgrad)
    for (int d = 0; d < 3; ++d)
      if (s.stride[d] != 1) return no("strided dgrad (it runs as stride-1 forward convolutions, one a phase, "
                                    "where a forward algorithm takes each; else XLA)");
  const std::string extent = ExtentError(s);
  if (!extent.empty()) return no(extent);
  const ConvDirectTiling t = ConvDirectTile(ConvDirectPass(op, s), dtype);
  if (!t.ok) return no(t.why);
  if (t.threads > kMaxThreads)
    return no("K / groups x window past " + std::to_string(kMaxThreads) + " threads a block");
  if (why) why->clear();
  return true;
}

int64_t ConvGroupedWorkspaceBytes(ConvOp op, const ConvShape& s, DType dtype, int sm_count) {
  if (op != ConvOp::kWgrad) return 0;
  const ConvDirectTiling t = ConvDirectTile(ConvDirectPass(op, s), dtype);
  if (!t.ok) return 0;
  return ConvDirectWgradSumBytes(s, dtype) +
         ConvDirectWgradParts(t, sm_count) * ConvDirectWgradWidth(s) * 4;
}

int64_t ConvDirectWgradWidth(const ConvShape& s) {
  return s.k * s.window[0] * s.window[1] * s.window[2] * (s.c / s.groups);
}

int64_t ConvDirectWgradSumBytes(const ConvShape& s, DType dtype) {
  return dtype == DType::kF32 ? 0 : Ceil(ConvDirectWgradWidth(s) * 4, 256) * 256;
}

int64_t ConvDirectWgradParts(const ConvDirectTiling& t, int sm_count) {
  const int64_t sms = sm_count > 0 ? std::min(sm_count, kSmCountBound) : kSmCountBound;
  return std::max<int64_t>(1, std::min(t.tiles, Ceil(kWgradBlocksPerSm * sms, t.slices)));
}

bool ConvDepthwiseTiled(ConvOp op, const ConvShape& s, DType dtype, bool aligned) {
  if (!aligned || s.groups != s.c || s.k != s.c) return false;
  if (op == ConvOp::kDgrad)
    for (int d = 0; d < 3; ++d)
      if (s.stride[d] != 1) return false;
  if (!ExtentError(s).empty()) return false;
  const ConvDirectTiling t = ConvDirectTile(ConvDirectPass(op, s), dtype);
  if (op == ConvOp::kWgrad)
    return t.ok && s.window[0] == 1 && t.window_w > 0 && t.threads <= kMaxThreads;
  return t.ok;
}

int64_t ConvDepthwiseTiledWgradParts(const ConvShape& s, DType dtype, int sm_count) {
  const ConvDirectTiling t = ConvDirectTile(ConvDirectPass(ConvOp::kWgrad, s), dtype);
  return t.ok ? ConvDirectWgradParts(t, sm_count) : 0;
}

}  // namespace jax_dnn
