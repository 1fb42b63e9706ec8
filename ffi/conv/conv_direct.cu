// The shared-memory tiled direct convolution: depthwise and grouped (few
// channels a group) fprop and stride-1 dgrad, channels last, fp32
// accumulation. The pass, the tiling and why: conv_direct_plan.h / .cc.
//
// A depthwise 3x3 convolution does 9 FMAs an element and is memory-bound; a
// 7x7 one (49) or ResNeXt's grouped 3x3 with 4 channels a group (36) is close
// to the FMA rate. So the kernel keeps DRAM busy and the FMA pipes fed:
//   - a block owns an output tile and a slice of whole groups (<= 128 bytes a
//     pixel); it copies the input tile plus halo, one window depth plane a
//     stage, with 16-byte cp.async (zero-fill in the padding: src-size 0)
//     into one of two shared buffers, and is persistent: while it computes
//     stage i, stage i + 1's copies are in flight. Concurrent blocks take
//     consecutive tiles, so the halo another block reads comes from L2;
//   - the window of the slice sits in shared memory as fp32 [tap][in][out];
//   - depthwise: a thread owns 2 channels (one 4-byte bf16x2 / half2 read, 8
//     at fp32), 2 output rows and 7 columns; for each window row it takes the
//     row's 2 x S weights into registers (they serve both output rows) and, on
//     the unrolled path (S = 3, 5, 7; W stride 1 or 2; no W dilation), streams
//     the 6 * stride + S inputs of each of its rows through registers, each
//     read from shared memory and converted once for the up to S outputs it
//     reaches; other windows take a runtime tap loop;
//   - grouped: a thread owns kt output channels of one group and 7 columns;
//     each input (a pair of the group's channels) is read once for the kt;
//   - the epilogue adds bias and residual, applies the activation (fprop),
//     and stores the thread's channels of each output;
//   - depthwise wgrad (TiledWgradKernel): the same tiles and slices, dy's
//     tile copied beside x's, a thread summing one window row's taps.
// 64 registers a thread (fp32 depthwise 85): 32 warps an SM where shared
// memory allows.
#include <algorithm>

#include "ffi/common/column_sum.h"
#include "ffi/common/device.cuh"
#include "ffi/common/device_info.h"
#include "ffi/conv/conv_depthwise.cuh"
#include "ffi/conv/conv_direct.h"

namespace jax_dnn {
namespace direct {
namespace {

constexpr int kQt = kConvDirectColsPerThread;
constexpr int kMaxThreads = 512;
constexpr int kMaxDepthwiseThreads = 256;  // 32 channel pairs x 8 (ConvDirectTile)

struct TiledParams {
  const void* in;
  const void* w;
  const void* bias;      // [out_ch] or null (fprop)
  const void* residual;  // like out, or null (fprop)
  void* out;
  int64_t in_ch, out_ch;
  int cg, kg;            // the pass's input / output channels a group
  int taps;
  bool dgrad;            // the window mirrored and transposed in its group
  int act;               // bias_act's id, -1 none
  int slice_in, slice_out;
  int in_ext[3], out_ext[3];
  int win[3], stride[3], dil[3], tap0[3];
  int lanes, col_threads;
  int tile_h, tile_w, rows_in, cols_in;
  int table_bytes;       // a multiple of 16: the buffers follow
  // A stage's elements: rows_in * cols_in * slice_in (wgrad: and dy's
  // tile_h * tile_w * slice_out after them).
  int buffer_elems;
  int tiles;             // < 2^31 (the plan checks)
  int tiles_w, tiles_h;
  // wgrad: dy [N, O, P, Q, C] beside in = x; partials [parts, C * taps].
  const void* dy;
  float* partials;
  int segments;
};

__device__ __forceinline__ void CpAsync16(void* dst, const void* src, int src_bytes) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(s), "l"(src),
               "r"(src_bytes)
               : "memory");
}
__device__ __forceinline__ void CpAsyncCommit() {
  asm volatile("cp.async.commit_group;" ::: "memory");
}
__device__ __forceinline__ void CpAsyncWaitOne() {
  asm volatile("cp.async.wait_group 1;" ::: "memory");
}

// Two consecutive channels of shared memory, widened to fp32.
__device__ __forceinline__ float2 LoadPair(const __nv_bfloat16* p) {
  return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(p));
}
__device__ __forceinline__ float2 LoadPair(const __half* p) {
  return __half22float2(*reinterpret_cast<const __half2*>(p));
}
__device__ __forceinline__ float2 LoadPair(const float* p) {
  return *reinterpret_cast<const float2*>(p);
}

// N consecutive floats of shared memory (N-aligned) as one access.
template <int N>
__device__ __forceinline__ void LoadFloats(const float* p, float (&out)[N]) {
  if constexpr (N == 4) {
    const float4 f = *reinterpret_cast<const float4*>(p);
    out[0] = f.x;
    out[1] = f.y;
    out[2] = f.z;
    out[3] = f.w;
  } else if constexpr (N == 2) {
    const float2 f = *reinterpret_cast<const float2*>(p);
    out[0] = f.x;
    out[1] = f.y;
  } else {
    out[0] = *p;
  }
}

struct TilePos {
  int64_t n;
  int od, th, tw;
};

