// The device properties the kernel plans (ffi/<op>/<op>_plan.cc) take as
// inputs. Plain C++ (no CUDA headers): the plans are built in CPU-only
// builds too. In a CUDA build, CurrentDeviceProps (device_info.h) reads them
// from the current device; where no device is known (a CPU-only build, a
// CUDA build lowering on a machine without a GPU, jax.export there) every
// field is 0 and each plan says what it assumes then.
#pragma once

namespace jax_dnn {

struct DeviceProps {
  int sm_count = 0;  // streaming multiprocessors; 0: no device known
};

}  // namespace jax_dnn
