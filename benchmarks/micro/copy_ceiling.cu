// What a read-once, write-once pass can reach on this GPU, the ceiling of the
// row forwards: copies of 16384 x 4096 bf16 (128 MiB in, 128 MiB out), run the
// way bench_ops.py runs an op (8 applications to 8 different arrays, back to
// back), against one launch over all 8 arrays (1 GiB), which has no kernel
// boundary between applications. Variants: how a thread's vectors are laid
// out (grid-stride or a contiguous chunk per block), the load and store cache
// hints, and the bulk copy engine (cp.async.bulk in and out of shared memory).
// With ROWS WIDTH (bf16) it times the library's access and the best one at
// that shape instead, as many applications as bench_ops.py runs there (1 GiB
// of input a call, at most 32): the ceiling of narrower rows, whose
// applications are shorter, so the boundary weighs more, and how much of the
// boundary programmatic dependent launches (PDL) and CUDA graphs take away.
// H200, 2026-11-24, 16384 x 1024 bf16, a copy an application: plain
// launches 19.1-19.3 us (boundary 2.7-3.0 us), PDL 18.0-18.2 (1.6-1.8 us);
// one graph of the plain launches 18.3, of PDL launches 18.1; a graph of
// child graphs, one a launch (how XLA's command buffers hold a custom call),
// 18.3 either way: PDL gains nothing there. So the library does not use
// PDL: jax_dnn's FFI handlers are command-buffer compatible and XLA runs
// them in such graphs (benchmarks/RESULTS.md, session 35).
//   nvcc -O3 -std=c++17 -arch=sm_90a copy_ceiling.cu -o copy_ceiling && ./copy_ceiling [ROWS WIDTH]
#include <algorithm>
#include <cstdlib>

#include "micro_common.cuh"

int64_t g_apps = 8;
int64_t g_vecs = int64_t{16384} * 4096 * 2 / 16;  // 16-byte vectors an application

// kLoad: 0 ld.global.nc.L1::no_allocate (the library's), 1 the same with an
// L2 256-byte prefetch, 2 ld.global, 3 ld.global.cg, 4 ld.global.cs,
// 5 ld.global.nc, 6 ld.global.lu.
template <int kLoad>
__device__ __forceinline__ uint4 Load(const uint4* p) {
  uint4 r;
#define JD_LOAD(INSN)                                                   \
  asm volatile(INSN " {%0,%1,%2,%3}, [%4];"                             \
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)             \
               : "l"(p))
  if constexpr (kLoad == 0) JD_LOAD("ld.global.nc.L1::no_allocate.v4.u32");
  else if constexpr (kLoad == 1) JD_LOAD("ld.global.nc.L1::no_allocate.L2::256B.v4.u32");
  else if constexpr (kLoad == 2) JD_LOAD("ld.global.v4.u32");
  else if constexpr (kLoad == 3) JD_LOAD("ld.global.cg.v4.u32");
  else if constexpr (kLoad == 4) JD_LOAD("ld.global.cs.v4.u32");
  else if constexpr (kLoad == 5) JD_LOAD("ld.global.nc.v4.u32");
  else JD_LOAD("ld.global.lu.v4.u32");
#undef JD_LOAD
  return r;
}

// kStore: 0 st.global, 1 st.global.cs, 2 st.global.L1::no_allocate,
// 3 st.global.cg, 4 st.global.wt.
template <int kStore>
__device__ __forceinline__ void Store(uint4* p, uint4 v) {
#define JD_STORE(INSN) \
  asm volatile(INSN " [%0], {%1,%2,%3,%4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory")
  if constexpr (kStore == 0) JD_STORE("st.global.v4.u32");
  else if constexpr (kStore == 1) JD_STORE("st.global.cs.v4.u32");
  else if constexpr (kStore == 2) JD_STORE("st.global.L1::no_allocate.v4.u32");
  else if constexpr (kStore == 3) JD_STORE("st.global.cg.v4.u32");
  else JD_STORE("st.global.wt.v4.u32");
#undef JD_STORE
}

