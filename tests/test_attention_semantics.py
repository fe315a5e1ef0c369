"""One attention semantics on every backend, against a float64 numpy reference.

The semantics (fp8jax.ops.attention's docstring): segment ids select the keys a
query may see; causal masks are aligned bottom-right (query i sees keys
j <= i + kv_len - q_len); a query row that sees no key outputs 0 and passes no
gradient. The same random inputs run on every backend a CPU can run ("xla", and
"pallas" in the Pallas interpreter); "cudnn" and "pallas_hopper_fp8" need a GPU.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp8jax
from fp8jax.ops import attention_backend
from fp8_reference import quantize_reference
from pallas_kernels.flash_attention import (
    BlockSizes, flash_attention, flash_attention_forward, fp8_forward_reference)

CPU_BACKENDS = ("xla", "pallas")
HEAD_DIM = 64
# bf16 inputs are exact in the reference; the backends round P (and dS) to bf16 for
# their products and round the results to bf16: a few roundings of at most 2**-8
# relative each, of mixed sign, stay far below 1e-2 in relative norm (measured:
# 2e-3 to 3.5e-3 on both CPU backends).
BF16_TOL = 1e-2
# FP8: the reference gets the dequantized E4M3 q, k, v, so what remains is P's E4M3
# rounding in the forward (3 mantissa bits: at most 2**-4 relative per probability).
# dq and dk inherit it through delta = rowsum(dO * O) where the backward takes O from
# the FP8 forward (the Pallas kernels); the "xla" backward differentiates float32
# attention itself and is exact to float32 arithmetic. Measured: about 1e-2.
FP8_TOL = 2.0**-4
# float32 attention on E4M3 values: contractions of at most a few hundred terms lose
# about n * 2**-24 ~ 1e-5 relative; 1e-4 leaves room and still catches any real change.
F32_TOL = 1e-4


@dataclasses.dataclass(frozen=True)
class Case:
  q_len: int
  kv_len: int
  causal: bool
  segments: bool = False
  batch: int = 1


CASES = {
    # Query id 3 has no key; batch element 1 pads its keys with id 0.
    "segments_with_keyless_rows": Case(48, 48, causal=False, segments=True, batch=2),
    # Segment 2 starts at key 24 but at query 20: causally, queries 20..23 see no key.
    "causal_segments_with_keyless_rows": Case(48, 48, causal=True, segments=True, batch=2),
    # Bottom-right: the first 40 queries see no key.
    "causal_q_longer": Case(80, 40, causal=True),
    # Bottom-right offset 110: not a multiple of any kernel block.
    "causal_kv_longer": Case(40, 150, causal=True),
}


def _segment_ids(case: Case):
  if not case.segments:
    return None, None
  assert case.q_len == case.kv_len == 48 and case.batch == 2
  q_seg = np.array([[1] * 20 + [2] * 20 + [3] * 8, [1] * 48], np.int32)
  kv_seg = np.array([[1] * 24 + [2] * 24, [1] * 30 + [0] * 18], np.int32)
  return jnp.asarray(q_seg), jnp.asarray(kv_seg)


def _inputs(case: Case, dtype, seed=0):
  """q [b, q_len, 2, 64], k/v [b, kv_len, 1, 64] (grouped-query), dout; all nonzero."""
  rng = np.random.default_rng(seed)

  def normal(length, heads, scale=1.0):
    x = scale * rng.standard_normal((case.batch, length, heads, HEAD_DIM))
    return jnp.asarray(x, jnp.float32).astype(dtype)

  return (normal(case.q_len, 2), normal(case.kv_len, 1, 2.0), normal(case.kv_len, 1, 3.0),
          normal(case.q_len, 2))


def _visible(case: Case, q_seg, kv_seg) -> np.ndarray:
  """bool [batch, q_len, kv_len], written out from the stated semantics."""
  visible = np.ones((case.batch, case.q_len, case.kv_len), bool)
  if case.causal:
    i, j = np.arange(case.q_len)[:, None], np.arange(case.kv_len)[None, :]
    visible &= j <= i + (case.kv_len - case.q_len)
  if q_seg is not None:
    visible &= np.asarray(q_seg)[:, :, None] == np.asarray(kv_seg)[:, None, :]
  return visible


def _reference(q, k, v, dout, visible):
  """float64 attention and its gradients: (out, dq, dk, dv); keyless rows give 0."""
  q, k, v, dout = (np.asarray(jnp.asarray(x, jnp.float32), np.float64) for x in (q, k, v, dout))
  group = q.shape[2] // k.shape[2]
  k_rep, v_rep = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)
  scale = HEAD_DIM**-0.5
  s = np.einsum("bqhd,bkhd->bhqk", q, k_rep) * scale
  mask = visible[:, None]
  row_max = np.where(mask, s, -np.inf).max(-1, keepdims=True)
  w = np.where(mask, np.exp(s - np.where(np.isfinite(row_max), row_max, 0.0)), 0.0)
  l = w.sum(-1, keepdims=True)
  p = w / np.where(l > 0, l, 1.0)
  out = np.einsum("bhqk,bkhd->bqhd", p, v_rep)
  dp = np.einsum("bqhd,bkhd->bhqk", dout, v_rep)
  ds = p * (dp - np.sum(p * dp, -1, keepdims=True))
  dq = np.einsum("bhqk,bkhd->bqhd", ds, k_rep) * scale
  dk = np.einsum("bhqk,bqhd->bkhd", ds, q) * scale
  dv = np.einsum("bhqk,bqhd->bkhd", p, dout)
  fold = lambda x: x.reshape(*x.shape[:2], k.shape[2], group, HEAD_DIM).sum(3)
  return out, dq, fold(dk), fold(dv)


def _f64(x):
  return np.asarray(jnp.asarray(x, jnp.float32), np.float64)


def _rel_err(actual, expected) -> float:
  return float(np.linalg.norm(_f64(actual) - expected) / np.linalg.norm(expected))


def _check_semantics(backend, out, vjp, dout, ref, keyless, tols):
  """Keyless rows: exactly 0 output and dq, and no effect on dk, dv; all within tols of ref."""
  grads = vjp(dout)
  if keyless.any():
    assert not np.any(_f64(out)[keyless]), f"{backend}: a row that sees no key must output 0"
    assert not np.any(_f64(grads[0])[keyless]), f"{backend}: a keyless row must get dq = 0"
    # Another output cotangent on keyless rows only must not move dk or dv by a bit.
    changed = vjp(jnp.where(keyless[:, :, None, None], 7 * dout + 1, dout).astype(dout.dtype))
    for name, a, b in zip(("dk", "dv"), grads[1:], changed[1:]):
      np.testing.assert_array_equal(_f64(a), _f64(b),
                                    err_msg=f"{backend}: keyless rows reached {name}")
  for name, actual, expected, tol in zip(("out", "dq", "dk", "dv"), (out, *grads), ref, tols):
    err = _rel_err(actual, expected)
    assert err < tol, (backend, name, err)


def _keyless_rows(visible) -> np.ndarray:
  return ~visible.any(-1)  # [batch, q_len]


@pytest.mark.parametrize("name", list(CASES))
def test_bf16_attention_follows_the_semantics_on_every_backend(name):
  case = CASES[name]
  q, k, v, dout = _inputs(case, jnp.bfloat16)
  q_seg, kv_seg = _segment_ids(case)
  visible = _visible(case, q_seg, kv_seg)
  keyless = _keyless_rows(visible)
  ref = _reference(q, k, v, dout, visible)
  for backend in CPU_BACKENDS:
    out, vjp = jax.vjp(lambda q, k, v: fp8jax.attention(
        q, k, v, causal=case.causal, q_segment_ids=q_seg, kv_segment_ids=kv_seg,
        backend=backend), q, k, v)
    _check_semantics(backend, out, vjp, dout, ref, keyless, tols=(BF16_TOL,) * 4)


def _dequantized(x) -> np.ndarray:
  """x through E4M3 with current scaling's scale, float32(448) / amax (independent quantizer)."""
  scale = np.float32(448.0) / np.float32(np.max(np.abs(np.asarray(x))))
  return quantize_reference(np.asarray(x), scale, "e4m3") * np.float64(np.float32(1) / scale)


