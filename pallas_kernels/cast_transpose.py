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
`cast_transpose_amax_in_chain` avoids that in a chain of launches (an FP8 layer's
casts): the first writes its tiles' maxima, one slot per program, which needs no
initialised buffer; one program of a later launch reduces them and writes zeroed
buffers that the launches after it max into.

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
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.cast_transpose_checks import (check_accumulation, check_block_sizes,
                                                  check_flag, check_fp8, check_pass_through,
                                                  check_products, check_reduce, check_x,
                                                  scalar_f32)
from pallas_kernels.cast_transpose_tiling import (ABS_MASK, CastTransposeBlockSizes, Tiling,
                                                  tile_count, tile_mask, tile_maxima,
                                                  tiling_for)
from pallas_kernels.varying import check_summed, out_struct, vary, varying_axes

_F32_MAX = float(jnp.finfo(jnp.float32).max)


@dataclasses.dataclass(frozen=True)
class _Cast:
  """The FP8 target of the cast, and whether the transposed copy is written."""

  dtype: jnp.dtype
  max: float
  transpose: bool


def _saturate(y, fp8_max: float):
  """clip(y, -fp8_max, fp8_max) that keeps NaN on every backend.

  Written with comparisons rather than min/max: Triton lowers float min/max to
  `minnum`/`maxnum`, which return the non-NaN operand and would turn NaN into
  +-fp8_max. A comparison with NaN is false, so NaN passes through.
  """
  y = jnp.where(y > fp8_max, fp8_max, y)
  return jnp.where(y < -fp8_max, -fp8_max, y)


