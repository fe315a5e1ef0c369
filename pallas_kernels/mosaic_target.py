"""The two ways a Mosaic GPU (Hopper) kernel of this package runs, behind one small interface.

compiled     Mosaic GPU lowers the kernel for sm_90a: tile products are `wgmma`, values
             live in register layouts, accumulators are wgmma accumulator refs.
interpreted  Mosaic GPU's CPU interpreter (`plgpu.kernel(..., interpret=params)`) runs
             the same kernel on a CPU: it simulates shared memory, TMA copies and
             barriers, and with `detect_races=True` reports data races between the
             warpgroups and the copy engine. It has no register layouts, no
             `plgpu.load`, no accumulator refs inside `pl.run_state`, and its wgmma
             cannot read a transposed shared-memory view (jax 0.10.2 and 0.11).

`MosaicTarget` holds the few operations that differ. Under the interpreter a tile
product reads its shared-memory operands with ordinary loads (which the race detector
sees, at the point where the hardware would issue the wgmma), transposes in registers
where the compiled kernel uses a transposed view, and multiplies in float32 at
HIGHEST precision: exact for FP8 and 16-bit products, with float32 sums as the
wgmma accumulator has. Everything else in a kernel (the pipeline, every barrier,
slot indexing, masks, the softmax, epilogues) is the same code in both.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
from jax import lax
import jax.numpy as jnp

try:  # The Mosaic GPU Pallas backend; absent from some jaxlib builds.
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import mosaic_gpu as plgpu
except ImportError:  # pragma: no cover - depends on the installed jaxlib
  pl = None
  plgpu = None


def interpret_params(interpret: Any):
  """The `interpret=` argument of `plgpu.kernel` for a kernel wrapper's `interpret` option.

  Args:
    interpret: False (compile for the GPU), True (the CPU interpreter with default
      parameters) or an interpreter parameters object (e.g. with race detection).

  Returns:
    None to compile, else the interpreter parameters.
  """
  if interpret is False or interpret is None:
    return None
  if interpret is True:
    try:  # Private in jax 0.10.2 and 0.11 (not exported from plgpu).
      from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
    except ImportError as e:  # pragma: no cover - depends on the installed jax
      raise NotImplementedError("interpret=True needs Mosaic GPU's CPU interpreter "
                                "(jax >= 0.10.2); this jax does not have it.") from e
    return InterpretGPUParams()
  return interpret


def swizzle_transforms(minor_dim_elems: int, dtype) -> tuple:
  """Tiling + swizzle for a shared-memory tile whose rows hold `minor_dim_elems` elements.

  The widest swizzle that divides a row (128, 64 or 32 bytes), the layout wgmma reads
  without bank conflicts; the tiling groups 8 rows of one swizzle width.
  """
  itemsize = jnp.dtype(dtype).itemsize
  row_bytes = minor_dim_elems * itemsize
  swizzle = next((s for s in (128, 64, 32) if row_bytes % s == 0), None)
  if swizzle is None:
    raise ValueError(f"A {minor_dim_elems}-element row of {jnp.dtype(dtype).name} is "
                     f"{row_bytes} bytes; wgmma tiles need a multiple of 32 bytes.")
  return (plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle))


@dataclasses.dataclass(frozen=True)
class MosaicTarget:
  """How a kernel body runs: compiled for sm_90a, or in Mosaic GPU's CPU interpreter.

  Attributes:
    interpret: True under the CPU interpreter.
  """

  interpret: bool

  def layout(self, x: jax.Array, layout) -> jax.Array:
    """`x` in a register layout (compiled); the interpreter has no layouts."""
    return x if self.interpret else plgpu.layout_cast(x, layout)

  def row_vector(self, ref) -> jax.Array:
    """A [rows] SMEM vector as one value per row of a [rows, cols] wgmma result."""
    return self._load(ref, plgpu.Layout.WGMMA.reduce(1))

  def col_vector(self, ref) -> jax.Array:
    """A [cols] SMEM vector as one value per column of a [rows, cols] wgmma result."""
    return self._load(ref, plgpu.Layout.WGMMA.reduce(0))

  def _load(self, ref, layout):
    if self.interpret:
      return ref[...]
    try:  # jax 0.11 takes the ref alone and deprecates the separate index.
      return plgpu.load(ref, layout=layout)
    except TypeError:  # jax 0.10.2: the index is a required argument.
      return plgpu.load(ref, (), layout=layout)

  def iota(self, shape: tuple[int, int], dimension: int) -> jax.Array:
    """int32 indices along `dimension` of a [rows, cols] tile, in the wgmma result layout."""
    if self.interpret:
      return lax.broadcasted_iota(jnp.int32, shape, dimension)
    return plgpu.broadcasted_iota(jnp.int32, shape, dimension, layout=plgpu.Layout.WGMMA)

  def mma(self, acc: jax.Array | None, a, b, *, transpose_b: bool,
          shape: tuple[int, int] | None = None,
          while_in_flight: Callable[[], None] | None = None) -> jax.Array:
    """acc + a @ B in float32, where B is the SMEM tile `b`, or its transpose.

    Args:
      acc: float32 [m, n] to accumulate into, or None for a fresh zero accumulator.
      a: [m, k]: an SMEM ref, or (16-bit types) a register value.
      b: SMEM ref holding B [k, n], or B^T [n, k] when `transpose_b` (the only form
        an FP8 wgmma reads: both operands K-major).
      transpose_b: whether `b` holds B^T.
      shape: (m, n) of the product; needed when `acc` is None.
      while_in_flight: called after the product is issued and before it is waited
        for (compiled: while the tensor cores work), e.g. to pass a ping-pong turn.

    Returns:
      float32 [m, n]; the product has completed, so `a` and `b` may be reused.
    """
    if self.interpret:
      a_value = a[...].astype(jnp.float32)  # a register value or an SMEM ref alike
      b_value = b[...].astype(jnp.float32)
      if transpose_b:
        b_value = b_value.T
      product = jnp.dot(a_value, b_value, precision=lax.Precision.HIGHEST,
                        preferred_element_type=jnp.float32)
      if while_in_flight is not None:
        while_in_flight()
      return product if acc is None else acc + product

    b_operand = plgpu.transpose_ref(b, (1, 0)) if transpose_b else b
    if acc is None:
      def fresh(acc_ref):
        plgpu.wgmma(acc_ref, a, b_operand)
        if while_in_flight is not None:
          while_in_flight()
        return acc_ref[...]  # waits for the wgmma
      return pl.run_scoped(fresh, plgpu.ACC(shape, jnp.float32))

    def accumulate(acc_ref):
      plgpu.wgmma(acc_ref, a, b_operand)
      if while_in_flight is not None:
        while_in_flight()
    # run_state waits for the wgmma before it returns the accumulator.
    return pl.run_state(accumulate)(plgpu.ACC.init(acc))

  def overlapped_mma(self, shape: tuple[int, int], a, b, acc: jax.Array, c, d, *,
                     transpose_d: bool, while_in_flight: Callable[[], None],
                     consume: Callable[[jax.Array, Any], Any], state):
    """Two products in flight at once: S = a @ b^T and acc + c @ D, with `consume(S, state)`
    run while the second is still on the tensor cores.

    Issues S (fresh float32 [shape]) and then acc + c @ D (D the SMEM tile `d`, or its
    transpose when `transpose_d`), calls `while_in_flight()`, waits for S alone (the
    wgmma groups complete in order), computes `consume(S, state)` and only then waits for
    the second product.

    Args:
      shape: (m, n) of S.
      a, b: S's operands: a [m, k] in SMEM; b holds B^T [n, k] (K-major).
      acc: float32 accumulator of the second product.
      c: [m, k2] register value (16-bit) or SMEM ref; d: SMEM tile.
      transpose_d, while_in_flight: as `mma`'s transpose_b and while_in_flight.
      consume: consume(S, state) -> new state (a pytree of arrays like `state`).
      state: the state `consume` starts from.

    Returns:
      (acc + c @ D, consume's new state); both products have completed.
    """
    if self.interpret:
      s_value = self.mma(None, a, b, transpose_b=True, shape=shape,
                         while_in_flight=while_in_flight)
      new_state = consume(s_value, state)
      return self.mma(acc, c, d, transpose_b=transpose_d), new_state

    d_operand = plgpu.transpose_ref(d, (1, 0)) if transpose_d else d

    def body(refs):
      acc_ref, state_refs = refs

      # S's accumulator is scoped inside the state: a wgmma on an accumulator that
      # run_state does not own cannot be discharged (jax 0.10.2).
      def with_s(s_ref):
        plgpu.wgmma(s_ref, a, plgpu.transpose_ref(b, (1, 0)))
        plgpu.wgmma(acc_ref, c, d_operand)
        while_in_flight()
        s_value = plgpu.wgmma_accumulator_load(s_ref, wait_n=1)  # S done, acc in flight
        new_state = consume(s_value, jax.tree.map(lambda r: r[...], state_refs))
        jax.tree.map(lambda r, v: r.__setitem__(Ellipsis, v), state_refs, new_state)
      pl.run_scoped(with_s, plgpu.ACC(shape, jnp.float32))
    # run_state waits for the accumulator before it returns it.
    return pl.run_state(body)((plgpu.ACC.init(acc), state))
