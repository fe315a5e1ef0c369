"""Budgets on the compiled program of FP8 training on 8 H100s: what each GPU runs.

Structure, not timing: each test compiles a step for one host of 8 H100 SXMs
without a GPU (`fp8jax.deviceless.h100_mesh`), plain `jax.jit` with sharded
arguments, and reads the per-device optimized HLO with `fp8jax.lowering.cost`
(default `CostConstants`). The lean FP8 path must survive the sharding:

* data parallel (batch over "data", weights replicated): each GPU quantizes its
  own shard, nothing is all-gathered, every GEMM works on the local rows, and
  the only collectives beside the bf16 step's are the amax all-reduce (a few
  scalars, combined by XLA into one per step). Beside the casts and the update,
  that all-reduce is the only launch for the amaxes, with the two kernels XLA's
  combiner puts around it (it packs the per-tensor maxima into one buffer and
  slices each back out after fusion, so its pack and its slices are kernels of
  their own: one per step, and one per sharded tensor, x and output gradient);
* FSDP (weights split over "data" too): the weight is all-gathered once, in
  FP8 (half the bytes of the bf16 step's gather), and transposed after it;
* data x model (tensor parallel): no GEMM on gathered activations;
* `jax.shard_map` (per-device code, `fp8jax.value_and_grad` inside): the same
  kernels on each device's arrays, the FP8 state reduced by one pmax per step
  and updated by one kernel.

Speedups are per device and compare the kernels' time (`compute_time_s`); the
collectives' NVLink time is held separately: FP8 must not send more bytes than
bf16 does (FSDP: fewer).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import fp8jax
from fp8jax import deviceless
from fp8jax.lowering.cost import cost
from fp8jax.ops import fused_kernels
from test_fp8_budgets import (bf16_dense_step, bf16_stack_loss, fp8_dense_step, fp8_stack_loss,
                               is_amax_reduction)

_MISSING = deviceless.deviceless_toolchain_missing()
pytestmark = [pytest.mark.hopper, pytest.mark.skipif(_MISSING is not None, reason=str(_MISSING))]

DELAYED, CURRENT = fp8jax.DelayedScaling(), fp8jax.CurrentScaling()
DEVICES = 8
SCALAR_BYTES = 64  # the amax all-reduce: a few float32 scalars


def _spec(mesh, shape, spec, dtype=jnp.bfloat16):
  return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))


def _replicated_state(mesh, state):
  return jax.tree.map(lambda a: _spec(mesh, a.shape, P(), a.dtype), state)


def _dense_steps(rows, width, recipe, mesh, x_spec, kernel_spec, g_spec=P("data", None)):
  """One `fp8_dense` forward+backward with its state update, and the bf16 step."""
  x = _spec(mesh, (rows, width), x_spec)
  kernel = _spec(mesh, (width, width), kernel_spec)
  g = _spec(mesh, (rows, width), g_spec)  # the output gradient, sharded as the output
  meta = _replicated_state(mesh, jax.eval_shape(lambda: fp8jax.init_dot_meta(recipe)))
  fp8 = cost(fp8_dense_step, x, kernel, g, meta, target="deviceless", label="fp8")
  bf16 = cost(bf16_dense_step, x, kernel, g, target="deviceless", label="bf16")
  return fp8, bf16


def _collectives(report, kind):
  return [k for k in report.kernels if k.category == "collective" and kind in k.name]


def _link_bytes(report):
  return report.link_time_s * report.constants.link_bytes_per_s


@pytest.fixture(scope="module")
def data_mesh():
  return deviceless.h100_mesh(data=DEVICES)


def test_data_parallel_dense_step_launches_the_casts_the_update_and_the_amax_all_reduce(
    data_mesh):
  """One `fp8_dense` forward+backward with its state update, 2048 rows per device and a
  2048 x 2048 kernel: the bf16 step's kernels, the 3 casts and the update, and the one
  all-reduce of the amaxes with XLA's pack and its two slices. Nothing is copied."""
  n = 2048
  fp8, bf16 = _dense_steps(DEVICES * n, n, DELAYED, data_mesh, P("data", None), P())
  assert not [k for k in fp8.kernels if k.category == "copy"], fp8.table()
  assert len(_collectives(fp8, "all-reduce")) == len(_collectives(bf16, "all-reduce")) + 1, \
      fp8.table()
  small = [k for k in fp8.kernels if k.category == "fusion"]
  assert sorted(k.name.rstrip(".0123456789") for k in small) == [
      "wrapped_concatenate", "wrapped_slice", "wrapped_slice"], fp8.table()
  casts = [k for k in fp8.kernels if k.category == "pallas" and k.bytes_in >= n * n * 2]
  updates = [k for k in fp8.kernels if "fp8_scale_update" in k.op_name]
  assert len(casts) == 3 and len(updates) == 1, fp8.table()
  assert fp8.non_gemm_launches == bf16.non_gemm_launches + 4 + 4, (fp8.table(), bf16.table())


