"""Turns a bench_ops.py JSON file into the markdown table of RESULTS.md.

Usage: python benchmarks/report.py benchmarks/results/<file>.json
"""

import json
import sys


def main(path):
  with open(path) as f:
    data = json.load(f)
  meta = data["meta"]
  print(f"{meta['device']}, jax {meta['jax']}, {meta['date']}; copy bandwidth "
        f"{meta['copy_gbs']:.0f} GB/s (bytes read + written).\n")
  print("| op | shape | dtype | mode | ours GB/s | % of copy | XLA GB/s | ours / XLA |")
  print("|---|---|---|---|---:|---:|---:|---:|")
  for r in data["results"]:
    shape = "×".join(map(str, r["shape"]))
    print(f"| {r['op']} | {shape} | {r['dtype']} | {r['mode']} | {r['ours_gbs']:.0f} | "
          f"{100 * r['ours_copy_frac']:.0f}% | {r['xla_gbs']:.0f} | {r['speedup']:.2f}× |")


if __name__ == "__main__":
  main(sys.argv[1])
