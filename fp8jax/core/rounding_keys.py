"""The randomness of stochastic rounding, kept in the explicit FP8 state.

A recipe that rounds output gradients stochastically (`Recipe.stochastic_rounding`,
e.g. `NVFP4Scaling`) keeps a PRNG key in the `rng` field of each matmul's gradient
role (`Fp8Meta.rng`): the raw data of a threefry key, uint32 [2] (uint32 [n, 2] for a
meta stacked over n layers). It is state like the scales: threaded through the step,
saved by checkpoints bit for bit, so a step is a pure function of its inputs and a
resumed run draws exactly the numbers the uninterrupted one would have.

    key at the start        `initial_key()`, the same for every layer
    key of one GEMM         fold_in(fold_in(key, gemm), bits of amax(g)): dgrad and wgrad
                            draw apart, and so do layers that share a key (their gradients'
                            amaxes differ), and the microbatches of one step
    key of the next step    fold_in(key, NEXT_STEP), at `fp8jax.end_step`

Equal states and inputs give equal draws; nothing is drawn from a global generator.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

IMPL = "threefry2x32"
KEY_SHAPE = (2,)  # the raw data of one threefry key
NEXT_STEP = 0x5EED  # folded into a key to make the next step's; distinct from the GEMM ids
GEMM_IDS = {"dgrad": 1, "wgrad": 2}


def initial_key() -> jax.Array:
  """uint32 [2]: the key every gradient role starts from (`jax.random.key(0)`'s data)."""
  return jax.random.key_data(jax.random.key(0, impl=IMPL))


def next_step_key(rng: jax.Array) -> jax.Array:
  """uint32 [..., 2]: the keys of the next step, from each key of `rng [..., 2]`."""
  flat = jnp.reshape(rng, (-1,) + KEY_SHAPE)
  advanced = jax.vmap(lambda data: jax.random.key_data(
      jax.random.fold_in(_wrap(data), NEXT_STEP)))(flat)
  return advanced.reshape(jnp.shape(rng))


def gemm_key(rng: jax.Array, gemm: str, tensor_amax: jax.Array) -> jax.Array:
  """uint32 [2]: the key for rounding the output gradient of one GEMM.

  Args:
    rng: uint32 [2], the gradient role's key for this step.
    gemm: "dgrad" or "wgrad".
    tensor_amax: float32 [], max |g| of the gradient being rounded (its bits are folded
      in, so that layers that share a key draw different numbers).
  """
  key = jax.random.fold_in(_wrap(rng), GEMM_IDS[gemm])
  bits = jax.lax.bitcast_convert_type(jnp.asarray(tensor_amax, jnp.float32), jnp.uint32)
  return jax.random.key_data(jax.random.fold_in(key, bits))


def uniform(key: jax.Array, shape) -> jax.Array:
  """float32 numbers in [0, 1) of `shape` drawn from `key` (uint32 [2])."""
  return jax.random.uniform(_wrap(key), shape, jnp.float32)


def _wrap(data: jax.Array):
  return jax.random.wrap_key_data(jnp.asarray(data, jnp.uint32), impl=IMPL)
