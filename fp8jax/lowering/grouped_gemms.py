"""Grouped (ragged) GEMM kernels in optimized HLO: the expert GEMMs of MoE layers.

A Mosaic GPU kernel is an opaque custom call to XLA (`custom_call_target="mosaic_gpu..."`):
nothing in the HLO says it multiplies matrices. A grouped GEMM kernel is known by its
operands and result, which no other kind of kernel has together: exactly two operands of
one matrix dtype (FP8, bf16 or f16; the float32 descales do not count), an integer operand
(the group sizes, or a schedule made from them), and

  ragged      a [M, C] (rows sorted by group), b [G, Nout, C] or [G, C, Nout]  -> [M, Nout]
  transposed  a [M, P], b [M, Q], or both token-minor ([P, M], [Q, M])          -> [G, P, Q]

Its FLOPs are those of one dense GEMM over all M rows, 2 M C Nout and 2 M P Q: each row
meets only its own group's weights (the kernels never expand G-fold). Rows past the groups'
sum do no work on the GPU but cannot be told from the shapes, so they are counted.

Which kernel it is, for the tables, comes from its name where the HLO has one:

  ragged_matmul, transposed_ragged_matmul   fp8jax's FP8 kernels: their wrappers' named
                                            scopes in the op_name (and fp8_ragged_dot's
                                            "fp8_grouped_fprop" / "_dgrad" / "_wgrad")
  ragged_dot_mgpu, transposed_ragged_dot_mgpu
                                            JAX's bf16 Hopper kernels: a named scope of that
                                            name around the call, or the source their MLIR
                                            module records (backend_config) where it does:
                                            their op_name is a generic ".../body/mpmd_map",
                                            and a backward pass's module records only the
                                            caller's frames
  grouped_gemm                              any other
"""
from __future__ import annotations

import dataclasses
import re

from fp8jax.lowering.hlo_text import ArrayShape, HloModule, Instruction
from fp8jax.lowering.report import is_fp8

MOSAIC_TARGET_PREFIX = "mosaic_gpu"
# op_name scopes -> the kernel they name (a scope matches as a whole name in the path).
_SCOPES = (("transposed_ragged_matmul", "transposed_ragged_matmul"),
           ("ragged_matmul", "ragged_matmul"),
           ("transposed_ragged_dot_mgpu", "transposed_ragged_dot_mgpu"),
           ("ragged_dot_mgpu", "ragged_dot_mgpu"),
           ("fp8_grouped_wgrad", "transposed_ragged_matmul"),
           ("fp8_grouped_fprop", "ragged_matmul"),
           ("fp8_grouped_dgrad", "ragged_matmul"))
# JAX's bf16 kernels: the file or the function the kernel's source locations name.
_JAX_SOURCES = re.compile(r"(transposed_)?ragged_dot(?:_mgpu\.py|\.<locals>)")
_MATRIX_DTYPES = ("bf16", "f16")
_INTEGER_DTYPES = ("s32", "u32", "s64", "u64", "s16", "u16")
UNNAMED = "grouped_gemm"


@dataclasses.dataclass(frozen=True)
class GroupedGemm:
  """One grouped GEMM kernel of the program.

  Attributes:
    kernel: which kernel ('ragged_matmul', 'transposed_ragged_matmul', 'ragged_dot_mgpu',
      'transposed_ragged_dot_mgpu'; `UNNAMED` where the HLO does not say).
    transposed: True for the wgrad form (out [G, P, Q] summed over each group's tokens).
    dtype: the operands' dtype ('f8e4m3fn', 'bf16', ...).
    groups: G.
    m, k, n: the product as one dense GEMM [m, k] x [k, n]: (M, C, Nout) for the ragged
      form, (P, M, Q) for the transposed one (k: the tokens, summed per group).
    lhs_index, rhs_index: which operands of the custom call are the two matrices.
    lhs_contracting, rhs_contracting: their contracted dim.
  """

  kernel: str
  transposed: bool
  dtype: str
  groups: int
  m: int
  k: int
  n: int
  lhs_index: int
  rhs_index: int
  lhs_contracting: int
  rhs_contracting: int

  @property
  def flops(self) -> int:
    """2 m k n: one multiply and one add per term, each token with its own group only."""
    return 2 * self.m * self.k * self.n


