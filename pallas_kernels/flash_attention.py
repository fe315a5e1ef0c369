"""Fused flash attention for Hopper as Pallas (Triton) kernels: bf16/f16 and FP8 E4M3.

Layout: every tensor is [batch, seq, heads, head_dim]:

  q:    [batch, q_len,  num_heads,    head_dim]
  k, v: [batch, kv_len, num_kv_heads, head_dim]   (num_heads % num_kv_heads == 0)

Math (per batch b and query head h, with kv head h // (num_heads / num_kv_heads)):

  S = sm_scale * q k^T,   S[i, j] = -inf where the mask forbids (i, j)
  P = softmax(S) row-wise (a row with nothing allowed gives P = 0 and O = 0)
  O = P v,   lse[i] = log(sum_j exp(S[i, j]))

The mask allows (i, j) when `q_segment_ids[b, i] == kv_segment_ids[b, j]` (if
segment ids are given) and `j <= i + kv_len - q_len` (if causal). Causal masks
are aligned bottom-right, as in FlashAttention >= 2.1: the last query row sees
every key, which is what decoding with a KV cache needs; with q_len == kv_len
this is `j <= i`. With q_len > kv_len the first q_len - kv_len rows see no key.
A row that sees no key gives O = 0 and lse = -inf, and it passes no gradient:
its dQ row is 0 and it adds nothing to dK or dV.

Forward (FlashAttention-2): one program per (q block, batch, head) keeps its q
tile resident, streams k/v tiles, and carries the running row max m, the row
sum l and the unnormalized output, rescaling them when m grows. Logits are
handled in base 2 (exp2 with log2(e) folded into the logit multiplier). It
writes O, lse and the row-wise max|O| (for the delayed scaling of the output).

FP8 forward: q, k, v are E4M3 arrays with float32 *descale* factors
(`x = x_fp8 * descale_x`). The descales ride in a small float32 operand, so new
scale values never retrace or recompile. The logits are `dot(q8, k8) *
(descale_q * descale_k * sm_scale)`. P (in [0, 1], relative to the running
row max of the key blocks seen so far) is quantized to E4M3 as `P * 256` for
the P.v product, whose float32 result is multiplied by `descale_v / 256`. The
row sum l uses the unrounded P, so lse is the exact one of the dequantized
inputs. The output is bf16, or E4M3 `saturate(O * out_scale)` when `out_scale`
is given. `fp8_forward_reference` is this arithmetic in plain jnp.

Backward (FlashAttention-2, recompute from lse, deterministic, no atomics):
  delta = rowsum(dO * O)                              (XLA, float32)
  P  = exp2(S * log2(e) - lse2),  dV = P^T dO,  dP = dO v^T,  dS = P * (dP - delta)
  dQ = sm_scale * dS k,  dK = sm_scale * dS^T q
One kernel owns a k/v block and loops over q blocks (dK, dV); another owns a q
block and loops over k/v blocks (dQ). Under grouped-query attention dK and dV
are produced per query head in float32 and summed over each group afterwards.

FP8 backward: its gradients are the exact-attention gradients w.r.t. the
dequantized inputs (straight-through). The kernels get the E4M3 values
themselves, cast to bf16 (exact: E4M3 is a subset of bf16), and the descales
as a float32 operand, as in the forward. With x = x8 * descale_x:
  S  = dot(q8, k8) * (sm_scale * descale_q * descale_k)   (the forward's logits)
  dP = dot(dO, v8) * descale_v,  dV = P^T dO
  dQ = (sm_scale * descale_k) * dS k8,  dK = (sm_scale * descale_q) * dS^T q8
Dequantizing to bf16 first would round the scaled q and k (2**-9 relative) and
move the recomputed logits off the ones the forward's lse was taken from, so
the recomputed P would not sum to 1 (by several percent for peaked attention).

Sequence lengths need not be multiples of the block sizes: the wrappers pad
the sequences up to a block multiple and the kernels mask key positions past
the true kv length; padded query rows are computed and sliced away.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.hopper_attention_tiling import SCALE_BLOCK, HopperAttentionBlockSizes

LOG2E = math.log2(math.e)
# Masked logits take a large *finite* value: a block whose logits are all
# masked then has max == MASK_VALUE and exp2(s - max) never meets inf - inf.
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)
# P in [0, 1] is stored in E4M3 as P * 256: a power of two, so the scaling itself
# is exact and P's E4M3 rounding keeps E4M3's relative precision (<= 2**-4) down
# to P = 2**-14; 256 < 448 so nothing saturates.
P_SCALE = 256.0
E4M3 = jnp.dtype(jnp.float8_e4m3fn)
E4M3_MAX = float(jnp.finfo(E4M3).max)
SUPPORTED_HEAD_DIMS = (64, 128, 256)

# lax.dot_general dimension numbers of the three tile products, all [m, n] results:
# a b^T from [m, k] x [n, k], a^T b from [k, m] x [k, n], a b from [m, k] x [k, n].
_NT = (((1,), (1,)), ((), ()))
_TN = (((0,), (0,)), ((), ()))
_NN = (((1,), (0,)), ((), ()))


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tile sizes and Triton launch knobs of the attention kernels.

  All block sizes are powers of two >= 16 (a tensor-core tile needs >= 16 rows;
  FP8 products on Hopper want block_kv >= 32). Shorter sequences shrink a block
  to the sequence's next power of two.

  Attributes:
    block_q, block_kv: forward tile: query rows per program, keys per inner step.
    block_q_dkv, block_kv_dkv: dK/dV kernel: q rows per inner step, keys per program.
    block_q_dq, block_kv_dq: dQ kernel: query rows per program, keys per inner step.
    num_warps, num_stages: Triton warps per program and software-pipeline depth
      of the forward kernel.
    num_warps_bwd, num_stages_bwd: the same for both backward kernels.
  """

  block_q: int = 128
  block_kv: int = 64
  block_q_dkv: int = 64
  block_kv_dkv: int = 64
  block_q_dq: int = 64
  block_kv_dq: int = 64
  num_warps: int = 8
  num_stages: int = 2
  num_warps_bwd: int = 8
  num_stages_bwd: int = 2

  def __post_init__(self):
    for field in dataclasses.fields(self):
      value = getattr(self, field.name)
      if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"BlockSizes.{field.name}={value!r} must be a positive int.")
      if field.name.startswith("block") and (value < 16 or value & (value - 1)):
        raise ValueError(
            f"BlockSizes.{field.name}={value} must be a power of two >= 16 "
            "(the tile of one tensor-core product).")

  @classmethod
  def for_head_dim(cls, head_dim: int) -> "BlockSizes":
    """Defaults for an H100 that keep every kernel within shared memory and registers.

    The float32 accumulators ([block, head_dim] per program) grow with head_dim,
    so wider heads get shorter tiles.
    """
    if head_dim <= 64:
      return cls(block_q=128, block_kv=64, block_q_dkv=64, block_kv_dkv=64,
                 block_q_dq=64, block_kv_dq=64, num_warps=4, num_stages=3,
                 num_warps_bwd=4, num_stages_bwd=2)
    if head_dim <= 128:
      return cls(block_q=128, block_kv=64, block_q_dkv=64, block_kv_dkv=64,
                 block_q_dq=64, block_kv_dq=64, num_warps=8, num_stages=2,
                 num_warps_bwd=8, num_stages_bwd=2)
    # head_dim 256: 64-row tiles keep every product on wgmma (32-row tiles fall back to
    # mma.sync); the dK/dV kernel then holds two 64x256 float32 accumulators and
    # spills a little (about 120 bytes per thread, measured with ptxas for sm_90a).
    return cls(block_q=64, block_kv=32, block_q_dkv=64, block_kv_dkv=64,
               block_q_dq=64, block_kv_dq=32, num_warps=8, num_stages=2,
               num_warps_bwd=8, num_stages_bwd=2)


