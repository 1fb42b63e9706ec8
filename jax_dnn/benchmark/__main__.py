"""python -m jax_dnn.benchmark [FAMILY ...] [--quick] [--out DIR]

Times jax_dnn's kernels beside XLA (and cuDNN where JAX reaches it) on the
first CUDA device, one family of ops after another; prints a table per
family and writes DIR/<family>.json and DIR/<family>.png. The method is in
jax_dnn/benchmark/harness.py.
"""

from __future__ import annotations

import argparse
import os
import sys

from jax_dnn import benchmark


def parse_args(argv=None):
  ap = argparse.ArgumentParser(
      prog="python -m jax_dnn.benchmark",
      description="jax_dnn's kernels beside XLA and cuDNN: a table, JSON and a plot per family.",
      epilog="families:\n" + "\n".join(f"  {name:12s} {what}"
                                        for name, (_, what) in benchmark.FAMILIES.items()),
      formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("families", nargs="*", metavar="FAMILY",
                  help="families to run (default: all, in the order listed below)")
  ap.add_argument("--quick", action="store_true",
                  help="a few cases per family: the 16384x4096 bf16 headline and one odd "
                       "width; attention at D=128, S=2048 and 8192; conv: four layers, one "
                       "fused conv and one matmul, fwd and fwd+bwd")
  ap.add_argument("--out", default="bench_out",
                  help="directory for <family>.json and <family>.png (default: bench_out)")
  args = ap.parse_args(argv)
  try:
    args.families = benchmark.select(args.families)
  except ValueError as e:
    ap.error(str(e))
  return args


def main(argv=None) -> int:
  args = parse_args(argv)
  import jax  # pylint: disable=g-import-not-at-top
  import jax_dnn  # pylint: disable=g-import-not-at-top
  from jax_dnn.benchmark import harness, report  # pylint: disable=g-import-not-at-top

  prog = "jax_dnn.benchmark"
  try:
    device = jax.devices("cuda")[0]
  except RuntimeError:
    print(f"{prog}: no CUDA device visible to JAX (backend: {jax.default_backend()}); "
          "nothing to measure.")
    return 0
  if not jax_dnn.has_cuda_kernels():
    print(f"{prog}: this jax_dnn was built without its CUDA kernels, so 'ours' would time the "
          "reference path; rebuild with `JAX_DNN_CUDA=ON pip install .` (needs nvcc).",
          file=sys.stderr)
    return 1
  if os.environ.get("JAX_DNN_IMPL", "auto").lower() == "reference":
    print(f"{prog}: JAX_DNN_IMPL=reference routes every op to the reference path, so 'ours' "
          "would not be our kernels; unset it.", file=sys.stderr)
    return 1
  note = report.extras_note()
  if note:
    print(f"{prog}: {note}")
  with jax.default_device(device):
    return harness.run(args.families, quick=args.quick, out=args.out)


if __name__ == "__main__":
  sys.exit(main())
