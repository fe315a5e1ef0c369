"""How a kernel's outputs vary over the devices of a `jax.shard_map`.

Inside `shard_map` (per-device code, `check_vma=True`) every value's type says
along which manual mesh axes it is *device-varying*. JAX derives that for its
own ops, but a `pallas_call` cannot: each output must be declared. The rule for
fp8jax's kernels is the one their jnp definitions follow: an output varies
along every axis along which some input it is computed from varies.

`out_struct` builds an output's `jax.ShapeDtypeStruct` with that declaration
(plain outside `shard_map`), `varying_axes` reads an input's axes, `vary`
marks an input varying along more axes, and `check_summed` refuses partial
sums (`unreduced` inputs), whose outputs no declaration describes. An input whose buffer a kernel
writes in place (`input_output_aliases`) gives its type to that output, so it
must first be marked varying along everything the output is computed from.
"""
from __future__ import annotations

import inspect

import jax


def manual_axes() -> dict[str, int]:
  """{axis name: number of devices} of the manual mesh axes the trace runs in: those of
  the enclosing `shard_map` / `pmap`; {} outside (or on a JAX without abstract meshes)."""
  names = tuple(getattr(_abstract_mesh(), "manual_axes", ()) or ())
  sizes = _mesh_sizes()
  return {name: int(sizes[name]) for name in names if name in sizes}


def fully_manual() -> bool:
  """Whether every mesh axis of more than one device is manual here: code inside a
  `shard_map` over all of them, where a kernel runs on each device's arrays as they
  are. (Where an axis stays automatic, XLA would gather what it splits for a kernel.)"""
  manual = manual_axes()
  return bool(manual) and all(name in manual for name, size in _mesh_sizes().items()
                              if size > 1)


def _abstract_mesh():
  get_mesh = getattr(jax.sharding, "get_abstract_mesh", None)
  return get_mesh() if get_mesh is not None else None


def _mesh_sizes() -> dict:
  return dict(getattr(_abstract_mesh(), "shape", {}) or {})


def can_declare_varying_outputs() -> bool:
  """Whether this JAX lets a kernel declare how its outputs vary (`jax.ShapeDtypeStruct`
  takes `manual_axis_type` (JAX 0.10 on) or `vma`)."""
  return _DECLARATION is not None


def varying_axes(*arrays) -> frozenset:
  """The mesh axes along which any array leaf of `arrays` (pytrees; None skipped) is
  device-varying. Empty outside `shard_map`, and inside `shard_map(..., check_vma=False)`."""
  axes = set()
  for x in jax.tree.leaves(arrays):
    if isinstance(x, jax.Array):  # tracers are jax.Arrays too
      aval = jax.typeof(x)
      manual = getattr(aval, "manual_axis_type", None)
      axes |= set(manual.varying if manual is not None else getattr(aval, "vma", ()))
  return frozenset(axes)


def check_summed(*arrays) -> None:
  """Raises unless every array is a whole value on each device: a kernel cannot take a
  partial sum still to be reduced over devices (`unreduced` / `reduced` axes)."""
  for x in jax.tree.leaves(arrays):
    manual = getattr(jax.typeof(x), "manual_axis_type", None) if isinstance(x, jax.Array) else None
    pending = set(getattr(manual, "unreduced", ())) | set(getattr(manual, "reduced", ()))
    if pending:
      raise ValueError(
          f"A pallas_kernels kernel got an array {jax.typeof(x)} that is a partial sum over "
          f"the mesh axes {sorted(pending)} (unreduced): its outputs would differ per device "
          "while typed alike. Reduce it first (jax.lax.psum over those axes).")


def vary(x: jax.Array, axes: frozenset) -> jax.Array:
  """`x` typed as varying along `axes` too (no data moves)."""
  missing = tuple(sorted(frozenset(axes) - varying_axes(x)))
  if not missing:
    return x
  return jax.lax.pcast(x, missing, to="varying")


def out_struct(shape, dtype, axes: frozenset = frozenset()) -> jax.ShapeDtypeStruct:
  """A kernel output's shape and dtype, varying along `axes` inside `shard_map`."""
  if not manual_axes() or _DECLARATION is None:
    return jax.ShapeDtypeStruct(shape, dtype)
  return jax.ShapeDtypeStruct(shape, dtype, **{_DECLARATION: _declared(frozenset(axes))})


def _declaration() -> str | None:
  """The `jax.ShapeDtypeStruct` argument that declares variation on this JAX, or None."""
  parameters = inspect.signature(jax.ShapeDtypeStruct).parameters
  if "manual_axis_type" in parameters:
    return "manual_axis_type" if _MANUAL_AXIS_TYPE is not None else None
  return "vma" if "vma" in parameters else None


_MANUAL_AXIS_TYPE = getattr(jax.sharding, "ManualAxisType", None)
_DECLARATION = _declaration()


def _declared(axes: frozenset):
  if _DECLARATION == "manual_axis_type":
    return _MANUAL_AXIS_TYPE(varying=axes)
  return axes
