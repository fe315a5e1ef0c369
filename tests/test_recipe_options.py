"""DelayedScaling / CurrentScaling options: power_of_two and high_precision; recipe validation.

References are float64 numpy (tests/fp8_reference.py); tolerances are derived
from the formats as in tests/test_dense_numerics.py: an element of a tensor with
scale s carries at most max(u |x|, min_subnormal / 2 / s) of error (u = 2**-4 for
E4M3, 2**-3 for E5M2), which over a dot product gives
sum_i (ea_i |b_i| + |a_i| eb_i + ea_i eb_i); a GEMM run in high precision on
float32 inputs has no quantization error, only float32 accumulation.
"""
import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp8jax
import fp8jax.checkpoint as ckpt
from fp8_reference import FORMAT_TABLE, quantize_reference, simulate_delayed_scaling


def pow2_floor(value):
  return 2.0**math.floor(math.log2(float(value)))


def test_power_of_two_scale_is_rounded_down_keeps_amax_in_range_and_has_an_exact_inverse():
  rng = np.random.default_rng(0)
  amaxes = (rng.uniform(1, 2, 200) * 10.0**rng.uniform(-6, 6, 200)).astype(np.float32)
  for fmt in (fp8jax.E4M3, fp8jax.E5M2):
    for margin in (0, 2):
      got = np.asarray(jax.vmap(lambda a: fp8jax.scale_from_amax(
          a, fmt, margin, jnp.float32(1), power_of_two=True))(jnp.asarray(amaxes)))
      unrounded = np.float32(fmt.max / 2.0**margin) / amaxes  # float32, as fp8jax
      np.testing.assert_array_equal(got, [pow2_floor(s) for s in unrounded])
      assert np.all(amaxes.astype(np.float64) * got <= fmt.max / 2.0**margin)
      assert np.all(got * (np.float32(1) / got) == 1)  # the descale is exact


def test_delayed_power_of_two_end_step_follows_the_reference_rounded_down():
  recipe = fp8jax.DelayedScaling(amax_history_len=3, power_of_two=True)
  amaxes = [3.0, 0.7, 100.0, 0.0, float("nan"), 0.02]
  scales, _ = simulate_delayed_scaling(amaxes, 3, "max", 0, 448.0)
  meta = fp8jax.init_meta(recipe, fp8jax.E4M3)
  for step, a in enumerate(amaxes):
    assert float(meta.scale) == (pow2_floor(scales[step]) if step else 1.0), step
    assert float(meta.scale_inv) == 1.0 / float(meta.scale)
    meta = fp8jax.end_step(dataclasses.replace(meta, amax=jnp.float32(a)))


def _problem(seed, m=48, k=64, n=40):
  keys = jax.random.split(jax.random.key(seed), 3)
  x = jax.random.normal(keys[0], (m, k), jnp.float32)
  kernel = jax.random.normal(keys[1], (k, n), jnp.float32) / np.sqrt(k)
  g = jax.random.normal(keys[2], (m, n), jnp.float32)
  return x, kernel, g


@jax.jit
def _dense_vjp(x, kernel, g, meta):
  y, vjp = jax.vjp(lambda x, k: fp8jax.fp8_dense(x, k, None, meta)[0], x, kernel)
  return (y, *vjp(g))


def _warm_meta(recipe, x, kernel, g):
  """Delayed scales from the tensors' own amaxes (as after warm-up), by the recipe's rule."""
  meta = fp8jax.init_dot_meta(recipe)
  for role, t in (("x", x), ("kernel", kernel), ("grad", g)):
    r = getattr(meta, role)
    scale = fp8jax.scale_from_amax(fp8jax.amax(t), r.fmt, recipe.margin, r.scale,
                                   power_of_two=recipe.power_of_two)
    meta = dataclasses.replace(meta, **{role: r.with_scale(scale)})
  return meta


OPTION_RECIPES = {
    f"{kind.__name__}-{name}": kind(**options)
    for kind in (fp8jax.DelayedScaling, fp8jax.CurrentScaling)
    for name, options in (("pow2", dict(power_of_two=True)),
                          ("hp_fprop", dict(high_precision=("fprop",))),
                          ("hp_dgrad", dict(high_precision=("dgrad",))),
                          ("hp_wgrad", dict(high_precision=("wgrad",))))}


