"""Delayed and current scaling follow the numerics contract step by step."""
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp8jax
from fp8jax.core.meta import record_amax
from fp8jax.ops.cast import quantize_with_meta
from fp8_reference import simulate_delayed_scaling

# Known amaxes per step, including 0, inf and NaN (which must leave the scale alone).
SCRIPTED_AMAXES = [3.0, 0.5, 10.0, 0.0, 2.5, np.inf, 1.25, np.nan, 7.0, 0.75,
                   0.1, 40.0, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9]


def _run_steps(recipe, amaxes):
  meta = fp8jax.init_meta(recipe, recipe.forward_format)
  scales_used, histories = [], []
  step = jax.jit(lambda m, a: fp8jax.end_step(record_amax(fp8jax.begin_step(m), a)))
  for a in amaxes:
    scales_used.append(float(meta.scale))
    meta = step(meta, jnp.float32(a))
    histories.append(np.asarray(meta.amax_history).tolist())
  return scales_used, histories, meta


@pytest.mark.parametrize("history_len,algo,margin",
                         list(itertools.product([1, 4, 16], ["max", "most_recent"], [0, 2])))
def test_delayed_scaling_matches_contract(history_len, algo, margin):
  recipe = fp8jax.DelayedScaling(history_len, algo, margin)
  scales, histories, _ = _run_steps(recipe, SCRIPTED_AMAXES)
  want_scales, want_histories = simulate_delayed_scaling(
      SCRIPTED_AMAXES, history_len, algo, margin, 448.0)
  np.testing.assert_array_equal(scales, np.float32(want_scales))
  np.testing.assert_array_equal(histories, np.float32(want_histories))


def test_delayed_scaling_hand_computed_values():
  # L = 4, "max", margin 1: written out by hand from the contract.
  recipe = fp8jax.DelayedScaling(4, "max", 1)
  scales, histories, _ = _run_steps(recipe, [2.0, 8.0, 1.0, 0.0, np.nan, 4.0, 1.0, 1.0, 1.0])
  # 224 = 448 / 2**1. The 8 leaves the 4-step window after step 4, so step 5 (amax 4) gives 56.
  assert scales == [1.0, 112.0, 28.0, 28.0, 28.0, 28.0, 56.0, 56.0, 56.0]
  assert histories[3] == [0.0, 1.0, 8.0, 2.0]          # amax 0 recorded, scale kept
  assert histories[4] == [0.0, 0.0, 1.0, 8.0]          # NaN recorded as 0, scale kept
  assert histories[8] == [1.0, 1.0, 1.0, 4.0]


@pytest.mark.parametrize("bad", [0.0, np.inf, -np.inf, np.nan])
def test_unusable_amax_keeps_scale_and_history_finite(bad):
  recipe = fp8jax.DelayedScaling(4, "most_recent")
  _, _, meta = _run_steps(recipe, [5.0])
  before = float(meta.scale)
  after = fp8jax.end_step(record_amax(fp8jax.begin_step(meta), jnp.float32(bad)))
  assert float(after.scale) == before
  assert np.all(np.isfinite(np.asarray(after.amax_history)))


def test_tiny_amax_never_gives_an_infinite_scale():
  recipe = fp8jax.DelayedScaling(1)
  _, _, meta = _run_steps(recipe, [1e-45])  # 448 / 1e-45 overflows float32
  assert float(meta.scale) == 1.0


def test_current_scaling_scale_comes_from_the_tensor_itself():
  recipe = fp8jax.CurrentScaling(margin=1)
  meta = fp8jax.init_meta(recipe, fp8jax.E4M3)
  x = jnp.array([0.5, -3.0, 1.0], jnp.float32)
  q, scale, new_meta = quantize_with_meta(x, meta)
  assert float(scale) == np.float32(448.0 / 2) / np.float32(3.0)
  assert float(new_meta.amax) == 3.0
  assert np.asarray(q.astype(jnp.float32))[1] == -224.0


@pytest.mark.parametrize("kwargs,match", [
    (dict(amax_compute_algo="mean"), "amax_compute_algo"),
    (dict(amax_history_len=0), "amax_history_len"),
    (dict(margin=-1), "margin"),
    (dict(fp8_format="e5m2"), "fp8_format"),
])
def test_unknown_recipe_option_is_rejected(kwargs, match):
  with pytest.raises(ValueError, match=match):
    fp8jax.DelayedScaling(**kwargs)


def test_recipes_are_hashable_static_jit_arguments():
  calls = []

  @jax.jit
  def f(x, meta):
    calls.append(1)
    return fp8jax.end_step(fp8jax.begin_step(meta)).scale * x

  meta = fp8jax.init_meta(fp8jax.DelayedScaling(8), fp8jax.E4M3)
  f(1.0, meta)
  f(2.0, jax.tree.map(lambda a: a + 1, meta))  # new values, same recipe: no retrace
  assert len(calls) == 1
  assert hash(fp8jax.DelayedScaling()) == hash(fp8jax.DelayedScaling())
