// The one nanobind module.
//   registrations(): {FFI target name: handler capsule}; jax_dnn/_src/
//     extension.py registers each with JAX for "CUDA". A CPU-only build (no
//     nvcc) has no handlers and says so via has_cuda().
//   The kernels' plans (ffi/<op>/<op>_plan.h), built in every build:
//     jax_dnn/_src/plans.py asks them while lowering for CUDA. Each takes the
//     DeviceProps it plans for; current_device() gives the current CUDA
//     device's (all 0 in a CPU-only build or where no GPU is present: each
//     plan says what it assumes then).
//   The convolution's algorithm registry (ffi/conv/conv_plan.h): ConvProblem,
//     ConvAlgorithm, conv_algorithms(problem, device), conv_plan(problem,
//     deterministic, device); in CUDA builds conv_benchmark(problem,
//     algorithm_ids, repeats) (ffi/conv/conv_benchmark.h: the algorithms
//     timed on the current device; absent in a CPU-only build).
//   The recurrence's plan (ffi/rnn/rnn_plan.h): rnn_plan(kind, dtype,
//     seq_len, batch, hidden, device, directions=1) -> RnnPlan, and
//     rnn_variant_workspace_bytes(kind, dtype, batch, hidden, variant).
//   build_info(): how this extension was built (python -m jax_dnn.doctor).
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "ffi/activation/activation_plan.h"
#include "ffi/attention/attention_plan.h"
#include "ffi/batch_norm/batch_norm_plan.h"
#include "ffi/common/device_props.h"
#include "ffi/common/dtype.h"
#include "ffi/conv/conv_plan.h"
#include "ffi/group_norm/group_norm_plan.h"
#include "ffi/layer_norm/layer_norm_plan.h"
#include "ffi/pooling/pooling_plan.h"
#include "ffi/rnn/rnn_plan.h"

#ifdef JAX_DNN_WITH_CUDA
#include "ffi/common/device_info.h"
#include "ffi/conv/conv_benchmark.h"
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
XLA_FFI_DECLARE_HANDLER_SYMBOL(ConvFwd);
XLA_FFI_DECLARE_HANDLER_SYMBOL(ConvDgrad);
XLA_FFI_DECLARE_HANDLER_SYMBOL(ConvWgrad);
XLA_FFI_DECLARE_HANDLER_SYMBOL(GroupNormFwd);
XLA_FFI_DECLARE_HANDLER_SYMBOL(GroupNormBwd);
XLA_FFI_DECLARE_HANDLER_SYMBOL(MaxPoolFwd);
XLA_FFI_DECLARE_HANDLER_SYMBOL(MaxPoolBwd);
XLA_FFI_DECLARE_HANDLER_SYMBOL(MaxPoolIdxFwd);
XLA_FFI_DECLARE_HANDLER_SYMBOL(MaxPoolIdxBwd);
XLA_FFI_DECLARE_HANDLER_SYMBOL(AvgPoolFwd);
XLA_FFI_DECLARE_HANDLER_SYMBOL(AvgPoolBwd);
XLA_FFI_DECLARE_HANDLER_SYMBOL(BatchNormStats);
XLA_FFI_DECLARE_HANDLER_SYMBOL(BatchNormFwd);
XLA_FFI_DECLARE_HANDLER_SYMBOL(BatchNormBwdStats);
XLA_FFI_DECLARE_HANDLER_SYMBOL(BatchNormBwd);
XLA_FFI_DECLARE_HANDLER_SYMBOL(RnnFwd);
XLA_FFI_DECLARE_HANDLER_SYMBOL(RnnBwd);
}  // namespace jax_dnn
#endif

namespace nb = nanobind;
using namespace nb::literals;

