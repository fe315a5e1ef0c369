"""Flax nnx layers with FP8 matmuls; FP8 state is an `Fp8MetaVariable`.

FP8 state is its own Variable type, so `nnx.split` separates it from the
parameters and an optimizer built on `nnx.Param` never sees it:

    graphdef, params, fp8_state = nnx.split(model, nnx.Param, Fp8MetaVariable)

    def loss_fn(params, fp8_state, x, y):
      model = nnx.merge(graphdef, params, fp8_state)
      loss = jnp.mean((model(x) - y) ** 2)
      return loss, nnx.state(model, Fp8MetaVariable)

    loss, grads, fp8_state = fp8jax.value_and_grad(loss_fn)(params, fp8_state, x, y)

`nnx.Optimizer(model, tx, wrt=nnx.Param)` then updates the parameters only and
leaves every `Fp8MetaVariable` as it is; put the step's next FP8 state in with
`nnx.update(model, fp8_state)`. A model with other state (`nnx.Dropout`'s rngs,
`nnx.BatchNorm`'s statistics) needs it carried too: use
`fp8jax.flax.nnx_value_and_grad(loss_fn)(model, *args)` under `nnx.jit`, which
does all of this and updates the model in place, as `nnx.value_and_grad` does.
Differentiating the FP8 state itself (e.g.
`nnx.grad(..., argnums=nnx.DiffState(0, nnx.Variable))`) raises
`fp8jax.Fp8StateGradientError` (see `fp8jax.ops.guards`).

Calling a layer records that call's amaxes in its `Fp8MetaVariable`, like
`nnx.BatchNorm` collects batch statistics. `model.eval()` sets
`use_running_average=True` on every layer (as for BatchNorm): the layers then
use the stored scales and record nothing, so evaluation between training steps
leaves the FP8 state untouched; `model.train()` switches recording back on.
"""
from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from fp8jax.ops.attention import attention, fp8_attention
from fp8jax.ops.dense import fp8_dense
from fp8jax.ops.dot import fp8_dot_general
from fp8jax.ops.einsum import fp8_einsum
from fp8jax.mesh.explicit import with_out_sharding
from fp8jax.flax.master_kernel import master_kernel
from fp8jax.core.meta import init_attention_meta, init_dot_meta
from fp8jax.core.recipes import DelayedScaling, Recipe, check_recipe
from fp8jax.ops.guards import NNX_FIX, detach_outside_step, guard_fp8_state


class Fp8MetaVariable(nnx.Variable):
  """An nnx Variable holding one `fp8jax.DotMeta` (never trained by an optimizer)."""


def _get(variable: nnx.Variable):
  return variable.get_value() if hasattr(variable, "get_value") else variable.value


def _set(variable: nnx.Variable, value) -> None:
  if hasattr(variable, "set_value"):
    variable.set_value(value)
  else:
    variable.value = value


def read_variable(variable: nnx.Variable, where: str):
  """The FP8 state an `Fp8MetaVariable` holds, for this call's FP8 op.

  Args:
    variable: the layer's `Fp8MetaVariable`.
    where: how an error names it, e.g. "of an Fp8Linear".

  Returns:
    The state (a `DotMeta`, `AttentionMeta` or `RaggedDotMeta`); differentiating it
    outside fp8jax's steps raises (see `fp8jax.ops.guards`).
  """
  return guard_fp8_state(_get(variable), where, fix=NNX_FIX)


def record_variable(module, variable, new_meta) -> None:
  """Stores an op's new FP8 state in `variable`, unless `module` is in evaluation mode.

  Args:
    module: the layer (its `use_running_average`, which `model.eval()` sets, skips it).
    variable: the layer's `Fp8MetaVariable`.
    new_meta: the state the FP8 op returned.

  Returns:
    None.
  """
  if not module.use_running_average:
    _set(variable, detach_outside_step(new_meta))


