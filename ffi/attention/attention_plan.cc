// The attention kernels' plans: see attention_plan.h. Every choice here is
// also the launchers' (attention_fwd_launch.cuh, attention_bwd_launch.cuh).
#include "ffi/attention/attention_plan.h"

namespace jax_dnn {
namespace attention {

bool NeedsGeneral(const AttentionOptions& o) {
  return o.softcap != 0.f || o.bias || o.mask || o.segments;
}

bool FwdNeedsGeneral(const AttentionOptions& o) { return NeedsGeneral(o) || !(o.scale > 0.f); }

bool FwdUniformKeys(const AttentionOptions& o) {
  return !o.causal && o.window_left < 0 && o.window_right < 0 && !o.q_lens && !o.kv_lens;
}

namespace {

// Where the 192-row kernel (attention_fwd_wide.cuh, head dims d = Dv = 128
// or 64, every tile seeing the same keys) runs: at 128 from 2048 keys and
// queries (its time against the 128-row kernel, H200, T = S, 16 heads:
// 0.945 at S = 2048, 0.878 at 3072, 0.972 at 4096; 0.996 at 1024, so not
// taken there), at 64 from 512 (0.89-0.98 at S = 512-4096, H100). Measured
// with T = S only: with few queries a 192-row tile wastes more rows than a
// 128-row one, so shorter T keeps the 128-row kernel.
bool FwdWideTakes(int d, int64_t s, int64_t t) {
  return d == 64 ? s >= 512 && t >= 512 : s >= 2048 && t >= 2048;
}

}  // namespace

FwdKernel ChooseFwdKernel(const AttentionShape& s, const AttentionOptions& o) {
  const int d = PadDim(s.h), dv = PadDim(s.hv);
  const bool general = FwdNeedsGeneral(o);
  // 64-key tiles past head dims 128 keep Q, two K and two V stages within
  // shared memory.
  if (d > 128 || dv > 128) return {128, 64, general};
  if (general) return {128, 128, true};
  if (d == dv && (d == 128 || d == 64) && FwdUniformKeys(o) && FwdWideTakes(d, s.s, s.t))
    return {192, 128, false};
  // 176-key tiles where rows see every key of a long sequence; 128 keys
  // otherwise. With a causal mask or a window, 128 keys match the 128-row
  // tiles and waste less at the diagonal. Without one, 128 keys are faster
  // up to S = 4096 and 176 beyond (H200, B*S = 16384, ratio to cuDNN at
  // D = 128, 128 -> 176 keys: 0.99 -> 0.92 at S = 2048, 0.98 -> 1.00 at 16384).
  const bool banded = o.causal || o.window_left >= 0 || o.window_right >= 0;
  return {128, banded || s.s <= 4096 ? 128 : 176, false};
}

// The split's fixed costs (a piece's pipeline start, the combine: 9 us at
// D = 128, 18 at 256) beat what it saves below 32 key tiles a work tile or
// at Hv = 256 (H200: 1.5% slower at D = 128, S = 2048; 1.5-3.5% faster at
// D = 128, S >= 4096 and at D = 64, S = 8192).
bool FwdSplitPays(int dv, int64_t key_tiles) { return dv <= 128 && key_tiles >= 32; }

}  // namespace attention

const char* AttentionUnsupported(DType dtype, const AttentionShape& s) {
  if (dtype != DType::kBF16 && dtype != DType::kF16) return "the kernels take bfloat16 or float16";
  bool dims = s.h % 8 == 0 && s.hv % 8 == 0;  // TMA's 16-byte strides
  bool listed = false;
  for (const attention::HeadDims& hd : attention::kHeadDims)
    listed |= attention::PadDim(s.h) == hd.d && attention::PadDim(s.hv) == hd.dv;
  if (!dims || !listed)
    return "head dims have no kernel (multiples of 8, padded to 64/128/192/256, or 192/128)";
  if (s.b <= 0 || s.t <= 0 || s.s <= 0 || s.n <= 0 || s.kh <= 0) return "empty shapes have no kernel";
  if (s.t >= (int64_t{1} << 31) - 256 || s.s >= (int64_t{1} << 31) - 256)
    return "sequence lengths must be below 2^31 - 256";
  return nullptr;
}

int64_t AttentionFwdWorkspaceElems(const AttentionShape& s, const AttentionOptions& o,
                                   const DeviceProps& device) {
  const attention::FwdKernel k = attention::ChooseFwdKernel(s, o);
  const int dv = attention::PadDim(s.hv);
  const int64_t key_tiles = (s.s + k.key_tile - 1) / k.key_tile;
  const int64_t tiles = (s.t + k.rows - 1) / k.rows * s.n * s.b;
  if (k.general || !attention::FwdUniformKeys(o) || !attention::FwdSplitPays(dv, key_tiles) ||
      device.sm_count <= 0 || tiles <= device.sm_count)
    return 0;
  return attention::FwdSplitElems(device.sm_count, k.rows, dv);
}

bool AttentionFusedDqSupported(const AttentionShape& s, const AttentionOptions& o) {
  const int d = attention::PadDim(s.h);
  return (d == 64 || d == 128) && attention::PadDim(s.hv) == d && !attention::NeedsGeneral(o);
}

bool AttentionBwdFusedDq(const AttentionShape& s, const AttentionOptions& o, bool deterministic) {
  return !deterministic && AttentionFusedDqSupported(s, o);
}

int64_t AttentionDqAccHeadElements(int64_t t, int64_t h) {
  const int d = attention::PadDim(h);
  const int64_t rows = attention::DqTileRows(d);
  return (t + rows - 1) / rows * rows * d;
}

int64_t AttentionDqAccElements(const AttentionShape& s) {
  return s.b * s.n * AttentionDqAccHeadElements(s.t, s.h);
}

}  // namespace jax_dnn
