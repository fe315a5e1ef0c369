"""FP8 constants and saturating quantize/dequantize vs the float64 reference."""
import zlib

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import fp8jax
from fp8_reference import FORMAT_TABLE, quantize_reference

FORMATS = {"e4m3": fp8jax.E4M3, "e5m2": fp8jax.E5M2}


@pytest.mark.parametrize("name", ["e4m3", "e5m2"])
def test_format_constants_match_ocp_table(name):
  fmt, table = FORMATS[name], FORMAT_TABLE[name]
  assert fmt.max == table["max"]
  assert fmt.min_normal == table["min_normal"]
  assert fmt.min_subnormal == table["min_subnormal"]
  assert fmt.mantissa_bits == table["mantissa_bits"]
  # The JAX dtype agrees with the table too (a wrong dtype would pass the lines above).
  info = ml_dtypes.finfo(fmt.dtype)
  assert float(info.max) == table["max"]
  assert float(info.smallest_normal) == table["min_normal"]
  assert float(info.smallest_subnormal) == table["min_subnormal"]


def test_hybrid_uses_e5m2_for_gradients_only():
  assert fp8jax.formats_for("hybrid") == (fp8jax.E4M3, fp8jax.E5M2)
  assert fp8jax.formats_for("e4m3") == (fp8jax.E4M3, fp8jax.E4M3)


def _hostile_inputs(rng, name, n=4096):
  table = FORMAT_TABLE[name]
  # Magnitudes from far below the smallest subnormal to far above max.
  magnitudes = 2.0**rng.uniform(-24, 20, n)
  x = (rng.choice([-1.0, 1.0], n) * magnitudes).astype(np.float32)
  grid = np.array([table["min_subnormal"] * k for k in range(1, 9)])
  # Exact halfway points between neighbouring grid values test round-half-to-even.
  normals = 2.0**np.arange(-6, 8) * (1 + np.arange(8)[:, None] / 8.0)
  halfway = (normals[:, :-1] + normals[:, 1:]).ravel() / 2
  special = np.array([0.0, -0.0, np.nan, np.inf, -np.inf, table["max"], -table["max"],
                      table["max"] * 1.01, -table["max"] * 4, table["min_normal"],
                      table["min_subnormal"] / 2, -table["min_subnormal"] / 3])
  return np.concatenate([x, grid, -grid, halfway, special]).astype(np.float32)


def _bits(values_f64, dtype):
  return np.asarray(values_f64).astype(dtype).view(np.uint8)


@pytest.mark.parametrize("name", ["e4m3", "e5m2"])
@pytest.mark.parametrize("scale", [1.0, 3.7, 2.0**-5, 1000.0])
def test_quantize_is_bitwise_equal_to_float64_reference(name, scale):
  # A seed fixed across processes (str hashing is salted per process).
  rng = np.random.default_rng(zlib.crc32(f"{name}/{scale}".encode()))
  fmt = FORMATS[name]
  x = _hostile_inputs(rng, name)
  q = np.asarray(fp8jax.quantize(jnp.asarray(x), jnp.float32(scale), fmt))
  expected = quantize_reference(x, scale, name)
  nan = np.isnan(expected)
  np.testing.assert_array_equal(np.isnan(q.astype(np.float64)), nan)  # NaN stays NaN, only NaN
  # Bitwise on the f8 values (so -0 vs +0 counts); the reference values are exact
  # grid points, so their cast to the FP8 dtype is exact.
  np.testing.assert_array_equal(q.view(np.uint8)[~nan], _bits(expected[~nan], fmt.dtype))


@pytest.mark.parametrize("name", ["e4m3", "e5m2"])
def test_quantize_saturates_beyond_max_and_keeps_signed_zero(name):
  fmt = FORMATS[name]
  x = jnp.array([fmt.max * 2, -fmt.max * 2, np.inf, -np.inf, -0.0, 0.0], jnp.float32)
  q = np.asarray(fp8jax.quantize(x, jnp.float32(1.0), fmt)).astype(np.float64)
  np.testing.assert_array_equal(q[:4], [fmt.max, -fmt.max, fmt.max, -fmt.max])
  assert np.signbit(q[4]) and not np.signbit(q[5])


@pytest.mark.parametrize("name", ["e4m3", "e5m2"])
@pytest.mark.parametrize("out_dtype", [jnp.float32, jnp.bfloat16])
def test_dequantize_matches_float64_reference(name, out_dtype):
  rng = np.random.default_rng(7)
  fmt = FORMATS[name]
  raw = rng.integers(0, 256, 2048, dtype=np.uint8).view(fmt.dtype)
  scale = np.float32(37.25)
  out = np.asarray(fp8jax.dequantize(jnp.asarray(raw), jnp.float32(scale), out_dtype))
  # Same arithmetic in float64: q * float32(1/scale); the exact product is rounded
  # once to float32 (exact in float64: 4 + 24 bits), then to the output dtype.
  inv = np.float64(np.float32(1.0) / scale)
  expected = (raw.astype(np.float64) * inv).astype(np.float32).astype(out_dtype)
  np.testing.assert_array_equal(out.astype(np.float64), np.asarray(expected).astype(np.float64))


def test_amax_is_max_abs_and_propagates_nan():
  x = jnp.array([[-3.5, 2.0], [1.0, -0.25]], jnp.bfloat16)
  assert float(fp8jax.amax(x)) == 3.5
  assert np.isnan(float(fp8jax.amax(jnp.array([1.0, np.nan]))))
