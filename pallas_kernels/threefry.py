"""JAX's random bits computed element by element, so a kernel can draw them itself.

`jax.random.uniform(key, shape)` with the default threefry PRNG (and JAX's default
`jax_threefry_partitionable=True`) gives element i of the flattened shape the bits of one
Threefry-2x32 block (Salmon et al. 2011, 20 rounds) of the counter (i >> 32, i & (2**32 - 1))
under the key's two words: the two output words xor-ed, then the top 23 bits as the
mantissa of a float in [1, 2), less 1. `uniform(key_words, index)` computes exactly that
from the element's flat index, with plain uint32 arithmetic that a Pallas kernel lowers
(add, shift, xor, bitcast), so a kernel drawing its own numbers gets `jax.random.uniform`'s.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))
_PARITY = 0x1BD11BDA  # the key schedule's constant: the third key word is k0 ^ k1 ^ this
_ONE_BITS = 0x3F800000  # float32 1.0


def _rotate_left(x: jax.Array, bits: int) -> jax.Array:
  return (x << jnp.uint32(bits)) | (x >> jnp.uint32(32 - bits))


def threefry_2x32(k0: jax.Array, k1: jax.Array, c0: jax.Array,
                  c1: jax.Array) -> tuple[jax.Array, jax.Array]:
  """The Threefry-2x32 block (20 rounds) of counters (c0, c1) under key (k0, k1).

  Args:
    k0, k1: uint32 key words (scalars, or arrays broadcasting with the counters).
    c0, c1: uint32 counters.

  Returns:
    The two uint32 output words.
  """
  keys = (k0, k1, k0 ^ k1 ^ jnp.uint32(_PARITY))
  x0, x1 = c0 + keys[0], c1 + keys[1]
  for block in range(5):
    for bits in _ROTATIONS[block % 2]:
      x0 = x0 + x1
      x1 = _rotate_left(x1, bits) ^ x0
    x0 = x0 + keys[(block + 1) % 3]
    x1 = x1 + keys[(block + 2) % 3] + jnp.uint32(block + 1)
  return x0, x1


def uniform(key_words: tuple[jax.Array, jax.Array], index: jax.Array) -> jax.Array:
  """`jax.random.uniform(key, shape)`'s number at flat index `index` (below 2**32).

  Args:
    key_words: the key's two uint32 words (`jax.random.key_data(key)`).
    index: uint32 flat (row-major) indices into the drawn shape.

  Returns:
    float32 numbers in [0, 1), bit for bit those of `jax.random.uniform`.
  """
  hi, lo = threefry_2x32(key_words[0], key_words[1], jnp.zeros_like(index), index)
  bits = ((hi ^ lo) >> jnp.uint32(9)) | jnp.uint32(_ONE_BITS)
  return jax.lax.bitcast_convert_type(bits, jnp.float32) - 1.0
