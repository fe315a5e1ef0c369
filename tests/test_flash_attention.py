"""Fused flash attention kernels (interpret mode on CPU) against a float64 numpy reference.

Every comparison feeds the reference the very values the kernel saw (bf16 inputs
upcast, or the dequantized E4M3 values), so the measured error is the kernel's
own: 16-bit rounding of P, dS and the outputs (bf16 path) and E4M3 rounding of
P (FP8 path).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.flash_attention import (
    BlockSizes, attention_reference, flash_attention, flash_attention_backward,
    flash_attention_forward, flash_attention_fp8, segment_ids_from_lengths)

# Small tiles so that sequences of a few hundred tokens span several blocks in every
# kernel; the forward, dK/dV and dQ kernels get different tilings on purpose so their
# loop bounds (causal limits, tails) are each exercised.
SMALL_BLOCKS = BlockSizes(block_q=64, block_kv=32, block_q_dkv=32, block_kv_dkv=64,
                          block_q_dq=64, block_kv_dq=32)

# bf16 path: q, k, v are exact in the reference; the kernel rounds P (for P.v) and dS
# (for dS.k, dS^T.q) to bf16 and rounds each output to bf16, each a relative error of at
# most 2**-9 per element. A few such roundings in sequence stay far below 1e-2 in
# relative norm (measured: about 2e-3).
BF16_TOL = 1e-2
# FP8 path: the reference gets the dequantized E4M3 q, k, v, so the remaining error is
# P's E4M3 rounding (3 mantissa bits: at most 2**-4 relative per element) in
# O = sum_j P_ij v_j / l_i. Each output element's error is a weighted sum of such
# per-element errors, bounded by 2**-4 * sum_j P_ij |v_j|; on random data the signs mix
# and the relative norm error is about 0.02 (measured), so 2**-4 is the bound, not the
# typical value. dQ and dK depend on the forward O through delta = rowsum(dO * O) and
# inherit that bound; dV = P^T dO uses the P recomputed in float32, so it keeps the
# bf16 tolerance.
FP8_TOL = 2.0**-4
# lse: the logits are float32 sums of exact products of 16-bit (or 8-bit) values,
# off by float32 accumulation error (~1e-6 relative on logits of order 10). 1e-3 is
# loose for that but still catches a missing or extra key (which moves lse by
# log(1 + weight / l), ~1/kv_len for one average key).
LSE_ATOL = 1e-3


@dataclasses.dataclass(frozen=True)
class Case:
  batch: int
  q_len: int
  kv_len: int
  heads: int
  kv_heads: int
  head_dim: int
  causal: bool = False
  segments: str | None = None  # None, "padded" (lengths) or "packed" (two documents + padding)


def _inputs(case: Case, dtype, seed: int = 0):
  rng = np.random.default_rng(seed)

  def normal(*shape):
    return jnp.asarray(rng.standard_normal(shape), jnp.float32).astype(dtype)

  q = normal(case.batch, case.q_len, case.heads, case.head_dim)
  k = normal(case.batch, case.kv_len, case.kv_heads, case.head_dim)
  v = normal(case.batch, case.kv_len, case.kv_heads, case.head_dim)
  dout = normal(case.batch, case.q_len, case.heads, case.head_dim)
  q_seg = kv_seg = None
  if case.segments == "padded":
    # Batch element 0 is fully valid, the others are padded at the end.
    q_seg = segment_ids_from_lengths(
        jnp.array([case.q_len] + [case.q_len * 2 // 3] * (case.batch - 1)), case.q_len)
    kv_seg = segment_ids_from_lengths(
        jnp.array([case.kv_len] + [case.kv_len * 2 // 3] * (case.batch - 1)), case.kv_len)
  elif case.segments == "packed":
    assert case.q_len == case.kv_len, "packed documents are a self-attention case"
    ids = np.zeros((case.batch, case.q_len), np.int32)
    ids[:, : case.q_len // 3] = 1
    ids[:, case.q_len // 3: case.q_len - 17] = 2
    q_seg = kv_seg = jnp.asarray(ids)
  return q, k, v, dout, q_seg, kv_seg


def _reference(q, k, v, dout, q_seg, kv_seg, causal, sm_scale, delta_out=None):
  """float64 numpy attention forward and backward: (out, lse, dq, dk, dv).

  Rows with no allowed key give out = 0, lse = -inf and zero gradients.
  `delta_out`: take delta = rowsum(dO * O) from this output (e.g. a kernel's own
  forward output) instead of the exact one; only dq and dk depend on it.
  """
  q, k, v, dout = (np.asarray(jnp.asarray(x, jnp.float32), np.float64) for x in (q, k, v, dout))
  batch, q_len, heads, head_dim = q.shape
  kv_len, kv_heads = k.shape[1], k.shape[2]
  group = heads // kv_heads
  k_rep, v_rep = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)
  s = np.einsum("bqhd,bkhd->bhqk", q, k_rep) * sm_scale
  allowed = np.ones(s.shape, bool)
  if causal:  # bottom-right aligned: query i sees keys j <= i + kv_len - q_len
    allowed &= np.arange(kv_len)[None, :] <= np.arange(q_len)[:, None] + (kv_len - q_len)
  if q_seg is not None:
    allowed &= np.asarray(q_seg)[:, None, :, None] == np.asarray(kv_seg)[:, None, None, :]
  masked = np.where(allowed, s, -np.inf)
  m = masked.max(axis=-1, keepdims=True)
  m = np.where(np.isfinite(m), m, 0.0)
  w = np.exp(masked - m)
  l = w.sum(axis=-1, keepdims=True)
  p = w / np.where(l > 0, l, 1.0)
  with np.errstate(divide="ignore"):
    lse = (m + np.log(l))[..., 0]
  out = np.einsum("bhqk,bkhd->bqhd", p, v_rep)
  dv = np.einsum("bhqk,bqhd->bkhd", p, dout)
  dp = np.einsum("bqhd,bkhd->bhqk", dout, v_rep)
  if delta_out is None:
    delta = np.sum(dp * p, axis=-1, keepdims=True)
  else:
    delta_out = np.asarray(jnp.asarray(delta_out, jnp.float32), np.float64)
    delta = np.einsum("bqhd,bqhd->bhq", dout, delta_out)[..., None]
  ds = p * (dp - delta)
  dq = np.einsum("bhqk,bkhd->bqhd", ds, k_rep) * sm_scale
  dk = np.einsum("bhqk,bqhd->bkhd", ds, q) * sm_scale
  dk = dk.reshape(batch, kv_len, kv_heads, group, head_dim).sum(axis=3)
  dv = dv.reshape(batch, kv_len, kv_heads, group, head_dim).sum(axis=3)
  return out, lse, dq, dk, dv


def _rel_err(actual, expected) -> float:
  actual = np.asarray(jnp.asarray(actual, jnp.float32), np.float64)
  return float(np.linalg.norm(actual - expected) / np.linalg.norm(expected))


def _quantize(x, scale):
  """E4M3 saturate(x * scale) and its dequantized float32 value."""
  q8 = jnp.clip(x.astype(jnp.float32) * scale, -448.0, 448.0).astype(jnp.float8_e4m3fn)
  return q8, q8.astype(jnp.float32) / scale


BF16_CASES = {
    "noncausal_mha_d64": Case(2, 256, 256, 2, 2, 64),
    "causal_gqa_d128_tail": Case(1, 200, 200, 4, 2, 128, causal=True),
    "padded_mqa_d64": Case(2, 192, 192, 4, 1, 64, segments="padded"),
    "causal_packed_d256_tail": Case(1, 136, 136, 2, 2, 256, causal=True, segments="packed"),
    "cross_attention_kv_longer_tail": Case(1, 96, 300, 2, 1, 128),
}


@pytest.mark.parametrize("name", list(BF16_CASES))
def test_bf16_forward_and_gradients_match_float64_reference(name):
  case = BF16_CASES[name]
  q, k, v, dout, q_seg, kv_seg = _inputs(case, jnp.bfloat16)
  kwargs = dict(q_segment_ids=q_seg, kv_segment_ids=kv_seg, causal=case.causal,
                block_sizes=SMALL_BLOCKS)
  out, vjp = jax.vjp(lambda q, k, v: flash_attention(q, k, v, **kwargs), q, k, v)
  dq, dk, dv = vjp(dout)
  fwd = flash_attention_forward(q, k, v, **kwargs)
  ref_out, ref_lse, ref_dq, ref_dk, ref_dv = _reference(
      q, k, v, dout, q_seg, kv_seg, case.causal, case.head_dim**-0.5)

  assert out.dtype == jnp.bfloat16 and dq.dtype == dk.dtype == dv.dtype == jnp.bfloat16
  assert _rel_err(out, ref_out) < BF16_TOL
  assert _rel_err(dq, ref_dq) < BF16_TOL
  assert _rel_err(dk, ref_dk) < BF16_TOL
  assert _rel_err(dv, ref_dv) < BF16_TOL
  np.testing.assert_allclose(np.asarray(fwd.lse), ref_lse, atol=LSE_ATOL, rtol=0)
  # The differentiable entry and the forward entry run the same kernel.
  np.testing.assert_array_equal(np.asarray(fwd.out, np.float32), np.asarray(out, np.float32))
  # out_amax is max|O| before the bf16 cast; rounding is monotone, so it rounds to max|out|.
  assert fwd.out_amax.astype(jnp.bfloat16) == jnp.max(jnp.abs(out))
  assert abs(float(fwd.out_amax) / np.abs(ref_out).max() - 1) < BF16_TOL


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.float32])
def test_f16_and_f32_inputs_run_and_return_their_dtype(dtype):
  # f16 runs natively (P and dS rounded to f16: 2**-11, tighter than bf16); f32 runs in
  # bf16 inside, adding one bf16 rounding (2**-9) of q, k, v: both within BF16_TOL.
  case = Case(1, 128, 128, 2, 1, 64, causal=True)
  q, k, v, dout, _, _ = _inputs(case, dtype, seed=1)
  out, vjp = jax.vjp(
      lambda q, k, v: flash_attention(q, k, v, causal=True, block_sizes=SMALL_BLOCKS), q, k, v)
  dq, dk, dv = vjp(dout)
  ref_out, _, ref_dq, ref_dk, ref_dv = _reference(q, k, v, dout, None, None, True, 64**-0.5)
  assert out.dtype == dq.dtype == dk.dtype == dv.dtype == dtype
  for actual, expected in ((out, ref_out), (dq, ref_dq), (dk, ref_dk), (dv, ref_dv)):
    assert _rel_err(actual, expected) < BF16_TOL


FP8_CASES = {
    "noncausal_gqa_d128_tail": Case(1, 200, 200, 4, 2, 128),
    "causal_padded_d64": Case(2, 160, 160, 2, 2, 64, causal=True, segments="padded"),
    "causal_mqa_d256": Case(1, 128, 128, 2, 1, 256, causal=True),
}


@pytest.mark.parametrize("name", list(FP8_CASES))
def test_fp8_forward_and_gradients_match_float64_reference_on_dequantized_inputs(name):
  case = FP8_CASES[name]
  q, k, v, dout, q_seg, kv_seg = _inputs(case, jnp.float32, seed=2)
  dout = dout.astype(jnp.bfloat16)
  # Current-scaling-style scales: each tensor's amax maps to E4M3's max (448).
  scales = [jnp.float32(448.0) / jnp.max(jnp.abs(x)) for x in (q, k, v)]
  (q8, q_deq), (k8, k_deq), (v8, v_deq) = (_quantize(x, s) for x, s in zip((q, k, v), scales))
  kwargs = dict(q_segment_ids=q_seg, kv_segment_ids=kv_seg, causal=case.causal,
                block_sizes=SMALL_BLOCKS)

  (out, out_amax), vjp = jax.vjp(
      lambda q, k, v: flash_attention_fp8(q, k, v, *scales, **kwargs), q, k, v)
  dq, dk, dv = vjp((dout, jnp.zeros((), jnp.float32)))
  ref_out, ref_lse, ref_dq, ref_dk, ref_dv = _reference(
      q_deq, k_deq, v_deq, dout, q_seg, kv_seg, case.causal, case.head_dim**-0.5)

  assert out.dtype == jnp.bfloat16 and dq.dtype == jnp.float32
  assert _rel_err(out, ref_out) < FP8_TOL
  assert _rel_err(dq, ref_dq) < FP8_TOL
  assert _rel_err(dk, ref_dk) < FP8_TOL
  assert _rel_err(dv, ref_dv) < BF16_TOL
  assert abs(float(out_amax) / np.abs(ref_out).max() - 1) < FP8_TOL

  # The raw kernel entry on the E4M3 arrays with descales: same result, plus lse and
  # an E4M3 output whose max is out_amax rounded (monotone rounding, as above).
  out_scale = jnp.float32(100.0)
  fwd = flash_attention_forward(q8, k8, v8, descale_q=1 / scales[0], descale_k=1 / scales[1],
                                descale_v=1 / scales[2], out_scale=out_scale, **kwargs)
  np.testing.assert_allclose(np.asarray(fwd.lse), ref_lse, atol=LSE_ATOL, rtol=0)
  assert fwd.out.dtype == jnp.float8_e4m3fn
  assert float(fwd.out_amax) == float(out_amax)
  assert (jnp.max(jnp.abs(fwd.out.astype(jnp.float32)))
          == (fwd.out_amax * out_scale).astype(jnp.float8_e4m3fn).astype(jnp.float32))
  # Dequantized E4M3 output: one more E4M3 rounding (2**-4) on top of the bf16 result.
  assert _rel_err(fwd.out.astype(jnp.float32) / out_scale, ref_out) < 2 * FP8_TOL

  # The backward entry on the E4M3 arrays reproduces the differentiable wrapper.
  grads = flash_attention_backward(
      q8, k8, v8, out, fwd.lse, dout, descale_q=1 / scales[0], descale_k=1 / scales[1],
      descale_v=1 / scales[2], **kwargs)
  for entry_grad, wrapper_grad in zip(grads, (dq, dk, dv)):
    np.testing.assert_array_equal(np.asarray(entry_grad, np.float32),
                                  np.asarray(wrapper_grad, np.float32))


def test_fp8_gradients_of_peaked_attention_are_exact_gradients_at_dequantized_inputs():
  # q ~ 4 N(0, 1) gives logits of standard deviation 4: each row's softmax is
  # dominated by a few keys, so the gradients are sensitive to how well the backward
  # reproduces the forward's P. The backward recomputes P = exp(S - lse) from the
  # forward's lse, which is only consistent if S is the forward's S; the kernel takes
  # the E4M3 values themselves (exact in bf16) and the forward's float32 multiplier, so
  # S matches up to float32 summation order. What remains is the bf16 path's error,
  # two bf16 roundings in sequence (of P or dS for the product, then of the result),
  # each at most 2**-9 relative per element and of mixed sign: `tol` = 2**-8 is their
  # sum (measured: 2.4e-3, as on the bf16 path). That holds for
  #  - dV = P^T dO, which does not involve the forward's O;
  #  - dQ, dK against a reference that takes delta = rowsum(dO * O) from the kernel's
  #    own forward O. Against the exact reference they also differ by
  #    sm_scale * (delta_O - delta)_i * (P k)_i (and its dK analogue), where
  #    delta_O - delta = dO_i . (O_kernel - O)_i carries P's E4M3 rounding in the
  #    forward: the FP8 forward's FP8_TOL bound (measured: 9.6e-3).
  # Dequantizing to bf16 before the backward (rounding q * descale_q and k * descale_k
  # to 8 bits) moves the recomputed logits off the forward's, so the recomputed P no
  # longer sums to 1: that gave 1.2e-2 on dV and 1.4e-2 on dQ, dK (O-consistent).
  tol = 2.0**-8
  case = Case(1, 232, 232, 2, 1, 128, causal=True)
  q, k, v, dout, _, _ = _inputs(case, jnp.float32, seed=9)
  q = 4.0 * q
  dout = dout.astype(jnp.bfloat16)
  scales = [jnp.float32(448.0) / jnp.max(jnp.abs(x)) for x in (q, k, v)]
  (_, q_deq), (_, k_deq), (_, v_deq) = (_quantize(x, s) for x, s in zip((q, k, v), scales))
  (out, _), vjp = jax.vjp(lambda q, k, v: flash_attention_fp8(
      q, k, v, *scales, causal=True, block_sizes=SMALL_BLOCKS), q, k, v)
  dq, dk, dv = vjp((dout, jnp.zeros((), jnp.float32)))
  sm_scale = case.head_dim**-0.5
  _, _, ref_dq, ref_dk, ref_dv = _reference(
      q_deq, k_deq, v_deq, dout, None, None, True, sm_scale)
  _, _, ref_dq_o, ref_dk_o, _ = _reference(
      q_deq, k_deq, v_deq, dout, None, None, True, sm_scale, delta_out=out)

  assert _rel_err(dv, ref_dv) < tol
  assert _rel_err(dq, ref_dq_o) < tol
  assert _rel_err(dk, ref_dk_o) < tol
  assert _rel_err(dq, ref_dq) < FP8_TOL
  assert _rel_err(dk, ref_dk) < FP8_TOL


def test_fp8_descales_are_traced_so_new_scales_do_not_retrace():
  case = Case(1, 64, 64, 2, 2, 64)
  q, k, v, _, _, _ = _inputs(case, jnp.float32, seed=3)
  q8, k8, v8 = (x.astype(jnp.float8_e4m3fn) for x in (q, k, v))
  traces = []

  @jax.jit
  def run(descale_v):
    traces.append(1)
    return flash_attention_forward(q8, k8, v8, descale_q=jnp.float32(1), descale_k=jnp.float32(1),
                                   descale_v=descale_v, block_sizes=SMALL_BLOCKS).out

  out_1 = run(jnp.float32(1.0))
  out_2 = run(jnp.float32(2.0))
  assert len(traces) == 1
  # Doubling v's descale doubles the output exactly (power-of-two scaling of bf16 values).
  np.testing.assert_array_equal(np.asarray(out_2, np.float32), 2 * np.asarray(out_1, np.float32))

  # The backward takes its descales as operands too.
  backward_traces = []
  lse = flash_attention_forward(q8, k8, v8, descale_q=jnp.float32(1), descale_k=jnp.float32(1),
                                descale_v=jnp.float32(1), block_sizes=SMALL_BLOCKS).lse

  @jax.jit
  def grads(descale_v):
    backward_traces.append(1)
    return flash_attention_backward(q8, k8, v8, out_1, lse, out_1, descale_q=jnp.float32(1),
                                    descale_k=jnp.float32(1), descale_v=descale_v,
                                    block_sizes=SMALL_BLOCKS)

  dq_1, _, dv_1 = grads(jnp.float32(1.0))
  dq_2, _, dv_2 = grads(jnp.float32(2.0))
  assert len(backward_traces) == 1
  # descale_v enters dP = dO v^T (so dQ moves), not P or dV = P^T dO.
  np.testing.assert_array_equal(np.asarray(dv_2, np.float32), np.asarray(dv_1, np.float32))
  assert not np.array_equal(np.asarray(dq_2, np.float32), np.asarray(dq_1, np.float32))


def test_padded_keys_cannot_influence_real_rows():
  # If masking leaked, changing the padded keys and values would change the real rows.
  case = Case(2, 160, 160, 2, 1, 64, segments="padded")
  q, k, v, dout, q_seg, kv_seg = _inputs(case, jnp.bfloat16, seed=4)
  pad = ~np.asarray(kv_seg, bool)[:, :, None, None]
  k_other = jnp.where(pad, 10 * k, k)
  v_other = jnp.where(pad, -100 * v + 3, v)
  real_rows = np.asarray(q_seg, bool)

  def attend(k, v):
    out, vjp = jax.vjp(lambda q, k, v: flash_attention(
        q, k, v, q_segment_ids=q_seg, kv_segment_ids=kv_seg, block_sizes=SMALL_BLOCKS), q, k, v)
    # Only real rows carry a gradient; padded rows' outputs are not used by anyone.
    dq, dk, dv = vjp(jnp.where(real_rows[:, :, None, None], dout, 0))
    return out, dq, dk, dv

  out_a, dq_a, dk_a, dv_a = attend(k, v)
  out_b, dq_b, dk_b, dv_b = attend(k_other, v_other)
  assert not np.array_equal(np.asarray(k, np.float32), np.asarray(k_other, np.float32))
  np.testing.assert_array_equal(np.asarray(out_a, np.float32)[real_rows],
                                np.asarray(out_b, np.float32)[real_rows])
  np.testing.assert_array_equal(np.asarray(dq_a, np.float32)[real_rows],
                                np.asarray(dq_b, np.float32)[real_rows])
  real_keys = np.asarray(kv_seg, bool)
  np.testing.assert_array_equal(np.asarray(dk_a, np.float32)[real_keys],
                                np.asarray(dk_b, np.float32)[real_keys])
  np.testing.assert_array_equal(np.asarray(dv_a, np.float32)[real_keys],
                                np.asarray(dv_b, np.float32)[real_keys])
  # Padded keys receive no gradient from real rows.
  assert not np.any(np.asarray(dk_a, np.float32)[~real_keys])
  assert not np.any(np.asarray(dv_a, np.float32)[~real_keys])


def test_causal_rows_ignore_future_keys():
  case = Case(1, 150, 150, 2, 2, 64, causal=True)
  q, k, v, _, _, _ = _inputs(case, jnp.bfloat16, seed=5)
  cut = 70  # rows <= cut may only see keys <= cut; 70 is inside a block of every tiling
  future = (np.arange(case.kv_len) > cut)[None, :, None, None]
  run = lambda k, v: flash_attention(q, k, v, causal=True, block_sizes=SMALL_BLOCKS)
  out_a = np.asarray(run(k, v), np.float32)
  out_b = np.asarray(run(jnp.where(future, -k, k), jnp.where(future, 5 + v, v)), np.float32)
  np.testing.assert_array_equal(out_a[:, : cut + 1], out_b[:, : cut + 1])
  assert not np.array_equal(out_a[:, cut + 1:], out_b[:, cut + 1:])


def test_rows_without_any_allowed_key_give_zero_output_lse_minus_inf_and_zero_gradient():
  case = Case(1, 96, 96, 2, 2, 64)
  q, k, v, dout, _, _ = _inputs(case, jnp.bfloat16, seed=6)
  q_seg = jnp.asarray(np.where(np.arange(96) < 80, 1, 2)[None], jnp.int32)  # id 2: no keys
  kv_seg = jnp.ones((1, 96), jnp.int32)
  kwargs = dict(q_segment_ids=q_seg, kv_segment_ids=kv_seg, block_sizes=SMALL_BLOCKS)
  fwd = flash_attention_forward(q, k, v, **kwargs)
  dq, dk, dv = flash_attention_backward(q, k, v, fwd.out, fwd.lse, dout, **kwargs)
  ref_out, _, ref_dq, ref_dk, ref_dv = _reference(q, k, v, dout, q_seg, kv_seg, False, 64**-0.5)

  assert not np.any(np.asarray(fwd.out, np.float32)[:, 80:])
  assert np.all(np.isneginf(np.asarray(fwd.lse)[:, :, 80:]))
  assert not np.any(np.asarray(dq, np.float32)[:, 80:])
  for actual, expected in ((fwd.out, ref_out), (dq, ref_dq), (dk, ref_dk), (dv, ref_dv)):
    assert np.all(np.isfinite(np.asarray(actual, np.float32)))
    assert _rel_err(actual, expected) < BF16_TOL


def test_attention_reference_matches_float64_numpy():
  # attention_reference works in float32: 1e-5 covers float32 rounding of softmax and
  # two contractions of length <= 128.
  case = Case(2, 40, 56, 4, 2, 64, causal=True, segments="padded")
  q, k, v, dout, q_seg, kv_seg = _inputs(case, jnp.float32, seed=7)
  out = attention_reference(q, k, v, q_segment_ids=q_seg, kv_segment_ids=kv_seg, causal=True)
  ref_out = _reference(q, k, v, dout, q_seg, kv_seg, True, 64**-0.5)[0]
  assert _rel_err(out, ref_out) < 1e-5


@pytest.mark.parametrize("call, match", [
    (lambda q, k, v: flash_attention(q, k[:, :, :1].repeat(3, axis=2), v[:, :, :1].repeat(3, axis=2)),
     "num_kv_heads"),
    (lambda q, k, v: flash_attention(q[..., :48], k[..., :48], v[..., :48]), "head_dim=48"),
    (lambda q, k, v: flash_attention(q, k, v, q_segment_ids=jnp.ones((1, 32), jnp.int32)),
     "kv_segment_ids"),
    (lambda q, k, v: flash_attention_forward(*(x.astype(jnp.float8_e4m3fn) for x in (q, k, v))),
     "descale_q"),
    (lambda q, k, v: flash_attention(q, k.astype(jnp.float16), v), "share one floating dtype"),
    (lambda q, k, v: flash_attention(q, k, v[:, :16]), "same shape"),
])
def test_bad_arguments_raise_errors_naming_them(call, match):
  q, k, v = (jnp.ones((1, 32, 4, 64), jnp.bfloat16) for _ in range(3))
  with pytest.raises((ValueError, TypeError), match=match):
    call(q, k, v)


def test_block_sizes_reject_tiles_that_are_not_powers_of_two():
  with pytest.raises(ValueError, match="block_kv=48"):
    BlockSizes(block_kv=48)


def test_out_amax_ignores_rows_added_to_fill_the_last_block():
  # 200 query rows fill 4 blocks of 64; the 56 rows the kernel adds carry segment id 0.
  # Keys with id 0 (never attended by the real queries, all id 1) hold huge values: a
  # kernel that let its filler rows into out_amax would report about 1000.
  case = Case(1, 200, 200, 2, 2, 64)
  q, k, v, _, _, _ = _inputs(case, jnp.bfloat16, seed=8)
  q_seg = jnp.ones((1, 200), jnp.int32)
  kv_seg = jnp.asarray((np.arange(200) < 192)[None], jnp.int32)
  v = jnp.where(np.asarray(kv_seg, bool)[:, :, None, None], v, 1000).astype(jnp.bfloat16)
  fwd = flash_attention_forward(q, k, v, q_segment_ids=q_seg, kv_segment_ids=kv_seg,
                                block_sizes=SMALL_BLOCKS)
  assert fwd.out_amax.astype(jnp.bfloat16) == jnp.max(jnp.abs(fwd.out))
  assert float(fwd.out_amax) < 10
