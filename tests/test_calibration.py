"""`fp8jax.calibrate`: a fresh delayed-scaling state trains right from its first step.

A fresh delayed state casts with scale 1: a gradient under E4M3's 2**-9 (or E5M2's 2**-16)
flushes to zero, with every GEMM behind it. Calibration runs the loss once with every
delayed role scaling from the tensor itself and seeds the histories, so the first step
casts with scales that fit. References: the same models in float32 (`fp8=False`,
`nn.Dense`, `fp8jax.attention`) trained with the same Adam steps, and the amaxes of the
calibration batch's tensors computed here.
"""
from __future__ import annotations

from types import SimpleNamespace

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import fp8jax
from fp8jax.core.calibration import Calibrating, is_fresh
from fp8jax.flax import nnx_calibrate, nnx_moe
from fp8jax.flax.nnx import Fp8MetaVariable
from fp8jax.flax.linen import Fp8Dense
from fp8jax.flax.linen_moe import Fp8MoE

STEPS, LR = 15, 1e-3
# The acceptance bound: each of the 15 losses within 1% of the float32 twin's. Measured:
# calibrated delayed and current scaling stay within 0.5% (two chained E4M3 GEMMs per
# token); a fresh delayed MoE falls 4% behind by step 5 and stays there.
TRACKS = 0.01


def _trainer(loss_fn):
  """A jitted Adam step over `loss_fn(params, fp8_state) -> (loss, fp8_state)`."""
  tx = optax.adam(LR)

  @jax.jit
  def step(params, opt_state, fp8_state):
    loss, grads, fp8_state = fp8jax.value_and_grad(loss_fn)(params, fp8_state)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, fp8_state, loss, grads

  def train(params, fp8_state, steps=STEPS):
    opt_state, losses, first_grads = tx.init(params), [], None
    for _ in range(steps):
      params, opt_state, fp8_state, loss, grads = step(params, opt_state, fp8_state)
      first_grads = grads if first_grads is None else first_grads
      losses.append(float(loss))
    return np.array(losses), first_grads

  train.step = step
  return train


def _first_grads(train, params, fp8_state):
  """The weight gradients of one step from `fp8_state` (the trainer's compiled step)."""
  return train.step(params, optax.adam(LR).init(params), fp8_state)[4]


def _rel(got, want):
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  return np.linalg.norm(got - want) / np.linalg.norm(want)


def _assert_tracks(losses, reference):
  gap = np.abs(losses / reference - 1)
  assert gap.max() < TRACKS, np.round(losses / reference - 1, 4)


# ----- Fp8MoE ----------------------------------------------------------------------------

D, HIDDEN, E, TOP_K = 32, 64, 4, 2
TOKENS = jax.random.normal(jax.random.key(0), (64, D))
TARGET = jnp.tanh(TOKENS @ jax.random.normal(jax.random.key(1), (D, D)) / 4)


def _moe_loss(layer):
  def loss_fn(params, fp8_state):
    variables = {"params": params, **({"fp8_meta": fp8_state} if layer.fp8 else {})}
    y, state = layer.apply(variables, TOKENS,
                           mutable=["fp8_meta", "intermediates"] if layer.fp8 else [])
    return jnp.mean((y - TARGET) ** 2), state["fp8_meta"] if layer.fp8 else fp8_state
  return loss_fn


@pytest.fixture(scope="module")
def moe():
  """The FP8 layer, its parameters, fresh and calibrated state, and its trainer (one
  compiled step and calibration for the tests here)."""
  layer = Fp8MoE(num_experts=E, top_k=TOP_K, hidden=HIDDEN)
  variables = jax.jit(layer.init)(jax.random.key(2), TOKENS)  # eagerly: seconds more
  params, fresh = variables["params"], variables["fp8_meta"]
  calibrated = jax.jit(fp8jax.calibrate(_moe_loss(layer)))(params, fresh)
  return SimpleNamespace(layer=layer, params=params, fresh=fresh, calibrated=calibrated,
                         train=_trainer(_moe_loss(layer)))


def test_a_calibrated_fresh_delayed_moe_trains_every_expert_from_step_one_like_float32(moe):
  twin = Fp8MoE(num_experts=E, top_k=TOP_K, hidden=HIDDEN, fp8=False)
  reference, reference_grads = _trainer(_moe_loss(twin))(moe.params, {})
  # Uncalibrated, step 1 casts the E4M3 output gradients (~1e-4) with scale 1: most of
  # the experts' weight gradients flush to exactly 0 (what calibration is for).
  fresh_grads = _first_grads(moe.train, moe.params, moe.fresh)
  assert np.mean(np.asarray(fresh_grads["w_in"]) == 0) > 0.3
  losses, grads = moe.train(moe.params, moe.calibrated)
  for name in ("w_in", "w_out"):
    # Every expert's weight gradient on step 1, against float32: two E4M3 GEMMs on the
    # way (~2**-4 relative per operand) keep it near 0.05; 0.15 bounds it.
    assert np.all(np.any(np.asarray(grads[name]) != 0, axis=(1, 2))), name
    assert _rel(grads[name], reference_grads[name]) < 0.15, name
  _assert_tracks(losses, reference)


