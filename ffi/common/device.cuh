// Device helpers shared by the kernels: fp32 conversion, 16-byte vector
// loads/stores, and warp reductions. All arithmetic is fp32.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace jax_dnn {

__device__ __forceinline__ float ToFloat(float v) { return v; }
__device__ __forceinline__ float ToFloat(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float ToFloat(__half v) { return __half2float(v); }

template <typename T>
__device__ __forceinline__ T FromFloat(float v);
template <>
__device__ __forceinline__ float FromFloat<float>(float v) { return v; }
template <>
__device__ __forceinline__ __nv_bfloat16 FromFloat<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}
template <>
__device__ __forceinline__ __half FromFloat<__half>(float v) { return __float2half_rn(v); }

// V consecutive elements moved as one access (16 bytes when V = 16 / sizeof(T)).
template <typename T, int V>
struct alignas(sizeof(T) * V) Packed {
  T v[V];
};

// Loads V elements at p (aligned to V elements) and widens them to fp32.
template <typename T, int V>
__device__ __forceinline__ void LoadVec(const T* p, float (&out)[V]) {
  Packed<T, V> pack = *reinterpret_cast<const Packed<T, V>*>(p);
#pragma unroll
  for (int i = 0; i < V; ++i) out[i] = ToFloat(pack.v[i]);
}

// Streaming variant for data read exactly once: evict-first keeps L2 for
// what is re-read (the residuals of a backward pass, a second pass over a row).
template <typename T, int V>
__device__ __forceinline__ void LoadVecStreaming(const T* p, float (&out)[V]) {
  static_assert(sizeof(Packed<T, V>) == 16 || sizeof(Packed<T, V>) <= 8, "");
  Packed<T, V> pack;
  if constexpr (sizeof(Packed<T, V>) == 16) {
    int4 raw = __ldcs(reinterpret_cast<const int4*>(p));
    pack = *reinterpret_cast<Packed<T, V>*>(&raw);
  } else {
    pack = *reinterpret_cast<const Packed<T, V>*>(p);
  }
#pragma unroll
  for (int i = 0; i < V; ++i) out[i] = ToFloat(pack.v[i]);
}

template <typename T, int V>
__device__ __forceinline__ void StoreVec(T* p, const float (&in)[V]) {
  Packed<T, V> pack;
#pragma unroll
  for (int i = 0; i < V; ++i) pack.v[i] = FromFloat<T>(in[i]);
  *reinterpret_cast<Packed<T, V>*>(p) = pack;
}

// 2^x as one MUFU.EX2 instruction (ex2.approx.ftz.f32: relative error
// ~2^-22; denormal results flush to zero).
__device__ __forceinline__ float FastExp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float WarpSum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float WarpMax(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Vector access needs the address aligned to the whole vector; callers fall
// back to scalar access (V = 1) when a pointer or the row width does not allow it.
inline bool IsAligned(const void* p, int bytes) {
  return (reinterpret_cast<std::uintptr_t>(p) % bytes) == 0;
}

}  // namespace jax_dnn
