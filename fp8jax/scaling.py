"""The delayed-scaling update: from amaxes to the next scale.

Per role and per step t (DESIGN numerics contract):

1. `begin_step`: the history rolls by one and its newest slot `amax_history[0]`
   opens at 0. The scale used during step t is the stored `scale`, which was
   computed from the history *before* step t.
2. Each use of the meta during the step records `max(amax_history[0], amax)`.
3. `end_step`: a non-finite step amax is recorded as 0 (no usable observation),
   then `amax = max(history)` ("max") or `history[0]` ("most_recent") and
   `scale = fp8_max / amax / 2**margin`. If the step's amax was 0, inf or NaN,
   or the result is not a finite positive number, the old scale is kept.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from fp8jax.formats import Fp8Format
from fp8jax.meta import Fp8Meta, check_fp8_state, map_metas
from fp8jax.validation import check_format, check_int


def scale_from_amax(amax: jax.Array, fmt: Fp8Format, margin: int,
                    fallback: jax.Array) -> jax.Array:
  """`fmt.max / amax / 2**margin`, or `fallback` when that is not finite and positive.

  Args:
    amax: float32[] absolute maximum of the tensor (may be 0, inf or NaN).
    fmt: the FP8 format the tensor is cast to.
    margin: power-of-two headroom.
    fallback: float32[] scale to keep when `amax` gives no usable scale.

  Returns:
    float32[] scale.
  """
  check_format(fmt, "fmt")
  check_int("margin", margin, minimum=0)
  amax = jnp.asarray(amax, jnp.float32)
  scale = jnp.float32(fmt.max / 2.0**margin) / amax
  usable = jnp.isfinite(amax) & (amax > 0) & jnp.isfinite(scale) & (scale > 0)
  return jnp.where(usable, scale, fallback)


def _with_newest(history, value) -> jax.Array:
  """`history` (any array type, stacked too) with its newest slot set to `value`."""
  return jnp.asarray(history).at[..., 0].set(value)


def record_amax(meta: Fp8Meta, amax: jax.Array) -> Fp8Meta:
  """Takes the max of the step's running amax and `amax` (NaN propagates until end_step)."""
  running = jnp.maximum(meta.amax_history[..., 0], amax)
  return dataclasses.replace(meta, amax_history=_with_newest(meta.amax_history, running))


def _open_step(meta: Fp8Meta) -> Fp8Meta:
  history = _with_newest(jnp.roll(meta.amax_history, 1, axis=-1), 0.0)
  return dataclasses.replace(meta, amax_history=history)


def _close_step(meta: Fp8Meta) -> Fp8Meta:
  step_amax = meta.amax_history[..., 0]
  step_amax_finite = jnp.isfinite(step_amax)
  history = _with_newest(meta.amax_history, jnp.where(step_amax_finite, step_amax, 0.0))
  if meta.recipe.amax_compute_algo == "max":
    window_amax = jnp.max(history, axis=-1)
  else:
    window_amax = history[..., 0]
  new_scale = scale_from_amax(window_amax, meta.fmt, meta.recipe.margin, fallback=meta.scale)
  keep_old = ~step_amax_finite | (step_amax <= 0)
  scale = jnp.where(keep_old, meta.scale, new_scale)
  return dataclasses.replace(meta, scale=scale, amax_history=history)


def _merge(forward: Fp8Meta, cotangent: Fp8Meta) -> Fp8Meta:
  running = jnp.maximum(forward.amax_history[..., 0], cotangent.amax_history[..., 0])
  return dataclasses.replace(forward, amax_history=_with_newest(forward.amax_history, running))


def begin_step(fp8_state):
  """Opens a step for every `Fp8Meta` in `fp8_state` (roll history, newest slot = 0).

  Args:
    fp8_state: any pytree holding `Fp8Meta` nodes (stacked ones too).

  Returns:
    The same structure, ready to record this step's amaxes.
  """
  check_fp8_state(fp8_state, "fp8_state")
  return map_metas(_open_step, fp8_state)


def end_step(fp8_state):
  """Closes a step: sanitizes the step's amax and computes each role's next scale.

  Args:
    fp8_state: pytree of `Fp8Meta` whose newest history slot holds the step's amax.

  Returns:
    The same structure with finite histories and the scales for the next step.
  """
  check_fp8_state(fp8_state, "fp8_state")
  return map_metas(_close_step, fp8_state)


def merge_step(forward_state, cotangent_state):
  """Combines what the forward pass and the backward pass recorded, by max.

  Forward roles (x, kernel) record their amax in the state the forward pass
  returns; gradient roles record theirs in the cotangent of the input state.
  Each side holds 0 for the roles it did not see, so a max per slot merges them.
  """
  check_fp8_state(forward_state, "forward_state")
  check_fp8_state(cotangent_state, "cotangent_state")
  if jax.tree.structure(forward_state) != jax.tree.structure(cotangent_state):
    raise ValueError(
        "forward_state and cotangent_state must have the same structure (the state the "
        "forward pass returned and the gradient with respect to the state it was given); "
        f"got {jax.tree.structure(forward_state)} and {jax.tree.structure(cotangent_state)}.")
  return map_metas(_merge, forward_state, cotangent_state)
