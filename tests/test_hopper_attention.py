"""The Hopper attention kernels (pallas_kernels.hopper_attention) against float64 numpy.

On a CPU the kernels run in Mosaic GPU's interpreter with race detection: the same
kernel code (pipeline, barriers, slot indexing, masks, epilogues) as on the GPU, with
tile products done in float32 (see pallas_kernels/mosaic_target.py). On a Hopper GPU
(`gpu` mark) the compiled kernels are checked at a larger size with the same bounds.

Every bound below is per element: |got - want| <= bound, where `want` is float64
attention on the kernels' own input values (bf16- or E4M3-rounded, descales applied)
and `bound` adds up the roundings the kernels do by design, each as a relative error
times the float64 sum of absolute terms it perturbs (so no cancellation hides an
error): bf16 rounding is 2**-9 relative (2**-8 used), E4M3's is 2**-4.
"""
import numpy as np
import pytest

E4M3_MAX = 448.0
BF16 = 2.0**-8   # bf16 rounding (2**-9) with a factor 2 for the f32 sums and approx exp2
E4M3 = 2.0**-4


def _visible(b, q_len, kv_len, causal, q_ids, kv_ids):
  vis = np.ones((b, 1, q_len, kv_len), bool)
  if causal:
    vis &= (np.arange(kv_len)[None] <= np.arange(q_len)[:, None] + kv_len - q_len)[None, None]
  if q_ids is not None:
    vis &= np.asarray(q_ids)[:, None, :, None] == np.asarray(kv_ids)[:, None, None, :]
  return vis


def _reference(q, k, v, g, sm, causal, q_ids, kv_ids):
  """float64 attention, its base-2 lse and gradients, plus the absolute sums bounds need."""
  b, q_len, heads, _ = q.shape
  kv_len, kv_heads = k.shape[1], k.shape[2]
  group = heads // kv_heads
  kr, vr = np.repeat(k, group, 2), np.repeat(v, group, 2)
  vis = _visible(b, q_len, kv_len, causal, q_ids, kv_ids)
  s = np.where(vis, np.einsum("bqhd,bkhd->bhqk", q, kr) * sm, -np.inf)
  m = s.max(-1, keepdims=True)
  m = np.where(np.isfinite(m), m, 0.0)
  e = np.exp(s - m)
  l = e.sum(-1, keepdims=True)
  p = e / np.where(l == 0, 1.0, l)
  o = np.einsum("bhqk,bkhd->bqhd", p, vr)
  lse2 = np.where(l[..., 0] == 0, -np.inf, (m[..., 0] + np.log(np.maximum(l[..., 0], 1e-300)))
                  / np.log(2.0))
  dp = np.einsum("bqhd,bkhd->bhqk", g, vr)
  delta = np.einsum("bqhd,bqhd->bhq", g, o)
  ds = p * (dp - delta[..., None])

  def per_kv_head(x):  # [b, kv_len, heads, d] -> summed over each kv head's group
    return x.reshape(b, kv_len, kv_heads, group, -1).sum(3)

  grads = (sm * np.einsum("bhqk,bkhd->bqhd", ds, kr),
           per_kv_head(sm * np.einsum("bhqk,bqhd->bkhd", ds, q)),
           per_kv_head(np.einsum("bhqk,bqhd->bkhd", p, g)))
  abs_terms = dict(
      ds_abs=np.abs(ds), p=p, visible=np.broadcast_to(vis, p.shape).astype(np.float64),
      g_abs_o=np.einsum("bqhd,bqhd->bhq", np.abs(g), np.abs(o))[..., None],
      abs_k=np.abs(kr), abs_v=np.abs(vr), abs_q=np.abs(q), abs_g=np.abs(g))
  return (o, lse2) + grads, abs_terms, per_kv_head


