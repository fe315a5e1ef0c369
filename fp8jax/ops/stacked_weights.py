"""Every layer's FP8 weights cast before the loop over layers (delayed or current scaling).

A model that scans its layers keeps each weight stacked, W [L, ...], with its FP8 state
stacked alike. Cast inside the loop, layer l's weight costs two launches: a copy of the
slice W[l] in float32 (a custom call reads no fused slice) and its cast; the 350m GPT's
24 layers x 4 projections, 192 launches a step where its bf16 twin, whose slices and
conversions XLA fuses into one kernel per weight, has 4. Under delayed scaling every
layer's scale is known before the loop, and under current scaling one reduction of the
stack makes every layer's scale from max|W[l]| there (where each layer would reduce its
slice), so the weights can be cast there instead, as TransformerEngine casts its weights
once per step:

    fp8_weights = stacked_weights.cast_layers(W, n_contract, kernel_meta)   # before
    ...loop over layers, the scan slicing fp8_weights (a LayerWeights) per layer:
        with stacked_weights.supplying([(W_l, fp8_weights_l)]):           # in the layer
          y = fp8_dense(x, W_l, meta_l)       # uses the copies made from W_l

`cast_layers` is one launch per weight (`pallas_kernels.cast_transpose_stacked`: reads
the float32 stack once, writes each layer's FP8 copy and transposed copy into buffers of
their own, and folds max|W[l]| into the layer's running amax in place); the loop reads
the copies in place. Inside
`supplying`, an FP8 op whose kernel is the very array (`is`, through differentiation's
tracers) paired with copies takes those copies instead of casting the kernel: the matrix
path of `fp8_dot_general`, `fp8_rms_norm_dense` and `fp8_mlp`; its kernel role's new
running amax is the one the stacked cast made, as its own cast would have made it, and
the gradient of W_l is its usual weight gradient. The copies are made with the scales of
the stacked state each layer's state is sliced from (under current scaling, the scales of
each layer's weight), and the op descales them with its state's scale_inv under delayed
scaling, with the copies' descale under current scaling: pair a layer's copies with that
layer's ops only, and the numbers are the ones the op's own cast gives, bit for bit.

Elsewhere (another recipe, a kernel not paired, a shape that does not match the op's
matrix layout) the op casts its kernel itself, as without `supplying`.
"""
from __future__ import annotations

import contextlib
import contextvars
import math
from typing import Iterable, NamedTuple

import jax
import jax.numpy as jnp

import pallas_kernels
from fp8jax.core.meta import Fp8Meta
from fp8jax.core.quantize import max_by_bits, scale_from_amax
from fp8jax.mesh.axes import global_amax, inside_shard_map
from fp8jax.mesh.partitioning import shard_local_stacked_cast
from fp8jax.ops import fused_kernels
from fp8jax.ops.weight_reuse import ReusedKernel, primal


class LayerWeights(NamedTuple):
  """One weight's FP8 copies for every layer (stacked: the loop's scanned input), or for
  one layer (the loop body's slice).

  Attributes:
    q: [L, K, N] (a layer's [K, N]): the FP8 weight, K its contracted axes folded.
    q_t: [L, N, K] ([N, K]): its transpose, the layout the forward GEMM reads.
    amax: float32[L] ([]): the kernel role's new running amax, max(the state's, max|W[l]|).
    seed: float32[L] ([]) zeros, each layer's a buffer of its own, which the layer's
      input cast accumulates its amax into in place (no launch initialises one).
    descale: under current scaling float32[L] ([]): 1 / the scale each layer's copies
      were made with, from max|W[l]|; None under delayed scaling (the op's state's own).
  """

  q: jax.Array
  q_t: jax.Array
  amax: jax.Array
  seed: jax.Array
  descale: jax.Array | None = None


