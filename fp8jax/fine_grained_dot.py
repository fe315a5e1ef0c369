"""FP8 matmul with per-row or per-block scales: RowwiseScaling, BlockScaling, MXFP8Scaling.

A dot_general is folded into `x [..., M, K] @ kernel [..., K, N]` (batch dims
leading, free reshapes and transposes outside the custom VJP). Its three GEMMs
each quantize both operands along *that GEMM's* contraction axis:

    fprop  out = x @ k       x along K (per row / 1 x B tiles),  k along K
    dgrad  dx  = g @ k^T     g along N,                          k along N
    wgrad  dk  = x^T @ g     x along M,                          g along M

Operand blocks per recipe, for a GEMM `A [P, C] @ B [C, Q]`:

    RowwiseScaling   A: one scale per row (1, C)   B: one per column (C, 1)
    BlockScaling     A: 1 x B tiles (1, B)          B: (B, 1) tiles; the kernel in
                                                    B x B blocks (one quantization
                                                    serves fprop and dgrad)
    MXFP8Scaling     A: (1, 32) E8M0 blocks         B: (32, 1) E8M0 blocks

GEMMs:

* Rowwise: a raw FP8 dot accumulated in float32, then the outer product of the
  two descale vectors applied to the product (an epilogue):
  `out[p, q] = (q(A) @ q(B))[p, q] * a_inv[p] * b_inv[q]`. The scales never
  touch the operands before the dot, so on Hopper the dot stays the cuBLASLt
  FP8 GEMM (a scale that varies along the contraction cannot be folded into it).
* Block and MX: emulated exactly: both operands dequantized per block to
  float32 and multiplied at HIGHEST precision (float32 accumulation). With
  `BlockScaling(gemm="pallas_hopper")` on a GPU, fprop and dgrad (whose right
  operand is the kernel in 128 x 128 blocks) run on the block-scaled Mosaic
  GPU kernel of `pallas_kernels.block_scaled_matmul`; wgrad, whose operands are
  both tiled along M, stays emulated.

GEMMs named in the recipe's `high_precision` run as `lax.dot_general` in the
input dtype on the unquantized operands.

State: every role's amax (of the whole tensor) is recorded in the meta as in
`fp8jax.dot`: x and kernel in the returned meta, the output gradient in the
cotangent of the meta input. The scales used are computed from the operands
and are not stored.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import warnings

import jax
import jax.numpy as jnp

from fp8jax.amax import amax
from fp8jax.block_quantize import BlockQuantized, dequantize_blocks
from fp8jax.explicit_mesh import is_explicitly_sharded
from fp8jax.meta import DotMeta
from fp8jax.scaling import amaxes_unbatched_like, record_amax
from fp8jax.shard_map_warnings import warn_if_scales_are_per_shard


def fine_grained_dot_general(x: jax.Array, kernel: jax.Array, meta: DotMeta,
                             dims) -> tuple[jax.Array, DotMeta]:
  """`lax.dot_general(x, kernel, dims)` under a per-row / per-block recipe.

  Args:
    x, kernel: floating arrays; `dims` normalized dimension numbers
      `((x_contracting, kernel_contracting), (x_batch, kernel_batch))`.
    meta: `DotMeta` of a `RowwiseScaling`, `BlockScaling` or `MXFP8Scaling`.

  Returns:
    (out, new_meta) as `fp8jax.fp8_dot_general`: out in x's dtype with
    dot_general's shape [batch, x free, kernel free].

  Inside `jax.shard_map` the scales are those of each device's part of the
  operands, which differ from one device's where a contracted axis is split
  (`fp8jax.shard_map_warnings` warns); under plain `jit` they are global.

  Raises:
    ValueError: x or kernel is sharded over an explicit-axis mesh.
  """
  if is_explicitly_sharded(x, kernel):
    # Per-row / per-block scales repeat and reshape the operands in ways JAX's
    # sharding types do not follow (jnp.repeat, block reshapes).
    raise ValueError(
        f"meta.recipe={type(meta.recipe).__name__}: per-row and per-block FP8 recipes do not "
        f"run on arrays sharded over an explicit-axis mesh (x {jax.typeof(x)}, kernel "
        f"{jax.typeof(kernel)}). Use DelayedScaling or CurrentScaling on that mesh, or make "
        "the mesh with jax.sharding.AxisType.Auto axes, where XLA partitions this recipe.")
  warn_if_scales_are_per_shard(meta.recipe, x, kernel)
  (x_contract, k_contract), (x_batch, k_batch) = dims
  x_free = [a for a in range(x.ndim) if a not in x_contract + x_batch]
  k_free = [a for a in range(kernel.ndim) if a not in k_contract + k_batch]
  batch_shape = tuple(x.shape[a] for a in x_batch)
  m_shape = tuple(x.shape[a] for a in x_free)
  n_shape = tuple(kernel.shape[a] for a in k_free)
  k_size = math.prod(x.shape[a] for a in x_contract)
  x3 = jnp.transpose(x, (*x_batch, *x_free, *x_contract)).reshape(
      *batch_shape, math.prod(m_shape), k_size)
  k3 = jnp.transpose(kernel, (*k_batch, *k_contract, *k_free)).reshape(
      *batch_shape, k_size, math.prod(n_shape))
  out, new_meta = _fine_grained_matmul(x3, k3, meta, jnp.dtype(kernel.dtype))
  return out.reshape(*batch_shape, *m_shape, *n_shape), new_meta


# ----- The GEMMs ---------------------------------------------------------------------------


def _batched_dims(ndim: int):
  """dot_general dims of `[..., P, C] @ [..., C, Q]` with the leading dims as batch."""
  batch = tuple(range(ndim - 2))
  return (((ndim - 1,), (ndim - 2,)), (batch, batch))


def rowwise_gemm(a: BlockQuantized, b: BlockQuantized, out_dtype) -> jax.Array:
  """`(q(A) @ q(B)) * a_inv[:, None] * b_inv[None, :]` in `out_dtype`.

  a: q [..., P, C] with scale_inv [..., P, 1]; b: q [..., C, Q] with scale_inv
  [..., 1, Q]. The raw FP8 dot accumulates in float32; the descales multiply
  its float32 product, which is then rounded once to `out_dtype`.
  """
  product = jax.lax.dot_general(a.q, b.q, _batched_dims(a.q.ndim),
                                preferred_element_type=jnp.float32)
  return (product * a.scale_inv * b.scale_inv).astype(out_dtype)


def emulated_block_gemm(a: BlockQuantized, b: BlockQuantized, out_dtype) -> jax.Array:
  """`dequantize(A) @ dequantize(B)` in float32 at HIGHEST precision, rounded to `out_dtype`."""
  return jax.lax.dot_general(dequantize_blocks(a), dequantize_blocks(b),
                             _batched_dims(a.q.ndim), precision=jax.lax.Precision.HIGHEST,
                             preferred_element_type=jnp.float32).astype(out_dtype)


def pallas_block_gemm(a: BlockQuantized, b: BlockQuantized, out_dtype) -> jax.Array:
  """The block-scaled Mosaic GPU kernel on A [P, C] (1 x 128 tiles) and B [C, Q] (128 x 128)."""
  import pallas_kernels
  if jax.default_backend() != "gpu":
    raise ValueError(
        "BlockScaling(gemm='pallas_hopper') runs the block-scaled FP8 GEMM kernel, which needs "
        f"a GPU, but JAX's backend is {jax.default_backend()!r}. Use "
        "BlockScaling(gemm='emulated') (the default) on this platform.")
  if a.q.ndim != 2:
    raise ValueError(
        f"BlockScaling(gemm='pallas_hopper') runs 2-D GEMMs only; this dot_general has batch "
        f"dims (operand shape {a.q.shape}). Use gemm='emulated' for batched contractions.")
  if not pallas_kernels.BLOCK_SCALED_GEMM_VALIDATED_ON_GPU:
    warnings.warn(
        "BlockScaling(gemm='pallas_hopper'): the block-scaled GEMM kernel has not yet been "
        "validated against its reference on a GPU (pallas_kernels.block_scaled_matmul."
        "BLOCK_SCALED_GEMM_VALIDATED_ON_GPU is False).", stacklevel=2)
  try:
    return pallas_kernels.block_scaled_matmul(a.q, a.scale_inv, b.q.T, b.scale_inv.T,
                                              out_dtype=out_dtype)
  except (ValueError, TypeError) as error:  # shapes or dtypes the kernel does not take
    raise type(error)(f"BlockScaling(gemm='pallas_hopper'): {error} Or use "
                      "gemm='emulated', which takes any shape.") from error


def _high_precision_dot(a: jax.Array, b: jax.Array) -> jax.Array:
  """`a [..., P, C] @ b [..., C, Q]` unquantized, in `a`'s dtype (b is cast to it, so a
  bf16 activation with a float32 kernel is a bf16 GEMM, as the FP8 path's output is)."""
  return jax.lax.dot_general(a, b.astype(a.dtype), _batched_dims(a.ndim))