@pytest.mark.parametrize("recipe", [DELAYED, CURRENT], ids=["delayed", "current"])
def test_data_parallel_quantizes_each_shard_and_gathers_nothing(data_mesh, recipe):
  n = 1024  # rows per device
  fp8, bf16 = _dense_steps(DEVICES * n, n, recipe, data_mesh, P("data", None), P())
  assert not _collectives(fp8, "all-gather"), fp8.table()
  # Every GEMM works on the local shard: the same FLOPs as bf16's local GEMMs.
  gemms = [k for k in fp8.kernels if k.is_gemm]
  assert len(gemms) == 3 and all(k.gemm_dtype.startswith("f8") for k in gemms), fp8.table()
  assert all(k.flops == 2 * n ** 3 for k in gemms), fp8.table()
  # The fused kernels run, one per tensor, on the local shard (x and g: n x n each).
  casts = [k for k in fp8.kernels if "custom_partitioning" in k.op_name and k.category == "pallas"
           and k.bytes_in >= n * n * 2]
  # (Current scaling's amax reductions are XLA's, partitioned by XLA.)
  assert len(casts) == 3, fp8.table()
  # Beyond bf16's collectives, only the amaxes: a few scalars.
  assert _link_bytes(fp8) <= _link_bytes(bf16) + SCALAR_BYTES, (fp8.table(), bf16.table())


def test_data_parallel_fp8_layers_add_at_most_5_kernels_each(data_mesh):
  """3 cast kernels (as on one GPU), and the two sharded tensors' amaxes sliced out
  of the one combined all-reduce."""

  def steps(layers):
    params = [_spec(data_mesh, (512, 512), P())] * layers
    x = _spec(data_mesh, (DEVICES * 1024, 512), P("data", None))
    state = _replicated_state(data_mesh, jax.eval_shape(
        lambda: [fp8jax.init_dot_meta(DELAYED) for _ in range(layers)]))
    fp8 = cost(fp8jax.value_and_grad(fp8_stack_loss), params, state, x, target="deviceless")
    bf16 = cost(jax.value_and_grad(bf16_stack_loss), params, x, target="deviceless")
    return fp8, bf16

  extra = {}
  for layers in (1, 4):
    fp8, bf16 = steps(layers)
    extra[layers] = fp8.non_gemm_launches - bf16.non_gemm_launches
    # One all-reduce of amaxes per step, whatever the depth.
    assert len(_collectives(fp8, "all-reduce")) - len(_collectives(bf16, "all-reduce")) == 1, \
        (fp8.table(), bf16.table())
  assert (extra[4] - extra[1]) / 3 <= 5, extra


@pytest.mark.parametrize("n, at_least", [(8192, 1.6), (2048, 1.0)])
def test_data_parallel_delayed_scaling_is_predicted_faster_per_device(data_mesh, n, at_least):
  fp8, bf16 = _dense_steps(DEVICES * n, n, DELAYED, data_mesh, P("data", None), P())
  assert bf16.compute_time_s / fp8.compute_time_s >= at_least, (fp8.table(), bf16.table())


