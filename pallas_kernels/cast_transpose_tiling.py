"""The tiling of the cast-transpose-amax kernels: tile sizes, the grid, the edge masks.

Shared by the kernels of `pallas_kernels.cast_transpose` and by callers that need
to know how many programs (tiles) a launch has: a launch that writes one amax per
tile returns `tile_count(shape)` of them.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

# The smallest tile edge: Triton tensors have power-of-two dimensions, and 16 keeps
# every layout (16-byte vectors, the transpose through shared memory) regular.
_MIN_BLOCK = 16
# The columns of one group of an activation kept in FP8 with one scale per row and group
# (`fp8jax.ops.saved_activations.GROUP`): a prologue input of one value per row and group
# is read one value per row of a tile, so the cast's tiles are this wide.
GROUP_COLUMNS = 128
# Clears the sign bit of a float32's bit pattern: |x| without a float operation.
ABS_MASK = 0x7FFFFFFF


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
class Tiling:
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


def _fit(block: int, length: int) -> int:
  """The tile edge for a dimension of `length`: never far past the dimension."""
  return min(block, max(_MIN_BLOCK, 1 << (length - 1).bit_length()))


def tiling_for(shape: tuple[int, int], block_sizes: CastTransposeBlockSizes) -> Tiling:
  rows, cols = shape
  return Tiling(rows=rows, cols=cols, block_rows=_fit(block_sizes.block_rows, rows),
                 block_cols=_fit(block_sizes.block_cols, cols))


def tile_mask(tiling: Tiling, block: tuple | None = None):
  """Boolean mask of the in-range elements of a program's block, or None when all are.

  `block`: the block's shape, [block_rows, block_cols] (the default), or a row's values
  [block_rows, 1] or a column's [1, block_cols] (masked on their own axis only).
  """
  block = block or (tiling.block_rows, tiling.block_cols)
  mask = None
  if tiling.row_tail and block[0] > 1:
    rows = (pl.program_id(0) * tiling.block_rows
            + lax.broadcasted_iota(jnp.int32, (tiling.block_rows, 1), 0))
    mask = rows < tiling.rows
  if tiling.col_tail and block[1] > 1:
    cols = (pl.program_id(1) * tiling.block_cols
            + lax.broadcasted_iota(jnp.int32, (1, tiling.block_cols), 1))
    col_mask = cols < tiling.cols
    mask = col_mask if mask is None else jnp.logical_and(mask, col_mask)
  if mask is not None:
    mask = jnp.broadcast_to(mask, block)
  return mask


def tile_count(shape: tuple[int, int],
               block_sizes: CastTransposeBlockSizes = CastTransposeBlockSizes()) -> int:
  """How many programs (tiles) the kernels launch over a 2-D tensor of `shape`: the
  length of the tile maxima `cast_transpose_amax_in_chain(..., tile_amaxes=True)` returns."""
  rows, cols = tiling_for(tuple(shape), block_sizes).grid
  return rows * cols


def tile_maxima(x, block_sizes):
  """float32[tile_count] max|x| of each tile in the kernels' program order (row-major over
  the grid), reduced on bit patterns: the jnp form of the tile maxima a launch writes."""
  tiling = tiling_for(x.shape, block_sizes)
  grid_rows, grid_cols = tiling.grid
  bits = lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32) & ABS_MASK
  bits = jnp.pad(bits, ((0, grid_rows * tiling.block_rows - x.shape[0]),
                        (0, grid_cols * tiling.block_cols - x.shape[1])))
  bits = bits.reshape(grid_rows, tiling.block_rows, grid_cols, tiling.block_cols)
  return lax.bitcast_convert_type(jnp.max(bits, axis=(1, 3)).reshape(-1), jnp.float32)
