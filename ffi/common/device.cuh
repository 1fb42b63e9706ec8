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

// max(x, 0) as jax.nn.relu computes it: a NaN stays NaN (NaN < 0 is false),
// where fmaxf(x, 0) would return 0.
__device__ __forceinline__ float Relu(float x) { return x < 0.f ? 0.f : x; }

// max(a, b) that is NaN when either is (PTX max.NaN, sm_80+: one FMNMX.NAN):
// a softmax's or a max pool's running max must carry a NaN to the result,
// as XLA's max does, where fmaxf drops it.
__device__ __forceinline__ float MaxNan(float a, float b) {
  float m;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(m) : "f"(a), "f"(b));
  return m;
}

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

// A 16-byte store is a streaming (evict-first) one: the kernels write each
// output once (see LoadStream16 below for the measurement).
template <typename T, int V>
__device__ __forceinline__ void StoreVec(T* p, const float (&in)[V]) {
  Packed<T, V> pack;
#pragma unroll
  for (int i = 0; i < V; ++i) pack.v[i] = FromFloat<T>(in[i]);
  if constexpr (sizeof(pack) == 16) {
    __stcs(reinterpret_cast<int4*>(p), *reinterpret_cast<const int4*>(&pack));
  } else {
    *reinterpret_cast<Packed<T, V>*>(p) = pack;
  }
}

// 2^x as one MUFU.EX2 instruction (ex2.approx.ftz.f32: relative error
// ~2^-22; denormal results flush to zero).
__device__ __forceinline__ float FastExp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// 1 / x as one MUFU.RCP instruction (rcp.approx.ftz.f32: ~1 ulp; 1 / inf = 0).
__device__ __forceinline__ float FastRcp(float x) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float WarpSum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float WarpMax(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = MaxNan(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// The streaming kernels' 16-byte accesses to data read once or written once.
// Why (H200): a copy of 128 MiB takes 68.1-68.3 us with a streaming
// (evict-first) store and a last-use or non-coherent load, 71.3 us with a
// plain store; in the library, last-use loads with streaming stores make the
// bf16 softmax backward 8-9% faster than non-coherent loads, and the fp32
// one 10% slower, which therefore keeps the non-coherent load (LoadNc16).
__device__ __forceinline__ uint4 LoadStream16(const void* p) {
  uint4 r;
  asm volatile("ld.global.lu.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
               : "l"(p));
  return r;
}

// Asks the bulk copy engine to bring `bytes` (a multiple of 16, from a
// 16-byte aligned address) into L2: no registers, no completion to wait for.
__device__ __forceinline__ void PrefetchL2(const void* p, uint32_t bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
}

__device__ __forceinline__ uint4 LoadNc16(const void* p) {
  uint4 r;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
               : "l"(p));
  return r;
}

// volatile with a memory clobber: stays in program order with the other
// volatile accesses (see StoreOrdered16 in row_regs.cuh).
__device__ __forceinline__ void StoreStream16(void* p, uint4 r) {
  asm volatile("st.global.cs.v4.b32 [%0], {%1,%2,%3,%4};" ::"l"(p), "r"(r.x), "r"(r.y), "r"(r.z),
               "r"(r.w)
               : "memory");
}

// Vector access needs the address aligned to the whole vector; callers fall
// back to scalar access (V = 1) when a pointer or the row width does not allow it.
inline bool IsAligned(const void* p, int bytes) {
  return (reinterpret_cast<std::uintptr_t>(p) % bytes) == 0;
}

}  // namespace jax_dnn
