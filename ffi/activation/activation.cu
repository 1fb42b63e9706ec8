// Activation and bias + activation kernels. See activation.h.
//
// Forward and the plain backward are flat grid-stride loops over 16-byte
// vectors: each element is read once and written once, the minimum traffic.
// The bias + activation backward is a 2-D kernel: a block covers 32 vectors of
// columns and strides over the rows of its part, so each thread accumulates
// dbias for its columns in registers while it writes dx; the block's eight row
// lanes are combined in a fixed order and written as one row of partials.
#include <algorithm>
#include <cmath>

#include "ffi/activation/activation.h"
#include "ffi/common/column_sum.h"
#include "ffi/common/device.cuh"

namespace jax_dnn {
namespace {

constexpr float kSqrtHalf = 0.70710678118654752f;
constexpr float kInvSqrt2Pi = 0.39894228040143268f;
constexpr float kTanhCoef = 0.79788456080286536f;  // sqrt(2 / pi)
constexpr float kCubic = 0.044715f;

template <Activation kAct>
__device__ __forceinline__ float Act(float x) {
  if constexpr (kAct == Activation::kRelu) return fmaxf(x, 0.f);
  if constexpr (kAct == Activation::kGelu) return 0.5f * x * (1.f + erff(x * kSqrtHalf));
  if constexpr (kAct == Activation::kGeluTanh)
    return 0.5f * x * (1.f + tanhf(kTanhCoef * (x + kCubic * x * x * x)));
  if constexpr (kAct == Activation::kSilu) return x / (1.f + expf(-x));
  if constexpr (kAct == Activation::kSigmoid) return 1.f / (1.f + expf(-x));
  if constexpr (kAct == Activation::kTanh) return tanhf(x);
}

// d act / dx. relu'(0) = 0, as in jax.nn.relu.
template <Activation kAct>
__device__ __forceinline__ float ActGrad(float x) {
  if constexpr (kAct == Activation::kRelu) return x > 0.f ? 1.f : 0.f;
  if constexpr (kAct == Activation::kGelu)
    return 0.5f * (1.f + erff(x * kSqrtHalf)) + x * kInvSqrt2Pi * expf(-0.5f * x * x);
  if constexpr (kAct == Activation::kGeluTanh) {
    const float t = tanhf(kTanhCoef * (x + kCubic * x * x * x));
    return 0.5f * (1.f + t) + 0.5f * x * (1.f - t * t) * kTanhCoef * (1.f + 3.f * kCubic * x * x);
  }
  if constexpr (kAct == Activation::kSilu) {
    const float s = 1.f / (1.f + expf(-x));
    return s * (1.f + x * (1.f - s));
  }
  if constexpr (kAct == Activation::kSigmoid) {
    const float s = 1.f / (1.f + expf(-x));
    return s * (1.f - s);
  }
  if constexpr (kAct == Activation::kTanh) {
    const float t = tanhf(x);
    return 1.f - t * t;
  }
}

constexpr int kFlatThreads = 256;

// dy == nullptr: forward (y = act(x + b)); otherwise backward without dbias.
template <typename T, int V, Activation kAct, bool kBwd>
__global__ void __launch_bounds__(kFlatThreads)
    ActivationFlatKernel(const T* dy, const T* x, const float* bias, T* out, int64_t vectors,
                         int64_t width, int64_t rows_per_group) {
  for (int64_t iv = int64_t{blockIdx.x} * kFlatThreads + threadIdx.x; iv < vectors;
       iv += int64_t{gridDim.x} * kFlatThreads) {
    const int64_t e = iv * V;
    float v[V], r[V];
    LoadVec<T, V>(x + e, v);
    if (bias != nullptr) {
      // V divides width, so a vector never crosses a row.
      const int64_t row = e / width;
      float b[V];
      LoadVec<float, V>(bias + (row / rows_per_group) * width + (e - row * width), b);
#pragma unroll
      for (int i = 0; i < V; ++i) v[i] += b[i];
    }
    if constexpr (kBwd) {
      float d[V];
      LoadVec<T, V>(dy + e, d);
#pragma unroll
      for (int i = 0; i < V; ++i) r[i] = d[i] * ActGrad<kAct>(v[i]);
    } else {
#pragma unroll
      for (int i = 0; i < V; ++i) r[i] = Act<kAct>(v[i]);
    }
    StoreVec<T, V>(out + e, r);
  }
}

constexpr int kColLanes = 32;  // threadIdx.x: vectors of columns
constexpr int kRowLanes = 8;   // threadIdx.y: rows

template <typename T, int V, Activation kAct>
__global__ void __launch_bounds__(kColLanes* kRowLanes) BiasActBwdKernel(ActivationBwdParams p) {
  const int64_t n = p.width;
  const int64_t col = (int64_t{blockIdx.x} * kColLanes + threadIdx.x) * V;
  const int64_t rows_per_group = p.rows / p.groups;
  const int64_t group = blockIdx.y / p.parts;
  const int64_t part = blockIdx.y % p.parts;
  const bool in = col < n;
  float acc[V] = {};
  if (in) {
    float b[V];
    LoadVec<float, V>(p.bias + group * n + col, b);
    for (int64_t local = part * kRowLanes + threadIdx.y; local < rows_per_group;
         local += p.parts * kRowLanes) {
      const int64_t e = (group * rows_per_group + local) * n + col;
      float v[V], d[V], r[V];
      LoadVec<T, V>(static_cast<const T*>(p.x) + e, v);
      LoadVec<T, V>(static_cast<const T*>(p.dy) + e, d);
#pragma unroll
      for (int i = 0; i < V; ++i) {
        r[i] = d[i] * ActGrad<kAct>(v[i] + b[i]);
        acc[i] += r[i];
      }
      StoreVec<T, V>(static_cast<T*>(p.dx) + e, r);
    }
  }
  // Combine the row lanes in a fixed order: deterministic.
  __shared__ float share[kRowLanes][kColLanes][V];
#pragma unroll
  for (int i = 0; i < V; ++i) share[threadIdx.y][threadIdx.x][i] = acc[i];
  __syncthreads();
  if (threadIdx.y == 0 && in) {
    float* partial = p.partials + int64_t{blockIdx.y} * n + col;
#pragma unroll
    for (int i = 0; i < V; ++i) {
      float s = 0.f;
      for (int r = 0; r < kRowLanes; ++r) s += share[r][threadIdx.x][i];
      partial[i] = s;
    }
  }
}

template <typename Fn>
cudaError_t DispatchActivation(Activation a, Fn&& fn) {
  switch (a) {
    case Activation::kRelu:
      return fn(std::integral_constant<Activation, Activation::kRelu>{});
    case Activation::kGelu:
      return fn(std::integral_constant<Activation, Activation::kGelu>{});
    case Activation::kGeluTanh:
      return fn(std::integral_constant<Activation, Activation::kGeluTanh>{});
    case Activation::kSilu:
      return fn(std::integral_constant<Activation, Activation::kSilu>{});
    case Activation::kSigmoid:
      return fn(std::integral_constant<Activation, Activation::kSigmoid>{});
    case Activation::kTanh:
      return fn(std::integral_constant<Activation, Activation::kTanh>{});
  }
  return cudaErrorInvalidValue;
}

// Enough blocks for several waves on any current GPU; the grid-stride loop
// covers the rest.
unsigned FlatGrid(int64_t vectors) {
  return static_cast<unsigned>(
      std::max<int64_t>(1, std::min<int64_t>((vectors + kFlatThreads - 1) / kFlatThreads, 1 << 16)));
}

template <bool kBwd, typename T>
cudaError_t LaunchFlat(Activation a, const void* dy, const void* x, const float* bias, void* out,
                       int64_t rows, int64_t width, int64_t groups, bool vec,
                       cudaStream_t stream) {
  constexpr int kVec = 16 / sizeof(T);
  const int64_t total = rows * width;
  const int64_t rows_per_group = rows / groups;
  return DispatchActivation(a, [&](auto act) {
    constexpr Activation kAct = decltype(act)::value;
    if (vec) {
      ActivationFlatKernel<T, kVec, kAct, kBwd><<<FlatGrid(total / kVec), kFlatThreads, 0, stream>>>(
          static_cast<const T*>(dy), static_cast<const T*>(x), bias, static_cast<T*>(out),
          total / kVec, width, rows_per_group);
    } else {
      ActivationFlatKernel<T, 1, kAct, kBwd><<<FlatGrid(total), kFlatThreads, 0, stream>>>(
          static_cast<const T*>(dy), static_cast<const T*>(x), bias, static_cast<T*>(out), total,
          width, rows_per_group);
    }
    return cudaGetLastError();
  });
}

// 16-byte vectors are used when every pointer is aligned and, with a bias,
// when the row width keeps vectors inside a row.
template <typename T>
bool CanVectorize(std::initializer_list<const void*> ptrs, const float* bias, int64_t rows,
                  int64_t width) {
  constexpr int kVec = 16 / sizeof(T);
  for (const void* ptr : ptrs)
    if (!IsAligned(ptr, 16)) return false;
  if (bias != nullptr) return width % kVec == 0 && IsAligned(bias, sizeof(float) * kVec);
  return (rows * width) % kVec == 0;
}

}  // namespace

cudaError_t LaunchActivationFwd(const ActivationFwdParams& p, cudaStream_t stream) {
  if (p.rows == 0 || p.width == 0) return cudaSuccess;
  return DispatchDType(p.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    const bool vec = CanVectorize<T>({p.x, p.y}, p.bias, p.rows, p.width);
    return LaunchFlat<false, T>(p.activation, nullptr, p.x, p.bias, p.y, p.rows, p.width,
                                p.groups, vec, stream);
  });
}