@pytest.mark.parametrize("name", ["causal_segments_with_keyless_rows", "causal_q_longer",
                                  "causal_kv_longer"])
def test_fp8_xla_path_does_the_pallas_kernels_arithmetic_and_both_follow_the_semantics(name):
  case = CASES[name]
  q, k, v, dout = _inputs(case, jnp.float32, seed=1)
  q_seg, kv_seg = _segment_ids(case)
  visible = _visible(case, q_seg, kv_seg)
  keyless = _keyless_rows(visible)
  meta = fp8jax.init_attention_meta(fp8jax.CurrentScaling())
  deq = [_dequantized(x) for x in (q, k, v)]
  ref = _reference(*deq, dout, visible)
  outs = {}
  for backend in CPU_BACKENDS:
    out, vjp = jax.vjp(lambda q, k, v: fp8jax.fp8_attention(
        q, k, v, meta, causal=case.causal, q_segment_ids=q_seg, kv_segment_ids=kv_seg,
        backend=backend)[0], q, k, v)
    grad_tol = (FP8_TOL, FP8_TOL, BF16_TOL) if backend == "pallas" else (F32_TOL,) * 3
    _check_semantics(backend, out, vjp, dout, ref, keyless, tols=(FP8_TOL, *grad_tol))
    outs[backend] = _f64(out)
  # Same E4M3 P, same float32 products: the two float32 outputs differ only by summation
  # order, at most n * 2**-23 * max|v| for n = kv_len terms summed in two orders (P sums
  # to 1 up to its E4M3 rounding); each is then rounded to bf16 (at most 2**-8 relative).
  # Without P's E4M3 rounding the xla output is off by about 2**-5 relative.
  xla, pallas = outs["xla"], outs["pallas"]
  bound = 2.0**-8 * (np.abs(xla) + np.abs(pallas)) + case.kv_len * 2.0**-22 * np.abs(deq[2]).max()
  assert np.all(np.abs(xla - pallas) <= bound), np.max(np.abs(xla - pallas) / bound)


