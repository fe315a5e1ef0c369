"""Saturating FP8 quantization with a scale: `q = saturate(x * scale)`."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from fp8jax.amax import amax, amax_max  # noqa: F401  (public through fp8jax.quantize too)
from fp8jax.formats import Fp8Format
from fp8jax.validation import check_floating, check_format, check_fp8_array


def quantize(x: jax.Array, scale: jax.Array, fmt: Fp8Format) -> jax.Array:
  """Casts `x * scale` to FP8, clipping to ±fmt.max first (NaN stays NaN).

  Args:
    x: floating array of any shape (bf16, f16 or f32).
    scale: float32 scalar (or broadcastable to `x`).
    fmt: target format (`fp8jax.E4M3` or `fp8jax.E5M2`).

  Returns:
    Array of `x`'s shape in `fmt.dtype`. The product is formed in float32, so
    the result is the round-to-nearest-even FP8 value of the float32 product.
  """
  check_floating(x, "x")
  check_format(fmt, "fmt")
  scaled = x.astype(jnp.float32) * scale
  return jnp.clip(scaled, -fmt.max, fmt.max).astype(fmt.dtype)


def dequantize(q: jax.Array, scale: jax.Array, dtype=jnp.float32) -> jax.Array:
  """`q * (1 / scale)` computed in float32, returned in `dtype`."""
  check_fp8_array(q, "q")
  return (q.astype(jnp.float32) * (1.0 / scale)).astype(dtype)
