"""Where fp8jax's Pallas kernels may run in place of the same arithmetic in jnp.

fp8jax's GPU kernels (`pallas_kernels.cast_transpose_amax`, `running_amax`,
`close_steps`) are chosen when a program is lowered for a GPU
(`jax.lax.platform_dependent`); elsewhere the jnp form runs, bit for bit the
same. They are used in single-device programs only:

* under plain `jit` on several devices, XLA's SPMD partitioner cannot split a
  custom kernel and would gather its inputs to every device;
* inside `shard_map`, a Pallas call must declare how each output varies over
  the mesh, which these kernels do not do yet.

There the jnp form runs: the same numbers, more kernels.
"""
from __future__ import annotations

import jax

from fp8jax.sharding import varying_axes


def kernels_allowed(*trees) -> bool:
  """Whether fp8jax's Pallas kernels may take the arrays in `trees` on a GPU."""
  return jax.device_count() == 1 and not varying_axes(*trees)
