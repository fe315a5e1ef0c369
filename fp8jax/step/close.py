"""Closing a step: the delayed-scaling update, from the step's amaxes to the next scale.

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
   A role that keeps a stochastic-rounding key (`Fp8Meta.rng`) gets the next
   step's key (`fp8jax.core.rounding_keys.next_step_key`).

On a GPU `end_step` runs as one kernel per recipe (per 32 roles) that reads
and writes every role's arrays directly (`fp8jax.ops.fused_kernels.close_steps`); XLA on
its own compiles the same update into a few kernels *per role*, because it does
not fuse independent small outputs into one launch. Elsewhere the update is
the same arithmetic in jnp, bit for bit.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from fp8jax.core.meta import check_fp8_state, check_shapes, is_meta, map_metas
from fp8jax.core.rounding_keys import next_step_key
from fp8jax.core.quantize import amax_max, round_down_to_power_of_two, scale_from_window
from fp8jax.ops import fused_kernels
from fp8jax.ops.guards import refuse_split_state


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


def close_step(forward_state, cotangent_state, *, written_over=None):
  """`end_step(merge_step(forward_state, cotangent_state))`, with the merge inside the update.

  What `fp8jax.value_and_grad` runs at the end of a step: the max of what the
  forward and the backward pass recorded is taken in the same fused update,
  so the merge adds no kernel per role.

  Args:
    forward_state: the state the forward pass returned.
    cotangent_state: the gradient with respect to the state the forward pass was given.
    written_over: optional, the state the step was given, when the step donates it
      (`jax.jit(..., donate_argnums=...)`). On a GPU the update then writes each
      stacked role's (a meta stacked over layers) new scale_inv and amax over that
      state's, reading nothing from them (its new history and scale replace the
      arrays of `forward_state`, which are the given ones), so JAX prunes none of the
      stacked roles' arrays as unused, pairs each donated buffer with its own new value,
      and XLA copies nothing into the state after the update. The numbers are the same
      without it. A step that passes it but does not donate the state copies each
      stacked role's four small arrays before the update instead.

  Returns:
    The next state, structured like `forward_state`.
  """
  check_fp8_state(forward_state, "forward_state")
  check_fp8_state(cotangent_state, "cotangent_state")
  _check_same_structure(forward_state, cotangent_state)
  _check_written_over(forward_state, written_over)
  return _end_step(forward_state, cotangent_state, written_over)


def end_step(fp8_state, *, written_over=None):
  """Closes a step: pushes each role's step amax into its history and computes its next scale.

  All roles that share a recipe are updated together as one vector (stacked
  metas too), so the compiled update does not grow with the number of layers.

  Args:
    fp8_state: pytree of `Fp8Meta` whose `amax` holds the step's amax.
    written_over: optional, the state the step was given: as for `close_step`.

  Returns:
    The same structure with finite histories, the scales (and reciprocals) for
    the next step, and running amaxes at 0.
  """
  check_fp8_state(fp8_state, "fp8_state")
  _check_written_over(fp8_state, written_over)
  return _end_step(fp8_state, None, written_over)


def _end_step(fp8_state, cotangent_state, written_over=None):
  refuse_split_state(fp8_state, "fp8_state")
  for path, meta in jax.tree_util.tree_leaves_with_path(fp8_state, is_leaf=is_meta):
    check_shapes(meta, f"fp8_state{jax.tree_util.keystr(path)}", stacked=True)
  metas, treedef = jax.tree.flatten(fp8_state, is_leaf=is_meta)
  others = (jax.tree.leaves(cotangent_state, is_leaf=is_meta) if cotangent_state is not None
            else [None] * len(metas))
  olds = (jax.tree.leaves(written_over, is_leaf=is_meta) if written_over is not None
          else [None] * len(metas))
  by_recipe: dict = {}
  for index, meta in enumerate(metas):
    by_recipe.setdefault(meta.recipe, []).append(index)
  closed = list(metas)
  for recipe, indices in by_recipe.items():
    group = _close_together([metas[i] for i in indices], [others[i] for i in indices],
                            [olds[i] for i in indices], recipe)
    for index, meta in zip(indices, group):
      if meta.rng is not None:
        meta = dataclasses.replace(meta, rng=next_step_key(meta.rng))
      closed[index] = meta
  return jax.tree.unflatten(treedef, closed)


def _close_together(metas, cotangents, olds, recipe):
  """`end_step` for metas that share `recipe`: `_close_rows` on every role, run as one
  fused kernel on a GPU (`fp8jax.ops.fused_kernels.close_steps`), which writes over the
  arrays of `olds` (the metas the step was given, or Nones: `close_step`)."""
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
        reference=reference, written_over=_old_arrays(metas, olds))
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


def _old_arrays(metas, olds):
  """(scale_invs, amaxes) of `olds` for the update to write over, flattened like the
  metas' own; None where there are none or any differs from its meta in shape or dtype
  (a loss that returned a state of other shapes: nothing is written over then)."""
  if olds[0] is None:
    return None
  for meta, old in zip(metas, olds):
    for field in ("scale_inv", "amax"):
      new, given = getattr(meta, field), getattr(old, field)
      if jnp.shape(new) != jnp.shape(given) or jnp.result_type(new) != jnp.result_type(given):
        return None
  return [jnp.ravel(m.scale_inv) for m in olds], [jnp.ravel(m.amax) for m in olds]


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
  candidate = scale_from_window(window, jnp.float32(numerator), scale)
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


def _check_written_over(state, written_over) -> None:
  if written_over is None:
    return
  check_fp8_state(written_over, "written_over")
  if jax.tree.structure(state) != jax.tree.structure(written_over):
    raise ValueError(
        "written_over must be the state the step was given, structured like the state "
        f"being closed; got {jax.tree.structure(written_over)} for "
        f"{jax.tree.structure(state)}. Pass that state, or None.")
