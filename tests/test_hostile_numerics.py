"""Hostile numbers (NaN, ±inf, huge, tiny, zero) never poison FP8 state; NaN stays where it was.

Property-based (hypothesis, derandomized: the same examples on every run).

What the math implies, stated once:
* `quantize` clips `x * scale` to ±max before the cast: +-inf and overflowing
  values saturate to +-max (they do NOT become NaN); values below half the
  smallest subnormal flush to (signed) zero; NaN stays NaN. Checked bit for bit
  against the float64 reference of tests/fp8_reference.py.
* A step's amax may be 0, inf or NaN; `end_step` records it as 0 and keeps the
  old scale, so scales are always finite and positive, histories finite.
* `fp8_dense` (y = x @ kernel): an inf in x is saturated, so it gives finite
  outputs. A NaN in row i of x makes *every* output of row i NaN (NaN * 0 is
  NaN in the dot), and no other output. Backward with a finite output gradient:
  dx is finite; dkernel[k, :] is NaN exactly for the columns k of x holding a NaN.
* Extreme magnitudes: the two descales are applied one after the other, so a
  zero row of x stays 0 even when scale_x * scale_kernel is not a float32
  number; outputs that float32 cannot hold overflow or flush as float32 does.

Adding an FP8 op (e.g. attention): append a `HostileCase` to HOSTILE_CASES with
a function running forward + backward and a function giving the expected NaN
pattern of its outputs; the generic properties below then cover it.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from hypothesis.extra import numpy as hnp

import fp8jax
from fp8jax.core.meta import record_amax, scale_for
from fp8_reference import FORMAT_TABLE, quantize_reference, simulate_delayed_scaling

# Fixed, small, derandomized: the file runs in well under a minute on 2 cores.
settings.register_profile("fp8jax-hostile", deadline=None, derandomize=True, max_examples=60,
                          suppress_health_check=[HealthCheck.too_slow,
                                                 HealthCheck.data_too_large])
HOSTILE = settings.get_profile("fp8jax-hostile")
# The float64 reference overflows to inf on purpose for huge inputs (then saturates).
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")

FORMATS = {"e4m3": fp8jax.E4M3, "e5m2": fp8jax.E5M2}
ANY_F32 = st.floats(width=32, allow_nan=True, allow_infinity=True, allow_subnormal=True)
# Amaxes as the library produces them: |x| max, so >= 0, or inf, or NaN.
ANY_AMAX = st.one_of(st.floats(0, None, width=32, allow_subnormal=True),
                     st.sampled_from([0.0, np.inf, np.nan, 1e-45, 3.4e38]))


@HOSTILE
@given(x=hnp.arrays(np.float32, 64, elements=ANY_F32),
       log2_scale=st.floats(-40, 40), name=st.sampled_from(sorted(FORMATS)),
       dtype=st.sampled_from([jnp.float32, jnp.bfloat16, jnp.float16]))
def test_quantize_saturates_flushes_and_keeps_nan_bitwise(x, log2_scale, name, dtype):
  scale = np.float32(2.0**log2_scale * 1.37)
  x = np.asarray(jnp.asarray(x).astype(dtype).astype(jnp.float32))  # the value quantize sees
  q = np.asarray(_quantize(jnp.asarray(x).astype(dtype), jnp.float32(scale), name))
  want = quantize_reference(x, scale, name)
  values = q.astype(np.float64)
  np.testing.assert_array_equal(np.isnan(values), np.isnan(x))   # NaN where NaN, only there
  assert np.all(np.abs(values[~np.isnan(values)]) <= FORMAT_TABLE[name]["max"])  # never inf
  finite = ~np.isnan(want)
  np.testing.assert_array_equal(q.view(np.uint8)[finite],
                                want[finite].astype(FORMATS[name].dtype).view(np.uint8))


@jax.jit
def _quantize_e4m3(x, scale):
  return fp8jax.quantize(x, scale, fp8jax.E4M3)


@jax.jit
def _quantize_e5m2(x, scale):
  return fp8jax.quantize(x, scale, fp8jax.E5M2)


def _quantize(x, scale, name):
  return (_quantize_e4m3 if name == "e4m3" else _quantize_e5m2)(x, scale)


@jax.jit
def _scale_step(meta, amaxes):
  """One delayed-scaling step in which the meta is used once per entry of `amaxes`."""
  meta = fp8jax.begin_step(meta)
  for i in range(amaxes.shape[0]):
    meta = record_amax(meta, amaxes[i])
  return fp8jax.end_step(meta)


@HOSTILE
@given(steps=st.lists(st.lists(ANY_AMAX, min_size=2, max_size=2), min_size=1, max_size=12),
       history_len=st.sampled_from([1, 3]), algo=st.sampled_from(["max", "most_recent"]),
       margin=st.sampled_from([0, 3]))
def test_scale_update_keeps_scales_finite_positive_and_follows_contract(steps, history_len,
                                                                        algo, margin):
  recipe = fp8jax.DelayedScaling(history_len, algo, margin)
  meta = fp8jax.init_meta(recipe, fp8jax.E5M2)
  for uses in steps:
    meta = _scale_step(meta, jnp.asarray(uses, jnp.float32))
    scale, history = float(meta.scale), np.asarray(meta.amax_history)
    assert np.isfinite(scale) and scale > 0
    assert np.all(np.isfinite(history)) and np.all(history >= 0)
  # Uses within a step combine by max (NaN propagates to the step's amax). The max
  # is exact on the bit patterns, so a subnormal amax is recorded as it is; its
  # scale would overflow, so it keeps the old scale (as any unusable amax does).
  per_step = [np.nan if any(np.isnan(u)) else max(u) for u in steps]
  want_scales, want_histories = simulate_delayed_scaling(per_step, history_len, algo, margin,
                                                         57344.0)
  np.testing.assert_array_equal(np.asarray(meta.amax_history), np.float32(want_histories[-1]))
  next_scale = simulate_delayed_scaling(per_step + [1.0], history_len, algo, margin,
                                        57344.0)[0][-1]
  assert float(meta.scale) == np.float32(next_scale)


@HOSTILE
@given(amax=ANY_AMAX, margin=st.sampled_from([0, 5]), name=st.sampled_from(sorted(FORMATS)))
def test_current_scaling_scale_is_finite_positive_for_any_amax(amax, margin, name):
  meta = fp8jax.init_meta(fp8jax.CurrentScaling(margin=margin), FORMATS[name])
  scale = float(scale_for(meta, jnp.float32(amax)))
  assert np.isfinite(scale) and scale > 0


# ----------------------------------------------------------------------------
# FP8 ops: forward + backward on hostile inputs.

@dataclasses.dataclass(frozen=True)
class HostileCase:
  """One FP8 op under hostile inputs.

  Attributes:
    name: test id.
    shapes: shapes of the op's floating inputs (the first is the one made hostile).
    run: `(inputs, fp8_state, cotangent) -> (outputs, grads, next_fp8_state)`,
      forward + backward of one training step (use `fp8jax.value_and_grad`).
    expected_nan: `(inputs) -> (nan mask of outputs, tuple of nan masks of grads)`
      for a finite output cotangent, from the op's math.
    out_shape: shape of the outputs (for the cotangent).
    init_state: `recipe -> fp8_state`.
  """
  name: str
  shapes: tuple
  run: Callable
  expected_nan: Callable
  out_shape: tuple
  init_state: Callable


def _dense_run(recipe):
  def loss_fn(params, meta, x, t):
    y, meta = fp8jax.fp8_dense(x, params["kernel"], None, meta)
    return (jnp.sum(y * t), y), meta

  def step(x, kernel, meta, t):
    (_, y), grads, meta = fp8jax.value_and_grad(
        lambda p, m, t: loss_fn({"kernel": p["kernel"]}, m, p["x"], t), has_aux=True)(
            {"x": x, "kernel": kernel}, meta, t)
    return y, (grads["x"], grads["kernel"]), meta
  return jax.jit(step)


def _dense_expected_nan(x, kernel):
  x_nan, k_nan = np.isnan(x), np.isnan(kernel)
  out = x_nan.any(axis=1)[:, None] | k_nan.any(axis=0)[None, :]
  # dx = g @ kernel^T: NaN where the kernel row... only from a NaN kernel; dk = x^T @ g.
  dx = np.broadcast_to(k_nan.any(axis=1)[None, :], x.shape)
  dk = np.broadcast_to(x_nan.any(axis=0)[:, None], kernel.shape)
  return out, (dx, dk)


_DENSE_STEPS = {}


def _dense_case_run(inputs, meta, t):
  recipe = meta.recipe
  if recipe not in _DENSE_STEPS:
    _DENSE_STEPS[recipe] = _dense_run(recipe)
  x, kernel = inputs
  return _DENSE_STEPS[recipe](x, kernel, meta, t)


HOSTILE_CASES = [
    HostileCase("fp8_dense", shapes=((4, 8), (8, 3)), run=_dense_case_run,
                expected_nan=_dense_expected_nan, out_shape=(4, 3),
                init_state=fp8jax.init_dot_meta),
]

# Finite magnitudes inside the documented range, plus zeros, infs and NaNs.
_FINITE = st.floats(-2.0**40, 2.0**40, width=32).filter(lambda v: v == 0 or abs(v) > 2.0**-40)
_HOSTILE_ENTRY = st.one_of(_FINITE, _FINITE, _FINITE, st.sampled_from(
    [0.0, -0.0, np.inf, -np.inf, np.nan, 2.0**40, 2.0**-40]))


@pytest.mark.parametrize("case", HOSTILE_CASES, ids=lambda c: c.name)
@pytest.mark.parametrize("recipe", [fp8jax.DelayedScaling(2), fp8jax.CurrentScaling()],
                         ids=["delayed", "current"])
@settings(HOSTILE, max_examples=25)
@given(data=st.data())
def test_fp8_op_nan_only_where_inputs_had_nan_and_state_stays_finite(case, recipe, data):
  hostile = data.draw(hnp.arrays(np.float32, case.shapes[0], elements=_HOSTILE_ENTRY), "x")
  others = [data.draw(hnp.arrays(np.float32, s, elements=st.floats(-4, 4, width=32)), f"in{i}")
            for i, s in enumerate(case.shapes[1:])]
  others = [o + np.float32(0.5) for o in others]  # not all zero: amax > 0
  cotangent = data.draw(hnp.arrays(np.float32, case.out_shape,
                                   elements=st.floats(-8, 8, width=32)), "cotangent")
  inputs = [jnp.asarray(hostile)] + [jnp.asarray(o) for o in others]
  state = case.init_state(recipe)
  want_out, want_grads = case.expected_nan(hostile, *others)
  for _ in range(2):  # the second step uses scales made from the first step's amaxes
    out, grads, state = case.run(inputs, state, jnp.asarray(cotangent))
    np.testing.assert_array_equal(np.isnan(np.asarray(out)), want_out)
    assert not np.any(np.isinf(np.asarray(out))), "saturating casts give finite outputs"
    for grad, want in zip(grads, want_grads):
      np.testing.assert_array_equal(np.isnan(np.asarray(grad)), want)
    for leaf in jax.tree.leaves(state):
      assert np.all(np.isfinite(np.asarray(leaf)))
    for meta in jax.tree.leaves(state, is_leaf=lambda n: isinstance(n, fp8jax.Fp8Meta)):
      assert np.all(np.asarray(meta.scale) > 0)


def test_extreme_amax_product_gives_no_nan_for_a_zero_row():
  # amax(x) * amax(kernel) = 1e46: the product of the two scales underflows float32,
  # so a single combined descale 1 / (scale_x * scale_kernel) would be inf.
  x = jnp.array([[1e30, 2e30], [0.0, 0.0]], jnp.float32)
  kernel = jnp.full((2, 1), 1e16, jnp.float32)
  y, _ = fp8jax.fp8_dense(x, kernel, None, fp8jax.init_dot_meta(fp8jax.CurrentScaling()))
  assert not np.isnan(np.asarray(y)).any()


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_huge_and_tiny_magnitudes_saturate_and_flush_as_the_format_says(name):
  table = FORMAT_TABLE[name]
  x = jnp.array([3e38, -3e38, np.inf, table["min_subnormal"] * 0.49,
                 -table["min_subnormal"] * 0.49, table["min_subnormal"] * 0.51], jnp.float32)
  q = np.asarray(fp8jax.quantize(x, jnp.float32(1.0), FORMATS[name])).astype(np.float64)
  np.testing.assert_array_equal(q[:3], [table["max"], -table["max"], table["max"]])
  assert q[3] == 0 and not np.signbit(q[3]) and q[4] == 0 and np.signbit(q[4])
  assert q[5] == table["min_subnormal"]  # just above half the smallest step rounds up
