// XLA FFI glue shared by the handlers (the only place, with *_ffi.cc files,
// that sees XLA types): dtype decoding, error conversion, shape helpers.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <optional>
#include <string>

#include "ffi/common/dtype.h"
#include "xla/ffi/api/ffi.h"

namespace jax_dnn {

namespace ffi = xla::ffi;

inline std::optional<DType> ToDType(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F32:
      return DType::kF32;
    case ffi::DataType::BF16:
      return DType::kBF16;
    case ffi::DataType::F16:
      return DType::kF16;
    default:
      return std::nullopt;
  }
}

inline ffi::Error InvalidArgument(const std::string& what) {
  return ffi::Error::InvalidArgument(what);
}

// Turns the status of a launch into an FFI error naming the op.
inline ffi::Error LaunchStatus(cudaError_t status, const char* op) {
  if (status == cudaSuccess) return ffi::Error::Success();
  return ffi::Error::Internal(std::string(op) + ": CUDA error: " + cudaGetErrorString(status));
}

// Product of dimensions [begin, end) of a buffer.
inline int64_t DimProduct(ffi::Span<const int64_t> dims, size_t begin, size_t end) {
  int64_t n = 1;
  for (size_t i = begin; i < end; ++i) n *= dims[i];
  return n;
}

inline int64_t LastDim(const ffi::AnyBuffer& b) {
  auto dims = b.dimensions();
  return dims.size() == 0 ? 1 : dims.back();
}

}  // namespace jax_dnn
