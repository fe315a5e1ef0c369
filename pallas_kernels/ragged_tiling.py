"""What the grouped (ragged) FP8 GEMM kernels share: tiles, work schedules, the CTA's loops.

The kernels (`ragged_matmul.py`: forward and dgrad; `transposed_ragged_matmul.py`: wgrad)
are persistent Mosaic GPU kernels for Hopper with the warp-specialized shape of
`pallas_kernels.smem_ring`: per CTA one producer warpgroup streams 128-wide FP8 tiles by
TMA, two compute warpgroups (64 output rows each) run E4M3 `wgmma` with both operands
K-major. This module holds:

* `RaggedMatmulBlockSizes`, `TransposedRaggedMatmulBlockSizes`: tiles and ring depth.
* The work schedules, computed in plain jnp from `group_sizes` before the kernel runs:
  `row_tile_schedule` (the (group, row tile) pairs of the forward/dgrad form, with a zero
  "tail" group for the rows past sum(group_sizes)) and `token_block_schedule` (each
  group's 128-token blocks for the wgrad form).
* The persistent CTA (`persistent_ring`: the compute and producer warpgroups' loops
  over work items, with the ring position carried across items), its shared memory
  (`ring_scratch`) and launch (`launch`).
* The compute warpgroups' loops over a work item's ring steps: `accumulate_steps`
  (per-tensor / per-row scales, applied after the loop) and `promote_steps` (128-block
  scales, DeepSeek-V3 / DeepGEMM promotion of each 128-deep product into an f32 sum).
* `store_rows` (the TMA store ladder for a dynamic number of rows), `mask_f8_columns`
  (zeroing FP8 shared-memory columns with a bitwise AND: Mosaic GPU has no arithmetic on
  8-bit registers).
* Argument checks shared by the kernels and their jnp references.

Scale modes (`scale_mode`): "tensor" (scalars, or one per group), "rowwise" (one per row
of each operand's non-contracted axis) and "block" (one per 128 of the contraction: 1x128
for the token operand, 128x128 blocks for weights), as DeepSeek-V3 trains.
"""
from __future__ import annotations

import dataclasses
import math
import types
from typing import Any, Callable, NamedTuple

import jax
from jax import lax
import jax.numpy as jnp

from pallas_kernels import varying
from pallas_kernels.mosaic_target import (MosaicTarget, interpret_params, pl, plgpu,
                                          swizzle_transforms)
from pallas_kernels.smem_ring import drain_ring, stream_steps, when

E4M3 = jnp.dtype(jnp.float8_e4m3fn)
SCALE_MODES = ("tensor", "rowwise", "block")
OUT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))
COMPUTE_WGS = 2        # compute warpgroups per CTA; a third one issues the TMA copies
WG_ROWS = 64           # output rows per compute warpgroup: the wgmma M
STEP = 128             # contraction per ring step: 128 FP8 bytes per row (swizzle 128),
                       # and the scale block of "block" mode
COMPUTE_REGISTERS, PRODUCER_REGISTERS = 232, 40   # 2 x 128 x 232 + 128 x 40 <= 65536
HOPPER_SMEM_BYTES = 227 * 1024                    # opt-in maximum per thread block, sm_90
H100_SXM_SMS = 132


def _check_block_sizes(cls_name: str, block_m, block_n, num_stages) -> None:
  if block_m != COMPUTE_WGS * WG_ROWS:
    raise ValueError(f"{cls_name}.block_m={block_m!r} must be {COMPUTE_WGS * WG_ROWS}: two "
                     f"compute warpgroups of {WG_ROWS} rows (the wgmma M).")
  if block_n not in (64, 128, 256):
    raise ValueError(f"{cls_name}.block_n={block_n!r} must be 64, 128 or 256 (a wgmma N; "
                     "128 or less with scale_mode='block').")
  if not isinstance(num_stages, int) or num_stages < 2:
    raise ValueError(f"{cls_name}.num_stages={num_stages!r} must be an int >= 2, so that "
                     "the TMA copies overlap the products.")


