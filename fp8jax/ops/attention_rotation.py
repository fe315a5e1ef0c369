"""Incoherent processing for FP8 attention: q and k turned by one random orthogonal matrix.

For an orthogonal R ([head_dim, head_dim], R R^T = I), (q R)(k R)^T = q k^T: attention is
unchanged in exact arithmetic. What changes is what E4M3 rounds. Query and key features
with outliers in a few channels (common in trained transformers, e.g. the channels rotary
embeddings leave slow) make a few products q_d k_d dominate the logits, and E4M3 rounds
each of them with a relative error of up to 2**-4; after the rotation every channel
holds a mix of all of them, and the rounding errors of many similar terms average out.
FlashAttention-3 applies this ("incoherent processing") to its FP8 attention.

R = H diag(s) / sqrt(head_dim): H is the Sylvester-Hadamard matrix (entries +-1) and s a
fixed vector of random signs. H diag(s) has entries +-1, exact in bf16, so the products
run on bf16 tensor cores with float32 sums and the only rounding is the result's own.
The backward turns the gradients back: dq = dq' R^T, dk = dk' R^T.
"""
from __future__ import annotations

import functools
import math

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from fp8jax.core.hadamard import sylvester_hadamard

# The signs are part of the definition (a checkpointed model sees the same R in every run).
ROTATION_SEED = 0


def check_rotatable(head_dim: int) -> None:
  """Raises ValueError unless head_dim is a power of two (a Hadamard matrix's size)."""
  if head_dim < 1 or head_dim & (head_dim - 1):
    raise ValueError(f"rotate=True needs head_dim a power of two (a Hadamard matrix's size); "
                     f"got head_dim={head_dim}. Pass rotate=False.")


@functools.lru_cache(maxsize=None)
def signed_hadamard(head_dim: int) -> np.ndarray:
  """float32 [head_dim, head_dim]: H diag(s), entries +-1; R = this / sqrt(head_dim)."""
  check_rotatable(head_dim)
  h = sylvester_hadamard(head_dim)
  signs = np.random.default_rng(ROTATION_SEED).choice(np.float32([-1.0, 1.0]), head_dim)
  return h * signs[None, :]


def _turn(x: jax.Array, transpose: bool) -> jax.Array:
  head_dim = x.shape[-1]
  m = jnp.asarray(signed_hadamard(head_dim), x.dtype)  # +-1: exact in every float dtype
  spec = "...e,de->...d" if transpose else "...d,de->...e"
  turned = jnp.einsum(spec, x, m, preferred_element_type=jnp.float32,
                      precision=lax.Precision.HIGHEST)
  return (turned * (1.0 / math.sqrt(head_dim))).astype(x.dtype)


def rotate(x: jax.Array) -> jax.Array:
  """x R along the last axis (x [..., head_dim]), in x's dtype."""
  return _turn(x, transpose=False)


def unrotate(x: jax.Array) -> jax.Array:
  """x R^T along the last axis: the inverse of `rotate` (and the gradient's way back)."""
  return _turn(x, transpose=True)
