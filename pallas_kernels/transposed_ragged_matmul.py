"""Transposed grouped FP8 GEMM for Hopper (the wgrad form), on the Mosaic GPU Pallas backend.

  out[g, i, j] = descales * sum over tokens r of group g of a_t[i, r] * b_t[j, r]

Tokens are sorted by group (group g owns the next group_sizes[g] tokens); an empty
group's output is zero, tokens past sum(group_sizes) belong to no group. For the weight
gradient of y = ragged_dot(x, w): a_t = x^T [K, M], b_t = dy^T [N, M] (both E4M3, tokens
contiguous: the K-major layout FP8 wgmma reads), out[g] = x_g^T dy_g [K, N].

Descales (x = x8 * descale), by `scale_mode`:
  "tensor":  a_descale f32[], b_descale f32[]          (epilogue: acc * a_d * b_d)
  "rowwise": a_descale f32[Ka], b_descale f32[Nb]      (epilogue: acc * a_d[i] * b_d[j])
  "block":   a_descale f32[Ka, ceil(M/128)], b_descale f32[Nb, ceil(M/128)]: one per
             128-token block, promoted per block: sum_t a_d[i, t] b_d[j, t] (sum over
             block t's tokens of the group). A block shared by two groups has one scale
             for both; masking decides which tokens count.

Kernel. A persistent grid walks the work items (group, Ka tile, Nb tile), group-major so
that CTAs running together read the same tokens. An item's steps are its group's
128-token blocks (`ragged_tiling.token_block_schedule`; none for an empty group, which
stores zeros). The producer warpgroup streams a_t [128, 128 tokens] and b_t [block_n,
128 tokens] tiles (and in "block" mode the two blocks' descale vectors) through a ring
whose position is carried across items. Each compute warpgroup owns 64 rows of the Ka
tile; on a block that a group boundary cuts, it zeroes the other groups' token columns
of its own rows of the a_t tile in shared memory (a bitwise AND: no FP8 arithmetic
exists in registers) before its wgmma. b_t is shared and never masked: its tokens
outside the group meet zeros, so b_t must hold finite values there (E4M3 NaN would
spread, as NaN * 0 is NaN): fp8_ragged_dot's casts write the tokens past the groups as
zeros and saturate the others.

Mosaic GPU's CPU interpreter runs the same kernel (`interpret=`), with the tile products
of `MosaicTarget` (see mosaic_target.py).
"""
from __future__ import annotations

import dataclasses
import functools
import types
from typing import Any

import jax
from jax import lax
import jax.numpy as jnp

from pallas_kernels import varying
from pallas_kernels.mosaic_target import MosaicTarget, pl, plgpu
from pallas_kernels.ragged_tiling import (STEP, WG_ROWS, TransposedRaggedMatmulBlockSizes,
                                          accumulate_steps, apply_rowwise_descales, cdiv,
                                          check_common, check_descale, check_fp8,
                                          check_group_sizes, check_multiple, check_smem,
                                          copy_rowwise_descales, launch, mask_f8_columns,
                                          persistent_ring, promote_steps, release,
                                          resolve_num_sms, ring_scratch, row_tile_schedule,
                                          smem_bytes, token_block_schedule, wait_ready,
                                          zeros_varying)
from pallas_kernels.smem_ring import slot_of, when

_FN = "transposed_ragged_matmul"


