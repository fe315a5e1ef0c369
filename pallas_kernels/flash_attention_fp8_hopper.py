"""FP8 (E4M3) flash-attention forward for Hopper, on the Mosaic GPU Pallas backend.

Why Mosaic GPU and not the Triton-lowered Pallas backend: on jax 0.10.2 the
Triton lowering emits `tt.dot` without `max_num_imprecise_acc`, and Triton
refuses its Hopper MMA (wgmma) for f8 operands with an f32 accumulator in that
case; the dot falls back to `mma.sync ... f16.f16` with the f8 operands upcast
(see pallas_kernels/NOTES.md). Mosaic GPU issues `wgmma.mma_async ... e4m3.e4m3`
directly when both wgmma operands are K-major in shared memory:

  S = Q K^T   A = Q tile [block_q, D] (D contiguous), B = K tile [block_kv, D]
              viewed transposed: K-major as stored.
  O += P V    A = P [block_q, block_kv], quantized to E4M3 and staged in shared
              memory; B = V^T tile [D, block_kv] viewed transposed: K-major only
              because the caller passes V already transposed (`transpose_v`).

The kernel follows the FlashAttention-3 structure: per CTA two compute
warpgroups (block_q query rows each) and one producer warpgroup that streams
K and V^T tiles by TMA through a ring of `num_stages` shared-memory slots; the
two compute warpgroups ping-pong so one's softmax overlaps the other's wgmma.

Numerics (per query row, online softmax in f32, base 2):
  s_j   = (q . k_j) * descale_q * descale_k * sm_scale * log2(e)
  m     = running max of s_j;  p_j = 2^(s_j - m);  l = running sum of p_j
  p8_j  = e4m3(p_j * P_SCALE)            (p_j <= 1, so no saturation is needed)
  acc  += p8 @ v8                        (FP8 wgmma, f32 accumulator)
  o     = acc * descale_v / (P_SCALE * l), returned as bfloat16,
  out_amax = max |o| over the whole output (of the bfloat16 values).

Only the forward pass is here. It compiles for sm_90a without a GPU
(`fp8jax.deviceless`), which is how the tests check that both dots are FP8
wgmma. Mosaic GPU's CPU interpreter (jax 0.10.2) does not support transposed
wgmma operands, so the kernel's numerics can only be checked on a Hopper GPU;
`flash_attention_fp8_reference` is the plain-jnp model to compare against.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
from jax import lax
import jax.numpy as jnp

# P_SCALE: the fixed scale of the softmax probabilities' E4M3 cast (a power of
# two below E4M3's max), the same in both attention kernels.
from pallas_kernels.flash_attention import P_SCALE
from pallas_kernels.mosaic_target import MosaicTarget, interpret_params

try:  # The Mosaic GPU Pallas backend; absent from some jaxlib builds.
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import mosaic_gpu as plgpu
except ImportError:  # pragma: no cover - depends on the installed jaxlib
  pl = None
  plgpu = None

_FP8 = jnp.float8_e4m3fn
_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)
_COMPUTE_WGS = 2  # compute warpgroups per CTA; a third one issues the TMA copies


@dataclasses.dataclass(frozen=True)
class HopperBlockSizes:
  """Tile sizes of the FP8 forward kernel (hashable: a static argument of `jit`).

  Attributes:
    block_q: query rows per compute warpgroup; a CTA handles `2 * block_q` rows.
      A multiple of 64 (the wgmma M).
    block_kv: key/value rows per inner step. A multiple of 64; 128 gives the P
      and V^T tiles 128-byte rows (the widest shared-memory swizzle).
    num_stages: depth of the K / V^T shared-memory ring (>= 2).
  """
  block_q: int = 64
  block_kv: int = 128
  num_stages: int = 2

  def __post_init__(self):
    if self.block_q % 64 or self.block_q <= 0:
      raise ValueError(f"block_q={self.block_q} must be a positive multiple of 64 "
                       "(the wgmma M dimension).")
    if self.block_kv % 64 or self.block_kv <= 0 or self.block_kv > 256:
      raise ValueError(f"block_kv={self.block_kv} must be a multiple of 64 in [64, 256] "
                       "(it is the wgmma N of Q K^T and the K of P V).")
    if self.num_stages < 2:
      raise ValueError(f"num_stages={self.num_stages} must be at least 2 to overlap "
                       "the TMA copies with compute.")


def transpose_v(v: jax.Array) -> jax.Array:
  """V [batch, seq, heads, head_dim] -> V^T [batch, heads, head_dim, seq].

  FP8 wgmma reads both operands K-major; in P @ V the contraction runs over the
  sequence, so the kernel needs V with the sequence axis contiguous. Produce it
  once where V is produced (e.g. fused into the QKV projection's epilogue), not
  per attention call, if the transpose shows up in a profile.
  """
  if v.ndim != 4:
    raise ValueError(f"v must be [batch, seq, heads, head_dim]; got shape {v.shape}.")
  return jnp.transpose(v, (0, 2, 3, 1))


def _swizzle_transforms(minor_dim_elems: int, dtype) -> tuple:
  """Tiling + swizzle for a shared-memory tile whose rows hold `minor_dim_elems` elements."""
  row_bytes = minor_dim_elems * jnp.dtype(dtype).itemsize
  swizzle = next((s for s in (128, 64, 32) if row_bytes % s == 0), None)
  if swizzle is None:
    raise ValueError(f"A {minor_dim_elems}-element row of {jnp.dtype(dtype).name} is "
                     f"{row_bytes} bytes; wgmma tiles need a multiple of 32 bytes.")
  return (plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)),
          plgpu.SwizzleTransform(swizzle))


def _check_inputs(q, k, v_t, causal: bool, block_sizes: HopperBlockSizes):
  for name, x in (("q", q), ("k", k), ("v_t", v_t)):
    if x.ndim != 4:
      raise ValueError(f"{name} must be 4-D; got shape {x.shape}.")
    if x.dtype != _FP8:
      raise ValueError(f"{name} must be float8_e4m3fn (quantize it with its scale first); "
                       f"got {x.dtype}.")
  batch, q_len, num_heads, head_dim = q.shape
  kv_len, num_kv_heads = k.shape[1], k.shape[2]
  if k.shape != (batch, kv_len, num_kv_heads, head_dim):
    raise ValueError(f"k must be [batch, kv_seq, kv_heads, head_dim] = "
                     f"[{batch}, *, *, {head_dim}] to match q {q.shape}; got {k.shape}.")
  if v_t.shape != (batch, num_kv_heads, head_dim, kv_len):
    raise ValueError(f"v_t must be V transposed to [batch, kv_heads, head_dim, kv_seq] = "
                     f"{(batch, num_kv_heads, head_dim, kv_len)}; got {v_t.shape}. "
                     "Use transpose_v(v).")
  if num_heads % num_kv_heads:
    raise ValueError(f"q heads ({num_heads}) must be a multiple of kv heads ({num_kv_heads}).")
  if head_dim not in (64, 128):
    # 256 would need ~243 KB of shared memory with these tiles (the limit is 227 KB).
    raise ValueError(f"head_dim={head_dim} is not supported; use 64 or 128.")
  rows_per_cta = _COMPUTE_WGS * block_sizes.block_q
  if q_len % rows_per_cta:
    raise ValueError(f"q seq length {q_len} must be a multiple of 2 * block_q = "
                     f"{rows_per_cta}; pad it or pick a smaller block_q.")
  if kv_len % block_sizes.block_kv:
    raise ValueError(f"kv seq length {kv_len} must be a multiple of block_kv = "
                     f"{block_sizes.block_kv}; pad it (with a mask) or change block_kv.")
  if causal and q_len != kv_len:
    raise ValueError(f"causal=True needs equal q and kv lengths; got {q_len} and {kv_len}.")


def _forward_kernel(q_ref, k_ref, vt_ref, scales_ref, out_ref, row_amax_ref, row_lse_ref,
                    scoped, *,
                    block_sizes: HopperBlockSizes, causal: bool, head_dim: int, kv_len: int,
                    q_heads_per_kv_head: int, target: MosaicTarget):
  """Body of one CTA: 2 * block_q query rows of one (batch, head)."""
  block_q, block_kv = block_sizes.block_q, block_sizes.block_kv
  num_stages = min(block_sizes.num_stages, kv_len // block_kv)
  (q_smem2, p_smem2, o_smem2, amax_smem2, lse_smem2, k_smem, vt_smem), ready, consumed, turn = (
      scoped)
  k_ready, vt_ready, q_ready = ready
  k_consumed, vt_consumed = consumed
  batch = lax.axis_index("batch")
  q_head = lax.axis_index("heads")
  wg = lax.axis_index("wg")
  cta_q_base = lax.axis_index("q_tiles") * (_COMPUTE_WGS * block_q)

  if causal:  # KV steps the CTA's last (lowest) query row needs.
    cta_kv_steps = pl.cdiv(cta_q_base + _COMPUTE_WGS * block_q, jnp.array(block_kv, jnp.int32))
  else:
    cta_kv_steps = kv_len // block_kv

  def take_turn():
    # Ping-pong between the two compute warpgroups: each arrives and waits on
    # the shared barrier, so one issues wgmma while the other does softmax.
    plgpu.barrier_arrive(turn)
    plgpu.barrier_wait(turn)

  @pl.when(wg < _COMPUTE_WGS)
  def _compute():
    plgpu.set_max_registers(232, action="increase")
    q_smem, p_smem, o_smem = q_smem2.at[wg], p_smem2.at[wg], o_smem2.at[wg]
    amax_smem, lse_smem = amax_smem2.at[wg], lse_smem2.at[wg]
    q_base = cta_q_base + wg * block_q
    kv_steps = (pl.cdiv(q_base + block_q, jnp.array(block_kv, jnp.int32))
                if causal else cta_kv_steps)

    plgpu.copy_gmem_to_smem(q_ref.at[batch, pl.ds(q_base, block_q), q_head], q_smem,
                            q_ready.at[wg])
    plgpu.barrier_wait(q_ready.at[wg])
    # Scalars from an array input, so new scale values never retrace the kernel.
    qk_scale_log2 = scales_ref[0]   # descale_q * descale_k * sm_scale * log2(e)
    out_scale = scales_ref[1]       # descale_v / P_SCALE

    row_layout = plgpu.Layout.WGMMA.reduce(1)
    m_i = target.layout(jnp.full((block_q,), -jnp.inf, jnp.float32), row_layout)
    l_i = target.layout(jnp.full((block_q,), 0.0, jnp.float32), row_layout)
    acc = target.layout(jnp.zeros((block_q, head_dim), jnp.float32), plgpu.Layout.WGMMA)

    @pl.when(kv_steps > 0)
    def _():
      plgpu.barrier_wait(k_ready.at[0])

    pl.when(wg == 1)(take_turn)  # warpgroup 0 issues its first wgmma first

    def kv_step_body(kv_step, carry, *, masked: bool):
      acc, m_i, l_i = carry
      slot = lax.rem(kv_step, jnp.array(num_stages, kv_step.dtype))

      s = target.mma(None, q_smem, k_smem.at[slot], transpose_b=True,
                     shape=(block_q, block_kv), while_in_flight=take_turn)
      plgpu.barrier_arrive(k_consumed.at[slot])

      s = s * qk_scale_log2
      if masked:
        q_ids = target.iota(s.shape, 0)
        kv_ids = target.iota(s.shape, 1)
        s = jnp.where(q_ids + q_base >= kv_ids + kv_step * block_kv, s, -jnp.inf)
      # Step 0 always holds key 0, which no query row masks, so m_i is finite
      # from the first step on and exp2(m_i - m_new) never sees inf - inf.
      m_new = jnp.maximum(m_i, s.max(axis=1))
      alpha = jnp.exp2(m_i - m_new)
      p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
      l_i = l_i * alpha + p.sum(axis=1)
      acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
      # P goes to shared memory as E4M3: an f8 wgmma A operand in registers needs
      # the 8-bit register layout, which Mosaic GPU cannot relayout into from the
      # accumulator layout (jax 0.10.2), so the A operand comes from SMEM.
      p_smem[...] = (p * P_SCALE).astype(_FP8)
      plgpu.commit_smem()
      plgpu.barrier_arrive(turn)  # softmax done: let the other warpgroup's wgmma in
      plgpu.barrier_wait(vt_ready.at[slot])
      plgpu.barrier_wait(turn)

      def wait_next_k():
        next_step = kv_step + 1
        next_slot = lax.rem(next_step, jnp.array(num_stages, kv_step.dtype))

        @pl.when(next_step < kv_steps)
        def _():
          plgpu.barrier_wait(k_ready.at[next_slot])
      acc = target.mma(acc, p_smem, vt_smem.at[slot], transpose_b=True,
                       while_in_flight=wait_next_k)
      plgpu.barrier_arrive(vt_consumed.at[slot])
      return acc, m_new, l_i

    carry = (acc, m_i, l_i)
    if not causal:
      carry = lax.fori_loop(0, kv_steps, functools.partial(kv_step_body, masked=False), carry)
    else:
      # Blocks entirely below the diagonal need no mask; the rest do.
      unmasked_steps = lax.div(q_base, jnp.array(block_kv, jnp.int32))
      carry = lax.fori_loop(0, unmasked_steps,
                            functools.partial(kv_step_body, masked=False), carry)
      carry = lax.fori_loop(unmasked_steps, kv_steps,
                            functools.partial(kv_step_body, masked=True), carry)

      def drain(kv_step, _):
        # The producer streams the CTA's steps for the longer warpgroup; the
        # shorter one still has to release those slots and keep the turn order.
        slot = lax.rem(kv_step, jnp.array(num_stages, kv_step.dtype))
        # Waiting for tiles this warpgroup skips costs nothing on the GPU and keeps
        # every warpgroup's barrier phases in step (the interpreter checks that).
        plgpu.barrier_wait(k_ready.at[slot])
        plgpu.barrier_wait(vt_ready.at[slot])
        plgpu.barrier_arrive(k_consumed.at[slot])
        plgpu.barrier_arrive(vt_consumed.at[slot])
        take_turn()
        take_turn()
      lax.fori_loop(kv_steps, cta_kv_steps, drain, None)
    acc, m_i, l_i = carry
    pl.when(wg == 0)(take_turn)

    o = acc * lax.broadcast_in_dim(out_scale / l_i, acc.shape, [0])
    o_smem[...] = o.astype(out_ref.dtype)
    amax_smem[...] = jnp.abs(o).max(axis=1)
    # Natural-log log-sum-exp of the row's scaled logits, for the backward pass:
    # sum_j exp(logit_j) = 2**m_i * l_i in the kernel's base-2 domain.
    lse_smem[...] = (m_i + jnp.log2(l_i)) * _LN2
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, out_ref.at[batch, pl.ds(q_base, block_q), q_head])
    plgpu.copy_smem_to_gmem(amax_smem, row_amax_ref.at[batch, q_head, pl.ds(q_base, block_q)])
    plgpu.copy_smem_to_gmem(lse_smem, row_lse_ref.at[batch, q_head, pl.ds(q_base, block_q)])
    plgpu.wait_smem_to_gmem(0)

  @pl.when(wg == _COMPUTE_WGS)
  def _produce():
    plgpu.set_max_registers(40, action="decrease")
    kv_head = lax.div(q_head, jnp.array(q_heads_per_kv_head, q_head.dtype))

    def issue(step, slot):
      kv_rows = pl.ds(step * block_kv, block_kv)
      plgpu.copy_gmem_to_smem(k_ref.at[batch, kv_rows, kv_head], k_smem.at[slot],
                              k_ready.at[slot])
      plgpu.copy_gmem_to_smem(vt_ref.at[batch, kv_head, :, kv_rows], vt_smem.at[slot],
                              vt_ready.at[slot])

    for slot in range(num_stages):
      if causal:  # The first CTAs may need fewer steps than there are slots.
        pl.when(slot < cta_kv_steps)(functools.partial(issue, slot, slot))
      else:
        issue(slot, slot)

    @pl.loop(0, jnp.maximum(cta_kv_steps - num_stages, 0))
    def _(step):
      slot = lax.rem(step, jnp.array(num_stages, step.dtype))
      plgpu.barrier_wait(k_consumed.at[slot])
      plgpu.barrier_wait(vt_consumed.at[slot])
      issue(step + num_stages, slot)

    # Observe the last releases too, so no barrier phase is left pending when the
    # CTA's shared memory goes away.
    @pl.loop(jnp.maximum(cta_kv_steps - num_stages, 0), cta_kv_steps)
    def _(step):
      slot = lax.rem(step, jnp.array(num_stages, step.dtype))
      plgpu.barrier_wait(k_consumed.at[slot])
      plgpu.barrier_wait(vt_consumed.at[slot])


@functools.partial(jax.jit, static_argnames=("causal", "block_sizes", "interpret"))
def _forward(q, k, v_t, scales, *, causal: bool, block_sizes: HopperBlockSizes, interpret):
  batch, q_len, num_heads, head_dim = q.shape
  kv_len, num_kv_heads = k.shape[1], k.shape[2]
  block_q, block_kv = block_sizes.block_q, block_sizes.block_kv
  num_stages = min(block_sizes.num_stages, kv_len // block_kv)

  qk_transforms = _swizzle_transforms(head_dim, _FP8)
  pv_transforms = _swizzle_transforms(block_kv, _FP8)
  o_transforms = _swizzle_transforms(head_dim, jnp.bfloat16)
  scratch = (
      plgpu.SMEM((_COMPUTE_WGS, block_q, head_dim), _FP8, transforms=qk_transforms),
      plgpu.SMEM((_COMPUTE_WGS, block_q, block_kv), _FP8, transforms=pv_transforms),
      plgpu.SMEM((_COMPUTE_WGS, block_q, head_dim), jnp.bfloat16, transforms=o_transforms),
      plgpu.SMEM((_COMPUTE_WGS, block_q), jnp.float32),
      plgpu.SMEM((_COMPUTE_WGS, block_q), jnp.float32),
      plgpu.SMEM((num_stages, block_kv, head_dim), _FP8, transforms=qk_transforms),
      plgpu.SMEM((num_stages, head_dim, block_kv), _FP8, transforms=pv_transforms),
  )
  barriers = (
      (plgpu.Barrier(num_barriers=num_stages),       # K slot filled
       plgpu.Barrier(num_barriers=num_stages),       # V^T slot filled
       plgpu.Barrier(num_barriers=_COMPUTE_WGS)),    # Q tile filled
      (plgpu.Barrier(num_arrivals=_COMPUTE_WGS, num_barriers=num_stages),) * 2,  # slot free
      plgpu.Barrier(num_arrivals=_COMPUTE_WGS),      # ping-pong turn
  )
  body = functools.partial(
      _forward_kernel, block_sizes=block_sizes, causal=causal, head_dim=head_dim,
      kv_len=kv_len, q_heads_per_kv_head=num_heads // num_kv_heads,
      target=MosaicTarget(interpret=interpret_params(interpret) is not None))

  def entry(q_ref, k_ref, vt_ref, scales_ref, out_ref, row_amax_ref, row_lse_ref):
    pl.run_scoped(
        lambda *scoped: body(q_ref, k_ref, vt_ref, scales_ref, out_ref, row_amax_ref,
                             row_lse_ref, scoped),
        scratch, *barriers, collective_axes="wg")

  out, row_amax, row_lse = plgpu.kernel(
      entry,
      out_type=(jax.ShapeDtypeStruct(q.shape, jnp.bfloat16),
                # seq minor, so each warpgroup's block_q row maxima are one 1-D TMA.
                jax.ShapeDtypeStruct((batch, num_heads, q_len), jnp.float32),
                jax.ShapeDtypeStruct((batch, num_heads, q_len), jnp.float32)),
      grid=(num_heads, q_len // (_COMPUTE_WGS * block_q), batch),
      grid_names=("heads", "q_tiles", "batch"),
      num_threads=_COMPUTE_WGS + 1,
      thread_name="wg",
      compiler_params=plgpu.CompilerParams(approx_math=True),
      interpret=interpret_params(interpret),
  )(q, k, v_t, scales)
  # Rounding to bfloat16 is monotonic, so the max of the rounded output is the
  # rounded max of the f32 values the kernel saw.
  out_amax = jnp.max(row_amax).astype(jnp.bfloat16).astype(jnp.float32)
  return out, out_amax, row_lse


def flash_attention_fp8(q: jax.Array, k: jax.Array, v_t: jax.Array,
                        descale_q: jax.Array, descale_k: jax.Array, descale_v: jax.Array,
                        *, causal: bool = False, sm_scale: float | jax.Array | None = None,
                        block_sizes: HopperBlockSizes = HopperBlockSizes(), return_lse: bool = False,
                        interpret=False) -> tuple[jax.Array, ...]:
  """FP8 flash-attention forward on Hopper FP8 tensor cores (Mosaic GPU).

  Args:
    q: float8_e4m3fn [batch, q_seq, heads, head_dim]; head_dim 64 or 128, q_seq a
      multiple of 2 * block_sizes.block_q.
    k: float8_e4m3fn [batch, kv_seq, kv_heads, head_dim]; heads % kv_heads == 0 and
      kv_seq a multiple of block_sizes.block_kv.
    v_t: float8_e4m3fn [batch, kv_heads, head_dim, kv_seq], i.e. `transpose_v(v)`.
    descale_q, descale_k, descale_v: float32 scalars (shape () or (1,)) that
      dequantize each input (x ~= x8 * descale, i.e. 1 / the quantization scale).
      Arrays, so new values do not recompile.
    causal: mask keys after each query (needs q_seq == kv_seq).
    sm_scale: softmax scale; defaults to 1 / sqrt(head_dim).
    block_sizes: tile sizes (static).
    interpret: False compiles for the GPU; True (or interpreter parameters, e.g.
      with race detection) runs the kernel in Mosaic GPU's CPU interpreter.

  Returns:
    (out, out_amax): out bfloat16 [batch, q_seq, heads, head_dim]; out_amax a
    float32 scalar, max |out|, for the next FP8 cast of the output. With
    `return_lse=True`, (out, out_amax, lse) where lse is float32 [batch, heads,
    q_seq], the natural-log log-sum-exp of each row's scaled logits (what the
    Pallas backward kernels recompute P from).
  """
  if plgpu is None:
    raise ImportError("flash_attention_fp8 needs jax.experimental.pallas.mosaic_gpu, which "
                      "this jax/jaxlib does not provide; install a CUDA jaxlib >= 0.10.2.")
  _check_inputs(q, k, v_t, causal, block_sizes)
  if sm_scale is None:
    sm_scale = 1.0 / math.sqrt(q.shape[-1])
  descales = [jnp.asarray(d, jnp.float32).reshape(()) for d in (descale_q, descale_k, descale_v)]
  scales = jnp.stack([descales[0] * descales[1] * jnp.float32(sm_scale) * _LOG2E,
                      descales[2] / P_SCALE])
  out, out_amax, lse = _forward(q, k, v_t, scales, causal=causal, block_sizes=block_sizes,
                                interpret=interpret)
  return (out, out_amax, lse) if return_lse else (out, out_amax)


def flash_attention_fp8_reference(q: jax.Array, k: jax.Array, v: jax.Array,
                                  descale_q: jax.Array, descale_k: jax.Array,
                                  descale_v: jax.Array, *, causal: bool = False,
                                  sm_scale: float | jax.Array | None = None,
                                  ) -> tuple[jax.Array, jax.Array]:
  """Plain-jnp attention on the dequantized FP8 inputs, in float32.

  Independent of the kernel: V in its natural [batch, kv_seq, kv_heads, head_dim]
  layout, a full (not online) softmax, and P kept in float32 (the kernel rounds
  P to E4M3, which a comparison's tolerance has to allow for).

  Returns:
    (out, out_amax) like `flash_attention_fp8`: out bfloat16, out_amax float32.
  """
  batch, q_len, num_heads, head_dim = q.shape
  kv_len, num_kv_heads = k.shape[1], k.shape[2]
  if sm_scale is None:
    sm_scale = 1.0 / math.sqrt(head_dim)
  qf = q.astype(jnp.float32) * jnp.asarray(descale_q, jnp.float32).reshape(())
  kf = k.astype(jnp.float32) * jnp.asarray(descale_k, jnp.float32).reshape(())
  vf = v.astype(jnp.float32) * jnp.asarray(descale_v, jnp.float32).reshape(())
  group = num_heads // num_kv_heads
  qf = qf.reshape(batch, q_len, num_kv_heads, group, head_dim)
  logits = jnp.einsum("bqhgd,bkhd->bhgqk", qf, kf,
                      precision=lax.Precision.HIGHEST) * sm_scale
  if causal:
    mask = jnp.arange(q_len)[:, None] >= jnp.arange(kv_len)[None, :]
    logits = jnp.where(mask, logits, -jnp.inf)
  weights = jax.nn.softmax(logits, axis=-1)
  out = jnp.einsum("bhgqk,bkhd->bqhgd", weights, vf, precision=lax.Precision.HIGHEST)
  out = out.reshape(batch, q_len, num_heads, head_dim).astype(jnp.bfloat16)
  return out, jnp.max(jnp.abs(out.astype(jnp.float32)))