@pytest.mark.parametrize("recipe", OPTION_RECIPES.values(), ids=list(OPTION_RECIPES))
def test_fp8_dense_with_options_matches_float64_within_format_bounds(recipe):
  x, kernel, g = _problem(1)
  meta = _warm_meta(recipe, x, kernel, g)
  y, dx, dk = (np.asarray(t, np.float64) for t in _dense_vjp(x, kernel, g, meta))
  x64, k64, g64 = (np.asarray(t, np.float64) for t in (x, kernel, g))

  def scale(role, t):
    if isinstance(recipe, fp8jax.DelayedScaling):
      return float(getattr(meta, role).scale)
    fmt = getattr(meta, role).fmt
    s = np.float32(fmt.max) / np.float32(np.max(np.abs(t)))
    return pow2_floor(s) if recipe.power_of_two else float(s)

  def element_error(t, role, gemm):
    if gemm in recipe.high_precision:
      return np.zeros_like(t)
    name = getattr(meta, role).fmt.name
    u = 2.0**-(FORMAT_TABLE[name]["mantissa_bits"] + 1)
    return np.maximum(u * np.abs(t), FORMAT_TABLE[name]["min_subnormal"] / 2 / scale(role, t))

  for got, gemm, (a, a_role), (b, b_role) in (
      (y, "fprop", (x64, "x"), (k64, "kernel")),
      (dx, "dgrad", (g64, "grad"), (k64.T, "kernel")),
      (dk, "wgrad", (x64.T, "x"), (g64, "grad"))):
    ea, eb = element_error(a, a_role, gemm), element_error(b, b_role, gemm)
    # float32 accumulation of K <= 64 terms and the descale/output roundings:
    # (K + 4) * 2**-24 < 1e-5 of sum |a||b|.
    slack = 1e-5 * (np.abs(a) @ np.abs(b))
    bound = ea @ np.abs(b) + np.abs(a) @ eb + ea @ eb + slack
    assert np.all(np.abs(got - a @ b) <= bound), (gemm, np.max(np.abs(got - a @ b) / bound))


def test_current_power_of_two_equals_the_exact_arithmetic_reference():
  x, kernel, g = _problem(2)
  y, dx, dk = _dense_vjp(x, kernel, g, fp8jax.init_dot_meta(
      fp8jax.CurrentScaling(power_of_two=True)))
  s = {name: pow2_floor(np.float32(FORMAT_TABLE[fmt]["max"]) / np.max(np.abs(np.asarray(t))))
       for name, t, fmt in (("x", x, "e4m3"), ("k", kernel, "e4m3"), ("g", g, "e5m2"))}
  qx = quantize_reference(np.asarray(x), s["x"], "e4m3") / s["x"]
  qk = quantize_reference(np.asarray(kernel), s["k"], "e4m3") / s["k"]
  qg = quantize_reference(np.asarray(g), s["g"], "e5m2") / s["g"]
  # Power-of-two descales are exact: only float32 accumulation of K <= 64 terms
  # ((K - 1) * 2**-24 < 1e-5 relative to sum |a||b|) and the output rounding remain.
  for got, a, b in ((y, qx, qk), (dx, qg, qk.T), (dk, qx.T, qg)):
    got = np.asarray(got, np.float64)
    assert np.all(np.abs(got - a @ b) <= 1e-5 * (np.abs(a) @ np.abs(b)))


@pytest.mark.parametrize("kind", [fp8jax.DelayedScaling, fp8jax.CurrentScaling])
def test_all_gemms_in_high_precision_equal_a_plain_bf16_dense_exactly(kind):
  x, kernel, g = (t.astype(jnp.bfloat16) for t in _problem(3))
  meta = fp8jax.init_dot_meta(kind(high_precision=("fprop", "dgrad", "wgrad")))
  got = _dense_vjp(x, kernel, g, meta)
  y, vjp = jax.vjp(lambda x, k: x @ k, x, kernel)
  for a, b in zip(got, (y, *vjp(g))):
    assert a.dtype == b.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@pytest.mark.parametrize("kind", [fp8jax.DelayedScaling, fp8jax.CurrentScaling])
def test_high_precision_wgrad_is_the_bf16_wgrad_and_dx_stays_fp8(kind):
  x, kernel, g = (t.astype(jnp.bfloat16) for t in _problem(4))
  _, dx, dk = _dense_vjp(x, kernel, g, fp8jax.init_dot_meta(kind(high_precision=("wgrad",))))
  _, fp8_dx, fp8_dk = _dense_vjp(x, kernel, g, fp8jax.init_dot_meta(kind()))
  np.testing.assert_array_equal(np.asarray(dk, np.float32), np.asarray(x.T @ g, np.float32))
  np.testing.assert_array_equal(np.asarray(dx, np.float32), np.asarray(fp8_dx, np.float32))
  assert not np.array_equal(np.asarray(dk, np.float32), np.asarray(fp8_dk, np.float32))


def test_high_precision_gemms_still_record_every_roles_amax():
  x, kernel, g = _problem(5)
  recipe = fp8jax.CurrentScaling(high_precision=("fprop", "dgrad", "wgrad"))

  def loss(params, fp8_state):
    y, meta = fp8jax.fp8_dense(params["x"], params["k"], None, fp8_state)
    return jnp.sum(y * g), meta  # output gradient = g

  _, _, state = jax.jit(fp8jax.value_and_grad(loss))({"x": x, "k": kernel},
                                                     fp8jax.init_dot_meta(recipe))
  for role, t in (("x", x), ("kernel", kernel), ("grad", g)):
    assert float(getattr(state, role).amax_history[0]) == float(jnp.max(jnp.abs(t))), role