namespace {

using jax_dnn::AttentionOptions;
using jax_dnn::AttentionShape;
using jax_dnn::ConvAlgorithm;
using jax_dnn::ConvProblem;
using jax_dnn::DeviceProps;
using jax_dnn::DType;

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
  d["jax_dnn_conv_fwd"] = Capsule(ConvFwd);
  d["jax_dnn_conv_dgrad"] = Capsule(ConvDgrad);
  d["jax_dnn_conv_wgrad"] = Capsule(ConvWgrad);
  d["jax_dnn_group_norm_fwd"] = Capsule(GroupNormFwd);
  d["jax_dnn_group_norm_bwd"] = Capsule(GroupNormBwd);
  d["jax_dnn_max_pool_fwd"] = Capsule(MaxPoolFwd);
  d["jax_dnn_max_pool_bwd"] = Capsule(MaxPoolBwd);
  d["jax_dnn_max_pool_idx_fwd"] = Capsule(MaxPoolIdxFwd);
  d["jax_dnn_max_pool_idx_bwd"] = Capsule(MaxPoolIdxBwd);
  d["jax_dnn_avg_pool_fwd"] = Capsule(AvgPoolFwd);
  d["jax_dnn_avg_pool_bwd"] = Capsule(AvgPoolBwd);
  d["jax_dnn_batch_norm_stats"] = Capsule(BatchNormStats);
  d["jax_dnn_batch_norm_fwd"] = Capsule(BatchNormFwd);
  d["jax_dnn_batch_norm_bwd_stats"] = Capsule(BatchNormBwdStats);
  d["jax_dnn_batch_norm_bwd"] = Capsule(BatchNormBwd);
  d["jax_dnn_rnn_fwd"] = Capsule(RnnFwd);
  d["jax_dnn_rnn_bwd"] = Capsule(RnnBwd);
#endif
  return d;
}

DeviceProps CurrentDevice() {
#ifdef JAX_DNN_WITH_CUDA
  return jax_dnn::CurrentDeviceProps();
#else
  return DeviceProps{};
#endif
}

// A dtype by its numpy name; nullopt for one the kernels never take.
std::optional<DType> DTypeNamed(const std::string& name) {
  if (name == "float32") return DType::kF32;
  if (name == "bfloat16") return DType::kBF16;
  if (name == "float16") return DType::kF16;
  return std::nullopt;
}

DType KernelDType(const std::string& name) {
  auto dtype = DTypeNamed(name);
  if (!dtype) throw nb::value_error(("jax_dnn plans: no kernel takes dtype " + name).c_str());
  return *dtype;
}

jax_dnn::RnnKind RnnKindNamed(const std::string& kind) {
  if (kind == "lstm") return jax_dnn::RnnKind::kLstm;
  if (kind == "gru") return jax_dnn::RnnKind::kGru;
  if (kind == "rnn_tanh") return jax_dnn::RnnKind::kRnnTanh;
  if (kind == "rnn_relu") return jax_dnn::RnnKind::kRnnRelu;
  throw nb::value_error(
      ("rnn_plan: kind must be 'lstm', 'gru', 'rnn_tanh' or 'rnn_relu', not " + kind).c_str());
}

void DefinePlanTypes(nb::module_& m) {
  nb::class_<DeviceProps>(m, "DeviceProps")
      .def(
          "__init__", [](DeviceProps* d, int sm_count) { new (d) DeviceProps{sm_count}; },
          nb::kw_only(), "sm_count"_a = 0)
      .def_rw("sm_count", &DeviceProps::sm_count)
      .def("__repr__", [](const DeviceProps& d) {
        return "DeviceProps(sm_count=" + std::to_string(d.sm_count) + ")";
      });

  nb::class_<AttentionShape>(m, "AttentionShape")
      .def(
          "__init__",
          [](AttentionShape* s, int64_t b, int64_t t, int64_t s_len, int64_t n, int64_t kh,
             int64_t h, int64_t hv) { new (s) AttentionShape{b, t, s_len, n, kh, h, hv}; },
          nb::kw_only(), "b"_a, "t"_a, "s"_a, "n"_a, "kh"_a, "h"_a, "hv"_a)
      .def_rw("b", &AttentionShape::b)
      .def_rw("t", &AttentionShape::t)
      .def_rw("s", &AttentionShape::s)
      .def_rw("n", &AttentionShape::n)
      .def_rw("kh", &AttentionShape::kh)
      .def_rw("h", &AttentionShape::h)
      .def_rw("hv", &AttentionShape::hv);

  nb::class_<AttentionOptions>(m, "AttentionOptions")
      .def(
          "__init__",
          [](AttentionOptions* o, bool bias, bool mask, bool q_lens, bool kv_lens, bool segments,
             bool causal, int64_t window_left, int64_t window_right, float scale, float softcap) {
            new (o) AttentionOptions{bias,   mask,        q_lens,       kv_lens, segments,
                                     causal, window_left, window_right, scale,   softcap};
          },
          nb::kw_only(), "bias"_a = false, "mask"_a = false, "q_lens"_a = false,
          "kv_lens"_a = false, "segments"_a = false, "causal"_a = false, "window_left"_a = -1,
          "window_right"_a = -1, "scale"_a = 1.f, "softcap"_a = 0.f)
      .def_rw("bias", &AttentionOptions::bias)
      .def_rw("mask", &AttentionOptions::mask)
      .def_rw("q_lens", &AttentionOptions::q_lens)
      .def_rw("kv_lens", &AttentionOptions::kv_lens)
      .def_rw("segments", &AttentionOptions::segments)
      .def_rw("causal", &AttentionOptions::causal)
      .def_rw("window_left", &AttentionOptions::window_left)
      .def_rw("window_right", &AttentionOptions::window_right)
      .def_rw("scale", &AttentionOptions::scale)
      .def_rw("softcap", &AttentionOptions::softcap);
}

