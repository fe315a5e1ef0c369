"""Grouped (ragged) FP8 GEMM for Hopper, forward / dgrad form, on the Mosaic GPU Pallas backend.

  out[r, n] = descales * sum_c a[r, c] * b_t[g(r), n, c]     for rows r of group g(r)
  out[r, n] = 0                                               for r >= sum(group_sizes)

with rows sorted by group (group g owns the next group_sizes[g] rows), as
`jax.lax.ragged_dot` defines. Both operands are E4M3 and K-major, the only layout FP8
wgmma reads: fprop passes b_t = w transposed ([G, N, K]), dgrad passes w as stored
([G, K, N], read as [G, Nout=K, Kc=N]) with the E4M3 output gradient as `a`.

Descales (x = x8 * descale), by `scale_mode`:
  "tensor":  a_descale f32[], b_descale f32[G]               (epilogue: acc * a_d * b_d[g])
  "rowwise": a_descale f32[M], b_descale f32[G, Nout]        (epilogue: acc * a_d[r] * b_d[g, n])
  "block":   a_descale f32[M, Kc/128] (1x128 tiles), b_descale f32[G, ceil(Nout/128), Kc/128]
             (128x128 blocks): every 128-deep product is promoted into an f32 sum,
             sum_c a_d[r, c] * b_d[g, n // 128, c] * (sum over chunk c), as DeepSeek-V3.

Kernel. A persistent grid of `num_sms` CTAs walks the work items: (group, 128-row tile)
pairs from `ragged_tiling.row_tile_schedule` times the N tiles, dealt round-robin. A
tile that a group boundary splits is visited once per group: each visit multiplies the
whole tile by its group's weights and stores only its group's rows (a ladder of TMA
stores, `ragged_tiling.store_rows`), so nothing is padded and different visits never
write the same rows. The zero "tail" rows past sum(group_sizes) are items with no steps
that store zeros; an empty group has no items. Per CTA, one producer warpgroup streams
A [128, 128] and B^T [block_n, 128] tiles (and in "block" mode the rows' descales) by
TMA through a ring whose position is carried across items; two compute warpgroups own
64 rows each, and one whose rows hold none of the item's group only passes the slots
along (DeepGEMM's skip of the wasted half at a boundary).

Mosaic GPU's CPU interpreter runs the same kernel (`interpret=`), with the tile products
of `MosaicTarget` (see mosaic_target.py).
"""
from __future__ import annotations

import dataclasses
import functools
import types
from typing import Any

import jax
from jax import lax
import jax.numpy as jnp

from pallas_kernels import varying
from pallas_kernels.mosaic_target import MosaicTarget, pl, plgpu
from pallas_kernels.ragged_tiling import (COMPUTE_WGS, STEP, WG_ROWS, RaggedMatmulBlockSizes,
                                          accumulate_steps, apply_rowwise_descales, cdiv,
                                          check_common, check_descale, check_fp8,
                                          check_group_sizes, check_multiple, check_smem,
                                          copy_rowwise_descales, launch, max_row_items,
                                          persistent_ring, promote_steps, release,
                                          resolve_num_sms, ring_scratch, row_tile_schedule,
                                          smem_bytes, store_rows, wait_ready, zeros_varying)
from pallas_kernels.smem_ring import slot_of, when

# Becomes True once test_compiled_kernels_match_float64_on_hopper (tests/
# test_ragged_matmul.py) has passed on an H100 for both grouped kernels (this one and
# transposed_ragged_matmul); until then they are proven to compile to FP8 wgmma
# (deviceless, tests/test_ragged_matmul_ptx.py) and their logic to match float64 in Mosaic
# GPU's CPU interpreter, but have never run on a GPU.
RAGGED_GEMM_VALIDATED_ON_GPU = False

_FN = "ragged_matmul"