@dataclasses.dataclass(frozen=True)
class RaggedMatmulBlockSizes:
  """Tiles of `ragged_matmul` (hashable: a static argument of `jit`).

  The contraction step is fixed to 128 (one scale block, 128 FP8 bytes per row).

  Attributes:
    block_m: output rows per work item: 128, two compute warpgroups of 64.
    block_n: output columns per work item: 64, 128 or 256 (at most 128 for
      scale_mode="block", where the partial and the promoted f32 accumulators share a
      warpgroup's registers, and one 128x128 weight block must cover the tile).
    num_stages: depth of the shared-memory ring of (A, B^T) tiles (>= 2).
  """
  block_m: int = 128
  block_n: int = 128
  num_stages: int = 4

  def __post_init__(self):
    _check_block_sizes(type(self).__name__, self.block_m, self.block_n, self.num_stages)


@dataclasses.dataclass(frozen=True)
class TransposedRaggedMatmulBlockSizes:
  """Tiles of `transposed_ragged_matmul` (hashable): one [block_m, block_n] tile of a group's
  [Ka, Nb] output per work item, 128 tokens per step.

  Attributes:
    block_m: rows of Ka per work item: 128, two compute warpgroups of 64.
    block_n: columns of Nb per work item: 64, 128 or 256 (at most 128 with "block").
    num_stages: depth of the shared-memory ring (>= 2).
  """
  block_m: int = 128
  block_n: int = 128
  num_stages: int = 4

  def __post_init__(self):
    _check_block_sizes(type(self).__name__, self.block_m, self.block_n, self.num_stages)