__device__ __forceinline__ TilePos DecodeTile(const TiledParams& p, int tile) {
  TilePos t;
  const int rows = tile / p.tiles_w;
  t.tw = tile - rows * p.tiles_w;
  const int planes = rows / p.tiles_h;
  t.th = rows - planes * p.tiles_h;
  const int n = planes / p.out_ext[0];
  t.od = planes - n * p.out_ext[0];
  t.n = n;
  return t;
}

// The input depth plane of output depth od and window depth tap t, or -1
// where it falls in the padding.
__device__ __forceinline__ int InputPlane(const TiledParams& p, int od, int t) {
  const int id = od * p.stride[0] + p.tap0[0] + t * p.dil[0];
  return (id >= 0 && id < p.in_ext[0]) ? id : -1;
}

// Starts the copies of one stage (tile, window depth t) into `buf`
// [rows_in][cols_in][slice_in]: every 16-byte chunk by one thread, zeros
// outside the input and past its channels.
template <typename T>
__device__ __forceinline__ void IssueStage(const TiledParams& p, const TilePos& tp, int t,
                                           int64_t in_c0, T* buf) {
  const int id = InputPlane(p, tp.od, t);
  if (id < 0) return;
  constexpr int kVec = 16 / sizeof(T);
  const int chunks = p.slice_in / kVec;
  const int total = p.rows_in * p.cols_in * chunks;
  const int ih0 = tp.th * p.tile_h * p.stride[1] + p.tap0[1];
  const int iw0 = tp.tw * p.tile_w * p.stride[2] + p.tap0[2];
  const T* in = static_cast<const T*>(p.in);
  const T* plane = in + ((tp.n * p.in_ext[0] + id) * p.in_ext[1]) * p.in_ext[2] * p.in_ch + in_c0;
  for (int e = threadIdx.x; e < total; e += blockDim.x) {
    const int px = e / chunks;
    const int ch = (e - px * chunks) * kVec;
    const int row = px / p.cols_in;
    const int col = px - row * p.cols_in;
    const int ih = ih0 + row, iw = iw0 + col;
    const bool valid = ih >= 0 && ih < p.in_ext[1] && iw >= 0 && iw < p.in_ext[2] &&
                       in_c0 + ch < p.in_ch;
    const T* src = valid ? plane + (static_cast<int64_t>(ih) * p.in_ext[2] + iw) * p.in_ch + ch
                         : in;
    CpAsync16(buf + static_cast<int64_t>(e) * kVec, src, valid ? 16 : 0);
  }
}

// Bias, residual and activation (fprop), then the thread's kt channels of
// each of its outputs inside the output.
template <typename T, int kRows, int kKt>
__device__ __forceinline__ void Epilogue(const TiledParams& p, const TilePos& tp, int64_t oc,
                                         int rt, int ct, const float (&acc)[kRows][kQt][kKt]) {
  float b[kKt] = {};
  if (p.bias != nullptr) {
#pragma unroll
    for (int j = 0; j < kKt; ++j) b[j] = ToFloat(static_cast<const T*>(p.bias)[oc + j]);
  }
  const T* residual = static_cast<const T*>(p.residual);
  T* out = static_cast<T*>(p.out);
#pragma unroll
  for (int row = 0; row < kRows; ++row) {
    const int oh = tp.th * p.tile_h + rt * kRows + row;
    if (oh >= p.out_ext[1]) break;
    const int64_t row_base = ((tp.n * p.out_ext[0] + tp.od) * p.out_ext[1] + oh) * p.out_ext[2];
#pragma unroll
    for (int q = 0; q < kQt; ++q) {
      const int ow = tp.tw * p.tile_w + ct * kQt + q;
      if (ow >= p.out_ext[2]) break;
      const int64_t off = (row_base + ow) * p.out_ch + oc;
      float v[kKt];
#pragma unroll
      for (int j = 0; j < kKt; ++j) v[j] = acc[row][q][j] + b[j];
      if (residual != nullptr) {
        const Packed<T, kKt> res = *reinterpret_cast<const Packed<T, kKt>*>(residual + off);
#pragma unroll
        for (int j = 0; j < kKt; ++j) v[j] += ToFloat(res.v[j]);
      }
      if (p.act >= 0) {
#pragma unroll
        for (int j = 0; j < kKt; ++j) v[j] = depthwise::ApplyActivation(p.act, v[j]);
      }
      Packed<T, kKt> pack;
#pragma unroll
      for (int j = 0; j < kKt; ++j) pack.v[j] = FromFloat<T>(v[j]);
      *reinterpret_cast<Packed<T, kKt>*>(out + off) = pack;
    }
  }
}

