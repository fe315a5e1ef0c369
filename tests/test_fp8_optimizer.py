"""Adam / AdamW with FP8 moments (fp8jax.optim): storage bounds, optax parity, training.

References: float64 numpy (the stored moments against the exact ones, with bounds derived
from E4M3's 3 mantissa bits), optax's own adamw (the same update from the same moments), the
FP8 format table (E4M3's codes as bit patterns).
"""
import inspect
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType, PartitionSpec as P

import fp8jax.optim as optim
from fp8jax.optim import moment_codec
from multidevice import multidevice

BLOCK = 128


def _log_uniform(key, shape, low_log2, high_log2, signed=True):
  """Magnitudes log-uniform in [2**low, 2**high) with random signs: never zero."""
  k1, k2 = jax.random.split(key)
  values = jnp.exp2(jax.random.uniform(k1, shape, minval=low_log2, maxval=high_log2))
  if signed:
    values = values * jnp.where(jax.random.bernoulli(k2, 0.5, shape), 1.0, -1.0)
  return values


def _per_element_k(moment, columns):
  return np.repeat(np.asarray(moment.k, np.float64), BLOCK, axis=-1)[..., :columns]


# Round to nearest: every nonzero code is a normal E4M3 number (the expansion maps a block
# into E4M3's normal range), so the code's relative error is at most half a step, 2**-4;
# undoing the expansion y = x**k takes the k-th root: |x_hat/x - 1| <= (1 + 2**-4)**(1/k) - 1.
# Float32 log2/exp2 add a few ulps, amplified by at most k_max = 8 in the exponent: 2**-18.
_F32_SLACK = 2.0 ** -18


@pytest.mark.parametrize("spread_log2", [3, 10, 30], ids=["narrow", "wide", "v_like"])
def test_round_to_nearest_storage_is_within_the_derived_bound_of_float64(spread_log2):
  x = _log_uniform(jax.random.key(spread_log2), (6, 300), -20.0 - spread_log2, -20.0)
  stored = moment_codec.encode(x, block=BLOCK, k_max=8.0)
  assert stored.codes.dtype == jnp.float8_e4m3fn and stored.codes.shape == x.shape
  assert stored.k.shape == stored.offset.shape == (6, 3)  # ceil(300 / 128) blocks per row
  got = np.asarray(moment_codec.decode(stored, block=BLOCK), np.float64)
  want = np.asarray(x, np.float64)
  k = _per_element_k(stored, x.shape[-1])
  bound = (1 + 2.0 ** -4) ** (1 / k) - 1 + _F32_SLACK
  assert np.all(np.abs(got / want - 1) <= bound)
  # Narrow blocks are stretched (k > 1), so they are stored more finely than 2**-4.
  if spread_log2 == 3:
    assert np.all(k >= 4) and np.max(np.abs(got / want - 1)) < 2.0 ** -4 / 3


def test_stochastic_rounding_is_within_one_step_and_unbiased():
  x = _log_uniform(jax.random.key(7), (1, 128), -30.0, -20.0, signed=False)
  stored = [moment_codec.encode(x, block=BLOCK, k_max=8.0, key=jax.random.key(i))
            for i in range(400)]
  k = _per_element_k(stored[0], 128)
  want = np.asarray(x, np.float64)
  decoded = np.stack([np.asarray(moment_codec.decode(s, block=BLOCK), np.float64)
                      for s in stored])
  # One whole E4M3 step (2**-3 relative) at most, in the expanded space.
  assert np.all(np.abs(decoded / want - 1) <= (1 + 2.0 ** -3) ** (1 / k) - 1 + _F32_SLACK)
  # Unbiased in the expanded space (what is rounded): E[y_hat] = y. The mean of 400 draws of a
  # two-point variable of spread <= 2**-3 relative has standard error <= 2**-4 / 20; 5 sigma.
  y_hat = decoded ** k
  relative_bias = np.mean(y_hat, axis=0) / want[0] ** k - 1
  assert np.all(np.abs(relative_bias) <= 5 * 2.0 ** -4 / 20)
  # Deterministic for a key.
  again = moment_codec.encode(x, block=BLOCK, k_max=8.0, key=jax.random.key(0))
  np.testing.assert_array_equal(np.asarray(again.codes, np.float32),
                                np.asarray(stored[0].codes, np.float32))


