// Register-resident rows: the layout of the forward row kernels and of the
// layer/RMS-norm backward.
//
// A team of kTeam threads (a warp or more) owns one row; each thread holds
// kVecs 16-byte vectors of it as raw packed elements (not widened to fp32:
// half the registers for bf16/fp16) and issues all their loads before using
// any. In the forwards outside clusters blocks are not persistent: one team per row,
// max(1, 128 / kTeam) teams a block, and the hardware starts a new block as
// soon as one retires. (The norm backward keeps its blocks, which hold
// partial parameter gradients: ffi/layer_norm/layer_norm_bwd.cu.)
//
// Why: with 8 vectors a thread (128 bytes in flight a thread) the bf16
// softmax at 16384 x 4096 runs at ~100% of a streaming copy's bandwidth
// (H200); with 4 vectors, 89%; a persistent kernel streaming rows through
// shared memory with the bulk copy engine (3 block barriers a row), ~80%.
//
// Rows whose width is not a multiple of the vector take ScalarRow below (the
// same interface with one element a "vector") or, in the forwards, ShiftedRow
// (the aligned vectors that cover the row, its neighbours' elements masked).
//
// The team reduction is shuffles down to lane 0 and a broadcast (every lane
// gets the same bits: merges need not be symmetric), then for teams wider
// than a warp one barrier over the team alone (a named barrier when a block
// holds several teams), with double-buffered slots so one barrier per row
// suffices in a loop; each warp then merges the warps' totals (Reduce).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "ffi/common/device.cuh"
#include "ffi/common/row_team.cuh"

namespace jax_dnn {

// Widens one 16-byte vector of T to fp32.
template <typename T>
__device__ __forceinline__ void Unpack16(uint4 r, float (&f)[16 / sizeof(T)]) {
  const uint32_t w[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if constexpr (sizeof(T) == 4) {
      f[i] = __uint_as_float(w[i]);
    } else if constexpr (std::is_same_v<T, __nv_bfloat16>) {
      // bf16 is the top half of an fp32. volatile: ptxas must redo this cheap
      // widening at each use rather than keep every widened value live across
      // the passes over the row (layer norm: 121 -> fewer registers).
      uint32_t lo, hi;
      asm volatile("shl.b32 %0, %2, 16;\n\tand.b32 %1, %2, 0xffff0000;"
                   : "=r"(lo), "=r"(hi) : "r"(w[i]));
      f[2 * i] = __uint_as_float(lo);
      f[2 * i + 1] = __uint_as_float(hi);
    } else {
      const float2 h = __half22float2(*reinterpret_cast<const __half2*>(&w[i]));
      f[2 * i] = h.x;
      f[2 * i + 1] = h.y;
    }
  }
}

// Narrows 16 / sizeof(T) fp32 values to T and stores them as one 16-byte
// vector, in program order with the other volatile accesses here: a kernel
// that loads its next row early (the norm backward) must not have ptxas hoist
// those loads above this row's stores, which keeps the whole widened row live
// (185-233 registers uncapped in the norm backward).
template <typename T>
__device__ __forceinline__ void StoreOrdered16(T* p, const float (&f)[16 / sizeof(T)]) {
  Packed<T, 16 / sizeof(T)> pack;
#pragma unroll
  for (int i = 0; i < 16 / static_cast<int>(sizeof(T)); ++i) pack.v[i] = FromFloat<T>(f[i]);
  StoreStream16(p, *reinterpret_cast<const uint4*>(&pack));
}

// kMinBlock: the block holds max(kMinBlock, kTeam) threads, so several
// teams share a block when the team is narrow.
template <typename T, int kTeam_, int kVecs_, int kMinBlock = 128>
struct RegRow {
  static constexpr int kTeam = kTeam_;
  static constexpr int kVecs = kVecs_;
  static constexpr int V = 16 / sizeof(T);  // elements per vector
  static constexpr int kBlock = kTeam < kMinBlock ? kMinBlock : kTeam;
  static constexpr int kTeams = kBlock / kTeam;
  static constexpr int kWarps = kTeam / 32;
  static_assert(kTeam % 32 == 0 && kTeam <= 1024 && kTeams <= 8, "team is whole warps");
  static_assert((kWarps & (kWarps - 1)) == 0, "Reduce's tree needs a power-of-two warp count");

