"""Flax training loops users already have: they either work or fail at once, never corrupt FP8 state."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training import train_state as flax_train_state

import fp8jax
from fp8jax.flax import linen as fp8nn
from fp8jax.flax import nnx as fp8nnx
from fp8jax.flax.train_state import TrainState
from fp8jax.ops.guards import Fp8StateGradientError


class Mlp(nn.Module):

  @nn.compact
  def __call__(self, x):
    return fp8nn.Fp8Dense(32)(nn.relu(fp8nn.Fp8Dense(64)(x)))


def _data(seed=0):
  kx, ky = jax.random.split(jax.random.key(seed))
  return jax.random.normal(kx, (16, 32)), jax.random.normal(ky, (16, 32))


def _bits(tree):
  return [np.asarray(leaf).tobytes() for leaf in jax.tree.leaves(tree)]


def test_flax_docs_loop_over_all_variables_fails_naming_fp8_state_and_the_fix():
  # Flax's FP8 documentation: the whole variables dict in a TrainState, jax.grad over it.
  model, (x, y) = Mlp(), _data()
  variables = model.init(jax.random.key(1), x)
  state = flax_train_state.TrainState.create(apply_fn=model.apply, params=variables,
                                             tx=optax.adamw(1e-3))

  def loss_fn(variables):
    return jnp.mean((model.apply(variables, x) - y) ** 2)

  with pytest.raises(Fp8StateGradientError, match=r"FP8 state 'fp8_meta/.*dot_meta'.*"
                     r"fp8jax.flax.TrainState"):
    jax.grad(loss_fn)(state.params)


def test_flax_loop_with_mutable_fp8_collection_also_fails_at_once():
  model, (x, y) = Mlp(), _data()
  variables = model.init(jax.random.key(1), x)

  def loss_fn(variables):
    out, updates = model.apply(variables, x, mutable=["fp8_meta"])
    return jnp.mean((out - y) ** 2), updates

  with pytest.raises(Fp8StateGradientError, match="not a gradient"):
    jax.jit(jax.grad(loss_fn, has_aux=True))(variables)


class Twice(nn.Module):
  """One FP8 layer called twice: its second call reads the state its first call stored."""

  @nn.compact
  def __call__(self, x):
    dense = fp8nn.Fp8Dense(32)
    return dense(nn.relu(dense(x)))


@pytest.mark.parametrize("model", [Mlp(), Twice()], ids=["mlp", "layer_called_twice"])
@pytest.mark.parametrize("mutable", [False, True], ids=["frozen_state", "mutable_state"])
def test_gradients_of_params_only_and_evaluation_never_trip_the_guard(model, mutable):
  (x, y) = _data()
  variables = model.init(jax.random.key(1), x)

  def loss_fn(params):
    state = {"params": params, "fp8_meta": variables["fp8_meta"]}
    if mutable:
      out, _ = model.apply(state, x, mutable=["fp8_meta"])
    else:
      out = model.apply(state, x)
    return jnp.mean((out - y) ** 2)

  grads = jax.jit(jax.grad(loss_fn))(variables["params"])
  assert all(np.all(np.isfinite(g)) and np.any(g != 0) for g in jax.tree.leaves(grads))
  evaluated = jax.jit(loss_fn)(variables["params"])
  assert np.isfinite(float(evaluated))


def test_layer_called_twice_still_threads_its_state_in_fp8jax_steps():
  # Inside fp8jax.value_and_grad the stored state keeps its derivative: the first
  # call's gradient amax reaches the state through the second call's read.
  model, (x, y) = Twice(), _data()
  variables = model.init(jax.random.key(1), x)
  _, _, state = fp8jax.value_and_grad(lambda p, s: _loss_fn(model, p, s, x, y))(
      variables["params"], variables["fp8_meta"])
  grad_meta = state["Fp8Dense_0"]["dot_meta"].grad
  assert float(grad_meta.amax_history[0]) > 0


def _loss_fn(model, params, fp8_state, x, y):
  out, updates = model.apply({"params": params, "fp8_meta": fp8_state}, x, mutable=["fp8_meta"])
  return jnp.mean((out - y) ** 2), updates["fp8_meta"]


def test_fp8jax_train_state_gives_the_functional_loop_bit_for_bit():
  model, tx = Mlp(), optax.adamw(1e-2, weight_decay=0.1)
  x, y = _data()
  variables = model.init(jax.random.key(1), x)
  loss_fn = lambda p, s, x, y: _loss_fn(model, p, s, x, y)

  state = TrainState.create(apply_fn=model.apply, variables=variables, tx=tx)

  @jax.jit
  def train_step(state, x, y):
    loss, grads, fp8_state = fp8jax.value_and_grad(loss_fn)(state.params, state.fp8_state, x, y)
    return state.apply_gradients(grads=grads, fp8_state=fp8_state), loss

  params, fp8_state, opt_state = variables["params"], variables["fp8_meta"], tx.init(
      variables["params"])

  @jax.jit
  def functional_step(params, opt_state, fp8_state, x, y):
    loss, grads, fp8_state = fp8jax.value_and_grad(loss_fn)(params, fp8_state, x, y)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, fp8_state, loss

  for step in range(3):
    x, y = _data(step)
    state, loss = train_step(state, x, y)
    params, opt_state, fp8_state, reference_loss = functional_step(params, opt_state,
                                                                   fp8_state, x, y)
    assert float(loss) == float(reference_loss)
  assert _bits(state.params) == _bits(params)
  assert _bits(state.opt_state) == _bits(opt_state)
  assert _bits(state.fp8_state) == _bits(fp8_state)
  # The FP8 state is what the recipe makes of it: amaxes recorded (> 0), scale = 1 / scale_inv.
  for meta in jax.tree.leaves(state.fp8_state, is_leaf=lambda n: isinstance(n, fp8jax.Fp8Meta)):
    assert np.all(np.asarray(meta.amax_history)[:3] > 0)
    np.testing.assert_array_equal(np.float32(1) / np.asarray(meta.scale), meta.scale_inv)
  assert set(state.variables) == {"params", "fp8_meta"}


def test_train_state_refuses_fp8_state_in_grads_and_a_missing_fp8_state():
  model, (x, _) = Mlp(), _data()
  variables = model.init(jax.random.key(1), x)
  state = TrainState.create(apply_fn=model.apply, variables=variables, tx=optax.sgd(0.1))
  with pytest.raises(ValueError, match="grads holds a 'fp8_meta' collection"):
    state.apply_gradients(grads=variables, fp8_state=state.fp8_state)
  with pytest.raises(TypeError, match="fp8_state"):
    state.apply_gradients(grads=variables["params"])  # fp8_state is keyword-required
  with pytest.raises(ValueError, match="either variables= .* or params="):
    TrainState.create(apply_fn=model.apply, variables=variables, params=variables["params"],
                      tx=optax.sgd(0.1))


class NnxMlp(nnx.Module):

  def __init__(self, rngs):
    self.up = fp8nnx.Fp8Linear(32, 64, rngs=rngs)
    self.down = fp8nnx.Fp8Linear(64, 32, rngs=rngs)

  def __call__(self, x):
    return self.down(jax.nn.relu(self.up(x)))


def test_nnx_optimizer_on_params_leaves_fp8_state_to_fp8jax():
  model = NnxMlp(nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, optax.adamw(1e-2, weight_decay=0.1), wrt=nnx.Param)
  x, y = _data()
  graphdef, params, fp8_state = nnx.split(model, nnx.Param, fp8nnx.Fp8MetaVariable)

  def loss_fn(params, fp8_state, x, y):
    model = nnx.merge(graphdef, params, fp8_state)
    loss = jnp.mean((model(x) - y) ** 2)
    return loss, nnx.state(model, fp8nnx.Fp8MetaVariable)

  _, grads, next_fp8_state = fp8jax.value_and_grad(loss_fn)(params, fp8_state, x, y)
  before = _bits(nnx.state(model, fp8nnx.Fp8MetaVariable))
  params_before = _bits(nnx.state(model, nnx.Param))
  optimizer.update(model, grads)
  # AdamW with weight decay moved every parameter and not one FP8 value.
  assert _bits(nnx.state(model, fp8nnx.Fp8MetaVariable)) == before
  assert all(a != b for a, b in zip(_bits(nnx.state(model, nnx.Param)), params_before))
  nnx.update(model, next_fp8_state)
  assert _bits(nnx.state(model, fp8nnx.Fp8MetaVariable)) == _bits(next_fp8_state)


def test_nnx_grad_over_params_of_a_layer_called_twice_works():
  layer = fp8nnx.Fp8Linear(32, 32, rngs=nnx.Rngs(0))
  x, _ = _data()
  grads = nnx.grad(lambda m: jnp.sum(m(jax.nn.relu(m(x)))))(layer)
  assert np.any(np.asarray(grads["kernel"][...]) != 0)


def test_nnx_grad_over_fp8_state_fails_at_once():
  model = NnxMlp(nnx.Rngs(0))
  x, y = _data()

  def loss_fn(model):
    return jnp.mean((model(x) - y) ** 2)

  with pytest.raises(Fp8StateGradientError, match="Fp8Linear.*nnx.split"):
    nnx.grad(loss_fn, argnums=nnx.DiffState(0, nnx.Variable))(model)


def test_hand_written_step_inside_differentiating_fp8_state_matches_value_and_grad():
  model, (x, y) = Mlp(), _data()
  variables = model.init(jax.random.key(1), x)
  params, fp8_state = variables["params"], variables["fp8_meta"]
  loss_fn = lambda p, s: _loss_fn(model, p, s, x, y)

  with fp8jax.differentiating_fp8_state():
    (_, forward), (grads, cotangent) = jax.value_and_grad(loss_fn, argnums=(0, 1),
                                                          has_aux=True)(
        params, fp8jax.begin_step(fp8_state))
  by_hand = fp8jax.close_step(forward, cotangent)
  _, reference_grads, reference = fp8jax.value_and_grad(
      lambda p, s: _loss_fn(model, p, s, x, y))(params, fp8_state)
  assert _bits(by_hand) == _bits(reference)
  assert _bits(grads) == _bits(reference_grads)
  # (The numbers written over a given state: tests/test_fused_kernels.py.)
  with pytest.raises(ValueError, match="written_over must be the state the step was given"):
    fp8jax.close_step(forward, cotangent, written_over={"other": fp8_state})
