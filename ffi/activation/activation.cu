// Activation and bias + activation kernels. See activation.h.
//
// Forward and the plain backward are flat: a block covers consecutive 16-byte
// vectors, several a thread; each element is read once and written once, the
// minimum traffic. The bias + activation forward on large inputs takes column
// tiles where a row allows (BiasActFwdColumnKernel), so that a thread's units
// share one bias vector.
// The bias + activation backward is a 2-D kernel: a block covers 32 vectors of
// columns and strides over the rows of its part, so each thread accumulates
// dbias for its columns in registers while it writes dx; the block's eight row
// lanes are combined in a fixed order and written as one row of partials.
#include <algorithm>
#include <cmath>

#include "ffi/activation/activation.h"
#include "ffi/activation/activation_math.cuh"
#include "ffi/common/column_sum.h"
#include "ffi/common/device.cuh"
#include "ffi/common/device_info.h"
#include "ffi/common/fast_div.h"
#include "ffi/common/row_regs.cuh"

namespace jax_dnn {
namespace {

constexpr int kFlatThreads = 256;
// Units (16-byte vectors, or elements on the scalar path) a thread on large
// inputs: a block covers kFlatThreads * kUnits consecutive units, and a
// thread issues the loads of all of its units before it uses any, so that
// enough bytes are in flight to cover the memory latency. One unit a thread
// left bf16 GELU at 71-80% of the copy bandwidth (benchmarks/RESULTS.md); on
// small inputs 4 units a thread leave SMs idle (1024 x 1024 bf16: 128
// blocks, half the speed), so those keep one.
constexpr int kFlatUnits = 4;
constexpr int kFlatMinBlocksPerSm = 8;  // below this many blocks an SM at kFlatUnits, one unit

// Where a unit's bias starts: its flat index split into (row, column) by
// multiplication (fast_div.h), and the row into its param_set when there are
// several. A row is units_per_row.divisor units of V elements.
struct BiasIndex {
  FastDiv units_per_row;
  FastDiv rows_per_set;
  bool grouped;
};

template <typename T, int V>
__device__ __forceinline__ Packed<T, V> LoadUnit(const T* p) {
  if constexpr (sizeof(Packed<T, V>) == 16) {
    const uint4 r = LoadStream16(p);
    return *reinterpret_cast<const Packed<T, V>*>(&r);
  } else {
    return *reinterpret_cast<const Packed<T, V>*>(p);
  }
}

// dy == nullptr: forward (y = act(x [+ b])); otherwise backward without dbias.
template <typename T, int V, Activation kAct, bool kBwd, bool kBias, int kUnits>
__global__ void __launch_bounds__(kFlatThreads)
    ActivationFlatKernel(const T* __restrict__ dy, const T* __restrict__ x,
                         const float* __restrict__ bias, T* __restrict__ out, int64_t units,
                         BiasIndex bi) {
  const int64_t first = int64_t{blockIdx.x} * (kFlatThreads * kUnits) + threadIdx.x;
  Packed<T, V> xs[kUnits], ds[kUnits];
#pragma unroll
  for (int k = 0; k < kUnits; ++k) {
    const int64_t u = first + k * kFlatThreads;
    if (u < units) {
      xs[k] = LoadUnit<T, V>(x + u * V);
      if constexpr (kBwd) ds[k] = LoadUnit<T, V>(dy + u * V);
    }
  }
#pragma unroll
  for (int k = 0; k < kUnits; ++k) {
    const int64_t u = first + k * kFlatThreads;
    if (u >= units) break;
    float v[V], r[V];
#pragma unroll
    for (int i = 0; i < V; ++i) v[i] = ToFloat(xs[k].v[i]);
    if constexpr (kBias) {
      // V divides the width on this path, so a unit never crosses a row.
      const int64_t row = static_cast<int64_t>(bi.units_per_row.Div(u));
      const int64_t row_units = static_cast<int64_t>(bi.units_per_row.divisor);
      const int64_t col = (u - row * row_units) * V;
      const int64_t param_set = bi.grouped ? static_cast<int64_t>(bi.rows_per_set.Div(row)) : 0;
      float b[V];
      LoadVec<float, V>(bias + param_set * row_units * V + col, b);
#pragma unroll
      for (int i = 0; i < V; ++i) v[i] += b[i];
    }
    if constexpr (kBwd) {
#pragma unroll
      for (int i = 0; i < V; ++i) r[i] = ToFloat(ds[k].v[i]) * ActGrad<kAct>(v[i]);
    } else {
#pragma unroll
      for (int i = 0; i < V; ++i) r[i] = Act<kAct>(v[i]);
    }
    StoreVec<T, V>(out + u * V, r);
  }
}

// The bias + activation forward on large inputs, where a thread's units can
// share one column: a block covers `cols` units of columns (a power of two
// dividing the row's units, at most the block) in 256 / cols row lanes, and a
// thread takes kFlatUnits rows of its column, 256 / cols rows apart. It loads
// its bias once, together with its x, instead of once a unit after that
// unit's x has arrived (four dependent L1 round trips a thread, during which
// it has no load in flight: 11% of the bf16 forward's time on the H200).
// Rows of at most 256 units that divide 256 make cols the row: the flat
// kernel's layout. A warp's units are contiguous either way: 32 or more of
// one row (cols >= 32), or whole rows.
struct ColumnTiles {
  int64_t units;      // all of x's
  int64_t stride;     // between a thread's units: row_units << lanes_shift
  uint32_t row_units;
  uint32_t chunks;      // row_units / cols: blocks across a row
  uint32_t cols_shift;  // cols = 1 << cols_shift
};

// ColumnTiles for rows x row_units units, or none where no power of two
// both divides a row and keeps warps whole (e.g. 1000-wide bf16: 125 units).
inline bool MakeColumnTiles(int64_t rows, int64_t row_units, ColumnTiles* t) {
  static_assert(kFlatThreads == 256, "lanes_shift = 8 - cols_shift");
  if (row_units <= 0 || row_units > 0xffffffff) return false;
  const int64_t cols = std::min<int64_t>(row_units & -row_units, kFlatThreads);
  if (cols < 32 && cols != row_units) return false;  // cols divides 256 either way
  t->cols_shift = 0;
  while ((int64_t{1} << t->cols_shift) < cols) ++t->cols_shift;
  // Fewer rows than a band would leave some of every thread's units idle.
  if (rows < (int64_t{kFlatUnits} << (8 - t->cols_shift))) return false;
  t->units = rows * row_units;
  t->stride = row_units << (8 - t->cols_shift);
  t->row_units = static_cast<uint32_t>(row_units);
  t->chunks = static_cast<uint32_t>(row_units / cols);
  return true;
}

// At most 40 registers, 6 blocks an SM, as the flat kernel has (the bf16
// GELU takes 46-48 unbounded; under the bound every activation takes 32-40,
// no spills).
template <typename T, int V, Activation kAct>
__global__ void __launch_bounds__(kFlatThreads, 6)
    BiasActFwdColumnKernel(const T* __restrict__ x, const float* __restrict__ bias,
                           T* __restrict__ out, ColumnTiles t) {
  const uint32_t band = blockIdx.x / t.chunks;
  const uint32_t col = ((blockIdx.x - band * t.chunks) << t.cols_shift) +
                       (threadIdx.x & ((1u << t.cols_shift) - 1));
  const uint32_t lane = threadIdx.x >> t.cols_shift;  // row lane
  // Flat unit indices from host-computed strides: a row index a unit and
  // row * row_units + col in the kernel ran 3% slower (H200, 16384 x 4096
  // bf16: 76.4-76.6 against 73.7-74.6 us).
  const int64_t first = int64_t{band} * kFlatUnits * t.stride + int64_t{lane} * t.row_units + col;
  const int64_t units = t.units, stride = t.stride;
  Packed<T, V> xs[kFlatUnits];
#pragma unroll
  for (int k = 0; k < kFlatUnits; ++k) {
    const int64_t u = first + k * stride;
    if (u < units) xs[k] = LoadUnit<T, V>(x + u * V);
  }
  float b[V];
  LoadVec<float, V>(bias + int64_t{col} * V, b);
#pragma unroll
  for (int k = 0; k < kFlatUnits; ++k) {
    const int64_t u = first + k * stride;
    if (u >= units) break;
    float r[V];
#pragma unroll
    for (int i = 0; i < V; ++i) r[i] = Act<kAct>(ToFloat(xs[k].v[i]) + b[i]);
    StoreVec<T, V>(out + u * V, r);
  }
}

// The bias + activation forward on rows that are not a multiple of 16 bytes
// (one parameter param_set, rows that fill their blocks' threads at least 3/4): a
// block takes kFlatThreads consecutive columns of kScalarTileRows
// consecutive rows, a thread one column, its bias loaded once and its rows'
// loads all issued before any is used (a warp's load reads 32 consecutive
// elements of a row). Why: the flat kernel's scalar path splits every
// element's flat index into row and column (a 64-bit multiply-high) and loads
// its bias after that, which sets its pace: at bf16 16384 x 4097 it takes
// 0.130 ms, this 0.103 (XLA 0.106; H200).
constexpr int kScalarTileRows = 16;

template <typename T, Activation kAct>
__global__ void __launch_bounds__(kFlatThreads)
    BiasActFwdRowsKernel(const T* __restrict__ x, const float* __restrict__ bias,
                         T* __restrict__ out, int64_t rows, int64_t n) {
  const int64_t col = int64_t{blockIdx.x} * kFlatThreads + threadIdx.x;
  if (col >= n) return;
  const float b = bias[col];
  for (int64_t row0 = int64_t{blockIdx.y} * kScalarTileRows; row0 < rows;
       row0 += int64_t{gridDim.y} * kScalarTileRows) {
    const T* xr = x + row0 * n + col;
    T* yr = out + row0 * n + col;
    T v[kScalarTileRows];
#pragma unroll
    for (int r = 0; r < kScalarTileRows; ++r)
      if (row0 + r < rows) v[r] = xr[r * n];
#pragma unroll
    for (int r = 0; r < kScalarTileRows; ++r)
      if (row0 + r < rows) yr[r * n] = FromFloat<T>(Act<kAct>(ToFloat(v[r]) + b));
  }
}

constexpr int kColLanes = kBiasActColLanes;  // threadIdx.x: vectors of columns (activation_plan.h)
constexpr int kRowLanes = kBiasActRowLanes;  // threadIdx.y: rows
// Rows in flight a thread in the bias + activation backward. Two rows, kept
// packed, at 64 registers (4 blocks an SM, as one row takes at 59): 0.95 of
// one row's time for the tanh GELU at 16384 x 4096 fp32 (H200; bf16
// 0.97-1.01). The erf GELU needs more registers for its gradient and would
// spill with two: it keeps the one-row loop (five blocks an SM with one row,
// 48 registers, run 16-18% slower at bf16). On the 16-bit scalar path (a
// column an element: 2 bytes a row and operand) eight rows, unbounded: ~0.82
// of two rows' time at 16384 x 4097 bf16 (H200, bwd); fp32 keeps two (eight
// took ~1.1 of their time).
template <Activation kAct>
constexpr bool kBwdTwoRows = kAct != Activation::kGelu;
template <typename T, int V>
constexpr bool kBwdScalarRows = V == 1 && sizeof(T) == 2;

// A packed unit to fp32 where it is used: 16-byte units through Unpack16,
// whose bf16 widening ptxas may not hoist (row_regs.cuh), so that the rows in
// flight stay packed (bf16 GELU backward: 32-44 bytes of spills at 64
// registers with plain conversions).
template <typename T, int V>
__device__ __forceinline__ void Widen(const Packed<T, V>& u, float (&f)[V]) {
  if constexpr (sizeof(Packed<T, V>) == 16) {
    Unpack16<T>(*reinterpret_cast<const uint4*>(&u), f);
  } else {
#pragma unroll
    for (int i = 0; i < V; ++i) f[i] = ToFloat(u.v[i]);
  }
}

template <typename T, int V, Activation kAct>
__global__ void __launch_bounds__(kColLanes* kRowLanes, kBwdTwoRows<kAct> && !kBwdScalarRows<T, V> ? 4 : 0)
    BiasActBwdKernel(ActivationBwdParams p) {
  const int64_t n = p.width;
  const int64_t col = (int64_t{blockIdx.x} * kColLanes + threadIdx.x) * V;
  const int64_t rows_per_set = p.rows / p.param_sets;
  const int64_t param_set = blockIdx.y / p.parts;
  const int64_t part = blockIdx.y % p.parts;
  const bool in = col < n;
  float acc[V] = {};
  if (in) {
    float b[V];
    LoadVec<float, V>(p.bias + param_set * n + col, b);
    if constexpr (!kBwdTwoRows<kAct> && !kBwdScalarRows<T, V>) {
      for (int64_t local = part * kRowLanes + threadIdx.y; local < rows_per_set;
           local += p.parts * kRowLanes) {
        const int64_t e = (param_set * rows_per_set + local) * n + col;
        float v[V], d[V], r[V];
        LoadVec<T, V>(static_cast<const T*>(p.x) + e, v);
        LoadVec<T, V>(static_cast<const T*>(p.dy) + e, d);
#pragma unroll
        for (int i = 0; i < V; ++i) {
          r[i] = d[i] * ActGrad<kAct>(v[i] + b[i]);
          acc[i] += r[i];
        }
        StoreVec<T, V>(static_cast<T*>(p.dx) + e, r);
      }
    } else {
      // Rows in flight a thread (kBwdRows), kept packed until used.
      constexpr int kBwdRows = kBwdScalarRows<T, V> ? 8 : 2;
      const int64_t step = p.parts * kRowLanes;
      const T* x = static_cast<const T*>(p.x) + param_set * rows_per_set * n + col;
      const T* dy = static_cast<const T*>(p.dy) + param_set * rows_per_set * n + col;
      T* dx = static_cast<T*>(p.dx) + param_set * rows_per_set * n + col;
      for (int64_t local = part * kRowLanes + threadIdx.y; local < rows_per_set;
           local += kBwdRows * step) {
        Packed<T, V> xs[kBwdRows], ds[kBwdRows];
#pragma unroll
        for (int j = 0; j < kBwdRows; ++j) {
          if (local + j * step < rows_per_set) {
            xs[j] = LoadUnit<T, V>(x + (local + j * step) * n);
            ds[j] = LoadUnit<T, V>(dy + (local + j * step) * n);
          }
        }
#pragma unroll
        for (int j = 0; j < kBwdRows; ++j) {
          if (local + j * step >= rows_per_set) break;
          float xf[V], df[V], r[V];
          Widen(xs[j], xf);
          Widen(ds[j], df);
#pragma unroll
          for (int i = 0; i < V; ++i) {
            r[i] = df[i] * ActGrad<kAct>(xf[i] + b[i]);
            acc[i] += r[i];
          }
          StoreVec<T, V>(dx + (local + j * step) * n, r);
        }
      }
    }
  }
  // Combine the row lanes in a fixed order: deterministic.
  __shared__ float share[kRowLanes][kColLanes][V];
#pragma unroll
  for (int i = 0; i < V; ++i) share[threadIdx.y][threadIdx.x][i] = acc[i];
  __syncthreads();
  if (threadIdx.y == 0 && in) {
    float* partial = p.partials + int64_t{blockIdx.y} * n + col;
#pragma unroll
    for (int i = 0; i < V; ++i) {
      float s = 0.f;
      for (int r = 0; r < kRowLanes; ++r) s += share[r][threadIdx.x][i];
      partial[i] = s;
    }
  }
}

template <typename Fn>
cudaError_t DispatchActivation(Activation a, Fn&& fn) {
  switch (a) {
    case Activation::kRelu:
      return fn(std::integral_constant<Activation, Activation::kRelu>{});
    case Activation::kGelu:
      return fn(std::integral_constant<Activation, Activation::kGelu>{});
    case Activation::kGeluTanh:
      return fn(std::integral_constant<Activation, Activation::kGeluTanh>{});
    case Activation::kSilu:
      return fn(std::integral_constant<Activation, Activation::kSilu>{});
    case Activation::kSigmoid:
      return fn(std::integral_constant<Activation, Activation::kSigmoid>{});
    case Activation::kTanh:
      return fn(std::integral_constant<Activation, Activation::kTanh>{});
  }
  return cudaErrorInvalidValue;
}

template <bool kBwd, typename T>
cudaError_t LaunchFlat(Activation a, const void* dy, const void* x, const float* bias, void* out,
                       int64_t rows, int64_t width, int64_t param_sets, bool vec,
                       cudaStream_t stream) {
  constexpr int kVec = 16 / sizeof(T);
  const int v = vec ? kVec : 1;
  const int64_t units = rows * width / v;
  const int64_t wide_blocks = (units + kFlatThreads * kFlatUnits - 1) / (kFlatThreads * kFlatUnits);
  const bool wide = wide_blocks >= int64_t{kFlatMinBlocksPerSm} * SmCount();
  const int64_t blocks = wide ? wide_blocks : (units + kFlatThreads - 1) / kFlatThreads;
  if (blocks > 0x7fffffff) return cudaErrorInvalidValue;  // gridDim.x limit
  BiasIndex bi{};
  if (bias != nullptr) {
    bi.units_per_row = FastDiv(static_cast<uint64_t>(width / v));
    bi.rows_per_set = FastDiv(static_cast<uint64_t>(std::max<int64_t>(1, rows / param_sets)));
    bi.grouped = param_sets > 1;
  }
  const unsigned grid = static_cast<unsigned>(blocks);
  return DispatchActivation(a, [&](auto act) {
    constexpr Activation kAct = decltype(act)::value;
    // The backward with a bias is BiasActBwdKernel (it also sums dbias).
    auto launch = [&](auto vec_tag, auto bias_tag) {
      constexpr int kV = decltype(vec_tag)::value ? kVec : 1;
      constexpr bool kBias = !kBwd && decltype(bias_tag)::value;
      if constexpr (kBias && kV == 1) {
        // See BiasActFwdRowsKernel; where a row's last block would leave
        // over a quarter of the threads idle (narrow rows), the flat kernel.
        const int64_t col_blocks = (width + kFlatThreads - 1) / kFlatThreads;
        if (param_sets == 1 && 4 * width >= 3 * kFlatThreads * col_blocks) {
          const int64_t bands = std::min<int64_t>((rows + kScalarTileRows - 1) / kScalarTileRows, 65535);
          if (col_blocks > 0x7fffffff) return cudaErrorInvalidValue;  // gridDim.x limit
          BiasActFwdRowsKernel<T, kAct>
              <<<dim3(static_cast<unsigned>(col_blocks), static_cast<unsigned>(bands)), kFlatThreads, 0,
                 stream>>>(static_cast<const T*>(x), bias, static_cast<T*>(out), rows, width);
          return cudaGetLastError();
        }
      }
      if constexpr (kBias) {
        // Every unit of a thread in one column (see BiasActFwdColumnKernel).
        ColumnTiles tiles;
        if (wide && param_sets == 1 && MakeColumnTiles(rows, width / kV, &tiles)) {
          const int64_t band_units = kFlatUnits * tiles.stride;  // rows of the row lanes
          const int64_t tile_blocks = (tiles.units + band_units - 1) / band_units * tiles.chunks;
          if (tile_blocks > 0x7fffffff) return cudaErrorInvalidValue;  // gridDim.x limit
          BiasActFwdColumnKernel<T, kV, kAct>
              <<<static_cast<unsigned>(tile_blocks), kFlatThreads, 0, stream>>>(
                  static_cast<const T*>(x), bias, static_cast<T*>(out), tiles);
          return cudaGetLastError();
        }
      }
      auto* kernel = wide ? ActivationFlatKernel<T, kV, kAct, kBwd, kBias, kFlatUnits>
                          : ActivationFlatKernel<T, kV, kAct, kBwd, kBias, 1>;
      kernel<<<grid, kFlatThreads, 0, stream>>>(static_cast<const T*>(dy),
                                                static_cast<const T*>(x), bias,
                                                static_cast<T*>(out), units, bi);
      return cudaGetLastError();
    };
    using Yes = std::true_type;
    using No = std::false_type;
    if (vec) return bias != nullptr ? launch(Yes{}, Yes{}) : launch(Yes{}, No{});
    return bias != nullptr ? launch(No{}, Yes{}) : launch(No{}, No{});
  });
}

// 16-byte vectors are used when every pointer is aligned and, with a bias,
// when the row width keeps vectors inside a row.
template <typename T>
bool CanVectorize(std::initializer_list<const void*> ptrs, const float* bias, int64_t rows,
                  int64_t width) {
  constexpr int kVec = 16 / sizeof(T);
  for (const void* ptr : ptrs)
    if (!IsAligned(ptr, 16)) return false;
  if (bias != nullptr) return width % kVec == 0 && IsAligned(bias, sizeof(float) * kVec);
  return (rows * width) % kVec == 0;
}

}  // namespace

cudaError_t LaunchActivationFwd(const ActivationFwdParams& p, cudaStream_t stream) {
  if (p.rows == 0 || p.width == 0) return cudaSuccess;
  return DispatchDType(p.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    const bool vec = CanVectorize<T>({p.x, p.y}, p.bias, p.rows, p.width);
    return LaunchFlat<false, T>(p.activation, nullptr, p.x, p.bias, p.y, p.rows, p.width,
                                p.param_sets, vec, stream);
  });
}