def test_calibration_seeds_each_history_with_the_batchs_amaxes_and_keeps_the_state_shape(moe):
  calibrated, fresh = moe.calibrated, moe.fresh
  # The state a train step compiled for the fresh state takes as it is: the same tree
  # structure (plain recipes, no calibration mark) and the same shapes.
  assert jax.tree.structure(calibrated) == jax.tree.structure(fresh)
  assert is_fresh(fresh) and not is_fresh(calibrated)
  w_in = calibrated["w_in_meta"]
  # Every token goes to TOP_K experts, so the first GEMM's input is TOKENS, reordered.
  assert float(w_in.x.amax_history[0]) == float(jnp.max(jnp.abs(TOKENS)))
  # 64 tokens x 2 over 4 experts: each expert got rows and recorded its weight's amax.
  np.testing.assert_array_equal(np.asarray(w_in.kernel.amax_history[:, 0]),
                                np.abs(np.asarray(moe.params["w_in"])).max(axis=(1, 2)))
  for meta in jax.tree.leaves(calibrated, is_leaf=fp8jax.core.meta.is_meta):
    # One entry, and the scale delayed scaling makes from it (fmt.max / amax).
    history = np.asarray(meta.amax_history)
    assert np.all(history[..., 0] > 0) and np.all(history[..., 1:] == 0)
    np.testing.assert_allclose(np.asarray(meta.scale) * history[..., 0], meta.fmt.max,
                               rtol=1e-6)
  _first_grads(moe.train, moe.params, fresh)
  _first_grads(moe.train, moe.params, calibrated)
  assert moe.train.step._cache_size() == 1  # one compiled train step serves both


def test_the_calibrating_recipe_answers_as_its_recipe_but_scales_from_the_tensor():
  recipe = fp8jax.DelayedScaling(amax_history_len=8, amax_compute_algo="most_recent",
                                 margin=1, fp8_format="e4m3", power_of_two=True,
                                 high_precision=("wgrad",))
  wrapped = Calibrating(recipe)
  fp8jax.core.recipes.check_recipe(wrapped)
  assert wrapped.scales_from_tensor and not recipe.scales_from_tensor
  for name in ("fp8_format", "forward_format", "gradient_format", "history_len",
               "amax_compute_algo", "margin", "power_of_two", "high_precision",
               "fused_update", "per_operand"):
    assert getattr(wrapped, name) == getattr(recipe, name), name
  history = jnp.array([[3.0, 1.0, 5.0] + [0.0] * 5])
  assert float(wrapped.window_amax(history)[0]) == float(recipe.window_amax(history)[0])
  # Recipes that scale from the tensor anyway are left as they are.
  state = {"d": fp8jax.init_dot_meta(recipe), "c": fp8jax.init_dot_meta(fp8jax.CurrentScaling())}
  marked = fp8jax.core.calibration.calibrating(state)
  assert marked["d"].recipe == wrapped and marked["c"].recipe == fp8jax.CurrentScaling()
  assert not is_fresh({"c": state["c"]})  # nothing to calibrate


# ----- Fp8Dense ----------------------------------------------------------------------------


class _Mlp(nn.Module):
  """Two dense layers and a 256-way softmax over 1024 tokens: a language model's output
  gradients (each logit's ~ p / tokens, around 4e-6 here, under E5M2's 2**-16 = 1.5e-5)."""

  dense: type

  @nn.compact
  def __call__(self, x):
    return self.dense(256, name="out")(nn.gelu(self.dense(64, name="up")(x)))


LM_TOKENS = jax.random.normal(jax.random.key(3), (1024, D))
LABELS = jax.random.randint(jax.random.key(3), (1024,), 0, 256)


def _mlp_loss(model):
  def loss_fn(params, fp8_state):
    logits, updates = model.apply({"params": params, "fp8_meta": fp8_state}, LM_TOKENS,
                                  mutable=["fp8_meta"])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, LABELS).mean()
    return loss, updates.get("fp8_meta", fp8_state)
  return loss_fn