// kDw: depthwise (kKt = 2, 2 rows a thread; kS > 0 the unrolled W window of
// W stride kSw, 0 the runtime tap loop). Else grouped: kKt output channels a
// thread, the group's input channels kCp (1 or 2) at a time.
// Launch bounds: 64 registers a thread (4 blocks of 256 or 2 of 512 an SM);
// fp32 depthwise 85 (3 blocks of 256: at 64 its 7-wide windows spilled).
template <typename T, bool kDw, int kS, int kSw, int kKt, int kCp>
__global__ void __launch_bounds__(kDw ? kMaxDepthwiseThreads : kMaxThreads,
                                  kDw ? (sizeof(T) == 4 ? 3 : 4) : 2)
    TiledKernel(TiledParams p) {
  constexpr int kRows = kDw ? 2 : 1;
  extern __shared__ __align__(16) unsigned char smem[];
  // [tap][cg][slice_out]: a warp's lanes read consecutive output channels.
  float* table = reinterpret_cast<float*>(smem);
  T* buffers = reinterpret_cast<T*>(smem + p.table_bytes);

  const int64_t in_c0 = static_cast<int64_t>(blockIdx.y) * p.slice_in;
  const int64_t out_c0 = static_cast<int64_t>(blockIdx.y) * p.slice_out;
  if (static_cast<int>(blockIdx.x) >= p.tiles) return;

  // The first stage's copies, then the window while they fly.
  IssueStage<T>(p, DecodeTile(p, blockIdx.x), 0, in_c0, buffers);
  CpAsyncCommit();
  {
    const T* w = static_cast<const T*>(p.w);
    const int width = p.slice_out * p.cg;
    for (int e = threadIdx.x; e < p.taps * width; e += blockDim.x) {
      const int tap = e / width;
      const int rest = e - tap * width;
      const int j = rest / p.slice_out;
      const int ol = rest - j * p.slice_out;
      const int64_t oc = out_c0 + ol;
      float v = 0.f;
      if (oc < p.out_ch) {
        if (!p.dgrad) {
          v = ToFloat(w[(oc * p.taps + tap) * p.cg + j]);
        } else {
          // w [K, taps, C / groups]: dx's channel oc (local c = oc % kg of
          // group g) takes dy's channel g * cg + j through the mirrored tap.
          const int64_t g = oc / p.kg;
          const int64_t k = g * p.cg + j;
          v = ToFloat(w[(k * p.taps + (p.taps - 1 - tap)) * p.kg + (oc - g * p.kg)]);
        }
      }
      table[e] = v;
    }
  }

  const int cl = threadIdx.x % p.lanes;
  const int sp = threadIdx.x / p.lanes;
  const int rt = sp / p.col_threads;
  const int ct = sp - rt * p.col_threads;
  const int ol = cl * kKt;  // the thread's first output channel in the slice
  const bool active = out_c0 + ol < p.out_ch && rt * kRows < p.tile_h;
  // Its first input in a buffer: row rt * kRows * stride, column ct * 7 *
  // stride, its (depthwise) channels or its group's first channel.
  const int x0 = ((rt * kRows * p.stride[1]) * p.cols_in + ct * kQt * p.stride[2]) * p.slice_in +
                 (kDw ? ol : (ol / p.kg) * p.cg);
  const int x_row = p.stride[1] * p.cols_in * p.slice_in;  // the next output row's
  const int x_col = p.stride[2] * p.slice_in;               // the next output column's

  float acc[kRows][kQt][kKt];
#pragma unroll
  for (int i = 0; i < kRows; ++i)
#pragma unroll
    for (int q = 0; q < kQt; ++q)
#pragma unroll
      for (int j = 0; j < kKt; ++j) acc[i][q][j] = 0.f;

  int stage = 0;  // parity: the buffer
#pragma unroll 1
  for (int tile = blockIdx.x; tile < p.tiles; tile += gridDim.x) {
#pragma unroll 1
    for (int t = 0; t < p.win[0]; ++t, ++stage) {
      {
        const int t1 = t + 1 == p.win[0] ? 0 : t + 1;
        const int tile1 = t1 == 0 ? tile + static_cast<int>(gridDim.x) : tile;
        if (tile1 < p.tiles)
          IssueStage<T>(p, DecodeTile(p, tile1), t1, in_c0,
                        buffers + ((stage + 1) & 1) * p.buffer_elems);
      }
      CpAsyncCommit();
      CpAsyncWaitOne();
      __syncthreads();
      const T* buf = buffers + (stage & 1) * p.buffer_elems + x0;
      if (active && InputPlane(p, DecodeTile(p, tile).od, t) >= 0) {
#pragma unroll 1
        for (int r = 0; r < p.win[1]; ++r) {
          const int tap_row = (t * p.win[1] + r) * p.win[2];
          const T* xr = buf + r * p.dil[1] * p.cols_in * p.slice_in;
          if constexpr (kDw) {
            const float* trow = table + tap_row * p.slice_out + ol;
            if constexpr (kS > 0) {
              float2 wr[kS];
#pragma unroll
              for (int s = 0; s < kS; ++s)
                wr[s] = *reinterpret_cast<const float2*>(trow + s * p.slice_out);
#pragma unroll
              for (int row = 0; row < kRows; ++row) {
#pragma unroll
                for (int jj = 0; jj < (kQt - 1) * kSw + kS; ++jj) {
                  const float2 x = LoadPair(xr + row * x_row + jj * p.slice_in);
#pragma unroll
                  for (int s = 0; s < kS; ++s) {
                    const int qq = jj - s;
                    if (qq >= 0 && qq % kSw == 0 && qq / kSw < kQt) {
                      acc[row][qq / kSw][0] = fmaf(x.x, wr[s].x, acc[row][qq / kSw][0]);
                      acc[row][qq / kSw][1] = fmaf(x.y, wr[s].y, acc[row][qq / kSw][1]);
                    }
                  }
                }
              }
            } else {
#pragma unroll 1
              for (int s = 0; s < p.win[2]; ++s) {
                const float2 wv = *reinterpret_cast<const float2*>(trow + s * p.slice_out);
                const T* xs = xr + s * p.dil[2] * p.slice_in;
#pragma unroll
                for (int q = 0; q < kQt; ++q, xs += x_col) {
#pragma unroll
                  for (int row = 0; row < kRows; ++row) {
                    const float2 x = LoadPair(xs + row * x_row);
                    acc[row][q][0] = fmaf(x.x, wv.x, acc[row][q][0]);
                    acc[row][q][1] = fmaf(x.y, wv.y, acc[row][q][1]);
                  }
                }
              }
            }
          } else {
#pragma unroll 1
            for (int s = 0; s < p.win[2]; ++s) {
              const float* tw = table + (tap_row + s) * p.cg * p.slice_out + ol;
              const T* xs = xr + s * p.dil[2] * p.slice_in;
#pragma unroll 1
              for (int c = 0; c < p.cg; c += kCp) {
                float wv[kKt][kCp];
#pragma unroll
                for (int u = 0; u < kCp; ++u) {
                  float f[kKt];
                  LoadFloats<kKt>(tw + (c + u) * p.slice_out, f);
#pragma unroll
                  for (int j = 0; j < kKt; ++j) wv[j][u] = f[j];
                }
#pragma unroll
                for (int q = 0; q < kQt; ++q) {
                  float x[kCp];
                  if constexpr (kCp == 2) {
                    const float2 f = LoadPair(xs + q * x_col + c);
                    x[0] = f.x;
                    x[1] = f.y;
                  } else {
                    x[0] = ToFloat(xs[q * x_col + c]);
                  }
#pragma unroll
                  for (int j = 0; j < kKt; ++j)
#pragma unroll
                    for (int u = 0; u < kCp; ++u)
                      acc[0][q][j] = fmaf(x[u], wv[j][u], acc[0][q][j]);
                }
              }
            }
          }
        }
      }
      __syncthreads();
    }
    if (active) Epilogue<T, kRows, kKt>(p, DecodeTile(p, tile), out_c0 + ol, rt, ct, acc);
#pragma unroll
    for (int row = 0; row < kRows; ++row)
#pragma unroll
      for (int q = 0; q < kQt; ++q)
#pragma unroll
        for (int j = 0; j < kKt; ++j) acc[row][q][j] = 0.f;
  }
}