cudaError_t LaunchActivationBwd(const ActivationBwdParams& p, cudaStream_t stream) {
  if (p.width == 0) return cudaSuccess;
  if (p.rows == 0) {
    if (p.dbias == nullptr) return cudaSuccess;
    return cudaMemsetAsync(p.dbias, 0, p.param_sets * p.width * sizeof(float), stream);
  }
  return DispatchDType(p.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    const bool vec = CanVectorize<T>({p.x, p.dy, p.dx}, p.bias, p.rows, p.width);
    if (p.bias == nullptr) {
      return LaunchFlat<true, T>(p.activation, p.dy, p.x, nullptr, p.dx, p.rows, p.width, 1, vec,
                                 stream);
    }
    if (p.param_sets * p.parts > 65535) return cudaErrorInvalidValue;  // gridDim.y limit
    cudaError_t status = DispatchActivation(p.activation, [&](auto act) {
      constexpr Activation kAct = decltype(act)::value;
      constexpr int kVec = 16 / sizeof(T);
      const int v = vec ? kVec : 1;
      dim3 grid(static_cast<unsigned>((p.width + kColLanes * v - 1) / (kColLanes * v)),
                static_cast<unsigned>(p.param_sets * p.parts));
      dim3 block(kColLanes, kRowLanes);
      if (vec) {
        BiasActBwdKernel<T, kVec, kAct><<<grid, block, 0, stream>>>(p);
      } else {
        BiasActBwdKernel<T, 1, kAct><<<grid, block, 0, stream>>>(p);
      }
      return cudaGetLastError();
    });
    if (status != cudaSuccess) return status;
    ColumnSumParams cs{};
    cs.partials = p.partials;
    cs.out[0] = p.dbias;
    cs.param_sets = p.param_sets;
    cs.parts = p.parts;
    cs.sums = 1;
    cs.width = p.width;
    return LaunchColumnSum(cs, stream);
  });
}

}  // namespace jax_dnn
