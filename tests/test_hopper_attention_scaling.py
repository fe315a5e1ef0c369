"""FP8 attention's finer scaling: per-block scales and the rotation of q and k.

`fp8jax.fp8_attention(block_scales=True)` quantizes q, k and v with one current scale per
128 rows of each head, the form the Hopper FP8 kernels take (their interpreter test is in
test_hopper_attention.py); `rotate=True` turns q and k by a fixed random orthogonal matrix
first. Both run on every backend that can take them; here on "xla", whose FP8 forward is
the Hopper kernel's arithmetic in jnp (checked against the kernel in the interpreter test).
References are float64 attention on the original inputs.
"""
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp8jax
from fp8jax.ops import attention_backend, attention_rotation


def _reference(q, k, v):
  """float64 non-causal attention of one head group per kv head."""
  q, k, v = (np.asarray(jnp.asarray(x, jnp.float32), np.float64) for x in (q, k, v))
  group = q.shape[2] // k.shape[2]
  k, v = np.repeat(k, group, 2), np.repeat(v, group, 2)
  s = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
  p = np.exp(s - s.max(-1, keepdims=True))
  return np.einsum("bhqk,bkhd->bqhd", p / p.sum(-1, keepdims=True), v)


def _relative_error(got, want, axis=None):
  got = np.asarray(jnp.asarray(got, jnp.float32), np.float64)
  return (np.sqrt(np.sum((got - want) ** 2, axis=axis))
          / np.sqrt(np.sum(want ** 2, axis=axis)))


def _fp8(q, k, v, **options):
  meta = fp8jax.init_attention_meta(fp8jax.CurrentScaling())
  return fp8jax.fp8_attention(q, k, v, meta, backend="xla", **options)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_rotation_is_orthogonal_and_unrotate_inverts_it(head_dim):
  m = attention_rotation.signed_hadamard(head_dim)
  # +-1 entries whose rows are orthogonal: M M^T = head_dim I exactly (integer sums).
  assert set(np.unique(m)) == {-1.0, 1.0}
  np.testing.assert_array_equal(m @ m.T, head_dim * np.eye(head_dim))
  x = jax.random.normal(jax.random.key(0), (3, head_dim), jnp.float32)
  # Two float32 products of head_dim terms: 2 * head_dim * 2**-24 relative to sum |x|.
  np.testing.assert_allclose(attention_rotation.unrotate(attention_rotation.rotate(x)), x,
                             atol=2 * head_dim * 2.0**-24 * float(jnp.abs(x).sum(-1).max()))


def test_rotated_fp8_attention_is_fp8_attention_of_the_turned_q_and_k():
  # With rotate=True, fp8_attention quantizes q R and k R: the same values as a call on
  # pre-turned inputs, so the same output bit for bit; its gradients are that call's
  # turned back (dq = dq' R^T), which AD through `rotate` gives up to float32 order
  # (products of head_dim terms: 1e-5 relative covers them).
  keys = jax.random.split(jax.random.key(1), 4)
  q, k, v, g = (jax.random.normal(key, (1, 128, 2, 64), jnp.float32) for key in keys)

  def rotated(q, k, v):
    return _fp8(q, k, v, rotate=True)[0]

  def turned_first(q, k, v):
    return _fp8(attention_rotation.rotate(q), attention_rotation.rotate(k), v)[0]

  out, vjp = jax.vjp(rotated, q, k, v)
  want_out, want_vjp = jax.vjp(turned_first, q, k, v)
  np.testing.assert_array_equal(out, want_out)
  for got, want in zip(vjp(g), want_vjp(g)):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(jnp.abs(want).max()))


def test_rotation_keeps_channel_outliers_from_dominating_fp8_error():
  # Query and key features with a few large channels (the same ones in q and k, as in
  # trained models): their products dominate the logits and E4M3 rounds each by up to
  # 2**-4. Turned, every channel carries a share of them and the roundings average out:
  # the output's error against float64 must fall by at least 2x (measured: 4x).
  rng = np.random.default_rng(2)
  q, k, v = (rng.normal(size=(1, 256, 2, 64)) for _ in range(3))
  q[..., :4] *= 20
  k[..., :4] *= 20
  want = _reference(q, k, v)
  q, k, v = (jnp.asarray(x, jnp.bfloat16) for x in (q, k, v))
  plain = _relative_error(_fp8(q, k, v)[0], want)
  turned = _relative_error(_fp8(q, k, v, rotate=True)[0], want)
  assert turned < plain / 2, (turned, plain)