template <typename T, bool kDw, int kS, int kSw, int kKt, int kCp>
cudaError_t Run(const ConvDirectTiling& t, const TiledParams& p, cudaStream_t stream) {
  auto kernel = TiledKernel<T, kDw, kS, kSw, kKt, kCp>;
  // As many blocks as fit on the device at once, shared by the slices.
  unsigned slots = 0;
  cudaError_t e = PersistentGrid(kernel, t.threads, static_cast<size_t>(t.smem_bytes),
                                 1LL << 30, &slots);
  if (e != cudaSuccess) return e;
  const int64_t blocks =
      std::min<int64_t>(t.tiles, std::max<int64_t>(1, static_cast<int64_t>(slots) / t.slices));
  const dim3 grid(static_cast<unsigned>(blocks), static_cast<unsigned>(t.slices));
  kernel<<<grid, t.threads, static_cast<size_t>(t.smem_bytes), stream>>>(p);
  return cudaGetLastError();
}

// The kernel for the tiling's path; see ConvDirectTile for the choice.
template <typename T>
cudaError_t RunTiled(const ConvDirectTiling& t, const TiledParams& p, cudaStream_t stream) {
  if (p.cg == 1 && p.kg == 1) {
    switch (t.window_w * 10 + t.stride_w) {
      case 31:
        return Run<T, true, 3, 1, 2, 1>(t, p, stream);
      case 51:
        return Run<T, true, 5, 1, 2, 1>(t, p, stream);
      case 71:
        return Run<T, true, 7, 1, 2, 1>(t, p, stream);
      case 32:
        return Run<T, true, 3, 2, 2, 1>(t, p, stream);
      case 52:
        return Run<T, true, 5, 2, 2, 1>(t, p, stream);
      case 72:
        return Run<T, true, 7, 2, 2, 1>(t, p, stream);
      default:
        return Run<T, true, 0, 0, 2, 1>(t, p, stream);
    }
  }
  const bool pairs = p.cg % 2 == 0;
  switch (t.kt) {
    case 4:
      return pairs ? Run<T, false, 0, 0, 4, 2>(t, p, stream)
                   : Run<T, false, 0, 0, 4, 1>(t, p, stream);
    case 2:
      return pairs ? Run<T, false, 0, 0, 2, 2>(t, p, stream)
                   : Run<T, false, 0, 0, 2, 1>(t, p, stream);
    default:
      return pairs ? Run<T, false, 0, 0, 1, 2>(t, p, stream)
                   : Run<T, false, 0, 0, 1, 1>(t, p, stream);
  }
}

