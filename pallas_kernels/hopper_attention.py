"""Flash attention on Hopper tensor cores (Mosaic GPU, FlashAttention-3 style): bf16/f16 and FP8.

* `hopper_attention`: bf16/f16 attention, differentiable (the dQ and dK/dV kernels of
  `hopper_attention_backward` are its derivative); `hopper_bf16_attention_forward` /
  `hopper_bf16_attention_backward` its two passes alone, for callers that place them.
* `hopper_fp8_attention_forward` / `hopper_fp8_attention_backward`: the FP8 pair, E4M3
  inputs with descales, one per tensor or one per SCALE_BLOCK (128) rows of each head
  (`quantize_head_blocks` makes them); the backward quantizes dO itself (see
  `hopper_attention_backward` for every operand's format and why).

Semantics are fp8jax's (fp8jax.ops.attention): GQA (heads a multiple of kv_heads), a
causal mask aligned bottom-right (query i sees keys j <= i + kv_len - q_len), segment ids
(a query sees keys of its own id), and a query row that sees no key outputs 0 and gets no
gradient. Shapes: head_dim 64 or 128, sequence lengths multiples of
`HopperAttentionBlockSizes().seq_multiple` (128).

Every function takes `interpret`: False compiles for the GPU (also deviceless, from a
CPU process), True or interpreter parameters run the kernels in Mosaic GPU's CPU
interpreter (see `mosaic_target`).
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
from jax import lax
import jax.numpy as jnp

from pallas_kernels import hopper_attention_backward, hopper_attention_forward
from pallas_kernels.hopper_attention_tiling import (E4M3, E4M3_MAX, LOG2E, P_SCALE, SCALE_BLOCK,
                                                    SIXTEEN_BIT, HopperAttentionBlockSizes,
                                                    check_shapes, geometry, safe_lse)
from pallas_kernels.mosaic_target import plgpu


def _checked_geometry(q, k, v, q_segment_ids, kv_segment_ids, causal, blocks, dtypes,
                      v_transposed=False):
  if plgpu is None:
    raise ImportError("The Hopper attention kernels need jax.experimental.pallas.mosaic_gpu, "
                      "which this jax/jaxlib does not provide; install a CUDA jaxlib >= 0.10.2.")
  for name, x in (("q", q), ("k", k), ("v", v)):
    if jnp.dtype(x.dtype) not in dtypes:
      raise TypeError(f"{name} is {x.dtype}; these kernels take {[d.name for d in dtypes]}.")
    if x.ndim != 4:
      raise ValueError(f"{name} must be 4-D [batch, seq, heads, head_dim]; got {x.shape}.")
  if not q.dtype == k.dtype == v.dtype:
    raise TypeError(f"q, k and v must share a dtype; got {q.dtype}, {k.dtype}, {v.dtype}.")
  if k.shape[0] != q.shape[0] or k.shape[3] != q.shape[3]:
    raise ValueError(f"k {k.shape} must share batch and head_dim with q {q.shape}.")
  expected_v = (k.shape[0], k.shape[2], k.shape[3], k.shape[1]) if v_transposed else k.shape
  if v.shape != expected_v:
    raise ValueError(f"v must have shape {expected_v}; got {v.shape}.")
  if (q_segment_ids is None) != (kv_segment_ids is None):
    raise ValueError("pass both q_segment_ids and kv_segment_ids, or neither.")
  if q_segment_ids is not None:
    for name, ids, x in (("q_segment_ids", q_segment_ids, q),
                         ("kv_segment_ids", kv_segment_ids, k)):
      if jnp.shape(ids) != x.shape[:2]:
        raise ValueError(f"{name} must have shape [batch, seq] = {x.shape[:2]}; "
                         f"got {jnp.shape(ids)}.")
  geo = geometry(q, k, causal=causal, segmented=q_segment_ids is not None)
  check_shapes(geo, blocks)
  return geo


def _ids(q_segment_ids, kv_segment_ids):
  if q_segment_ids is None:
    return None, None
  return jnp.asarray(q_segment_ids, jnp.int32), jnp.asarray(kv_segment_ids, jnp.int32)


def _sm_scale(sm_scale, head_dim):
  return 1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale


def _delta_and_stats(out, do, lse2):
  """float32 [batch, heads, 2, q_len]: each row's safe lse2 and delta = dO . O."""
  delta = jnp.einsum("bqhd,bqhd->bhq", do.astype(jnp.float32), out.astype(jnp.float32))
  return jnp.stack([safe_lse(lse2), delta], axis=2)