// A block copies kThreads * kPer contiguous vectors (thread t: t + k * kThreads),
// all loads before any store: the row kernels' access pattern.
template <int kThreads, int kPer, int kLoad, int kStore>
__global__ __launch_bounds__(kThreads) void ChunkCopy(const uint4* __restrict__ x,
                                                      uint4* __restrict__ y, int64_t n) {
  const int64_t base = int64_t{blockIdx.x} * kThreads * kPer + threadIdx.x;
  uint4 v[kPer];
#pragma unroll
  for (int k = 0; k < kPer; ++k)
    if (base + k * kThreads < n) v[k] = Load<kLoad>(x + base + k * kThreads);
#pragma unroll
  for (int k = 0; k < kPer; ++k)
    if (base + k * kThreads < n) Store<kStore>(y + base + k * kThreads, v[k]);
}

// Persistent blocks; one thread moves kChunk-byte pieces through kStages
// shared-memory stages with the bulk copy engine: load k waits on its
// mbarrier, its store is issued, and the stage the previous store read from
// is refilled once that store has finished reading it.
template <int kChunk, int kStages>
__global__ __launch_bounds__(32) void BulkCopy(const char* __restrict__ x, char* __restrict__ y,
                                               int64_t chunks) {
  extern __shared__ __align__(128) char smem[];
  __shared__ __align__(8) uint64_t bar[kStages];
  if (threadIdx.x != 0) return;
  auto saddr = [](const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); };
  for (int s = 0; s < kStages; ++s)
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(saddr(&bar[s])));
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  auto load = [&](int64_t c, int s) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(saddr(&bar[s])),
                 "r"(kChunk)
                 : "memory");
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::
            "r"(saddr(smem + s * kChunk)),
        "l"(x + c * kChunk), "r"(kChunk), "r"(saddr(&bar[s]))
        : "memory");
  };
  const int64_t first = blockIdx.x, step = gridDim.x;
  for (int s = 0; s < kStages && first + s * step < chunks; ++s) load(first + s * step, s);
  int k = 0;
  for (int64_t c = first; c < chunks; c += step, ++k) {
    const int s = k % kStages;
    const uint32_t parity = (k / kStages) & 1;
    asm volatile(
        "{ .reg .pred p; W: mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1; @!p bra W; }" ::"r"(
            saddr(&bar[s])),
        "r"(parity)
        : "memory");
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(y + c * kChunk),
                 "r"(saddr(smem + s * kChunk)), "r"(kChunk)
                 : "memory");
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    if (k > 0) {
      // The previous store has read its stage: refill it.
      asm volatile("cp.async.bulk.wait_group.read 1;" ::: "memory");
      const int ps = (k - 1) % kStages;
      const int64_t next = c - step + kStages * step;
      if (next < chunks) load(next, ps);
    }
  }
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

// ChunkCopy as a dependent launch (programmatic dependent launch, PDL): the
// grid may start while the kernel before it in the stream is still running;
// griddepcontrol.wait holds each block until that kernel has finished and its
// writes are visible, so that a block's launch and first scheduling overlap
// the previous kernel's tail. kTrigger: where a block lets the next kernel
// launch (griddepcontrol.launch_dependents): 0 never (at its exit), 1 first
// thing, 2 after its loads are issued.
template <int kThreads, int kPer, int kTrigger>
__global__ __launch_bounds__(kThreads) void ChunkCopyPdl(const uint4* __restrict__ x,
                                                         uint4* __restrict__ y, int64_t n) {
  asm volatile("griddepcontrol.wait;" ::: "memory");
  if constexpr (kTrigger == 1) asm volatile("griddepcontrol.launch_dependents;");
  const int64_t base = int64_t{blockIdx.x} * kThreads * kPer + threadIdx.x;
  uint4 v[kPer];
#pragma unroll
  for (int k = 0; k < kPer; ++k)
    if (base + k * kThreads < n) v[k] = Load<6>(x + base + k * kThreads);
  if constexpr (kTrigger == 2) asm volatile("griddepcontrol.launch_dependents;");
#pragma unroll
  for (int k = 0; k < kPer; ++k)
    if (base + k * kThreads < n) Store<1>(y + base + k * kThreads, v[k]);
}

__global__ void CountDiff(const uint4* a, const uint4* b, int64_t n, unsigned long long* bad) {
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    const uint4 u = a[i], v = b[i];
    if (u.x != v.x || u.y != v.y || u.z != v.z || u.w != v.w) atomicAdd(bad, 1ull);
  }
}

uint4 *g_x, *g_y;
unsigned long long* g_bad;