def cast_layers(kernels: jax.Array, n_contract: int, kernel_meta: Fp8Meta) -> LayerWeights:
  """Each layer's FP8 weight of a stack, in one launch (on a GPU).

  Args:
    kernels: [L, ...] the weights of L layers (layer l's is kernels[l], whose first
      `n_contract` axes are contracted, as the op's `dimension_numbers` say).
    n_contract: how many of a layer's leading kernel axes the op contracts.
    kernel_meta: the kernel role's `Fp8Meta` of the L layers, stacked (scale [L]; under
      current scaling the fallback scales, kept where a layer's amax gives none).

  Returns:
    A `LayerWeights` of L layers. Not differentiated: the weight's gradient comes from
    each layer's op.
  """
  if not isinstance(kernel_meta, Fp8Meta):
    raise TypeError(f"kernel_meta must be the kernel role's Fp8Meta (a DotMeta's .kernel), "
                    f"got {type(kernel_meta).__name__}.")
  if kernel_meta.recipe.per_operand or kernel_meta.recipe.high_precision:
    raise ValueError(f"cast_layers makes one scale per layer's weight (delayed or current "
                     f"scaling); the recipe {kernel_meta.recipe!r} scales per row or block, or "
                     "keeps a GEMM in high precision, so its ops cast their own weights.")
  if jnp.ndim(kernels) < 3 or not jnp.issubdtype(jnp.result_type(kernels), jnp.floating):
    raise ValueError(f"kernels must be a floating stack [layers, ...] of at least 2-D "
                     f"kernels; got shape {jnp.shape(kernels)} and dtype "
                     f"{jnp.result_type(kernels)}.")
  layers = kernels.shape[0]
  if jnp.shape(kernel_meta.scale) != (layers,):
    raise ValueError(f"kernel_meta must be the state of {layers} stacked layers (scale of "
                     f"shape ({layers},)); got scale of shape {jnp.shape(kernel_meta.scale)}.")
  if isinstance(n_contract, bool) or not isinstance(n_contract, int) or not (
      0 < n_contract < kernels.ndim - 1):
    raise ValueError(f"n_contract={n_contract} must leave a contracted and a free axis of a "
                     f"layer's kernel of shape {kernels.shape[1:]}.")
  k = math.prod(kernels.shape[1:1 + n_contract])
  stack = jax.lax.stop_gradient(kernels).reshape(layers, k, -1)
  fmt = kernel_meta.fmt
  scale = jax.lax.stop_gradient(kernel_meta.scale).astype(jnp.float32)
  running = jax.lax.stop_gradient(kernel_meta.amax).astype(jnp.float32)
  descale = None
  if kernel_meta.recipe.scales_from_tensor:
    scale, descale = _scales_from_layers(stack, kernel_meta, scale)

  def reference(stack, scale, running):
    qs, q_ts, amaxes, seeds = pallas_kernels.cast_transpose_stacked_reference(
        stack, scale, running, fp8_dtype=fmt.dtype, fp8_max=fmt.max)
    return jnp.stack(qs), jnp.stack(q_ts), amaxes, jnp.concatenate(seeds)

  def local_kernel(stack, scale, running):
    qs, q_ts, amaxes, seeds = pallas_kernels.cast_transpose_stacked(
        stack, scale, running, fp8_dtype=fmt.dtype, fp8_max=fmt.max)
    # Stacked for the loop: XLA folds each layer's slice of the stack into the array it
    # selects, so no copy is made; and the layers' new running amaxes, stacked back into
    # the state by the loop, into this vector.
    return jnp.stack(qs), jnp.stack(q_ts), amaxes, jnp.concatenate(seeds)

  args = (stack, scale, running)
  if inside_shard_map():  # per-device code: the jnp form (a Pallas call would not vary)
    return LayerWeights(*reference(*args), descale)
  return LayerWeights(*fused_kernels.choose(args, shard_local_stacked_cast(local_kernel),
                                            reference), descale)


def _scales_from_layers(stack: jax.Array, kernel_meta: Fp8Meta, fallback: jax.Array):
  """Current scaling's scale and descale of each layer [L], made from max|W[l]| as the op's
  own cast makes them (`fused_kernels.cast_from_amax`): one reduction of the whole stack
  (the amax of the whole weight inside `jax.shard_map`, where the stack's layer axis is
  whole: an op drops copies whose kernel varies over a mesh axis), where each layer's op
  would slice its weight out of the stack and reduce it."""
  with jax.named_scope("amax"):
    amaxes = global_amax(max_by_bits(jnp.abs(stack.astype(jnp.float32)), axis=(1, 2)), stack)
  recipe = kernel_meta.recipe
  scale = scale_from_amax(amaxes, kernel_meta.fmt, recipe.margin, fallback=fallback,
                          power_of_two=recipe.power_of_two)
  return scale, 1.0 / scale


_SUPPLIED = contextvars.ContextVar("fp8jax_supplied_weights", default=())


@contextlib.contextmanager
def supplying(pairs: Iterable[tuple[jax.Array, LayerWeights]]):
  """Inside, FP8 ops whose kernel is one of `pairs`' arrays take its copies.

  Args:
    pairs: (kernel, LayerWeights of one layer) pairs: the layer's weight as its op
      receives it (the parameter itself) and the copies `cast_layers` made of it.

  Returns:
    A context manager (`with stacked_weights.supplying(pairs): ...`).
  """
  entries = tuple((primal(kernel), weights) for kernel, weights in pairs)
  token = _SUPPLIED.set(_SUPPLIED.get() + entries)
  try:
    yield
  finally:
    _SUPPLIED.reset(token)


def supplied(kernel: jax.Array, layout) -> ReusedKernel | None:
  """The copies paired with this very kernel, for an op's matrix path.

  Args:
    kernel: the op's kernel, as the op received it.
    layout: the op's `fp8jax.ops.dot.MatrixLayout` (None: not a matrix product).

  Returns:
    A `weight_reuse.ReusedKernel` (its descale the copies' under current scaling, else
    None: the op's state's own) where `kernel` is
    paired and its copies' matrix is the layout's [k, n]; else None.
  """
  if layout is None:
    return None
  kernel = primal(kernel)
  for paired, weights in reversed(_SUPPLIED.get()):  # the innermost `supplying` first
    if paired is kernel and jnp.shape(weights.q) == (layout.k, layout.n):
      return ReusedKernel(weights.q, weights.q_t, running_amax=weights.amax,
                          scale_inv=weights.descale, seed=weights.seed)
  return None
