"""Current scaling without its amax pass: the producer of x hands `fp8_dense` max|x|.

`fp8_dense` on its own must read an arbitrary x once for its amax before it can cast it
(current scaling's scale is fmt.max / max|x|). When the op that wrote x computed that
amax while writing it (`fp8jax.rms_norm` / `fp8jax.gelu` with `return_amax=True`), the
layer takes it (`x_amax=`) and skips the pass: the same numbers bit for bit, one kernel
fewer per projection in the compiled step.
"""
from __future__ import annotations

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
def test_a_producers_amax_removes_the_projections_amax_pass_from_the_compiled_step():
  from fp8jax.lowering.cost import cost

  recipe = fp8jax.CurrentScaling()
  shapes = jax.eval_shape(lambda: _arguments(recipe))

  def amax_passes(x_amax_of):
    report = cost(jax.jit(_layer(recipe, x_amax_of)), *shapes, target="deviceless")
    return [k for k in report.kernels if k.category != "gemm" and "/amax/" in k.op_name]

  given = amax_passes(lambda h, h_amax: h_amax)
  measured = amax_passes(lambda h, h_amax: None)
  # x's amax pass is gone; the kernel's and the output gradient's remain.
  assert len(given) == len(measured) - 1, (given, measured)


@pytest.mark.parametrize("bad", [jnp.ones((2,)), jnp.int32(3)], ids=["vector", "int"])
def test_an_x_amax_that_is_not_one_float_is_refused_naming_it(bad):
  recipe = fp8jax.CurrentScaling()
  params, meta, x = _arguments(recipe)
  with pytest.raises(ValueError, match="x_amax must be one float"):
    fp8jax.fp8_dense(x, params["w"], None, meta, x_amax=bad)
