"""A recipe written outside fp8jax works wherever a built-in one does.

`EmaAmaxScaling` below is defined here, in a test module, the way a user
would: a frozen dataclass subclassing `fp8jax.DelayedScaling` that overrides
one protocol method, `window_amax` (an exponential moving average of the
observed amaxes instead of their max). It goes through `fp8_dense`,
`fp8_einsum`, the linen and nnx layers, checkpoints (saved under its
importable name) and telemetry; test_sharding.py runs it on an 8-device mesh.
The expected scales are computed here in float64 numpy from the amaxes the
state recorded, independently of fp8jax's update.
"""
from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import fp8jax
import fp8jax.checkpoint as ckpt
from fp8jax import telemetry
from fp8jax.flax import nnx_value_and_grad
from fp8jax.flax.linen import Fp8Dense
from fp8jax.flax.nnx import Fp8Linear


@dataclasses.dataclass(frozen=True)
class EmaAmaxScaling(fp8jax.DelayedScaling):
  """Delayed scaling from an exponential moving average of the observed amaxes."""

  decay: float = 0.5

  def window_amax(self, history):
    weights = self.decay ** jnp.arange(history.shape[1], dtype=jnp.float32)
    observed = (history > 0) * weights
    return jnp.sum(history * weights, axis=1) / jnp.maximum(jnp.sum(observed, axis=1), 1e-30)


RECIPE = EmaAmaxScaling(amax_history_len=4)
GAINS = (1.0, 4.0, 2.0)  # the input's scale per step: the EMA differs from the max


def _ema_scale(history: np.ndarray, fmt_max: float) -> float:
  """float64: fmt_max / (sum_i decay**i * a_i / sum over observed steps of decay**i)."""
  weights = RECIPE.decay ** np.arange(len(history), dtype=np.float64)
  observed = (history > 0) * weights
  return fmt_max / (np.sum(history * weights) / np.sum(observed))


def _assert_ema_scales(meta):
  for role in (meta.x, meta.kernel, meta.grad):
    history = np.asarray(role.amax_history, np.float64)
    # float32 arithmetic in the update against float64 here: a few ulps.
    np.testing.assert_allclose(float(role.scale), _ema_scale(history, role.fmt.max),
                               rtol=1e-6)


def _steps(loss, params, meta):
  step = jax.jit(fp8jax.value_and_grad(loss))
  for i, gain in enumerate(GAINS):
    x = jax.random.normal(jax.random.key(i), (32, 16)) * gain
    _, _, meta = step(params, meta, x)
  return meta


def _kernel():
  return jax.random.normal(jax.random.key(10), (16, 8)) / 4


def test_user_recipe_runs_fp8_dense_and_updates_by_its_own_rule():
  def loss(kernel, meta, x):
    y, meta = fp8jax.fp8_dense(x, kernel, None, meta)
    return jnp.sum(y.astype(jnp.float32) ** 2), meta

  meta = _steps(loss, _kernel(), fp8jax.init_dot_meta(RECIPE))
  assert meta.x.recipe == RECIPE
  assert np.count_nonzero(np.asarray(meta.x.amax_history)) == len(GAINS)
  _assert_ema_scales(meta)
  # Not what plain delayed scaling (max over the history) would give.
  assert float(meta.x.scale) > meta.x.fmt.max / float(np.max(meta.x.amax_history)) * 1.01


def test_user_recipe_runs_fp8_einsum():
  def loss(kernel, meta, x):
    y, meta = fp8jax.fp8_einsum("bk,kn->bn", x, kernel, meta)
    return jnp.sum(y.astype(jnp.float32) ** 2), meta

  _assert_ema_scales(_steps(loss, _kernel(), fp8jax.init_dot_meta(RECIPE)))