@dataclasses.dataclass(frozen=True)
class _Problem:
  """Static shape of one call (hashable)."""
  m: int            # rows, padded to at least one row tile (see ragged_matmul)
  n: int            # Nout
  k: int            # Kc
  groups: int
  scale_mode: str
  out_dtype: Any
  blocks: RaggedMatmulBlockSizes
  num_ctas: int

  @property
  def n_tiles(self) -> int:
    return self.n // self.blocks.block_n

  @property
  def k_steps(self) -> int:
    return self.k // STEP

  @property
  def stages(self) -> int:
    return min(self.blocks.num_stages, self.k_steps)

  def scratch(self) -> dict:
    # The staging tile is untiled so that a store box may start at any row; a row is
    # block_n * itemsize >= 128 bytes, so every box starts 128-byte aligned, as TMA needs.
    return ring_scratch(stages=self.stages, block_m=self.blocks.block_m,
                        block_n=self.blocks.block_n, out_dtype=self.out_dtype,
                        scale_mode=self.scale_mode, swizzled_out=False,
                        block_descales=dict(sa=self.blocks.block_m))


def _cta(refs, s, target: MosaicTarget, *, p: _Problem):
  """One CTA: its share of the (row item, N tile) work."""
  bm, bn = p.blocks.block_m, p.blocks.block_n
  kinds = ("a", "b", "sa") if p.scale_mode == "block" else ("a", "b")
  wg = lax.axis_index("wg")

  def item(index):
    """The item's segment (G = tail), row / column origin, row range and ring steps."""
    pair, n_tile = lax.div(index, jnp.int32(p.n_tiles)), lax.rem(index, jnp.int32(p.n_tiles))
    g = refs.group[pair]
    m0 = refs.m_tile[pair] * bm
    return types.SimpleNamespace(
        g=g, m0=m0, n0=n_tile * bn, real=g < p.groups,
        lo=jnp.maximum(refs.offsets[g], m0), hi=jnp.minimum(refs.offsets[g + 1], m0 + bm),
        steps=jnp.where(g < p.groups, p.k_steps, 0))

  def consume(index, first_step):
    it = item(index[0])
    r0 = it.m0 + wg * WG_ROWS
    first = jnp.clip(it.lo - r0, 0, WG_ROWS)   # this warpgroup's rows of the item:
    stop = jnp.clip(it.hi - r0, 0, WG_ROWS)    # [r0 + first, r0 + stop)
    shape = (WG_ROWS, bn)

    def operands(step):
      slot = slot_of(first_step + step, p.stages)
      wait_ready(s, slot, kinds)
      return s.a.at[slot, pl.ds(wg * WG_ROWS, WG_ROWS)], s.b.at[slot], slot

    def compute():  # a tail item has no steps: its sum is zero
      if p.scale_mode == "rowwise":  # copied while the products run
        copy_rowwise_descales(s, wg, refs.a_descale.at[pl.ds(r0, WG_ROWS)],
                              refs.b_descale.at[it.g, pl.ds(it.n0, bn)])
      if p.scale_mode == "block":
        b_block = it.n0 // STEP  # block_n <= 128: one weight block per tile and step

        def descale(step, slot):
          rows = target.row_vector(s.sa.at[slot, pl.ds(wg * WG_ROWS, WG_ROWS)])
          return lax.broadcast_in_dim(rows * refs.b_descale[it.g, b_block, step], shape, [0])
        out = promote_steps(target, it.steps, shape, operands, descale,
                            functools.partial(release, s))
      else:
        out = accumulate_steps(target, it.steps, shape, operands,
                               functools.partial(release, s))
        out = (apply_rowwise_descales(target, s, wg, out) if p.scale_mode == "rowwise"
               else out * refs.scale[it.g])
      # The tail's descales are zero padding (an index in bounds), which gives zeros
      # unless its rows' own descales are not finite; the select makes them exact.
      out = jnp.where(it.real, out, 0.0)
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last item's store has read it
      s.out.at[wg][...] = out.astype(p.out_dtype)
      plgpu.commit_smem()
      store_rows(s.out.at[wg], lambda row, size: refs.out.at[pl.ds(r0 + row, size),
                                                             pl.ds(it.n0, bn)],
                 first, stop - first, WG_ROWS)

    def pass_slots():  # none of this warpgroup's rows are the item's: keep the ring going
      @pl.loop(0, it.steps)
      def _(step):
        slot = slot_of(first_step + step, p.stages)
        wait_ready(s, slot, kinds)
        release(s, slot)

    when(stop > first, compute)
    when(stop <= first, pass_slots)
    return it.steps

  def produce(index):
    it = item(index[0])

    def issue(step, slot):
      k_cols = pl.ds(step * STEP, STEP)
      plgpu.copy_gmem_to_smem(refs.a.at[pl.ds(it.m0, bm), k_cols], s.a.at[slot],
                              s.a_ready.at[slot])
      plgpu.copy_gmem_to_smem(refs.b_t.at[it.g, pl.ds(it.n0, bn), k_cols], s.b.at[slot],
                              s.b_ready.at[slot])
      if p.scale_mode == "block":
        plgpu.copy_gmem_to_smem(refs.a_descale_t.at[step, pl.ds(it.m0, bm)], s.sa.at[slot],
                                s.sa_ready.at[slot])
    return it.steps, issue

  persistent_ring(s, (refs.num_items[0] * p.n_tiles,), p.stages, consume=consume,
                  produce=produce)


