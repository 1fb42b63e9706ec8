// Micro-benchmark: layer-norm / RMS-norm backward row kernels (bf16) against a
// streaming copy, in one process with CUDA events. Used to choose the
// register-row design of the norm backward before porting it into ffi/.
// Standalone: nvcc -O3 -std=c++17 -arch=sm_90a row_bwd.cu -o row_bwd
//
// Every variant: a team of kTeam threads owns a row, each thread holds kVecs
// 16-byte vectors of x and of dy as packed bf16; one team reduction per row
// (layer norm: count, mean, M2, sum g, sum g (x - mean); RMS: sum x^2,
// sum g x) by shuffles down + broadcast and one barrier per row for teams
// wider than a warp. Blocks are persistent (the dscale/dbias partial sums
// stay with the thread that owns the columns), each team walks rows with a
// stride, and each team writes one row of partials at the end; a column-sum
// kernel adds them in a fixed order. Variants differ in where the partial sums
// live (registers or shared memory), the team width, and whether the next
// row's loads are issued before the current row is processed.
#include <cuda_bf16.h>

#include "micro_common.cuh"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <type_traits>
#include <vector>

#ifndef UNPACK_VOLATILE
#define UNPACK_VOLATILE 1
#endif
#ifndef PARAM_SMEM
#define PARAM_SMEM 1
#endif
#ifndef PARAM_VOLATILE
#define PARAM_VOLATILE 1
#endif

using bf16 = __nv_bfloat16;

__device__ __forceinline__ void Unpack(uint4 r, float (&f)[8]) {
  const uint32_t w[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    uint32_t lo, hi;
#if UNPACK_VOLATILE
    asm volatile("shl.b32 %0, %2, 16;\n\tand.b32 %1, %2, 0xffff0000;" : "=r"(lo), "=r"(hi) : "r"(w[i]));
#else
    lo = w[i] << 16, hi = w[i] & 0xffff0000u;
#endif
    f[2 * i] = __uint_as_float(lo);
    f[2 * i + 1] = __uint_as_float(hi);
  }
}

