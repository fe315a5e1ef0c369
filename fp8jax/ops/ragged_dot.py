"""`fp8_ragged_dot`: the grouped GEMM of mixture-of-experts layers, forward and backward in FP8.

`jax.lax.ragged_dot`'s semantics: rows of `x [M, K]` are sorted by group, `group_sizes`
int32 [G] says how many rows each group (expert) has, group g's rows are multiplied by
`w[g] [K, N]`, and rows past the groups' sum give zeros. Those rows (a buffer's padding)
change nothing, whatever they hold (NaN included): no output, gradient or amax reads
them. The three GEMMs of a step:

    fprop  y[r]   = x[r] @ w[g(r)]                    x along K, w[g] along K
    dgrad  dx[r]  = dy[r] @ w[g(r)]^T                 dy along N, w[g] along N
    wgrad  dw[g]  = sum over r in g of x[r]^T dy[r]   x, dy along the tokens

State (`RaggedDotMeta`): x and the output gradient have one scale each; the weight has
one per expert (a leading G axis on its scale and amax history), since experts' weights
differ by orders of magnitude. An expert that saw no rows this step records no amax (0,
which keeps its scale at the end of the step). The output gradient is cast to E4M3 under
every recipe: Hopper's FP8 `wgmma` (Mosaic GPU) multiplies two operands of one element
type, and E4M3 gradients under per-tensor delayed or per-block scales are what
DeepSeek-V3 trained its experts with.

Where it runs: lowered for a GPU (also in a deviceless compile), the GEMMs are the
grouped FP8 Mosaic kernels of `pallas_kernels.ragged_matmul` /
`pallas_kernels.transposed_ragged_matmul` (a persistent schedule over (expert, tile)
pairs: no padding, no G-fold expansion); elsewhere, and on a GPU that is not a Hopper,
their plain-jnp twins with the same descales. Per-tensor recipes scale in the kernels'
epilogue, per-row recipes too (an outer product of row and column descales), 1 x 128 /
128 x 128 block recipes promote each 128-wide chunk of the contraction into a float32
accumulator. Block shapes the kernels do not take (MXFP8's 32-element blocks, a user's
own) are dequantized per block and multiplied in float32 (an emulation); GEMMs named in
a recipe's `high_precision` run as `lax.ragged_dot` in the input dtype.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels
from fp8jax.core.blocks import BlockQuantized, dequantize_blocks
from fp8jax.core.meta import (Fp8Meta, RaggedDotMeta, amaxes_unbatched_like,
                              check_ragged_dot_meta, record_amax)
from fp8jax.core.quantize import (amax, max_by_bits, quantize, round_down_to_power_of_two,
                                  scale_from_window)
from fp8jax.core.validation import check_floating
from fp8jax.mesh.axes import match_operand_axes, vary, varying_axes
from fp8jax.mesh.partitioning import vmapped_as
from fp8jax.ops.cast import cast_scale
from fp8jax.ops.fused_kernels import cast_transpose_amax, kernels_allowed
from fp8jax.ops.guards import check_threaded, refuse_split_state, reverse_mode_only

# The kernels' contraction step and tiles: shapes that are not multiples take the jnp path.
_KERNEL_MULTIPLE = 128
_TOKEN_MULTIPLE = 16


def fp8_ragged_dot(x: jax.Array, w: jax.Array, group_sizes: jax.Array,
                   meta: RaggedDotMeta) -> tuple[jax.Array, RaggedDotMeta]:
  """FP8 `jax.lax.ragged_dot(x, w, group_sizes)`: the expert GEMMs of a dropless MoE layer.

  Args:
    x: [M, K] floating (bf16, f16 or f32), rows sorted by group.
    w: [G, K, N] floating, one [K, N] weight per group (expert).
    group_sizes: int32 [G], rows per group, >= 0 with sum <= M. Checked where its values
      are known; under `jit` a negative size counts as 0 and rows past M are cut.
    meta: this grouped matmul's `RaggedDotMeta` (`init_ragged_dot_meta(recipe, G)`).

  Returns:
    (y, new_meta): y [M, N] in x's dtype, rows past sum(group_sizes) zero; new_meta with
    this use's amaxes of x and of each expert's weight (0 for an expert without rows).
  """
  check_operands(x, w, group_sizes, "fp8_ragged_dot")
  refuse_split_state(meta, "meta")
  check_ragged_dot_meta(meta, w.shape[0])
  meta.recipe.check_op("fp8_ragged_dot")
  check_threaded(meta, "fp8_ragged_dot", init="fp8jax.init_ragged_dot_meta")
  # Inside shard_map: the operands and the state alike device-varying (fp8jax.mesh.axes).
  group_sizes = group_sizes.astype(jnp.int32)
  x, w, meta = match_operand_axes(x, w, meta)
  group_sizes = vary(group_sizes, varying_axes(x))
  with reverse_mode_only("An FP8 grouped matmul (fp8jax.fp8_ragged_dot)", "jax.lax.ragged_dot"):
    return _ragged(x, w, group_sizes, meta, jnp.dtype(w.dtype))


def check_operands(x, w, group_sizes, op: str) -> None:
  """Raises a clear error unless x [M, K] and w [G, K, N] are floating with one K and
  `group_sizes` is a valid int [G] (`check_group_sizes`); `op` names the caller."""
  check_floating(x, "x")
  check_floating(w, "w")
  if x.ndim != 2 or w.ndim != 3 or x.shape[1] != w.shape[1]:
    raise ValueError(f"{op} takes x [M, K] and w [G, K, N] with the same K; got "
                     f"x {x.shape} and w {w.shape}.")
  check_group_sizes(group_sizes, w.shape[0], x.shape[0])


def check_group_sizes(group_sizes, num_groups: int, rows: int) -> None:
  """Raises a clear error for a `group_sizes` that is not int [G], or (where its values are
  known) has a negative size or sums past the rows of x."""
  shape = jnp.shape(group_sizes)
  dtype = jnp.result_type(group_sizes)
  if shape != (num_groups,) or not jnp.issubdtype(dtype, jnp.integer):
    raise ValueError(
        f"group_sizes must be an int32 array of shape ({num_groups},), one size per expert "
        f"of w; got {dtype} {shape}.")
  if isinstance(group_sizes, jax.core.Tracer):
    return
  sizes = np.asarray(group_sizes)
  if (sizes < 0).any():
    raise ValueError(f"group_sizes={sizes.tolist()} has a negative size; each is the number "
                     "of rows of x its expert takes (>= 0).")
  if sizes.sum() > rows:
    raise ValueError(f"group_sizes={sizes.tolist()} sums to {int(sizes.sum())}, more than the "
                     f"{rows} rows of x; the sizes count x's rows, sorted by group.")


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _ragged(x, w, group_sizes, meta, w_dtype):
  y, new_meta, _ = _forward(x, w, group_sizes, meta)
  return y, new_meta


def _ragged_fwd(x, w, group_sizes, meta, w_dtype):
  y, new_meta, residuals = _forward(x, w, group_sizes, meta)
  return (y, new_meta), residuals


def _ragged_bwd(w_dtype, residuals, cotangents):
  dy, meta_cotangent = cotangents
  recipe = meta_cotangent.recipe
  if recipe.per_operand:
    dx, dw, dy_amax = _operand_bwd(residuals, dy, meta_cotangent.grad, w_dtype)
  else:
    dx, dw, dy_amax = _tensor_bwd(residuals, dy, meta_cotangent.grad, w_dtype)
  group_sizes = residuals[-1]
  recorded = dataclasses.replace(meta_cotangent,
                                 grad=record_amax(meta_cotangent.grad, dy_amax))
  return (dx, dw, np.zeros(group_sizes.shape, jax.dtypes.float0),
          amaxes_unbatched_like(meta_cotangent, recorded))


_ragged.defvjp(_ragged_fwd, _ragged_bwd)


def _forward(x, w, group_sizes, meta):
  w_amax = _expert_amax(w)
  if meta.recipe.per_operand:
    y, x_amax, residuals = _operand_fwd(x, w, group_sizes, meta)
  else:
    y, x_amax, residuals = _tensor_fwd(x, w, group_sizes, meta, w_amax)
  # An expert without rows records nothing (0 keeps its scale when the step closes).
  new_meta = dataclasses.replace(
      meta, x=record_amax(meta.x, x_amax),
      kernel=record_amax(meta.kernel, jnp.where(group_sizes > 0, w_amax, 0.0)))
  return y, amaxes_unbatched_like(meta, new_meta), residuals


def _expert_amax(w):
  """float32 [G]: max |w[g]| of each expert (NaN if it holds a NaN), as `amax` per expert."""
  return max_by_bits(jnp.abs(w.astype(jnp.float32)), axis=(1, 2))


def _rows_in_groups(group_sizes, rows: int) -> jax.Array:
  """int32[]: how many leading rows of x [rows, ...] the groups hold (the rest is padding;
  negative sizes count as 0, as in the kernels' schedules)."""
  return jnp.minimum(jnp.sum(jnp.maximum(group_sizes, 0)), rows).astype(jnp.int32)


# ----- per-tensor recipes (delayed, current, and recipes of your own alike) -------------


def _expert_scales(meta: Fp8Meta, w_amax):
  """float32 [G]: each expert's scale (the stored one, or from its own amax)."""
  recipe = meta.recipe
  if not recipe.scales_from_tensor:
    return meta.scale
  numerator = jnp.float32(meta.fmt.max / 2.0 ** recipe.margin)
  scale = scale_from_window(w_amax, numerator, meta.scale)
  return round_down_to_power_of_two(scale) if recipe.power_of_two else scale


def _cast_rows(t, meta: Fp8Meta, in_groups):
  """(q, q^T, descale, amax) of a 2-D tensor under a per-tensor meta, of its first
  `in_groups` rows (the others read as 0: no amax, zero FP8 rows).

  One pass over t under delayed scaling: the cast kernel's own amax (max(0, max|t|), the
  same bits as `amax(t)`) is the one recorded. A recipe that scales from the tensor needs
  its amax before the cast: a pass of its own first.
  """
  if meta.recipe.scales_from_tensor:
    t_amax = amax(pallas_kernels.rows_in_use(t, in_groups))
    scale = cast_scale(meta, t_amax, like=t)
  else:
    t_amax, scale = None, meta.scale
  q, q_t, cast_amax, _ = cast_transpose_amax(t, scale, jnp.zeros((), jnp.float32), meta.fmt,
                                             valid_rows=in_groups)
  return q, q_t, 1.0 / scale, cast_amax if t_amax is None else t_amax


def _tensor_fwd(x, w, group_sizes, meta, w_amax):
  high = meta.recipe.high_precision
  in_groups = _rows_in_groups(group_sizes, x.shape[0])
  x8, x8_t, x_descale, x_amax = _cast_rows(x, meta.x, in_groups)
  w_scale = _expert_scales(meta.kernel, w_amax)
  w8 = quantize(w, w_scale[:, None, None], meta.kernel.fmt)
  # Written out here, the 1-byte copy is what fprop's transposed copy is made from: XLA
  # then reads w once for its amax and this cast together (one fusion), where it otherwise
  # reads w a second time to write both layouts from it (an H100 at 8 x 7168 x 2048
  # float32: predicted 307 us instead of 437, fp8jax cost).
  w8 = jax.lax.optimization_barrier(w8)
  w_descale = 1.0 / w_scale
  with jax.named_scope("fp8_grouped_fprop"):
    if "fprop" in high:
      y = jax.lax.ragged_dot(x, w.astype(x.dtype), group_sizes)
    else:
      y = grouped_matmul(x8, jnp.swapaxes(w8, 1, 2), group_sizes, x_descale, w_descale,
                         "tensor", x.dtype)
  residuals = (x if "wgrad" in high else x8_t, w if "dgrad" in high else w8, x_descale,
               w_descale, meta.grad, group_sizes)
  return y, x_amax, residuals


def _tensor_bwd(residuals, dy, grad_meta, w_dtype):
  x8_t, w8, x_descale, w_descale, grad_forward_meta, group_sizes = residuals
  high = grad_forward_meta.recipe.high_precision
  # The forward state's scale for the gradient; its amax goes to the cotangent.
  dy8, dy8_t, dy_descale, dy_amax = _cast_rows(dy, grad_forward_meta,
                                               _rows_in_groups(group_sizes, dy.shape[0]))
  with jax.named_scope("fp8_grouped_dgrad"):
    if "dgrad" in high:  # w8 is the unquantized weight
      dx = jax.lax.ragged_dot(dy, jnp.swapaxes(w8, 1, 2).astype(dy.dtype), group_sizes)
    else:
      dx = grouped_matmul(dy8, w8, group_sizes, dy_descale, w_descale, "tensor", dy.dtype)
  with jax.named_scope("fp8_grouped_wgrad"):
    if "wgrad" in high:  # x8_t is the unquantized x
      dw = _ragged_wgrad_high_precision(x8_t, dy, group_sizes, w_dtype)
    else:
      dw = transposed_grouped_matmul(x8_t, dy8_t, group_sizes, x_descale, dy_descale,
                                     "tensor", w_dtype)
  return dx, dw, dy_amax


def _ragged_wgrad_high_precision(x, dy, group_sizes, out_dtype):
  dims = jax.lax.RaggedDotDimensionNumbers(
      dot_dimension_numbers=(((0,), (0,)), ((), ())), lhs_ragged_dimensions=[0],
      rhs_group_dimensions=[])
  return jax.lax.ragged_dot_general(x, dy.astype(x.dtype), group_sizes, dims).astype(out_dtype)


# ----- per-row and per-block recipes -----------------------------------------------------


def _operand_fwd(x, w, group_sizes, meta):
  recipe = meta.recipe
  high = recipe.high_precision
  fmt = meta.x.fmt
  # Padding rows zeroed: scales along the tokens (wgrad's) would see them otherwise.
  x = pallas_kernels.rows_in_use(x, _rows_in_groups(group_sizes, x.shape[0]))
  x_amax = amax(x)
  with jax.named_scope("fp8_grouped_fprop"):
    if "fprop" in high:
      y = jax.lax.ragged_dot(x, w.astype(x.dtype), group_sizes)
      w_fprop = None
    else:
      x_fprop = recipe.quantize_operand(x, fmt, axis=-1, weight=False)
      w_fprop = recipe.quantize_operand(w, meta.kernel.fmt, axis=-2, weight=True)
      y = _operand_grouped(x_fprop, w_fprop, group_sizes, x.dtype)
  if "dgrad" in high:
    w_dgrad = w
  elif recipe.kernel_blocks_serve_dgrad and w_fprop is not None:
    w_dgrad = w_fprop
  else:
    w_dgrad = recipe.quantize_operand(w, meta.kernel.fmt, axis=-1, weight=True)
  x_wgrad = x if "wgrad" in high else recipe.quantize_operand(x, fmt, axis=-2, weight=False)
  return y, x_amax, (x_wgrad, w_dgrad, meta.grad, group_sizes)


def _operand_bwd(residuals, dy, grad_meta, w_dtype):
  x_wgrad, w_dgrad, grad_forward_meta, group_sizes = residuals
  recipe = grad_forward_meta.recipe
  high = recipe.high_precision
  fmt = grad_forward_meta.fmt
  dy = pallas_kernels.rows_in_use(dy, _rows_in_groups(group_sizes, dy.shape[0]))
  with jax.named_scope("fp8_grouped_dgrad"):
    if "dgrad" in high:
      dx = jax.lax.ragged_dot(dy, jnp.swapaxes(w_dgrad, 1, 2).astype(dy.dtype), group_sizes)
    else:
      dy_dgrad = recipe.quantize_operand(dy, fmt, axis=-1, weight=False)
      dx = _operand_grouped(dy_dgrad, _swap(w_dgrad), group_sizes, dy.dtype)
  with jax.named_scope("fp8_grouped_wgrad"):
    if "wgrad" in high:
      dw = _ragged_wgrad_high_precision(x_wgrad, dy, group_sizes, w_dtype)
    else:
      dy_wgrad = recipe.quantize_operand(dy, fmt, axis=-2, weight=False)
      dw = _operand_transposed_grouped(x_wgrad, dy_wgrad, group_sizes, w_dtype)
  return dx, dw, amax(dy)


def _swap(q: BlockQuantized) -> BlockQuantized:
  """The weight quantized along N, as the [G, N, K] operand of the dgrad product."""
  return BlockQuantized(jnp.swapaxes(q.q, -1, -2), jnp.swapaxes(q.scale_inv, -1, -2),
                        q.block[::-1])


def _operand_grouped(a: BlockQuantized, b: BlockQuantized, group_sizes, out_dtype):
  """`ragged_dot(a, b)` of a [M, C] quantized along C and b [G, C, Q] along C.

  Per-row scales (a (1, C) rows, b (C, 1) columns) and 1 x 128 / 128 x 128 blocks run on
  the grouped kernels; other blocks are dequantized and multiplied in float32.
  """
  m, c = a.q.shape
  q = b.q.shape[-1]
  if a.block == (1, c) and b.block == (c, 1):
    return grouped_matmul(a.q, jnp.swapaxes(b.q, 1, 2), group_sizes, a.scale_inv[:, 0],
                          b.scale_inv[:, 0, :], "rowwise", out_dtype)
  if a.block == (1, _KERNEL_MULTIPLE) and b.block == (_KERNEL_MULTIPLE, _KERNEL_MULTIPLE):
    return grouped_matmul(a.q, jnp.swapaxes(b.q, 1, 2), group_sizes, a.scale_inv,
                          jnp.swapaxes(b.scale_inv, 1, 2), "block", out_dtype)
  return _emulated(dequantize_blocks(a), dequantize_blocks(b), group_sizes, out_dtype)


def _operand_transposed_grouped(a: BlockQuantized, b: BlockQuantized, group_sizes, out_dtype):
  """Per group g: a_g^T b_g, a [M, P] and b [M, Q] quantized along M (the tokens)."""
  m, p = a.q.shape
  if a.block == (m, 1) and b.block == (m, 1):
    return transposed_grouped_matmul(a.q.T, b.q.T, group_sizes, a.scale_inv[0],
                                     b.scale_inv[0], "rowwise", out_dtype)
  if a.block == (_KERNEL_MULTIPLE, 1) and b.block == (_KERNEL_MULTIPLE, 1):
    return transposed_grouped_matmul(a.q.T, b.q.T, group_sizes, a.scale_inv.T, b.scale_inv.T,
                                     "block", out_dtype)
  return _ragged_wgrad_high_precision(dequantize_blocks(a), dequantize_blocks(b),
                                      group_sizes, out_dtype)


def _emulated(a, b, group_sizes, out_dtype):
  """float32 ragged product of dequantized operands, rounded once to `out_dtype`."""
  return jax.lax.ragged_dot(a, b, group_sizes, precision=jax.lax.Precision.HIGHEST,
                            preferred_element_type=jnp.float32).astype(out_dtype)


# ----- where the grouped GEMMs run -------------------------------------------------------


def grouped_matmul(a, b_t, group_sizes, a_descale, b_descale, scale_mode: str, out_dtype):
  """`pallas_kernels.ragged_matmul` where the program is lowered for a Hopper GPU and the
  shapes fit its tiles, else its jnp twin (the same products and descales)."""
  m, c = a.shape
  n = b_t.shape[1]
  fits = c % _KERNEL_MULTIPLE == 0 and n % _KERNEL_MULTIPLE == 0
  return _choose(pallas_kernels.ragged_matmul, pallas_kernels.ragged_matmul_reference,
                 fits, (a, b_t, group_sizes, a_descale, b_descale),
                 dict(scale_mode=scale_mode, out_dtype=out_dtype))


def transposed_grouped_matmul(a_t, b_t, group_sizes, a_descale, b_descale, scale_mode: str,
                              out_dtype):
  """`pallas_kernels.transposed_ragged_matmul` (wgrad) where it can run, else its jnp twin."""
  ka, m = a_t.shape
  nb = b_t.shape[0]
  fits = (ka % _KERNEL_MULTIPLE == 0 and nb % _KERNEL_MULTIPLE == 0
          and m % _TOKEN_MULTIPLE == 0)
  return _choose(pallas_kernels.transposed_ragged_matmul,
                 pallas_kernels.transposed_ragged_matmul_reference, fits,
                 (a_t, b_t, group_sizes, a_descale, b_descale),
                 dict(scale_mode=scale_mode, out_dtype=out_dtype))


def _choose(kernel, reference, fits: bool, args, options):
  run_reference = functools.partial(reference, **options)
  if not fits or not hopper_possible() or not kernels_allowed(args):
    return run_reference(*args)
  run_kernel = functools.partial(kernel, **options)
  return jax.lax.platform_dependent(*args, cuda=vmapped_as(run_kernel, run_reference),
                                    default=run_reference)


def hopper_possible() -> bool:
  """False where this process's GPU is not a Hopper (the kernels' wgmma is sm_90a);
  elsewhere (no GPU: a CPU run or a deviceless compile) the lowering platform decides."""
  if jax.default_backend() != "gpu":
    return True
  capability = str(getattr(jax.devices()[0], "compute_capability", ""))
  return capability.startswith("9")
