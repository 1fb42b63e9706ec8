"""`python -m jax_dnn.benchmark`: jax_dnn's kernels beside XLA (and cuDNN where
JAX reaches it), one op family per module.

A family is one module here that defines `FAMILY`, a `harness.Family`: its
cases (the full sweep and the --quick subset), how to build one case's inputs
and each implementation's function, its unit (GB/s or TFLOP/s, or ms where
the time itself is the measure) and the measured ceiling its rates are a
fraction of (copy bandwidth or matmul rate; none for a time).
A new family (convolutions, pooling, recurrent nets) adds that module and one
line to FAMILIES below. Family modules import JAX and jax_dnn; they are
imported only when they run, so `--help` and name checks stay light.
"""

from __future__ import annotations

import importlib

# name -> (module defining FAMILY, what it compares); the CLI's default order.
FAMILIES = {
    "activations": ("jax_dnn.benchmark.activations", "gelu and bias_act vs XLA, GB/s"),
    "softmax": ("jax_dnn.benchmark.softmax", "softmax and log_softmax vs XLA, GB/s"),
    "norms": ("jax_dnn.benchmark.norms", "layer_norm and rms_norm vs XLA, GB/s"),
    "attention": ("jax_dnn.benchmark.attention",
                  "dot_product_attention vs cuDNN and XLA, TFLOP/s"),
    "conv": ("jax_dnn.benchmark.conv",
             "convolutions (fwd, dgrad, wgrad), fused conv and matmul vs XLA/cuDNN, TFLOP/s"),
    "pooling": ("jax_dnn.benchmark.pooling",
                "max/avg/adaptive/global pooling vs Flax/XLA, GB/s"),
    "batch_norm": ("jax_dnn.benchmark.batch_norm",
                   "batch norm + ReLU (training) vs flax.nnx.BatchNorm + relu, GB/s"),
    "group_norm": ("jax_dnn.benchmark.group_norm",
                   "group norm + SiLU and instance norm vs flax.nnx, GB/s"),
    "rnn": ("jax_dnn.benchmark.rnn",
            "lstm/gru/rnn vs cuDNN (jax.experimental.rnn) and a lax.scan, ms"),
    "models": ("jax_dnn.benchmark.models",
               "examples/ training steps, jax_dnn vs Flax/XLA, 1 and all GPUs, ms "
               "(JAX_DNN_BENCH_MODELS=cnn,unet,lstm_lm,transformer; JAX_DNN_EXAMPLES=DIR)"),
}


def select(names) -> list[str]:
  """The families to run, in the order named (repeats dropped); all when `names` is empty.

  Raises ValueError naming any unknown family and the known ones.
  """
  names = list(names)
  unknown = [n for n in names if n not in FAMILIES]
  if unknown:
    raise ValueError(f"unknown benchmark famil{'y' if len(unknown) == 1 else 'ies'} "
                     f"{', '.join(map(repr, unknown))}; choose from {', '.join(FAMILIES)}")
  return list(dict.fromkeys(names)) if names else list(FAMILIES)


def load(name: str):
  """The `harness.Family` of a registered family (imports its module)."""
  module = importlib.import_module(FAMILIES[name][0])
  return module.FAMILY
