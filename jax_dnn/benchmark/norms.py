"""Layer norm and RMS norm: jax_dnn's kernels against XLA's fusion of the
same math (statistics in fp32, epsilon 1e-5), in GB/s."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

import jax_dnn
from jax_dnn.benchmark import rowwise

EPSILON = 1e-5


def xla_layer_norm(x, scale, bias):
  xf = x.astype(jnp.float32)
  mean = jnp.mean(xf, -1, keepdims=True)
  var = jnp.mean(jnp.square(xf - mean), -1, keepdims=True)
  return ((xf - mean) * jax.lax.rsqrt(var + EPSILON) * scale + bias).astype(x.dtype)


def xla_rms_norm(x, scale):
  xf = x.astype(jnp.float32)
  return (xf * jax.lax.rsqrt(jnp.mean(xf * xf, -1, keepdims=True) + EPSILON)
          * scale).astype(x.dtype)


# name -> (ours, xla, number of per-feature parameters)
OPS = {
    "layer_norm": (functools.partial(jax_dnn.layer_norm, epsilon=EPSILON), xla_layer_norm, 2),
    "rms_norm": (functools.partial(jax_dnn.rms_norm, epsilon=EPSILON), xla_rms_norm, 1),
}

FAMILY = rowwise.family("norms", OPS)
