"""Current scaling's cast in one launch: the kernel makes the scale from the tensor's amax.

Current scaling casts with `fp8_max / 2**margin / max|x|`, so x's amax must be known
before the cast. Given it (a reduction written before, which XLA can compute in the
kernel that writes x), `cast_transpose_from_amax` is one launch of the cast-transpose
kernel (`pallas_kernels.cast_transpose`) in which every program makes the scale itself
from the two scalars (an IEEE `div.rn.f32`, as XLA divides) and one program writes its
reciprocal, the GEMMs' combined descales and the running amax: no launch of a few
bytes computes any of them, and x is not reduced again. `cast_transpose_from_amax_reference`
is its plain-jnp definition, which the kernel matches bit for bit.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.activations import Prologue
from pallas_kernels.cast_transpose import (EXPONENT_BITS, AmaxSpec, CastSpec, ScaleFromAmax,
                                           bits_max, cast_transpose_amax_reference,
                                           keep_groups_reference, launch)
from pallas_kernels.cast_transpose_checks import (check_block_sizes, check_flag, check_fp8,
                                                  check_margin, check_pass_through,
                                                  check_products, check_prologue, check_x,
                                                  scalar_f32)
from pallas_kernels.cast_transpose_tiling import CastTransposeBlockSizes
from pallas_kernels.vector_element import element_value


class CastFromAmax(NamedTuple):
  """What `cast_transpose_from_amax` returns.

  Attributes:
    q, q_t: the FP8 copy [R, C] and its transpose [C, R] (None without `transpose`).
    amax: float32[] max(amax_in, recorded_amax).
    descale: float32[] 1 / scale, the scale the kernel made and cast with.
    products: the GEMMs' combined descales (None without `partner_descales`).
    passed: copies of the `pass_through` arrays, in their shapes.
    kept: with `keep_groups`, x's FP8 copy for a backward pass (as
      `cast_transpose_amax_in_chain`'s); else None.
  """

  q: jax.Array
  q_t: jax.Array | None
  amax: jax.Array
  descale: jax.Array
  products: tuple | None
  passed: tuple = ()
  kept: tuple | None = None


def cast_transpose_from_amax(
    x: jax.Array, amax: jax.Array, fallback_scale: jax.Array, amax_in: jax.Array, *,
    fp8_dtype, fp8_max: float, margin: int = 0, power_of_two: bool = False,
    recorded_amax: jax.Array | None = None, transpose: bool = True,
    partner_descales: tuple | None = None, pass_through: tuple = (),
    prologue: Prologue | None = None, prologue_inputs: tuple = (), keep_groups: bool = False,
    block_sizes: CastTransposeBlockSizes = CastTransposeBlockSizes(), interpret: bool = False,
) -> CastFromAmax:
  """Current scaling's cast in one launch: the kernel makes the scale from x's amax.

      scale    = fp8_max / 2**margin / amax   where that and amax are finite and > 0,
                 else fallback_scale (then rounded down to a power of two with
                 `power_of_two`); the division is IEEE round-to-nearest
      q        = saturate(x * scale),  q_t = q.T     (as `cast_transpose_amax`)
      amax_out = max(amax_in, recorded_amax)         (recorded_amax defaults to amax)
      descale  = 1 / scale,  products = min(descale * partner, float32 max)

  `amax` is max|x|, measured by whoever wrote x or by an earlier pass; this launch
  does not reduce x again. Every program makes the scale itself from the two
  scalars and one program writes the scalar outputs, so no launch of its own
  computes a scale, a descale or a running amax (with XLA each is a kernel of a few
  bytes). Amaxes are >= 0 or NaN; their max is taken on the bit patterns.

  Args:
    x: [R, C] bfloat16, float16 or float32.
    amax: float32[] max|x| (of the whole tensor where x is a shard of it).
    fallback_scale: float32[] the scale kept where `amax` gives none (0, inf, NaN).
    amax_in: float32[] running amax (it and fallback_scale may be `VectorElement`s, read in
      place from their vector).
    fp8_dtype, fp8_max, transpose, block_sizes, interpret: as for `cast_transpose_amax`.
    margin: the scale is divided by 2**margin (an int >= 0).
    power_of_two: round the scale down to a power of two.
    recorded_amax: float32[] what amax_out records (e.g. this shard's amax where
      `amax` is the whole tensor's); default `amax`.
    partner_descales: optional tuple of 1 to 4 float32[]: the descales of the
      tensors x meets in its GEMMs.
    pass_through: float32 arrays of at most one dimension to return copies of (see
      `cast_transpose_amax_in_chain`).
    prologue, prologue_inputs: cast `prologue.fn(x, *prologue_inputs)` (float32, made in
      the kernel's registers) instead of x, as `cast_transpose_amax_in_chain`; `amax` is
      then max|prologue.fn(...)|.
    keep_groups: also write x, before the prologue (or `prologue.kept`'s value of it), as
      the FP8 copy a backward pass keeps (`CastFromAmax.kept`, as
      `cast_transpose_amax_in_chain`).

  Returns:
    A `CastFromAmax`.
  """
  check_x(x)
  prologue_inputs = check_prologue(prologue, prologue_inputs, x)
  fp8_dtype = check_fp8(fp8_dtype, fp8_max)
  amax = scalar_f32(amax, "amax")
  fallback_scale = scalar_f32(fallback_scale, "fallback_scale", element_ok=True)
  amax_in = scalar_f32(amax_in, "amax_in", element_ok=True)
  recorded_amax = amax if recorded_amax is None else scalar_f32(recorded_amax, "recorded_amax")
  check_margin(margin)
  for flag, name in ((power_of_two, "power_of_two"), (transpose, "transpose"),
                     (interpret, "interpret"), (keep_groups, "keep_groups")):
    check_flag(flag, name)
  check_block_sizes(block_sizes)
  partners = None
  if partner_descales is not None:
    _, partners = check_products(jnp.float32(1), partner_descales)
  passed = check_pass_through(pass_through)
  cast = CastSpec(dtype=fp8_dtype, max=float(fp8_max), transpose=transpose,
                  from_amax=ScaleFromAmax(numerator=float(fp8_max) / 2.0**margin,
                                          power_of_two=power_of_two), prologue=prologue,
                  keeps_groups=keep_groups)
  modes = AmaxSpec(accumulate="given", passed=tuple(int(jnp.size(a)) for a in passed))
  q, q_t, amax_out, products, _, _, copies, descale, kept = launch(
      x, fallback_scale, amax_in, None, partners, None, None,
      tuple(jnp.ravel(a) for a in passed), (amax, recorded_amax), prologue_inputs, cast=cast,
      amax=modes,
      block_sizes=block_sizes, interpret=interpret)
  copies = tuple(c.reshape(jnp.shape(a)) for c, a in zip(copies, passed))
  return CastFromAmax(q, q_t, amax_out, descale.reshape(()), products, copies, kept)


def cast_transpose_from_amax_reference(
    x: jax.Array, amax: jax.Array, fallback_scale: jax.Array, amax_in: jax.Array, *,
    fp8_dtype, fp8_max: float, margin: int = 0, power_of_two: bool = False,
    recorded_amax: jax.Array | None = None, transpose: bool = True,
    partner_descales: tuple | None = None, pass_through: tuple = (),
    prologue: Prologue | None = None, prologue_inputs: tuple = (), keep_groups: bool = False,
) -> CastFromAmax:
  """`cast_transpose_from_amax` in plain jnp: the definition the kernel matches bit for bit."""
  check_x(x)
  prologue_inputs = check_prologue(prologue, prologue_inputs, x)
  check_flag(keep_groups, "keep_groups")
  kept = (keep_groups_reference(x if prologue is None else prologue.kept_of(x, prologue_inputs))
          if keep_groups else None)
  if prologue is not None:
    x = prologue.applied_to(x, prologue_inputs)
  fp8_dtype = check_fp8(fp8_dtype, fp8_max)
  amax = scalar_f32(amax, "amax")
  fallback_scale = element_value(scalar_f32(fallback_scale, "fallback_scale", element_ok=True))
  recorded_amax = amax if recorded_amax is None else scalar_f32(recorded_amax, "recorded_amax")
  check_margin(margin)
  quotient = jnp.float32(float(fp8_max) / 2.0**margin) / amax
  usable = jnp.isfinite(amax) & (amax > 0) & jnp.isfinite(quotient) & (quotient > 0)
  scale = jnp.where(usable, quotient, fallback_scale)
  if power_of_two:
    bits = lax.bitcast_convert_type(scale, jnp.int32)
    top_bit = jnp.left_shift(jnp.int32(1), jnp.maximum(31 - lax.clz(bits), 0))
    bits = jnp.where(bits & EXPONENT_BITS > 0, bits & EXPONENT_BITS,
                     jnp.where(bits > 0, top_bit, 0))
    scale = lax.bitcast_convert_type(bits, jnp.float32)
  descale = jnp.float32(1) / scale
  partners = None
  if partner_descales is not None:
    _, partners = check_products(jnp.float32(1), partner_descales)
  q, q_t, _, *products = cast_transpose_amax_reference(
      x, scale, jnp.float32(0), fp8_dtype=fp8_dtype, fp8_max=fp8_max, transpose=transpose,
      descale=None if partners is None else descale, partner_descales=partners)
  amax_in = element_value(scalar_f32(amax_in, "amax_in", element_ok=True))
  return CastFromAmax(q, q_t, bits_max(amax_in, recorded_amax),
                      descale, products[0] if products else None,
                      check_pass_through(pass_through), kept)
