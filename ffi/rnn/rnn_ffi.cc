// XLA FFI handlers for the recurrence (rnn.h): decode -> validate -> launch.
// Letters as in rnn.h, D the directions (w_hh [D G H, H] gives them); the
// float operands have w_hh's dtype.
#include <string>

#include "ffi/common/ffi_util.h"
#include "ffi/rnn/rnn.h"

namespace jax_dnn {
namespace {

bool DimsAre(const ffi::AnyBuffer& b, std::initializer_list<int64_t> want) {
  auto d = b.dimensions();
  if (d.size() != want.size()) return false;
  size_t i = 0;
  for (int64_t w : want)
    if (d[i++] != w) return false;
  return true;
}

template <typename Buf>
bool CountIs(const Buf& b, int64_t n) {
  return static_cast<int64_t>(b.element_count()) == n;
}

struct Problem {
  RnnKind kind;
  DType dtype;
  int64_t t, b, h, d;
  RnnLayout layout;  // a direction's
};

// kind, reverse, variant; w_hh [D G H, H] gives H and D; the layout of the
// variant.
ffi::Error CheckProblem(const std::string& op, const ffi::AnyBuffer& w_hh, int64_t t, int64_t b,
                        int64_t kind, int64_t reverse, int64_t variant, Problem* pr) {
  if (kind < 0 || kind > 3)
    return InvalidArgument(op + ": kind must be 0 (LSTM), 1 (GRU), 2 (RNN tanh) or 3 (RNN relu)");
  if (reverse != 0 && reverse != 1) return InvalidArgument(op + ": reverse must be 0 or 1");
  auto dtype = ToDType(w_hh.element_type());
  if (!dtype) return InvalidArgument(op + ": w_hh must be float32, bfloat16 or float16");
  pr->kind = static_cast<RnnKind>(kind);
  pr->dtype = *dtype;
  const int64_t g = RnnGates(pr->kind);
  auto wd = w_hh.dimensions();
  if (wd.size() != 2 || wd[1] < 1 || (wd[0] != g * wd[1] && wd[0] != 2 * g * wd[1]))
    return InvalidArgument(op + ": w_hh must be [D * G * H, H] (G = " + std::to_string(g) +
                           ", D = 1 or 2 directions)");
  pr->t = t;
  pr->b = b;
  pr->h = wd[1];
  pr->d = wd[0] / (g * wd[1]);
  if (pr->d == 2 && reverse != 0)
    return InvalidArgument(op +
                           ": reverse must be 0 with two directions (the second runs reversed)");
  if (t < 1 || b < 1) return InvalidArgument(op + ": seq_len and batch must be positive");
  const RnnVariant v = RnnVariantById(static_cast<int>(variant));
  if (variant < 0 || v.units == 0)
    return InvalidArgument(op + ": variant must be an rnn_plan variant id (0-" +
                           std::to_string(kRnnVariantCount - 1) + ")");
  pr->layout = RnnLayoutFor(pr->kind, pr->dtype, b, pr->h, v);
  if (pr->layout.fwd_smem_bytes > kRnnMaxSmemBytes || pr->layout.bwd_smem_bytes > kRnnMaxSmemBytes)
    return InvalidArgument(op + ": the variant's shared memory exceeds the device's; use rnn_plan");
  return ffi::Error::Success();
}

// An operand of D: same dtype as w_hh and the given dims.
ffi::Error CheckD(const std::string& op, const char* name, const ffi::AnyBuffer& x,
                  const Problem& pr, std::initializer_list<int64_t> dims) {
  if (ToDType(x.element_type()) != pr.dtype || !DimsAre(x, dims)) {
    std::string shape;
    for (int64_t d : dims) shape += (shape.empty() ? "[" : ", ") + std::to_string(d);
    return InvalidArgument(op + ": " + name + " must have w_hh's dtype and shape " + shape + "]");
  }
  return ffi::Error::Success();
}

// c0 / c_n / dc_n: [B, D * H] for the LSTM, empty otherwise.
ffi::Error CheckCell(const std::string& op, const char* name, const ffi::AnyBuffer& x,
                     const Problem& pr) {
  if (pr.kind == RnnKind::kLstm) return CheckD(op, name, x, pr, {pr.b, pr.d * pr.h});
  if (x.element_count() != 0)
    return InvalidArgument(op + ": " + name + " must be empty ([0]) for GRU and RNN");
  return ffi::Error::Success();
}

ffi::Error RnnFwdImpl(cudaStream_t stream, ffi::AnyBuffer gx, ffi::AnyBuffer w_hh,
                      ffi::AnyBuffer b_hh, ffi::AnyBuffer h0, ffi::AnyBuffer c0,
                      ffi::Buffer<ffi::S32> seq_lengths, ffi::Result<ffi::AnyBuffer> y,
                      ffi::Result<ffi::AnyBuffer> h_n, ffi::Result<ffi::AnyBuffer> c_n,
                      ffi::ResultBuffer<ffi::F32> states, ffi::ResultBuffer<ffi::U8> workspace,
                      int64_t kind, int64_t reverse, int64_t variant) {
  const std::string op = "jax_dnn_rnn_fwd";
  auto xd = gx.dimensions();
  if (xd.size() != 3) return InvalidArgument(op + ": gx must be [T, B, D * G * H]");
  Problem pr{};
  if (ffi::Error e = CheckProblem(op, w_hh, xd[0], xd[1], kind, reverse, variant, &pr); e.failure())
    return e;
  const int64_t g = RnnGates(pr.kind), s = RnnStateSlots(pr.kind), dh = pr.d * pr.h;
  if (ffi::Error e = CheckD(op, "gx", gx, pr, {pr.t, pr.b, g * dh}); e.failure()) return e;
  if (ffi::Error e = CheckD(op, "b_hh", b_hh, pr, {g * dh}); e.failure()) return e;
  if (ffi::Error e = CheckD(op, "h0", h0, pr, {pr.b, dh}); e.failure()) return e;
  if (ffi::Error e = CheckCell(op, "c0", c0, pr); e.failure()) return e;
  if (seq_lengths.dimensions().size() != 1 || seq_lengths.dimensions()[0] != pr.b)
    return InvalidArgument(op + ": seq_lengths must be int32 [B]");
  if (ffi::Error e = CheckD(op, "y", *y, pr, {pr.t, pr.b, dh}); e.failure()) return e;
  if (ffi::Error e = CheckD(op, "h_n", *h_n, pr, {pr.b, dh}); e.failure()) return e;
  if (ffi::Error e = CheckCell(op, "c_n", *c_n, pr); e.failure()) return e;
  if (!CountIs(*states, pr.t * pr.b * s * dh) || states->dimensions().size() != 4)
    return InvalidArgument(op + ": states must be float32 [T, B, S, D * H] (S = " +
                           std::to_string(s) + ")");
  if (static_cast<int64_t>(workspace->element_count()) < pr.d * pr.layout.fwd_workspace_bytes)
    return InvalidArgument(op + ": workspace must hold rnn_plan's fwd_workspace_bytes (" +
                           std::to_string(pr.d * pr.layout.fwd_workspace_bytes) + ")");
  RnnFwdParams p{};
  p.dtype = pr.dtype;
  p.kind = pr.kind;
  p.reverse = reverse != 0;
  p.variant = static_cast<int>(variant);
  p.directions = static_cast<int>(pr.d);
  p.seq_len = pr.t;
  p.batch = pr.b;
  p.hidden = pr.h;
  p.gx = gx.untyped_data();
  p.w_hh = w_hh.untyped_data();
  p.b_hh = b_hh.untyped_data();
  p.h0 = h0.untyped_data();
  p.c0 = c0.untyped_data();
  p.seq_lengths = seq_lengths.typed_data();
  p.y = y->untyped_data();
  p.h_n = h_n->untyped_data();
  p.c_n = c_n->untyped_data();
  p.states = states->typed_data();
  p.workspace = workspace->untyped_data();
  return LaunchStatus(LaunchRnnFwd(p, stream), op.c_str());
}

ffi::Error RnnBwdImpl(cudaStream_t stream, ffi::AnyBuffer dy, ffi::AnyBuffer dh_n,
                      ffi::AnyBuffer dc_n, ffi::AnyBuffer w_hh, ffi::AnyBuffer h0,
                      ffi::AnyBuffer c0, ffi::Buffer<ffi::S32> seq_lengths,
                      ffi::Buffer<ffi::F32> states, ffi::ResultBuffer<ffi::F32> dgx,
                      ffi::ResultBuffer<ffi::F32> dgh_n, ffi::ResultBuffer<ffi::F32> dh0,
                      ffi::ResultBuffer<ffi::F32> dc0, ffi::ResultBuffer<ffi::U8> workspace,
                      int64_t kind, int64_t reverse, int64_t variant) {
  const std::string op = "jax_dnn_rnn_bwd";
  auto yd = dy.dimensions();
  if (yd.size() != 3) return InvalidArgument(op + ": dy must be [T, B, D * H]");
  Problem pr{};
  if (ffi::Error e = CheckProblem(op, w_hh, yd[0], yd[1], kind, reverse, variant, &pr); e.failure())
    return e;
  const int64_t g = RnnGates(pr.kind), s = RnnStateSlots(pr.kind), dh = pr.d * pr.h;
  const bool lstm = pr.kind == RnnKind::kLstm, gru = pr.kind == RnnKind::kGru;
  if (ffi::Error e = CheckD(op, "dy", dy, pr, {pr.t, pr.b, dh}); e.failure()) return e;
  if (ffi::Error e = CheckD(op, "dh_n", dh_n, pr, {pr.b, dh}); e.failure()) return e;
  if (ffi::Error e = CheckCell(op, "dc_n", dc_n, pr); e.failure()) return e;
  if (ffi::Error e = CheckD(op, "h0", h0, pr, {pr.b, dh}); e.failure()) return e;
  if (ffi::Error e = CheckCell(op, "c0", c0, pr); e.failure()) return e;
  if (seq_lengths.dimensions().size() != 1 || seq_lengths.dimensions()[0] != pr.b)
    return InvalidArgument(op + ": seq_lengths must be int32 [B]");
  if (!CountIs(states, pr.t * pr.b * s * dh) || states.dimensions().size() != 4)
    return InvalidArgument(op + ": states must be float32 [T, B, S, D * H] (S = " +
                           std::to_string(s) + ")");
  if (!CountIs(*dgx, pr.t * pr.b * g * dh))
    return InvalidArgument(op + ": dgx must be float32 [T, B, D * G * H]");
  if (!CountIs(*dgh_n, gru ? pr.t * pr.b * dh : 0))
    return InvalidArgument(op + ": dgh_n must be float32 [T, B, D * H] for GRU, [0] otherwise");
  if (!CountIs(*dh0, pr.b * dh)) return InvalidArgument(op + ": dh0 must be float32 [B, D * H]");
  if (!CountIs(*dc0, lstm ? pr.b * dh : 0))
    return InvalidArgument(op + ": dc0 must be float32 [B, D * H] for LSTM, [0] otherwise");
  if (static_cast<int64_t>(workspace->element_count()) < pr.d * pr.layout.bwd_workspace_bytes)
    return InvalidArgument(op + ": workspace must hold rnn_plan's bwd_workspace_bytes (" +
                           std::to_string(pr.d * pr.layout.bwd_workspace_bytes) + ")");
  RnnBwdParams p{};
  p.dtype = pr.dtype;
  p.kind = pr.kind;
  p.reverse = reverse != 0;
  p.variant = static_cast<int>(variant);
  p.directions = static_cast<int>(pr.d);
  p.seq_len = pr.t;
  p.batch = pr.b;
  p.hidden = pr.h;
  p.dy = dy.untyped_data();
  p.dh_n = dh_n.untyped_data();
  p.dc_n = dc_n.untyped_data();
  p.w_hh = w_hh.untyped_data();
  p.h0 = h0.untyped_data();
  p.c0 = c0.untyped_data();
  p.seq_lengths = seq_lengths.typed_data();
  p.states = states.typed_data();
  p.dgx = dgx->typed_data();
  p.dgh_n = dgh_n->typed_data();
  p.dh0 = dh0->typed_data();
  p.dc0 = dc0->typed_data();
  p.workspace = workspace->untyped_data();
  return LaunchStatus(LaunchRnnBwd(p, stream), op.c_str());
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(RnnFwd, RnnFwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()          // gx [T, B, D * G * H]
                                  .Arg<ffi::AnyBuffer>()          // w_hh [D * G * H, H]
                                  .Arg<ffi::AnyBuffer>()          // b_hh [D * G * H]
                                  .Arg<ffi::AnyBuffer>()          // h0 [B, D * H]
                                  .Arg<ffi::AnyBuffer>()          // c0 [B, D * H] (LSTM) or [0]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // seq_lengths [B]
                                  .Ret<ffi::AnyBuffer>()          // y [T, B, D * H]
                                  .Ret<ffi::AnyBuffer>()          // h_n [B, D * H]
                                  .Ret<ffi::AnyBuffer>()          // c_n [B, D * H] (LSTM) or [0]
                                  .Ret<ffi::Buffer<ffi::F32>>()   // states [T, B, S, D * H]
                                  .Ret<ffi::Buffer<ffi::U8>>()    // workspace
                                  .Attr<int64_t>("kind")          // 0 LSTM, 1 GRU, 2 tanh, 3 relu
                                  .Attr<int64_t>("reverse")       // 0 / 1
                                  .Attr<int64_t>("variant"),      // rnn_plan's variant id
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(RnnBwd, RnnBwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()          // dy [T, B, D * H]
                                  .Arg<ffi::AnyBuffer>()          // dh_n [B, D * H]
                                  .Arg<ffi::AnyBuffer>()          // dc_n [B, D * H] (LSTM) or [0]
                                  .Arg<ffi::AnyBuffer>()          // w_hh [D * G * H, H]
                                  .Arg<ffi::AnyBuffer>()          // h0 [B, D * H]
                                  .Arg<ffi::AnyBuffer>()          // c0 [B, D * H] (LSTM) or [0]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // seq_lengths [B]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // states [T, B, S, D * H]
                                  .Ret<ffi::Buffer<ffi::F32>>()   // dgx [T, B, D * G * H]
                                  .Ret<ffi::Buffer<ffi::F32>>()   // dgh_n [T, B, D * H] (GRU), [0]
                                  .Ret<ffi::Buffer<ffi::F32>>()   // dh0 [B, D * H]
                                  .Ret<ffi::Buffer<ffi::F32>>()   // dc0 [B, D * H] (LSTM) or [0]
                                  .Ret<ffi::Buffer<ffi::U8>>()    // workspace
                                  .Attr<int64_t>("kind")
                                  .Attr<int64_t>("reverse")
                                  .Attr<int64_t>("variant"),
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace jax_dnn