jax_dnn::ConvOp ConvOpNamed(const std::string& op) {
  if (op == "fwd") return jax_dnn::ConvOp::kFprop;
  if (op == "dgrad") return jax_dnn::ConvOp::kDgrad;
  if (op == "wgrad") return jax_dnn::ConvOp::kWgrad;
  throw nb::value_error(("ConvProblem: op must be 'fwd', 'dgrad' or 'wgrad', not " + op).c_str());
}

const char* ConvOpName(jax_dnn::ConvOp op) {
  return op == jax_dnn::ConvOp::kFprop ? "fwd" : op == jax_dnn::ConvOp::kDgrad ? "dgrad" : "wgrad";
}

// A (D, H, W) argument of ConvProblem into conv.h's array.
void ConvAxes(const char* name, const std::vector<int64_t>& v, int64_t (&out)[3]) {
  if (v.size() != 3)
    throw nb::value_error(
        (std::string("ConvProblem: ") + name + " must have 3 entries (D, H, W)").c_str());
  for (int i = 0; i < 3; ++i) out[i] = v[i];
}

std::vector<int64_t> AxesList(const int64_t (&v)[3]) { return {v[0], v[1], v[2]}; }

void DefineConvTypes(nb::module_& m) {
  using V = std::vector<int64_t>;
  nb::class_<ConvProblem>(m, "ConvProblem")
      .def(
          "__init__",
          [](ConvProblem* p, const std::string& op, const std::string& dtype, int64_t n, int64_t c,
             int64_t k, int64_t groups, const V& input, const V& window, const V& output,
             const V& stride, const V& dilation, const V& pad_lo, const V& pad_hi, int rank,
             int activation, bool bias, bool residual) {
            ConvProblem q;
            q.op = ConvOpNamed(op);
            q.dtype = KernelDType(dtype);
            q.shape.n = n;
            q.shape.c = c;
            q.shape.k = k;
            q.shape.groups = groups;
            ConvAxes("input", input, q.shape.input);
            ConvAxes("window", window, q.shape.window);
            ConvAxes("output", output, q.shape.output);
            ConvAxes("stride", stride, q.shape.stride);
            ConvAxes("dilation", dilation, q.shape.dilation);
            ConvAxes("pad_lo", pad_lo, q.shape.pad_lo);
            ConvAxes("pad_hi", pad_hi, q.shape.pad_hi);
            q.shape.rank = rank;
            q.activation = activation;
            q.bias = bias;
            q.residual = residual;
            new (p) ConvProblem(q);
          },
          "op"_a, "dtype"_a, "n"_a, "c"_a, "k"_a, "groups"_a, "input"_a, "window"_a, "output"_a,
          "stride"_a, "dilation"_a, "pad_lo"_a, "pad_hi"_a, "rank"_a, "activation"_a = -1,
          "bias"_a = false, "residual"_a = false)
      .def_prop_ro("op", [](const ConvProblem& p) { return std::string(ConvOpName(p.op)); })
      .def_prop_ro("n", [](const ConvProblem& p) { return p.shape.n; })
      .def_prop_ro("c", [](const ConvProblem& p) { return p.shape.c; })
      .def_prop_ro("k", [](const ConvProblem& p) { return p.shape.k; })
      .def_prop_ro("groups", [](const ConvProblem& p) { return p.shape.groups; })
      .def_prop_ro("input", [](const ConvProblem& p) { return AxesList(p.shape.input); })
      .def_prop_ro("window", [](const ConvProblem& p) { return AxesList(p.shape.window); })
      .def_prop_ro("output", [](const ConvProblem& p) { return AxesList(p.shape.output); })
      .def_prop_ro("stride", [](const ConvProblem& p) { return AxesList(p.shape.stride); })
      .def_prop_ro("dilation", [](const ConvProblem& p) { return AxesList(p.shape.dilation); })
      .def_prop_ro("pad_lo", [](const ConvProblem& p) { return AxesList(p.shape.pad_lo); })
      .def_prop_ro("pad_hi", [](const ConvProblem& p) { return AxesList(p.shape.pad_hi); })
      .def_prop_ro("rank", [](const ConvProblem& p) { return p.shape.rank; })
      .def_ro("activation", &ConvProblem::activation)
      .def_ro("bias", &ConvProblem::bias)
      .def_ro("residual", &ConvProblem::residual);

  nb::class_<ConvAlgorithm>(m, "ConvAlgorithm")
      .def_ro("id", &ConvAlgorithm::id)
      .def_ro("name", &ConvAlgorithm::name)
      .def_ro("supported", &ConvAlgorithm::supported)
      .def_ro("reason", &ConvAlgorithm::reason)
      .def_ro("workspace_bytes", &ConvAlgorithm::workspace_bytes)
      .def_ro("deterministic", &ConvAlgorithm::deterministic)
      .def("__repr__", [](const ConvAlgorithm& a) {
        return "ConvAlgorithm(id=" + std::to_string(a.id) + ", name='" + a.name +
               "', supported=" + (a.supported ? "True" : "False") + ", reason='" + a.reason +
               "', workspace_bytes=" + std::to_string(a.workspace_bytes) +
               ", deterministic=" + (a.deterministic ? "True" : "False") + ")";
      });
}

