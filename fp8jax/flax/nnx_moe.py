"""`Fp8MoE` for nnx: a dropless mixture-of-experts MLP whose expert GEMMs run in FP8.

The same layer as `fp8jax.flax.linen_moe.Fp8MoE` (see there for the routing): a float32
router, top-k experts per token, two grouped matmuls (`fp8jax.fp8_ragged_dot`) whose
`RaggedDotMeta`s are `Fp8MetaVariable`s (so `nnx.split(model, nnx.Param,
Fp8MetaVariable)` and `fp8jax.flax.nnx_value_and_grad` carry them), and the combine.
Each call stores its load-balancing loss in the layer's `load_balancing_loss`
(an `nnx.Intermediate`: read `layer.load_balancing_loss[...]` after the call and add it
to the training loss); `model.eval()` stops the FP8 state's recording.
"""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx

from fp8jax.core.meta import init_ragged_dot_meta
from fp8jax.core.recipes import DelayedScaling, Recipe, check_recipe
from fp8jax.flax.nnx import Fp8MetaVariable, read_variable, record_variable
from fp8jax.ops import moe_routing
from fp8jax.ops.bf16_ragged_dot import bf16_ragged_dot
from fp8jax.ops.ragged_dot import fp8_ragged_dot


class Fp8MoE(nnx.Module):
  """Mixture-of-experts MLP: x [..., features] -> [..., features].

  Args:
    features: d, the input and output width.
    num_experts: E.
    top_k: experts per token.
    hidden: each expert's hidden width.
    activation: the experts' non-linearity (GELU by default).
    fp8: run the expert GEMMs in FP8 (else `fp8jax.bf16_ragged_dot` in the input dtype:
      `jax.lax.ragged_dot`, on JAX's Hopper grouped GEMM kernels where they apply).
    recipe: the FP8 recipe of both grouped matmuls.
    dtype, param_dtype: computation (None: x's) and parameter dtypes.
  """

  def __init__(self, features: int, num_experts: int, top_k: int, hidden: int, *,
               activation: Callable = nnx.gelu, fp8: bool = True,
               recipe: Recipe = DelayedScaling(), dtype: Any = None,
               param_dtype: Any = jnp.float32,
               kernel_init=nnx.initializers.lecun_normal(),
               use_running_average: bool = False, rngs: nnx.Rngs):
    check_recipe(recipe)
    self.num_experts, self.top_k, self.activation = num_experts, top_k, activation
    self.fp8, self.dtype = fp8, dtype
    self.use_running_average = use_running_average
    self.router = nnx.Linear(features, num_experts, use_bias=False, dtype=jnp.float32,
                             param_dtype=param_dtype, kernel_init=kernel_init, rngs=rngs)

    def experts(shape):
      keys = jax.random.split(rngs.params(), num_experts)
      return nnx.Param(jax.vmap(lambda key: kernel_init(key, shape, param_dtype))(keys))

    self.w_in = experts((features, hidden))
    self.w_out = experts((hidden, features))
    self.load_balancing_loss = nnx.Intermediate(jnp.zeros((), jnp.float32))
    if fp8:
      self.w_in_meta = Fp8MetaVariable(init_ragged_dot_meta(recipe, num_experts))
      self.w_out_meta = Fp8MetaVariable(init_ragged_dot_meta(recipe, num_experts))

  def __call__(self, x: jax.Array) -> jax.Array:
    features = x.shape[-1]
    tokens = x.reshape(-1, features)
    routing = moe_routing.route_top_k(self.router(tokens.astype(jnp.float32)), self.top_k)
    self.load_balancing_loss[...] = moe_routing.load_balancing_loss(routing)
    x_sorted, group_sizes, order = moe_routing.sort_by_expert(tokens, routing.experts,
                                                              self.num_experts)
    dtype = self.dtype or x.dtype
    h = self._grouped(x_sorted.astype(dtype), self.w_in, group_sizes, "w_in_meta")
    y_sorted = self._grouped(self.activation(h), self.w_out, group_sizes, "w_out_meta")
    y = moe_routing.combine(y_sorted, order, routing.weights)
    return y.reshape(x.shape).astype(dtype)

  def _grouped(self, x, param, group_sizes, meta_name: str):
    w = param[...].astype(x.dtype)
    if not self.fp8:
      # Every sorted (token, expert) pair has its expert: the groups fill the rows.
      return bf16_ragged_dot(x, w, group_sizes, all_rows_grouped=True)
    variable = getattr(self, meta_name)
    y, new_meta = fp8_ragged_dot(x, w, group_sizes,
                                 read_variable(variable, f"{meta_name} of an Fp8MoE"))
    record_variable(self, variable, new_meta)
    return y