  uint4 raw[kVecs];

  __device__ static int Lane() { return threadIdx.x % kTeam; }
  __device__ static int Team() { return threadIdx.x / kTeam; }
  // First column of vector v of this lane. Vectors interleave across the
  // team, so a warp's loads of one v are 512 contiguous bytes.
  __device__ static int64_t Col(int v) { return (int64_t{v} * kTeam + Lane()) * V; }
  // n % V == 0, so a vector is either wholly inside the row or wholly past it.
  __device__ static bool In(int v, int64_t n) { return Col(v) < n; }

  // Vectors past the row are zeros. One base pointer, compile-time offsets
  // per vector (immediates in the loads, not a 64-bit address per vector).
  __device__ void Load(const T* row, int64_t n) {
    const T* base = row + Lane() * V;
#pragma unroll
    for (int v = 0; v < kVecs; ++v) {
      const void* p = base + v * kTeam * V;
      if (!In(v, n)) {
        raw[v] = make_uint4(0, 0, 0, 0);
      } else if constexpr (sizeof(T) == 4) {
        raw[v] = LoadNc16(p);  // see LoadStream16 in device.cuh
      } else {
        raw[v] = LoadStream16(p);
      }
    }
  }
  // The same from a copy of the row (its first n elements) in shared memory,
  // laid out as in global memory: vector v of this lane at [v * kTeam + lane],
  // consecutive lanes on consecutive 16 bytes (no bank conflicts).
  __device__ void LoadShared(const uint4* row, int64_t n) {
#pragma unroll
    for (int v = 0; v < kVecs; ++v)
      raw[v] = In(v, n) ? row[v * kTeam + Lane()] : make_uint4(0, 0, 0, 0);
  }
  __device__ void Get(int v, float (&f)[V]) const { Unpack16<T>(raw[v], f); }

  // Shared slots of the team reduction: [parity][team][warp].
  template <typename State>
  struct Slots {
    State s[2][kTeams][kWarps > 0 ? kWarps : 1];
  };

