"""Per-row and per-block FP8: quantization with one scale per row, per 1 x B tile, per
B x B block or per MX block, and the GEMMs of such operands.

A 2-D array `x [R, C]` (any leading batch dims are carried along) is cut into
blocks of `block = (br, bc)` elements over its last two axes; the last block
along an axis may be partial and gets its own scale from its own elements.
Per block b with `amax_b = max |x|` over the block:

    float32 scales:  scale_b = fmt.max / amax_b             (float32 division:
                                                              fp8jax.scale_from_amax)
                     power_of_two: scale_b rounded down to a power of two
                     (amax_b 0, inf or NaN, or a scale that is not a finite
                     positive number: scale_b = 1)
    MX (E8M0):       shared_b = clip(floor(log2(amax_b)) - emax, -127, 127),
                     scale_inv_b = 2**shared_b, scale_b = 2**-shared_b
                     (scale_rounding "round_up": shared_b = clip(ceil(log2(
                     amax_b / fmt.max)), -127, 127), the smallest power of two
                     that saturates no element)
    elements:        q = saturate(x * scale_b)  in fmt (product in float32,
                     clipped to +-fmt.max, rounded to nearest even)
    dequantized:     q * scale_inv_b,  scale_inv_b = 1 / scale_b

A row scale of `x [R, C]` is the block (1, C), a column scale (R, 1), a 1 x B
tile along the last axis (1, B), a B x B block (B, B).

MX follows the OCP Microscaling Formats (MX) v1.0 specification: emax is the
exponent of the element format's largest normal (8 for E4M3, 15 for E5M2), so
the block's largest element lands in [2**emax, 2**(emax+1)) before the cast and
saturates to fmt.max when it lies above it (E4M3: 448 < 2**9). A block whose
amax is 0 has floor(log2 0) = -inf, clamped to the smallest E8M0 value, 2**-127
(the convention of the OCP reference code); its elements are all 0. A block
holding a NaN or an infinity gets the E8M0 NaN (code 255): every element of it
dequantizes to NaN.

NVIDIA's MXFP8 training recipe rounds the other way (`scale_rounding="round_up"`):
the shared scale is amax / fmt.max rounded up to a power of two, so the block's
largest element lands in (fmt.max / 2, fmt.max] and nothing saturates. The two
rules agree when amax's significand is at most fmt.max's (1.75 for E4M3 and E5M2:
amax in [2**k, 1.75 * 2**k]); for a significand in (1.75, 2) the round-up rule's
scale is twice the floor rule's, where the floor rule would saturate the largest
elements (they land in (448, 512) for E4M3) and the round-up rule keeps them at
half the range, one bit less precise.

GEMMs of `A [..., P, C] @ B [..., C, Q]` quantized along C (`Recipe.operand_gemm`):

* `rowwise_gemm`: a raw FP8 dot accumulated in float32, then the outer product of
  the two descale vectors applied to the product (an epilogue):
  `out[p, q] = (q(A) @ q(B))[p, q] * a_inv[p] * b_inv[q]`. The scales never touch
  the operands before the dot, so on Hopper the dot stays the cuBLASLt FP8 GEMM (a
  scale that varies along the contraction cannot be folded into it).
* `emulated_block_gemm`: both operands dequantized per block to float32 and
  multiplied at HIGHEST precision (float32 accumulation): exact, every platform.
* `pallas_block_gemm`: A in 1 x 128 tiles, B in 128 x 128 blocks on the
  block-scaled Mosaic GPU kernel of `pallas_kernels.block_scaled_matmul` (a GPU).
"""
from __future__ import annotations

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels
from fp8jax.core.formats import E4M3, E5M2, Fp8Format
from fp8jax.core.quantize import floor_log2, max_by_bits, saturate_cast, scale_from_amax
from fp8jax.core.validation import check_floating, check_format

# Exponent of the largest normal of each element format (OCP MX v1.0, table 1).
MX_EMAX = {E4M3.name: 8, E5M2.name: 15}
MX_BLOCK = 32
E8M0_NAN = 255
# How an MX block's shared exponent is rounded: OCP MX v1.0's floor(log2(amax)) - emax,
# or NVIDIA's MXFP8 recipe's ceil(log2(amax / fmt.max)).
MX_SCALE_ROUNDINGS = ("floor", "round_up")
_SIGNIFICAND_BITS = 0x007FFFFF  # the stored significand (mantissa) field of a float32


