"""Flash-attention forward for Hopper on Mosaic GPU: one kernel for bf16/f16 and for FP8 (E4M3).

Per CTA (grid: heads x q tiles x batch) two compute warpgroups own `block_q` query rows
each and a producer warpgroup streams K and V tiles (and the keys' segment ids) by TMA
through a ring of `num_stages` shared-memory slots. The compute warpgroups ping-pong on
a barrier ("turn"): while one runs its softmax the other's wgmma runs (FlashAttention-3).

The two products of a key block:

  S = Q K^T   A = the Q tile [block_q, D] (SMEM); B = the K tile [block_kv, D] read
              transposed, i.e. K-major, as stored.
  O += P V    16-bit: A = P in registers, B = the V tile [block_kv, D] (N-major, which
                      16-bit wgmma may read).
              FP8:    A = E4M3(P * P_SCALE) staged in SMEM (Mosaic GPU cannot relayout the
                      f32 accumulator into the 8-bit register layout); B = the V^T tile
                      [D, block_kv] read transposed: FP8 wgmma reads both operands K-major,
                      so V comes in transposed, [batch, kv_heads, D, kv_len].

Numerics per query row (base 2, float32; FP8 inputs x = x8 * descale_x):
  s_j = (q . k_j) * qk_scale,  qk_scale = sm_scale * log2(e) [* descale_q * descale_k]
  m = running max of the visible s_j;  p_j = 2**(s_j - m);  l = running sum of p_j
  acc = rescaled sum of p_j v_j  (FP8: of E4M3(p_j * P_SCALE) v8_j)
  o = acc * out_scale / l,  out_scale = 1 [or descale_v / P_SCALE];  lse2 = m + log2(l)
Block-scaled FP8 inputs (one descale per SCALE_BLOCK rows of each head, `geo.block_scaled`)
change only scalars, read per key step: qk_scale takes the descales of the warpgroup's
query block and of the step's key block; V's block descale enters P before its E4M3
rounding as the ratio r_j = descale_v[block of j] / max over the head's blocks (<= 1, so
P * P_SCALE * r_j still fits E4M3), and out_scale = that max / P_SCALE:
  acc = rescaled sum of E4M3(p_j * P_SCALE * r_j) v8_j,  o = acc * out_scale / l.
A row that sees no key (segment ids, or causal with q_len > kv_len) has l = 0: its
output is 0 and its lse2 -inf. FP8 also writes each row's max |o| (for the output's
delayed scaling); the wrapper reduces it.

Masks are aligned bottom-right (see hopper_attention_tiling): blocks every row of a
warpgroup sees whole run without a mask; a causal warpgroup skips the blocks none of its
rows sees, and the shorter warpgroup of a CTA "drains" the steps the producer streams
for the longer one.
"""
from __future__ import annotations

import functools
import types

import jax
from jax import lax
import jax.numpy as jnp

from pallas_kernels.hopper_attention_tiling import (COMPUTE_WGS, E4M3, P_SCALE,
                                                    AttentionGeometry,
                                                    HopperAttentionBlockSizes, key_steps,
                                                    masked_softmax_max, scale_block,
                                                    stream_tiles, tile_visibility, when)
from pallas_kernels.mosaic_target import (MosaicTarget, interpret_params, pl, plgpu,
                                          swizzle_transforms)


