"""Guards on how FP8 ops and their state are used: clear errors instead of silent loss.

* Threading (`check_threaded`, `UnthreadedStateError`): one read per state per step.
  Every FP8 op returns its state with this call's amaxes recorded, and that
  returned state is what the next op (or the loss function's return) must carry.
  Passing the *same* state to two ops keeps only one op's record: the other op's
  amaxes, and so its tensor's range, are silently lost (e.g. an x amax of 2.04
  recorded where the tensor reached 20.35). Inside `fp8jax.value_and_grad` (and
  `accumulate_gradients`) each op notes the amax arrays of the state it reads, per
  trace; reading one again in the same trace raises `UnthreadedStateError`. Reads
  in different traces (the branches of `lax.cond`, a scan body traced again) are
  separate uses, not a reuse.
* Forward mode (`reverse_mode_only`, `ForwardModeError`): an FP8 op's derivative
  is its custom backward pass: it quantizes the output gradient to FP8 with the
  op's gradient scale and records its amax in the FP8 state. Forward mode
  (`jax.jvp`, `jax.jacfwd`) has no such pass, and JAX's generic message for it
  ("can't apply forward-mode autodiff (jvp) to a custom_vjp function") does not
  say what to do instead. The translation happens where the op is traced: `jax.jvp(f)`
  or `jax.jacfwd(f)` of a function that calls the op. When the op was traced
  earlier into a program that forward mode then transforms (`jax.jvp(jax.jit(f))`,
  an op inside `lax.scan` / `nn.scan`), JAX raises its own TypeError, whose cause
  is the same.
* State split by shard_map (`refuse_split_state`): FP8 state is replicated; a
  history that arrives shorter than its recipe's by exactly the number of devices
  along some manual mesh axes was split by the `in_specs` given for it, and the
  error says so instead of suggesting `resize_history`.
* Who may differentiate FP8 state (`guard_fp8_state`, `Fp8StateGradientError`):
  fp8jax's step functions, not an optimizer.

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
import math

import jax
import jax.numpy as jnp

from fp8jax.core.meta import is_meta
from fp8jax.mesh.axes import describe_axes, manual_axes, splitting_axes

try:  # jax >= 0.4.36: identifies the trace an op is being traced in
  from jax.extend.core import get_opaque_trace_state as _trace_state
except ImportError:  # without it nothing is checked, and nothing is reused
  _trace_state = None


def current_trace():
  """A token of the trace being built (equal for the same trace), or None if unknown."""
  if _trace_state is None:
    return None
  try:
    return _trace_state()
  except Exception:  # an API that may change: the checks are a help, never a failure
    return None


# ----- Threading: one read per state per step ---------------------------------------------

_READS = contextvars.ContextVar("fp8jax_meta_reads", default=None)


class UnthreadedStateError(ValueError):
  """One FP8 state was given to two FP8 ops in a step; the first op's amaxes would be lost."""


@contextlib.contextmanager
def checking_threading():
  """Checks, while the enclosed code traces, that no FP8 state is read by two ops."""
  token = _READS.set([])
  try:
    yield
  finally:
    _READS.reset(token)


def check_threaded(meta, op: str, init: str = "fp8jax.init_dot_meta") -> None:
  """Notes that `op` reads `meta`; raises `UnthreadedStateError` if an op read it already.

  Only the functional ops are checked this way: Flax layers own their state and
  read it afresh on every call.

  Args:
    meta: the state an FP8 op was given (a `DotMeta`, `AttentionMeta`, ...).
    op: the op's name for the message, e.g. "fp8_dot_general".
    init: the function that makes such a state, for the message.
  """
  reads = _READS.get()
  trace = current_trace()
  if reads is None or trace is None:
    return
  for role in jax.tree.leaves(meta, is_leaf=is_meta):
    if not is_meta(role):
      continue
    # A list, compared by identity and trace equality (trace tokens are not hashable);
    # a step holds a few hundred reads at most.
    for amax, read_in, earlier_op in reads:
      if amax is role.amax and read_in == trace:
        raise UnthreadedStateError(
            f"{op} was given an FP8 state that {earlier_op} already read in this step. Each "
            "FP8 op returns the state with its amaxes recorded: pass that returned state to "
            f"the next op (y, meta = op(..., meta)), or give each op its own state ({init} "
            "per op). Reusing the same state keeps only one op's amaxes, so the other "
            "tensor's range is lost.")
    reads.append((role.amax, trace, op))


# ----- Forward mode ------------------------------------------------------------------------

FP8_BACKWARD = ("its backward pass quantizes the output gradient to FP8 and records its amax "
                "in the FP8 state")


class ForwardModeError(TypeError):
  """Forward-mode differentiation was applied to an FP8 op, which supports reverse mode only."""


@contextlib.contextmanager
def reverse_mode_only(op: str, high_precision_twin: str, why: str = FP8_BACKWARD):
  """Turns JAX's forward-mode error, raised while `op` is traced, into `ForwardModeError`.

  Args:
    op: the public op's name, e.g. "fp8jax.fp8_dot_general".
    high_precision_twin: what computes the same thing with plain JAX ops, for the message.
    why: what the op's own backward pass does that forward mode cannot.
  """
  try:
    yield
  except TypeError as error:
    if "forward-mode autodiff" not in str(error):
      raise
    raise ForwardModeError(
        f"{op} supports reverse-mode differentiation only (jax.grad, jax.vjp, "
        f"jax.jacrev, fp8jax.value_and_grad): {why}, which forward mode "
        "(jax.jvp, jax.jacfwd) cannot do. Use jax.jacrev for "
        f"Jacobians, or for forward-mode derivatives evaluate {high_precision_twin} on the "
        "same arrays.") from None


# ----- State that shard_map split over devices ---------------------------------------------


def refuse_split_state(fp8_state, argname: str) -> None:
  """Raises ValueError when an amax history of `fp8_state` was split over devices.

  Inside `jax.shard_map` an `in_specs` entry that splits the FP8 state gives each
  device a slice of every history: shorter than its recipe's by exactly the
  device count of some manual mesh axes. Other wrong shapes are left to the
  state's own checks (`fp8jax.core.meta.check_shapes`), which name the fix for them.
  """
  for path, meta in jax.tree_util.tree_leaves_with_path(fp8_state, is_leaf=is_meta):
    if not is_meta(meta):
      continue
    shape = jnp.shape(meta.amax_history)
    if not shape or shape[:-1] != jnp.shape(meta.scale):
      continue
    full = meta.recipe.history_len
    axes = splitting_axes(int(shape[-1]), full)
    if not axes:
      continue
    devices = math.prod(manual_axes()[name] for name in axes)
    raise ValueError(
        f"{argname}{jax.tree_util.keystr(path)}.amax_history has shape {tuple(shape)} on each "
        f"device, but its recipe {meta.recipe} keeps {full} entries: the history was split "
        f"over {describe_axes(axes)} ({devices} devices) of the shard_map this runs in, so "
        f"each device holds 1/{devices} of it. FP8 state must be replicated: give it "
        "in_specs P() (and out_specs P()) in jax.shard_map, e.g. in_specs=(param_specs, P(), "
        "P('data')) for (params, fp8_state, batch); fp8jax makes the recorded amaxes global "
        "itself.")


# ----- Who may differentiate FP8 state ------------------------------------------------------

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
