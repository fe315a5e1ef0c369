"""Current scaling without its amax pass: the producer of x hands `fp8_dense` max|x|.

`fp8_dense` on its own must reduce an arbitrary x for its amax before it can cast it
(current scaling's scale is fmt.max / max|x|). Where x's producer is a kernel XLA
writes, XLA computes that reduction inside it; where it is not (a parameter, a GEMM's
or a Pallas kernel's output) the reduction is a pass of its own. Given the amax
(`x_amax=`, e.g. from `fp8jax.rms_norm` / `fp8jax.gelu` with `return_amax=True`), the
layer skips the reduction: the same numbers bit for bit, and only x's cast reads x.
"""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp8jax
from fp8jax import deviceless
from fp8jax.flax.linen import Fp8Dense

_MISSING = deviceless.deviceless_toolchain_missing()


def _layer(recipe, x_amax_of):
  def loss(params, state, x):
    h, h_amax = fp8jax.rms_norm(x, params["norm"], return_amax=True)
    y, meta = fp8jax.fp8_dense(h, params["w"], None, state, x_amax=x_amax_of(h, h_amax))
    return jnp.sum(y.astype(jnp.float32) ** 2), meta
  return fp8jax.value_and_grad(loss)


def _arguments(recipe, seed=0):
  keys = jax.random.split(jax.random.key(seed), 2)
  x = (jax.random.normal(keys[0], (64, 128)) * 3).astype(jnp.bfloat16)
  params = {"norm": jnp.ones((128,), jnp.float32),
            "w": jax.random.normal(keys[1], (128, 64)) / 11}
  return params, fp8jax.init_dot_meta(recipe), x


def _assert_same(a, b):
  for got, want in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_current_scaling_with_the_producers_amax_is_bit_identical_to_its_own_pass():
  recipe = fp8jax.CurrentScaling()
  args = _arguments(recipe)
  given = jax.jit(_layer(recipe, lambda h, h_amax: h_amax))(*args)
  measured = jax.jit(_layer(recipe, lambda h, h_amax: None))(*args)
  _assert_same(given, measured)
  # The norm's amax is max|h| exactly.
  params, _, x = args
  h, h_amax = fp8jax.rms_norm(x, params["norm"], return_amax=True)
  assert float(h_amax) == float(jnp.max(jnp.abs(h.astype(jnp.float32))))


def test_delayed_scaling_ignores_x_amax():
  recipe = fp8jax.DelayedScaling(amax_history_len=4)
  args = _arguments(recipe, seed=1)
  wrong = jax.jit(_layer(recipe, lambda h, h_amax: 1e6 * h_amax))(*args)
  measured = jax.jit(_layer(recipe, lambda h, h_amax: None))(*args)
  _assert_same(wrong, measured)


def test_the_flax_layer_passes_x_amax_only_for_the_inputs_it_does_not_cast():
  recipe = fp8jax.CurrentScaling()
  x = (jax.random.normal(jax.random.key(3), (32, 64)) * 5).astype(jnp.bfloat16)
  true_amax = jnp.max(jnp.abs(x.astype(jnp.float32)))
  layer = Fp8Dense(16, recipe=recipe, use_bias=False, dtype=jnp.bfloat16)
  variables = layer.init(jax.random.key(4), x)
  apply = lambda amax, layer=layer: layer.apply(variables, x, x_amax=amax,
                                                mutable=["fp8_meta"])
  _assert_same(apply(true_amax), apply(None))
  # A wrong amax is used as given (the caller's contract): the output changes.
  scaled, _ = apply(3 * true_amax)  # not a power of two: another rounding grid
  assert not np.array_equal(np.asarray(scaled, np.float32), np.asarray(apply(None)[0], np.float32))
  # A layer that casts x (here: promoted to the float32 kernel's dtype) measures the
  # cast x itself: the given amax is ignored.
  cast = Fp8Dense(16, recipe=recipe, use_bias=False)
  _assert_same(cast.apply(variables, x, x_amax=3 * true_amax, mutable=["fp8_meta"]),
               cast.apply(variables, x, mutable=["fp8_meta"]))


@pytest.mark.hopper
@pytest.mark.skipif(_MISSING is not None, reason=str(_MISSING))
def test_given_its_amax_x_is_read_by_its_cast_alone_in_the_compiled_step():
  """x is a parameter of the step here, so nothing in the step writes it and without
  `x_amax` current scaling reads it in a reduction of its own before the cast. Given
  the amax (from whatever wrote x), only the cast reads x."""
  from fp8jax.lowering.cost import cost

  recipe = fp8jax.CurrentScaling()
  rows, width, out = 1024, 512, 64  # x is the one tensor of 1 MB; the others are 128 KB

  def x_readers(given):
    def loss(w, state, x, x_amax):
      y, meta = fp8jax.fp8_dense(x, w, None, state, x_amax=x_amax if given else None)
      return jnp.sum(y.astype(jnp.float32) ** 2), meta

    args = (jax.ShapeDtypeStruct((width, out), jnp.bfloat16),
            jax.eval_shape(lambda: fp8jax.init_dot_meta(recipe)),
            jax.ShapeDtypeStruct((rows, width), jnp.bfloat16),
            jax.ShapeDtypeStruct((), jnp.float32))
    report = cost(fp8jax.value_and_grad(loss), *args, target="deviceless")
    return [k for k in report.kernels if not k.is_gemm and k.bytes_in >= rows * width * 2]

  def kinds(kernels):  # the cast kernel, or the reduction under fp8jax's "amax" scope
    return sorted("cast" if "cast_transpose_amax" in k.op_name else
                  "amax" if re.search(r"[/(]amax[/)]", k.op_name) else k.name for k in kernels)

  assert kinds(x_readers(True)) == ["cast"]
  assert kinds(x_readers(False)) == ["amax", "cast"]


@pytest.mark.parametrize("bad", [jnp.ones((2,)), jnp.int32(3)], ids=["vector", "int"])
def test_an_x_amax_that_is_not_one_float_is_refused_naming_it(bad):
  recipe = fp8jax.CurrentScaling()
  params, meta, x = _arguments(recipe)
  with pytest.raises(ValueError, match="x_amax must be one float"):
    fp8jax.fp8_dense(x, params["w"], None, meta, x_amax=bad)
