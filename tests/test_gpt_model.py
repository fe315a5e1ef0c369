"""fp8jax.models.gpt: the byte-level GPT in bf16 and FP8 (shapes, state, numerics, training)."""
import dataclasses
import functools
import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fp8jax
from fp8jax.ops import attention as fused_attention
from fp8jax.models import gpt

# A small shape for the structural tests (rolled scan, head_dim 32); the training
# smoke uses the real "tiny" config.
SMALL = gpt.GptConfig(d_model=64, n_layers=2, n_heads=2, seq_len=32)
RECIPE = fp8jax.DelayedScaling()


def _tokens(seed, batch=2, seq=32):
  return jax.random.randint(jax.random.key(seed), (batch, seq), 0, 256, jnp.int32)


def _init(model, tokens):
  return jax.jit(model.init)(jax.random.key(0), tokens)  # jitted: faster than eager here


# Compiled once for the whole module (every test uses [2, 32] tokens): the
# compiles, not the runs, are what takes time on a CPU.
_bf16_logits = jax.jit(gpt.Gpt(SMALL).apply)
_fp8_logits = jax.jit(gpt.Gpt(SMALL, RECIPE).apply)                    # evaluation
_fp8_record = jax.jit(functools.partial(gpt.Gpt(SMALL, RECIPE).apply,  # training forward
                                        mutable=["fp8_meta"]))


@pytest.fixture(scope="module")
def small_variables():
  """(bf16 variables, FP8 variables): the FP8 model's init, and its params alone.

  The bf16 twin has the same parameter tree (checked against its own init in
  test_bf16_and_fp8_models_have_one_parameter_tree_of_float32), so these are its
  variables.
  """
  fp8_variables = _init(gpt.Gpt(SMALL, RECIPE), _tokens(0))
  return {"params": fp8_variables["params"]}, fp8_variables


def _fp8_train_step(config):
  model = gpt.Gpt(config, RECIPE)

  def loss_fn(params, fp8_state, tokens):
    logits, updates = model.apply({"params": params, "fp8_meta": fp8_state}, tokens,
                                  mutable=["fp8_meta"])
    return jnp.mean(logits ** 2), updates["fp8_meta"]

  return jax.jit(fp8jax.value_and_grad(loss_fn))


@pytest.fixture(scope="module")
def small_step_result(small_variables):
  """(loss, grads, next FP8 state) of one FP8 value_and_grad step of SMALL."""
  variables = small_variables[1]
  return _fp8_train_step(SMALL)(variables["params"], variables["fp8_meta"], _tokens(3))


def test_logits_are_float32_batch_by_seq_by_256(small_variables):
  bf16_variables, fp8_variables = small_variables
  tokens = _tokens(1)
  for out in (_bf16_logits(bf16_variables, tokens), _fp8_logits(fp8_variables, tokens)):
    assert out.shape == (2, 32, 256) and out.dtype == jnp.float32
    assert np.all(np.isfinite(np.asarray(out)))


def test_bf16_and_fp8_models_have_one_parameter_tree_of_float32(small_variables):
  tokens = jax.ShapeDtypeStruct((2, 32), jnp.int32)
  bf16 = jax.eval_shape(gpt.Gpt(SMALL).init, jax.random.key(0), tokens)
  assert set(bf16) == {"params"}  # the bf16 twin has no FP8 state
  fp8_params = small_variables[1]["params"]
  # Same tree, shapes and dtypes: a bf16 checkpoint's params load into the FP8 model.
  assert jax.tree.structure(bf16["params"]) == jax.tree.structure(fp8_params)
  as_specs = lambda tree: jax.tree.map(lambda a: (a.shape, a.dtype), tree)
  assert as_specs(bf16["params"]) == as_specs(fp8_params)
  assert {leaf.dtype for leaf in jax.tree.leaves(fp8_params)} == {jnp.dtype("float32")}


