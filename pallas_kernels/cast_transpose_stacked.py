"""Every layer's FP8 weight copies in one launch, from a stack of layers' weights.

A model that runs its layers in a loop (an `nn.scan`, unrolled or not) keeps each
weight as a stack W [L, R, C]. Cast layer by layer, the weight of layer l is first
sliced out of the stack (a copy of W[l] in float32, a launch of its own, since no
kernel of XLA's takes a slice into a custom call) and then cast (a second launch): two
launches a layer and weight, and the float32 weight read twice and written once more.
Under delayed scaling every layer's scale is known before the loop, so this kernel
casts the whole stack at once, reading W once and writing each layer's copies into
buffers of their own:

  qs[l]       = saturate(W[l] * scale[l])     [R, C] in fp8_dtype, one array per layer
  q_ts[l]     = qs[l]^T                       [C, R]
  amax_out[l] = max(amax_in[l], max|W[l]|)    float32[L], in amax_in's buffer

(`saturate` as in `pallas_kernels.cast_transpose`: clip to +-fp8_max, round to nearest
even, NaN stays NaN; the amax on bit patterns, so NaN wins.) Separate arrays, not slices
of an [L, R, C] result: a GEMM reads each where it is, where a slice of a stacked result
would again be a copy. A loop over layers that takes them stacked (`jnp.stack`, the
loop's scanned input) reads them in place too: XLA folds a slice of a concatenation into
the operand it selects.

Tiling: one program per [block_rows, block_cols] tile and layer (a 3-D grid, the layer
last), which writes its tile of that layer's arrays (every program sees a block of each
layer's outputs and stores into its own layer's only) and maxes its tile's |W| into the
layer's running amax with an atomic, in place (an input/output alias: with the running
amaxes a donated step's state, nothing is copied first). The kernel also writes a zeroed
float32 per layer (`seeds`), for the layer's next cast to accumulate its amax into in place.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.cast_transpose import saturate, store_masked
from pallas_kernels.cast_transpose_checks import (INPUT_DTYPES, check_block_sizes, check_flag,
                                                  check_fp8)
from pallas_kernels.cast_transpose_tiling import (ABS_MASK, CastTransposeBlockSizes, tile_mask,
                                                  tiling_for)


def _kernel(x_ref, scale_ref, amax_in_ref, *refs, layers: int, tiling, fp8_dtype,
            fp8_max: float):
  """One tile of one layer (program (i, j, l)). Refs: x's tile, the layer's scale and
  running amax (aliased to its output), then per layer: q x L, q_t x L, seed x L, then
  the running amaxes out; the program writes layer l's."""
  del amax_in_ref  # the same buffer as amax_ref
  q_refs, q_t_refs = refs[:layers], refs[layers:2 * layers]
  seed_refs, amax_ref = refs[2 * layers:3 * layers], refs[3 * layers]
  layer = pl.program_id(2)
  first = (pl.program_id(0) == 0) & (pl.program_id(1) == 0)
  mask = tile_mask(tiling)
  # Out-of-range elements read as 0, the identity of the amax.
  x = x_ref[...] if mask is None else plgpu.load(x_ref, mask=mask, other=0)
  x = x.astype(jnp.float32)
  magnitude_bits = lax.bitcast_convert_type(x, jnp.int32) & ABS_MASK
  plgpu.atomic_max(amax_ref, jnp.int32(0),
                   lax.bitcast_convert_type(jnp.max(magnitude_bits), jnp.float32))
  q = saturate(x * scale_ref[0], fp8_max).astype(fp8_dtype)
  for l in range(layers):
    @pl.when(layer == l)
    def _(l=l):
      store_masked(q_refs[l], q, mask)
      store_masked(q_t_refs[l], q.T, None if mask is None else mask.T)

    @pl.when(first & (layer == l))
    def _(l=l):
      seed_refs[l][0] = jnp.float32(0)