class Fp8Linear(nnx.Module):
  """`nnx.Linear` with an FP8 matmul: y = x @ kernel + bias, x of shape [..., in_features].

  `use_running_average=True` (what `model.eval()` sets) uses the stored scales
  and records no amaxes.
  """

  def __init__(self, in_features: int, out_features: int, *, use_bias: bool = True,
               recipe: Recipe = DelayedScaling(), dtype: Any = None,
               param_dtype: Any = jnp.float32,
               kernel_init=nnx.initializers.lecun_normal(),
               bias_init=nnx.initializers.zeros_init(), use_running_average: bool = False,
               rngs: nnx.Rngs):
    check_recipe(recipe)
    self.use_running_average = use_running_average
    self.in_features = in_features
    self.out_features = out_features
    self.dtype = dtype
    self.kernel = nnx.Param(kernel_init(rngs.params(), (in_features, out_features), param_dtype))
    self.bias = (nnx.Param(bias_init(rngs.params(), (out_features,), param_dtype))
                 if use_bias else None)
    self.fp8_meta = Fp8MetaVariable(init_dot_meta(recipe))

  def __call__(self, inputs: jax.Array, out_sharding=None) -> jax.Array:
    """inputs [..., in_features] -> [..., out_features]; `out_sharding` as for `nnx.Linear`
    (the output's sharding on an explicit-axis mesh)."""
    kernel = _get(self.kernel)
    bias = _get(self.bias) if self.bias is not None else None
    x, promoted, bias = nnx.nn.dtypes.promote_dtype((inputs, kernel, bias), dtype=self.dtype)
    kernel = master_kernel(kernel, promoted)
    y, new_meta = fp8_dense(x, kernel, bias, read_variable(self.fp8_meta, "of an Fp8Linear"))
    record_variable(self, self.fp8_meta, new_meta)
    return with_out_sharding(y, out_sharding)


class Fp8Einsum(nnx.Module):
  """`nnx.Einsum` with an FP8 contraction: `einsum(einsum_str, x, kernel)`.

  As for `nnx.Einsum`, an equation given to a call takes the place of this one.
  """

  def __init__(self, einsum_str: str | None, kernel_shape, *, recipe: Recipe = DelayedScaling(),
               dtype: Any = None, param_dtype: Any = jnp.float32,
               kernel_init=nnx.initializers.lecun_normal(), use_running_average: bool = False,
               rngs: nnx.Rngs):
    check_recipe(recipe)
    self.use_running_average = use_running_average
    self.einsum_str = einsum_str
    self.dtype = dtype
    self.kernel = nnx.Param(kernel_init(rngs.params(), tuple(kernel_shape), param_dtype))
    self.fp8_meta = Fp8MetaVariable(init_dot_meta(recipe))

  def __call__(self, inputs: jax.Array, einsum_str: str | None = None,
               out_sharding=None) -> jax.Array:
    """`einsum(einsum_str, inputs, kernel)`; `einsum_str` (overrides the constructor's)
    and `out_sharding` as for `nnx.Einsum`."""
    einsum_str = _one_equation(self.einsum_str, einsum_str)
    x, promoted = nnx.nn.dtypes.promote_dtype((inputs, _get(self.kernel)), dtype=self.dtype)
    kernel = master_kernel(_get(self.kernel), promoted)
    meta = read_variable(self.fp8_meta, "of an Fp8Einsum")
    y, new_meta = fp8_einsum(einsum_str, x, kernel, meta)
    record_variable(self, self.fp8_meta, new_meta)
    return with_out_sharding(y, out_sharding)


def _one_equation(constructed: str | None, called: str | None) -> str:
  """The call's equation if it gives one, else the constructor's (as `nnx.Einsum` reads them)."""
  if called is None and constructed is None:
    raise ValueError("Fp8Einsum has no einsum_str: give the equation at construction or to "
                     "the call (as for nnx.Einsum).")
  return constructed if called is None else called


class Fp8MultiHeadAttention(nnx.Module):
  """Self/cross attention with FP8 projections and the fused (FP8 or bf16) attention kernel.

  The attention's `AttentionMeta` is an `Fp8MetaVariable`, like the projections' metas.
  """

  def __init__(self, features: int, num_heads: int, head_dim: int, *,
               num_kv_heads: int | None = None, causal: bool = False,
               fp8_attention: bool = True, recipe: Recipe = DelayedScaling(),
               dtype: Any = None, param_dtype: Any = jnp.float32, backend: str | None = None,
               use_running_average: bool = False, rngs: nnx.Rngs):
    check_recipe(recipe)
    self.use_running_average = use_running_average
    kv_heads = num_kv_heads or num_heads
    self.causal, self.backend, self.use_fp8_attention = causal, backend, fp8_attention
    project = lambda spec, shape: Fp8Einsum(spec, shape, recipe=recipe, dtype=dtype,
                                            param_dtype=param_dtype, rngs=rngs)
    self.query = project("bsd,dhk->bshk", (features, num_heads, head_dim))
    self.key = project("bsd,dhk->bshk", (features, kv_heads, head_dim))
    self.value = project("bsd,dhk->bshk", (features, kv_heads, head_dim))
    self.out = project("bshk,hkd->bsd", (num_heads, head_dim, features))
    self.attention_meta = Fp8MetaVariable(init_attention_meta(recipe)) if fp8_attention else None

  def __call__(self, inputs_q: jax.Array, inputs_kv: jax.Array | None = None, *,
               q_segment_ids: jax.Array | None = None,
               kv_segment_ids: jax.Array | None = None) -> jax.Array:
    """inputs_q [batch, q_len, features] (and inputs_kv) -> [batch, q_len, features]."""
    inputs_kv = inputs_q if inputs_kv is None else inputs_kv
    q, k, v = self.query(inputs_q), self.key(inputs_kv), self.value(inputs_kv)
    kwargs = dict(causal=self.causal, q_segment_ids=q_segment_ids,
                  kv_segment_ids=kv_segment_ids, backend=self.backend)
    if self.use_fp8_attention:
      meta = read_variable(self.attention_meta, "of an Fp8MultiHeadAttention")
      out, new_meta = fp8_attention(q, k, v, meta, **kwargs)
      record_variable(self, self.attention_meta, new_meta)
    else:
      out = attention(q, k, v, **kwargs)
    return self.out(out)


