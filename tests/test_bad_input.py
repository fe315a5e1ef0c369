"""Bad input gets a clear exception that names the argument and the fix."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp8jax

META = fp8jax.init_dot_meta(fp8jax.DelayedScaling(amax_history_len=8))
X = jnp.ones((4, 8), jnp.float32)
K = jnp.ones((8, 3), jnp.float32)


@pytest.mark.parametrize("x,kernel,argname", [
    (X.astype(jnp.int32), K, "x"),
    (X, K.astype(jnp.int8), "kernel"),
    (X.astype(jnp.bool_), K, "x"),
    (X.astype(jnp.float8_e4m3fn), K, "x"),
])
def test_integer_bool_and_fp8_inputs_are_rejected(x, kernel, argname):
  with pytest.raises(TypeError, match=f"{argname} has dtype .*astype"):
    fp8jax.fp8_dense(x, kernel, None, META)


def test_role_meta_instead_of_dot_meta_is_rejected():
  with pytest.raises(TypeError, match="meta must be a fp8jax.DotMeta.*init_dot_meta"):
    fp8jax.fp8_dense(X, K, None, META.x)


def test_stacked_meta_outside_scan_is_rejected():
  stacked = jax.tree.map(lambda a: jnp.stack([a, a]), META)
  with pytest.raises(ValueError, match=r"meta.x.scale has shape \(2,\).*scan"):
    fp8jax.fp8_dense(X, K, None, stacked)


def test_history_length_not_matching_recipe_is_rejected():
  short = dataclasses.replace(META, x=dataclasses.replace(META.x, amax_history=jnp.zeros(4)))
  with pytest.raises(ValueError, match=r"meta.x.amax_history has shape \(4,\).*length 8"):
    fp8jax.fp8_dense(X, K, None, short)


def test_float64_meta_is_rejected():
  with jax.enable_x64():
    wide = dataclasses.replace(META, grad=dataclasses.replace(
        META.grad, scale=jnp.ones((), jnp.float64)))
    with pytest.raises(TypeError, match="meta.grad.scale must be float32"):
      fp8jax.fp8_dense(X, K, None, wide)


@pytest.mark.parametrize("x,kernel,bias,match", [
    (X, jnp.ones((7, 3)), None, "x's last dimension \\(8\\) must equal kernel's first \\(7\\)"),
    (X, jnp.ones((8, 3, 2)), None, "kernel of shape \\[K, N\\]"),
    (X, K, jnp.ones(4), "bias has shape \\(4,\\), expected \\(3,\\)"),
])
def test_dense_shape_mismatch_is_explained(x, kernel, bias, match):
  with pytest.raises(ValueError, match=match):
    fp8jax.fp8_dense(x, kernel, bias, META)


@pytest.mark.parametrize("dims,match", [
    ((((1,), (1,)), ((), ())), "contracting dimensions do not match"),
    ((((2,), (0,)), ((), ())), "names axes \\(2,\\) of x"),
    ((((1,), (0,)), ((0,), (0,))), "names axes \\(0, 0\\) of kernel"),
    (("bad",), "must be \\(\\(x_contracting"),
])
def test_dot_general_dimension_mismatch_is_explained(dims, match):
  with pytest.raises(ValueError, match=match):
    fp8jax.fp8_dot_general(X, K, META, dims)


@pytest.mark.parametrize("spec,match", [
    ("ab,bc", "explicit two-operand form"),
    ("abc,bc->ac", "gives x 3 labels but x has rank 2"),
    ("ab,bc->a", "label 'c' is summed over one operand only"),
    ("ab,bc->acd", "output label 'd' is in no operand"),
])
def test_einsum_bad_subscripts_are_explained(spec, match):
  with pytest.raises(ValueError, match=match):
    fp8jax.fp8_einsum(spec, X, K, META)


def test_non_recipe_is_rejected_when_making_state():
  with pytest.raises(TypeError, match="recipe must be a fp8jax recipe"):
    fp8jax.init_dot_meta("delayed")


def test_unknown_format_choice_is_rejected():
  with pytest.raises(ValueError, match="fp8_format='e2m1'.*hybrid"):
    fp8jax.CurrentScaling(fp8_format="e2m1")


def test_numpy_valued_state_works_like_jax_arrays():
  # State restored from disk or built by hand may hold numpy arrays.
  numpy_meta = jax.tree.map(lambda a: np.asarray(a), META)
  y, new_meta = fp8jax.fp8_dense(X, K, None, numpy_meta)
  want, want_meta = fp8jax.fp8_dense(X, K, None, META)
  np.testing.assert_array_equal(np.asarray(y), np.asarray(want))
  stepped = fp8jax.end_step(fp8jax.begin_step(numpy_meta))
  assert jax.tree.structure(stepped) == jax.tree.structure(META)