// launch(x, y, n) copies n vectors; timed as 8 launches on the 8 arrays and as
// one launch on all of them.
template <typename L>
void Measure(const char* name, L launch) {
  const float per_app = TimeMs([&] {
    for (int a = 0; a < g_apps; ++a) launch(g_x + a * g_vecs, g_y + a * g_vecs, g_vecs);
  }) / g_apps;
  CK(cudaMemset(g_y, 0, g_apps * g_vecs * 16));
  const float one = TimeMs([&] { launch(g_x, g_y, g_apps * g_vecs); }) / g_apps;
  CK(cudaMemset(g_bad, 0, 8));
  CountDiff<<<132 * 8, 256>>>(g_x, g_y, g_apps * g_vecs, g_bad);
  unsigned long long bad;
  CK(cudaMemcpy(&bad, g_bad, 8, cudaMemcpyDeviceToHost));
  auto gbs = [](float ms) { return 2.0 * g_vecs * 16 / (ms * 1e-3) / 1e9; };
  printf("%-34s 8 launches %6.1f us %5.0f GB/s | one launch %6.1f us %5.0f GB/s | boundary %4.1f us%s\n",
         name, per_app * 1e3, gbs(per_app), one * 1e3, gbs(one), (per_app - one) * 1e3,
         bad ? "  WRONG" : "");
}

// The g_apps launches as one CUDA graph: captured from the stream as they
// are (nested = false), or each captured alone and added to the graph as a
// child graph node after the previous one (nested = true), which is how XLA
// records a custom call into its command buffer.
template <typename L>
void MeasureGraph(const char* name, bool nested, L launch) {
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cudaGraph_t g;
  if (!nested) {
    CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    for (int a = 0; a < g_apps; ++a) launch(g_x + a * g_vecs, g_y + a * g_vecs, g_vecs, s);
    CK(cudaStreamEndCapture(s, &g));
  } else {
    CK(cudaGraphCreate(&g, 0));
    cudaGraphNode_t prev{};
    for (int a = 0; a < g_apps; ++a) {
      cudaGraph_t child;
      CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
      launch(g_x + a * g_vecs, g_y + a * g_vecs, g_vecs, s);
      CK(cudaStreamEndCapture(s, &child));
      cudaGraphNode_t node;
      CK(cudaGraphAddChildGraphNode(&node, g, a ? &prev : nullptr, a ? 1 : 0, child));
      prev = node;
    }
  }
  cudaGraphExec_t exec;
  CK(cudaGraphInstantiate(&exec, g, 0));
  const float per_app = TimeMs([&] { CK(cudaGraphLaunch(exec, 0)); }) / g_apps;
  auto gbs = [](float ms) { return 2.0 * g_vecs * 16 / (ms * 1e-3) / 1e9; };
  printf("%-40s graph%s %6.1f us %5.0f GB/s\n", name, nested ? " of child graphs" : "", per_app * 1e3,
         gbs(per_app));
  CK(cudaGraphExecDestroy(exec));
  CK(cudaGraphDestroy(g));
  CK(cudaStreamDestroy(s));
}

// ChunkCopyPdl over n vectors on stream s, as a dependent launch or not.
template <int kThreads, int kPer, int kTrigger>
void LaunchChunkCopyPdl(const uint4* x, uint4* y, int64_t n, cudaStream_t s, bool dependent) {
  const int64_t per = int64_t{kThreads} * kPer;
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(static_cast<unsigned>((n + per - 1) / per));
  cfg.blockDim = dim3(kThreads);
  cfg.stream = s;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = dependent ? 1 : 0;
  CK(cudaLaunchKernelEx(&cfg, ChunkCopyPdl<kThreads, kPer, kTrigger>, x, y, n));
}

template <int kThreads, int kPer, bool kPdl>
void ChunkGraph(const char* name, bool nested) {
  MeasureGraph(name, nested, [](uint4* x, uint4* y, int64_t n, cudaStream_t s) {
    LaunchChunkCopyPdl<kThreads, kPer, 0>(x, y, n, s, kPdl);
  });
}

template <int kThreads, int kPer, int kLoad, int kStore>
void Chunk(const char* name) {
  Measure(name, [](uint4* x, uint4* y, int64_t n) {
    const int64_t per = int64_t{kThreads} * kPer;
    ChunkCopy<kThreads, kPer, kLoad, kStore><<<(n + per - 1) / per, kThreads>>>(x, y, n);
  });
}

template <int kThreads, int kPer, int kTrigger>
void ChunkPdl(const char* name) {
  Measure(name, [](uint4* x, uint4* y, int64_t n) {
    LaunchChunkCopyPdl<kThreads, kPer, kTrigger>(x, y, n, /*s=*/0, /*dependent=*/true);
  });
}

