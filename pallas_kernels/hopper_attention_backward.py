"""Flash-attention backward for Hopper on Mosaic GPU: a dQ kernel and a dK/dV kernel, 16-bit and FP8.

Both kernels recompute the probabilities from the forward's base-2 log-sum-exp, as
FlashAttention-2/3 do, and split the work so that no kernel needs atomics:

  dQ kernel    grid heads x q tiles x batch. Two compute warpgroups own `block_q_dq`
               query rows each (Q, dO, lse, delta stay in shared memory); a producer
               warpgroup streams K and V tiles of `block_kv_dq` keys.
  dK/dV kernel grid kv_heads x kv tiles x batch. Two compute warpgroups own
               `block_kv_dkv` key rows each (K, V stay); the producer streams, for every
               query head of the group (GQA) and every query block, the Q and dO tiles
               and the rows' (lse, delta). dK and dV are summed over the group in the
               kernel, so GQA needs no reduction afterwards.

Per (query row i, key j), base 2 (scales below fold every descale in):
  p_ij  = 2**(s_ij * qk_scale - lse2_i)           (0 where masked)
  dp_ij = (dO_i . v_j) * dp_scale
  ds_ij = p_ij * (dp_ij - delta_i),  delta_i = dO_i . O_i (computed in XLA)
  dQ_i  = dq_scale * sum_j ds_ij k_j;   dK_j = dk_scale * sum_i ds_ij q_i
  dV_j  = dv_scale * sum_i p_ij dO_i

Operand formats. 16-bit inputs: every product in the input type. FP8 (E4M3 q, k, v):

  S = Q K^T and dP = dO V^T   E4M3 x E4M3 wgmma. dO is quantized to E4M3 with a
                              current scale (its own amax), since a wgmma takes one
                              operand type and the values need no E5M2 range once
                              scaled.
  dV = P^T dO                 E4M3 x E4M3: P is in [0, 1] and stored as E4M3(P *
                              P_SCALE), exactly as in the forward.
  dQ = dS K and dK = dS^T Q   bf16 x bf16, on exact bf16 copies of the E4M3 q and k
                              (E4M3 values are bf16 values). dS = P (dP - delta) spans
                              P's range times dP's: a row-block scale would need a
                              second accumulator per block that does not fit beside
                              dK and dV in a warpgroup's registers, and a single
                              tensor scale flushes small probabilities' gradients.
                              These are 2 of the 7 products (the dQ kernel recomputes
                              S and dP).

Block-scaled FP8 inputs (`geo.block_scaled`: one descale per SCALE_BLOCK rows of each
head) change scalars only: S's scale takes the descales of the tile's query and key
blocks, dP's the key block's V descale, both read per step; the bf16 copies of q and k
for dQ and dK are dequantized (E4M3 times its block's descale, rounded to bf16), so dq and
dk scales are sm_scale alone.

Causal masks are bottom-right aligned (hopper_attention_tiling); every warpgroup waits
for and releases every slot the producer fills, computing only the blocks its rows use.
"""
from __future__ import annotations

import functools
import types

import jax
from jax import lax
import jax.numpy as jnp

from pallas_kernels.hopper_attention_tiling import (COMPUTE_WGS, E4M3, P_SCALE, SCALE_BLOCK,
                                                    AttentionGeometry,
                                                    HopperAttentionBlockSizes, key_steps,
                                                    query_steps, release_slot, scale_block,
                                                    stream_tiles, tile_visibility)
from pallas_kernels.mosaic_target import (MosaicTarget, interpret_params, pl, plgpu,
                                          swizzle_transforms)

# Registers per thread after `setmaxnreg`, as in the forward: 2 x 128 x 232 + 128 x 40 <= 65536,
# the register file. dK and dV take 128 of a compute thread's 232.
COMPUTE_REGISTERS, PRODUCER_REGISTERS = 232, 40

# Order of the float32 scalars in the `scales` input.
QK_SCALE, DP_SCALE, DV_SCALE, DQ_SCALE, DK_SCALE = range(5)