def _forward_cta(refs, s, *, geo: AttentionGeometry, blocks: HopperAttentionBlockSizes,
                 fp8: bool, stages: int, target: MosaicTarget):
  """One CTA: 2 * block_q query rows of one (batch, head)."""
  block_q, block_kv, head_dim = blocks.block_q, blocks.block_kv, geo.head_dim
  batch = lax.axis_index("batch")
  head = lax.axis_index("heads")
  kv_head = lax.div(head, jnp.int32(geo.group))
  wg = lax.axis_index("wg")
  cta_row0 = lax.axis_index("q_tiles") * (COMPUTE_WGS * block_q)
  cta_steps, _ = key_steps(geo, cta_row0, COMPUTE_WGS * block_q, block_kv)

  def slot_of(step):
    return lax.rem(step, jnp.int32(stages))

  def arrive_turn():
    if blocks.ping_pong:
      plgpu.barrier_arrive(s.turn)

  def wait_turn():
    if blocks.ping_pong:
      plgpu.barrier_wait(s.turn)

  def take_turn():
    # Ping-pong: each compute warpgroup arrives and waits, so one issues wgmma while
    # the other does softmax (without ping-pong both issue as they go).
    arrive_turn()
    wait_turn()

  @pl.when(wg < COMPUTE_WGS)
  def _compute():
    plgpu.set_max_registers(232, action="increase")
    row0 = cta_row0 + wg * block_q
    rows = pl.ds(row0, block_q)
    steps, unmasked_steps = key_steps(geo, row0, block_q, block_kv)
    q_tile, p_tile = s.q.at[wg], (s.p.at[wg] if fp8 else None)
    plgpu.copy_gmem_to_smem(refs.q.at[batch, rows, head], q_tile, s.q_ready.at[wg])
    q_ids = None
    if geo.segmented:
      plgpu.copy_gmem_to_smem(refs.q_ids.at[batch, rows], s.q_ids.at[wg], s.q_ids_ready.at[wg])
      plgpu.barrier_wait(s.q_ids_ready.at[wg])
      q_ids = target.row_vector(s.q_ids.at[wg])
    plgpu.barrier_wait(s.q_ready.at[wg])
    # Scalars from array inputs: new descales never retrace the kernel.
    qk_scale, out_scale = refs.scales[0], refs.scales[1]
    if geo.block_scaled:
      qk_scale = qk_scale * refs.q_descale[batch, head, scale_block(row0)]
      out_scale = refs.out_scale[batch, kv_head]

    def step_scales(step):
      """(qk_scale, P's multiplier before its E4M3 rounding) of a key step."""
      if not geo.block_scaled:
        return qk_scale, P_SCALE
      key_block = scale_block(step * block_kv)
      return (qk_scale * refs.k_descale[batch, kv_head, key_block],
              P_SCALE * refs.v_ratio[batch, kv_head, key_block])

    row_layout = plgpu.Layout.WGMMA.reduce(1)
    m = target.layout(jnp.full((block_q,), -jnp.inf, jnp.float32), row_layout)
    l = target.layout(jnp.zeros((block_q,), jnp.float32), row_layout)
    acc = target.layout(jnp.zeros((block_q, head_dim), jnp.float32), plgpu.Layout.WGMMA)

    when(steps > 0, lambda: plgpu.barrier_wait(s.k_ready.at[0]))

    pl.when(wg == 1)(take_turn)  # warpgroup 0 issues its first wgmma first

    def softmax(step, logits, m, l, *, masked: bool):
      """(p, m, l, alpha) after key block `step`: p = 2**(s - m) of its logits, the
      running max and sum, and alpha = 2**(m_old - m), the factor for earlier blocks."""
      step_qk_scale, _ = step_scales(step)
      logits = logits * step_qk_scale
      if masked:
        kv_ids = None
        if geo.segmented:
          plgpu.barrier_wait(s.ids_ready.at[slot_of(step)])
          kv_ids = target.col_vector(s.kv_ids.at[slot_of(step)])
        visible = tile_visibility(geo, target, logits.shape, first_row=row0,
                                  first_col=step * block_kv, rows_are_queries=True,
                                  row_ids=q_ids, col_ids=kv_ids)
        logits = jnp.where(visible, logits, -jnp.inf)
        m_new, m_sub = masked_softmax_max(logits.max(axis=1), m)
      else:
        m_new = m_sub = jnp.maximum(m, logits.max(axis=1))
      alpha = jnp.exp2(m - m_sub)
      p = jnp.exp2(logits - lax.broadcast_in_dim(m_sub, logits.shape, [0]))
      return p, m_new, l * alpha + p.sum(axis=1), alpha

    def p_operand(step, p, tile):
      """P as P V's left operand: 16-bit registers, or (FP8) E4M3 in the SMEM `tile`."""
      if not fp8:
        return p.astype(refs.q.dtype)
      _, p_scale = step_scales(step)
      tile[...] = (p * p_scale).astype(E4M3)
      plgpu.commit_smem()
      return tile

    def rescaled(acc, alpha):
      return acc * lax.broadcast_in_dim(alpha, acc.shape, [0])

    def key_step(step, carry, *, masked: bool):
      acc, m, l = carry
      slot = slot_of(step)
      logits = target.mma(None, q_tile, s.k.at[slot], transpose_b=True,
                          shape=(block_q, block_kv), while_in_flight=take_turn)
      plgpu.barrier_arrive(s.k_free.at[slot])
      p, m, l, alpha = softmax(step, logits, m, l, masked=masked)
      acc = rescaled(acc, alpha)
      operand = p_operand(step, p, p_tile)
      arrive_turn()  # softmax done: the other warpgroup's wgmma may go
      plgpu.barrier_wait(s.v_ready.at[slot])
      wait_turn()    # the tensor cores are ours again

      def wait_next_k():
        @pl.when(step + 1 < steps)
        def _():
          plgpu.barrier_wait(s.k_ready.at[slot_of(step + 1)])
      acc = target.mma(acc, operand, s.v.at[slot], transpose_b=fp8,
                       while_in_flight=wait_next_k)
      plgpu.barrier_arrive(s.v_free.at[slot])
      return acc, m, l

    if blocks.overlap:
      acc, m, l = _overlapped_key_loop(
          (acc, m, l), steps=steps, unmasked_steps=unmasked_steps, masked_steps=(
              geo.causal or geo.segmented), softmax=softmax, p_operand=p_operand,
          rescaled=rescaled, q_tile=q_tile, p_tiles=s.p.at[wg] if fp8 else None, s=s,
          slot_of=slot_of, take_turn=take_turn, arrive_turn=arrive_turn,
          wait_turn=wait_turn, fp8=fp8, in_dtype=refs.q.dtype,
          shape=(block_q, block_kv), target=target)
    else:
      acc, m, l = lax.fori_loop(0, unmasked_steps, functools.partial(key_step, masked=False),
                                (acc, m, l))
      if geo.causal or geo.segmented:
        acc, m, l = lax.fori_loop(unmasked_steps, steps,
                                  functools.partial(key_step, masked=True), (acc, m, l))

    if geo.causal:
      def drain(step, _):
        # The producer streams the CTA's steps for the longer warpgroup; the shorter
        # one releases those slots and keeps the turn order. Waiting for tiles it
        # skips costs nothing and keeps every warpgroup's barrier phases in step.
        slot = slot_of(step)
        plgpu.barrier_wait(s.k_ready.at[slot])
        plgpu.barrier_wait(s.v_ready.at[slot])
        if geo.segmented:
          plgpu.barrier_wait(s.ids_ready.at[slot])
        plgpu.barrier_arrive(s.k_free.at[slot])
        plgpu.barrier_arrive(s.v_free.at[slot])
        take_turn()
        take_turn()
      lax.fori_loop(steps, cta_steps, drain, None)
    pl.when(wg == 0)(take_turn)

    # l == 0 only for a row that saw no key: output 0, lse -inf.
    o = acc * lax.broadcast_in_dim(jnp.where(l == 0.0, 0.0, out_scale / l), acc.shape, [0])
    s.o.at[wg][...] = o.astype(refs.out.dtype)
    s.lse.at[wg][...] = jnp.where(l == 0.0, -jnp.inf, m + jnp.log2(l))
    if fp8:
      s.amax.at[wg][...] = jnp.abs(o).max(axis=1)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(s.o.at[wg], refs.out.at[batch, rows, head])
    plgpu.copy_smem_to_gmem(s.lse.at[wg], refs.lse.at[batch, head, rows])
    if fp8:
      plgpu.copy_smem_to_gmem(s.amax.at[wg], refs.row_amax.at[batch, head, rows])
    plgpu.wait_smem_to_gmem(0)

  @pl.when(wg == COMPUTE_WGS)
  def _produce():
    plgpu.set_max_registers(40, action="decrease")

    def issue(step, slot):
      cols = pl.ds(step * block_kv, block_kv)
      plgpu.copy_gmem_to_smem(refs.k.at[batch, cols, kv_head], s.k.at[slot], s.k_ready.at[slot])
      v_tile = refs.v.at[batch, kv_head, :, cols] if fp8 else refs.v.at[batch, cols, kv_head]
      plgpu.copy_gmem_to_smem(v_tile, s.v.at[slot], s.v_ready.at[slot])
      if geo.segmented:
        plgpu.copy_gmem_to_smem(refs.kv_ids.at[batch, cols], s.kv_ids.at[slot],
                                s.ids_ready.at[slot])

    stream_tiles(cta_steps, stages, issue, lambda slot: [s.k_free.at[slot], s.v_free.at[slot]])


