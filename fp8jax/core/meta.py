"""`Fp8Meta`: the explicit per-tensor FP8 state, the containers of it, and what an op
does to it (record an amax, take the scale for a cast, descale).

An `Fp8Meta` is one tensor role's state: the `scale` multiplied in before the
cast to FP8, its reciprocal `scale_inv` that the GEMM applies to its product,
the `amax_history` of the last L closed steps (newest first) and `amax`, the
running amax of the step in progress. It is a pytree whose leaves are those four
float32 arrays; the recipe and the FP8 format are static (part of the tree
structure), so they are fixed under `jit` and cannot be mixed up between layers.

`DotMeta` groups the three roles of one FP8 matmul: the input `x`, the `kernel`
(forward, E4M3) and the output gradient `grad` (backward, E5M2 under "hybrid");
`AttentionMeta` the five of one attention: q, k, v, the output o and `grad`;
`RaggedDotMeta` the three of a grouped matmul, its `kernel` with one scale per expert.

Within a training step `amax` is the step's running amax: it is 0 when the
step opens and every use of the meta takes the max of it and the amax that use
saw (one scalar max, no other work on the state). `fp8jax.end_step` pushes it
into the history and computes the next `scale` and `scale_inv`, for all roles
of a model at once. Keeping the running amax apart from the history and the
reciprocal scale stored is what keeps the per-op state work O(1) (see
`fp8jax.step.close`); checkpoints of the earlier two-field layout are converted
on restore (`fp8jax.checkpoint`).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from fp8jax.core import rounding_keys
from fp8jax.core.formats import E4M3, Fp8Format
from fp8jax.core.quantize import amax_max, scale_from_amax, unbatched_like
from fp8jax.core.recipes import Recipe, check_recipe
from fp8jax.core.validation import check_format


@dataclasses.dataclass(frozen=True)
class Fp8Meta:
  """FP8 state of one tensor role.

  Attributes:
    scale: float32[] (or float32[n] when stacked over layers). `q = x * scale`.
    scale_inv: float32 like `scale`, always `1 / scale`: the GEMM's descale.
    amax_history: float32[L] (or [n, L] stacked): the amaxes of the last L closed
      steps, newest first.
    amax: float32 like `scale`: the running amax of the step in progress (0
      between steps).
    recipe: static; the scaling recipe this state follows.
    fmt: static; the FP8 format this role is cast to.
    rng: None, or for the gradient role of a matmul whose recipe rounds gradients
      stochastically (`Recipe.stochastic_rounding`) uint32 [2] (or [n, 2] stacked):
      the PRNG key of this step's rounding (`fp8jax.core.rounding_keys`). An integer
      leaf: `jax.grad` over such a state needs `allow_int=True` (as
      `fp8jax.value_and_grad` passes).

  Change `scale` only through `with_scale`, which keeps `scale_inv` in step.
  """

  scale: jax.Array
  scale_inv: jax.Array
  amax_history: jax.Array
  amax: jax.Array
  recipe: Recipe
  fmt: Fp8Format
  rng: jax.Array | None = None

  def with_scale(self, scale: jax.Array) -> "Fp8Meta":
    """This meta with `scale` and its reciprocal `scale_inv = 1 / scale` replaced."""
    scale = jnp.asarray(scale, jnp.float32)
    return dataclasses.replace(self, scale=scale, scale_inv=1.0 / scale)


DATA_FIELDS = ("scale", "scale_inv", "amax_history", "amax")

# `rng` is None (no leaf) for every role but a stochastically rounded gradient's.
jax.tree_util.register_dataclass(
    Fp8Meta, data_fields=[*DATA_FIELDS, "rng"], meta_fields=["recipe", "fmt"])


@dataclasses.dataclass(frozen=True)
class DotMeta:
  """FP8 state of one matmul: input `x`, `kernel`, and output gradient `grad`."""

  x: Fp8Meta
  kernel: Fp8Meta
  grad: Fp8Meta

  @property
  def recipe(self) -> Recipe:
    return self.x.recipe


jax.tree_util.register_dataclass(
    DotMeta, data_fields=["x", "kernel", "grad"], meta_fields=[])


@dataclasses.dataclass(frozen=True)
class AttentionMeta:
  """FP8 state of one attention: inputs q, k, v, output o, and output gradient `grad`."""

  q: Fp8Meta
  k: Fp8Meta
  v: Fp8Meta
  o: Fp8Meta
  grad: Fp8Meta

  @property
  def recipe(self) -> Recipe:
    return self.q.recipe


jax.tree_util.register_dataclass(
    AttentionMeta, data_fields=["q", "k", "v", "o", "grad"], meta_fields=[])

ATTENTION_FORWARD_ROLES = ("q", "k", "v", "o")


@dataclasses.dataclass(frozen=True)
class RaggedDotMeta:
  """FP8 state of one grouped matmul (`fp8jax.fp8_ragged_dot`, the experts of a MoE layer).

  Roles: the input `x`, the experts' weights `kernel` and the output gradient `grad`.
  `kernel`'s arrays carry a leading expert axis (scale, scale_inv, amax float32 [G],
  amax_history float32 [G, L]): experts' weights differ by orders of magnitude, so each
  has its own scale. `grad` is E4M3 under every recipe (see `fp8jax.ops.ragged_dot`).
  """

  x: Fp8Meta
  kernel: Fp8Meta
  grad: Fp8Meta

  @property
  def recipe(self) -> Recipe:
    return self.x.recipe


jax.tree_util.register_dataclass(
    RaggedDotMeta, data_fields=["x", "kernel", "grad"], meta_fields=[])


def init_meta(recipe: Recipe, fmt: Fp8Format) -> Fp8Meta:
  """A fresh role state: scale 1, an all-zero amax history of the recipe's length, amax 0."""
  check_recipe(recipe)
  check_format(fmt, "fmt")
  return Fp8Meta(
      scale=jnp.ones((), jnp.float32),
      scale_inv=jnp.ones((), jnp.float32),
      amax_history=jnp.zeros((recipe.history_len,), jnp.float32),
      amax=jnp.zeros((), jnp.float32),
      recipe=recipe,
      fmt=fmt)


