"""Flax `fp8_ops` state <-> fp8jax metas, checked against Flax's own fp8_ops on the same inputs."""
import functools
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp8jax
from fp8jax.flax import from_flax_fp8_ops, to_flax_fp8_ops
from fp8jax.flax import linen as fp8nn
from fp8jax.flax.fp8_ops_state import FLAX_COLLECTION, flax_recipe

HISTORY = 4
STEPS = HISTORY + 3  # more steps than the history holds: Flax's rotation wraps around


class FlaxModel(nn.Module):
  op: type = nn.Fp8DirectDotGeneralOp
  dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x):
    op = functools.partial(self.op, amax_history_length=HISTORY)
    dense = functools.partial(nn.Dense, dot_general_cls=op, dtype=self.dtype,
                              param_dtype=self.dtype)
    return dense(48)(dense(64)(x))


class Fp8jaxModel(nn.Module):
  dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x):
    op = functools.partial(fp8nn.Fp8DotGeneral, recipe=flax_recipe(HISTORY))
    dense = functools.partial(nn.Dense, dot_general_cls=op, dtype=self.dtype,
                              param_dtype=self.dtype)
    return dense(48)(dense(64)(x))


def _inputs(step, dtype=jnp.float32):
  # A different amax every step, so that the history's order matters.
  x = jax.random.normal(jax.random.key(step), (8, 32)) * (1.0 + step)
  return x.astype(dtype)


# A loss linear in the output: its gradient (and so the recorded gradient amax)
# does not depend on FP8 rounding in the forward pass, so both libraries record
# the very same amaxes.
_W = jax.random.normal(jax.random.key(99), (8, 48))


def _flax_step(model, params, flax_state, x):
  """One Flax step, overwrite-with-gradient: the state's cotangent is its next value."""

  def loss_fn(owg):
    y = model.apply({"params": params, FLAX_COLLECTION: owg}, x)
    return jnp.sum(y.astype(jnp.float32) * _W), y

  grads, y = jax.grad(loss_fn, has_aux=True)(flax_state)
  return grads, y


def _flax_param_grads(model, params, flax_state, x):
  """The parameter gradients of one Flax step (the state's cotangent is its next value)."""

  def loss_fn(params):
    y = model.apply({"params": params, FLAX_COLLECTION: flax_state}, x)
    return jnp.sum(y.astype(jnp.float32) * _W)

  return jax.grad(loss_fn)(params)


def _fp8jax_step(model, params, fp8_state, x):

  def loss_fn(params, fp8_state):
    y, updates = model.apply({"params": params, "fp8_meta": fp8_state}, x, mutable=["fp8_meta"])
    return jnp.sum(y.astype(jnp.float32) * _W), updates["fp8_meta"]

  _, grads, next_state = fp8jax.value_and_grad(loss_fn)(params, fp8_state)
  y = model.apply({"params": params, "fp8_meta": fp8_state}, x)
  return next_state, y, grads


def _run(op=nn.Fp8DirectDotGeneralOp, dtype=jnp.float32):
  """STEPS steps of each library on the same inputs and params, from fresh state."""
  x0 = _inputs(0, dtype)
  flax_model, fp8jax_model = FlaxModel(op, dtype), Fp8jaxModel(dtype)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)  # Fp8DotGeneralOp is deprecated
    flax_variables = flax_model.init(jax.random.key(1), x0)
  params = flax_variables["params"]
  fp8_state = fp8jax_model.init(jax.random.key(1), x0)["fp8_meta"]
  flax_state = flax_variables[FLAX_COLLECTION]
  for step in range(STEPS):
    flax_state, _ = _flax_step(flax_model, params, flax_state, _inputs(step, dtype))
    fp8_state, _, _ = _fp8jax_step(fp8jax_model, params, fp8_state, _inputs(step, dtype))
  return flax_model, fp8jax_model, params, flax_state, fp8_state


@pytest.fixture(scope="module")
def runs():
  return _run()


def _metas(state):
  return jax.tree.leaves(state, is_leaf=lambda n: isinstance(n, fp8jax.Fp8Meta))


def test_same_params_tree_so_the_state_fits_the_same_model(runs):
  flax_model, fp8jax_model, params, flax_state, fp8_state = runs
  converted = from_flax_fp8_ops(flax_state)
  assert jax.tree.structure(converted, is_leaf=lambda n: isinstance(n, fp8jax.DotMeta)) == \
      jax.tree.structure(fp8_state, is_leaf=lambda n: isinstance(n, fp8jax.DotMeta))


