"""What the Hopper attention kernels share: tiles, the problem's static shape, and mask arithmetic.

The kernels (`hopper_attention_forward.py`, `hopper_attention_backward.py`) follow the
FlashAttention-3 structure on Mosaic GPU: per CTA, one producer warpgroup streams tiles by
TMA through a ring of `num_stages` shared-memory slots and two compute warpgroups consume
them with `wgmma`. This module holds the pieces both passes need:

* `HopperAttentionBlockSizes`: every tile size and the pipeline depth (one frozen dataclass,
  a static argument of `jit`).
* `AttentionGeometry`: the static shape (batch, lengths, heads, head_dim) and mask kind.
* The causal arithmetic. Masks are aligned bottom-right (as fp8jax's attention semantics
  say): query row r sees key column c iff c <= r + (kv_len - q_len). For a tile of rows
  and a tile of columns that gives which key blocks a row block needs at all, and which
  of those need no mask.
* `tile_visibility`: the mask of one [rows, cols] tile (causal and/or segment ids).
* The pipeline: `stream_tiles` (the producer's loop over a ring of slots) and
  `release_slot` (a compute warpgroup passing a slot it does not need), with `when`;
  they live in `pallas_kernels.smem_ring` (shared with the grouped GEMMs) and are
  re-exported here.
"""
from __future__ import annotations

import dataclasses
import math

import jax
from jax import lax
import jax.numpy as jnp

from pallas_kernels.smem_ring import release_slot, stream_tiles, when  # noqa: F401 (re-exported)

COMPUTE_WGS = 2   # compute warpgroups per CTA; a third one issues the TMA copies
LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
E4M3 = jnp.dtype(jnp.float8_e4m3fn)
E4M3_MAX = float(jnp.finfo(E4M3).max)
SIXTEEN_BIT = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
HEAD_DIMS = (64, 128)
# P in [0, 1] is stored in E4M3 as P * P_SCALE, as in the Triton-lowered FP8 kernel
# (pallas_kernels.flash_attention): a power of two, so the scaling is exact, and < 448,
# so nothing saturates.
P_SCALE = 256.0
# Rows of q, k or v (per head) that share one descale when the FP8 inputs are block-scaled:
# one CTA's query rows (2 x 64), one 128-key step, as FlashAttention-3 and DeepSeek-V3 tile.
SCALE_BLOCK = 128


@dataclasses.dataclass(frozen=True)
class HopperAttentionBlockSizes:
  """Tiles and pipeline depth of the Hopper attention kernels (hashable: a static argument).

  Every block is per compute warpgroup: a CTA covers two of them. The wgmma M is 64, so a
  warpgroup's rows are 64; its N (keys or queries per step) is 64 or 128.

  Attributes:
    block_q: forward: query rows per compute warpgroup (CTA: 2 * block_q rows).
    block_kv: forward: keys per step (the N of Q K^T, the K of P V).
    block_q_dq, block_kv_dq: dQ kernel: query rows per warpgroup, keys per step.
    block_kv_dkv, block_q_dkv: dK/dV kernel: key rows per warpgroup, queries per step.
    num_stages: depth of each shared-memory ring (>= 2).
    ping_pong: the forward's two compute warpgroups take turns on the tensor cores (one's
      softmax under the other's wgmma, FlashAttention-3); False lets both issue freely
      (a tuning variant, `benchmarks.attention --tune`).
    overlap: the forward issues key block j's Q K^T and block j-1's P V together and runs
      block j's softmax under P V (FlashAttention-3's intra-warpgroup overlap); its K
      and V slots are held a step longer, so it wants num_stages >= 3 to keep the loads
      ahead. Off by default until a GPU has timed it (a tuning variant).
  """

  block_q: int = 64
  block_kv: int = 128
  block_q_dq: int = 64
  block_kv_dq: int = 64
  block_kv_dkv: int = 64
  block_q_dkv: int = 64
  num_stages: int = 2
  ping_pong: bool = True
  overlap: bool = False

  def __post_init__(self):
    for name in ("block_q", "block_q_dq", "block_kv_dkv"):
      if getattr(self, name) != 64:
        raise ValueError(f"HopperAttentionBlockSizes.{name}={getattr(self, name)} must be 64: "
                         "one warpgroup's rows are one wgmma M (64).")
    for name in ("block_kv", "block_kv_dq", "block_q_dkv"):
      if getattr(self, name) not in (64, 128):
        raise ValueError(f"HopperAttentionBlockSizes.{name}={getattr(self, name)} must be 64 "
                         "or 128 (a wgmma N, and a K whose FP8 rows fill a 64- or 128-byte "
                         "swizzle).")
    if not isinstance(self.num_stages, int) or self.num_stages < 2:
      raise ValueError(f"HopperAttentionBlockSizes.num_stages={self.num_stages!r} must be an "
                       "int >= 2, so that the TMA copies overlap compute.")
    for name in ("ping_pong", "overlap"):
      if not isinstance(getattr(self, name), bool):
        raise ValueError(f"HopperAttentionBlockSizes.{name}={getattr(self, name)!r} must be a "
                         "bool.")

  @property
  def seq_multiple(self) -> int:
    """Both sequence lengths must be multiples of this (every kernel's row and step tiles)."""
    return math.lcm(COMPUTE_WGS * self.block_q, self.block_kv, COMPUTE_WGS * self.block_q_dq,
                    self.block_kv_dq, COMPUTE_WGS * self.block_kv_dkv, self.block_q_dkv)


