"""Flax linen layers with FP8 matmuls; FP8 state lives in the "fp8_meta" collection.

Each layer keeps one `DotMeta` in the `fp8_meta` variable collection. Apply
the model with `mutable=["fp8_meta"]` in training and return that collection
from the loss function (see `fp8jax.value_and_grad`):

    def loss_fn(params, fp8_state, x, y):
      out, updates = model.apply({"params": params, "fp8_meta": fp8_state}, x,
                                 mutable=["fp8_meta"])
      return jnp.mean((out - y) ** 2), updates["fp8_meta"]

When the collection is not mutable (evaluation) the layers use the stored
scales and leave the state alone. `model.init` creates fresh metas and does not
record the amaxes of the initialization pass.

Layers under `nn.scan`: give each layer its own meta with
`variable_axes={"params": 0, "fp8_meta": 0}`, or share one meta between all
scanned layers with `variable_carry="fp8_meta"` (amaxes then combine by max).
Flax cannot create a carried collection inside `init`; initialize the
per-layer version and pass `fp8jax.merge_stacked_metas(variables["fp8_meta"])`
as the shared state. Do not broadcast the collection (`variable_broadcast`):
a broadcast meta cannot record amaxes.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp

from fp8jax.ops.attention import attention, fp8_attention
from fp8jax.ops.dense import fp8_dense
from fp8jax.ops.dot import fp8_dot_general
from fp8jax.ops.norm_dense import NORM_EPS, fp8_rms_norm_dense
from fp8jax.ops.rms_norm import config as norm_config
from fp8jax.ops.einsum import fp8_einsum, parse_two_operand_subscripts
from fp8jax.mesh.explicit import with_out_sharding
from fp8jax.core.calibration import training_recipe
from fp8jax.flax.master_kernel import master_kernel
from fp8jax.core.meta import DotMeta, init_attention_meta, init_dot_meta
from fp8jax.core.recipes import DelayedScaling, Recipe
from fp8jax.ops.guards import detach_outside_step, guard_fp8_state

#: The Flax collection that holds the FP8 layers' state (`Fp8Meta` per role).
FP8_COLLECTION = "fp8_meta"

default_kernel_init = nn.initializers.lecun_normal()


def fp8_variable(module: nn.Module, name: str, init_fn: Callable, *init_args):
  """`module.variable(FP8_COLLECTION, name, init_fn, *init_args)`, with fp8jax's error where
  a lifted transform (`nn.scan`, `nn.vmap`, ...) does not carry the FP8 collection."""
  try:
    return module.variable(FP8_COLLECTION, name, init_fn, *init_args)
  except flax.errors.ScopeCollectionNotFound:
    path = "/".join(module.scope.path) or "(top)"
    raise ValueError(
        f"{module.__class__.__name__} at {path!r} keeps FP8 state in the "
        f"'{FP8_COLLECTION}' collection, which this call does not have. Pass it to apply "
        f"(model.apply({{'params': ..., '{FP8_COLLECTION}': variables['{FP8_COLLECTION}']}}, "
        "...)); and if a lifted transform wraps the layer, "
        f"add '{FP8_COLLECTION}' to its variable_axes, e.g. nn.scan(..., variable_axes="
        f"{{'params': 0, '{FP8_COLLECTION}': 0}}) or nn.vmap(..., variable_axes={{'params': "
        f"0, '{FP8_COLLECTION}': 0}}) for one state per layer or instance, and pass "
        f"'{FP8_COLLECTION}' as a mutable collection in training.") from None


def dot_meta_variable(module: nn.Module, recipe: Recipe, name: str = "dot_meta"):
  """The module's `DotMeta` variable; checks it follows the module's recipe."""
  variable = fp8_variable(module, name, init_dot_meta, recipe)
  stored = variable.value.recipe
  if training_recipe(stored) != recipe:  # the state of a step of fp8jax.calibrate follows it too
    raise ValueError(
        f"{module.__class__.__name__} {module.name!r} has recipe={recipe} but its "
        f"'{FP8_COLLECTION}' state was made for recipe={stored}. Initialize fresh FP8 state "
        "for the new recipe (model.init) or convert it with fp8jax.resize_history.")
  return variable


def read_meta(module: nn.Module, variable):
  """The FP8 state in `variable`, for this call's FP8 op.

  Differentiating it outside fp8jax's steps (e.g. `jax.grad` over the whole
  `variables` dict for a Flax `TrainState`) raises an error that says what to
  do instead, rather than let an optimizer train FP8 state (see
  `fp8jax.ops.guards`).
  """
  where = f"'{FP8_COLLECTION}/{'/'.join(module.scope.path)}/{variable.name}'"
  return guard_fp8_state(variable.value, where)


def store_dot_meta(module: nn.Module, variable, new_meta: DotMeta) -> None:
  """Writes a layer's new FP8 state when the collection is mutable (training), not in init.

  With `dot_meta_variable`, what a layer built from fp8jax's functions (not from
  the layers here) uses to keep its state by this module's conventions.
  """
  # The init pass must not record amaxes: the first training step would then
  # start from an observation of the random initialization.
  if module.is_mutable_collection(FP8_COLLECTION) and not module.is_initializing():
    variable.value = detach_outside_step(new_meta)


class Fp8DotGeneral(nn.Module):
  """A `dot_general` for `nn.Dense(dot_general_cls=Fp8DotGeneral)` and friends.

  Use `functools.partial(Fp8DotGeneral, recipe=...)` to pick a recipe.
  """

  recipe: Recipe = DelayedScaling()

  @nn.compact
  def __call__(self, lhs, rhs, dimension_numbers, precision=None,
               preferred_element_type=None, *, out_sharding=None):
    """`lax.dot_general`'s arguments; `out_sharding` names the output's sharding on an
    explicit-axis mesh, as there."""
    del precision  # FP8 GEMMs accumulate in float32 regardless.
    variable = dot_meta_variable(self, self.recipe)
    out, new_meta = fp8_dot_general(lhs, rhs, read_meta(self, variable), dimension_numbers)
    store_dot_meta(self, variable, new_meta)
    if preferred_element_type is not None:
      out = out.astype(preferred_element_type)
    return with_out_sharding(out, out_sharding)


class Fp8Dense(nn.Module):
  """`nn.Dense` with an FP8 matmul: y = x @ kernel + bias, x of shape [..., K].

  Attributes:
    features: N, the output size.
    use_bias: whether to add a bias.
    recipe: the FP8 scaling recipe.
    dtype: computation dtype (x and kernel are cast to it); None keeps x's dtype.
    param_dtype: dtype of the kernel and bias parameters.
    kernel_init, bias_init: initializers.
  """

  features: int
  use_bias: bool = True
  recipe: Recipe = DelayedScaling()
  dtype: Any = None
  param_dtype: Any = jnp.float32
  kernel_init: Callable = default_kernel_init
  bias_init: Callable = nn.initializers.zeros_init()

  @nn.compact
  def __call__(self, inputs: jax.Array, x_amax: jax.Array | None = None, *,
               norm_scale: jax.Array | None = None, norm_eps: float = NORM_EPS,
               norm_save_fp8: bool = False) -> jax.Array:
    """`x_amax`: max|inputs| from the op that wrote them (`fp8jax.fp8_dense`'s).
    `norm_scale`: the gain [K] of an RMSNorm to apply to the inputs first, made by the
    FP8 cast (`fp8jax.fp8_rms_norm_dense`); `norm_eps`, `norm_save_fp8`: its eps and
    `save_fp8`."""
    x = inputs
    kernel = self.param("kernel", self.kernel_init, (x.shape[-1], self.features),
                        self.param_dtype)
    bias = (self.param("bias", self.bias_init, (self.features,), self.param_dtype)
            if self.use_bias else None)
    x, promoted, bias = nn.dtypes.promote_dtype(x, kernel, bias, dtype=self.dtype)
    kernel = master_kernel(kernel, promoted)
    variable = dot_meta_variable(self, self.recipe)
    if norm_scale is not None:
      _check_norm(x, x_amax, norm_scale, norm_eps)
      y, new_meta = fp8_rms_norm_dense(x, norm_scale, kernel, read_meta(self, variable),
                                       eps=norm_eps, save_fp8=norm_save_fp8)
      y = y if bias is None else y + bias.astype(y.dtype)
    else:
      y, new_meta = fp8_dense(x, kernel, bias, read_meta(self, variable),
                              x_amax=_amax_of_cast(x_amax, inputs, x))
    store_dot_meta(self, variable, new_meta)
    return y


class Fp8DenseGeneral(nn.Module):
  """`nn.DenseGeneral` with an FP8 matmul over the `axis` dims of x.

  The kernel has shape `x.shape[axis] + features`; the output is x's other
  dims followed by `features`.
  """

  features: int | Sequence[int]
  axis: int | Sequence[int] = -1
  use_bias: bool = True
  recipe: Recipe = DelayedScaling()
  dtype: Any = None
  param_dtype: Any = jnp.float32
  kernel_init: Callable = default_kernel_init
  bias_init: Callable = nn.initializers.zeros_init()

  @nn.compact
  def __call__(self, inputs: jax.Array, x_amax: jax.Array | None = None, *,
               norm_scale: jax.Array | None = None, norm_eps: float = NORM_EPS,
               norm_save_fp8: bool = False) -> jax.Array:
    """`x_amax`: max|inputs| from the op that wrote them (`fp8jax.fp8_dot_general`'s).
    `norm_scale`: the gain of an RMSNorm over x's last axis (the one `axis` contracts) to
    apply first, made by the FP8 cast (`fp8jax.fp8_rms_norm_dense`); `norm_eps`,
    `norm_save_fp8`: its eps and `save_fp8`."""
    x = inputs
    features = _as_tuple(self.features)
    axis = tuple(sorted(a % x.ndim for a in _as_tuple(self.axis)))
    if norm_scale is not None and axis != (x.ndim - 1,):
      raise ValueError(f"norm_scale normalizes x's last axis, the one the projection "
                       f"contracts; this layer contracts axis={self.axis!r} of x {x.shape}. "
                       "Apply fp8jax.rms_norm to the inputs instead.")
    kernel_shape = tuple(x.shape[a] for a in axis) + features
    kernel = self.param("kernel", self.kernel_init, kernel_shape, self.param_dtype)
    bias = (self.param("bias", self.bias_init, features, self.param_dtype)
            if self.use_bias else None)
    x, promoted, bias = nn.dtypes.promote_dtype(x, kernel, bias, dtype=self.dtype)
    kernel = master_kernel(kernel, promoted)
    variable = dot_meta_variable(self, self.recipe)
    dims = ((axis, tuple(range(len(axis)))), ((), ()))
    if norm_scale is not None:
      _check_norm(x, x_amax, norm_scale, norm_eps)
      y, new_meta = fp8_rms_norm_dense(x, norm_scale, kernel, read_meta(self, variable),
                                       eps=norm_eps, save_fp8=norm_save_fp8)
    else:
      y, new_meta = fp8_dot_general(x, kernel, read_meta(self, variable), dims,
                                    x_amax=_amax_of_cast(x_amax, inputs, x))
    store_dot_meta(self, variable, new_meta)
    if bias is not None:
      y = y + bias.astype(y.dtype)
    return y


def _check_norm(x, x_amax, norm_scale, norm_eps) -> None:
  """The norm a layer's cast applies, checked under the names the layer's call takes."""
  norm_config(x, norm_scale, norm_eps, None, False, False, add=False,
              names=("norm_scale", "norm_eps"))
  if x_amax is not None:
    raise ValueError("x_amax is max|inputs|, but with norm_scale the projection casts the "
                     "normalized inputs, whose amax its cast measures: pass one or the other.")


def _amax_of_cast(x_amax, inputs, x):
  """`x_amax` when x is the inputs unchanged; None where the layer's `dtype` cast them
  (rounding can move the largest value, so the amax is measured on the cast x)."""
  return x_amax if x_amax is not None and x.dtype == inputs.dtype else None


class Fp8Einsum(nn.Module):
  """`nn.Einsum` with an FP8 contraction: `einsum(einsum_str, x, kernel) + bias`.

  Attributes:
    shape: the kernel's shape.
    einsum_str: explicit two-operand form, e.g. "bsd,dhk->bshk"; or None, and each
      call gives it (as for `nn.Einsum`: exactly one of the two).
    use_bias: add a bias of the output's trailing dims that come from the kernel.
  """

  shape: Sequence[int]
  einsum_str: str | None = None
  use_bias: bool = False
  recipe: Recipe = DelayedScaling()
  dtype: Any = None
  param_dtype: Any = jnp.float32
  kernel_init: Callable = default_kernel_init
  bias_init: Callable = nn.initializers.zeros_init()

  @nn.compact
  def __call__(self, inputs: jax.Array, einsum_str: str | None = None) -> jax.Array:
    x = inputs
    einsum_str = nn.merge_param("einsum_str", self.einsum_str, einsum_str)
    kernel = self.param("kernel", self.kernel_init, tuple(self.shape), self.param_dtype)
    bias = None
    if self.use_bias:
      _, k_labels, out_labels = parse_two_operand_subscripts(einsum_str, x.ndim,
                                                             len(self.shape))
      trailing = []
      for label in reversed(out_labels):
        if label not in k_labels:
          break
        trailing.insert(0, self.shape[k_labels.index(label)])
      bias = self.param("bias", self.bias_init, tuple(trailing), self.param_dtype)
    x, promoted, bias = nn.dtypes.promote_dtype(x, kernel, bias, dtype=self.dtype)
    kernel = master_kernel(kernel, promoted)
    variable = dot_meta_variable(self, self.recipe)
    y, new_meta = fp8_einsum(einsum_str, x, kernel, read_meta(self, variable))
    store_dot_meta(self, variable, new_meta)
    if bias is not None:
      y = y + bias.astype(y.dtype)
    return y


def _as_tuple(value) -> tuple:
  return tuple(value) if isinstance(value, (tuple, list)) else (value,)


class Fp8MultiHeadAttention(nn.Module):
  """Multi-head attention with FP8 projections and the fused (FP8 or bf16) attention kernel.

  q, k, v and output projections are `Fp8DenseGeneral` layers; the attention
  itself is `fp8jax.fp8_attention` (its `AttentionMeta` lives in the
  "fp8_meta" collection) or, with `fp8_attention=False`, the bf16 kernel.

  Attributes:
    num_heads: query heads.
    head_dim: features per head.
    num_kv_heads: key/value heads (grouped-query attention); default num_heads.
    causal: causal masking.
    fp8_attention: run q, k, v and P in FP8 inside the kernel.
    recipe: the FP8 recipe for all projections and the attention.
    backend: force an attention backend (see `fp8jax.ops.attention_backend`).
  """

  num_heads: int
  head_dim: int
  num_kv_heads: int | None = None
  causal: bool = False
  fp8_attention: bool = True
  recipe: Recipe = DelayedScaling()
  dtype: Any = None
  param_dtype: Any = jnp.float32
  kernel_init: Callable = default_kernel_init
  backend: str | None = None

  @nn.compact
  def __call__(self, inputs_q: jax.Array, inputs_kv: jax.Array | None = None, *,
               q_segment_ids: jax.Array | None = None,
               kv_segment_ids: jax.Array | None = None) -> jax.Array:
    """inputs_q [batch, q_len, features] (and inputs_kv [batch, kv_len, features]) -> same shape as inputs_q."""
    inputs_kv = inputs_q if inputs_kv is None else inputs_kv
    kv_heads = self.num_kv_heads or self.num_heads
    project = functools.partial(Fp8DenseGeneral, use_bias=False, recipe=self.recipe,
                                dtype=self.dtype, param_dtype=self.param_dtype,
                                kernel_init=self.kernel_init)
    q = project((self.num_heads, self.head_dim), name="query")(inputs_q)
    k = project((kv_heads, self.head_dim), name="key")(inputs_kv)
    v = project((kv_heads, self.head_dim), name="value")(inputs_kv)
    kwargs = dict(causal=self.causal, q_segment_ids=q_segment_ids,
                  kv_segment_ids=kv_segment_ids, backend=self.backend)
    if self.fp8_attention:
      variable = fp8_variable(self, "attention_meta", init_attention_meta, self.recipe)
      out, new_meta = fp8_attention(q, k, v, read_meta(self, variable), **kwargs)
      store_dot_meta(self, variable, new_meta)
    else:
      out = attention(q, k, v, **kwargs)
    return project(inputs_q.shape[-1], axis=(-2, -1), name="out")(out)
