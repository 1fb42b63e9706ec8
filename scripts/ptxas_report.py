"""Compiles one CUDA source for sm_90a with ptxas's resource report and prints,
per kernel, what would cost performance silently: register spills and the
wgmma notes (C7514: wgmmas serialized, e.g. by wait counts chosen at run time
or accumulators read while in flight; C7518: serialized by a wait the compiler
put in a divergent path, e.g. paths that join with different wgmmas in
flight; C7517/C7519: waits/fences the compiler injected). Runs without a GPU (nvcc only), from the repository root:

  python3 scripts/ptxas_report.py ffi/attention/attention_bwd_bf16.cu

Exit status 1 when any kernel's wgmmas are serialized (C7514, C7518).
"""

import re
import subprocess
import sys


def main():
  src = sys.argv[1]
  cmd = ["nvcc", "-std=c++17", "-gencode", "arch=compute_90a,code=sm_90a", "-I.",
         "--expt-relaxed-constexpr", "-Xptxas=-v,-warn-spills", "-c", src, "-o", "/dev/null"]
  r = subprocess.run(cmd, capture_output=True, text=True)
  if r.returncode:
    print(r.stderr[-4000:])
    return r.returncode
  current, notes = None, {}
  for line in r.stderr.splitlines():
    m = re.search(r"(?:Compiling entry function|in function) '(_Z\w+)'", line)
    if m:
      notes.setdefault(m.group(1), set())
      if "Compiling entry" in line:
        current = m.group(1)
      code = re.search(r"\((C75\d\d)\)", line)
      if code:
        notes[m.group(1)].add(code.group(1))
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)
    if spill and current and spill.groups() != ("0", "0"):
      notes[current].add(f"spill {spill.group(1)}/{spill.group(2)} B")
  serialized = False
  for fn, what in sorted(notes.items()):
    name = re.sub(r"EEv.*$", "EE", re.sub(r"^_ZN7jax_dnn(9attention)?\d*", "", fn))  # readable enough
    print(f"{name[:90]:90s} {' '.join(sorted(what)) or 'clean'}")
    serialized |= "C7514" in what or "C7518" in what
  return 1 if serialized else 0


if __name__ == "__main__":
  sys.exit(main())
