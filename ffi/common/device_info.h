// Device properties the launchers size grids with, read once per device
// (host code; cudaDeviceGetAttribute does not synchronize).
#pragma once

#include <cuda_runtime.h>

#include "ffi/common/device_props.h"

namespace jax_dnn {

// The current device's properties, cached per device; all 0 where there is
// no device (no GPU or no driver: the plans' "no device known").
inline DeviceProps CurrentDeviceProps() {
  constexpr int kMaxDevices = 64;
  static DeviceProps cache[kMaxDevices] = {};
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= kMaxDevices) {
    cudaGetLastError();  // leave no error behind for a launcher's check
    return DeviceProps{};
  }
  if (cache[dev].sm_count == 0) {
    int sms = 0;
    if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess) {
      cudaGetLastError();
      return DeviceProps{};
    }
    cache[dev].sm_count = sms;
  }
  return cache[dev];
}

// The current device's SM count for a launch (at least 1).
inline int SmCount() {
  const int sms = CurrentDeviceProps().sm_count;
  return sms > 0 ? sms : 1;
}

// Blocks for a persistent kernel: as many as fit on the device at once
// (occupancy API with the kernel's dynamic shared memory), at most `work`.
template <typename Kernel>
cudaError_t PersistentGrid(Kernel kernel, int block, size_t smem, long long work, unsigned* grid) {
  // Set whenever there is dynamic shared memory: the limit is on static plus
  // dynamic, so even under 48 KB of dynamic the kernel's static part may pass it.
  if (smem > 0) {
    cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(smem));
    if (e != cudaSuccess) return e;
  }
  int per_sm = 0;
  cudaError_t e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, block, smem);
  if (e != cudaSuccess) return e;
  if (per_sm < 1) return cudaErrorInvalidConfiguration;
  const long long slots = static_cast<long long>(per_sm) * SmCount();
  *grid = static_cast<unsigned>(work < slots ? work : slots);
  return cudaSuccess;
}

}  // namespace jax_dnn
