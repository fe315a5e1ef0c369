"""fp8jax: functional FP8 training for JAX/Flax on Hopper GPUs.

Everything is a pure function over explicit pytrees: parameters, optimizer
state, and the FP8 state (`Fp8Meta`: scale + amax history per tensor role).

Public submodules besides the names below: `fp8jax.flax.linen` and
`fp8jax.flax.nnx` (Flax layers), `fp8jax.checkpoint` (orbax checkpoints; needs
the 'checkpoint' extra), `fp8jax.step.all_reduce` and `fp8jax.mesh.axes` (FP8
state on a mesh), `fp8jax.lowering` (GEMM report and cost model),
`fp8jax.deviceless`, `fp8jax.attention_backend` (`fp8jax.ops.attention_backend`:
which attention kernel runs) and `fp8jax.fused_kernels` (`fp8jax.ops.fused_kernels`:
where the fused FP8 kernels run; `fused_kernels(True)`),
`fp8jax.telemetry` (what quantization does to each tensor: saturation,
underflow, SNR), `fp8jax.optim` (Adam / AdamW with FP8 moments),
`fp8jax.saved_activations` (activations kept for the backward in FP8, and a
`jax.checkpoint` policy that keeps exactly them), and the demo's `fp8jax.models.gpt` (a byte-level GPT of fp8jax layers),
`fp8jax.data` (its embedded corpus) and `fp8jax.runs` (training runs: `fp8jax
train`, `compare`, `calibrate`).

The code lives in layers, each importing only from those below it (docs/development.md, "Layout"):
`core` (numerics and state), `mesh`, `ops` (the FP8 ops), `step` (closing a step,
`value_and_grad`), then telemetry, checkpoints, lowering, Flax, the demo and the CLI.
"""
# Before any JAX backend is used: keeps CPU-only machines with the CUDA plugin quiet.
from fp8jax import platform_guard  # noqa: F401
from fp8jax.core.formats import E2M1, E4M3, E5M2, Fp8Format, formats_for
from fp8jax.core.recipes import (BlockScaling, CurrentScaling, DelayedScaling, MXFP8Scaling,
                                 NVFP4Scaling, Recipe, RowwiseScaling)
from fp8jax.core.meta import (AttentionMeta, DotMeta, Fp8Meta, RaggedDotMeta,
                              init_attention_meta, init_dot_meta, init_meta,
                              init_ragged_dot_meta, merge_stacked_metas, resize_history)
from fp8jax.core.quantize import amax, dequantize, quantize, scale_from_amax
from fp8jax.ops.dot import fp8_dot_general
from fp8jax.ops.dense import fp8_dense
from fp8jax.ops.einsum import fp8_einsum
from fp8jax.ops.mlp import fp8_mlp
from fp8jax.ops.norm_dense import fp8_rms_norm_dense
from fp8jax.ops.norm_qkv_rope import fp8_rms_norm_qkv_rope
from fp8jax.ops.ragged_dot import fp8_ragged_dot
from fp8jax.ops.bf16_ragged_dot import bf16_ragged_dot
from fp8jax.ops.attention import attention, fp8_attention
from fp8jax.ops.gelu import gelu
from fp8jax.ops.rms_norm import add_rms_norm, rms_norm
from fp8jax.ops import saved_activations  # noqa: F401  (fp8jax.saved_activations.policy())
from fp8jax.ops.guards import (ForwardModeError, Fp8StateGradientError, UnthreadedStateError,
                               differentiating_fp8_state)
from fp8jax.step.close import begin_step, close_step, end_step, merge_step
from fp8jax.step.training import accumulate_gradients, calibrate, value_and_grad
from fp8jax.step.all_reduce import all_reduce_amax
# The tools; the attention backends and the fused kernels are public submodules of ops.
from fp8jax import deviceless, lowering, optim, telemetry  # noqa: F401
from fp8jax.ops import attention_backend, fused_kernels, stacked_weights  # noqa: F401

__all__ = [
    "E2M1", "E4M3", "E5M2", "Fp8Format", "formats_for",
    "Recipe", "CurrentScaling", "DelayedScaling", "RowwiseScaling", "BlockScaling",
    "MXFP8Scaling", "NVFP4Scaling",
    "DotMeta", "Fp8Meta", "init_dot_meta", "init_meta", "merge_stacked_metas",
    "resize_history",
    "amax", "dequantize", "quantize",
    "begin_step", "close_step", "end_step", "merge_step", "scale_from_amax",
    "fp8_dot_general", "fp8_dense", "fp8_einsum", "fp8_mlp", "fp8_rms_norm_dense",
    "fp8_rms_norm_qkv_rope",
    "RaggedDotMeta", "fp8_ragged_dot", "init_ragged_dot_meta", "bf16_ragged_dot",
    "accumulate_gradients", "calibrate", "value_and_grad", "UnthreadedStateError",
    "Fp8StateGradientError", "differentiating_fp8_state", "ForwardModeError",
    "all_reduce_amax",
    "AttentionMeta", "attention", "fp8_attention", "init_attention_meta",
    "rms_norm", "add_rms_norm", "gelu",
    "attention_backend", "deviceless", "fused_kernels", "lowering", "optim", "stacked_weights",
    "telemetry",
]
