"""fp8jax's FP8 bookkeeping kernels, and where they run instead of the same jnp.

The one module through which fp8jax reaches `pallas_kernels` for FP8 state and
quantization work (attention has its own, `fp8jax.fused_attention`):

* `cast_transpose_amax`: an FP8 dense layer reads each high-precision tensor
  T [R, C] (activation, weight, output gradient) in two GEMMs with different
  contracted dims, and cuBLASLt's FP8 GEMM on Hopper wants the contracted dim
  innermost for both operands. So each tensor is needed as `q = saturate(T *
  scale)` in FP8 in its own layout and transposed, and its amax is recorded.
  One kernel reads T once, writes both FP8 copies and folds max|T| into the
  running amax; XLA by itself needs four kernels and two reads of T for it.
* `tensor_amax`: the amax pass current scaling needs before it can cast.
* `close_steps`: the end-of-step update of every FP8 role of a model in one
  launch (XLA compiles it into a few kernels per role).

Each is chosen when the program is lowered (`jax.lax.platform_dependent`): on a
GPU the Pallas kernel, elsewhere the jnp definition, so a program compiled for
an H100 on a CPU-only machine gets the kernels too. Kernel and jnp agree bit
for bit (tests/test_fused_kernels.py), except that XLA on CPU flushes
subnormal inputs to zero where the GPU keeps them.

The kernels run in single-device programs only. Under plain `jit` on several
devices XLA's SPMD partitioner cannot split a custom kernel (it would gather
its inputs to every device), and inside `shard_map` a Pallas call must declare
how each output varies over the mesh, which these kernels do not do yet: there
the jnp form runs (the same numbers, more kernels). `fused_kernels(True)`
forces them on (e.g. a single-device program on a host with several GPUs),
`fused_kernels(False)` off.
"""
from __future__ import annotations

import contextlib
import contextvars
import warnings

import jax
import jax.numpy as jnp

import pallas_kernels
from fp8jax.formats import Fp8Format
from fp8jax.amax import amax, amax_max
from fp8jax.quantize import quantize
from fp8jax.sharding import varying_axes

_F32_MAX = float(jnp.finfo(jnp.float32).max)
_KERNEL_INPUT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
_FORCED = contextvars.ContextVar("fp8jax_fused_kernels", default=None)
_warned_several_devices = False


@contextlib.contextmanager
def fused_kernels(enabled: bool):
  """Forces fp8jax's fused GPU kernels on or off for the programs traced inside."""
  if not isinstance(enabled, bool):
    raise TypeError(f"enabled={enabled!r} must be True or False.")
  token = _FORCED.set(enabled)
  try:
    yield
  finally:
    _FORCED.reset(token)


def kernels_allowed(*trees) -> bool:
  """Whether the fused kernels may take the arrays in `trees` (if lowered for a GPU)."""
  forced = _FORCED.get()
  if forced is not None:
    return forced
  if varying_axes(*trees):
    return False
  if jax.device_count() > 1:
    global _warned_several_devices
    if not _warned_several_devices and jax.default_backend() == "gpu":
      _warned_several_devices = True
      warnings.warn(
          f"fp8jax: {jax.device_count()} devices are visible, so its fused FP8 kernels are "
          "off (XLA could not partition them); FP8 bookkeeping runs as plain XLA, with more "
          "kernels. For single-device programs use `with fp8jax.fused_kernels.fused_kernels"
          "(True):` around the jit trace.", stacklevel=3)
    return False
  return True


def choose(args, kernel, reference):
  """`kernel(*args)` where the program is lowered for a GPU and kernels are allowed, else
  `reference(*args)`."""
  if not kernels_allowed(args):
    return reference(*args)
  return jax.lax.platform_dependent(*args, cuda=kernel, default=reference)


def cast_transpose_amax(x: jax.Array, scale: jax.Array, running_amax: jax.Array,
                        fmt: Fp8Format, descale: jax.Array | None = None,
                        partner_descales: tuple | None = None):
  """`(q, q.T, max(running_amax, max|x|), products)` with `q = saturate(x * scale)` in `fmt`.

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
    products = (tuple(jnp.minimum(descale * p, _F32_MAX) for p in partner_descales)
                if with_products else None)
    return q, q.T, amax_max(running_amax, amax(x)), products

  def kernel(x, scale, running_amax, descale, partner_descales):
    out = pallas_kernels.cast_transpose_amax(
        x, scale, running_amax, fp8_dtype=fmt.dtype, fp8_max=fmt.max, descale=descale,
        partner_descales=partner_descales)
    return out if with_products else (*out, None)

  args = (x, scale, running_amax, descale, partner_descales)
  if not _takes(x):
    return reference(*args)
  return choose(args, kernel, reference)


def tensor_amax(x: jax.Array) -> jax.Array:
  """float32[] max|x| of a 2-D `x` in one pass (NaN if `x` holds a NaN)."""
  zero = jnp.zeros((), jnp.float32)

  def reference(x, start):
    return amax_max(start, amax(x))

  def kernel(x, start):
    return pallas_kernels.running_amax(x, start)

  if not _takes(x):
    return reference(x, zero)
  return choose((x, zero), kernel, reference)


def close_steps(amaxes, other_amaxes, histories, scales, *, numerators, history_len,
                amax_compute_algo, reference):
  """`reference(amaxes, other_amaxes, histories, scales)` (the jnp update of
  `fp8jax.scaling`), or `pallas_kernels.close_steps` doing the same in one launch."""

  def kernel(amaxes, other_amaxes, histories, scales):
    return pallas_kernels.close_steps(
        amaxes, histories, scales, numerators=numerators, history_len=history_len,
        amax_compute_algo=amax_compute_algo, other_amaxes=other_amaxes)

  return choose((amaxes, other_amaxes, histories, scales), kernel, reference)


def _takes(x) -> bool:
  """Whether the cast kernels accept `x` (2-D, non-empty, bf16/f16/f32)."""
  return x.ndim == 2 and x.size > 0 and jnp.dtype(x.dtype) in _KERNEL_INPUT_DTYPES
