"""fp8_ragged_dot: FP8 grouped GEMMs (mixture of experts), forward and both gradients.

References: float64 numpy of the same quantization (each group's rows times its expert's
dequantized weight, computed group by group), `jax.lax.ragged_dot` on unquantized values
(the semantics: rows past the groups' sum are zero), and the FP8 format tables (E4M3's
largest value, 448).
"""
import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import fp8jax
from fp8jax import fp8_ragged_dot, init_ragged_dot_meta
from fp8jax.core.blocks import dequantize_blocks

E4M3_MAX = 448.0
RECIPES = {
    "delayed": fp8jax.DelayedScaling(amax_history_len=4),
    "current": fp8jax.CurrentScaling(),
    "rowwise": fp8jax.RowwiseScaling(),
    "block": fp8jax.BlockScaling(),
    "mxfp8": fp8jax.MXFP8Scaling(),
}
K, N = 256, 128


def _problem(sizes, m=None, seed=0):
  """x [M, K], w [G, K, N] with experts of very different magnitudes, and dy [M, N]."""
  g = len(sizes)
  m = m or max(int(sum(sizes)), 1)
  keys = jax.random.split(jax.random.key(seed), 3)
  magnitudes = jnp.asarray([10.0 ** ((i % 5) - 2) for i in range(g)], jnp.float32)
  x = jax.random.normal(keys[0], (m, K), jnp.float32)
  w = jax.random.normal(keys[1], (g, K, N), jnp.float32) * magnitudes[:, None, None]
  dy = jax.random.normal(keys[2], (m, N), jnp.float32)
  return x, w, jnp.asarray(sizes, jnp.int32), dy


def _ragged64(a, b, sizes):
  """float64 ragged product: rows of group g times b[g]; rows past the sum zero."""
  out = np.zeros((a.shape[0], b.shape[2]))
  start = 0
  for g, size in enumerate(np.asarray(sizes)):
    out[start:start + size] = a[start:start + size] @ b[g]
    start += size
  return out


def _wgrad64(x, dy, sizes):
  offsets = np.concatenate([[0], np.cumsum(np.asarray(sizes))])
  return np.stack([x[offsets[g]:offsets[g + 1]].T @ dy[offsets[g]:offsets[g + 1]]
                   for g in range(len(offsets) - 1)])


def _e4m3(values64):
  """float64 -> the E4M3 value (round to nearest even, saturating), from the format table."""
  clipped = np.clip(values64, -E4M3_MAX, E4M3_MAX)
  return clipped.astype(np.float32).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)


def _run(recipe, x, w, sizes, dy, meta=None):
  meta = init_ragged_dot_meta(recipe, w.shape[0]) if meta is None else meta

  def loss(x, w, meta):
    y, new_meta = fp8_ragged_dot(x, w, sizes, meta)
    return jnp.sum(y * dy), (y, new_meta)

  (_, (y, new_meta)), (dx, dw, meta_grad) = jax.value_and_grad(
      loss, argnums=(0, 1, 2), has_aux=True)(x, w, meta)
  return y, dx, dw, new_meta, meta_grad


# The products of E4M3 values are exact in float32; the f32 sums of K (or, for wgrad, up
# to M) of them carry at most K * 2**-24 of the sum of the terms' magnitudes; the final
# descale multiply and the f32 output add 2**-23 more. 2**-14 * sum|terms| bounds all
# shapes here (K = 256, M <= 600 < 2**10) with room.
def _assert_within_f32_sums(got, want, magnitudes):
  bound = 2.0 ** -14 * magnitudes + 1e-30
  assert np.all(np.abs(np.asarray(got, np.float64) - want) <= bound), float(
      np.max(np.abs(np.asarray(got, np.float64) - want) / bound))


@pytest.mark.parametrize("sizes", [(300,), (100, 0, 150, 30), (7, 0, 0, 250, 1, 0, 33, 9) * 2],
                         ids=["G1", "G4_empty", "G16_unsorted_empty"])
