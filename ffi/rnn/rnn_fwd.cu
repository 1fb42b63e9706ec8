// The recurrence's forward as one persistent kernel (rnn.h for the math and
// layouts, rnn_plan.h for the sizes). Letters as there; U units a block,
// N = G * U its gate rows, Bp: B padded to 16, Hp: H padded to 64 bytes.
//
// Block j owns hidden units [j U, (j + 1) U) and all G gates of them, so the
// cell math is local. Its weight rows W_hh[g H + j U + u, :] (N x H) stay in
// shared memory for the whole sequence (streamed variant: a padded copy in
// the workspace, read through L2 each step). A step:
//   1. read h_{t-1} [Bp, Hp] (input dtype) from the exchange buffer written
//      the step before (double-buffered, L2-resident) as mma A fragments and
//      form hh = h_{t-1} W_slice^T with mma.sync (fp32 accumulation),
//      batch rows as M (chunks of kRnnChunkRows), split over the 8 warps;
//   2. add b_hh and gx_t and apply the cell in fp32 (c or the GRU's h kept
//      in shared memory across steps); write this block's slice of h_t to
//      the other exchange buffer, and y and the states;
//   3. grid barrier (rnn_common.cuh GridArrive / GridWait): while it waits,
//      the block stores its deferred outputs, prefetches gx two steps ahead
//      into L2 and loads the next step's first gx. The double buffer makes
//      one barrier a step enough: a block writes buffer (s + 1) % 2 at step
//      s only after every block passed the barrier that ended step s - 1,
//      i.e. finished reading it.
// The launch is cooperative (all blocks co-resident, or the launch fails
// instead of hanging): every block waits on every other each step.
// Frozen rows (s >= len) copy their h to the next buffer and write zeros.
//
// Per step and block: Bp * Hp input-dtype elements of h read from L2 (24 KiB
// at B = 16, H = 768 bf16), N * Hp * 2 B mma operands from shared memory.
#include <cooperative_groups.h>

#include "ffi/rnn/rnn.h"
#include "ffi/rnn/rnn_common.cuh"

