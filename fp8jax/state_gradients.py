"""Who may differentiate FP8 state: fp8jax's step functions, not an optimizer.

Inside a step, the cotangent of an FP8 state carries what the backward pass
recorded (the output gradients' amaxes); `fp8jax.value_and_grad` merges it with
the forward pass's record and closes the step. It is not a gradient and not the
next state. A Flax loop that puts the whole `variables` dict in a `TrainState`
and takes `jax.grad` over it would hand that cotangent to the optimizer, and
AdamW would then "train" the FP8 state (weight decay and momentum on scales and
histories) without any error.

fp8jax does not follow Flax's overwrite-with-gradient convention (where the
cotangent is the next state): JAX sums the cotangents of a value used more than
once, so a state shared by several uses (tied embeddings, a meta carried
through `nn.scan`, both of which fp8jax combines by max) would come back as a
sum of states, silently wrong. Instead the Flax layers read their state through
`guard_fp8_state`: differentiating it outside `differentiating_fp8_state` (which
`fp8jax.value_and_grad` and `fp8jax.accumulate_gradients` enter) fails when JAX
traces the backward pass, with an error that says what to do. Evaluation,
gradients with respect to the parameters only, and fp8jax's own steps are
unaffected: the check runs only when the state itself is differentiated.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools

import jax

_ACTIVE = contextvars.ContextVar("fp8jax_differentiating_fp8_state", default=False)

NNX_FIX = (
    "Differentiate only the parameters: split the model with `graphdef, params, fp8_state = "
    "nnx.split(model, nnx.Param, Fp8MetaVariable)` and step with "
    "`loss, grads, fp8_state = fp8jax.value_and_grad(loss_fn)(params, fp8_state, batch)` "
    "(see fp8jax.flax.nnx), or keep nnx.grad's default wrt=nnx.Param; "
    "nnx.Optimizer(model, tx, wrt=nnx.Param) never touches FP8 state.")

FIX = (
    "Differentiate only the parameters and keep the FP8 state beside them: "
    "fp8jax.flax.TrainState.create(apply_fn=..., variables=variables, tx=...) holds "
    "params, opt_state and fp8_state, and a step "
    "`loss, grads, fp8_state = fp8jax.value_and_grad(loss_fn)(state.params, "
    "state.fp8_state, batch)` followed by "
    "`state.apply_gradients(grads=grads, fp8_state=fp8_state)` returns the next FP8 "
    "state. (To write your own step with fp8jax.begin_step / merge_step / close_step, "
    "differentiate inside `with fp8jax.differentiating_fp8_state():`.)")


class Fp8StateGradientError(TypeError):
  """Gradients were taken with respect to FP8 state outside an fp8jax step."""


@contextlib.contextmanager
def differentiating_fp8_state():
  """Declares that FP8 state differentiated in this block is consumed as fp8jax's step record.

  `fp8jax.value_and_grad` and `fp8jax.accumulate_gradients` enter it around
  their differentiation; enter it yourself only for a hand-written step that
  passes the state's cotangent to `fp8jax.merge_step` / `close_step`. It acts
  while JAX traces (the check is static), so wrap the `jax.grad` call itself,
  and with `jax.vjp` both the forward call and the call of the pullback.
  """
  token = _ACTIVE.set(True)
  try:
    yield
  finally:
    _ACTIVE.reset(token)


def guard_fp8_state(state, where: str, fix: str = FIX):
  """`state` unchanged; differentiating it outside `differentiating_fp8_state` raises.

  Args:
    state: a pytree of FP8 state (a layer's `DotMeta` or `AttentionMeta`).
    where: the state's place for the error message, e.g. "'fp8_meta' of Dense_0".
    fix: what to do instead, for the error message (the linen loop by default).

  Returns:
    `state`. Under differentiation, its backward pass passes the cotangent on
    inside fp8jax's steps and raises `Fp8StateGradientError` anywhere else.
  """
  return _guarded((where, fix), state)


def detach_outside_step(new_state):
  """`new_state` as a layer stores it: outside fp8jax's steps, with no derivative.

  A layer called twice in one forward pass reads, the second time, the state its
  first call stored; that state depends on the parameters through the FP8 op, so
  `jax.grad` over the parameters alone would differentiate it and trip the guard.
  Outside `differentiating_fp8_state` nothing consumes that derivative, so the
  stored state is cut from it; inside, it carries the backward pass's record.
  """
  return new_state if _ACTIVE.get() else jax.lax.stop_gradient(new_state)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _guarded(where, state):
  return state


def _guarded_fwd(where, state):
  return state, None


def _guarded_bwd(where_and_fix, _, cotangent):
  where, fix = where_and_fix
  if not _ACTIVE.get():
    raise Fp8StateGradientError(
        f"Gradients were requested for the FP8 state {where}. FP8 state is not a "
        "parameter: its cotangent is fp8jax's record of the backward pass, not a gradient "
        "and not the next state (fp8jax does not follow Flax's _overwrite_with_gradient "
        "convention), so an optimizer given it would corrupt the scales and histories. "
        + fix)
  return (cotangent,)


_guarded.defvjp(_guarded_fwd, _guarded_bwd)
