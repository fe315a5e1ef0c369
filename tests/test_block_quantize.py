"""Per-row, per-tile, per-block and MX quantization vs an independent float64 reference, bitwise.

The reference (numpy, float64) follows the same arithmetic as fp8jax, written
out from the definitions:
* block amax: max |x| over the block's elements (a partial last block holds
  only its own elements);
* float32 scale: `np.float32(fmt.max) / np.float32(amax)`, a float32 division as
  fp8jax computes it; power_of_two: 2**floor(log2(scale)) from the float64
  logarithm of that float32 value; amax 0 (or a non-finite quotient): scale 1;
* MX (OCP MX v1.0): shared_exp = floor(log2(amax)) - emax (via np.frexp, exact),
  clipped to the E8M0 range [-127, 127], -127 for an all-zero block; scale
  2**-shared_exp; NVIDIA's round-up rule ("mx_round_up"): the smallest integer
  shared_exp with amax <= fmt.max * 2**shared_exp (exact in float64), clipped alike;
* elements: `tests/fp8_reference.quantize_reference` (product in float32,
  saturate, round half to even onto the FP8 grid);
* dequantized: q * float32(1 / scale), rounded to float32 (the product of a
  4-bit FP8 value and a float32 is exact in float64, so rounding it once to
  float32 is the float32 multiply).
Every comparison is exact (array_equal): both sides do the same IEEE operations.
"""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp8jax
from fp8jax.core import blocks as bq
from fp8jax.core import quantize as quantize_lib
from fp8_reference import FORMAT_TABLE, quantize_reference

FORMATS = {"e4m3": fp8jax.E4M3, "e5m2": fp8jax.E5M2}
EMAX = {"e4m3": 8, "e5m2": 15}


def rows_of_different_magnitudes(shape, seed=0):
  """Random normal values, each row scaled by 10**u with u uniform in [-4, 4]."""
  rng = np.random.default_rng(seed)
  x = rng.standard_normal(shape) * 10.0**rng.uniform(-4, 4, size=shape[:-1] + (1,))
  return x.astype(np.float32)


def reference_blocks(x, block):
  """Yields (row slice, column slice) of every block of the 2-D `x`, partial ones included."""
  rows, cols = x.shape
  for i in range(0, rows, block[0]):
    for j in range(0, cols, block[1]):
      yield slice(i, min(i + block[0], rows)), slice(j, min(j + block[1], cols))


def reference_float32_scale(amax, name, power_of_two):
  with np.errstate(divide="ignore", over="ignore"):
    scale = np.float32(FORMAT_TABLE[name]["max"]) / np.float32(amax)
  if not (np.isfinite(scale) and scale > 0):
    return np.float32(1.0)
  if power_of_two:
    scale = np.float32(2.0**math.floor(math.log2(float(scale))))
  return scale


def reference_mx_shared_exponent(amax, name):
  if amax == 0:
    return -127  # floor(log2(0)) = -inf, clamped to the smallest E8M0 exponent
  mantissa, exponent = np.frexp(np.float64(amax))  # amax = mantissa * 2**exponent, m in [0.5, 1)
  return int(np.clip(exponent - 1 - EMAX[name], -127, 127))


def reference_mx_round_up_exponent(amax, name):
  """The smallest s with amax <= fmt.max * 2**s: ceil(log2(amax / fmt.max)), exactly."""
  if amax == 0:
    return -127
  s = reference_mx_shared_exponent(amax, name)  # floor(log2(amax)) - emax: a lower bound
  while amax > FORMAT_TABLE[name]["max"] * 2.0**s:  # exact: a power-of-two product
    s += 1
  while s > -127 and amax <= FORMAT_TABLE[name]["max"] * 2.0**(s - 1):
    s -= 1
  return int(np.clip(s, -127, 127))