# Small tiles so that several key and query blocks meet the causal diagonal at offsets
# that are not block multiples (35 and -35 against 16-row blocks); the three kernels get
# different tilings so that each one's block limits are exercised.
SMALL_BLOCKS = BlockSizes(block_q=32, block_kv=16, block_q_dkv=16, block_kv_dkv=32,
                          block_q_dq=32, block_kv_dq=16)


@pytest.mark.parametrize("q_len, kv_len", [(40, 75), (75, 40)])
def test_pallas_block_skipping_keeps_bottom_right_causality(q_len, kv_len):
  case = Case(q_len, kv_len, causal=True)
  q, k, v, dout = _inputs(case, jnp.bfloat16, seed=2)
  visible = _visible(case, None, None)
  run = lambda q, k, v: flash_attention(q, k, v, causal=True, block_sizes=SMALL_BLOCKS)
  out, vjp = jax.vjp(run, q, k, v)
  ref = _reference(q, k, v, dout, visible)
  _check_semantics("pallas", out, vjp, dout, ref, _keyless_rows(visible), tols=(BF16_TOL,) * 4)


def test_fp8_reference_rounds_p_against_the_kernels_running_max_over_many_blocks():
  # Five key blocks of 16: the running max grows across blocks, so P's E4M3 rounding
  # depends on where the kernel rescales; the reference must round the same P.
  case = Case(40, 75, causal=True)
  q, k, v, _ = _inputs(case, jnp.float32, seed=3)
  q8, k8, v8 = (x.astype(jnp.float8_e4m3fn) for x in (4 * q, k, v))  # 4x: peaked rows
  args = dict(descale_q=jnp.float32(0.5), descale_k=jnp.float32(0.25),
              descale_v=jnp.float32(2.0), causal=True, block_sizes=SMALL_BLOCKS)
  kernel = flash_attention_forward(q8, k8, v8, **args)
  reference = fp8_forward_reference(q8, k8, v8, **args)
  out_k, out_r = _f64(kernel.out), _f64(reference.out)
  # As in the fp8_attention test above: summation order, then bf16 rounding.
  bound = 2.0**-8 * (np.abs(out_k) + np.abs(out_r)) + case.kv_len * 2.0**-22 * 2.0 * np.abs(
      _f64(v8)).max()
  assert np.all(np.abs(out_k - out_r) <= bound), np.max(np.abs(out_k - out_r) / bound)
  # out_amax is float32 on both sides: summation order only (F32_TOL relative). lse =
  # m + log(l) with the same m; l's summation order moves log(l) by ~n * 2**-24 absolute.
  np.testing.assert_allclose(float(reference.out_amax), float(kernel.out_amax), rtol=F32_TOL)
  np.testing.assert_allclose(np.asarray(reference.lse), np.asarray(kernel.lse), rtol=0,
                             atol=F32_TOL)