void DefinePlans(nb::module_& m) {
  m.def("current_device", &CurrentDevice);

  m.def(
      "attention_unsupported",
      [](const std::string& dtype, const AttentionShape& s) -> std::optional<std::string> {
        auto t = DTypeNamed(dtype);
        const char* why =
            t ? jax_dnn::AttentionUnsupported(*t, s) : "the kernels take bfloat16 or float16";
        if (why == nullptr) return std::nullopt;
        return std::string(why);
      },
      "dtype"_a, "shape"_a);
  m.def(
      "attention_fwd_kernel",
      [](const AttentionShape& s, const AttentionOptions& o) {
        const auto k = jax_dnn::attention::ChooseFwdKernel(s, o);
        return std::make_tuple(k.rows, k.key_tile, k.general);
      },
      "shape"_a, "options"_a);
  m.def("attention_fwd_workspace_elems", &jax_dnn::AttentionFwdWorkspaceElems, "shape"_a,
        "options"_a, "device"_a);
  m.def("attention_bwd_fused_dq", &jax_dnn::AttentionBwdFusedDq, "shape"_a, "options"_a,
        "deterministic"_a);
  m.def("attention_dq_acc_head_elements", &jax_dnn::AttentionDqAccHeadElements, "t"_a, "h"_a);

  m.def("layer_norm_bwd_parts", &jax_dnn::LayerNormBwdParts, "rows"_a, "param_sets"_a, "width"_a,
        "rms"_a, "device"_a);
  m.def(
      "bias_act_bwd_parts",
      [](int64_t rows, int64_t param_sets, int64_t width, const std::string& dtype,
         const DeviceProps& device) {
        return jax_dnn::BiasActBwdParts(rows, param_sets, width, KernelDType(dtype), device);
      },
      "rows"_a, "param_sets"_a, "width"_a, "dtype"_a, "device"_a);
  m.def(
      "batch_norm_parts",
      [](int64_t rows, int64_t param_sets, int64_t width, const std::string& dtype,
         const DeviceProps& device) {
        return jax_dnn::BatchNormParts(rows, param_sets, width, KernelDType(dtype), device);
      },
      "rows"_a, "param_sets"_a, "width"_a, "dtype"_a, "device"_a);

  nb::class_<jax_dnn::GroupNormPlan>(m, "GroupNormPlan")
      .def_ro("supported", &jax_dnn::GroupNormPlan::supported)
      .def_ro("by_default", &jax_dnn::GroupNormPlan::by_default)
      .def_ro("reason", &jax_dnn::GroupNormPlan::reason)
      .def_ro("vec", &jax_dnn::GroupNormPlan::vec)
      .def_ro("threads_x", &jax_dnn::GroupNormPlan::threads_x)
      .def_ro("threads_y", &jax_dnn::GroupNormPlan::threads_y)
      .def_ro("splits", &jax_dnn::GroupNormPlan::splits)
      .def_ro("apply_rows", &jax_dnn::GroupNormPlan::apply_rows)
      .def_ro("chunk_samples", &jax_dnn::GroupNormPlan::chunk_samples);
  m.def(
      "group_norm_plan",
      [](int64_t n, int64_t spatial, int64_t channels, int64_t groups, const std::string& dtype,
         const DeviceProps& device) {
        return jax_dnn::PlanGroupNorm(n, spatial, channels, groups, KernelDType(dtype), device);
      },
      "n"_a, "spatial"_a, "channels"_a, "groups"_a, "dtype"_a, "device"_a);

  nb::class_<jax_dnn::RnnPlan>(m, "RnnPlan")
      .def_ro("supported", &jax_dnn::RnnPlan::supported)
      .def_ro("reason", &jax_dnn::RnnPlan::reason)
      .def_ro("by_default", &jax_dnn::RnnPlan::by_default)
      .def_ro("variant", &jax_dnn::RnnPlan::variant)
      .def_ro("units", &jax_dnn::RnnPlan::units)
      .def_ro("streamed", &jax_dnn::RnnPlan::streamed)
      .def_ro("global_state", &jax_dnn::RnnPlan::global_state)
      .def_ro("blocks", &jax_dnn::RnnPlan::blocks)
      .def_ro("directions", &jax_dnn::RnnPlan::directions)
      .def_ro("fwd_workspace_bytes", &jax_dnn::RnnPlan::fwd_workspace_bytes)
      .def_ro("bwd_workspace_bytes", &jax_dnn::RnnPlan::bwd_workspace_bytes)
      .def_ro("fwd_smem_bytes", &jax_dnn::RnnPlan::fwd_smem_bytes)
      .def_ro("bwd_smem_bytes", &jax_dnn::RnnPlan::bwd_smem_bytes)
      .def("__repr__", [](const jax_dnn::RnnPlan& p) {
        return "RnnPlan(supported=" + std::string(p.supported ? "True" : "False") +
               ", reason='" + p.reason + "', variant=" + std::to_string(p.variant) +
               ", units=" + std::to_string(p.units) +
               ", streamed=" + (p.streamed ? "True" : "False") +
               ", global_state=" + (p.global_state ? "True" : "False") +
               ", blocks=" + std::to_string(p.blocks) +
               ", directions=" + std::to_string(p.directions) +
               ", fwd_workspace_bytes=" + std::to_string(p.fwd_workspace_bytes) +
               ", bwd_workspace_bytes=" + std::to_string(p.bwd_workspace_bytes) + ")";
      });
  m.def(
      "rnn_plan",
      [](const std::string& kind, const std::string& dtype, int64_t seq_len, int64_t batch,
         int64_t hidden, const DeviceProps& device, int64_t directions) {
        const jax_dnn::RnnKind k = RnnKindNamed(kind);
        auto t = DTypeNamed(dtype);
        if (!t) {
          jax_dnn::RnnPlan plan;
          plan.reason = "the kernels take bfloat16, float16 or float32, not " + dtype;
          return plan;
        }
        return jax_dnn::PlanRnn(k, *t, seq_len, batch, hidden, device, directions);
      },
      "kind"_a, "dtype"_a, "seq_len"_a, "batch"_a, "hidden"_a, "device"_a, "directions"_a = 1);
  // (fwd, bwd) workspace bytes of any variant id: lets a check run each
  // variant, not only the one the plan picks.
  m.def(
      "rnn_variant_workspace_bytes",
      [](const std::string& kind, const std::string& dtype, int64_t batch, int64_t hidden,
         int variant) {
        const jax_dnn::RnnVariant v = jax_dnn::RnnVariantById(variant);
        if (v.units == 0) throw nb::value_error("rnn_variant_workspace_bytes: no such variant");
        const jax_dnn::RnnLayout l =
            jax_dnn::RnnLayoutFor(RnnKindNamed(kind), KernelDType(dtype), batch, hidden, v);
        return std::make_tuple(l.fwd_workspace_bytes, l.bwd_workspace_bytes);
      },
      "kind"_a, "dtype"_a, "batch"_a, "hidden"_a, "variant"_a);

  m.def("conv_algorithms", &jax_dnn::ConvAlgorithms, "problem"_a, "device"_a);
  m.def("conv_plan", &jax_dnn::ConvPlan, "problem"_a, "deterministic"_a, "device"_a);

#ifdef JAX_DNN_WITH_CUDA
  // One entry per id: the median milliseconds (float), or why that
  // algorithm could not run (str). Raises RuntimeError where nothing could
  // be timed (no device, out of memory). The GIL is released while the
  // device works.
  m.def(
      "conv_benchmark",
      [](const ConvProblem& problem, const std::vector<int>& algorithm_ids, int repeats) {
        const ConvProblem copy = problem;
        std::vector<jax_dnn::ConvTiming> timings;
        std::string error;
        {
          nb::gil_scoped_release release;
          error = jax_dnn::ConvBenchmark(copy, algorithm_ids, repeats, &timings);
        }
        if (!error.empty()) throw std::runtime_error("conv_benchmark: " + error);
        nb::list out;
        for (const jax_dnn::ConvTiming& t : timings) {
          if (t.error.empty())
            out.append(nb::float_(t.ms));
          else
            out.append(nb::str(t.error.c_str()));
        }
        return out;
      },
      "problem"_a, "algorithm_ids"_a, "repeats"_a = 10);
#endif
  m.def(
      "pool_global_parts",
      [](int64_t n, int64_t c, int64_t spatial, int64_t outputs, bool adaptive,
         const std::string& dtype, const DeviceProps& device) {
        return jax_dnn::PoolGlobalParts(n, c, spatial, outputs, adaptive, KernelDType(dtype),
                                        device);
      },
      "n"_a, "c"_a, "spatial"_a, "outputs"_a, "adaptive"_a, "dtype"_a, "device"_a);
}

// CMake passes the build's CUDA architectures and nvcc version unquoted.
#define JAX_DNN_STRING(...) #__VA_ARGS__
#define JAX_DNN_EXPAND_STRING(...) JAX_DNN_STRING(__VA_ARGS__)

nb::dict BuildInfo() {
  nb::dict info;
#ifdef JAX_DNN_WITH_CUDA
  info["cuda"] = true;
  info["cuda_architectures"] = JAX_DNN_EXPAND_STRING(JAX_DNN_BUILT_CUDA_ARCHS);
  info["nvcc"] = JAX_DNN_EXPAND_STRING(JAX_DNN_BUILT_NVCC_VERSION);
#ifdef JAX_DNN_CONV_IGEMM_NOT_BUILT
  info["implicit_gemm_conv"] = false;
#else
  info["implicit_gemm_conv"] = true;
#endif
#else
  info["cuda"] = false;
#endif
  return info;
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
  m.def("build_info", &BuildInfo);
  DefinePlanTypes(m);
  DefineConvTypes(m);
  DefinePlans(m);
}