def cdiv(x, d: int):
  """ceil(x / d) for non-negative ints or int32 arrays."""
  return -(-x // d)


# ----- work schedules (plain jnp, before the kernel) ------------------------------------


class RowTileSchedule(NamedTuple):
  """The forward/dgrad kernels' work items: (group, row tile) pairs, tail included.

  Segment g < G holds the rows [offsets[g], offsets[g + 1]) of group g; segment G (the
  "tail") the rows [sum(group_sizes), M), whose output is zero. Every non-empty segment
  has one item per row tile it touches, in row order, so a tile split by a group
  boundary is visited once per group and each visit writes only its own rows.

  Attributes:
    offsets: int32 [G + 2], non-decreasing, offsets[0] = 0, offsets[G + 1] = M.
    group: int32 [T] the item's segment (G for the tail), -1 for t >= num_items.
    m_tile: int32 [T] the item's row tile (rows [m_tile * block_m, +block_m)), 0 past
      num_items. T = max_row_items(M, G, block_m).
    num_items: int32 [1] the number of items.
  """
  offsets: jax.Array
  group: jax.Array
  m_tile: jax.Array
  num_items: jax.Array


def max_row_items(m: int, groups: int, block_m: int) -> int:
  """Most (segment, row tile) items of M rows in G groups: each of the G boundaries
  between the G + 1 segments adds at most one tile visit."""
  return cdiv(m, block_m) + groups


def group_offsets(group_sizes: jax.Array, m: int) -> jax.Array:
  """int32 [G + 1]: group g's rows are [offsets[g], offsets[g + 1]).

  Defined for any int32 input: negative sizes count as 0 and offsets are clipped to M,
  so no kernel reads or writes past the arrays whatever group_sizes holds (valid input:
  sizes >= 0 with sum <= M, as jax.lax.ragged_dot requires).
  """
  ends = jnp.minimum(jnp.cumsum(jnp.maximum(group_sizes.astype(jnp.int32), 0)), m)
  return jnp.concatenate([jnp.zeros((1,), jnp.int32), ends.astype(jnp.int32)])


def row_tile_schedule(group_sizes: jax.Array, m: int, block_m: int) -> RowTileSchedule:
  """The (group, row tile) work items of M rows sorted by group (see `RowTileSchedule`)."""
  g = group_sizes.shape[0]
  offsets = jnp.concatenate([group_offsets(group_sizes, m), jnp.full((1,), m, jnp.int32)])
  starts, stops = offsets[:-1], offsets[1:]
  tiles = jnp.where(stops > starts, cdiv(stops, block_m) - starts // block_m, 0)
  last = jnp.cumsum(tiles)  # items up to and including each segment
  t = jnp.arange(max_row_items(m, g, block_m), dtype=jnp.int32)
  # The segment of item t: the first whose cumulative count exceeds t.
  seg = jnp.minimum(jnp.searchsorted(last, t, side="right"), g).astype(jnp.int32)
  m_tile = starts[seg] // block_m + t - (last[seg] - tiles[seg])
  valid = t < last[-1]
  return RowTileSchedule(offsets=offsets, group=jnp.where(valid, seg, -1),
                         m_tile=jnp.where(valid, m_tile, 0).astype(jnp.int32),
                         num_items=last[-1:].astype(jnp.int32))


class TokenBlockSchedule(NamedTuple):
  """The wgrad kernel's steps per group: the 128-token blocks its tokens touch.

  Attributes:
    offsets: int32 [G + 1]: group g's tokens are [offsets[g], offsets[g + 1]).
    first_block: int32 [G]: the group's first block (tokens [128 * b, 128 * b + 128)).
    num_blocks: int32 [G]: how many blocks (0 for an empty group).
  """
  offsets: jax.Array
  first_block: jax.Array
  num_blocks: jax.Array


def token_block_schedule(group_sizes: jax.Array, m: int, block: int = STEP
                         ) -> TokenBlockSchedule:
  """Each group's token blocks (see `TokenBlockSchedule`); M tokens sorted by group."""
  offsets = group_offsets(group_sizes, m)
  starts, stops = offsets[:-1], offsets[1:]
  first = starts // block
  return TokenBlockSchedule(offsets=offsets, first_block=first,
                            num_blocks=jnp.where(stops > starts, cdiv(stops, block) - first, 0))


# ----- inside the kernels ----------------------------------------------------------------


def ring_scratch(*, stages: int, block_m: int, block_n: int, out_dtype, scale_mode: str,
                 swizzled_out: bool, block_descales: dict[str, int]) -> dict:
  """Shared memory and barriers of one CTA of a grouped GEMM (names as the kernels use them).

  a, b:         the ring: FP8 tiles [stages, block_m, 128] and [stages, block_n, 128]
                (swizzle 128, what wgmma reads), with a_ready / b_ready per slot and one
                `free` barrier per slot that both compute warpgroups arrive on.
  out:          each compute warpgroup's output staging tile [64, block_n]; untiled
                unless `swizzled_out` (the store ladder's boxes start at any row).
  "block":      per name in `block_descales` (name -> length), a ring of descale
                vectors [stages, length] with <name>_ready.
  "rowwise":    row [2, 64] and col [2, block_n], each warpgroup's epilogue descales,
                with row_ready / col_ready.
  """
  def f8_tile(rows):
    return plgpu.SMEM((stages, rows, STEP), E4M3, transforms=swizzle_transforms(STEP, E4M3))
  out_transforms = swizzle_transforms(block_n, out_dtype) if swizzled_out else ()
  scratch = dict(
      a=f8_tile(block_m), b=f8_tile(block_n),
      out=plgpu.SMEM((COMPUTE_WGS, WG_ROWS, block_n), out_dtype, transforms=out_transforms),
      a_ready=plgpu.Barrier(num_barriers=stages), b_ready=plgpu.Barrier(num_barriers=stages),
      free=plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=stages))
  if scale_mode == "block":
    for name, length in block_descales.items():
      scratch[name] = plgpu.SMEM((stages, length), jnp.float32)
      scratch[f"{name}_ready"] = plgpu.Barrier(num_barriers=stages)
  if scale_mode == "rowwise":
    scratch.update(row=plgpu.SMEM((COMPUTE_WGS, WG_ROWS), jnp.float32),
                   col=plgpu.SMEM((COMPUTE_WGS, block_n), jnp.float32),
                   row_ready=plgpu.Barrier(num_barriers=COMPUTE_WGS),
                   col_ready=plgpu.Barrier(num_barriers=COMPUTE_WGS))
  return scratch


def smem_bytes(scratch: dict) -> int:
  """Shared memory that `ring_scratch` allocates (8 bytes per barrier)."""
  total = 0
  for x in scratch.values():
    if isinstance(x, plgpu.Barrier):
      total += 8 * math.prod(x.num_barriers)
    else:
      total += math.prod(x.shape) * jnp.dtype(x.dtype).itemsize
  return total


def launch(cta: Callable, inputs: dict[str, jax.Array], scratch: dict, out_type,
           num_ctas: int, interpret: Any, name: str) -> jax.Array:
  """Runs `cta(refs, scratch, target)` on a persistent grid of `num_ctas` CTAs ("sm").

  refs holds the GMEM inputs by their names in `inputs`, then `out`; each CTA has two
  compute warpgroups and one producer ("wg"). `name` (the kernel's public name) becomes a
  named scope, so the kernel's custom call in the optimized HLO carries it in its op_name:
  a compiled program's reader (fp8jax's cost model, a profile) knows it is this grouped
  GEMM, which XLA cannot tell from an opaque Mosaic GPU call.
  """
  params = interpret_params(interpret)
  target = MosaicTarget(interpret=params is not None)
  names = tuple(inputs) + ("out",)

  def entry(*refs):
    named = types.SimpleNamespace(**dict(zip(names, refs)))
    pl.run_scoped(lambda **allocated: cta(named, types.SimpleNamespace(**allocated), target),
                  collective_axes="wg", **scratch)

  # Lane semantics, named: the kernels are written (and their PTX proved) in it, and
  # JAX 0.11 made Warpgroup semantics the default, which rejects their implicit
  # broadcasts (first seen on an H200 with jax 0.11.2).
  lane = plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane)
  with jax.named_scope(name):
    return plgpu.kernel(entry, out_type=out_type, grid=(num_ctas,), grid_names=("sm",),
                        num_threads=COMPUTE_WGS + 1, thread_name="wg",
                        compiler_params=lane, interpret=params)(*inputs.values())


