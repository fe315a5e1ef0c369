"""NVFP4Scaling: its quantizer against float64 references from the published definitions,
stochastic rounding, the Hadamard transform, the three GEMMs, training, state and refusals.

The references here are written from the definitions, not from fp8jax:

* E2M1 (OCP Microscaling Formats v1.0, section 5.3.3): sign, 2 exponent bits with bias
  1, 1 mantissa bit; exponent 0 is subnormal (0 and 0.5). Rounding to nearest picks the
  nearer grid point and, at a midpoint, the one with an even code (mantissa bit 0).
* E4M3 (OCP FP8 v1.0): `fp8_reference.round_to_fp8`, saturated at 448.
* NVFP4 (NVIDIA's description, as TransformerEngine's NVFP4 recipe documents it): an
  E4M3 scale per 16 values, `block_amax / 6 * s_t`, and a float32 tensor scale
  `s_t = 448 * 6 / amax`. The scale arithmetic is float32 by definition; the reference
  does it with numpy float32 (IEEE, as XLA), the roundings onto E4M3 and E2M1 in float64
  from the grids above.
"""
from __future__ import annotations

import dataclasses
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import fp8jax
import fp8jax.checkpoint as ckpt
from fp8jax import telemetry
from fp8jax.core import blocks as bq
from fp8jax.core import nvfp4, rounding_keys
from fp8jax.flax import Fp8Model, Fp8Rule
from fp8jax.flax import linen as fp8nn
from fp8_reference import round_to_fp8
from multidevice import N_DEVICES, multidevice
from test_block_quantize import rows_of_different_magnitudes
from test_fine_grained_recipes import linen_train_step


# Jitted once per shape: the eager ops of one quantization would compile one by one.
quantize = jax.jit(nvfp4.quantize_nvfp4, static_argnums=1)
dequantize = jax.jit(bq.dequantize_blocks)


def e2m1_grid() -> tuple[np.ndarray, np.ndarray]:
  """(codes 0..7, their float64 magnitudes) from the E2M1 bit layout."""
  codes = np.arange(8)
  exponent, mantissa = codes >> 1, codes & 1
  values = np.where(exponent == 0, mantissa * 0.5,
                    (1 + mantissa / 2) * 2.0 ** (exponent - 1.0))
  return codes, values


def reference_e2m1(v: np.ndarray) -> np.ndarray:
  """float64 `v` (in [-6, 6]) rounded to the nearest E2M1 value, ties to the even code."""
  codes, grid = e2m1_grid()
  a = np.abs(np.asarray(v, np.float64))
  distance = np.abs(a[..., None] - grid)
  nearest = distance.min(axis=-1, keepdims=True)
  # Among the nearest grid points (two at a midpoint) take the even code.
  candidates = np.where(distance == nearest, codes, 99)
  even_first = np.where(candidates % 2 == 0, candidates, candidates + 100)
  return np.copysign(grid[np.min(even_first, axis=-1) % 100], v)