@dataclasses.dataclass(frozen=True)
class AttentionGeometry:
  """The static shape of one attention call and its mask kind.

  Attributes:
    batch, q_len, kv_len, heads, kv_heads, head_dim: q is [batch, q_len, heads,
      head_dim]; k and v are [batch, kv_len, kv_heads, head_dim].
    causal: bottom-right aligned causal mask.
    segmented: segment ids are given (a query sees only keys of its own id).
    block_scaled: FP8 inputs carry one descale per `SCALE_BLOCK` rows of each head
      (else one per tensor).
  """

  batch: int
  q_len: int
  kv_len: int
  heads: int
  kv_heads: int
  head_dim: int
  causal: bool
  segmented: bool
  block_scaled: bool = False

  @property
  def group(self) -> int:
    """Query heads per key/value head (grouped-query attention)."""
    return self.heads // self.kv_heads

  @property
  def causal_offset(self) -> int:
    """kv_len - q_len: row r sees columns c <= r + causal_offset."""
    return self.kv_len - self.q_len


def geometry(q, k, *, causal: bool, segmented: bool,
             block_scaled: bool = False) -> AttentionGeometry:
  """The `AttentionGeometry` of q [batch, q_len, heads, d] and k [batch, kv_len, kv_heads, d]."""
  batch, q_len, heads, head_dim = q.shape
  return AttentionGeometry(batch=batch, q_len=q_len, kv_len=k.shape[1], heads=heads,
                           kv_heads=k.shape[2], head_dim=head_dim, causal=bool(causal),
                           segmented=bool(segmented), block_scaled=bool(block_scaled))


def scale_block(row) -> jax.Array:
  """The index of the `SCALE_BLOCK`-row block that holds row `row` (an int32 scalar)."""
  return lax.div(row, jnp.int32(SCALE_BLOCK))


def check_shapes(geo: AttentionGeometry, blocks: HopperAttentionBlockSizes) -> None:
  """Raises ValueError, naming the fix, for a shape these kernels do not run."""
  if geo.head_dim not in HEAD_DIMS:
    raise ValueError(f"head_dim={geo.head_dim} is not supported by the Hopper attention "
                     f"kernels; use one of {HEAD_DIMS} (or another backend).")
  if geo.heads % geo.kv_heads:
    raise ValueError(f"q's {geo.heads} heads must be a multiple of k's {geo.kv_heads} heads.")
  multiple = blocks.seq_multiple
  for name, length in (("q", geo.q_len), ("kv", geo.kv_len)):
    if length % multiple or length == 0:
      raise ValueError(f"{name} sequence length {length} must be a positive multiple of "
                       f"{multiple} for these tiles; pad it (masking the padding with "
                       "segment ids) or use another backend.")


def _cdiv_nonnegative(x, d: int):
  """ceil(x / d) for int32 x, with negative x counted as 0."""
  return lax.div(jnp.maximum(x, 0) + (d - 1), jnp.int32(d))


def _floor_nonnegative(x, d: int):
  """floor(x / d) for int32 x, with negative x counted as 0."""
  return lax.div(jnp.maximum(x, 0), jnp.int32(d))


