"""`update_and_apply`: an optimizer's step written into the parameters.

    params, opt_state = fp8jax.optim.update_and_apply(tx, grads, opt_state, params)

is `tx.update(grads, opt_state, params)` then `optax.apply_updates`, for any optax
transformation. For `fp8jax.optim.adamw` on a GPU the kernel that steps each large
leaf's FP8 moments also clips its gradient (`max_grad_norm`) and writes its new parameter
(AdamW's decay, the learning rate and the addition in the same pass): the update is never
written, nor read again by a pass of its own, and the clipped gradient is not written by
a pass of its own either (the 350m demo GPT's step with the memory features: 26.71 ms
against 27.85 on an H100, `fp8jax cost`). The numbers are `tx.update` and
`optax.apply_updates`' to float32 rounding on a GPU, and theirs exactly where the jnp form
runs (CPU).
"""
from __future__ import annotations

import warnings
import weakref
from typing import Any, Callable

import jax
import optax

from fp8jax.optim.moment_codec import Fp8Moment

# A transformation's update function -> its fused step `(grads, state, params) -> (new
# params, new state)`. Keyed weakly: a transformation dropped takes its entry with it.
_FUSED: "weakref.WeakKeyDictionary[Callable, Callable]" = weakref.WeakKeyDictionary()


def register_fused(tx: optax.GradientTransformation, fused: Callable) -> None:
  """`update_and_apply(tx, ...)` runs `fused(grads, state, params) -> (params, state)`,
  which must give `tx.update` then `optax.apply_updates`' results."""
  _FUSED[tx.update] = fused


def update_and_apply(tx: optax.GradientTransformation, grads: Any, opt_state: Any,
                     params: Any) -> tuple[Any, Any]:
  """One optimizer step applied to the parameters.

  Args:
    tx: an optax transformation (`fp8jax.optim.adamw`'s, or any other).
    grads, opt_state, params: as for `tx.update(grads, opt_state, params)`.

  Returns:
    (the new params, the new optimizer state): `optax.apply_updates(params, updates)`
    and the state `tx.update` returns.
  """
  fused = _fused_step(tx)
  if fused is not None:
    return fused(grads, opt_state, params)
  if _holds_fp8_moments(opt_state):
    warnings.warn(
        "fp8jax.optim.update_and_apply: this transformation keeps FP8 Adam moments but is "
        "not fp8jax.optim.adamw's own (wrapped by optax.inject_hyperparams, MultiSteps or a "
        "chain, or with a weight-decay schedule), so the moments' kernel returns the update "
        "and a pass of its own applies it. Pass adamw's transformation itself, with "
        "max_grad_norm= for the clipping, to have the kernel write the parameters.",
        stacklevel=2)
  updates, opt_state = tx.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state


def _fused_step(tx) -> Callable | None:
  try:
    return _FUSED.get(tx.update)
  except TypeError:  # an update function that cannot be weakly referenced or hashed
    return None


def _holds_fp8_moments(opt_state) -> bool:
  is_moment = lambda node: isinstance(node, Fp8Moment)
  return any(is_moment(node) for node in jax.tree.leaves(opt_state, is_leaf=is_moment))
