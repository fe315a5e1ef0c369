"""Block-scaled GEMMs on Blackwell: `jax.nn.scaled_matmul` on MXFP8 and NVFP4 operands.

Blackwell's tensor cores apply per-block scales inside the GEMM. JAX exposes them as
`jax.nn.scaled_matmul`, which compiled for a Blackwell GPU becomes cuDNN's block-scaled
dot (the custom call `__cudnn$blockScaledDot`) when its operands are

    MXFP8: float8_e4m3fn / float8_e5m2 values, float8_e8m0fnu scales, blocks of 32
    NVFP4: float4_e2m1fn values, float8_e4m3fn scales, blocks of 16

both operands contracting their last axis, with one scale per block along it. On every
other target the recipes keep their emulation (dequantize, float32 GEMM), which computes
the same products; `Recipe.target_gemm` chooses.

A GEMM `A [..., P, C] @ B [..., C, Q]` here has A quantized in (1, bs) blocks and B in
(bs, 1) blocks or, for a weight, (bs, bs) blocks, whose scale repeats over the bs
columns of the block. NVFP4's per-tensor scales multiply the float32 product.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from fp8jax.core.blocks import BlockQuantized

# GPU architectures whose cuDNN block-scaled dot `jax.nn.scaled_matmul` lowers to.
BLACKWELL_ARCHS = ("sm_100", "sm_103")


def is_blackwell(gpu_arch: str | None) -> bool:
  """Whether a compile target's architecture ("sm_100", ...) has block-scaled tensor cores."""
  return gpu_arch in BLACKWELL_ARCHS


def blackwell_gemm(a: BlockQuantized, b: BlockQuantized, out_dtype, scale_dtype,
                   setting: str) -> jax.Array:
  """`A @ B` by `jax.nn.scaled_matmul`, in `out_dtype`.

  Args:
    a: values [..., P, C] in (1, bs) blocks.
    b: values [..., C, Q] in (bs, 1) or (bs, bs) blocks.
    out_dtype: the result's dtype (the product accumulates in float32).
    scale_dtype: the block scales' dtype: float8_e8m0fnu (MXFP8: `scale_inv`, powers of
      two, converted exactly) or float8_e4m3fn (NVFP4: `block_scale`, with the tensor
      scales `tensor_scale_inv` applied to the product).
    setting: the recipe option that chose this path, for error messages.

  Raises:
    ValueError: C is not a multiple of the block size (cuDNN takes whole blocks only).
  """
  size = b.block[0]
  contraction = a.q.shape[-1]
  if contraction % size:
    raise ValueError(
        f"{setting} runs jax.nn.scaled_matmul, which takes whole blocks of {size} along the "
        f"contraction, but this GEMM contracts {contraction} elements. Pad that dimension "
        f"to a multiple of {size}, or use gemm='emulated', which takes any size.")
  nvfp4 = jnp.dtype(scale_dtype) == jnp.dtype(jnp.float8_e4m3fn)
  a_scales = a.block_scale if nvfp4 else a.scale_inv.astype(scale_dtype)
  b_scales = b.block_scale if nvfp4 else b.scale_inv.astype(scale_dtype)
  if b.block[1] > 1:  # a weight's (bs, bs) block: one scale for each of its columns
    b_scales = jnp.repeat(b_scales, b.block[1], axis=-1)[..., :b.q.shape[-1]]
  batch = a.q.shape[:-2]
  lhs = a.q.reshape(math.prod(batch), *a.q.shape[-2:])
  rhs = jnp.swapaxes(b.q, -1, -2).reshape(lhs.shape[0], b.q.shape[-1], contraction)
  lhs_scales = a_scales.reshape(lhs.shape[0], *a_scales.shape[-2:])
  rhs_scales = jnp.swapaxes(b_scales, -1, -2).reshape(lhs.shape[0], b.q.shape[-1], -1)
  product = jax.nn.scaled_matmul(lhs, rhs, lhs_scales, rhs_scales,
                                 preferred_element_type=jnp.float32)
  if nvfp4:
    product = product / a.tensor_scale / b.tensor_scale
  return product.reshape(*batch, *product.shape[-2:]).astype(out_dtype)
