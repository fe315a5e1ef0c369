"""The lowering report: what every GEMM of a compiled function became.

Plain frozen dataclasses, so a test can assert on fields and a person can
print the report (`str(report)` is a table with one block per GEMM).
"""
from __future__ import annotations

import dataclasses
import enum

FP8_DTYPES = ("f8e4m3fn", "f8e5m2", "f8e4m3", "f8e4m3fnuz", "f8e5m2fnuz", "f8e4m3b11fnuz",
              "f8e3m4", "f8e8m0fnu")


def is_fp8(dtype: str) -> bool:
  """True for an XLA FP8 dtype name such as 'f8e4m3fn'."""
  return dtype in FP8_DTYPES


GEMM_ROLES = ("fprop", "dgrad", "wgrad")


def role_in(op_name: str) -> str:
  """The GEMM role ('fprop', 'dgrad', 'wgrad') whose fp8jax scope (`fp8_<role>`,
  `fp8_grouped_<role>`) an op_name holds innermost, or ''."""
  found = [(op_name.rfind(scope), role) for role in GEMM_ROLES
           for scope in (f"fp8_{role}", f"fp8_grouped_{role}") if scope in op_name]
  return max(found)[1] if found else ""


class GemmKind(str, enum.Enum):
  """How XLA lowered one GEMM."""

  CUBLASLT_FP8 = "cublaslt-fp8"   # custom call __cublas$lt$matmul$f8: FP8 tensor cores
  CUBLAS = "cublas"               # __cublas$lt$matmul or __cublas$gemm: a non-FP8 GEMM
  TRITON = "triton"               # a Triton GEMM fusion (kind=kCustom, __triton_*gemm*)
  DOT = "dot"                     # a `dot` XLA left in the HLO (emitted as a loop/reduction)
  OTHER = "other"                 # anything else holding a dot (cuDNN fusion, custom fusion)
  GROUPED = "grouped"             # a grouped (ragged) GEMM kernel: Mosaic GPU, MoE experts


class ExpertPath(str, enum.Enum):
  """How the GEMM of a grouped matmul (MoE experts: `lax.ragged_dot`,
  `fp8jax.fp8_ragged_dot`) runs.

  GROUPED_KERNEL: one kernel for all experts, each row against its own expert's weights
    (fp8jax's grouped FP8 kernels, JAX's bf16 Mosaic GPU ones); the FLOPs of one GEMM.
  TILE_LOOP: a loop of GEMMs over (expert, row tile) work items, one launch each:
    `fp8_ragged_dot`'s jnp twin where the kernels do not apply (a K or N off their
    128 tiles, a GPU that is not a Hopper); XLA makes its tile products cuBLASLt FP8 GEMMs.
  DENSE_EXPANSION: XLA's own `lax.ragged_dot`: every row against every expert's weights,
    masked (G times the FLOPs), in one GEMM.
  """

  GROUPED_KERNEL = "grouped kernel"
  TILE_LOOP = "per-tile loop"
  DENSE_EXPANSION = "dense expansion"


@dataclasses.dataclass(frozen=True)
class Transpose:
  """A physical transpose on an operand's path (a buffer written in another element order).

  Attributes:
    instruction: the HLO instruction (usually a fusion) that writes the transposed buffer.
    dtype: dtype of the transposed data (f8 if XLA transposed after quantizing).
    in_quantize: True when the transpose is fused into the fusion that quantizes
      the tensor (the data is read once, written in both layouts), False for a
      separate transpose kernel.
  """

  instruction: str
  dtype: str
  in_quantize: bool

  def __str__(self) -> str:
    where = "fused into the quantize" if self.in_quantize else "separate kernel"
    return f"{self.instruction} ({self.dtype}, {where})"


@dataclasses.dataclass(frozen=True)
class Convert:
  """A dtype conversion on an operand's path."""

  source: str
  target: str
  instruction: str

  @property
  def upcasts_fp8(self) -> bool:
    """True when an FP8 value is widened (the GEMM then does not see FP8 data)."""
    return is_fp8(self.source) and not is_fp8(self.target)

  def __str__(self) -> str:
    return f"{self.source}->{self.target}"


