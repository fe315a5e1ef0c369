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

On a device mesh: under plain `jax.jit` with sharded arrays nothing changes.
Inside `jax.shard_map` the in-step state is reduced by max over the devices
before the step closes (see `fp8jax.step.all_reduce`); with `check_vma=False` or
`pmap`, say over which axes with `axis_name` (a step traced per device without
it warns: its state would keep one device's amaxes).
"""
from __future__ import annotations

from typing import Any, Callable

import dataclasses

import jax
import jax.numpy as jnp

from fp8jax.core.calibration import calibrated, calibrating
from fp8jax.core.meta import check_fp8_state, is_meta
from fp8jax.mesh.axes import AxisName, normalize_axis_name, vary_like, varying_axes
from fp8jax.ops import weight_reuse
from fp8jax.ops.guards import checking_threading, differentiating_fp8_state
from fp8jax.step.all_reduce import all_reduce_amax, warn_if_amaxes_stay_local
from fp8jax.step.close import begin_step, close_step, end_step, merge_step


def value_and_grad(loss_fn: Callable, has_aux: bool = False,
                   axis_name: AxisName = None, report_overflow: bool = False) -> Callable:
  """Wraps `loss_fn` to return `(loss, param_grads, next_fp8_state)`.

  Donate the FP8 state to the jitted step (`jax.jit(..., donate_argnums=...)`): the
  state update writes the next state over the one given (`fp8jax.close_step`'s
  `written_over`), in place when donated; a step that does not donate it copies each
  stacked meta's arrays (a few float32 numbers per layer) before the update.

  Args:
    loss_fn: `(params, fp8_state, *args) -> (loss, new_fp8_state)`, or with
      `has_aux=True`, `-> ((loss, aux), new_fp8_state)`.
    has_aux: whether the loss comes with auxiliary data.
    axis_name: for use inside `jax.shard_map(..., check_vma=False)` or `pmap`:
      the mesh axis name (or tuple of names) over whose devices the recorded
      amaxes are combined by max before the step closes. Not needed under plain
      `jit` nor inside `shard_map` with `check_vma=True` (the default), where
      fp8jax reduces over every axis along which the state became device-varying.
      Per-device code over manual axes it does not name warns when traced: the
      state would keep one device's amaxes.
      Gradients are not reduced: that stays the caller's choice (note that with
      `check_vma=True` JAX already sums the gradients of replicated parameters).
    report_overflow: also return `overflow`, a bool[] that is True when any amax
      this step recorded (a forward tensor's or an output gradient's) was inf or
      NaN. FP8 casts saturate, so an overflowing gradient reaches `grads` finite
      and `optax.apply_if_finite` or fp16 loss scaling cannot see it; skip the
      update when `overflow` is set. The FP8 state needs no undoing: a
      non-finite amax is recorded as 0 and keeps the scale (`fp8jax.end_step`).

  Returns:
    A function `(params, fp8_state, *args) -> (loss, grads, next_fp8_state)`,
    or `((loss, aux), grads, next_fp8_state)` with `has_aux=True`; with
    `report_overflow=True`, `(..., next_fp8_state, overflow)`. `grads` has
    the structure of `params`; `next_fp8_state` that of `fp8_state`.
  """
  _check_loss_fn(loss_fn)
  names = normalize_axis_name(axis_name)

  def wrapped(params, fp8_state, *args):
    check_fp8_state(fp8_state, "fp8_state")
    warn_if_amaxes_stay_local("fp8jax.value_and_grad", names, fp8_state)
    state = _open(fp8_state, (params, args))
    value, grads, (forward, cotangent) = _differentiate(loss_fn, has_aux, params, state, args)
    # The forward pass recorded x and kernel amaxes, the backward pass gradient
    # amaxes; the step's update takes their max itself (no kernel per role), and
    # writes the new state over the one given (which a train step donates).
    if axis_name is not None or varying_axes((forward, cotangent)):
      forward, cotangent = all_reduce_amax((forward, cotangent), axis_name)
    next_state = close_step(forward, cotangent, written_over=fp8_state)
    if report_overflow:
      return value, grads, next_state, _any_amax_not_finite((forward, cotangent))
    return value, grads, next_state

  return wrapped


def calibrate(loss_fn: Callable, has_aux: bool = False,
              axis_name: AxisName = None) -> Callable:
  """Wraps `loss_fn` to return FP8 state seeded from one forward and backward pass.

  Run it once on a training batch before the first step of a fresh delayed-scaling
  state (and again after `fp8jax.resize_history` or any change that leaves a history
  empty). A fresh state casts with scale 1, which flushes small gradients to zero
  (and every GEMM behind them) and rounds small activations coarsely, so its first
  steps would train on wrong gradients until the histories fill. Calibration runs the
  loss's forward and backward pass with every delayed role scaling from the tensor it
  casts (`fp8jax.core.calibration.Calibrating`), records each role's amax and closes
  the step as `value_and_grad` does: each history gets one entry and its next scale,
  the one the first training step then uses. Parameters are not touched and the
  gradients are not computed past what the amaxes need (under `jit` XLA drops the
  weight-gradient GEMMs). Roles whose recipe scales from the tensor anyway (current,
  per-row, per-block) record an entry like any step. The train step's compiled
  program is unchanged: calibration is a program of its own, run once.

  Args:
    loss_fn: as for `value_and_grad` (the train step's own loss function).
    has_aux: whether the loss comes with auxiliary data.
    axis_name: as for `value_and_grad`.

  Returns:
    A function `(params, fp8_state, *args) -> calibrated_fp8_state`, structured like
    `fp8_state`.
  """
  step = value_and_grad(loss_fn, has_aux=has_aux, axis_name=axis_name)

  def wrapped(params, fp8_state, *args):
    _, _, seeded = step(params, calibrating(fp8_state), *args)
    return calibrated(seeded)

  return wrapped


def _any_amax_not_finite(states) -> jax.Array:
  amaxes = [meta.amax for meta in jax.tree.leaves(states, is_leaf=is_meta) if is_meta(meta)]
  if not amaxes:
    return jnp.zeros((), jnp.bool_)
  return jnp.any(jnp.stack([~jnp.all(jnp.isfinite(a)) for a in amaxes]))


def accumulate_gradients(loss_fn: Callable, params: Any, fp8_state: Any, microbatches: Any,
                         has_aux: bool = False, axis_name: AxisName = None):
  """Gradient accumulation over microbatches as one FP8 step.

  All microbatches use the step's scales; every role's recorded amax is the max
  over all microbatches (not a sum, not the last one), and the history advances
  by one entry. Each FP8 kernel (weight) is quantized once for the whole step
  and its FP8 copies serve every microbatch (`fp8jax.ops.weight_reuse`). Meant to
  run under `jax.jit`: the loss is traced once more outside the microbatch loop
  to quantize the kernels, and only `jit` compiles away the rest of that trace
  (called eagerly, it runs a forward pass more, and callbacks in the loss run
  once more).

  Args:
    loss_fn: as for `value_and_grad`.
    params: parameters.
    fp8_state: FP8 state at the start of the step.
    microbatches: pytree whose leaves have a leading axis of n microbatches.
    has_aux: whether `loss_fn` returns `(loss, aux)`.
    axis_name: as for `value_and_grad`.

  Returns:
    (mean loss, mean grads, next_fp8_state); with `has_aux`, `((mean loss, stacked aux),
    mean grads, next_fp8_state)`.
  """
  _check_loss_fn(loss_fn)
  names = normalize_axis_name(axis_name)
  check_fp8_state(fp8_state, "fp8_state")
  warn_if_amaxes_stay_local("fp8jax.accumulate_gradients", names, fp8_state)
  leaves = jax.tree.leaves(microbatches)
  if not leaves or any(jnp.ndim(leaf) == 0 for leaf in leaves):
    raise ValueError(
        "microbatches must be a pytree of arrays with a leading microbatch axis, e.g. the "
        "batch reshaped to [n_microbatches, microbatch_size, ...]; got "
        f"{jax.tree.map(jnp.shape, microbatches)}.")
  sizes = {jnp.shape(leaf)[0] for leaf in leaves}
  if len(sizes) != 1:
    raise ValueError(
        "microbatches must be a pytree whose leaves share one leading (microbatch) axis; "
        f"got leading sizes {sorted(sizes)}.")
  n = sizes.pop()

  # Each FP8 kernel is quantized once, here, for every microbatch (fp8jax.ops.weight_reuse);
  # the rest of this forward pass is unused and compiled away under jit.
  state = _open(fp8_state, (params, microbatches))
  with weight_reuse.collecting() as kernels:
    loss_fn(params, state, jax.tree.map(lambda leaf: leaf[0], microbatches))

  def one_microbatch(carry, batch):
    # Only the running amaxes travel between microbatches; scales and histories
    # are the step's, so every microbatch quantizes with the same scales.
    grad_sum, amaxes = carry
    value, grads, (forward, cotangent) = _differentiate(
        loss_fn, has_aux, params, _with_amaxes(state, amaxes), (batch,), reuse=kernels)
    grad_sum = jax.tree.map(jnp.add, grad_sum, grads)
    return (grad_sum, _amaxes(merge_step(forward, cotangent))), value

  zeros = jax.tree.map(jnp.zeros_like, params)
  (grad_sum, amaxes), values = jax.lax.scan(one_microbatch, (zeros, _amaxes(state)),
                                            microbatches)
  state = _with_amaxes(state, amaxes)
  grads = jax.tree.map(lambda g: g / n, grad_sum)
  if has_aux:
    losses, aux = values
    value = (jnp.mean(losses), aux)
  else:
    value = jnp.mean(values)
  return value, grads, _close(state, axis_name, fp8_state)


def _amaxes(fp8_state):
  """The running amax of every meta (a tree shaped like the state, amaxes for metas)."""
  return jax.tree.map(lambda meta: meta.amax, fp8_state, is_leaf=is_meta)


def _with_amaxes(fp8_state, amaxes):
  return jax.tree.map(lambda meta, amax: dataclasses.replace(meta, amax=amax), fp8_state,
                      amaxes, is_leaf=is_meta)


def _open(fp8_state, inputs):
  # Inside shard_map the state will record device-local amaxes: type it as
  # device-varying along the inputs' axes from the start, so that the reduction
  # is one pmax at the end of the step (and scan carries keep their type).
  return vary_like(begin_step(fp8_state), varying_axes(inputs))


def _close(state, axis_name, written_over):
  if axis_name is not None or varying_axes(state):
    state = all_reduce_amax(state, axis_name)
  return end_step(state, written_over=written_over)


def _check_loss_fn(loss_fn) -> None:
  if not callable(loss_fn):
    raise TypeError(
        f"loss_fn must be a function (params, fp8_state, *args) -> (loss, new_fp8_state), "
        f"got {type(loss_fn).__name__}: {loss_fn!r}.")


def _differentiate(loss_fn, has_aux, params, state, args, reuse=None):
  """Forward + backward inside an open step.

  Returns (value, grads, (forward_state, state_cotangent)): what the forward and
  the backward pass recorded, to be merged by max.
  """

  def split_loss(p, s):
    with checking_threading():  # one op per state: see fp8jax.ops.guards
      if reuse is None:
        returned = loss_fn(p, s, *args)
      else:
        with weight_reuse.replaying(reuse):  # at the level the loss's ops are traced
          returned = loss_fn(p, s, *args)
    if not isinstance(returned, tuple) or len(returned) != 2:
      raise TypeError(
          "loss_fn must return (loss, new_fp8_state)" + (
              " with loss = (loss, aux) since has_aux=True" if has_aux else "") +
          f"; got {type(returned).__name__}. Return the FP8 state threaded through the "
          "FP8 ops as the second element.")
    value, new_state = returned
    if has_aux and (not isinstance(value, tuple) or len(value) != 2):
      raise TypeError(
          f"has_aux=True, so loss_fn must return ((loss, aux), new_fp8_state); its first "
          f"element is a {type(value).__name__}.")
    _check_same_structure(s, new_state)
    _check_same_shapes(s, new_state)
    loss = value[0] if has_aux else value
    return loss, (value, new_state)

  # A stochastic-rounding key (uint32, `Fp8Meta.rng`) in the state needs allow_int; it
  # gets a float0 cotangent, which closing the step ignores.
  with_keys = any(meta.rng is not None for meta in jax.tree.leaves(state, is_leaf=is_meta))
  with differentiating_fp8_state():  # the state's cotangent is the step's record here
    (_, (value, forward_state)), (grads, state_cotangent) = jax.value_and_grad(
        split_loss, argnums=(0, 1), has_aux=True, allow_int=with_keys)(params, state)
  return value, grads, (forward_state, state_cotangent)


def _check_same_shapes(given, returned) -> None:
  """The returned state's arrays must have the given state's shapes; a common extra
  leading axis means it came back batched (`jax.vmap` with its default out_axes=0)."""
  pairs = [(path, jnp.shape(a), jnp.shape(b)) for (path, a), b in
           zip(jax.tree_util.tree_leaves_with_path(given), jax.tree.leaves(returned))]
  wrong = [(path, a, b) for path, a, b in pairs if a != b]
  if not wrong:
    return
  path, want, got = wrong[0]
  where = jax.tree_util.keystr(path)
  if all(b[1:] == a and b[:1] == wrong[0][2][:1] for _, a, b in wrong):
    raise ValueError(
        f"loss_fn returned a new_fp8_state with an extra leading axis of size {got[0]} "
        f"(fp8_state{where}: given {want}, returned {got}): the state came back batched, "
        "e.g. from jax.vmap, whose default out_axes=0 gives every output a batch axis. "
        "Return it unbatched: jax.vmap(fn, ..., out_axes=(0, None)) for fn returning "
        "(per_example_loss, fp8_state). One FP8 state under vmap records the amax of the "
        "whole batch, as the unvmapped batch would.")
  raise ValueError(
      f"loss_fn returned a new_fp8_state whose arrays differ in shape from the fp8_state it "
      f"was given: fp8_state{where} was {want}, came back {got}. Return the state that came "
      "out of the FP8 ops.")


def _check_same_structure(given, returned) -> None:
  given_def, returned_def = jax.tree.structure(given), jax.tree.structure(returned)
  if given_def != returned_def:
    raise ValueError(
        "loss_fn returned a new_fp8_state whose tree structure differs from the fp8_state "
        f"it was given:\n  given:    {_short(given_def)}\n  returned: {_short(returned_def)}\n"
        "Return the state that came out of the FP8 ops, structured like the input (for Flax "
        "linen: pass variables['fp8_meta'] in and return updates['fp8_meta'] from "
        "apply(..., mutable=['fp8_meta'])).")


def _short(treedef, limit: int = 400) -> str:
  text = str(treedef)
  return text if len(text) <= limit else text[:limit] + " ..."