def init_dot_meta(recipe: Recipe) -> DotMeta:
  """A fresh `DotMeta` for one FP8 matmul under `recipe`.

  `x` and `kernel` use the recipe's forward format, `grad` its gradient format (and,
  under a recipe that rounds gradients stochastically, the starting key of that
  rounding, `fp8jax.core.rounding_keys.initial_key()`).
  """
  check_recipe(recipe)
  grad = init_meta(recipe, recipe.gradient_format)
  if recipe.stochastic_rounding:
    grad = dataclasses.replace(grad, rng=rounding_keys.initial_key())
  return DotMeta(
      x=init_meta(recipe, recipe.forward_format),
      kernel=init_meta(recipe, recipe.forward_format),
      grad=grad)


def init_attention_meta(recipe: Recipe) -> AttentionMeta:
  """Fresh `AttentionMeta`: q, k, v, o in the recipe's forward format, grad in its gradient format."""
  check_recipe(recipe)
  forward = {role: init_meta(recipe, recipe.forward_format) for role in ATTENTION_FORWARD_ROLES}
  return AttentionMeta(**forward, grad=init_meta(recipe, recipe.gradient_format))


def init_ragged_dot_meta(recipe: Recipe, num_groups: int) -> RaggedDotMeta:
  """A fresh `RaggedDotMeta` for a grouped matmul of `num_groups` experts under `recipe`.

  Returns:
    x in the recipe's forward format with scalar arrays; kernel likewise with a leading
    [num_groups] axis on every array (each expert its own scale and history); grad in
    E4M3 with scalar arrays.
  """
  check_recipe(recipe)
  if (not isinstance(num_groups, int) or isinstance(num_groups, bool)) or num_groups < 1:
    raise ValueError(f"num_groups={num_groups!r} must be a positive int: the number of "
                     "experts, w.shape[0] of fp8_ragged_dot's weight.")
  one = init_meta(recipe, recipe.forward_format)
  per_expert = jax.tree.map(lambda a: jnp.broadcast_to(a, (num_groups,) + a.shape), one)
  return RaggedDotMeta(x=one, kernel=per_expert, grad=init_meta(recipe, E4M3))


