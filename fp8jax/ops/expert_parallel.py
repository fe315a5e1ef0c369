"""Expert parallelism: a MoE layer's experts split over a mesh axis, tokens sent in FP8.

Inside `jax.shard_map` over an expert axis of n devices, each device holds E / n
experts (its slice of `w_in [E, d, h]` and `w_out [E, h, d]`) and its own tokens. After
routing and sorting its (token, expert) pairs by expert (`fp8jax.ops.moe_routing`),
`expert_parallel_mlp`

1. tells every device how many pairs it will get for each of its experts (one
   all-to-all of a few integers: `plan_dispatch`);
2. dispatches the pairs to the devices that hold their experts: an all-to-all of the
   rows only (on a GPU `jax.lax.ragged_all_to_all`: each device's rows for device j go
   to j and nothing else moves; elsewhere a padded `all_to_all`, the same result). Where
   the recipe allows, the rows travel in FP8 with their scales (half of bf16's bytes),
   as DeepSeek-V3 dispatches: per-tensor delayed scaling (one scale, the replicated
   state's, on every device) and the per-row / per-block recipes (each row's scales
   travel with it). The receiving expert GEMM quantizes the rows again with the same
   scales, which gives back the very FP8 values that were sent;
3. runs its experts' MLPs on the rows it received (two `fp8_ragged_dot`s with its
   experts' slice of the FP8 state), and
4. sends each output row back to the device that owns the token (in the input dtype,
   as DeepSeek-V3 combines in bf16).

With FSDP over another mesh axis (`fsdp_axis`) each device holds a slice of its
experts' weights, gathered before the GEMMs in FP8 with their scales (half of bf16's
bytes; per-tensor delayed and per-block recipes) and reduce-scattered in the backward.

The FP8 state stays replicated: each device records its experts' amaxes in its slice,
the rows' amax before they are sent, and `fp8jax.value_and_grad`'s all-reduce (a max)
makes them global, so the state after a step is the one a single device computes.

Dropless: a device can receive up to n times its own pair count (every device's pairs
for its experts); the receive buffer has that size, and rows past what arrived are zero.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from fp8jax.core.blocks import BlockQuantized, dequantize_blocks
from fp8jax.core.meta import RaggedDotMeta, record_amax
from fp8jax.core.quantize import amax, amax_max, max_by_bits, quantize
from fp8jax.mesh.axes import vary, varying_axes
from fp8jax.ops.ragged_dot import fp8_ragged_dot


class DispatchPlan(NamedTuple):
  """Who sends how many (token, expert) pairs to whom; all int32.

  Attributes:
    send_counts: [n], the pairs this device sends to each device.
    send_offsets: [n], where those start among this device's sorted pairs.
    recv_counts: [n], the pairs each device sends here.
    recv_expert_counts: [n, E / n], of those, how many for each of this device's experts.
    return_offsets: [n], where this device's pairs started among each device's sorted
      pairs (where the outputs go back to).
  """

  send_counts: jax.Array
  send_offsets: jax.Array
  recv_counts: jax.Array
  recv_expert_counts: jax.Array
  return_offsets: jax.Array


def plan_dispatch(group_sizes: jax.Array, axis_name: str) -> DispatchPlan:
  """Who sends how many pairs to whom (one all-to-all of a few integers).

  Args:
    group_sizes: int32 [E], this device's pairs per expert (sorted by expert); the
      experts are split evenly over `axis_name`, in order.
    axis_name: the expert axis.

  Returns:
    The `DispatchPlan` (int32 arrays of n and [n, E / n] entries).
  """
  n = jax.lax.axis_size(axis_name)
  per_device = group_sizes.astype(jnp.int32).reshape(n, -1)  # [n, E / n]
  send_counts = jnp.sum(per_device, axis=1)
  send_offsets = jnp.cumsum(send_counts) - send_counts

  def exchange(x):  # row j goes to device j; row s of the result came from device s
    return jax.lax.all_to_all(x, axis_name, split_axis=0, concat_axis=0, tiled=True)

  recv_expert_counts = exchange(per_device)
  return DispatchPlan(send_counts=send_counts, send_offsets=send_offsets,
                      recv_counts=jnp.sum(recv_expert_counts, axis=1),
                      recv_expert_counts=recv_expert_counts,
                      return_offsets=exchange(send_offsets[:, None])[:, 0])


# ----- moving rows: to the experts' devices and back ---------------------------------------


def _to_experts(x, plan: DispatchPlan, axis_name: str):
  """[P, ...] sorted pairs -> [n * P, ...]: device s's rows at [s * P, s * P + recv[s])."""
  n, rows = jax.lax.axis_size(axis_name), x.shape[0]

  def ragged(x, plan):
    me = jax.lax.axis_index(axis_name)
    # The buffer it fills differs per device: typed so (shard_map's varying axes).
    out = vary(jnp.zeros((n * rows,) + x.shape[1:], x.dtype),
               varying_axes(x) | {axis_name})
    return jax.lax.ragged_all_to_all(
        x, out, plan.send_offsets, plan.send_counts,
        jnp.full((n,), me * rows, jnp.int32), plan.recv_counts, axis_name=axis_name)

  def padded(x, plan):
    destination, rank = _slots(plan.send_counts, plan.send_offsets, rows)
    buffer = jnp.zeros((n, rows) + x.shape[1:], x.dtype).at[destination, rank].set(
        x, mode="drop")
    received = jax.lax.all_to_all(buffer, axis_name, split_axis=0, concat_axis=0,
                                  tiled=True)
    return received.reshape((n * rows,) + x.shape[1:])

  return jax.lax.platform_dependent(x, plan, cuda=ragged, default=padded)


