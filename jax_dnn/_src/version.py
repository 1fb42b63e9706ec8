"""jax_dnn's version: the package's (pyproject.toml reads it from here) and the
one the convolution tuner's cache entries record."""

__version__ = "0.1.0"
