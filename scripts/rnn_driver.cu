// The recurrence kernels (ffi/rnn) from a plain CUDA program, for
// compute-sanitizer: run through XLA (sanitize_ops.py rnn), the tool exits
// with a segmentation fault (memcheck and racecheck, H200, 2026-11-27), so
// this driver launches LaunchRnnFwd and LaunchRnnBwd itself on random
// inputs, with the plan's variant or a given one, and checks that every
// output is finite. Built and run by gpu_check.sh's sanitize stage:
//
//   nvcc -std=c++17 -O3 -arch=sm_90a --expt-relaxed-constexpr -I. \
//     -o rnn_driver scripts/rnn_driver.cu ffi/rnn/rnn_fwd.cu ffi/rnn/rnn_bwd.cu \
//     ffi/rnn/rnn_plan.cc
//   compute-sanitizer --tool memcheck ./rnn_driver lstm bf16 20 5 33 --ragged
//
// Arguments: KIND (lstm, gru, rnn_tanh, rnn_relu) DTYPE (bf16, f16, f32) T B H,
// then --ragged (lengths spread over [0, T], one row longer than T, one
// negative), --reverse, --bidirectional (two directions in one launch),
// --variant N, --reps N (timed launches; default 1).
// Exit status 0 only when every launch succeeds and every output is finite.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "ffi/rnn/rnn.h"

namespace {

using jax_dnn::DType;
using jax_dnn::RnnKind;

uint64_t g_state = 88172645463325252ull;
float Uniform() {  // xorshift64, in [-1, 1)
  g_state ^= g_state << 13;
  g_state ^= g_state >> 7;
  g_state ^= g_state << 17;
  return static_cast<float>((g_state >> 11) * (1.0 / 9007199254740992.0) * 2 - 1);
}

uint16_t ToBf16(float f) {  // round to nearest even
  uint32_t u;
  memcpy(&u, &f, 4);
  u += 0x7fff + ((u >> 16) & 1);
  return static_cast<uint16_t>(u >> 16);
}

uint16_t ToF16(float f) {  // cuda_fp16.h's conversion (host code too)
  const __half h = __float2half_rn(f);
  uint16_t u;
  memcpy(&u, &h, 2);
  return u;
}

float FromBits(DType dt, const unsigned char* p) {
  if (dt == DType::kF32) {
    float f;
    memcpy(&f, p, 4);
    return f;
  }
  uint16_t u;
  memcpy(&u, p, 2);
  if (dt == DType::kBF16) {
    const uint32_t w = static_cast<uint32_t>(u) << 16;
    float f;
    memcpy(&f, &w, 4);
    return f;
  }
  __half h;
  memcpy(&h, &u, 2);
  return __half2float(h);
}

bool Check(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return true;
  fprintf(stderr, "rnn_driver: %s: %s\n", what, cudaGetErrorString(e));
  return false;
}

struct Buffer {
  void* ptr = nullptr;
  size_t bytes = 0;
  DType dtype = DType::kF32;
};

// Device memory of n elements of dt, random in [-scale, scale).
Buffer Random(size_t n, DType dt, float scale) {
  Buffer b;
  b.dtype = dt;
  const size_t es = dt == DType::kF32 ? 4 : 2;
  b.bytes = n * es;
  std::vector<unsigned char> host(b.bytes);
  for (size_t i = 0; i < n; ++i) {
    const float v = Uniform() * scale;
    if (es == 4) {
      memcpy(&host[i * 4], &v, 4);
    } else {
      const uint16_t u = dt == DType::kBF16 ? ToBf16(v) : ToF16(v);
      memcpy(&host[i * 2], &u, 2);
    }
  }
  cudaMalloc(&b.ptr, std::max<size_t>(b.bytes, 16));
  cudaMemcpy(b.ptr, host.data(), b.bytes, cudaMemcpyHostToDevice);
  return b;
}

// Device memory poisoned with 0xFF bytes (NaN in every float type): an
// output the kernels leave unwritten fails the finiteness check.
Buffer Poisoned(size_t n, DType dt) {
  Buffer b;
  b.dtype = dt;
  b.bytes = n * (dt == DType::kF32 ? 4 : 2);
  cudaMalloc(&b.ptr, std::max<size_t>(b.bytes, 16));
  cudaMemset(b.ptr, 0xff, std::max<size_t>(b.bytes, 16));
  return b;
}

bool Finite(const Buffer& b, const char* name) {
  std::vector<unsigned char> host(b.bytes);
  cudaMemcpy(host.data(), b.ptr, b.bytes, cudaMemcpyDeviceToHost);
  const size_t es = b.dtype == DType::kF32 ? 4 : 2;
  for (size_t i = 0; i < b.bytes / es; ++i) {
    if (!std::isfinite(FromBits(b.dtype, &host[i * es]))) {
      fprintf(stderr, "rnn_driver: %s[%zu] is not finite\n", name, i);
      return false;
    }
  }
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 6) {
    fprintf(stderr, "usage: %s KIND DTYPE T B H [--ragged] [--reverse] [--variant N] [--reps N]\n",
            argv[0]);
    return 2;
  }
  const std::string kind_name = argv[1], dtype_name = argv[2];
  const RnnKind kind = kind_name == "lstm"       ? RnnKind::kLstm
                       : kind_name == "gru"      ? RnnKind::kGru
                       : kind_name == "rnn_tanh" ? RnnKind::kRnnTanh
                                                 : RnnKind::kRnnRelu;
  const DType dt = dtype_name == "f32" ? DType::kF32 : dtype_name == "f16" ? DType::kF16
                                                                          : DType::kBF16;
  const int64_t t = atoll(argv[3]), b = atoll(argv[4]), h = atoll(argv[5]);
  bool ragged = false, reverse = false;
  int64_t d = 1;
  int variant = -1, reps = 1;
  for (int i = 6; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--ragged") ragged = true;
    if (a == "--reverse") reverse = true;
    if (a == "--bidirectional") d = 2;
    if (a == "--variant" && i + 1 < argc) variant = atoi(argv[++i]);
    if (a == "--reps" && i + 1 < argc) reps = std::max(1, atoi(argv[++i]));
  }

