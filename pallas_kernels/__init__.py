"""Pallas kernels (no Flax here). This module is the entry point fp8jax uses.

* `flash_attention`, `flash_attention_forward`, `flash_attention_backward`:
  the fused FlashAttention-2 kernels (Triton-lowered on GPUs, the Pallas
  interpreter on CPU), bf16/f16 and FP8 E4M3 with descales.
* `hopper_fp8_attention_forward`: the FP8 forward whose dots are FP8 `wgmma` on
  Hopper (Mosaic GPU); q, k and V^T as E4M3.
"""
from pallas_kernels.flash_attention import (SUPPORTED_HEAD_DIMS, flash_attention,
                                            flash_attention_backward, flash_attention_forward)
from pallas_kernels.flash_attention_fp8_hopper import (
    flash_attention_fp8 as hopper_fp8_attention_forward, transpose_v)

__all__ = [
    "SUPPORTED_HEAD_DIMS", "flash_attention", "flash_attention_backward",
    "flash_attention_forward", "hopper_fp8_attention_forward", "transpose_v",
]