// volatile, like the loads and unpacks: volatile asm keeps its program order,
// so the next row's loads cannot be hoisted above this row's stores (with a
// plain store ptxas issued them early and kept the unpacked row, its scale
// and the new raw vectors all live: 233 registers for RMS norm).
__device__ __forceinline__ void Store16(void* p, uint4 v) {
  asm volatile("st.global.v4.b32 [%0], {%1,%2,%3,%4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
}

// volatile: re-read (from L1) at each use; otherwise ptxas keeps the products
// dy * scale of the statistics pass live until the dx pass (232 registers).
__device__ __forceinline__ float4 LoadParam4(const float* p) {
  float4 r;
#if PARAM_VOLATILE
  asm volatile("ld.global.nc.v4.f32 {%0,%1,%2,%3}, [%4];"
#else
  asm("ld.global.nc.v4.f32 {%0,%1,%2,%3}, [%4];"
#endif
               : "=f"(r.x), "=f"(r.y), "=f"(r.z), "=f"(r.w)
               : "l"(p));
  return r;
}

__device__ __forceinline__ void Load8(const float* p, float (&f)[8]) {
  const float4 a = LoadParam4(p);
  const float4 b = LoadParam4(p + 4);
  f[0] = a.x, f[1] = a.y, f[2] = a.z, f[3] = a.w, f[4] = b.x, f[5] = b.y, f[6] = b.z, f[7] = b.w;
}

struct LnState {
  float n, mean, m2, g, s;
  __device__ static LnState Merge(const LnState& a, const LnState& b) {
    const float n = a.n + b.n;
    const float d = b.mean - a.mean;
    const float wb = b.n * __frcp_rn(n);
    return {n, a.mean + d * wb, a.m2 + b.m2 + d * d * a.n * wb, a.g + b.g,
            a.s + b.s + d * (b.g * a.n - a.g * b.n) * __frcp_rn(n)};
  }
};
struct RmsState {
  float ss, sgx;
  __device__ static RmsState Merge(const RmsState& a, const RmsState& b) {
    return {a.ss + b.ss, a.sgx + b.sgx};
  }
};

template <typename S>
__device__ __forceinline__ S Shfl(S s, int o, bool down) {
  constexpr int k = sizeof(S) / 4;
  float* f = reinterpret_cast<float*>(&s);
  S out;
  float* g = reinterpret_cast<float*>(&out);
#pragma unroll
  for (int i = 0; i < k; ++i)
    g[i] = down ? __shfl_down_sync(0xffffffffu, f[i], o) : __shfl_sync(0xffffffffu, f[i], o);
  return out;
}

constexpr float kEps = 1e-5f;

// kAcc: 0 registers, 1 shared memory ([team][sum][vector slot][lane] float4s,
// conflict-free). kTeams teams a block. kThreadsPerSM: the launch bound asks
// ptxas for registers that let this many threads live on an SM (512: 128
// registers); left free, ptxas hoists every unpack and parameter load of a
// pass and takes up to 255.
template <bool kRms, int kTeam, int kVecs, int kAcc, bool kPrefetch, int kTeams, int kThreadsPerSM = 512>
__global__ void __launch_bounds__(kTeam* kTeams, kThreadsPerSM / (kTeam * kTeams))
    NormBwd(const bf16* __restrict__ x, const bf16* __restrict__ dy, const float* __restrict__ scale,
            bf16* __restrict__ dx, float* __restrict__ partials, int rows) {
  constexpr int kWarps = kTeam / 32;
  constexpr int n = kTeam * kVecs * 8;
  constexpr int kSums = kRms ? 1 : 2;
  using S = std::conditional_t<kRms, RmsState, LnState>;
  __shared__ S slots[2][kTeams][kWarps];
  extern __shared__ float4 smem_acc[];
  const int team = threadIdx.x / kTeam, lane = threadIdx.x % kTeam;
#if PARAM_SMEM
  // scale staged once a block in shared memory, [vector][half][lane] float4s
  // (conflict-free): the passes then hold no global loads but the row's.
  __shared__ float4 scale_s[kVecs][2][kTeam];
  if (team == 0) {
    for (int v = 0; v < kVecs; ++v)
      for (int h = 0; h < 2; ++h)
        scale_s[v][h][lane] = *reinterpret_cast<const float4*>(scale + (v * kTeam + lane) * 8 + 4 * h);
  }
  __syncthreads();
  auto load_scale = [&](int v, float (&f)[8]) {
    const float4 a = scale_s[v][0][lane], b = scale_s[v][1][lane];
    f[0] = a.x, f[1] = a.y, f[2] = a.z, f[3] = a.w, f[4] = b.x, f[5] = b.y, f[6] = b.z, f[7] = b.w;
  };
#else
  auto load_scale = [&](int v, float (&f)[8]) { Load8(scale + (v * kTeam + lane) * 8, f); };
#endif
  const int64_t stride = int64_t{gridDim.x} * kTeams;
  int64_t row = int64_t{blockIdx.x} * kTeams + team;
  auto col = [&](int v) { return (v * kTeam + lane) * 8; };
  // Shared accumulators: float4 slot (team, s, v, half) at lane.
  auto acc_at = [&](int s, int v, int h) -> float4& {
    return smem_acc[(((team * kSums + s) * kVecs + v) * 2 + h) * kTeam + lane];
  };
  float acc[kAcc == 0 ? kSums : 1][kAcc == 0 ? kVecs : 1][8];
  if constexpr (kAcc == 0) {
#pragma unroll
    for (int s = 0; s < kSums; ++s)
#pragma unroll
      for (int v = 0; v < kVecs; ++v)
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[s][v][i] = 0.f;
  } else {
    for (int s = 0; s < kSums; ++s)
      for (int v = 0; v < kVecs; ++v)
        for (int h = 0; h < 2; ++h) acc_at(s, v, h) = make_float4(0, 0, 0, 0);
  }
  uint4 rx[kVecs], rd[kVecs];
  // One base pointer a row, compile-time offsets per vector (immediates in
  // the load/store instructions instead of a 64-bit address per vector).
  auto load = [&](uint4(&a)[kVecs], uint4(&b)[kVecs], int64_t r) {
    if (r < rows) {
      const bf16* xr = x + r * n + lane * 8;
      const bf16* dr = dy + r * n + lane * 8;
#pragma unroll
      for (int v = 0; v < kVecs; ++v) {
        a[v] = LoadNc(xr + v * kTeam * 8);
        b[v] = LoadNc(dr + v * kTeam * 8);
      }
    }
  };
  load(rx, rd, row);
#pragma unroll 1
  for (int k = 0; row < rows; ++k, row += stride) {
    uint4 nx[kVecs], nd[kVecs];
    if constexpr (kPrefetch) load(nx, nd, row + stride);
    S st;
    if constexpr (kRms) {
      float ss = 0.f, sgx = 0.f;
#pragma unroll
      for (int v = 0; v < kVecs; ++v) {
        float f[8], d[8], g[8];
        Unpack(rx[v], f);
        Unpack(rd[v], d);
        load_scale(v, g);
#pragma unroll
        for (int i = 0; i < 8; ++i) ss += f[i] * f[i], sgx += d[i] * g[i] * f[i];
      }
      st = {ss, sgx};
    } else {
      float sum = 0.f;
#pragma unroll
      for (int v = 0; v < kVecs; ++v) {
        float f[8];
        Unpack(rx[v], f);
#pragma unroll
        for (int i = 0; i < 8; ++i) sum += f[i];
      }
      const float mean = sum * (1.f / (kVecs * 8));
      float m2 = 0.f, gs = 0.f, s = 0.f;
#pragma unroll
      for (int v = 0; v < kVecs; ++v) {
        float f[8], d[8], g[8];
        Unpack(rx[v], f);
        Unpack(rd[v], d);
        load_scale(v, g);
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          const float c = f[i] - mean, gg = d[i] * g[i];
          m2 += c * c, gs += gg, s += gg * c;
        }
      }
      st = {float(kVecs * 8), mean, m2, gs, s};
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) st = S::Merge(st, Shfl(st, o, true));
    st = Shfl(st, 0, false);
    if constexpr (kWarps > 1) {
      if (lane % 32 == 0) slots[k & 1][team][lane / 32] = st;
      if constexpr (kTeams == 1) {
        __syncthreads();
      } else if (team == 0) {
        asm volatile("bar.sync 1, %0;" ::"n"(kTeam) : "memory");
      } else {
        asm volatile("bar.sync 2, %0;" ::"n"(kTeam) : "memory");
      }
      st = slots[k & 1][team][0];
#pragma unroll
      for (int w = 1; w < kWarps; ++w) st = S::Merge(st, slots[k & 1][team][w]);
    }
    float mean = 0.f, rstd, mean_g = 0.f, mean_gx;
    if constexpr (kRms) {
      rstd = rsqrtf(st.ss * (1.f / n) + kEps);
      mean_gx = st.sgx * rstd * (1.f / n);
    } else {
      mean = st.mean;
      rstd = rsqrtf(st.m2 * (1.f / n) + kEps);
      mean_g = st.g * (1.f / n);
      mean_gx = st.s * rstd * (1.f / n);
    }
#pragma unroll
    for (int v = 0; v < kVecs; ++v) {
      float f[8], d[8], g[8], out[8];
      Unpack(rx[v], f);
      Unpack(rd[v], d);
      load_scale(v, g);
      float da[8], db[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const float xh = (f[i] - mean) * rstd;
        out[i] = rstd * (d[i] * g[i] - mean_g - xh * mean_gx);
        da[i] = d[i] * xh;
        db[i] = d[i];
      }
      if constexpr (kAcc == 0) {
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          acc[0][v][i] += da[i];
          if constexpr (!kRms) acc[kSums - 1][v][i] += db[i];
        }
      } else {
#pragma unroll
        for (int s = 0; s < kSums; ++s) {
          const float* src = s == 0 ? da : db;
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            float4& a = acc_at(s, v, h);
            float4 t = a;
            t.x += src[4 * h], t.y += src[4 * h + 1], t.z += src[4 * h + 2], t.w += src[4 * h + 3];
            a = t;
          }
        }
      }
      Store16(dx + row * n + lane * 8 + v * kTeam * 8, Pack(out));
    }
    if constexpr (kPrefetch) {
#pragma unroll
      for (int v = 0; v < kVecs; ++v) rx[v] = nx[v], rd[v] = nd[v];
    } else {
      load(rx, rd, row + stride);
    }
  }
  // One row of partials per team; with shared accumulators the block's teams
  // are merged first (team 0 adds the others in order): one row a block.
  constexpr bool kMerge = kAcc == 1 && kTeams > 1;
  if constexpr (kMerge) __syncthreads();
  if (kMerge && team != 0) return;
  float* out = partials + (int64_t{blockIdx.x} * (kMerge ? 1 : kTeams) + team) * kSums * n;