def test_user_recipe_runs_fp8_attention():
  batch, seq, heads, head_dim = 2, 32, 2, 64
  meta = fp8jax.init_attention_meta(RECIPE)

  def loss(_, meta, x):
    q = k = v = x.reshape(batch, seq, heads, head_dim).astype(jnp.bfloat16)
    out, meta = fp8jax.fp8_attention(q, k, v, meta, causal=True, backend="xla")
    return jnp.sum(out.astype(jnp.float32) ** 2), meta

  step = jax.jit(fp8jax.value_and_grad(loss))
  for i, gain in enumerate(GAINS):
    x = jax.random.normal(jax.random.key(i), (batch * seq, heads * head_dim)) * gain
    _, _, meta = step(jnp.zeros(()), meta, x)
  for role in (meta.q, meta.k, meta.v, meta.o, meta.grad):
    history = np.asarray(role.amax_history, np.float64)
    assert np.count_nonzero(history) == len(GAINS)
    np.testing.assert_allclose(float(role.scale), _ema_scale(history, role.fmt.max), rtol=1e-6)


def test_user_recipe_runs_gradient_accumulation():
  def loss(kernel, meta, x):
    y, meta = fp8jax.fp8_dense(x, kernel, None, meta)
    return jnp.sum(y.astype(jnp.float32) ** 2), meta

  meta = fp8jax.init_dot_meta(RECIPE)
  for i, gain in enumerate(GAINS):
    microbatches = jax.random.normal(jax.random.key(i), (2, 16, 16)) * gain
    _, _, meta = jax.jit(lambda k, m, x: fp8jax.accumulate_gradients(loss, k, m, x))(
        _kernel(), meta, microbatches)
    # One history entry per step: the max over both microbatches.
    assert float(meta.x.amax_history[0]) == float(jnp.max(jnp.abs(microbatches)))
  _assert_ema_scales(meta)


def test_user_recipe_runs_linen_layers():
  model = Fp8Dense(8, recipe=RECIPE)
  variables = model.init(jax.random.key(0), jnp.ones((32, 16)))

  def loss(params, state, x):
    y, updates = model.apply({"params": params, "fp8_meta": state}, x, mutable=["fp8_meta"])
    return jnp.sum(y ** 2), updates["fp8_meta"]

  state = _steps(loss, variables["params"], variables["fp8_meta"])
  _assert_ema_scales(state["dot_meta"])


def test_user_recipe_runs_nnx_layers():
  model = Fp8Linear(16, 8, recipe=RECIPE, rngs=nnx.Rngs(0))

  @nnx.jit
  def step(model, x):
    return nnx_value_and_grad(lambda m, x: jnp.sum(m(x) ** 2))(model, x)

  for i, gain in enumerate(GAINS):
    step(model, jax.random.normal(jax.random.key(i), (32, 16)) * gain)
  meta = model.fp8_meta.get_value() if hasattr(model.fp8_meta, "get_value") else \
      model.fp8_meta.value
  _assert_ema_scales(meta)


def test_user_recipe_checkpoint_round_trips_by_its_importable_name(tmp_path):
  kernel = _kernel()
  meta = _steps(lambda k, m, x: (lambda y, m: (jnp.sum(y ** 2), m))(
      *fp8jax.fp8_dense(x, k, None, m)), kernel, fp8jax.init_dot_meta(RECIPE))
  path = ckpt.save(tmp_path / "step_3", params={"k": kernel}, opt_state={},
                   fp8_state={"l": meta})
  saved = ckpt.read_description(path)["fp8_metas"]["['l'].x"]["recipe"]
  assert saved["kind"] == f"{__name__}:EmaAmaxScaling" and saved["decay"] == 0.5
  restored = ckpt.restore(path, params={"k": kernel}, opt_state={}, fp8_state={"l": meta},
                          keep_saved_recipes=True)
  got = restored["fp8_state"]["l"]
  assert got.x.recipe == RECIPE and type(got.x.recipe) is EmaAmaxScaling
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(meta)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_saved_recipe_that_cannot_be_imported_is_named():
  with pytest.raises(ValueError, match=r"'no_such_module:Ema' cannot be imported.*importable"):
    ckpt.recipe_from_description({"kind": "no_such_module:Ema", "decay": 0.5})


def test_user_recipe_telemetry():
  meta = fp8jax.init_dot_meta(RECIPE)
  x = jax.random.normal(jax.random.key(0), (32, 16)) * 3
  stats = telemetry.dot_stats(x, _kernel(), meta)
  # Delayed scaling from the initial scale 1: nothing saturates, the SNR is finite.
  assert float(stats["x"].saturated) == 0.0 and np.isfinite(float(stats["x"].snr_db))
  assert set(telemetry.state_stats({"l": meta})) == {"l/x", "l/kernel", "l/grad"}