def key_steps(geo: AttentionGeometry, first_row, num_rows: int, block_kv: int):
  """(steps, unmasked_steps): the key blocks that query rows [first_row, first_row + num_rows) use.

  Row r sees columns c <= r + offset (causal). Key block j (columns [j*block_kv,
  (j+1)*block_kv)) is needed when its first column is visible to the last row:
  j*block_kv <= last_row + offset, so `steps = ceil((last_row + offset + 1) / block_kv)`,
  at most all blocks. It needs no causal mask when its last column is visible to the
  first row: (j+1)*block_kv - 1 <= first_row + offset, so the first
  `floor((first_row + offset + 1) / block_kv)` blocks are unmasked. Without causality
  every block is needed; segment ids mask every block.

  Returns:
    0 <= unmasked_steps <= steps <= kv_len / block_kv: Python ints without causality
    (static loop bounds), int32 scalars with it.
  """
  total = geo.kv_len // block_kv
  if not geo.causal:
    return total, 0 if geo.segmented else total
  offset = geo.causal_offset
  steps = jnp.minimum(_cdiv_nonnegative(first_row + num_rows + offset, block_kv), total)
  unmasked = jnp.minimum(_floor_nonnegative(first_row + offset + 1, block_kv), steps)
  return steps, (jnp.int32(0) if geo.segmented else unmasked)


def query_steps(geo: AttentionGeometry, first_key, num_keys: int, block_q: int):
  """(first_step, first_unmasked): the query blocks that key rows [first_key, first_key + num_keys) get gradients from.

  Row r sees column c iff r >= c - offset (causal). Query block i (rows [i*block_q,
  (i+1)*block_q)) matters when its last row sees the first key: (i+1)*block_q - 1 >=
  first_key - offset, i.e. i >= floor((first_key - offset) / block_q). It needs no causal
  mask when its first row sees the last key: i*block_q >= first_key + num_keys - 1 -
  offset, i.e. i >= ceil((first_key + num_keys - 1 - offset) / block_q). Every block up
  to the last is used (the last query row sees every key).

  Returns:
    0 <= first_step <= first_unmasked <= q_len / block_q: without causality the Python
    ints 0 and 0 (or 0 and q_len / block_q when segment ids mask every block), int32
    scalars with it.
  """
  total = geo.q_len // block_q
  if not geo.causal:
    return 0, total if geo.segmented else 0
  offset = geo.causal_offset
  first = jnp.minimum(_floor_nonnegative(first_key - offset, block_q), total)
  unmasked = jnp.minimum(_cdiv_nonnegative(first_key + num_keys - 1 - offset, block_q), total)
  unmasked = jnp.maximum(unmasked, first)
  return first, (jnp.int32(total) if geo.segmented else unmasked)


def tile_visibility(geo: AttentionGeometry, target, shape, *, first_row, first_col,
                    rows_are_queries: bool, row_ids=None, col_ids=None):
  """bool [rows, cols]: which (query, key) pairs of one tile are visible.

  Args:
    geo: the geometry (causal offset, whether segment ids apply).
    target: the `MosaicTarget` (layouts of the iotas).
    shape: (rows, cols) of the tile, a wgmma result.
    first_row, first_col: the tile's first row and column in the full problem.
    rows_are_queries: True for a [queries, keys] tile (forward, dQ), False for a
      [keys, queries] one (dK/dV).
    row_ids, col_ids: the segment ids of the tile's rows and columns, in the layouts
      `target.row_vector` / `target.col_vector` give (when `geo.segmented`).
  """
  visible = None
  if geo.causal:
    rows = target.iota(shape, 0) + first_row
    cols = target.iota(shape, 1) + first_col
    query, key = (rows, cols) if rows_are_queries else (cols, rows)
    visible = key <= query + geo.causal_offset
  if geo.segmented:
    same = (lax.broadcast_in_dim(row_ids, shape, [0])
            == lax.broadcast_in_dim(col_ids, shape, [1]))
    visible = same if visible is None else visible & same
  return visible


def masked_softmax_max(visible_max, previous_max):
  """The running row max, and the value to subtract from logits, for a masked tile.

  With every key of a row masked so far the max is -inf; subtracting 0 instead keeps
  exp2(-inf - max) = 0 instead of exp2(-inf + inf) = NaN. Per row, not per element.
  """
  new_max = jnp.maximum(previous_max, visible_max)
  return new_max, jnp.where(new_max == -jnp.inf, 0.0, new_max)


def safe_lse(lse2: jax.Array) -> jax.Array:
  """The base-2 lse a backward kernel subtracts: +inf for a row that saw no key.

  exp2(s - lse) is then 0 for every key of that row (s is finite or -inf), so the row
  passes no gradient, as the semantics say, instead of exp2(-inf + inf) = NaN.
  """
  return jnp.where(lse2 == -jnp.inf, jnp.inf, lse2)