def persistent_ring(s, work, stages: int, *, consume: Callable, produce: Callable) -> None:
  """The CTA's loops over its share of the work items (round-robin over the grid).

  Every warpgroup walks the same items and counts the ring steps they take, so step t of
  the CTA is slot t % stages for the producer and the consumers alike, across items.

  Args:
    s: the CTA's `ring_scratch`.
    work: the grid of work items (static ints or int32), as `plgpu.nd_loop` takes it.
    stages: slots in the ring.
    consume: consume(index, first_step) -> the item's steps: a compute warpgroup's work
      on one item (its steps are ring steps first_step, first_step + 1, ...).
    produce: produce(index) -> (steps, issue): the item's steps and issue(step, slot),
      which starts the TMA copies of the item's step into a slot.
  """
  wg = lax.axis_index("wg")

  def free(slot):
    return [s.free.at[slot]]

  @pl.when(wg < COMPUTE_WGS)
  def _compute():
    plgpu.set_max_registers(COMPUTE_REGISTERS, action="increase")

    @plgpu.nd_loop(work, collective_axes="sm", init_carry=jnp.int32(0))
    def _(info, carry):
      return carry + consume(info.index, carry)
    plgpu.wait_smem_to_gmem(0)  # the last item's output stores

  @pl.when(wg == COMPUTE_WGS)
  def _produce():
    plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")

    @plgpu.nd_loop(work, collective_axes="sm", init_carry=jnp.int32(0))
    def total_steps(info, carry):
      steps, issue = produce(info.index)
      stream_steps(carry, steps, stages, issue, free)
      return carry + steps

    drain_ring(total_steps, stages, free)


