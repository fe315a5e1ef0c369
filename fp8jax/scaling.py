"""The delayed-scaling update: from amaxes to the next scale.

Per role and per step t (DESIGN numerics contract):

1. The step opens with the running amax `meta.amax` at 0 (`fp8jax.begin_step`,
   or the state `end_step` returned). The scale used during step t is the
   stored `scale`, computed from the history of the steps *before* t.
2. Each use of the meta during the step records `amax = max(amax, amax of x)`:
   one scalar max, the only work an FP8 op does on its state.
3. `end_step` closes the step for every role of the model at once: a
   non-finite step amax is recorded as 0 (no usable observation) and pushed as
   the newest history entry (the oldest drops out), then
   `window = max(history)` ("max") or `history[0]` ("most_recent") and
   `scale = fp8_max / window / 2**margin`. If the step's amax was 0, inf or NaN,
   or the result is not a finite positive number, the old scale is kept.
   `scale_inv = 1 / scale` and the running amax returns to 0. Under
   `power_of_two=True` the new scale is then rounded down to a power of two.

On a GPU `end_step` runs as one kernel per recipe (per 32 roles) that reads
and writes every role's arrays directly (`fp8jax.fused_kernels.close_steps`); XLA on
its own compiles the same update into a few kernels *per role*, because it does
not fuse independent small outputs into one launch. Elsewhere the update is
the same arithmetic in jnp, bit for bit.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from fp8jax import fused_kernels
from fp8jax.formats import Fp8Format
from fp8jax.meta import Fp8Meta, check_fp8_state, is_meta, map_metas
from fp8jax.amax import amax, amax_max, unbatched_like
from fp8jax.block_quantize import round_down_to_power_of_two
from fp8jax.manual_axes import split_state_message
from fp8jax.quantize import quantize
from fp8jax.sharding import global_amax
from fp8jax.validation import check_format, check_int


def scale_from_amax(amax: jax.Array, fmt: Fp8Format, margin: int,
                    fallback: jax.Array, power_of_two: bool = False) -> jax.Array:
  """`fmt.max / amax / 2**margin`, or `fallback` when that is not finite and positive.

  Args:
    amax: float32[] absolute maximum of the tensor (may be 0, inf or NaN).
    fmt: the FP8 format the tensor is cast to.
    margin: power-of-two headroom.
    fallback: float32[] scale to keep when `amax` gives no usable scale.
    power_of_two: round the scale down to a power of two (its float32 mantissa
      bits cleared): `amax * scale <= fmt.max` still holds and `1 / scale` is exact.

  Returns:
    float32[] scale.
  """
  check_format(fmt, "fmt")
  check_int("margin", margin, minimum=0)
  scale = _scale_from_amax(amax, jnp.float32(fmt.max / 2.0**margin), fallback)
  # The fallback is a scale this rule made before (or 1), so rounding it changes nothing.
  return round_down_to_power_of_two(scale) if power_of_two else scale


def _scale_from_amax(amax, numerator, fallback):
  amax = jnp.asarray(amax, jnp.float32)
  scale = numerator / amax
  usable = jnp.isfinite(amax) & (amax > 0) & jnp.isfinite(scale) & (scale > 0)
  return jnp.where(usable, scale, fallback)


def record_amax(meta: Fp8Meta, amax: jax.Array) -> Fp8Meta:
  """Takes the max of the step's running amax and `amax` (NaN propagates until end_step)."""
  return dataclasses.replace(meta, amax=amax_max(meta.amax, amax))


def amaxes_unbatched_like(reference_state, recorded_state):
  """`recorded_state` with each role's amax made `fp8jax.amax.unbatched_like` the same
  role's amax in `reference_state`: what an FP8 op returns as its state (and its
  state's cotangent), so that under `jax.vmap` over examples one FP8 state records
  the amax of the whole batch (not their sum, not a batched state)."""
  return map_metas(
      lambda reference, recorded: dataclasses.replace(
          recorded, amax=unbatched_like(reference.amax, recorded.amax)),
      reference_state, recorded_state)


def begin_step(fp8_state):
  """Opens a step for every `Fp8Meta` in `fp8_state`: each running amax starts at 0.

  `end_step` already leaves the running amaxes at 0, so a state that came out of
  `end_step` (or `init_dot_meta`) is open as it is; this makes any state so.

  Args:
    fp8_state: any pytree holding `Fp8Meta` nodes (stacked ones too).

  Returns:
    The same structure, ready to record this step's amaxes.
  """
  check_fp8_state(fp8_state, "fp8_state")
  return map_metas(lambda m: dataclasses.replace(m, amax=jnp.zeros_like(m.amax)), fp8_state)