def test_converted_flax_state_equals_fp8jax_state_after_the_same_steps(runs):
  # Same inputs, same params, same steps: the converted Flax state is fp8jax's own
  # state bit for bit (histories newest first, the next step's scale).
  _, _, _, flax_state, fp8_state = runs
  converted = from_flax_fp8_ops(flax_state)
  for got, want in zip(_metas(converted), _metas(fp8_state), strict=True):
    np.testing.assert_array_equal(got.amax_history, want.amax_history)
    np.testing.assert_array_equal(got.scale, want.scale)
    np.testing.assert_array_equal(got.scale_inv, want.scale_inv)
    assert got.recipe == want.recipe and got.fmt == want.fmt
    assert np.all(np.asarray(got.amax_history) > 0)  # every slot filled by a real amax


def test_round_trip_to_flax_continues_exactly_like_flax(runs):
  # Flax -> fp8jax -> Flax, then one more Flax step: the same output and the same
  # next state as the Flax run that was never converted.
  flax_model, _, params, flax_state, _ = runs
  round_trip = to_flax_fp8_ops(from_flax_fp8_ops(flax_state))
  for got, want in zip(jax.tree.leaves(round_trip["Dense_0"]),
                       jax.tree.leaves(flax_state["Dense_0"])):
    assert got.shape == want.shape
  x = _inputs(STEPS)
  want_state, want_y = _flax_step(flax_model, params, flax_state, x)
  got_state, got_y = _flax_step(flax_model, params, round_trip, x)
  np.testing.assert_array_equal(got_y, want_y)
  for path, got in jax.tree_util.tree_leaves_with_path(got_state):
    if "amax_history" in jax.tree_util.keystr(path):
      want = dict(jax.tree_util.tree_leaves_with_path(want_state))[path]
      np.testing.assert_array_equal(got, want)


def test_switching_library_mid_run_gives_flax_next_step_output(runs):
  # Continue in fp8jax from converted Flax state: the same scales as Flax's next
  # step, so the output matches Flax's up to how each applies the scale (Flax
  # divides by 1/s, fp8jax multiplies by s: a float32 ulp that can move an
  # element across an FP8 rounding boundary, one E4M3 step = 2^-3 relative on that
  # element). Over 32-term dot products that stays far below 1% of the output.
  flax_model, fp8jax_model, params, flax_state, _ = runs
  x = _inputs(STEPS)
  _, flax_y = _flax_step(flax_model, params, flax_state, x)
  _, fp8jax_y, _ = _fp8jax_step(fp8jax_model, params, from_flax_fp8_ops(flax_state), x)
  scale = float(jnp.max(jnp.abs(flax_y)))
  np.testing.assert_allclose(fp8jax_y, flax_y, rtol=0, atol=1e-2 * scale)


@pytest.mark.parametrize("recipe", [
    fp8jax.DelayedScaling(margin=1), fp8jax.DelayedScaling(power_of_two=True),
    fp8jax.DelayedScaling(high_precision=("wgrad",)), fp8jax.CurrentScaling()],
    ids=["margin", "power_of_two", "high_precision", "current"])
def test_to_flax_refuses_recipes_flax_does_not_run(recipe):
  # Flax's fp8_ops would run plain delayed scaling: converting would change the recipe.
  meta = fp8jax.init_dot_meta(recipe)
  with pytest.raises(ValueError, match="margin=0, fp8_format='hybrid', power_of_two=False"):
    to_flax_fp8_ops({"Dense_0": {"Fp8DotGeneral_0": {"dot_meta": meta}}})


def test_conversions_refuse_what_flax_cannot_hold():
  with pytest.raises(ValueError, match="holds exactly"):
    from_flax_fp8_ops({"Dense_0": {"Fp8DirectDotGeneralOp_0": {"input_scale": jnp.ones(1)}}})
  with pytest.raises(TypeError, match="flax_state must be"):
    from_flax_fp8_ops([1, 2])
  with pytest.raises(ValueError, match=r"whole variables dict; pass .*_overwrite_with_gradient"):
    from_flax_fp8_ops({"params": {}, "_overwrite_with_gradient": {}})


