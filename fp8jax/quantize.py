"""Saturating FP8 quantization with a scale: `q = saturate(x * scale)`."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from fp8jax.formats import Fp8Format
from fp8jax.meta import Fp8Meta
from fp8jax.recipes import CurrentScaling
from fp8jax.scaling import record_amax, scale_from_amax
from fp8jax.sharding import global_amax
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


def amax(x: jax.Array) -> jax.Array:
  """float32[] absolute maximum of `x` (NaN if `x` holds a NaN).

  Reduced as an int32 max over the bit patterns of |x| in float32: for
  non-negative floats they order like the values and every NaN sorts above
  inf, so the result is exact and keeps NaN on every backend (XLA's float max
  reduction on CPU drops NaN for larger arrays), and it is what the fused GPU
  kernel computes.
  """
  bits = jax.lax.bitcast_convert_type(jnp.abs(x.astype(jnp.float32)), jnp.int32)
  return jax.lax.bitcast_convert_type(jnp.max(bits, initial=0), jnp.float32)


def quantize_with_meta(x: jax.Array, meta: Fp8Meta) -> tuple[jax.Array, jax.Array, Fp8Meta]:
  """Quantizes `x` as `meta`'s recipe says and records `x`'s amax.

  Delayed scaling uses the stored `meta.scale`; current scaling computes the
  scale from `x`'s own amax (keeping `meta.scale` if that amax is 0 or not finite);
  inside `shard_map` that is the amax of the whole tensor, not of this shard.

  Returns:
    (q in meta.fmt.dtype, the float32[] scale used, meta with the amax recorded).
  """
  x_amax = amax(x)
  scale = scale_for(meta, x_amax, like=x)
  return quantize(x, scale, meta.fmt), scale, record_amax(meta, x_amax)


def scale_for(meta: Fp8Meta, x_amax: jax.Array, like: jax.Array | None = None) -> jax.Array:
  """The float32[] scale to quantize a tensor of amax `x_amax` with under `meta`.

  `like` is the tensor itself: under `shard_map`, current scaling takes the max
  of `x_amax` over the devices holding the other shards of that tensor.
  """
  if isinstance(meta.recipe, CurrentScaling):
    if like is not None:
      x_amax = global_amax(x_amax, like)
    return scale_from_amax(x_amax, meta.fmt, meta.recipe.margin, fallback=meta.scale)
  return meta.scale
