"""Training-step helpers that thread FP8 state through `jax.grad`.

A loss function written for fp8jax has the signature

    loss_fn(params, fp8_state, *args) -> (loss, new_fp8_state)
    loss_fn(params, fp8_state, *args) -> ((loss, aux), new_fp8_state)   # has_aux=True

where `new_fp8_state` is the state after the forward pass threaded it through
every FP8 op (for Flax linen: the `fp8_meta` collection returned by
`apply(..., mutable=["fp8_meta"])`). The helpers here open a step, differentiate,
merge what the forward and backward passes recorded (max per role), and close
the step, giving the scales for the next step. Parameters and FP8 state stay in
separate trees, so an optimizer only ever sees parameter gradients.
"""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from fp8jax.scaling import begin_step, end_step, merge_step


def value_and_grad(loss_fn: Callable, has_aux: bool = False) -> Callable:
  """Wraps `loss_fn` to return `(loss, param_grads, next_fp8_state)`.

  Args:
    loss_fn: `(params, fp8_state, *args) -> (loss, new_fp8_state)`, or with
      `has_aux=True`, `-> ((loss, aux), new_fp8_state)`.
    has_aux: whether the loss comes with auxiliary data.

  Returns:
    A function `(params, fp8_state, *args) -> (loss, grads, next_fp8_state)`,
    or `((loss, aux), grads, next_fp8_state)` with `has_aux=True`. `grads` has
    the structure of `params`; `next_fp8_state` that of `fp8_state`.
  """

  def wrapped(params, fp8_state, *args):
    state = begin_step(fp8_state)
    value, grads, state = _differentiate(loss_fn, has_aux, params, state, args)
    return value, grads, end_step(state)

  return wrapped


def accumulate_gradients(loss_fn: Callable, params: Any, fp8_state: Any, microbatches: Any,
                         has_aux: bool = False):
  """Gradient accumulation over microbatches as one FP8 step.

  All microbatches use the step's scales; every role's recorded amax is the max
  over all microbatches (not a sum, not the last one), and the history advances
  by one entry.

  Args:
    loss_fn: as for `value_and_grad`.
    params: parameters.
    fp8_state: FP8 state at the start of the step.
    microbatches: pytree whose leaves have a leading axis of n microbatches.
    has_aux: whether `loss_fn` returns `(loss, aux)`.

  Returns:
    (mean loss, mean grads, next_fp8_state); with `has_aux`, `((mean loss, stacked aux),
    mean grads, next_fp8_state)`.
  """
  sizes = {leaf.shape[0] for leaf in jax.tree.leaves(microbatches)}
  if len(sizes) != 1:
    raise ValueError(
        "microbatches must be a pytree whose leaves share one leading (microbatch) axis; "
        f"got leading sizes {sorted(sizes)}.")
  n = sizes.pop()

  def one_microbatch(carry, batch):
    grad_sum, state = carry
    value, grads, state = _differentiate(loss_fn, has_aux, params, state, (batch,))
    grad_sum = jax.tree.map(jnp.add, grad_sum, grads)
    return (grad_sum, state), value

  zeros = jax.tree.map(jnp.zeros_like, params)
  (grad_sum, state), values = jax.lax.scan(one_microbatch, (zeros, begin_step(fp8_state)),
                                            microbatches)
  grads = jax.tree.map(lambda g: g / n, grad_sum)
  if has_aux:
    losses, aux = values
    value = (jnp.mean(losses), aux)
  else:
    value = jnp.mean(values)
  return value, grads, end_step(state)


def _differentiate(loss_fn, has_aux, params, state, args):
  """Forward + backward inside an open step; returns the merged in-step state."""

  def split_loss(p, s):
    value, new_state = loss_fn(p, s, *args)
    loss = value[0] if has_aux else value
    return loss, (value, new_state)

  (_, (value, forward_state)), (grads, state_cotangent) = jax.value_and_grad(
      split_loss, argnums=(0, 1), has_aux=True)(params, state)
  return value, grads, merge_step(forward_state, state_cotangent)
