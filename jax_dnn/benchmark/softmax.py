"""Softmax and log-softmax over the last axis: jax_dnn's kernels against
XLA's fusion of jax.nn's (in fp32, rounded to x's dtype), in GB/s."""

from __future__ import annotations

import jax
import jax.numpy as jnp

import jax_dnn
from jax_dnn.benchmark import rowwise


def xla_softmax(x):
  return jax.nn.softmax(x.astype(jnp.float32), axis=-1).astype(x.dtype)


def xla_log_softmax(x):
  return jax.nn.log_softmax(x.astype(jnp.float32), axis=-1).astype(x.dtype)


# name -> (ours, xla, number of per-feature parameters)
OPS = {
    "softmax": (jax_dnn.softmax, xla_softmax, 0),
    "log_softmax": (jax_dnn.log_softmax, xla_log_softmax, 0),
}

FAMILY = rowwise.family("softmax", OPS)
