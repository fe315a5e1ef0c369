"""The one-pass FP8 Adam kernel (`pallas_kernels.adam_fp8`) against the jnp step it stands for.

`fp8jax.optim.scale_by_adam_fp8` runs each large leaf's step as one kernel on a GPU. Its
numbers must be the jnp step's to float32 rounding (the Pallas interpreter here): the
update, the codes, and each block's k and offset, with the second moment's stochastic
rounding drawing `jax.random.uniform`'s numbers inside the kernel. On a mesh each device
steps its own shard, drawing its shard's numbers of the whole leaf: the same bits as one
device. On an H100 the step of a leaf is one launch that moves 12 bytes a parameter.
"""
from __future__ import annotations

import math
import re

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
  above = np.searchsorted(table, y64, side="right")  # the first value above y (448: none)
  lower, upper = table[above - 1], table[np.minimum(above, len(table) - 1)]
  gap = upper - lower
  p_up = np.where(gap > 0, (y64 - lower) / np.where(gap > 0, gap, 1), 0)
  np.testing.assert_array_equal(got, np.where(draw < p_up, upper, lower))


def _problem(shape, dtype, seed=0):
  """Parameters, and 4 steps of gradients whose magnitudes span 10 binades (a zero row in
  the last)."""
  rng = np.random.default_rng(seed)
  params = {"w": jnp.asarray(rng.standard_normal(shape), jnp.float32),
            "gain": jnp.asarray(rng.standard_normal(shape[-1:]), jnp.float32)}
  grads = [{name: jnp.asarray(rng.standard_normal(p.shape)
                              * np.exp2(rng.uniform(-8, 2, p.shape)), dtype)
            for name, p in params.items()} for _ in range(4)]
  grads[-1]["w"] = grads[-1]["w"].at[..., 1, :].set(0)
  return params, grads


def _updater(tx):
  # A function of its own each time: jit's cache would hand back a program traced before
  # the kernels were switched on.
  return jax.jit(lambda *args: tx.update(*args))


@pytest.fixture
def kernel_calls(monkeypatch, interpreted_kernels) -> list:
  """The interpreted kernel's launches traced, one entry each (so a test knows it ran)."""
  import pallas_kernels
  calls, launch = [], pallas_kernels.adam_fp8_update

  def counted(*args, **kwargs):
    calls.append(args[0].shape)
    return launch(*args, **kwargs)

  monkeypatch.setattr(pallas_kernels, "adam_fp8_update", counted)
  return calls


def _close_steps(tx, params, grads, request) -> None:
  """Each step from the jnp step's state: the kernel's update and moments against the jnp
  step's. The kernel does the jnp step's float32 operations in its order, but XLA:CPU
  fuses the jnp step's multiply-adds into FMAs where the interpreter's separate
  operations round twice (measured: up to 3 ulps of the update, 1 of an offset), so:
  the update within 2**-20 of its scale and each block's offset within 2**-20 relative
  (8 ulps), and a code or a
  block's k moved only where such an ulp carries y across a rounding boundary (at most
  one step, in at most 1 element in 10**3)."""
  jnp_update = _updater(tx)
  states, state = [], jax.jit(tx.init)(params)
  for step_grads in grads:
    states.append(state)
    want = jnp_update(step_grads, state, params)
    state = want[1]
  calls = request.getfixturevalue("kernel_calls")
  kernel_update = _updater(tx)
  for step_grads, state in zip(grads, states):
    want_updates, want_state = jnp_update(step_grads, state, params)
    got_updates, got_state = kernel_update(step_grads, state, params)
    for got, want in zip(jax.tree.leaves(got_updates), jax.tree.leaves(want_updates)):
      # The Adam direction is of order 1, the update lr (1e-3) times it plus the decay.
      np.testing.assert_allclose(got, want, rtol=0, atol=2.0 ** -20 * 1e-3)
    adam_states = [_adam_state(s) for s in (got_state, want_state)]
    for moment in ("mu", "nu"):
      got, want = (getattr(s, moment)["w"] for s in adam_states)
      codes = [np.asarray(m.codes).view(np.uint8).astype(int) for m in (got, want)]
      assert np.mean(codes[0] != codes[1]) <= 1e-3 and np.all(abs(codes[0] - codes[1]) <= 1)
      assert np.mean(np.asarray(got.k) != np.asarray(want.k)) <= 1e-3
      np.testing.assert_allclose(got.offset, want.offset, rtol=2.0 ** -20)
      np.testing.assert_array_equal(*(getattr(s, moment)["gain"] for s in adam_states))
  assert calls, "the kernel did not run"


def _adam_state(state) -> optim.ScaleByAdamFp8State:
  """The FP8 Adam state inside an optax chain's state (or `inject_hyperparams`')."""
  found = [node for node in jax.tree.leaves(
      state, is_leaf=lambda node: isinstance(node, optim.ScaleByAdamFp8State))
      if isinstance(node, optim.ScaleByAdamFp8State)]
  assert len(found) == 1, state
  return found[0]


@pytest.mark.parametrize("rounding", ["stochastic", "nearest"])
@pytest.mark.parametrize("shape, dtype", [((70, 300), jnp.float32), ((70, 100), jnp.float32),
                                          ((3, 40, 260), jnp.bfloat16)],
                         ids=["ragged", "one_block", "stacked_bf16"])
def test_the_one_pass_step_is_the_jnp_step(request, shape, dtype, rounding):
  """Ragged last blocks and row tiles, a row narrower than a block, a leaf of three layers
  with a bf16 gradient; both roundings of the second moment."""
  params, grads = _problem(shape, dtype)
  tx = optim.adamw(1e-3, weight_decay=0.1,
                   storage=optim.MomentStorage(min_size=16, second_moment_rounding=rounding))
  _close_steps(tx, params, grads, request)