@pytest.mark.parametrize("n, at_least", [(8192, 1.5), (2048, 0.8)])
def test_data_parallel_current_scaling_pays_only_its_amax_all_reduces(data_mesh, n, at_least):
  """Current scaling needs each tensor's global amax before its cast: the sharded
  tensors' (x and g) go through a small all-reduce (with XLA's pack and slices
  around it) that the casts wait on. The one-GPU bounds of test_fp8_budgets are
  1.5x and 0.85x; at 2048 those launches cost 0.90x -> 0.85x, hence 0.8x here."""
  fp8, bf16 = _dense_steps(DEVICES * n, n, CURRENT, data_mesh, P("data", None), P())
  assert bf16.compute_time_s / fp8.compute_time_s >= at_least, (fp8.table(), bf16.table())


@pytest.mark.parametrize("recipe", [DELAYED, CURRENT], ids=["delayed", "current"])
def test_fsdp_gathers_the_weight_once_in_fp8(data_mesh, recipe):
  n = 2048
  fp8, bf16 = _dense_steps(DEVICES * n, n, recipe, data_mesh, P("data", None), P("data", None))
  gathers = _collectives(fp8, "all-gather")
  assert len(gathers) == 1, fp8.table()
  hlo_gathers = [line for line in _hlo(recipe, data_mesh, n).splitlines()
                 if " all-gather-start(" in line]
  assert len(hlo_gathers) == 1 and "f8e4m3fn" in hlo_gathers[0] and "bf16" not in \
      hlo_gathers[0], hlo_gathers
  # One FP8 copy of the weight (n x n bytes) crosses NVLink, half of bf16's gather:
  # each device receives the 7/8 of it it does not hold.
  sent = (gathers[0].time_s - fp8.constants.kernel_overhead_s) * fp8.constants.link_bytes_per_s
  assert sent == pytest.approx(n * n * (DEVICES - 1) / DEVICES, rel=1e-9), fp8.table()
  assert _link_bytes(fp8) < _link_bytes(bf16), (fp8.table(), bf16.table())
  bound = 1.0 if recipe == DELAYED else 0.70
  assert bf16.compute_time_s / fp8.compute_time_s >= bound, (fp8.table(), bf16.table())


def _stacked_fp8_dense_step(x, kernel, g, meta):
  """`fp8_dense_step` traced as a layer of a stack (`fused_kernels.stacked_state`): its
  casts read the state's scalars packed in one vector, a rank-1 operand of the weight
  cast's partitioning rule."""
  with fused_kernels.stacked_state():
    return fp8_dense_step(x, kernel, g, meta)


@pytest.mark.parametrize("recipe", [DELAYED, CURRENT], ids=["delayed", "current"])
def test_fsdp_layer_of_a_stack_casts_its_weight_shard_with_packed_scales(data_mesh, recipe):
  """Inside `stacked_state()` the FSDP step partitions as outside it: one all-gather of
  the FP8 weight, the same GEMMs, and the same other kernels plus the one that packs the
  scales (here the state is a whole array, no slice of a stack, so packing saves nothing;
  in a stack it saves a launch per scale and layer, `test_fp8_budgets`)."""
  n = 2048
  x = _spec(data_mesh, (DEVICES * n, n), P("data", None))
  kernel = _spec(data_mesh, (n, n), P("data", None))
  meta = _replicated_state(data_mesh, jax.eval_shape(lambda: fp8jax.init_dot_meta(recipe)))
  plain, stacked = (cost(step, x, kernel, x, meta, target="deviceless")
                    for step in (fp8_dense_step, _stacked_fp8_dense_step))
  gathers = _collectives(stacked, "all-gather")
  assert len(gathers) == 1 and len(_collectives(plain, "all-gather")) == 1, stacked.table()
  assert stacked.non_gemm_launches == plain.non_gemm_launches + 1, (stacked.table(),
                                                                     plain.table())
  assert stacked.gemm_launches == plain.gemm_launches == 3