def grouped_gemm(module: HloModule, instr: Instruction) -> GroupedGemm | None:
  """The grouped GEMM `instr` is, or None (not a Mosaic GPU call, or not a grouped GEMM's
  operands and result)."""
  if instr.opcode != "custom-call" or not instr.attributes.get(
      "custom_call_target", "").startswith(MOSAIC_TARGET_PREFIX):
    return None
  out = instr.shape
  if out is None or len(out.dims) not in (2, 3):
    return None
  computation = module.computations[instr.computation]
  matrices, has_integers = [], False
  for index, name in enumerate(instr.operands):
    producer = computation.instructions.get(name)
    shape = producer.shape if producer is not None else None
    if shape is None:
      continue
    if is_fp8(shape.dtype) or shape.dtype in _MATRIX_DTYPES:
      matrices.append((index, shape))
    has_integers |= shape.dtype in _INTEGER_DTYPES
  if not has_integers or len(matrices) != 2 or matrices[0][1].dtype != matrices[1][1].dtype:
    return None
  (lhs_index, lhs), (rhs_index, rhs) = matrices
  transposed = len(out.dims) == 3
  sizes = _transposed_sizes(lhs, rhs, out) if transposed else _ragged_sizes(lhs, rhs, out)
  if sizes is None:
    return None
  groups, m, k, n, lhs_contracting, rhs_contracting = sizes
  return GroupedGemm(kernel=_kernel_name(instr, transposed), transposed=transposed,
                     dtype=lhs.dtype, groups=groups, m=m, k=k, n=n, lhs_index=lhs_index,
                     rhs_index=rhs_index, lhs_contracting=lhs_contracting,
                     rhs_contracting=rhs_contracting)


def _kernel_name(instr: Instruction, transposed: bool) -> str:
  """The name of the grouped kernel of this form that the call's op_name or recorded
  source gives, else `UNNAMED`."""
  for scope, kernel in _SCOPES:
    # A scope is a whole name in the op_name's path: 'a/ragged_matmul/b',
    # 'transpose(jvp(fp8_grouped_dgrad))/...'.
    if (kernel.startswith("transposed_") == transposed
        and re.search(rf"(?:^|[/(]){scope}(?:$|[/)])", instr.op_name)):
      return kernel
  for found in _JAX_SOURCES.finditer(instr.attributes.get("backend_config", "")):
    if bool(found.group(1)) == transposed:
      return "transposed_ragged_dot_mgpu" if transposed else "ragged_dot_mgpu"
  return UNNAMED


def _ragged_sizes(a: ArrayShape, b: ArrayShape, out: ArrayShape):
  """(G, M, C, Nout, a's and b's contracted dim) of a [M, C] by b [G, ., .] -> [M, Nout]."""
  if len(a.dims) != 2 or len(b.dims) != 3:
    return None
  (m, c), (groups, b1, b2), (out_m, n) = a.dims, b.dims, out.dims
  if out_m != m:
    return None
  if (b1, b2) == (n, c):
    return groups, m, c, n, 1, 2
  if (b1, b2) == (c, n):
    return groups, m, c, n, 1, 1
  return None


def _transposed_sizes(a: ArrayShape, b: ArrayShape, out: ArrayShape):
  """(G, P, M, Q, a's and b's contracted dim) of per-group a^T b -> [G, P, Q]."""
  if len(a.dims) != 2 or len(b.dims) != 2:
    return None
  groups, p, q = out.dims
  if a.dims[0] == p and b.dims[0] == q and a.dims[1] == b.dims[1]:
    return groups, p, a.dims[1], q, 1, 1  # token-minor: [P, M], [Q, M]
  if a.dims[1] == p and b.dims[1] == q and a.dims[0] == b.dims[0]:
    return groups, p, a.dims[0], q, 0, 0  # token-major: [M, P], [M, Q]
  return None

