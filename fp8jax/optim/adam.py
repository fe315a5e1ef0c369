"""Adam and AdamW whose moments are stored in FP8: `scale_by_adam_fp8`, `adam`, `adamw`.

The update is optax's `scale_by_adam`, computed in float32 from the moments decoded for
this step; the step's update uses the new moments before they are stored, so storage
error enters the next step only (as COAT, MS-AMP and torchao do). Both moments of every
leaf with at least `MomentStorage.min_size` elements and two or more dimensions are stored
as `fp8jax.optim.Fp8Moment` (about 1.06 bytes per element instead of 4: see
`fp8jax.optim.moment_codec`); smaller leaves (norm gains, biases) stay float32. On a GPU
a stored leaf's step is one kernel (`fp8jax.optim.fused_adam`), its numbers this form's
to float32 rounding.

`adamw` is `optax.adamw`'s chain with this transformation in place of `scale_by_adam`,
so it composes with `optax.chain`, `optax.inject_hyperparams` (the storage options are one
frozen dataclass, which stays static) and `optax.MultiSteps`, and its state is a pytree of
arrays that `fp8jax.checkpoint` saves bit for bit.
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax
from optax._src import numerics

from pallas_kernels.adam_fp8 import AdamHyper, adam_constants
from fp8jax.optim import apply, fused_adam
from fp8jax.optim.moment_codec import Fp8Moment, decode, encode

_ROUNDINGS = ("stochastic", "nearest")


@dataclasses.dataclass(frozen=True)
class MomentStorage:
  """How Adam's moments are stored (a static, hashable configuration).

  Attributes:
    block: elements per block along each leaf's last axis (one expansion per block). Any
      sharding of that axis works: where a device holds less than a block (or a share
      that is not a multiple of one) on an explicit mesh, the blocks' extremes are
      gathered (a `gcd(share, block)`-th of the leaf) and the stored moments stay those
      of one device.
    k_max: the largest expansion exponent (see `fp8jax.optim.moment_codec`).
    second_moment_rounding: "stochastic" (default; unbiased, see the codec's docstring for
      why round-to-nearest stalls v at b2 = 0.999) or "nearest".
    seed: the seed of the stochastic rounding's bits (with the step count and the leaf).
    min_size: leaves with fewer elements, or fewer than two dimensions, stay float32.
  """

  block: int = 128
  k_max: float = 8.0
  second_moment_rounding: str = "stochastic"
  seed: int = 0
  min_size: int = 4096

  def __post_init__(self):
    for name in ("block", "min_size", "seed"):
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or value < (name != "seed"):
        raise ValueError(f"MomentStorage.{name}={value!r} must be a positive int.")
    if not 1.0 <= float(self.k_max) <= 64.0:
      raise ValueError(f"MomentStorage.k_max={self.k_max!r} must be in [1, 64].")
    if self.second_moment_rounding not in _ROUNDINGS:
      raise ValueError(f"MomentStorage.second_moment_rounding="
                       f"{self.second_moment_rounding!r} must be one of {_ROUNDINGS}.")

  def stores(self, leaf) -> bool:
    """Whether a leaf of this shape is stored in FP8 (else float32)."""
    return jnp.ndim(leaf) >= 2 and jnp.size(leaf) >= self.min_size


class ScaleByAdamFp8State(NamedTuple):
  """Like optax's `ScaleByAdamState`; `mu` and `nu` leaves are `Fp8Moment`s or float32."""

  count: jax.Array
  mu: Any
  nu: Any


def _as_moment(stored, where: str) -> Fp8Moment:
  """A stored moment as an `Fp8Moment`.

  Containers of optimizer state may hand it back in nodes of their own: Flax's
  `nnx.Optimizer` stores the state returned by each update through `nnx.state`, which turns
  every `Fp8Moment` into a `State` mapping its field names to its arrays. Which leaves are
  stored in FP8 follows from their shapes (`MomentStorage.stores`), not from this class.
  """
  if isinstance(stored, Fp8Moment):
    return stored
  if isinstance(stored, Mapping) and set(stored) == set(Fp8Moment._fields):
    return Fp8Moment(**{field: stored[field] for field in Fp8Moment._fields})
  raise TypeError(
      f"The optimizer state's moment at {where} should be an fp8jax.optim.Fp8Moment (or a "
      f"mapping of its fields {Fp8Moment._fields}), got {type(stored).__name__}: pass the "
      "state this optimizer's init or update returned, made with the same MomentStorage.")


def _refuse_mu_dtype(mu_dtype) -> None:
  if mu_dtype is not None:
    raise ValueError(
        f"mu_dtype={mu_dtype!r}: fp8jax.optim stores the first moment of each large leaf in "
        "FP8 and of the others in float32, whatever mu_dtype says; leave it None and set "
        "the storage with MomentStorage, or use optax's optimizer for a mu_dtype of yours.")


