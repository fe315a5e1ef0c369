"""NVFP4: E2M1 values in blocks of 16 with an E4M3 scale each and one float32 scale per tensor.

The quantization of a tensor `t` (NVIDIA's NVFP4 format, as its training recipe and
TransformerEngine's `NVFP4BlockScaling` use it), all products and quotients in float32:

    tensor scale    s_t = 448 * 6 / amax(t)            1 where amax is 0, inf or NaN
    block scale     d_b = e4m3(block_amax / 6 * s_t)   the E4M3 value, rounded to nearest
                                                       even, saturating at 448; NaN for a
                                                       block holding a NaN or an infinity
    multiplier      m_b = s_t / d_b                    0 where d_b is 0 (a block so small
                                                       against the tensor that it flushes)
    elements        q = e2m1(clip(t * m_b, -6, 6))     round to nearest even, or stochastic
    dequantized     q * scale_inv_b,  scale_inv_b = d_b * (1 / s_t)

so a block's largest element lands at (about) 6 and the tensor's largest block scale at
(about) 448: E4M3's range holds the blocks' spread, float32 the tensor's. A block is 1 x 16
elements along a GEMM's contraction axis, or 16 x 16 (a weight: the same blocks serve the
weight and its transpose); a partial last block has its own scale from its own elements.

E2M1 (OCP MX v1.0, 5.3.3): 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives. On each
binade [2**e, 2**(e+1)) the grid is evenly spaced: 0.5 below 2, 1 in [2, 4), 2 in [4, 6].
Round to nearest even picks the nearer neighbour and, at a midpoint, the one whose
mantissa bit is 0. Stochastic rounding picks the upper neighbour with probability
(|v| - lower) / (upper - lower), so the expected value is v: no bias, at the price of
variance. Its uniform numbers come from a key the caller passes (`fp8jax.core.rounding_keys`).

The random Hadamard transform (RHT) multiplies every 16 consecutive elements along a
GEMM's contraction axis by the orthonormal 16 x 16 matrix `H S` (H the Sylvester Hadamard
matrix / 4, S a fixed diagonal of signs). Applied to both operands of a GEMM it leaves the
product unchanged in exact arithmetic, `(A H S)(S H^T B) = A B`, while it spreads a block's
outliers over its 16 elements, which 4-bit blocks need. NVIDIA applies it to the inputs of
the weight-gradient GEMM only.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from fp8jax.core.blocks import BlockQuantized, block_amax, expand_blocks
from fp8jax.core.formats import E2M1, E4M3
from fp8jax.core.hadamard import sylvester_hadamard
from fp8jax.core.quantize import amax, saturate_cast, scale_from_window
from fp8jax.core.validation import check_floating

BLOCK = 16
# The tensor scale's numerator: a block scale of at most E4M3's max times E2M1's max.
TENSOR_SCALE_NUMERATOR = E4M3.max * E2M1.max  # 2688
# The signs S of the transform: drawn once (numpy's default_rng(20251001)) and fixed here,
# so that every layer and step transforms alike and the transform needs no state.
HADAMARD_SIGNS = (1, -1, 1, 1, -1, -1, -1, 1, -1, -1, -1, 1, -1, 1, -1, -1)


@dataclasses.dataclass(frozen=True)
class Nvfp4Quantized(BlockQuantized):
  """NVFP4 values with their scales: a `BlockQuantized` whose `q` is E2M1.

  Attributes:
    q: [..., R, C] float4_e2m1fn.
    scale_inv: float32 [..., nR, nC]: `d_b * (1 / s_t)`, each block's descale (NaN for
      a block holding a NaN or an infinity).
    block: static (br, bc): (1, 16), (16, 1) or (16, 16).
    block_scale: float8_e4m3fn [..., nR, nC]: d_b, each block's E4M3 scale.
    tensor_scale: float32 []: s_t, the tensor's scale (of all of x, batch dims included).
  """

  block_scale: jax.Array
  tensor_scale: jax.Array

  def transpose(self) -> "Nvfp4Quantized":
    base = BlockQuantized.transpose(self)
    return Nvfp4Quantized(base.q, base.scale_inv, base.block,
                          jnp.swapaxes(self.block_scale, -1, -2), self.tensor_scale)


jax.tree_util.register_dataclass(
    Nvfp4Quantized, data_fields=["q", "scale_inv", "block_scale", "tensor_scale"],
    meta_fields=["block"])


def tensor_scale(tensor_amax: jax.Array) -> jax.Array:
  """float32 `s_t = 448 * 6 / amax`; 1 where amax is 0, inf or NaN (or the quotient overflows)."""
  return scale_from_window(tensor_amax, jnp.float32(TENSOR_SCALE_NUMERATOR), jnp.float32(1.0))


def block_scales(blocks_amax: jax.Array, s_t: jax.Array) -> jax.Array:
  """float8_e4m3fn `d_b = e4m3(block_amax / 6 * s_t)` (NaN where block_amax is not finite)."""
  blocks_amax = jnp.asarray(blocks_amax, jnp.float32)
  d = saturate_cast(blocks_amax / jnp.float32(E2M1.max), s_t, E4M3)
  return jnp.where(jnp.isfinite(blocks_amax), d, jnp.asarray(jnp.nan, E4M3.dtype))


def round_to_e2m1(v: jax.Array, uniform: jax.Array | None = None) -> jax.Array:
  """float32 `v` in [-6, 6] (or NaN) rounded onto the E2M1 grid, as float32.

  Args:
    v: float32, already clipped to +-6.
    uniform: None for round to nearest even; else float32 numbers in [0, 1) of v's
      shape: |v| goes up to the next grid point when `uniform < (|v| - lower) / spacing`.

  The spacing on |v|'s binade is a power of two, so |v| / spacing and its fraction are
  exact; `jnp.round` rounds half to even, and an even multiple of the spacing is the
  grid point whose mantissa bit is 0.
  """
  magnitude = jnp.abs(v)
  spacing = jnp.where(magnitude < 2.0, 0.5, jnp.where(magnitude < 4.0, 1.0, 2.0))
  steps = magnitude / spacing
  if uniform is None:
    rounded = jnp.round(steps)
  else:
    lower = jnp.floor(steps)
    rounded = lower + (uniform < steps - lower).astype(jnp.float32)
  return jnp.copysign(rounded * spacing, v)


def quantize_nvfp4(x: jax.Array, block: tuple[int, int],
                   uniform: jax.Array | None = None) -> Nvfp4Quantized:
  """NVFP4 quantization of `x [..., R, C]` in `block`s, with one tensor scale for all of x.

  Args:
    x: floating array with at least 2 dims.
    block: (1, 16), (16, 1) or (16, 16).
    uniform: None (round to nearest even), or float32 numbers in [0, 1) of x's shape
      for stochastic rounding (`round_to_e2m1`).

  Returns:
    `Nvfp4Quantized` (the formulas of this module's docstring).
  """
  check_floating(x, "x")
  s_t = tensor_scale(amax(x))
  d = block_scales(block_amax(x, block), s_t)
  scaled = jnp.clip(x.astype(jnp.float32) * expand_blocks(multipliers(d, s_t), block, x.shape),
                    -E2M1.max, E2M1.max)
  q = round_to_e2m1(scaled, uniform).astype(E2M1.dtype)
  return Nvfp4Quantized(q, d.astype(jnp.float32) * (1.0 / s_t), tuple(block), d, s_t)


def multipliers(d: jax.Array, s_t: jax.Array) -> jax.Array:
  """float32 `m_b = s_t / d_b` per block (0 where d_b is 0; NaN where d_b is NaN)."""
  d32 = d.astype(jnp.float32)
  return jnp.where(d32 == 0.0, 0.0, s_t / d32)


def hadamard_matrix() -> np.ndarray:
  """float32 [16, 16] `H S`: the Sylvester Hadamard matrix / 4 times the fixed signs' diagonal.

  Orthonormal: `(H S)(H S)^T = I`, every entry +-1/4 (exact in float32).
  """
  h = sylvester_hadamard(BLOCK)
  return (h / 4.0 * np.asarray(HADAMARD_SIGNS, np.float32)[None, :]).astype(np.float32)


def hadamard_rows(t: jax.Array) -> jax.Array:
  """`t [..., R, C]` with every 16 rows multiplied by `(H S)^T`, float32 [..., R16, C].

  R is padded with zero rows to R16, a multiple of 16. For two operands that share
  their rows, `hadamard_rows(a)^T @ hadamard_rows(b) = a^T @ b` (exactly, but for the
  float32 roundings): the padded rows add zero products. Computed at HIGHEST precision.
  """
  rows = t.shape[-2]
  padded = -(-rows // BLOCK) * BLOCK
  pad = [(0, 0)] * (t.ndim - 2) + [(0, padded - rows), (0, 0)]
  blocks_of_rows = jnp.pad(t.astype(jnp.float32), pad).reshape(
      *t.shape[:-2], padded // BLOCK, BLOCK, t.shape[-1])
  transformed = jnp.einsum("ij,...bic->...bjc", jnp.asarray(hadamard_matrix()), blocks_of_rows,
                           precision=jax.lax.Precision.HIGHEST)
  return transformed.reshape(*t.shape[:-2], padded, t.shape[-1])