// Starts the copies of the tile's dy [tile_h][tile_w][slice_out] (wgrad),
// zeros past the output's edges and channels.
template <typename T>
__device__ __forceinline__ void IssueDy(const TiledParams& p, const TilePos& tp, int64_t c0,
                                        T* buf) {
  constexpr int kVec = 16 / sizeof(T);
  const int chunks = p.slice_out / kVec;
  const int total = p.tile_h * p.tile_w * chunks;
  const int oh0 = tp.th * p.tile_h, ow0 = tp.tw * p.tile_w;
  const T* dy = static_cast<const T*>(p.dy);
  const T* plane =
      dy + ((tp.n * p.out_ext[0] + tp.od) * p.out_ext[1]) * p.out_ext[2] * p.out_ch + c0;
  for (int e = threadIdx.x; e < total; e += blockDim.x) {
    const int px = e / chunks;
    const int ch = (e - px * chunks) * kVec;
    const int row = px / p.tile_w;
    const int col = px - row * p.tile_w;
    const int oh = oh0 + row, ow = ow0 + col;
    const bool valid = oh < p.out_ext[1] && ow < p.out_ext[2] && c0 + ch < p.out_ch;
    const T* src = valid ? plane + (static_cast<int64_t>(oh) * p.out_ext[2] + ow) * p.out_ch + ch
                         : dy;
    CpAsync16(buf + static_cast<int64_t>(e) * kVec, src, valid ? 16 : 0);
  }
}

// Depthwise wgrad, window T = 1 (the plan checks), W window kS at W stride
// kSw: dw[c, r, s] = sum over outputs of dy[o, c] * x[o * stride + tap0 + (r,
// s) * dilation, c]. A block's slice and tiles as the forward's, dy's tile
// copied beside x's; a thread (channel pair, window row r, segment) sums its
// row's kS x 2 taps over its units (an output row of 7 columns: 7 dy pairs in
// registers, the 6 * kSw + kS inputs streamed past them) of every tile the
// block walks. At the end the segments are added in order and the block
// writes its partial sums, row blockIdx.x of partials [parts, C * taps],
// which a fixed-order column sum reduces: deterministic.
template <typename T, int kS, int kSw>
__global__ void __launch_bounds__(kMaxThreads, 2) TiledWgradKernel(TiledParams p) {
  extern __shared__ __align__(16) unsigned char smem[];
  float2* sums = reinterpret_cast<float2*>(smem);  // [segments][R][lanes][kS]
  T* buffers = reinterpret_cast<T*>(smem + p.table_bytes);
  const int x_elems = p.rows_in * p.cols_in * p.slice_in;

  const int64_t c0 = static_cast<int64_t>(blockIdx.y) * p.slice_in;
  const int cl = threadIdx.x % p.lanes;
  const int rest = threadIdx.x / p.lanes;
  const int r = rest % p.win[1];
  const int seg = rest / p.win[1];
  const int col_groups = p.tile_w / kQt;
  const int units = p.tile_h * col_groups;

  float2 acc[kS];
#pragma unroll
  for (int s = 0; s < kS; ++s) acc[s] = make_float2(0.f, 0.f);

  if (static_cast<int>(blockIdx.x) < p.tiles) {
    {
      const TilePos tp = DecodeTile(p, blockIdx.x);
      IssueStage<T>(p, tp, 0, c0, buffers);
      IssueDy<T>(p, tp, c0, buffers + x_elems);
    }
    CpAsyncCommit();
    int stage = 0;
#pragma unroll 1
    for (int tile = blockIdx.x; tile < p.tiles; tile += gridDim.x, ++stage) {
      const int next = tile + static_cast<int>(gridDim.x);
      if (next < p.tiles) {
        const TilePos tp = DecodeTile(p, next);
        T* buf = buffers + ((stage + 1) & 1) * p.buffer_elems;
        IssueStage<T>(p, tp, 0, c0, buf);
        IssueDy<T>(p, tp, c0, buf + x_elems);
      }
      CpAsyncCommit();
      CpAsyncWaitOne();
      __syncthreads();
      const T* xb = buffers + (stage & 1) * p.buffer_elems;
      const T* db = xb + x_elems;
      if (InputPlane(p, DecodeTile(p, tile).od, 0) >= 0) {
#pragma unroll 1
        for (int u = seg; u < units; u += p.segments) {
          const int oh = u / col_groups;
          const int cg = u - oh * col_groups;
          const T* dp = db + (oh * p.tile_w + cg * kQt) * p.slice_in + cl * 2;
          float2 g[kQt];
#pragma unroll
          for (int q = 0; q < kQt; ++q) g[q] = LoadPair(dp + q * p.slice_in);
          const T* xp =
              xb + ((oh * p.stride[1] + r * p.dil[1]) * p.cols_in + cg * kQt * kSw) * p.slice_in +
              cl * 2;
#pragma unroll
          for (int jj = 0; jj < (kQt - 1) * kSw + kS; ++jj) {
            const float2 x = LoadPair(xp + jj * p.slice_in);
#pragma unroll
            for (int s = 0; s < kS; ++s) {
              const int qq = jj - s;
              if (qq >= 0 && qq % kSw == 0 && qq / kSw < kQt) {
                acc[s].x = fmaf(x.x, g[qq / kSw].x, acc[s].x);
                acc[s].y = fmaf(x.y, g[qq / kSw].y, acc[s].y);
              }
            }
          }
        }
      }
      __syncthreads();
    }
  }
  // The segments' sums, added in segment order.
  float2* mine = sums + ((seg * p.win[1] + r) * p.lanes + cl) * kS;
#pragma unroll
  for (int s = 0; s < kS; ++s) mine[s] = acc[s];
  __syncthreads();
  const int64_t c = c0 + cl * 2;
  if (seg != 0 || c >= p.out_ch) return;
#pragma unroll
  for (int s = 0; s < kS; ++s) {
    float2 v = acc[s];
    for (int sg = 1; sg < p.segments; ++sg) {
      const float2 o = sums[((sg * p.win[1] + r) * p.lanes + cl) * kS + s];
      v.x += o.x;
      v.y += o.y;
    }
    float* out = p.partials + static_cast<int64_t>(blockIdx.x) * p.out_ch * p.taps;
    out[c * p.taps + r * kS + s] = v.x;
    out[(c + 1) * p.taps + r * kS + s] = v.y;
  }
}