  // Merges a State (a struct of floats with a static Merge) over the team.
  // Every thread of the team calls it; `parity` alternates between
  // consecutive rows of one team (0 when each team does one row). The order
  // of the merges is fixed, so every thread gets the same bits.
  template <typename State>
  __device__ static State Reduce(State st, Slots<State>& slots, int parity) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) st = State::Merge(st, ShuffleState(st, o, true));
    st = ShuffleState(st, 0, false);
    if constexpr (kWarps >= 4) {
      // Lane w reads warp w's total and the warp merges them as a tree: a
      // thread does one shared load and log2(kWarps) merges, not kWarps of
      // each. With kWarps of each (every thread doing all of them), these
      // reductions and the cluster exchange's merges were ~5 of the 41
      // instructions an element of the 4096 x 131072 bf16 layer-norm backward
      // (16 warps a team); the tree takes it to 0.88 of that time (H200).
      // Under 4 warps the serial form's shorter chain of dependent steps is
      // as cheap.
      if (threadIdx.x % 32 == 0) slots.s[parity][Team()][Lane() / 32] = st;
      TeamSync();
      const int lane = threadIdx.x % 32;
      st = slots.s[parity][Team()][lane < kWarps ? lane : 0];
#pragma unroll
      for (int o = kWarps / 2; o > 0; o >>= 1) st = State::Merge(st, ShuffleState(st, o, true));
      st = ShuffleState(st, 0, false);
    } else if constexpr (kWarps > 1) {
      if (threadIdx.x % 32 == 0) slots.s[parity][Team()][Lane() / 32] = st;
      TeamSync();
      st = slots.s[parity][Team()][0];
#pragma unroll
      for (int w = 1; w < kWarps; ++w) st = State::Merge(st, slots.s[parity][Team()][w]);
    }
    return st;
  }

  // Waits for the team's threads. The barrier ids are compile-time constants:
  // with an id computed at run time ptxas reserves all 16 barriers of the
  // block, and the SM's barrier pool then held only 4 blocks (seen: 23% of
  // warps active at 64-80 registers a thread, where registers allow 6-8).
  __device__ static void TeamSync() {
    static_assert(kTeams <= 4 || kWarps == 1, "at most 4 multi-warp teams a block");
    if constexpr (kTeams == 1) {
      __syncthreads();
    } else {
      BarOfTeam<0>(Team());  // uniform within a team: teams are whole warps
    }
  }
  // Barrier 1 + team, with ids 1..kTeams spelled as constants.
  template <int kId>
  __device__ static void BarOfTeam(int team) {
    if constexpr (kId + 1 < kTeams) {
      if (team != kId) return BarOfTeam<kId + 1>(team);
    }
    Bar<kId + 1>();
  }
  template <int kId>
  __device__ static void Bar() {
    asm volatile("bar.sync %0, %1;" ::"n"(kId), "n"(kTeam) : "memory");
  }
};

// A register-resident row of single elements, for rows whose width is not a
// multiple of the 16-byte vector (their starts are then misaligned, so no
// vector load can serve them). Lane l of the team holds the elements at
// columns l + k * kTeam (k < kElems), raw (a 16-bit element in the low half
// of a 32-bit register), all kElems loads issued before any is used: a
// warp's load instruction reads 32 contiguous elements (64 bytes at 16 bits,
// 128 at fp32), x is read once and y written once, and a thread's columns are
// the same in every row (the norm backward keeps its per-column partial
// parameter gradients across the rows a block visits). It has RegRow's
// interface with vectors of one element (V = 1, kVecs = kElems), so the
// register-row kernels serve these rows unchanged. The alternative, 16-byte
// vectors over each row's aligned interior with a scalar head and tail,
// shifts a thread's columns from row to row, which those partials cannot
// follow.
template <typename T, int kTeam_, int kElems, int kMinBlock = 128>
struct ScalarRow {
  using Layout = RegRow<T, kTeam_, 1, kMinBlock>;  // the team layout and its reduction
  static constexpr int kTeam = kTeam_;
  static constexpr int kVecs = kElems;
  static constexpr int V = 1;
  static constexpr int kBlock = Layout::kBlock;
  static constexpr int kTeams = Layout::kTeams;
  static constexpr int kWarps = Layout::kWarps;

  // Blocks an SM that __launch_bounds__ asks registers for: 1024 threads (64
  // registers a thread) up to 16 elements a thread (no spills), none past
  // that. A thread's loads are single elements (2-4 bytes), so the bytes in
  // flight come from resident threads.
  static constexpr int kMinBlocks = kElems > 16 ? 0 : kBlock >= 1024 ? 1 : 1024 / kBlock;

  T raw[kElems];

  __device__ static int Lane() { return Layout::Lane(); }
  __device__ static int Team() { return Layout::Team(); }
  __device__ static int64_t Col(int v) { return int64_t{v} * kTeam + Lane(); }
  __device__ static bool In(int v, int64_t n) { return Col(v) < n; }