@dataclasses.dataclass(frozen=True)
class _Problem:
  """Static shape of one call (hashable)."""
  tokens: int       # M, padded to whole token blocks (see transposed_ragged_matmul)
  ka: int
  nb: int
  groups: int
  scale_mode: str
  out_dtype: Any
  blocks: TransposedRaggedMatmulBlockSizes
  num_ctas: int

  @property
  def grid(self) -> tuple[int, int, int]:
    return (self.groups, self.ka // self.blocks.block_m, self.nb // self.blocks.block_n)

  def scratch(self) -> dict:
    return ring_scratch(stages=self.blocks.num_stages, block_m=self.blocks.block_m,
                        block_n=self.blocks.block_n, out_dtype=self.out_dtype,
                        scale_mode=self.scale_mode, swizzled_out=True,
                        block_descales=dict(sa=self.blocks.block_m, sb=self.blocks.block_n))


def _cta(refs, s, target: MosaicTarget, *, p: _Problem):
  """One CTA: its share of the (group, Ka tile, Nb tile) items."""
  bm, bn, stages = p.blocks.block_m, p.blocks.block_n, p.blocks.num_stages
  kinds = ("a", "b", "sa", "sb") if p.scale_mode == "block" else ("a", "b")
  wg = lax.axis_index("wg")

  def item(index):
    g, ka_tile, n_tile = index
    return types.SimpleNamespace(
        g=g, ka0=ka_tile * bm, n0=n_tile * bn, lo=refs.offsets[g], hi=refs.offsets[g + 1],
        first_block=refs.first_block[g], steps=refs.num_blocks[g])

  def consume(index, first_step):
    it = item(index)
    rows = pl.ds(it.ka0 + wg * WG_ROWS, WG_ROWS)
    shape = (WG_ROWS, bn)
    if p.scale_mode == "rowwise":  # copied while the products run
      copy_rowwise_descales(s, wg, refs.a_descale.at[rows], refs.b_descale.at[pl.ds(it.n0, bn)])

    def operands(step):
      slot = slot_of(first_step + step, stages)
      wait_ready(s, slot, kinds)
      a_tile = s.a.at[slot, pl.ds(wg * WG_ROWS, WG_ROWS)]
      first_token = (it.first_block + step) * STEP
      # Only a block cut by a group boundary has other groups' tokens to zero.
      when((first_token < it.lo) | (first_token + STEP > it.hi),
           lambda: mask_f8_columns(target, a_tile, it.lo - first_token, it.hi - first_token))
      return a_tile, s.b.at[slot], slot

    if p.scale_mode == "block":
      def descale(step, slot):
        a_d = target.row_vector(s.sa.at[slot, pl.ds(wg * WG_ROWS, WG_ROWS)])
        b_d = target.col_vector(s.sb.at[slot])
        return lax.broadcast_in_dim(a_d, shape, [0]) * lax.broadcast_in_dim(b_d, shape, [1])
      out = promote_steps(target, it.steps, shape, operands, descale,
                          functools.partial(release, s))
    else:
      out = accumulate_steps(target, it.steps, shape, operands, functools.partial(release, s))
      out = (apply_rowwise_descales(target, s, wg, out) if p.scale_mode == "rowwise"
             else out * refs.scale[0])
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last item's store has read it
    s.out.at[wg][...] = out.astype(p.out_dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(s.out.at[wg], refs.out.at[it.g, rows, pl.ds(it.n0, bn)])
    return it.steps

  def produce(index):
    it = item(index)

    def issue(step, slot):
      token_block = it.first_block + step
      tokens = pl.ds(token_block * STEP, STEP)
      plgpu.copy_gmem_to_smem(refs.a_t.at[pl.ds(it.ka0, bm), tokens], s.a.at[slot],
                              s.a_ready.at[slot])
      plgpu.copy_gmem_to_smem(refs.b_t.at[pl.ds(it.n0, bn), tokens], s.b.at[slot],
                              s.b_ready.at[slot])
      if p.scale_mode == "block":
        plgpu.copy_gmem_to_smem(refs.a_descale_t.at[token_block, pl.ds(it.ka0, bm)],
                                s.sa.at[slot], s.sa_ready.at[slot])
        plgpu.copy_gmem_to_smem(refs.b_descale_t.at[token_block, pl.ds(it.n0, bn)],
                                s.sb.at[slot], s.sb_ready.at[slot])
    return it.steps, issue

  persistent_ring(s, p.grid, stages, consume=consume, produce=produce)


@functools.partial(jax.jit, static_argnames=("p", "interpret"))
def _run(a_t, b_t, group_sizes, a_descale, b_descale, *, p: _Problem, interpret):
  if p.tokens > a_t.shape[1]:  # see transposed_ragged_matmul
    pad = ((0, 0), (0, p.tokens - a_t.shape[1]))
    a_t, b_t = jnp.pad(a_t, pad), jnp.pad(b_t, pad)
  sched = token_block_schedule(group_sizes, p.tokens)
  if p.scale_mode == "tensor":
    scales = dict(scale=jnp.reshape(a_descale * b_descale, (1,)))
  elif p.scale_mode == "rowwise":
    scales = dict(a_descale=a_descale, b_descale=b_descale)
  else:  # one token block's descales contiguous: one TMA copy per step and operand
    blocks = cdiv(p.tokens, STEP)
    a_descale_t, b_descale_t = (jnp.pad(x, ((0, 0), (0, blocks - x.shape[1]))).T
                                for x in (a_descale, b_descale))
    scales = dict(a_descale_t=a_descale_t, b_descale_t=b_descale_t)
  inputs = dict(offsets=sched.offsets, first_block=sched.first_block,
                num_blocks=sched.num_blocks, a_t=a_t, b_t=b_t, **scales)
  out = launch(functools.partial(_cta, p=p), inputs, p.scratch(),
                jax.ShapeDtypeStruct((p.groups, p.ka, p.nb), p.out_dtype), p.num_ctas,
                interpret, _FN)
  # Inside shard_map the output varies along every axis an input varies along (plgpu
  # kernels leave their outputs' types unchecked and plain: typed here).
  return varying.vary(out, varying.varying_axes(inputs))


def _check(a_t, b_t, group_sizes, a_descale, b_descale, scale_mode, out_dtype, block_sizes):
  check_common(scale_mode, out_dtype, block_sizes, TransposedRaggedMatmulBlockSizes, _FN)
  check_fp8(_FN, "a_t", a_t, 2, "[Ka, M] (tokens contiguous, e.g. x transposed)")
  check_fp8(_FN, "b_t", b_t, 2, "[Nb, M] (tokens contiguous, e.g. dy transposed)")
  ka, m = a_t.shape
  nb, m_b = b_t.shape
  if m_b != m:
    raise ValueError(f"{_FN}: b_t must be [Nb, M] with M = {m} tokens (a_t's last axis); got "
                     f"shape {tuple(b_t.shape)}. Pass dy transposed, tokens last.")
  check_group_sizes(_FN, group_sizes, None, "one size per group of the output")
  groups = group_sizes.shape[0]
  blocks = cdiv(m, STEP)
  want = {"tensor": ((), ()), "rowwise": ((ka,), (nb,)),
          "block": ((ka, blocks), (nb, blocks))}[scale_mode]
  meaning = {"tensor": ("one descale for a_t", "one descale for b_t"),
             "rowwise": ("one per row of a_t", "one per row of b_t"),
             "block": ("one per row of a_t and 128 tokens", "one per row of b_t and 128 "
                       "tokens")}[scale_mode]
  check_descale(_FN, "a_descale", a_descale, want[0], scale_mode, meaning[0])
  check_descale(_FN, "b_descale", b_descale, want[1], scale_mode, meaning[1])
  return ka, nb, m, groups


def transposed_ragged_matmul(
    a_t: jax.Array, b_t: jax.Array, group_sizes: jax.Array, a_descale: jax.Array,
    b_descale: jax.Array, *, scale_mode: str, out_dtype=jnp.float32,
    block_sizes: TransposedRaggedMatmulBlockSizes = TransposedRaggedMatmulBlockSizes(),
    num_sms: int | None = None, interpret: Any = False) -> jax.Array:
  """Per-group a_t b_t^T over each group's tokens (wgrad) on Hopper FP8 tensor cores.

  out[g, i, j] = sum_{r in group g} a_t[i, r] * b_t[j, r] * descales; an empty group
  gives zeros. See the module docstring for the scale modes.

  Args:
    a_t: float8_e4m3fn [Ka, M], tokens sorted by group and contiguous; Ka a multiple of
      128 (pad with zero rows).
    b_t: float8_e4m3fn [Nb, M]; Nb a multiple of block_sizes.block_n. Finite (see the
      module docstring).
    group_sizes: int32 [G], sizes >= 0 with sum <= M (not checked: traced values).
    a_descale, b_descale: float32, shaped by `scale_mode` (module docstring).
    scale_mode: "tensor", "rowwise" or "block".
    out_dtype: float32 (default) or bfloat16.
    block_sizes: tiles and ring depth (static).
    num_sms, interpret: as `ragged_matmul`.

  Returns:
    out_dtype [G, Ka, Nb].
  """
  if plgpu is None:
    raise ImportError("transposed_ragged_matmul needs jax.experimental.pallas.mosaic_gpu, "
                      "which this jax/jaxlib does not provide; use "
                      "transposed_ragged_matmul_reference.")
  ka, nb, m, g = _check(a_t, b_t, group_sizes, a_descale, b_descale, scale_mode, out_dtype,
                        block_sizes)
  bm, bn = block_sizes.block_m, block_sizes.block_n
  check_multiple(_FN, "Ka", ka, bm, f"pad a_t with zero rows up to {cdiv(ka, bm) * bm} and "
                 "slice the output.")
  check_multiple(_FN, "Nb", nb, bn, f"pad b_t with zero rows up to {cdiv(nb, bn) * bn} and "
                 "slice the output, or pick a block_n that divides Nb.")
  check_multiple(_FN, "M", m, 16, f"pad the token axis of a_t and b_t with zero columns up "
                 f"to {cdiv(m, 16) * 16} (tokens past sum(group_sizes) belong to no group).")
  # The token axis is padded with zeros to whole 128-token blocks (tokens past
  # sum(group_sizes) belong to no group). Mosaic GPU in JAX 0.11 refuses a TMA copy over
  # a dimension that is not a whole number of its 128-wide tiles (seen on an H200 with
  # jax 0.11.2; JAX 0.10 had TMA fill the last block's missing tokens with zeros), and
  # the CPU interpreter raises on reads past the array.
  tokens = cdiv(m, STEP) * STEP
  items = g * (ka // bm) * (nb // bn)
  problem = _Problem(tokens=tokens, ka=ka, nb=nb, groups=g, scale_mode=scale_mode,
                     out_dtype=jnp.dtype(out_dtype), blocks=block_sizes,
                     num_ctas=min(resolve_num_sms(num_sms, interpret), items))
  check_smem(_FN, smem_bytes(problem.scratch()), block_sizes)
  return _run(a_t, b_t, group_sizes, a_descale, b_descale, p=problem, interpret=interpret)


def transposed_ragged_matmul_reference(
    a_t: jax.Array, b_t: jax.Array, group_sizes: jax.Array, a_descale: jax.Array,
    b_descale: jax.Array, *, scale_mode: str, out_dtype=jnp.float32,
    block_sizes: TransposedRaggedMatmulBlockSizes = TransposedRaggedMatmulBlockSizes(),
    num_sms: int | None = None, interpret: Any = False) -> jax.Array:
  """Plain-jnp `transposed_ragged_matmul`: its specification and the CPU / non-Hopper path.

  A loop over the (group, 128-token block) pairs that hold tokens (the forward's row
  tile schedule over tokens): each adds a_t[:, block] b_t[:, block]^T, both operands'
  other groups' tokens zeroed, to its group's float32 sum, so the FLOPs are about those
  of one dense GEMM over M. Descales are applied as the kernel applies them: after the
  sum ("tensor", "rowwise") or per token block ("block"). Any Ka, Nb and M. `block_sizes`,
  `num_sms` and `interpret` are accepted for a drop-in swap and unused.

  Args / Returns: as `transposed_ragged_matmul`.
  """
  del block_sizes, num_sms, interpret
  ka, nb, m, g = _check(a_t, b_t, group_sizes, a_descale, b_descale, scale_mode, out_dtype,
                        TransposedRaggedMatmulBlockSizes())
  tokens = cdiv(m, STEP) * STEP
  pad = ((0, 0), (0, tokens - m))
  a_all, b_all = jnp.pad(a_t, pad), jnp.pad(b_t, pad)
  sched = row_tile_schedule(group_sizes, m, STEP)
  # Inside shard_map, what the loops build differs per device as the inputs do.
  zeros = functools.partial(zeros_varying, axes=varying.varying_axes(
      a_t, b_t, group_sizes, a_descale, b_descale))

  def product(seg, t0):
    """float32 [Ka, Nb]: token block [t0, t0 + 128) of group seg, descaled per block."""
    token_ids = t0 + jnp.arange(STEP)
    keep = (token_ids >= sched.offsets[seg]) & (token_ids < sched.offsets[seg + 1])

    def group_tokens(x):
      x = lax.dynamic_slice_in_dim(x, t0, STEP, 1).astype(jnp.float32)
      return jnp.where(keep[None, :], x, 0.0)
    partial = lax.dot_general(group_tokens(a_all), group_tokens(b_all),
                              (((1,), (1,)), ((), ())), precision=lax.Precision.HIGHEST,
                              preferred_element_type=jnp.float32)
    if scale_mode == "block":
      block_index = t0 // STEP
      partial = partial * (lax.dynamic_index_in_dim(a_descale, block_index, 1)
                           * lax.dynamic_index_in_dim(b_descale, block_index, 1).T)
    return partial

  def visit(i, out):
    seg, t0 = sched.group[i], sched.m_tile[i] * STEP
    gi = jnp.clip(seg, 0, g - 1)
    # The tail segment (seg == G) belongs to no group and the schedule's padding
    # (seg == -1) holds nothing: no product.
    partial = lax.cond((seg >= 0) & (seg < g), lambda: product(gi, t0),
                       lambda: zeros((ka, nb)))
    return lax.dynamic_update_index_in_dim(
        out, lax.dynamic_index_in_dim(out, gi, 0, keepdims=False) + partial, gi, 0)

  # A static trip count (a scan): differentiable, and vmap-able over group_sizes.
  out = lax.fori_loop(0, sched.group.shape[0], visit, zeros((g, ka, nb)))
  if scale_mode == "tensor":
    out = out * (a_descale * b_descale)
  elif scale_mode == "rowwise":
    out = out * a_descale[None, :, None] * b_descale[None, None, :]
  return out.astype(out_dtype)