def _from_experts(y, plan: DispatchPlan, axis_name: str):
  """The inverse of `_to_experts`: [n * P, ...] -> [P, ...] in this device's pair order."""
  n = jax.lax.axis_size(axis_name)
  rows = y.shape[0] // n

  def ragged(y, plan):
    out = vary(jnp.zeros((rows,) + y.shape[1:], y.dtype), varying_axes(y) | {axis_name})
    return jax.lax.ragged_all_to_all(
        y, out, jnp.arange(n, dtype=jnp.int32) * rows, plan.recv_counts,
        plan.return_offsets, plan.send_counts, axis_name=axis_name)

  def padded(y, plan):
    back = jax.lax.all_to_all(y.reshape((n, rows) + y.shape[1:]), axis_name, split_axis=0,
                              concat_axis=0, tiled=True)
    destination, rank = _slots(plan.send_counts, plan.send_offsets, rows)
    valid = jnp.arange(rows) < jnp.sum(plan.send_counts)
    picked = back[jnp.minimum(destination, n - 1), jnp.minimum(rank, rows - 1)]
    return jnp.where(valid.reshape((rows,) + (1,) * (y.ndim - 1)), picked, 0)

  return jax.lax.platform_dependent(y, plan, cuda=ragged, default=padded)


def _slots(counts, offsets, rows: int):
  """For each of `rows` sorted pairs: its destination device and its rank among the pairs
  sent there (the destination is n, out of range, for rows past the pairs)."""
  index = jnp.arange(rows, dtype=jnp.int32)
  destination = jnp.searchsorted(jnp.cumsum(counts), index, side="right").astype(jnp.int32)
  rank = index - offsets[jnp.minimum(destination, counts.shape[0] - 1)]
  return destination, rank


def send(x, plan, axis_name):
  """The rows to their experts' devices; its transpose (the backward) sends them back.

  Returns:
    [n * P, ...] in x's dtype: device s's rows at [s * P, s * P + plan.recv_counts[s]),
    zeros elsewhere.
  """
  return _move(x, plan, axis_name, False)