def wait_ready(s, slot, kinds) -> None:
  """Waits until the slot's tiles of each kind ("a", "b", descales) have landed."""
  for kind in kinds:
    plgpu.barrier_wait(getattr(s, f"{kind}_ready").at[slot])


def release(s, slot) -> None:
  """A compute warpgroup is done with the slot (the producer refills it once both are)."""
  plgpu.barrier_arrive(s.free.at[slot])


def copy_rowwise_descales(s, wg, row_src, col_src) -> None:
  """Starts the copies of a warpgroup's epilogue descales (its rows', the tile's columns')."""
  plgpu.copy_gmem_to_smem(row_src, s.row.at[wg], s.row_ready.at[wg])
  plgpu.copy_gmem_to_smem(col_src, s.col.at[wg], s.col_ready.at[wg])


def apply_rowwise_descales(target: MosaicTarget, s, wg, acc: jax.Array) -> jax.Array:
  """acc [64, n] * row descale [64, 1] * column descale [1, n], once their copies landed."""
  plgpu.barrier_wait(s.row_ready.at[wg])
  plgpu.barrier_wait(s.col_ready.at[wg])
  return (acc * lax.broadcast_in_dim(target.row_vector(s.row.at[wg]), acc.shape, [0])
          * lax.broadcast_in_dim(target.col_vector(s.col.at[wg]), acc.shape, [1]))


def zeros_tile(target: MosaicTarget, shape) -> jax.Array:
  """float32 zeros in the wgmma result layout."""
  return target.layout(jnp.zeros(shape, jnp.float32), plgpu.Layout.WGMMA)


def accumulate_steps(target: MosaicTarget, num_steps, shape, operands: Callable,
                     release: Callable) -> jax.Array:
  """float32 [m, n]: sum over a work item's steps s of A_s @ B_s, in one f32 accumulator.

  Args:
    target: compiled or interpreted.
    num_steps: steps (a Python int or int32; 0 gives zeros).
    shape: (m, n) of the product.
    operands: operands(s) -> (a [m, 128] SMEM, b_t [n, 128] SMEM, slot): waits for step
      s's tiles (and prepares them); B is given transposed (K-major, as FP8 wgmma reads).
    release: release(slot) arrives on the slot's free barrier(s).

  Compiled, the wgmmas are chained into one accumulator and each slot is released once
  the next step's wgmma is issued and the previous one has completed, so the tensor
  cores never wait for a release.
  """
  if target.interpret:
    def step(s, acc):
      a, b_t, slot = operands(s)
      acc = target.mma(acc, a, b_t, transpose_b=True)
      release(slot)
      return acc
    return lax.fori_loop(0, num_steps, step, jnp.zeros(shape, jnp.float32))

  def scope(acc_ref):
    def step(s, previous_slot):
      a, b_t, slot = operands(s)
      plgpu.wgmma(acc_ref, a, plgpu.transpose_ref(b_t, (1, 0)))
      plgpu.wgmma_wait(1)  # step s - 1's product is done: its slot may be refilled
      when(s > 0, lambda: release(previous_slot))
      return slot
    last_slot = lax.fori_loop(0, num_steps, step, jnp.int32(0))
    plgpu.wgmma_wait(0)
    when(num_steps > 0, lambda: release(last_slot))
    return acc_ref[...]
  return pl.run_scoped(scope, plgpu.ACC(shape, jnp.float32))


