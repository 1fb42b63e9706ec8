// XLA FFI handlers for fused attention: decode -> validate -> launch.
// Operands after q, k, v (forward) or do, q, k, v, o, lse (backward) are the
// optional ones in the order bias, mask, q_lens, kv_lens, q_seg, kv_seg,
// each present when its has_* attribute says so (see _src/attention.py).
// The last results are workspace (attention_plan.h sizes them; Python
// appends them in the CUDA lowering only).
#include <string>

#include "ffi/attention/attention.h"
#include "ffi/common/ffi_util.h"

namespace jax_dnn {
namespace {

constexpr char kFwd[] = "jax_dnn_attention_fwd";
constexpr char kBwd[] = "jax_dnn_attention_bwd";

struct Flags {
  bool bias, mask, q_lens, kv_lens, seg, causal;
  int64_t window_left, window_right;
};

ffi::Error Err(const char* op, const std::string& what) {
  return InvalidArgument(std::string(op) + ": " + what);
}

ffi::Error CheckQkv(const char* op, const ffi::AnyBuffer& q, const ffi::AnyBuffer& k,
                    const ffi::AnyBuffer& v, AttentionShape* s, DType* dtype) {
  auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || vd.size() != 4)
    return Err(op, "query, key and value must be rank 4 [B, T|S, heads, head_dim]");
  auto t = ToDType(q.element_type());
  if (!t || *t == DType::kF32 || k.element_type() != q.element_type() ||
      v.element_type() != q.element_type())
    return Err(op, "query, key and value must share one dtype, bfloat16 or float16");
  *dtype = *t;
  *s = AttentionShape{qd[0], qd[1], kd[1], qd[2], kd[2], qd[3], vd[3]};
  if (kd[0] != s->b || vd[0] != s->b || vd[1] != s->s || vd[2] != s->kh || kd[3] != s->h)
    return Err(op, "key [B, S, K, H] and value [B, S, K, Hv] must match query [B, T, N, H]");
  if (s->kh == 0 || s->n % s->kh != 0) return Err(op, "key/value heads must divide query heads");
  if (const char* why = AttentionUnsupported(*dtype, *s))
    return Err(op, std::string(why) + " (head dims " + std::to_string(s->h) + "/" +
                       std::to_string(s->hv) + ")");
  return ffi::Error::Success();
}

// Decodes the optional operands starting at args[first].
ffi::Error DecodeMask(const char* op, const ffi::RemainingArgs& args, size_t first, const Flags& f,
                      const AttentionShape& s, AttentionMask* m) {
  size_t i = first;
  auto next = [&]() -> ffi::ErrorOr<ffi::AnyBuffer> {
    if (i >= args.size())
      return ffi::Unexpected(Err(op, "missing operand"));
    return args.get<ffi::AnyBuffer>(i++);
  };
  m->causal = f.causal;
  m->window_left = f.window_left;
  m->window_right = f.window_right;
  auto logits_operand = [&](const ffi::AnyBuffer& x, const char* name, int64_t* param_sets,
                            bool* per_head) -> ffi::Error {
    auto d = x.dimensions();
    if (d.size() != 4 || d[0] < 1 || s.b % d[0] != 0 || (d[1] != 1 && d[1] != s.n) ||
        d[2] != s.t || d[3] != s.s)
      return Err(op, std::string(name) + " must be [G, N|1, T, S] with G dividing B");
    *param_sets = d[0];
    *per_head = d[1] == s.n && s.n != 1;
    return ffi::Error::Success();
  };
  if (f.bias) {
    auto x = next();
    if (x.has_error()) return x.error();
    if (x->element_type() != ffi::DataType::F32) return Err(op, "bias must be float32");
    if (auto e = logits_operand(*x, "bias", &m->bias_sets, &m->bias_per_head); e.failure())
      return e;
    m->bias = static_cast<const float*>(x->untyped_data());
  }
  if (f.mask) {
    auto x = next();
    if (x.has_error()) return x.error();
    if (x->element_type() != ffi::DataType::PRED) return Err(op, "mask must be bool");
    if (auto e = logits_operand(*x, "mask", &m->mask_sets, &m->mask_per_head); e.failure())
      return e;
    m->mask = static_cast<const bool*>(x->untyped_data());
  }
  auto ids = [&](int64_t rows, int64_t cols, const char* name, const int32_t** out) -> ffi::Error {
    auto x = next();
    if (x.has_error()) return x.error();
    if (x->element_type() != ffi::DataType::S32 || x->element_count() != rows * cols)
      return Err(op, std::string(name) + " must be int32 of " + std::to_string(rows * cols) +
                         " elements");
    *out = static_cast<const int32_t*>(x->untyped_data());
    return ffi::Error::Success();
  };
  if (f.q_lens)
    if (auto e = ids(s.b, 1, "query_seq_lengths", &m->q_lens); e.failure()) return e;
  if (f.kv_lens)
    if (auto e = ids(s.b, 1, "key_value_seq_lengths", &m->kv_lens); e.failure()) return e;
  if (f.seg) {
    if (auto e = ids(s.b, s.t, "q_segment_ids", &m->q_seg); e.failure()) return e;
    if (auto e = ids(s.b, s.s, "kv_segment_ids", &m->kv_seg); e.failure()) return e;
  }
  if (i != args.size()) return Err(op, "unexpected extra operands");
  return ffi::Error::Success();
}

ffi::Error AttentionFwdImpl(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k,
                            ffi::AnyBuffer v, ffi::RemainingArgs rest,
                            ffi::Result<ffi::AnyBuffer> o, ffi::ResultBuffer<ffi::F32> lse,
                            ffi::ResultBuffer<ffi::F32> ws, bool has_bias, bool has_mask,
                            bool has_q_lens, bool has_kv_lens, bool has_seg, bool is_causal,
                            int64_t window_left, int64_t window_right, float scale,
                            float softcap) {
  AttentionFwdParams p{};
  if (auto e = CheckQkv(kFwd, q, k, v, &p.shape, &p.dtype); e.failure()) return e;
  const Flags f{has_bias, has_mask, has_q_lens, has_kv_lens, has_seg, is_causal, window_left,
                window_right};
  if (auto e = DecodeMask(kFwd, rest, 0, f, p.shape, &p.mask); e.failure()) return e;
  const AttentionShape& s = p.shape;
  if (o->element_type() != q.element_type() || o->element_count() != s.b * s.t * s.n * s.hv ||
      lse->element_count() != s.b * s.n * s.t)
    return Err(kFwd, "outputs must be o [B, T, N, Hv] and lse [B, N, T] float32");
  p.scale = scale;
  p.softcap = softcap;
  p.q = q.untyped_data();
  p.k = k.untyped_data();
  p.v = v.untyped_data();
  p.o = o->untyped_data();
  p.lse = lse->typed_data();
  // The split tail's workspace (AttentionFwdWorkspaceElems); any size is
  // safe (too small for this device: no split).
  p.ws_elems = static_cast<int64_t>(ws->element_count());
  p.ws = p.ws_elems > 0 ? ws->typed_data() : nullptr;
  return LaunchStatus(LaunchAttentionFwd(p, stream), kFwd);
}

ffi::Error AttentionBwdImpl(cudaStream_t stream, ffi::AnyBuffer d_o, ffi::AnyBuffer q,
                            ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer o,
                            ffi::Buffer<ffi::F32> lse, ffi::RemainingArgs rest,
                            ffi::Result<ffi::AnyBuffer> dq, ffi::Result<ffi::AnyBuffer> dk,
                            ffi::Result<ffi::AnyBuffer> dv, ffi::ResultBuffer<ffi::F32> dbias,
                            ffi::ResultBuffer<ffi::F32> delta, ffi::ResultBuffer<ffi::F32> dq_acc,
                            bool has_bias, bool has_mask, bool has_q_lens, bool has_kv_lens,
                            bool has_seg, bool is_causal, int64_t window_left,
                            int64_t window_right, float scale, float softcap, bool fused_dq) {
  AttentionBwdParams p{};
  if (auto e = CheckQkv(kBwd, q, k, v, &p.shape, &p.dtype); e.failure()) return e;
  const Flags f{has_bias, has_mask, has_q_lens, has_kv_lens, has_seg, is_causal, window_left,
                window_right};
  if (auto e = DecodeMask(kBwd, rest, 0, f, p.shape, &p.mask); e.failure()) return e;
  const AttentionShape& s = p.shape;
  const int64_t o_count = s.b * s.t * s.n * s.hv;
  if (d_o.element_type() != q.element_type() || o.element_type() != q.element_type() ||
      d_o.element_count() != o_count || o.element_count() != o_count ||
      lse.element_count() != s.b * s.n * s.t)
    return Err(kBwd, "do and o must be [B, T, N, Hv] of q's dtype, lse [B, N, T] float32");
  if (dq->element_count() != q.element_count() || dk->element_count() != k.element_count() ||
      dv->element_count() != v.element_count() || delta->element_count() != s.b * s.n * s.t ||
      (has_bias && dbias->element_count() != s.b * s.n * s.t * s.s))
    return Err(kBwd, "gradient outputs must match q, k, v; dbias [B, N, T, S]; delta [B, N, T]");
  p.scale = scale;
  p.softcap = softcap;
  p.q = q.untyped_data();
  p.k = k.untyped_data();
  p.v = v.untyped_data();
  p.o = o.untyped_data();
  p.d_o = d_o.untyped_data();
  p.lse = lse.typed_data();
  p.dq = dq->untyped_data();
  p.dk = dk->untyped_data();
  p.dv = dv->untyped_data();
  p.dbias = has_bias ? dbias->typed_data() : nullptr;
  p.delta = delta->typed_data();
  if (fused_dq) {
    if (!AttentionFusedDqSupported(s, OptionsOf(p.mask, p.scale, p.softcap)))
      return Err(kBwd, "fused_dq needs head dims padding to 64/64, or 128/128 without soft-cap, "
                       "mask or segments, and no bias");
    if (dq_acc->element_count() != AttentionDqAccElements(s))
      return Err(kBwd, "dq_acc must hold B * N * ceil(T / R) * R * pad64(H) floats "
                      "(R = 128 at head dim 64, else 64)");
    p.dq_acc = dq_acc->typed_data();
  }
  return LaunchStatus(LaunchAttentionBwd(p, stream), kBwd);
}

}  // namespace

