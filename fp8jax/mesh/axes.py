"""The mesh axes a trace runs per device over, and along which each value differs.

Inside `jax.shard_map` (and `pmap`) code is traced once for one device: the
mesh's *manual* axes are those along which each device holds only its part of a
value. With `check_vma=True` (shard_map's default) JAX also types every value with
the manual axes along which it is *device-varying*. Everything fp8jax reads of
that is here: `manual_axes`, `inside_shard_map`, `varying_axes`, whether values are
typed at all (`types_recorded`), and the helpers that act on it: `vary` /
`vary_like` (mark values varying), `match_operand_axes` (one matmul's operands
alike, with a state whose cotangent combines by max), `global_amax` (a max over
the axes a tensor is split along), `splitting_axes` (which axes split a length).
The per-device type reading itself is `pallas_kernels.varying`'s, which the
kernels need too.
"""
from __future__ import annotations

import functools
import itertools
import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp

from pallas_kernels.varying import fully_manual, manual_axes, vary, varying_axes

__all__ = ["AxisName", "describe_axes", "fully_manual", "global_amax", "inside_shard_map",
           "manual_axes", "match_operand_axes", "normalize_axis_name", "splitting_axes",
           "types_recorded", "vary", "vary_like", "varying_axes"]

AxisName = str | Sequence[str] | None


def inside_shard_map() -> bool:
  """Whether the trace is per-device code (`jax.shard_map`: the mesh has manual axes)."""
  return bool(manual_axes())


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


def types_recorded(axes: tuple) -> bool:
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


def normalize_axis_name(axis_name: AxisName, argname: str = "axis_name") -> tuple:
  """`axis_name` as a tuple of mesh axis names; raises TypeError for anything else."""
  if axis_name is None:
    return ()
  names = (axis_name,) if isinstance(axis_name, str) else axis_name
  try:
    names = tuple(names)
  except TypeError:
    names = None
  if not names or not all(isinstance(n, str) for n in names):
    raise TypeError(
        f"{argname}={axis_name!r} must be None, a mesh axis name (str) or a tuple of them, "
        "e.g. axis_name='data' or axis_name=('data', 'model').")
  return names


def vary_like(tree: Any, axes: frozenset) -> Any:
  """Every array leaf of `tree` marked as varying along `axes` (gradients sum back)."""
  if not axes:
    return tree
  return jax.tree.map(lambda a: vary(a, axes), tree)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _vary_for_max(state, axes):
  return vary_like(state, frozenset(axes))


def _vary_for_max_fwd(state, axes):
  return _vary_for_max(state, axes), None


def _vary_for_max_bwd(axes, _, cotangent):
  # The "cotangent" of FP8 state carries recorded amaxes: devices combine by max.
  return (jax.tree.map(lambda c: jax.lax.pmax(c, axes), cotangent),)


_vary_for_max.defvjp(_vary_for_max_fwd, _vary_for_max_bwd)


def match_operand_axes(x: jax.Array, kernel: jax.Array, state: Any):
  """Gives the operands of one matmul, and its state, the same device-varying axes.

  Inside `shard_map` a custom VJP must return cotangents of the same type as
  its inputs, so a replicated kernel or state used with a sharded `x` is first
  marked varying. The kernel's gradient then sums over devices (as for any
  replicated parameter); the state's cotangent, which carries recorded amaxes,
  combines by max instead.
  """
  if not inside_shard_map():  # only per-device code types values as varying
    return x, kernel, state
  axes = varying_axes(x, kernel, state)
  if not axes:
    return x, kernel, state
  missing = axes - varying_axes(state)
  if missing:
    state = _vary_for_max(state, tuple(sorted(missing)))
  return vary(x, axes), vary(kernel, axes), state


def global_amax(local_amax: jax.Array, like: jax.Array) -> jax.Array:
  """The amax of the whole tensor of which `like` is this device's shard.

  `local_amax` is `like`'s own amax; under `shard_map` it is combined by max over
  the mesh axes along which `like` varies. Outside shard_map it is returned as is.
  """
  axes = tuple(sorted(varying_axes(like)))
  if not axes:
    return local_amax
  return jax.lax.pmax(local_amax, axes)
