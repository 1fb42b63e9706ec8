// Direct depthwise convolution, wgrad: dw[k, t, r, s] = sum over n, o, p, q of
// dy[n, o, p, q, k] * x[n, o * sd - pd + t * dd, p * sh - ph + r * dh,
// q * sw - pw + s * dw, k / M]; letters as in conv_depthwise.cuh.
//
// Deterministic in two stages, no atomics. The first stage is the tiled
// kernel's (LaunchConvDirectWgradPartials, conv_direct.cu) where
// ConvDepthwiseTiled holds; otherwise this file's: a block takes a part of the
// (n, o, p) output rows, 8 channel vectors (32 channels on the vector path)
// and some window rows (t, r); a thread owns one channel vector and one
// window row, keeps that row's S x 4 sums in registers, and walks its lane's
// share of the part's rows: along each row it loads tile_w dy vectors and
// streams the (tile_w - 1) * stride + S inputs they reach, each loaded once
// and used by up to S taps (the unrolled path, as fprop's; other windows,
// strides and dilations: one tap a thread, a runtime loop). The block adds its
// lanes in lane order and writes fp32 partials [part, K * taps]; ColumnSum
// (ffi/common/column_sum.h) adds the parts in a fixed order into dw (fp32) or
// the workspace's fp32 sum, which a last kernel casts into dw.
// Why 32 channels a block: the partials are parts x K x taps floats; with few
// channels a block the grid fills the GPU with few parts (ConvNeXt's 56^2 /
// 128 7x7 layer at N = 64: 66 parts, 1.6 MB of partials against 103 MB of x
// and dy).
#include <algorithm>

#include "ffi/common/device_info.h"
#include "ffi/conv/conv_depthwise.cuh"
#include "ffi/conv/conv_direct.h"