  cudaDeviceProp prop;
  if (!Check(cudaGetDeviceProperties(&prop, 0), "device")) return 1;
  jax_dnn::DeviceProps device;
  device.sm_count = prop.multiProcessorCount;
  const jax_dnn::RnnPlan plan = jax_dnn::PlanRnn(kind, dt, t, b, h, device, d);
  if (!plan.supported) {
    fprintf(stderr, "rnn_driver: unsupported: %s\n", plan.reason.c_str());
    return 1;
  }
  if (variant < 0) variant = plan.variant;
  const jax_dnn::RnnVariant v = jax_dnn::RnnVariantById(variant);
  const jax_dnn::RnnLayout l = jax_dnn::RnnLayoutFor(kind, dt, b, h, v);
  if (v.units == 0 || !jax_dnn::RnnLayoutFits(l, device.sm_count, d) || (d == 2 && reverse)) {
    fprintf(stderr, "rnn_driver: variant %d does not fit this problem\n", variant);
    return 1;
  }

  const int64_t g = jax_dnn::RnnGates(kind), s = jax_dnn::RnnStateSlots(kind);
  const int64_t dh = d * h;  // the directions packed along the features (rnn.h)
  const float w_scale = 1.f / std::sqrt(static_cast<float>(h));
  Buffer gx = Random(t * b * g * dh, dt, 1.f), w_hh = Random(g * dh * h, dt, w_scale);
  Buffer b_hh = Random(g * dh, dt, 0.1f), h0 = Random(b * dh, dt, 0.5f);
  Buffer c0 = Random(b * dh, dt, 0.5f);
  Buffer dy = Random(t * b * dh, dt, 0.5f), dh_n = Random(b * dh, dt, 0.5f);
  Buffer dc_n = Random(b * dh, dt, 0.5f);
  std::vector<int32_t> lengths(b, static_cast<int32_t>(t));
  if (ragged) {
    for (int64_t r = 0; r < b; ++r) lengths[r] = static_cast<int32_t>((r * 7919) % (t + 1));
    if (b > 1) lengths[1] = static_cast<int32_t>(t + 3);  // clamped to T
    if (b > 2) lengths[2] = -1;                           // clamped to 0
  }
  int32_t* seq_lengths = nullptr;
  cudaMalloc(&seq_lengths, b * 4);
  cudaMemcpy(seq_lengths, lengths.data(), b * 4, cudaMemcpyHostToDevice);
  Buffer y = Poisoned(t * b * dh, dt), h_n = Poisoned(b * dh, dt), c_n = Poisoned(b * dh, dt);
  Buffer states = Poisoned(t * b * s * dh, DType::kF32);
  Buffer dgx = Poisoned(t * b * g * dh, DType::kF32), dgh_n = Poisoned(t * b * dh, DType::kF32);
  Buffer dh0 = Poisoned(b * dh, DType::kF32), dc0 = Poisoned(b * dh, DType::kF32);
  Buffer fwd_ws = Poisoned(d * l.fwd_workspace_bytes, DType::kBF16);
  Buffer bwd_ws = Poisoned(d * l.bwd_workspace_bytes, DType::kBF16);

