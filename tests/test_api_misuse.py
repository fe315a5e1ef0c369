"""Catalogue of API misuse: each gets an exception that names the argument and the fix.

Complements tests/test_bad_input.py (dtypes and shapes of fp8_dense / dot_general /
einsum, stacked or role metas, history length, float64 meta, bad recipes).
What cannot be detected: a `DotMeta` of another layer with the same recipe (all
DotMetas of a recipe look alike; only the Flax modules, which own their state,
can tell), and a kernel of another layer with the same shape.
"""
from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

import fp8jax
from fp8jax.flax import linen as fp8nn

RECIPE = fp8jax.DelayedScaling(amax_history_len=4)
META = fp8jax.init_dot_meta(RECIPE)
X = jnp.ones((4, 8))
K = jnp.ones((8, 3))
PARAMS = {"kernel": K}


def loss_fn(params, meta, x):
  y, meta = fp8jax.fp8_dense(x, params["kernel"], None, meta)
  return jnp.sum(y), meta


# --- quantize / dequantize / init ------------------------------------------------

@pytest.mark.parametrize("fmt", ["e4m3", jnp.float8_e4m3fn, None])
def test_quantize_with_a_name_or_dtype_instead_of_a_format(fmt):
  with pytest.raises(TypeError, match="fmt must be fp8jax.E4M3 or fp8jax.E5M2"):
    fp8jax.quantize(X, jnp.float32(1.0), fmt)


def test_quantize_of_integers():
  with pytest.raises(TypeError, match="x has dtype int32.*astype"):
    fp8jax.quantize(jnp.ones(4, jnp.int32), jnp.float32(1.0), fp8jax.E4M3)


def test_dequantize_of_an_array_that_was_never_quantized():
  with pytest.raises(TypeError, match="q has dtype float32; dequantize takes the FP8 array"):
    fp8jax.dequantize(X, jnp.float32(2.0))


def test_init_meta_with_a_format_name():
  with pytest.raises(TypeError, match="fmt must be fp8jax.E4M3"):
    fp8jax.init_meta(RECIPE, "e5m2")


def test_scale_from_amax_with_negative_margin():
  with pytest.raises(ValueError, match="margin=-1 must be an integer >= 0"):
    fp8jax.scale_from_amax(jnp.float32(2.0), fp8jax.E4M3, -1, jnp.float32(1.0))


@pytest.mark.parametrize("value", [8.0, "8", jnp.int32(8)])
def test_recipe_field_that_is_not_a_python_int(value):
  # A traced or array value cannot be a static recipe field.
  with pytest.raises(ValueError, match="amax_history_len=.* must be an integer >= 1"):
    fp8jax.DelayedScaling(amax_history_len=value)


# --- recipes are static ------------------------------------------------------------

def test_recipe_passed_as_a_traced_jit_argument():
  def make(recipe, x):
    return fp8jax.init_dot_meta(recipe).x.scale * x
  # JAX's own message names the argument and the fix (static_argnames).
  with pytest.raises(TypeError, match="(?s)DelayedScaling.*at path recipe.*static"):
    jax.jit(make)(RECIPE, 1.0)
  assert jax.jit(make, static_argnames="recipe")(RECIPE, 2.0) == 2.0


def test_meta_passed_as_a_static_jit_argument():
  # Metas hold arrays: they are data (traced), never static.
  f = jax.jit(lambda x, meta: fp8jax.fp8_dense(x, K, None, meta)[0], static_argnames="meta")
  with pytest.raises(ValueError, match="Non-hashable static arguments.*DotMeta"):
    f(X, META)


# --- wrong meta for the op -------------------------------------------------------

def test_whole_fp8_state_dict_passed_as_one_layers_meta():
  with pytest.raises(TypeError, match="meta must be a fp8jax.DotMeta.*got dict"):
    fp8jax.fp8_dense(X, K, None, {"l1": META})


def test_dot_meta_with_swapped_roles():
  swapped = dataclasses.replace(META, x=META.grad, grad=META.x)
  with pytest.raises(ValueError, match="meta.kernel has format|meta.grad has format.*swapped"):
    fp8jax.fp8_dense(X, K, None, swapped)


def test_dot_meta_assembled_from_two_recipes():
  other = fp8jax.init_dot_meta(fp8jax.DelayedScaling(amax_history_len=4, margin=1))
  mixed = dataclasses.replace(META, kernel=other.kernel)
  with pytest.raises(ValueError, match="meta.kernel follows recipe .*margin=1.*share a recipe"):
    fp8jax.fp8_dense(X, K, None, mixed)


# --- step functions given the wrong tree ---------------------------------------------

@pytest.mark.parametrize("fn", [fp8jax.begin_step, fp8jax.end_step,
                                lambda s: fp8jax.all_reduce_amax(s)])
def test_params_passed_where_fp8_state_belongs(fn):
  with pytest.raises(TypeError, match=r"fp8_state\['kernel'\] is a .*outside any Fp8Meta"):
    fn(PARAMS)