def promote_steps(target: MosaicTarget, num_steps, shape, operands: Callable,
                  descale: Callable, release: Callable) -> jax.Array:
  """float32 [m, n]: sum over steps s of descale_s * (A_s @ B_s), each product promoted.

  Each step's 128-deep FP8 product runs into a fresh wgmma accumulator, then is scaled
  and added into a separate f32 sum (DeepSeek-V3 / DeepGEMM): the tensor cores' reduced-
  precision accumulation never spans more than one scale block. The slot is released
  before the promotion, so the producer refills it during the multiply-adds.

  Args:
    target, num_steps, shape, operands, release: as `accumulate_steps`.
    descale: descale(s, slot) -> float32 [m, n] (broadcast) descales of step s, read
      from the slot before it is released.
  """
  def step(s, promoted):
    a, b_t, slot = operands(s)
    partial = target.mma(None, a, b_t, transpose_b=True, shape=shape)
    scale = descale(s, slot)
    release(slot)
    return promoted + partial * scale

  if isinstance(num_steps, int) and num_steps > 0:  # the first step starts the sum
    a, b_t, slot = operands(0)
    partial = target.mma(None, a, b_t, transpose_b=True, shape=shape)
    scale = descale(0, slot)
    release(slot)
    return lax.fori_loop(1, num_steps, step, partial * scale)
  return lax.fori_loop(0, num_steps, step, zeros_tile(target, shape))


def store_rows(src, dst_rows: Callable, first, count, max_rows: int) -> None:
  """TMA-stores rows [first, first + count) of the SMEM tile `src`, for a dynamic count.

  A TMA box has a static shape, so the rows go out as a ladder of power-of-two boxes:
  the binary digits of `count` (<= max_rows), largest first.

  Args:
    src: SMEM ref [rows, cols], untiled (a box may start at any row).
    dst_rows: dst_rows(row, size) -> the GMEM ref that receives tile rows [row, row + size).
    first, count: int32 scalars.
    max_rows: static bound on count.
  """
  size = 1 << (max_rows.bit_length() - 1)
  row = first
  while size >= 1:
    def store(row=row, size=size):
      plgpu.copy_smem_to_gmem(src.at[pl.ds(row, size)], dst_rows(row, size))
    pl.when((count & size) != 0)(store)
    row = row + (count & size)
    size //= 2


def _load(ref, layout):
  try:  # jax 0.11 takes the ref alone and deprecates the separate index.
    return plgpu.load(ref, layout=layout)
  except TypeError:  # jax 0.10.2: the index is a required argument.
    return plgpu.load(ref, (), layout=layout)


def mask_f8_columns(target: MosaicTarget, tile, lo, hi) -> None:
  """Zeros the columns outside [lo, hi) of an FP8 SMEM tile [rows, cols], in place.

  Mosaic GPU has no arithmetic on 8-bit registers, so the tile is loaded in the 8-bit
  wgmma layout, bitcast to int8 and ANDed with 0 / -1. `commit_smem` then makes the
  writes visible to the wgmma that reads the tile.
  """
  shape = tile.shape
  if target.interpret:
    x = tile[...]
    cols = lax.broadcasted_iota(jnp.int32, shape, 1)
  else:
    layout = plgpu.Layout.WGMMA_8BIT
    x = _load(tile, layout)
    cols = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=layout)
  keep = jnp.where((cols >= lo) & (cols < hi), jnp.int32(-1), jnp.int32(0)).astype(jnp.int8)
  tile[...] = lax.bitcast_convert_type(lax.bitcast_convert_type(x, jnp.int8) & keep, x.dtype)
  plgpu.commit_smem()


# ----- checks -----------------------------------------------------------------------------


