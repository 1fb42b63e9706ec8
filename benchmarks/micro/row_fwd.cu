// Micro-benchmark: forward row kernels (softmax, layer norm) in bf16 against
// a plain streaming copy, in one process with CUDA events. Used to choose the
// row-kernel design (team width, persistent or not, register prefetch) before
// porting it into ffi/. Standalone: nvcc -O3 -arch=sm_90a row_fwd.cu -o row_fwd
//
// Every variant holds its row in registers as packed bf16 (16-byte vectors),
// reduces one mergeable state per row (softmax: max, sum; layer norm: mean,
// M2) with warp shuffles and, for teams wider than a warp, one named barrier
// per row over double-buffered shared slots (no block-wide barrier).
#include <cuda_bf16.h>

#include "micro_common.cuh"

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>

__device__ __forceinline__ float Ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ void Unpack(uint4 r, float (&f)[8]) {
  const uint32_t w[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = __uint_as_float(w[i] << 16);
    f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
  }
}

struct MaxSum {
  float m, s;
  __device__ static MaxSum Merge(MaxSum a, MaxSum b) {
    const float m = fmaxf(a.m, b.m);
    const float L = 1.4426950408889634f;
    return {m, a.s * Ex2((a.m - m) * L) + b.s * Ex2((b.m - m) * L)};
  }
};
template <typename S>
__device__ __forceinline__ S ShflXor(S s, int o) {
  constexpr int k = sizeof(S) / 4;
  float* f = reinterpret_cast<float*>(&s);
  S out;
  float* g = reinterpret_cast<float*>(&out);
#pragma unroll
  for (int i = 0; i < k; ++i) g[i] = __shfl_xor_sync(0xffffffffu, f[i], o);
  return out;
}

// kOp: 0 softmax, 1 layer norm.
template <int kOp, int kTeam, int kVecs, bool kPersist, bool kPrefetch>
__global__ void __launch_bounds__(kTeam < 128 ? 128 : kTeam)
    RowFwd(const __nv_bfloat16* __restrict__ x, __nv_bfloat16* __restrict__ y,
           const float* __restrict__ scale, const float* __restrict__ bias, int rows) {
  constexpr int kBlock = kTeam < 128 ? 128 : kTeam;
  constexpr int kTeams = kBlock / kTeam;
  constexpr int kWarps = kTeam / 32;
  constexpr int n = kTeam * kVecs * 8;
  using S = std::conditional_t<kOp == 0, MaxSum, MeanM2>;
  __shared__ S slots[2][kTeams][kWarps];
  const int team = threadIdx.x / kTeam, lane = threadIdx.x % kTeam;
  const int64_t stride = kPersist ? int64_t{gridDim.x} * kTeams : 0;
  int64_t row = int64_t{blockIdx.x} * kTeams + team;
  uint4 raw[kVecs];
  auto load = [&](uint4(&r)[kVecs], int64_t rw) {
    if (rw < rows) {
#pragma unroll
      for (int v = 0; v < kVecs; ++v) r[v] = LoadNc(x + rw * n + (v * kTeam + lane) * 8);
    }
  };
  load(raw, row);
  for (int k = 0; row < rows; ++k) {
    uint4 nxt[kVecs];
    if constexpr (kPersist && kPrefetch) load(nxt, row + stride);
    // Thread-local state over the thread's elements.
    S st;
    if constexpr (kOp == 0) {
      float m = -INFINITY;
#pragma unroll
      for (int v = 0; v < kVecs; ++v) {
        float f[8];
        Unpack(raw[v], f);
#pragma unroll
        for (int i = 0; i < 8; ++i) m = fmaxf(m, f[i]);
      }
      const float L = 1.4426950408889634f, mL = m * L;
      float s = 0.f;
#pragma unroll
      for (int v = 0; v < kVecs; ++v) {
        float f[8];
        Unpack(raw[v], f);
#pragma unroll
        for (int i = 0; i < 8; ++i) s += Ex2(fmaf(f[i], L, -mL));
      }
      st = {m, s};
    } else {
      float sum = 0.f;
#pragma unroll
      for (int v = 0; v < kVecs; ++v) {
        float f[8];
        Unpack(raw[v], f);
#pragma unroll
        for (int i = 0; i < 8; ++i) sum += f[i];
      }
      const float mean = sum * (1.f / (kVecs * 8));
      float m2 = 0.f;
#pragma unroll
      for (int v = 0; v < kVecs; ++v) {
        float f[8];
        Unpack(raw[v], f);
#pragma unroll
        for (int i = 0; i < 8; ++i) m2 += (f[i] - mean) * (f[i] - mean);
      }
      st = {float(kVecs * 8), mean, m2};
    }
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) st = S::Merge(st, ShflXor(st, o));
    if constexpr (kWarps > 1) {
      const int w = lane / 32;
      if (lane % 32 == 0) slots[k & 1][team][w] = st;
      asm volatile("bar.sync %0, %1;" ::"r"(1 + team), "r"(kTeam) : "memory");
      st = slots[k & 1][team][0];
#pragma unroll
      for (int i = 1; i < kWarps; ++i) st = S::Merge(st, slots[k & 1][team][i]);
    }
    {
      if constexpr (kOp == 0) {
        const float L = 1.4426950408889634f, mL = st.m * L, inv = 1.f / st.s;
#pragma unroll
        for (int v = 0; v < kVecs; ++v) {
          float f[8];
          Unpack(raw[v], f);
#pragma unroll
          for (int i = 0; i < 8; ++i) f[i] = Ex2(fmaf(f[i], L, -mL)) * inv;
          *reinterpret_cast<uint4*>(y + row * n + (v * kTeam + lane) * 8) = Pack(f);
        }
      } else {
        const float rstd = rsqrtf(st.m2 / n + 1e-5f);
#pragma unroll
        for (int v = 0; v < kVecs; ++v) {
          float f[8];
          Unpack(raw[v], f);
          const int col = (v * kTeam + lane) * 8;
          const float4 s0 = __ldg(reinterpret_cast<const float4*>(scale + col));
          const float4 s1 = __ldg(reinterpret_cast<const float4*>(scale + col + 4));
          const float4 b0 = __ldg(reinterpret_cast<const float4*>(bias + col));
          const float4 b1 = __ldg(reinterpret_cast<const float4*>(bias + col + 4));
          const float sc[8] = {s0.x, s0.y, s0.z, s0.w, s1.x, s1.y, s1.z, s1.w};
          const float bi[8] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w};
#pragma unroll
          for (int i = 0; i < 8; ++i) f[i] = (f[i] - st.mean) * rstd * sc[i] + bi[i];
          *reinterpret_cast<uint4*>(y + row * n + col) = Pack(f);
        }
      }
    }
    if constexpr (!kPersist) break;
    // Barriers are per team, so a team past the last row simply stops.
    row += stride;
    if constexpr (kPrefetch) {
#pragma unroll
      for (int v = 0; v < kVecs; ++v) raw[v] = nxt[v];
    } else {
      load(raw, row);
    }
  }
}