def test_value_and_grad_with_arguments_in_the_wrong_order():
  with pytest.raises(TypeError, match=r"fp8_state\['kernel'\] is a .*Pass only the FP8 state"):
    fp8jax.value_and_grad(loss_fn)(META, PARAMS, X)


def test_merge_step_of_different_structures():
  with pytest.raises(ValueError, match="forward_state and cotangent_state must have the same"):
    fp8jax.merge_step({"a": META}, {"b": META})


def test_value_and_grad_of_a_non_function():
  with pytest.raises(TypeError, match="loss_fn must be a function"):
    fp8jax.value_and_grad(loss_fn(PARAMS, META, X))


def test_loss_fn_that_does_not_return_the_new_state():
  with pytest.raises(TypeError, match=r"loss_fn must return \(loss, new_fp8_state\)"):
    fp8jax.value_and_grad(lambda p, m, x: loss_fn(p, m, x)[0])(PARAMS, META, X)


def test_has_aux_without_aux():
  with pytest.raises(TypeError, match=r"has_aux=True, so loss_fn must return \(\(loss, aux\)"):
    fp8jax.value_and_grad(loss_fn, has_aux=True)(PARAMS, META, X)


def test_loss_fn_returning_a_differently_structured_state():
  def wrapped_state(params, state, x):
    loss, meta = loss_fn(params, state["l1"], x)
    return loss, {"fp8_meta": {"l1": meta}}  # e.g. the whole `updates` dict of linen
  with pytest.raises(ValueError, match="(?s)new_fp8_state whose tree structure differs.*"
                                       r"updates\['fp8_meta'\]"):
    fp8jax.value_and_grad(wrapped_state)(PARAMS, {"l1": META}, X)


def test_linen_loss_forgetting_to_pass_fp8_state_in():
  model = fp8nn.Fp8Dense(3, recipe=RECIPE)
  variables = model.init(jax.random.key(0), X)

  def forgets(params, fp8_state, x):  # applies without the fp8_meta collection
    y, updates = model.apply({"params": params}, x, mutable=["fp8_meta"])
    return jnp.sum(y), updates["fp8_meta"]

  with pytest.raises(ValueError, match="tree structure differs"):
    fp8jax.value_and_grad(forgets)(variables["params"], {}, X)


@pytest.mark.parametrize("microbatches,match", [
    ((X, X[:2]), "share one leading"),
    (jnp.float32(1.0), "leading microbatch axis"),
    ({}, "leading microbatch axis"),
])
def test_accumulate_gradients_with_bad_microbatches(microbatches, match):
  with pytest.raises(ValueError, match=match):
    fp8jax.accumulate_gradients(lambda p, m, b: loss_fn(p, m, b[0]), PARAMS, META,
                                microbatches)


# --- sharding ---------------------------------------------------------------------

@pytest.mark.parametrize("axis_name", [0, ("data", 1), ()])
def test_axis_name_of_the_wrong_type(axis_name):
  with pytest.raises(TypeError, match="axis_name=.* must be None, a mesh axis name"):
    fp8jax.value_and_grad(loss_fn, axis_name=axis_name)


def test_axis_name_outside_shard_map():
  step = jax.jit(fp8jax.value_and_grad(loss_fn, axis_name="data"))
  with pytest.raises(ValueError, match="(?s)axis_name='data'.*unbound.*shard_map.*None"):
    step(PARAMS, META, X)


# --- Flax ------------------------------------------------------------------------------

def test_linen_module_with_a_string_recipe():
  with pytest.raises(TypeError, match="recipe must be a fp8jax recipe.*got str"):
    fp8nn.Fp8Dense(3, recipe="delayed").init(jax.random.key(0), X)


def test_linen_state_of_another_recipe_names_the_conversion():
  variables = fp8nn.Fp8Dense(3, recipe=RECIPE).init(jax.random.key(0), X)
  other = fp8nn.Fp8Dense(3, recipe=fp8jax.DelayedScaling(amax_history_len=8))
  with pytest.raises(ValueError, match="made for recipe=.*fp8jax.resize_history"):
    other.apply(variables, X)
  converted = fp8jax.resize_history(variables["fp8_meta"], other.recipe)
  other.apply({"params": variables["params"], "fp8_meta": converted}, X)


def test_resize_history_to_a_non_recipe():
  with pytest.raises(TypeError, match="new_recipe must be a fp8jax recipe"):
    fp8jax.resize_history({"l": META}, 8)


def test_plain_nn_dense_params_given_to_an_fp8_model():
  # A bf16 model's variables have no fp8_meta: applying the FP8 model with them
  # in training (mutable) creates fresh state, caught by the structure check above;
  # in evaluation (immutable) Flax itself refuses.
  variables = nn.Dense(3).init(jax.random.key(0), X)
  with pytest.raises(Exception, match="fp8_meta"):
    fp8nn.Fp8Dense(3, recipe=RECIPE).apply(variables, X)
