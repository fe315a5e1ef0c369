"""FP8 GEMMs on explicit-axis meshes: the output sharding each GEMM names.

On a mesh whose axes are `jax.sharding.AxisType.Explicit` an array's sharding
is part of its type (`jax.typeof(x)` reads `float32[32@data,16]`), and
`lax.dot_general` does not guess where a product lives when the dimension it
contracts is split over devices: the wgrad GEMM of data parallelism,
`x^T @ g`, contracts the batch, which is split over "data", and raises
`ShardingTypeError` unless it is told.

fp8jax's GEMMs tell it as JAX's own transpose of a dot does:

* a gradient has the sharding of its primal: dgrad x's, wgrad the kernel's
  (so an FSDP kernel's gradient is reduce-scattered back onto its rows, and a
  replicated kernel's is all-reduced);
* the forward product has its operands' free dimensions' shardings, a mesh
  axis already taken by an earlier dimension dropped from a later one (JAX
  then gathers an FSDP kernel's FP8 copies for the fprop and dgrad GEMMs).

JAX adds the partial products of a split contraction itself. Outside explicit
meshes (Auto axes under plain `jit`, one device, `shard_map`'s manual axes)
types carry no sharding and these GEMMs are plain `dot_general`s.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import jax
from jax.sharding import NamedSharding, PartitionSpec

Spec = tuple  # one PartitionSpec entry (None, an axis name, a tuple of names) per dim


def explicit_spec(x: jax.Array) -> Spec:
  """The mesh axes that split each dim of `x` in its type: all None unless explicit."""
  aval = jax.typeof(x)
  spec = tuple(getattr(getattr(aval, "sharding", None), "spec", None) or ())
  return spec + (None,) * (aval.ndim - len(spec))


def is_explicitly_sharded(*trees: Any) -> bool:
  """Whether any array leaf of `trees` is split over an explicit mesh axis."""
  return any(entry is not None
             for leaf in jax.tree.leaves(trees) if isinstance(leaf, jax.Array)
             for entry in explicit_spec(leaf))


def dot_general(a: jax.Array, b: jax.Array, dims, out_spec: Spec | None = None,
                **kwargs) -> jax.Array:
  """`jax.lax.dot_general(a, b, dims, **kwargs)`, sharded as `out_spec` on explicit meshes.

  `out_spec` defaults to `free_dims_spec(a, b, dims)`; it is ignored (and no
  `out_sharding` passed) when neither operand is explicitly sharded.
  """
  sharded = [t for t in (a, b) if is_explicitly_sharded(t)]
  if not sharded:
    return jax.lax.dot_general(a, b, dims, **kwargs)
  if out_spec is None:
    out_spec = free_dims_spec(a, b, dims)
  # The operand's own (abstract) mesh: the arrays may carry it without `jax.set_mesh`.
  mesh = jax.typeof(sharded[0]).sharding.mesh
  out_sharding = NamedSharding(mesh, PartitionSpec(*out_spec))
  return jax.lax.dot_general(a, b, dims, out_sharding=out_sharding, **kwargs)


def free_dims_spec(a: jax.Array, b: jax.Array, dims) -> Spec:
  """The spec of `dot_general(a, b, dims)` laid out [batch, a free, b free].

  Each output dim keeps its operand dim's mesh axes (a batch dim a's, or b's
  where a's is unsplit), less any axis an earlier output dim already uses.
  """
  (a_contract, b_contract), (a_batch, b_batch) = dims
  a_spec, b_spec = explicit_spec(a), explicit_spec(b)
  batch = [a_spec[i] if a_spec[i] is not None else b_spec[j] for i, j in zip(a_batch, b_batch)]
  a_free = [a_spec[i] for i in range(a.ndim) if i not in (*a_contract, *a_batch)]
  b_free = [b_spec[i] for i in range(b.ndim) if i not in (*b_contract, *b_batch)]
  return _without_repeated_axes(batch + a_free + b_free)


def reshape(t: jax.Array, shape: Sequence[int], spec: Spec) -> jax.Array:
  """`t.reshape(shape)`, sharded as `spec` where `t` is split over an explicit mesh axis.

  JAX does not guess the sharding of a reshape that splits a dim of an
  explicitly sharded array (e.g. `[32@data, 64] -> [4, 8, 4, 16]`); this names it.
  """
  if not is_explicitly_sharded(t):
    return t.reshape(shape)
  mesh = jax.typeof(t).sharding.mesh
  return jax.lax.reshape(t, tuple(shape), out_sharding=NamedSharding(
      mesh, PartitionSpec(*_without_repeated_axes(spec))))


def to_matrix(t: jax.Array, n_row_dims: int) -> jax.Array:
  """`t` folded to 2-D: its first `n_row_dims` dims become the rows, the others the columns.

  On an explicit mesh each folded dim keeps the mesh axes of its leading (major) dim,
  so a batch split over "data" stays split over "data" with no data moved.
  """
  rows = math.prod(t.shape[:n_row_dims])
  cols = math.prod(t.shape[n_row_dims:])
  spec = explicit_spec(t)
  return reshape(t, (rows, cols), (spec[0] if n_row_dims else None,
                                   spec[n_row_dims] if n_row_dims < t.ndim else None))


def spec_before_transpose(spec: Spec, perm: Sequence[int]) -> Spec:
  """The spec of `r` such that `jnp.transpose(r, perm)` is sharded as `spec`."""
  before = [None] * len(perm)
  for i, p in enumerate(perm):
    before[p] = spec[i]
  return tuple(before)


def _without_repeated_axes(entries) -> Spec:
  used, out = set(), []
  for entry in entries:
    names = () if entry is None else (entry if isinstance(entry, tuple) else (entry,))
    kept = tuple(n for n in names if n not in used)
    used |= set(kept)
    out.append(None if not kept else kept[0] if len(kept) == 1 else kept)
  return tuple(out)


def with_out_sharding(y: jax.Array, out_sharding: Any) -> jax.Array:
  """`y` resharded as `out_sharding` (a `Sharding` or `PartitionSpec`), or `y` if None.

  What the `out_sharding` argument of Flax's layers (and of `lax.dot_general`)
  does: the result's type names that sharding. As in JAX, it is for explicit-axis
  meshes; naming an Auto axis raises JAX's own error.
  """
  if out_sharding is None:
    return y
  return jax.sharding.reshard(y, out_sharding)
