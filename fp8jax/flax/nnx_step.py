"""`value_and_grad` for nnx models with FP8 layers and any other state (dropout rngs,
batch statistics): nnx's own step shape, with fp8jax's FP8 step inside.

    @nnx.jit
    def train_step(model, optimizer, x, y):
      loss, grads = fp8jax.flax.nnx_value_and_grad(loss_fn)(model, x, y)
      optimizer.update(model, grads)
      return loss

    def loss_fn(model, x, y):          # as for nnx.value_and_grad
      return jnp.mean((model(x) - y) ** 2)

The model is split into the parameters (differentiated), its `Fp8MetaVariable`s
(threaded through `fp8jax.value_and_grad`: the step's amaxes recorded, the
scales updated) and everything else (`nnx.Rngs` counts, `nnx.BatchNorm`
statistics, ...), which the call may change as nnx would. All three are written
back into `model`, so under `nnx.jit` the step updates it in place, as
`nnx.value_and_grad` does. The hand-written loop of `fp8jax.flax.nnx` (split
into params and FP8 state, merge inside the loss) cannot carry that other state
and fails with nnx's TraceContextError.

`nnx_calibrate(loss_fn)(model, *args)` seeds a fresh model's delayed-scaling state
before its first step (`fp8jax.calibrate`), changing nothing else.
"""
from __future__ import annotations

from typing import Callable

from flax import nnx

from fp8jax.flax.nnx import Fp8MetaVariable
from fp8jax.step.training import calibrate as fp8_calibrate
from fp8jax.step.training import value_and_grad as fp8_value_and_grad


def nnx_value_and_grad(loss_fn: Callable, *, has_aux: bool = False, wrt=nnx.Param,
                       report_overflow: bool = False) -> Callable:
  """Wraps `loss_fn(model, *args) -> loss` (or `(loss, aux)`) for an nnx model.

  Args:
    loss_fn: called with the model and the step's arguments.
    has_aux: whether `loss_fn` returns `(loss, aux)`.
    wrt: the nnx filter of what is differentiated (default `nnx.Param`).
    report_overflow: also return whether any recorded amax was inf or NaN (see
      `fp8jax.value_and_grad`).

  Returns:
    `step(model, *args) -> (loss, grads)` (`((loss, aux), grads)` with `has_aux`;
    `(..., overflow)` with `report_overflow`), `grads` an `nnx.State` of the `wrt`
    variables, as `nnx.value_and_grad` returns. The model's FP8 state and other
    state are updated in place.
  """

  def step(model: nnx.Module, *args):
    graphdef, params, fp8_state, rest = nnx.split(model, wrt, Fp8MetaVariable, ...)
    pure_loss = _pure_loss(loss_fn, has_aux, wrt, graphdef)
    results = fp8_value_and_grad(pure_loss, has_aux=True, report_overflow=report_overflow)(
        params, fp8_state, rest, *args)
    (loss, extra), grads, new_fp8_state = results[:3]
    aux, new_rest = extra if has_aux else (None, extra)
    nnx.update(model, new_fp8_state, new_rest)
    value = (loss, aux) if has_aux else loss
    return (value, grads) + tuple(results[3:])

  return step


def nnx_calibrate(loss_fn: Callable, *, has_aux: bool = False, wrt=nnx.Param) -> Callable:
  """`fp8jax.calibrate` for an nnx model: seeds its FP8 state before the first step.

  Run once on a training batch, under `nnx.jit` or eagerly, before the first train
  step of a model with fresh delayed-scaling state (see `fp8jax.calibrate`).

  Args:
    loss_fn, has_aux, wrt: as for `nnx_value_and_grad` (the train step's loss).

  Returns:
    `calibrate(model, *args) -> None`: the model's `Fp8MetaVariable`s are updated in
    place; its parameters and other state (dropout rngs, batch statistics) are not.
  """

  def calibrate(model: nnx.Module, *args) -> None:
    graphdef, params, fp8_state, rest = nnx.split(model, wrt, Fp8MetaVariable, ...)
    pure_loss = _pure_loss(loss_fn, has_aux, wrt, graphdef)
    nnx.update(model, fp8_calibrate(pure_loss, has_aux=True)(params, fp8_state, rest, *args))

  return calibrate


def _pure_loss(loss_fn: Callable, has_aux: bool, wrt, graphdef) -> Callable:
  """`loss_fn` over the model's split state, for `fp8jax.value_and_grad`:
  `(params, fp8_state, rest, *args) -> ((loss, (aux, new_rest) or new_rest), new_fp8_state)`."""

  def pure_loss(params, fp8_state, rest, *args):
    merged = nnx.merge(graphdef, params, fp8_state, rest, copy=True)  # variables of this trace
    out = loss_fn(merged, *args)
    new_fp8_state = nnx.state(merged, Fp8MetaVariable)
    new_rest = nnx.state(merged, nnx.Not(nnx.Any(wrt, Fp8MetaVariable)))
    if has_aux:
      loss, aux = out
      return (loss, (aux, new_rest)), new_fp8_state
    return (out, new_rest), new_fp8_state

  return pure_loss
