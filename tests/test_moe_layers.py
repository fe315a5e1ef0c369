"""Mixture-of-experts layers: routing semantics, FP8 expert GEMMs, and converting a MoE model.

References: float64 numpy of the whole layer (each token through each of its k experts,
weighted), the same layer with `fp8=False` (jax.lax.ragged_dot in float32), and the
Switch Transformer load-balancing formula written out in numpy.
"""
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from flax import nnx

import fp8jax
from fp8jax.flax import Fp8Model, Fp8Rule, convert_to_fp8, nnx_value_and_grad
from fp8jax.flax.linen_moe import Fp8MoE, sum_sown_losses
from fp8jax.flax.nnx import Fp8MetaVariable
from fp8jax.flax import nnx_moe
from fp8jax.ops import moe_routing

D, HIDDEN, E, TOP_K = 64, 128, 4, 2
X_SHAPE = (2, 24, D)  # 48 tokens, 96 (token, expert) pairs


def _x(seed=0):
  return jax.random.normal(jax.random.key(seed), X_SHAPE, jnp.float32)


def _rel(got, want):
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  return np.linalg.norm(got - want) / np.linalg.norm(want)


def _moe64(tokens, router, w_in, w_out, k):
  """float64: each token through its top-k experts (renormalized softmax weights)."""
  tokens, router = np.asarray(tokens, np.float64), np.asarray(router, np.float64)
  logits = tokens @ router
  probs = np.exp(logits - logits.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  out = np.zeros_like(tokens)
  gelu = lambda h: np.asarray(jax.nn.gelu(jnp.asarray(h, jnp.float32)), np.float64)
  for t in range(tokens.shape[0]):
    top = np.argsort(-probs[t], kind="stable")[:k]
    weights = probs[t, top] / probs[t, top].sum()
    for e, weight in zip(top, weights):
      h = gelu(tokens[t] @ np.asarray(w_in[e], np.float64))
      out[t] += weight * (h @ np.asarray(w_out[e], np.float64))
  return out


def test_routing_sorts_by_expert_and_combine_undoes_it_exactly():
  tokens = _x().reshape(-1, D)
  routing = moe_routing.route_top_k(jax.random.normal(jax.random.key(1), (48, E)), TOP_K)
  x_sorted, sizes, order = moe_routing.sort_by_expert(tokens, routing.experts, E)
  flat = np.asarray(routing.experts).reshape(-1)
  np.testing.assert_array_equal(np.asarray(sizes), np.bincount(flat, minlength=E))
  assert np.all(np.diff(flat[np.asarray(order)]) >= 0)  # rows grouped by expert, in order
  np.testing.assert_array_equal(x_sorted, tokens[np.asarray(order) // TOP_K])
  # Identity experts: combining gives each token back (weights sum to 1 per token).
  np.testing.assert_allclose(moe_routing.combine(x_sorted, order, routing.weights), tokens,
                             rtol=1e-6, atol=1e-6)


def test_load_balancing_loss_is_the_switch_formula():
  logits = jax.random.normal(jax.random.key(2), (48, E)) * 3
  routing = moe_routing.route_top_k(logits, TOP_K)
  probs = np.asarray(routing.probs, np.float64)
  counts = np.bincount(np.asarray(routing.experts).reshape(-1), minlength=E)
  want = E * np.sum(counts / counts.sum() * probs.mean(0))
  np.testing.assert_allclose(float(moe_routing.load_balancing_loss(routing)), want, rtol=1e-6)
  uniform = moe_routing.route_top_k(jnp.zeros((E * 4, E)).at[jnp.arange(E * 4),
                                                              jnp.arange(E * 4) % E].set(1.0), 1)
  np.testing.assert_allclose(float(moe_routing.load_balancing_loss(uniform)), 1.0, rtol=1e-6)


def test_linen_layer_in_float32_is_the_float64_mixture_of_experts():
  x = _x()
  layer = Fp8MoE(num_experts=E, top_k=TOP_K, hidden=HIDDEN, fp8=False)
  variables = layer.init(jax.random.key(0), x)
  y = layer.apply(variables, x)
  p = variables["params"]
  want = _moe64(x.reshape(-1, D), p["router"]["kernel"], p["w_in"], p["w_out"], TOP_K)
  # float32 GEMMs of K <= 128 against float64: relative error ~1e-6; 1e-5 bounds it.
  assert _rel(y.reshape(-1, D), want) < 1e-5


def _linen_step(layer, variables, x, target):
  def loss_fn(params, fp8_state):
    y, state = layer.apply({"params": params, "fp8_meta": fp8_state}, x,
                           mutable=["fp8_meta", "intermediates"])
    aux = sum_sown_losses(state["intermediates"])
    return jnp.mean((y - target) ** 2) + 0.01 * aux, state["fp8_meta"]

  return fp8jax.value_and_grad(loss_fn)(variables["params"], variables["fp8_meta"])


def test_linen_fp8_layer_trains_like_the_float32_layer_with_a_state_per_expert():
  x, target = _x(0), _x(1)
  fp8_layer = Fp8MoE(num_experts=E, top_k=TOP_K, hidden=HIDDEN)
  f32_layer = Fp8MoE(num_experts=E, top_k=TOP_K, hidden=HIDDEN, fp8=False)
  variables = fp8_layer.init(jax.random.key(0), x)
  meta = variables["fp8_meta"]["w_in_meta"]
  assert isinstance(meta, fp8jax.RaggedDotMeta) and meta.kernel.scale.shape == (E,)
  y = fp8_layer.apply(variables, x, mutable=["fp8_meta"])[0]
  want = f32_layer.apply({"params": variables["params"]}, x)
  # Two chained FP8 GEMMs (E4M3: ~2**-4 / sqrt(3) RMS per operand): ~7% at most; 0.12.
  assert _rel(y, want) < 0.12
  # Delayed scaling: the first step records the amaxes (its gradient scale is still 1,
  # which E4M3 gradients of ~1e-4 underflow); the second step runs with scales from them.
  _, _, fp8_state = _linen_step(fp8_layer, variables, x, target)
  loss, grads, fp8_state = _linen_step(fp8_layer, dict(variables, fp8_meta=fp8_state), x,
                                       target)

  def f32_loss(params):
    y, state = f32_layer.apply({"params": params}, x, mutable=["intermediates"])
    return jnp.mean((y - target) ** 2) + 0.01 * sum_sown_losses(state["intermediates"])

  want_loss, want_grads = jax.value_and_grad(f32_loss)(variables["params"])
  assert abs(float(loss) / float(want_loss) - 1) < 0.12
  for name in ("w_in", "w_out", "router"):  # E5M2/E4M3 gradients through two GEMMs: 0.25
    got, expected = grads[name], want_grads[name]
    got = got["kernel"] if name == "router" else got
    expected = expected["kernel"] if name == "router" else expected
    assert _rel(got, expected) < 0.25, name
  # Each expert that saw tokens recorded its own weight's amax in the closed step.
  w_in = np.asarray(variables["params"]["w_in"])
  history = np.asarray(fp8_state["w_in_meta"].kernel.amax_history[:, 0])
  used = history > 0
  assert used.any()
  np.testing.assert_array_equal(history[used], np.abs(w_in).max(axis=(1, 2))[used])


def test_nnx_layer_trains_and_matches_its_float32_twin():
  x, target = _x(0), _x(1)
  model = nnx_moe.Fp8MoE(D, E, TOP_K, HIDDEN, rngs=nnx.Rngs(0))
  twin = nnx_moe.Fp8MoE(D, E, TOP_K, HIDDEN, fp8=False, rngs=nnx.Rngs(0))
  assert _rel(model(x), twin(x)) < 0.12  # as for the linen layer

  def loss_fn(model, x):
    return jnp.mean((model(x) - target) ** 2) + 0.01 * model.load_balancing_loss[...]

  step = nnx.jit(nnx_value_and_grad(loss_fn))
  step(model, x)  # the first step sets the gradient scales (see the linen test)
  loss, grads = step(model, x)
  _, want_grads = nnx.value_and_grad(loss_fn)(twin, x)
  assert _rel(grads["w_in"].get_value(), want_grads["w_in"].get_value()) < 0.25
  assert np.isfinite(float(loss))
  state = nnx.state(model, Fp8MetaVariable)
  assert float(state["w_in_meta"].get_value().x.amax_history[0]) == float(jnp.max(jnp.abs(x)))
  assert grads["w_in"].get_value().shape == (E, D, HIDDEN)
  assert float(model.load_balancing_loss[...]) > 0.5  # ~1 for a roughly balanced router


class PlainMoE(nn.Module):
  """An MoE MLP written without fp8jax: routing by hand, experts by jax.lax.ragged_dot."""

  @nn.compact
  def __call__(self, x):
    tokens = x.reshape(-1, D)
    routing = moe_routing.route_top_k(nn.Dense(E, use_bias=False, name="router")(tokens),
                                      TOP_K)
    x_sorted, sizes, order = moe_routing.sort_by_expert(tokens, routing.experts, E)
    w_in = self.param("w_in", nn.initializers.lecun_normal(), (E, D, HIDDEN))
    w_out = self.param("w_out", nn.initializers.lecun_normal(), (E, HIDDEN, D))
    h = nn.gelu(jax.lax.ragged_dot(x_sorted, w_in, sizes))
    return moe_routing.combine(jax.lax.ragged_dot(h, w_out, sizes), order,
                               routing.weights).reshape(x.shape)


def test_an_existing_linen_moe_model_converts_unmodified_and_the_report_lists_each_expert_gemm():
  x, target = _x(0), _x(1)
  rules = (Fp8Rule(op="ragged_dot"), Fp8Rule(recipe=None))  # the experts, nothing else
  fp8_model = Fp8Model(PlainMoE(), rules=rules)
  report = fp8_model.report(jax.random.key(0), x)
  rows = {row.path: row for row in report.rows}
  assert rows[("ragged_dot_0",)].fp8 and rows[("ragged_dot_1",)].fp8
  assert (rows[("ragged_dot_0",)].k, rows[("ragged_dot_0",)].n) == (D, HIDDEN)
  variables = fp8_model.init(jax.random.key(0), x)
  assert variables["fp8_meta"]["ragged_dot_0"].kernel.scale.shape == (E,)
  plain = PlainMoE().apply({"params": variables["params"]}, x)
  y, _ = fp8_model.apply(variables, x, mutable=["fp8_meta"])
  assert _rel(y, plain) < 0.12  # two chained FP8 GEMMs, as above

  tx = optax.adam(1e-2)
  params, opt_state, fp8_state = variables["params"], tx.init(variables["params"]), \
      variables["fp8_meta"]

  @jax.jit
  def step(params, opt_state, fp8_state):
    def loss_fn(params, fp8_state):
      y, state = fp8_model.apply({"params": params, "fp8_meta": fp8_state}, x,
                                 mutable=["fp8_meta"])
      return jnp.mean((y - target) ** 2), state["fp8_meta"]
    loss, grads, fp8_state = fp8jax.value_and_grad(loss_fn)(params, fp8_state)
    updates, opt_state = tx.update(grads, opt_state)
    return optax.apply_updates(params, updates), opt_state, fp8_state, loss

  losses = []
  for _ in range(20):
    params, opt_state, fp8_state, loss = step(params, opt_state, fp8_state)
    losses.append(float(loss))
  assert losses[-1] < 0.8 * losses[0]


class NnxPlainMoE(nnx.Module):
  def __init__(self, rngs):
    self.router = nnx.Linear(D, E, use_bias=False, rngs=rngs)
    init = nnx.initializers.lecun_normal()
    self.w_in = nnx.Param(init(rngs.params(), (E, D, HIDDEN)))
    self.w_out = nnx.Param(init(rngs.params(), (E, HIDDEN, D)))

  def __call__(self, x):
    tokens = x.reshape(-1, D)
    routing = moe_routing.route_top_k(self.router(tokens), TOP_K)
    x_sorted, sizes, order = moe_routing.sort_by_expert(tokens, routing.experts, E)
    h = nnx.gelu(jax.lax.ragged_dot(x_sorted, self.w_in[...], sizes))
    return moe_routing.combine(jax.lax.ragged_dot(h, self.w_out[...], sizes), order,
                               routing.weights).reshape(x.shape)


def test_an_existing_nnx_moe_model_converts_by_rules_with_example_inputs():
  x, target = _x(0), _x(1)
  model = NnxPlainMoE(nnx.Rngs(0))
  want = model(x)
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # nothing stays high precision unexpectedly
    report = convert_to_fp8(model, rules=(Fp8Rule(op="ragged_dot"), Fp8Rule(recipe=None)),
                            example_inputs=(x,), report=True)
  assert sorted(row.path for row in report.converted) == [("ragged_dot_0",), ("ragged_dot_1",)]
  assert _rel(model(x), want) < 0.12
  loss, _ = nnx.jit(nnx_value_and_grad(lambda m, x: jnp.mean((m(x) - target) ** 2)))(model, x)
  assert np.isfinite(float(loss))
  states = nnx.state(model, Fp8MetaVariable)
  assert states["fp8_dot_states"]["ragged_dot_0"].get_value().kernel.scale.shape == (E,)


def test_telemetry_reports_each_expert():
  """Per expert: the state's amax and headroom, and the weight's saturation, against numpy."""
  from fp8jax import telemetry
  x = _x(0).reshape(-1, D)
  w = jax.random.normal(jax.random.key(3), (E, D, HIDDEN)) * jnp.asarray(
      [1.0, 100.0, 0.01, 1.0])[:, None, None]
  meta = fp8jax.init_ragged_dot_meta(fp8jax.DelayedScaling(), E)
  stats = telemetry.ragged_dot_stats(x, w, meta)
  amaxes = np.abs(np.asarray(w)).max(axis=(1, 2))
  np.testing.assert_array_equal(stats["kernel"].amax, amaxes)
  # Scale 1 (a fresh state): expert 1 (amax ~400) nearly fills 448; expert 2's small
  # values round to 0 (below half of E4M3's smallest subnormal 2**-9).
  w64 = np.asarray(w, np.float64)
  saturated = (np.abs(w64) > 448).mean(axis=(1, 2))
  q = np.clip(w64, -448, 448).astype(np.float32).astype(ml_dtypes.float8_e4m3fn)
  flushed = ((w64 != 0) & (q.astype(np.float64) == 0)).mean(axis=(1, 2))
  np.testing.assert_allclose(stats["kernel"].saturated, saturated, atol=1e-7)
  np.testing.assert_allclose(stats["kernel"].flushed, flushed, atol=1e-7)
  assert flushed[2] > 0.05 > flushed[0]  # the small expert loses far more
  state = telemetry.state_stats({"moe": meta})
  assert state["moe/kernel"].headroom.shape == (E,)
