"""The weight an FP8 layer quantizes: its stored (master) copy, not a rounded one.

A Flax layer promotes its kernel to the computation dtype before the dot
(`dtype=jnp.bfloat16` rounds a float32 master weight to bf16). An FP8 layer quantizes
the kernel anyway, so it takes the stored weight as it is: on a GPU one pass over the
float32 master writes both FP8 copies (no bf16 copy is written and read back by a kernel
of its own, and the weight is rounded once, not twice). The weight's gradient comes out
of its GEMM in the activations' dtype, as a bf16 layer's does, and the optimizer's read
converts it to the parameter's (`fp8jax.ops.dot.wgrad_dtype`).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def master_kernel(stored: jax.Array, promoted: jax.Array) -> jax.Array:
  """The kernel an FP8 op quantizes: `stored` when it is floating, else `promoted`.

  Args:
    stored: the layer's kernel parameter as stored (e.g. float32 [K, N]).
    promoted: the same kernel as the layer's dtype promotion gives it.

  Returns:
    `stored` (any floating dtype; the FP8 cast reads it), or `promoted` for an integer one.
  """
  return stored if jnp.issubdtype(jnp.result_type(stored), jnp.floating) else promoted
