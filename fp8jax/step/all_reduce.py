"""FP8 state on a device mesh: a step's amaxes made global, replicated state.

The amax that FP8 scaling needs is the amax of the *logical* tensor, and the
FP8 state (scales, histories) is the same on every device. How that comes about
depends on how the step is partitioned:

* Plain `jax.jit` with sharded inputs on a mesh of `AxisType.Auto` axes
  (GSPMD): every array is a global array, so `max(abs(x))` is already the
  global amax and nothing here is needed.
* Plain `jax.jit` on a mesh of `AxisType.Explicit` axes (shardings in the
  types; with `jax.set_mesh` or arrays placed with `NamedSharding` alone): the
  amaxes are global as above. There `fp8_dense`, `fp8_dot_general` and
  `fp8_einsum` with per-tensor recipes (`DelayedScaling`, `CurrentScaling`, a
  recipe of your own) train data parallel (batch split, kernels replicated)
  and FSDP (kernels also split on their rows over the batch axes), giving the
  one-device FP8 state: each GEMM names the sharding of its product, a
  gradient that of its parameter (`fp8jax.mesh.explicit`). Other kernel
  shardings (tensor parallelism) follow the same rule but are not yet covered
  by tests. Unlike on Auto axes, fp8jax's fused FP8 kernels do not run on
  explicitly sharded tensors (the jnp form runs, with a warning on a GPU;
  `fused_kernels(True)` raises ValueError), attention runs its "xla" backend
  only (asking for another raises ValueError), and per-row / per-block recipes
  (`RowwiseScaling`, `BlockScaling`, `MXFP8Scaling`) raise ValueError: use Auto
  axes for those.
* `jax.shard_map` (per-device code): each device sees only its shard, so a
  local amax is a shard's amax. fp8jax handles this from the types that
  shard_map gives values (`check_vma=True`, the default): JAX records along
  which mesh axes a value is *device-varying*. The FP8 ops record local
  amaxes; `fp8jax.value_and_grad` / `accumulate_gradients` then reduce the
  whole in-step state with one `pmax` over the axes along which it became
  varying, before `end_step`. Current scaling, whose scale must be known before
  the cast, takes a `pmax` of the tensor's amax over the axes along which the
  tensor varies right there. Both give bit-for-bit the amax of the logical
  tensor (a max does not depend on reduction order).
* `shard_map(..., check_vma=False)` (or `pmap`): JAX no longer knows what is
  sharded. Pass `axis_name=` to `fp8jax.value_and_grad` /
  `accumulate_gradients`; delayed scaling is then exact. Current scaling then
  scales each shard by its own amax (a valid FP8 quantization, but not the
  one a single device computes); use delayed scaling or `check_vma=True`.
  A step traced per device over manual axes that nothing reduces the amaxes
  over warns (`warn_if_amaxes_stay_local`).

Gradients are *sums* over devices, amaxes are *maxes*. The FP8 state reaches
the custom VJP of `fp8_dot_general` as an input whose cotangent is the next
state, so where shard_map would make that cotangent a sum over devices (the
transpose of broadcasting a replicated value), fp8jax takes a max instead
(`fp8jax.mesh.axes.match_operand_axes`).
"""
from __future__ import annotations

import warnings
from typing import Any

import jax
import jax.numpy as jnp

from fp8jax.core.meta import check_fp8_state, is_meta
from fp8jax.mesh.axes import (AxisName, describe_axes, manual_axes, normalize_axis_name,
                              types_recorded, vary, varying_axes)


