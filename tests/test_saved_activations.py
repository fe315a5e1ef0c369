"""FP8 saved activations: the 1 x 128 group format against float64, and what a backward keeps.

The round-trip bound is derived in `fp8jax.ops.saved_activations`: with a group's
power-of-two scale s (amax A, A s in (224, 448]), an element comes back within
max(2**-4 |x|, 2**-10 / s) of x: half an E4M3 step relative where x s is normal
(>= 2**-6), half the subnormal spacing 2**-9 below. Dequantizing multiplies by a power
of two, exact in float32.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.ad_checkpoint import checkpoint_name

import fp8jax
from fp8jax.ops import saved_activations
from fp8jax.ops.gelu import gelu
from fp8jax.ops.rms_norm import add_rms_norm, rms_norm


def _log_uniform(shape, seed, decades=12):
  rng = np.random.default_rng(seed)
  magnitude = 10.0 ** rng.uniform(-decades / 2, decades / 2, shape)
  return (np.where(rng.random(shape) < 0.5, -1.0, 1.0) * magnitude).astype(np.float32)


def _group_bound(x64, group):
  """max(2**-4 |x|, 2**-10 / s) per element, s the group's power-of-two scale (float64)."""
  columns = x64.shape[-1]
  n = -(-columns // group)
  padded = np.pad(np.abs(x64), [(0, 0)] * (x64.ndim - 1) + [(0, n * group - columns)])
  amax = padded.reshape(*x64.shape[:-1], n, group).max(-1)
  scale = np.where(amax > 0, 2.0 ** np.floor(np.log2(448.0 / np.where(amax > 0, amax, 1))), 1.0)
  per_element = np.repeat(1.0 / scale, group, axis=-1)[..., :columns]
  return np.maximum(2.0**-4 * np.abs(x64), 2.0**-10 * per_element), scale


@pytest.mark.parametrize("shape,group", [((64, 512), 128), ((3, 5, 200), 128), ((16, 64), 64),
                                         ((7, 130), 128)])
def test_round_trip_is_within_the_derived_bound_of_float64(shape, group):
  x = _log_uniform(shape, seed=sum(shape))
  saved = saved_activations.save(jnp.asarray(x), "test", group=group)
  assert saved.q.dtype == jnp.float8_e4m3fn and saved.q.shape == shape
  assert saved.scale_inv.shape == (*shape[:-1], -(-shape[-1] // group))
  back = np.asarray(saved_activations.restore(saved, jnp.float32, group=group), np.float64)
  bound, scale = _group_bound(x.astype(np.float64), group)
  error = np.abs(back - x)
  assert np.all(error <= bound), float(np.max(error / bound))
  # The bound is tight (it is half a step): some element comes within 10% of it.
  assert np.max(error / bound) > 0.9
  np.testing.assert_array_equal(np.asarray(saved.scale_inv, np.float64), 1.0 / scale)


def test_zero_groups_stay_zero_and_nan_stays_nan():
  x = np.zeros((4, 256), np.float32)
  x[1, 130] = np.nan
  x[2, :128] = 3.0
  saved = saved_activations.save(jnp.asarray(x), "test")
  back = np.asarray(saved_activations.restore(saved))
  np.testing.assert_array_equal(back[0], 0.0)
  assert np.isnan(back[1, 130]) and np.all(back[1, :128] == 0)
  np.testing.assert_array_equal(back[2, :128], 3.0)  # 3 * 2**7 = 384 is an E4M3 number


def test_saved_bytes_are_one_per_element_and_four_per_group():
  assert saved_activations.saved_bytes((8, 2048, 8192)) == 8 * 2048 * (8192 + 4 * 64)
  x = jnp.ones((5, 300), jnp.bfloat16)
  saved = saved_activations.save(x, "test")
  assert saved.q.nbytes + saved.scale_inv.nbytes == saved_activations.saved_bytes(x.shape)


def _saved_residuals(fn, *args):
  """[(dtype, shape)] of what `jax.vjp(fn, *args)` keeps for the backward."""
  from jax._src.ad_checkpoint import saved_residuals
  return [(aval.dtype, aval.shape) for aval, _ in saved_residuals(fn, *args)]


def test_the_ops_keep_only_fp8_codes_and_float32_scales():
  x = jax.random.normal(jax.random.key(0), (4, 32, 256), jnp.bfloat16)
  w = jnp.ones((256,), jnp.float32)
  f8, f32 = jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float32)

  kept = _saved_residuals(lambda x: gelu(x, save_fp8=True), x)
  assert sorted(kept, key=str) == sorted([(f8, x.shape), (f32, (4, 32, 2))], key=str)
  # Plain autodiff of the bf16 GELU keeps several bf16 tensors of x's shape.
  plain = _saved_residuals(lambda x: jax.nn.gelu(x, approximate=True), x)
  assert sum(np.prod(s) * d.itemsize for d, s in plain) >= 4 * x.size * 2

  kept = _saved_residuals(lambda x, w: rms_norm(x, w, save_fp8=True), x, w)
  # n in FP8 with its group scales, r per row, and the gain itself (a param).
  assert sorted(kept, key=str) == sorted([(f8, x.shape), (f32, (4, 32, 2)), (f32, (4, 32, 1)),
                                          (f32, (256,))], key=str)
  kept = _saved_residuals(lambda x, d, w: add_rms_norm(x, d, w, save_fp8=True)[1], x, x, w)
  assert (f8, x.shape) in kept and not [k for k in kept if k[0] == jnp.bfloat16]


def _block(x, w1, w2, norm_w):
  h = rms_norm(x, norm_w, save_fp8=True)
  h = gelu(jnp.dot(h, w1), save_fp8=True)
  return jnp.sum(jnp.dot(h, w2).astype(jnp.float32) ** 2)


def test_the_remat_policy_keeps_the_named_fp8_copies_and_gives_the_same_gradients():
  keys = jax.random.split(jax.random.key(1), 3)
  x = jax.random.normal(keys[0], (64, 128), jnp.bfloat16)
  w1 = (jax.random.normal(keys[1], (128, 256)) / 12).astype(jnp.bfloat16)
  w2 = (jax.random.normal(keys[2], (256, 128)) / 16).astype(jnp.bfloat16)
  norm_w = jnp.ones((128,), jnp.float32)
  args = (x, w1, w2, norm_w)
  want = jax.grad(_block, argnums=(0, 1, 2, 3))(*args)
  remat = jax.checkpoint(_block, policy=saved_activations.policy())
  got = jax.grad(remat, argnums=(0, 1, 2, 3))(*args)
  for a, b in zip(got, want):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
  kept = _saved_residuals(remat, *args)
  f8 = jnp.dtype(jnp.float8_e4m3fn)
  assert sorted(s for d, s in kept if d == f8) == [(64, 128), (64, 256)]
  # Nothing of the activations' size is kept in bf16: the block's inputs are the
  # only 16-bit residuals (remat keeps its arguments).
  assert not [k for k in kept if k[0] == jnp.bfloat16 and k[1] == (64, 256)]
  # Under nothing_saveable the FP8 copies are recomputed too: none is kept.
  nothing = jax.checkpoint(_block, policy=jax.checkpoint_policies.nothing_saveable)
  assert not [k for k in _saved_residuals(nothing, *args) if k[0] == f8]


def _mlp(x, w1, w2, meta, c):
  """An FP8 MLP feeding a loss linear in its output (as a residual stream feeds the next
  block, whose input remat keeps): the backward needs none of its outputs."""
  h, _ = fp8jax.fp8_dense(x, w1, None, meta)
  y, _ = fp8jax.fp8_dense(gelu(h, save_fp8=True), w2, None, meta)
  return jnp.sum(y.astype(jnp.float32) * c)


def _fp8_casts(jaxpr, found=None) -> list:
  """The shapes of every cast to E4M3 in `jaxpr` and the jaxprs inside it."""
  found = [] if found is None else found
  for eqn in jaxpr.eqns:
    if (eqn.primitive.name == "convert_element_type"
        and eqn.outvars[0].aval.dtype == jnp.float8_e4m3fn):
      found.append(eqn.outvars[0].aval.shape)
    for param in eqn.params.values():
      for sub in param if isinstance(param, (tuple, list)) else (param,):
        if isinstance(sub, (jax.extend.core.ClosedJaxpr, jax.extend.core.Jaxpr)):
          _fp8_casts(getattr(sub, "jaxpr", sub), found)
  return found


@pytest.mark.parametrize("recipe", [fp8jax.DelayedScaling(), fp8jax.RowwiseScaling()],
                         ids=["per_tensor", "per_row"])
def test_the_remat_policy_keeps_each_fp8_projection_input_and_the_backward_does_not_recast_it(
    recipe):
  keys = jax.random.split(jax.random.key(2), 4)
  x = jax.random.normal(keys[0], (64, 128), jnp.bfloat16)
  w1 = jax.random.normal(keys[1], (128, 256)) / 12
  w2 = jax.random.normal(keys[2], (256, 128)) / 16
  c = jax.random.normal(keys[3], (64, 128))
  meta = fp8jax.init_dot_meta(recipe)
  remat = jax.checkpoint(_mlp, policy=saved_activations.policy())
  kept = sorted(s for d, s in _saved_residuals(remat, x, w1, w2, meta, c)
                if d == jnp.float8_e4m3fn)
  # Each projection's FP8 input as its wgrad GEMM reads it (x^T on the per-tensor path;
  # per row, x quantized along M) and the GELU's FP8 input [64, 256]; no weight's copy.
  per_tensor = recipe == fp8jax.DelayedScaling()
  inputs = [(128, 64), (256, 64)] if per_tensor else [(64, 128), (64, 256)]
  assert kept == sorted(inputs + [(64, 256)])
  # What the backward computes (jax.vjp's function: remat's recomputation and the three
  # GEMMs of each layer): the GELU's output, the down projection's input, is not cast to
  # FP8 again (before the names it was, from a recomputed up projection and GELU).
  _, backward = jax.vjp(lambda x, w1, w2: remat(x, w1, w2, meta, c), x, w1, w2)
  recast = _fp8_casts(jax.make_jaxpr(backward)(jnp.float32(1.0)).jaxpr)
  assert not [shape for shape in recast if shape in ((64, 256), (256, 64))], recast


def test_names_match_the_policy():
  q_name, s_name = saved_activations.names("gelu")
  assert q_name.startswith(saved_activations.PREFIX) and s_name.startswith(
      saved_activations.PREFIX)
  policy = saved_activations.policy()
  x = jnp.ones((4, 128))
  keep = jax.checkpoint(lambda x: jnp.sin(checkpoint_name(jnp.sin(x), q_name)), policy=policy)
  drop = jax.checkpoint(lambda x: jnp.sin(checkpoint_name(jnp.sin(x), "other")), policy=policy)
  assert len(_saved_residuals(keep, x)) > len(_saved_residuals(drop, x))


@pytest.mark.parametrize("norm", [False, True], ids=["gelu", "rms_norm"])
@pytest.mark.parametrize("current", [False, True], ids=["chain", "from_amax"])
@pytest.mark.parametrize("interpret", [True, False], ids=["kernel", "jnp"])
def test_a_cast_that_keeps_its_input_writes_the_bits_of_save(current, interpret, norm):
  """`keep_groups`: the cast of gelu(h) also writes h itself as `save` keeps it, and the cast
  of rms_norm(x) the x r the norm's backward keeps (`rms_norm.kept_for_backward`), bit for
  bit (the kernel in the Pallas interpreter and its jnp definition): one group per tile, a
  ragged last group, a row of zeros (scale 1, zero codes), a group of tiny values (a large
  power-of-two scale) and magnitudes over 12 decades."""
  from pallas_kernels import (CastTransposeBlockSizes, cast_transpose_amax_in_chain,
                              cast_transpose_amax_in_chain_reference, cast_transpose_from_amax,
                              cast_transpose_from_amax_reference)
  from pallas_kernels.activations import GELU, RMS_NORM
  from fp8jax.ops import rms_norm as norm_math
  h = _log_uniform((80, 300), seed=7)
  h[3] = 0.0
  h[5, 128:256] *= 1e-30
  h = jnp.asarray(h, jnp.bfloat16)
  prologue = dict(prologue=GELU)
  want = saved_activations.quantize_groups(h)
  if norm:
    r = norm_math.reciprocal_rms(h, 1e-6)
    gains = jnp.asarray(np.random.default_rng(3).uniform(0.5, 1.5, (1, 300)), jnp.float32)
    prologue = dict(prologue=RMS_NORM, prologue_inputs=(r, gains))
    want = tuple(norm_math.kept_for_backward(h, r, save_fp8=True))
  args = dict(fp8_dtype=jnp.float8_e4m3fn, fp8_max=448.0, keep_groups=True, **prologue)
  blocks = dict(block_sizes=CastTransposeBlockSizes(block_rows=16, block_cols=128))
  if current:
    scalars = (jnp.float32(3.0), jnp.float32(1.0), jnp.float32(0.0))
    if interpret:
      cast = lambda **kw: cast_transpose_from_amax(h, *scalars, interpret=True, **blocks, **kw)
    else:
      cast = lambda **kw: cast_transpose_from_amax_reference(h, *scalars, **kw)
  else:
    chain = (functools.partial(cast_transpose_amax_in_chain, interpret=True) if interpret
             else cast_transpose_amax_in_chain_reference)
    cast = lambda **kw: chain(h, jnp.float32(10.0), None, tile_amaxes=True, **blocks, **kw)
  codes, descales = cast(**args).kept
  assert codes.dtype == want[0].dtype and descales.shape == (80, 3)
  np.testing.assert_array_equal(np.asarray(codes).view(np.uint8),
                                np.asarray(want[0]).view(np.uint8))
  np.testing.assert_array_equal(np.asarray(descales).view(np.uint32),
                                np.asarray(want[1]).view(np.uint32))
  assert float(descales[3, 0]) == 1.0 and float(descales[5, 1]) < 2.0**-80


def test_a_cast_narrower_than_a_group_keeps_each_row_as_one_group():
  """48 columns: the kernel's tile is 64 wide and spans each row, one group (as `save`)."""
  from pallas_kernels import cast_transpose_amax_in_chain
  x = jnp.asarray(_log_uniform((40, 48), seed=9), jnp.bfloat16)
  kept = cast_transpose_amax_in_chain(x, jnp.float32(1), None, fp8_dtype=jnp.float8_e4m3fn,
                                      fp8_max=448.0, keep_groups=True, tile_amaxes=True,
                                      interpret=True).kept
  want = saved_activations.quantize_groups(x)
  assert kept[1].shape == (40, 1)
  for got, expected in zip(kept, want):
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(expected, np.float32))


@pytest.mark.parametrize("columns, block_cols", [(256, 64), (200, 256), (96, 64)])
def test_keeping_a_cast_s_input_needs_tiles_one_group_wide(columns, block_cols):
  """A tile narrower than a group splits it; one wider than a group, over more than a
  group's columns, would hold several groups under one descale: both are refused."""
  from pallas_kernels import CastTransposeBlockSizes, cast_transpose_amax_in_chain
  h = jnp.ones((32, columns), jnp.bfloat16)
  with pytest.raises(ValueError, match="block_cols=128"):
    cast_transpose_amax_in_chain(h, jnp.float32(1), None, fp8_dtype=jnp.float8_e4m3fn,
                                 fp8_max=448.0, keep_groups=True, tile_amaxes=True,
                                 block_sizes=CastTransposeBlockSizes(block_rows=16,
                                                                     block_cols=block_cols),
                                 interpret=True)
