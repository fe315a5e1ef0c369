"""A Flax `TrainState` that carries the FP8 state beside the parameters.

Flax's `TrainState` holds `params`, `opt_state` and the optimizer; this one also
holds `fp8_state` (a linen model's "fp8_meta" collection, or any fp8jax FP8
state). The optimizer only ever sees `params`; the FP8 state is replaced by the
one `fp8jax.value_and_grad` returns:

    state = TrainState.create(apply_fn=model.apply, variables=variables,
                              tx=optax.adamw(1e-3))

    def loss_fn(params, fp8_state, x, y):
      out, updates = state.apply_fn({"params": params, "fp8_meta": fp8_state}, x,
                                    mutable=["fp8_meta"])
      return jnp.mean((out - y) ** 2), updates["fp8_meta"]

    @jax.jit
    def train_step(state, x, y):
      loss, grads, fp8_state = fp8jax.value_and_grad(loss_fn)(
          state.params, state.fp8_state, x, y)
      return state.apply_gradients(grads=grads, fp8_state=fp8_state), loss

`state.variables` gives `{"params": ..., "fp8_meta": ...}` for evaluation. Other
collections (e.g. "batch_stats") go in `extra_variables` and are returned as they
are; update them with `state.replace(extra_variables=...)`.
"""
from __future__ import annotations

from typing import Any, Callable

import optax
from flax import struct
from flax.training import train_state

from fp8jax.flax.linen import FP8_COLLECTION
from fp8jax.core.meta import check_fp8_state


class TrainState(train_state.TrainState):
  """`flax.training.train_state.TrainState` plus `fp8_state` and any other collections.

  Attributes:
    fp8_state: the FP8 state (for linen: the "fp8_meta" collection).
    extra_variables: variable collections other than "params" and "fp8_meta".
  """

  fp8_state: Any = struct.field(pytree_node=True, default=None)
  extra_variables: Any = struct.field(pytree_node=True, default=None)

  @classmethod
  def create(cls, *, apply_fn: Callable, tx: optax.GradientTransformation,
             variables: Any = None, params: Any = None, fp8_state: Any = None,
             **kwargs) -> "TrainState":
    """A fresh state: step 0, `tx.init(params)`.

    Args:
      apply_fn: usually `model.apply`.
      tx: the optax optimizer; it sees the parameters only.
      variables: the dict `model.init` returned; split into "params", "fp8_meta"
        and the other collections. Give either this or `params` (and `fp8_state`).
      params, fp8_state: the parameters and the FP8 state, when you hold them apart.
      **kwargs: further fields of your subclass.
    """
    if variables is not None:
      if params is not None or fp8_state is not None or "extra_variables" in kwargs:
        raise ValueError(
            "TrainState.create: give either variables= (the dict model.init returned; its "
            "collections other than params and fp8_meta become extra_variables) or "
            "params=, fp8_state= and extra_variables=, not both.")
      if not hasattr(variables, "keys") or "params" not in variables:
        raise ValueError(
            "TrainState.create: variables must be the dict model.init returned, with a "
            f"'params' collection; got {type(variables).__name__} with keys "
            f"{sorted(getattr(variables, 'keys', lambda: [])())}.")
      variables = dict(variables)
      params = variables.pop("params")
      fp8_state = variables.pop(FP8_COLLECTION, {})
      extra = variables or None
    else:
      if params is None:
        raise ValueError("TrainState.create: give variables= (from model.init) or params=.")
      extra = kwargs.pop("extra_variables", None)
    check_fp8_state({} if fp8_state is None else fp8_state, "fp8_state")
    return cls(step=0, apply_fn=apply_fn, params=params, tx=tx, opt_state=tx.init(params),
               fp8_state={} if fp8_state is None else fp8_state, extra_variables=extra,
               **kwargs)

  def apply_gradients(self, *, grads: Any, fp8_state: Any, **kwargs) -> "TrainState":
    """One optimizer step on `params` with `grads`, and the step's next `fp8_state`.

    Args:
      grads: gradients shaped like `params` (not the whole variables dict).
      fp8_state: the next FP8 state, as `fp8jax.value_and_grad` returned it. It is
        required: a step that forgot it would freeze the scales.
      **kwargs: other fields to replace.
    """
    if _has_fp8_collection(grads):
      raise ValueError(
          f"apply_gradients: grads holds a '{FP8_COLLECTION}' collection. FP8 state is not "
          "trained by the optimizer: pass the gradients of params only, and the next FP8 "
          "state as fp8_state= (both come from fp8jax.value_and_grad).")
    check_fp8_state(fp8_state, "fp8_state")
    return super().apply_gradients(grads=grads, fp8_state=fp8_state, **kwargs)

  @property
  def variables(self) -> dict:
    """`{"params": params, "fp8_meta": fp8_state, **extra_variables}` for `apply_fn`."""
    return {"params": self.params, FP8_COLLECTION: self.fp8_state,
            **(self.extra_variables or {})}


def _has_fp8_collection(grads) -> bool:
  return hasattr(grads, "keys") and FP8_COLLECTION in grads
