// Element types the kernels accept, and a dispatcher from the runtime tag to a
// compile-time type. No XLA types here.
#pragma once

namespace jax_dnn {

enum class DType { kF32, kBF16, kF16 };

}  // namespace jax_dnn

// The dispatcher names CUDA's 16-bit types: code nvcc compiles only. Host-only
// code (the plans, the handlers) sees the enum alone, so that the plans build
// without CUDA.
#ifdef __CUDACC__
#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace jax_dnn {

template <typename T>
struct TypeTag {
  using type = T;
};

// Calls fn(TypeTag<T>{}) for the C++ type behind `dtype`.
template <typename Fn>
auto DispatchDType(DType dtype, Fn&& fn) {
  switch (dtype) {
    case DType::kBF16:
      return fn(TypeTag<__nv_bfloat16>{});
    case DType::kF16:
      return fn(TypeTag<__half>{});
    case DType::kF32:
    default:
      return fn(TypeTag<float>{});
  }
}

}  // namespace jax_dnn
#endif  // __CUDACC__
