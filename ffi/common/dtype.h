// Element types the kernels accept, and a dispatcher from the runtime tag to a
// compile-time type. Host and device code; no XLA types here.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace jax_dnn {

enum class DType { kF32, kBF16, kF16 };

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

inline int DTypeSize(DType dtype) { return dtype == DType::kF32 ? 4 : 2; }

}  // namespace jax_dnn