#pragma unroll
  for (int s = 0; s < kSums; ++s)
#pragma unroll
    for (int v = 0; v < kVecs; ++v) {
      float4 a0, a1;
      if constexpr (kAcc == 0) {
        a0 = make_float4(acc[s][v][0], acc[s][v][1], acc[s][v][2], acc[s][v][3]);
        a1 = make_float4(acc[s][v][4], acc[s][v][5], acc[s][v][6], acc[s][v][7]);
      } else {
        a0 = acc_at(s, v, 0);
        a1 = acc_at(s, v, 1);
        for (int t = 1; kMerge && t < kTeams; ++t) {
          const int o = t * kSums * kVecs * 2 * kTeam;
          const float4 b0 = (&acc_at(s, v, 0))[o], b1 = (&acc_at(s, v, 1))[o];
          a0.x += b0.x, a0.y += b0.y, a0.z += b0.z, a0.w += b0.w;
          a1.x += b1.x, a1.y += b1.y, a1.z += b1.z, a1.w += b1.w;
        }
      }
      *reinterpret_cast<float4*>(out + s * n + col(v)) = a0;
      *reinterpret_cast<float4*>(out + s * n + col(v) + 4) = a1;
    }
}

// Sums `parts` rows of partials per (sum, column): 32 columns x 8 lanes a block.
__global__ void __launch_bounds__(256) ColumnSum(const float* partials, float* out, int parts, int sums, int n) {
  const int c = blockIdx.x * 32 + threadIdx.x, s = blockIdx.y, lane = threadIdx.y;
  const int share = (parts + 7) / 8;
  float a = 0.f;
  for (int j = lane * share; j < min(parts, (lane + 1) * share); ++j)
    a += partials[(int64_t{j} * sums + s) * n + c];
  __shared__ float l[8][32];
  l[lane][threadIdx.x] = a;
  __syncthreads();
  if (lane == 0) {
    float t = 0.f;
    for (int i = 0; i < 8; ++i) t += l[i][threadIdx.x];
    out[s * n + c] = t;
  }
}