# ----- Recipe fields: validation, normalization, checkpoints ------------------------------


@pytest.mark.parametrize("make,match", [
    (lambda: fp8jax.DelayedScaling(high_precision=("wgrad", "bprop")),
     r"names 'bprop'.*\('fprop', 'dgrad', 'wgrad'\)"),
    (lambda: fp8jax.CurrentScaling(high_precision="wgrad"), r"a tuple \('wgrad',\)"),
    (lambda: fp8jax.RowwiseScaling(high_precision=("wgrad", "wgrad")), "names a GEMM twice"),
    (lambda: fp8jax.DelayedScaling(power_of_two=1), "power_of_two=1 must be True or False"),
    (lambda: fp8jax.BlockScaling(block_size=100), "block_size=100 must be a positive multiple of 16"),
    (lambda: fp8jax.BlockScaling(block_size=0), "block_size=0 must be a positive multiple"),
    (lambda: fp8jax.BlockScaling(gemm="cutlass"), "gemm='cutlass' is not supported"),
    (lambda: fp8jax.BlockScaling(block_size=64, gemm="pallas_hopper"),
     "block_size=128, fp8_format='e4m3', or gemm='emulated'"),
    (lambda: fp8jax.MXFP8Scaling(fp8_format="hybrid"),
     r"fp8_format='hybrid' is not an MXFP8 element format.*\['e4m3', 'e5m2'\]"),
    (lambda: fp8jax.RowwiseScaling(fp8_format="e5m2"), "fp8_format='e5m2' is not a known"),
])
def test_bad_recipe_fields_are_refused_naming_the_field_and_the_fix(make, match):
  with pytest.raises(ValueError, match=match):
    make()


def test_high_precision_from_json_list_becomes_the_same_hashable_recipe():
  a = fp8jax.DelayedScaling(high_precision=["wgrad"])
  b = fp8jax.DelayedScaling(high_precision=("wgrad",))
  assert a == b and hash(a) == hash(b) and a.high_precision == ("wgrad",)


def test_default_recipes_describe_as_before_so_older_checkpoints_still_match():
  assert ckpt.describe_recipe(fp8jax.CurrentScaling()) == {
      "kind": "CurrentScaling", "margin": 0, "fp8_format": "hybrid"}


@pytest.mark.parametrize("recipe", [
    fp8jax.DelayedScaling(amax_history_len=4, power_of_two=True, high_precision=("wgrad",)),
    fp8jax.CurrentScaling(high_precision=("fprop", "dgrad")),
], ids=["delayed", "current"])
def test_checkpoint_restores_recipes_with_options(tmp_path, recipe):
  fp8_state = {"l1": fp8jax.init_dot_meta(recipe)}
  params = {"w": jnp.ones((2, 2))}
  path = ckpt.save(tmp_path / "c", params=params, opt_state={}, fp8_state=fp8_state)
  restored = ckpt.restore(path, params=params, opt_state={}, fp8_state=fp8_state)
  assert restored["fp8_state"]["l1"].kernel.recipe == recipe
  # A target without the options is refused, naming the field.
  plain = {"l1": fp8jax.init_dot_meta(dataclasses.replace(recipe, high_precision=()))}
  with pytest.raises(ValueError, match="high_precision: checkpoint"):
    ckpt.restore(path, params=params, opt_state={}, fp8_state=plain)


@pytest.mark.parametrize("recipe", [
    fp8jax.CurrentScaling(high_precision=("fprop", "dgrad", "wgrad")),
    fp8jax.RowwiseScaling(high_precision=("fprop", "dgrad", "wgrad")),
    fp8jax.DelayedScaling(high_precision=("wgrad",)),
], ids=["current", "rowwise", "delayed_wgrad"])
def test_high_precision_gemms_keep_the_dtypes_of_the_fp8_path(recipe):
  # bf16 activations with a float32 kernel: the output and dx are bf16 and dk is
  # float32, as on the FP8 path (a high-precision GEMM runs in the activation's dtype).
  x = jax.random.normal(jax.random.key(0), (32, 64), jnp.bfloat16)
  kernel = jax.random.normal(jax.random.key(1), (64, 48), jnp.float32)
  meta = fp8jax.init_dot_meta(recipe)

  def loss(x, kernel):
    y, _ = fp8jax.fp8_dense(x, kernel, None, meta)
    return jnp.sum(y.astype(jnp.float32)), y

  (_, y), (dx, dk) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(x, kernel)
  assert (y.dtype, dx.dtype, dk.dtype) == (jnp.bfloat16, jnp.bfloat16, jnp.float32)