# ----- The custom VJP ----------------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _fine_grained_matmul(x, kernel, meta, kernel_dtype):
  out, new_meta, _ = _forward(x, kernel, meta)
  return out, new_meta


def _forward(x, kernel, meta):
  recipe = meta.recipe
  high = recipe.high_precision
  new_meta = dataclasses.replace(meta, x=record_amax(meta.x, amax(x)),
                                 kernel=record_amax(meta.kernel, amax(kernel)))
  k_fprop = None
  with jax.named_scope("fp8_fprop"):
    if "fprop" in high:
      out = _high_precision_dot(x, kernel)
    else:
      x_fprop = recipe.quantize_operand(x, meta.x.fmt, axis=-1, weight=False)
      k_fprop = recipe.quantize_operand(kernel, meta.kernel.fmt, axis=-2, weight=True)
      out = recipe.operand_gemm(x_fprop, k_fprop, x.dtype)
  # What the backward GEMMs read of x and the kernel, quantized here (FP8 residuals).
  if "dgrad" in high:
    k_dgrad = kernel
  elif recipe.kernel_blocks_serve_dgrad and k_fprop is not None:
    k_dgrad = k_fprop  # B x B blocks are the same blocks of k^T
  else:
    k_dgrad = recipe.quantize_operand(kernel, meta.kernel.fmt, axis=-1, weight=True)
  x_wgrad = x if "wgrad" in high else recipe.quantize_operand(x, meta.x.fmt, axis=-2,
                                                              weight=False)
  return out, amaxes_unbatched_like(meta, new_meta), (x_wgrad, k_dgrad, meta.grad)


