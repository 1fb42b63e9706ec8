// LaunchConv (conv_launch.h): an algorithm id to its launcher. Host code
// only; in a .cu file because it is part of the CUDA build alone.
#include "ffi/conv/conv_launch.h"

#include <string>

#include "ffi/conv/conv_depthwise.h"
#include "ffi/conv/conv_direct.h"
#include "ffi/conv/conv_implicit_gemm.h"

namespace jax_dnn {

cudaError_t LaunchConv(int algo, const ConvProblem& problem, const ConvArgs& args,
                       const DeviceProps& device, cudaStream_t stream, std::string* invalid) {
  invalid->clear();
  const ConvAlgorithm algorithm = ConvAlgorithmFor(algo, problem, device);
  if (!algorithm.supported) {
    *invalid = "algorithm " + algorithm.name + " (" + std::to_string(algo) +
               ") does not take this call: " + algorithm.reason;
    return cudaErrorNotSupported;
  }
  // gemm_1x1's wgrad fits its splits to the workspace it gets (one split
  // needs none), so a plan made for another device still runs.
  const bool adapts = algorithm.id == kConvGemm1x1 && problem.op == ConvOp::kWgrad;
  if (!adapts && args.workspace_bytes < algorithm.workspace_bytes) {
    *invalid = "the workspace has " + std::to_string(args.workspace_bytes) + " bytes, " +
               algorithm.name + " needs " + std::to_string(algorithm.workspace_bytes);
    return cudaErrorNotSupported;
  }
  ConvArgs call = args;
  call.dtype = problem.dtype;
  if (call.workspace_bytes == 0) call.workspace = nullptr;
  if (algorithm.id == kConvDepthwiseDirect)
    return LaunchConvDepthwise(problem.op, problem.shape, call, stream);
  if (algorithm.id == kConvGroupedDirect)
    return LaunchConvDirectTiled(problem.op, problem.shape, call, stream);
  const int sm_count = device.sm_count > 0 ? device.sm_count : 1;
  const cudaError_t status =
      LaunchConvImplicitGemm(problem.op, algorithm.id, problem.shape, call, sm_count, stream,
                             invalid);
  if (!invalid->empty()) return cudaErrorNotSupported;
  return status;
}

}  // namespace jax_dnn