cudaError_t LaunchActivationBwd(const ActivationBwdParams& p, cudaStream_t stream) {
  if (p.width == 0) return cudaSuccess;
  if (p.rows == 0) {
    if (p.dbias == nullptr) return cudaSuccess;
    return cudaMemsetAsync(p.dbias, 0, p.groups * p.width * sizeof(float), stream);
  }
  return DispatchDType(p.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    const bool vec = CanVectorize<T>({p.x, p.dy, p.dx}, p.bias, p.rows, p.width);
    if (p.bias == nullptr) {
      return LaunchFlat<true, T>(p.activation, p.dy, p.x, nullptr, p.dx, p.rows, p.width, 1, vec,
                                 stream);
    }
    if (p.groups * p.parts > 65535) return cudaErrorInvalidValue;  // gridDim.y limit
    cudaError_t status = DispatchActivation(p.activation, [&](auto act) {
      constexpr Activation kAct = decltype(act)::value;
      constexpr int kVec = 16 / sizeof(T);
      const int v = vec ? kVec : 1;
      dim3 grid(static_cast<unsigned>((p.width + kColLanes * v - 1) / (kColLanes * v)),
                static_cast<unsigned>(p.groups * p.parts));
      dim3 block(kColLanes, kRowLanes);
      if (vec) {
        BiasActBwdKernel<T, kVec, kAct><<<grid, block, 0, stream>>>(p);
      } else {
        BiasActBwdKernel<T, 1, kAct><<<grid, block, 0, stream>>>(p);
      }
      return cudaGetLastError();
    });
    if (status != cudaSuccess) return status;
    ColumnSumParams cs{};
    cs.partials = p.partials;
    cs.out[0] = p.dbias;
    cs.groups = p.groups;
    cs.parts = p.parts;
    cs.sums = 1;
    cs.width = p.width;
    return LaunchColumnSum(cs, stream);
  });
}

}  // namespace jax_dnn
