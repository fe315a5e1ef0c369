"""Expert parallelism: experts split over 8 devices inside shard_map, tokens dispatched in FP8.

Reference: the same MoE layer on one device (the global batch, all experts), as
fp8_ragged_dot computes it (for a per-block recipe, with the rows rounded to their FP8
tiles as the dispatch delivers them). On 8 CPU devices (tests/multidevice.py) the
dispatch is a padded all_to_all with the same result as the GPU's ragged_all_to_all; a
deviceless 8 x H100 compile (test_ragged_dot_lowering.py) shows what the GPUs run.
"""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp8jax
from fp8jax.core.blocks import dequantize_blocks
from fp8jax.core.meta import record_amax
from fp8jax.ops import expert_parallel, moe_routing
from multidevice import N_DEVICES, multidevice

D, HIDDEN, E, TOP_K, TOKENS_PER_DEVICE = 128, 256, 16, 2, 48  # 2 experts per device


def _problem():
  keys = jax.random.split(jax.random.key(0), 5)
  tokens = jax.random.normal(keys[0], (N_DEVICES * TOKENS_PER_DEVICE, D))
  router = jax.random.normal(keys[1], (D, E)) * 0.5
  scale = jnp.exp(jnp.linspace(-1.0, 1.0, E))[:, None, None]  # experts of other magnitudes
  w_in = jax.random.normal(keys[2], (E, D, HIDDEN)) * 0.1 * scale
  w_out = jax.random.normal(keys[3], (E, HIDDEN, D)) * 0.1 / scale
  target = jax.random.normal(keys[4], tokens.shape)
  return tokens, router, w_in, w_out, target


def _moe(tokens, router, w_in, w_out, meta_in, meta_out, mlp):
  routing = moe_routing.route_top_k(tokens @ router, TOP_K)
  x_sorted, sizes, order = moe_routing.sort_by_expert(tokens, routing.experts, E)
  y_sorted, meta_in, meta_out = mlp(x_sorted, sizes, w_in, w_out, meta_in, meta_out)
  return moe_routing.combine(y_sorted, order, routing.weights), meta_in, meta_out


def _one_device_mlp(x_sorted, sizes, w_in, w_out, meta_in, meta_out):
  if meta_in is None:
    h = jax.lax.ragged_dot(x_sorted, w_in, sizes)
    return jax.lax.ragged_dot(jax.nn.gelu(h), w_out, sizes), None, None
  x_in = x_sorted
  recipe = meta_in.recipe
  if recipe.per_operand:
    # What the FP8 dispatch delivers: the rows rounded to their 1 x 128 FP8 tiles (the
    # fprop GEMM gets back the same FP8 values; the wgrad GEMM, which tiles x along the
    # tokens instead, sees the rounded rows).
    x_in = dequantize_blocks(recipe.quantize_operand(x_sorted, meta_in.x.fmt, axis=-1,
                                                     weight=False), x_sorted.dtype)
  h, new_in = fp8jax.fp8_ragged_dot(x_in, w_in, sizes, meta_in)
  y, meta_out = fp8jax.fp8_ragged_dot(jax.nn.gelu(h), w_out, sizes, meta_out)
  # The rows' amax before the rounding, as the dispatching device records it.
  new_in = dataclasses.replace(new_in, x=record_amax(meta_in.x, fp8jax.amax(x_sorted)))
  return y, new_in, meta_out


def _step(mlp, recipe, params, tokens, target, metas):
  """One step of a mean-squared loss: (loss, grads, new FP8 state)."""
  def loss_fn(params, metas):
    y, meta_in, meta_out = _moe(tokens, params["router"], params["w_in"], params["w_out"],
                                metas["in"], metas["out"], mlp)
    return jnp.sum((y - target) ** 2), {"in": meta_in, "out": meta_out}
  return fp8jax.value_and_grad(loss_fn)(params, metas)


def _metas(recipe):
  return {"in": fp8jax.init_ragged_dot_meta(recipe, E),
          "out": fp8jax.init_ragged_dot_meta(recipe, E)}


def _expert_parallel(recipe, fsdp=False):
  """(loss, grads, state) of one step with the experts split 8 ways, or 4 ways with each
  expert's weights split 2 ways (FSDP) besides (the sum of the devices' losses is the
  global loss)."""
  from jax.sharding import PartitionSpec as P
  if fsdp:
    mesh = jax.make_mesh((N_DEVICES // 2, 2), ("expert", "data"))
    axes, weights = ("expert", "data"), P("expert", "data")
  else:
    mesh = jax.make_mesh((N_DEVICES,), ("expert",))
    axes, weights = ("expert",), P("expert")
  mlp = functools.partial(expert_parallel.expert_parallel_mlp, axis_name="expert",
                          fsdp_axis="data" if fsdp else None)

  def per_device(params, tokens, target, metas):
    # The router is replicated: shard_map's transpose sums its gradient over devices.
    loss, grads, state = _step(lambda *a: mlp(*a), recipe, params, tokens, target, metas)
    return jax.lax.psum(loss, axes), grads, state

  params_spec = {"router": P(), "w_in": weights, "w_out": weights}
  specs = (params_spec, P(axes), P(axes), P())
  step = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=specs,
                               out_specs=(P(), params_spec, P())))
  tokens, router, w_in, w_out, target = _problem()
  args = ({"router": router, "w_in": w_in, "w_out": w_out}, tokens, target, _metas(recipe))
  return step(*_placed(mesh, args, specs))


