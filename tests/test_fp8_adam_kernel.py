"""The one-pass FP8 Adam kernel (`pallas_kernels.adam_fp8`) against the jnp step it stands for.

`fp8jax.optim.scale_by_adam_fp8` runs each large leaf's step as one kernel on a GPU. Its
numbers must be the jnp step's, bit for bit (the Pallas interpreter here): the update, the
codes, and each block's k and offset, with the second moment's stochastic rounding
drawing `jax.random.uniform`'s numbers inside the kernel, on one device and on a mesh
(where each device draws its own shard's numbers of the whole leaf). On an H100 the step
of a leaf is one launch that moves 12 bytes a parameter.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import fp8jax.optim as optim
from fp8jax import deviceless
from pallas_kernels import threefry
from pallas_kernels.adam_fp8 import round_to_e4m3_stochastic
from multidevice import multidevice


@pytest.mark.parametrize("shape", [(7, 300), (3, 5, 129), (1000,)])
def test_the_kernel_s_draws_are_jax_random_uniform_s_numbers(shape):
  key = jax.random.fold_in(jax.random.fold_in(jax.random.key(20261129), 7), 3)
  words = jax.random.key_data(key)
  index = jnp.arange(np.prod(shape), dtype=jnp.uint32).reshape(shape)
  got = threefry.uniform((words[0], words[1]), index)
  want = jax.random.uniform(key, shape, jnp.float32)
  np.testing.assert_array_equal(np.asarray(got).view(np.uint32), np.asarray(want).view(np.uint32))


def test_stochastic_rounding_picks_a_neighbour_in_the_e4m3_table_with_its_probability():
  """Against E4M3's value table in float64: the code is the lower or upper neighbour of
  y, the upper one exactly where the draw is below (y - lower) / (upper - lower)."""
  table = np.unique(np.abs(np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn)
                           .astype(np.float64)))
  table = table[np.isfinite(table)]  # 0, the subnormals, ..., 448
  rng = np.random.default_rng(1)
  y = np.concatenate([2.0 ** rng.uniform(-14, np.log2(448), 20000), table,
                      np.nextafter(table.astype(np.float32), np.float32(0)), [448.0]])
  y = np.clip(y, 0, 448).astype(np.float32)
  draw = rng.uniform(0, 1, y.shape).astype(np.float32)
  got = np.asarray(round_to_e4m3_stochastic(jnp.asarray(y), jnp.asarray(draw))
                   ).astype(np.float64)
  y64 = y.astype(np.float64)
  upper_at = np.minimum(np.searchsorted(table, y64, side="right"), len(table) - 1)
  lower = table[np.searchsorted(table, y64, side="right") - 1]
  upper = np.where(lower == y64, table[np.minimum(upper_at, len(table) - 1)], table[upper_at])
  gap = upper - lower
  p_up = np.where(gap > 0, (y64 - lower) / np.where(gap > 0, gap, 1), 0)
  np.testing.assert_array_equal(got, np.where(draw < p_up, upper, lower))


def _problem(shape, dtype, seed=0):
  """Parameters, and 4 steps of gradients whose magnitudes span 10 binades (a zero row in
  the last: blocks of zeros keep their k)."""
  rng = np.random.default_rng(seed)
  params = {"w": jnp.asarray(rng.standard_normal(shape), jnp.float32),
            "gain": jnp.asarray(rng.standard_normal(shape[-1:]), jnp.float32)}
  grads = [{name: jnp.asarray(rng.standard_normal(p.shape)
                              * np.exp2(rng.uniform(-8, 2, p.shape)), dtype)
            for name, p in params.items()} for _ in range(4)]
  grads[-1]["w"] = grads[-1]["w"].at[..., 1, :].set(0)
  return params, grads


def _states(tx, params, grads, put=lambda tree: tree):
  update = jax.jit(tx.update)
  state, out = jax.jit(tx.init)(put(params)), []
  for step_grads in grads:
    updates, state = update(put(step_grads), state, put(params))
    out.append((updates, state))
  return out


def _assert_bitwise(got, want):
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    a, b = np.atleast_1d(np.asarray(a)), np.atleast_1d(np.asarray(b))
    assert a.dtype == b.dtype and a.shape == b.shape
    np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))


@pytest.mark.parametrize("rounding", ["stochastic", "nearest"])
@pytest.mark.parametrize("shape, dtype", [((70, 300), jnp.float32), ((70, 100), jnp.float32),
                                          ((3, 40, 260), jnp.bfloat16)],
                         ids=["ragged", "one_block", "stacked_bf16"])
def test_the_one_pass_step_is_the_jnp_step_bit_for_bit(request, shape, dtype, rounding):
  """Four steps: ragged last blocks and row tiles, a row narrower than a block, a leaf of
  three layers with a bf16 gradient; both roundings of the second moment."""
  params, grads = _problem(shape, dtype)
  tx = optim.adamw(1e-3, weight_decay=0.1,
                   storage=optim.MomentStorage(min_size=16, second_moment_rounding=rounding))
  want = _states(tx, params, grads)
  request.getfixturevalue("interpreted_kernels")
  _assert_bitwise(_states(tx, params, grads), want)


def test_with_injected_hyperparameters_the_one_pass_step_is_the_jnp_step(request):
  """b1, b2 and eps as arrays of the state (`optax.inject_hyperparams`): the kernel takes
  1 - b1 as the jnp step computes it, in float32 from the array."""
  params, grads = _problem((70, 300), jnp.float32)
  tx = optax.inject_hyperparams(optim.adamw)(learning_rate=1e-3, b1=0.8, b2=0.95, eps=1e-6,
                                             storage=optim.MomentStorage(min_size=16))
  want = _states(tx, params, grads)
  request.getfixturevalue("interpreted_kernels")
  _assert_bitwise(_states(tx, params, grads), want)


@multidevice
def test_on_a_mesh_each_device_steps_its_shard_as_the_one_device_step(interpreted_kernels):
  """Rows over "data" and columns over "model" in whole blocks (256 of 512 a device): each
  device's kernel draws its shard's numbers of the whole leaf. A leaf of 192 columns (96 a
  device: not whole blocks) runs on its rows' shards with every column."""
  params, grads = _problem((64, 512), jnp.float32, seed=3)
  # Only leaves whose moments are stored in FP8: XLA:CPU rounds a float32 leaf's sharded
  # arithmetic differently (test_fp8_optimizer.py's mesh test).
  del params["gain"]
  params["v"] = params["w"][:, :192] * 3
  for step_grads, seed in zip(grads, range(4)):
    del step_grads["gain"]
    step_grads["v"] = jnp.asarray(np.random.default_rng(seed).standard_normal((64, 192)),
                                  jnp.float32)
  tx = optim.adamw(1e-3, weight_decay=0.1, storage=optim.MomentStorage(min_size=16))
  want = _states(tx, params, grads)
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("data", "model"))
  specs = {"w": P("data", "model"), "v": P("data", "model")}
  put = lambda tree: {name: jax.device_put(leaf, NamedSharding(mesh, specs[name]))
                      for name, leaf in tree.items()}
  got = _states(tx, params, grads, put)
  for (got_updates, got_state), (want_updates, want_state) in zip(got, want):
    _assert_bitwise(got_state, want_state)
    for name in params:
      # The decay and the learning rate are XLA's float32 arithmetic after the kernel:
      # within 2**-20 of the update's scale, lr (as test_fp8_optimizer.py's mesh test).
      np.testing.assert_allclose(got_updates[name], want_updates[name], rtol=0,
                                 atol=2.0 ** -20 * 1e-3)