def is_meta(node: Any) -> bool:
  """True for an `Fp8Meta` node (use as `is_leaf` in tree maps)."""
  return isinstance(node, Fp8Meta)


def map_metas(fn, *trees):
  """Applies `fn` to every `Fp8Meta` of one or more equally shaped trees."""
  return jax.tree.map(fn, *trees, is_leaf=is_meta)


def merge_stacked_metas(fp8_state, axis: int = 0):
  """Combines metas stacked over layers (leading `axis`) into one shared meta.

  Histories combine by max (the rule for any meta used several times); the
  scale becomes the smallest of the layers' scales, which overflows none of them.
  Use it to make the state for layers that share one meta, e.g. `nn.scan`
  with `variable_carry="fp8_meta"`, from a per-layer initialization.

  Args:
    fp8_state: pytree of `Fp8Meta` whose arrays have a stacked `axis`.
    axis: the layer axis.

  Returns:
    The same structure without that axis.
  """
  def merge(meta: Fp8Meta) -> Fp8Meta:
    merged = dataclasses.replace(meta, amax_history=jnp.max(meta.amax_history, axis=axis),
                                 amax=jnp.max(meta.amax, axis=axis))
    if meta.rng is not None:  # one key for the shared meta: the first layer's
      merged = dataclasses.replace(merged, rng=jnp.take(meta.rng, 0, axis=axis))
    return merged.with_scale(jnp.min(meta.scale, axis=axis))
  return map_metas(merge, fp8_state)


def check_dot_meta(meta: Any, argname: str = "meta") -> None:
  """Raises a clear error unless `meta` is one (unstacked) `DotMeta`."""
  if not isinstance(meta, DotMeta):
    raise TypeError(
        f"{argname} must be a fp8jax.DotMeta (make one with "
        f"fp8jax.init_dot_meta(recipe)), got {type(meta).__name__}.")
  for role in ("x", "kernel", "grad"):
    check_role_meta(getattr(meta, role), f"{argname}.{role}")
  recipe = meta.x.recipe
  for role, want in (("kernel", recipe.forward_format), ("grad", recipe.gradient_format),
                     ("x", recipe.forward_format)):
    role_meta = getattr(meta, role)
    if role_meta.recipe != recipe:
      raise ValueError(
          f"{argname}.{role} follows recipe {role_meta.recipe} but {argname}.x follows "
          f"{recipe}: the roles of one DotMeta must share a recipe (was it assembled from "
          "two layers' states?). Make it with fp8jax.init_dot_meta(recipe).")
    if role_meta.fmt != want:
      raise ValueError(
          f"{argname}.{role} has format {role_meta.fmt} but recipe {recipe} casts the "
          f"{role} role to {want}; were the roles swapped? Make the DotMeta with "
          "fp8jax.init_dot_meta(recipe).")
  if (meta.grad.rng is not None) != bool(recipe.stochastic_rounding):
    raise ValueError(
        f"{argname}.grad.rng is {'a key' if meta.grad.rng is not None else 'None'}, but "
        f"recipe {recipe} rounds gradients "
        f"{'stochastically' if recipe.stochastic_rounding else 'to nearest'}: the gradient "
        "role keeps a rounding key exactly when they are rounded stochastically. Make the "
        "DotMeta with fp8jax.init_dot_meta(recipe).")