def scale_by_adam_fp8(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
                      eps_root: float = 0.0, mu_dtype: None = None, *,
                      nesterov: bool = False,
                      storage: MomentStorage = MomentStorage()) -> optax.GradientTransformation:
  """`optax.scale_by_adam` with both moments stored in FP8 (`MomentStorage`).

  Args:
    b1, b2, eps, eps_root, nesterov: as for `optax.scale_by_adam` (same order).
    mu_dtype: must be None (the moments' storage is `storage`'s); any other value raises.
    storage: how the moments are stored.

  Returns:
    An `optax.GradientTransformation` whose state is a `ScaleByAdamFp8State`; the updates
    have the gradients' shapes and dtypes.
  """
  return _adam_fp8(b1, b2, eps, eps_root, mu_dtype, nesterov, storage)[0]


def _adam_fp8(b1, b2, eps, eps_root, mu_dtype, nesterov, storage
              ) -> tuple[optax.GradientTransformation, Callable]:
  """(`scale_by_adam_fp8`'s transformation, its `steps(grads, state, applied)`, which
  also apply the step to the parameters given `_Applied`)."""
  _refuse_mu_dtype(mu_dtype)
  if not isinstance(storage, MomentStorage):
    raise TypeError(f"storage must be a fp8jax.optim.MomentStorage, got {storage!r}.")

  def store(moment, like, rounding_key):
    if not storage.stores(like):
      return moment.astype(jnp.float32)
    return encode(moment, block=storage.block, k_max=storage.k_max, key=rounding_key)

  def load(stored, like, where):
    if not storage.stores(like):
      return stored
    return decode(_as_moment(stored, where), block=storage.block)

  def init_fn(params):
    # zeros_like: on an explicit mesh the moments take their parameter's sharding.
    zeros = lambda p: store(jnp.zeros_like(p, jnp.float32), p, None)
    return ScaleByAdamFp8State(count=jnp.zeros([], jnp.int32), mu=jax.tree.map(zeros, params),
                               nu=jax.tree.map(zeros, params))

  hyper = AdamHyper(k_max=float(storage.k_max),
                    stochastic=storage.second_moment_rounding == "stochastic")

  def steps(updates, state, applied: _Applied | None):
    """Each leaf's update (or, `applied`, its new parameter) and the new state."""
    count_inc = numerics.safe_increment(state.count)
    paths_and_leaves, treedef = jax.tree_util.tree_flatten_with_path(updates)
    paths = [jax.tree_util.keystr(path) for path, _ in paths_and_leaves]
    leaves = [leaf for _, leaf in paths_and_leaves]
    mu_leaves = treedef.flatten_up_to(state.mu)
    nu_leaves = treedef.flatten_up_to(state.nu)
    param_leaves = treedef.flatten_up_to(applied.params) if applied else [None] * len(leaves)
    step_key = jax.random.fold_in(jax.random.key(storage.seed), count_inc)
    constants = adam_constants(b1, b2, eps, eps_root, _bias_correction(b1, count_inc),
                               _bias_correction(b2, count_inc))
    new_firsts, new_mu, new_nu = [], [], []
    for index, (g, mu_stored, nu_stored, p) in enumerate(
        zip(leaves, mu_leaves, nu_leaves, param_leaves)):
      rounding_key = jax.random.fold_in(step_key, index) if hyper.stochastic else None

      def jnp_step(g, mu_stored, nu_stored, where=paths[index], rounding_key=rounding_key):
        g32 = g.astype(jnp.float32)
        # optax's order of operations, so that float32 leaves match optax bit for bit.
        mu = (1 - b1) * g32 + b1 * load(mu_stored, g, f"mu{where}")
        nu = (1 - b2) * (g32 ** 2) + b2 * load(nu_stored, g, f"nu{where}")
        mu_hat = _bias_corrected(mu, b1, count_inc)
        if nesterov:
          mu_hat = (b1 * _bias_corrected(mu, b1, numerics.safe_increment(count_inc))
                    + (1.0 - b1) * _bias_corrected(g32, b1, count_inc))
        nu_hat = _bias_corrected(nu, b2, count_inc)
        update = (mu_hat / (jnp.sqrt(nu_hat + eps_root) + eps)).astype(g.dtype)
        return update, store(mu, g, None), store(nu, g, rounding_key)

      in_kernel = storage.stores(g) and fused_adam.fits_the_kernel(g, storage.block, nesterov)
      moments = ((_as_moment(mu_stored, f"mu{paths[index]}"),
                  _as_moment(nu_stored, f"nu{paths[index]}")) if in_kernel else ())

      def kernel_step(g, mu_stored, nu_stored):
        # One kernel on a GPU (`fp8jax.optim.fused_adam`): jnp_step's numbers to float32
        # rounding.
        del mu_stored, nu_stored  # as `moments`
        return fused_adam.adam_step(g, *moments, constants, rounding_key, hyper,
                                    reference=jnp_step)

      adam_step = kernel_step if in_kernel else jnp_step
      if applied is None:
        step = adam_step(g, mu_stored, nu_stored)
      elif in_kernel and _kernel_applies_to(g, p):
        # The kernel clips g, steps the moments and writes the new parameter.
        numbers = (applied.step_size, applied.decays[index], applied.grad_norm,
                   applied.max_grad_norm)
        step = fused_adam.adam_step(
            g, *moments, constants, rounding_key, hyper,
            reference=functools.partial(_clipped_stepped_applied, jnp_step, p, applied,
                                        applied.decays[index]),
            applied_to=(p, jnp.stack([jnp.asarray(n, jnp.float32) for n in numbers])))
      else:
        step = _clipped_stepped_applied(adam_step, p, applied, applied.decays[index], g,
                                        mu_stored, nu_stored)
      for out, value in zip((new_firsts, new_mu, new_nu), step):
        out.append(value)
    unflatten = lambda xs: jax.tree.unflatten(treedef, xs)
    return unflatten(new_firsts), ScaleByAdamFp8State(count=count_inc, mu=unflatten(new_mu),
                                                      nu=unflatten(new_nu))

  def update_fn(updates, state, params=None):
    del params
    return steps(updates, state, applied=None)

  return optax.GradientTransformation(init_fn, update_fn), steps