def test_zeros_constant_blocks_and_a_partial_last_block_round_trip():
  x = jnp.concatenate([jnp.zeros((2, 128)), jnp.full((2, 128), -3.5e-7),
                       _log_uniform(jax.random.key(1), (2, 44), -12.0, -4.0)], axis=1)
  x = x.at[0, 5].set(0.0).at[1, 300].set(0.0)
  stored = moment_codec.encode(x, block=BLOCK, k_max=8.0)
  got = np.asarray(moment_codec.decode(stored, block=BLOCK), np.float64)
  want = np.asarray(x, np.float64)
  assert np.all(got[want == 0] == 0)  # zeros stay zeros
  np.testing.assert_allclose(got[:, 128:256], want[:, 128:256], rtol=_F32_SLACK)  # one value
  nonzero = want != 0
  k = _per_element_k(stored, 300)
  assert np.all(np.abs(got[nonzero] / want[nonzero] - 1)
                <= ((1 + 2.0 ** -4) ** (1 / k) - 1 + _F32_SLACK)[nonzero])


def _params(seed=0):
  keys = jax.random.split(jax.random.key(seed), 3)
  return {"w1": jax.random.normal(keys[0], (64, 256)) * 0.1,
          "w2": jax.random.normal(keys[1], (256, 32)) * 0.1,
          "b": jnp.zeros((256,))}  # small: stays float32


def _loss(params, x, y):
  h = jax.nn.gelu(x @ params["w1"] + params["b"])
  return jnp.mean((h @ params["w2"] - y) ** 2)


def _batch(step):
  key = jax.random.fold_in(jax.random.key(42), step)
  x = jax.random.normal(key, (128, 64))
  target_w = jax.random.normal(jax.random.key(3), (64, 32)) * 0.2
  return x, jnp.tanh(x @ target_w)


def _train(tx, steps, params=None, state=None, first_step=0):
  params = _params() if params is None else params
  state = tx.init(params) if state is None else state

  @jax.jit
  def step(params, state, x, y):
    loss, grads = jax.value_and_grad(_loss)(params, x, y)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss

  losses = []
  for i in range(first_step, first_step + steps):
    params, state, loss = step(params, state, *_batch(i))
    losses.append(float(loss))
  return params, state, losses


def test_with_every_leaf_in_float32_it_is_optax_adamw():
  storage = optim.MomentStorage(min_size=10**9)
  params, state, losses = _train(optim.adamw(1e-2, weight_decay=0.1, storage=storage), 20)
  want_params, _, want_losses = _train(optax.adamw(1e-2, weight_decay=0.1), 20)
  # The same float32 operations; XLA may fuse them differently: float32 rounding only.
  np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
  for name in params:
    np.testing.assert_allclose(params[name], want_params[name], rtol=1e-4, atol=1e-7)
  moments = jax.tree.leaves((state[0].mu, state[0].nu))
  assert moments and all(leaf.dtype == jnp.float32 for leaf in moments)


def test_fp8_moments_train_like_float32_moments_and_take_a_quarter_of_the_bytes():
  tx = optim.adamw(1e-2, weight_decay=0.1)
  _, state, losses = _train(tx, 200)
  _, want_state, want_losses = _train(optax.adamw(1e-2, weight_decay=0.1), 200)
  assert losses[-1] < 0.2 * losses[0]  # it trains
  # Storage error (<= 2**-4 relative per element, unbiased for v) perturbs each update by a
  # few percent; over 200 steps the losses stay within 5% of float32 Adam's.
  late = slice(150, 200)
  assert abs(np.mean(losses[late]) / np.mean(want_losses[late]) - 1) < 0.05
  mu_w1 = state[0].mu["w1"]
  assert isinstance(mu_w1, optim.Fp8Moment) and mu_w1.codes.dtype == jnp.float8_e4m3fn
  assert state[0].mu["b"].dtype == jnp.float32  # a 1-D leaf stays float32
  stored = sum(leaf.nbytes for leaf in jax.tree.leaves((state[0].mu["w1"], state[0].nu["w1"])))
  float32 = sum(leaf.nbytes for leaf in jax.tree.leaves((want_state[0].mu["w1"],
                                                        want_state[0].nu["w1"])))
  # 1 byte per element plus 2 float32 per 128 elements, per moment: 1.0625 / 4.
  assert stored / float32 == pytest.approx(1.0625 / 4)


