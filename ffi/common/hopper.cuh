// Hopper (sm_90a) building blocks as thin inline-PTX wrappers: mbarriers, TMA
// tensor and bulk loads, wgmma fences and shared-memory matrix descriptors, register
// reallocation. Each wrapper is one instruction or a loop around one; the
// comments say what the kernels rely on.
#pragma once

#include <cuda.h>  // CUtensorMap (the type only; no driver library is linked)

#include <cstdint>

namespace jax_dnn {
namespace hopper {

__device__ __forceinline__ uint32_t SmemAddr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// x from lane 0: ptxas then treats it as warp-uniform, so that what derives
// from it (the warpgroup's shared-memory offsets, hence the wgmma
// descriptors) lives in uniform registers, with no per-wgmma R2UR moves.
__device__ __forceinline__ int WarpUniform(int x) { return __shfl_sync(0xffffffff, x, 0); }

// st.shared.b32 at addr + kOffset (a 32-bit shared address: the kernels
// compute swizzled addresses with XORs that a generic pointer would hide).
template <int kOffset>
__device__ __forceinline__ void StoreShared32(uint32_t addr, uint32_t v) {
  asm volatile("st.shared.b32 [%0+%2], %1;" ::"r"(addr), "r"(v), "n"(kOffset) : "memory");
}

// --- mbarrier ------------------------------------------------------------------

__device__ __forceinline__ void BarrierInit(uint64_t* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(SmemAddr(bar)), "r"(count));
}

// Makes the initialized barriers visible to the async proxy (TMA).
__device__ __forceinline__ void FenceBarrierInit() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

// Arrives once and adds `bytes` to the transaction count that TMA completes.
__device__ __forceinline__ void BarrierExpectTx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(SmemAddr(bar)),
               "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void BarrierArrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(SmemAddr(bar)) : "memory");
}

// Waits for the phase with the given parity to complete.
__device__ __forceinline__ void BarrierWait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT_%=;\n"
      "}\n" ::"r"(SmemAddr(bar)),
      "r"(parity)
      : "memory");
}

// --- clusters -------------------------------------------------------------------

// This CTA's rank in its cluster.
__device__ __forceinline__ uint32_t ClusterCtaRank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}

// Every thread of every CTA in the cluster arrives, then waits for the others
// (release / acquire at cluster scope: what a CTA wrote to its barriers and
// shared memory before is visible to the others after). Not .aligned: the
// threads of a warp may reach it apart.
__device__ __forceinline__ void ClusterSync() {
  asm volatile("barrier.cluster.arrive.release;\n\tbarrier.cluster.wait.acquire;" ::: "memory");
}

// The same barrier without the release: a CTA's earlier writes are not made
// visible by it, so it does not wait for them to complete (the release form
// waits for every outstanding store, this CTA's global ones included). For
// ordering through mbarriers instead (a barrier's initialization, with
// FenceBarrierInit; st.async pushes), and for keeping CTAs alive.
__device__ __forceinline__ void ClusterSyncRelaxed() {
  asm volatile("barrier.cluster.arrive.relaxed;\n\tbarrier.cluster.wait.acquire;" ::: "memory");
}

// The address of `p`'s offset in the shared memory of cluster CTA `cta`.
__device__ __forceinline__ uint32_t MapShared(const void* p, uint32_t cta) {
  uint32_t r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(SmemAddr(p)), "r"(cta));
  return r;
}

// Stores 32 bits at `remote` (a MapShared address) and completes 4 bytes of
// the transaction count of the barrier at `remote_bar` (in the same CTA).
__device__ __forceinline__ void StoreAsync32(uint32_t remote, uint32_t v, uint32_t remote_bar) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [%0], %1, [%2];" ::"r"(
                   remote),
               "r"(v), "r"(remote_bar)
               : "memory");
}

// Arrives on the barrier at `bar`'s offset in the shared memory of cluster
// CTA `cta` (this one's included).
__device__ __forceinline__ void BarrierArriveCluster(uint64_t* bar, uint32_t cta) {
  asm volatile(
      "{\n"
      ".reg .b32 remote;\n"
      "mapa.shared::cluster.u32 remote, %0, %1;\n"
      "mbarrier.arrive.shared::cluster.b64 _, [remote];\n"
      "}\n" ::"r"(SmemAddr(bar)),
      "r"(cta)
      : "memory");
}