  // Elements past the row are zeros. Evict-first (last-use) loads for the
  // 16-bit types, non-coherent ones for fp32, as RegRow's vectors.
  __device__ void Load(const T* row, int64_t n) {
    const T* base = row + Lane();
#pragma unroll
    for (int v = 0; v < kElems; ++v) {
      if (!In(v, n)) {
        raw[v] = FromFloat<T>(0.f);
      } else if constexpr (sizeof(T) == 4) {
        raw[v] = __ldg(base + v * kTeam);
      } else {
        raw[v] = __ldlu(base + v * kTeam);
      }
    }
  }
  __device__ void Get(int v, float (&f)[1]) const { f[0] = ToFloat(raw[v]); }

  template <typename State>
  using Slots = typename Layout::template Slots<State>;
  template <typename State>
  __device__ static State Reduce(State st, Slots<State>& slots, int parity) {
    return Layout::Reduce(st, slots, parity);
  }
};

// Whether Row is a ShiftedRow (the kernels' element masks and stores).
template <typename Row, typename = void>
struct IsShiftedRow : std::false_type {};
template <typename Row>
struct IsShiftedRow<Row, std::void_t<decltype(Row::kShifted)>> : std::bool_constant<Row::kShifted> {};
template <typename Row>
constexpr bool kIsShiftedRow = IsShiftedRow<Row>::value;

// __launch_bounds__'s blocks an SM for a register-row kernel: ScalarRow's
// and ShiftedRow's kMinBlocks, none asked for RegRow.
template <typename Row>
constexpr int RowMinBlocks() {
  if constexpr (Row::V == 1) {
    return Row::kMinBlocks;
  } else if constexpr (IsShiftedRow<Row>::value) {
    return Row::kMinBlocks;
  } else {
    return 0;
  }
}

// The widest row ScalarRow holds: kMaxTeam threads x kMaxElems elements.
template <int kMaxElems = 32, int kMaxTeam = 512>
constexpr int64_t ScalarRowMaxWidth() {
  return int64_t{kMaxTeam} * kMaxElems;
}

// Calls fn(ScalarRow<T, team, elems, kMinBlock>{}) for the narrowest shape
// that holds `width` (<= ScalarRowMaxWidth<kMaxElems, kMaxTeam>()) elements:
// a warp with 1, 2, 4, ... kStepElems elements a thread, then teams of 64 to
// kMaxTeam threads with kStepElems each, then kMaxTeam threads with 2, 4, ...
// times kStepElems up to kMaxElems (kStepElems bounds a thread's registers
// for the rows that fit a 512-thread team).
template <typename T, int kStepElems, int kMaxElems, int kMinBlock = 128, int kMaxTeam = 512,
          int kTeam = 32, int kElems = 1, typename Fn>
auto DispatchScalarRow(int64_t width, Fn&& fn) {
  using Row = ScalarRow<T, kTeam, kElems, kMinBlock>;
  if constexpr (kTeam == kMaxTeam && kElems == kMaxElems) {
    return fn(Row{});
  } else {
    if (width <= int64_t{kTeam} * kElems) return fn(Row{});
    if constexpr (kElems < kStepElems || kTeam == kMaxTeam) {
      return DispatchScalarRow<T, kStepElems, kMaxElems, kMinBlock, kMaxTeam, kTeam, kElems * 2>(width, fn);
    } else {
      return DispatchScalarRow<T, kStepElems, kMaxElems, kMinBlock, kMaxTeam, kTeam * 2, kElems>(width, fn);
    }
  }
}

// A plain sum as a mergeable State.
struct Sum1 {
  float s;
  __device__ static Sum1 Merge(const Sum1& a, const Sum1& b) { return {a.s + b.s}; }
};

// The widest row the register layout holds: kMaxTeam threads x kMaxVecs
// vectors.
template <typename T, int kMaxVecs = 8, int kMaxTeam = 512>
constexpr int64_t RegRowMaxWidth() {
  return int64_t{kMaxTeam} * kMaxVecs * (16 / sizeof(T));
}

