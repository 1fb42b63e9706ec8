// ConvBenchmark (conv_benchmark.h): times convolution algorithms for one
// problem on the current device. Host code plus one fill kernel; every
// algorithm runs through LaunchConv (conv_launch.h), the handlers' path.
//
// Sizes (conv.h's layouts): x N*D*H*W*C, w K*T*R*S*(C/groups), y N*O*P*Q*K
// elements, bias K, residual like y; all counts in 64 bits.
#include "ffi/conv/conv_benchmark.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "ffi/common/device_info.h"
#include "ffi/common/dtype.h"
#include "ffi/conv/conv_launch.h"

namespace jax_dnn {
namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
// A candidate slower than this multiple of the best median so far, on its
// second untimed run, is not timed further.
constexpr double kHopeless = 1.5;

// Uniform in [-1, 1) from a counter-based hash of the index (SplitMix64's
// finalizer): no state, any grid.
template <typename T>
__global__ void FillUniformKernel(T* out, int64_t count, uint64_t seed) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += stride) {
    uint64_t z = seed + static_cast<uint64_t>(i) * 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    const float u = static_cast<float>(z >> 40) * (1.0f / 16777216.0f);  // [0, 1), 24 bits
    out[i] = static_cast<T>(2.0f * u - 1.0f);
  }
}

cudaError_t FillUniform(DType dtype, void* out, int64_t count, uint64_t seed,
                        cudaStream_t stream) {
  if (count == 0) return cudaSuccess;
  const int block = 256;
  const int64_t blocks = std::min<int64_t>((count + block - 1) / block, 4096);
  DispatchDType(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    FillUniformKernel<T><<<static_cast<unsigned>(blocks), block, 0, stream>>>(
        static_cast<T*>(out), count, seed);
    return 0;
  });
  return cudaGetLastError();
}

// a * b, or -1 where it would pass int64.
int64_t MulOrMinus1(int64_t a, int64_t b) {
  if (a < 0 || b < 0) return -1;
  if (a != 0 && b > std::numeric_limits<int64_t>::max() / a) return -1;
  return a * b;
}

int64_t Product(std::initializer_list<int64_t> v) {
  int64_t p = 1;
  for (int64_t x : v) p = MulOrMinus1(p, x);
  return p;
}

// Device memory, a stream and events, released on every return path.
struct Resources {
  std::vector<void*> buffers;
  std::vector<cudaEvent_t> events;
  cudaStream_t stream = nullptr;

  ~Resources() {
    if (stream != nullptr) cudaStreamSynchronize(stream);
    for (cudaEvent_t e : events) cudaEventDestroy(e);
    for (void* p : buffers) cudaFree(p);
    if (stream != nullptr) cudaStreamDestroy(stream);
    cudaGetLastError();  // leave no error behind for the next launch's check
  }

  // A buffer of `bytes` (null for 0), or why not.
  std::string Allocate(int64_t bytes, void** out) {
    *out = nullptr;
    if (bytes < 0) return "a buffer's size passes 2^63 bytes";
    if (bytes == 0) return "";
    const cudaError_t e = cudaMalloc(out, static_cast<size_t>(bytes));
    if (e != cudaSuccess) {
      cudaGetLastError();
      *out = nullptr;
      return "allocating " + std::to_string(bytes) + " bytes: " + cudaGetErrorString(e);
    }
    buffers.push_back(*out);
    return "";
  }

  cudaEvent_t Event() {
    cudaEvent_t e = nullptr;
    if (cudaEventCreate(&e) != cudaSuccess) return nullptr;
    events.push_back(e);
    return e;
  }
};

std::string CudaError(const char* what, cudaError_t e) {
  return std::string(what) + ": " + cudaGetErrorString(e);
}

// Milliseconds between two recorded events (after their work finished), or
// NaN with *error set.
double Elapsed(cudaEvent_t start, cudaEvent_t end, std::string* error) {
  cudaError_t e = cudaEventSynchronize(end);
  float ms = 0.f;
  if (e == cudaSuccess) e = cudaEventElapsedTime(&ms, start, end);
  if (e != cudaSuccess) {
    *error = CudaError("running the kernel", e);
    return kNaN;
  }
  return ms;
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

}  // namespace

