// Micro-benchmark: what the fp32 scale and bias cost the bf16 layer-norm
// forward (16384 x 4096), and whether a team that normalizes kRows rows at
// once (loading each parameter vector once for them) wins it back.
// Standalone: nvcc -O3 -arch=sm_90a ln_params.cu -o ln_params
//
// The layout is the library's (ffi/common/row_regs.cuh): a team of kTeam
// threads, kVecs 16-byte vectors of each row a thread, all loads issued
// before any is used; one Chan-merged (count, mean, M2) reduction a row.
// kParams: 0 none, 1 scale, 2 scale and bias (fp32, read from L1/L2 for every
// row, as the library does).
#include <cuda_bf16.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "micro_common.cuh"

namespace {

// bf16 is the top half of an fp32. volatile, as in the library: ptxas then
// redoes this widening at each use instead of keeping every widened value
// of the row live across the passes.
__device__ __forceinline__ void Unpack(uint4 r, float (&f)[8]) {
  const uint32_t w[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    uint32_t lo, hi;
    asm volatile("shl.b32 %0, %2, 16;\n\tand.b32 %1, %2, 0xffff0000;" : "=r"(lo), "=r"(hi) : "r"(w[i]));
    f[2 * i] = __uint_as_float(lo);
    f[2 * i + 1] = __uint_as_float(hi);
  }
}

// Named barrier 1 + team over kThreads threads, the id a compile-time
// constant (a run-time id makes ptxas reserve all 16 barriers of the block,
// which caps the blocks an SM holds).
template <int kTeams, int kThreads, int kId = 0>
__device__ __forceinline__ void TeamBar(int team) {
  if constexpr (kId + 1 < kTeams) {
    if (team != kId) return TeamBar<kTeams, kThreads, kId + 1>(team);
  }
  asm volatile("bar.sync %0, %1;" ::"n"(kId + 1), "n"(kThreads) : "memory");
}

// 8 fp32 parameters, read through the read-only path (L1 hits after the first row).
__device__ __forceinline__ void Load8(const float* p, float (&f)[8]) {
  const float4 a = __ldg(reinterpret_cast<const float4*>(p));
  const float4 b = __ldg(reinterpret_cast<const float4*>(p + 4));
  f[0] = a.x, f[1] = a.y, f[2] = a.z, f[3] = a.w, f[4] = b.x, f[5] = b.y, f[6] = b.z, f[7] = b.w;
}

__device__ __forceinline__ MeanM2 Shfl(MeanM2 s, int o) {
  return {__shfl_xor_sync(0xffffffffu, s.n, o), __shfl_xor_sync(0xffffffffu, s.mean, o),
          __shfl_xor_sync(0xffffffffu, s.m2, o)};
}

template <int kTeam, int kVecs, int kRows, int kParams>
__global__ void __launch_bounds__(kTeam < 128 ? 128 : kTeam)
    LnFwd(const __nv_bfloat16* __restrict__ x, __nv_bfloat16* __restrict__ y,
          const float* __restrict__ scale, const float* __restrict__ bias, int rows) {
  constexpr int kBlock = kTeam < 128 ? 128 : kTeam;
  constexpr int kTeams = kBlock / kTeam;
  constexpr int kWarps = kTeam / 32;
  constexpr int n = kTeam * kVecs * 8;
  __shared__ MeanM2 slots[kTeams][kWarps][kRows];
  const int team = threadIdx.x / kTeam, lane = threadIdx.x % kTeam;
  const int64_t row0 = (int64_t{blockIdx.x} * kTeams + team) * kRows;
  if (row0 >= rows) return;  // rows % (kTeams * kRows) == 0 here
  uint4 raw[kRows][kVecs];
#pragma unroll
  for (int r = 0; r < kRows; ++r)
#pragma unroll
    for (int v = 0; v < kVecs; ++v) raw[r][v] = LoadNc(x + (row0 + r) * n + (v * kTeam + lane) * 8);
  MeanM2 st[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    float sum = 0.f;
#pragma unroll
    for (int v = 0; v < kVecs; ++v) {
      float f[8];
      Unpack(raw[r][v], f);
#pragma unroll
      for (int i = 0; i < 8; ++i) sum += f[i];
    }
    const float mean = sum * (1.f / (kVecs * 8));
    float m2 = 0.f;
#pragma unroll
    for (int v = 0; v < kVecs; ++v) {
      float f[8];
      Unpack(raw[r][v], f);
#pragma unroll
      for (int i = 0; i < 8; ++i) m2 += (f[i] - mean) * (f[i] - mean);
    }
    st[r] = {float(kVecs * 8), mean, m2};
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) st[r] = MeanM2::Merge(st[r], Shfl(st[r], o));
  }
  if constexpr (kWarps > 1) {  // one barrier for all kRows rows
    const int w = lane / 32;
    if (lane % 32 == 0) {
#pragma unroll
      for (int r = 0; r < kRows; ++r) slots[team][w][r] = st[r];
    }
    TeamBar<kTeams, kTeam>(team);
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      st[r] = slots[team][0][r];
#pragma unroll
      for (int i = 1; i < kWarps; ++i) st[r] = MeanM2::Merge(st[r], slots[team][i][r]);
    }
  }
  float rstd[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) rstd[r] = rsqrtf(st[r].m2 / n + 1e-5f);