_MISSING = deviceless.deviceless_toolchain_missing()


@pytest.mark.hopper
@pytest.mark.skipif(_MISSING is not None, reason=str(_MISSING))
def test_h100_fp8_adam_step_is_one_launch_a_leaf_moving_12_bytes_a_parameter():
  """The whole AdamW step of a [4096, 4096] float32 leaf, as the demo's train step donates
  its state: the moments' kernel reads g (4 bytes) and both codes (2) and writes the
  update (4) and both codes (2), in place, without a copy; the step moves fewer bytes
  than optax's float32 AdamW (28 a parameter; the jnp form of the FP8 moments: 41)."""
  from fp8jax.lowering.cost import cost
  shape = (4096, 4096)
  params = {"w": jax.ShapeDtypeStruct(shape, jnp.float32)}

  def report(tx):
    def step(grads, state, params):
      updates, state = tx.update(grads, state, params)
      return optax.apply_updates(params, updates), state

    state = jax.eval_shape(tx.init, params)
    return cost(jax.jit(step, donate_argnums=(1, 2)), params, state, params,
                target="deviceless")

  fp8, fp32 = report(optim.adamw(1e-3)), report(optax.adamw(1e-3))
  kernels = [k for k in fp8.kernels if "adam_fp8_update" in k.op_name]
  assert len(kernels) == 1, fp8.table()
  # Beside the codes, each row's two numbers per block: 8 bytes a 128-column block.
  per_parameter = (kernels[0].bytes_in + kernels[0].bytes_out) / np.prod(shape)
  assert per_parameter == pytest.approx(12 + 4 * 8 / 128, rel=1e-3), fp8.table()
  assert not [k for k in fp8.kernels if k.category == "copy"], fp8.table()
  assert fp8.bytes < fp32.bytes, (fp8.table(), fp32.table())


@pytest.mark.gpu
def test_on_a_gpu_the_kernel_steps_as_xla_runs_the_jnp_step(hopper_device):
  """Four steps on a Hopper GPU, the kernel against XLA's jnp step (`fused_kernels(False)`)
  from the same state each step: Triton's and XLA's log2 and exp2 may differ in a float32
  ulp, which moves a code only where y lies that close to a rounding boundary (a few codes
  in 10**4 at most, by one step), and the update with it."""
  from fp8jax.ops import fused_kernels
  params, grads = _problem((1000, 1000), jnp.float32, seed=5)
  tx = optim.adamw(1e-3, weight_decay=0.1, storage=optim.MomentStorage(min_size=16))
  put = lambda tree: jax.device_put(tree, hopper_device)
  # Two functions, so that each jit traces its own program (the flag is read when tracing).
  kernel_update = jax.jit(lambda *args: tx.update(*args))
  jnp_update = jax.jit(lambda *args: tx.update(*args))
  state = jax.jit(tx.init)(put(params))
  for step_grads in grads:
    with fused_kernels.fused_kernels(False):
      want_updates, want_state = jnp_update(put(step_grads), state, put(params))
    got_updates, got_state = kernel_update(put(step_grads), state, put(params))
    for moment in ("mu", "nu"):
      got, want = (np.asarray(getattr(s[0], moment)["w"].codes).view(np.uint8).astype(int)
                   for s in (got_state, want_state))
      assert np.mean(got != want) < 1e-3 and np.max(np.abs(got - want)) <= 1, moment
    scale = np.mean(np.abs(np.asarray(want_updates["w"])))
    assert np.mean(np.abs(np.asarray(got_updates["w"]) - np.asarray(want_updates["w"]))
                   ) < 1e-3 * scale
    state = want_state
