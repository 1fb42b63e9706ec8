"""jax_dnn: deep-learning primitives for JAX, backed by our own CUDA kernels.

Every op is a custom-VJP function over JAX primitives that lower to jax_dnn's
CUDA kernels (XLA FFI) on GPUs and to a pure-JAX reference elsewhere, so it
composes with jit, vmap, grad and checkpoint on any platform.
"""

from jax_dnn._src import extension as _extension
from jax_dnn._src.activation import bias_act, gelu, relu, sigmoid, silu, tanh
from jax_dnn._src.attention import dot_product_attention
from jax_dnn._src.batch_norm import batch_norm, batch_norm_inference
from jax_dnn._src.config import config
from jax_dnn._src.fuse.rewrite import fuse
from jax_dnn._src.conv.api import (conv, conv_algorithms, conv_general_dilated, conv_transpose,
                               matmul)
from jax_dnn._src.group_norm import group_norm, instance_norm
from jax_dnn._src.layer_norm import layer_norm, rms_norm
from jax_dnn._src.pooling import (adaptive_avg_pool, adaptive_max_pool, avg_pool, max_pool,
                                  pool_plan)
from jax_dnn._src.rnn.layers import gru, lstm, rnn
from jax_dnn._src.rnn.weights import (get_num_params_in_gru, get_num_params_in_lstm,
                                      get_num_params_in_rnn, init_gru_weight, init_lstm_weight,
                                      init_rnn_weight, pack_rnn_weights, rnn_weights_from_torch,
                                      rnn_weights_to_torch, unpack_gru_weights,
                                      unpack_lstm_weights, unpack_rnn_weights)
from jax_dnn._src.softmax import log_softmax, softmax
from jax_dnn._src.version import __version__


_extension.registered_targets()  # register the CUDA handlers with JAX on import
has_cuda_kernels = _extension.has_cuda_kernels
export_disabled_checks = _extension.export_disabled_checks


def __getattr__(name):
  # `jax_dnn.nn` (the Flax NNX layers) is reachable after `import jax_dnn`, as
  # `jax.nn` is after `import jax`, but Flax is imported only on first use.
  if name == "nn":
    import importlib  # pylint: disable=g-import-not-at-top
    return importlib.import_module("jax_dnn.nn")
  raise AttributeError(f"module 'jax_dnn' has no attribute {name!r}")


def __dir__():
  return sorted(list(globals()) + ["nn"])

__all__ = [
    "adaptive_avg_pool",
    "adaptive_max_pool",
    "avg_pool",
    "batch_norm",
    "batch_norm_inference",
    "bias_act",
    "config",
    "conv",
    "conv_algorithms",
    "conv_general_dilated",
    "conv_transpose",
    "dot_product_attention",
    "export_disabled_checks",
    "fuse",
    "gelu",
    "get_num_params_in_gru",
    "get_num_params_in_lstm",
    "get_num_params_in_rnn",
    "group_norm",
    "gru",
    "has_cuda_kernels",
    "init_gru_weight",
    "init_lstm_weight",
    "init_rnn_weight",
    "instance_norm",
    "layer_norm",
    "log_softmax",
    "lstm",
    "matmul",
    "max_pool",
    "nn",
    "pack_rnn_weights",
    "pool_plan",
    "relu",
    "rms_norm",
    "rnn",
    "rnn_weights_from_torch",
    "rnn_weights_to_torch",
    "sigmoid",
    "silu",
    "softmax",
    "tanh",
    "unpack_gru_weights",
    "unpack_lstm_weights",
    "unpack_rnn_weights",
]