@dataclasses.dataclass(frozen=True)
class Operand:
  """One GEMM operand and how XLA produced it.

  Attributes:
    shape: shape as the GEMM reads it, e.g. 'f8e4m3fn[64,128]'.
    dtype: dtype the GEMM reads (for a Triton fusion: at the `dot` inside it).
    contracting_minor: whether the contracting dim is the innermost in memory
      (what cuBLASLt FP8 needs on Hopper: "TN"); None if unknown.
    transposes: physical transposes on the path from the traced source.
    converts: dtype conversions on the path, nearest the GEMM last.
    pads: pads on the path ('dims 100->112 in loop_pad_fusion.1').
    quantized_in: the instruction that casts the tensor to FP8, if on the path.
    source: where the trace stopped (the quantized tensor's input, a parameter,
      another GEMM's output, or an op the trace does not look through).
  """

  shape: str
  dtype: str
  contracting_minor: bool | None
  transposes: tuple[Transpose, ...]
  converts: tuple[Convert, ...]
  pads: tuple[str, ...]
  quantized_in: str | None
  source: str

  @property
  def upcast_fp8(self) -> bool:
    """True if FP8 data on the path is converted to a wider type before the GEMM."""
    return any(c.upcasts_fp8 for c in self.converts)


@dataclasses.dataclass(frozen=True)
class Gemm:
  """One GEMM in the optimized HLO.

  Attributes:
    name: the HLO instruction (custom call or fusion).
    kind: how it was lowered (`GemmKind`).
    target: the custom-call target or the fusion kind ('__cublas$lt$matmul$f8', ...).
    lhs, rhs: the two operands.
    output: output shape, e.g. 'f32[64,256]'.
    op_name: the JAX op in the metadata ('.../transpose(jvp())/dot_general' is backward).
    ptx_mma: for kernels XLA generated (Triton), the matrix instructions in its PTX;
      empty when there is no PTX (cuBLAS is a library) or it was not collected.
    runs_in_fp8: whether this GEMM is shown to run on FP8 tensor cores.
    why_not_fp8: for a GEMM that does not, the reason in words ('' otherwise).
    caller_op_names: the op_names of the instructions that call the computation holding
      it (loops, conditionals, calls, fusions), outermost first; () in the entry.
  """

  name: str
  kind: GemmKind
  target: str
  lhs: Operand
  rhs: Operand
  output: str
  op_name: str
  ptx_mma: tuple[str, ...]
  runs_in_fp8: bool
  why_not_fp8: str
  caller_op_names: tuple[str, ...] = ()

  @property
  def operand_dtypes(self) -> tuple[str, str]:
    return (self.lhs.dtype, self.rhs.dtype)

  @property
  def output_dtype(self) -> str:
    return self.output.split("[")[0]

  @property
  def is_backward(self) -> bool:
    """True for a GEMM of the backward pass (JAX names those 'transpose(jvp(...))'), read
    where it is used, as `role` is: the outermost op_name on its call path that names a
    pass ('transpose(' or 'jvp(')."""
    for op_name in self.caller_op_names + (self.op_name,):
      if "transpose(" in op_name:
        return True
      if "jvp(" in op_name:
        return False
    return False

  @property
  def transposes(self) -> tuple[Transpose, ...]:
    return self.lhs.transposes + self.rhs.transposes

  @property
  def role(self) -> str:
    """'fprop', 'dgrad' or 'wgrad' for fp8jax's GEMMs, else 'forward' / 'backward' from
    JAX's own naming.

    fp8jax's ops name their GEMMs' scopes (fp8jax.ops.dot, fp8jax.ops.ragged_dot). The
    role is read where the GEMM is used: from the outermost instruction on its call path
    that names one (a loop, a conditional), else from its own op_name. A loop body's own
    names can be another use's: JAX lowers a function it has lowered before (the per-tile
    body of `fp8_ragged_dot`'s jnp twin, the same for fprop and dgrad when K == N) once,
    with the names of its first use, and XLA keeps them, while each loop that runs it is
    lowered, and named, where it runs.
    """
    for op_name in self.caller_op_names + (self.op_name,):
      role = role_in(op_name)
      if role:
        return role
    return "backward" if self.is_backward else "forward"

  @property
  def expert_path(self) -> ExpertPath | None:
    """For a GEMM of a grouped matmul, how it runs (`ExpertPath`); None for other GEMMs.

    A grouped kernel is known by its kind; XLA's expansion of `lax.ragged_dot` keeps the
    primitive's name (`ragged_dot_general`) as the last part of its op_name; the jnp
    twin's tile GEMMs sit in a loop inside `fp8_ragged_dot`'s named scopes.
    """
    if self.kind == GemmKind.GROUPED:
      return ExpertPath.GROUPED_KERNEL
    if self.op_name.rsplit("/", 1)[-1].startswith("ragged_dot"):
      return ExpertPath.DENSE_EXPANSION
    if "fp8_grouped_" in self.op_name and "/while/" in self.op_name:
      return ExpertPath.TILE_LOOP
    return None


