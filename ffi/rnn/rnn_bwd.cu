// The recurrence's backward as one persistent kernel (rnn.h for the math and
// layouts, rnn_plan.h for the sizes). Letters as there; U units a block,
// Bp: B padded to 16, GHp: G H padded to 64 bytes. Steps run in reverse
// processing order.
//
// Block j owns the hidden units [j U, (j + 1) U), as in the forward, and
// holds the columns W_hh[:, j U + u] (G H x U, stored [U, GHp] with G H
// contiguous: the mma B operand) in shared memory (streamed variant: a
// padded copy in the workspace). Per row and unit it keeps dh (the
// recurrent gradient reaching h_t) and, LSTM, dc, or, GRU, u * dh (the
// direct path to h_{t-1}) in fp32 shared memory. A step s:
//   1. cell: dh += dy_t; from the saved states (and c_{t-1} / h_{t-1}: the
//      states of the previous time, or c0 / h0 at the sequence's first
//      step) form the gate gradients of its units; write dgx (and the
//      GRU's dgh_n) and publish dgh = the gradient w.r.t. hh, rounded to the
//      input dtype as the matmul's operand, to the exchange buffer [Bp, GHp];
//   2. grid barrier (rnn_common.cuh GridArrive / GridWait): while it waits,
//      the block stores its deferred dgx, prefetches dy and the states two
//      steps ahead into L2 and loads the next step's first cell inputs;
//   3. dh_{t-1} = dgh_t W_hh[:, its units] (+ u dh for the GRU) with
//      mma.sync over K = G H, for the rows active at this step.
// One barrier a step: the exchange buffer is double-buffered (as in the
// forward), and step 1 touches only the block's own rows of shared memory.
// Rows not active at a step (s >= len) publish zeros and keep dh / dc.
#include <cooperative_groups.h>

#include "ffi/rnn/rnn.h"
#include "ffi/rnn/rnn_common.cuh"

