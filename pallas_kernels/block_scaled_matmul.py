"""Block-scaled FP8 GEMM (DeepSeek-V3 recipe) for Hopper, on the Mosaic GPU Pallas backend.

Operands and scales (C = ceil(K / 128) scale chunks along K, chunk c = k in [128c, 128c + 128)):

  a            float8_e4m3fn [M, K]          row-major: K contiguous
  a_scale_inv  float32       [M, C]          one descale per row and 128-wide K chunk (1x128)
  b_t          float8_e4m3fn [N, K]          B transposed: K contiguous ("K-major")
  b_scale_inv  float32       [ceil(N/128), C] one descale per 128x128 block of B

  out[m, n] = sum_c  a_scale_inv[m, c] * b_scale_inv[n // 128, c]
                     * sum_{k in chunk c} a[m, k] * b_t[n, k]

The inner sum is one chunk's FP8 tensor-core product, accumulated in the wgmma's
f32 registers; after every chunk it is *promoted*: multiplied by the two descales
and added into a separate f32 accumulator. Hopper's FP8 wgmma keeps fewer
mantissa bits in its accumulator than a full f32 add, so letting it run over all
of K loses precision as K grows; DeepSeek-V3 / DeepGEMM bound that by promoting
every 128 of K, and the scale granularity makes 128 the natural chunk anyway.

Why B is taken as b_t [N, K]: FP8 wgmma reads both operands K-major from shared
memory (only 16-bit types may use the transpose bits; see pallas_kernels/NOTES.md),
so a [K, N] B would need a transpose before every call. Produce b_t where B is
produced (a weight is stored [N, K] once, like a torch Linear weight), not per
call. a_scale_inv is transposed to [C, M] inside the wrapper (M * C floats, 1/128
of A's bytes) so that one chunk's row descales are one contiguous TMA copy.

Kernel structure (per CTA, one block_m x block_n output tile): one producer
warpgroup streams A [block_m, 128], B^T [block_n, 128] and the chunk's row
descales [block_m] by TMA through a ring of `num_stages` shared-memory slots; two
compute warpgroups each own block_m / 2 rows, issue the chunk's
`wgmma ... e4m3.e4m3` into a fresh accumulator, wait for it, and promote. The
two warpgroups run independently, so one's promotion overlaps the other's wgmma.

`block_scaled_matmul_reference` is the plain-jnp definition (f32, HIGHEST
precision per chunk, the same chunk order) and what runs on CPUs.

Mosaic GPU's CPU interpreter (jax 0.10.2) cannot read a transposed shared-memory
view as a wgmma operand, and FP8 wgmma needs one for B. With `interpret=True`
the wrapper therefore hands the kernel B as [K, N] and the kernel reads it
untransposed; everything else (pipeline, barriers, scale indexing, promotion,
epilogue) is the compiled kernel's code.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
from jax import lax
import jax.numpy as jnp

try:  # The Mosaic GPU Pallas backend; absent from some jaxlib builds.
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import mosaic_gpu as plgpu
except ImportError:  # pragma: no cover - depends on the installed jaxlib
  pl = None
  plgpu = None

from pallas_kernels.mosaic_target import interpret_params, swizzle_transforms

_FP8 = jnp.float8_e4m3fn
_COMPUTE_WGS = 2  # compute warpgroups per CTA; a third one issues the TMA copies
_OUT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))

# The K extent of one scale chunk, of one pipeline step and of one promotion.
SCALE_BLOCK = 128

# Becomes True once test_kernel_matches_reference_on_hopper (tests/
# test_block_scaled_matmul.py) has passed on an H100; until then the kernel is
# proven to compile to FP8 wgmma (deviceless) and its logic to match the
# reference in Mosaic GPU's CPU interpreter, but it has never run on a GPU.
BLOCK_SCALED_GEMM_VALIDATED_ON_GPU = False


@dataclasses.dataclass(frozen=True)
class BlockScaledMatmulBlockSizes:
  """Tiles of the block-scaled GEMM (hashable: a static argument of `jit`).

  The K tile is fixed to SCALE_BLOCK (128): one pipeline step is one scale chunk.

  Attributes:
    block_m: output rows per CTA, split over the 2 compute warpgroups; a
      multiple of 128 (each warpgroup's rows are a multiple of the wgmma M, 64).
    block_n: output columns per CTA; 64 or 128, so that one B descale covers the
      tile in each chunk.
    num_stages: depth of the shared-memory ring of A / B^T tiles (>= 2).
  """
  block_m: int = 128
  block_n: int = 128
  num_stages: int = 4

  def __post_init__(self):
    if self.block_m <= 0 or self.block_m % (_COMPUTE_WGS * 64):
      raise ValueError(f"block_m={self.block_m} must be a positive multiple of 128: two "
                       "compute warpgroups, each a multiple of the wgmma M (64) rows.")
    if self.block_n not in (64, 128):
      raise ValueError(f"block_n={self.block_n} must be 64 or 128 so that one 128-row "
                       "block of B (one b_scale_inv entry per chunk) covers the tile.")
    # Each compute warpgroup holds two f32 accumulators of (block_m / 2) x block_n:
    # the wgmma one and the promoted one, (block_m / 2) * block_n / 128 registers
    # per thread each. Past 64 + 64 they no longer fit beside the addresses and
    # scales in Hopper's 255 registers per thread without spilling.
    if (self.block_m // _COMPUTE_WGS) * self.block_n > 64 * 128:
      raise ValueError(f"block_m={self.block_m} with block_n={self.block_n} gives each "
                       "compute warpgroup more than 64 x 128 accumulator elements "
                       "(the registers of two f32 accumulators); use block_m=128 or "
                       "block_n=64.")
    if self.num_stages < 2:
      raise ValueError(f"num_stages={self.num_stages} must be at least 2 to overlap the "
                       "TMA copies with the wgmma.")


def _check_operands(a, a_scale_inv, b_t, b_scale_inv, out_dtype) -> None:
  """Shape and dtype checks shared by the kernel and the reference."""
  for name, x in (("a", a), ("b_t", b_t)):
    if x.ndim != 2:
      raise ValueError(f"{name} must be 2-D; got shape {x.shape}.")
    if x.dtype != _FP8:
      raise ValueError(f"{name} must be float8_e4m3fn (quantize it with its block scales "
                       f"first); got {x.dtype}.")
  m, k = a.shape
  n, k_b = b_t.shape
  if k_b != k:
    raise ValueError(f"b_t must be B transposed, [N, K] with K = {k} (a's second dim) "
                     f"contiguous; got shape {b_t.shape}. For a [K, N] matrix pass b.T.")
  chunks = -(-k // SCALE_BLOCK)
  n_blocks = -(-n // SCALE_BLOCK)
  for name, x, want, what in (
      ("a_scale_inv", a_scale_inv, (m, chunks), "[M, ceil(K/128)]: one descale per row of a "
       "and 128-wide chunk of K"),
      ("b_scale_inv", b_scale_inv, (n_blocks, chunks), "[ceil(N/128), ceil(K/128)]: one "
       "descale per 128x128 block of B")):
    if tuple(x.shape) != want:
      raise ValueError(f"{name} must be {what} = {want}; got shape {tuple(x.shape)}.")
    if x.dtype != jnp.float32:
      raise ValueError(f"{name} must be float32; got {x.dtype}.")
  if jnp.dtype(out_dtype) not in _OUT_DTYPES:
    raise ValueError(f"out_dtype must be bfloat16 or float32; got {jnp.dtype(out_dtype)}.")


def _check_tiles(m: int, n: int, k: int, block_sizes: BlockScaledMatmulBlockSizes) -> None:
  block_m, block_n = block_sizes.block_m, block_sizes.block_n
  if m % block_m:
    raise ValueError(f"M={m} is not a multiple of block_m={block_m}: pad M up to "
                     f"{-(-m // block_m) * block_m} (zero rows of a, any finite rows of "
                     "a_scale_inv) and slice the output, or pick a block_m that divides M.")
  if n % block_n:
    raise ValueError(f"N={n} is not a multiple of block_n={block_n}: pad N up to "
                     f"{-(-n // block_n) * block_n} (zero rows of b_t, and rows of "
                     "b_scale_inv up to ceil(N/128)) and slice the output, or pick a "
                     "block_n that divides N.")
  if k % SCALE_BLOCK:
    raise ValueError(f"K={k} is not a multiple of the scale chunk ({SCALE_BLOCK}): pad K up "
                     f"to {-(-k // SCALE_BLOCK) * SCALE_BLOCK} with zero columns of a and "
                     "b_t (the scales already have ceil(K/128) chunks and need no change).")


def _kernel(a_ref, b_ref, a_scale_ref, b_scale_ref, out_ref, scoped, *,
            block_sizes: BlockScaledMatmulBlockSizes, k_steps: int, interpret: bool):
  """Body of one CTA: the block_m x block_n output tile at grid point (m_tiles, n_tiles)."""
  # The two places the interpreted kernel differs (see the module docstring):
  # B^T tiles vs B tiles, and register layouts, which the interpreter neither
  # needs nor implements (a layout cast moves no value).
  b_transposed = not interpret
  as_layout = (lambda x, layout: x) if interpret else plgpu.layout_cast
  block_m, block_n = block_sizes.block_m, block_sizes.block_n
  rows = block_m // _COMPUTE_WGS
  num_stages = min(block_sizes.num_stages, k_steps)
  (a_smem, b_smem, sa_smem, out_smem2), ready, consumed = scoped
  a_ready, b_ready, sa_ready = ready
  wg = lax.axis_index("wg")
  m0 = lax.axis_index("m_tiles") * block_m
  n0 = lax.axis_index("n_tiles") * block_n
  b_block = n0 // SCALE_BLOCK  # block_n divides 128: the tile lies in one B scale block

  @pl.when(wg < _COMPUTE_WGS)
  def _compute():
    plgpu.set_max_registers(232, action="increase")
    out_smem = out_smem2.at[wg]
    row_layout = plgpu.Layout.WGMMA.reduce(1)

    def promoted_chunk(k_step):
      """This chunk's FP8 product, scaled by its descales: f32 in the WGMMA layout."""
      slot = lax.rem(k_step, jnp.array(num_stages, k_step.dtype))
      plgpu.barrier_wait(a_ready.at[slot])
      plgpu.barrier_wait(b_ready.at[slot])
      a_tile = a_smem.at[slot, pl.ds(wg * rows, rows)]
      b_tile = b_smem.at[slot]
      if b_transposed:  # [block_n, 128] stored, K-major: the FP8 wgmma B layout
        b_tile = plgpu.transpose_ref(b_tile, (1, 0))

      def chunk_dot(acc_ref):
        plgpu.wgmma(acc_ref, a_tile, b_tile)
        return acc_ref[...]  # waits for the wgmma
      # A fresh (zeroed) wgmma accumulator per chunk: the FP8 tensor-core sum
      # never runs past 128 of K before it is promoted below.
      partial = pl.run_scoped(chunk_dot, plgpu.ACC((rows, block_n), jnp.float32))

      plgpu.barrier_wait(sa_ready.at[slot])
      row_descale = as_layout(sa_smem[slot, pl.ds(wg * rows, rows)], row_layout)
      plgpu.barrier_arrive(consumed.at[slot])  # A, B^T and descales of this slot are read
      descale = row_descale * b_scale_ref[b_block, k_step]
      return partial * lax.broadcast_in_dim(descale, partial.shape, [0])

    # Chunk 0 starts the promoted accumulator (it then has the wgmma's layout).
    promoted = lax.fori_loop(1, k_steps, lambda k_step, acc: acc + promoted_chunk(k_step),
                             promoted_chunk(jnp.int32(0)))
    out_smem[...] = promoted.astype(out_ref.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(out_smem,
                            out_ref.at[pl.ds(m0 + wg * rows, rows), pl.ds(n0, block_n)])
    plgpu.wait_smem_to_gmem(0)

  @pl.when(wg == _COMPUTE_WGS)
  def _produce():
    plgpu.set_max_registers(40, action="decrease")

    def issue(step, slot):
      k_cols = pl.ds(step * SCALE_BLOCK, SCALE_BLOCK)
      plgpu.copy_gmem_to_smem(a_ref.at[pl.ds(m0, block_m), k_cols], a_smem.at[slot],
                              a_ready.at[slot])
      b_src = (b_ref.at[pl.ds(n0, block_n), k_cols] if b_transposed
               else b_ref.at[k_cols, pl.ds(n0, block_n)])
      plgpu.copy_gmem_to_smem(b_src, b_smem.at[slot], b_ready.at[slot])
      plgpu.copy_gmem_to_smem(a_scale_ref.at[step, pl.ds(m0, block_m)], sa_smem.at[slot],
                              sa_ready.at[slot])

    for slot in range(num_stages):
      issue(slot, slot)

    @pl.loop(0, k_steps - num_stages)
    def _(step):
      slot = lax.rem(step, jnp.array(num_stages, step.dtype))
      plgpu.barrier_wait(consumed.at[slot])
      issue(step + num_stages, slot)

    # Observe the last releases too, so no barrier phase is left pending when
    # the CTA's shared memory goes away.
    @pl.loop(k_steps - num_stages, k_steps)
    def _(step):
      plgpu.barrier_wait(consumed.at[lax.rem(step, jnp.array(num_stages, step.dtype))])


@functools.partial(jax.jit, static_argnames=("out_dtype", "block_sizes", "interpret"))
def _block_scaled_matmul(a, a_scale_inv, b_t, b_scale_inv, *, out_dtype,
                         block_sizes: BlockScaledMatmulBlockSizes, interpret: Any):
  m, k = a.shape
  n = b_t.shape[0]
  k_steps = k // SCALE_BLOCK
  num_stages = min(block_sizes.num_stages, k_steps)
  block_m, block_n = block_sizes.block_m, block_sizes.block_n
  b_transposed = not interpret
  b_operand = b_t if b_transposed else b_t.T
  b_tile_shape = (block_n, SCALE_BLOCK) if b_transposed else (SCALE_BLOCK, block_n)

  scratch = (
      plgpu.SMEM((num_stages, block_m, SCALE_BLOCK), _FP8,
                 transforms=swizzle_transforms(SCALE_BLOCK, _FP8)),
      plgpu.SMEM((num_stages, *b_tile_shape), _FP8,
                 transforms=swizzle_transforms(b_tile_shape[1], _FP8)),
      plgpu.SMEM((num_stages, block_m), jnp.float32),
      plgpu.SMEM((_COMPUTE_WGS, block_m // _COMPUTE_WGS, block_n), out_dtype,
                 transforms=swizzle_transforms(block_n, out_dtype)),
  )
  barriers = (
      (plgpu.Barrier(num_barriers=num_stages),) * 3,  # A, B^T, row descales of a slot landed
      plgpu.Barrier(num_arrivals=_COMPUTE_WGS, num_barriers=num_stages),  # slot free
  )
  body = functools.partial(_kernel, block_sizes=block_sizes, k_steps=k_steps,
                           interpret=bool(interpret))

  def entry(a_ref, b_ref, a_scale_ref, b_scale_ref, out_ref):
    pl.run_scoped(
        lambda *scoped: body(a_ref, b_ref, a_scale_ref, b_scale_ref, out_ref, scoped),
        scratch, *barriers, collective_axes="wg")

  return plgpu.kernel(
      entry,
      out_type=jax.ShapeDtypeStruct((m, n), out_dtype),
      # m fastest: CTAs launched together share a B^T column of tiles.
      grid=(m // block_m, n // block_n),
      grid_names=("m_tiles", "n_tiles"),
      num_threads=_COMPUTE_WGS + 1,
      thread_name="wg",
      interpret=interpret_params(interpret),
  )(a, b_operand, a_scale_inv.T, b_scale_inv)


def block_scaled_matmul(a: jax.Array, a_scale_inv: jax.Array, b_t: jax.Array,
                        b_scale_inv: jax.Array, *, out_dtype=jnp.bfloat16,
                        block_sizes: BlockScaledMatmulBlockSizes = BlockScaledMatmulBlockSizes(),
                        interpret: Any = False) -> jax.Array:
  """Block-scaled FP8 GEMM on Hopper FP8 tensor cores, promoted every 128 of K.

  out[m, n] = sum_c a_scale_inv[m, c] * b_scale_inv[n // 128, c]
                    * sum_{k in [128c, 128c + 128)} a[m, k] * b_t[n, k]

  Args:
    a: float8_e4m3fn [M, K]; M a multiple of block_sizes.block_m, K of 128.
    a_scale_inv: float32 [M, K // 128], the descale of each row's 128-wide K chunk.
    b_t: float8_e4m3fn [N, K], B transposed (K contiguous); N a multiple of
      block_sizes.block_n.
    b_scale_inv: float32 [ceil(N / 128), K // 128], the descale of each 128x128
      block of B.
    out_dtype: bfloat16 (default) or float32.
    block_sizes: tiles and pipeline depth (static).
    interpret: False compiles the kernel. True runs it in Mosaic GPU's CPU
      interpreter instead (slow; for tests), as does an interpreter parameters
      object (e.g. one with race detection), which is passed to `plgpu.kernel`.
      B then enters the kernel as [K, N]: the interpreter cannot read the
      transposed shared-memory view that FP8 wgmma needs.

  Returns:
    out_dtype [M, N].
  """
  if plgpu is None:
    raise ImportError("block_scaled_matmul needs jax.experimental.pallas.mosaic_gpu, which "
                      "this jax/jaxlib does not provide; install a CUDA jaxlib >= 0.10.2, or "
                      "use block_scaled_matmul_reference.")
  if not isinstance(block_sizes, BlockScaledMatmulBlockSizes):
    raise TypeError(f"block_sizes must be a BlockScaledMatmulBlockSizes; got "
                    f"{type(block_sizes).__name__}.")
  _check_operands(a, a_scale_inv, b_t, b_scale_inv, out_dtype)
  _check_tiles(a.shape[0], b_t.shape[0], a.shape[1], block_sizes)
  return _block_scaled_matmul(a, a_scale_inv, b_t, b_scale_inv,
                              out_dtype=jnp.dtype(out_dtype), block_sizes=block_sizes,
                              interpret=interpret)


def block_scaled_matmul_reference(a: jax.Array, a_scale_inv: jax.Array, b_t: jax.Array,
                                  b_scale_inv: jax.Array, out_dtype=jnp.bfloat16) -> jax.Array:
  """Plain-jnp block-scaled FP8 GEMM: the kernel's specification and its CPU path.

  Any M, N, K (a partial last chunk or B block is fine). Each 128-wide K chunk is
  dequantized to float32, multiplied at HIGHEST precision, scaled by its row and
  block descales and added into a float32 accumulator in chunk order, the
  kernel's promotion order. A scan over chunks keeps memory at one [M, N]
  accumulator.

  Args / Returns: as `block_scaled_matmul` (shapes are not restricted to tiles).
  """
  _check_operands(a, a_scale_inv, b_t, b_scale_inv, out_dtype)
  m, k = a.shape
  n = b_t.shape[0]
  chunks = a_scale_inv.shape[1]
  pad = chunks * SCALE_BLOCK - k
  # Zero K padding adds nothing to any chunk's sum.
  a_chunks = jnp.pad(a.astype(jnp.float32), ((0, 0), (0, pad)))
  b_chunks = jnp.pad(b_t.astype(jnp.float32), ((0, 0), (0, pad)))
  a_chunks = a_chunks.reshape(m, chunks, SCALE_BLOCK).transpose(1, 0, 2)  # [C, M, 128]
  b_chunks = b_chunks.reshape(n, chunks, SCALE_BLOCK).transpose(1, 0, 2)  # [C, N, 128]
  # Column n's descale in chunk c: the row of its 128-row block of B.
  b_descale = jnp.repeat(b_scale_inv, SCALE_BLOCK, axis=0)[:n].T  # [C, N]

  def promote(acc, chunk):
    a_c, b_c, a_s, b_s = chunk
    partial = lax.dot_general(a_c, b_c, (((1,), (1,)), ((), ())),
                              precision=lax.Precision.HIGHEST,
                              preferred_element_type=jnp.float32)
    return acc + partial * (a_s[:, None] * b_s[None, :]), None

  acc, _ = lax.scan(promote, jnp.zeros((m, n), jnp.float32),
                    (a_chunks, b_chunks, a_scale_inv.T, b_descale))
  return acc.astype(out_dtype)
