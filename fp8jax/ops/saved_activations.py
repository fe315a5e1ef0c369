"""Saved activations in FP8: what a backward pass keeps, one byte per element.

The inputs of the non-linear ops (RMSNorm, GELU) and attention's output are kept for the
backward pass, 2 bytes per element in bf16; in FP8 1.03 (the 1b GPT's norms and GELU:
12.7 KB per token and layer instead of 24.6 KB, docs/guides/memory.md). As COAT (Xi et al.
2024) does for its non-linear layers, the copy is E4M3 with one scale per group of
`GROUP` = 128 consecutive elements along the last (feature) axis; groups never span
tokens, whose magnitudes differ most.

    saved = save(x, "gelu")             # SavedFp8(q f8_e4m3fn [..., C], scale_inv f32 [..., ceil(C / 128)])
    x_hat = restore(saved, jnp.bfloat16)

Per group with amax A, the scale is `s = 448 / A` rounded down to a power of two, so
`A s` is in (224, 448] (no saturation) and `1 / s` is exact. An element y = x s is
rounded to nearest even in E4M3: relative error <= 2**-4 where |y| >= 2**-6 (normal, 3
mantissa bits), absolute <= 2**-10 below (subnormal spacing 2**-9). In x:

    |restore(save(x)) - x| <= max(2**-4 |x|, 2**-10 / s) <= max(2**-4 |x|, 2**-10 A / 224)

A group whose amax is 0 keeps scale 1 (its codes are 0); one holding an inf or a NaN
keeps scale 1 too: a NaN stays NaN, an inf saturates to 448 (the forward output already
carries it).

Remat: both arrays are named (`jax.ad_checkpoint.checkpoint_name`, "fp8jax_saved/<op>/q"
and ".../scale_inv") so a `jax.checkpoint` policy can keep exactly them: `policy()`
returns one (optionally offloading them to host memory). A policy cannot change a saved
value's dtype (it only chooses save, recompute or offload), which is why the ops store
the FP8 copy themselves, in their custom VJPs (`fp8jax.ops.rms_norm`, `fp8jax.ops.gelu`,
`fp8jax.fp8_attention(save_output_fp8=True)`). Where an FP8 cast already reads the
input (`fp8_mlp`'s GELU, the norm of `fp8_rms_norm_dense` and of the fused qkv
projection), the cast kernel writes the copy in the same pass (its `keep_groups`,
the same bits as `save`) and `from_cast` wraps it.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from fp8jax.core.formats import E4M3
from pallas_kernels.cast_transpose_tiling import GROUP_COLUMNS
from fp8jax.core.quantize import max_by_bits, saturate_cast, scale_from_amax

# 128: the fused casts that read or write a saved copy take one group per tile.
GROUP = GROUP_COLUMNS
PREFIX = "fp8jax_saved/"
# The ops whose saved activations are named, and the FP8 GEMM inputs `fp8_dot_general`
# keeps ("dense_x": the FP8 copy of each projection's input its wgrad GEMM reads).
OPS = ("norm", "gelu", "attention_out", "dense_x")
# The float32[] zero the input's cast hands the output gradient's cast to accumulate its
# amax into (delayed scaling): a projection's backward reads it beside the FP8 input, and
# recomputing it would recompute the cast.
GRAD_AMAX_SEED = f"{PREFIX}dense_x/grad_amax_seed"


class SavedFp8(NamedTuple):
  """An activation kept for the backward pass in FP8.

  Attributes:
    q: float8_e4m3fn, the activation's shape [..., C].
    scale_inv: float32 [..., ceil(C / group)], each group's power-of-two `1 / s`.
  """

  q: jax.Array
  scale_inv: jax.Array


def names(op: str) -> tuple[str, str]:
  """The checkpoint names of `op`'s saved codes and scales."""
  return f"{PREFIX}{op}/q", f"{PREFIX}{op}/scale_inv"


def save(x: jax.Array, op: str, group: int = GROUP) -> SavedFp8:
  """x [..., C] (any float dtype) as E4M3 codes with one power-of-two scale per 1 x `group`.

  Returns:
    `SavedFp8`, both arrays named for `op` (see `policy`).
  """
  return SavedFp8(*named(*quantize_groups(x, group), op))


