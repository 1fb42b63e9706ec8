// The one launch path of a convolution algorithm: the FFI handlers
// (conv_ffi.cc) and the benchmark (conv_benchmark.cu) both run an algorithm
// through it, so a timed candidate is exactly what a compiled program runs.
// No XLA types here.
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "ffi/common/device_props.h"
#include "ffi/conv/conv.h"
#include "ffi/conv/conv_plan.h"

namespace jax_dnn {

// Checks a call of algorithm `algo` on `problem` against that algorithm's
// rules on `device` (ConvAlgorithmFor, the function the plans answer with)
// and against args.workspace_bytes, then launches it on `stream` with the
// pointers of `args` that problem.op uses (conv.h; args.dtype is taken from
// the problem). Where the call breaks the rules, or the kernel declines it,
// nothing runs: *invalid says why (a sentence) and the result is
// cudaErrorNotSupported. Otherwise *invalid stays empty and the result is
// the launch's status.
cudaError_t LaunchConv(int algo, const ConvProblem& problem, const ConvArgs& args,
                       const DeviceProps& device, cudaStream_t stream, std::string* invalid);

}  // namespace jax_dnn
