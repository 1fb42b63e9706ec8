"""GELU (tanh form) and bias + GELU: jax_dnn's kernels against XLA's fusion
of jax.nn.gelu (in fp32, rounded to x's dtype), in GB/s."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

import jax_dnn
from jax_dnn.benchmark import rowwise


def xla_gelu(x):
  return jax.nn.gelu(x.astype(jnp.float32)).astype(x.dtype)


def xla_bias_gelu(x, bias):
  return jax.nn.gelu(x.astype(jnp.float32) + bias).astype(x.dtype)


# name -> (ours, xla, number of per-feature parameters)
OPS = {
    "gelu": (jax_dnn.gelu, xla_gelu, 0),
    "bias_act(gelu)": (functools.partial(jax_dnn.bias_act, activation="gelu_tanh"),
                       xla_bias_gelu, 1),
}

# gelu is elementwise: past W = 8192 the row length changes nothing. bias_act
# broadcasts its bias along the row, so it runs every width.
FAMILY = rowwise.family("activations", OPS, max_width={"gelu": 8192})
