"""How far two fwd_trace dumps (bf16 o, then fp32 lse) are apart: fwd_ab.sh
prints this for a variant whose output is not byte-identical to the first's
(a different summation order, as the split tail's)."""
import sys

import numpy as np

a, b, name = sys.argv[1:4]
x, y = np.fromfile(a, np.uint8), np.fromfile(b, np.uint8)
if x.size != y.size:
  sys.exit(f"{name}: dumps differ in size")
# o (bf16, D elements a row) comes first, then lse (fp32, one a row).
d = int(sys.argv[4]) if len(sys.argv) > 4 else 128
n_lse = x.size // (2 * d + 4)
o_bytes = 2 * d * n_lse


def parts(z):
  o = (z[:o_bytes].view(np.uint16).astype(np.uint32) << 16).view(np.float32)
  return o, z[o_bytes:].view(np.float32)


(ox, lx), (oy, ly) = parts(x), parts(y)
print(f"{name} DIFFERS: o max |diff| {np.max(np.abs(ox - oy)):.3g} (max |o| {np.max(np.abs(ox)):.3g}, "
      f"{np.mean(ox != oy):.2%} of elements), lse max |diff| {np.max(np.abs(lx - ly)):.3g}")