std::string ConvBenchmark(const ConvProblem& problem, const std::vector<int>& algorithm_ids,
                          int repeats, std::vector<ConvTiming>* timings) {
  timings->clear();
  const DeviceProps device = CurrentDeviceProps();
  if (device.sm_count == 0) return "no CUDA device";
  const ConvShape& s = problem.shape;
  if (std::string why = ConvShapeError(s); !why.empty()) return why;
  repeats = std::max(repeats, 1);

  const int64_t elem = problem.dtype == DType::kF32 ? 4 : 2;
  const int64_t x_elems = Product({s.n, s.input[0], s.input[1], s.input[2], s.c});
  const int64_t w_elems = Product({s.k, s.window[0], s.window[1], s.window[2], s.c / s.groups});
  const int64_t y_elems = Product({s.n, s.output[0], s.output[1], s.output[2], s.k});
  const bool fprop = problem.op == ConvOp::kFprop;
  const int64_t bias_elems = fprop && problem.bias ? s.k : 0;
  const int64_t residual_elems = fprop && problem.residual ? y_elems : 0;

  std::vector<ConvAlgorithm> algorithms;
  int64_t workspace_bytes = 0;
  for (int id : algorithm_ids) {
    algorithms.push_back(ConvAlgorithmFor(id, problem, device));
    if (algorithms.back().supported)
      workspace_bytes = std::max(workspace_bytes, algorithms.back().workspace_bytes);
  }

  Resources r;
  if (cudaError_t e = cudaStreamCreateWithFlags(&r.stream, cudaStreamNonBlocking);
      e != cudaSuccess) {
    r.stream = nullptr;
    return CudaError("creating a stream", e);
  }
  // Operands: x, w, y, bias, residual, workspace; the op's inputs random.
  void *x = nullptr, *w = nullptr, *y = nullptr, *bias = nullptr, *residual = nullptr,
       *workspace = nullptr;
  for (auto [bytes, ptr] : {std::pair{MulOrMinus1(x_elems, elem), &x},
                            std::pair{MulOrMinus1(w_elems, elem), &w},
                            std::pair{MulOrMinus1(y_elems, elem), &y},
                            std::pair{MulOrMinus1(bias_elems, elem), &bias},
                            std::pair{MulOrMinus1(residual_elems, elem), &residual},
                            std::pair{workspace_bytes, &workspace}}) {
    if (std::string why = r.Allocate(bytes, ptr); !why.empty()) return why;
  }
  // Which buffers the op reads (conv.h's ConvArgs): fprop x, w, bias,
  // residual -> y; dgrad dy (y-shaped), w -> dx; wgrad x, dy -> dw.
  std::vector<std::pair<void*, int64_t>> inputs;
  ConvArgs args;
  args.activation = fprop ? problem.activation : kConvNoActivation;
  if (fprop) {
    args.x = x, args.w = w, args.bias = bias, args.residual = residual, args.y = y;
    inputs = {{x, x_elems}, {w, w_elems}, {bias, bias_elems}, {residual, residual_elems}};
  } else if (problem.op == ConvOp::kDgrad) {
    args.dy = y, args.w = w, args.dx = x;
    inputs = {{y, y_elems}, {w, w_elems}};
  } else {
    args.x = x, args.dy = y, args.dw = w;
    inputs = {{x, x_elems}, {y, y_elems}};
  }
  uint64_t seed = 0x5EEDull;
  for (auto [ptr, count] : inputs)
    if (cudaError_t e = FillUniform(problem.dtype, ptr, count, seed++, r.stream); e != cudaSuccess)
      return CudaError("filling the operands", e);

  std::vector<cudaEvent_t> starts, ends;
  for (int i = 0; i < repeats + 1; ++i) {
    starts.push_back(r.Event());
    ends.push_back(r.Event());
    if (starts.back() == nullptr || ends.back() == nullptr) return "creating CUDA events";
  }

  double best = kNaN;
  for (const ConvAlgorithm& algorithm : algorithms) {
    ConvTiming t{kNaN, ""};
    if (!algorithm.supported) {
      t.error = algorithm.name + " does not take the problem: " + algorithm.reason;
      timings->push_back(t);
      continue;
    }
    args.workspace = workspace;
    args.workspace_bytes = algorithm.workspace_bytes;
    auto run = [&]() -> std::string {
      std::string invalid;
      const cudaError_t e = LaunchConv(algorithm.id, problem, args, device, r.stream, &invalid);
      if (!invalid.empty()) return invalid;
      return e == cudaSuccess ? "" : CudaError("launching", e);
    };
    // Untimed runs: the first pays one-time costs (shared-memory
    // attributes, module loading); the second's time sizes the repeats.
    std::string error = run();
    if (error.empty()) {
      cudaEventRecord(starts[0], r.stream);
      error = run();
      cudaEventRecord(ends[0], r.stream);
    }
    const double warm = error.empty() ? Elapsed(starts[0], ends[0], &error) : kNaN;
    if (!error.empty()) {
      t.error = algorithm.name + ": " + error;
      timings->push_back(t);
      cudaGetLastError();
      continue;
    }
    if (std::isfinite(best) && warm > kHopeless * best) {
      t.ms = warm;
      timings->push_back(t);
      continue;
    }
    const int n = static_cast<int>(
        std::clamp(kConvBenchmarkBudgetMs / std::max(warm, 1e-3), 1.0, double(repeats)));
    for (int i = 1; i <= n && error.empty(); ++i) {
      cudaEventRecord(starts[i], r.stream);
      error = run();
      cudaEventRecord(ends[i], r.stream);
    }
    std::vector<double> ms;
    for (int i = 1; i <= n && error.empty(); ++i) ms.push_back(Elapsed(starts[i], ends[i], &error));
    if (!error.empty()) {
      t.error = algorithm.name + ": " + error;
      cudaGetLastError();
    } else {
      t.ms = Median(ms);
      if (!std::isfinite(best) || t.ms < best) best = t.ms;
    }
    timings->push_back(t);
  }
  return "";
}

}  // namespace jax_dnn
