"""The Hopper FP8 attention kernels' arithmetic in plain jnp: forward and backward together.

`hopper_fp8_attention_reference` rounds what the kernels round, where they round it
(`hopper_attention_forward` and `hopper_attention_backward` say why):

  forward   S = q8 k8^T times the descales, P = 2**(S - running max) per 128 keys,
            E4M3(P * 256 [* r]) for P V, bf16 output (`flash_attention.fp8_forward_reference`);
  backward  dO in E4M3 with its own current scale (`quantize_gradient`); delta = dO8 . O
            from the bf16 output; P = 2**(S - lse2) recomputed in float32;
            dP = dO8 V8^T times the descales; dV = E4M3(P * 256)^T dO8; dS = P (dP - delta)
            rounded to bf16; dQ = dS K16, dK = dS^T Q16 with K16, Q16 the bf16 copies the
            kernels read (exact E4M3 values per tensor, dequantized per block).

Products are float32 at HIGHEST precision (exact for E4M3 operands) where the GPU's FP8
`wgmma` keeps fewer bits; the kernels' approximate exp2 is exact here. So on a GPU the
kernels differ from this by their accumulators' and exp2's errors; in Mosaic GPU's CPU
interpreter by float32 summation order only. Any sequence length and head_dim run (the
kernels' tiles do not matter to the arithmetic beyond the 128-key running max).
"""
from __future__ import annotations

import math

import jax
from jax import lax
import jax.numpy as jnp

from pallas_kernels.flash_attention import (BlockSizes, _reference_mask, block_descale_rows,
                                            fp8_forward_reference)
from pallas_kernels.hopper_attention import quantize_gradient
from pallas_kernels.hopper_attention_tiling import E4M3, LOG2E, P_SCALE, safe_lse


def hopper_fp8_attention_reference(
    q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, descale_q, descale_k, descale_v,
    *, causal: bool = False, sm_scale: float | None = None,
    q_segment_ids: jax.Array | None = None, kv_segment_ids: jax.Array | None = None,
    g_descale=None) -> tuple[jax.Array, ...]:
  """(out, lse2, dq, dk, dv) as `hopper_fp8_attention_forward` / `_backward` compute them.

  Args:
    q, k, v, descale_*, causal, sm_scale, q_segment_ids, kv_segment_ids: as for
      `hopper_fp8_attention_forward` (descales per tensor or per 128-row block).
    g: the output's cotangent, any float dtype; or E4M3 with `g_descale` given (as for
      `hopper_fp8_attention_backward`).

  Returns:
    out, dq [batch, q_len, heads, D] and dk, dv [batch, kv_len, kv_heads, D] in bf16;
    lse2 float32 [batch, heads, q_len] (base 2, -inf for a row that sees no key).
  """
  batch, q_len, heads, head_dim = q.shape
  kv_len, kv_heads = k.shape[1], k.shape[2]
  group = heads // kv_heads
  sm_scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale
  descales = (descale_q, descale_k, descale_v)
  forward = fp8_forward_reference(
      q, k, v, descale_q=descale_q, descale_k=descale_k, descale_v=descale_v,
      q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids, causal=causal,
      sm_scale=sm_scale, block_sizes=BlockSizes(block_kv=128))
  lse2 = forward.lse * LOG2E
  if g_descale is None:
    g8, g_descale = quantize_gradient(g)
  else:
    g8 = g
  rows = block_descale_rows(descales, q, k)
  if rows is None:  # per tensor: scalars; the bf16 copies of q and k are exact
    dq_, dk_, dv_ = (jnp.reshape(jnp.asarray(d, jnp.float32), ()) for d in descales)
    q16, k16 = q.astype(jnp.bfloat16), k.astype(jnp.bfloat16)
    logit = jnp.float32(sm_scale * LOG2E) * dq_ * dk_
    dp_scale, dq_scale, dk_scale = g_descale * dv_, dk_ * sm_scale, dq_ * sm_scale
  else:  # per block: [b, heads, rows] and [b, kv_heads, rows]; dequantized bf16 copies
    dq_, dk_, dv_ = rows
    q16 = (q.astype(jnp.float32) * jnp.swapaxes(dq_, 1, 2)[..., None]).astype(jnp.bfloat16)
    k16 = (k.astype(jnp.float32) * jnp.swapaxes(dk_, 1, 2)[..., None]).astype(jnp.bfloat16)
    logit = (jnp.float32(sm_scale * LOG2E) * dq_.reshape(batch, kv_heads, group, q_len, 1)
             ) * dk_[:, :, None, None, :]
    dp_scale = (g_descale * dv_)[:, :, None, None, :]
    dq_scale = dk_scale = jnp.float32(sm_scale)

  def grouped(x):  # [b, q_len, heads, D] -> [b, q_len, kv_heads, group, D]
    return x.reshape(batch, q_len, kv_heads, group, head_dim)

  def dot(spec, a, b):
    return jnp.einsum(spec, a, b, precision=lax.Precision.HIGHEST,
                      preferred_element_type=jnp.float32)

  gf = g8.astype(jnp.float32)
  # [b, kv_heads, group, q]: delta from the bf16 output and the dequantized dO8.
  delta = jnp.einsum("bqhgd,bqhgd->bhgq", grouped(gf * g_descale),
                     grouped(forward.out.astype(jnp.float32)))
  lse = safe_lse(lse2).reshape(batch, kv_heads, group, q_len)
  s = dot("bqhgd,bkhd->bhgqk", grouped(q.astype(jnp.float32)), k.astype(jnp.float32)) * logit
  visible = _reference_mask(q_len, kv_len, causal, *(
      None if ids is None else jnp.asarray(ids, jnp.int32)
      for ids in (q_segment_ids, kv_segment_ids)))[:, :, None]
  p = jnp.where(visible, jnp.exp2(s - lse[..., None]), 0.0)
  dp = dot("bqhgd,bkhd->bhgqk", grouped(gf), v.astype(jnp.float32)) * dp_scale
  ds = (p * (dp - delta[..., None])).astype(jnp.bfloat16)
  p8 = (p * P_SCALE).astype(E4M3)
  dq = dot("bhgqk,bkhd->bqhgd", ds, k16) * dq_scale
  dk = dot("bhgqk,bqhgd->bkhd", ds, grouped(q16)) * dk_scale
  dv = dot("bhgqk,bqhgd->bkhd", p8.astype(jnp.float32), grouped(gf)) * (g_descale / P_SCALE)
  return (forward.out, lse2, dq.reshape(q.shape).astype(jnp.bfloat16),
          dk.astype(jnp.bfloat16), dv.astype(jnp.bfloat16))