def _placed(mesh, args, specs):
  """`args` on the mesh as `specs` (a prefix tree of them) say: shard_map takes arrays
  already placed so."""
  from jax.sharding import NamedSharding, PartitionSpec
  shardings = jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs,
                           is_leaf=lambda x: isinstance(x, PartitionSpec))
  per_leaf = jax.tree.map(lambda sharding, arg: jax.tree.map(lambda _: sharding, arg),
                          shardings, args, is_leaf=lambda x: isinstance(x, NamedSharding))
  return jax.device_put(args, per_leaf)


def _one_device(recipe):
  tokens, router, w_in, w_out, target = _problem()
  return _step(_one_device_mlp, recipe, {"router": router, "w_in": w_in, "w_out": w_out},
               tokens, target, _metas(recipe))


def _assert_same_step(recipe, weight_gradient_tolerance=2e-3, fsdp=False):
  loss, grads, state = _expert_parallel(recipe, fsdp)
  want_loss, want_grads, want_state = _one_device(recipe)
  # The same FP8 values reach the same GEMMs; only float32 summation order may differ
  # (another row tiling of each expert's rows): a few float32 ulps, 1e-5 relative.
  np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-5)
  for name in ("w_in", "w_out", "router"):
    # Those ulps can move a rare gradient element across an E4M3 rounding boundary, one
    # FP8 step (1/8 of it) for that element and its column of dw: a few 1e-4 of the norm.
    tolerance = 2e-3 if name == "router" else weight_gradient_tolerance
    got, want = np.asarray(grads[name], np.float64), np.asarray(want_grads[name], np.float64)
    assert np.linalg.norm(got - want) <= tolerance * np.linalg.norm(want), name
  # The FP8 state after the step is the one-device state, bit for bit.
  for got, want in zip(jax.tree.leaves(state), jax.tree.leaves(want_state)):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@multidevice
def test_delayed_scaling_step_with_fp8_dispatch_equals_one_device():
  _assert_same_step(fp8jax.DelayedScaling(amax_history_len=4))


@multidevice
def test_block_scaling_step_with_fp8_dispatch_equals_one_device():
  """Forward and dgrad match as for delayed scaling; the weight gradient tiles x and dy
  along the tokens in 128-token blocks, and a device's rows (grouped from all devices)
  fall into other blocks than on one device: independent E4M3 roundings of both
  operands, ~5% RMS each in a sum of random-signed terms, so the two differ by up to
  ~7% of the norm; 0.1 bounds it (a wrong expert or scale gives ~1)."""
  _assert_same_step(fp8jax.BlockScaling(), weight_gradient_tolerance=0.1)


@multidevice
def test_with_expert_weights_gathered_in_fp8_over_an_fsdp_axis_the_step_equals_one_device():
  """Experts split 4 ways, each expert's weights 2 ways (FSDP): gathered in FP8 with the
  replicated per-expert scales, they reach the GEMMs as the very FP8 values one device
  casts, and the gradient is reduce-scattered back."""
  _assert_same_step(fp8jax.DelayedScaling(amax_history_len=4), fsdp=True)


@multidevice
def test_without_fp8_the_dispatch_is_the_high_precision_moe():
  loss, grads, _ = _expert_parallel_bf16()
  tokens, router, w_in, w_out, target = _problem()
  y, _, _ = _moe(tokens, router, w_in, w_out, None, None, _one_device_mlp)
  np.testing.assert_allclose(float(loss), float(jnp.sum((y - target) ** 2)), rtol=1e-5)


def _expert_parallel_bf16():
  from jax.sharding import PartitionSpec as P
  mesh = jax.make_mesh((N_DEVICES,), ("expert",))
  mlp = functools.partial(expert_parallel.expert_parallel_mlp, axis_name="expert")

  def per_device(params, tokens, target):
    y, _, _ = _moe(tokens, params["router"], params["w_in"], params["w_out"], None, None,
                   lambda *a: mlp(*a))
    return jax.lax.psum(jnp.sum((y - target) ** 2), "expert"), None, None

  params_spec = {"router": P(), "w_in": P("expert"), "w_out": P("expert")}
  tokens, router, w_in, w_out, target = _problem()
  specs = (params_spec, P("expert"), P("expert"))
  args = ({"router": router, "w_in": w_in, "w_out": w_out}, tokens, target)
  return jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=specs,
                               out_specs=(P(), None, None)))(*_placed(mesh, args, specs))
