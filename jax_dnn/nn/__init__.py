"""Flax NNX layers over jax_dnn's ops (drop-in for their flax.nnx namesakes)."""

from jax_dnn.nn.attention import MultiHeadAttention, dot_product_attention
from jax_dnn.nn.batch_norm import BatchNorm
from jax_dnn.nn.conv import Conv, ConvTranspose
from jax_dnn.nn.group_norm import GroupNorm, InstanceNorm
from jax_dnn.nn.normalization import LayerNorm, RMSNorm
from jax_dnn.nn.recurrent import GRU, LSTM, RNN, Bidirectional

__all__ = ["BatchNorm", "Bidirectional", "Conv", "ConvTranspose", "GRU", "GroupNorm",
           "InstanceNorm", "LSTM", "LayerNorm", "MultiHeadAttention", "RMSNorm", "RNN",
           "dot_product_attention"]