def cast_transpose_stacked(
    x: jax.Array, scale: jax.Array, amax_in: jax.Array, *, fp8_dtype, fp8_max: float,
    block_sizes: CastTransposeBlockSizes = CastTransposeBlockSizes(),
    interpret: bool = False,
) -> tuple[tuple, tuple, jax.Array, tuple]:
  """Each layer's FP8 copy, transposed copy and running amax of a stack, in one launch.

  Args:
    x: [L, R, C] bfloat16, float16 or float32: layer l's tensor is x[l].
    scale: float32[L], layer l's scale (multiplies before the cast).
    amax_in: float32[L], each layer's running amax (>= 0 or NaN); updated in place.
    fp8_dtype: jnp.float8_e4m3fn or jnp.float8_e5m2.
    fp8_max: the largest finite value of fp8_dtype: 448.0 or 57344.0.
    block_sizes: tile sizes and launch knobs (those of `cast_transpose_amax`).
    interpret: run the Pallas interpreter (on CPU) instead of lowering for a GPU.

  Returns:
    (qs, q_ts, amax_out, seeds): qs a tuple of L arrays [R, C] and q_ts of L arrays
    [C, R], in fp8_dtype; amax_out float32[L] max(amax_in[l], max|x[l]|) (NaN where
    either holds one); seeds a tuple of L float32[1] zeros, each a buffer of its own for a
    later cast to accumulate an amax into (`cast_transpose_amax_in_chain`'s
    `accumulator`), so that no launch of its own initialises one.
  """
  layers, rows, cols = _check_stack(x, scale, amax_in)
  fp8_dtype = check_fp8(fp8_dtype, fp8_max)
  check_flag(interpret, "interpret")
  check_block_sizes(block_sizes)
  tiling = tiling_for((rows, cols), block_sizes)
  block = (tiling.block_rows, tiling.block_cols)
  # x and the scales are read once: program (i, j, l) reads tile (i, j) of layer l.
  layer_value = pl.BlockSpec((1,), lambda i, j, l: (l,))
  in_specs = [pl.BlockSpec((None, *block), lambda i, j, l: (l, i, j)), layer_value,
              layer_value]
  # Every program sees the same block of each layer's outputs and writes layer l's.
  out_specs = ([pl.BlockSpec(block, lambda i, j, l: (i, j))] * layers
               + [pl.BlockSpec(block[::-1], lambda i, j, l: (j, i))] * layers
               + [pl.BlockSpec((1,), lambda i, j, l: (0,))] * layers + [layer_value])
  out_shape = ([jax.ShapeDtypeStruct((rows, cols), fp8_dtype)] * layers
               + [jax.ShapeDtypeStruct((cols, rows), fp8_dtype)] * layers
               + [jax.ShapeDtypeStruct((1,), jnp.float32)] * layers
               + [jax.ShapeDtypeStruct((layers,), jnp.float32)])
  outs = pl.pallas_call(
      functools.partial(_kernel, layers=layers, tiling=tiling, fp8_dtype=fp8_dtype,
                        fp8_max=float(fp8_max)),
      grid=(*tiling.grid, layers),
      in_specs=in_specs,
      out_specs=out_specs,
      out_shape=out_shape,
      # The programs atomically max into the running amaxes' buffer in place.
      input_output_aliases={2: 3 * layers},
      compiler_params=plgpu.CompilerParams(num_warps=block_sizes.num_warps,
                                           num_stages=block_sizes.num_stages),
      interpret=interpret,
      name="cast_transpose_stacked",
  )(x, scale.astype(jnp.float32), amax_in.astype(jnp.float32))
  return (tuple(outs[:layers]), tuple(outs[layers:2 * layers]), outs[3 * layers],
          tuple(outs[2 * layers:3 * layers]))


def cast_transpose_stacked_reference(x: jax.Array, scale: jax.Array, amax_in: jax.Array, *,
                                     fp8_dtype, fp8_max: float
                                     ) -> tuple[tuple, tuple, jax.Array, tuple]:
  """`cast_transpose_stacked` in plain jnp: the definition the kernel matches bit for bit."""
  layers, _, _ = _check_stack(x, scale, amax_in)
  fp8_dtype = check_fp8(fp8_dtype, fp8_max)
  scale = scale.astype(jnp.float32)
  x32 = x.astype(jnp.float32)
  q = jnp.clip(x32 * scale[:, None, None], -fp8_max, fp8_max).astype(fp8_dtype)
  # On bit patterns (|v| with the sign bit cleared orders as an int32; NaN above inf).
  bits = lax.bitcast_convert_type(x32, jnp.int32) & ABS_MASK
  running = lax.bitcast_convert_type(amax_in.astype(jnp.float32), jnp.int32)
  amax_out = lax.bitcast_convert_type(jnp.maximum(running, jnp.max(bits, axis=(1, 2))),
                                      jnp.float32)
  seeds = (jnp.zeros((1,), jnp.float32),) * layers
  return (tuple(q[l] for l in range(layers)), tuple(q[l].T for l in range(layers)), amax_out,
          seeds)


def _check_stack(x, scale, amax_in) -> tuple[int, int, int]:
  shape = jnp.shape(x)
  if len(shape) != 3 or 0 in shape:
    raise ValueError(f"x must be a stack [layers, rows, cols] with no empty axis, got shape "
                     f"{shape}; reshape each layer's tensor to 2-D first.")
  if jnp.result_type(x) not in INPUT_DTYPES:
    raise TypeError(f"x has dtype {jnp.result_type(x)}; pass bfloat16, float16 or float32.")
  if jnp.shape(scale) != shape[:1]:
    raise ValueError(f"scale must hold one float32 scale per layer, shape {shape[:1]}; got "
                     f"{jnp.shape(scale)}.")
  if jnp.shape(amax_in) != shape[:1]:
    raise ValueError(f"amax_in must hold one float32 running amax per layer, shape "
                     f"{shape[:1]}; got {jnp.shape(amax_in)}.")
  return shape
