// Timeline of the attention forward kernel, without JAX: where a work tile's
// time goes (waits, prologue, key-tile loop, epilogue) and how the CTAs end
// (the persistent grid's tail). Build and run on the GPU machine:
//   nvcc -std=c++17 -O3 -gencode arch=compute_90a,code=sm_90a --expt-relaxed-constexpr \
//     -I. scripts/fwd_trace.cu ffi/attention/attention_tma.cu -o build/fwd_trace
//   build/fwd_trace [S=8192] [causal|x] [D=128: 64, 128, 192 or 256] [dump]
// FWD_B / FWD_N set the batch and head count, FWD_T the queries (T <= S,
// default S; the TFLOP/s printed assume T = S); FWD_ONCE=1 launches once and
// stops (for compute-sanitizer).
// With a fourth argument the output and logsumexp go to that file (raw), to
// compare two builds of the kernel byte for byte.
// B * S = 16384 tokens, 2048 / D heads of D (the benchmark's shapes), bf16.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

constexpr int kMaxCtas = 1024, kMaxTiles = 64, kEvents = 8;
__device__ long long g_clock[kMaxCtas * 3 * kMaxTiles * kEvents];
__device__ long long g_timer[kMaxCtas * 3 * kMaxTiles * kEvents];

__device__ __forceinline__ long long GlobalTimer() {
  long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// role 0: the producer thread; 1, 2: the consumers (their first thread).
// -DFWD_TRACE_OFF builds the kernel without probes (timing only).
#ifdef FWD_TRACE_OFF
#define JAX_DNN_FWD_PROBE(role, tile, event)
#else
#define JAX_DNN_FWD_PROBE(role, tile, event)                                                  \
  do {                                                                                        \
    if (threadIdx.x % 128 == 0 && (tile) < kMaxTiles && blockIdx.x < kMaxCtas) {              \
      const int i_ = ((blockIdx.x * 3 + (role)) * kMaxTiles + (tile)) * kEvents + (event);    \
      g_clock[i_] = clock64();                                                                \
      g_timer[i_] = GlobalTimer();                                                            \
    }                                                                                         \
  } while (0)
#endif

#include "ffi/attention/attention_fwd_launch.cuh"

using namespace jax_dnn;

__global__ void Fill(__nv_bfloat16* x, long long n, unsigned seed) {
  for (long long i = blockIdx.x * 256ll + threadIdx.x; i < n; i += 256ll * gridDim.x) {
    unsigned h = unsigned(i) * 2654435761u ^ seed;
    h ^= h >> 15, h *= 2246822519u, h ^= h >> 13, h *= 3266489917u, h ^= h >> 16;
    // Sum of four uniforms: roughly normal, mean 0, variance 1.
    float u = ((h & 255) + ((h >> 8) & 255) + ((h >> 16) & 255) + (h >> 24)) / 255.f - 2.f;
    x[i] = __float2bfloat16(u * 1.732f);
  }
}

#define CHECK(x)                                                                 \
  do {                                                                           \
    cudaError_t e_ = (x);                                                        \
    if (e_ != cudaSuccess) {                                                     \
      std::printf("%s: %s (line %d)\n", #x, cudaGetErrorString(e_), __LINE__);   \
      return 1;                                                                  \
    }                                                                            \
  } while (0)

static double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

int main(int argc, char** argv) {
  const long long s = argc > 1 ? std::atoll(argv[1]) : 8192;
  const bool causal = argc > 2 && std::strcmp(argv[2], "causal") == 0;
  const long long d = argc > 3 ? std::atoll(argv[3]) : 128;
  const char* env_b = std::getenv("FWD_B");
  const char* env_n = std::getenv("FWD_N");
  const long long b = env_b ? std::atoll(env_b) : 16384 / s, n = env_n ? std::atoll(env_n) : 2048 / d;
  const char* env_t = std::getenv("FWD_T");  // queries (<= S; default S)
  const long long t = env_t ? std::min(std::atoll(env_t), s) : s;
  const long long elems = b * s * n * d;
  __nv_bfloat16 *q, *k, *v, *o;
  float* lse;
  CHECK(cudaMalloc(&q, elems * 2));
  CHECK(cudaMalloc(&k, elems * 2));
  CHECK(cudaMalloc(&v, elems * 2));
  CHECK(cudaMalloc(&o, elems * 2));
  CHECK(cudaMalloc(&lse, b * n * s * 4));
  Fill<<<1024, 256>>>(q, elems, 1);
  Fill<<<1024, 256>>>(k, elems, 2);
  Fill<<<1024, 256>>>(v, elems, 3);
  AttentionFwdParams p{};
  p.dtype = DType::kBF16;
  p.shape = AttentionShape{b, t, s, n, n, d, d};
  p.mask.causal = causal;
  p.scale = 1.f / std::sqrt(float(d));
  p.softcap = 0.f;
  p.q = q, p.k = k, p.v = v, p.o = o, p.lse = lse;
  // The split tail's workspace (attention.h; unused by a
  // tree from before it, whose AttentionFwdParams ends at lse).
#ifdef JAX_DNN_FWD_HAS_WS
  p.ws_elems = 2 * 132 * 192 * (d + 1);  // room for 192-row tiles (AttentionFwdWideKernel)
  CHECK(cudaMalloc(&p.ws, p.ws_elems * 4));
#endif
  cudaStream_t stream;
  CHECK(cudaStreamCreate(&stream));
  auto launch = [&] {
    if (d == 64) return attention::LaunchFwdDims<__nv_bfloat16, 64, 64>(p, stream);
    if (d == 192) return attention::LaunchFwdDims<__nv_bfloat16, 192, 192>(p, stream);
    if (d == 256) return attention::LaunchFwdDims<__nv_bfloat16, 256, 256>(p, stream);
    return attention::LaunchFwdDims<__nv_bfloat16, 128, 128>(p, stream);
  };
  if (std::getenv("FWD_ONCE")) {
    CHECK(launch());
    CHECK(cudaDeviceSynchronize());
    std::printf("launched once\n");
    return 0;
  }
  for (int i = 0; i < 5; ++i) CHECK(launch());
  cudaEvent_t e0, e1;
  CHECK(cudaEventCreate(&e0));
  CHECK(cudaEventCreate(&e1));
  std::vector<double> us;
  for (int r = 0; r < 7; ++r) {
    CHECK(cudaEventRecord(e0, stream));
    for (int i = 0; i < 10; ++i) CHECK(launch());
    CHECK(cudaEventRecord(e1, stream));
    CHECK(cudaEventSynchronize(e1));
    float ms;
    CHECK(cudaEventElapsedTime(&ms, e0, e1));
    us.push_back(ms * 100.0);
  }
  const double flops = 4.0 * b * n * s * s * d * (causal ? 0.5 : 1.0);
  std::printf("D=%lld S=%lld causal=%d: %.1f us a call (median of 7 x 10), %.0f TFLOP/s\n", d, s,
              int(causal), Median(us), flops / Median(us) * 1e-6);

  if (argc > 4) {
    std::vector<char> h(elems * 2 + b * n * s * 4);
    CHECK(cudaMemcpy(h.data(), o, elems * 2, cudaMemcpyDeviceToHost));
    CHECK(cudaMemcpy(h.data() + elems * 2, lse, b * n * s * 4, cudaMemcpyDeviceToHost));
    FILE* f = std::fopen(argv[4], "wb");
    if (f == nullptr || std::fwrite(h.data(), 1, h.size(), f) != h.size()) return 1;
    std::fclose(f);
  }

  // One traced launch, alone.
  std::vector<long long> clk(kMaxCtas * 3 * kMaxTiles * kEvents), tmr(clk.size());
  CHECK(cudaMemcpyToSymbol(g_clock, clk.data(), clk.size() * 8));
  CHECK(cudaMemcpyToSymbol(g_timer, clk.data(), clk.size() * 8));
  CHECK(cudaDeviceSynchronize());
  CHECK(launch());
  CHECK(cudaDeviceSynchronize());
  CHECK(cudaMemcpyFromSymbol(clk.data(), g_clock, clk.size() * 8));
  CHECK(cudaMemcpyFromSymbol(tmr.data(), g_timer, tmr.size() * 8));
  auto at = [&](std::vector<long long>& a, int cta, int role, int tile, int ev) -> long long& {
    return a[((cta * 3 + role) * kMaxTiles + tile) * kEvents + ev];
  };
  int ctas = 0;
  while (ctas < kMaxCtas && at(tmr, ctas, 1, 0, 0) != 0) ++ctas;
  // Kernel span per CTA (globaltimer, ns): first probe to consumers' last.
  long long t_min = 1ll << 62, t_max = 0;
  std::vector<double> ends;
  std::vector<int> tiles_of(ctas);
  for (int c = 0; c < ctas; ++c) {
    int nt = 0;
    while (nt < kMaxTiles && at(tmr, c, 1, nt, 5) != 0) ++nt;
    tiles_of[c] = nt;
    t_min = std::min(t_min, at(tmr, c, 0, 0, 0) ? at(tmr, c, 0, 0, 0) : at(tmr, c, 1, 0, 0));
    long long end = 0;
    for (int r = 1; r <= 2; ++r) end = std::max(end, at(tmr, c, r, nt - 1, 5));
    ends.push_back(double(end));
    t_max = std::max(t_max, end);
  }
  if (ctas == 0) return 0;  // built without probes
  std::sort(ends.begin(), ends.end());
  std::printf("traced launch: %d CTAs, span %.1f us; CTA ends (us after the first start): min %.1f, "
              "10%% %.1f, median %.1f, 90%% %.1f, max %.1f\n",
              ctas, (t_max - t_min) * 1e-3, (ends.front() - t_min) * 1e-3,
              (ends[ctas / 10] - t_min) * 1e-3, (ends[ctas / 2] - t_min) * 1e-3,
              (ends[ctas * 9 / 10] - t_min) * 1e-3, (ends.back() - t_min) * 1e-3);
  // Cycles -> ns from CTA 0's consumer 0 (first to last probe).
  const int nt0 = tiles_of[0];
  const double ns_per_clk = double(at(tmr, 0, 1, nt0 - 1, 5) - at(tmr, 0, 1, 0, 0)) /
                            double(at(clk, 0, 1, nt0 - 1, 5) - at(clk, 0, 1, 0, 0));
  std::printf("clock: %.3f GHz (consumer 0 of CTA 0)\n", 1.0 / ns_per_clk);
  // Per-step medians over every CTA, consumer and work tile after the first,
  // in cycles: q wait (0->1), prologue (1->2), loop (2->3), last P V (3->4),
  // epilogue (4->5), gap to the next tile (5 -> next 0).
  std::vector<double> qwait, pro, loop, lastpv, epi, gap, whole, pq;
  for (int c = 0; c < ctas; ++c)
    for (int r = 1; r <= 2; ++r)
      for (int t = 1; t < tiles_of[c]; ++t) {
        // A work tile whose first scores went out with the previous tile's
        // last P V has no Q wait of its own (event 1 not recorded).
        if (at(clk, c, r, t, 1) == 0) at(clk, c, r, t, 1) = at(clk, c, r, t, 0);
        auto e = [&](int ev) { return double(at(clk, c, r, t, ev)); };
        qwait.push_back(e(1) - e(0));
        pro.push_back(e(2) - e(1));
        loop.push_back(e(3) - e(2));
        lastpv.push_back(e(4) - e(3));
        epi.push_back(e(5) - e(4));
        gap.push_back(e(0) - double(at(clk, c, r, t - 1, 5)));
        whole.push_back(e(5) - double(at(clk, c, r, t - 1, 5)));
      }
  for (int c = 0; c < ctas; ++c)
    for (int t = 1; t < tiles_of[c]; ++t)  // producer: Q issued vs consumer 0 asking for it
      pq.push_back(double(at(clk, c, 0, t, 1) - at(clk, c, 1, t - 1, 3)));
  std::printf("per work tile (median cycles): q wait %.0f, prologue %.0f, loop %.0f, last PV %.0f, "
              "epilogue %.0f, gap %.0f; whole %.0f\n",
              Median(qwait), Median(pro), Median(loop), Median(lastpv), Median(epi), Median(gap),
              Median(whole));
  {  // A spread of CTA ends: more tiles on some CTAs, or slow tiles?
    std::vector<int> per(tiles_of);
    std::sort(per.begin(), per.end());
    std::vector<double> w(whole);
    std::sort(w.begin(), w.end());
    if (!w.empty())
      std::printf("work tiles a CTA: min %d, median %d, max %d; whole (cycles): 90%% %.0f, 99%% %.0f, "
                  "max %.0f\n", per.front(), per[per.size() / 2], per.back(), w[w.size() * 9 / 10],
                  w[w.size() * 99 / 100], w.back());
  }
  std::vector<double> nt, qw, rest;  // the last P V phase, split where probes 6 and 7 are
  for (int c = 0; c < ctas; ++c)
    for (int r = 1; r <= 2; ++r)
      for (int t = 1; t + 1 < tiles_of[c]; ++t)
        if (at(clk, c, r, t, 6) != 0 && at(clk, c, r, t, 7) != 0) {
          nt.push_back(double(at(clk, c, r, t, 6) - at(clk, c, r, t, 3)));
          qw.push_back(double(at(clk, c, r, t, 7) - at(clk, c, r, t, 6)));
          rest.push_back(double(at(clk, c, r, t, 4) - at(clk, c, r, t, 7)));
        }
  if (!nt.empty())
    std::printf("last P V phase (median cycles): to the next tile's indices %.0f, Q wait %.0f, the "
                "step %.0f\n", Median(nt), Median(qw), Median(rest));
  std::printf("producer issues Q %.0f cycles after consumer 0 leaves its loop (median)\n", Median(pq));
  std::printf("CTA 0, consumer 0 / 1, tile 1..3 (cycles from tile start):\n");
  for (int t = 1; t < std::min(nt0, 4); ++t)
    for (int r = 1; r <= 2; ++r) {
      const long long t0 = at(clk, 0, 1, t, 0);
      std::printf("  tile %d c%d:", t, r - 1);
      for (int ev = 0; ev < 6; ++ev) std::printf(" %lld", at(clk, 0, r, t, ev) - t0);
      std::printf("   producer: %lld %lld %lld\n", at(clk, 0, 0, t, 0) - t0, at(clk, 0, 0, t, 1) - t0,
                  at(clk, 0, 0, t, 2) - t0);
    }
  return 0;
}