template <int kChunk, int kStages, int kPerSm>
void Bulk(const char* name) {
  constexpr int smem = kChunk * kStages;
  CK(cudaFuncSetAttribute(BulkCopy<kChunk, kStages>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                          smem));
  Measure(name, [](uint4* x, uint4* y, int64_t n) {
    BulkCopy<kChunk, kStages><<<132 * kPerSm, 32, smem>>>(
        reinterpret_cast<const char*>(x), reinterpret_cast<char*>(y), n * 16 / kChunk);
  });
}

int main(int argc, char** argv) {
  const bool shape = argc == 3;
  if (shape) {
    const int64_t bytes = std::atoll(argv[1]) * std::atoll(argv[2]) * 2;
    g_vecs = bytes / 16;
    g_apps = std::max<int64_t>(1, std::min<int64_t>(32, ((int64_t{1} << 30) + bytes - 1) / bytes));
    printf("%s x %s bf16: %lld applications\n", argv[1], argv[2], static_cast<long long>(g_apps));
  }
  CK(cudaMalloc(&g_x, g_apps * g_vecs * 16));
  CK(cudaMalloc(&g_y, g_apps * g_vecs * 16));
  CK(cudaMalloc(&g_bad, 8));
  std::vector<uint32_t> h(g_vecs * 4);
  for (size_t i = 0; i < h.size(); ++i) h[i] = uint32_t(i * 2654435761u);
  for (int a = 0; a < g_apps; ++a)
    CK(cudaMemcpy(g_x + a * g_vecs, h.data(), g_vecs * 16, cudaMemcpyHostToDevice));
  for (int rep = 0; shape && rep < 2; ++rep) {
    Chunk<256, 8, 6, 1>("chunk 256x8 ld.lu, st.cs (library)");
    Chunk<256, 8, 4, 1>("chunk 256x8 ld.cs, st.cs");
    Chunk<256, 4, 6, 1>("chunk 256x4 ld.lu, st.cs (activations)");
    ChunkPdl<256, 8, 0>("chunk 256x8 PDL, trigger at exit");
    ChunkPdl<256, 8, 1>("chunk 256x8 PDL, trigger first");
    ChunkPdl<256, 8, 2>("chunk 256x8 PDL, trigger after loads");
    ChunkPdl<256, 4, 1>("chunk 256x4 PDL, trigger first");
    ChunkGraph<256, 8, false>("chunk 256x8 plain", false);
    ChunkGraph<256, 8, true>("chunk 256x8 PDL", false);
    ChunkGraph<256, 8, false>("chunk 256x8 plain", true);
    ChunkGraph<256, 8, true>("chunk 256x8 PDL", true);
  }
  for (int rep = 0; !shape && rep < 2; ++rep) {
    Measure("grid-stride x4 (micro_common Copy)", [](uint4* x, uint4* y, int64_t n) {
      Copy<<<132 * 8, 256>>>(x, y, n);
    });
    Chunk<256, 8, 0, 0>("chunk 256x8 nc.L1::no_allocate, st");
    Chunk<256, 8, 2, 0>("chunk 256x8 ld, st");
    Chunk<256, 8, 3, 0>("chunk 256x8 ld.cg, st");
    Chunk<256, 8, 4, 0>("chunk 256x8 ld.cs, st");
    Chunk<256, 8, 5, 0>("chunk 256x8 ld.nc, st");
    Chunk<256, 8, 6, 0>("chunk 256x8 ld.lu, st");
    Chunk<256, 8, 0, 1>("chunk 256x8 nc.L1::no_allocate, st.cs");
    Chunk<256, 8, 2, 1>("chunk 256x8 ld, st.cs");
    Chunk<256, 8, 3, 1>("chunk 256x8 ld.cg, st.cs");
    Chunk<256, 8, 4, 1>("chunk 256x8 ld.cs, st.cs");
    Chunk<256, 8, 6, 1>("chunk 256x8 ld.lu, st.cs");
    Chunk<256, 8, 2, 3>("chunk 256x8 ld, st.cg");
    Chunk<256, 8, 2, 4>("chunk 256x8 ld, st.wt");
    Chunk<256, 4, 2, 1>("chunk 256x4 ld, st.cs");
    Chunk<128, 8, 2, 1>("chunk 128x8 ld, st.cs");
    Chunk<512, 4, 2, 1>("chunk 512x4 ld, st.cs");
  }
  return 0;
}