def _gpu_key(**changes):
  base = dict(platform="gpu", gpu_arch="sm_90", dtype="bfloat16", fp8=False, head_dim=48,
              mask="causal", recipe_type=None, gqa_ratio=1, size_class="unaligned",
              equal_lengths=False)
  return attention_backend.BackendKey(**{**base, **changes})


def test_cudnn_is_not_chosen_or_accepted_for_causal_attention_with_unequal_lengths():
  # jax drives cuDNN's causal mask top-left aligned; fp8jax's is bottom-right.
  attention_backend.select_backend.cache_clear()
  with pytest.warns(UserWarning, match="cuDNN cannot run it .*bottom-right"):
    assert attention_backend.select_backend(_gpu_key()).name == "xla"
  with pytest.raises(ValueError, match="backend='cudnn' cannot run.*q_len != kv_len"):
    attention_backend.select_backend(_gpu_key(), "cudnn")
  # The key is built from the shapes: unequal lengths are seen as such.
  key = attention_backend.make_key((1, 40, 2, 48), (1, 75, 2, 48), "bfloat16", fp8=False,
                                   causal=True, has_segments=False, recipe_type=None,
                                   platform="gpu", gpu_arch="sm_90")
  assert key == _gpu_key()
  # Equal lengths (top-left == bottom-right) and non-causal calls keep cuDNN.
  with pytest.warns(UserWarning, match="head_dim 48"):
    assert attention_backend.select_backend(_gpu_key(equal_lengths=True)).name == "cudnn"
  with pytest.warns(UserWarning, match="head_dim 48"):
    assert attention_backend.select_backend(_gpu_key(mask="none")).name == "cudnn"


def _gpu_arch():
  if jax.default_backend() != "gpu":
    return None
  capability = getattr(jax.devices()[0], "compute_capability", "")
  return "sm_" + str(capability).replace(".", "")


@pytest.mark.gpu
@pytest.mark.skipif(_gpu_arch() is None,
                    reason="backend='cudnn' runs cuDNN's fused attention: needs an NVIDIA GPU")
def test_cudnn_follows_the_semantics_where_it_runs():
  # What fp8jax lets cuDNN run: causal attention with equal lengths, and non-causal
  # attention of any lengths (no segment ids, so no row is keyless).
  for case in (Case(128, 128, causal=True), Case(64, 192, causal=False)):
    q, k, v, dout = _inputs(case, jnp.bfloat16, seed=4)
    out, vjp = jax.vjp(lambda q, k, v: fp8jax.attention(
        q, k, v, causal=case.causal, backend="cudnn"), q, k, v)
    ref = _reference(q, k, v, dout, _visible(case, None, None))
    for actual, expected in zip((out, *vjp(dout)), ref):
      assert _rel_err(actual, expected) < BF16_TOL


@pytest.mark.skipif(_gpu_arch() != "sm_90",
                    reason="backend='pallas_hopper_fp8' is a Hopper (sm_90) Mosaic GPU kernel")
def test_hopper_fp8_kernel_follows_the_semantics_where_it_runs():
  # It takes equal lengths that are multiples of 128 and no segment ids, so no row
  # is keyless and top-left and bottom-right causality coincide.
  case = Case(256, 256, causal=True)
  q, k, v, dout = _inputs(case, jnp.float32, seed=5)
  meta = fp8jax.init_attention_meta(fp8jax.CurrentScaling())
  out, vjp = jax.vjp(lambda q, k, v: fp8jax.fp8_attention(
      q, k, v, meta, causal=True, backend="pallas_hopper_fp8")[0], q, k, v)
  ref = _reference(*(_dequantized(x) for x in (q, k, v)), dout, _visible(case, None, None))
  for actual, expected, tol in zip((out, *vjp(dout)), ref, (FP8_TOL, FP8_TOL, FP8_TOL,
                                                             BF16_TOL)):
    assert _rel_err(actual, expected) < tol
