"""The absolute maximum of a tensor, and the max of two amaxes, exact and NaN-keeping."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.custom_batching import custom_vmap


def amax(x: jax.Array) -> jax.Array:
  """float32[] absolute maximum of `x` (NaN if `x` holds a NaN).

  Reduced as an int32 max over the bit patterns of |x| in float32: for
  non-negative floats they order like the values and every NaN sorts above
  inf, so the result is exact and keeps NaN on every backend (XLA's float max
  reduction on CPU drops NaN for larger arrays), and it is what the fused GPU
  kernel computes.
  """
  bits = jax.lax.bitcast_convert_type(jnp.abs(x.astype(jnp.float32)), jnp.int32)
  return jax.lax.bitcast_convert_type(jnp.max(bits, initial=0), jnp.float32)


def amax_max(a: jax.Array, b: jax.Array) -> jax.Array:
  """max(a, b) of two amaxes (>= 0 or NaN), on their bit patterns: a NaN on either side wins.

  XLA's float max keeps NaN, but Triton's (and CUDA's fmaxf) drop it; comparing
  the int32 bit patterns orders non-negative floats by value with NaN above inf
  on every backend, which is what fp8jax's kernels do too.
  """
  a_bits = jax.lax.bitcast_convert_type(jnp.asarray(a, jnp.float32), jnp.int32)
  b_bits = jax.lax.bitcast_convert_type(jnp.asarray(b, jnp.float32), jnp.int32)
  return jax.lax.bitcast_convert_type(jnp.maximum(a_bits, b_bits), jnp.float32)


@custom_vmap
def unbatched_like(reference: jax.Array, value: jax.Array) -> jax.Array:
  """`value`, an amax recorded into a state whose amax was `reference`.

  Only `jax.vmap` changes anything: where `value` is batched and `reference` is
  not (a model written for one example, vmapped over the batch, with one FP8
  state), the per-example amaxes are reduced to their max, so the state gets
  the amax of the whole batch, bit for bit what the folded batch records. Where
  `reference` is batched too (a state per vmapped instance, e.g. `nn.vmap` with
  "fp8_meta" in `variable_axes`), each instance keeps its own amax.
  """
  del reference
  return value


@unbatched_like.def_vmap
def _unbatched_like_rule(axis_size, in_batched, reference, value):
  del axis_size, reference
  reference_batched, value_batched = in_batched
  if value_batched and not reference_batched:
    bits = jax.lax.bitcast_convert_type(jnp.asarray(value, jnp.float32), jnp.int32)
    return jax.lax.bitcast_convert_type(jnp.max(bits, axis=0), jnp.float32), False
  return value, value_batched
