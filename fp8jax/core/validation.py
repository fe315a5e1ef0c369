"""Input checks shared by the public functions: clear errors that name the argument."""
from __future__ import annotations

import jax.numpy as jnp

from fp8jax.core.formats import Fp8Format


def check_floating(x, argname: str) -> None:
  """Raises TypeError unless `x` is a bf16/f16/f32/f64 array (not int, bool or FP8)."""
  dtype = jnp.result_type(x)
  if not jnp.issubdtype(dtype, jnp.floating) or jnp.dtype(dtype).itemsize < 2:
    raise TypeError(
        f"{argname} has dtype {dtype}; fp8jax takes bfloat16, float16 or float32 inputs "
        f"and quantizes them itself. Cast {argname} with .astype(jnp.bfloat16) first.")


def check_format(fmt, argname: str = "fmt") -> None:
  """Raises TypeError unless `fmt` is an `Fp8Format` (fp8jax.E4M3 or fp8jax.E5M2)."""
  if not isinstance(fmt, Fp8Format):
    raise TypeError(
        f"{argname} must be fp8jax.E4M3 or fp8jax.E5M2 (an fp8jax.Fp8Format), got "
        f"{type(fmt).__name__}: {fmt!r}. A dtype or a name is not enough: the format "
        "also carries the max value used for saturation.")


def check_fp8_array(q, argname: str) -> None:
  """Raises TypeError unless `q` is an FP8 (float8_e4m3fn / float8_e5m2) array."""
  dtype = jnp.result_type(q)
  if dtype not in (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2)):
    raise TypeError(
        f"{argname} has dtype {dtype}; dequantize takes the FP8 array that "
        "fp8jax.quantize returned (float8_e4m3fn or float8_e5m2).")


def check_int(name: str, value, minimum: int) -> None:
  """Raises ValueError unless `value` is an int (not bool) >= `minimum`, naming `name`."""
  if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
    raise ValueError(f"{name}={value!r} must be an integer >= {minimum}.")