class AttentionForward(NamedTuple):
  """What the forward kernel returns.

  Attributes:
    out: [batch, q_len, num_heads, head_dim]; bf16/f16 (the compute dtype), or
      E4M3 `saturate(O * out_scale)` when an `out_scale` was given.
    out_amax: float32[] max |O| over the whole output, taken before any output
      quantization (feed it to the output role's delayed scaling).
    lse: float32[batch, num_heads, q_len], natural-log log-sum-exp of each row's
      scaled logits (-inf for a row with no allowed key).
  """

  out: jax.Array
  out_amax: jax.Array
  lse: jax.Array


@dataclasses.dataclass(frozen=True)
class _Options:
  """Static (hashable) configuration shared by the forward and backward passes."""

  causal: bool
  sm_scale: float
  block_sizes: BlockSizes
  interpret: bool


@dataclasses.dataclass(frozen=True)
class _Tiling:
  """Static facts one kernel needs: true lengths, tiles, and which masks apply."""

  q_len: int
  kv_len: int
  block_q: int
  block_kv: int
  causal: bool
  segmented: bool

  @property
  def kv_tail(self) -> bool:
    """Whether the last key block reaches past kv_len and must be masked."""
    return self.kv_len % self.block_kv != 0

  @property
  def causal_offset(self) -> int:
    """kv_len - q_len: a causal query i sees keys j <= i + causal_offset (bottom-right)."""
    return self.kv_len - self.q_len

  @property
  def num_q_blocks(self) -> int:
    return _cdiv(self.q_len, self.block_q)

  @property
  def num_kv_blocks(self) -> int:
    return _cdiv(self.kv_len, self.block_kv)