@functools.partial(jax.jit, static_argnames=("p", "interpret"))
def _run(a, b_t, group_sizes, a_descale, b_descale, *, p: _Problem, interpret):
  m_in, bm = a.shape[0], p.blocks.block_m
  if p.m > m_in:  # see ragged_matmul
    a = jnp.pad(a, ((0, p.m - m_in), (0, 0)))
  sched = row_tile_schedule(group_sizes, p.m, bm)

  def rows_padded(x):  # per-row descales, padded so every tile's TMA copy is in bounds
    return jnp.pad(x, [(0, cdiv(p.m, bm) * bm - x.shape[0])] + [(0, 0)] * (x.ndim - 1))
  # Tensor and rowwise descales get a zero entry for the tail segment (index G).
  if p.scale_mode == "tensor":
    scales = dict(scale=jnp.pad(a_descale * b_descale, (0, 1)))
  elif p.scale_mode == "rowwise":
    scales = dict(a_descale=rows_padded(a_descale),
                  b_descale=jnp.pad(b_descale, ((0, 1), (0, 0))))
  else:  # one step's row descales contiguous: one TMA copy per step
    scales = dict(a_descale_t=rows_padded(a_descale).T, b_descale=b_descale)
  inputs = dict(offsets=sched.offsets, group=sched.group, m_tile=sched.m_tile,
                num_items=sched.num_items, a=a, b_t=b_t, **scales)
  out = launch(functools.partial(_cta, p=p), inputs, p.scratch(),
               jax.ShapeDtypeStruct((p.m, p.n), p.out_dtype), p.num_ctas, interpret, _FN)
  # Inside shard_map the output varies along every axis an input varies along (plgpu
  # kernels leave their outputs' types unchecked and plain: typed here).
  return varying.vary(out[:m_in], varying.varying_axes(inputs))


def _check(a, b_t, group_sizes, a_descale, b_descale, scale_mode, out_dtype, block_sizes):
  check_common(scale_mode, out_dtype, block_sizes, RaggedMatmulBlockSizes, _FN)
  check_fp8(_FN, "a", a, 2, "[M, Kc] (Kc contiguous)")
  check_fp8(_FN, "b_t", b_t, 3, "[G, Nout, Kc] (Kc contiguous: w transposed for fprop, w as "
            "stored for dgrad)")
  m, k = a.shape
  g, n, k_b = b_t.shape
  if k_b != k:
    raise ValueError(f"{_FN}: b_t must be [G, Nout, Kc] with Kc = {k} (a's last axis), the "
                     f"contraction contiguous; got shape {tuple(b_t.shape)}. For fprop with "
                     "w [G, K, N] pass w transposed to [G, N, K].")
  check_group_sizes(_FN, group_sizes, g, "b_t's first axis")
  want = {"tensor": ((), (g,)), "rowwise": ((m,), (g, n)),
          "block": ((m, cdiv(k, STEP)), (g, cdiv(n, STEP), cdiv(k, STEP)))}[scale_mode]
  meaning = {"tensor": ("one descale for a", "one descale per group"),
             "rowwise": ("one per row of a", "one per group and output column"),
             "block": ("one per row and 128 of Kc", "one per group and 128x128 block")
             }[scale_mode]
  check_descale(_FN, "a_descale", a_descale, want[0], scale_mode, meaning[0])
  check_descale(_FN, "b_descale", b_descale, want[1], scale_mode, meaning[1])
  return m, n, k, g


