"""`fp8_dot_general`: `lax.dot_general` with FP8 operands in forward and backward.

Forward:  out = (q(x) . q(kernel)) / (s_x * s_kernel)           (fprop GEMM)
Backward: dx  = (q(g) . q(kernel)^T) / (s_g * s_kernel)          (dgrad GEMM)
          dk  = (q(x)^T . q(g)) / (s_x * s_g)                    (wgrad GEMM)

with `q(t) = saturate(t * s_t)` in the role's FP8 format (E4M3 for x and
kernel; E5M2 for the output gradient g under "hybrid"). Raw f8 arrays go into
`lax.dot_general` with float32 accumulation and the scales are applied to the
float32 product as scalars, which is the form XLA rewrites into the cuBLASLt
FP8 GEMM on Hopper (DESIGN.md, lowering contract).

State: the function returns the meta with the amaxes of x and kernel recorded;
the gradient role's amax is recorded in the cotangent of `meta` during the
backward pass, max-combined with the cotangent flowing in from later uses.
Threading the meta (use -> new meta -> next use) therefore gives the max over
all uses in both directions; see `fp8jax.value_and_grad`.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from fp8jax.meta import DotMeta, check_dot_meta
from fp8jax.quantize import amax, quantize, quantize_with_meta, scale_for
from fp8jax.scaling import record_amax
from fp8jax.sharding import match_operand_axes
from fp8jax.validation import check_floating

DimensionNumbers = tuple[tuple[Sequence[int], Sequence[int]], tuple[Sequence[int], Sequence[int]]]


def fp8_dot_general(x: jax.Array, kernel: jax.Array, meta: DotMeta,
                    dimension_numbers: DimensionNumbers) -> tuple[jax.Array, DotMeta]:
  """FP8 `lax.dot_general(x, kernel, dimension_numbers)`.

  Args:
    x: floating array (bf16, f16 or f32), the activation.
    kernel: floating array, the weight.
    meta: the `DotMeta` of this matmul (from `fp8jax.init_dot_meta`).
    dimension_numbers: as for `jax.lax.dot_general`:
      `((x_contracting, kernel_contracting), (x_batch, kernel_batch))`.

  Returns:
    (out, new_meta): `out` has `lax.dot_general`'s shape and `x`'s dtype
    (accumulated in float32); `new_meta` has this use's amaxes recorded.
  """
  check_floating(x, "x")
  check_floating(kernel, "kernel")
  check_dot_meta(meta, "meta")
  dims = normalize_dimension_numbers(dimension_numbers, x.shape, kernel.shape)
  x, kernel, meta = match_operand_axes(x, kernel, meta)  # inside shard_map; see fp8jax.sharding
  return _fp8_dot(x, kernel, meta, dims, jnp.dtype(kernel.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _fp8_dot(x, kernel, meta, dims, kernel_dtype):
  out, new_meta, _ = _fp8_dot_fwd_impl(x, kernel, meta, dims)
  return out, new_meta


def _fp8_dot_fwd_impl(x, kernel, meta, dims):
  qx, scale_x, meta_x = quantize_with_meta(x, meta.x)
  qk, scale_k, meta_k = quantize_with_meta(kernel, meta.kernel)
  # Named scopes label the three GEMMs in HLO metadata (fp8jax.lowering reads them).
  with jax.named_scope("fp8_fprop"):
    out = scaled_dot(qx, qk, scale_x, scale_k, dims, x.dtype)
  new_meta = dataclasses.replace(meta, x=meta_x, kernel=meta_k)
  residuals = (qx, qk, scale_x, scale_k, meta.grad)
  return out, new_meta, residuals


def _fp8_dot_fwd(x, kernel, meta, dims, kernel_dtype):
  out, new_meta, residuals = _fp8_dot_fwd_impl(x, kernel, meta, dims)
  return (out, new_meta), residuals


def _fp8_dot_bwd(dims, kernel_dtype, residuals, cotangents):
  qx, qk, scale_x, scale_k, grad_meta = residuals
  g, meta_cotangent = cotangents
  g_amax = amax(g)
  scale_g = scale_for(grad_meta, g_amax, like=g)
  qg = quantize(g, scale_g, grad_meta.fmt)

  dgrad_dims, dgrad_perm = dgrad_dimension_numbers(dims, qx.ndim, qk.ndim)
  with jax.named_scope("fp8_dgrad"):
    dx = jnp.transpose(scaled_dot(qg, qk, scale_g, scale_k, dgrad_dims, g.dtype), dgrad_perm)

  wgrad_dims, wgrad_perm = wgrad_dimension_numbers(dims, qx.ndim, qk.ndim)
  with jax.named_scope("fp8_wgrad"):
    dk = jnp.transpose(scaled_dot(qx, qg, scale_x, scale_g, wgrad_dims, kernel_dtype), wgrad_perm)

  meta_in_cotangent = dataclasses.replace(
      meta_cotangent, grad=record_amax(meta_cotangent.grad, g_amax))
  return dx, dk, meta_in_cotangent


_fp8_dot.defvjp(_fp8_dot_fwd, _fp8_dot_bwd)


def scaled_dot(qa: jax.Array, qb: jax.Array, scale_a: jax.Array, scale_b: jax.Array,
               dims, out_dtype) -> jax.Array:
  """`dot_general(qa, qb) / scale_a / scale_b` with f8 operands and a float32 product.

  The two descales are applied one after the other: their product alone can
  leave float32's range (tiny scales of huge tensors underflow to 0, and 1/0
  would turn an all-zero row into 0 * inf = NaN).
  """
  product = jax.lax.dot_general(qa, qb, dims, preferred_element_type=jnp.float32)
  return (product * (1.0 / scale_a) * (1.0 / scale_b)).astype(out_dtype)


def normalize_dimension_numbers(dimension_numbers, x_shape, kernel_shape):
  """Checks `dimension_numbers` against the operand shapes; returns them as int tuples."""
  try:
    (x_contract, k_contract), (x_batch, k_batch) = dimension_numbers
    dims = ((tuple(int(a) for a in x_contract), tuple(int(a) for a in k_contract)),
            (tuple(int(a) for a in x_batch), tuple(int(a) for a in k_batch)))
  except (TypeError, ValueError):
    raise ValueError(
        f"dimension_numbers={dimension_numbers!r} must be "
        "((x_contracting, kernel_contracting), (x_batch, kernel_batch)), "
        "as for jax.lax.dot_general.") from None
  (x_contract, k_contract), (x_batch, k_batch) = dims
  for name, axes, shape in (("x", x_contract + x_batch, x_shape),
                            ("kernel", k_contract + k_batch, kernel_shape)):
    if any(not 0 <= a < len(shape) for a in axes) or len(set(axes)) != len(axes):
      raise ValueError(
          f"dimension_numbers={dimension_numbers!r} names axes {axes} of {name}, which has "
          f"shape {tuple(shape)}: each axis must be distinct and in [0, {len(shape)}).")
  for kind, x_axes, k_axes in (("contracting", x_contract, k_contract),
                               ("batch", x_batch, k_batch)):
    x_sizes = tuple(x_shape[a] for a in x_axes)
    k_sizes = tuple(kernel_shape[a] for a in k_axes)
    if x_sizes != k_sizes:
      raise ValueError(
          f"{kind} dimensions do not match: x axes {x_axes} have sizes {x_sizes} but kernel "
          f"axes {k_axes} have sizes {k_sizes} (x shape {tuple(x_shape)}, kernel shape "
          f"{tuple(kernel_shape)}). Transpose or reshape one operand so they agree.")
  return dims


def _free_axes(ndim, *used):
  taken = set(a for axes in used for a in axes)
  return [a for a in range(ndim) if a not in taken]


def dgrad_dimension_numbers(dims, x_ndim, k_ndim):
  """Dimension numbers of `dot_general(g, kernel)` giving dx, and the permutation to x's layout.

  `out = dot_general(x, kernel)` lays its axes out as [batch, x free, kernel free].
  dx contracts g's kernel-free axes with the kernel's free axes; the result is
  [batch, x free, kernel contracting (ascending)] and is permuted back to x.
  """
  (x_contract, k_contract), (x_batch, k_batch) = dims
  x_free = _free_axes(x_ndim, x_contract, x_batch)
  k_free = _free_axes(k_ndim, k_contract, k_batch)
  n_batch, n_x_free = len(x_batch), len(x_free)
  g_batch = list(range(n_batch))
  g_k_free = list(range(n_batch + n_x_free, n_batch + n_x_free + len(k_free)))
  dot_dims = ((tuple(g_k_free), tuple(k_free)), (tuple(g_batch), tuple(k_batch)))
  position = {}
  for i, a in enumerate(x_batch):
    position[a] = i
  for i, a in enumerate(x_free):
    position[a] = n_batch + i
  k_contract_sorted = sorted(k_contract)
  for xa, ka in zip(x_contract, k_contract):
    position[xa] = n_batch + n_x_free + k_contract_sorted.index(ka)
  return dot_dims, tuple(position[a] for a in range(x_ndim))


def wgrad_dimension_numbers(dims, x_ndim, k_ndim):
  """Dimension numbers of `dot_general(x, g)` giving dkernel, and the permutation to its layout.

  The result is [batch, x contracting (ascending), kernel free] and is permuted
  back to the kernel's layout.
  """
  (x_contract, k_contract), (x_batch, k_batch) = dims
  x_free = _free_axes(x_ndim, x_contract, x_batch)
  k_free = _free_axes(k_ndim, k_contract, k_batch)
  n_batch = len(x_batch)
  g_batch = list(range(n_batch))
  g_x_free = list(range(n_batch, n_batch + len(x_free)))
  dot_dims = ((tuple(x_free), tuple(g_x_free)), (tuple(x_batch), tuple(g_batch)))
  position = {}
  for i, a in enumerate(k_batch):
    position[a] = i
  x_contract_sorted = sorted(x_contract)
  for xa, ka in zip(x_contract, k_contract):
    position[ka] = n_batch + x_contract_sorted.index(xa)
  for i, a in enumerate(k_free):
    position[a] = n_batch + len(x_contract) + i
  return dot_dims, tuple(position[a] for a in range(k_ndim))