// --- TMA -----------------------------------------------------------------------

// Loads one 4-D box at coordinates (c0 innermost .. c3) into shared memory;
// completes `bytes` of transactions on `bar`. Out-of-bounds elements are
// filled with zeros, which the kernels rely on for ragged tiles.
__device__ __forceinline__ void TmaLoad4d(void* smem, const CUtensorMap* map, uint64_t* bar,
                                          int c0, int c1, int c2, int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3, %4, %5}], [%6];" ::"r"(SmemAddr(smem)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3),
      "r"(SmemAddr(bar))
      : "memory");
}

// TmaLoad4d into the shared memory of every cluster CTA in `cta_mask`, at
// smem's offset, completing the bytes on the barrier at bar's offset in each.
__device__ __forceinline__ void TmaLoad4dMulticast(void* smem, const CUtensorMap* map, uint64_t* bar,
                                                   int c0, int c1, int c2, int c3, uint16_t cta_mask) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.multicast::cluster"
      " [%0], [%1, {%2, %3, %4, %5}], [%6], %7;" ::"r"(SmemAddr(smem)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3),
      "r"(SmemAddr(bar)), "h"(cta_mask)
      : "memory");
}

// Copies `bytes` (a multiple of 16; both addresses 16-byte aligned) of
// contiguous global memory into this CTA's shared memory with the bulk copy
// engine, completing the bytes on `bar`.
__device__ __forceinline__ void BulkLoad(void* smem, const void* gmem, uint32_t bytes, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
          SmemAddr(smem)),
      "l"(reinterpret_cast<uint64_t>(gmem)), "r"(bytes), "r"(SmemAddr(bar))
      : "memory");
}

// Fetches one 4-D box into L2 only (no shared memory, no barrier), so that a
// later TmaLoad4d of it waits on L2 rather than on HBM.
__device__ __forceinline__ void TmaPrefetchL2(const CUtensorMap* map, int c0, int c1, int c2, int c3) {
  asm volatile("cp.async.bulk.prefetch.tensor.4d.L2.global.tile [%0, {%1, %2, %3, %4}];" ::"l"(
                   reinterpret_cast<uint64_t>(map)),
               "r"(c0), "r"(c1), "r"(c2), "r"(c3)
               : "memory");
}

// Adds `bytes` of fp32 from shared memory to global memory (element-wise, in
// L2), asynchronously; both addresses 16-byte aligned, bytes a multiple of 16.
// The source may be overwritten once BulkWaitRead says the read is done.
__device__ __forceinline__ void BulkReduceAddF32(float* gmem, const void* smem, uint32_t bytes) {
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;" ::"l"(
                   reinterpret_cast<uint64_t>(gmem)),
               "r"(SmemAddr(smem)), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void BulkCommit() {
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}
// Waits until at most kPending committed bulk groups are still reading shared memory.
template <int kPending>
__device__ __forceinline__ void BulkWaitRead() {
  asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(kPending) : "memory");
}
// Waits until every committed bulk group has completed (its writes done).
__device__ __forceinline__ void BulkWaitAll() {
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}
// The first 1024-byte-aligned address in a dynamic shared-memory buffer (what
// 128-byte-swizzled TMA tiles need). Pointer arithmetic on the __shared__
// array itself, not a round trip through an integer, so that the compiler
// still knows the derived pointers are shared memory and emits LDS/STS with
// 32-bit addresses rather than generic LD/ST (generic and shared addresses
// agree in their low bits).
__device__ __forceinline__ uint8_t* AlignSmem1024(uint8_t* smem) {
  return smem + ((1024 - (reinterpret_cast<uintptr_t>(smem) & 1023)) & 1023);
}

// Makes this thread's ordinary shared-memory writes visible to the async
// proxy (wgmma operands, bulk copies) once a barrier has ordered them.
__device__ __forceinline__ void FenceProxyAsync() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

__device__ __forceinline__ void TmaPrefetchDescriptor(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}

// --- wgmma -----------------------------------------------------------------------

