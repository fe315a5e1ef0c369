"""`Fp8NormQkvRope`: a transformer block's norm, FP8 qkv projection and RoPE, with the qkv
gradient cast straight from attention's dq, dk and dv.

    qkv = Fp8NormQkvRope(heads=16, head_dim=64, recipe=fp8jax.DelayedScaling(),
                         dtype=jnp.bfloat16)
    q, k, v = qkv(x, norm_scale=gain)     # x [batch, seq, d] -> 3 x [batch, seq, heads, head_dim]

What `fp8jax.ops.norm_qkv_rope.fp8_rms_norm_qkv_rope` computes: rms_norm(x) projected to
each head's q, k and v by one FP8 GEMM, RoPE on q and k at positions 0, 1, ... Under delayed
and current scaling the projection's casts make the normalized input themselves (no bf16 norm output)
and its output-gradient cast reads dq, dk and dv as attention returns them (no stacked bf16
gradient); elsewhere the same numbers by the unfused ops. Parameters and state sit where an
`Fp8DenseGeneral(features=(heads, 3, head_dim), use_bias=False)` keeps them:

    params:   {"kernel": [d, heads, 3, head_dim]}
    fp8_meta: {"dot_meta": DotMeta}

so a block written with that layer, the norm's gain handed over as its `norm_scale=`, and
RoPE after it loads into this one.
"""
from __future__ import annotations

from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from fp8jax.core.recipes import DelayedScaling, Recipe
from fp8jax.flax.linen import default_kernel_init, dot_meta_variable, read_meta, store_dot_meta
from fp8jax.flax.master_kernel import master_kernel
from fp8jax.ops.norm_dense import NORM_EPS
from fp8jax.ops.norm_qkv_rope import fp8_rms_norm_qkv_rope


class Fp8NormQkvRope(nn.Module):
  """rms_norm(x) -> q, k, v per head by one FP8 projection, RoPE on q and k (no biases).

  Attributes:
    heads: attention heads.
    head_dim: features per head (even; the fused backward needs 32, 64, 128 or 256).
    rope_base: RoPE's base (`fp8jax.ops.rotary.rope`).
    recipe: the projection's FP8 scaling recipe.
    dtype: computation dtype of x (None keeps x's); the kernel is quantized from its
      stored (master) dtype (`fp8jax.flax.master_kernel`).
    param_dtype: dtype of the kernel.
    kernel_init: the kernel's initializer.
  """

  heads: int
  head_dim: int
  rope_base: float = 10000.0
  recipe: Recipe = DelayedScaling()
  dtype: Any = None
  param_dtype: Any = jnp.float32
  kernel_init: Callable = default_kernel_init

  @nn.compact
  def __call__(self, x: jax.Array, *, norm_scale: jax.Array, norm_eps: float = NORM_EPS,
               norm_save_fp8: bool = False) -> tuple[jax.Array, jax.Array, jax.Array]:
    """x [batch, seq, d]; `norm_scale` [d]: the norm's gain; `norm_eps`, `norm_save_fp8`:
    its eps and `save_fp8` (`fp8jax.rms_norm`).

    Returns:
      (q, k, v), each [batch, seq, heads, head_dim] in the computation dtype.
    """
    kernel = self.param("kernel", self.kernel_init,
                        (x.shape[-1], self.heads, 3, self.head_dim), self.param_dtype)
    x, promoted = nn.dtypes.promote_dtype(x, kernel, dtype=self.dtype)
    variable = dot_meta_variable(self, self.recipe)
    qkv, new_meta = fp8_rms_norm_qkv_rope(x, norm_scale, master_kernel(kernel, promoted),
                                          read_meta(self, variable), rope_base=self.rope_base,
                                          eps=norm_eps, save_fp8=norm_save_fp8)
    store_dot_meta(self, variable, new_meta)
    return qkv