def _hlo(recipe, mesh, n):
  x = _spec(mesh, (DEVICES * n, n), P("data", None))
  kernel = _spec(mesh, (n, n), P("data", None))
  meta = _replicated_state(mesh, jax.eval_shape(lambda: fp8jax.init_dot_meta(recipe)))

  def loss(kernel, meta, x):
    y, meta = fp8jax.fp8_dense(x, kernel, None, meta)
    return jnp.mean(y.astype(jnp.float32) ** 2), meta

  step = fp8jax.value_and_grad(loss)
  return deviceless.compile_for_h100(
      step, kernel, meta, x, compiler_options={"xla_gpu_enable_triton_gemm": False}).as_text()


def _shard_map_dense_steps(n, recipe, mesh):
  """The data-parallel `fp8_dense` layer written per device, as the scaling-out guide's shard_map
  recipe has it: `fp8jax.value_and_grad` inside `jax.shard_map` over "data", x and
  the kernel differentiated (so fprop, dgrad and wgrad GEMMs all run), the loss a
  global sum whose output gradient is g; and the same step in bf16."""
  x = _spec(mesh, (DEVICES * n, n), P("data", None))
  kernel = _spec(mesh, (n, n), P())
  g = _spec(mesh, (DEVICES * n, n), P("data", None))
  meta = _replicated_state(mesh, jax.eval_shape(lambda: fp8jax.init_dot_meta(recipe)))

  def fp8_loss(params, meta, g):
    y, meta = fp8jax.fp8_dense(*params, None, meta)
    return jax.lax.psum(jnp.sum(y.astype(jnp.float32) * g.astype(jnp.float32)), "data"), meta

  def bf16_loss(params, g):
    x, kernel = params
    return jax.lax.psum(jnp.sum((x @ kernel).astype(jnp.float32) * g.astype(jnp.float32)),
                        "data")

  params_spec = (P("data", None), P())
  fp8_step = jax.shard_map(fp8jax.value_and_grad(fp8_loss), mesh=mesh,
                           in_specs=(params_spec, P(), P("data", None)),
                           out_specs=(P(), params_spec, P()))
  bf16_step = jax.shard_map(jax.value_and_grad(bf16_loss), mesh=mesh,
                            in_specs=(params_spec, P("data", None)),
                            out_specs=(P(), params_spec))
  fp8 = cost(fp8_step, (x, kernel), meta, g, target="deviceless", label="fp8")
  bf16 = cost(bf16_step, (x, kernel), g, target="deviceless", label="bf16")
  return fp8, bf16


@pytest.mark.parametrize("recipe", [DELAYED, CURRENT], ids=["delayed", "current"])
def test_shard_map_runs_the_fused_kernels_on_each_devices_arrays(data_mesh, recipe):
  n = 1024  # rows per device
  fp8, bf16 = _shard_map_dense_steps(n, recipe, data_mesh)
  assert not _collectives(fp8, "all-gather"), fp8.table()
  gemms = [k for k in fp8.kernels if k.is_gemm]
  assert len(gemms) == 3 and all(k.gemm_dtype.startswith("f8") for k in gemms), fp8.table()
  assert all(k.flops == 2 * n ** 3 for k in gemms), fp8.table()
  # One Pallas cast kernel per tensor (x, kernel, g: n x n each on every device),
  # current scaling's amax reduction before each, and one kernel for the state update.
  casts = [k for k in fp8.kernels if "cast_transpose_amax" in k.op_name and
           k.category == "pallas" and k.bytes_in >= n * n * 2]
  amax_passes = [k for k in fp8.kernels if is_amax_reduction(k) and k.bytes_in >= n * n * 2]
  updates = [k for k in fp8.kernels if "fp8_scale_update" in k.op_name]
  assert len(casts) == 3 and len(updates) == 1, fp8.table()
  assert len(amax_passes) == (3 if recipe == CURRENT else 0), fp8.table()
  # Beyond bf16's collectives: the FP8 state's pmax at the step's end (its
  # histories ride along: shard_map types the whole state as per device), and
  # for current scaling each tensor's amax before its cast.
  state_bytes = 2 * sum(leaf.size * 4 for leaf in jax.tree.leaves(
      jax.eval_shape(lambda: fp8jax.init_dot_meta(recipe))))  # forward and backward
  assert _link_bytes(fp8) <= _link_bytes(bf16) + 2 * state_bytes + SCALAR_BYTES, fp8.table()


