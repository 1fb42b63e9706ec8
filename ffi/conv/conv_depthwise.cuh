// Internals of the depthwise kernels shared by conv_depthwise.cu (fprop,
// dgrad, the launcher) and conv_depthwise_wgrad.cu. Letters as in conv.h:
// x [N, D, H, W, C], w [K, T, R, S], y / dy [N, O, P, Q, K], K = C * M
// (M the multiplier: output channel k reads input channel k / M).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>

#include "ffi/common/device.cuh"
#include "ffi/common/fast_div.h"
#include "ffi/conv/conv.h"
#include "ffi/conv/conv_depthwise_plan.h"

namespace jax_dnn {
namespace depthwise {

// V channels at p (aligned to V elements) widened to fp32, through the
// read-only path: the inputs are re-read by the neighbouring outputs' taps,
// so L1 keeps them (no L1::no_allocate, unlike the streaming kernels).
template <typename T, int V>
__device__ __forceinline__ void LoadChannels(const T* p, float (&out)[V]) {
  if constexpr (V == 1) {
    out[0] = ToFloat(__ldg(p));
  } else if constexpr (sizeof(T) * V == 16) {
    const uint4 r = __ldg(reinterpret_cast<const uint4*>(p));
    Packed<T, V> pack;
    memcpy(&pack, &r, 16);
#pragma unroll
    for (int i = 0; i < V; ++i) out[i] = ToFloat(pack.v[i]);
  } else {
    static_assert(sizeof(T) * V == 8, "4 channels of 16-bit elements");
    const uint2 r = __ldg(reinterpret_cast<const uint2*>(p));
    Packed<T, V> pack;
    memcpy(&pack, &r, 8);
#pragma unroll
    for (int i = 0; i < V; ++i) out[i] = ToFloat(pack.v[i]);
  }
}

// bias_act's activations (ffi/activation), by id (the fused epilogue of
// conv_depthwise.cu and conv_direct.cu); accurate fp32 math: the
// epilogue runs once an output, after taps FMAs.
__device__ __forceinline__ float ApplyActivation(int act, float x) {
  switch (act) {
    case 0:
      return Relu(x);
    case 1:
      return 0.5f * x * (1.f + erff(x * 0.70710678118654752f));
    case 2: {
      const float u = 0.79788456080286536f * fmaf(0.044715f * x, x * x, x);
      return 0.5f * x * (1.f + tanhf(u));
    }
    case 3:
      return x / (1.f + expf(-x));  // x -> -inf: x / inf = -0, no NaN
    case 4:
      return 1.f / (1.f + expf(-x));
    case 5:
      return tanhf(x);
    default:
      return x;
  }
}

// The runtime loop's source position along one axis of output (or, for
// dgrad's gather, input) position `o` and tap `tap`: false where it falls in
// the padding (or, gathering at stride > 1, between the strided outputs).
struct Axis {
  int64_t stride, dil, pad;  // pad: the offset of tap 0 (may be negative: dgrad's mirrored window)
  int64_t extent;            // of the source
  FastDiv by_stride;         // the gather's division (a 64-bit `/` is tens of instructions)
};

template <bool kGather>
__device__ __forceinline__ bool SourcePos(const Axis& a, int64_t o, int tap, int64_t* i) {
  if constexpr (kGather) {
    const int64_t num = o + a.pad - tap * a.dil;
    if (num < 0) return false;
    *i = static_cast<int64_t>(a.by_stride.Div(static_cast<uint64_t>(num)));
    if (*i * a.stride != num) return false;
  } else {
    *i = o * a.stride - a.pad + tap * a.dil;
    if (*i < 0) return false;
  }
  return *i < a.extent;
}

// fprop / dgrad as one direct pass: `out` [N, out_ext, out_ch] from `in`
// [N, in_ext, in_ch] and the window; see DepthwiseDirectKernel.
struct DirectPass {
  const void* in;
  const void* w;         // [K, taps]
  const void* bias;      // [K] or null (fprop)
  const void* residual;  // like out, or null (fprop)
  void* out;
  int64_t in_ch, out_ch;
  int mult;              // M
  int terms;             // w rows an output channel sums: M on dgrad's scalar path, else 1
  bool dgrad;            // output channel c reads in channels c * M + j (j < terms)
  bool gather;           // dgrad at stride > 1: source = (o + pad - tap * dil) / stride
  bool mirror;           // the window's taps reversed (dgrad at stride 1)
  int act;               // bias_act's id, -1 none
  int out_ext[3];
  Axis axis[3];
  int win[3];
  int taps;
  int block_vecs;        // channel vectors a block
  int tiles_w;           // tiles along the output's W
  FastDiv by_tiles_w, by_out_h, by_out_d;  // a tile's index into (n, od, oh, tile along W)
  int64_t tiles;
  int64_t block_tiles;   // consecutive tiles a block (a multiple of its tile lanes)
};

cudaError_t LaunchDepthwiseWgrad(const ConvShape& shape, const ConvArgs& args, cudaStream_t stream);

}  // namespace depthwise
}  // namespace jax_dnn
