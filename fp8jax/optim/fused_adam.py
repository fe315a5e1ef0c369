"""Adam's step of one leaf with FP8 moments as one GPU kernel (`pallas_kernels.adam_fp8`).

`scale_by_adam_fp8` updates each large leaf here. On a GPU, where the fused kernels may
run (`fp8jax.ops.fused_kernels.kernels_allowed`), one kernel reads the gradient and both
stored moments and writes the update and both moments stored again; in XLA (`reference`,
the jnp form, everywhere else) the float32 moments are written and read again for the
blocks' statistics and for each encoding. The two give the same numbers (the kernel's
module says how). On a mesh each device runs the kernel on its shard
(`fp8jax.mesh.partitioning.shard_local`; columns split only in whole blocks), told where
its shard starts so that its stochastic rounding draws the whole leaf's numbers.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

import pallas_kernels
from pallas_kernels.adam_fp8 import BLOCK, AdamHyper, StoredMoment
from fp8jax.mesh.axes import inside_shard_map
from fp8jax.mesh.partitioning import shard_local
from fp8jax.ops import fused_kernels
from fp8jax.optim.moment_codec import Fp8Moment

_GRADIENT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_OUTPUTS = ("same", "same", "groups", "groups", "same", "groups", "groups")


def fits_the_kernel(g: jax.Array, block: int, nesterov: bool) -> bool:
  """Whether the kernel can take this leaf: blocks of its 128 columns, plain Adam
  (Nesterov's update stays jnp), a float gradient, fewer than 2**32 elements (the
  random numbers' counter) and no shard_map around it (the jnp form runs there)."""
  return (block == BLOCK and not nesterov and jnp.dtype(g.dtype) in _GRADIENT_DTYPES
          and g.size < 2 ** 32 and not inside_shard_map())


def adam_step(g: jax.Array, mu: Fp8Moment, nu: Fp8Moment, constants: jax.Array,
              rounding_key: jax.Array | None, hyper: AdamHyper,
              reference: Callable) -> tuple[jax.Array, Fp8Moment, Fp8Moment]:
  """The update and new moments of one leaf: the kernel on a GPU, else `reference`.

  Args:
    g: the gradient [..., C] (at least 2-D; `fits_the_kernel`).
    mu, nu: its stored moments.
    constants: float32[8], the step's numbers (`pallas_kernels.adam_fp8.adam_constants`).
    rounding_key: the second moment's stochastic-rounding key (None: to nearest).
    hyper: the step's static options.
    reference: `reference(g, mu, nu) -> (update, mu, nu)`, the jnp form of the same step.

  Returns:
    (the update in g's dtype, the new mu, the new nu).
  """
  key_words = (jax.random.key_data(rounding_key) if rounding_key is not None
               else jnp.zeros((2,), jnp.uint32))

  def kernel(g, mu, nu, constants, key_words):
    columns = g.shape[-1]
    as_rows = lambda a: a.reshape(-1, a.shape[-1])
    flat = [as_rows(a) for a in (g, *mu, *nu)]

    def local(g, mu_codes, mu_k, mu_offset, nu_codes, nu_k, nu_offset, constants,
              key_words, position):
      update, new_mu, new_nu = pallas_kernels.adam_fp8_update(
          g, StoredMoment(mu_codes, mu_k, mu_offset), StoredMoment(nu_codes, nu_k, nu_offset),
          constants, key_words, position, hyper=hyper, whole_columns=columns)
      return (update, *new_mu, *new_nu)

    results = shard_local(local, _OUTPUTS, tensors=7, position=2)(
        *flat, constants, key_words, jnp.zeros((2,), jnp.int32))
    update, *moments = (r.reshape(*like.shape[:-1], r.shape[-1])
                        for r, like in zip(results, (g, *mu, *nu)))
    return update, Fp8Moment(*moments[:3]), Fp8Moment(*moments[3:])

  def jnp_step(g, mu, nu, constants, key_words):
    del constants, key_words  # the reference makes its own
    return reference(g, mu, nu)

  return fused_kernels.choose((g, mu, nu, constants, key_words), kernel, jnp_step)