static float g_copy_gbs = 0;
static bf16 *g_x, *g_dy, *g_dx;
static float *g_scale, *g_part, *g_dparams;
static int g_rows = 16384;

struct Ref {
  std::vector<double> dx;       // first 64 rows
  std::vector<double> dparams;  // [sums][n]
};

Ref Reference(bool rms, const std::vector<bf16>& hx, const std::vector<bf16>& hd,
              const std::vector<float>& sc, int rows, int n) {
  Ref r;
  r.dx.resize(size_t(64) * n);
  r.dparams.assign(size_t(2) * n, 0.0);
  std::vector<double> xh(n);
  for (int row = 0; row < rows; ++row) {
    const bf16* xr = hx.data() + size_t(row) * n;
    const bf16* dr = hd.data() + size_t(row) * n;
    double mean = 0, var = 0;
    if (!rms) {
      for (int i = 0; i < n; ++i) mean += __bfloat162float(xr[i]);
      mean /= n;
    }
    for (int i = 0; i < n; ++i) var += std::pow(__bfloat162float(xr[i]) - mean, 2);
    const double rstd = 1 / std::sqrt(var / n + kEps);
    double mg = 0, mgx = 0;
    for (int i = 0; i < n; ++i) {
      xh[i] = (__bfloat162float(xr[i]) - mean) * rstd;
      const double g = double(__bfloat162float(dr[i])) * sc[i];
      mg += g, mgx += g * xh[i];
      r.dparams[i] += __bfloat162float(dr[i]) * xh[i];
      r.dparams[n + i] += __bfloat162float(dr[i]);
    }
    mg /= n, mgx /= n;
    if (rms) mg = 0;
    if (row < 64)
      for (int i = 0; i < n; ++i)
        r.dx[size_t(row) * n + i] = rstd * (__bfloat162float(dr[i]) * sc[i] - mg - xh[i] * mgx);
  }
  return r;
}