@dataclasses.dataclass(frozen=True)
class BlockQuantized:
  """FP8 values with one descale per block.

  Attributes:
    q: [..., R, C] in an FP8 dtype.
    scale_inv: float32 [..., ceil(R / br), ceil(C / bc)]: `1 / scale` of each block.
    block: static (br, bc), the block shape over the last two axes.
  """

  q: jax.Array
  scale_inv: jax.Array
  block: tuple[int, int]

  def transpose(self) -> "BlockQuantized":
    """The same quantization of the transposed matrix (last two axes swapped)."""
    return BlockQuantized(jnp.swapaxes(self.q, -1, -2), jnp.swapaxes(self.scale_inv, -1, -2),
                          (self.block[1], self.block[0]))


jax.tree_util.register_dataclass(BlockQuantized, data_fields=["q", "scale_inv"],
                                 meta_fields=["block"])


def block_amax(x: jax.Array, block: tuple[int, int]) -> jax.Array:
  """float32 [..., ceil(R / br), ceil(C / bc)]: the absolute maximum of each block of `x`.

  Exact, and NaN wins (`fp8jax.core.quantize.max_by_bits`, as `fp8jax.amax`). A
  partial last block is padded with zeros, which change no max.
  """
  br, bc = _check_block(block, x)
  rows, cols = x.shape[-2:]
  n_r, n_c = -(-rows // br), -(-cols // bc)
  pad = [(0, 0)] * (x.ndim - 2) + [(0, n_r * br - rows), (0, n_c * bc - cols)]
  magnitudes = jnp.pad(jnp.abs(x.astype(jnp.float32)), pad)
  return max_by_bits(magnitudes.reshape(*x.shape[:-2], n_r, br, n_c, bc), axis=(-3, -1))


def block_scales(amax: jax.Array, fmt: Fp8Format, power_of_two: bool = False) -> jax.Array:
  """float32 `fmt.max / amax` per block (rounded down to a power of two if asked); 1 where
  `amax` is 0, inf or NaN or the quotient is not a finite positive number."""
  return scale_from_amax(amax, fmt, 0, fallback=jnp.float32(1.0), power_of_two=power_of_two)


def expand_blocks(values: jax.Array, block: tuple[int, int], shape) -> jax.Array:
  """Per-block `values [..., nR, nC]` repeated to every element of an array of `shape`."""
  br, bc = block
  rows, cols = shape[-2:]
  out = jnp.repeat(jnp.repeat(values, br, axis=-2), bc, axis=-1)
  return out[..., :rows, :cols]


def quantize_with_block_scales(x: jax.Array, scale: jax.Array, block: tuple[int, int],
                               fmt: Fp8Format) -> BlockQuantized:
  """`saturate(x * scale_b)` in `fmt` per block, with `scale_inv = 1 / scale` (float32)."""
  q = saturate_cast(x, expand_blocks(scale, block, x.shape), fmt)
  return BlockQuantized(q, 1.0 / scale, tuple(block))


def quantize_blocks(x: jax.Array, fmt: Fp8Format, block: tuple[int, int],
                    power_of_two: bool = False) -> BlockQuantized:
  """Quantizes `x [..., R, C]` with one float32 scale `fmt.max / amax` per block.

  Args:
    x: floating array with at least 2 dims.
    fmt: fp8jax.E4M3 or fp8jax.E5M2.
    block: (br, bc); (1, C) is one scale per row, (R, 1) per column.
    power_of_two: round each scale down to a power of two.

  Returns:
    `BlockQuantized` with q in fmt.dtype and float32 scale_inv per block.
  """
  check_floating(x, "x")
  check_format(fmt, "fmt")
  scale = block_scales(block_amax(x, block), fmt, power_of_two)
  return quantize_with_block_scales(x, scale, block, fmt)


def quantize_rows(x: jax.Array, fmt: Fp8Format, axis: int,
                  power_of_two: bool = False) -> BlockQuantized:
  """One scale per vector along `axis` (-1: per row, amax over C; -2: per column, over R)."""
  rows, cols = x.shape[-2:]
  return quantize_blocks(x, fmt, (1, cols) if axis == -1 else (rows, 1), power_of_two)


def mx_shared_exponents(amax: jax.Array, fmt: Fp8Format,
                        scale_rounding: str = "floor") -> jax.Array:
  """E8M0 codes (uint8, `shared_exp + 127`; 255 for NaN) of blocks with absolute max `amax`.

  "floor" (OCP MX v1.0): `shared_exp = clip(floor(log2(amax)) - emax, -127, 127)`.
  "round_up" (NVIDIA's MXFP8 recipe): `shared_exp = clip(ceil(log2(amax / fmt.max)),
  -127, 127)`, exactly: with amax = m * 2**e (m in [1, 2)) and fmt.max = 1.75 * 2**emax,
  that is `e - emax`, plus 1 where m > 1.75 (compared on the float32 significand bits,
  so no rounding of amax / fmt.max moves a block across the boundary).
  floor(log2(amax)) is read from amax's float32 exponent field; for amax 0 or
  subnormal the field reads -127, and any value that low clamps to -127 after
  subtracting emax (>= 8) just as the exact logarithm would.
  """
  check_format(fmt, "fmt")
  check_scale_rounding(scale_rounding)
  amax = jnp.asarray(amax, jnp.float32)
  shared = floor_log2(amax) - MX_EMAX[fmt.name]
  if scale_rounding == "round_up":
    significand = jax.lax.bitcast_convert_type(amax, jnp.int32) & _SIGNIFICAND_BITS
    max_significand = int(np.float32(fmt.max).view(np.int32)) & _SIGNIFICAND_BITS
    shared = shared + (significand > max_significand).astype(jnp.int32)
  shared = jnp.clip(shared, -127, 127)
  codes = jnp.where(jnp.isfinite(amax), shared + 127, E8M0_NAN)
  return codes.astype(jnp.uint8)


def check_scale_rounding(scale_rounding) -> None:
  """Raises ValueError unless `scale_rounding` is one of `MX_SCALE_ROUNDINGS`."""
  if scale_rounding not in MX_SCALE_ROUNDINGS:
    raise ValueError(
        f"scale_rounding={scale_rounding!r} is not an MX scale rule; use 'floor' (OCP MX "
        "v1.0: floor(log2(amax)) - emax; a block's largest elements may saturate) or "
        "'round_up' (NVIDIA's MXFP8 recipe: amax / fmt.max rounded up to a power of two; "
        "nothing saturates).")


def e8m0_to_float32(codes: jax.Array) -> jax.Array:
  """The float32 value 2**(code - 127) of E8M0 codes (code 255: NaN; code 0: 2**-127)."""
  codes = jnp.asarray(codes, jnp.int32)
  normal = jax.lax.bitcast_convert_type(jnp.left_shift(codes, 23), jnp.float32)
  smallest = jax.lax.bitcast_convert_type(jnp.int32(0x00400000), jnp.float32)  # 2**-127
  value = jnp.where(codes == 0, smallest, normal)
  return jnp.where(codes == E8M0_NAN, jnp.float32(jnp.nan), value)


def quantize_mx(x: jax.Array, fmt: Fp8Format, axis: int = -1,
                scale_rounding: str = "floor") -> BlockQuantized:
  """MXFP8: `x [..., R, C]` in blocks of 32 along `axis` (-1 or -2) with E8M0 scales.

  `scale_rounding`: "floor" (OCP MX) or "round_up" (NVIDIA), as `mx_shared_exponents`.

  Returns:
    `BlockQuantized` with block (1, 32) or (32, 1); `scale_inv` is the shared
    scale 2**shared_exp as float32 (`mx_shared_exponents` gives the E8M0 codes).
  """
  check_floating(x, "x")
  check_format(fmt, "fmt")
  block = (1, MX_BLOCK) if axis == -1 else (MX_BLOCK, 1)
  codes = mx_shared_exponents(block_amax(x, block), fmt, scale_rounding)
  quantized = quantize_with_block_scales(x, _e8m0_reciprocal(codes), block, fmt)
  # The stored descale is the E8M0 value itself (2**-127 for a block of zeros).
  return dataclasses.replace(quantized, scale_inv=e8m0_to_float32(codes))


def _e8m0_reciprocal(codes: jax.Array) -> jax.Array:
  """float32 2**(127 - code), built from its exponent bits (NaN for code 255).

  Not `1 / e8m0_to_float32(codes)`: 2**-127 is subnormal, and backends that
  flush subnormals (XLA on CPU does) would divide by 0. For finite blocks the
  code is at most 119 + 127 (amax < 2**128), so 2**(127 - code) is a normal float32.
  """
  codes = jnp.asarray(codes, jnp.int32)
  value = jax.lax.bitcast_convert_type(jnp.left_shift(254 - codes, 23), jnp.float32)
  return jnp.where(codes == E8M0_NAN, jnp.float32(jnp.nan), value)


def dequantize_blocks(quantized: BlockQuantized, dtype=jnp.float32) -> jax.Array:
  """`q * scale_inv_b` per block, formed in float32, returned in `dtype`."""
  per_element = expand_blocks(quantized.scale_inv, quantized.block, quantized.q.shape)
  return (quantized.q.astype(jnp.float32) * per_element).astype(dtype)


def _check_block(block, x) -> tuple[int, int]:
  if (not isinstance(block, (tuple, list)) or len(block) != 2
      or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
    raise ValueError(f"block={block!r} must be two positive ints (rows, columns) of a block.")
  if jnp.ndim(x) < 2:
    raise ValueError(f"x has shape {jnp.shape(x)}; block quantization needs at least 2 dims "
                     "[..., R, C]. Reshape a vector to [1, C].")
  return int(block[0]), int(block[1])


# ----- GEMMs of block-quantized operands ---------------------------------------------------


def batched_dims(ndim: int):
  """dot_general dims of `[..., P, C] @ [..., C, Q]` with the leading dims as batch."""
  batch = tuple(range(ndim - 2))
  return (((ndim - 1,), (ndim - 2,)), (batch, batch))


def rowwise_gemm(a: BlockQuantized, b: BlockQuantized, out_dtype) -> jax.Array:
  """`(q(A) @ q(B)) * a_inv[:, None] * b_inv[None, :]` in `out_dtype`.

  a: q [..., P, C] with scale_inv [..., P, 1]; b: q [..., C, Q] with scale_inv
  [..., 1, Q]. The raw FP8 dot accumulates in float32; the descales multiply
  its float32 product, which is then rounded once to `out_dtype`.
  """
  product = jax.lax.dot_general(a.q, b.q, batched_dims(a.q.ndim),
                                preferred_element_type=jnp.float32)
  return (product * a.scale_inv * b.scale_inv).astype(out_dtype)


def emulated_block_gemm(a: BlockQuantized, b: BlockQuantized, out_dtype) -> jax.Array:
  """`dequantize(A) @ dequantize(B)` in float32 at HIGHEST precision, rounded to `out_dtype`."""
  return jax.lax.dot_general(dequantize_blocks(a), dequantize_blocks(b),
                             batched_dims(a.q.ndim), precision=jax.lax.Precision.HIGHEST,
                             preferred_element_type=jnp.float32).astype(out_dtype)


def pallas_block_gemm(a: BlockQuantized, b: BlockQuantized, out_dtype) -> jax.Array:
  """The block-scaled Mosaic GPU kernel on A [P, C] (1 x 128 tiles) and B [C, Q] (128 x 128)."""
  if jax.default_backend() != "gpu":
    raise ValueError(
        "BlockScaling(gemm='pallas_hopper') runs the block-scaled FP8 GEMM kernel, which needs "
        f"a GPU, but JAX's backend is {jax.default_backend()!r}. Use "
        "BlockScaling(gemm='emulated') (the default) on this platform.")
  if a.q.ndim != 2:
    raise ValueError(
        f"BlockScaling(gemm='pallas_hopper') runs 2-D GEMMs only; this dot_general has batch "
        f"dims (operand shape {a.q.shape}). Use gemm='emulated' for batched contractions.")
  if not pallas_kernels.BLOCK_SCALED_GEMM_VALIDATED_ON_GPU:
    warnings.warn(
        "BlockScaling(gemm='pallas_hopper'): the block-scaled GEMM kernel has not yet been "
        "validated against its reference on a GPU (pallas_kernels.block_scaled_matmul."
        "BLOCK_SCALED_GEMM_VALIDATED_ON_GPU is False).", stacklevel=2)
  try:
    return pallas_kernels.block_scaled_matmul(a.q, a.scale_inv, b.q.T, b.scale_inv.T,
                                              out_dtype=out_dtype)
  except (ValueError, TypeError) as error:  # shapes or dtypes the kernel does not take
    raise type(error)(f"BlockScaling(gemm='pallas_hopper'): {error} Or use "
                      "gemm='emulated', which takes any shape.") from error