// Grouped wgrad, window T = 1: dw[k, (r, s), c] = sum over outputs of
// dy[o, k] * x[o * stride + tap0 + (r, s) * dilation, g(k) * kCG + c]. A
// thread (output channel pair of one group, tap, segment) sums the pair's
// kCG x 2 products over its units (an output row of 7 columns: 7 dy pairs in
// registers, each input pair of the group read once for both channels);
// the rest as TiledWgradKernel's.
// 16 channels a group: 32 sums a thread, up to 128 registers (at 64 it spilled).
template <typename T, int kCG>
__global__ void __launch_bounds__(kMaxThreads, kCG >= 16 ? 1 : 2)
    TiledGroupedWgradKernel(TiledParams p) {
  extern __shared__ __align__(16) unsigned char smem[];
  float2* sums = reinterpret_cast<float2*>(smem);  // [segments][taps][lanes][kCG]
  T* buffers = reinterpret_cast<T*>(smem + p.table_bytes);
  const int x_elems = p.rows_in * p.cols_in * p.slice_in;

  const int64_t in_c0 = static_cast<int64_t>(blockIdx.y) * p.slice_in;
  const int64_t out_c0 = static_cast<int64_t>(blockIdx.y) * p.slice_out;
  const int taps = p.win[1] * p.win[2];
  const int cl = threadIdx.x % p.lanes;
  const int rest = threadIdx.x / p.lanes;
  const int tap = rest % taps;
  const int seg = rest / taps;
  const int r = tap / p.win[2];
  const int s = tap - r * p.win[2];
  const int ol = cl * 2;
  const int gin = (ol / p.kg) * kCG;  // the group's first input channel in the slice
  const int col_groups = p.tile_w / kQt;
  const int units = p.tile_h * col_groups;

  float2 acc[kCG];
#pragma unroll
  for (int c = 0; c < kCG; ++c) acc[c] = make_float2(0.f, 0.f);

  if (static_cast<int>(blockIdx.x) < p.tiles) {
    {
      const TilePos tp = DecodeTile(p, blockIdx.x);
      IssueStage<T>(p, tp, 0, in_c0, buffers);
      IssueDy<T>(p, tp, out_c0, buffers + x_elems);
    }
    CpAsyncCommit();
    int stage = 0;
#pragma unroll 1
    for (int tile = blockIdx.x; tile < p.tiles; tile += gridDim.x, ++stage) {
      const int next = tile + static_cast<int>(gridDim.x);
      if (next < p.tiles) {
        const TilePos tp = DecodeTile(p, next);
        T* buf = buffers + ((stage + 1) & 1) * p.buffer_elems;
        IssueStage<T>(p, tp, 0, in_c0, buf);
        IssueDy<T>(p, tp, out_c0, buf + x_elems);
      }
      CpAsyncCommit();
      CpAsyncWaitOne();
      __syncthreads();
      const T* xb = buffers + (stage & 1) * p.buffer_elems;
      const T* db = xb + x_elems;
      if (InputPlane(p, DecodeTile(p, tile).od, 0) >= 0) {
#pragma unroll 1
        for (int u = seg; u < units; u += p.segments) {
          const int oh = u / col_groups;
          const int cg = u - oh * col_groups;
          const T* dp = db + (oh * p.tile_w + cg * kQt) * p.slice_out + ol;
          const T* xp = xb +
                        ((oh * p.stride[1] + r * p.dil[1]) * p.cols_in + cg * kQt * p.stride[2] +
                         s * p.dil[2]) * p.slice_in + gin;
#pragma unroll
          for (int q = 0; q < kQt; ++q) {
            const float2 g = LoadPair(dp + q * p.slice_out);
            const T* xq = xp + q * p.stride[2] * p.slice_in;
#pragma unroll
            for (int c = 0; c < kCG; c += 2) {
              const float2 x = LoadPair(xq + c);
              acc[c].x = fmaf(x.x, g.x, acc[c].x);
              acc[c].y = fmaf(x.x, g.y, acc[c].y);
              acc[c + 1].x = fmaf(x.y, g.x, acc[c + 1].x);
              acc[c + 1].y = fmaf(x.y, g.y, acc[c + 1].y);
            }
          }
        }
      }
      __syncthreads();
    }
  }
  // The segments' sums, added in segment order.
  float2* mine = sums + ((seg * taps + tap) * p.lanes + cl) * kCG;
#pragma unroll
  for (int c = 0; c < kCG; ++c) mine[c] = acc[c];
  __syncthreads();
  const int64_t k = out_c0 + ol;
  if (seg != 0 || k >= p.out_ch) return;
  float* out = p.partials + static_cast<int64_t>(blockIdx.x) * p.out_ch * taps * kCG;
#pragma unroll
  for (int c = 0; c < kCG; ++c) {
    float2 v = acc[c];
    for (int sg = 1; sg < p.segments; ++sg) {
      const float2 o = sums[((sg * taps + tap) * p.lanes + cl) * kCG + c];
      v.x += o.x;
      v.y += o.y;
    }
    out[(k * taps + tap) * kCG + c] = v.x;
    out[((k + 1) * taps + tap) * kCG + c] = v.y;
  }
}

