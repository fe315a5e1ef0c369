"""FP8 telemetry: how well each tensor fits its FP8 format, as float32 scalars to log.

Two levels, both pure functions that work under `jax.jit`:

* State level, `state_stats(fp8_state)`: for every `Fp8Meta` of a state (a linen
  "fp8_meta" collection, an nnx state of `Fp8MetaVariable`, `DotMeta` or
  `AttentionMeta` trees), the amax of the last closed step, the scale the next
  step will use and the headroom `log2(fmt.max / (amax * scale))`. It reads only
  the state (a few scalar ops per role), so it is cheap enough for every step,
  and it covers every role, the output gradient `grad` included.
* Tensor level, `tensor_stats(x, meta)`: the quantization of a tensor exactly as
  the FP8 op does it (the same scale for the recipe, per row or per block for
  `RowwiseScaling`, `BlockScaling` and `MXFP8Scaling`, the same saturating cast):
  amax, scale, the fractions that saturate, flush to zero or land in subnormals,
  and the quantization SNR; `ragged_dot_stats` gives them per expert for a grouped
  matmul (`state_stats` of its per-expert state already has a field per expert). For
  linen models,
  `fp8jax.flax.linen_telemetry.linen_tensor_stats()` computes
  them for the input `x` and the `kernel` of every FP8 layer call of a step and
  sows them into the "fp8_telemetry" collection.

Cost of the tensor level: per tensor one more quantize-dequantize and a handful
of reductions (for current scaling also an amax pass), i.e. a few extra reads of
every activation and weight. It is meant for logging steps: jit one step with the
telemetry collection mutable and run it every N steps, and the plain step
otherwise (the interceptor does nothing while the collection is not mutable).

What is not covered at tensor level: the output gradient of a matmul exists
only in the backward pass (its state-level stats show its amax and headroom),
the attention core of `Fp8MultiHeadAttention` (its projections are covered),
and nnx models, whose layers are plain Python objects with no method
interception; for those call `tensor_stats(x, layer.fp8_meta.get_value().x)` on
the tensors you pass, or log `state_stats`.
"""
from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from fp8jax.core.blocks import dequantize_blocks, expand_blocks
from fp8jax.core.meta import (DotMeta, Fp8Meta, RaggedDotMeta, check_dot_meta, check_fp8_state,
                              check_ragged_dot_meta, check_role_meta, is_meta)
from fp8jax.core.quantize import amax as _amax
from fp8jax.core.quantize import dequantize, quantize
from fp8jax.core.recipes import is_fine_grained
from fp8jax.core.validation import check_floating
from fp8jax.ops.cast import cast_scale

#: The Flax collection the layers sow their `TensorStats` into.
TELEMETRY_COLLECTION = "fp8_telemetry"


class TensorStats(NamedTuple):
  """How one tensor quantizes under its meta; every field is a float32 scalar.

  Attributes:
    amax: max |x| (NaN if x holds a NaN), as `fp8jax.amax`.
    scale: the scale the FP8 op multiplies x by: `meta.scale` under delayed
      scaling, `fmt.max / amax / 2**margin` under current scaling.
    saturated: fraction of elements with |x * scale| > fmt.max (they are clipped
      to ±fmt.max; an infinite x counts here too).
    flushed: fraction of elements with x != 0 whose FP8 value is 0.
    subnormal: fraction of elements whose FP8 value q is nonzero with
      |q| < fmt.min_normal.
    snr_db: 10 * log10(sum(x**2) / sum((x - dequantize(q))**2)) over the finite
      elements of x, in float32; +inf when the error is zero (an all-zero tensor,
      or one whose every element is an FP8 value times 1 / scale) or too small
      against max |x| for float32 to hold its square.
  """

  amax: jax.Array
  scale: jax.Array
  saturated: jax.Array
  flushed: jax.Array
  subnormal: jax.Array
  snr_db: jax.Array


class MetaStats(NamedTuple):
  """State-level facts of one `Fp8Meta`; float32 with the shape of `meta.scale`.

  Attributes:
    amax: `amax_history[..., 0]`, the amax of the last closed step.
    scale: `meta.scale`, the scale the next step quantizes with (under current
      scaling the op computes its own from the tensor instead).
    headroom: `log2(fmt.max / (amax * scale))`: how many binades a tensor with
      last step's amax has below fmt.max under this scale. 0 means it exactly
      fills the format (delayed scaling with margin 0 right after that amax set
      the scale), negative means such a tensor saturates, +inf means amax is 0
      (the role saw no data).
  """

  amax: jax.Array
  scale: jax.Array
  headroom: jax.Array