template <bool kRms, int kTeam, int kVecs, int kAcc, bool kPrefetch, int kTeams, int kTPS = 512>
void Run(const Ref& ref) {
  constexpr int n = kTeam * kVecs * 8;
  constexpr int kSums = kRms ? 1 : 2;
  const int rows = g_rows;
  auto kern = NormBwd<kRms, kTeam, kVecs, kAcc, kPrefetch, kTeams, kTPS>;
  const size_t smem = kAcc ? size_t(kTeams) * kSums * n * 4 : 0;
  // Always raised: the static scale stage and the dynamic accumulators together may pass 48 KB.
  CK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  int per_sm = 0, sms = 0;
  CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kern, kTeam * kTeams, smem));
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  if (per_sm == 0) {
    printf("%s team=%d vecs=%d acc=%d: does not fit an SM (smem %zu)\n", kRms ? "rms" : "ln", kTeam, kVecs, kAcc, smem);
    return;
  }
  // As many teams as fit at once, trimmed so that every team does the same
  // number of rows.
  const int slots = per_sm * sms * kTeams;
  const int rows_per_team = (rows + slots - 1) / slots;
  const int teams = (rows + rows_per_team - 1) / rows_per_team;
  const int grid = (teams + kTeams - 1) / kTeams;
  const int parts = grid * (kAcc == 1 ? 1 : kTeams);
  cudaFuncAttributes attr;
  CK(cudaFuncGetAttributes(&attr, kern));
  CK(cudaMemset(g_dx, 0xff, size_t(rows) * n * 2));
  CK(cudaMemset(g_dparams, 0xff, size_t(2) * n * 4));
  auto both = [&] {
    kern<<<grid, kTeam * kTeams, smem>>>(g_x, g_dy, g_scale, g_dx, g_part, rows);
    ColumnSum<<<dim3(n / 32, kSums), dim3(32, 8)>>>(g_part, g_dparams, parts, kSums, n);
  };
  const float ms = TimeMs(both);
  const float ms_main =
      TimeMs([&] { kern<<<grid, kTeam * kTeams, smem>>>(g_x, g_dy, g_scale, g_dx, g_part, rows); });
  CK(cudaGetLastError());
  std::vector<bf16> hdx(size_t(64) * n);
  std::vector<float> hp(size_t(kSums) * n);
  CK(cudaMemcpy(hdx.data(), g_dx, hdx.size() * 2, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(hp.data(), g_dparams, hp.size() * 4, cudaMemcpyDeviceToHost));
  // Also the last row: every team must have reached its last row.
  bf16 last;
  CK(cudaMemcpy(&last, g_dx + size_t(rows) * n - 1, 2, cudaMemcpyDeviceToHost));
  double err = 0, perr = 0;
  for (size_t i = 0; i < hdx.size(); ++i) {
    const double d = std::fabs(__bfloat162float(hdx[i]) - ref.dx[i]) / (1e-2 + std::fabs(ref.dx[i]));
    err = std::max(err, std::isnan(d) ? 1e9 : d);
  }
  for (int s = 0; s < kSums; ++s)
    for (int i = 0; i < n; ++i) {
      const double e = ref.dparams[s * n + i];
      const double d = std::fabs(hp[s * n + i] - e) / (1 + std::fabs(e));
      perr = std::max(perr, std::isnan(d) ? 1e9 : d);
    }
  if (std::isnan(__bfloat162float(last))) err = 1e9;
  const double bytes = 3.0 * rows * n * 2;
  const double gbs = bytes / (ms * 1e-3) / 1e9;
  printf("%-3s n=%-5d team=%-3d vecs=%d acc=%-4s pre=%d teams/blk=%d tps=%-4d regs=%-3d blk/SM=%-2d parts=%-4d "
         "%6.1f us (kernel %6.1f) %5.0f GB/s %5.1f%% copy  err dx %.1e dp %.1e\n",
         kRms ? "rms" : "ln", n, kTeam, kVecs, kAcc ? "smem" : "regs", kPrefetch, kTeams, kTPS, attr.numRegs,
         per_sm, parts, ms * 1e3, ms_main * 1e3, gbs, 100 * gbs / g_copy_gbs, err, perr);
}