  jax_dnn::RnnFwdParams p{};
  p.dtype = dt;
  p.kind = kind;
  p.reverse = reverse;
  p.variant = variant;
  p.directions = static_cast<int>(d);
  p.seq_len = t;
  p.batch = b;
  p.hidden = h;
  p.gx = gx.ptr;
  p.w_hh = w_hh.ptr;
  p.b_hh = b_hh.ptr;
  p.h0 = h0.ptr;
  p.c0 = c0.ptr;
  p.seq_lengths = seq_lengths;
  p.y = y.ptr;
  p.h_n = h_n.ptr;
  p.c_n = c_n.ptr;
  p.states = static_cast<float*>(states.ptr);
  p.workspace = fwd_ws.ptr;
  jax_dnn::RnnBwdParams q{};
  q.dtype = dt;
  q.kind = kind;
  q.reverse = reverse;
  q.variant = variant;
  q.directions = static_cast<int>(d);
  q.seq_len = t;
  q.batch = b;
  q.hidden = h;
  q.dy = dy.ptr;
  q.dh_n = dh_n.ptr;
  q.dc_n = dc_n.ptr;
  q.w_hh = w_hh.ptr;
  q.h0 = h0.ptr;
  q.c0 = c0.ptr;
  q.seq_lengths = seq_lengths;
  q.states = static_cast<const float*>(states.ptr);
  q.dgx = static_cast<float*>(dgx.ptr);
  q.dgh_n = static_cast<float*>(dgh_n.ptr);
  q.dh0 = static_cast<float*>(dh0.ptr);
  q.dc0 = static_cast<float*>(dc0.ptr);
  q.workspace = bwd_ws.ptr;

  // Median of `reps` launches after one untimed, for each direction.
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  auto time = [&](auto launch, const char* what, float* ms) {
    std::vector<float> times;
    for (int i = 0; i <= reps; ++i) {
      cudaEventRecord(start);
      if (!Check(launch(), what)) return false;
      cudaEventRecord(stop);
      if (!Check(cudaEventSynchronize(stop), what)) return false;
      float m = 0.f;
      cudaEventElapsedTime(&m, start, stop);
      if (i > 0) times.push_back(m);
    }
    std::sort(times.begin(), times.end());
    *ms = times[times.size() / 2];
    return true;
  };
  float fwd_ms = 0.f, bwd_ms = 0.f;
  if (!time([&] { return jax_dnn::LaunchRnnFwd(p, nullptr); }, "forward", &fwd_ms)) return 1;
  if (!time([&] { return jax_dnn::LaunchRnnBwd(q, nullptr); }, "backward", &bwd_ms)) return 1;

  // Outputs at every position; c_n, dc0 for the LSTM only; dgh_n for the GRU.
  bool ok = Finite(y, "y") && Finite(h_n, "h_n") && Finite(states, "states") &&
            Finite(dgx, "dgx") && Finite(dh0, "dh0");
  if (kind == RnnKind::kLstm) ok = ok && Finite(c_n, "c_n") && Finite(dc0, "dc0");
  if (kind == RnnKind::kGru) ok = ok && Finite(dgh_n, "dgh_n");
  printf("rnn_driver %s %s T=%lld B=%lld H=%lld%s%s%s variant %d (U=%d%s%s, %lld blocks): "
         "fwd %.3f ms (%.2f us/step), bwd %.3f ms (%.2f us/step), outputs %s\n",
         kind_name.c_str(), dtype_name.c_str(), static_cast<long long>(t),
         static_cast<long long>(b), static_cast<long long>(h), ragged ? " ragged" : "",
         reverse ? " reverse" : "", d == 2 ? " bidirectional" : "", variant, v.units, v.streamed ? ", streamed" : "",
         v.global_state ? ", state in workspace" : "", static_cast<long long>(d * l.blocks), fwd_ms,
         fwd_ms * 1e3 / t, bwd_ms, bwd_ms * 1e3 / t, ok ? "finite" : "NOT FINITE");
  return ok ? 0 : 1;
}