def hopper_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool = False,
                     sm_scale: float | None = None, q_segment_ids: jax.Array | None = None,
                     kv_segment_ids: jax.Array | None = None,
                     block_sizes: HopperAttentionBlockSizes = HopperAttentionBlockSizes(),
                     interpret=False) -> jax.Array:
  """bf16/f16 flash attention on Hopper `wgmma`, differentiable.

  Args:
    q: [batch, q_len, heads, head_dim]; k, v: [batch, kv_len, kv_heads, head_dim]; one
      16-bit dtype.
    causal: bottom-right aligned causal mask.
    sm_scale: logit multiplier (default 1/sqrt(head_dim)).
    q_segment_ids, kv_segment_ids: optional int [batch, seq]; attend within equal ids.
    block_sizes: tiles (static); interpret: see the module docstring.

  Returns:
    [batch, q_len, heads, head_dim] in q's dtype.
  """
  geo = _checked_geometry(q, k, v, q_segment_ids, kv_segment_ids, causal, block_sizes,
                          SIXTEEN_BIT)
  q_ids, kv_ids = _ids(q_segment_ids, kv_segment_ids)
  return _attention(q, k, v, q_ids, kv_ids, geo, block_sizes, _sm_scale(sm_scale, geo.head_dim),
                    interpret)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8))
def _attention(q, k, v, q_ids, kv_ids, geo, blocks, sm_scale, interpret):
  return _attention_fwd(q, k, v, q_ids, kv_ids, geo, blocks, sm_scale, interpret)[0]


def _attention_fwd(q, k, v, q_ids, kv_ids, geo, blocks, sm_scale, interpret):
  out, lse2 = _forward_16bit(q, k, v, q_ids, kv_ids, geo, blocks, sm_scale, interpret)
  return out, (q, k, v, q_ids, kv_ids, out, lse2)


def _attention_bwd(geo, blocks, sm_scale, interpret, residuals, g):
  q, k, v, q_ids, kv_ids, out, lse2 = residuals
  dq, dk, dv = _backward_16bit(q, k, v, out, lse2, g, q_ids, kv_ids, geo, blocks, sm_scale,
                               interpret)
  return dq, dk, dv, None, None


_attention.defvjp(_attention_fwd, _attention_bwd)


def _forward_16bit(q, k, v, q_ids, kv_ids, geo, blocks, sm_scale, interpret):
  scales = _scalars(sm_scale * LOG2E, 1.0)
  out, lse2, _ = hopper_attention_forward.forward(q, k, v, scales, q_ids, kv_ids, geo=geo,
                                                  blocks=blocks, interpret=interpret)
  return out, lse2


def _backward_16bit(q, k, v, out, lse2, g, q_ids, kv_ids, geo, blocks, sm_scale, interpret):
  do = g.astype(q.dtype)
  scales = _scalars(sm_scale * LOG2E, 1.0, 1.0, sm_scale, sm_scale)
  return hopper_attention_backward.backward(
      q, k, v, do, _delta_and_stats(out, do, lse2), scales, q_ids, kv_ids, geo=geo,
      blocks=blocks, interpret=interpret)


def _scalars(*values) -> jax.Array:
  """float32 [len(values)], built from scalars: no captured constant array, which
  `custom_partitioning` (per-shard callers) refuses."""
  return jnp.stack([jnp.float32(value) for value in values])