#pragma unroll
  for (int v = 0; v < kVecs; ++v) {
    const int col = (v * kTeam + lane) * 8;
    float sc[8], bi[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) sc[i] = 1.f, bi[i] = 0.f;
    if constexpr (kParams >= 1) Load8(scale + col, sc);
    if constexpr (kParams >= 2) Load8(bias + col, bi);
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      float f[8];
      Unpack(raw[r][v], f);
#pragma unroll
      for (int i = 0; i < 8; ++i) f[i] = (f[i] - st[r].mean) * rstd[r] * sc[i] + bi[i];
      *reinterpret_cast<uint4*>(y + (row0 + r) * n + col) = Pack(f);
    }
  }
}

__nv_bfloat16 *g_x, *g_y;
float *g_scale, *g_bias;
float g_copy_gbs = 0;

template <int kTeam, int kVecs, int kRows, int kParams>
void Run(int rows, const std::vector<float>& ref, int check_rows) {
  constexpr int n = kTeam * kVecs * 8;
  constexpr int kBlock = kTeam < 128 ? 128 : kTeam;
  constexpr int kTeams = kBlock / kTeam;
  auto kern = LnFwd<kTeam, kVecs, kRows, kParams>;
  const int grid = rows / (kTeams * kRows);
  int per_sm = 0;
  CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kern, kBlock, 0));
  cudaFuncAttributes attr;
  CK(cudaFuncGetAttributes(&attr, kern));
  CK(cudaMemset(g_y, 0xff, size_t(rows) * n * 2));
  const float ms = TimeMs([&] { kern<<<grid, kBlock>>>(g_x, g_y, g_scale, g_bias, rows); });
  CK(cudaGetLastError());
  double err = -1;
  if (kParams == 2) {
    std::vector<__nv_bfloat16> hy(size_t(check_rows) * n);
    CK(cudaMemcpy(hy.data(), g_y, hy.size() * 2, cudaMemcpyDeviceToHost));
    err = 0;
    for (size_t i = 0; i < hy.size(); ++i) {
      const double d = std::fabs(__bfloat162float(hy[i]) - ref[i]) / (1e-2 + std::fabs(ref[i]));
      err = std::max(err, std::isnan(d) ? 1e9 : d);
    }
  }
  const double gbs = 2.0 * rows * n * 2 / (ms * 1e-3) / 1e9;
  printf("n=%-5d team=%-3d vecs=%d rows/team=%d params=%d regs=%-3d blk/SM=%-2d  %7.1f us  %6.0f GB/s  %5.1f%% copy  relerr=%.1e\n",
         n, kTeam, kVecs, kRows, kParams, attr.numRegs, per_sm, ms * 1e3, gbs, 100 * gbs / g_copy_gbs,
         err);
}

}  // namespace

int main() {
  constexpr int kRowsTotal = 16384, kN = 4096;
  const size_t elems = size_t(kRowsTotal) * kN;
  CK(cudaMalloc(&g_x, elems * 2));
  CK(cudaMalloc(&g_y, elems * 2));
  CK(cudaMalloc(&g_scale, kN * 4));
  CK(cudaMalloc(&g_bias, kN * 4));
  std::vector<__nv_bfloat16> hx(elems);
  srand(1);
  for (auto& v : hx) v = __float2bfloat16(3.f * (rand() / float(RAND_MAX) - 0.5f) + 1.f);
  std::vector<float> sc(kN), bi(kN);
  for (int i = 0; i < kN; ++i) sc[i] = 1 + 0.1f * (rand() / float(RAND_MAX)), bi[i] = 0.1f * (rand() / float(RAND_MAX));
  CK(cudaMemcpy(g_scale, sc.data(), kN * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(g_bias, bi.data(), kN * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(g_x, hx.data(), elems * 2, cudaMemcpyHostToDevice));
  {
    uint4* a = reinterpret_cast<uint4*>(g_x);
    uint4* b = reinterpret_cast<uint4*>(g_y);
    const float ms = TimeMs([&] { Copy<<<132 * 8, 256>>>(a, b, int64_t(elems / 8)); });
    g_copy_gbs = 2.0 * elems * 2 / (ms * 1e-3) / 1e9;
    printf("copy %zu MB: %.1f us  %.0f GB/s\n", elems * 2 >> 20, ms * 1e3, g_copy_gbs);
  }
  const int check_rows = 64;
  std::vector<float> ref(size_t(check_rows) * kN);
  for (int r = 0; r < check_rows; ++r) {
    double a = 0, b = 0;
    for (int i = 0; i < kN; ++i) a += __bfloat162float(hx[size_t(r) * kN + i]);
    a /= kN;
    for (int i = 0; i < kN; ++i) b += std::pow(__bfloat162float(hx[size_t(r) * kN + i]) - a, 2);
    const double rstd = 1 / std::sqrt(b / kN + 1e-5);
    for (int i = 0; i < kN; ++i)
      ref[size_t(r) * kN + i] = (__bfloat162float(hx[size_t(r) * kN + i]) - a) * rstd * sc[i] + bi[i];
  }
  for (int rep = 0; rep < 2; ++rep) {
    Run<64, 8, 1, 0>(kRowsTotal, ref, check_rows);
    Run<64, 8, 1, 1>(kRowsTotal, ref, check_rows);
    Run<64, 8, 1, 2>(kRowsTotal, ref, check_rows);
    Run<64, 8, 2, 2>(kRowsTotal, ref, check_rows);
    Run<128, 4, 1, 2>(kRowsTotal, ref, check_rows);
    Run<128, 4, 2, 2>(kRowsTotal, ref, check_rows);
    Run<128, 4, 4, 2>(kRowsTotal, ref, check_rows);
    Run<32, 16, 1, 2>(kRowsTotal, ref, check_rows);  // a warp a row: no barrier
  }
  return 0;
}