def test_parameter_count_matches_the_params_tree_for_every_size():
  tokens = jax.ShapeDtypeStruct((1, 8), jnp.int32)
  for name, config in gpt.SIZES.items():
    # eval_shape: the parameter shapes of even the 1b model, without allocating them.
    shapes = jax.eval_shape(gpt.Gpt(config).init, jax.random.key(0), tokens)
    counted = sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(shapes["params"]))
    assert gpt.parameter_count(config) == counted, name
    assert config.vocab_size == 256 and config.d_ff == 4 * config.d_model
    assert config.head_dim in (64, 128, 256), name  # the fused attention kernels' head dims
  assert gpt.parameter_count(gpt.SIZES["tiny"]) == 820_352  # as documented in gpt.py


def test_unknown_size_and_bad_config_are_explained():
  with pytest.raises(ValueError, match="size='2b'.*'125m'.*'tiny'"):
    gpt.config_for("2b", seq_len=128)
  with pytest.raises(ValueError, match="unknown GptConfig field.*'seq_length'"):
    gpt.config_for("tiny", seq_length=128)
  with pytest.raises(ValueError, match="d_model=100 must split into n_heads=3"):
    gpt.GptConfig(d_model=100, n_layers=1, n_heads=3, seq_len=8)
  with pytest.raises(ValueError, match="attention_backend='flash'"):
    gpt.config_for("tiny", attention_backend="flash")
  model = gpt.Gpt(SMALL)
  with pytest.raises(TypeError, match="tokens has dtype float32"):
    model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.float32))
  with pytest.raises(ValueError, match="40 positions but config.seq_len=32"):
    model.init(jax.random.key(0), jnp.zeros((1, 40), jnp.int32))
  assert gpt.config_for("tiny", seq_len=64).seq_len == 64


def test_fp8_state_is_stacked_per_layer_and_every_role_records_an_amax(
    small_variables, small_step_result):
  _, variables = small_variables
  state = variables["fp8_meta"]
  blocks, head = state["blocks"], state["head"]["dot_meta"]
  dots = {"qkv": blocks["attention"]["qkv"], "out": blocks["attention"]["out"],
          "up": blocks["mlp"]["up"], "down": blocks["mlp"]["down"]}
  assert all(isinstance(d["dot_meta"], fp8jax.DotMeta) for d in dots.values())
  assert isinstance(blocks["attention"]["attention_meta"], fp8jax.AttentionMeta)
  for leaf in jax.tree.leaves(blocks):
    assert leaf.shape[0] == SMALL.n_layers
  assert isinstance(head, fp8jax.DotMeta) and head.x.scale.shape == ()
  # Flax's init records nothing: every running amax starts at 0.
  assert all(float(jnp.max(m.amax)) == 0 for m in _roles(state))

  _, updates = _fp8_record(variables, _tokens(2))
  new = updates["fp8_meta"]
  assert jax.tree.structure(new) == jax.tree.structure(state)
  forward = [(path, m) for path, m in _roles_with_paths(new) if not path.endswith("grad")]
  assert len(forward) == 4 * 2 + 4 + 2  # four DotMetas (x, kernel), q/k/v/o, the head
  for path, meta in forward:  # every layer of every forward role
    assert np.all(np.asarray(meta.amax) > 0), path
  # The output gradient is seen in the backward pass: one value_and_grad step
  # closes with every role's amax, gradients included, in its history.
  _, _, closed = small_step_result
  for path, meta in _roles_with_paths(closed):
    assert np.all(np.asarray(meta.amax_history)[..., 0] > 0), path


def _roles_with_paths(state):
  flat = jax.tree_util.tree_leaves_with_path(
      state, is_leaf=lambda n: isinstance(n, fp8jax.Fp8Meta))
  return [(jax.tree_util.keystr(path), meta) for path, meta in flat]


def _roles(state):
  return [meta for _, meta in _roles_with_paths(state)]


