"""Runtime fusion of unmodified JAX programs onto jax_dnn's ops (rewrite.py)."""
