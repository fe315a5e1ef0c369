"""`fp8jax.fp8_rms_norm_qkv_rope`: a block's RMSNorm, qkv projection and RoPE, whose backward
casts the projection's output gradient straight from dq, dk and dv.

    (q, k, v), meta = fp8_rms_norm_qkv_rope(x, scale, kernel, meta, rope_base=1e4)
    # qkv = rms_norm(x, scale) @ kernel   x [B, S, D], kernel [D, H, 3, head_dim]
    # q, k = rope(qkv[..., 0, :]), rope(qkv[..., 1, :]); v = qkv[..., 2, :]

The forward is `fp8jax.fp8_rms_norm_dense` and RoPE (`fp8jax.ops.rotary.split_qkv_rope`).
The backward gets dq, dk, dv from attention. Autodiff would stack them back into the
projection's output gradient, dq and dk turned by RoPE's transpose: a pass that reads the
three and writes the stacked bf16 gradient, which the gradient's FP8 cast then reads
again. Here the cast reads dq, dk and dv itself and makes the stacked gradient in its
registers (`pallas_kernels.rotary_gradient`): that pass and its copy are gone (the 1b GPT:
3.6 ms of its step on an H100, deviceless estimate). The numbers are autodiff's, bit for
bit (the gradient rounded to its dtype where autodiff rounds it, a zero's sign included).

The fused backward runs where `fp8_rms_norm_dense` fuses (delayed or current scaling on
fp8jax's lean matrix path, see that module; current scaling reduces the stacked
gradient's amax from dq, dk, dv first) and head_dim is a power of two from 32 to 256 (the
kernel's tile is a half head); elsewhere this is that op followed by RoPE, with the same
state.
"""
from __future__ import annotations

import dataclasses
import functools
import numbers
import warnings

import jax
import jax.numpy as jnp

from fp8jax.core.meta import DotMeta, check_dot_meta
from fp8jax.core.validation import check_floating
from fp8jax.ops import norm_dense, stacked_weights
from fp8jax.ops import rms_norm as norm_math
from fp8jax.ops.guards import check_threaded, refuse_split_state, reverse_mode_only
from fp8jax.ops.rotary import frequencies, split_qkv_rope
from pallas_kernels.rotary_gradient import HEAD_DIMS as FUSED_HEAD_DIMS, rotary_qkv_gradient


def fp8_rms_norm_qkv_rope(x: jax.Array, scale: jax.Array, kernel: jax.Array, meta: DotMeta, *,
                          rope_base: float, eps: float = norm_dense.NORM_EPS,
                          save_fp8: bool = False
                          ) -> tuple[tuple[jax.Array, jax.Array, jax.Array], DotMeta]:
  """A transformer block's RMSNorm, FP8 qkv projection and RoPE, fused (see the module).

  Args:
    x: [batch, seq, D] floating.
    scale: [D], the norm's learned gain.
    kernel: [D, heads, 3, head_dim] floating: each head's q, k and v features.
    meta: the projection's `DotMeta`.
    rope_base: RoPE's base (`fp8jax.ops.rotary.rope`); positions are 0 .. seq - 1.
    eps: added to the norm's mean square.
    save_fp8: keep the normalized input for the backward in FP8
      (`fp8jax.ops.saved_activations`) instead of x itself.

  Returns:
    ((q, k, v), new meta): each [batch, seq, heads, head_dim] in x's dtype, q and k turned
    by RoPE.
  """
  check_floating(x, "x")
  check_floating(kernel, "kernel")
  if x.ndim != 3 or kernel.ndim != 4 or kernel.shape[0] != x.shape[-1] or kernel.shape[2] != 3:
    raise ValueError(f"fp8_rms_norm_qkv_rope wants x [batch, seq, D] and kernel [D, heads, 3, "
                     f"head_dim]; got x {x.shape} and kernel {kernel.shape}.")
  head_dim = kernel.shape[-1]
  if head_dim % 2:
    raise ValueError(f"kernel's head_dim={head_dim} must be even (RoPE turns pairs).")
  if not isinstance(rope_base, numbers.Real) or isinstance(rope_base, bool) or not rope_base > 0:
    raise ValueError(f"rope_base={rope_base!r} must be a positive number.")
  call = norm_math.config(x, scale, eps, None, save_fp8, False, add=False)
  refuse_split_state(meta, "meta")
  check_dot_meta(meta, "meta")
  dims = (((x.ndim - 1,), (0,)), ((), ()))
  layout = norm_dense.fused_layout(x, kernel, meta, dims, scale)
  if layout is not None and head_dim not in FUSED_HEAD_DIMS:
    _warn_unfused(head_dim)
  if layout is None or head_dim not in FUSED_HEAD_DIMS:
    y, new_meta = norm_dense.fp8_rms_norm_dense(x, scale, kernel, meta, eps=call.eps,
                                                save_fp8=call.save_fp8)
    return split_qkv_rope(y, float(rope_base)), new_meta
  check_threaded(meta, "fp8_rms_norm_qkv_rope")
  with reverse_mode_only("fp8jax.fp8_rms_norm_qkv_rope",
                         "fp8jax.rms_norm, jnp.dot and fp8jax.ops.rotary.rope"):
    reused = stacked_weights.supplied(kernel, layout)
    static = _Static(norm_dense.Static(layout, jnp.dtype(kernel.dtype), call.eps, call.save_fp8),
                     float(rope_base))
    return _norm_qkv_rope(x, scale, kernel, meta, reused, static)


@functools.lru_cache(maxsize=None)
def _warn_unfused(head_dim: int) -> None:
  """Once per head_dim: the backward stacks dq, dk, dv (the kernel tiles no such head)."""
  warnings.warn(f"fp8_rms_norm_qkv_rope: head_dim={head_dim} is not one of "
                f"{FUSED_HEAD_DIMS}, so the qkv gradient is stacked in bf16 before its cast "
                "(the same numbers, one more pass).", stacklevel=3)


@dataclasses.dataclass(frozen=True)
class _Static:
  norm_dense: norm_dense.Static
  rope_base: float


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _norm_qkv_rope(x, scale, kernel, meta, reused, static):
  return _forward(x, scale, kernel, meta, reused, static, differentiated=False)[0]


def _forward(x, scale, kernel, meta, reused, static, differentiated=True):
  (y, new_meta), residuals = norm_dense.forward(x, scale, kernel, meta, reused, static.norm_dense,
                                                differentiated)
  return (split_qkv_rope(y, static.rope_base), new_meta), residuals


def _backward(static, residuals, cotangents):
  (dq, dk, dv), meta_cotangent = cotangents
  batch, seq, heads, head_dim = dq.shape
  # The cast's operands as the projection's output gradient [batch, seq, heads, 1, head_dim]
  # would be folded (`fp8jax.ops.dot.matrix_bwd`): rows batch x seq; columns heads x head_dim
  # (dq, dk, dv), one per row (positions) or per column (frequencies).
  slot = lambda g: g.astype(dq.dtype)[:, :, :, None, :]
  positions = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.float32)[None, :, None, None, None],
                               (batch, seq, 1, 1, 1))
  theta = frequencies(head_dim, static.rope_base)
  per_column = jnp.tile(jnp.concatenate([theta, theta]), heads).reshape(1, 1, heads, 1, head_dim)
  return norm_dense.backward(static.norm_dense, residuals, slot(dq), meta_cotangent,
                             g_prologue=rotary_qkv_gradient(head_dim, dq.dtype),
                             g_prologue_inputs=(slot(dk), slot(dv), positions, per_column))


_norm_qkv_rope.defvjp(_forward, _backward)