def test_per_tensor_delayed_matches_float64_of_the_same_quantization(sizes):
  recipe = RECIPES["delayed"]
  x, w, group_sizes, dy = _problem(sizes, m=sum(sizes) + 20)  # 20 tail rows past the sum
  meta = init_ragged_dot_meta(recipe, len(sizes))
  # Scales an earlier step would have left: x's from its amax, each expert's from its own.
  x_scale = E4M3_MAX / float(jnp.max(jnp.abs(x)))
  w_scales = E4M3_MAX / np.asarray(jnp.max(jnp.abs(w), axis=(1, 2)), np.float64)
  dy_scale = E4M3_MAX / float(jnp.max(jnp.abs(dy))) / 2  # E4M3 gradients (module docstring)
  meta = dataclasses.replace(
      meta, x=meta.x.with_scale(jnp.float32(x_scale)),
      kernel=meta.kernel.with_scale(jnp.asarray(w_scales, jnp.float32)),
      grad=meta.grad.with_scale(jnp.float32(dy_scale)))
  y, dx, dw, new_meta, meta_grad = _run(recipe, x, w, group_sizes, dy, meta)

  s_x = np.float64(np.float32(x_scale))
  s_w = np.asarray(np.float32(w_scales), np.float64)
  s_dy = np.float64(np.float32(dy_scale))
  x8 = _e4m3(np.asarray(x, np.float64) * s_x) / s_x
  w8 = _e4m3(np.asarray(w, np.float64) * s_w[:, None, None]) / s_w[:, None, None]
  dy8 = _e4m3(np.asarray(dy, np.float64) * s_dy) / s_dy
  _assert_within_f32_sums(y, _ragged64(x8, w8, sizes), _ragged64(np.abs(x8), np.abs(w8), sizes))
  _assert_within_f32_sums(dx, _ragged64(dy8, np.swapaxes(w8, 1, 2), sizes),
                          _ragged64(np.abs(dy8), np.abs(np.swapaxes(w8, 1, 2)), sizes))
  _assert_within_f32_sums(dw, _wgrad64(x8, dy8, sizes), _wgrad64(np.abs(x8), np.abs(dy8), sizes))
  rows = sum(sizes)
  assert np.all(np.asarray(y)[rows:] == 0) and np.all(np.asarray(dx)[rows:] == 0)
  # State: x's amax and dy's over the rows in groups (the tail rows are not read), each
  # expert's amax (0 for an expert without rows).
  assert float(new_meta.x.amax) == float(jnp.max(jnp.abs(x[:rows])))
  want_w_amax = np.where(np.asarray(sizes) > 0, np.asarray(jnp.max(jnp.abs(w), axis=(1, 2))), 0)
  np.testing.assert_array_equal(np.asarray(new_meta.kernel.amax), want_w_amax)
  assert float(meta_grad.grad.amax) == float(jnp.max(jnp.abs(dy[:rows])))


@pytest.mark.parametrize("name", ["rowwise", "block", "mxfp8"])
def test_per_operand_recipes_match_float64_of_their_own_quantization(name):
  """Each GEMM quantizes both operands along its own contraction, as the recipe says (its
  quantize_operand is tested against the format tables elsewhere): the grouped product of
  those dequantized operands, group by group in float64, is the reference."""
  recipe = RECIPES[name]
  sizes = (130, 0, 70, 3)
  x, w, group_sizes, dy = _problem(sizes)
  y, dx, dw, _, _ = _run(recipe, x, w, group_sizes, dy)
  fmt = fp8jax.E4M3

  def dq(t, axis, weight):
    return np.asarray(dequantize_blocks(recipe.quantize_operand(t, fmt, axis, weight)),
                      np.float64)

  x_f, w_f = dq(x, -1, False), dq(w, -2, True)
  w_d = dq(w, -2, True) if recipe.kernel_blocks_serve_dgrad else dq(w, -1, True)
  dy_d, x_w, dy_w = dq(dy, -1, False), dq(x, -2, False), dq(dy, -2, False)
  _assert_within_f32_sums(y, _ragged64(x_f, w_f, sizes), _ragged64(np.abs(x_f), np.abs(w_f), sizes))
  _assert_within_f32_sums(dx, _ragged64(dy_d, np.swapaxes(w_d, 1, 2), sizes),
                          _ragged64(np.abs(dy_d), np.abs(np.swapaxes(w_d, 1, 2)), sizes))
  _assert_within_f32_sums(dw, _wgrad64(x_w, dy_w, sizes), _wgrad64(np.abs(x_w), np.abs(dy_w), sizes))


