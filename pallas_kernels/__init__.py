"""Pallas kernels (no Flax here). This module is the entry point fp8jax uses.

* `flash_attention`, `flash_attention_forward`, `flash_attention_backward`:
  the fused FlashAttention-2 kernels (Triton-lowered on GPUs, the Pallas
  interpreter on CPU), bf16/f16 and FP8 E4M3 with descales.
* `hopper_attention` (bf16/f16, differentiable; its passes alone:
  `hopper_bf16_attention_forward` / `_backward`), `hopper_fp8_attention_forward` and
  `hopper_fp8_attention_backward`: FlashAttention-3 style kernels on Hopper tensor cores
  (Mosaic GPU, warp-specialized, TMA-fed `wgmma`, FP8 products in E4M3);
  `HopperAttentionBlockSizes` their tiles; `quantize_gradient` the backward's E4M3
  cast of dO (for callers that quantize the whole dO before running on shards);
  `quantize_head_blocks` the E4M3 cast of q, k or v with one current scale per
  `ATTENTION_SCALE_BLOCK` (128) rows of each head, whose descales the FP8 pair also takes.
* `adam_fp8_update`: Adam's step of a 2-D leaf whose moments are stored in FP8
  (`fp8jax.optim`) in one pass: the gradient and both stored moments read, the update
  and both moments stored again written; its stochastic rounding draws
  `jax.random.uniform`'s numbers in the kernel (`pallas_kernels.threefry`).
* `cast_transpose_amax`: one pass over a 2-D tensor that writes its FP8 copy, the
  transposed FP8 copy and its amax folded into a running amax (Triton-lowered on GPUs,
  the Pallas interpreter on CPU); `cast_transpose_amax_reference` is its plain-jnp
  definition, `CastTransposeBlockSizes` its tiles. With `valid_rows` only the leading
  rows are read (`rows_in_use`: the others as 0), for a grouped GEMM's padded rows.
* `cast_transpose_amax_in_chain`: the same kernel as one launch of a chain (an FP8
  layer's casts) that leaves no buffer to initialise before it: the first launch
  writes its tile maxima (`tile_count` of them), a later one reduces them and writes
  zeroed accumulators that later launches fold their amaxes into;
  `cast_transpose_amax_in_chain_reference` its plain-jnp definition.
  A prologue can make the tensor cast: the GELU, its backward, an RMSNorm
  (`pallas_kernels.activations`), or a qkv projection's output gradient from dq, dk, dv
  and RoPE's transpose (`pallas_kernels.rotary_gradient.rotary_qkv_gradient`).
* `cast_transpose_stacked`: every layer's FP8 weight of a stack [L, R, C] in one launch
  (each layer's FP8 copy and transposed copy in buffers of their own, its running amax
  updated in place), for a loop over layers whose scales are known before it;
  `cast_transpose_stacked_reference` its plain-jnp definition.
* `cast_transpose_from_amax`: current scaling's cast in one launch: given the tensor's
  amax, the kernel makes the scale, its reciprocal, the GEMMs' descales and the running
  amax itself (no scalar launch around it); `cast_transpose_from_amax_reference` its
  plain-jnp definition, `CastFromAmax` what it returns.
* `VectorElement`: a float32 scalar operand of the casts (a scale, a descale) read in
  place from a vector of packed scalars, so no launch slices it out first.
* `running_amax`: the amax-only pass of the same kernel, max(amax_in, max|x|) (the
  module's `cast_transpose.amax`, renamed here so it does not read like
  `fp8jax.quantize.amax`, which takes no running amax).
* `block_scaled_matmul`: the DeepSeek-V3 style FP8 GEMM for Hopper (Mosaic GPU):
  E4M3 operands with 1x128 (A) and 128x128 (B) descales, FP8 `wgmma` per 128 of K,
  promoted into an f32 accumulator; `block_scaled_matmul_reference` is its plain-jnp
  definition and CPU path, `BlockScaledMatmulBlockSizes` its tiles.
* `ragged_matmul` and `transposed_ragged_matmul`: grouped (ragged) FP8 GEMMs for
  mixture-of-experts layers on Hopper (Mosaic GPU, persistent and warp-specialized, E4M3
  `wgmma`), with `jax.lax.ragged_dot` semantics: `ragged_matmul` is the forward and dgrad
  form ([M, Kc] rows by group times a [G, Nout, Kc] weight), `transposed_ragged_matmul`
  the wgrad form (per group, a_t [Ka, M] b_t [Nb, M]^T over the group's tokens); descales
  per tensor, per row, or per 128 block promoted in the loop (DeepSeek-V3). Their
  `*_reference` functions are the plain-jnp definitions and CPU paths,
  `RaggedMatmulBlockSizes` / `TransposedRaggedMatmulBlockSizes` their tiles, and
  `RAGGED_GEMM_VALIDATED_ON_GPU` says whether they have passed on a GPU yet.
* `close_steps`: the end-of-step update of delayed scaling (history roll, new
  scale and reciprocal) for many tensor roles in one launch;
  `close_steps_reference` is its plain-jnp definition; `amax_max` the max of
  two amaxes that keeps NaN on every backend.
* `can_declare_varying_outputs`: whether these kernels can run inside
  `jax.shard_map` on this JAX (they declare how their outputs vary over its
  mesh axes; `pallas_kernels.varying`).
"""
from pallas_kernels.adam_fp8 import adam_fp8_update
from pallas_kernels.cast_transpose import (cast_transpose_amax, cast_transpose_amax_reference,
                                           rows_in_use)