#define JAX_DNN_ATTENTION_ATTRS                                                            \
  .Attr<bool>("has_bias")                                                                  \
      .Attr<bool>("has_mask")                                                              \
      .Attr<bool>("has_q_lens")                                                            \
      .Attr<bool>("has_kv_lens")                                                           \
      .Attr<bool>("has_seg")                                                               \
      .Attr<bool>("is_causal")                                                             \
      .Attr<int64_t>("window_left")                                                        \
      .Attr<int64_t>("window_right")                                                       \
      .Attr<float>("scale")                                                                \
      .Attr<float>("softcap")

XLA_FFI_DEFINE_HANDLER_SYMBOL(AttentionFwd, AttentionFwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()          // q [B, T, N, H]
                                  .Arg<ffi::AnyBuffer>()          // k [B, S, K, H]
                                  .Arg<ffi::AnyBuffer>()          // v [B, S, K, Hv]
                                  .RemainingArgs()                // the optional operands
                                  .Ret<ffi::AnyBuffer>()          // o [B, T, N, Hv]
                                  .Ret<ffi::Buffer<ffi::F32>>()   // lse [B, N, T]
                                  .Ret<ffi::Buffer<ffi::F32>>()   // workspace: the split tail's
                                      JAX_DNN_ATTENTION_ATTRS);