template <typename T, int kCG>
cudaError_t RunGroupedWgrad(const ConvDirectTiling& t, const TiledParams& p, int64_t max_parts,
                            int64_t* parts, cudaStream_t stream) {
  auto kernel = TiledGroupedWgradKernel<T, kCG>;
  unsigned slots = 0;
  cudaError_t e = PersistentGrid(kernel, t.threads, static_cast<size_t>(t.smem_bytes),
                                 1LL << 30, &slots);
  if (e != cudaSuccess) return e;
  const int64_t blocks = std::min<int64_t>(
      {t.tiles, std::max<int64_t>(1, static_cast<int64_t>(slots) / t.slices), max_parts});
  *parts = blocks;
  const dim3 grid(static_cast<unsigned>(blocks), static_cast<unsigned>(t.slices));
  kernel<<<grid, t.threads, static_cast<size_t>(t.smem_bytes), stream>>>(p);
  return cudaGetLastError();
}

template <typename T>
__global__ void CastKernel(const float* __restrict__ in, T* __restrict__ out, int64_t count) {
  const int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (e < count) out[e] = FromFloat<T>(in[e]);
}

template <typename T, int kS, int kSw>
cudaError_t RunWgrad(const ConvDirectTiling& t, const TiledParams& p, int64_t max_parts,
                     int64_t* parts, cudaStream_t stream) {
  auto kernel = TiledWgradKernel<T, kS, kSw>;
  unsigned slots = 0;
  cudaError_t e = PersistentGrid(kernel, t.threads, static_cast<size_t>(t.smem_bytes),
                                 1LL << 30, &slots);
  if (e != cudaSuccess) return e;
  const int64_t blocks = std::min<int64_t>(
      {t.tiles, std::max<int64_t>(1, static_cast<int64_t>(slots) / t.slices), max_parts});
  *parts = blocks;
  const dim3 grid(static_cast<unsigned>(blocks), static_cast<unsigned>(t.slices));
  kernel<<<grid, t.threads, static_cast<size_t>(t.smem_bytes), stream>>>(p);
  return cudaGetLastError();
}