def check_attention_meta(meta: Any, argname: str = "meta") -> None:
  """Raises a clear error unless `meta` is one (unstacked) `AttentionMeta`."""
  if not isinstance(meta, AttentionMeta):
    raise TypeError(f"{argname} must be a fp8jax.AttentionMeta (make one with "
                    f"fp8jax.init_attention_meta(recipe)), got {type(meta).__name__}.")
  for role in ATTENTION_FORWARD_ROLES + ("grad",):
    check_role_meta(getattr(meta, role), f"{argname}.{role}")


def check_ragged_dot_meta(meta: Any, num_groups: int, argname: str = "meta") -> None:
  """Raises a clear error unless `meta` is a `RaggedDotMeta` for `num_groups` experts."""
  if not isinstance(meta, RaggedDotMeta):
    raise TypeError(f"{argname} must be a fp8jax.RaggedDotMeta (make one with "
                    f"fp8jax.init_ragged_dot_meta(recipe, num_groups)), got "
                    f"{type(meta).__name__}.")
  check_role_meta(meta.x, f"{argname}.x")
  check_role_meta(meta.grad, f"{argname}.grad")
  if not isinstance(meta.kernel, Fp8Meta):
    raise TypeError(f"{argname}.kernel must be a fp8jax.Fp8Meta, got "
                    f"{type(meta.kernel).__name__}.")
  got = jnp.shape(meta.kernel.scale)
  if got != (num_groups,):
    raise ValueError(
        f"{argname}.kernel.scale has shape {got}, expected ({num_groups},): one scale per "
        f"expert of w. Make the state with fp8jax.init_ragged_dot_meta(recipe, "
        f"num_groups={num_groups}).")
  check_shapes(meta.kernel, f"{argname}.kernel", stacked=True)
  check_scale_inv(meta.kernel, f"{argname}.kernel")
  for role in ("kernel", "grad"):
    if getattr(meta, role).recipe != meta.x.recipe:
      raise ValueError(f"{argname}.{role} follows recipe {getattr(meta, role).recipe} but "
                       f"{argname}.x follows {meta.x.recipe}; make the state with "
                       "fp8jax.init_ragged_dot_meta(recipe, num_groups).")
  if meta.grad.fmt != E4M3:
    raise ValueError(f"{argname}.grad has format {meta.grad.fmt}; grouped matmuls cast the "
                     "output gradient to E4M3. Make the state with "
                     "fp8jax.init_ragged_dot_meta(recipe, num_groups).")


def check_role_meta(meta: Any, argname: str) -> None:
  """Raises a clear error unless `meta` is an unstacked `Fp8Meta` matching its recipe."""
  if not isinstance(meta, Fp8Meta):
    raise TypeError(f"{argname} must be a fp8jax.Fp8Meta, got {type(meta).__name__}.")
  check_shapes(meta, argname)
  for field in DATA_FIELDS:
    dtype = jnp.result_type(getattr(meta, field))
    if dtype != jnp.float32:
      raise TypeError(f"{argname}.{field} must be float32, got {dtype}.")
  check_scale_inv(meta, argname)