def _overlapped_key_loop(carry, *, steps, unmasked_steps, masked_steps: bool, softmax,
                         p_operand, rescaled, q_tile, p_tiles, s, slot_of, take_turn,
                         arrive_turn, wait_turn, fp8: bool, in_dtype, shape, target):
  """The key loop with FlashAttention-3's intra-warpgroup overlap (`blocks.overlap`).

  Step j issues S_j = Q K_j^T and then P_{j-1} V_{j-1} and runs block j's softmax while
  the second product is on the tensor cores; block j-1's P is kept for it (FP8: in the
  other of two SMEM tiles, so block j's may be written meanwhile). The first step has no
  P V before it and a last P V follows the loop. The ping-pong turns are the plain loop's:
  two per step, the first while S_j is in flight, the second once the softmax is done.
  `softmax`, `p_operand` and `rescaled` are the plain loop's pieces.
  """
  acc, m, l = carry
  block_q, block_kv = shape

  def tile(step):
    return p_tiles.at[lax.rem(step, jnp.int32(2))] if fp8 else None

  p_none = (target.layout(jnp.zeros(shape, in_dtype), plgpu.Layout.WGMMA) if not fp8
            else jnp.zeros((), jnp.float32))  # FP8: P lives in the SMEM tiles
  alpha_none = target.layout(jnp.zeros((block_q,), jnp.float32), plgpu.Layout.WGMMA.reduce(1))

  def first(step, carry, *, masked: bool):
    acc, m, l, _ = carry
    slot = slot_of(step)
    logits = target.mma(None, q_tile, s.k.at[slot], transpose_b=True, shape=shape,
                        while_in_flight=take_turn)
    plgpu.barrier_arrive(s.k_free.at[slot])
    p, m, l, alpha = softmax(step, logits, m, l, masked=masked)
    operand = p_operand(step, p, tile(step))
    arrive_turn()
    wait_turn()
    return rescaled(acc, alpha), m, l, operand if not fp8 else p_none

  def overlapped(step, carry, *, masked: bool):
    acc, m, l, p_prev = carry
    slot, prev = slot_of(step), slot_of(step - 1)
    plgpu.barrier_wait(s.k_ready.at[slot])
    plgpu.barrier_wait(s.v_ready.at[prev])

    def consume(logits, state):  # block `step`'s softmax, under P_{step-1} V_{step-1}
      m, l, _, _ = state
      plgpu.barrier_arrive(s.k_free.at[slot])
      p, m, l, alpha = softmax(step, logits, m, l, masked=masked)
      operand = p_operand(step, p, tile(step))
      arrive_turn()  # softmax done: the other warpgroup's wgmma may go
      return m, l, alpha, operand if not fp8 else p_none

    acc, (m, l, alpha, p_next) = target.overlapped_mma(
        shape, q_tile, s.k.at[slot], acc, p_prev if not fp8 else tile(step - 1), s.v.at[prev],
        transpose_d=fp8, while_in_flight=take_turn, consume=consume,
        state=(m, l, alpha_none, p_none))
    plgpu.barrier_arrive(s.v_free.at[prev])
    wait_turn()    # the tensor cores are ours again
    return rescaled(acc, alpha), m, l, p_next

  def last(_, carry):
    acc, m, l, p_prev = carry
    prev = slot_of(steps - 1)
    plgpu.barrier_wait(s.v_ready.at[prev])
    acc = target.mma(acc, p_prev if not fp8 else tile(steps - 1), s.v.at[prev], transpose_b=fp8)
    plgpu.barrier_arrive(s.v_free.at[prev])
    return acc, m, l, p_prev

  def smaller(a, b):  # Python ints stay static loop bounds
    return min(a, b) if isinstance(a, int) and isinstance(b, int) else jnp.minimum(a, b)

  def larger(a, b):
    return max(a, b) if isinstance(a, int) and isinstance(b, int) else jnp.maximum(a, b)

  one = smaller(steps, 1)  # step 0 runs when there is a key block at all
  carry = (acc, m, l, p_none)
  # Step 0 is masked like any step past unmasked_steps (0 of them with segment ids).
  carry = lax.fori_loop(0, smaller(one, unmasked_steps), functools.partial(
      first, masked=False), carry)
  if masked_steps:
    carry = lax.fori_loop(smaller(one, unmasked_steps), one, functools.partial(
        first, masked=True), carry)
  carry = lax.fori_loop(one, larger(unmasked_steps, one), functools.partial(
      overlapped, masked=False), carry)
  if masked_steps:
    carry = lax.fori_loop(larger(unmasked_steps, one), steps, functools.partial(
        overlapped, masked=True), carry)
  acc, m, l, _ = lax.fori_loop(0, one, last, carry)
  return acc, m, l


