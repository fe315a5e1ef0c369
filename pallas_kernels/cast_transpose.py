"""Fused FP8 cast + transpose + amax as one Pallas (Triton) kernel.

An FP8 dense layer needs, for each high-precision 2-D tensor X [R, C] (activation,
kernel, output gradient), its FP8 copy Q, the transposed copy Q^T (cuBLASLt's FP8
GEMMs on Hopper read both operands K-major, so the backward pass needs the other
layout), and max|X| folded into the tensor's running amax. This kernel reads X once
and writes all three:

  q        = saturate(x * scale)            [R, C] in fp8_dtype
  q_t      = q^T                            [C, R] in fp8_dtype (optional)
  amax_out = max(amax_in, max_ij |x_ij|)    float32[]

where `saturate(y) = clip(y, -fp8_max, fp8_max)` rounded to nearest even, the
product formed in float32; NaN stays NaN, +-inf saturates to +-fp8_max. A NaN in x
makes amax_out NaN.

Tiling: a 2-D grid, one program per [block_rows, block_cols] tile of X. A program
loads its tile once, writes the Q tile and the transposed tile of Q^T, and folds the
tile's max|x| into the single float32 amax with an atomic max. The amax buffer is
`amax_in` itself (an input/output alias), so no kernel runs before this one to
initialise it.

The amax is exact and propagates NaN on every backend because it is reduced on bit
patterns: for a float32 with the sign bit cleared (|x|), the IEEE bit pattern read as
an int32 orders exactly like the value, and every NaN (0x7f800001..0x7fffffff) sorts
above +inf. So the tile max is an int32 max of `bits(x) & 0x7fffffff`; no float
min/max is involved (Triton lowers float max to `maxnum`, which drops NaN). The atomic is `pallas.triton.atomic_max` on the float32 buffer:
on a GPU Triton implements it as a signed int32 `atom.max` for non-negative values,
the same order; the interpreter applies `jnp.maximum`, which agrees on every
non-negative value and NaN.

Shapes need not be multiples of the tile: loads, stores and the amax are masked on
the last row / column tile (only on those dimensions that need it, so a tile-aligned
shape compiles to unmasked, vectorised accesses). A dimension shorter than a tile
shrinks that tile to the dimension's next power of two (at least 16).

Platform notes. The interpreter on CPU matches `cast_transpose_amax_reference` bit for
bit, and so does the GPU kernel (checked on an H100), with two caveats that come from
the platforms, not the kernel: XLA on CPU flushes float32 / bf16 subnormal inputs to
zero (the GPU kernel keeps them, so their amax and, with huge scales, their q can
differ), and NaN payloads of q are not specified (e5m2 has several NaN encodings).
On a GPU, an `amax_in` that is a NaN with the sign bit set would be replaced by the
tile maxima (the signed integer order puts it below zero); amaxes never have it set.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.varying import check_summed, out_struct, vary, varying_axes

FP8_MAX = {
    jnp.dtype(jnp.float8_e4m3fn): float(jnp.finfo(jnp.float8_e4m3fn).max),  # 448
    jnp.dtype(jnp.float8_e5m2): float(jnp.finfo(jnp.float8_e5m2).max),      # 57344
}
INPUT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
_F32_MAX = float(jnp.finfo(jnp.float32).max)
# Clears the sign bit of a float32's bit pattern: |x| without a float operation.
_ABS_MASK = 0x7FFFFFFF
# The smallest tile edge: Triton tensors have power-of-two dimensions, and 16 keeps
# every layout (16-byte vectors, the transpose through shared memory) regular.
_MIN_BLOCK = 16


@dataclasses.dataclass(frozen=True)
class CastTransposeBlockSizes:
  """Tile sizes and Triton launch knobs of the cast-transpose-amax kernels.

  The kernel is memory bound: per element it reads 2 bytes (bf16) and writes 2 (Q and
  Q^T) with a handful of ALU operations, so the tile is chosen for full-width memory
  accesses and enough programs in flight:

  * block_cols=128: a row of the X tile is 256 contiguous bytes of bf16 and a row of the
    Q tile 128 bytes (a cache line). The compiled loads of X and the stores of Q and
    Q^T are all 16 bytes wide (`ld.global.v4.b32` / `st.global.v4.b32`, deviceless
    sm_90a compile of tile-aligned shapes).
  * block_rows=64: a row of the Q^T tile is 64 contiguous bytes (two 32-byte sectors).
  * num_warps=4: 128 threads, 64 elements each. Triton transposes the bf16 tile through
    shared memory (`ldmatrix...trans`, 16 KiB) and recomputes the cast for Q^T;
    127 registers, no spills.
  * num_stages=1: the kernel has no loop, so Triton has nothing to software-pipeline.

  Measured on one H100 (jax 0.11.2, bf16 -> e4m3, per call, 16 chained calls on
  distinct inputs): [8192, 8192] 124-137 us (about 2 TB/s counting 4 bytes per
  element) against 237-241 us for XLA's four kernels; [2048, 2048] 29-34 us against
  42-45 us. 64x128 with 4 warps was the best or within noise of the best of the tiles
  tried (32x128, 64x64, 128x64, 64x128 with 8 warps, 32x256, 128x128 with 8 warps, the
  last 5-15% slower at 8192); the spread between them is about 10%.

  Attributes:
    block_rows: rows of X per program (a power of two >= 16).
    block_cols: columns of X per program (a power of two >= 16).
    num_warps: Triton warps per program.
    num_stages: Triton software-pipeline depth.
  """

  block_rows: int = 64
  block_cols: int = 128
  num_warps: int = 4
  num_stages: int = 1

  def __post_init__(self):
    for field in dataclasses.fields(self):
      value = getattr(self, field.name)
      if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(
            f"CastTransposeBlockSizes.{field.name}={value!r} must be a positive int.")
      if field.name.startswith("block") and (value < _MIN_BLOCK or value & (value - 1)):
        raise ValueError(
            f"CastTransposeBlockSizes.{field.name}={value} must be a power of two >= "
            f"{_MIN_BLOCK} (Triton tiles have power-of-two shapes), e.g. 64 or 128.")
    if self.num_warps & (self.num_warps - 1):
      raise ValueError(
          f"CastTransposeBlockSizes.num_warps={self.num_warps} must be a power of two "
          "(Triton's layouts require it), e.g. 4 or 8.")


@dataclasses.dataclass(frozen=True)
class _Tiling:
  """Static facts a program needs: the true shape, its tile, and which edges to mask."""

  rows: int
  cols: int
  block_rows: int
  block_cols: int

  @property
  def row_tail(self) -> bool:
    """Whether the last row tile reaches past `rows` (its extra rows are masked)."""
    return self.rows % self.block_rows != 0

  @property
  def col_tail(self) -> bool:
    """Whether the last column tile reaches past `cols`."""
    return self.cols % self.block_cols != 0

  @property
  def grid(self) -> tuple[int, int]:
    return (pl.cdiv(self.rows, self.block_rows), pl.cdiv(self.cols, self.block_cols))


@dataclasses.dataclass(frozen=True)
class _Cast:
  """The FP8 target of the cast, and whether the transposed copy is written."""

  dtype: jnp.dtype
  max: float
  transpose: bool


def _fit(block: int, length: int) -> int:
  """The tile edge for a dimension of `length`: never far past the dimension."""
  return min(block, max(_MIN_BLOCK, 1 << (length - 1).bit_length()))


def _tiling(shape: tuple[int, int], block_sizes: CastTransposeBlockSizes) -> _Tiling:
  rows, cols = shape
  return _Tiling(rows=rows, cols=cols, block_rows=_fit(block_sizes.block_rows, rows),
                 block_cols=_fit(block_sizes.block_cols, cols))


# ---------------------------------------------------------------------------
# The kernel.
# ---------------------------------------------------------------------------


def _tile_mask(tiling: _Tiling):
  """Boolean [block_rows, block_cols] of in-range elements, or None when all are."""
  mask = None
  if tiling.row_tail:
    rows = (pl.program_id(0) * tiling.block_rows
            + lax.broadcasted_iota(jnp.int32, (tiling.block_rows, 1), 0))
    mask = rows < tiling.rows
  if tiling.col_tail:
    cols = (pl.program_id(1) * tiling.block_cols
            + lax.broadcasted_iota(jnp.int32, (1, tiling.block_cols), 1))
    col_mask = cols < tiling.cols
    mask = col_mask if mask is None else jnp.logical_and(mask, col_mask)
  if mask is not None:
    mask = jnp.broadcast_to(mask, (tiling.block_rows, tiling.block_cols))
  return mask


def _saturate(y, fp8_max: float):
  """clip(y, -fp8_max, fp8_max) that keeps NaN on every backend.

  Written with comparisons rather than min/max: Triton lowers float min/max to
  `minnum`/`maxnum`, which return the non-NaN operand and would turn NaN into
  +-fp8_max. A comparison with NaN is false, so NaN passes through.
  """
  y = jnp.where(y > fp8_max, fp8_max, y)
  return jnp.where(y < -fp8_max, -fp8_max, y)


def _kernel(*refs, tiling: _Tiling, cast: _Cast | None, partners: int):
  """One [block_rows, block_cols] tile: Q, Q^T (per `cast`) and the amax.

  Refs: x, [scale], [descale, partner x `partners`], amax_in (aliased to
  amax_out, unused), [q], [q_t], [product x `partners`], amax_out.
  """
  refs = list(refs)
  x_ref = refs.pop(0)
  scale_ref = refs.pop(0) if cast is not None else None
  if partners:
    descale_ref = refs.pop(0)
    partner_refs = [refs.pop(0) for _ in range(partners)]
  refs.pop(0)  # amax_in: the same buffer as amax_out
  q_ref = refs.pop(0) if cast is not None else None
  q_t_ref = refs.pop(0) if cast is not None and cast.transpose else None
  product_refs = [refs.pop(0) for _ in range(partners)]
  (amax_ref,) = refs
  if partners:
    @pl.when((pl.program_id(0) == 0) & (pl.program_id(1) == 0))
    def _():
      # The GEMMs' combined descales, capped at the largest float32 so that an
      # all-zero row times an overflowing product stays 0 instead of NaN.
      for partner_ref, product_ref in zip(partner_refs, product_refs):
        product_ref[...] = jnp.minimum(descale_ref[...] * partner_ref[...], _F32_MAX)

  mask = _tile_mask(tiling)
  if mask is None:
    x = x_ref[...]
  else:
    # Out-of-range elements read as 0, the identity of the amax below.
    x = plgpu.load(x_ref, mask=mask, other=0)
  x = x.astype(jnp.float32)  # exact for bf16 / f16 inputs

  magnitude_bits = lax.bitcast_convert_type(x, jnp.int32) & _ABS_MASK
  tile_amax = lax.bitcast_convert_type(jnp.max(magnitude_bits), jnp.float32)
  plgpu.atomic_max(amax_ref, jnp.int32(0), tile_amax)

  if cast is None:
    return
  q = _saturate(x * scale_ref[0], cast.max).astype(cast.dtype)
  _store(q_ref, q, mask)
  if cast.transpose:
    _store(q_t_ref, q.T, None if mask is None else mask.T)


def _store(ref, value, mask):
  if mask is None:
    ref[...] = value
  else:
    plgpu.store(ref, value, mask=mask)


def _call(x, scale, amax_in, descale=None, partners=None, *, cast: _Cast | None,
          block_sizes: CastTransposeBlockSizes, interpret: bool):
  """Runs the kernel over all tiles of x.

  Returns (q, q_t, amax_out, products): q None without a cast, products None
  without partners.
  """
  tiling = _tiling(x.shape, block_sizes)
  rows, cols = x.shape
  block = (tiling.block_rows, tiling.block_cols)
  # Scalars travel as [1] arrays (a free reshape in XLA): the interpreter's atomics
  # need an index into the ref.
  scalar_spec = pl.BlockSpec((1,), lambda i, j: (0,))
  tile_spec = pl.BlockSpec(block, lambda i, j: (i, j))
  in_specs = [tile_spec, scalar_spec]
  # Inside shard_map: the amax is written in place, so its input carries the type
  # of max(amax_in, max|x|); every other output varies as what it is computed from.
  check_summed(x, scale, amax_in, descale, partners)
  amax_in = vary(amax_in, varying_axes(x, amax_in))
  operands = [x, amax_in.reshape(1)]
  out_specs, out_shape = [], []
  n_partners = 0 if partners is None else len(partners)
  # 0-d blocks: the GEMM reads each product as its scalar operand directly (a [1]
  # array would need a reshape XLA puts between converts, costing a kernel).
  rank0_spec = pl.BlockSpec((), lambda i, j: ())
  if n_partners:
    in_specs[1:1] = [rank0_spec] * (1 + n_partners)
    operands[1:1] = [descale, *partners]
  if cast is not None:
    in_specs.insert(1, scalar_spec)
    operands.insert(1, scale.reshape(1))
    out_specs.append(tile_spec)
    cast_axes = varying_axes(x, scale)
    out_shape.append(out_struct((rows, cols), cast.dtype, cast_axes))
    if cast.transpose:
      out_specs.append(pl.BlockSpec(block[::-1], lambda i, j: (j, i)))
      out_shape.append(out_struct((cols, rows), cast.dtype, cast_axes))
  out_specs += [rank0_spec] * n_partners
  out_shape += [out_struct((), jnp.float32, varying_axes(descale, partner))
                for partner in partners or ()]
  out_specs.append(scalar_spec)
  out_shape.append(out_struct((1,), jnp.float32, varying_axes(amax_in)))
  outs = pl.pallas_call(
      functools.partial(_kernel, tiling=tiling, cast=cast, partners=n_partners),
      grid=tiling.grid,
      in_specs=in_specs,
      out_specs=out_specs,
      out_shape=out_shape,
      # amax_in is the amax accumulator: the programs atomically max into it in place.
      input_output_aliases={len(operands) - 1: len(out_shape) - 1},
      compiler_params=plgpu.CompilerParams(num_warps=block_sizes.num_warps,
                                           num_stages=block_sizes.num_stages),
      interpret=interpret,
      name="cast_transpose_amax" if cast is not None else "amax",
  )(*operands)
  amax_out = outs[-1].reshape(())
  products = tuple(outs[-1 - n_partners:-1]) if n_partners else None
  if cast is None:
    return None, None, amax_out, products
  return outs[0], (outs[1] if cast.transpose else None), amax_out, products


@functools.partial(jax.jit, static_argnames=("cast", "block_sizes", "interpret"))
def _call_jit(x, scale, amax_in, descale=None, partners=None, *, cast, block_sizes, interpret):
  return _call(x, scale, amax_in, descale, partners, cast=cast, block_sizes=block_sizes,
               interpret=interpret)


# ---------------------------------------------------------------------------
# Public API.
# ---------------------------------------------------------------------------


def cast_transpose_amax(
    x: jax.Array, scale: jax.Array, amax_in: jax.Array, *, fp8_dtype, fp8_max: float,
    transpose: bool = True, descale: jax.Array | None = None,
    partner_descales: jax.Array | None = None,
    block_sizes: CastTransposeBlockSizes = CastTransposeBlockSizes(),
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array | None, jax.Array]:
  """FP8 copy, transposed FP8 copy and running amax of a 2-D tensor, in one pass.

  q = clip(x.astype(float32) * scale, -fp8_max, fp8_max).astype(fp8_dtype) (round to
  nearest even; NaN stays NaN; +-inf saturates to +-fp8_max), q_t = q.T, and
  amax_out = max(amax_in, max |x|) in float32 (NaN if x holds a NaN).

  Args:
    x: [R, C] bfloat16, float16 or float32.
    scale: float32[] quantization scale (multiplies before the cast).
    amax_in: float32[] running amax, >= 0 or NaN (an amax never has its sign bit set;
      on a GPU a NaN with the sign bit set, as x86 produces for 0 * inf, would be
      replaced by max|x| instead of kept).
    fp8_dtype: jnp.float8_e4m3fn or jnp.float8_e5m2.
    fp8_max: the largest finite value of fp8_dtype: 448.0 or 57344.0.
    transpose: also write q_t; when False, q_t is None and nothing is written for it.
    descale, partner_descales: optional float32[] and a tuple of float32[] scalars:
      the kernel then also returns `min(descale * partner, float32 max)` per partner,
      the combined descales of the GEMMs this tensor enters (one scalar operand per
      GEMM, instead of a separate kernel that multiplies two scalars).
    block_sizes: tile sizes and launch knobs.
    interpret: run the Pallas interpreter (on CPU) instead of lowering for a GPU.

  Returns:
    (q [R, C], q_t [C, R] or None, amax_out float32[]), plus the tuple of float32[]
    products when `partner_descales` is given. q and q_t in fp8_dtype.
  """
  _check_x(x)
  fp8_dtype = _check_fp8(fp8_dtype, fp8_max)
  scale = _scalar_f32(scale, "scale")
  amax_in = _scalar_f32(amax_in, "amax_in")
  _check_flag(transpose, "transpose")
  _check_flag(interpret, "interpret")
  _check_block_sizes(block_sizes)
  cast = _Cast(dtype=fp8_dtype, max=float(fp8_max), transpose=transpose)
  descale, partner_descales = _check_products(descale, partner_descales)
  q, q_t, amax_out, products = _call_jit(x, scale, amax_in, descale, partner_descales,
                                         cast=cast, block_sizes=block_sizes,
                                         interpret=interpret)
  return (q, q_t, amax_out) if products is None else (q, q_t, amax_out, products)


def amax(
    x: jax.Array, amax_in: jax.Array, *,
    block_sizes: CastTransposeBlockSizes = CastTransposeBlockSizes(),
    interpret: bool = False,
) -> jax.Array:
  """float32[] max(amax_in, max |x|) over a 2-D x, in one pass (NaN if x holds a NaN).

  Args:
    x: [R, C] bfloat16, float16 or float32.
    amax_in: float32[] running amax, >= 0 or NaN (see `cast_transpose_amax`); the
      kernel updates its buffer in place.
    block_sizes: tile sizes and launch knobs.
    interpret: run the Pallas interpreter (on CPU) instead of lowering for a GPU.

  Returns:
    float32[] amax_out.
  """
  _check_x(x)
  amax_in = _scalar_f32(amax_in, "amax_in")
  _check_flag(interpret, "interpret")
  _check_block_sizes(block_sizes)
  return _call_jit(x, None, amax_in, cast=None, block_sizes=block_sizes,
                   interpret=interpret)[2]


def cast_transpose_amax_reference(
    x: jax.Array, scale: jax.Array, amax_in: jax.Array, *, fp8_dtype, fp8_max: float,
    transpose: bool = True, descale: jax.Array | None = None,
    partner_descales: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array | None, jax.Array]:
  """`cast_transpose_amax` in plain jnp: the definition the kernel matches bit for bit.

  q is `fp8jax.quantize`'s formula; the amax is `fp8jax.amax`'s with the NaN
  rule made explicit (a NaN in x or in amax_in gives NaN). Takes the same arguments
  (without the kernel knobs) and returns the same (q, q_t or None, amax_out).
  """
  _check_x(x)
  fp8_dtype = _check_fp8(fp8_dtype, fp8_max)
  scale = _scalar_f32(scale, "scale")
  amax_in = _scalar_f32(amax_in, "amax_in")
  q = jnp.clip(x.astype(jnp.float32) * scale, -fp8_max, fp8_max).astype(fp8_dtype)
  x_amax = jnp.max(jnp.abs(x)).astype(jnp.float32)
  # The NaN rule is spelled out: XLA on CPU (jax 0.10.2) drops NaN from some float32
  # max reductions (any [64, 64] or larger 2-D one returns the largest finite |x|).
  x_amax = jnp.where(jnp.any(jnp.isnan(x)), jnp.float32(jnp.nan), x_amax)
  amax_out = jnp.where(jnp.isnan(amax_in), amax_in, jnp.maximum(amax_in, x_amax))
  descale, partner_descales = _check_products(descale, partner_descales)
  if partner_descales is None:
    return q, (q.T if transpose else None), amax_out
  products = tuple(jnp.minimum(descale * p, _F32_MAX) for p in partner_descales)
  return q, (q.T if transpose else None), amax_out, products


# ---------------------------------------------------------------------------
# Input checks.
# ---------------------------------------------------------------------------


def _check_x(x) -> None:
  shape = jnp.shape(x)
  if len(shape) != 2:
    raise ValueError(
        f"x must be a 2-D [rows, cols] array, got shape {shape}; reshape it first, "
        "e.g. x.reshape(-1, x.shape[-1]).")
  if 0 in shape:
    raise ValueError(f"x has shape {shape}, with no elements; it has no FP8 copy or amax.")
  dtype = jnp.result_type(x)
  if dtype not in INPUT_DTYPES:
    raise TypeError(
        f"x has dtype {dtype}; pass bfloat16, float16 or float32 "
        "(e.g. x.astype(jnp.bfloat16)).")


def _check_fp8(fp8_dtype, fp8_max) -> jnp.dtype:
  try:
    dtype = jnp.dtype(fp8_dtype)
  except TypeError:
    dtype = None
  if dtype not in FP8_MAX:
    raise TypeError(
        f"fp8_dtype={fp8_dtype!r} is not supported; pass jnp.float8_e4m3fn or "
        "jnp.float8_e5m2.")
  if isinstance(fp8_max, bool) or not isinstance(fp8_max, (int, float)) \
      or float(fp8_max) != FP8_MAX[dtype]:
    raise ValueError(
        f"fp8_max={fp8_max!r} does not match fp8_dtype {dtype.name}, whose largest finite "
        f"value is {FP8_MAX[dtype]}; pass fp8_max={FP8_MAX[dtype]}.")
  return dtype


def _check_products(descale, partner_descales):
  """(descale f32[], tuple of f32[]) or (None, None); both or neither must be given."""
  if (descale is None) != (partner_descales is None):
    raise ValueError("descale and partner_descales go together: pass both (to get the GEMMs' "
                     "combined descales) or neither.")
  if descale is None:
    return None, None
  if not isinstance(partner_descales, (tuple, list)) or not 1 <= len(partner_descales) <= 4:
    raise ValueError("partner_descales must be a tuple of 1 to 4 float32 scalars, got "
                     f"{type(partner_descales).__name__}.")
  partners = tuple(_scalar_f32(p, f"partner_descales[{i}]")
                   for i, p in enumerate(partner_descales))
  return _scalar_f32(descale, "descale"), partners


def _scalar_f32(value, argname: str) -> jax.Array:
  """`value` as a float32[] array; Python floats are accepted, other dtypes are not."""
  if isinstance(value, (int, float)) and not isinstance(value, bool):
    return jnp.asarray(value, jnp.float32)
  shape = jnp.shape(value)
  dtype = jnp.result_type(value)
  if shape != () or dtype != jnp.float32:
    raise ValueError(
        f"{argname} must be a float32 scalar (shape ()), got shape {shape} and dtype "
        f"{dtype}; pass one value per tensor, e.g. jnp.float32(v) or "
        f"{argname}.astype(jnp.float32).")
  return jnp.asarray(value)


def _check_flag(value, argname: str) -> None:
  if not isinstance(value, bool):
    raise TypeError(f"{argname} must be True or False, got {value!r}.")


def _check_block_sizes(block_sizes) -> None:
  if not isinstance(block_sizes, CastTransposeBlockSizes):
    raise TypeError(
        f"block_sizes must be a CastTransposeBlockSizes, got "
        f"{type(block_sizes).__name__}: {block_sizes!r}.")
