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

Tiling (`pallas_kernels.cast_transpose_tiling`): a 2-D grid, one program per
[block_rows, block_cols] tile of X. A program loads its tile once, writes the Q tile
and the transposed tile of Q^T, and folds the tile's max|x| into the single float32
amax with an atomic max. The amax buffer is `amax_in` itself (an input/output alias),
so no kernel runs before this one to initialise it, unless XLA must keep amax_in
(a jit parameter, a constant): then it copies it first, a launch for 4 bytes.
`cast_transpose_amax_in_chain` (`pallas_kernels.cast_transpose_chain`) avoids that in
a chain of launches (an FP8 layer's casts): the first writes its tiles' maxima, one slot
per program, which needs no initialised buffer; one program of a later launch reduces
them and writes zeroed buffers that the launches after it max into.
`cast_transpose_from_amax` (`pallas_kernels.cast_transpose_current`) is current
scaling's launch: given max|x|, every program makes the scale `fp8_max / 2**margin /
amax` itself (an IEEE `div.rn.f32`: Triton's float32 `/` is approximate) and one
program writes its reciprocal, the GEMMs' descales and the running amax, so no launch
of a few bytes computes them; x is not reduced again. This module holds the kernel
they all launch (`launch`), the plain cast and amax pass, and their definition.

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

from pallas_kernels import rotary_gradient
from pallas_kernels.activations import Prologue
from pallas_kernels.cast_transpose_checks import (broadcast_kind, check_block_sizes,
                                                  check_flag, check_fp8, check_products,
                                                  check_x, row_limit, scalar_f32)
from pallas_kernels.cast_transpose_tiling import (ABS_MASK, GROUP_COLUMNS,
                                                  CastTransposeBlockSizes, Tiling, tile_count,
                                                  tile_mask, tiling_for)
from pallas_kernels.varying import check_summed, out_struct, vary, varying_axes
from pallas_kernels.vector_element import VectorElement, element_value

_F32_MAX = float(jnp.finfo(jnp.float32).max)
EXPONENT_BITS = 0x7F800000


@dataclasses.dataclass(frozen=True)
class ScaleFromAmax:
  """Current scaling: the scale is made in the kernel from a given amax (static).

  scale = numerator / amax where both that and amax are finite and > 0, else the
  fallback scale; rounded down to a power of two if `power_of_two`.
  """

  numerator: float
  power_of_two: bool


@dataclasses.dataclass(frozen=True)
class CastSpec:
  """The FP8 target of the cast, whether the transposed copy is written, whether
  the scale is made from a given amax (`from_amax`) instead of read, the
  elementwise function of x (and of the tensors it also reads) that is cast
  (`prologue`, `pallas_kernels.activations`; None casts x), whether an int32
  operand limits the rows in use (`row_limit`: rows at and past it read as 0), and
  whether the kernel also writes x itself (before the prologue) as E4M3 codes with one
  power-of-two descale per row and group of `GROUP_COLUMNS` columns (`keeps_groups`:
  the copy a backward pass keeps, `keep_groups_reference`; of `prologue.kept`'s value
  where the prologue names one)."""

  dtype: jnp.dtype
  max: float
  transpose: bool
  from_amax: ScaleFromAmax | None = None
  prologue: Prologue | None = None
  row_limit: bool = False
  keeps_groups: bool = False


def saturate(y, fp8_max: float):
  """clip(y, -fp8_max, fp8_max) that keeps NaN on every backend.

  Written with comparisons rather than min/max: Triton lowers float min/max to
  `minnum`/`maxnum`, which return the non-NaN operand and would turn NaN into
  +-fp8_max. A comparison with NaN is false, so NaN passes through.
  """
  y = jnp.where(y > fp8_max, fp8_max, y)
  return jnp.where(y < -fp8_max, -fp8_max, y)


@dataclasses.dataclass(frozen=True)
class AmaxSpec:
  """How one launch makes its amax (static).

  accumulate: "in_place": the programs max into amax_in's own buffer (aliased);
    "accumulator": into a zeroed buffer an earlier launch wrote (aliased), one
    program folding amax_in in; "tiles": each program writes its tile's max to
    its own slot, so no buffer has to be initialised before the launch;
    "given": the amax of x is given (current scaling) with the amax to record, one
    program writes max(amax_in, recorded) and no program reduces its tile.
  reduce: also reduce an earlier launch's tile maxima with their running amax.
  seeds: how many zeroed float32 buffers to write for later launches' accumulators.
  passed: the lengths of the small float32 vectors copied through (see
    `cast_transpose_amax_in_chain`'s `pass_through`).
  """

  accumulate: str = "in_place"
  reduce: bool = False
  seeds: int = 0
  passed: tuple = ()


# Tile maxima an earlier launch wrote are reduced this many at a time by one program.
_REDUCE_CHUNK = 1024


def _kernel(*refs, tiling: Tiling, cast: CastSpec | None, partners: int, amax: AmaxSpec,
            interpret: bool):
  """One [block_rows, block_cols] tile: Q, Q^T (per `cast`) and the amax.

  Refs: x, [prologue input x `cast.prologue.inputs`: x's tile, or its rows' [block_rows, 1]
  values (of the whole row, or of the tile's group of columns) or its columns'
  [1, block_cols]], [rows], [scale], [given, recorded],
  [descale], [partner x `partners`], [amax_in],
  [accumulator], [tiles_in, tiles_running], [passed in x `passed`], then [q], [q_t],
  [descale_out], [product x `partners`], amax_out, [reduced], [seed x `seeds`],
  [passed out x `passed`], [kept codes, kept descales (`cast.keeps_groups`)]. amax_out is amax_in's buffer ("in_place"), the
  accumulator's ("accumulator"), one slot per program ("tiles") or its own
  ("given"). With `cast.from_amax` the scale ref holds the fallback scale, the
  kernel makes the descale (descale_out) instead of reading it. With `cast.row_limit`
  the rows ref holds how many leading rows are in use.
  """
  refs = list(refs)
  x_ref = refs.pop(0)
  prologue = cast.prologue if cast is not None else None
  other_refs = [refs.pop(0) for _ in range(prologue.inputs if prologue else 0)]
  rows_ref = refs.pop(0) if cast is not None and cast.row_limit else None
  scale_ref = refs.pop(0) if cast is not None else None
  given_ref, recorded_ref = ((refs.pop(0), refs.pop(0)) if amax.accumulate == "given"
                              else (None, None))
  from_amax = cast.from_amax if cast is not None else None
  descale_ref = refs.pop(0) if partners and from_amax is None else None
  partner_refs = [refs.pop(0) for _ in range(partners)]
  amax_in_ref = refs.pop(0) if amax.accumulate != "tiles" else None
  if amax.accumulate == "accumulator":
    refs.pop(0)  # the accumulator: the same buffer as amax_out
  if amax.reduce:
    tiles_in_ref, tiles_running_ref = refs.pop(0), refs.pop(0)
  passed_in_refs = [refs.pop(0) for _ in amax.passed]
  q_ref = refs.pop(0) if cast is not None else None
  q_t_ref = refs.pop(0) if cast is not None and cast.transpose else None
  descale_out_ref = refs.pop(0) if from_amax is not None else None
  product_refs = [refs.pop(0) for _ in range(partners)]
  amax_ref = refs.pop(0)
  reduced_ref = refs.pop(0) if amax.reduce else None
  seed_refs = [refs.pop(0) for _ in range(amax.seeds)]
  kept_refs = refs[-2:] if cast is not None and cast.keeps_groups else ()
  passed_out_refs = refs[:len(refs) - len(kept_refs)]
  first = (pl.program_id(0) == 0) & (pl.program_id(1) == 0)
  scale = None  # no cast (an amax launch)
  if from_amax is not None:
    # Every program makes the same scale from the given amax (a few scalar
    # operations, where a kernel of their own would cost a launch). On [1] blocks:
    # the inline division takes tensors, not scalars.
    scale = _scale_from_amax(given_ref[...], scale_ref[...], from_amax, interpret)
  elif cast is not None:
    scale = scale_ref[0]
  if partners or from_amax is not None:
    @pl.when(first)
    def _():
      if from_amax is not None:
        descale = _divide(jnp.float32(1), scale, interpret).reshape(())
        descale_out_ref[...] = descale
      else:
        descale = _read_scalar(descale_ref)
      # The GEMMs' combined descales, capped at the largest float32 so that an
      # all-zero row times an overflowing product stays 0 instead of NaN.
      for partner_ref, product_ref in zip(partner_refs, product_refs):
        product_ref[...] = jnp.minimum(descale * _read_scalar(partner_ref), _F32_MAX)
  if amax.accumulate == "given":
    @pl.when(first)
    def _():
      amax_ref[0] = _bits_max_pair(amax_in_ref[0], recorded_ref[0])
  if amax.reduce or amax.seeds or amax.passed or amax.accumulate == "accumulator":
    @pl.when(first)
    def _():
      # One program writes what earlier launches left to reduce, what later
      # launches will accumulate into and what the step's state update will read:
      # no other kernel initialises or copies a buffer.
      if amax.reduce:
        reduced_ref[0] = _reduce_tiles(tiles_in_ref, tiles_running_ref[0])
      for seed_ref in seed_refs:
        seed_ref[0] = jnp.float32(0)
      for length, src, dst in zip(amax.passed, passed_in_refs, passed_out_refs):
        _copy_vector(src, dst, length)
      if amax.accumulate == "accumulator":
        plgpu.atomic_max(amax_ref, jnp.int32(0), amax_in_ref[0])

  mask = tile_mask(tiling)

  def load(ref):
    # Out-of-range elements read as 0, the identity of the amax below. A prologue's row
    # or column values ([block_rows, 1], [1, block_cols]) are masked on their own axis.
    block_mask = (mask if ref.shape == (tiling.block_rows, tiling.block_cols)
                  else tile_mask(tiling, ref.shape))
    tile = ref[...] if block_mask is None else plgpu.load(ref, mask=block_mask, other=0)
    return tile.astype(jnp.float32)  # exact for bf16 / f16 inputs

  if prologue is not None and prologue.rotary is not None:
    # The qkv output gradient from dq, dk, dv (`pallas_kernels.rotary_gradient`): the tile
    # is made, cast and stored a half of the head's features at a time. Its columns are
    # whole heads, so only the last row tile can reach past the tensor.
    half = tiling.block_cols // 2
    parts = rotary_gradient.kernel_halves(x_ref, other_refs,
                                          tile_mask(tiling, (tiling.block_rows, 1)), tiling,
                                          jnp.dtype(prologue.rotary_dtype))
    _amax_cast_store(parts, tile_mask(tiling, (tiling.block_rows, half)), amax, amax_ref,
                     cast, scale, from_amax, q_ref, q_t_ref)
    return
  x = load(x_ref)
  others = [load(ref) for ref in other_refs]
  if kept_refs:
    kept = prologue.kept(x, *others) if prologue is not None and prologue.kept else x
    _store_groups(kept, tiling, mask, *kept_refs, interpret)
  if prologue is not None:
    # The tensor cast is the prologue's result, in float32 (never written in bf16);
    # it maps zeros to 0, so a masked edge keeps the amax's identity.
    x = prologue.fn(x, *others)
  if rows_ref is not None:
    # Rows past the limit (a grouped GEMM's rows past its groups) read as 0: they enter
    # no amax, and their FP8 rows are written as zeros (a NaN there would otherwise
    # reach a GEMM that multiplies it by 0).
    rows = (pl.program_id(0) * tiling.block_rows
            + lax.broadcasted_iota(jnp.int32, (tiling.block_rows, 1), 0))
    x = jnp.where(jnp.broadcast_to(rows < rows_ref[0], x.shape), x, 0.0)

  _amax_cast_store([(x, None)], mask, amax, amax_ref, cast, scale, from_amax, q_ref, q_t_ref)


def _amax_cast_store(parts, mask, amax: AmaxSpec, amax_ref, cast, scale, from_amax, q_ref,
                     q_t_ref):
  """Folds the tile's amax in, casts it and stores Q and Q^T. `parts`: [(float32 tile,
  None)], or the tile as [(columns' values, their `pl.ds` in the tile)] pieces of one
  shape, `mask` that shape's."""
  if amax.accumulate != "given":
    magnitude_bits = [jnp.max(lax.bitcast_convert_type(x, jnp.int32) & ABS_MASK)
                      for x, _ in parts]
    tile_amax = lax.bitcast_convert_type(functools.reduce(jnp.maximum, magnitude_bits),
                                         jnp.float32)
    if amax.accumulate == "tiles":
      amax_ref[0] = tile_amax
    else:
      plgpu.atomic_max(amax_ref, jnp.int32(0), tile_amax)

  if cast is None:
    return
  for x, columns in parts:
    q = saturate(x * scale.reshape(1, 1) if from_amax is not None else x * scale,
                  cast.max).astype(cast.dtype)
    store_masked(q_ref if columns is None else q_ref.at[:, columns], q, mask)
    if cast.transpose:
      store_masked(q_t_ref if columns is None else q_t_ref.at[columns, :], q.T,
                   None if mask is None else mask.T)


# A kept group's scale: the largest power of two that keeps its amax within E4M3's 448.
_KEPT_SCALE = ScaleFromAmax(numerator=float(jnp.finfo(jnp.float8_e4m3fn).max),
                            power_of_two=True)


def _store_groups(x, tiling: Tiling, mask, codes_ref, descale_ref, interpret: bool):
  """Stores the tile x [rows, GROUP_COLUMNS] (float32, out-of-range elements 0) as E4M3
  codes with one power-of-two scale per row, 448 / the row's amax rounded down (1 where
  the amax is 0, inf or NaN), and each row's descale 1 / scale (exact)."""
  row_amax = lax.bitcast_convert_type(
      jnp.max(lax.bitcast_convert_type(x, jnp.int32) & ABS_MASK, axis=1, keepdims=True),
      jnp.float32)
  scale = _scale_from_amax(row_amax, jnp.float32(1), _KEPT_SCALE, interpret)
  codes = saturate(x * scale, _KEPT_SCALE.numerator).astype(jnp.float8_e4m3fn)
  store_masked(codes_ref, codes, mask)
  store_masked(descale_ref, _divide(jnp.float32(1), scale, interpret),
               tile_mask(tiling, (tiling.block_rows, 1)))


def keep_groups_reference(x: jax.Array) -> tuple[jax.Array, jax.Array]:
  """What a cast with `keeps_groups` writes besides its cast, in plain jnp: x [R, C] as
  E4M3 codes [R, C] and one descale per row and group of `GROUP_COLUMNS` columns
  [R, ceil(C / GROUP_COLUMNS)] (a ragged last group padded with zeros), each group's
  scale 448 / its amax rounded down to a power of two, 1 where that is not finite and
  positive.

  Returns:
    (codes float8_e4m3fn [R, C], descales float32 [R, ceil(C / GROUP_COLUMNS)]).
  """
  rows, columns = x.shape
  groups = -(-columns // GROUP_COLUMNS)
  padded = jnp.pad(x.astype(jnp.float32), ((0, 0), (0, groups * GROUP_COLUMNS - columns)))
  padded = padded.reshape(rows, groups, GROUP_COLUMNS)
  amax = lax.bitcast_convert_type(
      jnp.max(lax.bitcast_convert_type(padded, jnp.int32) & ABS_MASK, axis=-1), jnp.float32)
  scale = _scale_from_amax(amax, jnp.float32(1), _KEPT_SCALE, interpret=True)
  codes = saturate(padded * scale[..., None], _KEPT_SCALE.numerator).astype(jnp.float8_e4m3fn)
  return codes.reshape(rows, -1)[:, :columns], 1.0 / scale


def _scale_from_amax(given, fallback, from_amax: ScaleFromAmax, interpret: bool):
  """`numerator / given`, or `fallback` where that or `given` is not finite and > 0
  (0, inf, NaN), rounded down to a power of two if asked: `fp8jax`'s
  `scale_from_amax`, with an IEEE division (`_divide`)."""
  quotient = _divide(jnp.float32(from_amax.numerator), given, interpret)
  # |v| < inf is false for inf and NaN: isfinite without a call Triton may not lower.
  usable = ((jnp.abs(given) < jnp.inf) & (given > 0) & (jnp.abs(quotient) < jnp.inf)
            & (quotient > 0))
  scale = jnp.where(usable, quotient, fallback)
  if not from_amax.power_of_two:
    return scale
  # A normal float32 keeps its exponent field; a subnormal one its highest set bit.
  bits = lax.bitcast_convert_type(scale, jnp.int32)
  normal = bits & EXPONENT_BITS
  top_bit = jnp.left_shift(jnp.int32(1), jnp.maximum(31 - lax.clz(bits), 0))
  subnormal = jnp.where(bits > 0, top_bit, 0)
  return lax.bitcast_convert_type(jnp.where(normal > 0, normal, subnormal), jnp.float32)


def _divide(numerator, denominator, interpret: bool):
  """IEEE float32 division: Triton's `/` is an approximate one on NVIDIA GPUs, which
  would make the scale differ from the same scale made by XLA."""
  if interpret:
    return numerator / denominator
  numerator = jnp.broadcast_to(numerator, jnp.shape(denominator)).astype(jnp.float32)
  (quotient,) = plgpu.elementwise_inline_asm(
      "div.rn.f32 $0, $1, $2;", args=[numerator, denominator],
      constraints="=r,r,r", pack=1,
      result_shape_dtypes=[jax.ShapeDtypeStruct(jnp.shape(denominator), jnp.float32)])
  return quotient


def _bits_max_pair(a, b):
  """max(a, b) of two float32 amaxes (>= 0 or NaN) on their bit patterns: NaN wins."""
  bits = [lax.bitcast_convert_type(v, jnp.int32) for v in (a, b)]
  return lax.bitcast_convert_type(jnp.maximum(*bits), jnp.float32)


def store_masked(ref, value, mask):
  if mask is None:
    ref[...] = value
  else:
    plgpu.store(ref, value, mask=mask)


def _copy_vector(src_ref, dst_ref, length: int):
  """dst[:length] = src[:length], a chunk at a time (one program)."""
  for start in range(0, length, _REDUCE_CHUNK):
    index = start + lax.iota(jnp.int32, _REDUCE_CHUNK)
    mask = index < length
    plgpu.store(dst_ref.at[index], plgpu.load(src_ref.at[index], mask=mask, other=0.0),
                mask=mask)


def _reduce_tiles(tiles_ref, running):
  """max(running, max(tiles)) on bit patterns (amaxes are >= 0 or NaN), a chunk at a time."""
  count = tiles_ref.shape[0]

  def chunk(c, best):
    index = c * _REDUCE_CHUNK + lax.iota(jnp.int32, _REDUCE_CHUNK)
    values = plgpu.load(tiles_ref.at[index], mask=index < count, other=0.0)
    return jnp.maximum(best, jnp.max(lax.bitcast_convert_type(values, jnp.int32)))

  best = lax.fori_loop(0, pl.cdiv(count, _REDUCE_CHUNK), chunk,
                       lax.bitcast_convert_type(running, jnp.int32))
  return lax.bitcast_convert_type(best, jnp.float32)


def _call(x, scale, amax_in, descale=None, partners=None, accumulator=None, tiles=None,
          passed=(), given=None, others=(), valid_rows=None, *, cast: CastSpec | None,
          amax: AmaxSpec, block_sizes: CastTransposeBlockSizes, interpret: bool):
  """Runs the kernel over all tiles of x.

  Returns (q, q_t, amax_out, products, reduced, seeds, passed, descale, kept): q None
  without a cast, products None without partners, amax_out float32[] or
  (`amax.accumulate == "tiles"`) float32[tile_count], reduced None unless
  `amax.reduce`, seeds and passed (copies of `passed`, float32 vectors) tuples,
  descale the float32[] 1 / scale made from `given` = (amax, recorded amax)
  (`cast.from_amax`), else None, kept the (codes, descales) of x (`cast.keeps_groups`),
  else None. `valid_rows`: int32[], the rows in use (`cast.row_limit`).
  """
  from_amax = cast.from_amax if cast is not None else None
  rotary = cast.prologue.rotary if cast is not None and cast.prologue is not None else None
  if rotary is not None:
    # The tensor cast is the qkv output gradient (`pallas_kernels.rotary_gradient`).
    tiling = rotary_gradient.tiling(x.shape, rotary, block_sizes)
    rows, cols = rotary_gradient.output_shape(x.shape)
  else:
    tiling = tiling_for(x.shape, block_sizes)
    rows, cols = x.shape
  block = (tiling.block_rows, tiling.block_cols)
  # Scalars travel as [1] arrays (a free reshape in XLA): the interpreter's atomics
  # need an index into the ref.
  scalar_spec = pl.BlockSpec((1,), lambda i, j: (0,))
  tile_spec = pl.BlockSpec(block, lambda i, j: (i, j))
  # 0-d blocks: the GEMM reads each product as its scalar operand directly (a [1]
  # array would need a reshape XLA puts between converts, costing a kernel).
  rank0_spec = pl.BlockSpec((), lambda i, j: ())
  check_summed(x, scale, amax_in, descale, partners, accumulator, tiles, passed, given, others,
               valid_rows)
  # Inside shard_map: a buffer written in place gives its type to the output, so it
  # carries that of max(amax_in, max|x|); every other output varies as what it is
  # computed from (the row limit decides what x is read as).
  amax_axes = varying_axes(x, amax_in, accumulator, valid_rows)
  if amax.accumulate == "in_place" and amax_in is not None:
    amax_in = vary(amax_in, amax_axes)
  operands = [x, *others]
  in_specs = (rotary_gradient.input_specs(tiling) if rotary is not None else
              [tile_spec] + [_prologue_input_spec(t, x, block) for t in others])
  if cast is not None and cast.row_limit:
    operands.append(valid_rows.reshape(1))
    in_specs.append(scalar_spec)
  if cast is not None:
    _add_scalar(operands, in_specs, scale, scalar_spec)
  if amax.accumulate == "given":
    operands += [a.reshape(1) for a in given]
    in_specs += [scalar_spec] * 2
  n_partners = 0 if partners is None else len(partners)
  if n_partners and from_amax is None:
    _add_scalar(operands, in_specs, descale, rank0_spec)
  for partner in partners or ():
    _add_scalar(operands, in_specs, partner, rank0_spec)
  if amax.accumulate == "given":  # read only: it may be a VectorElement
    _add_scalar(operands, in_specs, amax_in, scalar_spec)
  elif amax.accumulate != "tiles":  # tile maxima leave amax_in to the launch reducing them
    operands.append(amax_in.reshape(1))
    in_specs.append(scalar_spec)
  aliased = len(operands) - 1
  if amax.accumulate == "accumulator":
    operands.append(vary(accumulator, amax_axes).reshape(1))
    in_specs.append(scalar_spec)
    aliased = len(operands) - 1
  if amax.reduce:
    tiles_in, tiles_running = tiles
    operands += [tiles_in, tiles_running.reshape(1)]
    in_specs += [pl.BlockSpec(tiles_in.shape, lambda i, j: (0,)), scalar_spec]
  whole_vector = lambda length: pl.BlockSpec((length,), lambda i, j: (0,))
  operands += list(passed)
  in_specs += [whole_vector(length) for length in amax.passed]

  out_specs, out_shape = [], []
  if cast is not None:
    out_specs.append(tile_spec)
    cast_axes = varying_axes(x, *others, scale, given[:1] if given else None, valid_rows)
    out_shape.append(out_struct((rows, cols), cast.dtype, cast_axes))
    if cast.transpose:
      out_specs.append(pl.BlockSpec(block[::-1], lambda i, j: (j, i)))
      out_shape.append(out_struct((cols, rows), cast.dtype, cast_axes))
  # The descale is an operand, or made from the fallback scale and the given amax.
  descale_axes = (varying_axes(descale) if from_amax is None
                  else varying_axes(scale, given[0]))
  if from_amax is not None:
    out_specs.append(rank0_spec)
    out_shape.append(out_struct((), jnp.float32, descale_axes))
  out_specs += [rank0_spec] * n_partners
  out_shape += [out_struct((), jnp.float32, descale_axes | varying_axes(partner))
                for partner in partners or ()]
  amax_at = len(out_shape)
  if amax.accumulate == "tiles":
    grid_cols = tiling.grid[1]
    out_specs.append(pl.BlockSpec((1,), lambda i, j: (i * grid_cols + j,)))
    out_shape.append(out_struct((tile_count(x.shape, block_sizes),), jnp.float32,
                                varying_axes(x, valid_rows)))
    aliases = {}
  elif amax.accumulate == "given":  # one program writes it: nothing to alias
    out_specs.append(scalar_spec)
    out_shape.append(out_struct((1,), jnp.float32, varying_axes(amax_in, given[1])))
    aliases = {}
  else:
    out_specs.append(scalar_spec)
    out_shape.append(out_struct((1,), jnp.float32, varying_axes(operands[aliased])))
    # The programs atomically max into the aliased buffer in place.
    aliases = {aliased: amax_at}
  if amax.reduce:
    out_specs.append(scalar_spec)
    out_shape.append(out_struct((1,), jnp.float32, varying_axes(*tiles)))
  out_specs += [scalar_spec] * amax.seeds
  out_shape += [out_struct((1,), jnp.float32)] * amax.seeds
  out_specs += [whole_vector(length) for length in amax.passed]
  out_shape += [out_struct((length,), jnp.float32, varying_axes(vector))
                for length, vector in zip(amax.passed, passed)]
  keeps = cast is not None and cast.keeps_groups
  if keeps:
    # A tile is one group, or (C <= GROUP_COLUMNS and C <= its width) the whole row,
    # a group of its own; a wider tile over more columns would hold several groups.
    one_group_per_tile = (block[1] == GROUP_COLUMNS
                          or cols <= min(block[1], GROUP_COLUMNS))
    if rotary is not None or not one_group_per_tile:
      raise ValueError(f"keep_groups writes x with one descale per row and group of "
                       f"{GROUP_COLUMNS} columns, a group per tile: pass block_sizes with "
                       f"block_cols={GROUP_COLUMNS} (got {block[1]}), and no rotary prologue.")
    kept_axes = varying_axes(x)
    out_specs += [tile_spec, pl.BlockSpec((block[0], 1), lambda i, j: (i, j))]
    out_shape += [out_struct((rows, cols), jnp.float8_e4m3fn, kept_axes),
                  out_struct((rows, tiling.grid[1]), jnp.float32, kept_axes)]
  outs = pl.pallas_call(
      functools.partial(_kernel, tiling=tiling, cast=cast, partners=n_partners, amax=amax,
                        interpret=interpret),
      grid=tiling.grid,
      in_specs=in_specs,
      out_specs=out_specs,
      out_shape=out_shape,
      input_output_aliases=aliases,
      compiler_params=plgpu.CompilerParams(num_warps=block_sizes.num_warps,
                                           num_stages=block_sizes.num_stages),
      interpret=interpret,
      name="cast_transpose_amax" if cast is not None else "amax",
  )(*operands)
  amax_out = outs[amax_at] if amax.accumulate == "tiles" else outs[amax_at].reshape(())
  products = tuple(outs[amax_at - n_partners:amax_at]) if n_partners else None
  reduced = outs[amax_at + 1].reshape(()) if amax.reduce else None
  seeds_at = amax_at + 1 + amax.reduce
  seeds = tuple(s.reshape(()) for s in outs[seeds_at:seeds_at + amax.seeds])
  copies = tuple(outs[seeds_at + amax.seeds:len(outs) - 2 * keeps])
  q = outs[0] if cast is not None else None
  q_t = outs[1] if cast is not None and cast.transpose else None
  descale_out = outs[amax_at - n_partners - 1] if from_amax is not None else None
  kept = tuple(outs[-2:]) if keeps else None
  return q, q_t, amax_out, products, reduced, seeds, copies, descale_out, kept


def _prologue_input_spec(t, x, block) -> pl.BlockSpec:
  """The block of a prologue input each program reads: x's tile, or that tile's rows'
  values ([R, 1] inputs) or its columns' ([1, C]), or its rows' values of its one group
  of columns ([R, ceil(C / GROUP_COLUMNS)] inputs, where a tile is one group wide)."""
  kind = broadcast_kind(t.shape, x.shape)
  if kind == "rows":
    return pl.BlockSpec((block[0], 1), lambda i, j: (i, 0))
  if kind == "groups":
    if block[1] != GROUP_COLUMNS:
      raise ValueError(
          f"a prologue input of one value per row and group of {GROUP_COLUMNS} columns "
          f"{tuple(t.shape)} is read a group per tile: pass block_sizes with block_cols="
          f"{GROUP_COLUMNS} (got {block[1]}).")
    return pl.BlockSpec((block[0], 1), lambda i, j: (i, j))
  if kind == "columns":
    return pl.BlockSpec((1, block[1]), lambda i, j: (0, j))
  return pl.BlockSpec(block, lambda i, j: (i, j))


def _add_scalar(operands: list, in_specs: list, value, spec: pl.BlockSpec) -> None:
  """Appends a float32 scalar operand: an array with `spec` ([1] blocks take it as a [1]
  array, a free reshape in XLA), or a `VectorElement`, whose [1] block is its element of
  the vector, read in place (no launch slices it out)."""
  if isinstance(value, VectorElement):
    operands.append(value.vector)
    in_specs.append(_element_spec(value.index))
  else:
    operands.append(value if spec.block_shape == () else value.reshape(1))
    in_specs.append(spec)


def _element_spec(index: int) -> pl.BlockSpec:
  """The [1] block of a vector that holds its element `index`, for every program."""
  return pl.BlockSpec((1,), lambda i, j: (index,))


def _read_scalar(ref):
  """The float32[] a scalar operand's ref holds, from its 0-d or [1] block."""
  return ref[...] if ref.shape == () else ref[0]


@functools.partial(jax.jit, static_argnames=("cast", "amax", "block_sizes", "interpret"))
def launch(x, scale, amax_in, descale=None, partners=None, accumulator=None, tiles=None,
           passed=(), given=None, others=(), valid_rows=None, *, cast, amax=AmaxSpec(),
           block_sizes, interpret):
  """One jitted launch of the kernel over all tiles of x (`_call`), for this module's
  public functions and those of `cast_transpose_chain` and `cast_transpose_current`.
  `others`: the further tensors `cast.prologue` reads, each of x's shape, [R, 1], [1, C]
  or [R, ceil(C / GROUP_COLUMNS)]; `valid_rows`:
  the rows in use (`cast.row_limit`)."""
  return _call(x, scale, amax_in, descale, partners, accumulator, tiles, passed, given,
               others, valid_rows, cast=cast, amax=amax, block_sizes=block_sizes,
               interpret=interpret)


# ---------------------------------------------------------------------------
# Public API.
# ---------------------------------------------------------------------------


def cast_transpose_amax(
    x: jax.Array, scale: jax.Array, amax_in: jax.Array, *, fp8_dtype, fp8_max: float,
    transpose: bool = True, descale: jax.Array | None = None,
    partner_descales: jax.Array | None = None, valid_rows: jax.Array | None = None,
    block_sizes: CastTransposeBlockSizes = CastTransposeBlockSizes(),
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array | None, jax.Array]:
  """FP8 copy, transposed FP8 copy and running amax of a 2-D tensor, in one pass.

  q = clip(x.astype(float32) * scale, -fp8_max, fp8_max).astype(fp8_dtype) (round to
  nearest even; NaN stays NaN; +-inf saturates to +-fp8_max), q_t = q.T, and
  amax_out = max(amax_in, max |x|) in float32 (NaN if x holds a NaN).

  Args:
    x: [R, C] bfloat16, float16 or float32.
    scale: float32[] quantization scale (multiplies before the cast), or a
      `VectorElement` (as are descale and each partner descale): read in place from its
      vector.
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
    valid_rows: optional int32[]: only rows [0, valid_rows) are in use (a grouped
      GEMM's rows within its groups); the others read as 0: they enter no amax and
      their rows of q (columns of q_t) are 0, whatever x holds there (NaN included).
    block_sizes: tile sizes and launch knobs.
    interpret: run the Pallas interpreter (on CPU) instead of lowering for a GPU.

  Returns:
    (q [R, C], q_t [C, R] or None, amax_out float32[]), plus the tuple of float32[]
    products when `partner_descales` is given. q and q_t in fp8_dtype.
  """
  check_x(x)
  fp8_dtype = check_fp8(fp8_dtype, fp8_max)
  scale = scalar_f32(scale, "scale", element_ok=True)
  amax_in = scalar_f32(amax_in, "amax_in")
  check_flag(transpose, "transpose")
  check_flag(interpret, "interpret")
  check_block_sizes(block_sizes)
  valid_rows = row_limit(valid_rows)
  cast = CastSpec(dtype=fp8_dtype, max=float(fp8_max), transpose=transpose,
                  row_limit=valid_rows is not None)
  descale, partner_descales = check_products(descale, partner_descales)
  q, q_t, amax_out, products, *_ = launch(x, scale, amax_in, descale, partner_descales,
                                          valid_rows=valid_rows, cast=cast,
                                          block_sizes=block_sizes, interpret=interpret)
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
  check_x(x)
  amax_in = scalar_f32(amax_in, "amax_in")
  check_flag(interpret, "interpret")
  check_block_sizes(block_sizes)
  return launch(x, None, amax_in, cast=None, block_sizes=block_sizes,
                interpret=interpret)[2]


def rows_in_use(x: jax.Array, valid_rows: jax.Array | None) -> jax.Array:
  """x with its rows at and past `valid_rows` zeroed (what the kernel reads them as)."""
  if valid_rows is None:
    return x
  return jnp.where(jnp.arange(x.shape[0])[:, None] < valid_rows, x, jnp.zeros((), x.dtype))


def bits_max(*values):
  """The max of float32 amaxes (>= 0 or NaN; scalars or vectors) on their bit
  patterns, where NaN sorts above inf."""
  flat = jnp.concatenate([jnp.ravel(jnp.asarray(v, jnp.float32)) for v in values])
  return lax.bitcast_convert_type(jnp.max(lax.bitcast_convert_type(flat, jnp.int32)),
                                  jnp.float32)


def cast_transpose_amax_reference(
    x: jax.Array, scale: jax.Array, amax_in: jax.Array, *, fp8_dtype, fp8_max: float,
    transpose: bool = True, descale: jax.Array | None = None,
    partner_descales: jax.Array | None = None, valid_rows: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array | None, jax.Array]:
  """`cast_transpose_amax` in plain jnp: the definition the kernel matches bit for bit.

  q is `fp8jax.quantize`'s formula; the amax is `fp8jax.amax`'s with the NaN
  rule made explicit (a NaN in x or in amax_in gives NaN). Takes the same arguments
  (without the kernel knobs) and returns the same (q, q_t or None, amax_out).
  """
  check_x(x)
  fp8_dtype = check_fp8(fp8_dtype, fp8_max)
  scale = element_value(scalar_f32(scale, "scale", element_ok=True))
  amax_in = scalar_f32(amax_in, "amax_in")
  x = rows_in_use(x, row_limit(valid_rows))
  q = jnp.clip(x.astype(jnp.float32) * scale, -fp8_max, fp8_max).astype(fp8_dtype)
  x_amax = jnp.max(jnp.abs(x)).astype(jnp.float32)
  # The NaN rule is spelled out: XLA on CPU (jax 0.10.2) drops NaN from some float32
  # max reductions (any [64, 64] or larger 2-D one returns the largest finite |x|).
  x_amax = jnp.where(jnp.any(jnp.isnan(x)), jnp.float32(jnp.nan), x_amax)
  amax_out = jnp.where(jnp.isnan(amax_in), amax_in, jnp.maximum(amax_in, x_amax))
  descale, partner_descales = check_products(descale, partner_descales)
  if partner_descales is None:
    return q, (q.T if transpose else None), amax_out
  descale = element_value(descale)
  products = tuple(jnp.minimum(descale * element_value(p), _F32_MAX)
                   for p in partner_descales)
  return q, (q.T if transpose else None), amax_out, products