def hopper_bf16_attention_forward(
    q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool = False,
    sm_scale: float | None = None, q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    block_sizes: HopperAttentionBlockSizes = HopperAttentionBlockSizes(),
    interpret=False) -> tuple[jax.Array, jax.Array]:
  """The forward kernel of `hopper_attention` alone (not differentiable), bf16/f16.

  For callers that place the forward and backward kernels themselves (e.g. run each on
  its own shard of the batch and heads).

  Returns:
    (out, lse2): out [batch, q_len, heads, head_dim] in q's dtype; lse2 float32 [batch,
    heads, q_len], each row's base-2 log-sum-exp, which `hopper_bf16_attention_backward`
    takes.
  """
  geo = _checked_geometry(q, k, v, q_segment_ids, kv_segment_ids, causal, block_sizes,
                          SIXTEEN_BIT)
  q_ids, kv_ids = _ids(q_segment_ids, kv_segment_ids)
  return _forward_16bit(q, k, v, q_ids, kv_ids, geo, block_sizes,
                        _sm_scale(sm_scale, geo.head_dim), interpret)


def hopper_bf16_attention_backward(
    q: jax.Array, k: jax.Array, v: jax.Array, out: jax.Array, lse2: jax.Array, g: jax.Array, *,
    causal: bool = False, sm_scale: float | None = None,
    q_segment_ids: jax.Array | None = None, kv_segment_ids: jax.Array | None = None,
    block_sizes: HopperAttentionBlockSizes = HopperAttentionBlockSizes(),
    interpret=False) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(dq, dk, dv) of `hopper_bf16_attention_forward`, in q's dtype and q's / k's shapes.

  Args: as given to the forward; out and lse2 its results; g the output's cotangent.
  """
  geo = _checked_geometry(q, k, v, q_segment_ids, kv_segment_ids, causal, block_sizes,
                          SIXTEEN_BIT)
  q_ids, kv_ids = _ids(q_segment_ids, kv_segment_ids)
  return _backward_16bit(q, k, v, out, lse2, g, q_ids, kv_ids, geo, block_sizes,
                         _sm_scale(sm_scale, geo.head_dim), interpret)


def _descale(x):
  return jnp.asarray(x, jnp.float32).reshape(())


def _with_descales(geo, descales):
  """`geo`, block-scaled if (descale_q, descale_k, descale_v) are per block (all three
  scalars: per tensor); raises ValueError for any other shapes."""
  if all(math.prod(jnp.shape(d)) == 1 for d in descales):
    return geo
  expected = ((geo.batch, geo.heads, geo.q_len // SCALE_BLOCK),) + (
      (geo.batch, geo.kv_heads, geo.kv_len // SCALE_BLOCK),) * 2
  for name, d, shape in zip(("descale_q", "descale_k", "descale_v"), descales, expected):
    if jnp.shape(d) != shape:
      raise ValueError(
          f"{name} has shape {jnp.shape(d)}: the descales are one per tensor (all three "
          f"scalars) or one per {SCALE_BLOCK} rows of each head (descale_q {expected[0]}, "
          f"descale_k and descale_v {expected[1]}; quantize_head_blocks makes them).")
  return dataclasses.replace(geo, block_scaled=True)


def _current_scale(amax):
  """E4M3_MAX / amax where amax is finite and positive, else 1 (a cast then saturates or
  passes NaN as the data says, and the scale itself stays finite)."""
  usable = jnp.isfinite(amax) & (amax > 0)
  return jnp.where(usable, E4M3_MAX / jnp.where(usable, amax, 1.0), 1.0)


def _cast(x, scale):
  return jnp.clip(x.astype(jnp.float32) * scale, -E4M3_MAX, E4M3_MAX).astype(E4M3)


def quantize_head_blocks(x: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(x8, descale): x in E4M3 with one current scale per SCALE_BLOCK (128) rows of each head.

  Args:
    x: [batch, seq, heads, head_dim], any float dtype and any seq (a last partial block
      has its own scale).

  Returns:
    x8: float8_e4m3fn, x's shape; descale: float32 [batch, heads, ceil(seq / 128)], so
    that x ~= x8 * descale of the row's block.

  A block's scale is its head's (the head's amax maps to E4M3's max; a zero or non-finite
  amax gives scale 1, as in `quantize_gradient`) times the largest power of two 2**k,
  k <= 64, that keeps the block's amax within E4M3's max: the block's largest value lands
  in E4M3's top octave, with E4M3's full relative precision, and the blocks' descales
  differ by exact powers of two. That matters for V: the forward kernel rounds P * 256 *
  (the block's descale over the head's largest), exactly P * 256 * 2**-k, so a
  probability of 1 (a row's largest, all of a peaked row's output) stays exact as it is
  per tensor; an arbitrary ratio would round it (measured: 10% more error with channel
  outliers).
  """
  batch, seq, heads, head_dim = x.shape
  blocks = -(-seq // SCALE_BLOCK)
  padded = jnp.pad(jnp.abs(x.astype(jnp.float32)),
                   ((0, 0), (0, blocks * SCALE_BLOCK - seq), (0, 0), (0, 0)))
  amax = jnp.max(padded.reshape(batch, blocks, SCALE_BLOCK, heads, head_dim), axis=(2, 4))
  head_amax = jnp.max(amax, axis=1, keepdims=True)  # [batch, 1, heads]
  usable = jnp.isfinite(head_amax) & (amax > 0)
  octaves = jnp.floor(jnp.log2(jnp.where(usable, head_amax, 1.0))
                      - jnp.log2(jnp.where(usable, amax, 1.0)))
  # 2**k from its exponent bits: exact (exp2 or ldexp may round on some backends).
  k = jnp.clip(octaves, 0, 64).astype(jnp.int32)
  scale = _current_scale(head_amax) * lax.bitcast_convert_type((k + 127) << 23, jnp.float32)
  x8 = _cast(x, jnp.repeat(scale, SCALE_BLOCK, axis=1)[:, :seq, :, None])
  return x8, jnp.swapaxes(1.0 / scale, 1, 2)


def hopper_fp8_attention_forward(
    q: jax.Array, k: jax.Array, v: jax.Array, descale_q, descale_k, descale_v, *,
    causal: bool = False, sm_scale: float | None = None,
    q_segment_ids: jax.Array | None = None, kv_segment_ids: jax.Array | None = None,
    block_sizes: HopperAttentionBlockSizes = HopperAttentionBlockSizes(),
    interpret=False) -> tuple[jax.Array, jax.Array, jax.Array]:
  """FP8 flash-attention forward: both products are E4M3 `wgmma`.

  Args:
    q: float8_e4m3fn [batch, q_len, heads, head_dim]; k, v: float8_e4m3fn [batch, kv_len,
      kv_heads, head_dim] (V is transposed here for the kernel).
    descale_q, descale_k, descale_v: float32, x ~= x8 * descale (arrays: new values do
      not recompile): all three scalars (per tensor), or all three per SCALE_BLOCK rows of
      each head: descale_q [batch, heads, q_len / 128], descale_k and descale_v [batch,
      kv_heads, kv_len / 128] (`quantize_head_blocks`).
    causal, sm_scale, q_segment_ids, kv_segment_ids, block_sizes, interpret: as for
      `hopper_attention`.

  Returns:
    (out, out_amax, lse2): out bfloat16 [batch, q_len, heads, head_dim]; out_amax the
    float32 max |out| (for the output's delayed scaling); lse2 float32 [batch, heads,
    q_len], each row's base-2 log-sum-exp (-inf for a row that sees no key), which
    `hopper_fp8_attention_backward` takes.
  """
  geo = _with_descales(_checked_geometry(q, k, v, q_segment_ids, kv_segment_ids, causal,
                                         block_sizes, (E4M3,)),
                       (descale_q, descale_k, descale_v))
  q_ids, kv_ids = _ids(q_segment_ids, kv_segment_ids)
  sm_scale = _sm_scale(sm_scale, geo.head_dim)
  block_scales = None
  if geo.block_scaled:
    scales = _scalars(sm_scale * LOG2E, 0.0)
    descale_v = jnp.asarray(descale_v, jnp.float32)
    # V's block descales enter P as ratios to the head's largest (see the kernel).
    v_max = jnp.max(descale_v, axis=2)
    v_max = jnp.where(v_max > 0, v_max, 1.0)
    block_scales = (jnp.asarray(descale_q, jnp.float32), jnp.asarray(descale_k, jnp.float32),
                    descale_v / v_max[..., None], v_max / P_SCALE)
  else:
    scales = jnp.stack([_descale(descale_q) * _descale(descale_k) * (sm_scale * LOG2E),
                        _descale(descale_v) / P_SCALE])
  out, lse2, row_amax = hopper_attention_forward.forward(
      q, k, jnp.transpose(v, (0, 2, 3, 1)), scales, q_ids, kv_ids, block_scales, geo=geo,
      blocks=block_sizes, interpret=interpret)
  return out, jnp.max(row_amax), lse2


def quantize_gradient(g: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(g8, descale): dO in E4M3 with a current scale (its own amax maps to E4M3's max).

  A zero or non-finite amax gives scale 1: the cast then saturates or passes NaN as
  the data says, and the scale itself stays finite.
  """
  scale = _current_scale(jnp.max(jnp.abs(g.astype(jnp.float32))))
  return _cast(g, scale), 1.0 / scale


def hopper_fp8_attention_backward(
    q: jax.Array, k: jax.Array, v: jax.Array, out: jax.Array, lse2: jax.Array, g: jax.Array,
    descale_q, descale_k, descale_v, *, causal: bool = False, sm_scale: float | None = None,
    q_segment_ids: jax.Array | None = None, kv_segment_ids: jax.Array | None = None,
    block_sizes: HopperAttentionBlockSizes = HopperAttentionBlockSizes(),
    interpret=False, g_descale=None) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Gradients of `hopper_fp8_attention_forward` with respect to the dequantized q, k, v.

  Args:
    q, k, v, descale_*, causal, sm_scale, segment ids, block_sizes, interpret: as given
      to the forward.
    out, lse2: the forward's output and base-2 lse.
    g: the output's cotangent, [batch, q_len, heads, head_dim] (any float dtype); it is
      quantized to E4M3 with a current scale (`quantize_gradient`).
    g_descale: None, or g's descale when g is already E4M3 from `quantize_gradient`
      (a caller that runs this on shards quantizes the whole g first: one scale).

  Returns:
    (dq, dk, dv) in bfloat16: the gradients with respect to q8 * descale_q, k8 *
    descale_k and v8 * descale_v, in q's and k's shapes.
  """
  geo = _with_descales(_checked_geometry(q, k, v, q_segment_ids, kv_segment_ids, causal,
                                         block_sizes, (E4M3,)),
                       (descale_q, descale_k, descale_v))
  q_ids, kv_ids = _ids(q_segment_ids, kv_segment_ids)
  sm_scale = _sm_scale(sm_scale, geo.head_dim)
  if g_descale is None:
    g8, descale_g = quantize_gradient(g)
  elif g.dtype != E4M3:
    raise TypeError(f"g has dtype {g.dtype} with g_descale given; pass g quantized by "
                    "quantize_gradient (E4M3), or no g_descale.")
  else:
    g8, descale_g = g, _descale(g_descale)
  block_scales = None
  if geo.block_scaled:
    # Per-step descales are read in the kernels; the bf16 q and k are dequantized.
    block_scales = tuple(jnp.asarray(d, jnp.float32) for d in (descale_q, descale_k, descale_v))
    scales = jnp.stack([jnp.float32(sm_scale * LOG2E), descale_g, descale_g / P_SCALE,
                        jnp.float32(sm_scale), jnp.float32(sm_scale)])
  else:
    dq_, dk_, dv_ = (_descale(d) for d in (descale_q, descale_k, descale_v))
    scales = jnp.stack([dq_ * dk_ * (sm_scale * LOG2E), descale_g * dv_, descale_g / P_SCALE,
                        dk_ * sm_scale, dq_ * sm_scale])
  # delta from the dequantized dO8: the kernels' dP is built from dO8 too.
  stats = _delta_and_stats(out, g8.astype(jnp.float32) * descale_g, lse2)
  return hopper_attention_backward.backward(q, k, v, g8, stats, scales, q_ids, kv_ids,
                                            block_scales, geo=geo, blocks=block_sizes,
                                            interpret=interpret)