def test_nearest_rounding_stalls_the_second_moment_that_stochastic_rounding_tracks():
  """Why stochastic rounding is the default: at b2 = 0.999 the second moment moves ~0.1% a
  step, far below E4M3's 6.25% half step; rounded to nearest in a block whose scale an
  outlier pins, v never decays, and the step size stays wrong for good."""
  def gradient(step):  # element 0 pins the block's scale; the others drop 10x at step 300
    small = 1e-3 if step < 300 else 1e-4
    return jnp.full((1, 128), small).at[0, 0].set(1.0)

  def final_nu(rounding):
    storage = optim.MomentStorage(second_moment_rounding=rounding, min_size=1)
    tx = optim.scale_by_adam_fp8(b2=0.999, storage=storage)
    state = tx.init(jnp.zeros((1, 128)))
    update = jax.jit(tx.update)
    for step in range(3000):
      _, state = update(gradient(step), state)
    return np.asarray(moment_codec.decode(state.nu, block=BLOCK))[0, 1:]

  exact = optax.scale_by_adam(b2=0.999)
  state = exact.init(jnp.zeros((1, 128)))
  update = jax.jit(exact.update)
  for step in range(3000):
    _, state = update(gradient(step), state)
  want = np.asarray(state.nu)[0, 1:]
  nearest, stochastic = final_nu("nearest"), final_nu("stochastic")
  assert np.median(nearest / want) > 2.0  # stuck near its value of step 300
  # Unbiased: the median over 127 elements is within 25% (each element's SR noise over the
  # ~1000-step averaging horizon is ~10-20%).
  assert abs(np.median(stochastic / want) - 1) < 0.25


def test_composes_with_optax_chain_and_inject_hyperparams():
  tx = optax.chain(optax.clip_by_global_norm(1.0),
                   optax.inject_hyperparams(optim.adamw)(learning_rate=1e-2, b2=0.95))
  _, state, losses = _train(tx, 30)
  assert losses[-1] < losses[0]
  assert float(state[1].hyperparams["learning_rate"]) == pytest.approx(1e-2)


def test_checkpoint_round_trip_is_bit_exact_and_a_restored_run_continues_bit_for_bit(tmp_path):
  ckpt = pytest.importorskip("fp8jax.checkpoint")
  tx = optim.adamw(1e-2)
  params, state, _ = _train(tx, 10)
  ckpt.save(tmp_path / "step_10", params=params, opt_state=state, fp8_state={})
  restored = ckpt.restore(tmp_path / "step_10", params=params, opt_state=state, fp8_state={})
  for got, want in zip(jax.tree.leaves(restored["opt_state"]), jax.tree.leaves(state)):
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(np.atleast_1d(np.asarray(got)).view(np.uint8),
                                  np.atleast_1d(np.asarray(want)).view(np.uint8))
  straight, _, straight_losses = _train(tx, 10, params, state, first_step=10)
  resumed, _, resumed_losses = _train(tx, 10, restored["params"], restored["opt_state"],
                                      first_step=10)
  assert straight_losses == resumed_losses
  for name in straight:
    np.testing.assert_array_equal(straight[name], resumed[name])


@pytest.mark.parametrize("field,value,message", [
    ("block", 0, "block=0 must be a positive int"),
    ("second_moment_rounding", "up", "must be one of"),
    ("k_max", 0.5, r"k_max=0.5 must be in \[1, 64\]"),
])
def test_bad_storage_options_are_named(field, value, message):
  with pytest.raises(ValueError, match=message):
    optim.MomentStorage(**{field: value})
  with pytest.raises(TypeError, match="storage must be a fp8jax.optim.MomentStorage"):
    optim.scale_by_adam_fp8(storage="fp8")


