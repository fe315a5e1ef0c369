"""Warnings for per-device code whose FP8 numbers would silently differ from one device's.

Inside `jax.shard_map` with `check_vma=True` (the default) JAX types every value
with the mesh axes along which it differs between devices, and fp8jax reads
those types to make amaxes global (`fp8jax.sharding`). Two layouts still give
other numbers than one device, and fp8jax can see them while it traces:

* `shard_map(..., check_vma=False)` or `pmap` without `axis_name=`: nothing is
  typed, so no amax is reduced and the FP8 state that comes out is one device's
  (the amax of its own shard, smaller than the whole batch's).
* Per-row / per-block recipes (`Recipe.per_operand`) with operands split over a
  manual axis: each device scales its part of every row, so where a GEMM's
  contracted axis is split (the weight gradient contracts the batch) the scales,
  and so the gradients, differ from one device's by a percent or more.

Each warns when the step is traced (under `jax.jit`: once per compilation), with
the same text for every layer, so Python's default filter shows it once.
"""
from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp

from fp8jax.manual_axes import describe_axes, manual_axes
from fp8jax.recipes import GEMMS
from fp8jax.sharding import varying_axes


def warn_if_amaxes_stay_local(where: str, axis_names: tuple, fp8_state) -> None:
  """Warns when the step runs per device over manual axes that nothing reduces the amaxes over.

  Args:
    where: the step function for the message, e.g. "fp8jax.value_and_grad".
    axis_names: the `axis_name`s it was given (normalized to a tuple).
    fp8_state: the state it closes (no warning for a model without FP8 state).
  """
  missing = tuple(name for name in manual_axes() if name not in axis_names)
  if not missing or not jax.tree.leaves(fp8_state) or _types_recorded(missing):
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


def warn_if_scales_are_per_shard(recipe, *operands: jax.Array) -> None:
  """Warns when a per-row / per-block recipe's matmul runs on operands split over manual axes.

  Each device then computes the row and block scales of its own part of the
  operands; where that part is a slice of a contracted axis, they are not the
  scales of the whole row. fp8jax cannot tell which dimension a manual axis
  splits, so it warns whenever an operand is split (with `check_vma=False`,
  whenever the matmul runs per device at all).
  """
  if set(GEMMS) <= set(recipe.high_precision):  # no GEMM is quantized
    return
  manual = tuple(manual_axes())
  if not manual:
    return
  split = tuple(sorted(varying_axes(operands)))
  if not split and _types_recorded(manual):
    return  # typed, and no operand differs between devices: nothing is split
  name = type(recipe).__name__
  if split:
    layout = f"this FP8 matmul's operands are split over {describe_axes(split)}"
    axis = split[0]
  else:
    layout = (f"this FP8 matmul runs per device over {describe_axes(manual)} "
              "(check_vma=False or pmap: fp8jax cannot see which operands are split)")
    axis = manual[0]
  warnings.warn(
      f"{name} scales each GEMM operand per row / per block from the values one device "
      f"holds, and inside jax.shard_map {layout}. Wherever that splits the axis a GEMM "
      "contracts, each device scales from its own slice of every row, and the results "
      "differ from one device's (the gradients by a percent or more): the weight gradient "
      f"contracts the batch, so a batch split over {axis!r} does it, and so does a "
      "row-parallel layer's input dimension. Run the step under plain jax.jit with sharded "
      "arrays (the scales are then those of whole rows, as on one device), keep contracted "
      "axes unsplit inside shard_map, or use a per-tensor recipe (DelayedScaling, "
      "CurrentScaling), whose amaxes fp8jax makes global.",
      stacklevel=2)  # one place for every layer: Python's default filter shows it once


def _as_axis_name(axes: tuple) -> str:
  """How to pass `axes` as `axis_name=`: 'data' or ('data', 'model')."""
  return repr(axes[0]) if len(axes) == 1 else repr(tuple(axes))


def _types_recorded(axes: tuple) -> bool:
  """Whether JAX types values with the mesh axes they vary along here (`check_vma=True`).

  Asked of a probe, a constant marked varying along `axes`: its type keeps the
  axes where shard_map checks them and drops them under `check_vma=False` and
  `pmap` (the probe is unused, so `jit` removes it).
  """
  pcast = getattr(jax.lax, "pcast", None)
  if pcast is None:  # a JAX without it cannot tell: assume typed, and warn of nothing
    return True
  probe = pcast(jnp.zeros((), jnp.float32), tuple(axes), to="varying")
  return bool(varying_axes(probe))