def send_back(y, plan, axis_name):
  """The outputs back to the tokens' devices; its transpose (the backward) is `send`.

  Returns:
    [P, ...] in y's dtype, in this device's sorted pair order.
  """
  return _move(y, plan, axis_name, True)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _move(x, plan, axis_name, back):
  return (_from_experts if back else _to_experts)(x, plan, axis_name)


def _move_fwd(x, plan, axis_name, back):
  return _move(x, plan, axis_name, back), plan


def _move_bwd(axis_name, back, plan, g):  # each direction is the other's transpose
  return (_to_experts if back else _from_experts)(g, plan, axis_name), None


_move.defvjp(_move_fwd, _move_bwd)


# ----- FP8 dispatch ------------------------------------------------------------------------


def fp8_dispatch_allowed(meta: RaggedDotMeta) -> bool:
  """Whether the rows can travel in FP8 and the expert GEMM recover those very values.

  Returns:
    True for one stored scale on every device (delayed scaling) and for scales per row
    (per-row and per-block recipes, whose activation blocks along K lie within a row);
    False for current scaling and a high-precision fprop.
  """
  recipe = meta.recipe
  if "fprop" in recipe.high_precision:
    return False
  return recipe.per_operand or not recipe.scales_from_tensor


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def send_fp8(x, plan, meta, axis_name):
  """`send(x)` with the rows in FP8 on the wire (cast as the first expert GEMM casts x).

  The backward sends the cotangent back in its own dtype (a straight-through cast).

  Returns:
    As `send`, the rows dequantized on arrival to x's dtype.
  """
  return _send_fp8_fwd(x, plan, meta, axis_name)[0]


def _send_fp8_fwd(x, plan, meta, axis_name):
  recipe = meta.recipe
  if recipe.per_operand:
    rows = recipe.quantize_operand(x, meta.x.fmt, axis=-1, weight=False)
    q = send(rows.q, plan, axis_name)
    scale_inv = send(rows.scale_inv, plan, axis_name)
    out = dequantize_blocks(BlockQuantized(q, scale_inv, rows.block), x.dtype)
  else:
    q = send(quantize(x, meta.x.scale, meta.x.fmt), plan, axis_name)
    out = (q.astype(jnp.float32) * meta.x.scale_inv).astype(x.dtype)
  return out, plan


def _send_fp8_bwd(axis_name, plan, g):
  return _from_experts(g, plan, axis_name), None, None


send_fp8.defvjp(_send_fp8_fwd, _send_fp8_bwd)


# ----- FSDP: expert weights gathered in FP8 ------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def gather_experts(w, meta, axis_name):
  """This device's experts' weights whole, gathered over `axis_name` (FSDP).

  `axis_name` splits their contracted axis (1). They travel in FP8 where the recipe
  allows (as the activations do) and are dequantized on arrival. The backward
  reduce-scatters the gradient in its own dtype.

  Returns:
    [E_local, K, N] in w's dtype.
  """
  return _gather_experts_fwd(w, meta, axis_name)[0]


def _gather_experts_fwd(w, meta, axis_name):
  recipe = meta.recipe
  gather = lambda a: jax.lax.all_gather(a, axis_name, axis=1, tiled=True)
  if recipe.per_operand and _blocks_within_shard(w, meta, axis_name):
    blocks = recipe.quantize_operand(w, meta.kernel.fmt, axis=-2, weight=True)
    whole = BlockQuantized(gather(blocks.q), gather(blocks.scale_inv), blocks.block)
    out = dequantize_blocks(whole, w.dtype)
  elif not recipe.scales_from_tensor:
    scale = meta.kernel.scale[:, None, None]
    q = gather(quantize(w, scale, meta.kernel.fmt))
    out = (q.astype(jnp.float32) * meta.kernel.scale_inv[:, None, None]).astype(w.dtype)
  else:  # a scale per device's shard would not be the whole weight's: gather as it is
    out = gather(w)
  return out, None


