"""FP8 matmul with per-row or per-block scales: RowwiseScaling, BlockScaling, MXFP8Scaling,
NVFP4Scaling (and any recipe with `Recipe.per_operand`).

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
    NVFP4Scaling     A: (1, 16) E2M1 blocks         B: (16, 1); the kernel in 16 x 16
                     with E4M3 scales, and a        blocks (serving fprop and dgrad);
                     float32 scale per operand      wgrad's operands Hadamard-transformed

GEMMs: each is the recipe's (`Recipe.operand_gemm`, from `fp8jax.core.blocks`):

* Rowwise: a raw FP8 dot accumulated in float32, the two descale vectors applied
  to its product (an epilogue), so on Hopper the dot stays the cuBLASLt FP8 GEMM.
* Block and MX: emulated exactly (dequantized per block, float32 dot at HIGHEST
  precision). With `BlockScaling(gemm="pallas_hopper")` on a GPU, fprop and dgrad
  (whose right operand is the kernel in 128 x 128 blocks) run on the block-scaled
  Mosaic GPU kernel; wgrad, whose operands are both tiled along M, stays emulated.

The GEMMs are `Recipe.target_gemm`, told the compile target's GPU architecture
(`fp8jax.mesh.target`): MXFP8Scaling and NVFP4Scaling with `gemm="native"` run
`jax.nn.scaled_matmul` (cuDNN) on a Blackwell GPU and the emulation elsewhere.

GEMMs named in the recipe's `high_precision` run as `lax.dot_general` in the
input dtype on the unquantized operands.

Stochastic rounding (`Recipe.stochastic_rounding`): the output gradient's two
quantizations (for dgrad and for wgrad) each get a key from the gradient role's
`rng` (`fp8jax.core.rounding_keys.gemm_key`); the state's key itself advances when
the step closes.

State: every role's amax (of the whole tensor) is recorded in the meta as in
`fp8jax.ops.dot`: x and kernel in the returned meta, the output gradient in the
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

from fp8jax.core.blocks import batched_dims
from fp8jax.core.meta import DotMeta, amaxes_unbatched_like, record_amax
from fp8jax.core.quantize import amax
from fp8jax.core.recipes import GEMMS
from fp8jax.core.rounding_keys import gemm_key
from fp8jax.mesh.axes import describe_axes, manual_axes, types_recorded, varying_axes
from fp8jax.mesh.explicit import is_explicitly_sharded
from fp8jax.mesh.target import compile_target
from fp8jax.ops import saved_activations


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
  (`warn_if_scales_are_per_shard` warns); under plain `jit` they are global.

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
  out, new_meta = _fine_grained_matmul(x3, k3, meta, jnp.dtype(kernel.dtype),
                                       compile_target().gpu_arch)
  return out.reshape(*batch_shape, *m_shape, *n_shape), new_meta


def _high_precision_dot(a: jax.Array, b: jax.Array) -> jax.Array:
  """`a [..., P, C] @ b [..., C, Q]` unquantized, in `a`'s dtype (b is cast to it, so a
  bf16 activation with a float32 kernel is a bf16 GEMM, as the FP8 path's output is)."""
  return jax.lax.dot_general(a, b.astype(a.dtype), batched_dims(a.ndim))


# ----- The custom VJP ----------------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _fine_grained_matmul(x, kernel, meta, kernel_dtype, gpu_arch):
  out, new_meta, _ = _forward(x, kernel, meta, gpu_arch)
  return out, new_meta


def _forward(x, kernel, meta, gpu_arch):
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
      out = recipe.target_gemm(x_fprop, k_fprop, x.dtype, gpu_arch)
  # What the backward GEMMs read of x and the kernel, quantized here (FP8 residuals).
  if "dgrad" in high:
    k_dgrad = kernel
  elif recipe.kernel_blocks_serve_dgrad and k_fprop is not None:
    k_dgrad = k_fprop  # B x B blocks are the same blocks of k^T
  else:
    k_dgrad = recipe.quantize_operand(kernel, meta.kernel.fmt, axis=-1, weight=True)
  if "wgrad" in high:
    x_wgrad = x
  else:
    x_wgrad = recipe.quantize_operand(x, meta.x.fmt, axis=-2, weight=False)
    # Named: what `saved_activations.policy()` keeps under remat.
    q, scale_inv = saved_activations.named(x_wgrad.q, x_wgrad.scale_inv, "dense_x")
    x_wgrad = dataclasses.replace(x_wgrad, q=q, scale_inv=scale_inv)
  return out, amaxes_unbatched_like(meta, new_meta), (x_wgrad, k_dgrad, meta.grad)