XLA_FFI_DEFINE_HANDLER_SYMBOL(AttentionBwd, AttentionBwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()          // do [B, T, N, Hv]
                                  .Arg<ffi::AnyBuffer>()          // q
                                  .Arg<ffi::AnyBuffer>()          // k
                                  .Arg<ffi::AnyBuffer>()          // v
                                  .Arg<ffi::AnyBuffer>()          // o
                                  .Arg<ffi::Buffer<ffi::F32>>()   // lse [B, N, T]
                                  .RemainingArgs()                // the optional operands
                                  .Ret<ffi::AnyBuffer>()          // dq
                                  .Ret<ffi::AnyBuffer>()          // dk
                                  .Ret<ffi::AnyBuffer>()          // dv
                                  .Ret<ffi::Buffer<ffi::F32>>()   // dlogits [B, N, T, S] (with bias;
                                                                  // else workspace, unused)
                                  .Ret<ffi::Buffer<ffi::F32>>()   // workspace: delta [B, N, T]
                                  .Ret<ffi::Buffer<ffi::F32>>()   // workspace: the fused dQ's fp32
                                                                  // accumulator (else unused)
                                      JAX_DNN_ATTENTION_ATTRS
                                  .Attr<bool>("fused_dq"));       // the single-pass backward

}  // namespace jax_dnn