def reference_nvfp4(x: np.ndarray, block) -> dict:
  """The NVFP4 quantization of float32 `x [R, C]` in `block`s, step by step."""
  x = np.asarray(x, np.float32)
  amax = np.float32(np.max(np.abs(x)))
  s_t = np.float32(448.0 * 6.0) / amax if amax > 0 else np.float32(1.0)
  rows, cols = x.shape
  br, bc = block
  n_r, n_c = -(-rows // br), -(-cols // bc)
  d = np.zeros((n_r, n_c), np.float32)
  q = np.zeros_like(x, np.float64)
  for i in range(n_r):
    for j in range(n_c):
      tile = x[i * br:(i + 1) * br, j * bc:(j + 1) * bc]
      scaled_block_amax = np.float32(np.max(np.abs(tile)) / np.float32(6.0)) * s_t
      d[i, j] = round_to_fp8(np.minimum(np.float64(scaled_block_amax), 448.0), "e4m3")
      m = np.float32(s_t / d[i, j]) if d[i, j] > 0 else np.float32(0.0)
      v = np.clip((tile * m).astype(np.float32).astype(np.float64), -6.0, 6.0)
      q[i * br:(i + 1) * br, j * bc:(j + 1) * bc] = reference_e2m1(v)
  scale_inv = d * (np.float32(1.0) / s_t)
  return {"q": q, "d": d, "s_t": s_t, "scale_inv": scale_inv}


def assert_matches_reference(got, x, block):
  want = reference_nvfp4(x, block)
  assert got.q.dtype == jnp.float4_e2m1fn and got.block == block
  np.testing.assert_array_equal(np.asarray(got.q, np.float64), want["q"])
  np.testing.assert_array_equal(np.asarray(got.block_scale, np.float32), want["d"])
  assert np.float32(got.tensor_scale) == want["s_t"]
  np.testing.assert_array_equal(np.asarray(got.scale_inv), want["scale_inv"])


# ----- The quantizer ---------------------------------------------------------------------


def test_every_representable_e2m1_value_round_trips():
  codes, magnitudes = e2m1_grid()
  np.testing.assert_array_equal(magnitudes, [0, 0.5, 1, 1.5, 2, 3, 4, 6])
  values = np.concatenate([magnitudes, -magnitudes]).astype(np.float32)  # 16 codes
  # Through the rounding, and through the 4-bit dtype the quantizer stores.
  np.testing.assert_array_equal(np.asarray(nvfp4.round_to_e2m1(jnp.asarray(values))), values)
  np.testing.assert_array_equal(
      np.asarray(jnp.asarray(values).astype(jnp.float4_e2m1fn).astype(jnp.float32)), values)
  # Through the whole quantizer: one 16-element block holding 6 (amax 6, so s_t = 448,
  # d = 448 and the multiplier 1) and every other value, in a row and in a 16 x 16 block.
  row = np.concatenate([values[:8], values[9:], [6.0]]).astype(np.float32)[None, :]
  for x, block in ((row, (1, 16)), (np.tile(row, (16, 1)), (16, 16))):
    got = quantize(jnp.asarray(x), block)
    np.testing.assert_array_equal(np.asarray(dequantize(got)), x)


def test_round_to_nearest_even_at_every_midpoint_and_between():
  _, grid = e2m1_grid()
  midpoints = (grid[1:] + grid[:-1]) / 2  # 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5
  between = np.random.default_rng(0).uniform(0, 6, 4096)
  v = np.concatenate([midpoints, -midpoints, between, -between]).astype(np.float32)
  got = np.asarray(nvfp4.round_to_e2m1(jnp.asarray(v)), np.float64)
  np.testing.assert_array_equal(got, reference_e2m1(v))
  np.testing.assert_array_equal(got[:7], [0, 1, 1, 2, 2, 4, 4])  # the even neighbour


@pytest.mark.parametrize("block", [(1, 16), (16, 1), (16, 16)], ids=["1x16", "16x1", "16x16"])
@pytest.mark.parametrize("shape", [(48, 64), (40, 70)], ids=["multiple", "partial"])
def test_quantizer_matches_the_float64_reference_bit_for_bit(shape, block):
  # Rows 10**-4..10**4 apart: blocks far below the tensor's amax get small E4M3 scales
  # (subnormal ones); the first 16 x 16 corner, 10**-9 smaller, flushes to 0.
  x = rows_of_different_magnitudes(shape)
  x[:16, :16] *= 1e-9
  got = quantize(jnp.asarray(x), block)
  assert_matches_reference(got, x, block)
  assert np.any(np.asarray(got.block_scale, np.float32) == 0)  # a flushed block is covered


def test_midpoints_of_scaled_blocks_round_to_even_in_the_quantizer():
  # Blocks of amax 6 * 2**k: s_t, d and the multiplier are exact powers of two times 448,
  # so every element lands exactly on an E2M1 midpoint.
  _, grid = e2m1_grid()
  midpoints = (grid[1:] + grid[:-1]) / 2
  row = np.concatenate([midpoints, -midpoints, [6.0, -6.0]]).astype(np.float32)
  x = (row[None, :] * 2.0 ** np.arange(-3, 3)[:, None]).astype(np.float32)
  got = quantize(jnp.asarray(x), (1, 16))
  assert_matches_reference(got, x, (1, 16))


def test_scales_of_zero_and_non_finite_blocks():
  x = np.ones((2, 32), np.float32)
  x[0, :16] = 0.0
  x[1, 16] = np.nan
  got = quantize(jnp.asarray(x), (1, 16))
  d = np.asarray(got.block_scale, np.float32)
  assert d[0, 0] == 0 and np.isnan(d[1, 1])  # a block of zeros; a block holding NaN
  deq = np.asarray(dequantize(got))
  assert np.all(deq[0, :16] == 0) and np.all(np.isnan(deq[1, 16:]))
  assert np.all(np.isfinite(deq[0, 16:])) and np.all(np.isfinite(deq[1, :16]))
  # A tensor of zeros keeps the fallback tensor scale 1 and dequantizes to zeros.
  zeros = quantize(jnp.zeros((4, 16)), (1, 16))
  assert float(zeros.tensor_scale) == 1.0 and not np.any(np.asarray(dequantize(zeros)))


# ----- Stochastic rounding ------------------------------------------------------------------


def test_stochastic_rounding_is_unbiased_and_picks_a_neighbour():
  # One 16 x 16 block of amax 6 (multiplier 1): the elements are rounded as they are.
  rng = np.random.default_rng(1)
  x = rng.uniform(-6, 6, (16, 16)).astype(np.float32)
  x[0, 0] = 6.0
  x[1, :8] = [0, 0.5, 1.5, 3, -4, -6, 2, -1]  # on the grid: never moved
  draws = 4000

  @jax.jit
  def dequantized(keys):
    def one(key):
      u = rounding_keys.uniform(key, x.shape)
      return dequantize(quantize(jnp.asarray(x), (16, 16), u))
    return jax.vmap(one)(keys)

  keys = jax.vmap(lambda i: rounding_keys.gemm_key(rounding_keys.initial_key(), "wgrad",
                                                   jnp.float32(i)))(jnp.arange(draws))
  samples = np.asarray(dequantized(keys), np.float64)
  # Each draw is one of the two grid neighbours of x.
  _, grid = e2m1_grid()
  a = np.abs(x.astype(np.float64))
  lower = grid[np.searchsorted(grid, a, side="right") - 1]
  upper = grid[np.minimum(np.searchsorted(grid, a, side="left"), 7)]
  magnitudes = np.abs(samples)
  assert np.all((magnitudes == lower) | (magnitudes == upper))
  assert np.all(np.sign(samples) * np.sign(x) >= 0)
  # Unbiased: the mean error over the draws is within 4 standard errors of 0 for every
  # element (a Bernoulli between the neighbours; a false alarm has probability ~6e-5
  # per element, and the draws are fixed).
  on_grid = lower == upper
  error = samples.mean(axis=0) - x
  standard_error = samples.std(axis=0) / np.sqrt(draws)
  assert np.all(error[on_grid] == 0)
  assert np.all(np.abs(error[~on_grid]) <= 4 * standard_error[~on_grid]), np.max(
      np.abs(error[~on_grid]) / standard_error[~on_grid])
  # Round to nearest is biased on the same elements: its mean error is far outside.
  nearest = np.asarray(dequantize(quantize(jnp.asarray(x), (16, 16))))
  assert np.sum(np.abs(nearest - x)[~on_grid] > 4 * standard_error[~on_grid]) > 100
  # Equal keys draw equal numbers; other keys others.
  again = np.asarray(dequantized(keys[:2]), np.float64)
  np.testing.assert_array_equal(again, samples[:2])
  assert np.any(samples[0] != samples[1])


# ----- The random Hadamard transform --------------------------------------------------------


def test_hadamard_transform_is_orthonormal_with_entries_of_a_quarter():
  h = nvfp4.hadamard_matrix().astype(np.float64)
  np.testing.assert_array_equal(np.abs(h), 0.25)
  np.testing.assert_array_equal(h @ h.T, np.eye(16))  # exact: sums of +-1/16
  # H S with S a diagonal of signs: H's columns, some negated (H = Sylvester's / 4).
  sylvester = np.array([[(-1) ** bin(i & j).count("1") for j in range(16)]
                        for i in range(16)]) / 4.0
  signs = h[0] / sylvester[0]
  np.testing.assert_array_equal(h, sylvester * signs)
  assert set(signs) == {-1.0, 1.0}


def test_hadamard_rows_leave_the_wgrad_product_unchanged_within_float32_rounding():
  rng = np.random.default_rng(2)
  m = 37  # not a multiple of 16: the padded rows add nothing
  a = (rng.standard_normal((m, 24)) * 10.0 ** rng.uniform(-3, 3, (m, 1))).astype(np.float32)
  b = rng.standard_normal((m, 20)).astype(np.float32)
  got = np.asarray(nvfp4.hadamard_rows(jnp.asarray(a)).T @ nvfp4.hadamard_rows(jnp.asarray(b)),
                   np.float64)
  want = a.T.astype(np.float64) @ b.astype(np.float64)
  # Each transformed element is a float32 sum of 16 terms +-t/4 (error <= 16 * 2**-24 of
  # the block's sum of |t| / 4, call it t~); the product sums m16 = 48 float32 terms.
  # To first order the error is below (2 * 16 + 48) * 2**-24 * (a~^T b~); doubled.
  def magnitude(t):
    padded = np.pad(np.abs(t.astype(np.float64)), ((0, 48 - m), (0, 0)))
    return np.repeat(padded.reshape(3, 16, -1).sum(axis=1) / 4, 16, axis=0)
  bound = 2 * (32 + 48) * 2.0**-24 * (magnitude(a).T @ magnitude(b))
  assert np.all(np.abs(got - want) <= bound), np.max(np.abs(got - want) / bound)
  assert np.max(np.abs(got - want)) > 0  # float32 arithmetic, not an exact copy


# ----- The three GEMMs of fp8_dense ---------------------------------------------------------


@jax.jit
def _dense_vjp(x, kernel, g, meta):
  y, vjp = jax.vjp(lambda x, k: fp8jax.fp8_dense(x, k, None, meta)[0], x, kernel)
  return (y, *vjp(g))


def _reference_dequantized(t, block):
  want = reference_nvfp4(t, block)
  return want["q"] * np.asarray(bq.expand_blocks(jnp.asarray(want["scale_inv"]), block,
                                                 t.shape), np.float64)


@pytest.mark.parametrize("weight_blocks", ["16x16", "1x16"])
def test_fp8_dense_gemms_are_the_products_of_the_reference_quantization(weight_blocks):
  rng = np.random.default_rng(3)
  m, k, n = 40, 70, 36  # partial blocks along every axis
  x = rows_of_different_magnitudes((m, k), seed=3)
  kernel = (rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float32)
  g = rows_of_different_magnitudes((m, n), seed=4)
  recipe = fp8jax.NVFP4Scaling(weight_blocks=weight_blocks, stochastic_rounding=False)
  got = [np.asarray(t, np.float64) for t in _dense_vjp(
      jnp.asarray(x), jnp.asarray(kernel), jnp.asarray(g), fp8jax.init_dot_meta(recipe))]
  w_fprop, w_dgrad = (((16, 16), (16, 16)) if weight_blocks == "16x16" else
                      ((16, 1), (1, 16)))
  # The weight-gradient GEMM's inputs are x and g after the transform along the tokens
  # (its float32 values, which the test above checks against float64).
  x_h, g_h = (np.asarray(nvfp4.hadamard_rows(jnp.asarray(t))) for t in (x, g))
  gemms = [(got[0], _reference_dequantized(x, (1, 16)), _reference_dequantized(kernel, w_fprop)),
           (got[1], _reference_dequantized(g, (1, 16)), _reference_dequantized(kernel, w_dgrad).T),
           (got[2], _reference_dequantized(x_h, (16, 1)).T, _reference_dequantized(g_h, (16, 1)))]
  for result, a, b in gemms:
    # Emulated: float32 dequantized operands (2**-24 each) and a float32 dot of C terms;
    # twice (C + 4) * 2**-24 of sum |a||b| covers both, as in test_fine_grained_recipes.
    slack = 2 * (a.shape[1] + 4) * 2.0**-24 * (np.abs(a) @ np.abs(b))
    assert np.all(np.abs(result - a @ b) <= slack), np.max(np.abs(result - a @ b) / slack)
  # Not vacuous: 4-bit operands, an error of some percent of the exact products.
  exact = (x.astype(np.float64) @ kernel, g.astype(np.float64) @ kernel.T,
           x.T.astype(np.float64) @ g)
  for result, want in zip(got, exact):
    assert 0.01 < np.linalg.norm(result - want) / np.linalg.norm(want) < 0.3


def test_stochastic_rounding_touches_the_gradients_only_and_follows_the_state_key():
  x, kernel, g = (jax.random.normal(jax.random.key(i), s)
                  for i, s in enumerate([(32, 48), (48, 32), (32, 32)]))
  state = fp8jax.init_dot_meta(fp8jax.NVFP4Scaling())
  nearest = _dense_vjp(x, kernel, g, fp8jax.init_dot_meta(
      fp8jax.NVFP4Scaling(stochastic_rounding=False)))
  first, again = _dense_vjp(x, kernel, g, state), _dense_vjp(x, kernel, g, state)
  stepped = _dense_vjp(x, kernel, g, fp8jax.end_step(state))
  np.testing.assert_array_equal(first[0], nearest[0])  # the forward rounds to nearest
  for i in (1, 2):  # dx, dk
    assert np.any(np.asarray(first[i]) != np.asarray(nearest[i]))
    np.testing.assert_array_equal(first[i], again[i])  # same key, same draws
    assert np.any(np.asarray(stepped[i]) != np.asarray(first[i]))  # the next step's key


def test_gradient_accumulation_advances_the_key_once_per_step():
  # The microbatches share the step's key (their gradients' amaxes make their draws
  # differ); the step closes once, so the key moves on once.
  params = {"k": jax.random.normal(jax.random.key(0), (32, 16))}

  def loss(params, fp8_state, x):
    y, fp8_state = fp8jax.fp8_dense(x, params["k"], None, fp8_state)
    return jnp.sum(y ** 2), fp8_state

  state = fp8jax.init_dot_meta(fp8jax.NVFP4Scaling())
  microbatches = jax.random.normal(jax.random.key(1), (2, 16, 32))
  _, grads, new_state = jax.jit(lambda p, s, m: fp8jax.accumulate_gradients(loss, p, s, m))(
      params, state, microbatches)
  np.testing.assert_array_equal(new_state.grad.rng, rounding_keys.next_step_key(state.grad.rng))
  assert np.all(np.isfinite(np.asarray(grads["k"]))) and np.any(np.asarray(grads["k"]) != 0)


# ----- Training, state, checkpoints, Fp8Model rules, telemetry -------------------------------


class _Mlp(nn.Module):
  """Two FP8 layers under NVFP4 (the last one kept in bf16 by a rule, as NVIDIA does)."""

  @nn.compact
  def __call__(self, x):
    h = nn.relu(nn.Dense(64, name="up")(x))
    return nn.Dense(1, name="out")(h)


def _regression():
  x = jax.random.normal(jax.random.key(0), (64, 32))
  return x, jnp.sin(x[:, :1] * 2) + x[:, 1:2] ** 2


def _model():
  return Fp8Model(_Mlp(), rules=(Fp8Rule(path="out", recipe=None),
                                 Fp8Rule(path="up", recipe=fp8jax.NVFP4Scaling())))


def _train(step, params, fp8_state, opt_state, steps):
  losses = []
  for _ in range(steps):
    params, opt_state, fp8_state, loss = step(params, opt_state, fp8_state)
    losses.append(float(loss))
  return params, opt_state, fp8_state, losses


def test_fp8_model_rules_train_under_nvfp4_and_a_checkpoint_resumes_bit_for_bit(tmp_path):
  model = _model()
  x, _ = _regression()
  variables = model.init(jax.random.key(1), x)
  state = variables[fp8nn.FP8_COLLECTION]
  assert set(state) == {"up"}  # the last layer stays bf16
  assert state["up"]["dot_meta"].grad.rng.dtype == jnp.uint32
  tx = optax.adam(1e-2)
  params, opt_state = variables["params"], tx.init(variables["params"])
  step = linen_train_step(model, tx, *_regression())
  whole = _train(step, params, state, opt_state, 40)
  # Adam at 1e-2 halves this regression's loss well within 40 steps in float32; a
  # broken gradient (wrong layout, a biased rounding) does not.
  assert np.all(np.isfinite(whole[3])) and whole[3][-1] < 0.5 * whole[3][0], whole[3]
  # Interrupted after 20 steps, saved, restored and continued: the same 40 steps.
  half = _train(step, params, state, opt_state, 20)
  path = ckpt.save(tmp_path / "c", params=half[0], opt_state=half[1], fp8_state=half[2])
  restored = ckpt.restore(path, params=half[0], opt_state=half[1], fp8_state=state)
  np.testing.assert_array_equal(restored["fp8_state"]["up"]["dot_meta"].grad.rng,
                                half[2]["up"]["dot_meta"].grad.rng)
  resumed = _train(step, restored["params"], restored["fp8_state"], restored["opt_state"], 20)
  assert resumed[3] == whole[3][20:]
  for a, b in zip(jax.tree.leaves(resumed[:3]), jax.tree.leaves(whole[:3]), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # The key advanced every step (a fresh key per step, none repeated).
  assert not np.array_equal(half[2]["up"]["dot_meta"].grad.rng, whole[2]["up"]["dot_meta"].grad.rng)


def test_telemetry_counts_saturation_and_underflow_against_e2m1():
  # Rows of different magnitudes: the small rows' blocks flush or land in E2M1's one
  # subnormal (0.5); counted with E2M1's thresholds (max 6, smallest normal 1).
  x = rows_of_different_magnitudes((32, 48), seed=5)
  meta = fp8jax.init_dot_meta(fp8jax.NVFP4Scaling())
  stats = telemetry.tensor_stats(jnp.asarray(x), meta.x)
  want = reference_nvfp4(x, (1, 16))
  q = want["q"]
  s_t = np.float64(want["s_t"])
  d = want["d"]
  multiplier = np.where(d > 0, (s_t / np.where(d > 0, d, 1)).astype(np.float32), 0.0)
  scaled = np.abs(x * np.asarray(bq.expand_blocks(jnp.asarray(multiplier, jnp.float32),
                                                  (1, 16), x.shape)))
  n = x.size
  assert float(stats.saturated) == np.float32(np.sum(scaled > 6.0) / n)
  assert float(stats.flushed) == np.float32(np.sum((x != 0) & (q == 0)) / n)
  assert float(stats.subnormal) == np.float32(np.sum((q != 0) & (np.abs(q) < 1.0)) / n)
  assert float(stats.flushed) > 0 and float(stats.subnormal) > 0


# ----- Refusals and the native path --------------------------------------------------------


@pytest.mark.parametrize("options, message", [
    ({"weight_blocks": "32x32"}, "weight_blocks='32x32'.*one E4M3 scale per 16 values.*'16x16'"),
    ({"gemm": "cudnn"}, "gemm='cudnn'.*'emulated'.*'native'"),
    ({"hadamard": 1}, "hadamard=1 must be True or False"),
    ({"high_precision": "wgrad"}, "high_precision='wgrad'.*tuple"),
])
def test_bad_settings_are_refused_naming_the_setting_and_the_fix(options, message):
  with pytest.raises(ValueError, match=message):
    fp8jax.NVFP4Scaling(**options)


def test_grouped_matmul_is_refused_naming_the_fix():
  meta = fp8jax.init_ragged_dot_meta(fp8jax.NVFP4Scaling(), 2)
  x, w = jnp.ones((32, 16)), jnp.ones((2, 16, 16))
  with pytest.raises(ValueError, match="NVFP4Scaling cannot quantize fp8_ragged_dot.*another "
                                       "recipe"):
    fp8jax.fp8_ragged_dot(x, w, jnp.array([16, 16], jnp.int32), meta)


def test_state_without_its_rounding_key_is_refused():
  meta = fp8jax.init_dot_meta(fp8jax.NVFP4Scaling())
  broken = dataclasses.replace(meta, grad=dataclasses.replace(meta.grad, rng=None))
  with pytest.raises(ValueError, match="grad.rng is None.*init_dot_meta"):
    fp8jax.fp8_dense(jnp.ones((16, 16)), jnp.ones((16, 16)), None, broken)
  with pytest.raises(ValueError, match="cannot convert.*rounding keys"):
    fp8jax.resize_history(fp8jax.init_dot_meta(fp8jax.CurrentScaling(fp8_format="e4m3")),
                          fp8jax.NVFP4Scaling())


def _scaled_matmul_as_documented(lhs, rhs, lhs_scales, rhs_scales, preferred_element_type):
  """`jax.nn.scaled_matmul` as its docstring defines it (its cuDNN form needs a Blackwell GPU)."""
  def scaled(t, scales):
    size = t.shape[-1] // scales.shape[-1]
    return t.astype(jnp.float32) * jnp.repeat(scales.astype(jnp.float32), size, axis=-1)
  return jnp.einsum("bmk,bnk->bmn", scaled(lhs, lhs_scales), scaled(rhs, rhs_scales),
                    precision=jax.lax.Precision.HIGHEST).astype(preferred_element_type)


@pytest.mark.parametrize("recipe", [fp8jax.NVFP4Scaling(gemm="native"),
                                    fp8jax.MXFP8Scaling(gemm="native")], ids=["nvfp4", "mxfp8"])
def test_native_gemm_hands_scaled_matmul_the_emulations_operands(recipe, monkeypatch):
  # Compiled for a Blackwell GPU, the GEMM is jax.nn.scaled_matmul on the E2M1 / E4M3
  # values and their E4M3 / E8M0 block scales (a 16 x 16 block's scale repeated over its
  # columns), the tensor scales applied after. With the documented semantics in its
  # place, it must give the emulation's product: the same operands, another float32
  # order (within 2 * (C + 4) * 2**-24 of sum |a||b|, as for the emulation).
  monkeypatch.setattr(jax.nn, "scaled_matmul", _scaled_matmul_as_documented)
  rng = np.random.default_rng(6)
  quantize_operand = jax.jit(recipe.quantize_operand, static_argnums=(1, 2, 3))
  gemm = jax.jit(recipe.target_gemm, static_argnums=(2, 3))
  a = quantize_operand(jnp.asarray(rng.standard_normal((2, 32, 64)), jnp.float32),
                       recipe.forward_format, -1, False)
  b = quantize_operand(jnp.asarray(rng.standard_normal((2, 64, 48)), jnp.float32),
                       recipe.forward_format, -2, True)
  emulated = np.asarray(gemm(a, b, jnp.float32, "sm_90"), np.float64)
  native = np.asarray(gemm(a, b, jnp.float32, "sm_100"), np.float64)
  magnitude = np.abs(np.asarray(dequantize(a), np.float64)) @ np.abs(
      np.asarray(dequantize(b), np.float64))
  assert np.all(np.abs(native - emulated) <= 2 * (64 + 4) * 2.0**-24 * magnitude)
  assert np.max(np.abs(emulated)) > 1.0


def test_native_gemm_refuses_a_contraction_of_partial_blocks():
  recipe = fp8jax.NVFP4Scaling(gemm="native")
  a, b = (jax.eval_shape(lambda t: recipe.quantize_operand(t, fp8jax.E4M3, axis, weight),
                         jax.ShapeDtypeStruct(shape, jnp.float32))
          for shape, axis, weight in (((8, 40), -1, False), ((40, 8), -2, True)))
  with pytest.raises(ValueError, match="NVFP4Scaling\\(gemm='native'\\).*40 elements.*"
                                       "multiple of 16.*gemm='emulated'"):
    recipe.target_gemm(a, b, jnp.float32, "sm_100")


@multidevice
def test_a_shard_map_step_keeps_one_rounding_key_on_every_device():
  # The key travels through the step's all-reduce (a pmax of its own; its float0
  # cotangent takes none) and comes back replicated, advanced once, as under plain jit.
  mesh = jax.make_mesh((N_DEVICES,), ("data",))
  x = jax.device_put(jax.random.normal(jax.random.key(1), (8 * N_DEVICES, 32)),
                     NamedSharding(mesh, P("data")))
  params = {"k": jax.random.normal(jax.random.key(0), (32, 16))}

  def loss(params, fp8_state, x):
    y, fp8_state = fp8jax.fp8_dense(x, params["k"], None, fp8_state)
    return jnp.sum(y ** 2), fp8_state

  def step(params, fp8_state, x):
    value, grads, fp8_state = fp8jax.value_and_grad(loss)(params, fp8_state, x)
    return jax.lax.psum(value, "data"), grads, fp8_state

  sharded = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P(), P("data")),
                                  out_specs=(P(), P(), P())))
  state = fp8jax.init_dot_meta(fp8jax.NVFP4Scaling())
  with warnings.catch_warnings():  # per-device block scales: warned once, expected here
    warnings.simplefilter("ignore")
    _, _, new_state = sharded(params, state, x)
  np.testing.assert_array_equal(new_state.grad.rng,
                                rounding_keys.next_step_key(state.grad.rng))
  assert float(new_state.grad.amax_history[0]) > 0