// Calls fn(RegRow<T, team, vecs, kMinBlock>{}) for the narrowest shape whose
// registers hold `width` (<= RegRowMaxWidth<T, kMaxVecs, kMaxTeam>())
// elements: a warp with 1, 2, 4, ... vectors a thread up to kMaxVecs, then
// teams of 64 to kMaxTeam threads with kMaxVecs each. (kTeam, kVecs: the
// shape tried at this step.)
template <typename T, int kMaxVecs = 8, int kMinBlock = 128, int kMaxTeam = 512, int kTeam = 32,
          int kVecs = 1, typename Fn>
auto DispatchRegRow(int64_t width, Fn&& fn) {
  using Row = RegRow<T, kTeam, kVecs, kMinBlock>;
  if constexpr (kTeam == kMaxTeam && kVecs == kMaxVecs) {
    return fn(Row{});
  } else {
    if (width <= int64_t{kTeam} * kVecs * Row::V) return fn(Row{});
    if constexpr (kVecs < kMaxVecs) {
      return DispatchRegRow<T, kMaxVecs, kMinBlock, kMaxTeam, kTeam, kVecs * 2>(width, fn);
    } else {
      return DispatchRegRow<T, kMaxVecs, kMinBlock, kMaxTeam, kTeam * 2, kVecs>(width, fn);
    }
  }
}

// A register-resident row read as the aligned 16-byte vectors that cover it,
// for rows whose width is not a multiple of the vector (the forwards): a row
// starting `off` elements into a vector (off = its address / sizeof(T) mod V)
// is held as the vectors from row - off, in RegRow's layout (vector v of a
// lane is chunk v * kTeam + lane), so a thread has RegRow's bytes in flight
// (16-byte loads) where ScalarRow has one element a register. Element i of
// chunk c is column c * V + i - off; those outside [0, n) belong to the
// neighbouring rows and hold `fill` (Load: 0 for sums, -inf for a max). A
// thread's columns move with the row's offset, so per-column parameters are
// not read as vectors: softmax's forward takes it (no parameters); the
// norms' forwards and the backwards, whose register partials need fixed
// columns, keep ScalarRow. Stores: 16-byte ones for chunks wholly
// in the row, element by element for its first and last chunk (a 16-byte
// store there would write the neighbour row another team owns).
// The row's pointer must be aligned to sizeof(T) and every row's chunks must
// lie in one allocation that starts 16-byte aligned: only a chunk that would
// cross `end` (the last row's last) is loaded element by element.
template <typename T, int kTeam_, int kVecs_, int kMinBlock = 128>
struct ShiftedRow {
  using Layout = RegRow<T, kTeam_, kVecs_, kMinBlock>;
  static constexpr int kTeam = kTeam_;
  static constexpr int kVecs = kVecs_;
  static constexpr int V = Layout::V;
  static constexpr int kBlock = Layout::kBlock;
  static constexpr int kTeams = Layout::kTeams;
  static constexpr int kWarps = Layout::kWarps;
  static constexpr bool kShifted = true;
  // Blocks an SM that __launch_bounds__ asks registers for: one for teams of
  // 256 or more threads, where ptxas otherwise held the norms at 64
  // registers and spilled; none (ptxas's choice) below.
  static constexpr int kMinBlocks = kBlock >= 256 ? 1 : 0;

  uint4 raw[kVecs];
  int col0;  // column of element 0 of this lane's vector 0: Lane() * V - off

  __device__ static int Lane() { return Layout::Lane(); }
  __device__ static int Team() { return Layout::Team(); }
  // Column of element 0 of vector v of this lane (negative in the row's
  // first chunk when off > 0). 32-bit: rows fit the register layout.
  __device__ int Col(int v) const { return col0 + v * kTeam * V; }
  // Vector v holds at least one of the row's elements.
  __device__ bool In(int v, int64_t n) const { return Col(v) < static_cast<int>(n); }
  // Vector v holds elements outside the row (its first or last chunk).
  __device__ bool Edge(int v, int64_t n) const { return Col(v) < 0 || Col(v) + V > static_cast<int>(n); }
  // Element i of vector v is one of the row's.
  __device__ bool Has(int v, int i, int64_t n) const {
    return static_cast<unsigned>(Col(v) + i) < static_cast<unsigned>(n);
  }
  // The number of the row's elements in vector v.
  __device__ int Count(int v, int64_t n) const {
    const int c = Col(v), m = static_cast<int>(n);
    const int hi = c + V < m ? c + V : m;
    const int lo = c > 0 ? c : 0;
    return hi > lo ? hi - lo : 0;
  }

