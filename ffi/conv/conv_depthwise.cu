// Direct depthwise convolution, fprop and dgrad (wgrad: conv_depthwise_wgrad.cu),
// channels last; letters as in conv_depthwise.cuh. fp32 accumulation.
// LaunchConvDepthwise hands what the shared-memory tiled kernel takes
// (ConvDepthwiseTiled: conv_direct.cu) to it; the kernels here run the rest:
// a multiplier, channels not a multiple of 16 bytes, unaligned buffers and
// strided dgrad.
//
// A depthwise convolution does taps FMAs an output element and reads each
// input once from DRAM: memory-bound at 3x3 (9 FMAs an element), close to
// the fp32 FMA rate at 7x7 (49: the H200's 67 TFLOP/s of FMA give 38 us for
// ConvNeXt's 56^2 / 128 / N = 64 layer, the copy bandwidth 25 us). So a
// thread reuses what it loads:
//   - it owns 4 channels (one 8-byte access at bf16/fp16, 16 at fp32), or 1
//     where C % 4 != 0 or the multiplier is > 1 (the scalar path), and a tile
//     of tile_w consecutive outputs along W of one output row;
//   - the block first copies the window of its channels into shared memory
//     as fp32 [taps][channels] (mirrored for dgrad), then a thread takes one
//     window row (S x 4 floats) at a time into registers;
//   - on the unrolled path (S = 3, 5, 7; W stride 1 or 2, no W dilation) it
//     streams the (tile_w - 1) * stride + S inputs of that row through
//     registers, each loaded and converted once and used by every output of
//     the tile it reaches: 14 outputs x 7 taps from 20 loads at 7x7;
//   - the rows of a tile's window, and the neighbouring tiles' overlap, come
//     from L1: a block covers 8-16 channel vectors (32-64 channels) and walks
//     a run of consecutive tiles, along W then down H, so each step reads
//     about one new input row a tile row from L2, and DRAM sees each input
//     about once. (Blocks of all 128 channels, each tile walked by the
//     whole grid in turn, would read every input row R times from L2.)
// Other windows, strides and dilations take a runtime tap loop (tile of 4).
//
// dgrad at stride 1 is a forward pass of dy with the mirrored window and
// padding (window - 1) * dilation - pad_lo. At stride > 1 it gathers: input
// position i takes dy at (i + pad_lo - tap * dilation) / stride where that
// divides, so no zeros are multiplied and nothing is accumulated atomically.
// With a multiplier, dx[c] sums the M output channels c * M + j.
#include <algorithm>
#include <cmath>

#include "ffi/common/device_info.h"
#include "ffi/conv/conv_depthwise.cuh"
#include "ffi/conv/conv_depthwise.h"
#include "ffi/conv/conv_direct.h"

