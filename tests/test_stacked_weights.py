"""Every layer's FP8 weights cast before the loop over layers (`fp8jax.ops.stacked_weights`).

The stacked cast kernel (`pallas_kernels.cast_transpose_stacked`) against its jnp
definition and the FP8 format tables; the ops taking supplied copies against the same ops
casting their own kernels (bit for bit: the copies are made with the same scales); the
demo GPT with `cast_weights_first` against without. What it saves a step, compiled for an
H100: tests/test_fp8_budgets.py.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp8jax
import pallas_kernels
from fp8jax.models import gpt
from fp8jax.ops import fused_kernels, stacked_weights

DELAYED = fp8jax.DelayedScaling()
E4M3_MAX, E5M2_MAX = 448.0, 57344.0
_SMALL_TILES = pallas_kernels.CastTransposeBlockSizes(block_rows=32, block_cols=32)


def _bits(a):
  return np.asarray(a).view(np.uint8)


@pytest.mark.parametrize("dtype,fp8_max", [(jnp.float8_e4m3fn, E4M3_MAX),
                                           (jnp.float8_e5m2, E5M2_MAX)], ids=["e4m3", "e5m2"])
def test_stacked_cast_kernel_matches_its_definition_bit_for_bit(dtype, fp8_max):
  # 4 layers of [100, 72]: neither axis a multiple of the 32 x 32 tile (masked edges);
  # each layer its own scale, so a layer cast with another's would differ.
  x = jax.random.normal(jax.random.key(0), (4, 100, 72), jnp.float32) * 40.0
  x = x.at[0, 3, 5].set(jnp.inf).at[1, 99, 71].set(-1e9).at[2, 7, 9].set(jnp.nan)
  scale = jnp.array([2.0, 0.5, 9.0, 1.5], jnp.float32)
  # Running amaxes: below the layer's max, NaN (kept), above it (kept).
  running = jnp.array([3.0, jnp.nan, 1.0, 1e6], jnp.float32)
  qs, q_ts, amax_out, seeds = pallas_kernels.cast_transpose_stacked(
      x, scale, running, fp8_dtype=dtype, fp8_max=fp8_max, block_sizes=_SMALL_TILES,
      interpret=True)
  want_q, want_q_t, want_amax, _ = pallas_kernels.cast_transpose_stacked_reference(
      x, scale, running, fp8_dtype=dtype, fp8_max=fp8_max)
  for layer in range(4):
    np.testing.assert_array_equal(_bits(qs[layer]), _bits(want_q[layer]))
    np.testing.assert_array_equal(_bits(q_ts[layer]), _bits(want_q_t[layer]))
    np.testing.assert_array_equal(_bits(q_ts[layer]), _bits(qs[layer]).T)
    np.testing.assert_array_equal(np.asarray(seeds[layer]), [0.0])
  amaxes = np.asarray(amax_out)
  np.testing.assert_array_equal(amaxes, np.asarray(want_amax))
  # Independent of both: max(running, max|x|) per layer (inf; the running NaN; NaN in x;
  # the running 1e6 above the layer's max), the values the format's round to nearest even
  # of the clipped product (ml_dtypes' cast).
  assert amaxes[0] == np.inf and np.isnan(amaxes[1]) and np.isnan(amaxes[2])
  assert amaxes[3] == np.float32(1e6)
  x64 = np.asarray(x, np.float64)
  for layer in range(4):
    clipped = np.clip(x64[layer] * float(scale[layer]), -fp8_max, fp8_max)
    np.testing.assert_array_equal(_bits(qs[layer]),
                                  _bits(clipped.astype(np.float32).astype(dtype)))
  assert float(qs[0][3, 5].astype(jnp.float32)) == fp8_max       # +inf saturates
  assert float(qs[1][99, 71].astype(jnp.float32)) == -fp8_max    # so does a huge value
  assert np.isnan(float(qs[2][7, 9].astype(jnp.float32)))         # NaN stays NaN
  # Without a NaN anywhere, the amax is max(running, max|x|) exactly.
  finite = jnp.abs(x[3])
  assert float(jnp.max(finite)) < 1e6 and amaxes[3] == max(1e6, float(jnp.max(finite)))


@pytest.mark.gpu
def test_stacked_cast_kernel_on_hopper_matches_its_definition_bit_for_bit(hopper_device):
  # Compiled by Triton for the GPU (the same checks as the interpreter's above): 24 layers
  # of [1000, 3000] (ragged edges on both axes), a running amax per layer on either side.
  keys = jax.random.split(jax.random.key(5), 3)
  x = jax.random.normal(keys[0], (24, 1000, 3000), jnp.float32) * 3.0
  x = x.at[5, 999, 2999].set(jnp.nan).at[7, 0, 0].set(-jnp.inf)
  scale = jax.random.uniform(keys[1], (24,), jnp.float32, 8.0, 64.0)
  running = jax.random.uniform(keys[2], (24,), jnp.float32, 0.0, 30.0)
  x, scale, running = jax.device_put((x, scale, running), hopper_device)
  for dtype, fp8_max in ((jnp.float8_e4m3fn, E4M3_MAX), (jnp.float8_e5m2, E5M2_MAX)):
    got = jax.jit(lambda x, s, r: pallas_kernels.cast_transpose_stacked(
        x, s, r, fp8_dtype=dtype, fp8_max=fp8_max))(x, scale, running)
    want = jax.jit(lambda x, s, r: pallas_kernels.cast_transpose_stacked_reference(
        x, s, r, fp8_dtype=dtype, fp8_max=fp8_max))(x, scale, running)
    for layer in range(24):
      np.testing.assert_array_equal(_bits(got[0][layer]), _bits(want[0][layer]))
      np.testing.assert_array_equal(_bits(got[1][layer]), _bits(want[1][layer]))
    np.testing.assert_array_equal(np.asarray(got[2]), np.asarray(want[2]))
    assert np.isnan(np.asarray(got[2])[5]) and np.asarray(got[2])[7] == np.inf


def test_stacked_cast_refuses_what_it_cannot_cast():
  x = jnp.ones((2, 16, 16), jnp.float32)
  cast = lambda x, scale, running=jnp.zeros((2,)): pallas_kernels.cast_transpose_stacked(
      x, scale, running, fp8_dtype=jnp.float8_e4m3fn, fp8_max=E4M3_MAX, interpret=True)
  with pytest.raises(ValueError, match=r"x must be a stack \[layers, rows, cols\]"):
    cast(x[0], jnp.ones((2,)))
  with pytest.raises(ValueError, match="one float32 scale per layer"):
    cast(x, jnp.ones((3,)))
  with pytest.raises(ValueError, match="one float32 running amax per layer"):
    cast(x, jnp.ones((2,)), jnp.zeros((3,)))
  with pytest.raises(TypeError, match="x has dtype int32"):
    cast(x.astype(jnp.int32), jnp.ones((2,)))
  meta = jax.tree.map(lambda *a: jnp.stack(a), *[fp8jax.init_dot_meta(DELAYED)] * 2)
  with pytest.raises(ValueError, match="n_contract=2 must leave"):
    stacked_weights.cast_layers(jnp.ones((2, 8, 8)), 2, meta.kernel)
  with pytest.raises(ValueError, match="state of 3 stacked layers"):
    stacked_weights.cast_layers(jnp.ones((3, 8, 8)), 1, meta.kernel)


# ----- The ops: supplied copies give what their own casts give ---------------------------

LAYERS, D, F, TOKENS = 3, 64, 128, 96
CURRENT = fp8jax.CurrentScaling()
# Delayed scaling casts with the state's scales; current scaling makes each layer's scale
# from its weight's amax (the stack reduced once before the loop).
RECIPES = pytest.mark.parametrize("recipe", [DELAYED, CURRENT], ids=["delayed", "current"])


def _layers_step(supplied: bool):
  """A step of LAYERS blocks over stacked params and state, each block
  `fp8_rms_norm_dense` (qkv-like, [D] -> [D]) then `fp8_mlp` with the residual; with
  `supplied`, every weight cast before the loop and paired in each layer (the recipe is
  the state's)."""

  def loss(params, state, x):
    weights = None
    if supplied:
      weights = {name: stacked_weights.cast_layers(params[name], 1, state[name].kernel)
                 for name in ("proj", "up", "down")}
    records = []
    with fused_kernels.stacked_state():
      for layer in range(LAYERS):
        take = lambda tree: jax.tree.map(lambda a: a[layer], tree)
        w = {name: params[name][layer] for name in ("proj", "up", "down")}
        meta = {name: take(state[name]) for name in ("proj", "up", "down")}
        pairs = [] if weights is None else [(w[name], take(weights[name])) for name in w]
        with stacked_weights.supplying(pairs):
          h, meta["proj"] = fp8jax.fp8_rms_norm_dense(x, params["gain"][layer], w["proj"],
                                                      meta["proj"])
          x, meta["up"], meta["down"] = fp8jax.fp8_mlp(
              x, w["up"], w["down"], meta["up"], meta["down"], norm_scale=params["gain"][layer],
              residual=h)
        records.append(meta)
    new_state = jax.tree.map(lambda *a: jnp.stack(a), *records)
    return jnp.mean(x.astype(jnp.float32) ** 2), new_state

  return jax.jit(fp8jax.value_and_grad(loss))


def _layers_inputs(recipe=DELAYED):
  keys = jax.random.split(jax.random.key(1), 6)
  params = {"proj": jax.random.normal(keys[0], (LAYERS, D, D)) * 0.1,
            "up": jax.random.normal(keys[1], (LAYERS, D, F)) * 0.1,
            "down": jax.random.normal(keys[2], (LAYERS, F, D)) * 0.1,
            "gain": 1.0 + 0.1 * jax.random.normal(keys[3], (LAYERS, D))}
  state = {name: jax.tree.map(lambda *a: jnp.stack(a), *[fp8jax.init_dot_meta(recipe)] * LAYERS)
           for name in ("proj", "up", "down")}
  # Each layer's scales their own (random, positive), so that a copy cast with another
  # layer's scale, or read by another layer, would show (under current scaling each
  # layer's weights are of another magnitude, below, and the scales are the fallbacks).
  scale_keys = iter(jax.random.split(keys[4], 64))

  def randomize(meta):
    kernel = dataclasses.replace(
        meta.kernel, scale=jax.random.uniform(next(scale_keys), (LAYERS,), jnp.float32, 8, 64))
    # A running amax on either side of the weights' max|W| (about 0.4), as a step that
    # already saw a larger or a smaller tensor would have.
    kernel = dataclasses.replace(kernel, scale_inv=1.0 / kernel.scale,
                                 amax=jnp.array([0.1, 5.0, 0.0], jnp.float32))
    return dataclasses.replace(meta, kernel=kernel)

  state = {name: randomize(meta) for name, meta in state.items()}
  magnitudes = jnp.array([0.5, 1.0, 3.0])[:, None, None]
  params.update({name: params[name] * magnitudes for name in ("proj", "up", "down")})
  # A layer whose weight is all zeros: current scaling keeps that layer's fallback scale.
  params["down"] = params["down"].at[1].set(0.0)
  x = jax.random.normal(keys[5], (TOKENS, D), jnp.float32).astype(jnp.bfloat16)
  return params, state, x


def _assert_same(got, want):
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def _supplied_and_own(monkeypatch, recipe):
  calls = _spy_on_pairing(monkeypatch)
  inputs = _layers_inputs(recipe)
  supplied = _layers_step(True)(*inputs)
  # Every op of every layer took its copies: proj [D, D], up [D, F], down [F, D].
  assert calls and all(found for *_, found in calls), calls
  assert {(k, n) for k, n, _ in calls} == {(D, D), (D, F), (F, D)}, calls
  calls.clear()
  own = _layers_step(False)(*inputs)
  assert not any(found for *_, found in calls), calls
  return supplied, own


@RECIPES
def test_ops_given_weights_cast_before_the_loop_compute_the_same_step(monkeypatch, recipe):
  _assert_same(*_supplied_and_own(monkeypatch, recipe))


@RECIPES
def test_the_stacked_kernel_in_the_interpreter_gives_the_same_step(interpreted_kernels,
                                                                   monkeypatch, recipe):
  _assert_same(*_supplied_and_own(monkeypatch, recipe))


def test_only_the_paired_kernel_of_matching_shape_takes_the_copies(monkeypatch):
  params, state, x = _layers_inputs()
  meta = jax.tree.map(lambda a: a[0], state["proj"])
  copies = jax.tree.map(lambda a: a[0],
                        stacked_weights.cast_layers(params["proj"], 1, state["proj"].kernel))
  w = params["proj"][0]
  calls = _spy_on_pairing(monkeypatch)
  with stacked_weights.supplying([(w, copies)]):
    fp8jax.fp8_dense(x, w, None, meta)              # the paired array: copies taken
    fp8jax.fp8_dense(x, w + 0.0, None, meta)        # equal values, another array: own cast
    other = stacked_weights.LayerWeights(copies.q[:8], copies.q_t[:, :8], copies.amax,
                                         copies.seed)
  with stacked_weights.supplying([(w, other)]):     # copies of another shape: own cast
    fp8jax.fp8_dense(x, w, None, meta)
  with stacked_weights.supplying([(w, other)]):     # the innermost pairing wins
    with stacked_weights.supplying([(w, copies)]):
      fp8jax.fp8_dense(x, w, None, meta)
  assert [found for *_, found in calls] == [True, False, False, True]


def _spy_on_pairing(monkeypatch) -> list:
  """Records (k, n, took copies) of every FP8 op's lookup of supplied weights."""
  calls = []
  real = stacked_weights.supplied

  def spy(kernel, layout):
    found = real(kernel, layout)
    if layout is not None:
      calls.append((layout.k, layout.n, found is not None))
    return found

  monkeypatch.setattr(stacked_weights, "supplied", spy)
  return calls


# The tiny GPT's matrices (d 128, 2 heads of 64, d_ff 512, the byte vocabulary):
# qkv, out, up, down of a block, and the tied head, which is not in the loop.
_BLOCK_MATRICES = {(128, 384), (128, 128), (128, 512), (512, 128)}
_HEAD = (128, 256)


def _gpt_steps(config, recipe, variables, tokens, accumulate: bool):
  model = gpt.Gpt(config, recipe)

  def loss_fn(params, fp8_state, tokens):
    logits, updates = model.apply({"params": params, "fp8_meta": fp8_state}, tokens,
                                  mutable=["fp8_meta"])
    return jnp.mean(logits ** 2), updates["fp8_meta"]

  if accumulate:  # two microbatches of one sequence each
    step = jax.jit(lambda p, s, t: fp8jax.accumulate_gradients(loss_fn, p, s,
                                                               t.reshape(2, 1, -1)))
  else:
    step = jax.jit(fp8jax.value_and_grad(loss_fn))
  params, state = variables["params"], variables["fp8_meta"]
  # Three steps: the later ones cast with scales the first steps' amaxes made.
  for _ in range(3):
    loss, grads, state = step(params, state, tokens)
    params = jax.tree.map(lambda p, g: p - 0.5 * g, params, grads)
  return loss, grads, state


@pytest.mark.parametrize("remat,accumulate,recipe", [
    (False, False, DELAYED), (True, False, DELAYED), (False, True, DELAYED),
    (False, False, CURRENT)], ids=["stored", "remat", "accumulated", "current"])
def test_gpt_casting_its_weights_first_trains_bit_for_bit_as_before(remat, accumulate, recipe,
                                                                    monkeypatch):
  config = gpt.config_for("tiny", seq_len=32, n_layers=2, remat=remat)
  tokens = jax.random.randint(jax.random.key(3), (2, 32), 0, 256, jnp.int32)
  variables = jax.jit(gpt.Gpt(config, recipe).init)(jax.random.key(0), tokens)
  calls = _spy_on_pairing(monkeypatch)
  results = {}
  for first in (False, True):
    calls.clear()
    results[first] = _gpt_steps(dataclasses.replace(config, cast_weights_first=first),
                                recipe, variables, tokens, accumulate)
    took = {(k, n) for k, n, found in calls if found}
    # Cast first, each of a block's four projections took its copies and nothing else
    # did; otherwise none did.
    assert took == (_BLOCK_MATRICES if first else set()), calls
    assert {(k, n) for k, n, found in calls if not found} == (
        {_HEAD} if first else _BLOCK_MATRICES | {_HEAD}), calls
  _assert_same(results[True], results[False])
