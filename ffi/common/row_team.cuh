// A "row team": kTeam consecutive threads (a warp up to a whole block) that
// own one row at a time. Blocks hold max(1, kMinBlock / kTeam) teams, so short
// rows still fill 128-thread blocks. Team reductions are warp shuffles, then
// (for teams wider than a warp) one pass through shared memory in a fixed
// order, so results are deterministic.
#pragma once

#include <cmath>

#include "ffi/common/device.cuh"

namespace jax_dnn {

// Shuffles every float of a State (a struct of floats) across the warp:
// down by `arg` lanes, or from lane `arg`.
template <typename State>
__device__ __forceinline__ State ShuffleState(const State& st, int arg, bool down) {
  constexpr int kN = sizeof(State) / sizeof(float);
  State out;
  const float* f = reinterpret_cast<const float*>(&st);
  float* g = reinterpret_cast<float*>(&out);
#pragma unroll
  for (int i = 0; i < kN; ++i)
    g[i] = down ? __shfl_down_sync(0xffffffffu, f[i], arg) : __shfl_sync(0xffffffffu, f[i], arg);
  return out;
}

// Blocks for a non-persistent row kernel with `teams_per_block` rows a
// block, capped (the kernels stride over the rest).
inline unsigned RowGrid(int teams_per_block, int64_t rows) {
  const int64_t blocks = (rows + teams_per_block - 1) / teams_per_block;
  return static_cast<unsigned>(blocks < (int64_t{1} << 30) ? blocks : (int64_t{1} << 30));
}

template <int kTeam_>
struct RowTeam {
  static constexpr int kTeam = kTeam_;
  static constexpr int kMinBlock = 128;
  static constexpr int kTeamsPerBlock = kTeam >= kMinBlock ? 1 : kMinBlock / kTeam;
  static constexpr int kBlock = kTeam * kTeamsPerBlock;
  static constexpr int kWarps = kTeam / 32;
  static_assert(kTeam % 32 == 0 && kTeam <= 1024, "team is whole warps");

  // Shared scratch for team reductions: one slot per warp, up to kMaxState
  // floats each.
  static constexpr int kMaxState = 6;
  struct Scratch {
    float v[kTeamsPerBlock][kWarps > 0 ? kWarps : 1][kMaxState];
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

  // Reduces a mergeable State (a struct of floats with a static
  // `State Merge(const State&, const State&)`) over the team. Lanes merge down
  // to lane 0 and broadcast, then warps merge in index order, so every thread
  // gets the same bits and the result does not depend on scheduling. Every
  // thread of the block must call it.
  template <typename State>
  __device__ static State Reduce(State st, Scratch& s) {
    constexpr int kN = sizeof(State) / sizeof(float);
    static_assert(sizeof(State) % sizeof(float) == 0 && kN <= kMaxState, "");
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) st = State::Merge(st, ShuffleState(st, o, /*down=*/true));
    st = ShuffleState(st, 0, /*down=*/false);
    if constexpr (kWarps > 1) {
      const int warp = Lane() / 32;
      __syncthreads();  // previous readers of the scratch are done
      if (threadIdx.x % 32 == 0) {
        const float* f = reinterpret_cast<const float*>(&st);
#pragma unroll
        for (int i = 0; i < kN; ++i) s.v[Team()][warp][i] = f[i];
      }
      __syncthreads();
      st = Load<State>(s.v[Team()][0]);
#pragma unroll
      for (int w = 1; w < kWarps; ++w) st = State::Merge(st, Load<State>(s.v[Team()][w]));
    }
    return st;
  }

  template <typename State>
  __device__ static State Load(const float* f) {
    State out;
    float* g = reinterpret_cast<float*>(&out);
#pragma unroll
    for (int i = 0; i < static_cast<int>(sizeof(State) / sizeof(float)); ++i) g[i] = f[i];
    return out;
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
      for (int w = 1; w < kWarps; ++w) a = MaxNan(a, s.v[Team()][w][0]);
    }
    return a;
  }
};

// Count, mean and sum of squared deviations of a set of values; merges
// exactly (Chan et al.), so the variance never suffers E[x^2] - E[x]^2
// cancellation. Empty sets (n = 0) merge as the identity.
struct MeanM2 {
  float n, mean, m2;
  // The weight b.n / n uses the hardware reciprocal (__frcp_rn, a few
  // instructions): an IEEE division is a subroutine, and a row takes ~17
  // merges, which made division the cost of the whole layer norm (measured).
  __device__ static MeanM2 Merge(const MeanM2& a, const MeanM2& b) {
    const float n = a.n + b.n;
    if (n == 0.f) return a;
    const float delta = b.mean - a.mean;
    const float wb = b.n * __frcp_rn(n);
    return {n, a.mean + delta * wb, a.m2 + b.m2 + delta * delta * a.n * wb};
  }
};

// Online softmax statistics: running max m and sum of exp(x - m).
struct MaxSum {
  float m, s;
  __device__ static float Rescale(float from, float to) {
    return from == -INFINITY ? 0.f : FastExp2((from - to) * 1.4426950408889634f);
  }
  __device__ static MaxSum Merge(const MaxSum& a, const MaxSum& b) {
    const float m = MaxNan(a.m, b.m);
    return {m, a.s * Rescale(a.m, m) + b.s * Rescale(b.m, m)};
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