def reference_quantize(x, block, name, rule):
  """(q values, scale_inv per block, dequantized values) as float64 / float32 arrays."""
  q = np.zeros(x.shape)
  deq = np.zeros(x.shape, np.float32)
  n_r, n_c = -(-x.shape[0] // block[0]), -(-x.shape[1] // block[1])
  scale_inv = np.zeros((n_r, n_c), np.float32)
  for rs, cs in reference_blocks(x, block):
    amax = float(np.max(np.abs(x[rs, cs].astype(np.float64))))
    if rule == "mx":
      scale = np.float32(2.0**-reference_mx_shared_exponent(amax, name))
    elif rule == "mx_round_up":
      scale = np.float32(2.0**-reference_mx_round_up_exponent(amax, name))
    else:
      scale = reference_float32_scale(amax, name, power_of_two=(rule == "power_of_two"))
    inv = np.float32(1.0) / scale
    q[rs, cs] = quantize_reference(x[rs, cs], scale, name)
    deq[rs, cs] = (q[rs, cs] * np.float64(inv)).astype(np.float32)
    scale_inv[rs.start // block[0], cs.start // block[1]] = inv
  return q, scale_inv, deq


def assert_matches_reference(got, x, block, name, rule):
  q, scale_inv, deq = reference_quantize(x, block, name, rule)
  assert got.block == block
  np.testing.assert_array_equal(np.asarray(got.q, np.float64), q)
  np.testing.assert_array_equal(np.asarray(got.scale_inv), scale_inv)
  np.testing.assert_array_equal(np.asarray(bq.dequantize_blocks(got)), deq)


# Shapes that are and are not multiples of the block, and blocks of each kind.
SHAPES = [(64, 96), (50, 70)]
BLOCKS = {"tile_1x32": (1, 32), "tile_32x1": (32, 1), "block_32x32": (32, 32),
          "block_16x48": (16, 48)}


@pytest.mark.parametrize("name,power_of_two", [("e4m3", False), ("e4m3", True), ("e5m2", False)],
                         ids=["e4m3", "e4m3-pow2", "e5m2"])
@pytest.mark.parametrize("block", BLOCKS.values(), ids=list(BLOCKS))
@pytest.mark.parametrize("shape", SHAPES, ids=["multiple", "partial"])
def test_block_quantize_matches_float64_reference_bitwise(shape, block, power_of_two, name):
  x = rows_of_different_magnitudes(shape)
  got = bq.quantize_blocks(jnp.asarray(x), FORMATS[name], block, power_of_two)
  assert got.scale_inv.shape == (-(-shape[0] // block[0]), -(-shape[1] // block[1]))
  assert_matches_reference(got, x, block, name, "power_of_two" if power_of_two else "float32")


@pytest.mark.parametrize("axis", [-1, -2], ids=["per_row", "per_column"])
@pytest.mark.parametrize("shape", SHAPES, ids=["multiple", "partial"])
def test_rowwise_quantize_matches_float64_reference_bitwise(shape, axis):
  x = rows_of_different_magnitudes(shape, seed=1)
  got = bq.quantize_rows(jnp.asarray(x), fp8jax.E4M3, axis)
  block = (1, shape[1]) if axis == -1 else (shape[0], 1)
  assert_matches_reference(got, x, block, "e4m3", "float32")


def test_partial_last_block_has_its_own_scale_from_its_own_elements():
  # The last 1x32 tile of each row holds 6 elements (K = 70) of another magnitude.
  x = rows_of_different_magnitudes((4, 70), seed=2)
  x[:, 64:] *= 1e3
  got = bq.quantize_blocks(jnp.asarray(x), fp8jax.E4M3, (1, 32))
  want = np.float32(1.0) / (np.float32(448.0) / np.max(np.abs(x[:, 64:]), axis=1))
  np.testing.assert_array_equal(np.asarray(got.scale_inv[:, 2]), want.astype(np.float32))


def test_block_of_zeros_gets_scale_one_and_quantizes_to_zero():
  x = rows_of_different_magnitudes((32, 64), seed=3)
  x[:, :32] = 0.0
  got = bq.quantize_blocks(jnp.asarray(x), fp8jax.E4M3, (32, 32))
  assert float(got.scale_inv[0, 0]) == 1.0
  assert not np.any(np.asarray(got.q[:, :32], np.float32))
  assert_matches_reference(got, x, (32, 32), "e4m3", "float32")


@pytest.mark.parametrize("name", ["e4m3", "e5m2"])
@pytest.mark.parametrize("axis", [-1, -2])
@pytest.mark.parametrize("shape", [(64, 96), (40, 70)], ids=["multiple", "partial"])
def test_mx_quantize_matches_ocp_mx_reference_bitwise(shape, axis, name):
  x = rows_of_different_magnitudes(shape, seed=4)
  x[:32, :32] = 0.0  # the first block (1x32 or 32x1) has amax 0
  got = bq.quantize_mx(jnp.asarray(x), FORMATS[name], axis)
  block = (1, 32) if axis == -1 else (32, 1)
  assert_matches_reference(got, x, block, name, "mx")
  # The E8M0 codes are shared_exp + 127, from the same exponents.
  amax = bq.block_amax(jnp.asarray(x), block)
  codes = np.asarray(bq.mx_shared_exponents(amax, FORMATS[name]), np.int64)
  want = np.vectorize(lambda a: reference_mx_shared_exponent(a, name) + 127)(np.asarray(amax))
  np.testing.assert_array_equal(codes, want)
  assert codes[0, 0] == 0  # the all-zero block: the smallest E8M0 value


def test_mx_largest_element_saturates_to_the_format_max():
  # amax = 1.9 * 2**3: shared_exp = 3 - 8 = -5, so the largest element becomes
  # 1.9 * 2**8 = 486.4 before the cast, above E4M3's 448: it saturates.
  rng = np.random.default_rng(5)
  x = (rng.uniform(-1, 1, (1, 32)) * 8).astype(np.float32)
  x[0, 7] = np.float32(1.9 * 8)
  got = bq.quantize_mx(jnp.asarray(x), fp8jax.E4M3)
  assert float(got.scale_inv[0, 0]) == 2.0**-5
  assert float(got.q[0, 7].astype(jnp.float32)) == 448.0
  assert_matches_reference(got, x, (1, 32), "e4m3", "mx")


def test_mx_block_with_nan_or_inf_dequantizes_to_nan_and_others_do_not():
  x = rows_of_different_magnitudes((2, 64), seed=6)
  x[0, 3] = np.nan
  x[1, 40] = np.inf
  got = bq.quantize_mx(jnp.asarray(x), fp8jax.E4M3)
  codes = np.asarray(bq.mx_shared_exponents(bq.block_amax(jnp.asarray(x), (1, 32)),
                                            fp8jax.E4M3))
  np.testing.assert_array_equal(codes[[0, 1], [0, 1]], [bq.E8M0_NAN, bq.E8M0_NAN])
  deq = np.asarray(bq.dequantize_blocks(got))
  assert np.all(np.isnan(deq[0, :32])) and np.all(np.isnan(deq[1, 32:]))
  assert np.all(np.isfinite(deq[0, 32:])) and np.all(np.isfinite(deq[1, :32]))


def test_round_down_to_power_of_two_matches_float64_floor_log2_normal_and_subnormal():
  rng = np.random.default_rng(7)
  values = np.concatenate([
      (rng.uniform(1, 2, 50) * 2.0**rng.integers(-126, 127, 50)),
      rng.uniform(1, 2**23, 20) * 2.0**-149,  # subnormal float32
      [2.0**-149, 2.0**-126, 1.0, 3.0, 2.0**127]]).astype(np.float32)
  got = np.asarray(quantize_lib.round_down_to_power_of_two(jnp.asarray(values)))
  want = np.array([2.0**math.floor(math.log2(float(v))) for v in values], np.float32)
  np.testing.assert_array_equal(got, want)
  assert float(quantize_lib.round_down_to_power_of_two(jnp.float32(0.0))) == 0.0


def test_e8m0_codes_decode_to_powers_of_two_and_nan():
  codes = jnp.arange(256, dtype=jnp.int32).astype(jnp.uint8)
  got = np.asarray(bq.e8m0_to_float32(codes), np.float64)
  np.testing.assert_array_equal(got[:255], 2.0**(np.arange(255) - 127))
  assert np.isnan(got[255])


def test_bad_block_is_refused_naming_the_argument():
  with pytest.raises(ValueError, match="block=.*two positive ints"):
    bq.quantize_blocks(jnp.ones((4, 4)), fp8jax.E4M3, (0, 4))
  with pytest.raises(ValueError, match="at least 2 dims"):
    bq.quantize_blocks(jnp.ones((4,)), fp8jax.E4M3, (1, 4))