def test_fp8_logits_match_bf16_logits_of_the_same_bf16_checkpoint(small_variables):
  bf16_variables, fp8_variables = small_variables
  params = bf16_variables["params"]
  tokens = _tokens(4)
  # Delayed scaling needs an observed amax: one calibration forward, then close the step.
  _, updates = _fp8_record({"params": params, "fp8_meta": fp8_variables["fp8_meta"]}, tokens)
  state = fp8jax.end_step(updates["fp8_meta"])
  fp8_logits = _fp8_logits({"params": params, "fp8_meta": state}, tokens)
  bf16_logits = _bf16_logits({"params": params}, tokens)
  err = float(jnp.linalg.norm(fp8_logits - bf16_logits) / jnp.linalg.norm(bf16_logits))
  # E4M3 keeps 3 mantissa bits: rounding to nearest errs by at most 2**-4 relative,
  # about 2**-4 / sqrt(3) ~ 3.6% rms. A GEMM of two such operands has independent
  # errors of random sign, ~sqrt(2) * 3.6% ~ 5% of its output in norm; the logits
  # inherit the blocks' errors too, damped by the residual stream (the embedding
  # dominates it at initialization). 10% is that GEMM bound with a factor 2 for
  # the layers; measured: 5.2-5.4%. bf16 alone differs by ~2**-8, so the lower bound
  # shows the FP8 model really quantized.
  assert 2**-8 < err < 0.10, err


@pytest.mark.parametrize("recipe", [None, RECIPE], ids=["bf16", "fp8_delayed"])
def test_logits_before_position_t_do_not_depend_on_token_t(small_variables, recipe):
  bf16_variables, fp8_variables = small_variables
  variables, logits = ((bf16_variables, _bf16_logits) if recipe is None
                       else (fp8_variables, _fp8_logits))
  tokens = _tokens(5)
  t = 11
  changed = tokens.at[:, t].set((tokens[:, t] + 1) % 256)
  before, after = logits(variables, tokens), logits(variables, changed)
  # Exact: every row's GEMMs are independent and the masked keys' softmax weights
  # are exactly 0. (Delayed scaling uses stored scales; current scaling would take
  # a per-tensor amax over all positions, so its scales would see the change.)
  np.testing.assert_array_equal(np.asarray(before[:, :t]), np.asarray(after[:, :t]))
  assert float(jnp.max(jnp.abs(before[:, t:] - after[:, t:]))) > 1e-3  # t onward does see it


def test_rope_matches_complex_rotation_and_depends_only_on_relative_position():
  x = jax.random.normal(jax.random.key(6), (1, 5, 2, 8), jnp.float32)
  positions = jnp.asarray([0, 1, 2, 7, 100])
  rope = jax.jit(gpt.rope, static_argnums=2)
  got = np.asarray(rope(x, positions, 10000.0), np.float64)
  # float64 reference: pair i is the complex number x_i + j x_{i+4}, times
  # exp(j p theta_i) with theta_i = 10000**(-2i/8).
  xs = np.asarray(x, np.float64)
  z = xs[..., :4] + 1j * xs[..., 4:]
  theta = 10000.0 ** (-2 * np.arange(4) / 8)
  rotated = z * np.exp(1j * np.asarray(positions)[None, :, None, None] * theta)
  want = np.concatenate([rotated.real, rotated.imag], axis=-1)
  np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)  # float32 sin/cos at p=100
  # q(m) . k(n) depends on m - n only: shift both positions by 9.
  q, k = x[:, :1], x[:, 1:2]
  dot = lambda m, n: float(jnp.sum(rope(q, jnp.asarray([m]), 1e4) *
                                   rope(k, jnp.asarray([n]), 1e4)))
  assert dot(3, 1) == pytest.approx(dot(12, 10), abs=1e-4)
  assert dot(3, 1) != pytest.approx(dot(3, 2), abs=1e-2)


