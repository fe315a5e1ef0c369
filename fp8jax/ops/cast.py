"""How an FP8 op casts one tensor with its role's state: the scale, the cast, the record.

Delayed scaling casts with the stored scale. A recipe that scales from the tensor
(`Recipe.scales_from_tensor`) first takes the amax of the *whole* tensor: under
`jax.vmap` with one state the max over the batch (`unbatched_like`), inside
`jax.shard_map` the max over the devices that hold the other shards of it
(`global_amax`); then `fp8jax.core.meta.scale_for` makes the scale of that amax.
"""
from __future__ import annotations

import jax

from fp8jax.core.meta import Fp8Meta, record_amax, scale_for
from fp8jax.core.quantize import amax, quantize, unbatched_like
from fp8jax.mesh.axes import global_amax


def cast_scale(meta: Fp8Meta, tensor_amax: jax.Array, like: jax.Array) -> jax.Array:
  """The float32[] scale to cast `like` (this trace's view of a tensor) with under `meta`.

  `tensor_amax` is `like`'s own amax. Only a recipe that scales from the tensor
  reads it (delayed scaling builds no reduction of it across devices).
  """
  if not meta.recipe.scales_from_tensor:
    return meta.scale
  return scale_for(meta, amax_of_whole(meta, tensor_amax, like))


def amax_of_whole(meta: Fp8Meta, tensor_amax: jax.Array, like: jax.Array) -> jax.Array:
  """The float32[] amax of the whole tensor `like` is this trace's view of, from `like`'s
  own amax: the max over a `jax.vmap` batch where `meta` is unbatched, over the devices
  that hold the other shards inside `jax.shard_map`; elsewhere `tensor_amax` itself."""
  return global_amax(unbatched_like(meta.amax, tensor_amax), like)


def quantize_with_meta(x: jax.Array, meta: Fp8Meta) -> tuple[jax.Array, jax.Array, Fp8Meta]:
  """Quantizes `x` as `meta`'s recipe says and records `x`'s amax.

  Delayed scaling uses the stored `meta.scale`; current scaling computes the
  scale from `x`'s own amax (keeping `meta.scale` if that amax is 0 or not finite);
  inside `shard_map` that is the amax of the whole tensor, not of this shard.

  Returns:
    (q in meta.fmt.dtype, the float32[] scale used, meta with the amax recorded).
  """
  x_amax = amax(x)
  scale = cast_scale(meta, x_amax, like=x)
  return quantize(x, scale, meta.fmt), scale, record_amax(meta, x_amax)
