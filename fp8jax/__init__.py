"""fp8jax: functional FP8 training for JAX/Flax on Hopper GPUs.

Everything is a pure function over explicit pytrees: parameters, optimizer
state, and the FP8 state (`Fp8Meta`: scale + amax history per tensor role).

Public submodules besides the names below: `fp8jax.flax.linen` and
`fp8jax.flax.nnx` (Flax layers), `fp8jax.checkpoint` (orbax checkpoints; needs
the 'checkpoint' extra), `fp8jax.sharding`, `fp8jax.lowering` (GEMM report and
cost model), `fp8jax.deviceless`, `fp8jax.attention_backend` and
`fp8jax.fused_kernels` (where the fused FP8 kernels run; `fused_kernels(True)`),
`fp8jax.telemetry` (what quantization does to each tensor: saturation,
underflow, SNR), and the demo's `fp8jax.models.gpt` (a byte-level GPT of fp8jax layers),
`fp8jax.data` (its embedded corpus) and `fp8jax.runs` (training runs: `fp8jax
train`, `compare`, `calibrate`).
"""
# Before any JAX backend is used: keeps CPU-only machines with the CUDA plugin quiet.
from fp8jax import platform_guard  # noqa: F401
from fp8jax.formats import E4M3, E5M2, Fp8Format, formats_for
from fp8jax.recipes import (BlockScaling, CurrentScaling, DelayedScaling, MXFP8Scaling, Recipe,
                            RowwiseScaling)
from fp8jax.meta import (DotMeta, Fp8Meta, init_dot_meta, init_meta, merge_stacked_metas,
                         resize_history)
from fp8jax.quantize import amax, dequantize, quantize
from fp8jax.scaling import begin_step, close_step, end_step, merge_step, scale_from_amax
from fp8jax.dot import fp8_dot_general
from fp8jax.dense import fp8_dense
from fp8jax.einsum import fp8_einsum
from fp8jax.training import accumulate_gradients, value_and_grad
from fp8jax.meta_threading import UnthreadedStateError
from fp8jax.state_gradients import Fp8StateGradientError, differentiating_fp8_state
from fp8jax.forward_mode import ForwardModeError
from fp8jax.fused_attention import AttentionMeta, attention, fp8_attention, init_attention_meta
from fp8jax.sharding import all_reduce_amax
from fp8jax import attention_backend, deviceless, fused_kernels, lowering, telemetry

__all__ = [
    "E4M3", "E5M2", "Fp8Format", "formats_for",
    "Recipe", "CurrentScaling", "DelayedScaling", "RowwiseScaling", "BlockScaling",
    "MXFP8Scaling",
    "DotMeta", "Fp8Meta", "init_dot_meta", "init_meta", "merge_stacked_metas",
    "resize_history",
    "amax", "dequantize", "quantize",
    "begin_step", "close_step", "end_step", "merge_step", "scale_from_amax",
    "fp8_dot_general", "fp8_dense", "fp8_einsum",
    "accumulate_gradients", "value_and_grad", "UnthreadedStateError",
    "Fp8StateGradientError", "differentiating_fp8_state", "ForwardModeError",
    "all_reduce_amax",
    "AttentionMeta", "attention", "fp8_attention", "init_attention_meta",
    "attention_backend", "deviceless", "fused_kernels", "lowering", "telemetry",
]