def _bounds(want, terms, per_kv_head, sm, p_rounding, p_floor=0.0, dp_err=0.0, ds_rounding=BF16):
  """Per-element bounds for (o, dq, dk, dv).

  P is rounded before P V and P^T dO, by `p_rounding` relative and, below the format's
  normal range, by up to `p_floor` absolute (per visible query and key); `dp_err` is the
  error of dP = dO V^T beyond float32's (per query and key), `ds_rounding` dS's relative
  error before dS K and dS^T Q."""
  o, dq, dk, dv = want
  p_err = p_rounding * terms["p"] + p_floor * terms["visible"]
  pv_err = np.einsum("bhqk,bkhd->bqhd", p_err, terms["abs_v"])
  # delta = dO . O uses the kernel's output, off by its own bound (P's rounding in
  # P V, then bf16); dS is rounded to bf16 for dS K and dS^T Q.
  delta_err = (np.einsum("bqhd,bqhd->bhq", terms["abs_g"], pv_err)[..., None]
               + BF16 * terms["g_abs_o"])
  ds_err = ds_rounding * terms["ds_abs"] + terms["p"] * (delta_err + dp_err)
  return (
      pv_err + BF16 * np.abs(o) + 1e-6,
      sm * np.einsum("bhqk,bkhd->bqhd", ds_err, terms["abs_k"]) + BF16 * np.abs(dq) + 1e-6,
      per_kv_head(sm * np.einsum("bhqk,bqhd->bkhd", ds_err, terms["abs_q"]))
      + BF16 * np.abs(dk) + 1e-6,
      per_kv_head(np.einsum("bhqk,bqhd->bkhd", p_err, terms["abs_g"]))
      + BF16 * np.abs(dv) + 1e-6,
  )


def _assert_within(name, got, want, bound):
  got = np.asarray(got, np.float64)
  excess = np.abs(got - want) - bound
  assert np.all(excess <= 0), (
      f"{name}: max excess {excess.max():.3g} at "
      f"{np.unravel_index(np.argmax(excess), excess.shape)} (error "
      f"{np.abs(got - want).max():.3g})")


def _segment_ids(rng, batch, length):
  return np.sort(rng.integers(0, 3, (batch, length)), axis=1).astype(np.int32)


def _problem(seed, batch, q_len, kv_len, heads, kv_heads, head_dim, segmented):
  rng = np.random.default_rng(seed)
  q = rng.normal(size=(batch, q_len, heads, head_dim)) * 2.0  # peaked rows: tile errors show
  k = rng.normal(size=(batch, kv_len, kv_heads, head_dim))
  v = rng.normal(size=(batch, kv_len, kv_heads, head_dim))
  g = rng.normal(size=(batch, q_len, heads, head_dim))
  ids = (_segment_ids(rng, batch, q_len), _segment_ids(rng, batch, kv_len)) if segmented else (
      None, None)
  return q, k, v, g, ids


def _interpreter():
  from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
  return InterpretGPUParams(detect_races=True)


def _check_no_races():
  from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks
  assert not gpu_callbacks.get_races().races_found, "the interpreter found a data race"


def _run_bf16(shape, causal, segmented, interpret, device=None, blocks=None):
  import jax
  import jax.numpy as jnp
  from pallas_kernels.hopper_attention import HopperAttentionBlockSizes, hopper_attention
  q, k, v, g, (q_ids, kv_ids) = _problem(0, *shape, segmented)
  q, k, v, g = (jnp.asarray(x, jnp.bfloat16) for x in (q, k, v, g))
  if device is not None:
    q, k, v, g = jax.device_put((q, k, v, g), device)
  sm = q.shape[-1] ** -0.5

  def attend(q, k, v):
    return hopper_attention(q, k, v, causal=causal, q_segment_ids=q_ids,
                            kv_segment_ids=kv_ids, interpret=interpret,
                            block_sizes=blocks or HopperAttentionBlockSizes())
  out, vjp = jax.vjp(jax.jit(attend), q, k, v)
  got = (out,) + vjp(g)
  f64 = [np.asarray(x.astype(jnp.float32), np.float64) for x in (q, k, v, g)]
  want, terms, per_kv_head = _reference(*f64, sm, causal, q_ids, kv_ids)
  want = (want[0],) + want[2:]
  # P is rounded to bf16 for P V and P^T dO.
  for name, a, w, bnd in zip(("out", "dq", "dk", "dv"), got, want,
                             _bounds(want, terms, per_kv_head, sm, BF16)):
    _assert_within(name, a, w, bnd)


