"""fp8jax.telemetry matches a float64 numpy reference built from the FP8 format tables.

The reference never casts to an FP8 dtype. With p = |float32(x) * scale| (the
product the op forms in float32), M = fmt.max, N = fmt.min_normal,
S = fmt.min_subnormal = N * 2**-mantissa_bits, round-to-nearest-even on the FP8
grid gives these exact rules (subnormals are spaced S apart on [0, N)):

  saturated  iff p > M                 (clipped to M before the cast)
  flushed    iff 0 < p <= S/2          (S/2 is a tie between 0 and S: even is 0)
  subnormal  iff S/2 < p < N - S/2     (N - S/2 is a tie between the largest
                                        subnormal N - S, odd, and N, even: N)
  normal     iff N - S/2 <= p <= M

`fp8_reference` rounds with the same grid for the SNR reference.
"""
import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import fp8jax
from fp8jax import telemetry
from fp8jax.flax.linen_telemetry import linen_tensor_stats
from fp8jax.flax import linen as fp8nn
from fp8jax.flax import nnx as fp8nnx

FORMATS = [fp8jax.E4M3, fp8jax.E5M2]
U = 2.0 ** -24  # float32 unit roundoff


def _meta(recipe, fmt, scale=1.0):
  return fp8jax.init_meta(recipe, fmt).with_scale(scale)


def _recipe(kind):
  if kind == "current":
    return fp8jax.CurrentScaling()
  return fp8jax.DelayedScaling(amax_history_len=4)


def f32_next(value, toward):
  return float(np.nextafter(np.float32(value), np.float32(toward)))


def fp8_reference(x, scale, fmt):
  """float64 FP8 values of `x * scale` (before descaling), from fmt's constants alone.

  Clip to ±max, then round to nearest even on the grid of spacing
  2**(max(e, log2(min_normal)) - mantissa_bits), e the binade of the value.
  """
  p = (np.asarray(x, np.float32) * np.float32(scale)).astype(np.float64)
  p = np.clip(p, -fmt.max, fmt.max)
  mag = np.abs(p)
  _, e = np.frexp(mag)  # mag = f * 2**e, f in [0.5, 1): the binade is 2**(e - 1)
  binade = np.maximum(e - 1, np.log2(fmt.min_normal))
  ulp = 2.0 ** (binade - fmt.mantissa_bits)
  return np.sign(p) * np.round(mag / ulp) * ulp  # np.round: half to even


def reference_stats(x, scale, fmt):
  """(counts saturated, flushed, subnormal; snr_db) in float64 numpy."""
  x64 = np.asarray(x, np.float32).astype(np.float64)
  p = np.abs(np.asarray(x, np.float32) * np.float32(scale)).astype(np.float64)
  q = fp8_reference(x, scale, fmt)
  counts = (int(np.sum(p > fmt.max)),
            int(np.sum((x64 != 0) & (q == 0))),
            int(np.sum((q != 0) & (np.abs(q) < fmt.min_normal))))
  finite = np.isfinite(x64)
  error = x64[finite] - q[finite] / np.float64(scale)
  with np.errstate(divide="ignore"):  # no error at all: +inf, as telemetry defines it
    snr_db = 10 * np.log10(np.sum(x64[finite] ** 2) / np.sum(error ** 2))
  return counts, snr_db


def assert_fractions(stats, counts, n):
  """Each fraction is exactly count / n up to float32 rounding, and gives back the count.

  The count is an exact int32 sum; XLA may turn the division by the constant n
  into a product with a rounded 1 / n, so the fraction is within two roundings
  (2 * U relative) of count / n, far less than the 1 / n between neighbouring counts.
  """
  for name, count in zip(("saturated", "flushed", "subnormal"), counts):
    fraction = float(getattr(stats, name))
    assert round(fraction * n) == count, (name, fraction * n, count)
    assert abs(fraction - count / n) <= 2 * U * count / n, (name, fraction, count / n)


def test_format_tables_are_consistent_with_the_grid_the_reference_uses():
  for fmt in FORMATS:
    assert fmt.min_subnormal == fmt.min_normal * 2.0 ** -fmt.mantissa_bits
    # The reference rounds max to itself and the grid ends there.
    assert fp8_reference(np.float32(fmt.max), 1.0, fmt) == fmt.max
    assert float(jnp.asarray(fmt.max, jnp.float32).astype(fmt.dtype)) == fmt.max