def check_common(scale_mode, out_dtype, block_sizes, block_sizes_type, fn: str) -> None:
  """scale_mode, out_dtype and block_sizes, with the fix in each message."""
  if scale_mode not in SCALE_MODES:
    raise ValueError(f"{fn}: scale_mode={scale_mode!r} must be one of {SCALE_MODES}.")
  if jnp.dtype(out_dtype) not in OUT_DTYPES:
    raise ValueError(f"{fn}: out_dtype must be bfloat16 or float32; got "
                     f"{jnp.dtype(out_dtype).name}.")
  if not isinstance(block_sizes, block_sizes_type):
    raise TypeError(f"{fn}: block_sizes must be a {block_sizes_type.__name__}; got "
                    f"{type(block_sizes).__name__}.")
  if scale_mode == "block" and block_sizes.block_n > STEP:
    raise ValueError(f"{fn}: block_sizes.block_n={block_sizes.block_n} must be 64 or 128 with "
                     "scale_mode='block' (two f32 accumulators per warpgroup; one 128-wide "
                     "scale block per tile).")


def check_fp8(fn: str, name: str, x, ndim: int, layout: str) -> None:
  if x.ndim != ndim:
    raise ValueError(f"{fn}: {name} must be {ndim}-D {layout}; got shape {tuple(x.shape)}.")
  if x.dtype != E4M3:
    raise ValueError(f"{fn}: {name} must be float8_e4m3fn (both operands of an FP8 wgmma "
                     f"have one type: quantize it to E4M3 first); got {x.dtype}.")


def check_group_sizes(fn: str, group_sizes, groups: int | None, what: str) -> None:
  """group_sizes is int32 [G]; `groups` is G where another argument fixes it."""
  if group_sizes.ndim != 1 or (groups is not None and group_sizes.shape[0] != groups):
    want = "[G]" if groups is None else f"[G] with G = {groups}"
    raise ValueError(f"{fn}: group_sizes must be int32 {want} ({what}); got shape "
                     f"{tuple(group_sizes.shape)}.")
  if group_sizes.dtype != jnp.int32:
    raise ValueError(f"{fn}: group_sizes must be int32 (the rows of each group, in order); "
                     f"got {group_sizes.dtype}. Pass group_sizes.astype(jnp.int32).")


def check_descale(fn: str, name: str, x, want: tuple, scale_mode: str, meaning: str) -> None:
  if tuple(x.shape) != want:
    raise ValueError(f"{fn}: with scale_mode={scale_mode!r}, {name} must be float32 "
                     f"{list(want)} ({meaning}); got shape {tuple(x.shape)}.")
  if x.dtype != jnp.float32:
    raise ValueError(f"{fn}: {name} must be float32; got {x.dtype}.")


def check_multiple(fn: str, name: str, value: int, multiple: int, fix: str) -> None:
  if value % multiple or value == 0:
    raise ValueError(f"{fn}: {name}={value} must be a positive multiple of {multiple}; {fix}")


def check_smem(fn: str, smem_bytes: int, block_sizes) -> None:
  if smem_bytes > HOPPER_SMEM_BYTES:
    raise ValueError(f"{fn}: {block_sizes} needs {smem_bytes} bytes of shared memory, more "
                     f"than a Hopper block's {HOPPER_SMEM_BYTES}; lower num_stages or block_n.")


def resolve_num_sms(num_sms, interpret) -> int:
  """The persistent grid size: the argument; else, compiled, the GPU's SM count or (no GPU
  attached: a deviceless compile) an H100 SXM's 132; else, interpreted, 4 (the
  interpreter runs CTAs one after another, compiling each, so fewer is faster)."""
  if num_sms is not None:
    if not isinstance(num_sms, int) or num_sms < 1:
      raise ValueError(f"num_sms={num_sms!r} must be a positive int (the GPU's SM count).")
    return num_sms
  if interpret:
    return 4
  try:
    count = getattr(jax.devices("gpu")[0], "core_count", None)
  except RuntimeError:  # no GPU backend: a deviceless compile
    count = None
  return int(count) if count else H100_SXM_SMS


def zeros_varying(shape, axes) -> jax.Array:
  """float32 zeros typed as varying along `axes` (inside shard_map; plain elsewhere): the
  jnp references' accumulators, which differ per device as their inputs do."""
  return varying.vary(jnp.zeros(shape, jnp.float32), axes)