def _bias_correction(decay: float, count: jax.Array) -> jax.Array:
  """1 - decay**count in float32 (optax's)."""
  return (1 - decay ** count).astype(jnp.float32)


def _bias_corrected(moment, decay, count):
  return moment / _bias_correction(decay, count).astype(moment.dtype)


class _Applied(NamedTuple):
  """What applying the step to the parameters needs: the parameters, optax's step size
  (minus the learning rate, float32[]), each leaf's weight decay in the order of the
  tree's leaves (0.0 where none is added), and the clipping: the gradient's global norm
  (float32[]) and the norm it is clipped to (inf: none)."""

  params: Any
  step_size: jax.Array
  decays: tuple[float, ...]
  grad_norm: jax.Array
  max_grad_norm: float


def _clipped_stepped_applied(adam_step, p, applied: _Applied, decay: float, g, mu_stored,
                             nu_stored):
  """A leaf through optax's clip_by_global_norm, `adam_step`, then add_decayed_weights,
  scale_by_learning_rate and apply_updates, in their order: (the new parameter, mu, nu)."""
  if applied.max_grad_norm != float("inf"):
    g = jax.lax.select(applied.grad_norm < applied.max_grad_norm, g,
                       (g / applied.grad_norm.astype(g.dtype)) * applied.max_grad_norm)
  update, mu, nu = adam_step(g, mu_stored, nu_stored)
  if decay != 0:  # optax adds no decay of 0 (nor to a leaf its mask leaves out)
    update = update + decay * p
  update = jnp.array(applied.step_size, dtype=update.dtype) * update
  return jnp.asarray(p + update).astype(jnp.asarray(p).dtype), mu, nu


def _kernel_applies_to(g, p) -> bool:
  """Whether the kernel may write the new parameter: float32 gradient and parameter of one
  shape (other dtypes round between optax's steps, which the kernel does not)."""
  f32 = jnp.dtype(jnp.float32)
  return (jnp.shape(p) == jnp.shape(g) and jnp.dtype(g.dtype) == f32
          and jnp.dtype(p.dtype) == f32)


def adam(learning_rate: float | Callable, b1: float = 0.9, b2: float = 0.999,
         eps: float = 1e-8, eps_root: float = 0.0, mu_dtype: None = None, *,
         nesterov: bool = False,
         storage: MomentStorage = MomentStorage()) -> optax.GradientTransformation:
  """`optax.adam` with FP8 moments: `chain(scale_by_adam_fp8, scale_by_learning_rate)`.

  Args:
    learning_rate, b1, b2, eps, eps_root, nesterov: as for `optax.adam` (same order).
    mu_dtype: must be None (the moments' storage is `storage`'s); any other value raises.
    storage: how the moments are stored (`MomentStorage`).

  Returns:
    An `optax.GradientTransformation`.
  """
  return optax.chain(
      scale_by_adam_fp8(b1, b2, eps, eps_root, mu_dtype, nesterov=nesterov, storage=storage),
      optax.scale_by_learning_rate(learning_rate))