def _nnx_updates(tx, jit: bool):
  """The updates of 5 `nnx.Optimizer` steps on an `nnx.Linear(64, 128)` whose gradient is a
  constant `c / 64` with |c| log-uniform in [2**-3, 1] (`x` is the identity)."""
  model = nnx.Linear(64, 128, rngs=nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  x = jnp.eye(64)
  c = _log_uniform(jax.random.key(5), (64, 128), -3.0, 0.0)
  loss = lambda model: jnp.sum(model(x) * c) / 64

  def step(model, optimizer):
    return optimizer.update(model, nnx.grad(loss)(model))

  step = nnx.jit(step) if jit else step
  return [np.asarray(step(model, optimizer)["kernel"], np.float64) for _ in range(5)]


def _relative_moment_error_bounds(decay, stored_error, steps):
  """Bounds on |m_t / m_t* - 1| of a moment stored with relative error <= `stored_error`,
  under a constant gradient g: m_t = (1 - decay) g + decay m_(t-1)(1 + e), exactly
  a_t* g with a_t* = 1 - decay**t, all terms of g's sign. The first step's moment is
  exact (the stored zeros decode to zero); then eta_t <= w_t ((1 + eta_(t-1))(1 + d) - 1)
  with w_t = decay a_(t-1)* / a_t*, and 1 - (1 - eta)(1 - d) is no larger."""
  bounds = [0.0]
  for t in range(2, steps + 1):
    weight = decay * (1 - decay ** (t - 1)) / (1 - decay ** t)
    bounds.append(weight * ((1 + bounds[-1]) * (1 + stored_error) - 1))
  return np.array(bounds)


def test_in_an_nnx_optimizer_it_steps_like_optax_adamw_within_the_moments_rounding():
  """`nnx.Optimizer` stores each update's state through `nnx.state`, which hands the FP8
  moments back as `nnx.State` nodes; the optimizer reads them from the second update on."""
  storage = optim.MomentStorage(min_size=4096)  # the 64 x 128 kernel in FP8, the bias not
  want = _nnx_updates(optax.adamw(1e-2, weight_decay=0.0), jit=False)
  eager = _nnx_updates(optim.adamw(1e-2, weight_decay=0.0, storage=storage), jit=False)
  jitted = _nnx_updates(optim.adamw(1e-2, weight_decay=0.0, storage=storage), jit=True)
  # The tolerance, from the storage bounds above: m is proportional to g, whose magnitudes
  # span 3 binades in a block, so k >= floor(16 * 14.8 / 3) / 16 > 4; v to g**2 (6 binades,
  # k > 2). m rounds to nearest (half an E4M3 step, 2**-4, in the expanded space), v
  # stochastically (a whole step, 2**-3): relative errors <= 1.0625**(1/4) - 1 and
  # 1.125**(1/2) - 1 per store, compounded over the steps as the recursion says. An update
  # lr m_hat / (sqrt(v_hat) + eps) (eps << |g| >= 2**-9) is then off by at most
  # (1 + eta_m) / sqrt(1 - eta_v) - 1 relative, plus float32 slack.
  eta_m = _relative_moment_error_bounds(0.9, 1.0625 ** 0.25 - 1 + _F32_SLACK, 5)
  eta_v = _relative_moment_error_bounds(0.999, 1.125 ** 0.5 - 1 + _F32_SLACK, 5)
  bounds = (1 + eta_m) / np.sqrt(1 - eta_v) - 1 + 1e-6
  for loop in (eager, jitted):
    for step, (got, reference) in enumerate(zip(loop, want)):
      assert np.all(np.abs(got / reference - 1) <= bounds[step]), step
  # The moments were used: a first moment restarted from zero each step would give
  # m_hat / sqrt(v_hat) = 0.24 / 0.45 = 0.54 times optax's update by the fifth.
  assert bounds[-1] < 0.46


def test_adam_and_adamw_take_optax_parameters_in_optax_order():
  for ours, theirs in [(optim.adamw, optax.adamw), (optim.adam, optax.adam),
                       (optim.scale_by_adam_fp8, optax.scale_by_adam)]:
    ours_params = [(p.name, p.kind) for p in inspect.signature(ours).parameters.values()]
    theirs_params = [(p.name, p.kind) for p in inspect.signature(theirs).parameters.values()]
    extra = [("storage", inspect.Parameter.KEYWORD_ONLY)]
    if ours is optim.adamw:  # the clipping that update_and_apply fuses into the kernel
      extra.append(("max_grad_norm", inspect.Parameter.KEYWORD_ONLY))
    assert ours_params == theirs_params + extra
  # An optax-style positional call binds weight decay as optax does (it used to land in
  # `mask` and fail in the first update). Float32 moments: optax's own arithmetic.
  args = (1e-2, 0.9, 0.95, 1e-8, 0.0, None, 0.1)
  params, _, losses = _train(optim.adamw(*args, storage=optim.MomentStorage(min_size=10**9)), 3)
  want_params, _, want_losses = _train(optax.adamw(*args), 3)
  # As in the float32 test above; a weight decay of optax's default 1e-4 instead of 0.1
  # would move w1 by lr * 0.1 * |w1| ~ 1e-4 a step, 1e-3 relative.
  np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
  for name in params:
    np.testing.assert_allclose(params[name], want_params[name], rtol=1e-4, atol=1e-7)
  with pytest.raises(ValueError, match="mu_dtype=.*bfloat16.*leave it None"):
    optim.adamw(1e-3, mu_dtype=jnp.bfloat16)


@multidevice
def test_moments_of_a_last_axis_split_finer_than_a_block_are_those_of_one_device():
  """On an explicit mesh whose devices hold 64, 48 or 80 columns of a leaf (under the
  128-column block), each device reduces its part of a block, the blocks' extremes are
  gathered, and the stored moments are the one-device moments, bit for bit."""
  mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
  specs = {"w": P("data", "model"), "v": P(None, ("data", "model")),
           "u": P("data", None, "model")}  # 320 columns: a last block of 64
  shapes = {"w": (64, 256), "v": (32, 384), "u": (4, 16, 320)}
  rng = np.random.default_rng(0)
  params = {name: rng.standard_normal(shape, np.float32) for name, shape in shapes.items()}
  grads = [{name: (rng.choice([-1.0, 1.0], shape) * 2.0 ** rng.uniform(-20, 0, shape)
                   ).astype(np.float32) for name, shape in shapes.items()} for _ in range(2)]
  tx = optim.adamw(1e-3, weight_decay=0.1)  # stochastic rounding of v: the bits too
  init, update = jax.jit(tx.init), jax.jit(tx.update)
  state, want = init(params), []
  for step_grads in grads:
    updates, state = update(step_grads, state, params)
    want.append((updates, state))
  with jax.set_mesh(mesh):
    put = lambda tree: {name: jax.device_put(leaf, specs[name]) for name, leaf in tree.items()}
    sharded_params = put(params)
    sharded_state = init(sharded_params)
    for step_grads, (updates, state) in zip(grads, want):
      sharded_updates, sharded_state = update(put(step_grads), sharded_state, sharded_params)
      for name in shapes:
        # XLA:CPU fuses a shard's float32 arithmetic with other multiply-adds than the
        # whole array's (the FSDP test in test_sharding.py measured 3 ulps): 2**-20 of
        # the update's scale, lr.
        np.testing.assert_allclose(sharded_updates[name], updates[name], rtol=0,
                                   atol=2.0 ** -20 * 1e-3)
      for got, want_leaf in zip(jax.tree.leaves(sharded_state), jax.tree.leaves(state)):
        np.testing.assert_array_equal(np.atleast_1d(np.asarray(got)).view(np.uint8),
                                      np.atleast_1d(np.asarray(want_leaf)).view(np.uint8))
  for name, spec in specs.items():
    for moment in (sharded_state[0].mu[name], sharded_state[0].nu[name]):
      assert moment.codes.sharding.spec == spec
      # Two or three blocks a row: the blocks' axis is whole on every device.
      assert moment.k.sharding.spec[-1] is None and moment.k.shape == state[0].mu[name].k.shape
