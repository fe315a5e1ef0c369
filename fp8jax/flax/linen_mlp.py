"""`Fp8Mlp`: a transformer's MLP, `down(gelu(up(x)))`, in FP8 with the GELU in the casts.

    mlp = Fp8Mlp(hidden=4 * d, recipe=fp8jax.DelayedScaling(), dtype=jnp.bfloat16)
    y = mlp(x)                                    # x [..., d] -> y [..., d]

The two projections are `fp8jax.ops.mlp.fp8_mlp`'s: under delayed and current scaling the second
projection's FP8 cast computes the GELU of the first's output itself, and the first's
output-gradient cast computes the GELU's backward, so neither the activation nor its
gradient is written in bf16 and read back (see there). Parameters and state sit where a
pair of `Fp8Dense(use_bias=False)` layers named "up" and "down" keeps them:

    params:   {"up": {"kernel": [d, hidden]}, "down": {"kernel": [hidden, features]}}
    fp8_meta: {"up": {"dot_meta": DotMeta}, "down": {"dot_meta": DotMeta}}

so a model written with those two layers and `nn.gelu(approximate=True)` loads into it.
"""
from __future__ import annotations

from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from fp8jax.core.recipes import DelayedScaling, Recipe
from fp8jax.flax.linen import default_kernel_init, dot_meta_variable, read_meta, store_dot_meta
from fp8jax.flax.master_kernel import master_kernel
from fp8jax.ops.mlp import fp8_mlp
from fp8jax.ops.norm_dense import NORM_EPS


class MlpWeights(nn.Module):
  """One projection's kernel and `DotMeta`, under the names an `Fp8Dense` gives them."""

  shape: tuple[int, int]
  recipe: Recipe
  param_dtype: Any
  kernel_init: Callable

  @nn.compact
  def __call__(self):
    kernel = self.param("kernel", self.kernel_init, self.shape, self.param_dtype)
    return kernel, dot_meta_variable(self, self.recipe)


class Fp8Mlp(nn.Module):
  """`down(gelu(up(x)))` without biases, both projections FP8, the GELU in their casts.

  Attributes:
    hidden: F, the up projection's width.
    features: the output width (default: x's last dimension).
    recipe: the FP8 scaling recipe of both projections.
    dtype: computation dtype of x (None keeps x's); the kernels are quantized from
      their stored (master) dtype (`fp8jax.flax.master_kernel`).
    param_dtype: dtype of the kernels.
    kernel_init: the up projection's initializer.
    output_kernel_init: the down projection's (default: `kernel_init`).
    save_fp8: keep the GELU's input for the backward in FP8 (`fp8jax.ops.saved_activations`).
  """

  hidden: int
  features: int | None = None
  recipe: Recipe = DelayedScaling()
  dtype: Any = None
  param_dtype: Any = jnp.float32
  kernel_init: Callable = default_kernel_init
  output_kernel_init: Callable | None = None
  save_fp8: bool = False

  @nn.compact
  def __call__(self, inputs: jax.Array, *, norm_scale: jax.Array | None = None,
               norm_eps: float = NORM_EPS, norm_save_fp8: bool | None = None,
               residual: jax.Array | None = None) -> jax.Array:
    """inputs [..., D] -> [..., features], in the computation dtype. `norm_scale`: the gain
    [D] of an RMSNorm to apply to the inputs first, made by the up projection's FP8 cast
    (`fp8jax.ops.mlp.fp8_mlp`); `norm_eps`: its eps. `norm_save_fp8`: None (the layer's
    `save_fp8`) or equal to it (one flag keeps both inputs in FP8). `residual` (with
    `norm_scale`): the pre-norm sublayer `s + mlp(rms_norm(s))`, `s = inputs + residual`."""
    if norm_scale is not None and norm_save_fp8 not in (None, self.save_fp8):
      raise ValueError(f"norm_save_fp8={norm_save_fp8} differs from the layer's save_fp8="
                       f"{self.save_fp8}: fp8_mlp keeps the norm's and the GELU's inputs "
                       "alike. Pass the layer's save_fp8.")
    d = inputs.shape[-1]
    features = self.features or d
    if residual is not None and features != d:
      raise ValueError(f"residual is added to the output, so the layer's features={features} "
                       f"must be the inputs' width {d} (or None).")
    up = MlpWeights((d, self.hidden), self.recipe, self.param_dtype, self.kernel_init, name="up")
    down = MlpWeights((self.hidden, features), self.recipe, self.param_dtype,
                    self.output_kernel_init or self.kernel_init, name="down")
    (w_in, up_meta), (w_out, down_meta) = up(), down()
    x, promoted_in, promoted_out = nn.dtypes.promote_dtype(inputs, w_in, w_out,
                                                           dtype=self.dtype)
    y, new_up, new_down = fp8_mlp(x, master_kernel(w_in, promoted_in),
                                  master_kernel(w_out, promoted_out), read_meta(up, up_meta),
                                  read_meta(down, down_meta), save_fp8=self.save_fp8,
                                  norm_scale=norm_scale, norm_eps=norm_eps,
                                  residual=None if residual is None else residual.astype(x.dtype))
    store_dot_meta(up, up_meta, new_up)
    store_dot_meta(down, down_meta, new_down)
    return y