namespace jax_dnn {
namespace depthwise {
namespace {

// The launch bound lets ptxas use up to 255 registers: left to its
// occupancy heuristics, it capped the 5-wide kernel at 128 and spilled.
constexpr int kMaxThreads = kConvDepthwiseThreads;

// One thread: channels [oc0, oc0 + V) of output channel vector `cv` and the
// outputs (n, od, oh, q0 .. q0 + kQt) of its tile; kS > 0: the unrolled window
// width and kSw the W stride; kS == 0: the runtime tap loop (kGather: dgrad's
// strided gather).
template <typename T, int V, int kS, int kSw, int kQt, bool kGather>
__global__ void __launch_bounds__(kMaxThreads, 1) DepthwiseDirectKernel(DirectPass p) {
  extern __shared__ float table[];  // [taps][block channels][terms]
  const int cb = p.block_vecs;
  const int width = cb * V * p.terms;
  const int64_t ch0 = static_cast<int64_t>(blockIdx.y) * cb * V;
  const T* w = static_cast<const T*>(p.w);
#pragma unroll 4
  for (int e = threadIdx.x; e < p.taps * width; e += blockDim.x) {
    const int tap = e / width;
    const int col = e - tap * width;
    const int64_t oc = ch0 + col / p.terms;
    const int j = col % p.terms;
    float v = 0.f;
    if (oc < p.out_ch) {
      const int64_t row = p.dgrad ? oc * p.mult + j : oc;
      v = ToFloat(w[row * p.taps + (p.mirror ? p.taps - 1 - tap : tap)]);
    }
    table[e] = v;
  }
  __syncthreads();

  const int cv = threadIdx.x % cb;
  const int lanes = blockDim.x / cb;
  const int64_t oc0 = ch0 + static_cast<int64_t>(cv) * V;
  if (oc0 >= p.out_ch) return;
  float b[V] = {};
  if (p.bias != nullptr) LoadChannels<T, V>(static_cast<const T*>(p.bias) + oc0, b);
  // A block takes a run of consecutive tiles, `lanes` at a time: along W, then
  // down the output rows, so the input rows of one step are mostly those of
  // the step before (in L1), and its window table serves them all.
  const int64_t first = static_cast<int64_t>(blockIdx.x) * p.block_tiles;
  const int64_t last = std::min(p.tiles, first + p.block_tiles);
  for (int64_t tile = first + threadIdx.x / cb; tile < last; tile += lanes) {
    const int64_t rows = static_cast<int64_t>(p.by_tiles_w.Div(tile));
    const int64_t q0 = (tile - rows * p.tiles_w) * kQt;
    const int64_t planes = static_cast<int64_t>(p.by_out_h.Div(rows));
    const int64_t oh = rows - planes * p.out_ext[1];
    const int64_t n = static_cast<int64_t>(p.by_out_d.Div(planes));
    const int64_t od = planes - n * p.out_ext[0];

    const T* in = static_cast<const T*>(p.in);
    const int64_t in_w_stride = p.in_ch;
    const int64_t in_h_stride = p.axis[2].extent * in_w_stride;
    const int64_t in_d_stride = p.axis[1].extent * in_h_stride;
    float acc[kQt][V] = {};
    for (int j = 0; j < p.terms; ++j) {
      // V == 4 only with M == 1: the vector's channels are the output's.
      const int64_t ic = p.dgrad ? oc0 * p.mult + j : oc0 / p.mult;
      const T* in_n = in + n * p.axis[0].extent * in_d_stride + ic;
      const float* tab = table + cv * V * p.terms + j;
      for (int t = 0; t < p.win[0]; ++t) {
        int64_t id;
        if (!SourcePos<kGather>(p.axis[0], od, t, &id)) continue;
        for (int r = 0; r < p.win[1]; ++r) {
          int64_t ih;
          if (!SourcePos<kGather>(p.axis[1], oh, r, &ih)) continue;
          const T* row = in_n + id * in_d_stride + ih * in_h_stride;
          const float* trow = tab + (t * p.win[1] + r) * p.win[2] * width;
          if constexpr (kS > 0) {
            static_assert(V == 4, "the unrolled path is the vector path");
            float wr[kS][V];
#pragma unroll
            for (int s = 0; s < kS; ++s) {
              const float4 f = *reinterpret_cast<const float4*>(trow + s * width);
              wr[s][0] = f.x;
              wr[s][1] = f.y;
              wr[s][2] = f.z;
              wr[s][3] = f.w;
            }
            const int64_t iw0 = q0 * kSw - p.axis[2].pad;
#pragma unroll
            for (int jj = 0; jj < (kQt - 1) * kSw + kS; ++jj) {
              const int64_t iw = iw0 + jj;
              if (iw < 0 || iw >= p.axis[2].extent) continue;
              float x[V];
              LoadChannels<T, V>(row + iw * in_w_stride, x);
#pragma unroll
              for (int s = 0; s < kS; ++s) {
                const int qq = jj - s;
                if (qq >= 0 && qq % kSw == 0 && qq / kSw < kQt) {
                  float* a = acc[qq / kSw];
#pragma unroll
                  for (int i = 0; i < V; ++i) a[i] = fmaf(x[i], wr[s][i], a[i]);
                }
              }
            }
          } else {
            for (int s = 0; s < p.win[2]; ++s) {
              float wv[V];
#pragma unroll
              for (int i = 0; i < V; ++i) wv[i] = trow[s * width + i * p.terms];
#pragma unroll
              for (int q = 0; q < kQt; ++q) {
                int64_t iw;
                if (!SourcePos<kGather>(p.axis[2], q0 + q, s, &iw)) continue;
                float x[V];
                LoadChannels<T, V>(row + iw * in_w_stride, x);
#pragma unroll
                for (int i = 0; i < V; ++i) acc[q][i] = fmaf(x[i], wv[i], acc[q][i]);
              }
            }
          }
        }
      }
    }

    const int64_t out_base =
        ((n * p.out_ext[0] + od) * p.out_ext[1] + oh) * p.out_ext[2] * p.out_ch + oc0;
    T* out = static_cast<T*>(p.out);
    const T* residual = static_cast<const T*>(p.residual);
#pragma unroll
    for (int q = 0; q < kQt; ++q) {
      if (q0 + q >= p.out_ext[2]) break;
      const int64_t off = out_base + (q0 + q) * p.out_ch;
      float v[V];
#pragma unroll
      for (int i = 0; i < V; ++i) v[i] = acc[q][i] + b[i];
      if (residual != nullptr) {
        float res[V];
        LoadChannels<T, V>(residual + off, res);
#pragma unroll
        for (int i = 0; i < V; ++i) v[i] += res[i];
      }
      if (p.act >= 0) {
#pragma unroll
        for (int i = 0; i < V; ++i) v[i] = ApplyActivation(p.act, v[i]);
      }
      StoreVec<T, V>(out + off, v);
    }
  }
}

template <typename T, int V, int kS, int kSw, int kQt, bool kGather>
cudaError_t Run(const ConvDepthwiseTiling& t, const DirectPass& p, cudaStream_t stream) {
  auto kernel = DepthwiseDirectKernel<T, V, kS, kSw, kQt, kGather>;
  const int lanes = t.block_threads / t.block_vecs;
  const size_t smem = static_cast<size_t>(p.taps) * t.block_vecs * V * p.terms * sizeof(float);
  // As many blocks as fit on the device at once, shared by the channel blocks.
  unsigned slots = 0;
  cudaError_t e = PersistentGrid(kernel, t.block_threads, smem, 1LL << 30, &slots);
  if (e != cudaSuccess) return e;
  const int64_t tile_blocks = (t.tiles + lanes - 1) / lanes;
  const int64_t blocks = std::min(tile_blocks, std::max<int64_t>(1, slots / t.channel_blocks));
  DirectPass q = p;
  q.block_tiles = (tile_blocks + blocks - 1) / blocks * lanes;
  const dim3 grid(static_cast<unsigned>((t.tiles + q.block_tiles - 1) / q.block_tiles),
                  static_cast<unsigned>(t.channel_blocks));
  kernel<<<grid, t.block_threads, smem, stream>>>(q);
  return cudaGetLastError();
}

// The kernel for the plan's (vec, window_w, stride_w, tile_w); see
// ConvDepthwiseTile for the choice.
template <typename T>
cudaError_t RunDirect(const ConvDepthwiseTiling& t, const DirectPass& p, cudaStream_t stream) {
  if (t.tiles == 0 || t.channel_blocks == 0) return cudaSuccess;
  if (p.gather) {
    if (t.vec == 4) return Run<T, 4, 0, 0, 4, true>(t, p, stream);
    return Run<T, 1, 0, 0, 4, true>(t, p, stream);
  }
  if (t.vec == 1) return Run<T, 1, 0, 0, 4, false>(t, p, stream);
  switch (t.window_w * 10 + t.stride_w) {
    case 31:
      return Run<T, 4, 3, 1, 14, false>(t, p, stream);
    case 51:
      return Run<T, 4, 5, 1, 14, false>(t, p, stream);
    case 71:
      return Run<T, 4, 7, 1, 14, false>(t, p, stream);
    case 32:
      return Run<T, 4, 3, 2, 7, false>(t, p, stream);
    case 52:
      return Run<T, 4, 5, 2, 7, false>(t, p, stream);
    default:
      return Run<T, 4, 0, 0, 4, false>(t, p, stream);
  }
}

bool VectorAligned(const void* p, DType dtype) {
  return p == nullptr || IsAligned(p, dtype == DType::kF32 ? 16 : 8);
}

}  // namespace
}  // namespace depthwise

cudaError_t LaunchConvDepthwise(ConvOp op, const ConvShape& s, const ConvArgs& a,
                                cudaStream_t stream) {
  using depthwise::DirectPass;
  if (op == ConvOp::kWgrad) return depthwise::LaunchDepthwiseWgrad(s, a, stream);
  const bool dgrad = op == ConvOp::kDgrad;
  DirectPass p{};
  p.in = dgrad ? a.dy : a.x;
  p.out = dgrad ? a.dx : a.y;
  p.w = a.w;
  p.bias = dgrad ? nullptr : a.bias;
  p.residual = dgrad ? nullptr : a.residual;
  const bool aligned = depthwise::VectorAligned(p.in, a.dtype) &&
                       depthwise::VectorAligned(p.out, a.dtype) &&
                       depthwise::VectorAligned(p.bias, a.dtype) &&
                       depthwise::VectorAligned(p.residual, a.dtype);
  const bool aligned16 = IsAligned(p.in, 16) && IsAligned(p.out, 16) &&
                         (p.bias == nullptr || IsAligned(p.bias, 16)) &&
                         (p.residual == nullptr || IsAligned(p.residual, 16));
  if (ConvDepthwiseTiled(op, s, a.dtype, aligned16))
    return LaunchConvDirectTiled(op, s, a, stream);
  const ConvDepthwiseTiling t = ConvDepthwiseTile(op, s, a.dtype, SmCount(), aligned);
  p.in_ch = dgrad ? s.k : s.c;
  p.out_ch = dgrad ? s.c : s.k;
  p.mult = static_cast<int>(s.k / s.c);
  p.terms = (dgrad && t.vec == 1) ? p.mult : 1;
  p.dgrad = dgrad;
  const bool unit_stride = s.stride[0] == 1 && s.stride[1] == 1 && s.stride[2] == 1;
  p.gather = dgrad && !unit_stride;
  p.mirror = dgrad && unit_stride;
  p.act = dgrad ? kConvNoActivation : a.activation;
  p.taps = static_cast<int>(s.window[0] * s.window[1] * s.window[2]);
  for (int d = 0; d < 3; ++d) {
    p.out_ext[d] = static_cast<int>(dgrad ? s.input[d] : s.output[d]);
    p.win[d] = static_cast<int>(s.window[d]);
    depthwise::Axis& ax = p.axis[d];
    ax.stride = s.stride[d];
    ax.dil = s.dilation[d];
    ax.extent = dgrad ? s.output[d] : s.input[d];
    // The mirrored window's tap 0 sits (window - 1) * dilation - pad_lo before its output.
    ax.pad = p.mirror ? (s.window[d] - 1) * s.dilation[d] - s.pad_lo[d] : s.pad_lo[d];
    ax.by_stride = FastDiv(static_cast<uint64_t>(s.stride[d]));
  }
  p.block_vecs = t.block_vecs;
  p.tiles_w = static_cast<int>((p.out_ext[2] + t.tile_w - 1) / t.tile_w);
  p.by_tiles_w = FastDiv(static_cast<uint64_t>(std::max(p.tiles_w, 1)));
  p.by_out_h = FastDiv(static_cast<uint64_t>(std::max(p.out_ext[1], 1)));
  p.by_out_d = FastDiv(static_cast<uint64_t>(std::max(p.out_ext[0], 1)));
  p.tiles = t.tiles;
  return DispatchDType(a.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    return depthwise::RunDirect<T>(t, p, stream);
  });
}

}  // namespace jax_dnn