@dataclasses.dataclass(frozen=True)
class LoweringReport:
  """Every GEMM of one compiled function.

  Attributes:
    target: what it was compiled for ('H100 SXM, sm_90a (deviceless)' or a device kind).
    compiler_options: the XLA options used ({} = XLA defaults, None = not known).
    gemms: one `Gemm` per GEMM, in HLO order.
    hlo: the optimized HLO text the report was read from.
  """

  target: str
  compiler_options: dict | None
  gemms: tuple[Gemm, ...]
  hlo: str = dataclasses.field(repr=False, default="")

  @property
  def num_fp8(self) -> int:
    return sum(g.runs_in_fp8 for g in self.gemms)

  @property
  def all_fp8(self) -> bool:
    """True if there is at least one GEMM and every GEMM runs in FP8."""
    return bool(self.gemms) and self.num_fp8 == len(self.gemms)

  def summary(self) -> str:
    """'N of M GEMMs run in FP8'."""
    return f"{self.num_fp8} of {len(self.gemms)} GEMMs run in FP8"

  def gemms_by_kind(self) -> dict[GemmKind, tuple[Gemm, ...]]:
    """The GEMMs grouped by `GemmKind` (only kinds that occur)."""
    groups: dict[GemmKind, list[Gemm]] = {}
    for gemm in self.gemms:
      groups.setdefault(gemm.kind, []).append(gemm)
    return {kind: tuple(items) for kind, items in groups.items()}

  def not_fp8(self) -> tuple[Gemm, ...]:
    return tuple(g for g in self.gemms if not g.runs_in_fp8)

  def expert_gemms(self) -> tuple[Gemm, ...]:
    """The GEMMs of grouped matmuls (MoE experts), each with its `Gemm.expert_path`."""
    return tuple(g for g in self.gemms if g.expert_path is not None)

  def __str__(self) -> str:
    if self.compiler_options is None:
      options = "compiler options not recorded"
    else:
      options = ", ".join(f"{k}={v}" for k, v in sorted(self.compiler_options.items())
                          if k != "xla_dump_to") or "XLA defaults"
    lines = [f"GEMM lowering for {self.target} [{options}]",
             f"{self.summary()}"]
    counts = ", ".join(f"{len(v)} {k.value}" for k, v in self.gemms_by_kind().items())
    if counts:
      lines[-1] += f" ({counts})"
    experts = self.expert_gemms()
    if experts:
      paths: dict[str, int] = {}
      for gemm in experts:
        paths[gemm.expert_path.value] = paths.get(gemm.expert_path.value, 0) + 1
      lines.append(f"{len(experts)} expert GEMMs (grouped matmuls): " + ", ".join(
          f"{n} {path}" for path, n in paths.items()))
    expert_column = f" {'expert path':<16}" if experts else ""
    header = (f"{'#':>3}  {'kind':<13} {'lhs':<20} {'rhs':<20} {'out':<14} {'fp8':<4} "
              f"{'role':<8}{expert_column} transposes")
    lines += ["", header, "-" * len(header)]
    for i, g in enumerate(self.gemms):
      n_transposes = len(g.transposes)
      path = f" {(g.expert_path.value if g.expert_path else '-'):<16}" if experts else ""
      lines.append(f"{i:>3}  {g.kind.value:<13} {g.lhs.shape:<20} {g.rhs.shape:<20} "
                   f"{g.output:<14} {'yes' if g.runs_in_fp8 else 'NO':<4} {g.role:<8}{path} "
                   f"{n_transposes}")
    for i, g in enumerate(self.gemms):
      lines += ["", f"[{i}] {g.name}: {g.target}  ({g.op_name or 'no op_name'})"]
      if not g.runs_in_fp8:
        lines.append(f"    not FP8: {g.why_not_fp8}")
      if g.ptx_mma:
        lines.append(f"    PTX: {', '.join(g.ptx_mma)}")
      for label, op in (("lhs", g.lhs), ("rhs", g.rhs)):
        parts = [f"{op.shape}"]
        if op.contracting_minor is not None:
          parts.append("K innermost" if op.contracting_minor else "K NOT innermost")
        if op.quantized_in:
          parts.append(f"quantized in {op.quantized_in}")
        parts.append("transposes: " + ("; ".join(map(str, op.transposes)) or "none"))
        if op.converts:
          parts.append("converts: " + ", ".join(map(str, op.converts)))
        if op.pads:
          parts.append("pads: " + "; ".join(op.pads))
        parts.append(f"from {op.source}")
        lines.append(f"    {label}: " + " | ".join(parts))
    return "\n".join(lines)
