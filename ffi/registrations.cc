// The one nanobind module. `registrations()` returns {FFI target name: handler
// capsule}; jax_dnn/_src/extension.py registers each with JAX for "CUDA".
// A CPU-only build (no nvcc) has no handlers and says so via `has_cuda()`.
#include <nanobind/nanobind.h>

#ifdef JAX_DNN_WITH_CUDA
#include "xla/ffi/api/ffi.h"
namespace jax_dnn {
XLA_FFI_DECLARE_HANDLER_SYMBOL(ActivationFwd);
XLA_FFI_DECLARE_HANDLER_SYMBOL(ActivationBwd);
XLA_FFI_DECLARE_HANDLER_SYMBOL(BiasActFwd);
XLA_FFI_DECLARE_HANDLER_SYMBOL(BiasActBwd);
XLA_FFI_DECLARE_HANDLER_SYMBOL(SoftmaxFwd);
XLA_FFI_DECLARE_HANDLER_SYMBOL(SoftmaxBwd);
XLA_FFI_DECLARE_HANDLER_SYMBOL(LayerNormFwd);
XLA_FFI_DECLARE_HANDLER_SYMBOL(LayerNormBwd);
XLA_FFI_DECLARE_HANDLER_SYMBOL(RmsNormFwd);
XLA_FFI_DECLARE_HANDLER_SYMBOL(RmsNormBwd);
XLA_FFI_DECLARE_HANDLER_SYMBOL(AttentionFwd);
XLA_FFI_DECLARE_HANDLER_SYMBOL(AttentionBwd);
}  // namespace jax_dnn
#endif

namespace nb = nanobind;

namespace {

template <typename Fn>
nb::capsule Capsule(Fn* fn) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}

nb::dict Registrations() {
  nb::dict d;
#ifdef JAX_DNN_WITH_CUDA
  using namespace jax_dnn;
  d["jax_dnn_activation_fwd"] = Capsule(ActivationFwd);
  d["jax_dnn_activation_bwd"] = Capsule(ActivationBwd);
  d["jax_dnn_bias_act_fwd"] = Capsule(BiasActFwd);
  d["jax_dnn_bias_act_bwd"] = Capsule(BiasActBwd);
  d["jax_dnn_softmax_fwd"] = Capsule(SoftmaxFwd);
  d["jax_dnn_softmax_bwd"] = Capsule(SoftmaxBwd);
  d["jax_dnn_layer_norm_fwd"] = Capsule(LayerNormFwd);
  d["jax_dnn_layer_norm_bwd"] = Capsule(LayerNormBwd);
  d["jax_dnn_rms_norm_fwd"] = Capsule(RmsNormFwd);
  d["jax_dnn_rms_norm_bwd"] = Capsule(RmsNormBwd);
  d["jax_dnn_attention_fwd"] = Capsule(AttentionFwd);
  d["jax_dnn_attention_bwd"] = Capsule(AttentionBwd);
#endif
  return d;
}

}  // namespace

NB_MODULE(_jax_dnn, m) {
  m.def("registrations", &Registrations);
  m.def("has_cuda", []() {
#ifdef JAX_DNN_WITH_CUDA
    return true;
#else
    return false;
#endif
  });
}