def _fine_grained_fwd(x, kernel, meta, kernel_dtype):
  out, new_meta, residuals = _forward(x, kernel, meta)
  return (out, new_meta), residuals


def _fine_grained_bwd(kernel_dtype, residuals, cotangents):
  x_wgrad, k_dgrad, grad_meta = residuals
  g, meta_cotangent = cotangents
  recipe, high, fmt = grad_meta.recipe, grad_meta.recipe.high_precision, grad_meta.fmt
  with jax.named_scope("fp8_dgrad"):
    if "dgrad" in high:
      dx = _high_precision_dot(g, jnp.swapaxes(k_dgrad, -1, -2)).astype(g.dtype)
    else:
      g_dgrad = recipe.quantize_operand(g, fmt, axis=-1, weight=False)
      dx = recipe.operand_gemm(g_dgrad, k_dgrad.transpose(), g.dtype)
  with jax.named_scope("fp8_wgrad"):
    if "wgrad" in high:
      dk = _high_precision_dot(jnp.swapaxes(x_wgrad, -1, -2), g).astype(kernel_dtype)
    else:
      g_wgrad = recipe.quantize_operand(g, fmt, axis=-2, weight=False)
      dk = recipe.operand_gemm(x_wgrad.transpose(), g_wgrad, kernel_dtype)
  grad_cotangent = record_amax(meta_cotangent.grad, amax(g))
  return dx, dk, amaxes_unbatched_like(
      meta_cotangent, dataclasses.replace(meta_cotangent, grad=grad_cotangent))


_fine_grained_matmul.defvjp(_fine_grained_fwd, _fine_grained_bwd)