// Orders register writes (accumulators, A fragments) before later wgmmas read them.
__device__ __forceinline__ void WgmmaFence() {
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
}
__device__ __forceinline__ void WgmmaCommit() {
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}
template <int kPending>
__device__ __forceinline__ void WgmmaWait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(kPending) : "memory");
}
// Keeps the compiler from moving accumulator reads/writes across an async wgmma.
template <int kN>
__device__ __forceinline__ void FenceRegisters(float (&d)[kN]) {
#pragma unroll
  for (int i = 0; i < kN; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// Keeps 32-bit registers (e.g. the A fragments of an in-flight wgmma) live
// and unmodified up to this point.
template <int kN>
__device__ __forceinline__ void KeepRegisters(uint32_t (&r)[kN][4]) {
#pragma unroll
  for (int i = 0; i < kN; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) asm volatile("" : "+r"(r[i][j])::"memory");
}

// Shared-memory matrix descriptor for a 128-byte-swizzled operand, the layout
// TMA writes with CU_TENSOR_MAP_SWIZZLE_128B: rows of 64 16-bit elements
// (128 bytes), 8-row atoms of 1024 bytes (the buffer must be 1024-aligned).
//   K-major (A or B with K contiguous): SBO = 1024 (next 8 rows); LBO unused.
//     Step K by 16 elements: +32 bytes on the start address.
//   MN-major (B with N contiguous, imm-trans-b = 1; likewise A with M
//     contiguous, imm-trans-a = 1): SBO = 1024 (next 8 rows of K), LBO =
//     bytes between 64-column slabs of N (or M). Step K by 16: +2048.
__device__ __forceinline__ uint64_t Descriptor(uint32_t smem_addr, uint32_t lbo_bytes) {
  uint64_t d = 0;
  d |= static_cast<uint64_t>((smem_addr & 0x3FFFF) >> 4);
  d |= static_cast<uint64_t>((lbo_bytes & 0x3FFFF) >> 4) << 16;
  d |= static_cast<uint64_t>(1024 >> 4) << 32;
  d |= static_cast<uint64_t>(1) << 62;  // 128-byte swizzle
  return d;
}

// Descriptor(smem_addr + bytes, lbo_bytes) for `bytes` a multiple of 16, as
// one add to the start field of the loop-invariant Descriptor(smem_addr, ...):
// shared addresses stay below 256 KB, so the 14-bit field cannot carry.
// (Rebuilt from the sum, each descriptor cost ~10 masks, shifts and moves
// around every wgmma in the SASS.) Fewer instructions are not always a
// faster schedule: with this form and WarpUniform, the dK/dV kernel got
// 3-6% faster, but the dQ kernel 13% slower (head dim 64, ncu) and the
// forward 3% (head dim 64, ncu; with WarpUniform alone, up to 5% at head
// dim 256 in the benchmark), so those keep the rebuilt form (H200).
__device__ __forceinline__ uint64_t Descriptor(uint32_t smem_addr, uint32_t lbo_bytes,
                                               uint32_t bytes) {
  const uint64_t d = Descriptor(smem_addr, lbo_bytes);
  const uint32_t lo = static_cast<uint32_t>(d) + (bytes >> 4);
  return (d & 0xFFFFFFFF00000000ull) | lo;
}

// --- named barriers (ids 1..15; 0 is __syncthreads) ------------------------------

// Waits until `count` threads (a multiple of 32, this warp's included) arrived.
__device__ __forceinline__ void NamedBarrierSync(int id, int count) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(count) : "memory");
}
// Arrives without waiting.
__device__ __forceinline__ void NamedBarrierArrive(int id, int count) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(count) : "memory");
}

// --- register reallocation between warpgroups ---------------------------------------

// The pool is what the launch gave the CTA (the kernels compile to 168 per
// thread at 384 threads): an increase waits until decreases have freed
// enough, so producer x 128 + consumers x 256 must stay within 168 x 384
// (24 / 240 or 40 / 232), or the kernel hangs.
template <int kRegs>
__device__ __forceinline__ void RegAlloc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(kRegs));
}
template <int kRegs>
__device__ __forceinline__ void RegDealloc() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kRegs));
}

// 2^x with the MUFU instruction (ex2.approx.ftz: 2 ulp; exp2(-inf) = 0).
__device__ __forceinline__ float Exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// Packs two floats into the 32-bit pair of 16-bit values a wgmma A fragment holds.
template <typename T>
__device__ __forceinline__ uint32_t PackPair(float lo, float hi);
template <>
__device__ __forceinline__ uint32_t PackPair<__nv_bfloat16>(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}
template <>
__device__ __forceinline__ uint32_t PackPair<__half>(float lo, float hi) {
  __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

}  // namespace hopper
}  // namespace jax_dnn
