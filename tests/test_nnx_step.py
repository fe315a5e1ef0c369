"""`fp8jax.flax.nnx_value_and_grad`: an nnx train step with FP8 layers, dropout and
batch statistics, updated in place under `nnx.jit` as `nnx.value_and_grad` does.

The hand-written loop of `fp8jax.flax.nnx` (params and FP8 state split out,
merged inside the loss) cannot carry the rng counts and batch statistics (nnx
refuses the split, or, given `...`, raises a TraceContextError when the merged
model writes them). Checked against independent numbers: the
BatchNorm's running mean after one step is the momentum update of the batch
mean computed here in numpy; the FP8 state's newest x amax is max|x| of the
layer's input; the dropout mask changes between steps (its rng advanced).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import fp8jax
from fp8jax.flax import nnx_value_and_grad
from fp8jax.flax.nnx import Fp8Linear

MOMENTUM = 0.9


class _Net(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.norm = nnx.BatchNorm(16, momentum=MOMENTUM, rngs=rngs)
    self.up = Fp8Linear(16, 32, recipe=fp8jax.DelayedScaling(), rngs=rngs)
    self.drop = nnx.Dropout(0.5, rngs=rngs)
    self.down = Fp8Linear(32, 4, recipe=fp8jax.DelayedScaling(), rngs=rngs)

  def __call__(self, x):
    return self.down(self.drop(nnx.relu(self.up(self.norm(x)))))


def _value(variable):
  return variable.get_value() if hasattr(variable, "get_value") else variable.value


def _loss(model, x, y):
  return jnp.mean((model(x) - y) ** 2)


def _batch(seed):
  kx, ky = jax.random.split(jax.random.key(seed))
  return jax.random.normal(kx, (32, 16)) * 3 + 1, jax.random.normal(ky, (32, 4))


def test_nnx_step_updates_fp8_state_batch_stats_and_rngs_in_place():
  model = _Net(nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)

  @nnx.jit
  def train_step(model, optimizer, x, y):
    loss, grads = nnx_value_and_grad(_loss)(model, x, y)
    optimizer.update(model, grads)
    return loss

  x, y = _batch(0)
  kernel_before = np.asarray(model.up.kernel[...])
  train_step(model, optimizer, x, y)

  # BatchNorm: running mean = momentum * 0 + (1 - momentum) * batch mean.
  want_mean = (1 - MOMENTUM) * np.asarray(x, np.float64).mean(axis=0)
  np.testing.assert_allclose(np.asarray(model.norm.mean[...]), want_mean, rtol=1e-5,
                             atol=1e-6)  # float32 mean of 32 rows
  # FP8 state: the first layer's input is the normalized x (the batch's own statistics).
  normalized = (x - x.mean(0)) / jnp.sqrt(x.var(0) + model.norm.epsilon)
  recorded = float(_value(model.up.fp8_meta).x.amax_history[0])
  np.testing.assert_allclose(recorded, float(jnp.max(jnp.abs(normalized))), rtol=1e-5)
  assert float(_value(model.down.fp8_meta).grad.amax_history[0]) > 0
  # The parameters were updated by the optimizer.
  assert not np.array_equal(np.asarray(model.up.kernel[...]), kernel_before)

  # Dropout's rng advanced: the same input gives another mask on the next call.
  model.eval()
  model.drop.deterministic = False
  first = np.asarray(model(x))
  second = np.asarray(model(x))
  assert not np.array_equal(first, second)


def test_nnx_step_with_aux_and_overflow_report():
  model = _Net(nnx.Rngs(1))

  def loss_with_aux(model, x, y):
    out = model(x)
    return jnp.mean((out - y) ** 2), out

  @nnx.jit
  def step(model, x, y):
    return nnx_value_and_grad(loss_with_aux, has_aux=True, report_overflow=True)(model, x, y)

  (loss, out), grads, overflow = step(model, *_batch(2))
  assert out.shape == (32, 4) and np.isfinite(float(loss)) and not bool(overflow)
  assert {g.shape for g in jax.tree.leaves(grads)} >= {(16, 32), (32, 4)}  # both kernels
