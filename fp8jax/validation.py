"""Input checks shared by the public functions: clear errors that name the argument."""
from __future__ import annotations

import jax.numpy as jnp


def check_floating(x, argname: str) -> None:
  """Raises TypeError unless `x` is a bf16/f16/f32/f64 array (not int, bool or FP8)."""
  dtype = jnp.result_type(x)
  if not jnp.issubdtype(dtype, jnp.floating) or jnp.dtype(dtype).itemsize < 2:
    raise TypeError(
        f"{argname} has dtype {dtype}; fp8jax takes bfloat16, float16 or float32 inputs "
        f"and quantizes them itself. Cast {argname} with .astype(jnp.bfloat16) first.")