def test_shard_map_fp8_layers_add_at_most_3_kernels_each(data_mesh):
  """As on one GPU: 3 cast kernels per layer; the state's one pmax, its packing and
  the update are per step."""

  def steps(layers):
    params = [_spec(data_mesh, (512, 512), P())] * layers
    x = _spec(data_mesh, (DEVICES * 1024, 512), P("data", None))
    state = _replicated_state(data_mesh, jax.eval_shape(
        lambda: [fp8jax.init_dot_meta(DELAYED) for _ in range(layers)]))

    def fp8_loss(params, state, x):
      loss, state = fp8_stack_loss(params, state, x)
      return jax.lax.psum(loss, "data") / DEVICES, state

    def bf16_loss(params, x):
      return jax.lax.psum(bf16_stack_loss(params, x), "data") / DEVICES

    fp8_step = jax.shard_map(fp8jax.value_and_grad(fp8_loss), mesh=data_mesh,
                             in_specs=(P(), P(), P("data", None)), out_specs=(P(), P(), P()))
    bf16_step = jax.shard_map(jax.value_and_grad(bf16_loss), mesh=data_mesh,
                              in_specs=(P(), P("data", None)), out_specs=(P(), P()))
    return (cost(fp8_step, params, state, x, target="deviceless"),
            cost(bf16_step, params, x, target="deviceless"))

  extra = {}
  for layers in (1, 4):
    fp8, bf16 = steps(layers)
    extra[layers] = fp8.non_gemm_launches - bf16.non_gemm_launches
    assert sum("fp8_scale_update" in k.op_name for k in fp8.kernels) == 1, fp8.table()
    # One pmax of the FP8 state per step, whatever the depth.
    assert len(_collectives(fp8, "all-reduce")) - len(_collectives(bf16, "all-reduce")) == 1, \
        (fp8.table(), bf16.table())
  assert (extra[4] - extra[1]) / 3 <= 3, extra


@pytest.mark.parametrize("n, at_least", [(8192, 1.6), (2048, 1.0)])
def test_shard_map_delayed_scaling_is_predicted_faster_per_device(data_mesh, n, at_least):
  fp8, bf16 = _shard_map_dense_steps(n, DELAYED, data_mesh)
  assert bf16.compute_time_s / fp8.compute_time_s >= at_least, (fp8.table(), bf16.table())


def test_data_by_model_mesh_runs_no_gemm_on_gathered_activations():
  mesh = deviceless.h100_mesh(data=4, model=2)
  n = 1024  # rows per data shard; the kernel's output axis is split over "model"
  fp8, bf16 = _dense_steps(4 * n, n, DELAYED, mesh, P("data", None), P(None, "model"),
                           g_spec=P("data", "model"))
  assert not _collectives(fp8, "all-gather"), fp8.table()
  gemms = [k for k in fp8.kernels if k.is_gemm]
  assert len(gemms) == 3 and all(k.gemm_dtype.startswith("f8") for k in gemms), fp8.table()
  assert all(k.flops == 2 * n * n * (n // 2) for k in gemms), fp8.table()
  assert _link_bytes(fp8) <= _link_bytes(bf16) + SCALAR_BYTES, (fp8.table(), bf16.table())
