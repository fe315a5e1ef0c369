"""Flax layers over fp8jax's pure functions: `linen` and `nnx`.

Import the flavour you use: `from fp8jax.flax import linen as fp8nn` or
`from fp8jax.flax import nnx as fp8nnx`.
"""
