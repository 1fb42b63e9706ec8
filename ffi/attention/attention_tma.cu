#include "ffi/attention/attention_tma.h"

#include <cudaTypedefs.h>  // PFN_cuTensorMapEncodeTiled

namespace jax_dnn {
namespace attention {

namespace {

// The driver entry point, looked up once through the runtime (so that no
// libcuda link is needed at build time).
PFN_cuTensorMapEncodeTiled_v12000 EncodeTiled() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = []() -> PFN_cuTensorMapEncodeTiled_v12000 {
    void* ptr = nullptr;
    cudaDriverEntryPointQueryResult status;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr, 12000, cudaEnableDefault,
                                         &status) != cudaSuccess ||
        status != cudaDriverEntryPointSuccess)
      return nullptr;
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(ptr);
  }();
  return fn;
}

}  // namespace

bool MakeTensorMap(CUtensorMap* map, const void* data, int64_t batch, int64_t seq, int64_t heads,
                   int64_t dim, int rows) {
  auto encode = EncodeTiled();
  if (encode == nullptr) return false;
  const cuuint64_t dims[4] = {cuuint64_t(dim), cuuint64_t(heads), cuuint64_t(seq), cuuint64_t(batch)};
  const cuuint64_t strides[3] = {cuuint64_t(dim * 2), cuuint64_t(heads * dim * 2),
                                 cuuint64_t(seq * heads * dim * 2)};
  const cuuint32_t box[4] = {64, 1, cuuint32_t(rows), 1};
  const cuuint32_t elem_strides[4] = {1, 1, 1, 1};
  // The element type only sets the size here: bf16 and f16 move alike.
  CUresult r = encode(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 4, const_cast<void*>(data), dims,
                      strides, box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                      CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                      CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS;
}

}  // namespace attention
}  // namespace jax_dnn