def test_layers_stacked_by_scan_convert_per_layer():
  # Under nn.scan each role's history is [layers, L] and its scale [layers]; the
  # conversion works per layer on the last axis, the same as layer by layer.
  recipe = flax_recipe(HISTORY)
  rng = np.random.default_rng(0)
  layers = []
  for _ in range(3):
    meta = fp8jax.init_dot_meta(recipe)
    layers.append(jax.tree.map(
        lambda a: jnp.asarray(rng.uniform(0.5, 4.0, np.shape(a)), jnp.float32), meta))
  layers = [fp8jax.DotMeta(**{r: getattr(m, r).with_scale(getattr(m, r).scale)
                              for r in ("x", "kernel", "grad")}) for m in layers]
  stacked = jax.tree.map(lambda *a: jnp.stack(a), *layers)
  flax_stacked = to_flax_fp8_ops({"Fp8DotGeneral_0": {"dot_meta": stacked}})
  for i, layer in enumerate(layers):
    one = to_flax_fp8_ops({"Fp8DotGeneral_0": {"dot_meta": layer}})
    for name, value in one["Fp8DirectDotGeneralOp_0"].items():
      np.testing.assert_array_equal(flax_stacked["Fp8DirectDotGeneralOp_0"][name][i], value)
  back = from_flax_fp8_ops(flax_stacked)["Fp8DotGeneral_0"]["dot_meta"]
  for role in ("x", "kernel", "grad"):
    np.testing.assert_array_equal(getattr(back, role).amax_history,
                                  getattr(stacked, role).amax_history)


def _relative(got, want) -> float:
  """max |got - want| relative to max |want| over every leaf."""
  return max(float(np.max(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32)))
                   / np.max(np.abs(np.asarray(b, np.float32))))
             for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True))


def _flax_divisors(flax_state):
  """Each role's divisor (Flax's stored scale, the one its last step used), in meta order."""
  return [layer[f"{prefix}_scale"][0]
          for op in (flax_state["Dense_0"], flax_state["Dense_1"])
          for layer in op.values() for prefix in ("input", "kernel", "output_grad")]


def test_in_bf16_the_scales_carry_over_but_the_next_steps_differ_by_percents():
  # What the converters' docstrings state: bf16 keeps the state exact (the scales
  # fp8jax's next step uses are Flax's own next scales, checked against the divisors
  # Flax's next step stores) but not the step, because Flax quantizes, multiplies and
  # descales in bf16 where fp8jax works in float32 and rounds once.
  flax_model, fp8jax_model, params, flax_state, _ = _run(dtype=jnp.bfloat16)
  converted = from_flax_fp8_ops(flax_state)
  x = _inputs(STEPS, jnp.bfloat16)
  flax_next, _ = _flax_step(flax_model, params, flax_state, x)
  for meta, divisor in zip(_metas(converted), _flax_divisors(flax_next), strict=True):
    np.testing.assert_array_equal(1.0 / meta.scale, divisor)  # both 1 / (fp8_max / amax)
  flax_grads = _flax_param_grads(flax_model, params, flax_state, x)
  _, _, fp8jax_grads = _fp8jax_step(fp8jax_model, params, converted, x)
  # Float32 agrees to ~1e-8 on the same model (one flipped FP8 element at most);
  # bf16 moves the largest gradient elements by 7-12% across seeds.
  assert _relative(fp8jax_grads, flax_grads) > 2e-2


@pytest.mark.filterwarnings("ignore:The Fp8DotGeneralOp is deprecated:DeprecationWarning")
def test_with_the_qdq_op_the_state_matches_fp8jax_to_float32_rounding():
  # Flax's Fp8DotGeneralOp multiplies dequantized operands in float32 where fp8jax
  # descales the FP8 product: tensors computed from a product (the second layer's
  # input, the first layer's output gradient) round differently in the last bits,
  # so their amaxes, and the scales from them, agree to a few float32 ulps
  # (2**-20 relative), not bit for bit.
  flax_model, _, params, flax_state, fp8_state = _run(op=nn.Fp8DotGeneralOp)
  converted = from_flax_fp8_ops(flax_state)
  for got, want in zip(_metas(converted), _metas(fp8_state), strict=True):
    np.testing.assert_allclose(got.amax_history, want.amax_history, rtol=2.0**-20)
    np.testing.assert_allclose(got.scale, want.scale, rtol=2.0**-20)
  # The round trip still continues exactly as Flax, named as this op's submodules are.
  round_trip = to_flax_fp8_ops(converted, op_name="Fp8DotGeneralOp")
  x = _inputs(STEPS)
  want_state, want_y = _flax_step(flax_model, params, flax_state, x)
  got_state, got_y = _flax_step(flax_model, params, round_trip, x)
  np.testing.assert_array_equal(got_y, want_y)
  for got, want in zip(jax.tree.leaves(got_state), jax.tree.leaves(want_state), strict=True):
    np.testing.assert_array_equal(got, want)
