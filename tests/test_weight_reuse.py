"""Under gradient accumulation each FP8 kernel is quantized once per step, never reused wrongly.

`fp8jax.accumulate_gradients` quantizes every FP8 kernel once, outside its
microbatch loop, and the loop reuses those FP8 copies (`fp8jax.ops.weight_reuse`).
The results must be exactly those of quantizing the kernel in every microbatch,
for any parameters, and a copy must only ever serve the array it came from.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp8jax
from fp8jax import deviceless
from fp8jax.ops import weight_reuse
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


def _kernel_casts_in_scan_body(fn, *args):
  """How many FP8 casts of a kernel-shaped array the microbatch loop's body holds.

  The GPU kernels' own bodies (pallas_call, whose tiles may have any shape) are
  not looked into: the jnp path stands for both.
  """
  jaxpr = jax.make_jaxpr(fn)(*args)
  kernel_shapes = {(32, 64), (64, 16)}
  found = []

  def walk(jaxpr, in_scan):
    for eqn in jaxpr.eqns:
      if (in_scan and eqn.primitive.name == "convert_element_type" and
          jnp.dtype(eqn.params["new_dtype"]).itemsize == 1 and
          tuple(eqn.invars[0].aval.shape) in kernel_shapes):
        found.append(eqn)
      if eqn.primitive.name == "pallas_call":
        continue
      for sub in _subjaxprs(eqn):
        walk(sub, in_scan or eqn.primitive.name == "scan")

  walk(jaxpr.jaxpr, False)
  return len(found)


def _subjaxprs(eqn):
  for value in eqn.params.values():
    for item in value if isinstance(value, (list, tuple)) else [value]:
      inner = getattr(item, "jaxpr", None)
      if inner is not None:
        yield inner if hasattr(inner, "eqns") else inner.jaxpr
      elif hasattr(item, "eqns"):
        yield item


@pytest.mark.parametrize("loss_fn,reused", [(_loss, True), (_loss_with_computed_kernels, False)],
                         ids=["param_kernels", "computed_kernels"])
def test_the_microbatch_loop_quantizes_kernels_only_when_they_cannot_be_reused(loss_fn, reused):
  params, batch = _problem(0)
  fp8_state = {"l1": fp8jax.init_dot_meta(RECIPES["delayed"]),
               "l2": fp8jax.init_dot_meta(RECIPES["delayed"])}
  casts = _kernel_casts_in_scan_body(
      lambda p, s, b: fp8jax.accumulate_gradients(loss_fn, p, s, b), params, fp8_state, batch)
  assert (casts == 0) if reused else (casts >= 2), casts


def _loss_in_nested_traces(params, fp8_state, batch):
  """The same two layers, the first inside a lax.scan, the second under remat and a cond."""
  def first(carry, _):
    h, m = fp8jax.fp8_dense(batch["x"], params["w1"], None, carry)
    return m, h
  m1, hs = jax.lax.scan(first, fp8_state["l1"], None, length=1)

  @jax.checkpoint
  def second(h, meta):
    return jax.lax.cond(jnp.all(jnp.isfinite(h)),
                        lambda: fp8jax.fp8_dense(h, params["w2"], None, meta),
                        lambda: fp8jax.fp8_dense(h * 0, params["w2"], None, meta))
  y, m2 = second(jax.nn.gelu(hs[0]), fp8_state["l2"])
  return jnp.mean((y.astype(jnp.float32) - batch["t"]) ** 2), {"l1": m1, "l2": m2}


def test_kernels_used_inside_scan_remat_or_cond_of_the_loss_are_quantized_where_used():
  params, batch = _problem(3)
  fp8_state = {"l1": fp8jax.init_dot_meta(RECIPES["delayed"]),
               "l2": fp8jax.init_dot_meta(RECIPES["delayed"])}
  loss, grads, state = jax.jit(
      lambda p, s, b: fp8jax.accumulate_gradients(_loss_in_nested_traces, p, s, b))(
          params, fp8_state, batch)
  want = jax.jit(lambda p, s, b: fp8jax.accumulate_gradients(_loss, p, s, b))(
      params, fp8_state, batch)
  _assert_bitwise((loss, grads, state), want)


def test_a_recorded_quantization_serves_only_the_array_it_came_from():
  meta = fp8jax.init_dot_meta(RECIPES["delayed"]).kernel
  w, other = jnp.ones((16, 16)), jnp.ones((16, 16))
  with weight_reuse.collecting() as cache:
    cache.add(w, meta, ("q", "q_t", "amax", "scale_inv"))
    cache.add(w, meta, ("q2", "q_t2", "amax2", "scale_inv2"))
  with weight_reuse.replaying(cache) as replay:
    assert replay.applies_here()  # traced at the level the replay began
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