def test_a_recipe_that_is_not_a_frozen_dataclass_is_refused():
  class Loose(fp8jax.Recipe):  # not a dataclass
    pass

  with pytest.raises(TypeError, match="frozen dataclass"):
    fp8jax.init_dot_meta(Loose())


@dataclasses.dataclass(frozen=True)
class PowerOfTwoByDefault(fp8jax.DelayedScaling):
  """A recipe of one's own whose defaults differ from fp8jax's."""

  power_of_two: bool = True


def test_a_user_recipe_is_saved_with_every_field_its_defaults_could_change(tmp_path):
  recipe = PowerOfTwoByDefault(power_of_two=False)
  meta = fp8jax.init_dot_meta(recipe)
  path = ckpt.save(tmp_path / "c", params={}, opt_state={}, fp8_state={"l": meta})
  restored = ckpt.restore(path, params={}, opt_state={}, fp8_state={"l": meta},
                          keep_saved_recipes=True)
  assert restored["fp8_state"]["l"].x.recipe == recipe  # not the class default True


@dataclasses.dataclass(frozen=True)
class _MeanOfHistory(fp8jax.Recipe):
  amax_compute_algo: str = "mean"  # no such rule, and window_amax is not overridden


def test_a_user_recipe_with_an_invalid_protocol_value_is_refused():
  with pytest.raises(ValueError, match=r"_MeanOfHistory.amax_compute_algo='mean' is not one of"):
    fp8jax.init_dot_meta(_MeanOfHistory())


@dataclasses.dataclass(frozen=True)
class _WindowKeepsTheHistory(fp8jax.DelayedScaling):
  """Forgets to reduce: returns the [rows, L] history itself."""

  def window_amax(self, history):
    return history


@dataclasses.dataclass(frozen=True)
class _WindowFails(fp8jax.DelayedScaling):
  def window_amax(self, history):
    return history.max(axis=2)


def test_a_window_amax_of_the_wrong_shape_is_named_where_the_recipe_is_first_used():
  """It used to fail the first step with "cannot reshape array of shape (1, 16)"."""
  recipe = _WindowKeepsTheHistory(amax_history_len=16)
  with pytest.raises(ValueError, match=r"_WindowKeepsTheHistory.window_amax\(history\) must "
                                       r"return one float per row.*shape \(3, 16\) it must "
                                       r"return shape \(3,\).*returned shape \(3, 16\)"):
    fp8jax.init_dot_meta(recipe)
  with pytest.raises(TypeError, match=r"_WindowFails.window_amax\(history\) failed on a "
                                      r"float32 history of shape \(3, 4\)"):
    fp8jax.init_meta(_WindowFails(amax_history_len=4), fp8jax.E4M3)


def test_user_recipe_runs_fp8_ragged_dot_and_each_expert_follows_its_own_rule():
  """The grouped matmul's per-expert state closes by the recipe's own window_amax, row by
  row: each expert's scale is the EMA of its own amaxes."""
  sizes = jnp.asarray([40, 0, 24], jnp.int32)
  x = jax.random.normal(jax.random.key(0), (64, 32))
  w = jax.random.normal(jax.random.key(1), (3, 32, 16)) * jnp.asarray([1.0, 5.0, 0.2])[:, None,
                                                                                          None]
  meta = fp8jax.init_ragged_dot_meta(RECIPE, 3)

  def loss(params, meta):
    y, meta = fp8jax.fp8_ragged_dot(params["x"], params["w"], sizes, meta)
    return jnp.sum(y ** 2), meta

  for gain in GAINS:
    _, _, meta = fp8jax.value_and_grad(loss)({"x": x * gain, "w": w * gain}, meta)
  for g in (0, 2):
    history = np.asarray(meta.kernel.amax_history[g], np.float64)
    np.testing.assert_allclose(float(meta.kernel.scale[g]), _ema_scale(history, 448.0),
                               rtol=1e-6)
  assert float(meta.kernel.scale[1]) == 1.0  # no rows in any step: never recorded
  _assert_ema_scales(fp8jax.DotMeta(x=meta.x, kernel=dataclasses.replace(
      meta.kernel, scale=meta.kernel.scale[0], amax_history=meta.kernel.amax_history[0]),
      grad=meta.grad))