def _cdiv(a: int, b: int) -> int:
  return -(-a // b)


def _next_power_of_2(n: int) -> int:
  return 1 << max(n - 1, 0).bit_length()


def _fit(block: int, length: int) -> int:
  """The block size to use for a sequence of `length`: never far past the sequence."""
  return min(block, max(16, _next_power_of_2(length)))


def _round_up(n: int, multiple: int) -> int:
  return _cdiv(n, multiple) * multiple


# ---------------------------------------------------------------------------
# Masking, shared by all kernels.
# ---------------------------------------------------------------------------


def _block_mask(tiling: _Tiling, q_start, kv_start, q_seg, kv_seg):
  """Boolean [block_q, block_kv] of allowed (query, key) pairs, or None if all are."""
  mask = None

  def both(a, b):
    return b if a is None else jnp.logical_and(a, b)

  q_pos = q_start + lax.broadcasted_iota(jnp.int32, (tiling.block_q, tiling.block_kv), 0)
  kv_pos = kv_start + lax.broadcasted_iota(jnp.int32, (tiling.block_q, tiling.block_kv), 1)
  if tiling.kv_tail:
    mask = both(mask, kv_pos < tiling.kv_len)
  if tiling.causal:
    mask = both(mask, kv_pos <= q_pos + tiling.causal_offset)
  if tiling.segmented:
    mask = both(mask, q_seg[:, None] == kv_seg[None, :])
  return mask


def _causal_kv_block_limit(tiling: _Tiling, q_block):
  """Number of key blocks a query block visits (causal: those its last row sees).

  0 when no row of the block sees a key (q_len > kv_len): the loop then never
  runs and the rows keep l == 0, which the forward turns into O = 0.
  """
  if not tiling.causal:
    return tiling.num_kv_blocks
  # The block's last row, (q_block + 1) * block_q - 1, sees keys below this end.
  keys_end = jnp.maximum((q_block + 1) * tiling.block_q + tiling.causal_offset, 0)
  return jnp.minimum(lax.div(keys_end + tiling.block_kv - 1, tiling.block_kv),
                     tiling.num_kv_blocks)


# ---------------------------------------------------------------------------
# Forward.
# ---------------------------------------------------------------------------


def _forward_kernel(*refs, tiling: _Tiling, fp8: bool, quantize_out: bool):
  """One (q block, batch, head) program of the forward pass.

  Scalars operand: [logit multiplier (sm_scale * log2 e * descale_q * descale_k),
  P.v multiplier (descale_v / P_SCALE for FP8, else 1), out_scale, unused].
  """
  if tiling.segmented:
    (scalars_ref, q_ref, k_ref, v_ref, q_seg_ref, kv_seg_ref,
     o_ref, lse_ref, amax_ref) = refs
  else:
    scalars_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, amax_ref = refs
    q_seg_ref = kv_seg_ref = None
  block_q, block_kv = tiling.block_q, tiling.block_kv
  q_block = pl.program_id(0)
  q_start = q_block * block_q
  logit_multiplier = scalars_ref[0]
  pv_multiplier = scalars_ref[1]

  q = q_ref[...]
  q_seg = q_seg_ref[...] if tiling.segmented else None
  head_dim = q.shape[-1]

  def body(kv_block, carry):
    acc, m_prev, l_prev = carry
    kv_start = kv_block * block_kv
    kv_slice = pl.ds(kv_start, block_kv)
    k = k_ref[kv_slice, :]
    s = lax.dot_general(q, k, _NT, preferred_element_type=jnp.float32) * logit_multiplier
    kv_seg = kv_seg_ref[kv_slice] if tiling.segmented else None
    mask = _block_mask(tiling, q_start, kv_start, q_seg, kv_seg)
    if mask is not None:
      s = jnp.where(mask, s, MASK_VALUE)
    m_next = jnp.maximum(m_prev, jnp.max(s, axis=-1))
    correction = jnp.exp2(m_prev - m_next)
    p = jnp.exp2(s - m_next[:, None])
    if mask is not None:
      # A fully masked block has s == m_next == MASK_VALUE, so p would be 1.
      p = jnp.where(mask, p, 0.0)
    l_next = correction * l_prev + jnp.sum(p, axis=-1)
    v = v_ref[kv_slice, :]
    if fp8:
      p_mm = (p * P_SCALE).astype(E4M3)
    else:
      p_mm = p.astype(v.dtype)
    pv = lax.dot_general(p_mm, v, _NN, preferred_element_type=jnp.float32)
    return acc * correction[:, None] + pv, m_next, l_next

  acc = jnp.zeros((block_q, head_dim), jnp.float32)
  m = jnp.full((block_q,), MASK_VALUE, jnp.float32)
  l = jnp.zeros((block_q,), jnp.float32)
  acc, m, l = lax.fori_loop(0, _causal_kv_block_limit(tiling, q_block), body, (acc, m, l))

  # l == 0 only for a row with no allowed key: its output is 0 and its lse -inf.
  l_safe = jnp.where(l > 0.0, l, 1.0)
  o = acc * (pv_multiplier / l_safe)[:, None]
  lse_ref[...] = m + jnp.log2(l)
  amax_ref[...] = jnp.max(jnp.abs(o), axis=-1)
  if quantize_out:
    out_scale = scalars_ref[2]
    o_ref[...] = jnp.clip(o * out_scale, -E4M3_MAX, E4M3_MAX).astype(o_ref.dtype)
  else:
    o_ref[...] = o.astype(o_ref.dtype)


def _forward_call(q, k, v, q_seg, kv_seg, scalars, *, options: _Options,
                  out_dtype, quantize_out: bool):
  """Pads, runs the forward kernel and unpads.

  Returns:
    (out [B, Sq, H, D], out_amax f32[], lse2 f32[B, H, Sq] in base 2).
  """
  batch, q_len, num_heads, head_dim = q.shape
  kv_len, num_kv_heads = k.shape[1], k.shape[2]
  group = num_heads // num_kv_heads
  blocks = options.block_sizes
  block_q = _fit(blocks.block_q, q_len)
  block_kv = _fit(blocks.block_kv, kv_len)
  q_pad, kv_pad = _round_up(q_len, block_q), _round_up(kv_len, block_kv)
  tiling = _Tiling(q_len=q_len, kv_len=kv_len, block_q=block_q, block_kv=block_kv,
                   causal=options.causal, segmented=q_seg is not None)

  q = _pad_seq(q, q_pad)
  k, v = _pad_seq(k, kv_pad), _pad_seq(v, kv_pad)
  grid = (q_pad // block_q, batch, num_heads)
  in_specs = [
      pl.BlockSpec((4,), lambda i, b, h: (0,)),
      pl.BlockSpec((None, block_q, None, head_dim), lambda i, b, h: (b, i, h, 0)),
      pl.BlockSpec((None, kv_pad, None, head_dim), lambda i, b, h: (b, 0, h // group, 0)),
      pl.BlockSpec((None, kv_pad, None, head_dim), lambda i, b, h: (b, 0, h // group, 0)),
  ]
  operands = [scalars, q, k, v]
  if tiling.segmented:
    in_specs += [pl.BlockSpec((None, block_q), lambda i, b, h: (b, i)),
                 pl.BlockSpec((None, kv_pad), lambda i, b, h: (b, 0))]
    operands += [_pad_seq(q_seg, q_pad), _pad_seq(kv_seg, kv_pad)]
  row_spec = pl.BlockSpec((None, None, block_q), lambda i, b, h: (b, h, i))
  out, lse2, row_amax = pl.pallas_call(
      functools.partial(_forward_kernel, tiling=tiling, fp8=q.dtype == E4M3,
                        quantize_out=quantize_out),
      grid=grid,
      in_specs=in_specs,
      out_specs=[pl.BlockSpec((None, block_q, None, head_dim), lambda i, b, h: (b, i, h, 0)),
                 row_spec, row_spec],
      out_shape=[jax.ShapeDtypeStruct((batch, q_pad, num_heads, head_dim), out_dtype),
                 jax.ShapeDtypeStruct((batch, num_heads, q_pad), jnp.float32),
                 jax.ShapeDtypeStruct((batch, num_heads, q_pad), jnp.float32)],
      compiler_params=plgpu.CompilerParams(num_warps=blocks.num_warps,
                                           num_stages=blocks.num_stages),
      interpret=options.interpret,
      name="flash_attention_fwd",
  )(*operands)
  # Padded query rows hold real but meaningless values: they must not reach amax.
  out_amax = jnp.max(row_amax[:, :, :q_len])
  return out[:, :q_len], out_amax, lse2[:, :, :q_len]


def _pad_seq(x, length: int):
  """Pads axis 1 (the sequence) of `x` with zeros up to `length`."""
  if x.shape[1] == length:
    return x
  widths = [(0, 0)] * x.ndim
  widths[1] = (0, length - x.shape[1])
  return jnp.pad(x, widths)


# ---------------------------------------------------------------------------
# Backward.
# ---------------------------------------------------------------------------


def _recompute_p(q, k, lse2, tiling: _Tiling, q_start, kv_start, q_seg, kv_seg,
                 logit_multiplier):
  """P of one tile from the saved base-2 lse; exactly 0 where masked.

  `logit_multiplier` (a Python float, or a float32 scalar for FP8) must be the
  forward's, bit for bit, so that P matches the lse.
  """
  s = lax.dot_general(q, k, _NT, preferred_element_type=jnp.float32) * logit_multiplier
  p = jnp.exp2(s - lse2[:, None])
  mask = _block_mask(tiling, q_start, kv_start, q_seg, kv_seg)
  if mask is not None:
    # Masked logits are not bounded by lse, so exp2 may be inf there; select, never multiply.
    p = jnp.where(mask, p, 0.0)
  return p


class _BackwardMultipliers(NamedTuple):
  """Per-tile multipliers of the backward kernels (see the module docstring).

  Python floats (compile-time constants) for bf16/f16 inputs; float32 scalars
  read from the scalars operand for FP8.
  `dp` is None when there is no v descale to apply.
  """

  logits: float | jax.Array  # sm_scale * log2(e) [* descale_q * descale_k]
  dp: jax.Array | None  # descale_v
  dq: float | jax.Array  # sm_scale [* descale_k]
  dk: float | jax.Array  # sm_scale [* descale_q]


def _backward_multipliers(scalars_ref, sm_scale: float) -> _BackwardMultipliers:
  """Reads the FP8 scalars operand, or gives the static bf16/f16 multipliers."""
  if scalars_ref is None:
    return _BackwardMultipliers(logits=sm_scale * LOG2E, dp=None, dq=sm_scale, dk=sm_scale)
  return _BackwardMultipliers(logits=scalars_ref[0], dp=scalars_ref[1], dq=scalars_ref[2],
                              dk=scalars_ref[3])


def _dp_tile(do, v, dp_multiplier):
  """dP = dO v^T of one tile, times descale_v for E4M3 values of v."""
  dp = lax.dot_general(do, v, _NT, preferred_element_type=jnp.float32)
  return dp if dp_multiplier is None else dp * dp_multiplier


def _dkdv_kernel(*refs, tiling: _Tiling, sm_scale: float, scaled: bool):
  """One (kv block, batch, query head) program: dK and dV of its keys over all q blocks.

  `scaled`: the first operand is the FP8 backward's float32 scalars
  [logit multiplier, descale_v, sm_scale * descale_k, sm_scale * descale_q].
  """
  scalars_ref = refs[0] if scaled else None
  refs = refs[1:] if scaled else refs
  multipliers = _backward_multipliers(scalars_ref, sm_scale)
  if tiling.segmented:
    (q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, q_seg_ref, kv_seg_ref,
     dk_ref, dv_ref) = refs
  else:
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref = refs
    q_seg_ref = kv_seg_ref = None
  block_q, block_kv = tiling.block_q, tiling.block_kv
  kv_block = pl.program_id(0)
  kv_start = kv_block * block_kv
  k = k_ref[...]
  v = v_ref[...]
  kv_seg = kv_seg_ref[...] if tiling.segmented else None
  head_dim = k.shape[-1]

  def body(q_block, carry):
    dk, dv = carry
    q_start = q_block * block_q
    q_slice = pl.ds(q_start, block_q)
    q = q_ref[q_slice, :]
    do = do_ref[q_slice, :]
    q_seg = q_seg_ref[q_slice] if tiling.segmented else None
    p = _recompute_p(q, k, lse_ref[q_slice], tiling, q_start, kv_start, q_seg, kv_seg,
                     multipliers.logits)
    dv = dv + lax.dot_general(p.astype(do.dtype), do, _TN, preferred_element_type=jnp.float32)
    dp = _dp_tile(do, v, multipliers.dp)
    ds = p * (dp - delta_ref[q_slice][:, None])
    dk = dk + lax.dot_general(ds.astype(q.dtype), q, _TN, preferred_element_type=jnp.float32)
    return dk, dv

  # Causal: rows i < kv_start - causal_offset never see this block's keys.
  first_q_block = 0
  if tiling.causal:
    first_q_block = lax.div(jnp.maximum(kv_start - tiling.causal_offset, 0), block_q)
  zeros = jnp.zeros((block_kv, head_dim), jnp.float32)
  dk, dv = lax.fori_loop(first_q_block, tiling.num_q_blocks, body, (zeros, zeros))
  dk_ref[...] = (dk * multipliers.dk).astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)


def _dq_kernel(*refs, tiling: _Tiling, sm_scale: float, scaled: bool):
  """One (q block, batch, query head) program: dQ of its rows over all key blocks.

  `scaled`: as for `_dkdv_kernel`.
  """
  scalars_ref = refs[0] if scaled else None
  refs = refs[1:] if scaled else refs
  multipliers = _backward_multipliers(scalars_ref, sm_scale)
  if tiling.segmented:
    (q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, q_seg_ref, kv_seg_ref, dq_ref) = refs
  else:
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref = refs
    q_seg_ref = kv_seg_ref = None
  block_q, block_kv = tiling.block_q, tiling.block_kv
  q_block = pl.program_id(0)
  q_start = q_block * block_q
  q = q_ref[...]
  do = do_ref[...]
  lse2 = lse_ref[...]
  delta = delta_ref[...]
  q_seg = q_seg_ref[...] if tiling.segmented else None

  def body(kv_block, dq):
    kv_start = kv_block * block_kv
    kv_slice = pl.ds(kv_start, block_kv)
    k = k_ref[kv_slice, :]
    v = v_ref[kv_slice, :]
    kv_seg = kv_seg_ref[kv_slice] if tiling.segmented else None
    p = _recompute_p(q, k, lse2, tiling, q_start, kv_start, q_seg, kv_seg, multipliers.logits)
    dp = _dp_tile(do, v, multipliers.dp)
    ds = p * (dp - delta[:, None])
    return dq + lax.dot_general(ds.astype(k.dtype), k, _NN, preferred_element_type=jnp.float32)

  dq = jnp.zeros(q.shape, jnp.float32)
  dq = lax.fori_loop(0, _causal_kv_block_limit(tiling, q_block), body, dq)
  dq_ref[...] = (dq * multipliers.dq).astype(dq_ref.dtype)


def _backward_call(q, k, v, out, lse2, dout, q_seg, kv_seg, scalars=None, *,
                   options: _Options):
  """dQ, dK, dV of attention at (q, k, v), all in the compute dtype of q.

  Args:
    q, k, v: bf16/f16 [B, S, H(kv), D]; for FP8 the E4M3 values cast to bf16
      (not dequantized: the descales come in `scalars`).
    out, dout: [B, Sq, H, D] forward output and its cotangent (any float dtype).
    lse2: f32[B, H, Sq], base-2 log-sum-exp from the forward.
    scalars: None, or for FP8 `_fp8_backward_scalars(...)`, f32[4].
  """
  batch, q_len, num_heads, head_dim = q.shape
  kv_len, num_kv_heads = k.shape[1], k.shape[2]
  group = num_heads // num_kv_heads
  blocks = options.block_sizes
  dtype = q.dtype
  segmented = q_seg is not None
  block_q_dkv, block_kv_dkv = _fit(blocks.block_q_dkv, q_len), _fit(blocks.block_kv_dkv, kv_len)
  block_q_dq, block_kv_dq = _fit(blocks.block_q_dq, q_len), _fit(blocks.block_kv_dq, kv_len)
  q_pad = _round_up(q_len, max(block_q_dkv, block_q_dq))
  kv_pad = _round_up(kv_len, max(block_kv_dkv, block_kv_dq))

  delta = jnp.einsum("bqhd,bqhd->bhq", out.astype(jnp.float32), dout.astype(jnp.float32))
  # Rows with no allowed key have lse = -inf; +inf makes their recomputed P exactly 0,
  # and the padded rows get +inf for the same reason.
  lse2 = jnp.where(jnp.isfinite(lse2), lse2, jnp.inf)
  row_widths = [(0, 0), (0, 0), (0, q_pad - q_len)]
  lse2 = jnp.pad(lse2, row_widths, constant_values=jnp.inf)
  delta = jnp.pad(delta, row_widths)
  q_p, do_p = _pad_seq(q, q_pad), _pad_seq(dout.astype(dtype), q_pad)
  k_p, v_p = _pad_seq(k, kv_pad), _pad_seq(v, kv_pad)
  seg_operands = [_pad_seq(q_seg, q_pad), _pad_seq(kv_seg, kv_pad)] if segmented else []
  scaled = scalars is not None
  scalar_operands = [scalars] if scaled else []
  scalar_specs = [pl.BlockSpec((4,), lambda *_: (0,))] if scaled else []
  params = plgpu.CompilerParams(num_warps=blocks.num_warps_bwd,
                                num_stages=blocks.num_stages_bwd)

  # dK, dV: grid over key blocks; each program reads all of q, dO, lse, delta.
  tiling = _Tiling(q_len=q_len, kv_len=kv_len, block_q=block_q_dkv, block_kv=block_kv_dkv,
                   causal=options.causal, segmented=segmented)
  full_q = pl.BlockSpec((None, q_pad, None, head_dim), lambda j, b, h: (b, 0, h, 0))
  full_rows = pl.BlockSpec((None, None, q_pad), lambda j, b, h: (b, h, 0))
  kv_tile = pl.BlockSpec((None, block_kv_dkv, None, head_dim),
                         lambda j, b, h: (b, j, h // group, 0))
  in_specs = scalar_specs + [full_q, kv_tile, kv_tile, full_q, full_rows, full_rows]
  if segmented:
    in_specs += [pl.BlockSpec((None, q_pad), lambda j, b, h: (b, 0)),
                 pl.BlockSpec((None, block_kv_dkv), lambda j, b, h: (b, j))]
  # Per query head; a group's heads are summed below (no atomics, so deterministic).
  dkv_dtype = dtype if group == 1 else jnp.float32
  dkv_shape = jax.ShapeDtypeStruct((batch, kv_pad, num_heads, head_dim), dkv_dtype)
  dkv_spec = pl.BlockSpec((None, block_kv_dkv, None, head_dim), lambda j, b, h: (b, j, h, 0))
  dk, dv = pl.pallas_call(
      functools.partial(_dkdv_kernel, tiling=tiling, sm_scale=options.sm_scale,
                        scaled=scaled),
      grid=(kv_pad // block_kv_dkv, batch, num_heads),
      in_specs=in_specs,
      out_specs=[dkv_spec, dkv_spec],
      out_shape=[dkv_shape, dkv_shape],
      compiler_params=params,
      interpret=options.interpret,
      name="flash_attention_bwd_dkdv",
  )(*scalar_operands, q_p, k_p, v_p, do_p, lse2, delta, *seg_operands)

  # dQ: grid over query blocks; each program reads all of k and v.
  tiling = _Tiling(q_len=q_len, kv_len=kv_len, block_q=block_q_dq, block_kv=block_kv_dq,
                   causal=options.causal, segmented=segmented)
  q_tile = pl.BlockSpec((None, block_q_dq, None, head_dim), lambda i, b, h: (b, i, h, 0))
  row_tile = pl.BlockSpec((None, None, block_q_dq), lambda i, b, h: (b, h, i))
  full_kv = pl.BlockSpec((None, kv_pad, None, head_dim), lambda i, b, h: (b, 0, h // group, 0))
  in_specs = scalar_specs + [q_tile, full_kv, full_kv, q_tile, row_tile, row_tile]
  if segmented:
    in_specs += [pl.BlockSpec((None, block_q_dq), lambda i, b, h: (b, i)),
                 pl.BlockSpec((None, kv_pad), lambda i, b, h: (b, 0))]
  dq = pl.pallas_call(
      functools.partial(_dq_kernel, tiling=tiling, sm_scale=options.sm_scale, scaled=scaled),
      grid=(q_pad // block_q_dq, batch, num_heads),
      in_specs=in_specs,
      out_specs=q_tile,
      out_shape=jax.ShapeDtypeStruct((batch, q_pad, num_heads, head_dim), dtype),
      compiler_params=params,
      interpret=options.interpret,
      name="flash_attention_bwd_dq",
  )(*scalar_operands, q_p, k_p, v_p, do_p, lse2, delta, *seg_operands)

  dq, dk, dv = dq[:, :q_len], dk[:, :kv_len], dv[:, :kv_len]
  if group > 1:
    dk = dk.reshape(batch, kv_len, num_kv_heads, group, head_dim).sum(axis=3).astype(dtype)
    dv = dv.reshape(batch, kv_len, num_kv_heads, group, head_dim).sum(axis=3).astype(dtype)
  return dq, dk, dv


# ---------------------------------------------------------------------------
# Argument checks and option resolution.
# ---------------------------------------------------------------------------


def _is_fp8(x) -> bool:
  return jnp.dtype(x.dtype) in (E4M3, jnp.dtype(jnp.float8_e5m2))


def _check_qkv(q, k, v, any_head_dim: bool = False) -> None:
  """Shapes and dtypes the kernels take; `any_head_dim` for the jnp references."""
  for name, x in (("q", q), ("k", k), ("v", v)):
    if getattr(x, "ndim", None) != 4:
      raise ValueError(
          f"{name} must be a 4-D array [batch, seq, heads, head_dim], got shape "
          f"{getattr(x, 'shape', None)}.")
  if k.shape != v.shape:
    raise ValueError(f"k and v must have the same shape, got k {k.shape} and v {v.shape}.")
  if q.shape[0] != k.shape[0]:
    raise ValueError(f"q and k must have the same batch size, got q {q.shape} and k {k.shape}.")
  head_dim = q.shape[3]
  if k.shape[3] != head_dim:
    raise ValueError(
        f"q and k must have the same head_dim, got q {q.shape} and k {k.shape}.")
  if head_dim not in SUPPORTED_HEAD_DIMS and not any_head_dim:
    raise ValueError(
        f"head_dim={head_dim} (q.shape[3]) is not supported; use one of "
        f"{SUPPORTED_HEAD_DIMS}. Otherwise zero-pad q, k and v to a supported head_dim and "
        f"pass sm_scale=1/sqrt({head_dim}) (zero columns do not change the logits).")
  if q.shape[2] % k.shape[2] != 0:
    raise ValueError(
        f"num_heads={q.shape[2]} (q.shape[2]) must be a multiple of num_kv_heads="
        f"{k.shape[2]} (k.shape[2]) for grouped-query attention.")
  dtypes = {jnp.dtype(x.dtype) for x in (q, k, v)}
  if any(_is_fp8(x) for x in (q, k, v)):
    if dtypes != {E4M3}:
      raise TypeError(
          f"FP8 attention takes q, k and v all in float8_e4m3fn, got q {q.dtype}, k {k.dtype}, "
          f"v {v.dtype}. Quantize all three to E4M3 (or pass all three in bf16).")
  elif len(dtypes) != 1 or not jnp.issubdtype(q.dtype, jnp.floating):
    raise TypeError(
        f"q, k and v must share one floating dtype (bf16, f16 or f32), got q {q.dtype}, "
        f"k {k.dtype}, v {v.dtype}.")


def _check_segment_ids(q_segment_ids, kv_segment_ids, q, k):
  if (q_segment_ids is None) != (kv_segment_ids is None):
    raise ValueError(
        "q_segment_ids and kv_segment_ids must be given together (for self-attention pass "
        "the same array twice).")
  if q_segment_ids is None:
    return None, None
  for name, ids, x in (("q_segment_ids", q_segment_ids, q), ("kv_segment_ids", kv_segment_ids, k)):
    expected = x.shape[:2]
    if tuple(jnp.shape(ids)) != expected:
      raise ValueError(
          f"{name} must have shape [batch, seq] = {expected}, got {jnp.shape(ids)}.")
    if not jnp.issubdtype(jnp.result_type(ids), jnp.integer):
      raise TypeError(f"{name} must be an integer array, got {jnp.result_type(ids)}.")
  return jnp.asarray(q_segment_ids, jnp.int32), jnp.asarray(kv_segment_ids, jnp.int32)


def _scalar_f32(value, argname: str) -> jax.Array:
  if value is None:
    raise ValueError(f"{argname} is required for float8_e4m3fn inputs (x = x_fp8 * {argname}).")
  if jnp.shape(value) != ():
    raise ValueError(f"{argname} must be a scalar (per-tensor), got shape {jnp.shape(value)}.")
  return jnp.asarray(value, jnp.float32)


def _options(q, causal, sm_scale, block_sizes, interpret) -> _Options:
  if sm_scale is None:
    sm_scale = 1.0 / math.sqrt(q.shape[-1])
  if block_sizes is None:
    block_sizes = BlockSizes.for_head_dim(q.shape[-1])
  if not isinstance(block_sizes, BlockSizes):
    raise TypeError(f"block_sizes must be a BlockSizes, got {type(block_sizes).__name__}.")
  if interpret is None:
    # Pallas' Triton kernels only run on a GPU; on CPU the interpreter runs them.
    interpret = jax.default_backend() == "cpu"
  return _Options(causal=bool(causal), sm_scale=float(sm_scale), block_sizes=block_sizes,
                  interpret=bool(interpret))


def _compute_dtype(x):
  """bf16/f16 stay; f32 (and f64) inputs run in bf16: the kernels use 16-bit tensor cores."""
  dtype = jnp.dtype(x.dtype)
  return dtype if dtype in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)) else jnp.dtype(
      jnp.bfloat16)


# ---------------------------------------------------------------------------
# Public entry points.
# ---------------------------------------------------------------------------


def flash_attention_forward(
    q: jax.Array, k: jax.Array, v: jax.Array, *,
    descale_q: jax.Array | None = None, descale_k: jax.Array | None = None,
    descale_v: jax.Array | None = None, out_scale: jax.Array | None = None,
    q_segment_ids: jax.Array | None = None, kv_segment_ids: jax.Array | None = None,
    causal: bool = False, sm_scale: float | None = None,
    block_sizes: BlockSizes | None = None, interpret: bool | None = None,
) -> AttentionForward:
  """The forward kernel (not differentiable): `AttentionForward(out, out_amax, lse)`.

  Args:
    q: [batch, q_len, num_heads, head_dim], bf16/f16/f32 or float8_e4m3fn.
    k, v: [batch, kv_len, num_kv_heads, head_dim], q's dtype; num_kv_heads divides
      num_heads (grouped-query / multi-query attention).
    descale_q, descale_k, descale_v: float32[] for E4M3 inputs (`x = x_fp8 * descale`),
      e.g. `1 / scale` of the quantization. Arrays, so new values do not recompile.
    out_scale: optional float32[]; the output is then E4M3 `saturate(O * out_scale)`.
    q_segment_ids, kv_segment_ids: optional int [batch, q_len] / [batch, kv_len]; a
      query attends only to keys of equal id (padding: give padded tokens their own id).
    causal: query i attends only to keys j <= i + kv_len - q_len (bottom-right
      aligned; j <= i for equal lengths). Rows that see no key give 0.
    sm_scale: logit multiplier, default 1/sqrt(head_dim).
    block_sizes: tiles and launch knobs; default `BlockSizes.for_head_dim(head_dim)`.
    interpret: run the Pallas interpreter; default: when the default backend is CPU.
      Pass False to lower for a GPU from a CPU process (deviceless compile).

  Returns:
    `AttentionForward`: out (bf16/f16, f32 for f32 inputs, bf16 for E4M3 inputs, or
    E4M3 with `out_scale`), out_amax f32[] = max |O|, lse f32[batch, num_heads, q_len].
  """
  _check_qkv(q, k, v)
  q_seg, kv_seg = _check_segment_ids(q_segment_ids, kv_segment_ids, q, k)
  options = _options(q, causal, sm_scale, block_sizes, interpret)
  if q.dtype == E4M3:
    descales = (_scalar_f32(descale_q, "descale_q"), _scalar_f32(descale_k, "descale_k"),
                _scalar_f32(descale_v, "descale_v"))
    compute_dtype = jnp.dtype(jnp.bfloat16)
    result_dtype = compute_dtype
  else:
    for name, value in (("descale_q", descale_q), ("descale_k", descale_k),
                        ("descale_v", descale_v)):
      if value is not None:
        raise ValueError(
            f"{name} applies to float8_e4m3fn inputs only, but q has dtype {q.dtype}.")
    descales = None
    compute_dtype = _compute_dtype(q)
    result_dtype = jnp.dtype(q.dtype)
    q, k, v = (x.astype(compute_dtype) for x in (q, k, v))
  if out_scale is not None:
    out_scale = _scalar_f32(out_scale, "out_scale")
  out, out_amax, lse2 = _forward_jit(q, k, v, q_seg, kv_seg, descales, out_scale,
                                     options=options, out_dtype=compute_dtype)
  if out_scale is None:
    out = out.astype(result_dtype)
  return AttentionForward(out=out, out_amax=out_amax, lse=lse2 * (1.0 / LOG2E))


@functools.partial(jax.jit, static_argnames=("options", "out_dtype"))
def _forward_jit(q, k, v, q_seg, kv_seg, descales, out_scale, *, options, out_dtype):
  logit_multiplier = _logit_multiplier(options.sm_scale, descales)
  pv_multiplier = jnp.float32(1.0)
  if descales is not None:
    pv_multiplier = descales[2] * (1.0 / P_SCALE)
  quantize_out = out_scale is not None
  scalars = jnp.stack([logit_multiplier, pv_multiplier,
                       out_scale if quantize_out else jnp.float32(1.0), jnp.float32(0.0)])
  return _forward_call(q, k, v, q_seg, kv_seg, scalars, options=options,
                       out_dtype=E4M3 if quantize_out else out_dtype,
                       quantize_out=quantize_out)


def _logit_multiplier(sm_scale: float, descales):
  """float32 base-2 logit multiplier: sm_scale * log2(e) [* descale_q * descale_k].

  The forward and the FP8 backward both take it from here, so the backward's
  recomputed logits are the forward's ones bit for bit (up to summation order).
  """
  multiplier = jnp.float32(sm_scale * LOG2E)
  if descales is None:
    return multiplier
  return multiplier * descales[0] * descales[1]


def _fp8_backward_scalars(sm_scale: float, descales):
  """The FP8 backward kernels' float32 operand (they take E4M3 values cast to bf16).

  [logit multiplier, descale_v, sm_scale * descale_k, sm_scale * descale_q]: the
  logits, dP = dO v^T, dQ = dS k and dK = dS^T q each get their inputs' descales.
  """
  descale_q, descale_k, descale_v = descales
  return jnp.stack([_logit_multiplier(sm_scale, descales), descale_v,
                    jnp.float32(sm_scale) * descale_k, jnp.float32(sm_scale) * descale_q])


def flash_attention_backward(
    q: jax.Array, k: jax.Array, v: jax.Array, out: jax.Array, lse: jax.Array,
    dout: jax.Array, *,
    descale_q: jax.Array | None = None, descale_k: jax.Array | None = None,
    descale_v: jax.Array | None = None,
    q_segment_ids: jax.Array | None = None, kv_segment_ids: jax.Array | None = None,
    causal: bool = False, sm_scale: float | None = None,
    block_sizes: BlockSizes | None = None, interpret: bool | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """The backward kernels: (dq, dk, dv) from the forward's output and lse.

  Args:
    q, k, v, descale_*, q_segment_ids, kv_segment_ids, causal, sm_scale,
      block_sizes, interpret: exactly as given to `flash_attention_forward`.
      E4M3 inputs run in bf16 (exact for E4M3 values) with the descales
      applied in float32, as the forward does.
    out: the forward output [batch, q_len, num_heads, head_dim] in bf16/f16/f32
      (dequantize an E4M3 output first).
    lse: float32[batch, num_heads, q_len] from `flash_attention_forward`.
    dout: cotangent of `out`, same shape.

  Returns:
    (dq, dk, dv) shaped like q, k, v: the gradients w.r.t. q, k, v (for E4M3
    inputs: w.r.t. the dequantized q, k, v, in bf16). dk, dv are summed over
    the query heads that share a kv head.
  """
  _check_qkv(q, k, v)
  q_seg, kv_seg = _check_segment_ids(q_segment_ids, kv_segment_ids, q, k)
  options = _options(q, causal, sm_scale, block_sizes, interpret)
  for name, x in (("out", out), ("dout", dout)):
    if tuple(x.shape) != tuple(q.shape):
      raise ValueError(f"{name} must have q's shape {q.shape}, got {x.shape}.")
    if _is_fp8(x):
      raise TypeError(f"{name} has dtype {x.dtype}; pass it dequantized (bf16 or f32).")
  if tuple(jnp.shape(lse)) != (q.shape[0], q.shape[2], q.shape[1]):
    raise ValueError(
        f"lse must have shape [batch, num_heads, q_len] = "
        f"{(q.shape[0], q.shape[2], q.shape[1])}, got {jnp.shape(lse)}.")
  if q.dtype == E4M3:
    descales = (_scalar_f32(descale_q, "descale_q"), _scalar_f32(descale_k, "descale_k"),
                _scalar_f32(descale_v, "descale_v"))
    result_dtype = jnp.dtype(jnp.bfloat16)
  else:
    descales = None
    result_dtype = jnp.dtype(q.dtype)
  q, k, v = (x.astype(_compute_dtype(q)) for x in (q, k, v))
  dq, dk, dv = _backward_jit(q, k, v, out, lse, dout, q_seg, kv_seg, descales,
                             options=options)
  return dq.astype(result_dtype), dk.astype(result_dtype), dv.astype(result_dtype)


@functools.partial(jax.jit, static_argnames=("options",))
def _backward_jit(q, k, v, out, lse, dout, q_seg, kv_seg, descales, *, options):
  lse2 = jnp.asarray(lse, jnp.float32) * LOG2E
  scalars = None if descales is None else _fp8_backward_scalars(options.sm_scale, descales)
  return _backward_call(q, k, v, out, lse2, dout, q_seg, kv_seg, scalars, options=options)


def flash_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, *,
    q_segment_ids: jax.Array | None = None, kv_segment_ids: jax.Array | None = None,
    causal: bool = False, sm_scale: float | None = None,
    block_sizes: BlockSizes | None = None, interpret: bool | None = None,
) -> jax.Array:
  """Differentiable fused attention in bf16/f16 (f32 inputs run in bf16).

  Args:
    q: [batch, q_len, num_heads, head_dim]; k, v: [batch, kv_len, num_kv_heads, head_dim].
    Other arguments as for `flash_attention_forward`.

  Returns:
    out [batch, q_len, num_heads, head_dim] in q's dtype. Gradients flow to q, k, v
    through the fused backward kernels.
  """
  _check_qkv(q, k, v)
  if _is_fp8(q):
    raise TypeError(
        f"q has dtype {q.dtype}; use flash_attention_fp8 (differentiable) or "
        "flash_attention_forward (E4M3 inputs with descales).")
  q_seg, kv_seg = _check_segment_ids(q_segment_ids, kv_segment_ids, q, k)
  options = _options(q, causal, sm_scale, block_sizes, interpret)
  return _attention(q, k, v, q_seg, kv_seg, options)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _attention(q, k, v, q_seg, kv_seg, options):
  return _attention_fwd(q, k, v, q_seg, kv_seg, options)[0]


def _attention_fwd(q, k, v, q_seg, kv_seg, options):
  compute_dtype = _compute_dtype(q)
  qc, kc, vc = (x.astype(compute_dtype) for x in (q, k, v))
  out, _, lse2 = _forward_jit(qc, kc, vc, q_seg, kv_seg, None, None, options=options,
                              out_dtype=compute_dtype)
  return out.astype(q.dtype), (qc, kc, vc, out, lse2, q_seg, kv_seg)


def _attention_bwd(options, residuals, dout):
  qc, kc, vc, out, lse2, q_seg, kv_seg = residuals
  dq, dk, dv = _backward_call(qc, kc, vc, out, lse2, dout, q_seg, kv_seg, options=options)
  # The output was cast to the inputs' dtype, so its cotangent carries that dtype.
  dtype = dout.dtype
  return dq.astype(dtype), dk.astype(dtype), dv.astype(dtype), None, None


_attention.defvjp(_attention_fwd, _attention_bwd)


def flash_attention_fp8(
    q: jax.Array, k: jax.Array, v: jax.Array,
    q_scale: jax.Array, k_scale: jax.Array, v_scale: jax.Array, *,
    q_segment_ids: jax.Array | None = None, kv_segment_ids: jax.Array | None = None,
    causal: bool = False, sm_scale: float | None = None,
    block_sizes: BlockSizes | None = None, interpret: bool | None = None,
) -> tuple[jax.Array, jax.Array]:
  """Differentiable FP8 attention: quantizes q, k, v to E4M3 and runs the FP8 kernel.

  `x_fp8 = saturate(x * x_scale)` for x in (q, k, v); the kernel sees the E4M3
  values with descales `1 / x_scale`. The backward is straight-through: it returns
  the exact-attention gradients at the dequantized q, k, v (computed in bf16 by the
  fused backward kernels), as the gradients w.r.t. q, k, v. Scales get no gradient.

  Args:
    q, k, v: bf16/f16/f32 arrays, shapes as for `flash_attention`.
    q_scale, k_scale, v_scale: float32[] quantization scales (multiply before the cast).
    Other arguments as for `flash_attention_forward`.

  Returns:
    (out bf16 [batch, q_len, num_heads, head_dim], out_amax f32[] = max |O|).
  """
  _check_qkv(q, k, v)
  if _is_fp8(q):
    raise TypeError(
        f"q has dtype {q.dtype}; flash_attention_fp8 quantizes bf16/f16/f32 inputs itself. "
        "For already-quantized inputs use flash_attention_forward with descales.")
  scales = tuple(_scalar_f32(s, name) for s, name in
                 ((q_scale, "q_scale"), (k_scale, "k_scale"), (v_scale, "v_scale")))
  q_seg, kv_seg = _check_segment_ids(q_segment_ids, kv_segment_ids, q, k)
  options = _options(q, causal, sm_scale, block_sizes, interpret)
  return _attention_fp8(q, k, v, scales, q_seg, kv_seg, options, jnp.dtype(q.dtype))


def _quantize_e4m3(x, scale):
  return jnp.clip(x.astype(jnp.float32) * scale, -E4M3_MAX, E4M3_MAX).astype(E4M3)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def _attention_fp8(q, k, v, scales, q_seg, kv_seg, options, input_dtype):
  return _attention_fp8_fwd(q, k, v, scales, q_seg, kv_seg, options, input_dtype)[0]


def _attention_fp8_fwd(q, k, v, scales, q_seg, kv_seg, options, input_dtype):
  quantized = tuple(_quantize_e4m3(x, s) for x, s in zip((q, k, v), scales))
  descales = tuple(1.0 / s for s in scales)
  out, out_amax, lse2 = _forward_jit(*quantized, q_seg, kv_seg, descales, None,
                                     options=options, out_dtype=jnp.dtype(jnp.bfloat16))
  # The natural-log lse, as `flash_attention_forward` returns it: the backward below is
  # then the public `flash_attention_backward` path, bit for bit (base 2 -> e -> 2 is
  # not exact in float32, and a last-bit change of lse can flip a bf16 rounding of P).
  residuals = (quantized, descales, out, lse2 * (1.0 / LOG2E), q_seg, kv_seg)
  return (out, out_amax), residuals


def _attention_fp8_bwd(options, input_dtype, residuals, cotangents):
  quantized, descales, out, lse, q_seg, kv_seg = residuals
  dout, _ = cotangents  # out_amax is a statistic, not a differentiable output.
  q, k, v = (x.astype(jnp.bfloat16) for x in quantized)
  grads = _backward_jit(q, k, v, out, lse, dout, q_seg, kv_seg, descales, options=options)
  grads = tuple(g.astype(input_dtype) for g in grads)
  return (*grads, None, None, None)


_attention_fp8.defvjp(_attention_fp8_fwd, _attention_fp8_bwd)


def segment_ids_from_lengths(lengths: jax.Array, seq_len: int) -> jax.Array:
  """int32[batch, seq_len] segment ids: 1 for positions < lengths[b], 0 after.

  Pass the result as both q_segment_ids and kv_segment_ids for padded
  self-attention: real tokens attend only to real tokens (padded rows attend to
  padding and should be ignored by the caller).
  """
  lengths = jnp.asarray(lengths)
  if lengths.ndim != 1:
    raise ValueError(f"lengths must be a 1-D [batch] array, got shape {lengths.shape}.")
  return (jnp.arange(seq_len)[None, :] < lengths[:, None]).astype(jnp.int32)


def _reference_mask(q_len: int, kv_len: int, causal: bool, q_seg, kv_seg):
  """Boolean [batch or 1, 1, q_len, kv_len] of allowed (query, key) pairs (the kernels' mask)."""
  allowed = jnp.ones((1, 1, q_len, kv_len), bool)
  if causal:
    offset = kv_len - q_len  # bottom-right alignment
    allowed &= jnp.arange(kv_len)[None, :] <= jnp.arange(q_len)[:, None] + offset
  if q_seg is not None:
    allowed &= q_seg[:, None, :, None] == kv_seg[:, None, None, :]
  return allowed


def attention_reference(
    q: jax.Array, k: jax.Array, v: jax.Array, *,
    descale_q: jax.Array | None = None, descale_k: jax.Array | None = None,
    descale_v: jax.Array | None = None,
    q_segment_ids: jax.Array | None = None, kv_segment_ids: jax.Array | None = None,
    causal: bool = False, sm_scale: float | None = None,
) -> jax.Array:
  """Plain-jnp attention in float32 with the kernels' semantics (for tests and fallbacks).

  Same layout, masking (bottom-right causal), GQA and E4M3 descale conventions as
  `flash_attention_forward`; P is not rounded to E4M3 here (`fp8_forward_reference`
  does that as the kernel does). A row with no allowed key gives 0.

  Returns:
    float32 [batch, q_len, num_heads, head_dim].
  """
  _check_qkv(q, k, v)
  q_seg, kv_seg = _check_segment_ids(q_segment_ids, kv_segment_ids, q, k)
  if sm_scale is None:
    sm_scale = 1.0 / math.sqrt(q.shape[-1])
  if q.dtype == E4M3:
    q, k, v = (x.astype(jnp.float32) * _scalar_f32(d, name) for x, d, name in
               ((q, descale_q, "descale_q"), (k, descale_k, "descale_k"),
                (v, descale_v, "descale_v")))
  q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
  group = q.shape[2] // k.shape[2]
  k = jnp.repeat(k, group, axis=2)
  v = jnp.repeat(v, group, axis=2)
  logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) * sm_scale
  allowed = _reference_mask(q.shape[1], k.shape[1], causal, q_seg, kv_seg)
  logits = jnp.where(allowed, logits, -jnp.inf)
  row_max = jnp.max(logits, axis=-1, keepdims=True)
  row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
  weights = jnp.where(allowed, jnp.exp(logits - row_max), 0.0)
  total = jnp.sum(weights, axis=-1, keepdims=True)
  probs = weights / jnp.where(total > 0, total, 1.0)
  return jnp.einsum("bhqk,bkhd->bqhd", probs, v)


def block_descale_rows(descales, q, k):
  """(descale_q [b, heads, q_len], descale_k, descale_v [b, kv_heads, kv_len]): block
  descales (one per SCALE_BLOCK rows of each head) expanded to one per row, float32; None
  when all three are per tensor (size 1). Raises ValueError for other shapes."""
  if all(math.prod(jnp.shape(d)) == 1 for d in descales):
    return None
  batch, q_len, num_heads, _ = q.shape
  kv_len, num_kv_heads = k.shape[1], k.shape[2]
  rows = {"descale_q": (batch, num_heads, _cdiv(q_len, SCALE_BLOCK), q_len),
          "descale_k": (batch, num_kv_heads, _cdiv(kv_len, SCALE_BLOCK), kv_len),
          "descale_v": (batch, num_kv_heads, _cdiv(kv_len, SCALE_BLOCK), kv_len)}
  per_row = []
  for (name, (*shape, length)), d in zip(rows.items(), descales):
    if jnp.shape(d) != tuple(shape):
      raise ValueError(f"{name} has shape {jnp.shape(d)}; block descales are "
                       f"[batch, heads, ceil(seq / {SCALE_BLOCK})] = {tuple(shape)} "
                       "(or pass all three descales as scalars).")
    per_row.append(jnp.repeat(jnp.asarray(d, jnp.float32), SCALE_BLOCK,
                              axis=2)[..., :length])
  return tuple(per_row)


def _reference_multipliers(sm_scale: float, descales, q, k):
  """(logit, P and output multipliers) of `fp8_forward_reference`, broadcastable to its
  logits [b, kv_heads, group, q, kv], to P's keys [b, kv_heads, 1, 1, kv] and to its
  [b, q, kv_heads, group, d] accumulator."""
  rows = block_descale_rows(descales, q, k)
  if rows is None:
    descales = tuple(_scalar_f32(jnp.reshape(d, ()), name) for d, name in
                     zip(descales, ("descale_q", "descale_k", "descale_v")))
    return (_logit_multiplier(sm_scale, descales), jnp.full((1,) * 5, P_SCALE, jnp.float32),
            descales[2] * (1.0 / P_SCALE))
  batch, q_len, num_heads, _ = q.shape
  num_kv_heads = k.shape[2]
  dq, dk, dv = rows
  v_max = jnp.max(dv, axis=2, keepdims=True)
  v_max = jnp.where(v_max > 0, v_max, 1.0)  # [b, kv_heads, 1], as the Hopper wrapper does
  logit = (jnp.float32(sm_scale * LOG2E)
           * dq.reshape(batch, num_kv_heads, num_heads // num_kv_heads, q_len, 1)
           ) * dk[:, :, None, None, :]
  p = (P_SCALE * (dv / v_max))[:, :, None, None, :]
  out = (v_max[:, None, :, :, None] * (1.0 / P_SCALE))  # [b, 1, kv_heads, 1, 1]
  return logit, p, out


def fp8_forward_reference(
    q: jax.Array, k: jax.Array, v: jax.Array, *,
    descale_q: jax.Array, descale_k: jax.Array, descale_v: jax.Array,
    q_segment_ids: jax.Array | None = None, kv_segment_ids: jax.Array | None = None,
    causal: bool = False, sm_scale: float | None = None,
    block_sizes: BlockSizes | None = None,
) -> AttentionForward:
  """The FP8 forward kernel's arithmetic in plain jnp (no Pallas), e.g. for an XLA path.

  The kernel (see the module docstring) computes base-2 logits
  `s = dot(q8, k8) * (sm_scale * log2(e) * descale_q * descale_k)` and, per key block
  of `block_kv` keys, `p = 2^(s - m)` with m the running row max over the blocks seen
  so far; it rounds `p * P_SCALE` to E4M3 for the P.v product and rescales earlier
  blocks' products by `2^(m_old - m_new)` when m grows. The row sum l uses the
  unrounded p. Here each block's p is rounded against that same running max and
  weighted by `2^(m_block - m_row)`, so P's E4M3 values equal the kernel's and the
  results differ only by float32 summation order.

  Block descales (one per SCALE_BLOCK = 128 rows of each head) are the Hopper
  kernel's arithmetic (`pallas_kernels.hopper_attention_forward`): the logits take the
  query's and the key's block descales, and P is rounded as `P * 256 * r_j`, r_j = the
  key's V block descale over the largest of its head, the output scaled by that
  largest / 256.

  Args:
    q, k, v: float8_e4m3fn, shapes as for `flash_attention_forward`.
    descale_q, descale_k, descale_v: float32 (`x = x_fp8 * descale`): all three scalars
      (per tensor), or per block of 128 rows of each head: descale_q
      [batch, num_heads, ceil(q_len / 128)], descale_k and descale_v [batch,
      num_kv_heads, ceil(kv_len / 128)].
    q_segment_ids, kv_segment_ids, causal, sm_scale: as for `flash_attention_forward`.
    block_sizes: the kernel's tiles (only block_kv matters); default as the kernel's
      (with block descales the Hopper kernel's 128 keys).

  Returns:
    `AttentionForward` as the kernel returns it: out bf16, out_amax f32[] = max |O|
    (before the bf16 cast), lse f32[batch, num_heads, q_len].
  """
  _check_qkv(q, k, v, any_head_dim=True)  # the XLA path runs every head_dim
  if q.dtype != E4M3:
    raise TypeError(f"fp8_forward_reference takes float8_e4m3fn q, k, v; got {q.dtype}.")
  q_seg, kv_seg = _check_segment_ids(q_segment_ids, kv_segment_ids, q, k)
  descales = (descale_q, descale_k, descale_v)
  if block_sizes is None and not all(math.prod(jnp.shape(d)) == 1 for d in descales):
    block_sizes = BlockSizes(block_kv=HopperAttentionBlockSizes().block_kv)
  options = _options(q, causal, sm_scale, block_sizes, interpret=False)
  batch, q_len, num_heads, head_dim = q.shape
  kv_len, num_kv_heads = k.shape[1], k.shape[2]
  group = num_heads // num_kv_heads
  block_kv = _fit(options.block_sizes.block_kv, kv_len)
  num_blocks = _cdiv(kv_len, block_kv)
  logit_multiplier, p_multiplier, out_multiplier = _reference_multipliers(
      options.sm_scale, descales, q, k)

  # [b, kv_heads, group, q, kv]: products of E4M3 values are exact in float32.
  qf = q.astype(jnp.float32).reshape(batch, q_len, num_kv_heads, group, head_dim)
  s = jnp.einsum("bqhgd,bkhd->bhgqk", qf, k.astype(jnp.float32),
                 precision=lax.Precision.HIGHEST) * logit_multiplier
  allowed = _reference_mask(q_len, kv_len, causal, q_seg, kv_seg)[:, :, None]
  s = jnp.where(allowed, s, MASK_VALUE)
  # The kernel's key blocks; keys past kv_len are masked as in its last block.
  pad = [(0, 0)] * 4 + [(0, num_blocks * block_kv - kv_len)]
  s_blocks = jnp.pad(s, pad, constant_values=MASK_VALUE)
  allowed_blocks = jnp.pad(jnp.broadcast_to(allowed, s.shape), pad)
  s_blocks = s_blocks.reshape(*s.shape[:-1], num_blocks, block_kv)
  allowed_blocks = allowed_blocks.reshape(s_blocks.shape)
  block_max = jnp.max(s_blocks, axis=-1)
  m_block = lax.cummax(block_max, axis=block_max.ndim - 1)  # the kernel's running max
  m_row = m_block[..., -1:]
  p = jnp.where(allowed_blocks, jnp.exp2(s_blocks - m_block[..., None]), 0.0)
  rescale = jnp.exp2(m_block - m_row)[..., None]
  l = jnp.sum(p * rescale, axis=(-2, -1))  # [b, kv_heads, group, q]
  # P's multiplier per key, in the key blocks' shape (padded keys have p = 0).
  p_multiplier = jnp.pad(jnp.broadcast_to(p_multiplier, p_multiplier.shape[:-1] + (kv_len,)),
                         pad, constant_values=P_SCALE).reshape(
                             *p_multiplier.shape[:-1], num_blocks, block_kv)
  p8 = (p * p_multiplier).astype(E4M3).astype(jnp.float32) * rescale
  p8 = p8.reshape(*s.shape[:-1], num_blocks * block_kv)[..., :kv_len]
  acc = jnp.einsum("bhgqk,bkhd->bqhgd", p8, v.astype(jnp.float32),
                   precision=lax.Precision.HIGHEST)
  # l == 0 only for a row with no allowed key: its output is 0, its lse -inf.
  l_safe = jnp.moveaxis(jnp.where(l > 0.0, l, 1.0), 3, 1)[..., None]  # as acc
  o = acc * (out_multiplier / l_safe)
  o = o.reshape(batch, q_len, num_heads, head_dim)
  lse = (m_row[..., 0] + jnp.log2(l)).reshape(batch, num_heads, q_len) * (1.0 / LOG2E)
  # initial=0: the amax of an empty batch is 0 (nothing observed).
  return AttentionForward(out=o.astype(jnp.bfloat16), out_amax=jnp.max(jnp.abs(o), initial=0.0),
                          lse=lse)