namespace jax_dnn {
namespace {

namespace cg = cooperative_groups;
using rnn::ChunkMatmul;
using rnn::Mma;
using rnn::RedSum;
using rnn::StepTime;

// What the cell's backward reads of row b, unit `unit` at processing step
// s: dy_t, the states at t, and c_{t-1} (LSTM) or h_{t-1} (GRU).
template <int G>
struct BwdCellIn {
  float dy;
  float st[G == 1 ? 1 : 5];
  float prev;
};

// A direction's slices of the inputs the cell's backward reads (rnn.h's
// packed layout: rows of pitch DH = D H).
template <typename T>
struct BwdInputs {
  const T* dy;         // [T, B, DH]
  const float* states; // [T, B, S, DH]
  const T* init;       // c0 (LSTM) or h0 (GRU) [B, DH]
  int64_t dh;          // DH
  bool reverse;
};

// Loads BwdCellIn where the row is active at s and the unit below H (the
// caller skips the others before using it).
template <typename T, int G>
__device__ __forceinline__ void LoadBwdCellIn(const BwdInputs<T>& x, const RnnBwdParams& p,
                                              const rnn::Lengths& lens, int64_t b, int64_t unit,
                                              int64_t s, BwdCellIn<G>& in) {
  constexpr int S = G == 1 ? 1 : 5;
  const int64_t B = p.batch, H = p.hidden, DH = x.dh;
  const int64_t len = lens[b];
  if (s < 0 || s >= len || unit >= H) return;
  const int64_t t = StepTime(s, len, x.reverse);
  in.dy = rnn::LoadNc(x.dy + (t * B + b) * DH + unit);
  const float* st = x.states + (t * B + b) * S * DH + unit;
#pragma unroll
  for (int k = 0; k < S; ++k) in.st[k] = rnn::LoadNc(st + k * DH);
  if constexpr (G != 1) {
    const bool first = x.reverse ? t == len - 1 : t == 0;
    const int64_t tprev = x.reverse ? t + 1 : t - 1;
    in.prev = first ? rnn::LoadNc(x.init + b * DH + unit)
                    : rnn::LoadNc(x.states + ((tprev * B + b) * S + 4) * DH + unit);
  }
}

template <typename T, int G, int U>
__global__ void __launch_bounds__(kRnnThreads, 1)
    RnnBwdKernel(const RnnBwdParams p, const RnnLayout l, const RnnVariant v) {
  constexpr int kLdr = U + 4;
  constexpr int S = G == 1 ? 1 : 5;
  extern __shared__ __align__(16) unsigned char smem[];
  cg::grid_group grid = cg::this_grid();
  const int tid = threadIdx.x;
  const int64_t T_ = p.seq_len, B = p.batch, H = p.hidden, GH = G * H;
  const rnn::Direction dir = rnn::ThisDirection(l, p.reverse);
  // Row pitches of the packed tensors (rnn.h): [.., D, H] and [.., D, G H].
  const int64_t DH = p.directions * H, DGH = p.directions * GH;
  const int64_t unit0 = dir.block * U;
  const int64_t ex_size = l.bp * l.ghp;
  unsigned char* ws = static_cast<unsigned char*>(p.workspace) + dir.d * l.bwd_workspace_bytes;
  T* ex = reinterpret_cast<T*>(ws);  // [2, Bp, GHp]
  T* w = v.streamed  // [U, bwd_pitch]
             ? reinterpret_cast<T*>(ws + l.bwd_weights_offset) + dir.block * U * l.bwd_pitch
             : reinterpret_cast<T*>(smem);
  float* red = reinterpret_cast<float*>(smem + l.bwd_red_offset);
  rnn::Lengths lens{nullptr, p.seq_lengths, T_};
  float* dh =  // [Bp, U]
      v.global_state
          ? reinterpret_cast<float*>(ws + l.bwd_state_ws_offset) + dir.block * 2 * l.bp * U
                     : reinterpret_cast<float*>(smem + l.bwd_state_offset);
  float* aux = dh + l.bp * U;  // [Bp, U]: dc (LSTM), u * dh (GRU)
  // The direction's slices.
  const T* w_hh = static_cast<const T*>(p.w_hh) + dir.d * GH * H;
  const T* dy = static_cast<const T*>(p.dy) + dir.d * H;
  const float* states = p.states + dir.d * H;
  const BwdInputs<T> cell_in{dy, states,
                             static_cast<const T*>(G == 4 ? p.c0 : p.h0) + dir.d * H, DH,
                             dir.reverse};
  const T* dh_n = static_cast<const T*>(p.dh_n) + dir.d * H;
  const T* dc_n = static_cast<const T*>(p.dc_n) + dir.d * H;
  float* dgx_out = p.dgx + dir.d * GH;
  float* dgh_n = p.dgh_n + dir.d * H;
  float* dh0 = p.dh0 + dir.d * H;
  float* dc0 = p.dc0 + dir.d * H;
  const bool relu = p.kind == RnnKind::kRnnRelu;

  lens.Load(B, v.global_state ? nullptr : reinterpret_cast<int*>(smem + l.bwd_lens_offset));
  // Weight columns (read along G H: the loads of a warp cover U adjacent
  // units of a row), initial dh / dc, zero padding of the exchange buffers
  // (rows >= B by each block for its columns, columns [G H, GHp) by block 0).
  for (int64_t i = tid; i < U * l.bwd_pitch; i += kRnnThreads) {
    const int64_t n = i / U, u = i % U, unit = unit0 + u;
    w[u * l.bwd_pitch + n] = unit < H && n < GH ? w_hh[n * H + unit] : FromFloat<T>(0.f);
  }
  for (int64_t i = tid; i < l.bp * U; i += kRnnThreads) {
    const int64_t b = i / U, unit = unit0 + i % U;
    const bool live = b < B && unit < H;
    dh[i] = live ? ToFloat(dh_n[b * DH + unit]) : 0.f;
    aux[i] = live && G == 4 ? ToFloat(dc_n[b * DH + unit]) : 0.f;
    if (b >= B && unit < H) {
      for (int g = 0; g < G; ++g) {
        ex[b * l.ghp + g * H + unit] = FromFloat<T>(0.f);
        ex[ex_size + b * l.ghp + g * H + unit] = FromFloat<T>(0.f);
      }
    }
  }
  if (dir.block == 0) {
    const int64_t pad = l.ghp - GH;
    for (int64_t i = tid; i < 2 * l.bp * pad; i += kRnnThreads)
      ex[i / pad * l.ghp + GH + i % pad] = FromFloat<T>(0.f);
  }
  unsigned long long* arrived = reinterpret_cast<unsigned long long*>(ws + l.bwd_barrier_offset);
  if (dir.block == 0 && tid == 0) *arrived = 0;
  grid.sync();  // also orders the streamed variant's global weight copy

  // dy and the states rows of processing step s into L2 (two steps ahead).
  auto prefetch = [&](int64_t s) {
    if (s < 0) return;
    for (int64_t i = tid; i < B * (S + 1); i += kRnnThreads) {
      const int64_t b = i / (S + 1), k = i % (S + 1), len = lens[b];
      if (s >= len) continue;
      const int64_t t1 = StepTime(s, len, dir.reverse);
      if (k == S)
        rnn::PrefetchL2(dy + (t1 * B + b) * DH + unit0);
      else
        rnn::PrefetchL2(states + ((t1 * B + b) * S + k) * DH + unit0);
    }
  };
  // The cell inputs of the thread's first (row, unit) of the next step,
  // loaded during the barrier before it (one pair a thread at B * U <= 256);
  // further pairs load in the cell loop.
  const bool has_first = tid < B * U;
  BwdCellIn<G> in_first;
  if (has_first) LoadBwdCellIn<T, G>(cell_in, p, lens, tid / U, unit0 + tid % U, T_ - 1, in_first);
  prefetch(T_ - 2);
  // dgx (and the GRU's dgh_n) of the thread's first (row, unit), stored
  // after the block's arrival at the step's barrier.
  float* dgx_late = nullptr;
  float dgx_late_v[G];
  float dghn_late_v = 0.f;
  int64_t dghn_late_i = 0;

  for (int64_t sp = 0; sp < T_; ++sp) {
    const int64_t s = T_ - 1 - sp;
    T* buf = ex + (sp & 1) * ex_size;

    // 1. The cell's gradients for the block's units.
    for (int64_t i = tid; i < B * U; i += kRnnThreads) {
      const int64_t b = i / U, unit = unit0 + i % U;
      if (unit >= H) continue;
      const int64_t len = lens[b];
      if (s >= len) {  // padded step: no gradient, nothing to pass back
        float* dgx = dgx_out + (s * B + b) * DGH + unit;
#pragma unroll
        for (int g = 0; g < G; ++g) {
          dgx[g * H] = 0.f;
          buf[b * l.ghp + g * H + unit] = FromFloat<T>(0.f);
        }
        if (G == 3) dgh_n[(s * B + b) * DH + unit] = 0.f;
        if (i == tid) dgx_late = nullptr;
        continue;
      }
      const int64_t t = StepTime(s, len, dir.reverse);
      BwdCellIn<G> in;
      if (i == tid)
        in = in_first;
      else
        LoadBwdCellIn<T, G>(cell_in, p, lens, b, unit, s, in);
      const float* st = in.st;
      const float d = dh[i] + in.dy;
      float dz[G], dgh[G];
      if constexpr (G == 4) {
        const float ig = st[0], fg = st[1], gg = st[2], og = st[3], c = st[4];
        const float cprev = in.prev;
        const float tc = rnn::Tanh(c);
        const float dc = aux[i] + d * og * (1.f - tc * tc);
        dz[0] = dc * gg * ig * (1.f - ig);
        dz[1] = dc * cprev * fg * (1.f - fg);
        dz[2] = dc * ig * (1.f - gg * gg);
        dz[3] = d * tc * og * (1.f - og);
        aux[i] = dc * fg;
#pragma unroll
        for (int g = 0; g < 4; ++g) dgh[g] = dz[g];
      } else if constexpr (G == 3) {
        const float r = st[0], z = st[1], n = st[2], hhn = st[3];
        const float hprev = in.prev;
        const float dn = d * (1.f - z) * (1.f - n * n);  // w.r.t. n's pre-activation
        dz[0] = dn * hhn * r * (1.f - r);
        dz[1] = d * (hprev - n) * z * (1.f - z);
        dz[2] = dn;
        dgh[0] = dz[0];
        dgh[1] = dz[1];
        dgh[2] = dn * r;
        aux[i] = d * z;
      } else {
        const float h = st[0];
        // relu: jax.nn.relu's gradient, d where z > 0 (there h > 0), else 0
        // (a NaN z too).
        dz[0] = relu ? (h > 0.f ? d : 0.f) : d * (1.f - h * h);
        dgh[0] = dz[0];
      }
#pragma unroll
      for (int g = 0; g < G; ++g) buf[b * l.ghp + g * H + unit] = FromFloat<T>(dgh[g]);
      float* dgx = dgx_out + (t * B + b) * DGH + unit;
      if (i == tid) {  // stored after the arrival
        dgx_late = dgx;
#pragma unroll
        for (int g = 0; g < G; ++g) dgx_late_v[g] = dz[g];
        dghn_late_v = dgh[G - 1];
        dghn_late_i = (t * B + b) * DH + unit;
      } else {
#pragma unroll
        for (int g = 0; g < G; ++g) dgx[g * H] = dz[g];
        if (G == 3) dgh_n[(t * B + b) * DH + unit] = dgh[2];
      }
    }
    __syncthreads();
    rnn::GridArrive(arrived);
    if (dgx_late != nullptr) {
#pragma unroll
      for (int g = 0; g < G; ++g) dgx_late[g * H] = dgx_late_v[g];
      if (G == 3) dgh_n[dghn_late_i] = dghn_late_v;
      dgx_late = nullptr;
    }
    prefetch(s - 2);
    if (has_first && s > 0)
      LoadBwdCellIn<T, G>(cell_in, p, lens, tid / U, unit0 + tid % U, s - 1, in_first);
    rnn::GridWait(arrived, static_cast<unsigned long long>(sp + 1) * l.blocks);

    // 2. dh_{t-1} = dgh_t W_hh[:, units] for the rows active at this step.
    for (int64_t m0 = 0; m0 < l.bp; m0 += kRnnChunkRows) {
      const int64_t chunk = l.bp - m0 < kRnnChunkRows ? l.bp - m0 : kRnnChunkRows;
      const int mtiles = static_cast<int>(chunk / 16);
      ChunkMatmul<T, U / 8>(buf + m0 * l.ghp, l.ghp, mtiles, w, l.bwd_pitch,
                            l.ghp / rnn::PairElems<T>(), red, kLdr);
      __syncthreads();
      const int64_t rows = B - m0 < kRnnChunkRows ? B - m0 : kRnnChunkRows;
      for (int64_t i = tid; i < rows * U; i += kRnnThreads) {
        const int rl = static_cast<int>(i / U), u = static_cast<int>(i % U);
        const int64_t b = m0 + rl;
        if (unit0 + u >= H || s >= lens[b]) continue;
        const float sum = RedSum(red, kLdr, mtiles, rl, u);
        dh[b * U + u] = G == 3 ? sum + aux[b * U + u] : sum;
      }
      __syncthreads();  // red is rewritten by the next chunk; dh is read by step 1
    }
  }

  for (int64_t i = tid; i < B * U; i += kRnnThreads) {
    const int64_t b = i / U, unit = unit0 + i % U;
    if (unit >= H) continue;
    dh0[b * DH + unit] = dh[i];
    if (G == 4) dc0[b * DH + unit] = aux[i];
  }
}

template <typename T, int G, int U>
struct KernelOf {
  static auto Get() { return RnnBwdKernel<T, G, U>; }
};

}  // namespace

cudaError_t LaunchRnnBwd(const RnnBwdParams& p, cudaStream_t stream) {
  const RnnVariant v = RnnVariantById(p.variant);
  if (v.units == 0) return cudaErrorInvalidValue;
  const RnnLayout l = RnnLayoutFor(p.kind, p.dtype, p.batch, p.hidden, v);
  return rnn::LaunchCooperative<KernelOf>(p, l, v, l.bwd_smem_bytes, stream);
}

}  // namespace jax_dnn