def _blocks_within_shard(w, meta, axis_name) -> bool:
  """Whether the recipe's weight blocks of the whole weight lie within one device's shard
  (DeepSeek-V3's 128 x 128 blocks do when the shard is a multiple of 128 long; a
  per-column scale over the whole contraction does not)."""
  whole_shape = (w.shape[0], w.shape[1] * jax.lax.axis_size(axis_name)) + w.shape[2:]
  block_of = lambda shape: jax.eval_shape(lambda: meta.recipe.quantize_operand(
      jnp.zeros(shape, w.dtype), meta.kernel.fmt, axis=-2, weight=True)).block
  whole = block_of(whole_shape)
  return whole == block_of(w.shape) and w.shape[1] % whole[0] == 0


def _gather_experts_bwd(axis_name, _, g):
  return jax.lax.psum_scatter(g, axis_name, scatter_dimension=1, tiled=True), None


gather_experts.defvjp(_gather_experts_fwd, _gather_experts_bwd)


# ----- the experts' MLP --------------------------------------------------------------------


def expert_parallel_mlp(x_sorted: jax.Array, group_sizes: jax.Array, w_in: jax.Array,
                        w_out: jax.Array, meta_in: RaggedDotMeta | None,
                        meta_out: RaggedDotMeta | None, *, axis_name: str,
                        activation: Callable = jax.nn.gelu, fsdp_axis: str | None = None):
  """The experts' MLP of one device's sorted pairs, experts split over `axis_name`.

  Call it inside `jax.shard_map` over `axis_name` (module docstring).

  Args:
    x_sorted: [P, d], this device's (token, expert) pairs sorted by expert
      (`moe_routing.sort_by_expert`).
    group_sizes: int32 [E], this device's pairs per expert (all E experts).
    w_in, w_out: this device's experts: [E / n, d, h] and [E / n, h, d] (shard_map's
      in_specs split the experts' axis over `axis_name`).
    meta_in, meta_out: the two grouped matmuls' `RaggedDotMeta`s for all E experts,
      replicated (in_specs P()); None for both: the GEMMs run as `jax.lax.ragged_dot`
      in the input dtype (no FP8 anywhere).
    axis_name: the expert axis.
    activation: the experts' non-linearity.
    fsdp_axis: a mesh axis that also splits each expert's weights along their first
      (contracted) feature axis (FSDP): they are gathered over it in FP8 with their
      scales where the recipe allows (`gather_experts`).

  Returns:
    (y_sorted [P, d] in x's dtype: each pair's expert output, in x_sorted's order;
    new_meta_in, new_meta_out: the states with this device's records, all E experts
    long; None without FP8).
  """
  n = jax.lax.axis_size(axis_name)
  local = w_in.shape[0]
  if group_sizes.shape != (n * local,):
    raise ValueError(
        f"group_sizes has shape {group_sizes.shape}, but {n} devices of {axis_name!r} with "
        f"{local} experts each hold {n * local}: pass this device's pair counts for every "
        "expert, and split the experts' axis of w_in and w_out evenly over the axis.")
  plan = plan_dispatch(group_sizes, axis_name)
  fp8 = meta_in is not None
  if fp8 and fp8_dispatch_allowed(meta_in):
    received = send_fp8(x_sorted, plan, meta_in, axis_name)
  else:
    received = send(x_sorted, plan, axis_name)
  order, local_sizes = _local_order(plan, x_sorted.shape[0])
  x_local = received[order]
  if not fp8:
    if fsdp_axis is not None:
      w_in, w_out = (jax.lax.all_gather(w, fsdp_axis, axis=1, tiled=True)
                     for w in (w_in, w_out))
    h = jax.lax.ragged_dot(x_local, w_in.astype(x_local.dtype), local_sizes)
    y_local = jax.lax.ragged_dot(activation(h), w_out.astype(x_local.dtype), local_sizes)
    new_in = new_out = None
  else:
    first = jax.lax.axis_index(axis_name) * local
    meta_in_local = _experts_slice(meta_in, first, local)
    meta_out_local = _experts_slice(meta_out, first, local)
    if fsdp_axis is not None:
      shard_amaxes = [max_by_bits(jnp.abs(w.astype(jnp.float32)), axis=(1, 2))
                      for w in (w_in, w_out)]
      w_in = gather_experts(w_in, meta_in_local, fsdp_axis)
      w_out = gather_experts(w_out, meta_out_local, fsdp_axis)
    h, in_local = fp8_ragged_dot(x_local, w_in.astype(x_local.dtype), local_sizes,
                                 meta_in_local)
    y_local, out_local = fp8_ragged_dot(activation(h), w_out.astype(h.dtype), local_sizes,
                                        meta_out_local)
    if fsdp_axis is not None:
      # The weights' amaxes as they are, before the gather rounded them to FP8 (the
      # step's all-reduce makes each shard's the whole weight's).
      in_local, out_local = (
          _with_weight_amax(state, before, amax_, local_sizes)
          for state, before, amax_ in ((in_local, meta_in_local, shard_amaxes[0]),
                                       (out_local, meta_out_local, shard_amaxes[1])))
    # The rows' amax as they were before the trip (the trip rounds them to FP8).
    in_local = dataclasses.replace(in_local, x=record_amax(meta_in.x, amax(x_sorted)))
    new_in = _experts_update(meta_in, in_local, first)
    new_out = _experts_update(meta_out, out_local, first)
  y_received = jnp.zeros_like(y_local).at[order].set(y_local, unique_indices=True)
  return send_back(y_received, plan, axis_name).astype(x_sorted.dtype), new_in, new_out