namespace jax_dnn {
namespace depthwise {
namespace {

constexpr int kMaxThreads = kConvDepthwiseThreads;

struct WgradPass {
  const void* x;
  const void* dy;
  float* partials;  // [parts, K * taps]
  int64_t c, k;
  int mult;
  int win[3];
  Axis axis[3];     // source: x's extents
  int out_ext[3];   // dy's
  int taps;
  int block_vecs, tap_rows, tap_rows_block, lanes;
  int64_t rows, rows_per_part;
};

// kS > 0: a thread sums the kS taps of window row tr = (t, r), unrolled along W
// at stride kSw with tiles of kQt outputs; kS == 0: one tap tr = (t, r, s).
template <typename T, int V, int kS, int kSw, int kQt>
__global__ void __launch_bounds__(kMaxThreads, 1) DepthwiseWgradKernel(WgradPass p) {
  constexpr int kTaps = kS > 0 ? kS : 1;
  extern __shared__ float lanes_sum[];  // [lanes][block_vecs * tap_rows_block][kTaps][V]
  const int cb = p.block_vecs;
  const int cv = threadIdx.x % cb;
  const int tri = (threadIdx.x / cb) % p.tap_rows_block;
  const int lane = threadIdx.x / (cb * p.tap_rows_block);
  const int tr = blockIdx.z * p.tap_rows_block + tri;
  const int64_t oc0 = (static_cast<int64_t>(blockIdx.y) * cb + cv) * V;
  const bool active = tr < p.tap_rows && oc0 < p.k;
  float acc[kTaps][V] = {};
  if (active) {
    int t, r, s = 0;
    if constexpr (kS > 0) {
      t = tr / p.win[1];
      r = tr % p.win[1];
    } else {
      s = tr % p.win[2];
      r = (tr / p.win[2]) % p.win[1];
      t = tr / (p.win[2] * p.win[1]);
    }
    const T* x = static_cast<const T*>(p.x) + oc0 / p.mult;  // V == 4 only with M == 1
    const T* dy = static_cast<const T*>(p.dy) + oc0;
    const int64_t x_h_stride = p.axis[2].extent * p.c;
    const int64_t x_d_stride = p.axis[1].extent * x_h_stride;
    const int64_t dy_row_stride = static_cast<int64_t>(p.out_ext[2]) * p.k;
    const int64_t first = static_cast<int64_t>(blockIdx.x) * p.rows_per_part;
    const int64_t last = std::min(p.rows, first + p.rows_per_part);
    for (int64_t row = first + lane; row < last; row += p.lanes) {
      const int64_t oh = row % p.out_ext[1];
      const int64_t od = (row / p.out_ext[1]) % p.out_ext[0];
      const int64_t n = row / (static_cast<int64_t>(p.out_ext[1]) * p.out_ext[0]);
      int64_t id, ih;
      if (!SourcePos<false>(p.axis[0], od, t, &id) || !SourcePos<false>(p.axis[1], oh, r, &ih)) {
        continue;
      }
      const T* xr = x + n * p.axis[0].extent * x_d_stride + id * x_d_stride + ih * x_h_stride;
      const T* dr = dy + row * dy_row_stride;  // row = (n * O + od) * P + oh
      if constexpr (kS > 0) {
        static_assert(V == 4, "the unrolled path is the vector path");
        for (int64_t q0 = 0; q0 < p.out_ext[2]; q0 += kQt) {
          float g[kQt][V];
#pragma unroll
          for (int q = 0; q < kQt; ++q) {
            if (q0 + q < p.out_ext[2]) {
              LoadChannels<T, V>(dr + (q0 + q) * p.k, g[q]);
            } else {
#pragma unroll
              for (int i = 0; i < V; ++i) g[q][i] = 0.f;
            }
          }
          const int64_t iw0 = q0 * kSw - p.axis[2].pad;
#pragma unroll
          for (int jj = 0; jj < (kQt - 1) * kSw + kS; ++jj) {
            const int64_t iw = iw0 + jj;
            if (iw < 0 || iw >= p.axis[2].extent) continue;
            float xv[V];
            LoadChannels<T, V>(xr + iw * p.c, xv);
#pragma unroll
            for (int s2 = 0; s2 < kS; ++s2) {
              const int qq = jj - s2;
              if (qq >= 0 && qq % kSw == 0 && qq / kSw < kQt) {
#pragma unroll
                for (int i = 0; i < V; ++i) acc[s2][i] = fmaf(g[qq / kSw][i], xv[i], acc[s2][i]);
              }
            }
          }
        }
      } else {
        for (int64_t q = 0; q < p.out_ext[2]; ++q) {
          int64_t iw;
          if (!SourcePos<false>(p.axis[2], q, s, &iw)) continue;
          float g[V], xv[V];
          LoadChannels<T, V>(dr + q * p.k, g);
          LoadChannels<T, V>(xr + iw * p.c, xv);
#pragma unroll
          for (int i = 0; i < V; ++i) acc[0][i] = fmaf(g[i], xv[i], acc[0][i]);
        }
      }
    }
  }
  // The lanes' sums, added in lane order.
  const int slots = cb * p.tap_rows_block;
  const int slot = threadIdx.x % slots;
  float* mine = lanes_sum + (static_cast<int64_t>(lane) * slots + slot) * kTaps * V;
#pragma unroll
  for (int u = 0; u < kTaps; ++u)
#pragma unroll
    for (int i = 0; i < V; ++i) mine[u * V + i] = acc[u][i];
  __syncthreads();
  if (lane != 0 || !active) return;
  float* out = p.partials + static_cast<int64_t>(blockIdx.x) * p.k * p.taps;
#pragma unroll
  for (int u = 0; u < kTaps; ++u) {
#pragma unroll
    for (int i = 0; i < V; ++i) {
      float sum = mine[u * V + i];
      for (int l = 1; l < p.lanes; ++l) {
        sum += lanes_sum[(static_cast<int64_t>(l) * slots + slot) * kTaps * V + u * V + i];
      }
      if (oc0 + i < p.k) out[(oc0 + i) * p.taps + (kS > 0 ? tr * kS + u : tr)] = sum;
    }
  }
}

template <typename T, int V, int kS, int kSw, int kQt>
cudaError_t Run(const ConvDepthwiseTiling& t, const WgradPass& p, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(t.parts), static_cast<unsigned>(t.channel_blocks),
                  static_cast<unsigned>(t.tap_blocks));
  const size_t smem = static_cast<size_t>(t.block_threads) * (kS > 0 ? kS : 1) * V * sizeof(float);
  DepthwiseWgradKernel<T, V, kS, kSw, kQt><<<grid, t.block_threads, smem, stream>>>(p);
  return cudaGetLastError();
}

template <typename T>
cudaError_t RunWgrad(const ConvDepthwiseTiling& t, const WgradPass& p, cudaStream_t stream) {
  if (t.vec == 1) return Run<T, 1, 0, 0, 4>(t, p, stream);
  switch (t.window_w * 10 + t.stride_w) {
    case 31:
      return Run<T, 4, 3, 1, 14>(t, p, stream);
    case 51:
      return Run<T, 4, 5, 1, 14>(t, p, stream);
    case 71:
      return Run<T, 4, 7, 1, 14>(t, p, stream);
    case 32:
      return Run<T, 4, 3, 2, 7>(t, p, stream);
    case 52:
      return Run<T, 4, 5, 2, 7>(t, p, stream);
    default:
      return Run<T, 4, 0, 0, 4>(t, p, stream);
  }
}

}  // namespace

cudaError_t LaunchDepthwiseWgrad(const ConvShape& s, const ConvArgs& a, cudaStream_t stream) {
  const int align = a.dtype == DType::kF32 ? 16 : 8;
  const bool aligned = IsAligned(a.x, align) && IsAligned(a.dy, align);
  ConvDepthwiseTiling t = ConvDepthwiseTile(ConvOp::kWgrad, s, a.dtype, SmCount(), aligned);
  const int64_t taps = s.window[0] * s.window[1] * s.window[2];
  const int64_t width = s.k * taps;
  if (width == 0) return cudaSuccess;
  // The parts the workspace holds (it may have been sized for another SM
  // count); the same for every call on one device: deterministic.
  const int64_t sum_bytes = ConvDepthwiseWgradSumBytes(s, a.dtype);
  const int64_t capacity = (a.workspace_bytes - sum_bytes) / (width * 4);
  if (capacity < 1) return cudaErrorInvalidValue;
  float* partials = reinterpret_cast<float*>(static_cast<char*>(a.workspace) + sum_bytes);
  // The shared-memory tiled kernel (conv_direct.cu) where it takes the
  // problem; its partials reduce as this file's do.
  const bool aligned16 = IsAligned(a.x, 16) && IsAligned(a.dy, 16);
  if (ConvDepthwiseTiled(ConvOp::kWgrad, s, a.dtype, aligned16)) {
    int64_t parts = 0;
    if (s.n == 0) {
      parts = 1;
      cudaError_t e = cudaMemsetAsync(partials, 0, width * 4, stream);
      if (e != cudaSuccess) return e;
    } else {
      cudaError_t e = LaunchConvDirectWgradPartials(s, a, partials, capacity, &parts, stream);
      if (e != cudaSuccess) return e;
    }
    return LaunchConvDirectSumParts(partials, parts, width, a, stream);
  }
  t.parts = std::min(t.parts, capacity);
  WgradPass p{};
  p.x = a.x;
  p.dy = a.dy;
  p.partials = partials;
  p.c = s.c;
  p.k = s.k;
  p.mult = static_cast<int>(s.k / s.c);
  for (int d = 0; d < 3; ++d) {
    p.win[d] = static_cast<int>(s.window[d]);
    p.out_ext[d] = static_cast<int>(s.output[d]);
    p.axis[d] = Axis{s.stride[d], s.dilation[d], s.pad_lo[d], s.input[d], FastDiv(1)};
  }
  p.taps = static_cast<int>(taps);
  p.block_vecs = t.block_vecs;
  p.tap_rows = t.tap_rows;
  p.tap_rows_block = t.tap_rows_block;
  p.lanes = t.lanes;
  p.rows = s.n * s.output[0] * s.output[1];
  p.rows_per_part = (p.rows + t.parts - 1) / t.parts;
  cudaError_t e = DispatchDType(a.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    return RunWgrad<T>(t, p, stream);
  });
  if (e != cudaSuccess) return e;
  return LaunchConvDirectSumParts(partials, t.parts, width, a, stream);
}

}  // namespace depthwise
}  // namespace jax_dnn