def _exact_gradient(rng, shape):
  """A cotangent whose current-scaled E4M3 quantization is exact (E4M3 values times 2**-6,
  amax 448 * 2**-6), so the float64 reference can use it as it is."""
  import jax.numpy as jnp
  g = np.clip(rng.normal(size=shape) * 64, -E4M3_MAX, E4M3_MAX)
  g8 = np.array(jnp.asarray(g, jnp.float8_e4m3fn).astype(jnp.float32), np.float64)
  g8.flat[0] = E4M3_MAX
  return g8 * 2.0**-6


def _block_descales(rng, x, scale_block=128):
  """float64 [batch, heads, seq / 128]: a descale per 128-row block of each head, odd
  blocks 4x below even ones, times 2**U(-0.5, 0.5): a block read with a neighbour's
  descale is off by 2x or more, which the bounds below cannot hide."""
  batch, seq, heads, _ = x.shape
  blocks = np.arange(seq // scale_block)
  return 4.0 ** -(blocks % 2) * 2.0 ** rng.uniform(-0.5, 0.5, (batch, heads, len(blocks)))


def _per_row(descale, scale_block=128):
  """[batch, heads, blocks] -> [batch, seq, heads, 1], each row its block's descale."""
  return np.repeat(np.swapaxes(descale, 1, 2), scale_block, axis=1)[..., None]


def _run_fp8(shape, causal, segmented, interpret, device=None, block_scaled=False,
             blocks=None):
  import jax
  import jax.numpy as jnp
  import importlib
  ha = importlib.import_module("pallas_kernels.hopper_attention")
  q, k, v, _, (q_ids, kv_ids) = _problem(1, *shape, segmented)
  g = _exact_gradient(np.random.default_rng(2), q.shape)
  if block_scaled:
    descales = tuple(_block_descales(np.random.default_rng(3 + i), x) * base
                     for i, (x, base) in enumerate(zip((q, k, v), (0.5, 0.25, 2.0))))
    per_row = [_per_row(d) for d in descales]
  else:
    descales = per_row = (0.5, 0.25, 2.0)
  q8, k8, v8 = (jnp.asarray(x / d, jnp.float8_e4m3fn) for x, d in zip((q, k, v), per_row))
  if device is not None:
    q8, k8, v8 = jax.device_put((q8, k8, v8), device)
  sm = q.shape[-1] ** -0.5
  kwargs = dict(causal=causal, q_segment_ids=q_ids, kv_segment_ids=kv_ids, interpret=interpret,
                block_sizes=blocks or ha.HopperAttentionBlockSizes())
  kernel_descales = [jnp.asarray(d, jnp.float32) for d in descales]
  out, out_amax, lse2 = jax.jit(lambda *a: ha.hopper_fp8_attention_forward(*a, **kwargs))(
      q8, k8, v8, *kernel_descales)
  dq, dk, dv = jax.jit(lambda *a: ha.hopper_fp8_attention_backward(*a, **kwargs))(
      q8, k8, v8, out, lse2, jnp.asarray(g, jnp.float32), *kernel_descales)
  f64 = [np.asarray(x.astype(jnp.float32), np.float64) * np.float32(d)
         for x, d in zip((q8, k8, v8), per_row)] + [g]
  want, terms, per_kv_head = _reference(*f64, sm, causal, q_ids, kv_ids)
  want_lse2 = want[1]
  want = (want[0],) + want[2:]
  # P is rounded to E4M3 (as P * 256) for P V and P^T dO; everything else as bf16.
  # Where P * 256 is below E4M3's normal range (2**-6) the rounding is absolute: half
  # its subnormal step, 2**-10, so 2**-18 in P (seen on an H200 at a key only one query
  # sees, where P * 256 was 0.0012).
  p_rounding, p_floor, dp_err, ds_rounding, lse2_err = E4M3 + 2.0**-10, 2.0**-18, 0.0, BF16, 0.0
  if block_scaled:
    # The forward rounds P * 256 * r, r = the key block's V descale over the head's
    # largest: the absolute floor is 2**-18 / r in P. dQ and dK multiply dS by bf16
    # copies of the dequantized q and k: one more bf16 rounding (2**-9) of each term.
    v_descale = descales[2]
    p_floor /= (v_descale / v_descale.max(axis=2, keepdims=True)).min()
    ds_rounding += 2.0**-9
  if device is not None:
    p_rounding, dp_err, ds_rounding, lse2_err = _fp8_accumulator_errors(
        *f64, sm, p_rounding, ds_rounding)
  bounds = _bounds(want, terms, per_kv_head, sm, p_rounding, p_floor, dp_err, ds_rounding)
  for name, a, w, bnd in zip(("out", "dq", "dk", "dv"), (out, dq, dk, dv), want, bounds):
    _assert_within(name, a, w, bnd)
  if device is None:
    _check_jnp_reference(q8, k8, v8, g, kernel_descales, causal, q_ids, kv_ids,
                         (out, lse2, dq, dk, dv), want, bounds)
  # The kernel takes the amax before the output's bf16 rounding (2**-9 relative).
  np.testing.assert_allclose(float(out_amax), float(jnp.max(jnp.abs(out.astype(jnp.float32)))),
                             rtol=2.0**-8)
  finite = np.isfinite(want_lse2)
  assert np.array_equal(np.isfinite(np.asarray(lse2)), finite), "rows that see no key differ"
  # lse2 is float32 sums of exact (interpreter) or 2**-22-accurate (GPU) exponentials, of
  # logits exact in the interpreter and off by the FP8 accumulator's error on the GPU.
  lse2_bound = 1e-5 * np.abs(want_lse2) + 1e-4 + lse2_err
  np.testing.assert_array_less(np.abs(np.asarray(lse2)[finite] - want_lse2[finite]),
                               lse2_bound[finite])


def _check_jnp_reference(q8, k8, v8, g, descales, causal, q_ids, kv_ids, kernel, want, bounds):
  """The kernels' arithmetic in jnp (fp8jax's XLA path, the CPU accuracy measurements)
  meets the kernels' float64 bounds and agrees with the interpreted kernels: only float32
  summation order differs, so results are within one bf16 step (2**-7 relative at most)
  except where that order moved a value across a rounding edge of P (E4M3) or dS (bf16),
  which shifts a few rows (measured: 7 of 131072 elements); lse2 within float32 rounding."""
  import importlib
  import jax.numpy as jnp
  reference = importlib.import_module("pallas_kernels.hopper_attention_reference")
  ref = reference.hopper_fp8_attention_reference(
      q8, k8, v8, jnp.asarray(g, jnp.float32), *descales, causal=causal,
      q_segment_ids=q_ids, kv_segment_ids=kv_ids)
  np.testing.assert_allclose(np.asarray(kernel[1]), np.asarray(ref[1]), rtol=1e-6)
  for name, got, mine, w, bound in zip(("out", "dq", "dk", "dv"), kernel[:1] + kernel[2:],
                                       ref[:1] + ref[2:], want, bounds):
    mine = np.asarray(mine, np.float64)
    _assert_within(f"{name} (jnp reference)", mine, w, bound)
    step = 2.0**-7 * np.abs(mine) + 1e-6 * np.abs(mine).max()
    apart = np.abs(np.asarray(got, np.float64) - mine) > step
    assert apart.mean() <= 1e-3, f"{name}: {apart.sum()} elements off the jnp reference"


def _fp8_accumulator_errors(q, k, v, g, sm, p_rounding, ds_rounding):
  """(p_rounding, dp_err, ds_rounding, lse2_err) for the compiled FP8 kernels on a Hopper GPU.

  Its FP8 wgmma sums products in fewer bits than float32 (about 14, DeepSeek-V3
  reports); as in test_ragged_matmul.py, each k32 instruction chained is allowed one
  rounding of 2**-13 of the sum of |terms|. So the logits S = Q K^T (depth head_dim) are
  off by up to s_err per query, the log-sum-exp as much (lse2 is in base 2), and
  P = exp(S - lse) by 2 * s_err relative (so is dS = P (dP - delta), which the backward
  computes from P again); P V and P^T dO chain over the sequence, and dP = dO V^T over
  head_dim. A wrong tile or mask is still off by O(|value|)."""
  head_dim, group = q.shape[-1], q.shape[2] // k.shape[2]
  kr, vr = np.repeat(k, group, 2), np.repeat(v, group, 2)

  def chained(depth):
    return depth / 32 * 2.0**-13
  s_err = chained(head_dim) * sm * np.einsum("bqhd,bkhd->bhqk", np.abs(q), np.abs(kr)).max(-1)
  sequence = max(q.shape[1], k.shape[1])
  p_rounding = p_rounding + 2 * s_err.max() + chained(sequence)
  dp_err = chained(head_dim) * np.einsum("bqhd,bkhd->bhqk", np.abs(g), np.abs(vr))
  return p_rounding, dp_err, ds_rounding + 2 * s_err.max(), s_err / np.log(2.0)


# (batch, q_len, kv_len, heads, kv_heads, head_dim), causal, segment ids
_INTERPRETER_CASES = [
    # GQA 2:1, causal with kv_len > q_len: warpgroups of a CTA need different key
    # blocks (the shorter one drains), two-slot rings refilled.
    ((1, 128, 256, 2, 1, 64), True, False),
    # Segment ids and causal together at head_dim 128: every tile masked.
    ((1, 256, 256, 2, 1, 128), True, True),
]
_FP8_INTERPRETER_CASES = [
    # q_len > kv_len, causal: the first query rows see no key (output 0, no gradient).
    ((1, 256, 128, 2, 1, 64), True, False),
    # Batch 2, GQA 2:1, segment ids, head_dim 128.
    ((2, 128, 128, 4, 2, 128), False, True),
]


@pytest.mark.parametrize("shape, causal, segmented", _INTERPRETER_CASES)
def test_bf16_forward_and_gradients_match_float64_in_cpu_interpreter(shape, causal, segmented):
  _run_bf16(shape, causal, segmented, _interpreter())
  _check_no_races()


@pytest.mark.parametrize("shape, causal, segmented", _FP8_INTERPRETER_CASES)
def test_fp8_forward_and_backward_match_float64_in_cpu_interpreter(shape, causal, segmented):
  _run_fp8(shape, causal, segmented, _interpreter())
  _check_no_races()


# FlashAttention-3's intra-warpgroup overlap (a tuning variant): block j's Q K^T and
# block j-1's P V in flight together, three stages.
_OVERLAP = dict(overlap=True, num_stages=3)


def test_block_scaled_fp8_forward_and_backward_match_float64_in_cpu_interpreter():
  # Two 128-row blocks of q, k and v per head, each its own descale; GQA 2:1 (the dK/dV
  # kernel reads both query heads' descales), causal and segment ids (masked steps); the
  # forward with the overlapped schedule (its two P tiles, masked first and later steps).
  from pallas_kernels import HopperAttentionBlockSizes
  _run_fp8((1, 256, 256, 2, 1, 64), True, True, _interpreter(), block_scaled=True,
           blocks=HopperAttentionBlockSizes(**_OVERLAP))
  _check_no_races()


def test_bf16_overlapped_forward_matches_float64_in_cpu_interpreter():
  # kv_len > q_len, causal: each warpgroup has unmasked steps, then masked ones, and the
  # shorter one drains; P stays in registers for the next step's P V.
  from pallas_kernels import HopperAttentionBlockSizes
  _run_bf16((1, 128, 384, 2, 1, 64), True, False, _interpreter(),
            blocks=HopperAttentionBlockSizes(**_OVERLAP))
  _check_no_races()


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("fp8", [False, True])
def test_compiled_kernels_match_float64_on_hopper(fp8, causal, hopper_device):
  shape = (2, 512, 512, 4, 2, 128)
  (_run_fp8 if fp8 else _run_bf16)(shape, causal, False, False, hopper_device)


@pytest.mark.gpu
def test_compiled_block_scaled_fp8_kernels_match_float64_on_hopper(hopper_device):
  _run_fp8((2, 512, 512, 4, 2, 128), True, False, False, hopper_device, block_scaled=True)


def test_quantize_gradient_maps_amax_to_e4m3_max_and_rounds_within_e4m3():
  import jax.numpy as jnp
  from pallas_kernels.hopper_attention import quantize_gradient
  g = np.random.default_rng(3).normal(size=(4, 64)) * 1e-3
  g8, descale = quantize_gradient(jnp.asarray(g, jnp.float32))
  back = np.asarray(g8.astype(jnp.float32), np.float64) * float(descale)
  assert np.abs(np.asarray(g8.astype(jnp.float32))).max() == E4M3_MAX
  # E4M3 rounds to 2**-4 relative; below its normal range (2**-6 * scale) absolutely
  # to half its subnormal step, 2**-10 * descale.
  np.testing.assert_array_less(np.abs(back - g), 2**-4 * np.abs(g) + 2**-10 * float(descale))
  g8, descale = quantize_gradient(jnp.zeros((4, 64)))
  assert float(descale) == 1.0


def test_quantize_head_blocks_scales_blocks_by_powers_of_two_of_their_heads_scale():
  import jax.numpy as jnp
  from pallas_kernels.hopper_attention import quantize_head_blocks
  rng = np.random.default_rng(4)
  # Heads 1e3 apart, rows past 128 5x smaller, batch row 1 zero past row 140 (a zero
  # block), a NaN in batch row 1's last head; 300 rows: a partial last block.
  x = (rng.normal(size=(2, 300, 3, 64)) * np.array([1.0, 1e-3, 0.3])[:, None]
       * np.where(np.arange(300) < 128, 1.0, 0.2)[:, None, None])
  x[1, 140:] = 0.0
  x[1, 5, 2, 7] = np.nan
  x8, descale = quantize_head_blocks(jnp.asarray(x, jnp.float32))
  descale = np.asarray(descale, np.float64)
  assert descale.shape == (2, 3, 3) and np.all(np.isfinite(descale)) and np.all(descale > 0)
  # Within a head the descales differ by exact powers of two, the largest the head's own.
  octaves = np.log2(descale / descale.max(axis=2, keepdims=True))
  np.testing.assert_allclose(octaves, np.round(octaves), atol=1e-6)
  x8 = np.asarray(x8.astype(jnp.float32), np.float64)
  back = x8 * np.repeat(np.swapaxes(descale, 1, 2), 128, axis=1)[:, :300, :, None]
  finite = np.isfinite(x)
  assert np.array_equal(np.isnan(x8), ~finite), "NaN stays NaN, nothing else becomes NaN"
  # Each nonzero finite block's largest value lands in E4M3's top octave (224, 448].
  blocks = np.abs(np.pad(np.where(finite, x8, 0.0), ((0, 0), (0, 84), (0, 0), (0, 0))))
  block_max = blocks.reshape(2, 3, 128, 3, 64).max(axis=(2, 4))
  nonzero = block_max > 0
  assert np.all((block_max[nonzero] > 224) & (block_max[nonzero] <= 448)), block_max
  # E4M3 rounds to 2**-4 relative; below its normal range to half its subnormal step
  # (2**-10 of the descale).
  bound = 2**-4 * np.abs(x) + 2**-10 * np.repeat(np.swapaxes(descale, 1, 2), 128,
                                                  axis=1)[:, :300, :, None]
  assert np.all(np.abs(back - x)[finite] <= bound[finite])


@pytest.mark.parametrize("change, match", [
    (dict(head_dim=96), "head_dim=96"),
    (dict(q_len=192), "multiple of 128"),
    (dict(dtype="float32"), "take"),
])
def test_rejects_shapes_and_dtypes_the_kernels_do_not_run(change, match):
  import jax
  import jax.numpy as jnp
  from pallas_kernels.hopper_attention import hopper_attention
  spec = dict(q_len=256, head_dim=64, dtype="bfloat16") | change
  q = jax.ShapeDtypeStruct((1, spec["q_len"], 2, spec["head_dim"]), jnp.dtype(spec["dtype"]))
  k = jax.ShapeDtypeStruct((1, 256, 1, spec["head_dim"]), jnp.dtype(spec["dtype"]))
  with pytest.raises((ValueError, TypeError), match=match):
    hopper_attention(q, k, k)