class Fp8LinearGeneral(nnx.Module):
  """`nnx.LinearGeneral` with an FP8 matmul over the `axis` dims of x.

  The kernel has shape `batch sizes + in_features + out_features`, where
  `batch_axis` maps leading axes of x (0, 1, ...) to their sizes, as in
  `nnx.LinearGeneral`, and is initialized the same way (the initializer sees
  the flattened 2-D kernel). The output has x's batch axes, then its other
  non-contracted axes, then `out_features`. `use_running_average=True` (what
  `model.eval()` sets) uses the stored scales and records no amaxes.
  """

  def __init__(self, in_features: int | Sequence[int], out_features: int | Sequence[int], *,
               axis: int | Sequence[int] = -1, batch_axis: Mapping[int, int] | None = None,
               use_bias: bool = True, recipe: Recipe = DelayedScaling(), dtype: Any = None,
               param_dtype: Any = jnp.float32, kernel_init=nnx.initializers.lecun_normal(),
               bias_init=nnx.initializers.zeros_init(), use_running_average: bool = False,
               rngs: nnx.Rngs):
    check_recipe(recipe)
    self.use_running_average = use_running_average
    self.in_features = _as_tuple(in_features)
    self.out_features = _as_tuple(out_features)
    self.axis = _as_tuple(axis)
    self.batch_axis = tuple(sorted(dict(batch_axis or {}).items()))
    self.dtype = dtype
    if len(self.in_features) != len(self.axis):
      raise ValueError(f"in_features={self.in_features} and axis={self.axis} must have the same "
                       "length: one size per contracted axis of x.")
    if [a for a, _ in self.batch_axis] != list(range(len(self.batch_axis))):
      raise ValueError(f"batch_axis={dict(self.batch_axis)} must map the leading axes of x "
                       "(0, 1, ...) to their sizes.")
    batch_shape = tuple(size for _, size in self.batch_axis)
    kernel_shape = batch_shape + self.in_features + self.out_features
    flat = (math.prod(batch_shape + self.in_features), math.prod(self.out_features))
    self.kernel = nnx.Param(
        kernel_init(rngs.params(), flat, param_dtype).reshape(kernel_shape))
    self.bias = (nnx.Param(bias_init(rngs.params(), (math.prod(batch_shape + self.out_features),),
                                     param_dtype).reshape(batch_shape + self.out_features))
                 if use_bias else None)
    self.fp8_meta = Fp8MetaVariable(init_dot_meta(recipe))

  def __call__(self, inputs: jax.Array, out_sharding=None) -> jax.Array:
    """`out_sharding` as for `nnx.LinearGeneral` (the output's sharding on an
    explicit-axis mesh)."""
    x = inputs
    axis = tuple(a % x.ndim for a in self.axis)
    batch = tuple(a for a, _ in self.batch_axis)
    kernel = _get(self.kernel)
    bias = _get(self.bias) if self.bias is not None else None
    x, promoted, bias = nnx.nn.dtypes.promote_dtype((x, kernel, bias), dtype=self.dtype)
    kernel = master_kernel(kernel, promoted)
    dims = ((axis, tuple(range(len(batch), len(batch) + len(axis)))),
            (batch, tuple(range(len(batch)))))
    meta = read_variable(self.fp8_meta, "of an Fp8LinearGeneral")
    y, new_meta = fp8_dot_general(x, kernel, meta, dims)
    record_variable(self, self.fp8_meta, new_meta)
    if bias is not None:
      # y is [batch axes, x's other axes, out_features]; the bias varies along the batch axes.
      expanded = tuple(x.shape[a] if a in batch else 1 for a in range(x.ndim) if a not in axis)
      y = y + jnp.reshape(bias, expanded + self.out_features).astype(y.dtype)
    return with_out_sharding(y, out_sharding)


def _as_tuple(value) -> tuple:
  return tuple(value) if isinstance(value, (tuple, list)) else (value,)