def crafted(fmt, scale, with_saturation, seed=0):
  """97 values x = p / scale (exact: scale is a power of two) with known categories.

  Returns (x float32[97], (saturated, flushed, subnormal) counts).
  """
  M, N, S = fmt.max, fmt.min_normal, fmt.min_subnormal
  saturated = [f32_next(M, np.inf), 2 * M, -1.5 * M] if with_saturation else []
  flushed = [S / 2, -S / 2, f32_next(S / 2, 0), S / 8, -S * 2.0 ** -10]
  subnormal = [f32_next(S / 2, np.inf), S, 1.5 * S, -3 * S, N - S,
               f32_next(N - S / 2, 0), -N / 2]
  normal = [M, -M, N - S / 2, N, -N, f32_next(N - S / 2, np.inf)]
  zeros = [0.0, -0.0]  # x == 0 is in no category
  rng = np.random.default_rng(seed)
  rest = 97 - len(saturated + flushed + subnormal + normal + zeros)
  # Log-uniform magnitudes in [N, M]: normal FP8 values after scaling.
  fill = np.exp(rng.uniform(np.log(N), np.log(M), rest)) * rng.choice([-1, 1], rest)
  p = np.array(saturated + flushed + subnormal + normal + zeros + list(fill), np.float32)
  x = rng.permutation(p / np.float32(scale)).astype(np.float32)
  return x, (len(saturated), len(flushed), len(subnormal))


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("kind", ["delayed", "current"])
def test_crafted_boundary_values_give_exact_fractions(fmt, kind):
  # Delayed: the meta's scale (1/4); current: scale = max / amax = 16, computed
  # from x itself (the meta's stored scale 1 must not be used).
  scale = 0.25 if kind == "delayed" else 16.0
  x, counts = crafted(fmt, scale, with_saturation=kind == "delayed")
  meta = _meta(_recipe(kind), fmt, 0.25 if kind == "delayed" else 1.0)
  stats = jax.jit(telemetry.tensor_stats)(jnp.asarray(x), meta)
  assert counts == ((3, 5, 7) if kind == "delayed" else (0, 5, 7))
  assert_fractions(stats, counts, x.size)
  assert float(stats.scale) == scale
  assert float(stats.amax) == float(np.max(np.abs(x)))
  # The reference quantizer agrees with the threshold rules on the same values.
  assert reference_stats(x, scale, fmt)[0] == counts


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("kind", ["delayed", "current"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_random_wide_range_stats_match_float64_reference(fmt, kind, dtype):
  rng = np.random.default_rng(1)
  n = 4096
  # Magnitudes over 40 binades: every category (and, delayed, saturation) occurs.
  x = jnp.asarray(rng.standard_normal(n) * 2.0 ** rng.uniform(-40, 0, n), dtype)
  x_amax = float(np.max(np.abs(np.asarray(x, np.float32))))
  if kind == "delayed":
    scale = np.float32(2 * fmt.max / x_amax)  # elements above amax / 2 saturate
    meta = _meta(_recipe(kind), fmt, scale)
  else:
    scale = np.float32(fmt.max) / np.float32(x_amax)  # what the op computes, in float32
    meta = _meta(_recipe(kind), fmt)
  counts, want_snr = reference_stats(x, scale, fmt)
  assert all(c > 0 for c in counts[1:]) and (counts[0] > 0) == (kind == "delayed")
  # float32 sums of n non-negative terms are off by at most (n - 1) * U relative in
  # any order, each of the two; the per-element errors (dequantize, the subtraction,
  # the common normalization) add a few U. The ratio is then off by < 2 (n + 64) U,
  # which is 10 / ln 10 times that in dB (about 2.1e-3 dB for n = 4096).
  tol_db = 10 / np.log(10) * 2 * (n + 64) * U
  for stats in (telemetry.tensor_stats(x, meta), jax.jit(telemetry.tensor_stats)(x, meta)):
    assert all(leaf.dtype == jnp.float32 and leaf.shape == () for leaf in stats)
    assert_fractions(stats, counts, n)
    assert float(stats.scale) == float(scale)
    assert float(stats.amax) == x_amax
    assert abs(float(stats.snr_db) - want_snr) <= tol_db, (float(stats.snr_db), want_snr)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_snr_is_inf_and_nothing_is_lost_when_x_is_on_the_fp8_grid(fmt):
  rng = np.random.default_rng(2)
  on_grid = jnp.asarray(rng.standard_normal(512) * 8, jnp.float32).astype(fmt.dtype)
  x = on_grid.astype(jnp.float32) * 2.0  # scale 1/2 maps it back onto the grid exactly
  assert float(jnp.max(jnp.abs(x))) > 0
  stats = jax.jit(telemetry.tensor_stats)(x, _meta(_recipe("delayed"), fmt, 0.5))
  assert float(stats.snr_db) == np.inf
  assert float(stats.saturated) == 0 and float(stats.flushed) == 0
  counts, _ = reference_stats(np.asarray(x), 0.5, fmt)
  assert_fractions(stats, counts, x.size)


def test_snr_counts_only_finite_elements_and_inf_saturates():
  fmt = fp8jax.E4M3
  rng = np.random.default_rng(3)
  finite = rng.standard_normal(64).astype(np.float32)
  x = np.concatenate([finite, [np.inf, -np.inf, np.nan]]).astype(np.float32)
  stats = telemetry.tensor_stats(jnp.asarray(x), _meta(_recipe("delayed"), fmt, 16.0))
  _, want_snr = reference_stats(finite, 16.0, fmt)
  # Same bound as above for n = 64: the sums are over the finite elements only.
  assert abs(float(stats.snr_db) - want_snr) <= 10 / np.log(10) * 2 * (64 + 64) * U
  assert np.isnan(float(stats.amax))
  counts, _ = reference_stats(x, 16.0, fmt)  # the infinities count as saturated
  assert counts[0] >= 2
  assert_fractions(stats, counts, x.size)


def test_empty_tensor_has_zero_fractions_and_inf_snr():
  stats = telemetry.tensor_stats(jnp.zeros((0, 8)), _meta(_recipe("current"), fp8jax.E4M3))
  assert [float(v) for v in stats] == [0.0, 1.0, 0.0, 0.0, 0.0, np.inf]


def _state_with(recipe, amaxes, scales):
  """A DotMeta whose roles have these newest history entries and scales."""
  meta = fp8jax.init_dot_meta(recipe)
  roles = {}
  for role, a, s in zip(("x", "kernel", "grad"), amaxes, scales):
    m = getattr(meta, role)
    history = m.amax_history.at[0].set(a).at[1].set(10 * a + 1)  # only [0] counts
    roles[role] = dataclasses.replace(m, amax_history=history).with_scale(s)
  return fp8jax.DotMeta(**roles)


def test_state_stats_give_last_amax_scale_and_headroom_per_role():
  recipe = fp8jax.DelayedScaling(amax_history_len=4)
  rng = np.random.default_rng(4)
  layer0 = _state_with(recipe, rng.uniform(0.1, 10, 3), rng.uniform(1, 1000, 3))
  # Dense_1: x exactly fills E4M3, kernel saturates (headroom < 0), grad saw nothing.
  layer1 = _state_with(recipe, [3.0, 2.0, 0.0], [448 / 3.0, 448.0, 1.0])
  state = {"Dense_0": {"dot_meta": layer0}, "Dense_1": {"dot_meta": layer1}}
  stats = jax.jit(telemetry.state_stats)(state)
  assert sorted(stats) == [f"Dense_{i}/dot_meta/{r}" for i in (0, 1)
                           for r in ("grad", "kernel", "x")]
  for i, layer in enumerate((layer0, layer1)):
    for role in ("x", "kernel", "grad"):
      meta, got = getattr(layer, role), stats[f"Dense_{i}/dot_meta/{role}"]
      a, s = float(meta.amax_history[0]), float(meta.scale)
      assert float(got.amax) == a and float(got.scale) == s
      want = np.log2(meta.fmt.max / (np.float64(a) * s)) if a > 0 else np.inf
      # Three float32 log2 of values below 2**16, each within a few ulp: < 1e-5 abs.
      np.testing.assert_allclose(float(got.headroom), want, rtol=0, atol=1e-5)
  assert abs(float(stats["Dense_1/dot_meta/x"].headroom)) < 1e-5
  assert float(stats["Dense_1/dot_meta/kernel"].headroom) < 0
  assert float(stats["Dense_1/dot_meta/grad"].headroom) == np.inf


def test_state_stats_key_nnx_state_by_attribute_path():
  class Two(nnx.Module):
    def __init__(self):
      self.first = fp8nnx.Fp8Linear(4, 3, rngs=nnx.Rngs(0))
      self.second = fp8nnx.Fp8Linear(3, 2, rngs=nnx.Rngs(1))

  state = nnx.state(Two(), fp8nnx.Fp8MetaVariable)
  stats = jax.jit(telemetry.state_stats)(state)
  assert sorted(stats) == [f"{layer}/fp8_meta/{r}" for layer in ("first", "second")
                           for r in ("grad", "kernel", "x")]
  # Fresh state: history all 0, scale 1.
  assert all(float(s.amax) == 0 and float(s.scale) == 1 for s in stats.values())


class TwoDense(nn.Module):
  recipe: object

  @nn.compact
  def __call__(self, x):
    h = jnp.tanh(fp8nn.Fp8Dense(32, recipe=self.recipe, name="dense_0")(x))
    return fp8nn.Fp8Dense(8, recipe=self.recipe, name="dense_1")(h)


def test_linen_train_step_logs_every_layer_and_role():
  # Delayed scaling; the capture of current-scaling layers is tested below.
  recipe = _recipe("delayed")
  model = TwoDense(recipe)
  keys = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(keys[0], (4, 16)) * 3
  y = jax.random.normal(keys[1], (4, 8))
  variables = jax.jit(model.init)(keys[2], x)

  def loss_fn(params, fp8_state, x, y):
    with linen_tensor_stats():
      out, updates = model.apply({"params": params, "fp8_meta": fp8_state}, x,
                                 mutable=["fp8_meta", telemetry.TELEMETRY_COLLECTION])
    return ((jnp.mean((out - y) ** 2), updates[telemetry.TELEMETRY_COLLECTION]),
            updates["fp8_meta"])

  @jax.jit
  def step(params, fp8_state, x, y):
    (loss, tensors), grads, fp8_state = fp8jax.value_and_grad(loss_fn, has_aux=True)(
        params, fp8_state, x, y)
    params = jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)
    return params, fp8_state, tensors, telemetry.state_stats(fp8_state)

  params, state = variables["params"], variables["fp8_meta"]
  params1, state1, _, _ = step(params, state, x, y)
  # The second step quantizes with the scales the first one set (delayed scaling).
  _, state2, tensors, meta_stats = step(params1, state1, x, y)

  logged = telemetry.scalars({"tensor": tensors, "state": meta_stats})
  want_keys = ({f"tensor/dense_{i}/{r}/0/{f}" for i in (0, 1) for r in ("x", "kernel")
                for f in telemetry.TensorStats._fields} |
               {f"state/dense_{i}/dot_meta/{r}/{f}" for i in (0, 1)
                for r in ("x", "kernel", "grad") for f in telemetry.MetaStats._fields})
  assert set(logged) == want_keys
  for key, value in logged.items():
    assert value.dtype == jnp.float32 and value.shape == (), key
    assert np.isfinite(float(value)), key

  # The sown stats are those of the tensors each layer quantized in that step.
  @jax.jit
  def direct(params, fp8_state, x):
    h = jnp.tanh(fp8jax.fp8_dense(x, params["dense_0"]["kernel"], params["dense_0"]["bias"],
                                  fp8_state["dense_0"]["dot_meta"])[0])
    return {name: telemetry.dot_stats(inp, params[name]["kernel"], fp8_state[name]["dot_meta"])
            for name, inp in (("dense_0", x), ("dense_1", h))}

  want = direct(params1, state1, x)
  for name in ("dense_0", "dense_1"):
    for role in ("x", "kernel"):
      got = tensors[name][role][0]
      for field in ("amax", "scale", "saturated", "flushed", "subnormal"):
        assert float(getattr(got, field)) == float(getattr(want[name][role], field))
      # Same float32 computation compiled in another program: summation order may
      # differ, bounded as in the reference test (n <= 512 here): < 2e-4 dB.
      assert abs(float(got.snr_db) - float(want[name][role].snr_db)) < 2e-4
  assert float(tensors["dense_0"]["x"][0].scale) != 1.0  # the first step set the scales


def test_linen_capture_covers_dense_general_einsum_and_dot_general():
  recipe = fp8jax.CurrentScaling()

  class Mixed(nn.Module):
    @nn.compact
    def __call__(self, x):
      a = fp8nn.Fp8DenseGeneral(3, recipe=recipe, dtype=jnp.bfloat16, name="general")(x)
      b = fp8nn.Fp8Einsum((8, 3), "bsd,dk->bsk", recipe=recipe, name="einsum")(x)
      c = nn.Dense(3, dot_general_cls=lambda: fp8nn.Fp8DotGeneral(recipe=recipe),
                   name="dense")(x)
      return a.astype(jnp.float32) + b + c

  x = jax.random.normal(jax.random.key(5), (2, 4, 8))
  model = Mixed()
  with linen_tensor_stats():
    variables = jax.jit(model.init)(jax.random.key(6), x)
  assert telemetry.TELEMETRY_COLLECTION not in variables  # init sows nothing

  def logged_apply(variables, x, collections):
    with linen_tensor_stats():
      return model.apply(variables, x, mutable=collections)

  # Without the collection mutable the interceptor adds nothing (shapes suffice).
  _, silent = jax.eval_shape(lambda v, x: logged_apply(v, x, ["fp8_meta"]), variables, x)
  assert telemetry.TELEMETRY_COLLECTION not in silent

  @jax.jit
  def apply(variables, x):
    logged = logged_apply(variables, x, ["fp8_meta", telemetry.TELEMETRY_COLLECTION])
    return logged, model.apply(variables, x, mutable=["fp8_meta"])

  (out, updates), (plain_out, _) = apply(variables, x)
  # Telemetry only observes: the layers' outputs are unchanged.
  np.testing.assert_array_equal(np.asarray(out), np.asarray(plain_out))
  tensors = updates[telemetry.TELEMETRY_COLLECTION]

  @jax.jit
  def direct(params, metas, x):
    return {
        # Fp8DenseGeneral(dtype=bf16) quantizes x after casting it to bf16, and its float32
        # master kernel as stored (fp8jax.flax.master_kernel).
        "general": telemetry.dot_stats(x.astype(jnp.bfloat16), params["general"]["kernel"],
                                       metas["general"]["dot_meta"]),
        "einsum": telemetry.dot_stats(x, params["einsum"]["kernel"], metas["einsum"]["dot_meta"]),
        "dense": {"Fp8DotGeneral_0": telemetry.dot_stats(
            x, params["dense"]["kernel"], metas["dense"]["Fp8DotGeneral_0"]["dot_meta"])},
    }

  want = direct(variables["params"], variables["fp8_meta"], x)
  for path in (("general",), ("einsum",), ("dense", "Fp8DotGeneral_0")):
    got, expected = tensors, want
    for part in path:
      got, expected = got[part], expected[part]
    for role in ("x", "kernel"):
      for field in ("amax", "scale", "saturated", "flushed", "subnormal"):
        assert float(getattr(got[role][0], field)) == float(getattr(expected[role], field))
      # As in the train-step test: the same float32 sums in another program.
      assert abs(float(got[role][0].snr_db) - float(expected[role].snr_db)) < 2e-4


def test_bad_arguments_raise_errors_that_name_them():
  meta = fp8jax.init_dot_meta(fp8jax.DelayedScaling(amax_history_len=4))
  x = jax.random.normal(jax.random.key(7), (8,))
  with pytest.raises(TypeError, match=r"x has dtype int32.*astype"):
    telemetry.tensor_stats(jnp.arange(8), meta.x)
  with pytest.raises(TypeError, match=r"meta must be one role's fp8jax.Fp8Meta, got a "
                                      r"DotMeta.*dot_meta.x"):
    telemetry.tensor_stats(x, meta)
  stacked = jax.tree.map(lambda a: jnp.stack([a, a]), meta.x)
  with pytest.raises(ValueError, match=r"meta.scale has shape \(2,\).*sliced per layer"):
    telemetry.tensor_stats(x, stacked)
  with pytest.raises(TypeError, match=r"meta must be a fp8jax.DotMeta"):
    telemetry.dot_stats(x, x, meta.x)
  with pytest.raises(TypeError, match=r"fp8_state must be a pytree of fp8jax.Fp8Meta"):
    telemetry.state_stats({"params": {"kernel": x}, "fp8_meta": {"dot_meta": meta}})


def _per_block_reference_scale(x2, block, fmt):
  """float32 `fmt.max / amax` of each block of x2, repeated to every element (numpy)."""
  rows, cols = x2.shape
  br, bc = block
  scale = np.empty_like(x2, dtype=np.float32)
  for r in range(0, rows, br):
    for c in range(0, cols, bc):
      tile = np.abs(x2[r:r + br, c:c + bc])
      scale[r:r + br, c:c + bc] = np.float32(fmt.max) / np.float32(tile.max())
  return scale


@pytest.mark.parametrize("recipe, operand, block", [
    (fp8jax.RowwiseScaling(fp8_format="e4m3"), "lhs", (1, 200)),
    (fp8jax.RowwiseScaling(fp8_format="e4m3"), "rhs", (96, 1)),
    (fp8jax.BlockScaling(), "lhs", (1, 128)),
    (fp8jax.BlockScaling(), "rhs", (128, 128)),
], ids=["rowwise_lhs", "rowwise_rhs", "block_lhs", "block_rhs"])
def test_per_row_and_per_block_stats_use_each_blocks_own_scale(recipe, operand, block):
  # Rows of very different magnitudes and a last block that is partial (200 = 128 + 72
  # columns, 96 rows): each element is scaled by its own row's / tile's / block's
  # fmt.max / amax, as the recipe's GEMM quantizes it.
  rng = np.random.default_rng(4)
  x2 = (rng.standard_normal((96, 200)) * 2.0 ** rng.uniform(-12, 12, (96, 1))).astype(np.float32)
  fmt = fp8jax.E4M3
  if block == (96, 1):
    block = (x2.shape[0], 1)
  scale = _per_block_reference_scale(x2, block, fmt)
  q = fp8_reference(x2, scale, fmt)
  counts = (int(np.sum(np.abs(x2 * scale).astype(np.float64) > fmt.max)),
            int(np.sum((x2 != 0) & (q == 0))),
            int(np.sum((q != 0) & (np.abs(q) < fmt.min_normal))))
  error = x2.astype(np.float64) - q / scale.astype(np.float64)
  want_snr = 10 * np.log10(np.sum(x2.astype(np.float64) ** 2) / np.sum(error ** 2))
  meta = fp8jax.init_dot_meta(recipe)
  role = meta.x if operand == "lhs" else meta.kernel
  stats = jax.jit(telemetry.tensor_stats, static_argnums=(2, 3))(jnp.asarray(x2), role,
                                                                 operand, 1)
  assert_fractions(stats, counts, x2.size)
  assert float(stats.scale) == float(scale.min())
  tol_db = 10 / np.log(10) * 2 * (x2.size + 64) * U  # as in the per-tensor test above
  assert abs(float(stats.snr_db) - want_snr) <= tol_db, (float(stats.snr_db), want_snr)
  # The per-tensor scale of the same tensor leaves the small rows far less precise.
  per_tensor = telemetry.tensor_stats(jnp.asarray(x2), fp8jax.init_dot_meta(
      fp8jax.CurrentScaling(fp8_format="e4m3")).x)
  assert float(per_tensor.flushed) > float(stats.flushed)


def test_headroom_of_a_scale_made_from_the_newest_amax_is_exactly_zero():
  # Delayed scaling, margin 0, history 1: the next scale is fmt.max / (the newest amax),
  # so the newest amax has no headroom and no saturation; float32 log2s of it came out
  # -4e-7 .. -2e-6 before, which read as "saturating". Amaxes drawn over many decades.
  recipe = fp8jax.DelayedScaling(amax_history_len=1)
  amaxes = np.exp(np.random.default_rng(0).uniform(-12, 12, 200)).astype(np.float32)
  meta = fp8jax.init_meta(recipe, recipe.forward_format)
  heads = []
  for a in amaxes:
    closed = fp8jax.end_step(dataclasses.replace(meta, amax=jnp.float32(a)))
    heads.append(float(telemetry.state_stats(closed)["meta"].headroom))
  assert heads == [0.0] * len(amaxes)
  # A tensor twice as large under that scale saturates: one bit short (float32 log2s).
  over = dataclasses.replace(closed, amax_history=closed.amax_history * 2)
  assert float(telemetry.state_stats(over)["meta"].headroom) == pytest.approx(-1.0, abs=2**-16)


@pytest.mark.parametrize("recipe", [fp8jax.RowwiseScaling(), fp8jax.MXFP8Scaling()],
                         ids=["rowwise", "mxfp8"])
def test_per_row_stats_of_a_contraction_over_a_middle_axis_fold_along_that_axis(recipe):
  """`Fp8DenseGeneral(axis=1)` on x [4, 64, 32] contracts K = 64 over axis 1: each
  (batch, column) pair is one row of the GEMM's x, scaled over its 64 elements.
  Reference: the same layer on x with axis 1 moved last (a contraction the stats
  always folded right), and float64 numpy for the rowwise SNR."""
  from fp8_reference import quantize_reference

  x = jax.random.normal(jax.random.key(7), (4, 64, 32), jnp.float32)
  x = x * jnp.exp(jax.random.normal(jax.random.key(8), (4, 1, 32)))  # rows of other ranges

  def stats(module, x):
    variables = module.init(jax.random.key(0), x)
    with linen_tensor_stats():
      _, logged = module.apply(variables, x, mutable=["fp8_meta",
                                                      telemetry.TELEMETRY_COLLECTION])
    return jax.tree.leaves(logged[telemetry.TELEMETRY_COLLECTION]["x"],
                           is_leaf=lambda s: isinstance(s, telemetry.TensorStats))[0]

  middle = stats(fp8nn.Fp8DenseGeneral(16, axis=1, recipe=recipe), x)
  last = stats(fp8nn.Fp8DenseGeneral(16, axis=-1, recipe=recipe), jnp.swapaxes(x, 1, 2))
  for field in ("snr_db", "saturated", "flushed"):
    np.testing.assert_allclose(float(getattr(middle, field)), float(getattr(last, field)),
                               rtol=1e-6, err_msg=field)  # same numbers, summed in another order
  if isinstance(recipe, fp8jax.RowwiseScaling):
    rows = np.moveaxis(np.asarray(x, np.float64), 1, 2).reshape(-1, 64)
    amax = np.abs(rows).max(axis=1, keepdims=True)
    scale = np.float32(448.0) / amax.astype(np.float32)
    error = sum(np.sum((row - quantize_reference(row, s, "e4m3") / np.float64(s)) ** 2)
                for row, s in zip(rows, scale[:, 0]))
    want = 10 * np.log10(np.sum(rows ** 2) / error)
    # float32 accumulation of the two sums in fp8jax against float64 here: 1e-3 dB.
    assert float(middle.snr_db) == pytest.approx(want, abs=1e-3)


def test_fp8_model_layers_sow_the_stats_of_the_same_model_written_with_fp8jax_layers():
  from fp8jax.flax import Fp8Model

  recipe = fp8jax.RowwiseScaling()

  class Plain(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Dense(16, name="out")(nn.relu(nn.DenseGeneral(32, axis=1, name="up")(x)))

  class Written(nn.Module):
    @nn.compact
    def __call__(self, x):
      h = fp8nn.Fp8DenseGeneral(32, axis=1, recipe=recipe, name="up")(x)
      return fp8nn.Fp8Dense(16, recipe=recipe, name="out")(nn.relu(h))

  x = jax.random.normal(jax.random.key(3), (4, 24, 8)) * 3
  converted = Fp8Model(Plain(), layer_filter=lambda layer: True, recipe=recipe)
  variables = converted.init(jax.random.key(4), x)

  def sown(apply):
    with linen_tensor_stats():
      _, updates = apply(variables, x, mutable=["fp8_meta", telemetry.TELEMETRY_COLLECTION])
    return updates[telemetry.TELEMETRY_COLLECTION]

  got, want = sown(converted.apply), sown(Written().apply)  # same params and state
  assert set(got) == {"up", "out"}
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
