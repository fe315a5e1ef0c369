"""MXFP8's two shared-scale rules: OCP's floor and NVIDIA's round-up, where they differ.

With amax = m * 2**e (m in [1, 2)) and fmt.max = 1.75 * 2**emax (E4M3: 448 = 1.75 * 2**8;
E5M2: 57344 = 1.75 * 2**15):

* "floor" (OCP MX v1.0): shared_exp = e - emax; the largest element lands at m * 2**emax,
  above fmt.max when m > 1.75, where it saturates.
* "round_up" (NVIDIA's MXFP8 recipe): the smallest shared_exp with amax <= fmt.max *
  2**shared_exp: e - emax for m <= 1.75, e - emax + 1 above; nothing saturates.

So the rules agree from a power of two up to 1.75 times it (amax just above a power of two
included) and differ above 1.75, up to just below the next power of two. The reference
(tests/test_block_quantize.py) finds each exponent by exact power-of-two comparisons.
"""
import jax.numpy as jnp
import numpy as np
import pytest

import fp8jax
from fp8jax.core import blocks as bq
from test_block_quantize import (FORMATS, assert_matches_reference, reference_mx_round_up_exponent,
                                 reference_mx_shared_exponent, rows_of_different_magnitudes)


def boundary_amaxes():
  """(amax, whether the two rules differ) at the boundaries, over many binades."""
  cases = []
  for k in (-20, -3, 0, 5, 40):
    low = np.float32(2.0**k)
    knee = np.float32(1.75 * 2.0**k)
    high = np.float32(2.0**(k + 1))
    cases += [(low, False), (np.nextafter(low, np.float32(np.inf)), False),
              (knee, False), (np.nextafter(knee, np.float32(np.inf)), True),
              (np.float32(1.9 * 2.0**k), True), (np.nextafter(high, np.float32(0)), True)]
  return cases


@pytest.mark.parametrize("name", ["e4m3", "e5m2"])
def test_the_rules_agree_up_to_the_knee_and_differ_by_one_binade_above_it(name):
  amaxes, differ = zip(*boundary_amaxes())
  amax = jnp.asarray(np.array(amaxes, np.float32))
  floor = np.asarray(bq.mx_shared_exponents(amax, FORMATS[name], "floor"), np.int64) - 127
  up = np.asarray(bq.mx_shared_exponents(amax, FORMATS[name], "round_up"), np.int64) - 127
  np.testing.assert_array_equal(floor, [reference_mx_shared_exponent(a, name) for a in amaxes])
  np.testing.assert_array_equal(up, [reference_mx_round_up_exponent(a, name) for a in amaxes])
  np.testing.assert_array_equal(up - floor, np.asarray(differ, np.int64))


@pytest.mark.parametrize("name", ["e4m3", "e5m2"])
def test_round_up_never_saturates_where_floor_does(name):
  fmt = FORMATS[name]
  rng = np.random.default_rng(7)
  rows = []
  for amax, differ in boundary_amaxes():
    row = (rng.uniform(-1, 1, 32) * amax).astype(np.float32)
    row[5] = -amax
    rows.append(row)
  x = np.stack(rows)
  floor = bq.quantize_mx(jnp.asarray(x), fmt, -1, "floor")
  up = bq.quantize_mx(jnp.asarray(x), fmt, -1, "round_up")
  assert_matches_reference(floor, x, (1, 32), name, "mx")
  assert_matches_reference(up, x, (1, 32), name, "mx_round_up")
  # Round-up: the largest element, amax * 2**-shared_exp, is at most fmt.max (exactly, so
  # the cast does not clip it) and above fmt.max / 2.
  scaled_up = np.abs(x[:, 5].astype(np.float64)) / np.asarray(up.scale_inv[:, 0], np.float64)
  assert np.all((scaled_up <= fmt.max) & (scaled_up > fmt.max / 2))
  # Floor: where the rules differ the largest element exceeds fmt.max and saturates.
  differ = np.array([d for _, d in boundary_amaxes()])
  scaled_floor = np.abs(x[:, 5].astype(np.float64)) / np.asarray(floor.scale_inv[:, 0],
                                                                 np.float64)
  assert np.all((scaled_floor > fmt.max) == differ)
  q_floor = np.abs(np.asarray(floor.q[:, 5], np.float64))
  np.testing.assert_array_equal(q_floor[differ], fmt.max)


@pytest.mark.parametrize("axis", [-1, -2])
def test_round_up_quantizes_whole_tensors_as_the_reference(axis):
  x = rows_of_different_magnitudes((40, 70), seed=8)
  x[:32, :32] = 0.0  # an all-zero block: the smallest E8M0 value under both rules
  got = bq.quantize_mx(jnp.asarray(x), fp8jax.E4M3, axis, "round_up")
  assert_matches_reference(got, x, (1, 32) if axis == -1 else (32, 1), "e4m3", "mx_round_up")


def test_the_recipe_option_selects_the_rule_and_bad_values_are_refused():
  x = jnp.asarray(np.array([[1.9] + [0.1] * 31], np.float32))
  scales = {rule: float(fp8jax.MXFP8Scaling(scale_rounding=rule).quantize_operand(
      x, fp8jax.E4M3, -1, False).scale_inv[0, 0]) for rule in ("floor", "round_up")}
  assert scales == {"floor": 2.0**-8, "round_up": 2.0**-7}
  with pytest.raises(ValueError, match="scale_rounding='nearest'.*'floor'.*'round_up'"):
    fp8jax.MXFP8Scaling(scale_rounding="nearest")
  with pytest.raises(ValueError, match="gemm='fast'.*'emulated'.*'native'"):
    fp8jax.MXFP8Scaling(gemm="fast")