def ragged_matmul(a: jax.Array, b_t: jax.Array, group_sizes: jax.Array, a_descale: jax.Array,
                  b_descale: jax.Array, *, scale_mode: str, out_dtype=jnp.bfloat16,
                  block_sizes: RaggedMatmulBlockSizes = RaggedMatmulBlockSizes(),
                  num_sms: int | None = None, interpret: Any = False) -> jax.Array:
  """Grouped FP8 GEMM (fprop / dgrad) on Hopper FP8 tensor cores: `ragged_dot` with descales.

  out[r, n] = sum_c a[r, c] * b_t[g, n, c] * descales, r in group g; rows past
  sum(group_sizes) are 0. See the module docstring for the scale modes.

  Args:
    a: float8_e4m3fn [M, Kc], rows sorted by group; Kc a multiple of 128 (pad with zeros).
    b_t: float8_e4m3fn [G, Nout, Kc]; Nout a multiple of block_sizes.block_n.
    group_sizes: int32 [G], sizes >= 0 with sum <= M (not checked: traced values; other
      values give clipped groups, never out-of-bounds accesses).
    a_descale, b_descale: float32, shaped by `scale_mode` (module docstring).
    scale_mode: "tensor", "rowwise" or "block".
    out_dtype: bfloat16 (default) or float32.
    block_sizes: tiles and ring depth (static).
    num_sms: CTAs of the persistent grid; default: the GPU's SM count, or 132 (H100 SXM)
      where no GPU is attached (a deviceless compile), or 4 when interpreted.
    interpret: False compiles for sm_90a; True or an interpreter parameters object (e.g.
      with race detection) runs Mosaic GPU's CPU interpreter (slow; for tests).

  Returns:
    out_dtype [M, Nout].
  """
  if plgpu is None:
    raise ImportError("ragged_matmul needs jax.experimental.pallas.mosaic_gpu, which this "
                      "jax/jaxlib does not provide; use ragged_matmul_reference.")
  m, n, k, g = _check(a, b_t, group_sizes, a_descale, b_descale, scale_mode, out_dtype,
                      block_sizes)
  bm, bn = block_sizes.block_m, block_sizes.block_n
  check_multiple(_FN, "Kc", k, STEP, f"pad a and b_t with zero columns up to "
                 f"{cdiv(k, STEP) * STEP} (block descales keep ceil(Kc/128) columns).")
  check_multiple(_FN, "Nout", n, bn, f"pad b_t with zero rows up to {cdiv(n, bn) * bn} and "
                 "slice the output, or pick a block_n that divides Nout.")
  # Compiled, TMA fills the rows of the last tile past M with zeros. The CPU interpreter
  # raises on those reads instead, so it gets A padded to whole tiles (zeros: what TMA
  # reads). A TMA box may not exceed the array, so one tile is the minimum either way.
  rows = cdiv(m, bm) * bm if interpret else max(m, bm)
  tiles = max_row_items(rows, g, bm) * (n // bn)
  problem = _Problem(m=rows, n=n, k=k, groups=g, scale_mode=scale_mode,
                     out_dtype=jnp.dtype(out_dtype), blocks=block_sizes,
                     num_ctas=min(resolve_num_sms(num_sms, interpret), tiles))
  check_smem(_FN, smem_bytes(problem.scratch()), block_sizes)
  return _run(a, b_t, group_sizes, a_descale, b_descale, p=problem, interpret=interpret)


def ragged_matmul_reference(a: jax.Array, b_t: jax.Array, group_sizes: jax.Array,
                            a_descale: jax.Array, b_descale: jax.Array, *, scale_mode: str,
                            out_dtype=jnp.bfloat16,
                            block_sizes: RaggedMatmulBlockSizes = RaggedMatmulBlockSizes(),
                            num_sms: int | None = None, interpret: Any = False) -> jax.Array:
  """Plain-jnp `ragged_matmul`: its specification and the CPU / non-Hopper path.

  A scan over the kernel's own (group, row tile) work items: each multiplies its 128 rows
  by its group's weights in float32 (HIGHEST: FP8 products are exact, sums f32) and keeps
  its group's rows, so the FLOPs are about those of one dense GEMM (lax.ragged_dot
  expands densely to G times them). Descales are applied as the kernel applies them: after
  the sum ("tensor", "rowwise") or per 128-deep chunk ("block"). Any M, Nout and Kc.
  `num_sms` and `interpret` are accepted for a drop-in swap and unused.

  Args / Returns: as `ragged_matmul`.
  """
  del num_sms, interpret
  m, n, k, g = _check(a, b_t, group_sizes, a_descale, b_descale, scale_mode, out_dtype,
                      block_sizes)
  bm = block_sizes.block_m
  chunks = cdiv(k, STEP)
  rows = cdiv(m, bm) * bm
  sched = row_tile_schedule(group_sizes, m, bm)
  # Inside shard_map, what the loops build differs per device as the inputs do.
  zeros = functools.partial(zeros_varying, axes=varying.varying_axes(
      a, b_t, group_sizes, a_descale, b_descale))
  a_rows = jnp.pad(a, ((0, rows - m), (0, chunks * STEP - k)))
  b_all = jnp.pad(b_t, ((0, 0), (0, 0), (0, chunks * STEP - k)))
  if scale_mode == "rowwise":
    a_descale = jnp.pad(a_descale, (0, rows - m))
  elif scale_mode == "block":
    a_descale = jnp.pad(a_descale, ((0, rows - m), (0, 0)))
    # Column n's descale per chunk: its 128-row block of the weight.
    b_descale = jnp.repeat(b_descale, STEP, axis=1)[:, :n]           # [G, Nout, C]

  def dot_t(x, y):  # x [r, c] @ y [n, c]^T, float32
    return lax.dot_general(x, y, (((1,), (1,)), ((), ())), precision=lax.Precision.HIGHEST,
                           preferred_element_type=jnp.float32)

  def product(gi, r0):
    """float32 [bm, Nout]: rows [r0, r0 + bm) times group gi's weights, descaled."""
    x = lax.dynamic_slice_in_dim(a_rows, r0, bm).astype(jnp.float32)
    w = b_all[gi].astype(jnp.float32)
    if scale_mode == "tensor":
      return dot_t(x, w) * (a_descale * b_descale[gi])
    if scale_mode == "rowwise":
      return (dot_t(x, w) * lax.dynamic_slice_in_dim(a_descale, r0, bm)[:, None]
              * b_descale[gi][None, :])
    a_s = lax.dynamic_slice_in_dim(a_descale, r0, bm)                  # [bm, C]

    def promote(acc, c):
      partial = dot_t(lax.dynamic_slice_in_dim(x, c * STEP, STEP, axis=1),
                      lax.dynamic_slice_in_dim(w, c * STEP, STEP, axis=1))
      scale = (lax.dynamic_index_in_dim(a_s, c, 1, keepdims=False)[:, None]
               * lax.dynamic_index_in_dim(b_descale[gi], c, 1, keepdims=False)[None, :])
      return acc + partial * scale, None
    return lax.scan(promote, zeros((bm, n)), jnp.arange(chunks))[0]

  def visit(i, out):
    seg, r0 = sched.group[i], sched.m_tile[i] * bm
    row_ids = r0 + jnp.arange(bm)
    segment = jnp.maximum(seg, 0)
    keep = (row_ids >= sched.offsets[segment]) & (row_ids < sched.offsets[segment + 1])
    # The tail (seg == G) is zero and the schedule's padding (seg == -1) holds nothing:
    # neither computes a product.
    y = lax.cond((seg >= 0) & (seg < g), lambda: product(jnp.clip(seg, 0, g - 1), r0),
                 lambda: zeros((bm, n)))
    y = jnp.where(keep[:, None], y, 0.0)
    return lax.dynamic_update_slice_in_dim(out, lax.dynamic_slice_in_dim(out, r0, bm) + y,
                                           r0, 0)

  # A static trip count (a scan): differentiable, and vmap-able over group_sizes.
  out = lax.fori_loop(0, sched.group.shape[0], visit, zeros((rows, n)))
  return out[:m].astype(out_dtype)
