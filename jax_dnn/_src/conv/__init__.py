"""Convolutions: the public ops and their primitives.

The modules, in the order a call meets them:
  api         the public ops (conv, conv_general_dilated, conv_transpose,
              matmul, conv_algorithms): checks, padding, the canonical
              channels-last problem;
  vjp         the custom VJPs over the primitives, the fused activation;
  primitives  conv_fwd / conv_dgrad / conv_wgrad: references, abstract
              evaluation, the kernels' plans, batching and sharding rules;
  phases      a strided dgrad as stride-1 forward convolutions, one a phase;
  tuning      benchmark mode: timing the candidates, the on-disk cache.
"""