def tensor_stats(x: jax.Array, meta: Fp8Meta, operand: str = "lhs",
                 n_contract: int = 1, contract_axes=None) -> TensorStats:
  """Quantization statistics of `x` under one role's `meta`, as the FP8 op computes q.

  With `s` the scale the op uses for each element and `n = x.size`:

    saturated = #{|x * s| > fmt.max} / n
    flushed   = #{x != 0 and q == 0} / n
    subnormal = #{q != 0 and |q| < fmt.min_normal} / n
    snr_db    = 10 * log10(sum(x**2) / sum((x - q / s)**2))   over finite x

  where `q = fp8(clip(float32(x) * s, ±fmt.max))` rounded to nearest even. For the
  per-tensor recipes `s` is `cast_scale(meta, amax(x), x)`, what
  `fp8jax.ops.cast.quantize_with_meta` uses. For the per-row / per-block recipes
  (`RowwiseScaling`, `BlockScaling`, `MXFP8Scaling`, `NVFP4Scaling`) it is the
  forward GEMM's scale of the element's row, column, tile or block along the
  contraction axis, from `fp8jax.core.blocks` as `fp8jax.ops.fine_grained_dot`
  computes it, and the reported `scale` is the smallest (the one of the largest
  block amax); `fmt` is then the format the values are written in
  (`Recipe.element_format`: E2M1, max 6 and smallest normal 1, under NVFP4).

  A tensor's (or row's, block's) largest element counts as saturated when
  `fmt.max / amax`, rounded to float32, makes its product exceed fmt.max by an
  ulp: clipped, though it rounds to fmt.max either way. With one scale per row
  that is up to one element per row, about 0.5 / K of a [M, K] tensor.

  Fractions of an empty tensor are 0. The state is not changed (no amax is
  recorded) and no gradient flows through the result. Inside `shard_map` the
  fractions and SNR are those of this device's shard.

  Args:
    x: floating array of any shape (bf16, f16 or f32): the tensor the op quantizes.
    meta: the unstacked `Fp8Meta` of x's role, e.g. `dot_meta.x` or `dot_meta.kernel`.
    operand: "lhs" for a matmul's activation (contracted on its trailing
      `n_contract` axes), "rhs" for its weight (contracted on its leading ones);
      only the per-row / per-block recipes depend on it.
    n_contract: how many axes the matmul contracts.
    contract_axes: the axes of x the matmul contracts, where they are not the
      trailing (lhs) or leading (rhs) `n_contract` ones (e.g. `DenseGeneral(axis=1)`);
      the per-row / per-block stats then fold x along them, as the op does.

  Returns:
    `TensorStats` of float32 scalars.
  """
  check_floating(x, "x")
  if not isinstance(meta, Fp8Meta):
    raise TypeError(
        f"meta must be one role's fp8jax.Fp8Meta, got a {type(meta).__name__}. Pass the "
        "role that quantizes x, e.g. dot_meta.x for a matmul's input or dot_meta.kernel "
        "for its weight (fp8jax.telemetry.dot_stats(x, kernel, dot_meta) does both).")
  check_role_meta(meta, "meta")
  if operand not in ("lhs", "rhs"):
    raise ValueError(f"operand={operand!r} must be 'lhs' (a matmul's activation) or 'rhs' "
                     "(its weight).")
  x, meta = jax.lax.stop_gradient((x, meta))  # telemetry only observes
  fmt = meta.fmt
  x_amax = _amax(x)
  if is_fine_grained(meta.recipe) and x.size:
    x2 = _as_matrix(x, operand, n_contract, contract_axes)
    # The forward GEMM's quantization of this operand along its contraction axis, and the
    # multipliers it applied per block (`Recipe.operand_scales`, not 1 / scale_inv).
    axis = -1 if operand == "lhs" else -2
    quantized = meta.recipe.quantize_operand(x2, fmt, axis, weight=operand == "rhs")
    block_scale = meta.recipe.operand_scales(x2, quantized, fmt)
    scale = expand_blocks(block_scale, quantized.block, x2.shape)
    q, x, dequantized = quantized.q, x2, dequantize_blocks(quantized)
    reported_scale = jnp.min(block_scale)
    fmt = meta.recipe.element_format(fmt)  # what q is in: E2M1 under NVFP4Scaling
  else:
    scale = cast_scale(meta, x_amax, like=x)
    q = quantize(x, scale, fmt)
    dequantized, reported_scale = dequantize(q, scale), scale
  return _stats(x, q, scale, dequantized, x_amax, reported_scale, fmt)