static float g_copy_gbs = 0;
static __nv_bfloat16 *g_x, *g_y;
static float *g_scale, *g_bias;

std::vector<float> Reference(int op, const std::vector<__nv_bfloat16>& hx, int rows, int n,
                             const std::vector<float>& sc, const std::vector<float>& bi) {
  std::vector<float> out(size_t(rows) * n);
  for (int r = 0; r < rows; ++r) {
    const __nv_bfloat16* xr = hx.data() + size_t(r) * n;
    double a = 0, b = 0;
    if (op == 0) {
      double m = -1e30;
      for (int i = 0; i < n; ++i) m = std::max(m, double(__bfloat162float(xr[i])));
      for (int i = 0; i < n; ++i) a += std::exp(double(__bfloat162float(xr[i])) - m);
      for (int i = 0; i < n; ++i)
        out[size_t(r) * n + i] = std::exp(double(__bfloat162float(xr[i])) - m) / a;
    } else {
      for (int i = 0; i < n; ++i) a += __bfloat162float(xr[i]);
      a /= n;
      for (int i = 0; i < n; ++i) b += std::pow(__bfloat162float(xr[i]) - a, 2);
      const double rstd = 1 / std::sqrt(b / n + 1e-5);
      for (int i = 0; i < n; ++i)
        out[size_t(r) * n + i] = (__bfloat162float(xr[i]) - a) * rstd * sc[i] + bi[i];
    }
  }
  return out;
}

template <int kOp, int kTeam, int kVecs, bool kPersist, bool kPrefetch>
void Run(int rows, const std::vector<float>& ref) {
  constexpr int n = kTeam * kVecs * 8;
  constexpr int kBlock = kTeam < 128 ? 128 : kTeam;
  constexpr int kTeams = kBlock / kTeam;
  auto kern = RowFwd<kOp, kTeam, kVecs, kPersist, kPrefetch>;
  int grid = (rows + kTeams - 1) / kTeams;
  int per_sm = 0;
  CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kern, kBlock, 0));
  int sms;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  if (kPersist) grid = std::min(grid, per_sm * sms);
  cudaFuncAttributes attr;
  CK(cudaFuncGetAttributes(&attr, kern));
  CK(cudaMemset(g_y, 0xff, size_t(rows) * n * 2));
  const float ms = TimeMs([&] { kern<<<grid, kBlock>>>(g_x, g_y, g_scale, g_bias, rows); });
  CK(cudaGetLastError());
  std::vector<__nv_bfloat16> hy(size_t(rows) * n);
  CK(cudaMemcpy(hy.data(), g_y, hy.size() * 2, cudaMemcpyDeviceToHost));
  double err = 0;
  const int check_rows = std::min(rows, 64);
  for (size_t i = 0; i < size_t(check_rows) * n; ++i) {
    const double d = std::fabs(__bfloat162float(hy[i]) - ref[i]) / (1e-3 + std::fabs(ref[i]));
    err = std::max(err, std::isnan(d) ? 1e9 : d);
  }
  // Last row too (persistent tails).
  const double gbs = 2.0 * rows * n * 2 / (ms * 1e-3) / 1e9;
  printf("%-9s n=%-5d team=%-3d persist=%d prefetch=%d regs=%-3d blk/SM=%-2d  %7.1f us  %6.0f GB/s  %5.1f%% copy  relerr=%.1e\n",
         kOp == 0 ? "softmax" : "layernorm", n, kTeam, kPersist, kPrefetch, attr.numRegs, per_sm,
         ms * 1e3, gbs, 100 * gbs / g_copy_gbs, err);
}

