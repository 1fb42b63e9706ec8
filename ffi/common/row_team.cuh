// A "row team": kTeam consecutive threads (a warp up to a whole block) that
// own one row at a time. Blocks hold max(1, kMinBlock / kTeam) teams, so short
// rows still fill 128-thread blocks. Team reductions are warp shuffles, then
// (for teams wider than a warp) one pass through shared memory in a fixed
// order, so results are deterministic.
#pragma once

#include "ffi/common/device.cuh"

namespace jax_dnn {

template <int kTeam_>
struct RowTeam {
  static constexpr int kTeam = kTeam_;
  static constexpr int kMinBlock = 128;
  static constexpr int kTeamsPerBlock = kTeam >= kMinBlock ? 1 : kMinBlock / kTeam;
  static constexpr int kBlock = kTeam * kTeamsPerBlock;
  static constexpr int kWarps = kTeam / 32;
  static_assert(kTeam % 32 == 0 && kTeam <= 1024, "team is whole warps");

  // Shared scratch for team reductions: one slot per warp, two values each.
  struct Scratch {
    float v[kTeamsPerBlock][kWarps > 0 ? kWarps : 1][2];
  };

  __device__ static int Lane() { return threadIdx.x % kTeam; }
  __device__ static int Team() { return threadIdx.x / kTeam; }

  // Sums a and b over the team. Every thread of the block must call it (it
  // contains __syncthreads when kTeam > 32).
  __device__ static void Sum2(float& a, float& b, Scratch& s) {
    a = WarpSum(a);
    b = WarpSum(b);
    if constexpr (kWarps > 1) {
      const int warp = Lane() / 32;
      __syncthreads();  // previous readers of the scratch are done
      if (threadIdx.x % 32 == 0) {
        s.v[Team()][warp][0] = a;
        s.v[Team()][warp][1] = b;
      }
      __syncthreads();
      a = 0.f;
      b = 0.f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) {
        a += s.v[Team()][w][0];
        b += s.v[Team()][w][1];
      }
    }
  }

  __device__ static float Sum(float a, Scratch& s) {
    float b = 0.f;
    Sum2(a, b, s);
    return a;
  }

  __device__ static float Max(float a, Scratch& s) {
    a = WarpMax(a);
    if constexpr (kWarps > 1) {
      const int warp = Lane() / 32;
      __syncthreads();
      if (threadIdx.x % 32 == 0) s.v[Team()][warp][0] = a;
      __syncthreads();
      a = s.v[Team()][0][0];
#pragma unroll
      for (int w = 1; w < kWarps; ++w) a = fmaxf(a, s.v[Team()][w][0]);
    }
    return a;
  }
};

// Calls fn(std::integral_constant<int, kTeam>) for the narrowest team whose
// register cache (kTeam * elems_per_thread) holds `width` elements, or the
// widest team when none does. The widest is 512, not 1024: a 1024-thread
// block is limited to 64 registers a thread, which spills a 32-float cache
// (seen in ptxas -warn-spills), so 1024 threads would cache no more.
template <typename Fn>
auto DispatchTeam(long long width, int elems_per_thread, Fn&& fn) {
  const long long per = elems_per_thread;
  if (width <= 32 * per) return fn(std::integral_constant<int, 32>{});
  if (width <= 64 * per) return fn(std::integral_constant<int, 64>{});
  if (width <= 128 * per) return fn(std::integral_constant<int, 128>{});
  if (width <= 256 * per) return fn(std::integral_constant<int, 256>{});
  return fn(std::integral_constant<int, 512>{});
}

}  // namespace jax_dnn
