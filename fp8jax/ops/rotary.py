"""Rotary position embedding (RoPE) and what its transpose needs, shared by the GPT and
the fused qkv projection (`fp8jax.ops.norm_qkv_rope`)."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def frequencies(head_dim: int, base: float) -> jax.Array:
  """float32 [head_dim / 2]: theta_i = base**(-2i / head_dim), the angle per position of pair i."""
  half = head_dim // 2
  return base ** (-jnp.arange(half, dtype=jnp.float32) / half)


def rope(x: jax.Array, positions: jax.Array, base: float) -> jax.Array:
  """Rotary position embedding of x [batch, seq, heads, head_dim] at `positions` [seq].

  Feature pairs (x_i, x_{i + D/2}), i < D/2 (the "half-split" layout), are
  rotated by the angle p * theta_i with theta_i = base**(-2i / D) at position p:

      x_i'       = x_i cos(p theta_i) - x_{i+D/2} sin(p theta_i)
      x_{i+D/2}' = x_{i+D/2} cos(p theta_i) + x_i sin(p theta_i)

  Seen as complex numbers z_i = x_i + j x_{i+D/2}, that is z_i * exp(j p theta_i),
  so a query at position m and a key at n have a dot product that depends on
  m - n only. Computed in float32; returns x's dtype.

  Returns:
    The turned x, x's shape and dtype.
  """
  half = x.shape[-1] // 2
  theta = frequencies(x.shape[-1], base)
  angle = positions.astype(jnp.float32)[:, None] * theta[None, :]        # [seq, D/2]
  cos, sin = jnp.cos(angle)[None, :, None, :], jnp.sin(angle)[None, :, None, :]
  x32 = x.astype(jnp.float32)
  x1, x2 = x32[..., :half], x32[..., half:]
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def split_qkv_rope(qkv: jax.Array, base: float) -> tuple[jax.Array, jax.Array, jax.Array]:
  """q, k, v of a qkv projection's output [batch, seq, heads, 3, head_dim], RoPE on q and k
  at positions 0, 1, ... (each [batch, seq, heads, head_dim]).

  Returns:
    (rope(q), rope(k), v).
  """
  positions = jnp.arange(qkv.shape[1])
  q, k, v = qkv[:, :, :, 0], qkv[:, :, :, 1], qkv[:, :, :, 2]
  return rope(q, positions, base), rope(k, positions, base), v