@functools.partial(jax.jit, static_argnames=("geo", "blocks", "interpret"))
def forward(q, k, v, scales, q_ids, kv_ids, block_scales=None, *, geo: AttentionGeometry,
            blocks: HopperAttentionBlockSizes, interpret):
  """Runs the kernel on checked inputs (see `pallas_kernels.hopper_attention`).

  Args:
    q: [batch, q_len, heads, D], bf16/f16 or E4M3; k: [batch, kv_len, kv_heads, D].
    v: 16-bit: [batch, kv_len, kv_heads, D]; E4M3: V^T, [batch, kv_heads, D, kv_len].
    scales: float32 [2]: qk_scale (base 2, per-tensor descales folded in) and out_scale
      (unused when block-scaled).
    q_ids, kv_ids: int32 [batch, q_len] / [batch, kv_len] segment ids, or None.
    block_scales: None, or (when `geo.block_scaled`) float32 (q_descale [batch, heads,
      q_len / SCALE_BLOCK], k_descale and v_ratio [batch, kv_heads, kv_len / SCALE_BLOCK],
      out_scale [batch, kv_heads]): see the module docstring.
    geo, blocks: static shape and tiles; interpret: see `mosaic_target.interpret_params`.

  Returns:
    (out [batch, q_len, heads, D] (q's dtype; bf16 for E4M3), lse2 float32 [batch, heads,
    q_len] (base 2), row_amax float32 [batch, heads, q_len] (E4M3 only, else None)).
  """
  fp8 = q.dtype == E4M3
  params = interpret_params(interpret)
  target = MosaicTarget(interpret=params is not None)
  block_q, block_kv, head_dim = blocks.block_q, blocks.block_kv, geo.head_dim
  stages = min(blocks.num_stages, geo.kv_len // block_kv)
  out_dtype = jnp.bfloat16 if fp8 else q.dtype
  in_dtype = q.dtype

  def smem(shape, dtype, minor=None):
    return plgpu.SMEM(shape, dtype, transforms=swizzle_transforms(minor or shape[-1], dtype))

  scratch = dict(
      q=smem((COMPUTE_WGS, block_q, head_dim), in_dtype),
      k=smem((stages, block_kv, head_dim), in_dtype),
      v=(smem((stages, head_dim, block_kv), in_dtype) if fp8
         else smem((stages, block_kv, head_dim), in_dtype)),
      o=smem((COMPUTE_WGS, block_q, head_dim), out_dtype),
      lse=plgpu.SMEM((COMPUTE_WGS, block_q), jnp.float32),
      q_ready=plgpu.Barrier(num_barriers=COMPUTE_WGS),
      k_ready=plgpu.Barrier(num_barriers=stages),
      v_ready=plgpu.Barrier(num_barriers=stages),
      k_free=plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=stages),
      v_free=plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=stages),
      turn=plgpu.Barrier(num_arrivals=COMPUTE_WGS),
  )
  if fp8:
    # Two P tiles per warpgroup with the overlap: block j's is written while block
    # j-1's is read.
    p_tiles = (COMPUTE_WGS, 2) if blocks.overlap else (COMPUTE_WGS,)
    scratch.update(p=smem((*p_tiles, block_q, block_kv), E4M3),
                   amax=plgpu.SMEM((COMPUTE_WGS, block_q), jnp.float32))
  if geo.segmented:
    scratch.update(q_ids=plgpu.SMEM((COMPUTE_WGS, block_q), jnp.int32),
                   kv_ids=plgpu.SMEM((stages, block_kv), jnp.int32),
                   q_ids_ready=plgpu.Barrier(num_barriers=COMPUTE_WGS),
                   ids_ready=plgpu.Barrier(num_barriers=stages))

  block_names = ("q_descale", "k_descale", "v_ratio", "out_scale")
  in_names = (("q", "k", "v", "scales") + (("q_ids", "kv_ids") if geo.segmented else ())
              + (block_names if geo.block_scaled else ()))
  out_names = ("out", "lse") + (("row_amax",) if fp8 else ())
  row_stats = jax.ShapeDtypeStruct((geo.batch, geo.heads, geo.q_len), jnp.float32)
  out_types = (jax.ShapeDtypeStruct(q.shape, out_dtype), row_stats) + ((row_stats,) if fp8
                                                                        else ())

  def entry(*refs):
    named = types.SimpleNamespace(**dict(zip(in_names + out_names, refs)))
    pl.run_scoped(
        lambda **allocated: _forward_cta(named, types.SimpleNamespace(**allocated), geo=geo,
                                         blocks=blocks, fp8=fp8, stages=stages, target=target),
        collective_axes="wg", **scratch)

  inputs = ((q, k, v, scales) + ((q_ids, kv_ids) if geo.segmented else ())
            + (tuple(block_scales) if geo.block_scaled else ()))
  outputs = plgpu.kernel(
      entry,
      out_type=out_types,
      grid=(geo.heads, geo.q_len // (COMPUTE_WGS * block_q), geo.batch),
      grid_names=("heads", "q_tiles", "batch"),
      num_threads=COMPUTE_WGS + 1,
      thread_name="wg",
      compiler_params=plgpu.CompilerParams(approx_math=True),
      interpret=params,
  )(*inputs)
  return outputs if fp8 else (*outputs, None)
