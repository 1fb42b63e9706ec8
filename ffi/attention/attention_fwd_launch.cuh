// Host launcher of the forward kernel for one element type (instantiated per
// type in attention_fwd_<type>.cu so the two compile in parallel).
#pragma once

#include "ffi/attention/attention_fwd.cuh"
#include "ffi/attention/attention_fwd_combine.cuh"
#include "ffi/attention/attention_fwd_wide.cuh"
#include "ffi/attention/attention_tma.h"
#include "ffi/common/device_info.h"

namespace jax_dnn {
namespace attention {

// Launches a forward kernel (AttentionFwdKernel, or AttentionFwdWideKernel:
// `threads` a CTA, `smem` bytes of shared memory, work tiles of kBM rows
// and key tiles of kBN) on `grid` CTAs in clusters of kCluster, then the
// split tail's combine.
template <typename T, int kDv, int kBM, int kBN, bool kSplit, int kCluster, typename Kernel>
cudaError_t LaunchFwdGrid(Kernel kernel, int threads, int smem, const AttentionFwdParams& p,
                          const FwdSchedule& sched, unsigned grid, cudaStream_t stream) {
  const AttentionShape& s = p.shape;
  CUtensorMap tq, tk, tv;
  if (!MakeTensorMap(&tq, p.q, s.b, s.t, s.n, s.h, 64) ||               // a consumer's 64 rows
      !MakeTensorMap(&tk, p.k, s.b, s.s, s.kh, s.h, kBN / kCluster) ||  // a CTA's share of a key tile
      !MakeTensorMap(&tv, p.v, s.b, s.s, s.kh, s.hv, kBN / kCluster))
    return cudaErrorInvalidValue;
  cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (e != cudaSuccess) return e;
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(grid);
  config.blockDim = dim3(threads);
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute cluster[1];
  cluster[0].id = cudaLaunchAttributeClusterDimension;
  cluster[0].val.clusterDim.x = kCluster;
  cluster[0].val.clusterDim.y = cluster[0].val.clusterDim.z = 1;
  config.attrs = cluster;
  config.numAttrs = kCluster > 1 ? 1 : 0;  // the plain form launches without clusters
  e = cudaLaunchKernelEx(&config, kernel, tq, tk, tv, p, sched);
  if (e != cudaSuccess || !kSplit) return e;
  AttentionFwdCombineKernel<T, kDv, kBM>
      <<<dim3(sched.split_tiles * kCluster, kBM / kFwdCombineRows), kFwdCombineRows * kDv / 8, 0, stream>>>(
          p, sched, static_cast<int>(grid));
  return cudaGetLastError();
}

// One instantiation of the 128-row kernel.
template <typename T, int kD, int kDv, int kBN, bool kGeneral, bool kSplit, int kCluster>
cudaError_t LaunchFwdKernel(const AttentionFwdParams& p, const FwdSchedule& sched, unsigned grid,
                            cudaStream_t stream) {
  using Tiles = FwdTiles<kD, kDv, kBN>;
  return LaunchFwdGrid<T, kDv, Tiles::kBM, kBN, kSplit, kCluster>(
      AttentionFwdKernel<T, kD, kDv, kBN, kGeneral, kSplit, kCluster>, 384, Tiles::kSmem, p, sched, grid, stream);
}

// How the work tiles are shared out over the CTAs (FwdSchedule): m_tiles
// query tiles of bm rows a head, each with key_tiles key tiles, in clusters
// of cl CTAs (units of cl tiles). A persistent grid (one CTA an SM) where
// the tiles do not fit on the device at once: with a split tail where every
// tile sees the same keys (`uniform`), the split pays (FwdSplitPays), the
// last round would leave SMs idle and the workspace is there (the plan
// sizes it for the device: AttentionFwdWorkspaceElems), else over pairs of
// tiles (FwdWorkAt) where `pairs` allows. *grid: the CTAs.
inline FwdSchedule FwdPlan(const AttentionFwdParams& p, long long m_tiles, long long key_tiles, int bm, int dv,
                           int cl, bool uniform, bool pairs, unsigned* grid) {
  const AttentionShape& s = p.shape;
  const long long sms = SmCount(), tiles = m_tiles * s.n * s.b;
  const long long units = tiles / cl, slots = sms / cl;  // clusters the device runs at once
  const bool split = uniform && FwdSplitPays(dv, key_tiles) && units > slots && units % slots != 0 &&
                     p.ws != nullptr && p.ws_elems >= FwdSplitElems(sms, bm, dv) &&
                     (units % slots) * key_tiles * slots < INT32_MAX &&  // FwdSplit's 32-bit ranges
                     slots <= kFwdCombineMaxCtas;
  FwdSchedule sched{};
  sched.cluster = cl;
  if (split) {
    sched.units = static_cast<int>(units);
    sched.rounds = static_cast<int>(units / slots);
    sched.split_tiles = static_cast<int>(units % slots);
    sched.key_tiles = static_cast<int>(key_tiles);
    sched.ws = p.ws;
  } else {
    sched.pairs = pairs && cl == 1 && tiles > sms;
    sched.units = static_cast<int>(FwdUnits(m_tiles, s.n, s.b, sched.pairs, cl));
  }
  *grid = static_cast<unsigned>((sched.units < slots ? sched.units : slots) * cl);
  return sched;
}

// Clusters of two CTAs that share their K/V loads (AttentionFwdKernel's
// kCluster): for the lean path without a mask at 176-key tiles (S > 4096).
// Those are where the forward is long enough for the power cap to set the
// clock; elsewhere the extra instantiations would not pay for their build.
// (The 192-row kernel takes most of those: ChooseFwdKernel.)
template <int kBN, bool kGeneral>
constexpr bool kFwdClusterBuilt = !kGeneral && kBN == 176;

// How many clusters of two CTAs of `kernel` (`threads` a CTA, `smem` bytes
// of dynamic shared memory) the device runs at once, cached per device in
// `cache`: the cluster form only runs where they fill every SM.
constexpr int kFwdMaxDevices = 64;
template <typename Kernel>
int FwdMaxClusters(Kernel kernel, int threads, int smem, int (&cache)[kFwdMaxDevices]) {
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= kFwdMaxDevices) return 0;
  if (cache[dev] == 0) {
    int n = 0;
    cudaLaunchConfig_t config = {};
    config.gridDim = dim3(2);
    config.blockDim = dim3(threads);
    config.dynamicSmemBytes = smem;
    cudaLaunchAttribute cluster[1];
    cluster[0].id = cudaLaunchAttributeClusterDimension;
    cluster[0].val.clusterDim.x = 2;
    cluster[0].val.clusterDim.y = cluster[0].val.clusterDim.z = 1;
    config.attrs = cluster;
    config.numAttrs = 1;
    if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) != cudaSuccess ||
        cudaOccupancyMaxActiveClusters(&n, kernel, &config) != cudaSuccess)
      n = 0, cudaGetLastError();  // no clusters: the plain form
    cache[dev] = n > 0 ? n : -1;
  }
  return cache[dev] > 0 ? cache[dev] : 0;
}
template <typename T, int kD, int kDv, int kBN>
int FwdMaxClusters() {
  static int cache[kFwdMaxDevices] = {};
  return FwdMaxClusters(AttentionFwdKernel<T, kD, kDv, kBN, false, false, 2>,  // the split form is alike
                        384, FwdTiles<kD, kDv, kBN>::kSmem, cache);
}