def all_reduce_amax(fp8_state: Any, axis_name: AxisName = None) -> Any:
  """Makes an in-step FP8 state global: every recorded amax becomes the max over devices.

  Call it between the last FP8 op of a step and `fp8jax.end_step` when writing
  a step by hand inside `shard_map`; `fp8jax.value_and_grad` and
  `accumulate_gradients` call it for you. All leaves travel in a single `pmax`.
  The running amax (each meta's `amax`) becomes the max over devices; every other
  leaf is identical on all devices (it came from the replicated state) and is
  unchanged, but is afterwards typed as replicated again.

  Args:
    fp8_state: pytree of `Fp8Meta` (an open step's state, e.g. after `merge_step`).
    axis_name: mesh axes to reduce over, in addition to every axis along which
      the state is device-varying (which `shard_map` records when
      `check_vma=True`). Needed with `check_vma=False` and under `pmap`.

  Returns:
    The same structure, identical on all devices of those axes.

  Raises:
    ValueError: `axis_name` names an axis that is not bound (e.g. called
      outside `shard_map`; under plain `jit` the amaxes are already global).
  """
  check_fp8_state(fp8_state, "fp8_state")
  names = normalize_axis_name(axis_name)
  axes = tuple(sorted(set(names) | varying_axes(fp8_state)))
  leaves, unflatten = _fields_first(fp8_state)
  if not axes or not leaves:
    return fp8_state
  # The float32 fields travel in one pmax. A stochastic-rounding key (uint32, the same on
  # every device) takes a pmax of its own, and its cotangent (float0) none.
  floats = [i for i, leaf in enumerate(leaves) if jnp.issubdtype(leaf.dtype, jnp.floating)]
  keys = [i for i, leaf in enumerate(leaves) if jnp.issubdtype(leaf.dtype, jnp.integer)]
  shapes = [jnp.shape(leaves[i]) for i in floats]
  try:
    flat = jnp.concatenate([jnp.ravel(vary(leaves[i], frozenset(axes))) for i in floats])
    flat = jax.lax.pmax(flat, axes)
    reduced_keys = [jax.lax.pmax(vary(leaves[i], frozenset(axes)), axes) for i in keys]
  except NameError as error:
    raise ValueError(
        f"axis_name={axis_name!r}: {error} axis_name is for code inside jax.shard_map "
        "(or pmap) over a mesh with that axis. Under plain jax.jit with sharded arrays "
        "leave axis_name=None: the amax is already that of the global array.") from None
  sizes = [int(jnp.size(leaves[i])) for i in floats]
  offsets = [sum(sizes[:i]) for i in range(len(sizes))]
  reduced = list(leaves)
  for i, o, n, s in zip(floats, offsets, sizes, shapes):
    reduced[i] = flat[o:o + n].reshape(s)
  for i, key in zip(keys, reduced_keys):
    reduced[i] = key
  return unflatten(reduced)


def _fields_first(fp8_state):
  """The state's arrays ordered field by field (every meta's amax, then every meta's
  history, ...), and the function that rebuilds the state from that list.

  So each field of all roles is one contiguous range of the all-reduced vector,
  which the state update reads packed, without slicing it per role."""
  metas, treedef = jax.tree.flatten(fp8_state, is_leaf=is_meta)
  fields = [jax.tree.flatten(meta) for meta in metas]
  order = sorted((k, m) for m, (leaves, _) in enumerate(fields) for k in range(len(leaves)))
  ordered = [fields[m][0][k] for k, m in order]

  def unflatten(arrays):
    per_meta = [list(leaves) for leaves, _ in fields]
    for (k, m), array in zip(order, arrays):
      per_meta[m][k] = array
    return jax.tree.unflatten(treedef, [meta_def.unflatten(leaves) for leaves, (_, meta_def)
                                        in zip(per_meta, fields)])

  return ordered, unflatten


def replicated(fp8_state: Any, mesh: jax.sharding.Mesh) -> Any:
  """`fp8_state` placed on every device of `mesh` (for `jax.jit` with sharded batches)."""
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  return jax.device_put(fp8_state, sharding)


def warn_if_amaxes_stay_local(where: str, axis_names: tuple, fp8_state) -> None:
  """Warns when the step runs per device over manual axes that nothing reduces the amaxes over.

  Args:
    where: the step function for the message, e.g. "fp8jax.value_and_grad".
    axis_names: the `axis_name`s it was given (normalized to a tuple).
    fp8_state: the state it closes (no warning for a model without FP8 state).
  """
  missing = tuple(name for name in manual_axes() if name not in axis_names)
  if not missing or not jax.tree.leaves(fp8_state) or types_recorded(missing):
    return
  given = "was given no axis_name"
  if axis_names:
    given = (f"its axis_name={_as_axis_name(axis_names)} does not name "
             f"{'it' if len(missing) == 1 else 'them'}")
  warnings.warn(
      f"{where} runs per device over {describe_axes(missing)} (jax.shard_map with "
      f"check_vma=False, or pmap) and {given}: JAX does not tell fp8jax what is sharded "
      "there, so no recorded amax is reduced over those devices and the FP8 state that comes "
      "out is one device's (the amax of its own shard, smaller than the whole tensor's). "
      f"Pass axis_name={_as_axis_name(axis_names + missing)} to {where} to combine the "
      "amaxes by max over the devices, or use jax.shard_map with check_vma=True (the "
      "default), where fp8jax finds the sharded axes itself.", stacklevel=3)


def _as_axis_name(axes: tuple) -> str:
  """How to pass `axes` as `axis_name=`: 'data' or ('data', 'model')."""
  return repr(axes[0]) if len(axes) == 1 else repr(tuple(axes))
