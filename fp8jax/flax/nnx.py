"""Flax nnx layers with FP8 matmuls; FP8 state is an `Fp8MetaVariable`.

FP8 state is its own Variable type, so `nnx.split` separates it from the
parameters and an optimizer built on `nnx.Param` never sees it:

    graphdef, params, fp8_state = nnx.split(model, nnx.Param, Fp8MetaVariable)

    def loss_fn(params, fp8_state, x, y):
      model = nnx.merge(graphdef, params, fp8_state)
      loss = jnp.mean((model(x) - y) ** 2)
      return loss, nnx.state(model, Fp8MetaVariable)

    loss, grads, fp8_state = fp8jax.value_and_grad(loss_fn)(params, fp8_state, x, y)

Calling a layer records that call's amaxes in its `Fp8MetaVariable`.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from fp8jax.dense import fp8_dense
from fp8jax.einsum import fp8_einsum
from fp8jax.meta import init_dot_meta
from fp8jax.recipes import DelayedScaling, Recipe, check_recipe


class Fp8MetaVariable(nnx.Variable):
  """An nnx Variable holding one `fp8jax.DotMeta` (never trained by an optimizer)."""


def _get(variable: nnx.Variable):
  return variable.get_value() if hasattr(variable, "get_value") else variable.value


def _set(variable: nnx.Variable, value) -> None:
  if hasattr(variable, "set_value"):
    variable.set_value(value)
  else:
    variable.value = value


class Fp8Linear(nnx.Module):
  """`nnx.Linear` with an FP8 matmul: y = x @ kernel + bias, x of shape [..., in_features]."""

  def __init__(self, in_features: int, out_features: int, *, use_bias: bool = True,
               recipe: Recipe = DelayedScaling(), dtype: Any = None,
               param_dtype: Any = jnp.float32,
               kernel_init=nnx.initializers.lecun_normal(),
               bias_init=nnx.initializers.zeros_init(), rngs: nnx.Rngs):
    check_recipe(recipe)
    self.in_features = in_features
    self.out_features = out_features
    self.dtype = dtype
    self.kernel = nnx.Param(kernel_init(rngs.params(), (in_features, out_features), param_dtype))
    self.bias = (nnx.Param(bias_init(rngs.params(), (out_features,), param_dtype))
                 if use_bias else None)
    self.fp8_meta = Fp8MetaVariable(init_dot_meta(recipe))

  def __call__(self, x: jax.Array) -> jax.Array:
    kernel = _get(self.kernel)
    bias = _get(self.bias) if self.bias is not None else None
    x, kernel, bias = nnx.nn.dtypes.promote_dtype((x, kernel, bias), dtype=self.dtype)
    y, new_meta = fp8_dense(x, kernel, bias, _get(self.fp8_meta))
    _set(self.fp8_meta, new_meta)
    return y


class Fp8Einsum(nnx.Module):
  """`nnx.Einsum` with an FP8 contraction: `einsum(einsum_str, x, kernel)`."""

  def __init__(self, einsum_str: str, kernel_shape, *, recipe: Recipe = DelayedScaling(),
               dtype: Any = None, param_dtype: Any = jnp.float32,
               kernel_init=nnx.initializers.lecun_normal(), rngs: nnx.Rngs):
    check_recipe(recipe)
    self.einsum_str = einsum_str
    self.dtype = dtype
    self.kernel = nnx.Param(kernel_init(rngs.params(), tuple(kernel_shape), param_dtype))
    self.fp8_meta = Fp8MetaVariable(init_dot_meta(recipe))

  def __call__(self, x: jax.Array) -> jax.Array:
    x, kernel = nnx.nn.dtypes.promote_dtype((x, _get(self.kernel)), dtype=self.dtype)
    y, new_meta = fp8_einsum(self.einsum_str, x, kernel, _get(self.fp8_meta))
    _set(self.fp8_meta, new_meta)
    return y