def adamw(learning_rate: float | Callable, b1: float = 0.9, b2: float = 0.999,
          eps: float = 1e-8, eps_root: float = 0.0, mu_dtype: None = None,
          weight_decay: float = 1e-4, mask: Any = None, *, nesterov: bool = False,
          storage: MomentStorage = MomentStorage(),
          max_grad_norm: float | None = None) -> optax.GradientTransformation:
  """`optax.adamw` with FP8 moments: the same parameters in the same order.

  Args:
    learning_rate, b1, b2, eps, eps_root, weight_decay, mask, nesterov: as for
      `optax.adamw`, so `adamw(1e-3, 0.9, 0.95, 1e-8, 0.0, None, 0.1)` binds as there.
    mu_dtype: must be None (the moments' storage is `storage`'s); any other value raises.
    storage: how the moments are stored (`MomentStorage`).
    max_grad_norm: None, or the gradient is first clipped to this global norm:
      `chain(optax.clip_by_global_norm(max_grad_norm), adamw(...))`, the same state.

  Returns:
    An `optax.GradientTransformation`:
    `chain(scale_by_adam_fp8, add_decayed_weights, scale_by_learning_rate)`, after the
    clipping if asked for. `fp8jax.optim.update_and_apply` steps it with the parameters
    written by the same kernel as the moments (on a GPU: 8 bytes a float32 parameter
    fewer than `tx.update` then `optax.apply_updates`).
  """
  # optax.inject_hyperparams hands numbers in as arrays, whose value is not checked here.
  if max_grad_norm is not None and not isinstance(max_grad_norm, jax.Array) and not (
      _is_number(max_grad_norm) and max_grad_norm > 0):
    raise ValueError(f"max_grad_norm={max_grad_norm!r} must be a positive number (the "
                     "global norm the gradient is clipped to) or None (no clipping).")
  adam_tx, adam_steps = _adam_fp8(b1, b2, eps, eps_root, mu_dtype, nesterov, storage)
  lr_tx = optax.scale_by_learning_rate(learning_rate)
  tx = optax.chain(adam_tx, optax.add_decayed_weights(weight_decay, mask), lr_tx)
  clip_tx = None
  if max_grad_norm is not None:
    clip_tx = optax.clip_by_global_norm(max_grad_norm)
    tx = optax.chain(clip_tx, tx)

  def fused(grads, state, params):
    """tx's step applied to `params` by the moments' kernel: (new params, new state).
    The clipping happens in the kernel too: XLA then writes the float32 gradient in the
    pass that reduces its norm, not in a pass of its own."""
    clip_state = None
    if clip_tx is not None:
      clip_state, state = state  # clip_by_global_norm keeps no state
    # The norm as optax.clip_by_global_norm takes it (optax.tree.norm since optax 0.2.7).
    grad_norm = optax.tree.norm(grads) if clip_tx is not None else jnp.zeros((), jnp.float32)
    adam_state, decay_state, lr_state = state
    # optax's step size, minus the learning rate of this update (as scale_by_schedule
    # multiplies it in): the learning-rate transformation applied to a one.
    step_size, lr_state = lr_tx.update(jnp.ones((), jnp.float32), lr_state)
    applied = _Applied(params, step_size, _weight_decays(weight_decay, mask, grads),
                       grad_norm, float("inf") if clip_tx is None else float(max_grad_norm))
    new_params, adam_state = adam_steps(grads, adam_state, applied)
    state = (adam_state, decay_state, lr_state)  # a constant decay keeps no state
    return new_params, (state if clip_tx is None else (clip_state, state))

  # The fused step knows a constant weight decay and clipping norm (a schedule of the
  # decay, or numbers made arrays by optax.inject_hyperparams, take tx.update's path).
  if _is_number(weight_decay) and (max_grad_norm is None or _is_number(max_grad_norm)):
    apply.register_fused(tx, fused)
  return tx


def _is_number(value) -> bool:
  return isinstance(value, (int, float)) and not isinstance(value, bool)


def _weight_decays(weight_decay: float, mask, grads) -> tuple:
  """Each leaf's weight decay in `grads`' leaf order: 0.0 where
  `optax.add_decayed_weights(weight_decay, mask)` adds none (a leaf the mask leaves out,
  which optax.masked evaluates on the updates)."""
  leaves = jax.tree.leaves(grads)
  if mask is None:
    return (weight_decay,) * len(leaves)
  mask_tree = mask(grads) if callable(mask) else mask
  # A mask may be a prefix of the gradients' tree: each of its flags covers a subtree.
  # (One that is neither was refused by `tx.init`, as optax.masked's init reads it too.)
  flags = jax.tree.leaves(jax.tree.map(
      lambda flag, sub: jax.tree.map(lambda _: flag, sub), mask_tree, grads))
  return tuple(weight_decay if flag else 0.0 for flag in flags)