template <typename T, int kD, int kDv, int kBN, bool kGeneral>
cudaError_t LaunchFwdTiles(const AttentionFwdParams& p, cudaStream_t stream) {
  using Tiles = FwdTiles<kD, kDv, kBN>;
  const AttentionShape& s = p.shape;
  // A grid of every tile when they fit on the device at once (one CTA an SM:
  // shared memory and registers); otherwise a persistent grid (FwdPlan), on
  // the lean path where every tile has the same keys in clusters of two
  // (m_tiles even).
  const long long m_tiles = (s.t + Tiles::kBM - 1) / Tiles::kBM, sms = SmCount();
  const long long tiles = m_tiles * s.n * s.b, key_tiles = (s.s + kBN - 1) / kBN;
  if (tiles > INT32_MAX / 2) return cudaErrorInvalidValue;  // the kernel's 32-bit tile indices
  const bool uniform = !kGeneral && FwdUniformKeys(OptionsOf(p.mask, p.scale, p.softcap));
  int cl = 1;
  if constexpr (kFwdClusterBuilt<kBN, kGeneral>)
    if (uniform && m_tiles % 2 == 0 && tiles > sms && 2 * FwdMaxClusters<T, kD, kDv, kBN>() >= sms)
      cl = 2;
  unsigned grid;
  const FwdSchedule sched = FwdPlan(p, m_tiles, key_tiles, Tiles::kBM, kDv, cl, uniform, /*pairs=*/true, &grid);
  const bool split = sched.split_tiles > 0;
  if constexpr (!kGeneral) {
    if constexpr (kFwdClusterBuilt<kBN, kGeneral>)
      if (cl == 2)
        return split ? LaunchFwdKernel<T, kD, kDv, kBN, false, true, 2>(p, sched, grid, stream)
                     : LaunchFwdKernel<T, kD, kDv, kBN, false, false, 2>(p, sched, grid, stream);
    if (split) return LaunchFwdKernel<T, kD, kDv, kBN, false, true, 1>(p, sched, grid, stream);
  }
  return LaunchFwdKernel<T, kD, kDv, kBN, kGeneral, false, 1>(p, sched, grid, stream);
}

