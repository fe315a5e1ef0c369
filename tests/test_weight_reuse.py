"""Under gradient accumulation each FP8 kernel is quantized once per step, never reused wrongly.

`fp8jax.accumulate_gradients` quantizes every FP8 kernel once, outside its
microbatch loop, and the loop reuses those FP8 copies (`fp8jax.weight_reuse`).
The results must be exactly those of quantizing the kernel in every microbatch,
for any parameters, and a copy must only ever serve the array it came from.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp8jax
from fp8jax import deviceless, weight_reuse
from fp8jax.lowering.cost import cost

RECIPES = {"delayed": fp8jax.DelayedScaling(amax_history_len=4), "current": fp8jax.CurrentScaling()}


def _loss(params, fp8_state, batch):
  h, m1 = fp8jax.fp8_dense(batch["x"], params["w1"], None, fp8_state["l1"])
  y, m2 = fp8jax.fp8_dense(jax.nn.gelu(h), params["w2"], None, fp8_state["l2"])
  return jnp.mean((y.astype(jnp.float32) - batch["t"]) ** 2), {"l1": m1, "l2": m2}


def _loss_with_computed_kernels(params, fp8_state, batch):
  # The kernels are computed inside the loss (equal values, new arrays in every
  # microbatch): nothing can be reused, every microbatch quantizes them.
  return _loss(jax.tree.map(lambda w: w * 1.0, params), fp8_state, batch)


def _problem(seed, n_micro=3):
  keys = jax.random.split(jax.random.key(seed), 4)
  params = {"w1": jax.random.normal(keys[0], (32, 64), jnp.float32) / 6,
            "w2": jax.random.normal(keys[1], (64, 16), jnp.float32) / 8}
  batch = {"x": jax.random.normal(keys[2], (n_micro, 24, 32), jnp.float32),
           "t": jax.random.normal(keys[3], (n_micro, 24, 16), jnp.float32)}
  return params, batch


def _assert_bitwise(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("recipe", RECIPES.values(), ids=RECIPES.keys())
def test_accumulation_equals_quantizing_in_every_microbatch_for_any_params(recipe):
  fp8_state = {"l1": fp8jax.init_dot_meta(recipe), "l2": fp8jax.init_dot_meta(recipe)}
  reusing = jax.jit(lambda p, s, b: fp8jax.accumulate_gradients(_loss, p, s, b))
  requantizing = jax.jit(
      lambda p, s, b: fp8jax.accumulate_gradients(_loss_with_computed_kernels, p, s, b))
  # The same compiled step with other parameters (and a state that moved on):
  # no FP8 copy from the first call may reach the second.
  for seed in (0, 1, 2):
    params, batch = _problem(seed)
    got, want = reusing(params, fp8_state, batch), requantizing(params, fp8_state, batch)
    _assert_bitwise(got, want)
    fp8_state = got[2]
  # The reusing step did learn something per call: the states of the calls differ.
  assert float(fp8_state["l1"].kernel.amax_history[0]) == float(
      fp8jax.amax(_problem(2)[0]["w1"]))


def test_a_recorded_quantization_serves_only_the_array_it_came_from():
  meta = fp8jax.init_dot_meta(RECIPES["delayed"]).kernel
  w, other = jnp.ones((16, 16)), jnp.ones((16, 16))
  with weight_reuse.collecting() as cache:
    cache.add(w, meta, ("q", "q_t", "amax", "scale_inv"))
    cache.add(w, meta, ("q2", "q_t2", "amax2", "scale_inv2"))
  with weight_reuse.replaying(cache) as replay:
    assert replay.take(other, meta) is None             # equal values, another array
    assert replay.take(w, meta) == ("q2", "q_t2", "amax2", "scale_inv2")  # position 2
    assert replay.take(w, meta) is None                 # nothing left
  other_recipe = fp8jax.init_dot_meta(fp8jax.DelayedScaling(amax_history_len=8)).kernel
  with weight_reuse.replaying(cache) as replay:
    assert replay.take(w, other_recipe) is None
  assert weight_reuse.current() is None


_MISSING = deviceless.deviceless_toolchain_missing()


@pytest.mark.hopper
@pytest.mark.skipif(_MISSING is not None, reason=str(_MISSING))
def test_h100_program_quantizes_each_kernel_once_per_step_not_per_microbatch():
  n_micro, layers = 4, 2
  spec = jax.ShapeDtypeStruct
  params = {"w1": spec((1024, 1024), jnp.bfloat16), "w2": spec((1024, 1024), jnp.bfloat16)}
  batch = {"x": spec((n_micro, 512, 1024), jnp.bfloat16), "t": spec((n_micro, 512, 1024), jnp.float32)}
  state = jax.eval_shape(lambda: {"l1": fp8jax.init_dot_meta(RECIPES["delayed"]),
                                  "l2": fp8jax.init_dot_meta(RECIPES["delayed"])})
  report = cost(lambda p, s, b: fp8jax.accumulate_gradients(_loss, p, s, b), params, state,
                batch, target="deviceless")
  casts = [k for k in report.kernels if "cast_transpose_amax" in k.op_name]
  once = sum(k.launches for k in casts if k.launches == 1)
  per_microbatch = sum(k.launches for k in casts if k.launches == n_micro)
  # One cast of each kernel per step; x and the output gradient of each layer in
  # every microbatch.
  assert once == layers, report.table()
  assert per_microbatch == 2 * layers * n_micro, report.table()