  __device__ static uint4 Load16(const void* p) {
    if constexpr (sizeof(T) == 4) {
      return LoadNc16(p);  // as RegRow
    } else {
      return LoadStream16(p);
    }
  }

  // Loads the row of n elements at `row`; `end` is one past the tensor's last
  // element. Elements outside the row (and vectors past it) are `fill`.
  __device__ void Load(const T* row, int64_t n, const T* end, T fill) {
    col0 = Lane() * V - static_cast<int>((reinterpret_cast<uintptr_t>(row) / sizeof(T)) % V);
    const T* base = row + col0;
    // Columns from the row's start to the tensor's end (capped: only the
    // last row's last vector can pass it).
    const int end_col = end - row < int64_t{1} << 30 ? static_cast<int>(end - row) : 1 << 30;
#pragma unroll
    for (int v = 0; v < kVecs; ++v) {
      const T* p = base + v * kTeam * V;
      Packed<T, V> pk;
      if (!In(v, n)) {
#pragma unroll
        for (int i = 0; i < V; ++i) pk.v[i] = fill;
      } else if (!Edge(v, n)) {
        raw[v] = Load16(p);
        continue;
      } else if (Col(v) + V <= end_col) {
        *reinterpret_cast<uint4*>(&pk) = Load16(p);
#pragma unroll
        for (int i = 0; i < V; ++i)
          if (!Has(v, i, n)) pk.v[i] = fill;
      } else {
#pragma unroll
        for (int i = 0; i < V; ++i) pk.v[i] = Has(v, i, n) ? p[i] : fill;
      }
      raw[v] = *reinterpret_cast<const uint4*>(&pk);
    }
  }
  __device__ void Get(int v, float (&f)[V]) const { Unpack16<T>(raw[v], f); }

  // Stores f as vector v of the row of n elements at `row` (the row's
  // elements of it only).
  __device__ void Store(T* row, int v, const float (&f)[V], int64_t n) const {
    T* p = row + Col(v);
    if (!Edge(v, n)) {
      StoreVec<T, V>(p, f);
      return;
    }
#pragma unroll
    for (int i = 0; i < V; ++i)
      if (Has(v, i, n)) p[i] = FromFloat<T>(f[i]);
  }

  template <typename State>
  using Slots = typename Layout::template Slots<State>;
  template <typename State>
  __device__ static State Reduce(State st, Slots<State>& slots, int parity) {
    return Layout::Reduce(st, slots, parity);
  }
};

// The widest row ShiftedRow holds: its vectors cover the row from the vector
// boundary before it.
template <typename T, int kMaxVecs = 8, int kMaxTeam = 512>
constexpr int64_t ShiftedRowMaxWidth() {
  return RegRowMaxWidth<T, kMaxVecs, kMaxTeam>() - (16 / sizeof(T) - 1);
}

// Calls fn(ShiftedRow<T, team, vecs>{}) for the narrowest RegRow shape that
// holds `width` elements from any offset (DispatchRegRow).
template <typename T, typename Fn>
auto DispatchShiftedRow(int64_t width, Fn&& fn) {
  return DispatchRegRow<T>(width + 16 / sizeof(T) - 1, [&](auto row) {
    using R = decltype(row);
    return fn(ShiftedRow<T, R::kTeam, R::kVecs>{});
  });
}

}  // namespace jax_dnn