@pytest.mark.parametrize("name", list(RECIPES))
def test_every_recipe_is_close_to_the_unquantized_ragged_dot(name):
  """Against jax.lax.ragged_dot itself: E4M3's 3 mantissa bits give each product ~2**-4 /
  sqrt(3) RMS relative error per operand, ~5% for a sum of many; 8% bounds it."""
  x, w, group_sizes, dy = _problem((90, 0, 160, 50, 0), seed=3)
  y, dx, dw, _, _ = _run(RECIPES[name], x, w, group_sizes, dy)
  want_y, vjp = jax.vjp(lambda x, w: jax.lax.ragged_dot(x, w, group_sizes), x, w)
  want_dx, want_dw = vjp(dy)
  for got, want in ((y, want_y), (dx, want_dx), (dw, want_dw)):
    assert float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want)) < 0.08


@pytest.mark.parametrize("name", list(RECIPES))
def test_rows_past_the_groups_change_no_output_gradient_or_state(name):
  """As jax.lax.ragged_dot: rows past sum(group_sizes) (a padded buffer) are not read.
  Filled with 1e6 and NaN, in x and in the output gradient, they leave every output,
  gradient and recorded amax as zeros there leave them (bit for bit), and the closed
  state (the next step's scales) with them."""
  recipe = RECIPES[name]
  x, w, group_sizes, dy = _problem((90, 0, 60, 7), m=192, seed=4)
  rows = 157
  run = jax.jit(lambda x, dy: _run(recipe, x, w, group_sizes, dy))  # one compile for both
  clean = run(x.at[rows:].set(0.0), dy.at[rows:].set(0.0))
  dirty = run(*[t.at[rows:].set(1e6).at[rows + 3].set(jnp.nan) for t in (x, dy)])
  for got, want in zip(jax.tree.leaves(dirty), jax.tree.leaves(clean)):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  y, dx = dirty[0], dirty[1]
  assert np.all(np.asarray(y)[rows:] == 0) and np.all(np.asarray(dx)[rows:] == 0)
  closed = [fp8jax.close_step(run[3], run[4]) for run in (dirty, clean)]
  for got, want in zip(jax.tree.leaves(closed[0]), jax.tree.leaves(closed[1])):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_an_expert_without_rows_keeps_its_scale_through_the_step():
  recipe = fp8jax.DelayedScaling(amax_history_len=2)
  x, w, group_sizes, dy = _problem((120, 0, 80))
  meta = init_ragged_dot_meta(recipe, 3)
  meta = dataclasses.replace(meta, kernel=meta.kernel.with_scale(jnp.float32([2.0, 3.0, 4.0])))

  def loss(params, meta):
    y, meta = fp8_ragged_dot(params["x"], params["w"], group_sizes, meta)
    return jnp.sum(y * dy), meta

  _, _, new_meta = fp8jax.value_and_grad(loss)({"x": x, "w": w}, meta)
  scales = np.asarray(new_meta.kernel.scale)
  assert scales[1] == 3.0  # no rows: no amax, the old scale stays
  amaxes = np.asarray(jnp.max(jnp.abs(w), axis=(1, 2)))
  np.testing.assert_allclose(scales[[0, 2]], E4M3_MAX / amaxes[[0, 2]], rtol=1e-6)


