"""The qkv projection's output gradient made by its cast, from dq, dk, dv and RoPE's transpose.

A transformer block projects x once to q, k and v ([R, H * 3 * D]: heads outermost, then
q, k, v, then the head's D features) and turns q and k by RoPE before attention. The
backward gets dq, dk, dv ([R, H * D] each) from attention; the projection's output gradient
is them stacked back, dq and dk turned by RoPE's transpose. Written by XLA, that is a pass
that reads the three and writes the stacked bf16 gradient for the projection's FP8 cast to
read again (the 1b GPT: 3.6 ms of its step on an H100, deviceless estimate).
As a `Prologue` of that cast (`rotary_qkv_gradient`), the cast reads dq, dk, dv itself and
makes the stacked gradient in its registers: the pass and the bf16 copy are gone.

RoPE (`fp8jax.ops.rotary.rope`) turns the pair (x_i, x_{i + D/2}) of a head by the angle
p * f_i at position p. Its transpose, for the gradient g of the turned pair:

    dx_i       = g_{i+D/2} sin + g_i cos
    dx_{i+D/2} = g_{i+D/2} cos + (-g_i) sin

in float32, rounded to the gradient's dtype (JAX's transpose of RoPE writes it in that
dtype). The kernel's program for the tile of one head's q, k or v loads each half of the
head's features from the one source it needs (masked loads of the two others move no
memory), computes cos and sin of position times frequency, and writes each half of the
FP8 tile and of its transpose.

Inputs of the prologue, beside dq (the cast's x): dk and dv (dq's shape), the float32
position of each row [R, 1] (exact up to 2**24), and the frequency of each column
[1, H * D] (f_i at i and at i + D/2 of every head; the kernel reads the first half's).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.activations import Prologue
from pallas_kernels.cast_transpose_tiling import (CastTransposeBlockSizes, Tiling,
                                                  tiling_for)

# q, k and v of a head, in the projection's feature order.
SLOTS = 3
# The head sizes the kernel tiles: a tile is a half head, a power of two from 16 to 128.
HEAD_DIMS = (32, 64, 128, 256)


@functools.lru_cache(maxsize=None)
def rotary_qkv_gradient(head_dim: int, dtype) -> Prologue:
  """The cast prologue that makes the qkv output gradient from (dq, dk, dv, positions,
  frequencies), rounded to `dtype` (the gradients'), for heads of `head_dim` features.

  Returns:
    A `Prologue` with `rotary` set to head_dim (the cast then writes [R, 3 x dq's columns]),
    the same object for the same arguments (a jitted launch takes it as a static argument).
  """
  if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim < 2 or head_dim % 2:
    raise ValueError(f"head_dim={head_dim!r} must be an even int >= 2 (RoPE turns pairs).")
  dtype = jnp.dtype(dtype)
  return Prologue(functools.partial(qkv_gradient, head_dim=head_dim, dtype=dtype), inputs=4,
                  rotary=head_dim, rotary_dtype=dtype.name)


def qkv_gradient(dq, dk, dv, positions, frequencies, *, head_dim: int, dtype) -> jax.Array:
  """The stacked qkv output gradient from float32 dq, dk, dv [R, H * head_dim], positions
  [R, 1] and frequencies [1, H * head_dim]: the definition the kernel matches.

  Returns:
    float32 [R, H * 3 * head_dim] (values of `dtype`).
  """
  rows, columns = dq.shape
  heads, half = columns // head_dim, head_dim // 2
  angle = (positions * frequencies).reshape(rows, heads, 2, half)[:, :, 0]
  cos, sin = jnp.cos(angle), jnp.sin(angle)

  def turned(g):
    g = g.reshape(rows, heads, 2, half)
    first, second = turn_back(g[:, :, 0], g[:, :, 1], cos, sin, dtype)
    return jnp.concatenate([first, second], axis=-1)

  value = positive_zero(dv.reshape(rows, heads, head_dim))
  stacked = jnp.stack([turned(dq), turned(dk), value], axis=2)
  return stacked.reshape(rows, heads * SLOTS * head_dim)


def turn_back(g1, g2, cos, sin, dtype) -> tuple[jax.Array, jax.Array]:
  """RoPE's transpose of one pair of halves (float32), each rounded to `dtype`.

  Returns:
    (dx of the first half, dx of the second), float32 values of `dtype`. A zero is +0:
    autodiff adds each half into a zero-padded gradient, and -0 + 0 is +0.
  """
  first = g2 * sin + g1 * cos
  second = g2 * cos + (-g1) * sin
  rounded = lambda y: positive_zero(y).astype(dtype).astype(jnp.float32)
  return rounded(first), rounded(second)


def positive_zero(y: jax.Array) -> jax.Array:
  """y with -0 as +0, as autodiff's sum into a zero-padded gradient leaves it (a select:
  `y + 0.0` would do it too, but a compiler may fold that away).

  Returns:
    y, its zeros +0.
  """
  return jnp.where(y == 0, jnp.zeros((), y.dtype), y)


def check_shapes(x_shape, others_shapes, head_dim: int) -> None:
  """Raises unless x (dq) and the prologue inputs have the shapes the kernel tiles."""
  rows, columns = x_shape
  if columns % head_dim:
    raise ValueError(f"dq has {columns} columns, not a multiple of head_dim={head_dim}.")
  wanted = [(rows, columns), (rows, columns), (rows, 1), (1, columns)]
  if [tuple(s) for s in others_shapes] != wanted:
    raise ValueError(f"the rotary qkv gradient's inputs (dk, dv, positions, frequencies) must "
                     f"have shapes {wanted}; got {[tuple(s) for s in others_shapes]}.")
  if head_dim not in HEAD_DIMS:
    raise ValueError(f"head_dim={head_dim}: the kernel's tile is one head's half ({head_dim // 2} "
                     "columns), a power of two from 16 to 128 (Triton tiles); use head_dim 32, "
                     "64, 128 or 256.")


def output_shape(x_shape) -> tuple[int, int]:
  """The cast tensor's shape: dq's rows, three times its columns."""
  return x_shape[0], SLOTS * x_shape[1]


def tiling(x_shape, head_dim: int, block_sizes: CastTransposeBlockSizes) -> Tiling:
  """One program per (rows, one head's q, k or v): columns in blocks of head_dim."""
  rows, columns = output_shape(x_shape)
  row_tiling = tiling_for((rows, columns), block_sizes)
  return Tiling(rows=rows, cols=columns, block_rows=row_tiling.block_rows,
                block_cols=head_dim)


def input_specs(tiling: Tiling) -> list[pl.BlockSpec]:
  """dq, dk, dv: the head's block of the program's rows; positions: the rows'; frequencies:
  the head's."""
  rows, head_dim = tiling.block_rows, tiling.block_cols
  head = pl.BlockSpec((rows, head_dim), lambda i, j: (i, j // SLOTS))
  return [head, head, head, pl.BlockSpec((rows, 1), lambda i, j: (i, 0)),
          pl.BlockSpec((1, head_dim), lambda i, j: (0, j // SLOTS))]


def kernel_halves(x_ref, other_refs, row_mask, tiling: Tiling, dtype) -> list:
  """[(first half, its columns), (second half, its columns)] of the program's float32 tile.

  `row_mask`: [block_rows, 1] rows in range, or None. Each half is loaded only from the
  source the program's slot reads (the others' loads are masked off entirely).
  """
  sources = [x_ref, *other_refs[:2]]
  positions_ref, frequencies_ref = other_refs[2:]
  rows, half = tiling.block_rows, tiling.block_cols // 2
  slot = pl.program_id(1) % SLOTS
  halves = (pl.ds(0, half), pl.ds(half, half))

  def load(ref, columns, wanted):
    mask = jnp.broadcast_to(slot == wanted, (rows, half))
    if row_mask is not None:
      mask = mask & jnp.broadcast_to(row_mask, (rows, half))
    return plgpu.load(ref.at[:, columns], mask=mask, other=0).astype(jnp.float32)

  def pick(columns):
    q, k, v = (load(ref, columns, wanted) for wanted, ref in enumerate(sources))
    return jnp.where(slot == 0, q, jnp.where(slot == 1, k, v))

  g1, g2 = pick(halves[0]), pick(halves[1])
  positions = (positions_ref[...] if row_mask is None
               else plgpu.load(positions_ref, mask=row_mask, other=0))
  angle = positions * frequencies_ref.at[:, halves[0]][...]
  first, second = turn_back(g1, g2, jnp.cos(angle), jnp.sin(angle), dtype)
  value = slot == SLOTS - 1  # v is not turned
  return [(jnp.where(value, positive_zero(g1), first), halves[0]),
          (jnp.where(value, positive_zero(g2), second), halves[1])]