def test_with_injected_hyperparameters_the_one_pass_step_is_the_jnp_step(request):
  """b1, b2 and eps as arrays of the state (`optax.inject_hyperparams`): the kernel takes
  1 - b1 as the jnp step computes it, in float32 from the array."""
  params, grads = _problem((70, 300), jnp.float32)
  tx = optax.inject_hyperparams(optim.adamw)(learning_rate=1e-3, b1=0.8, b2=0.95, eps=1e-6,
                                             storage=optim.MomentStorage(min_size=16))
  _close_steps(tx, params, grads, request)


@multidevice
def test_on_a_mesh_each_device_steps_its_shard_as_one_device_steps_the_leaf(kernel_calls):
  """The kernel on every device's shard against the kernel on the whole leaf: the same
  bits (each device draws its shard's numbers of the whole leaf), with nothing gathered.
  Rows over "data" and columns over "model" in whole blocks; a stack of 4 layers split on
  its middle axis; a leaf of 192 columns (96 a device: not whole blocks) on its rows'
  shards with every column."""
  rng = np.random.default_rng(3)
  shapes = {"w": (64, 512), "stack": (4, 64, 256), "v": (64, 192)}
  specs = {"w": P("data", "model"), "stack": P(None, "data", "model"), "v": P("data", "model")}
  params = {name: jnp.asarray(rng.standard_normal(shape), jnp.float32)
            for name, shape in shapes.items()}
  grads = [{name: jnp.asarray(rng.standard_normal(shape) * np.exp2(rng.uniform(-8, 2, shape)),
                              jnp.float32) for name, shape in shapes.items()}
           for _ in range(3)]
  tx = optim.adamw(1e-3, weight_decay=0.1, storage=optim.MomentStorage(min_size=16))
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("data", "model"))
  put = lambda tree: {name: jax.device_put(leaf, NamedSharding(mesh, specs[name]))
                      for name, leaf in tree.items()}
  update = _updater(tx)
  state, sharded_state = jax.jit(tx.init)(params), jax.jit(tx.init)(put(params))
  for step_grads in grads:
    want_updates, state = update(step_grads, state, params)
    got_updates, sharded_state = update(put(step_grads), sharded_state, put(params))
    for got, want in zip(jax.tree.leaves(sharded_state), jax.tree.leaves(state)):
      np.testing.assert_array_equal(np.atleast_1d(np.asarray(got)).view(np.uint8),
                                    np.atleast_1d(np.asarray(want)).view(np.uint8))
    for name in shapes:
      # The decay and the learning rate are XLA's float32 arithmetic after the kernel:
      # within 2**-20 of the update's scale, lr (as test_fp8_optimizer.py's mesh test).
      np.testing.assert_allclose(got_updates[name], want_updates[name], rtol=0,
                                 atol=2.0 ** -20 * 1e-3)
  hlo = update.lower(put(grads[0]), sharded_state, put(params)).compile().as_text()
  # Gathered: the 192-column leaf's row shards [16, 192] (its columns are not whole blocks
  # a device), and some of the blocks' k and offset (a block's two numbers, as the state's
  # init left them); never a shard of the other leaves' gradients or codes (4,096 and
  # 8,192 elements a device).
  gathered = [re.search(r"= \w+\[([\d,]*)\]", line).group(1)
              for line in hlo.splitlines() if " all-gather(" in line]
  assert "16,192" in gathered
  assert all(math.prod(map(int, dims.split(","))) <= 16 * 192 for dims in gathered), gathered
  assert kernel_calls


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


@pytest.mark.hopper
@pytest.mark.skipif(_MISSING is not None, reason=str(_MISSING))
def test_fsdp_gpt_step_s_adam_kernels_move_nothing_between_devices():
  """The demo GPT at the 350m width (two blocks) with FSDP and tensor parallelism on
  4 x 2 H100s, FP8 moments: each device's kernels step its shards of the stacked leaves,
  whose every split is whole blocks, so the step gathers only the weights' FP8 copies and
  reduce-scatters the bf16 gradients, as with optax's AdamW (measured: the same
  collectives, element for element)."""
  import fp8jax
  from fp8jax.lowering.compile import compile_text
  from fp8jax.lowering.hlo_text import parse_hlo_module
  from fp8jax.lowering.inspection import CUBLAS_ONLY_OPTIONS
  from fp8jax.models import gpt
  from fp8jax.models.gpt_sharding import shard_train_state
  from fp8jax.runs.steps import train_step_for

  config = gpt.config_for("350m", seq_len=1024, n_layers=2, saved_activations="fp8")
  mesh = deviceless.h100_mesh(data=4, model=2)
  model, tx = gpt.Gpt(config, recipe=fp8jax.DelayedScaling()), optim.adamw(1e-3)
  variables = jax.eval_shape(model.init, jax.random.key(0),
                             jax.ShapeDtypeStruct((1, 1024), jnp.int32))
  args = shard_train_state(mesh, variables["params"],
                           jax.eval_shape(tx.init, variables["params"]),
                           variables["fp8_meta"],
                           jax.ShapeDtypeStruct((32, 1025), jnp.int32), fsdp=True)
  hlo = compile_text(train_step_for(model, tx, fp8=True), *args,
                     compiler_options=dict(CUBLAS_ONLY_OPTIONS), target="deviceless",
                     collect_ptx=False).hlo
  assert "adam_fp8_update" in hlo
  for computation in parse_hlo_module(hlo).computations.values():
    for instruction in computation.instructions.values():
      kind = instruction.opcode.removesuffix("-start")
      if kind == "all-gather":
        assert {shape.dtype for shape in instruction.shapes} == {"f8e4m3fn"}, instruction
      assert kind not in ("all-to-all", "collective-permute"), instruction