template <int kOp, int kTeam, int kVecs>
void RunAll(int rows, const std::vector<__nv_bfloat16>& hx, const std::vector<float>& sc,
            const std::vector<float>& bi) {
  constexpr int n = kTeam * kVecs * 8;
  CK(cudaMemcpy(g_x, hx.data(), size_t(rows) * n * 2, cudaMemcpyHostToDevice));
  std::vector<__nv_bfloat16> head(hx.begin(), hx.begin() + size_t(64) * n);
  auto ref = Reference(kOp, head, std::min(rows, 64), n, sc, bi);
  Run<kOp, kTeam, kVecs, false, false>(rows, ref);
  Run<kOp, kTeam, kVecs, true, false>(rows, ref);
  Run<kOp, kTeam, kVecs, true, true>(rows, ref);
}

int main() {
  const size_t max_elems = size_t(16384) * 8192;
  CK(cudaMalloc(&g_x, max_elems * 2));
  CK(cudaMalloc(&g_y, max_elems * 2));
  CK(cudaMalloc(&g_scale, 8192 * 4));
  CK(cudaMalloc(&g_bias, 8192 * 4));
  std::vector<__nv_bfloat16> hx(max_elems);
  srand(1);
  for (auto& v : hx) v = __float2bfloat16(3.f * (rand() / float(RAND_MAX) - 0.5f));
  std::vector<float> sc(8192), bi(8192);
  for (int i = 0; i < 8192; ++i) sc[i] = 1 + 0.1f * (rand() / float(RAND_MAX)), bi[i] = 0.1f * (rand() / float(RAND_MAX));
  CK(cudaMemcpy(g_scale, sc.data(), 8192 * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(g_bias, bi.data(), 8192 * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(g_x, hx.data(), max_elems * 2, cudaMemcpyHostToDevice));
  for (int64_t elems : {int64_t(16384) * 4096, int64_t(1) << 29}) {
    const int64_t vecs = elems / 8;
    uint4 *a, *b;
    CK(cudaMalloc(&a, elems * 2));
    CK(cudaMalloc(&b, elems * 2));
    const float ms = TimeMs([&] { Copy<<<132 * 8, 256>>>(a, b, vecs); });
    const float gbs = 2.0 * elems * 2 / (ms * 1e-3) / 1e9;
    printf("copy %lld MB: %.1f us  %.0f GB/s\n", (long long)(elems * 2 >> 20), ms * 1e3, gbs);
    g_copy_gbs = std::max(g_copy_gbs, gbs);
    CK(cudaFree(a));
    CK(cudaFree(b));
  }
  const char* which = getenv("ROWS_ONLY");
  auto want = [&](int n) { return !which || atoi(which) == n; };
  if (want(4096)) {
    RunAll<0, 32, 16>(16384, hx, sc, bi);
    RunAll<0, 64, 8>(16384, hx, sc, bi);
    RunAll<0, 128, 4>(16384, hx, sc, bi);
    RunAll<0, 256, 2>(16384, hx, sc, bi);
    RunAll<0, 512, 1>(16384, hx, sc, bi);
    RunAll<1, 64, 8>(16384, hx, sc, bi);
    RunAll<1, 128, 4>(16384, hx, sc, bi);
    RunAll<1, 256, 2>(16384, hx, sc, bi);
    RunAll<1, 512, 1>(16384, hx, sc, bi);
  }
  if (want(1024)) {
    RunAll<0, 32, 4>(16384, hx, sc, bi);
    RunAll<0, 64, 2>(16384, hx, sc, bi);
    RunAll<0, 128, 1>(16384, hx, sc, bi);
    RunAll<1, 32, 4>(16384, hx, sc, bi);
    RunAll<1, 64, 2>(16384, hx, sc, bi);
    RunAll<1, 128, 1>(16384, hx, sc, bi);
  }
  if (want(8192)) {
    RunAll<0, 128, 8>(16384, hx, sc, bi);
    RunAll<0, 256, 4>(16384, hx, sc, bi);
    RunAll<0, 512, 2>(16384, hx, sc, bi);
    RunAll<1, 128, 8>(16384, hx, sc, bi);
    RunAll<1, 256, 4>(16384, hx, sc, bi);
    RunAll<1, 512, 2>(16384, hx, sc, bi);
  }
  return 0;
}
