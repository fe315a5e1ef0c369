"""Per-tensor FP8 numerics: the saturating cast, the amax, and the scale an amax gives.

    q     = saturate(x * scale)         clip to ±fmt.max, then cast (NaN stays NaN)
    amax  = max |x|                     exact, NaN wins
    scale = fmt.max / amax / 2**margin  or a fallback when that is not finite and positive

Amaxes are reduced on their int32 bit patterns (`max_by_bits`): for non-negative
float32 values they order like the values and every NaN sorts above inf, so the max
is exact and keeps NaN on every backend (XLA's float max reduction on CPU drops NaN
for larger arrays, Triton's and CUDA's fmaxf always do), and it is what fp8jax's
fused kernels compute.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.custom_batching import custom_vmap

from fp8jax.core.formats import Fp8Format
from fp8jax.core.validation import check_floating, check_format, check_fp8_array, check_int

_EXPONENT_BITS = 0x7F800000  # the exponent field of a float32


def _bits(x: jax.Array) -> jax.Array:
  """The int32 bit patterns of float32 `x`."""
  return jax.lax.bitcast_convert_type(jnp.asarray(x, jnp.float32), jnp.int32)


def _float32(bits: jax.Array) -> jax.Array:
  return jax.lax.bitcast_convert_type(bits, jnp.float32)


def max_by_bits(x: jax.Array, axis=None, initial=None) -> jax.Array:
  """float32 max of non-negative `x` (or NaN) over `axis`, reduced on the bit patterns."""
  return _float32(jnp.max(_bits(x), axis=axis, initial=initial))


def saturate_cast(x: jax.Array, scale: jax.Array, fmt: Fp8Format) -> jax.Array:
  """`clip(float32(x) * scale, ±fmt.max)` cast to `fmt.dtype` (no argument checks).

  `scale` is a scalar or broadcasts to `x` (one per block, expanded).
  """
  scaled = x.astype(jnp.float32) * scale
  return jnp.clip(scaled, -fmt.max, fmt.max).astype(fmt.dtype)


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
  return saturate_cast(x, scale, fmt)


def dequantize(q: jax.Array, scale: jax.Array, dtype=jnp.float32) -> jax.Array:
  """`q * (1 / scale)` computed in float32, returned in `dtype`."""
  check_fp8_array(q, "q")
  return (q.astype(jnp.float32) * (1.0 / scale)).astype(dtype)


def amax(x: jax.Array) -> jax.Array:
  """float32[] absolute maximum of `x` (NaN if `x` holds a NaN); exact (`max_by_bits`)."""
  # 0 for an empty x; the `initial` that gives it is left out elsewhere, where it would
  # change nothing but cost a launch of its own (XLA does not fuse max(reduce, 0)).
  return max_by_bits(jnp.abs(x.astype(jnp.float32)), initial=0 if jnp.size(x) == 0 else None)


def amax_max(a: jax.Array, b: jax.Array) -> jax.Array:
  """max(a, b) of two amaxes (>= 0 or NaN), on their bit patterns: a NaN on either side wins."""
  return _float32(jnp.maximum(_bits(a), _bits(b)))


@custom_vmap
def unbatched_like(reference: jax.Array, value: jax.Array) -> jax.Array:
  """`value`, an amax recorded into a state whose amax was `reference`.

  Only `jax.vmap` changes anything: where `value` is batched and `reference` is
  not (a model written for one example, vmapped over the batch, with one FP8
  state), the per-example amaxes are reduced to their max, so the state gets
  the amax of the whole batch, bit for bit what the folded batch records. Where
  `reference` is batched too (a state per vmapped instance, e.g. `nn.vmap` with
  "fp8_meta" in `variable_axes`), each instance keeps its own amax.
  """
  del reference
  return value


@unbatched_like.def_vmap
def _unbatched_like_rule(axis_size, in_batched, reference, value):
  del axis_size, reference
  reference_batched, value_batched = in_batched
  if value_batched and not reference_batched:
    return max_by_bits(value, axis=0), False
  return value, value_batched


def round_down_to_power_of_two(value: jax.Array) -> jax.Array:
  """The largest power of two <= `value`, for finite float32 `value` > 0 (0 stays 0).

  A normal float32 keeps its exponent field and loses its mantissa bits; a
  subnormal one keeps only its highest set bit.
  """
  bits = _bits(value)
  normal = bits & _EXPONENT_BITS
  top_bit = jnp.left_shift(jnp.int32(1), jnp.maximum(31 - jax.lax.clz(bits), 0))
  subnormal = jnp.where(bits > 0, top_bit, 0)
  return _float32(jnp.where(normal > 0, normal, subnormal))


def floor_log2(value: jax.Array) -> jax.Array:
  """int32 floor(log2(value)) of float32 `value` read from its exponent field (-127 for 0
  and subnormals, 128 for inf and NaN)."""
  return ((_bits(value) & _EXPONENT_BITS) >> 23) - 127


def scale_from_amax(amax: jax.Array, fmt: Fp8Format, margin: int,
                    fallback: jax.Array, power_of_two: bool = False) -> jax.Array:
  """`fmt.max / amax / 2**margin`, or `fallback` where that is not finite and positive.

  Args:
    amax: float32 absolute maximum of the tensor (or one per block; may be 0, inf or NaN).
    fmt: the FP8 format the tensor is cast to.
    margin: power-of-two headroom.
    fallback: float32 scale to keep where `amax` gives no usable scale.
    power_of_two: round the scale down to a power of two (its float32 mantissa
      bits cleared): `amax * scale <= fmt.max` still holds and `1 / scale` is exact.

  Returns:
    float32 scale of `amax`'s shape.
  """
  check_format(fmt, "fmt")
  check_int("margin", margin, minimum=0)
  scale = scale_from_window(amax, jnp.float32(fmt.max / 2.0**margin), fallback)
  # The fallback is a scale this rule made before (or 1), so rounding it changes nothing.
  return round_down_to_power_of_two(scale) if power_of_two else scale


def scale_from_window(amax: jax.Array, numerator: jax.Array, fallback: jax.Array) -> jax.Array:
  """`numerator / amax` where that is a finite positive number and amax is too, else
  `fallback`: the rule of `scale_from_amax` with `numerator = fmt.max / 2**margin`."""
  amax = jnp.asarray(amax, jnp.float32)
  scale = numerator / amax
  usable = jnp.isfinite(amax) & (amax > 0) & jnp.isfinite(scale) & (scale > 0)
  return jnp.where(usable, scale, fallback)