template <typename T>
cudaError_t RunTiledWgrad(const ConvDirectTiling& t, const TiledParams& p, int64_t max_parts,
                          int64_t* parts, cudaStream_t stream) {
  if (p.cg > 1) {
    switch (p.cg) {
      case 2:
        return RunGroupedWgrad<T, 2>(t, p, max_parts, parts, stream);
      case 4:
        return RunGroupedWgrad<T, 4>(t, p, max_parts, parts, stream);
      case 8:
        return RunGroupedWgrad<T, 8>(t, p, max_parts, parts, stream);
      case 16:
        return RunGroupedWgrad<T, 16>(t, p, max_parts, parts, stream);
      default:
        return cudaErrorInvalidValue;
    }
  }
  switch (t.window_w * 10 + t.stride_w) {
    case 31:
      return RunWgrad<T, 3, 1>(t, p, max_parts, parts, stream);
    case 51:
      return RunWgrad<T, 5, 1>(t, p, max_parts, parts, stream);
    case 71:
      return RunWgrad<T, 7, 1>(t, p, max_parts, parts, stream);
    case 32:
      return RunWgrad<T, 3, 2>(t, p, max_parts, parts, stream);
    case 52:
      return RunWgrad<T, 5, 2>(t, p, max_parts, parts, stream);
    case 72:
      return RunWgrad<T, 7, 2>(t, p, max_parts, parts, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace
}  // namespace direct

namespace direct {
namespace {

// The kernels' parameters for one pass and its tiling.
TiledParams Params(const ConvDirectPassShape& pass, const ConvDirectTiling& t, DType dtype) {
  TiledParams p{};
  p.in_ch = pass.in_ch;
  p.out_ch = pass.out_ch;
  p.cg = static_cast<int>(pass.cg);
  p.kg = static_cast<int>(pass.kg);
  p.taps = static_cast<int>(pass.window[0] * pass.window[1] * pass.window[2]);
  p.dgrad = pass.dgrad;
  p.act = kConvNoActivation;
  p.slice_in = static_cast<int>(t.slice_in);
  p.slice_out = static_cast<int>(t.slice_out);
  for (int d = 0; d < 3; ++d) {
    p.in_ext[d] = static_cast<int>(pass.in_ext[d]);
    p.out_ext[d] = static_cast<int>(pass.out_ext[d]);
    p.win[d] = static_cast<int>(pass.window[d]);
    p.stride[d] = static_cast<int>(pass.stride[d]);
    p.dil[d] = static_cast<int>(pass.dilation[d]);
    p.tap0[d] = static_cast<int>(pass.tap0[d]);
  }
  p.lanes = t.lanes;
  p.col_threads = t.col_threads;
  p.tile_h = t.tile_h;
  p.tile_w = t.tile_w;
  p.rows_in = t.rows_in;
  p.cols_in = t.cols_in;
  p.table_bytes = static_cast<int>(t.table_bytes);
  p.buffer_elems = static_cast<int>(t.buffer_bytes / (dtype == DType::kF32 ? 4 : 2));
  p.tiles = static_cast<int>(t.tiles);
  p.tiles_w = static_cast<int>(t.tiles_w);
  p.tiles_h = static_cast<int>(t.tiles_h);
  p.segments = t.segments;
  return p;
}

}  // namespace
}  // namespace direct

cudaError_t LaunchConvDirectTiled(ConvOp op, const ConvShape& s, const ConvArgs& a,
                                  cudaStream_t stream) {
  if (op == ConvOp::kWgrad) {
    // The partials after the fp32 sum in the workspace, then their
    // fixed-order sum.
    const int64_t width = ConvDirectWgradWidth(s);
    const int64_t sum_bytes = ConvDirectWgradSumBytes(s, a.dtype);
    const int64_t capacity = (a.workspace_bytes - sum_bytes) / (width * 4);
    if (capacity < 1) return cudaErrorInvalidValue;
    float* partials = reinterpret_cast<float*>(static_cast<char*>(a.workspace) + sum_bytes);
    int64_t parts = 0;
    cudaError_t e = LaunchConvDirectWgradPartials(s, a, partials, capacity, &parts, stream);
    if (e != cudaSuccess) return e;
    if (parts == 0) {
      parts = 1;
      e = cudaMemsetAsync(partials, 0, width * 4, stream);
      if (e != cudaSuccess) return e;
    }
    return LaunchConvDirectSumParts(partials, parts, width, a, stream);
  }
  const ConvDirectPassShape pass = ConvDirectPass(op, s);
  const ConvDirectTiling t = ConvDirectTile(pass, a.dtype);
  if (!t.ok) return cudaErrorInvalidValue;
  if (t.tiles == 0) return cudaSuccess;
  const bool dgrad = op == ConvOp::kDgrad;
  direct::TiledParams p = direct::Params(pass, t, a.dtype);
  p.in = dgrad ? a.dy : a.x;
  p.out = dgrad ? a.dx : a.y;
  p.w = a.w;
  p.bias = dgrad ? nullptr : a.bias;
  p.residual = dgrad ? nullptr : a.residual;
  p.act = dgrad ? kConvNoActivation : a.activation;
  for (const void* ptr : {p.in, static_cast<const void*>(p.out), p.bias, p.residual})
    if (ptr != nullptr && !IsAligned(ptr, 16)) return cudaErrorMisalignedAddress;
  return DispatchDType(a.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    return direct::RunTiled<T>(t, p, stream);
  });
}

cudaError_t LaunchConvDirectWgradPartials(const ConvShape& s, const ConvArgs& a, float* partials,
                                          int64_t max_parts, int64_t* parts,
                                          cudaStream_t stream) {
  const ConvDirectPassShape pass = ConvDirectPass(ConvOp::kWgrad, s);
  const ConvDirectTiling t = ConvDirectTile(pass, a.dtype);
  *parts = 0;
  if (!t.ok || (pass.cg == 1 && t.window_w == 0) || max_parts < 1) return cudaErrorInvalidValue;
  if (!IsAligned(a.x, 16) || !IsAligned(a.dy, 16)) return cudaErrorMisalignedAddress;
  if (t.tiles == 0) return cudaSuccess;
  direct::TiledParams p = direct::Params(pass, t, a.dtype);
  p.in = a.x;
  p.dy = a.dy;
  p.partials = partials;
  return DispatchDType(a.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    return direct::RunTiledWgrad<T>(t, p, max_parts, parts, stream);
  });
}

cudaError_t LaunchConvDirectSumParts(const float* partials, int64_t parts, int64_t width,
                                     const ConvArgs& a, cudaStream_t stream) {
  float* sum = a.dtype == DType::kF32 ? static_cast<float*>(a.dw)
                                       : static_cast<float*>(a.workspace);
  ColumnSumParams cs{};
  cs.partials = partials;
  cs.out[0] = sum;
  cs.out[1] = sum;
  cs.param_sets = 1;
  cs.parts = parts;
  cs.sums = 1;
  cs.width = width;
  cudaError_t e = LaunchColumnSum(cs, stream);
  if (e != cudaSuccess || a.dtype == DType::kF32) return e;
  return DispatchDType(a.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    constexpr int kCastThreads = 256;
    const unsigned blocks = static_cast<unsigned>((width + kCastThreads - 1) / kCastThreads);
    direct::CastKernel<T><<<blocks, kCastThreads, 0, stream>>>(sum, static_cast<T*>(a.dw), width);
    return cudaGetLastError();
  });
}

}  // namespace jax_dnn