@dataclasses.dataclass(frozen=True)
class _Amax:
  """How one launch makes its amax (static).

  accumulate: "in_place": the programs max into amax_in's own buffer (aliased);
    "accumulator": into a zeroed buffer an earlier launch wrote (aliased), one
    program folding amax_in in; "tiles": each program writes its tile's max to
    its own slot, so no buffer has to be initialised before the launch.
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


def _kernel(*refs, tiling: Tiling, cast: _Cast | None, partners: int, amax: _Amax):
  """One [block_rows, block_cols] tile: Q, Q^T (per `cast`) and the amax.

  Refs: x, [scale], [descale, partner x `partners`], [amax_in], [accumulator],
  [tiles_in, tiles_running], [passed in x `passed`], then [q], [q_t], [product x
  `partners`], amax_out, [reduced], [seed x `seeds`], [passed out x `passed`].
  amax_out is amax_in's buffer ("in_place"), the accumulator's ("accumulator") or
  one slot per program ("tiles").
  """
  refs = list(refs)
  x_ref = refs.pop(0)
  scale_ref = refs.pop(0) if cast is not None else None
  if partners:
    descale_ref = refs.pop(0)
    partner_refs = [refs.pop(0) for _ in range(partners)]
  amax_in_ref = refs.pop(0) if amax.accumulate != "tiles" else None
  if amax.accumulate == "accumulator":
    refs.pop(0)  # the accumulator: the same buffer as amax_out
  if amax.reduce:
    tiles_in_ref, tiles_running_ref = refs.pop(0), refs.pop(0)
  passed_in_refs = [refs.pop(0) for _ in amax.passed]
  q_ref = refs.pop(0) if cast is not None else None
  q_t_ref = refs.pop(0) if cast is not None and cast.transpose else None
  product_refs = [refs.pop(0) for _ in range(partners)]
  amax_ref = refs.pop(0)
  reduced_ref = refs.pop(0) if amax.reduce else None
  seed_refs = [refs.pop(0) for _ in range(amax.seeds)]
  passed_out_refs = refs
  first = (pl.program_id(0) == 0) & (pl.program_id(1) == 0)
  if partners:
    @pl.when(first)
    def _():
      # The GEMMs' combined descales, capped at the largest float32 so that an
      # all-zero row times an overflowing product stays 0 instead of NaN.
      for partner_ref, product_ref in zip(partner_refs, product_refs):
        product_ref[...] = jnp.minimum(descale_ref[...] * partner_ref[...], _F32_MAX)
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
  if mask is None:
    x = x_ref[...]
  else:
    # Out-of-range elements read as 0, the identity of the amax below.
    x = plgpu.load(x_ref, mask=mask, other=0)
  x = x.astype(jnp.float32)  # exact for bf16 / f16 inputs

  magnitude_bits = lax.bitcast_convert_type(x, jnp.int32) & ABS_MASK
  tile_amax = lax.bitcast_convert_type(jnp.max(magnitude_bits), jnp.float32)
  if amax.accumulate == "tiles":
    amax_ref[0] = tile_amax
  else:
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
          passed=(), *, cast: _Cast | None, amax: _Amax, block_sizes: CastTransposeBlockSizes,
          interpret: bool):
  """Runs the kernel over all tiles of x.

  Returns (q, q_t, amax_out, products, reduced, seeds, passed): q None without a
  cast, products None without partners, amax_out float32[] or (`amax.accumulate ==
  "tiles"`) float32[tile_count], reduced None unless `amax.reduce`, seeds and passed
  (copies of `passed`, float32 vectors) tuples.
  """
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
  check_summed(x, scale, amax_in, descale, partners, accumulator, tiles, passed)
  # Inside shard_map: a buffer written in place gives its type to the output, so it
  # carries that of max(amax_in, max|x|); every other output varies as what it is
  # computed from.
  amax_axes = varying_axes(x, amax_in, accumulator)
  if amax.accumulate == "in_place" and amax_in is not None:
    amax_in = vary(amax_in, amax_axes)
  operands, in_specs = [x], [tile_spec]
  if cast is not None:
    operands.append(scale.reshape(1))
    in_specs.append(scalar_spec)
  n_partners = 0 if partners is None else len(partners)
  if n_partners:
    operands += [descale, *partners]
    in_specs += [rank0_spec] * (1 + n_partners)
  if amax.accumulate != "tiles":  # tile maxima leave amax_in to the launch reducing them
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
    cast_axes = varying_axes(x, scale)
    out_shape.append(out_struct((rows, cols), cast.dtype, cast_axes))
    if cast.transpose:
      out_specs.append(pl.BlockSpec(block[::-1], lambda i, j: (j, i)))
      out_shape.append(out_struct((cols, rows), cast.dtype, cast_axes))
  out_specs += [rank0_spec] * n_partners
  out_shape += [out_struct((), jnp.float32, varying_axes(descale, partner))
                for partner in partners or ()]
  amax_at = len(out_shape)
  if amax.accumulate == "tiles":
    grid_cols = tiling.grid[1]
    out_specs.append(pl.BlockSpec((1,), lambda i, j: (i * grid_cols + j,)))
    out_shape.append(out_struct((tile_count(x.shape, block_sizes),), jnp.float32,
                                varying_axes(x)))
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
  outs = pl.pallas_call(
      functools.partial(_kernel, tiling=tiling, cast=cast, partners=n_partners, amax=amax),
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
  copies = tuple(outs[seeds_at + amax.seeds:])
  q = outs[0] if cast is not None else None
  q_t = outs[1] if cast is not None and cast.transpose else None
  return q, q_t, amax_out, products, reduced, seeds, copies


@functools.partial(jax.jit, static_argnames=("cast", "amax", "block_sizes", "interpret"))
def _call_jit(x, scale, amax_in, descale=None, partners=None, accumulator=None, tiles=None,
              passed=(), *, cast, amax=_Amax(), block_sizes, interpret):
  return _call(x, scale, amax_in, descale, partners, accumulator, tiles, passed, cast=cast,
               amax=amax, block_sizes=block_sizes, interpret=interpret)


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
  check_x(x)
  fp8_dtype = check_fp8(fp8_dtype, fp8_max)
  scale = scalar_f32(scale, "scale")
  amax_in = scalar_f32(amax_in, "amax_in")
  check_flag(transpose, "transpose")
  check_flag(interpret, "interpret")
  check_block_sizes(block_sizes)
  cast = _Cast(dtype=fp8_dtype, max=float(fp8_max), transpose=transpose)
  descale, partner_descales = check_products(descale, partner_descales)
  q, q_t, amax_out, products, *_ = _call_jit(x, scale, amax_in, descale, partner_descales,
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
  check_x(x)
  amax_in = scalar_f32(amax_in, "amax_in")
  check_flag(interpret, "interpret")
  check_block_sizes(block_sizes)
  return _call_jit(x, None, amax_in, cast=None, block_sizes=block_sizes,
                   interpret=interpret)[2]


class ChainedCast(NamedTuple):
  """What `cast_transpose_amax_in_chain` returns.

  Attributes:
    q, q_t: the FP8 copy [R, C] and its transpose [C, R] (None without `transpose`).
    amax: float32[] max(amax_in, max|x|); with `tile_amaxes`, float32[tile_count] the
      maxima of the tiles (each program's), for a later launch to reduce.
    products: the GEMMs' combined descales (None without `partner_descales`).
    reduced: float32[] max(running, max(tiles)) of `reduce=(tiles, running)`, or None.
    seeds: `seeds` float32[] zeros, each an accumulator for a later launch.
    passed: copies of the `pass_through` arrays, in their shapes.
  """

  q: jax.Array
  q_t: jax.Array | None
  amax: jax.Array
  products: tuple | None
  reduced: jax.Array | None
  seeds: tuple
  passed: tuple = ()


def cast_transpose_amax_in_chain(
    x: jax.Array, scale: jax.Array, amax_in: jax.Array | None, *, fp8_dtype, fp8_max: float,
    transpose: bool = True, descale: jax.Array | None = None,
    partner_descales: jax.Array | None = None, accumulator: jax.Array | None = None,
    tile_amaxes: bool = False, reduce: tuple | None = None, seeds: int = 0,
    pass_through: tuple = (), block_sizes: CastTransposeBlockSizes = CastTransposeBlockSizes(),
    interpret: bool = False,
) -> ChainedCast:
  """`cast_transpose_amax` as one launch of a chain that initialises no buffer.

  The kernel's programs fold their tiles' maxima into one float32 with atomics, so
  that buffer must hold its start value before the launch. Given amax_in itself
  (`cast_transpose_amax`), XLA copies it first wherever it cannot be overwritten (a
  jit parameter, a constant, a value read again): a kernel launch for 4 bytes. In a
  chain of launches (an FP8 layer's casts) nothing runs for it:

  * the first launch writes one maximum per tile (`tile_amaxes=True`), which needs
    no initialised buffer, and leaves amax_in (pass None) to a later launch;
  * a later launch reduces them with that running amax (`reduce=(tiles, running)`);
  * a launch writes zeroed buffers (`seeds=n`) that later launches accumulate into
    (`accumulator=`), folding their own amax_in in.

  Each of these extra values is written by one program of a launch that runs anyway.
  So are copies of small arrays (`pass_through`): the scales and amax histories the
  step's state update reads. An update that reads a jit parameter keeps it alive
  until the step's end, so with the state donated XLA must copy every new value it
  writes into that parameter's buffer; read from these copies, the parameters die
  at the casts and the update writes its results where they were.

  Args:
    x, scale, fp8_dtype, fp8_max, transpose, descale, partner_descales, block_sizes,
      interpret: as for `cast_transpose_amax`.
    amax_in: float32[] running amax (>= 0 or NaN); None with `tile_amaxes`.
    accumulator: float32[] holding 0 (a seed of an earlier launch): the amax is
      max(amax_in, max|x|) written into its buffer in place.
    tile_amaxes: return the maxima of the tiles instead of one amax.
    reduce: (tiles float32[T], running float32[]) of an earlier launch: also return
      max(running, max(tiles)).
    seeds: how many float32[] zeros to return (0 to 4).
    pass_through: float32 arrays of at most one dimension to return copies of.

  Returns:
    A `ChainedCast`.
  """
  check_x(x)
  fp8_dtype = check_fp8(fp8_dtype, fp8_max)
  scale = scalar_f32(scale, "scale")
  check_flag(transpose, "transpose")
  check_flag(interpret, "interpret")
  check_flag(tile_amaxes, "tile_amaxes")
  check_block_sizes(block_sizes)
  accumulate, amax_in, accumulator = check_accumulation(amax_in, accumulator, tile_amaxes)
  tiles = check_reduce(reduce)
  if isinstance(seeds, bool) or not isinstance(seeds, int) or not 0 <= seeds <= 4:
    raise ValueError(f"seeds={seeds!r} must be an int from 0 to 4.")
  cast = _Cast(dtype=fp8_dtype, max=float(fp8_max), transpose=transpose)
  descale, partner_descales = check_products(descale, partner_descales)
  passed = check_pass_through(pass_through)
  amax = _Amax(accumulate=accumulate, reduce=tiles is not None, seeds=seeds,
               passed=tuple(int(jnp.size(a)) for a in passed))
  out = _call_jit(x, scale, amax_in, descale, partner_descales, accumulator, tiles,
                  tuple(jnp.ravel(a) for a in passed), cast=cast, amax=amax,
                  block_sizes=block_sizes, interpret=interpret)
  copies = tuple(c.reshape(jnp.shape(a)) for c, a in zip(out[-1], passed))
  return ChainedCast(*out[:-1], copies)


def cast_transpose_amax_in_chain_reference(
    x: jax.Array, scale: jax.Array, amax_in: jax.Array | None, *, fp8_dtype, fp8_max: float,
    transpose: bool = True, descale: jax.Array | None = None,
    partner_descales: jax.Array | None = None, accumulator: jax.Array | None = None,
    tile_amaxes: bool = False, reduce: tuple | None = None, seeds: int = 0,
    pass_through: tuple = (), block_sizes: CastTransposeBlockSizes = CastTransposeBlockSizes(),
) -> ChainedCast:
  """`cast_transpose_amax_in_chain` in plain jnp, tile maxima included (the same tiles)."""
  check_x(x)
  check_flag(tile_amaxes, "tile_amaxes")
  check_block_sizes(block_sizes)
  accumulate, amax_in, accumulator = check_accumulation(amax_in, accumulator, tile_amaxes)
  tiles = check_reduce(reduce)
  start = jnp.float32(0) if accumulate == "tiles" else amax_in
  if accumulate == "accumulator":
    start = _bits_max(accumulator, amax_in)
  q, q_t, amax_out, *products = cast_transpose_amax_reference(
      x, scale, start, fp8_dtype=fp8_dtype, fp8_max=fp8_max, transpose=transpose,
      descale=descale, partner_descales=partner_descales)
  if tile_amaxes:
    amax_out = tile_maxima(x, block_sizes)
  reduced = _bits_max(tiles[1], tiles[0]) if tiles is not None else None
  return ChainedCast(q, q_t, amax_out, products[0] if products else None, reduced,
                     (jnp.float32(0),) * seeds, check_pass_through(pass_through))


def _bits_max(*values):
  """The max of float32 amaxes (>= 0 or NaN; scalars or vectors) on their bit
  patterns, where NaN sorts above inf."""
  flat = jnp.concatenate([jnp.ravel(jnp.asarray(v, jnp.float32)) for v in values])
  return lax.bitcast_convert_type(jnp.max(lax.bitcast_convert_type(flat, jnp.int32)),
                                  jnp.float32)


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
  check_x(x)
  fp8_dtype = check_fp8(fp8_dtype, fp8_max)
  scale = scalar_f32(scale, "scale")
  amax_in = scalar_f32(amax_in, "amax_in")
  q = jnp.clip(x.astype(jnp.float32) * scale, -fp8_max, fp8_max).astype(fp8_dtype)
  x_amax = jnp.max(jnp.abs(x)).astype(jnp.float32)
  # The NaN rule is spelled out: XLA on CPU (jax 0.10.2) drops NaN from some float32
  # max reductions (any [64, 64] or larger 2-D one returns the largest finite |x|).
  x_amax = jnp.where(jnp.any(jnp.isnan(x)), jnp.float32(jnp.nan), x_amax)
  amax_out = jnp.where(jnp.isnan(amax_in), amax_in, jnp.maximum(amax_in, x_amax))
  descale, partner_descales = check_products(descale, partner_descales)
  if partner_descales is None:
    return q, (q.T if transpose else None), amax_out
  products = tuple(jnp.minimum(descale * p, _F32_MAX) for p in partner_descales)
  return q, (q.T if transpose else None), amax_out, products
