"""Quantize a 2-D GEMM operand into both layouts the FP8 GEMMs read, in one pass.

An FP8 dense layer reads each high-precision tensor T [R, C] (activation,
weight, output gradient) in two GEMMs with different contracted dims, and
cuBLASLt's FP8 GEMM on Hopper wants the contracted dim innermost in memory for
both operands. So each tensor is needed as `q = saturate(T * scale)` in FP8 in
its own layout [R, C] *and* transposed [C, R], and its amax is recorded.

* On a GPU: one Pallas kernel (`pallas_kernels.cast_transpose_amax`) reads T
  once, writes both FP8 copies and folds max|T| into the running amax with an
  atomic max. XLA by itself needs four kernels and two reads of T for the same
  work (the cast+transpose fusion, a two-stage amax reduction, and a kernel for
  the max with the running amax).
* Elsewhere (CPU, TPU) and on several devices under plain `jit`: the same
  arithmetic in jnp, which XLA fuses and partitions as usual. The kernel is
  bitwise equal to it (tests/test_cast_transpose.py).

The choice is made when the program is lowered (`jax.lax.platform_dependent`),
so a program compiled for an H100 from a CPU-only machine gets the kernel too.
The kernel runs in single-device programs only (`fp8jax.kernel_choice`).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

import pallas_kernels
from fp8jax.formats import Fp8Format
from fp8jax.quantize import amax, quantize
from fp8jax.kernel_choice import kernels_allowed

_F32_MAX = float(jnp.finfo(jnp.float32).max)


def cast_transpose_amax(x: jax.Array, scale: jax.Array, running_amax: jax.Array,
                        fmt: Fp8Format, descale: jax.Array | None = None,
                        partner_descales: jax.Array | None = None):
  """`(q, q.T, max(running_amax, max|x|))` with `q = saturate(x * scale)` in `fmt`.

  Args:
    x: [R, C] bf16/f16/f32.
    scale: float32[] multiplied in before the cast.
    running_amax: float32[] the step's amax so far.
    fmt: the FP8 format.
    descale, partner_descales: optional float32[] and a tuple of float32[]: also
      return `min(descale * partner, float32 max)` per partner, the combined
      descales of the GEMMs x enters (see `fp8jax.dot.scaled_matmul_nt`),
      computed by the same kernel instead of one scalar kernel per GEMM.

  Returns:
    q [R, C] and q.T [C, R] in `fmt.dtype`, the updated float32[] running amax,
    and the tuple of float32[] products (None without `partner_descales`).
  """
  with_products = partner_descales is not None

  def reference(x, scale, running_amax, descale, partner_descales):
    q = quantize(x, scale, fmt)
    running = pallas_kernels.amax_max(running_amax, amax(x))
    products = (tuple(jnp.minimum(descale * p, _F32_MAX) for p in partner_descales)
                if with_products else None)
    return q, q.T, running, products

  def kernel(x, scale, running_amax, descale, partner_descales):
    out = pallas_kernels.cast_transpose_amax(
        x, scale, running_amax, fp8_dtype=fmt.dtype, fp8_max=fmt.max, descale=descale,
        partner_descales=partner_descales)
    return out if with_products else (*out, None)

  args = (x, scale, running_amax, descale, partner_descales)
  if not _kernel_allowed(x):
    return reference(*args)
  return jax.lax.platform_dependent(*args, cuda=kernel, default=reference)


def tensor_amax(x: jax.Array) -> jax.Array:
  """float32[] max|x| of a 2-D `x` in one pass (NaN if `x` holds a NaN)."""
  zero = jnp.zeros((), jnp.float32)

  def reference(x, start):
    return pallas_kernels.amax_max(start, amax(x))

  def kernel(x, start):
    return pallas_kernels.running_amax(x, start)

  if not _kernel_allowed(x):
    return reference(x, zero)
  return jax.lax.platform_dependent(x, zero, cuda=kernel, default=reference)


def _kernel_allowed(x: jax.Array) -> bool:
  return x.ndim == 2 and x.size > 0 and kernels_allowed(x)