namespace jax_dnn {
namespace {

namespace cg = cooperative_groups;
using rnn::ChunkMatmul;
using rnn::Mma;
using rnn::RedSum;
using rnn::Sigmoid;
using rnn::StepTime;

// gx_t [G] of row b, unit `unit` at processing step s, from the
// direction's gx (rows of pitch ldg) (zeros where the row is frozen or the
// unit past H: the caller does not use them then).
template <typename T, int G>
__device__ __forceinline__ void GatherGx(const T* gx, int64_t ldg, const RnnFwdParams& p,
                                         bool reverse, const rnn::Lengths& lens, int64_t b,
                                         int64_t unit, int64_t s, float (&xg)[G]) {
  const int64_t len = lens[b];
  const bool live = s < len && unit < p.hidden;
  const T* gxr = gx + (StepTime(s, len, reverse) * p.batch + b) * ldg + unit;
#pragma unroll
  for (int g = 0; g < G; ++g) xg[g] = live ? rnn::LoadNc(gxr + g * p.hidden) : 0.f;
}

template <typename T, int G, int U>
__global__ void __launch_bounds__(kRnnThreads, 1)
    RnnFwdKernel(const RnnFwdParams p, const RnnLayout l, const RnnVariant v) {
  constexpr int N = G * U;
  constexpr int kLdr = N + 4;
  constexpr int S = G == 1 ? 1 : 5;
  extern __shared__ __align__(16) unsigned char smem[];
  cg::grid_group grid = cg::this_grid();
  const int tid = threadIdx.x;
  const int64_t T_ = p.seq_len, B = p.batch, H = p.hidden, GH = G * H;
  const rnn::Direction dir = rnn::ThisDirection(l, p.reverse);
  // Row pitches of the packed tensors (rnn.h): [.., D, H] and [.., D, G H].
  const int64_t DH = p.directions * H, DGH = p.directions * GH;
  const int64_t unit0 = dir.block * U;
  const int64_t ex_size = l.bp * l.hp;
  unsigned char* ws = static_cast<unsigned char*>(p.workspace) + dir.d * l.fwd_workspace_bytes;
  T* ex = reinterpret_cast<T*>(ws);  // [2, Bp, Hp]
  T* w = v.streamed  // [N, fwd_pitch]
             ? reinterpret_cast<T*>(ws + l.fwd_weights_offset) + dir.block * N * l.fwd_pitch
             : reinterpret_cast<T*>(smem);
  float* red = reinterpret_cast<float*>(smem + l.fwd_red_offset);
  float* bias = reinterpret_cast<float*>(smem + l.fwd_bias_offset);    // [N]
  rnn::Lengths lens{nullptr, p.seq_lengths, T_};
  float* state =  // [Bp, U]
      v.global_state ? reinterpret_cast<float*>(ws + l.fwd_state_ws_offset) + dir.block * l.bp * U
                     : reinterpret_cast<float*>(smem + l.fwd_state_offset);
  // The direction's slices.
  const T* gx = static_cast<const T*>(p.gx) + dir.d * GH;
  const T* w_hh = static_cast<const T*>(p.w_hh) + dir.d * GH * H;
  const T* b_hh = static_cast<const T*>(p.b_hh) + dir.d * GH;
  const T* h0 = static_cast<const T*>(p.h0) + dir.d * H;
  const T* c0 = static_cast<const T*>(p.c0) + dir.d * H;
  T* y = static_cast<T*>(p.y) + dir.d * H;
  T* h_n = static_cast<T*>(p.h_n) + dir.d * H;
  T* c_n = static_cast<T*>(p.c_n) + dir.d * H;
  float* states = p.states + dir.d * H;
  const bool relu = p.kind == RnnKind::kRnnRelu;

  lens.Load(B, v.global_state ? nullptr : reinterpret_cast<int*>(smem + l.fwd_lens_offset));
  // Weight slice, bias, initial state, exchange buffer 0 (h0) and the zero
  // padding of both buffers (rows >= B by each block for its units, columns
  // [H, Hp) by block 0; nothing writes them later).
  for (int64_t i = tid; i < N * l.fwd_pitch; i += kRnnThreads) {
    const int64_t r = i / l.fwd_pitch, k = i % l.fwd_pitch;
    const int64_t unit = unit0 + r % U;
    w[i] = unit < H && k < H ? w_hh[(r / U * H + unit) * H + k] : FromFloat<T>(0.f);
  }
  for (int n = tid; n < N; n += kRnnThreads) {
    const int64_t unit = unit0 + n % U;
    bias[n] = unit < H ? ToFloat(b_hh[n / U * H + unit]) : 0.f;
  }
  for (int64_t i = tid; i < l.bp * U; i += kRnnThreads) {
    const int64_t b = i / U, unit = unit0 + i % U;
    if (unit >= H) continue;
    const bool row = b < B;
    ex[b * l.hp + unit] = row ? h0[b * DH + unit] : FromFloat<T>(0.f);
    if (!row) ex[ex_size + b * l.hp + unit] = FromFloat<T>(0.f);
    float s0 = 0.f;
    if (row && G == 4) s0 = ToFloat(c0[b * DH + unit]);
    if (row && G == 3) s0 = ToFloat(h0[b * DH + unit]);
    state[i] = s0;
  }
  if (dir.block == 0) {
    const int64_t pad = l.hp - H;
    for (int64_t i = tid; i < 2 * l.bp * pad; i += kRnnThreads)
      ex[i / pad * l.hp + H + i % pad] = FromFloat<T>(0.f);
  }
  unsigned long long* arrived = reinterpret_cast<unsigned long long*>(ws + l.fwd_barrier_offset);
  if (dir.block == 0 && tid == 0) *arrived = 0;
  grid.sync();  // also orders the streamed variant's global weight copy

  // gx of processing step s into L2 (two steps ahead of its use).
  auto prefetch = [&](int64_t s) {
    if (s >= T_) return;
    for (int64_t i = tid; i < B * G; i += kRnnThreads) {
      const int64_t b = i / G, len = lens[b];
      if (s < len)
        rnn::PrefetchL2(gx + (StepTime(s, len, dir.reverse) * B + b) * DGH + i % G * H + unit0);
    }
  };
  // gx of the thread's first (row, unit) of a chunk, loaded ahead (for the
  // first chunk, during the barrier before its step; for others, before the
  // chunk's matmul): one pair a thread at B * U <= 256 (e.g. B = 16, U = 8).
  const int64_t rows0 = B < kRnnChunkRows ? B : kRnnChunkRows;
  float xg_first[G];
  if (tid < rows0 * U)
    GatherGx<T, G>(gx, DGH, p, dir.reverse, lens, tid / U, unit0 + tid % U, 0, xg_first);
  prefetch(1);
  // The outputs of the thread's first (row, unit) of the last chunk, stored
  // after the block's arrival at the step's barrier.
  T* y_late = nullptr;
  T y_late_v;
  float* st_late = nullptr;
  float st_late_v[S];

  for (int64_t s = 0; s < T_; ++s) {
    const T* cur = ex + (s & 1) * ex_size;
    T* nxt = ex + ((s + 1) & 1) * ex_size;
    for (int64_t m0 = 0; m0 < l.bp; m0 += kRnnChunkRows) {
      const int64_t chunk = l.bp - m0 < kRnnChunkRows ? l.bp - m0 : kRnnChunkRows;
      const int mtiles = static_cast<int>(chunk / 16);
      const int64_t rows = B - m0 < kRnnChunkRows ? B - m0 : kRnnChunkRows;
      if (m0 > 0 && tid < rows * U)
        GatherGx<T, G>(gx, DGH, p, dir.reverse, lens, m0 + tid / U, unit0 + tid % U, s, xg_first);
      ChunkMatmul<T, N / 8>(cur + m0 * l.hp, l.hp, mtiles, w, l.fwd_pitch,
                            l.hp / rnn::PairElems<T>(), red, kLdr);
      __syncthreads();
      for (int64_t i = tid; i < rows * U; i += kRnnThreads) {
        const int rl = static_cast<int>(i / U), u = static_cast<int>(i % U);
        const int64_t b = m0 + rl, unit = unit0 + u;
        if (unit >= H) continue;
        const int64_t len = lens[b];
        float out[S];  // the states slots of (t, b, unit)
        T hv;          // h_t, y's value and the exchange's
        int64_t t;
        if (s >= len) {  // frozen: zeros at t = s, h carried to the next buffer
          t = s;
#pragma unroll
          for (int k = 0; k < S; ++k) out[k] = 0.f;
          nxt[b * l.hp + unit] = __ldcg(cur + b * l.hp + unit);
          hv = FromFloat<T>(0.f);
        } else {
          t = StepTime(s, len, dir.reverse);
          float hh[G], xg[G];
          if (i == tid) {
#pragma unroll
            for (int g = 0; g < G; ++g) xg[g] = xg_first[g];
          } else {
            GatherGx<T, G>(gx, DGH, p, dir.reverse, lens, b, unit, s, xg);
          }
#pragma unroll
          for (int g = 0; g < G; ++g)
            hh[g] = RedSum(red, kLdr, mtiles, rl, g * U + u) + bias[g * U + u];
          float& carry = state[b * U + u];
          float h;
          if constexpr (G == 4) {
            const float ig = Sigmoid(xg[0] + hh[0]), fg = Sigmoid(xg[1] + hh[1]);
            const float gg = rnn::Tanh(xg[2] + hh[2]), og = Sigmoid(xg[3] + hh[3]);
            const float c = fg * carry + ig * gg;
            carry = c;
            h = og * rnn::Tanh(c);
            out[0] = ig;
            out[1] = fg;
            out[2] = gg;
            out[3] = og;
            out[4] = c;
          } else if constexpr (G == 3) {
            const float r = Sigmoid(xg[0] + hh[0]), z = Sigmoid(xg[1] + hh[1]);
            const float n = rnn::Tanh(xg[2] + r * hh[2]);
            h = (1.f - z) * n + z * carry;
            carry = h;
            out[0] = r;
            out[1] = z;
            out[2] = n;
            out[3] = hh[2];
            out[4] = h;
          } else {
            const float a = xg[0] + hh[0];
            h = relu ? Relu(a) : rnn::Tanh(a);
            out[0] = h;
          }
          hv = FromFloat<T>(h);
          nxt[b * l.hp + unit] = hv;
        }
        T* yp = y + (t * B + b) * DH + unit;
        float* st = states + (t * B + b) * S * DH + unit;
        if (i == tid) {  // stored after the arrival (an earlier chunk's now)
          if (y_late != nullptr) {
            *y_late = y_late_v;
#pragma unroll
            for (int k = 0; k < S; ++k) st_late[k * DH] = st_late_v[k];
          }
          y_late = yp;
          y_late_v = hv;
          st_late = st;
#pragma unroll
          for (int k = 0; k < S; ++k) st_late_v[k] = out[k];
        } else {
          *yp = hv;
#pragma unroll
          for (int k = 0; k < S; ++k) st[k * DH] = out[k];
        }
      }
      __syncthreads();  // red is rewritten by the next chunk
    }
    rnn::GridArrive(arrived);
    if (y_late != nullptr) {
      *y_late = y_late_v;
#pragma unroll
      for (int k = 0; k < S; ++k) st_late[k * DH] = st_late_v[k];
      y_late = nullptr;
    }
    prefetch(s + 2);
    if (s + 1 < T_ && tid < rows0 * U)
      GatherGx<T, G>(gx, DGH, p, dir.reverse, lens, tid / U, unit0 + tid % U, s + 1, xg_first);
    rnn::GridWait(arrived, static_cast<unsigned long long>(s + 1) * l.blocks);
  }

  const T* last = ex + (T_ & 1) * ex_size;
  for (int64_t i = tid; i < B * U; i += kRnnThreads) {
    const int64_t b = i / U, unit = unit0 + i % U;
    if (unit >= H) continue;
    h_n[b * DH + unit] = __ldcg(last + b * l.hp + unit);
    if (G == 4) c_n[b * DH + unit] = FromFloat<T>(state[i]);
  }
}

template <typename T, int G, int U>
struct KernelOf {
  static auto Get() { return RnnFwdKernel<T, G, U>; }
};

}  // namespace

cudaError_t LaunchRnnFwd(const RnnFwdParams& p, cudaStream_t stream) {
  const RnnVariant v = RnnVariantById(p.variant);
  if (v.units == 0) return cudaErrorInvalidValue;
  const RnnLayout l = RnnLayoutFor(p.kind, p.dtype, p.batch, p.hidden, v);
  return rnn::LaunchCooperative<KernelOf>(p, l, v, l.fwd_smem_bytes, stream);
}

}  // namespace jax_dnn