def _as_matrix(x, operand, n_contract, contract_axes=None):
  """x folded into the GEMM's 2-D operand: [M, K] for "lhs", [K, N] for "rhs"."""
  if contract_axes is not None:
    contract = [axis % x.ndim for axis in contract_axes]
    free = [axis for axis in range(x.ndim) if axis not in contract]
    k = math.prod(x.shape[axis] for axis in contract)
    if operand == "lhs":
      return jnp.transpose(x, free + contract).reshape(-1, k)
    return jnp.transpose(x, contract + free).reshape(k, -1)
  if not isinstance(n_contract, int) or not 1 <= n_contract <= x.ndim:
    raise ValueError(f"n_contract={n_contract!r} must be an int in [1, {x.ndim}] (x has "
                     f"{x.ndim} axes).")
  if operand == "lhs":
    return x.reshape(-1, math.prod(x.shape[x.ndim - n_contract:]))
  return x.reshape(math.prod(x.shape[:n_contract]), -1)


def _stats(x, q, scale, dequantized, x_amax, reported_scale, fmt) -> TensorStats:
  x32 = x.astype(jnp.float32)
  q32 = q.astype(jnp.float32)
  n = jnp.float32(max(x.size, 1))

  def fraction(mask):
    return jnp.sum(mask, dtype=jnp.int32).astype(jnp.float32) / n

  finite = jnp.isfinite(x32)
  signal = jnp.where(finite, x32, 0.0)
  error = jnp.where(finite, x32 - dequantized.astype(jnp.float32), 0.0)
  # The SNR does not change when x and the error are divided by a common factor;
  # dividing by max |x| keeps the squares inside float32 for any finite x
  # (|x| > 1.8e19 would square to inf).
  norm = jnp.max(jnp.abs(signal), initial=0.0)
  norm = jnp.where(norm > 0, norm, 1.0)
  signal_power = jnp.sum(jnp.square(signal / norm))
  noise_power = jnp.sum(jnp.square(error / norm))
  snr_db = jnp.where(noise_power > 0, 10.0 * jnp.log10(signal_power / noise_power), jnp.inf)
  return TensorStats(
      amax=x_amax,
      scale=jnp.asarray(reported_scale, jnp.float32),
      saturated=fraction(jnp.abs(x32 * scale) > fmt.max),
      flushed=fraction((x32 != 0) & (q32 == 0)),
      subnormal=fraction((q32 != 0) & (jnp.abs(q32) < fmt.min_normal)),
      snr_db=snr_db.astype(jnp.float32))


def dot_stats(x: jax.Array, kernel: jax.Array, meta: DotMeta,
              n_contract: int = 1, dimension_numbers=None) -> dict[str, TensorStats]:
  """`tensor_stats` of both forward operands of one FP8 matmul.

  Args:
    x: the activation passed to `fp8_dot_general` / `fp8_dense` / `fp8_einsum`.
    kernel: the weight passed with it.
    meta: that call's `DotMeta`.
    n_contract: how many trailing axes of x (leading axes of kernel) are contracted.
    dimension_numbers: the call's `lax.dot_general` dimension numbers, for a
      contraction over other axes (they take precedence over `n_contract`).

  Returns:
    {"x": tensor_stats(x, meta.x, "lhs", n_contract),
     "kernel": tensor_stats(kernel, meta.kernel, "rhs", n_contract)}.
  """
  check_dot_meta(meta, "meta")
  if dimension_numbers is not None:
    (x_axes, kernel_axes), _ = dimension_numbers
    return {"x": tensor_stats(x, meta.x, "lhs", contract_axes=tuple(x_axes)),
            "kernel": tensor_stats(kernel, meta.kernel, "rhs", contract_axes=tuple(kernel_axes))}
  return {"x": tensor_stats(x, meta.x, "lhs", n_contract),
          "kernel": tensor_stats(kernel, meta.kernel, "rhs", n_contract)}


