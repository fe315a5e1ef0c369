"""The mesh axes a trace runs per device over, and FP8 state that shard_map split over them.

Inside `jax.shard_map` (and `pmap`) code is traced once for one device: the
mesh's *manual* axes are those along which each device holds only its part of a
value. fp8jax keeps FP8 state replicated (`fp8jax.sharding`), so a state whose
amax history arrives shorter than its recipe's by exactly the number of devices
along some manual axes was split by the `in_specs` given for it; that is what
the history-length errors of `fp8jax.meta` and `fp8jax.scaling` say then,
instead of suggesting `resize_history`.
"""
from __future__ import annotations

import itertools
import math

from pallas_kernels.varying import manual_axes  # {name: devices}, {} outside


def describe_axes(axes) -> str:
  """"the mesh axis 'data'" or "the mesh axes 'data', 'model'" (for messages)."""
  if len(axes) == 1:
    return f"the mesh axis {axes[0]!r}"
  return "the mesh axes " + ", ".join(repr(name) for name in axes)


def splitting_axes(local_len: int, full_len: int) -> tuple[str, ...]:
  """The manual mesh axes whose device counts multiply to `full_len / local_len`: over
  which a length-`full_len` axis was split when one device sees `local_len`; () if none.

  The fewest axes that do are returned (one is the common case: in_specs P("data")).
  """
  if local_len <= 0 or full_len <= local_len or full_len % local_len:
    return ()
  factor = full_len // local_len
  axes = manual_axes()
  for count in range(1, len(axes) + 1):
    for names in itertools.combinations(axes, count):
      if math.prod(axes[name] for name in names) == factor:
        return names
  return ()


def split_state_message(where: str, local_shape: tuple, recipe) -> str | None:
  """The error for an amax history that shard_map split over devices, or None.

  Args:
    where: the history's name for the message, e.g. "meta.x.amax_history".
    local_shape: its shape as this device sees it.
    recipe: the recipe of its meta (`history_len` is the full length).

  Returns:
    The message when `local_shape`'s last axis is `recipe.history_len` split over
    manual mesh axes of this trace; None otherwise (the caller's own message applies).
  """
  if not local_shape:
    return None
  full = recipe.history_len
  axes = splitting_axes(int(local_shape[-1]), full)
  if not axes:
    return None
  devices = math.prod(manual_axes()[name] for name in axes)
  return (
      f"{where} has shape {tuple(local_shape)} on each device, but its recipe {recipe} keeps "
      f"{full} entries: the history was split over {describe_axes(axes)} ({devices} "
      f"devices) of the shard_map this runs in, so each device holds 1/{devices} of it. FP8 "
      "state must be replicated: give it in_specs P() (and out_specs P()) in jax.shard_map, "
      "e.g. in_specs=(param_specs, P(), P('data')) for (params, fp8_state, batch); fp8jax "
      "makes the recorded amaxes global itself.")