def close_step(forward_state, cotangent_state):
  """`end_step(merge_step(forward_state, cotangent_state))`, with the merge inside the update.

  What `fp8jax.value_and_grad` runs at the end of a step: the max of what the
  forward and the backward pass recorded is taken in the same fused update,
  so the merge adds no kernel per role.
  """
  check_fp8_state(forward_state, "forward_state")
  check_fp8_state(cotangent_state, "cotangent_state")
  _check_same_structure(forward_state, cotangent_state)
  return _end_step(forward_state, cotangent_state)


def end_step(fp8_state):
  """Closes a step: pushes each role's step amax into its history and computes its next scale.

  All roles that share a recipe are updated together as one vector (stacked
  metas too), so the compiled update does not grow with the number of layers.

  Args:
    fp8_state: pytree of `Fp8Meta` whose `amax` holds the step's amax.

  Returns:
    The same structure with finite histories, the scales (and reciprocals) for
    the next step, and running amaxes at 0.
  """
  check_fp8_state(fp8_state, "fp8_state")
  return _end_step(fp8_state, None)


def _end_step(fp8_state, cotangent_state):
  _check_shapes(fp8_state)
  metas, treedef = jax.tree.flatten(fp8_state, is_leaf=is_meta)
  others = (jax.tree.leaves(cotangent_state, is_leaf=is_meta) if cotangent_state is not None
            else [None] * len(metas))
  by_recipe: dict = {}
  for index, meta in enumerate(metas):
    by_recipe.setdefault(meta.recipe, []).append(index)
  closed = list(metas)
  for recipe, indices in by_recipe.items():
    group = _close_together([metas[i] for i in indices], [others[i] for i in indices], recipe)
    for index, meta in zip(indices, group):
      closed[index] = meta
  return jax.tree.unflatten(treedef, closed)


def _check_shapes(fp8_state) -> None:
  """Raises naming the meta unless its arrays have the shapes its recipe gives them."""
  for path, meta in jax.tree_util.tree_leaves_with_path(fp8_state, is_leaf=is_meta):
    rows = jnp.shape(meta.scale)
    want = {"scale_inv": rows, "amax": rows,
            "amax_history": rows + (meta.recipe.history_len,)}
    for field, shape in want.items():
      got = jnp.shape(getattr(meta, field))
      if got != shape:
        if field == "amax_history" and got[:-1] == rows:
          split = split_state_message(f"fp8_state{jax.tree_util.keystr(path)}.{field}", got,
                                      meta.recipe)
          if split:  # shard_map's in_specs gave each device a slice of the history
            raise ValueError(split)
        raise ValueError(
            f"fp8_state{jax.tree_util.keystr(path)}.{field} has shape "
            f"{jnp.shape(getattr(meta, field))}, but scale has shape {rows} and the recipe "
            f"{meta.recipe} keeps a history of {meta.recipe.history_len}: expected {shape}. "
            "Make the state with fp8jax.init_dot_meta, or convert it with "
            "fp8jax.resize_history.")


def _close_together(metas, cotangents, recipe):
  """`end_step` for metas that share `recipe`: `_close_rows` on every role, run as one
  fused kernel on a GPU (`fp8jax.fused_kernels.close_steps`)."""
  amaxes = [jnp.ravel(m.amax) for m in metas]
  histories = [jnp.ravel(m.amax_history) for m in metas]
  scales = [jnp.ravel(m.scale) for m in metas]
  other_amaxes = ([jnp.ravel(c.amax) for c in cotangents] if cotangents[0] is not None
                  else None)
  numerators = [m.fmt.max / 2.0**recipe.margin for m in metas]

  def reference(amaxes, other_amaxes, histories, scales):
    others = other_amaxes if other_amaxes is not None else [None] * len(amaxes)
    rows = [_close_rows(*role, recipe) for role in zip(amaxes, others, histories, scales,
                                                         numerators)]
    return tuple(list(column) for column in zip(*rows))

  if recipe.fused_update:
    new_scales, scale_invs, new_histories, new_amaxes = fused_kernels.close_steps(
        amaxes, other_amaxes, histories, scales, numerators=numerators,
        history_len=recipe.history_len, amax_compute_algo=recipe.amax_compute_algo,
        reference=reference)
  else:  # the recipe's own window_amax, as written
    new_scales, scale_invs, new_histories, new_amaxes = reference(
        amaxes, other_amaxes, histories, scales)
  if recipe.power_of_two:
    # After the fused close (whose kernel knows nothing of the option): round each
    # new scale down to a power of two, whose reciprocal is exact.
    new_scales = [round_down_to_power_of_two(scale) for scale in new_scales]
    scale_invs = [1.0 / scale for scale in new_scales]
  return [dataclasses.replace(
      meta, scale=scale.reshape(jnp.shape(meta.scale)),
      scale_inv=scale_inv.reshape(jnp.shape(meta.scale)),
      amax_history=history.reshape(jnp.shape(meta.amax_history)),
      amax=amax.reshape(jnp.shape(meta.amax)))
      for meta, scale, scale_inv, history, amax
      in zip(metas, new_scales, scale_invs, new_histories, new_amaxes)]


