"""`Fp8MoE`: a dropless mixture-of-experts MLP for linen whose expert GEMMs run in FP8.

    moe = Fp8MoE(num_experts=8, top_k=2, hidden=4 * d)
    y = moe.apply(variables, x, mutable=["fp8_meta", "intermediates"])

A router (a float32 Dense, small and precision-sensitive: it stays high precision) picks
each token's top-k experts; the (token, expert) pairs are sorted by expert
(`fp8jax.ops.moe_routing`), each expert's MLP `activation(x @ w_in[e]) @ w_out[e]` runs as
two grouped matmuls (`fp8jax.fp8_ragged_dot`, with one `RaggedDotMeta` each in the
"fp8_meta" collection, a scale per expert), and the outputs are unsorted and combined by
the router's weights. Nothing is dropped: no capacity factor. The Switch Transformer
load-balancing loss is sown as "load_balancing_loss" in the "intermediates" collection;
add `aux_weight * loss` to the training loss (`sum_sown_losses` collects them).
`fp8=False` runs the same layer in the input dtype (the bf16 baseline) through
`fp8jax.bf16_ragged_dot`: `jax.lax.ragged_dot`, run on JAX's own Hopper grouped GEMM kernels
where the program is lowered for an H100 (XLA's `lax.ragged_dot` would multiply every row
by every expert there).
"""
from __future__ import annotations

from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from fp8jax.core.meta import init_ragged_dot_meta
from fp8jax.core.recipes import DelayedScaling, Recipe
from fp8jax.flax.linen import default_kernel_init, fp8_variable, read_meta, store_dot_meta
from fp8jax.ops import moe_routing
from fp8jax.ops.bf16_ragged_dot import bf16_ragged_dot
from fp8jax.ops.ragged_dot import fp8_ragged_dot

LOSS_NAME = "load_balancing_loss"


class Fp8MoE(nn.Module):
  """Mixture-of-experts MLP: x [..., d] -> [..., d] (see the module docstring).

  Attributes:
    num_experts: E.
    top_k: experts per token.
    hidden: each expert's hidden width.
    activation: the experts' non-linearity (GELU by default).
    fp8: run the expert GEMMs in FP8 (else `fp8jax.bf16_ragged_dot` in the input dtype).
    recipe: the FP8 recipe of both grouped matmuls.
    dtype: computation dtype (None: x's); param_dtype: the parameters'.
    kernel_init: the initializer of the router and of each expert's weights.
    output_kernel_init: that of each expert's `w_out` (None: `kernel_init`), e.g. the
      smaller standard deviation GPT-2 gives a residual branch's last projection.
  """

  num_experts: int
  top_k: int
  hidden: int
  activation: Callable = nn.gelu
  fp8: bool = True
  recipe: Recipe = DelayedScaling()
  dtype: Any = None
  param_dtype: Any = jnp.float32
  kernel_init: Callable = default_kernel_init
  output_kernel_init: Callable | None = None

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    features = x.shape[-1]
    tokens = x.reshape(-1, features)
    logits = nn.Dense(self.num_experts, use_bias=False, dtype=jnp.float32,
                      param_dtype=self.param_dtype, kernel_init=self.kernel_init,
                      name="router")(tokens.astype(jnp.float32))
    routing = moe_routing.route_top_k(logits, self.top_k)
    self.sow("intermediates", LOSS_NAME, moe_routing.load_balancing_loss(routing))
    x_sorted, group_sizes, order = moe_routing.sort_by_expert(tokens, routing.experts,
                                                              self.num_experts)
    dtype = self.dtype or x.dtype
    w_in = self._experts("w_in", (features, self.hidden), self.kernel_init).astype(dtype)
    w_out = self._experts("w_out", (self.hidden, features),
                          self.output_kernel_init or self.kernel_init).astype(dtype)
    h = self._grouped(x_sorted.astype(dtype), w_in, group_sizes, "w_in_meta")
    y_sorted = self._grouped(self.activation(h), w_out, group_sizes, "w_out_meta")
    y = moe_routing.combine(y_sorted, order, routing.weights)
    return y.reshape(x.shape).astype(dtype)

  def _experts(self, name: str, shape: tuple, kernel_init: Callable) -> jax.Array:
    """[E, *shape], each expert initialized as its own dense kernel."""
    init = jax.vmap(lambda key: kernel_init(key, shape, self.param_dtype))
    return self.param(name, lambda key: init(jax.random.split(key, self.num_experts)))

  def _grouped(self, x, w, group_sizes, meta_name: str):
    if not self.fp8:
      # Every sorted (token, expert) pair has its expert: the groups fill the rows.
      return bf16_ragged_dot(x, w, group_sizes, all_rows_grouped=True)
    variable = fp8_variable(self, meta_name, init_ragged_dot_meta, self.recipe,
                            self.num_experts)
    y, new_meta = fp8_ragged_dot(x, w, group_sizes, read_meta(self, variable))
    store_dot_meta(self, variable, new_meta)
    return y


def sum_sown_losses(intermediates: Any, name: str = LOSS_NAME) -> jax.Array:
  """The sum of every value sown as `name` in an "intermediates" collection.

  Args:
    intermediates: the collection `apply(..., mutable=["intermediates"])` returned.
    name: what the layers sowed (each MoE layer's load-balancing loss by default).

  Returns:
    float32[]: the sum (0 where nothing was sown).
  """
  total = jnp.zeros((), jnp.float32)
  for path, value in jax.tree_util.tree_leaves_with_path(intermediates):
    if any(getattr(key, "key", None) == name for key in path):
      total = total + jnp.sum(value)
  return total