def test_a_calibrated_fresh_delayed_dense_model_tracks_float32_from_step_one():
  fp8_model, twin = _Mlp(Fp8Dense), _Mlp(nn.Dense)
  variables = jax.jit(fp8_model.init)(jax.random.key(4), LM_TOKENS)
  params, fresh = variables["params"], variables["fp8_meta"]
  reference, reference_grads = _trainer(_mlp_loss(twin))(params, {})
  train = _trainer(_mlp_loss(fp8_model))
  # Uncalibrated, the logits' gradients flush under scale 1: step 1's output-layer
  # gradient is off by about half.
  fresh_grads = _first_grads(train, params, fresh)
  assert _rel(fresh_grads["out"]["kernel"], reference_grads["out"]["kernel"]) > 0.3
  calibrated = jax.jit(fp8jax.calibrate(_mlp_loss(fp8_model)))(params, fresh)
  losses, grads = train(params, calibrated)
  for layer in ("up", "out"):
    # E4M3 x and kernel, E5M2 output gradient: measured 0.05-0.07 relative error of the
    # weight gradient; 0.15 bounds it.
    assert _rel(grads[layer]["kernel"], reference_grads[layer]["kernel"]) < 0.15, layer
  _assert_tracks(losses, reference)


# ----- FP8 attention ------------------------------------------------------------------------

HEADS, HEAD_DIM, SEQ = 2, 16, 32
SEQUENCE = jax.random.normal(jax.random.key(5), (2, SEQ, D))


def _attention_loss(fp8: bool):
  def loss_fn(params, fp8_state):
    q, k, v = (jnp.einsum("bsd,dhk->bshk", SEQUENCE, params[name]) for name in "qkv")
    if fp8:
      out, fp8_state = fp8jax.fp8_attention(q, k, v, fp8_state, causal=True, backend="xla")
    else:
      out = fp8jax.attention(q, k, v, causal=True, backend="xla")
    logits = jnp.einsum("bshk,hkv->bsv", out, params["o"])
    return optax.softmax_cross_entropy_with_integer_labels(
        logits, LABELS[:2 * SEQ].reshape(2, SEQ)).mean(), fp8_state
  return loss_fn


def test_a_calibrated_fresh_delayed_fp8_attention_tracks_float32_from_step_one():
  # Small projections: q, k, v around 5e-4, under E4M3's smallest step (2**-9) at scale 1.
  keys = jax.random.split(jax.random.key(6), 4)
  params = {name: jax.random.normal(key, (D, HEADS, HEAD_DIM)) * 1e-4
            for name, key in zip("qkv", keys[:3])}
  params["o"] = jax.random.normal(keys[3], (HEADS, HEAD_DIM, 256))
  fresh = fp8jax.init_attention_meta(fp8jax.DelayedScaling())
  reference, reference_grads = _trainer(_attention_loss(False))(params, {})
  train = _trainer(_attention_loss(True))
  fresh_grads = _first_grads(train, params, fresh)
  assert _rel(fresh_grads["q"], reference_grads["q"]) > 0.5  # q, k, v flushed or rounded
  calibrated = jax.jit(fp8jax.calibrate(_attention_loss(True)))(params, fresh)
  losses, grads = train(params, calibrated)
  for name in "qkvo":
    # Straight-through gradients at E4M3-rounded q, k, v (2**-4 relative each): measured
    # 0.03; 0.15 bounds it.
    assert _rel(grads[name], reference_grads[name]) < 0.15, name
  _assert_tracks(losses, reference)


# ----- nnx ---------------------------------------------------------------------------------


def test_nnx_calibrate_seeds_the_models_fp8_state_and_changes_nothing_else():
  model = nnx_moe.Fp8MoE(D, E, TOP_K, HIDDEN, rngs=nnx.Rngs(0))
  loss = lambda model: jnp.mean((model(TOKENS) - TARGET) ** 2)
  before = jax.tree.map(np.asarray, nnx.state(model, nnx.Not(Fp8MetaVariable)))
  assert is_fresh(nnx.state(model, Fp8MetaVariable))
  nnx.jit(nnx_calibrate(loss))(model)
  assert not is_fresh(nnx.state(model, Fp8MetaVariable))
  # Parameters, the router's load-balancing loss and every other variable: as they were.
  jax.tree.map(np.testing.assert_array_equal, before,
               jax.tree.map(np.asarray, nnx.state(model, nnx.Not(Fp8MetaVariable))))
  w_in = nnx.state(model, Fp8MetaVariable)["w_in_meta"]
  w_in = w_in.get_value() if hasattr(w_in, "get_value") else w_in.value
  assert float(w_in.x.amax_history[0]) == float(jnp.max(jnp.abs(TOKENS)))
  np.testing.assert_array_equal(np.asarray(w_in.kernel.amax_history[:, 0]),
                                np.abs(np.asarray(model.w_in[...])).max(axis=(1, 2)))
  assert float(w_in.grad.amax_history[0]) > 0