def check_shapes(meta: Fp8Meta, argname: str, stacked: bool = False) -> None:
  """Raises ValueError naming `argname` unless `meta`'s arrays have the shapes its recipe
  gives them: `scale_inv` and `amax` that of `scale` (a scalar unless `stacked` over
  layers), `amax_history` that shape + (history_len,).

  A history that `jax.shard_map` split over devices gets its own message from the
  op or step that reads the mesh (`fp8jax.ops.guards.refuse_split_state`), before this.
  """
  rows = jnp.shape(meta.scale) if stacked else ()
  for field in ("scale", "scale_inv", "amax"):
    got = jnp.shape(getattr(meta, field))
    if got == rows:
      continue
    if not stacked:
      raise ValueError(
          f"{argname}.{field} has shape {got}, expected a scalar (). A meta stacked over "
          "layers must be sliced per layer (jax.lax.scan / nn.scan).")
    raise ValueError(
        f"{argname}.{field} has shape {got}, but scale has shape {rows}: a stacked meta's "
        "scale, scale_inv and amax share one shape. Make the state with "
        "fp8jax.init_dot_meta and stack whole metas.")
  history_len = meta.recipe.history_len
  want = rows + (history_len,)
  if jnp.shape(meta.amax_history) != want:
    raise ValueError(
        f"{argname}.amax_history has shape {jnp.shape(meta.amax_history)}, but its recipe "
        f"{meta.recipe} keeps a history of length {history_len}: expected {want}. Re-create "
        "the meta with fp8jax.init_dot_meta(recipe) or convert it with "
        "fp8jax.resize_history.")
  if meta.rng is not None:
    key_shape = rows + rounding_keys.KEY_SHAPE
    if jnp.shape(meta.rng) != key_shape or jnp.result_type(meta.rng) != jnp.uint32:
      raise ValueError(
          f"{argname}.rng has shape {jnp.shape(meta.rng)} and dtype "
          f"{jnp.result_type(meta.rng)}; a rounding key is uint32 {key_shape} (the data of "
          "a threefry key). Make the state with fp8jax.init_dot_meta(recipe).")


def check_scale_inv(meta: Fp8Meta, argname: str) -> None:
  """Raises unless `scale_inv` is `1 / scale` (checked where the values are known, not
  under `jit`): a scale changed without its reciprocal would descale wrongly."""
  scale, scale_inv = meta.scale, meta.scale_inv
  if isinstance(scale, jax.core.Tracer) or isinstance(scale_inv, jax.core.Tracer):
    return
  try:
    consistent = bool(jnp.all(jnp.asarray(scale_inv) == 1.0 / jnp.asarray(scale)))
  except (TypeError, ValueError):  # not arrays (e.g. shape specs): nothing to check
    return
  if not consistent:
    raise ValueError(
        f"{argname}.scale_inv is not 1 / {argname}.scale (scale {scale}, scale_inv "
        f"{scale_inv}). Change a scale with meta.with_scale(new_scale), which keeps its "
        "reciprocal in step; dataclasses.replace(meta, scale=...) does not.")


def check_fp8_state(fp8_state: Any, argname: str = "fp8_state") -> None:
  """Raises a clear error unless every leaf of `fp8_state` lies inside an `Fp8Meta`.

  Catches parameters (or a whole variables dict) passed where FP8 state belongs;
  the step functions would otherwise leave them silently untouched. An empty
  tree (a model without FP8 layers) is fine.
  """
  leaves = jax.tree_util.tree_leaves_with_path(fp8_state, is_leaf=is_meta)
  for path, leaf in leaves:
    if not isinstance(leaf, Fp8Meta):
      where = jax.tree_util.keystr(path) or "(root)"
      raise TypeError(
          f"{argname} must be a pytree of fp8jax.Fp8Meta (e.g. DotMeta per layer, or "
          f"variables['fp8_meta'] of a linen model), but {argname}{where} is a "
          f"{type(leaf).__name__} outside any Fp8Meta. Pass only the FP8 state, not "
          "parameters or a whole variables dict.")


