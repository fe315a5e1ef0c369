"""FP8 state that cannot silently go wrong: misuses a new user makes, refused or made right.

* one state given to two FP8 ops without threading it (the first op's amaxes
  would be lost): `UnthreadedStateError`; separate traces (`lax.cond`
  branches) and threaded use stay allowed;
* an `Fp8Model` (linen, by interception) vmapped over examples records the
  folded batch's amaxes (test_vmap_state.py has the functional ops);
* fp8jax layers under `nn.scan` / `nn.vmap` without "fp8_meta" in
  `variable_axes`: fp8jax's error naming the collection and the fix;
* an overflowing step is reported (`report_overflow=True`), though FP8
  saturation keeps its gradients finite.
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp8jax
from fp8jax.flax import Fp8Model
from fp8jax.flax.linen import Fp8Dense
from fp8jax.ops.guards import UnthreadedStateError

DELAYED = fp8jax.DelayedScaling()


def _arrays(*shapes_and_gains):
  keys = jax.random.split(jax.random.key(0), len(shapes_and_gains))
  return [jax.random.normal(key, shape, jnp.float32) * gain
          for key, (shape, gain) in zip(keys, shapes_and_gains)]


def test_one_state_given_to_two_ops_without_threading_is_refused():
  x1, x2, kernel = _arrays(((8, 16), 20.0), ((8, 16), 2.0), ((16, 16), 0.25))
  meta = fp8jax.init_dot_meta(DELAYED)

  def reused(kernel, meta):
    y1, _ = fp8jax.fp8_dense(x1, kernel, None, meta)
    y2, meta = fp8jax.fp8_dense(x2, kernel, None, meta)  # x1's amax (20x larger) dropped
    return jnp.sum(y1) + jnp.sum(y2), meta

  with pytest.raises(UnthreadedStateError, match="already read in this step"):
    fp8jax.value_and_grad(reused)(kernel, meta)

  def threaded(kernel, meta):
    y1, meta = fp8jax.fp8_dense(x1, kernel, None, meta)
    y2, meta = fp8jax.fp8_dense(x2, kernel, None, meta)
    return jnp.sum(y1) + jnp.sum(y2), meta

  _, _, state = jax.jit(fp8jax.value_and_grad(threaded))(kernel, meta)
  # The threaded state saw both inputs: the larger amax is x1's.
  assert float(state.x.amax_history[0]) == float(jnp.max(jnp.abs(x1)))


def test_the_two_branches_of_a_cond_may_read_the_same_state():
  x, kernel = _arrays(((8, 16), 3.0), ((16, 16), 0.25))
  meta = fp8jax.init_dot_meta(DELAYED)

  def branches(kernel, meta, take_first):
    y, meta = jax.lax.cond(take_first, lambda: fp8jax.fp8_dense(x, kernel, None, meta),
                           lambda: fp8jax.fp8_dense(2 * x, kernel, None, meta))
    return jnp.sum(y), meta

  step = jax.jit(fp8jax.value_and_grad(branches))
  for take_first, gain in ((True, 1), (False, 2)):
    _, _, state = step(kernel, meta, take_first)
    assert float(state.x.amax_history[0]) == float(jnp.max(jnp.abs(gain * x)))


def test_vmapped_fp8_model_records_the_folded_batch_state():
  batch = 8
  x, = _arrays(((batch, 4, 32), 3.0))
  x = x * jnp.linspace(0.5, 4.0, batch)[:, None, None]
  model = Fp8Model(nn.Dense(16), layer_filter=lambda layer: True)
  variables = model.init(jax.random.key(1), x[0])

  def loss(params, state, x, apply):
    y, updates = apply({"params": params, "fp8_meta": state}, x)
    return jnp.sum(y ** 2), updates["fp8_meta"]

  def one_call(variables, x):
    return model.apply(variables, x, mutable=["fp8_meta"])

  def vmapped(variables, x):
    return jax.vmap(one_call, in_axes=(None, 0), out_axes=(0, None))(variables, x)

  folded = lambda p, s, x: loss(p, s, x.reshape(-1, 32), one_call)
  by_example = lambda p, s, x: loss(p, s, x, vmapped)
  params, state = variables["params"], variables["fp8_meta"]
  _, _, want = jax.jit(fp8jax.value_and_grad(folded))(params, state, x)
  _, _, got = jax.jit(fp8jax.value_and_grad(by_example))(params, state, x)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


class _Block(nn.Module):
  @nn.compact
  def __call__(self, x, _):
    return Fp8Dense(16, recipe=DELAYED)(x), None


class _ScannedWithoutState(nn.Module):
  @nn.compact
  def __call__(self, x):
    blocks = nn.scan(_Block, variable_axes={"params": 0}, split_rngs={"params": True},
                     length=3)
    return blocks()(x, None)[0]


class _VmappedWithoutState(nn.Module):
  @nn.compact
  def __call__(self, x):
    dense = nn.vmap(Fp8Dense, variable_axes={"params": 0}, split_rngs={"params": True})
    return dense(16, recipe=DELAYED)(x)


@pytest.mark.parametrize("model, shape", [(_ScannedWithoutState(), (4, 16)),
                                          (_VmappedWithoutState(), (3, 4, 16))],
                         ids=["nn.scan", "nn.vmap"])
def test_lifted_transform_without_the_fp8_collection_names_the_fix(model, shape):
  with pytest.raises(ValueError, match=r"add 'fp8_meta' to its variable_axes"):
    model.init(jax.random.key(0), jnp.ones(shape))


def test_overflowing_step_is_reported_though_its_gradients_are_finite():
  x, kernel = _arrays(((8, 16), 1.0), ((16, 16), 0.25))
  meta = fp8jax.init_dot_meta(DELAYED)

  def loss(kernel, meta, weight):
    y, meta = fp8jax.fp8_dense(x, kernel, None, meta)
    return jnp.sum(y * weight), meta  # dL/dy = weight

  step = jax.jit(fp8jax.value_and_grad(loss, report_overflow=True))
  _, grads, _, overflow = step(kernel, meta, jnp.float32(1.0))
  assert not bool(overflow)
  _, grads, state, overflow = step(kernel, meta, jnp.float32(jnp.inf))
  assert bool(overflow)
  # What fp16 loss scaling and optax.apply_if_finite look at: finite (E5M2 saturates).
  assert bool(jnp.all(jnp.isfinite(grads)))
  # The state records no observation for the overflowing role and keeps its scale.
  assert float(state.grad.amax_history[0]) == 0.0
  assert float(state.grad.scale) == float(meta.grad.scale)