def _probabilities(s_tile, qk_scale, lse, visible):
  """p = 2**(s * qk_scale - lse2), 0 where not visible (lse2 broadcast to the tile).

  `visible` is a function giving the mask (or None): called after the exponential, so
  the mask's index tiles are not live beside the logits.
  """
  p = jnp.exp2(s_tile * qk_scale - lse)
  return p if visible is None else jnp.where(visible(), p, 0.0)


def _dq_cta(refs, s, *, geo: AttentionGeometry, blocks: HopperAttentionBlockSizes, fp8: bool,
            stages: int, target: MosaicTarget):
  """One CTA of the dQ kernel: 2 * block_q_dq query rows of one (batch, head)."""
  block_q, block_kv, head_dim = blocks.block_q_dq, blocks.block_kv_dq, geo.head_dim
  batch = lax.axis_index("batch")
  head = lax.axis_index("heads")
  wg = lax.axis_index("wg")
  cta_row0 = lax.axis_index("q_tiles") * (COMPUTE_WGS * block_q)
  cta_steps, _ = key_steps(geo, cta_row0, COMPUTE_WGS * block_q, block_kv)
  ds_type = jnp.bfloat16 if fp8 else refs.q.dtype
  tile_kinds = ("k", "v") + (("k16",) if fp8 else ()) + (("kv_ids",) if geo.segmented else ())

  def slot_of(step):
    return lax.rem(step, jnp.int32(stages))

  @pl.when(wg < COMPUTE_WGS)
  def _compute():
    plgpu.set_max_registers(COMPUTE_REGISTERS, action="increase")
    row0 = cta_row0 + wg * block_q
    rows = pl.ds(row0, block_q)
    steps, unmasked_steps = key_steps(geo, row0, block_q, block_kv)
    q_tile, do_tile = s.q.at[wg], s.do.at[wg]
    plgpu.copy_gmem_to_smem(refs.q.at[batch, rows, head], q_tile, s.q_ready.at[wg])
    plgpu.copy_gmem_to_smem(refs.do.at[batch, rows, head], do_tile, s.do_ready.at[wg])
    plgpu.copy_gmem_to_smem(refs.stats.at[batch, head, :, rows], s.stats.at[wg],
                            s.stats_ready.at[wg])
    q_ids = None
    if geo.segmented:
      plgpu.copy_gmem_to_smem(refs.q_ids.at[batch, rows], s.q_ids.at[wg], s.q_ids_ready.at[wg])
      plgpu.barrier_wait(s.q_ids_ready.at[wg])
      q_ids = target.row_vector(s.q_ids.at[wg])
    plgpu.barrier_wait(s.stats_ready.at[wg])
    lse = target.row_vector(s.stats.at[wg, 0])
    delta = target.row_vector(s.stats.at[wg, 1])
    plgpu.barrier_wait(s.q_ready.at[wg])
    plgpu.barrier_wait(s.do_ready.at[wg])
    scales = refs.scales
    shape = (block_q, block_kv)
    kv_head = lax.div(head, jnp.int32(geo.group))
    qk_scale = scales[QK_SCALE]
    if geo.block_scaled:
      qk_scale = qk_scale * refs.q_descale[batch, head, scale_block(row0)]

    def step_scales(step):
      """(S's and dP's scale) of a key step."""
      if not geo.block_scaled:
        return qk_scale, scales[DP_SCALE]
      key_block = scale_block(step * block_kv)
      return (qk_scale * refs.k_descale[batch, kv_head, key_block],
              scales[DP_SCALE] * refs.v_descale[batch, kv_head, key_block])

    def key_step(step, dq, *, masked: bool):
      slot = slot_of(step)
      step_qk_scale, dp_scale = step_scales(step)
      plgpu.barrier_wait(s.k_ready.at[slot])
      s_tile = target.mma(None, q_tile, s.k.at[slot], transpose_b=True, shape=shape)
      visible = None
      if masked:
        kv_ids = None
        if geo.segmented:
          plgpu.barrier_wait(s.kv_ids_ready.at[slot])
          kv_ids = target.col_vector(s.kv_ids.at[slot])
        visible = functools.partial(tile_visibility, geo, target, shape, first_row=row0,
                                    first_col=step * block_kv, rows_are_queries=True,
                                    row_ids=q_ids, col_ids=kv_ids)
      # Each value is finished before the next product is issued: fewer live registers.
      p = _probabilities(s_tile, step_qk_scale, lax.broadcast_in_dim(lse, shape, [0]),
                         visible)
      plgpu.barrier_wait(s.v_ready.at[slot])
      dp = target.mma(None, do_tile, s.v.at[slot], transpose_b=True, shape=shape)
      plgpu.barrier_arrive(s.v_free.at[slot])
      ds = p * (dp * dp_scale - lax.broadcast_in_dim(delta, shape, [0]))
      if fp8:
        plgpu.barrier_wait(s.k16_ready.at[slot])
      dq = target.mma(dq, ds.astype(ds_type), (s.k16 if fp8 else s.k).at[slot],
                      transpose_b=False)
      plgpu.barrier_arrive(s.k_free.at[slot])
      if fp8:
        plgpu.barrier_arrive(s.k16_free.at[slot])
      if geo.segmented:  # segment ids make every step a masked one
        plgpu.barrier_arrive(s.kv_ids_free.at[slot])
      return dq

    def skip(step, carry):
      # A key block the CTA's other warpgroup needs and this one does not: keep this
      # warpgroup's barrier phases in step with the producer's.
      release_slot(s, tile_kinds, slot_of(step))
      return carry

    dq = target.layout(jnp.zeros((block_q, head_dim), jnp.float32), plgpu.Layout.WGMMA)
    dq = lax.fori_loop(0, unmasked_steps, functools.partial(key_step, masked=False), dq)
    if geo.causal or geo.segmented:
      dq = lax.fori_loop(unmasked_steps, steps, functools.partial(key_step, masked=True), dq)
    if geo.causal:
      lax.fori_loop(steps, cta_steps, skip, None)

    s.dq.at[wg][...] = (dq * scales[DQ_SCALE]).astype(refs.dq.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(s.dq.at[wg], refs.dq.at[batch, rows, head])
    plgpu.wait_smem_to_gmem(0)

  @pl.when(wg == COMPUTE_WGS)
  def _produce():
    plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")
    kv_head = lax.div(head, jnp.int32(geo.group))

    def issue(step, slot):
      cols = pl.ds(step * block_kv, block_kv)
      for kind in tile_kinds:
        source = (refs.kv_ids.at[batch, cols] if kind == "kv_ids"
                  else getattr(refs, kind).at[batch, cols, kv_head])
        plgpu.copy_gmem_to_smem(source, getattr(s, kind).at[slot],
                                getattr(s, f"{kind}_ready").at[slot])

    stream_tiles(cta_steps, stages, issue,
                 lambda slot: [getattr(s, f"{kind}_free").at[slot] for kind in tile_kinds])


def _dkv_cta(refs, s, *, geo: AttentionGeometry, blocks: HopperAttentionBlockSizes, fp8: bool,
             stages: int, target: MosaicTarget):
  """One CTA of the dK/dV kernel: 2 * block_kv_dkv key rows of one (batch, kv head)."""
  block_kv, block_q, head_dim = blocks.block_kv_dkv, blocks.block_q_dkv, geo.head_dim
  batch = lax.axis_index("batch")
  kv_head = lax.axis_index("kv_heads")
  wg = lax.axis_index("wg")
  cta_key0 = lax.axis_index("kv_tiles") * (COMPUTE_WGS * block_kv)
  q_blocks = geo.q_len // block_q
  cta_first, _ = query_steps(geo, cta_key0, COMPUTE_WGS * block_kv, block_q)
  steps_per_head = q_blocks - cta_first
  cta_steps = geo.group * steps_per_head
  ds_type = jnp.bfloat16 if fp8 else refs.q.dtype
  tile_kinds = (("q", "do", "stats") + (("do_t", "q16") if fp8 else ())
                + (("q_ids",) if geo.segmented else ()))

  def slot_of(step):
    return lax.rem(step, jnp.int32(stages))

  @pl.when(wg < COMPUTE_WGS)
  def _compute():
    plgpu.set_max_registers(COMPUTE_REGISTERS, action="increase")
    key0 = cta_key0 + wg * block_kv
    keys = pl.ds(key0, block_kv)
    first, first_unmasked = query_steps(geo, key0, block_kv, block_q)
    k_tile, v_tile = s.k.at[wg], s.v.at[wg]
    plgpu.copy_gmem_to_smem(refs.k.at[batch, keys, kv_head], k_tile, s.k_ready.at[wg])
    plgpu.copy_gmem_to_smem(refs.v.at[batch, keys, kv_head], v_tile, s.v_ready.at[wg])
    kv_ids = None
    if geo.segmented:
      plgpu.copy_gmem_to_smem(refs.kv_ids.at[batch, keys], s.kv_ids.at[wg],
                              s.kv_ids_ready.at[wg])
      plgpu.barrier_wait(s.kv_ids_ready.at[wg])
      kv_ids = target.row_vector(s.kv_ids.at[wg])
    plgpu.barrier_wait(s.k_ready.at[wg])
    plgpu.barrier_wait(s.v_ready.at[wg])
    scales = refs.scales
    shape = (block_kv, block_q)
    qk_scale, dp_scale = scales[QK_SCALE], scales[DP_SCALE]
    if geo.block_scaled:
      key_block = scale_block(key0)
      qk_scale = qk_scale * refs.k_descale[batch, kv_head, key_block]
      dp_scale = dp_scale * refs.v_descale[batch, kv_head, key_block]

    def step_qk_scale(q_block, head_in_group):
      if not geo.block_scaled:
        return qk_scale
      head = kv_head * geo.group + head_in_group
      return qk_scale * refs.q_descale[batch, head, scale_block(q_block * block_q)]

    def query_step(q_block, carry, *, head_in_group, masked: bool):
      dk, dv = carry
      slot = slot_of(head_in_group * steps_per_head + q_block - cta_first)
      s_scale = step_qk_scale(q_block, head_in_group)
      plgpu.barrier_wait(s.q_ready.at[slot])
      s_t = target.mma(None, k_tile, s.q.at[slot], transpose_b=True, shape=shape)
      visible = None
      if masked:
        q_ids = None
        if geo.segmented:
          plgpu.barrier_wait(s.q_ids_ready.at[slot])
          q_ids = target.col_vector(s.q_ids.at[slot])
          plgpu.barrier_arrive(s.q_ids_free.at[slot])
        visible = functools.partial(tile_visibility, geo, target, shape, first_row=key0,
                                    first_col=q_block * block_q, rows_are_queries=False,
                                    row_ids=kv_ids, col_ids=q_ids)
      plgpu.barrier_wait(s.stats_ready.at[slot])
      # Each value is finished before the next product is issued: fewer live registers.
      p_t = _probabilities(s_t, s_scale, lax.broadcast_in_dim(
          target.col_vector(s.stats.at[slot, 0]), shape, [1]), visible)
      plgpu.barrier_wait(s.do_ready.at[slot])
      if fp8:
        p_tile = s.p.at[wg]
        p_tile[...] = (p_t * P_SCALE).astype(E4M3)
        plgpu.commit_smem()
        plgpu.barrier_wait(s.do_t_ready.at[slot])
        dv = target.mma(dv, p_tile, s.do_t.at[slot], transpose_b=True)
        plgpu.barrier_arrive(s.do_t_free.at[slot])
      else:
        dv = target.mma(dv, p_t.astype(ds_type), s.do.at[slot], transpose_b=False)
      dp_t = target.mma(None, v_tile, s.do.at[slot], transpose_b=True, shape=shape)
      ds_t = p_t * (dp_t * dp_scale - lax.broadcast_in_dim(
          target.col_vector(s.stats.at[slot, 1]), shape, [1]))
      plgpu.barrier_arrive(s.stats_free.at[slot])
      if fp8:
        plgpu.barrier_wait(s.q16_ready.at[slot])
        dk = target.mma(dk, ds_t.astype(ds_type), s.q16.at[slot], transpose_b=False)
        plgpu.barrier_arrive(s.q16_free.at[slot])
      else:
        dk = target.mma(dk, ds_t.astype(ds_type), s.q.at[slot], transpose_b=False)
      plgpu.barrier_arrive(s.q_free.at[slot])
      plgpu.barrier_arrive(s.do_free.at[slot])
      return dk, dv

    def skip(q_block, carry, *, head_in_group):
      # A query block the CTA's other warpgroup needs and this one does not: keep this
      # warpgroup's barrier phases in step with the producer's.
      release_slot(s, tile_kinds, slot_of(head_in_group * steps_per_head + q_block - cta_first))
      return carry

    def one_head(head_in_group, carry):
      if geo.causal:
        carry = lax.fori_loop(cta_first, first,
                              functools.partial(skip, head_in_group=head_in_group), carry)
      if geo.causal or geo.segmented:
        carry = lax.fori_loop(first, first_unmasked,
                              functools.partial(query_step, head_in_group=head_in_group,
                                                masked=True), carry)
      if geo.segmented:  # every block is masked
        return carry
      return lax.fori_loop(first_unmasked, q_blocks,
                           functools.partial(query_step, head_in_group=head_in_group,
                                             masked=False), carry)

    zeros = target.layout(jnp.zeros((block_kv, head_dim), jnp.float32), plgpu.Layout.WGMMA)
    dk, dv = lax.fori_loop(0, geo.group, one_head, (zeros, zeros))
    s.dk.at[wg][...] = (dk * scales[DK_SCALE]).astype(refs.dk.dtype)
    s.dv.at[wg][...] = (dv * scales[DV_SCALE]).astype(refs.dv.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(s.dk.at[wg], refs.dk.at[batch, keys, kv_head])
    plgpu.copy_smem_to_gmem(s.dv.at[wg], refs.dv.at[batch, keys, kv_head])
    plgpu.wait_smem_to_gmem(0)

  @pl.when(wg == COMPUTE_WGS)
  def _produce():
    plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")

    def issue(step, slot):
      head = kv_head * geo.group + lax.div(step, steps_per_head)
      rows = pl.ds((cta_first + lax.rem(step, steps_per_head)) * block_q, block_q)
      for kind in tile_kinds:
        if kind == "stats":
          source = refs.stats.at[batch, head, :, rows]
        elif kind == "q_ids":
          source = refs.q_ids.at[batch, rows]
        elif kind == "do_t":
          source = refs.do_t.at[batch, head, :, rows]
        else:
          source = getattr(refs, kind).at[batch, rows, head]
        plgpu.copy_gmem_to_smem(source, getattr(s, kind).at[slot],
                                getattr(s, f"{kind}_ready").at[slot])

    stream_tiles(cta_steps, stages, issue,
                 lambda slot: [getattr(s, f"{kind}_free").at[slot] for kind in tile_kinds])


def _bf16_copy(x8, block_descale=None):
  """x8 [batch, seq, heads, D] in bf16: exact (E4M3 values are bf16 values), or with a
  [batch, heads, seq / SCALE_BLOCK] descale dequantized (rounded to bf16, 2**-9)."""
  if block_descale is None:
    return x8.astype(jnp.bfloat16)
  per_row = jnp.repeat(jnp.swapaxes(block_descale, 1, 2), SCALE_BLOCK, axis=1)
  return (x8.astype(jnp.float32) * per_row[..., None]).astype(jnp.bfloat16)


def _smem(shape, dtype):
  return plgpu.SMEM(shape, dtype, transforms=swizzle_transforms(shape[-1], dtype))


def _ring(kinds, stages: int) -> dict:
  """A ready barrier (the TMA copy landed) and a free one (both warpgroups are done) per slot."""
  barriers = {}
  for kind in kinds:
    barriers[f"{kind}_ready"] = plgpu.Barrier(num_barriers=stages)
    barriers[f"{kind}_free"] = plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=stages)
  return barriers


def _launch(cta, named_inputs: dict, out_types: dict, scratch: dict, grid: dict, params):
  """Runs `cta(refs, scratch)` on a grid of CTAs of two compute and one producer warpgroup."""
  names = tuple(named_inputs) + tuple(out_types)

  def entry(*refs):
    named = types.SimpleNamespace(**dict(zip(names, refs)))
    pl.run_scoped(lambda **allocated: cta(named, types.SimpleNamespace(**allocated)),
                  collective_axes="wg", **scratch)

  return plgpu.kernel(
      entry,
      out_type=tuple(out_types.values()),
      grid=tuple(grid.values()),
      grid_names=tuple(grid),
      num_threads=COMPUTE_WGS + 1,
      thread_name="wg",
      compiler_params=plgpu.CompilerParams(approx_math=True),
      interpret=params,
  )(*named_inputs.values())


@functools.partial(jax.jit, static_argnames=("geo", "blocks", "interpret"))
def backward(q, k, v, do, stats, scales, q_ids, kv_ids, block_scales=None, *,
             geo: AttentionGeometry, blocks: HopperAttentionBlockSizes, interpret):
  """Runs the dQ and the dK/dV kernel on checked inputs (see `pallas_kernels.hopper_attention`).

  Args:
    q, k, v, do: q and dO [batch, q_len, heads, D], k and v [batch, kv_len, kv_heads,
      D]: all 16-bit, or all E4M3 (dO quantized, see the module docstring).
    stats: float32 [batch, heads, 2, q_len]: each row's base-2 lse (+inf for a row that
      saw no key, see `hopper_attention_tiling.safe_lse`) and delta = dO . O.
    scales: float32 [5]: qk, dp, dv, dq and dk scales (module docstring).
    q_ids, kv_ids: int32 [batch, q_len] / [batch, kv_len] segment ids, or None.
    block_scales: None, or (when `geo.block_scaled`) float32 (q_descale [batch, heads,
      q_len / SCALE_BLOCK], k_descale and v_descale [batch, kv_heads, kv_len /
      SCALE_BLOCK]); the qk and dp scales then leave the descales out, dq and dk are
      sm_scale alone.
    geo, blocks: static shape and tiles; interpret: see `mosaic_target.interpret_params`.

  Returns:
    (dq, dk, dv) in q's shape and k's shape, 16-bit (bf16 for E4M3 inputs).
  """
  fp8 = q.dtype == E4M3
  params = interpret_params(interpret)
  target = MosaicTarget(interpret=params is not None)
  grad_dtype = jnp.bfloat16 if fp8 else q.dtype
  head_dim = geo.head_dim
  ids = dict(q_ids=q_ids, kv_ids=kv_ids) if geo.segmented else {}
  descales = (dict(zip(("q_descale", "k_descale", "v_descale"), block_scales))
              if geo.block_scaled else {})
  inputs = dict(q=q, k=k, v=v, do=do, stats=stats, scales=scales, **ids, **descales)

  # dQ: K, V (and K's bf16 copy) stream by key block.
  block_q, block_kv = blocks.block_q_dq, blocks.block_kv_dq
  stages = min(blocks.num_stages, geo.kv_len // block_kv)
  kinds = ("k", "v") + (("k16",) if fp8 else ()) + (("kv_ids",) if geo.segmented else ())
  scratch = dict(
      q=_smem((COMPUTE_WGS, block_q, head_dim), q.dtype),
      do=_smem((COMPUTE_WGS, block_q, head_dim), q.dtype),
      stats=plgpu.SMEM((COMPUTE_WGS, 2, block_q), jnp.float32),
      k=_smem((stages, block_kv, head_dim), q.dtype),
      v=_smem((stages, block_kv, head_dim), q.dtype),
      dq=_smem((COMPUTE_WGS, block_q, head_dim), grad_dtype),
      q_ready=plgpu.Barrier(num_barriers=COMPUTE_WGS),
      do_ready=plgpu.Barrier(num_barriers=COMPUTE_WGS),
      stats_ready=plgpu.Barrier(num_barriers=COMPUTE_WGS),
      **_ring(kinds, stages))
  dq_inputs = dict(inputs)
  if fp8:
    scratch["k16"] = _smem((stages, block_kv, head_dim), jnp.bfloat16)
    dq_inputs["k16"] = _bf16_copy(k, descales.get("k_descale"))
  if geo.segmented:
    scratch.update(q_ids=plgpu.SMEM((COMPUTE_WGS, block_q), jnp.int32),
                   kv_ids=plgpu.SMEM((stages, block_kv), jnp.int32),
                   q_ids_ready=plgpu.Barrier(num_barriers=COMPUTE_WGS))
  (dq,) = _launch(
      functools.partial(_dq_cta, geo=geo, blocks=blocks, fp8=fp8, stages=stages, target=target),
      dq_inputs, dict(dq=jax.ShapeDtypeStruct(q.shape, grad_dtype)), scratch,
      dict(heads=geo.heads, q_tiles=geo.q_len // (COMPUTE_WGS * block_q), batch=geo.batch),
      params)

  # dK/dV: Q, dO, the rows' stats (and dO^T, Q's bf16 copy) stream by query block.
  block_kv, block_q = blocks.block_kv_dkv, blocks.block_q_dkv
  stages = min(blocks.num_stages, geo.group * (geo.q_len // block_q))
  kinds = (("q", "do", "stats") + (("do_t", "q16") if fp8 else ())
           + (("q_ids",) if geo.segmented else ()))
  scratch = dict(
      k=_smem((COMPUTE_WGS, block_kv, head_dim), q.dtype),
      v=_smem((COMPUTE_WGS, block_kv, head_dim), q.dtype),
      q=_smem((stages, block_q, head_dim), q.dtype),
      do=_smem((stages, block_q, head_dim), q.dtype),
      stats=plgpu.SMEM((stages, 2, block_q), jnp.float32),
      dk=_smem((COMPUTE_WGS, block_kv, head_dim), grad_dtype),
      dv=_smem((COMPUTE_WGS, block_kv, head_dim), grad_dtype),
      k_ready=plgpu.Barrier(num_barriers=COMPUTE_WGS),
      v_ready=plgpu.Barrier(num_barriers=COMPUTE_WGS),
      **_ring(kinds, stages))
  dkv_inputs = dict(inputs)
  if fp8:
    scratch.update(do_t=_smem((stages, head_dim, block_q), E4M3),
                   q16=_smem((stages, block_q, head_dim), jnp.bfloat16),
                   p=_smem((COMPUTE_WGS, block_kv, block_q), E4M3))
    dkv_inputs.update(do_t=jnp.transpose(do, (0, 2, 3, 1)),
                      q16=_bf16_copy(q, descales.get("q_descale")))
  if geo.segmented:
    scratch.update(kv_ids=plgpu.SMEM((COMPUTE_WGS, block_kv), jnp.int32),
                   q_ids=plgpu.SMEM((stages, block_q), jnp.int32),
                   kv_ids_ready=plgpu.Barrier(num_barriers=COMPUTE_WGS))
  dk, dv = _launch(
      functools.partial(_dkv_cta, geo=geo, blocks=blocks, fp8=fp8, stages=stages,
                        target=target),
      dkv_inputs, dict(dk=jax.ShapeDtypeStruct(k.shape, grad_dtype),
                       dv=jax.ShapeDtypeStruct(v.shape, grad_dtype)), scratch,
      dict(kv_heads=geo.kv_heads, kv_tiles=geo.kv_len // (COMPUTE_WGS * block_kv),
           batch=geo.batch),
      params)
  return dq, dk, dv
