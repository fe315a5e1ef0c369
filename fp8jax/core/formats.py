"""FP8 number formats: E4M3 and E5M2, as in the OCP FP8 specification; and E2M1.

Each format is described by its JAX dtype and the constants of its number line.
E2M1 (the 4-bit element format of OCP MX's MXFP4 and of NVIDIA's NVFP4: 0, 0.5,
1, 1.5, 2, 3, 4, 6 and their negatives, no inf or NaN) is described the same way;
fp8jax casts to it only inside `NVFP4Scaling`, which scales its blocks in E4M3.
A *format choice* ("hybrid" or "e4m3") says which format the forward tensors
(activations, kernels) and the backward tensors (output gradients) use.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Fp8Format:
  """One FP8 number format (or E2M1, the 4-bit element format of NVFP4).

  Attributes:
    name: "e4m3", "e5m2" (or "e2m1").
    dtype: the JAX dtype (`jnp.float8_e4m3fn`, `jnp.float8_e5m2`; `jnp.float4_e2m1fn`).
    max: largest finite value (448 for E4M3, 57344 for E5M2; 6 for E2M1).
    min_normal: smallest positive normal value (2**-6 and 2**-14; 1).
    min_subnormal: smallest positive subnormal value (2**-9 and 2**-16; 0.5).
    mantissa_bits: explicit mantissa bits (3 and 2; 1).
  """

  name: str
  dtype: jnp.dtype
  max: float
  min_normal: float
  min_subnormal: float
  mantissa_bits: int

  def __repr__(self) -> str:
    return f"fp8jax.{self.name.upper()}"


#: 4 exponent and 3 mantissa bits, largest 448: activations and weights.
E4M3 = Fp8Format("e4m3", jnp.dtype(jnp.float8_e4m3fn), 448.0, 2.0**-6, 2.0**-9, 3)
#: 5 exponent and 2 mantissa bits, largest 57344: gradients under "hybrid".
E5M2 = Fp8Format("e5m2", jnp.dtype(jnp.float8_e5m2), 57344.0, 2.0**-14, 2.0**-16, 2)
#: 2 exponent and 1 mantissa bits, largest 6: the values of NVFP4Scaling's blocks
#: (OCP MX v1.0, 5.3.3: exponent bias 1, normals 1 to 6, one subnormal, 0.5).
E2M1 = Fp8Format("e2m1", jnp.dtype(jnp.float4_e2m1fn), 6.0, 1.0, 0.5, 1)

# Format choice -> (format of forward tensors, format of gradients).
FORMAT_CHOICES = {
    "hybrid": (E4M3, E5M2),
    "e4m3": (E4M3, E4M3),
}


def formats_for(fp8_format: str) -> tuple[Fp8Format, Fp8Format]:
  """Returns (forward format, gradient format) for a format choice.

  Args:
    fp8_format: "hybrid" (E4M3 forward, E5M2 gradients) or "e4m3" (E4M3 everywhere).

  Raises:
    ValueError: for any other name.
  """
  if fp8_format not in FORMAT_CHOICES:
    raise ValueError(
        f"fp8_format={fp8_format!r} is not a known FP8 format choice; "
        f"use one of {sorted(FORMAT_CHOICES)}.")
  return FORMAT_CHOICES[fp8_format]