def test_runs_under_jit_vmap_scan_over_layers_and_checkpoint():
  recipe = RECIPES["delayed"]
  x, w, group_sizes, dy = _problem((60, 40, 28))
  single, _, _, _, _ = _run(recipe, x, w, group_sizes, dy)
  meta = init_ragged_dot_meta(recipe, 3)
  jitted = jax.jit(lambda x, w, meta: fp8_ragged_dot(x, w, group_sizes, meta))
  np.testing.assert_array_equal(jitted(x, w, meta)[0], single)
  remat = jax.checkpoint(lambda x, w, meta: fp8_ragged_dot(x, w, group_sizes, meta)[0])
  dx = jax.grad(lambda x: jnp.sum(remat(x, w, meta) * dy))(x)
  np.testing.assert_array_equal(dx, _run(recipe, x, w, group_sizes, dy)[1])
  # vmap over examples with one state: each example's product, the batch's amax.
  xs = jnp.stack([x, 2 * x])
  ys, batch_meta = jax.vmap(lambda x: fp8_ragged_dot(x, w, group_sizes, meta))(xs)
  np.testing.assert_array_equal(ys[0], single)
  np.testing.assert_array_equal(batch_meta.x.amax, float(jnp.max(jnp.abs(2 * x))))
  # lax.scan over two layers of experts, each with its own state (stacked).
  ws = jnp.stack([w[:, :N, :], w[:, N:, :]])  # [2 layers, G, N, N]
  metas = jax.tree.map(lambda a: jnp.stack([a, a]), init_ragged_dot_meta(recipe, 3))

  def layer(h, params):
    w_l, meta_l = params
    h, meta_l = fp8_ragged_dot(h, w_l, group_sizes, meta_l)
    return h, meta_l

  out, new_metas = jax.lax.scan(layer, x[:, :N], (ws, metas))
  assert out.shape == (128, N) and new_metas.kernel.amax.shape == (2, 3)
  assert float(new_metas.x.amax[0]) == float(jnp.max(jnp.abs(x[:, :N])))


def test_state_round_trips_a_checkpoint_bit_for_bit(tmp_path):
  ckpt = pytest.importorskip("fp8jax.checkpoint")
  x, w, group_sizes, dy = _problem((100, 28))
  _, _, _, meta, _ = _run(RECIPES["delayed"], x, w, group_sizes, dy)
  ckpt.save(tmp_path / "c", params={"w": w}, opt_state={}, fp8_state={"moe": meta})
  restored = ckpt.restore(tmp_path / "c", params={"w": w}, opt_state={},
                          fp8_state={"moe": init_ragged_dot_meta(RECIPES["delayed"], 2)})
  for got, want in zip(jax.tree.leaves(restored["fp8_state"]), jax.tree.leaves({"moe": meta})):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("sizes,message", [
    (np.array([10, -2, 5], np.int32), "negative size"),
    (np.array([100, 100, 100], np.int32), "sums to 300, more than the 128 rows"),
    (np.array([10, 5], np.int32), r"shape \(3,\), one size per expert"),
    (np.array([10.0, 5.0, 1.0], np.float32), "must be an int32 array"),
])
def test_bad_group_sizes_are_named(sizes, message):
  x, w, _, _ = _problem((50, 50, 28))
  with pytest.raises(ValueError, match=f"group_sizes.*{message}|{message}"):
    fp8_ragged_dot(x, w, jnp.asarray(sizes), init_ragged_dot_meta(RECIPES["delayed"], 3))


def test_a_state_for_another_number_of_experts_is_named():
  x, w, group_sizes, _ = _problem((50, 50, 28))
  with pytest.raises(ValueError, match=r"meta.kernel.scale has shape \(4,\), expected \(3,\)"):
    fp8_ragged_dot(x, w, group_sizes, init_ragged_dot_meta(RECIPES["delayed"], 4))
