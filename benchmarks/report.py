"""Turns bench_ops.py JSON files into the markdown table of RESULTS.md.

Usage: python benchmarks/report.py benchmarks/results/<file>.json[:op,op] [...]
With several files (runs of different ops, e.g. `bench_ops.py --ops ...`),
their rows are listed in order, and each file's copy bandwidth is given;
`:op,op` after a file keeps only those ops' rows of it.
"""

import json
import sys


def main(paths):
  runs = []  # (file name, its data)
  for arg in paths:
    path, _, keep = arg.partition(":")
    with open(path) as f:
      data = json.load(f)
    if keep:
      data["results"] = [r for r in data["results"] if r["op"] in keep.split(",")]
    runs.append((path.split("/")[-1], data))
  for name, data in runs:
    meta = data["meta"]
    ops = ", ".join(dict.fromkeys(r["op"] for r in data["results"]))
    print(f"- {meta['device']}, jax {meta['jax']}, {meta['date']}; copy bandwidth "
          f"{meta['copy_gbs']:.0f} GB/s (bytes read + written); {ops}: `{name}`.")
  print()
  print("| op | shape | dtype | mode | ours GB/s | % of copy | XLA GB/s | ours / XLA |")
  print("|---|---|---|---|---:|---:|---:|---:|")
  for r in (r for _, data in runs for r in data["results"]):
    shape = "×".join(map(str, r["shape"]))
    print(f"| {r['op']} | {shape} | {r['dtype']} | {r['mode']} | {r['ours_gbs']:.0f} | "
          f"{100 * r['ours_copy_frac']:.0f}% | {r['xla_gbs']:.0f} | {r['speedup']:.2f}× |")


if __name__ == "__main__":
  main(sys.argv[1:])
