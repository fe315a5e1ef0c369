"""An FP8 layer's casts as a chain of launches that initialises no buffer.

The cast-transpose kernel (`pallas_kernels.cast_transpose`) folds its programs' tile
maxima into one float32 with atomics, so that buffer must hold its start value before
the launch; where XLA cannot overwrite the running amax (a jit parameter, a constant, a
value read again) it copies it first, a launch for 4 bytes per tensor. In a chain (a
layer's three casts, delayed scaling) the launches hand each other what they need
instead: the first writes its tile maxima, a later one reduces them and writes zeroed
accumulators, a later one accumulates into one (`cast_transpose_amax_in_chain`;
`cast_transpose_amax_in_chain_reference` is its plain-jnp definition).
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels.activations import Prologue
from pallas_kernels.cast_transpose import (AmaxSpec, CastSpec, bits_max,
                                           cast_transpose_amax_reference,
                                           keep_groups_reference, launch, rows_in_use)
from pallas_kernels.cast_transpose_checks import (check_accumulation, check_block_sizes,
                                                  check_flag, check_fp8, check_pass_through,
                                                  check_products, check_prologue,
                                                  check_reduce, check_x, row_limit,
                                                  scalar_f32)
from pallas_kernels.cast_transpose_tiling import CastTransposeBlockSizes, tile_maxima


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
    kept: with `keep_groups`, x (before the prologue) as E4M3 codes [R, C] and one
      descale per row and group of 128 columns (`keep_groups_reference`); else None.
  """

  q: jax.Array
  q_t: jax.Array | None
  amax: jax.Array
  products: tuple | None
  reduced: jax.Array | None
  seeds: tuple
  passed: tuple = ()
  kept: tuple | None = None


def cast_transpose_amax_in_chain(
    x: jax.Array, scale: jax.Array, amax_in: jax.Array | None, *, fp8_dtype, fp8_max: float,
    transpose: bool = True, descale: jax.Array | None = None,
    partner_descales: jax.Array | None = None, accumulator: jax.Array | None = None,
    tile_amaxes: bool = False, reduce: tuple | None = None, seeds: int = 0,
    pass_through: tuple = (), prologue: Prologue | None = None, prologue_inputs: tuple = (),
    valid_rows: jax.Array | None = None, keep_groups: bool = False,
    block_sizes: CastTransposeBlockSizes = CastTransposeBlockSizes(),
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
    prologue: cast `prologue.fn(x, *prologue_inputs)` (float32, elementwise) instead
      of x, its amax included (`pallas_kernels.activations`): the function's result is
      made in the kernel's registers and never written in x's dtype. A rotary prologue
      (`pallas_kernels.rotary_gradient`) makes the qkv gradient [R, 3 C] from x = dq.
    prologue_inputs: the further tensors the prologue reads, each of x's shape, [R, 1],
      [1, C] or [R, ceil(C / 128)] (one per row and group of columns).
    valid_rows: as for `cast_transpose_amax` (rows past it read as 0, after the prologue).
    keep_groups: also write x itself, before the prologue (or `prologue.kept`'s value of
      it), as the FP8 copy a backward pass keeps (`ChainedCast.kept`): one pass over x
      makes both (block_cols 128).

  Returns:
    A `ChainedCast`.
  """
  check_x(x)
  prologue_inputs = check_prologue(prologue, prologue_inputs, x)
  fp8_dtype = check_fp8(fp8_dtype, fp8_max)
  scale = scalar_f32(scale, "scale", element_ok=True)
  check_flag(transpose, "transpose")
  check_flag(interpret, "interpret")
  check_flag(tile_amaxes, "tile_amaxes")
  check_block_sizes(block_sizes)
  accumulate, amax_in, accumulator = check_accumulation(amax_in, accumulator, tile_amaxes)
  tiles = check_reduce(reduce)
  if isinstance(seeds, bool) or not isinstance(seeds, int) or not 0 <= seeds <= 4:
    raise ValueError(f"seeds={seeds!r} must be an int from 0 to 4.")
  valid_rows = row_limit(valid_rows)
  _check_rotary(prologue, tile_amaxes, valid_rows)
  check_flag(keep_groups, "keep_groups")
  cast = CastSpec(dtype=fp8_dtype, max=float(fp8_max), transpose=transpose,
                  prologue=prologue, row_limit=valid_rows is not None,
                  keeps_groups=keep_groups)
  descale, partner_descales = check_products(descale, partner_descales)
  passed = check_pass_through(pass_through)
  amax = AmaxSpec(accumulate=accumulate, reduce=tiles is not None, seeds=seeds,
                  passed=tuple(int(jnp.size(a)) for a in passed))
  out = launch(x, scale, amax_in, descale, partner_descales, accumulator, tiles,
               tuple(jnp.ravel(a) for a in passed), None, prologue_inputs, valid_rows,
               cast=cast, amax=amax, block_sizes=block_sizes, interpret=interpret)
  copies = tuple(c.reshape(jnp.shape(a)) for c, a in zip(out[6], passed))
  return ChainedCast(*out[:6], copies, out[8])


def cast_transpose_amax_in_chain_reference(
    x: jax.Array, scale: jax.Array, amax_in: jax.Array | None, *, fp8_dtype, fp8_max: float,
    transpose: bool = True, descale: jax.Array | None = None,
    partner_descales: jax.Array | None = None, accumulator: jax.Array | None = None,
    tile_amaxes: bool = False, reduce: tuple | None = None, seeds: int = 0,
    pass_through: tuple = (), prologue: Prologue | None = None, prologue_inputs: tuple = (),
    valid_rows: jax.Array | None = None, keep_groups: bool = False,
    block_sizes: CastTransposeBlockSizes = CastTransposeBlockSizes(),
) -> ChainedCast:
  """`cast_transpose_amax_in_chain` in plain jnp, tile maxima included (the same tiles)."""
  check_x(x)
  prologue_inputs = check_prologue(prologue, prologue_inputs, x)
  _check_rotary(prologue, tile_amaxes, valid_rows)
  check_flag(keep_groups, "keep_groups")
  kept = (keep_groups_reference(x if prologue is None else prologue.kept_of(x, prologue_inputs))
          if keep_groups else None)
  if prologue is not None:
    x = prologue.applied_to(x, prologue_inputs)
  x = rows_in_use(x, row_limit(valid_rows))
  check_flag(tile_amaxes, "tile_amaxes")
  check_block_sizes(block_sizes)
  accumulate, amax_in, accumulator = check_accumulation(amax_in, accumulator, tile_amaxes)
  tiles = check_reduce(reduce)
  start = jnp.float32(0) if accumulate == "tiles" else amax_in
  if accumulate == "accumulator":
    start = bits_max(accumulator, amax_in)
  q, q_t, amax_out, *products = cast_transpose_amax_reference(
      x, scale, start, fp8_dtype=fp8_dtype, fp8_max=fp8_max, transpose=transpose,
      descale=descale, partner_descales=partner_descales)
  if tile_amaxes:
    amax_out = tile_maxima(x, block_sizes)
  reduced = bits_max(tiles[1], tiles[0]) if tiles is not None else None
  return ChainedCast(q, q_t, amax_out, products[0] if products else None, reduced,
                     (jnp.float32(0),) * seeds, check_pass_through(pass_through), kept)


def _check_rotary(prologue, tile_amaxes, valid_rows) -> None:
  if prologue is not None and prologue.rotary is not None and (
      tile_amaxes or valid_rows is not None):
    raise ValueError("the rotary qkv gradient's cast takes neither tile_amaxes nor valid_rows "
                     "(its tiles are one head's q, k or v).")