void Fill(int n, Ref& ln, Ref& rms) {
  const size_t elems = size_t(g_rows) * n;
  std::vector<bf16> hx(elems), hd(elems);
  srand(n);
  for (auto& v : hx) v = __float2bfloat16(3.f * (rand() / float(RAND_MAX) - 0.5f) + 0.5f);
  for (auto& v : hd) v = __float2bfloat16(2.f * (rand() / float(RAND_MAX) - 0.5f));
  std::vector<float> sc(n);
  for (auto& v : sc) v = 1 + 0.5f * (rand() / float(RAND_MAX) - 0.5f);
  CK(cudaMemcpy(g_x, hx.data(), elems * 2, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(g_dy, hd.data(), elems * 2, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(g_scale, sc.data(), n * 4, cudaMemcpyHostToDevice));
  ln = Reference(false, hx, hd, sc, g_rows, n);
  rms = Reference(true, hx, hd, sc, g_rows, n);
}

int main() {
  setvbuf(stdout, nullptr, _IOLBF, 0);
  const size_t max_elems = size_t(16384) * 8192;
  CK(cudaMalloc(&g_x, max_elems * 2));
  CK(cudaMalloc(&g_dy, max_elems * 2));
  CK(cudaMalloc(&g_dx, max_elems * 2));
  CK(cudaMalloc(&g_scale, 8192 * 4));
  CK(cudaMalloc(&g_part, size_t(1) << 28));
  CK(cudaMalloc(&g_dparams, 2 * 8192 * 4));
  {
    const int64_t elems = int64_t(16384) * 4096 * 3 / 2;  // same bytes as the 4096-wide backward
    uint4 *a, *b;
    CK(cudaMalloc(&a, elems * 2));
    CK(cudaMalloc(&b, elems * 2));
    const float ms = TimeMs([&] { Copy<<<132 * 8, 256>>>(a, b, elems / 8); });
    g_copy_gbs = 2.0 * elems * 2 / (ms * 1e-3) / 1e9;
    printf("copy %lld MB: %.1f us  %.0f GB/s\n", (long long)(elems * 2 >> 20), ms * 1e3, g_copy_gbs);
    CK(cudaFree(a));
    CK(cudaFree(b));
  }
  const char* which = getenv("ROWS_ONLY");
  auto want = [&](int n) { return !which || atoi(which) == n; };
  Ref ln, rms;
  if (want(4096)) {
    Fill(4096, ln, rms);
    Run<false, 128, 4, 0, false, 1>(ln);
    Run<false, 128, 4, 1, false, 1>(ln);
    Run<false, 128, 4, 1, true, 1>(ln);
    Run<false, 128, 4, 1, true, 2>(ln);
    Run<false, 256, 2, 1, true, 1>(ln);
    Run<false, 256, 2, 1, true, 1, 768>(ln);
    Run<false, 64, 8, 1, true, 2>(ln);
    Run<true, 256, 2, 0, false, 1>(rms);
    Run<true, 256, 2, 0, true, 1>(rms);
    Run<true, 128, 4, 1, false, 1>(rms);
    Run<true, 128, 4, 1, true, 1>(rms);
    Run<true, 128, 4, 1, true, 2>(rms);
    Run<true, 256, 2, 1, true, 1, 768>(rms);
  }
  if (want(1024)) {
    Fill(1024, ln, rms);
    Run<false, 64, 2, 0, true, 2>(ln);
    Run<false, 32, 4, 1, true, 4>(ln);
    Run<false, 64, 2, 1, true, 2>(ln);
    Run<false, 128, 1, 1, true, 1>(ln);
    Run<false, 128, 1, 1, true, 1, 1024>(ln);
    Run<true, 32, 4, 1, true, 4>(rms);
    Run<true, 64, 2, 1, true, 2>(rms);
  }
  if (want(8192)) {
    Fill(8192, ln, rms);
    Run<false, 256, 4, 0, false, 1>(ln);
    Run<false, 256, 4, 1, true, 1>(ln);
    Run<false, 512, 2, 1, true, 1>(ln);
    Run<true, 256, 4, 1, true, 1>(rms);
    Run<true, 512, 2, 1, true, 1>(rms);
  }
  return 0;
}