from pallas_kernels.cast_transpose_chain import (ChainedCast, cast_transpose_amax_in_chain,
                                                 cast_transpose_amax_in_chain_reference)
from pallas_kernels.cast_transpose_current import (CastFromAmax, cast_transpose_from_amax,
                                                   cast_transpose_from_amax_reference)
from pallas_kernels.cast_transpose_stacked import (cast_transpose_stacked,
                                                   cast_transpose_stacked_reference)
from pallas_kernels.cast_transpose_tiling import CastTransposeBlockSizes, tile_count
from pallas_kernels.vector_element import VectorElement, element_value
from pallas_kernels.cast_transpose import amax as running_amax
from pallas_kernels.scale_update import amax_max, close_steps, close_steps_reference
from pallas_kernels.varying import can_declare_varying_outputs
from pallas_kernels.flash_attention import (SUPPORTED_HEAD_DIMS, flash_attention,
                                            flash_attention_backward, flash_attention_forward,
                                            fp8_forward_reference)
from pallas_kernels.hopper_attention import (hopper_attention, hopper_bf16_attention_backward,
                                             hopper_bf16_attention_forward,
                                             hopper_fp8_attention_backward,
                                             hopper_fp8_attention_forward, quantize_gradient,
                                             quantize_head_blocks)
from pallas_kernels.hopper_attention_tiling import HopperAttentionBlockSizes
from pallas_kernels.hopper_attention_tiling import SCALE_BLOCK as ATTENTION_SCALE_BLOCK
from pallas_kernels.block_scaled_matmul import (BLOCK_SCALED_GEMM_VALIDATED_ON_GPU,
                                                BlockScaledMatmulBlockSizes,
                                                block_scaled_matmul,
                                                block_scaled_matmul_reference)
from pallas_kernels.ragged_tiling import (RaggedMatmulBlockSizes,
                                          TransposedRaggedMatmulBlockSizes)
from pallas_kernels.ragged_matmul import (RAGGED_GEMM_VALIDATED_ON_GPU, ragged_matmul,
                                          ragged_matmul_reference)
from pallas_kernels.transposed_ragged_matmul import (transposed_ragged_matmul,
                                                     transposed_ragged_matmul_reference)

__all__ = [
    "adam_fp8_update",
    "BLOCK_SCALED_GEMM_VALIDATED_ON_GPU", "BlockScaledMatmulBlockSizes", "block_scaled_matmul",
    "block_scaled_matmul_reference",
    "CastFromAmax", "CastTransposeBlockSizes", "ChainedCast", "SUPPORTED_HEAD_DIMS", "amax_max",
    "can_declare_varying_outputs", "cast_transpose_amax", "cast_transpose_amax_in_chain",
    "cast_transpose_amax_in_chain_reference", "cast_transpose_from_amax",
    "cast_transpose_from_amax_reference", "cast_transpose_stacked",
    "cast_transpose_stacked_reference", "rows_in_use", "tile_count",
    "cast_transpose_amax_reference", "close_steps", "close_steps_reference", "flash_attention",
    "flash_attention_backward", "flash_attention_forward", "fp8_forward_reference",
    "ATTENTION_SCALE_BLOCK", "HopperAttentionBlockSizes", "hopper_attention",
    "hopper_bf16_attention_backward", "hopper_bf16_attention_forward",
    "hopper_fp8_attention_backward", "hopper_fp8_attention_forward", "quantize_gradient",
    "quantize_head_blocks", "running_amax",
    "RAGGED_GEMM_VALIDATED_ON_GPU", "RaggedMatmulBlockSizes", "TransposedRaggedMatmulBlockSizes",
    "ragged_matmul", "ragged_matmul_reference", "transposed_ragged_matmul",
    "transposed_ragged_matmul_reference",
]