def from_cast(kept: tuple, shape: tuple, op: str) -> SavedFp8:
  """The FP8 copy a fused cast wrote of a [..., C] activation of `shape` (`kept`: its codes
  [M, C] and descales [M, ceil(C / GROUP)] of the activation folded to M rows), as `op`'s
  `SavedFp8` in the activation's shape, named (see `policy`).

  Returns:
    `SavedFp8` (q [..., C], scale_inv [..., ceil(C / GROUP)]).
  """
  codes, descales = kept
  return SavedFp8(*named(codes.reshape(shape),
                         descales.reshape(*shape[:-1], descales.shape[-1]), op))


def named(q: jax.Array, scale_inv: jax.Array, op: str) -> tuple[jax.Array, jax.Array]:
  """`q` and `scale_inv` named as `op`'s saved FP8 copy, so that `policy()` keeps them.

  Returns:
    (q, scale_inv), the same arrays (a name is an identity outside `jax.checkpoint`).
  """
  q_name, s_name = names(op)
  return checkpoint_name(q, q_name), checkpoint_name(scale_inv, s_name)


def quantize_groups(x: jax.Array, group: int = GROUP) -> tuple[jax.Array, jax.Array]:
  """`save`'s arrays, unnamed: the definition the fused kernels match.

  Returns:
    (q float8_e4m3fn [..., C], scale_inv float32 [..., ceil(C / group)]).
  """
  groups, n = _grouped(x.astype(jnp.float32), group)
  amax = max_by_bits(jnp.abs(groups), axis=-1)
  scale = scale_from_amax(amax, E4M3, 0, fallback=jnp.float32(1.0), power_of_two=True)
  q = saturate_cast(groups, scale[..., None], E4M3)
  q = q.reshape(*x.shape[:-1], n * group)[..., :x.shape[-1]]
  return q, 1.0 / scale


def restore(saved: SavedFp8, dtype=jnp.float32, group: int = GROUP) -> jax.Array:
  """The activation `saved` holds (`save` with the same `group`).

  Returns:
    `q * scale_inv` per group (exact in float32), [..., C] in `dtype`.
  """
  columns = saved.q.shape[-1]
  groups, n = _grouped(saved.q.astype(jnp.float32), group)
  x = (groups * saved.scale_inv[..., None]).reshape(*saved.q.shape[:-1], n * group)
  return x[..., :columns].astype(dtype)


def _grouped(x: jax.Array, group: int) -> tuple[jax.Array, int]:
  """x [..., C] as [..., ceil(C / group), group], a partial last group padded with zeros."""
  columns = x.shape[-1]
  n = -(-columns // group)
  if n * group != columns:
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, n * group - columns)])
  return x.reshape(*x.shape[:-1], n, group), n


def saved_bytes(shape, group: int = GROUP) -> int:
  """Bytes `save` keeps for an activation of `shape`.

  Returns:
    1 per element plus 4 per group.
  """
  *lead, columns = shape
  rows = 1
  for size in lead:
    rows *= size
  return rows * (columns + 4 * -(-columns // group))


def policy(offload: bool = False):
  """A `jax.checkpoint` policy that keeps every FP8 activation fp8jax saves, and nothing else.

  Under `jax.checkpoint(f, policy=policy())` (or `nn.remat(..., policy=policy())`) the
  backward pass reuses the FP8 copies of the norm, GELU and attention-output inputs and
  of each FP8 projection's input (`fp8_dot_general`, `fp8_dense` and `fp8_einsum`: the
  copy its wgrad GEMM reads, with its descale and, under delayed scaling, the float32[]
  zero its output gradient's amax accumulates into), and recomputes the rest of `f`
  (elementwise work, bf16 intermediates, the FP8 copies of the weights) from `f`'s inputs.
  A weight's FP8 copy under a per-tensor recipe (delayed or current scaling) is cast by a
  kernel that also reads its GEMM's input, for its sharding (FSDP gathers the FP8 copy):
  recomputing the copy recomputes that input where nothing keeps it (an MLP's GELU output,
  with the up projection before it).

  Args:
    offload: move the saved arrays to pinned host memory between the passes (on a GPU)
      instead of keeping them on the device.

  Returns:
    The policy.
  """
  all_names = [name for op in OPS for name in names(op)] + [GRAD_AMAX_SEED]
  if offload:
    return jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=all_names,
        offload_src="device", offload_dst="pinned_host")
  return jax.checkpoint_policies.save_only_these_names(*all_names)