def _close_rows(amax, other_amax, history, scale, numerator, recipe):
  """The step's close for one role's rows: amax [n], history [n * L], scale [n].

  Returns (scale, scale_inv, history, amax) of the same shapes (amax all 0).
  """
  if other_amax is not None:
    amax = amax_max(amax, other_amax)
  history_len = recipe.history_len
  history = history.reshape(-1, history_len)
  finite = jnp.abs(amax) < jnp.inf  # false for NaN and inf
  recorded = jnp.where(finite, amax, 0.0)
  history = jnp.concatenate([recorded[:, None], history[:, :history_len - 1]], axis=1)
  window = recipe.window_amax(history)
  candidate = _scale_from_amax(window, jnp.float32(numerator), scale)
  new_scale = jnp.where(finite & (amax > 0), candidate, scale)
  return new_scale, 1.0 / new_scale, history.reshape(-1), jnp.zeros_like(amax)


def merge_step(forward_state, cotangent_state):
  """Combines what the forward pass and the backward pass recorded, by max.

  Forward roles (x, kernel) record their amax in the state the forward pass
  returns; gradient roles record theirs in the cotangent of the input state.
  Each side holds 0 for the roles it did not see, so a max per role merges them.
  """
  check_fp8_state(forward_state, "forward_state")
  check_fp8_state(cotangent_state, "cotangent_state")
  _check_same_structure(forward_state, cotangent_state)
  return map_metas(lambda f, c: dataclasses.replace(f, amax=amax_max(f.amax, c.amax)),
                   forward_state, cotangent_state)


def _check_same_structure(forward_state, cotangent_state) -> None:
  if jax.tree.structure(forward_state) != jax.tree.structure(cotangent_state):
    raise ValueError(
        "forward_state and cotangent_state must have the same structure (the state the "
        "forward pass returned and the gradient with respect to the state it was given); "
        f"got {jax.tree.structure(forward_state)} and {jax.tree.structure(cotangent_state)}.")


def quantize_with_meta(x: jax.Array, meta: Fp8Meta) -> tuple[jax.Array, jax.Array, Fp8Meta]:
  """Quantizes `x` as `meta`'s recipe says and records `x`'s amax.

  Delayed scaling uses the stored `meta.scale`; current scaling computes the
  scale from `x`'s own amax (keeping `meta.scale` if that amax is 0 or not finite);
  inside `shard_map` that is the amax of the whole tensor, not of this shard.

  Returns:
    (q in meta.fmt.dtype, the float32[] scale used, meta with the amax recorded).
  """
  x_amax = amax(x)
  scale = scale_for(meta, x_amax, like=x)
  return quantize(x, scale, meta.fmt), scale, record_amax(meta, x_amax)


def scale_for(meta: Fp8Meta, x_amax: jax.Array, like: jax.Array | None = None) -> jax.Array:
  """The float32[] scale to quantize a tensor of amax `x_amax` with under `meta`.

  `like` is the tensor itself: under `shard_map`, current scaling takes the max
  of `x_amax` over the devices holding the other shards of that tensor; under
  `jax.vmap` with one state, the max over the batch (`fp8jax.amax.unbatched_like`). The
  per-row / per-block recipes scale per tensor, from its own amax, where one
  scale per tensor is all an op takes (the fused attention kernels).
  """
  if meta.recipe.scales_from_tensor:
    x_amax = unbatched_like(meta.amax, x_amax)  # under vmap: the whole batch's amax
    if like is not None:
      x_amax = global_amax(x_amax, like)
    return scale_from_amax(x_amax, meta.fmt, meta.recipe.margin, fallback=meta.scale,
                           power_of_two=meta.recipe.power_of_two)
  return meta.scale