def _local_order(plan: DispatchPlan, rows: int):
  """The order that sorts the received rows by this device's experts (rows that did not
  arrive last), and the rows per expert."""
  n, local = plan.recv_expert_counts.shape
  slot = jnp.arange(rows, dtype=jnp.int32)
  ends = jnp.cumsum(plan.recv_expert_counts, axis=1)  # [n, local]
  expert = jax.vmap(lambda e: jnp.searchsorted(e, slot, side="right"))(ends)  # [n, rows]
  expert = jnp.where(slot[None, :] < plan.recv_counts[:, None], expert, local)
  order = jnp.argsort(expert.reshape(-1), stable=True).astype(jnp.int32)
  return order, jnp.sum(plan.recv_expert_counts, axis=0).astype(jnp.int32)


def _with_weight_amax(state: RaggedDotMeta, before: RaggedDotMeta, weight_amax,
                      group_sizes) -> RaggedDotMeta:
  """`state` with its experts' weight amaxes recorded from `weight_amax` (0 for an expert
  without rows) instead of what the op saw."""
  recorded = record_amax(before.kernel, jnp.where(group_sizes > 0, weight_amax, 0.0))
  return dataclasses.replace(state, kernel=recorded)


def _experts_slice(meta: RaggedDotMeta, first, count: int) -> RaggedDotMeta:
  kernel = jax.tree.map(lambda a: jax.lax.dynamic_slice_in_dim(a, first, count), meta.kernel)
  return dataclasses.replace(meta, kernel=kernel)


def _experts_update(meta: RaggedDotMeta, local: RaggedDotMeta, first) -> RaggedDotMeta:
  """All experts' state with this device's experts' running amaxes recorded."""
  recorded = jax.lax.dynamic_update_slice_in_dim(
      meta.kernel.amax, amax_max(jax.lax.dynamic_slice_in_dim(
          meta.kernel.amax, first, local.kernel.amax.shape[0]), local.kernel.amax), first, 0)
  return dataclasses.replace(local, kernel=dataclasses.replace(meta.kernel, amax=recorded))