def test_remat_gives_the_same_loss_gradients_and_fp8_state(small_variables,
                                                            small_step_result):
  variables = small_variables[1]
  remat = _fp8_train_step(dataclasses.replace(SMALL, remat=True))(
      variables["params"], variables["fp8_meta"], _tokens(3))
  # Recomputation repeats the same ops on the same inputs; float32 reassociation
  # across different fusions is the only difference allowed.
  for a, b in zip(jax.tree.leaves(small_step_result), jax.tree.leaves(remat)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-9)


def _training_losses(recipe, steps=30, batch=4, seq=32):
  """adamw on windows of one repeating 16-byte pattern; returns the per-step losses."""
  # The tiny shape; a rolled layer loop (same math as tiny's unrolled one) compiles faster.
  config = gpt.config_for("tiny", seq_len=seq, scan_unroll=1)
  model = gpt.Gpt(config, recipe)
  pattern = np.random.default_rng(0).permutation(256)[:16]
  stream = np.tile(pattern, seq // 16 + 3)
  offsets = np.random.default_rng(1).integers(0, 16, (steps, batch))
  variables = _init(model, jnp.zeros((batch, seq), jnp.int32))
  params, fp8_state = variables["params"], variables.get("fp8_meta", {})
  tx = optax.adamw(3e-3)
  opt_state = tx.init(params)

  def loss_fn(params, fp8_state, tokens):
    if recipe is None:
      logits = model.apply({"params": params}, tokens[:, :-1])
    else:
      logits, updates = model.apply({"params": params, "fp8_meta": fp8_state}, tokens[:, :-1],
                                    mutable=["fp8_meta"])
      fp8_state = updates["fp8_meta"]
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
    return loss, fp8_state

  @jax.jit
  def step(params, opt_state, fp8_state, tokens):
    loss, grads, fp8_state = fp8jax.value_and_grad(loss_fn)(params, fp8_state, tokens)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, fp8_state, loss

  losses = []
  for row in offsets:
    tokens = jnp.asarray(np.stack([stream[o:o + seq + 1] for o in row]), jnp.int32)
    params, opt_state, fp8_state, loss = step(params, opt_state, fp8_state, tokens)
    losses.append(float(loss))
  return losses


@pytest.mark.parametrize("recipe", [None, RECIPE], ids=["bf16", "fp8_delayed"])
def test_tiny_model_learns_a_repeating_sequence_in_30_steps(recipe):
  losses = _training_losses(recipe)
  # Start: uniform over 256 bytes, ln 256 = 5.55. Knowing only which 16 bytes occur
  # gives ln 16 = 2.77; below 1 the model predicts each byte from the previous one.
  # (Measured: 5.6 -> 0.07 in bf16, 5.6 -> 0.08 in FP8.)
  assert losses[0] > 5.0 and losses[-1] < 1.0, losses


def test_attention_backend_is_xla_on_cpu_and_is_what_the_model_runs(monkeypatch):
  seen = []

  def spy(*args, **kwargs):  # records the backend of every attention call the model makes
    choice = choose(*args, **kwargs)
    seen.append(choice.name)
    return choice

  choose = fused_attention.choose_backend
  monkeypatch.setattr(fused_attention, "choose_backend", spy)
  tokens = jax.ShapeDtypeStruct((2, 16), jnp.int32)
  cases = [(SMALL, None, "xla"), (SMALL, RECIPE, "xla"),
           (gpt.config_for("tiny"), fp8jax.CurrentScaling(), "xla"),
           (dataclasses.replace(SMALL, fp8_attention=False), RECIPE, "xla"),
           (gpt.config_for("tiny", attention_backend="pallas"), RECIPE, "pallas")]
  for config, recipe, expected in cases:
    with warnings.catch_warnings():
      warnings.simplefilter("error")  # the CPU's choice is the fast path: no warning
      assert gpt.attention_backend(config, recipe, 2, 16) == expected
    seen.clear()
    jax.eval_shape(gpt.Gpt(config, recipe).init, jax.random.key(0), tokens)  # traces only
    assert seen and set(seen) == {expected}, (config, recipe, seen)