// One instantiation of the 192-row kernel (AttentionFwdWideKernel).
template <typename T, int kD, int kDv, bool kSplit, int kCluster>
cudaError_t LaunchFwdWideKernel(const AttentionFwdParams& p, const FwdSchedule& sched, unsigned grid,
                                cudaStream_t stream) {
  using Tiles = FwdWideTiles<kD, kDv>;
  return LaunchFwdGrid<T, kDv, Tiles::kBM, Tiles::kBN, kSplit, kCluster>(
      AttentionFwdWideKernel<T, kD, kDv, kSplit, kCluster>, 512, Tiles::kSmem, p, sched, grid, stream);
}

template <typename T, int kD, int kDv>
int FwdWideMaxClusters() {
  static int cache[kFwdMaxDevices] = {};
  return FwdMaxClusters(AttentionFwdWideKernel<T, kD, kDv, false, 2>, 512, FwdWideTiles<kD, kDv>::kSmem, cache);
}

// The 192-row kernel's schedule: LaunchFwdTiles's with every tile seeing the
// same keys -- single tiles (no pairs: no causal mask), a split tail where
// the last round would leave SMs idle, clusters of two CTAs where the query
// tiles of a head pair up (an even number) and fill every SM.
template <typename T, int kD, int kDv>
cudaError_t LaunchFwdWide(const AttentionFwdParams& p, cudaStream_t stream) {
  using Tiles = FwdWideTiles<kD, kDv>;
  const AttentionShape& s = p.shape;
  const long long m_tiles = (s.t + Tiles::kBM - 1) / Tiles::kBM, sms = SmCount();
  const long long tiles = m_tiles * s.n * s.b, key_tiles = (s.s + Tiles::kBN - 1) / Tiles::kBN;
  if (tiles > INT32_MAX / 2) return cudaErrorInvalidValue;
  int cl = 1;
  if (m_tiles % 2 == 0 && tiles > sms && 2 * FwdWideMaxClusters<T, kD, kDv>() >= sms) cl = 2;
  unsigned grid;  // single tiles: pairs only balance a causal mask's tiles
  const FwdSchedule sched = FwdPlan(p, m_tiles, key_tiles, Tiles::kBM, kDv, cl, /*uniform=*/true, /*pairs=*/false,
                                    &grid);
  const bool split = sched.split_tiles > 0;
  if (cl == 2)
    return split ? LaunchFwdWideKernel<T, kD, kDv, true, 2>(p, sched, grid, stream)
                 : LaunchFwdWideKernel<T, kD, kDv, false, 2>(p, sched, grid, stream);
  return split ? LaunchFwdWideKernel<T, kD, kDv, true, 1>(p, sched, grid, stream)
               : LaunchFwdWideKernel<T, kD, kDv, false, 1>(p, sched, grid, stream);
}

// The kernel ChooseFwdKernel (attention_plan.cc) picks, among those built
// for head dims kD, kDv.
template <typename T, int kD, int kDv>
cudaError_t LaunchFwdDims(const AttentionFwdParams& p, cudaStream_t stream) {
  const FwdKernel k = ChooseFwdKernel(p.shape, OptionsOf(p.mask, p.scale, p.softcap));
  if constexpr (kD <= 128 && kDv <= 128) {
    if (k.general) return LaunchFwdTiles<T, kD, kDv, 128, true>(p, stream);
    if constexpr ((kD == 128 && kDv == 128) || (kD == 64 && kDv == 64))
      if (k.rows == 192) return LaunchFwdWide<T, kD, kDv>(p, stream);
    return k.key_tile == 128 ? LaunchFwdTiles<T, kD, kDv, 128, false>(p, stream)
                             : LaunchFwdTiles<T, kD, kDv, 176, false>(p, stream);
  } else {
    return k.general ? LaunchFwdTiles<T, kD, kDv, 64, true>(p, stream)
                     : LaunchFwdTiles<T, kD, kDv, 64, false>(p, stream);
  }
}

template <typename T>
cudaError_t LaunchFwdTyped(const AttentionFwdParams& p, cudaStream_t stream) {
  cudaError_t e = cudaErrorInvalidValue;
  DispatchHeadDims(p.shape.h, p.shape.hv, [&](auto d, auto dv) {
    e = LaunchFwdDims<T, decltype(d)::value, decltype(dv)::value>(p, stream);
  });
  return e;
}

}  // namespace attention
}  // namespace jax_dnn