def _fine_grained_fwd(x, kernel, meta, kernel_dtype, gpu_arch):
  out, new_meta, residuals = _forward(x, kernel, meta, gpu_arch)
  return (out, new_meta), residuals


def _fine_grained_bwd(kernel_dtype, gpu_arch, residuals, cotangents):
  x_wgrad, k_dgrad, grad_meta = residuals
  g, meta_cotangent = cotangents
  recipe, high = grad_meta.recipe, grad_meta.recipe.high_precision
  g_amax = amax(g)
  with jax.named_scope("fp8_dgrad"):
    if "dgrad" in high:
      dx = _high_precision_dot(g, jnp.swapaxes(k_dgrad, -1, -2)).astype(g.dtype)
    else:
      g_dgrad = _quantize_gradient(g, grad_meta, g_amax, "dgrad", axis=-1)
      dx = recipe.target_gemm(g_dgrad, k_dgrad.transpose(), g.dtype, gpu_arch)
  with jax.named_scope("fp8_wgrad"):
    if "wgrad" in high:
      dk = _high_precision_dot(jnp.swapaxes(x_wgrad, -1, -2), g).astype(kernel_dtype)
    else:
      g_wgrad = _quantize_gradient(g, grad_meta, g_amax, "wgrad", axis=-2)
      dk = recipe.target_gemm(x_wgrad.transpose(), g_wgrad, kernel_dtype, gpu_arch)
  grad_cotangent = record_amax(meta_cotangent.grad, g_amax)
  return dx, dk, amaxes_unbatched_like(
      meta_cotangent, dataclasses.replace(meta_cotangent, grad=grad_cotangent))


_fine_grained_matmul.defvjp(_fine_grained_fwd, _fine_grained_bwd)


def _quantize_gradient(g, grad_meta, g_amax, gemm, axis):
  """The output gradient quantized for one GEMM; with a key when it is rounded stochastically."""
  recipe = grad_meta.recipe
  if grad_meta.rng is None:  # a recipe of your own may not take a key
    return recipe.quantize_operand(g, grad_meta.fmt, axis=axis, weight=False)
  return recipe.quantize_operand(g, grad_meta.fmt, axis=axis, weight=False,
                                 key=gemm_key(grad_meta.rng, gemm, g_amax))


# ----- Per-shard scales inside shard_map ---------------------------------------------------


def warn_if_scales_are_per_shard(recipe, *operands: jax.Array) -> None:
  """Warns when a per-row / per-block recipe's matmul runs on operands split over manual axes.

  Each device then computes the row and block scales of its own part of the
  operands; where that part is a slice of a contracted axis, they are not the
  scales of the whole row. fp8jax cannot tell which dimension a manual axis
  splits, so it warns whenever an operand is split (with `check_vma=False`,
  whenever the matmul runs per device at all).
  """
  if set(GEMMS) <= set(recipe.high_precision):  # no GEMM is quantized
    return
  manual = tuple(manual_axes())
  if not manual:
    return
  split = tuple(sorted(varying_axes(operands)))
  if not split and types_recorded(manual):
    return  # typed, and no operand differs between devices: nothing is split
  name = type(recipe).__name__
  if split:
    layout = f"this FP8 matmul's operands are split over {describe_axes(split)}"
    axis = split[0]
  else:
    layout = (f"this FP8 matmul runs per device over {describe_axes(manual)} "
              "(check_vma=False or pmap: fp8jax cannot see which operands are split)")
    axis = manual[0]
  warnings.warn(
      f"{name} scales each GEMM operand per row / per block from the values one device "
      f"holds, and inside jax.shard_map {layout}. Wherever that splits the axis a GEMM "
      "contracts, each device scales from its own slice of every row, and the results "
      "differ from one device's (the gradients by a percent or more): the weight gradient "
      f"contracts the batch, so a batch split over {axis!r} does it, and so does a "
      "row-parallel layer's input dimension. Run the step under plain jax.jit with sharded "
      "arrays (the scales are then those of whole rows, as on one device), keep contracted "
      "axes unsplit inside shard_map, or use a per-tensor recipe (DelayedScaling, "
      "CurrentScaling), whose amaxes fp8jax makes global.",
      stacklevel=2)  # one place for every layer: Python's default filter shows it once