def test_block_scales_keep_small_blocks_out_of_e4m3s_subnormals():
  # The second sequence is 2**-20 times the first: one scale per tensor puts its q, k
  # and v far under E4M3's smallest subnormal (2**-9 of the scaled range), so its output
  # is lost (relative error ~1); one scale per 128 rows keeps each block's values at
  # full E4M3 precision. Their error is then that of Gaussian data (5% measured: E4M3
  # rounds q, k, v and P, 2**-4 at most and ~2.6% rms each); 0.25 bounds four such
  # roundings with room, and stays far below the lost block's ~1.
  rng = np.random.default_rng(3)
  q, k, v = (rng.normal(size=(2, 128, 2, 64)) * np.array([1.0, 2.0**-20])[:, None, None, None]
             for _ in range(3))
  want = _reference(q, k, v)
  q, k, v = (jnp.asarray(x, jnp.float32) for x in (q, k, v))
  per_tensor = _relative_error(_fp8(q, k, v)[0], want, axis=(1, 2, 3))
  out, meta = _fp8(q, k, v, block_scales=True)
  per_block = _relative_error(out, want, axis=(1, 2, 3))
  assert per_tensor[1] > 0.9 and per_block.max() < 0.25, (per_tensor, per_block)
  # The roles still record their tensors' amaxes (the block scales are not stored).
  for role, x in (("q", q), ("k", k), ("v", v)):
    assert float(getattr(meta, role).amax) == float(jnp.abs(x).max())


def test_block_scales_follow_the_recipe_unless_asked():
  # Per-row / per-block recipes scale attention's inputs per block; per-tensor ones per
  # tensor; block_scales= overrides either. Block scales with a 2**-20 block differ
  # from per-tensor scales (previous test), so equal outputs mean the same path.
  rng = np.random.default_rng(4)
  q = jnp.asarray(rng.normal(size=(2, 128, 2, 64)) * np.array([1.0, 2.0**-20])[:, None, None,
                                                                                 None],
                  jnp.float32)

  def run(recipe, **options):
    meta = fp8jax.init_attention_meta(recipe)
    return np.asarray(fp8jax.fp8_attention(q, q, q, meta, backend="xla", **options)[0])

  blocks = run(fp8jax.CurrentScaling(), block_scales=True)
  tensor = run(fp8jax.CurrentScaling())
  assert not np.array_equal(blocks, tensor)
  np.testing.assert_array_equal(run(fp8jax.BlockScaling()), blocks)
  np.testing.assert_array_equal(run(fp8jax.RowwiseScaling()), blocks)
  np.testing.assert_array_equal(run(fp8jax.BlockScaling(), block_scales=False), tensor)


def test_options_the_call_cannot_take_are_explained():
  q = jnp.ones((1, 128, 2, 96), jnp.bfloat16)
  meta = fp8jax.init_attention_meta(fp8jax.CurrentScaling())
  with pytest.raises(ValueError, match="rotate=True needs head_dim a power of two"):
    fp8jax.fp8_attention(q, q, q, meta, backend="xla", rotate=True)
  q = jnp.ones((1, 128, 2, 64), jnp.bfloat16)
  with pytest.raises(ValueError, match="backend='pallas' cannot run.*block scales"):
    fp8jax.fp8_attention(q, q, q, meta, backend="pallas", block_scales=True)


def test_unmeasured_gpu_runs_block_scaled_fp8_on_xla_not_the_per_tensor_kernel():
  # Without a measurement the FP8 fallback is the Triton "pallas" kernel, which takes
  # one scale per tensor: block-scaled calls go to "xla" instead, and say why.
  attention_backend.select_backend.cache_clear()
  key = attention_backend.make_key((1, 4096, 16, 128), (1, 4096, 16, 128), "bfloat16",
                                   fp8=True, causal=True, has_segments=False,
                                   recipe_type="BlockScaling", platform="gpu",
                                   gpu_arch="sm_80", block_scaled=True)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    choice = attention_backend.select_backend(key)
  assert choice.name == "xla" and "block scales" in choice.reason
  assert any("block scales" in str(w.message) for w in caught)