def ragged_dot_stats(x: jax.Array, w: jax.Array, meta: RaggedDotMeta) -> dict[str, TensorStats]:
  """`tensor_stats` of both forward operands of one grouped matmul, the weight per expert.

  Args:
    x: [M, K], the rows passed to `fp8jax.fp8_ragged_dot`.
    w: [G, K, N], the experts' weights passed with them.
    meta: that call's `RaggedDotMeta`.

  Returns:
    {"x": tensor_stats(x, meta.x), "kernel": TensorStats whose fields are float32 [G],
    expert g's `tensor_stats(w[g], its meta)`}: per expert its amax, scale, saturated,
    flushed and subnormal fractions and SNR.
  """
  check_ragged_dot_meta(meta, w.shape[0], "meta")
  experts = [tensor_stats(w[g], jax.tree.map(lambda a, g=g: a[g], meta.kernel), "rhs")
             for g in range(w.shape[0])]
  return {"x": tensor_stats(x, meta.x, "lhs"),
          "kernel": TensorStats(*(jnp.stack(field) for field in zip(*experts)))}


#: Headrooms smaller than this (in binades) are reported as 0: float32 log2s of a scale
#: computed as fmt.max / amax differ from 0 by ~1e-6 at most.
HEADROOM_ROUNDING = 2.0 ** -16


def state_stats(fp8_state: Any) -> dict[str, MetaStats]:
  """`MetaStats` of every `Fp8Meta` in an FP8 state, keyed by its path.

  Log the state that `fp8jax.value_and_grad` (or `end_step`) returned: its
  newest history entry is the step just taken and its scale the next step's.
  Per role, with `a = amax_history[..., 0]` and `s = scale`:

    headroom = log2(fmt.max) - log2(a) - log2(s)     (float32; +inf when a == 0)

  in bits; a value within float32 rounding of 0 (|headroom| < 2**-16: a scale
  made from this very amax, as delayed scaling with margin 0 makes it) is
  reported as exactly 0, so a negative headroom means the amax times the scale
  exceeds fmt.max: that tensor saturates.

  Args:
    fp8_state: a pytree of `Fp8Meta`: a linen `variables["fp8_meta"]`, an nnx
      `nnx.state(model, Fp8MetaVariable)`, a `DotMeta`, or any tree of them.
      Metas stacked over layers give stats of their stacked shape.

  Returns:
    {path: MetaStats}, path joining the tree's keys with "/", e.g.
    "Fp8Dense_0/dot_meta/x" (the `.value` of an nnx Variable is left out; a
    lone `Fp8Meta` is keyed "meta").
  """
  check_fp8_state(fp8_state, "fp8_state")
  stats = {}
  for path, meta in jax.tree_util.tree_flatten_with_path(fp8_state, is_leaf=is_meta)[0]:
    newest = meta.amax_history[..., 0]
    headroom = jnp.log2(jnp.float32(meta.fmt.max)) - jnp.log2(newest) - jnp.log2(meta.scale)
    headroom = jnp.where(jnp.abs(headroom) < HEADROOM_ROUNDING, 0.0, headroom)
    stats[_path_string(path) or "meta"] = MetaStats(amax=newest, scale=meta.scale,
                                                   headroom=headroom)
  return stats


def scalars(stats: Any, prefix: str = "") -> dict[str, jax.Array]:
  """Flattens a tree of stats into {"path/field": scalar} for a metrics logger.

  Args:
    stats: what `state_stats`, `dot_stats` or the "fp8_telemetry" collection give.
    prefix: prepended to every key, e.g. "fp8/".

  Returns:
    A flat dict, e.g. {"Fp8Dense_0/dot_meta/x/headroom": ..., "Fp8Dense_0/x/0/snr_db": ...}
    (linen's sow keeps one entry per call, hence the call index "0").
  """
  return {prefix + _path_string(path): leaf
          for path, leaf in jax.tree_util.tree_flatten_with_path(stats)[0]}


def _path_string(path) -> str:
  """A pytree key path as "a/b/0/c"; skips nnx Variables' `.value`."""
  parts = []
  for key in path:
    if isinstance(key, jax.tree_util.DictKey):
      parts.append(str(key.key))
    elif isinstance(key, jax.tree_util.SequenceKey):
      parts.append(str(key.idx))
    elif isinstance(key, jax.tree_util.GetAttrKey):
      if key.name != "value":
        parts.append(key.name)
    else:
      parts.append(str(key).strip(".[]'\""))
  return "/".join(parts)