def resize_history(fp8_state: Any, new_recipe: Recipe) -> Any:
  """Converts FP8 state to `new_recipe`: a different history length, algo, margin or kind.

  Each role keeps its newest `min(L_old, L_new)` amaxes (newest first) and is
  padded with zeros at the old end; its scale is kept as it is (the next
  `fp8jax.end_step` computes one by the new recipe's rule). Nothing else is
  recomputed. The FP8 formats cannot change (their scales would be meaningless);
  create fresh state with `fp8jax.init_dot_meta(new_recipe)` for that.

  Args:
    fp8_state: pytree of `Fp8Meta` (stacked metas too: the history is the last axis).
    new_recipe: the recipe every meta is converted to.

  Returns:
    The same structure with `new_recipe` as every meta's recipe.

  Raises:
    ValueError: `new_recipe` uses other FP8 formats than a meta's recipe.
  """
  check_recipe(new_recipe, "new_recipe")
  check_fp8_state(fp8_state, "fp8_state")
  new_len = new_recipe.history_len

  def convert(meta: Fp8Meta) -> Fp8Meta:
    old = meta.recipe
    if (old.forward_format, old.gradient_format) != (new_recipe.forward_format,
                                                     new_recipe.gradient_format):
      raise ValueError(
          f"resize_history cannot change the FP8 formats: the state has "
          f"fp8_format={old.fp8_format!r} but new_recipe={new_recipe} has "
          f"fp8_format={new_recipe.fp8_format!r}. Its scales were made for the old formats; "
          "start from fresh state (fp8jax.init_dot_meta(new_recipe)).")
    if new_recipe.stochastic_rounding and not old.stochastic_rounding:
      raise ValueError(
          f"resize_history cannot convert state of {old} to {new_recipe}, which rounds "
          "gradients stochastically: its gradient roles need rounding keys the state does "
          "not hold. Start from fresh state (fp8jax.init_dot_meta(new_recipe)).")
    history = meta.amax_history[..., :new_len]
    pad = new_len - history.shape[-1]
    if pad > 0:
      history = jnp.concatenate(
          [history, jnp.zeros(history.shape[:-1] + (pad,), history.dtype)], axis=-1)
    rng = meta.rng if new_recipe.stochastic_rounding else None
    return dataclasses.replace(meta, amax_history=history, recipe=new_recipe, rng=rng)

  return map_metas(convert, fp8_state)


# ----- What an op does to a role's state --------------------------------------------------


def record_amax(meta: Fp8Meta, amax: jax.Array) -> Fp8Meta:
  """Takes the max of the step's running amax and `amax` (NaN propagates until end_step)."""
  return dataclasses.replace(meta, amax=amax_max(meta.amax, amax))


def amaxes_unbatched_like(reference_state, recorded_state):
  """`recorded_state` with each role's amax made `fp8jax.core.quantize.unbatched_like` the
  same role's amax in `reference_state`: what an FP8 op returns as its state (and its
  state's cotangent), so that under `jax.vmap` over examples one FP8 state records
  the amax of the whole batch (not their sum, not a batched state)."""
  return map_metas(
      lambda reference, recorded: dataclasses.replace(
          recorded, amax=unbatched_like(reference.amax, recorded.amax)),
      reference_state, recorded_state)


def scale_for(meta: Fp8Meta, tensor_amax: jax.Array) -> jax.Array:
  """The float32[] scale to cast a tensor with under `meta`.

  Delayed scaling: the stored `meta.scale`. Recipes that scale from the tensor
  (`Recipe.scales_from_tensor`): `scale_from_amax` of `tensor_amax`, the amax of
  the whole tensor (the op makes it so across `jax.vmap` and `shard_map`),
  keeping `meta.scale` where that amax is 0 or not finite. The per-row /
  per-block recipes scale per tensor this way where one scale per tensor is all
  an op takes (the fused attention kernels).
  """
  if meta.recipe.scales_from_tensor:
    return scale_from_amax(tensor_amax, meta.fmt, meta.recipe.margin, fallback=meta.scale,
                           power_of_two=meta.recipe.power_of_two)
  return meta.scale


def descale(meta: Fp8Meta, scale: jax.Array) -> jax.Array:
  """The descale `1 / scale` of a cast: the stored `scale_inv` when `scale` is the meta's."""
  if meta.recipe.scales_from_tensor:
    return 1.0 / scale
  return meta.scale_inv
