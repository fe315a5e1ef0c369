"""Finds the GEMMs in optimized HLO, classifies them and traces their operands.

A GEMM is one of:
* a custom call whose target starts with `__cublas$` (`__cublas$lt$matmul$f8` is
  the cuBLASLt FP8 GEMM; `__cublas$lt$matmul` / `__cublas$gemm` are not FP8),
* a fusion with `kind=kCustom` whose backend config names a Triton GEMM
  (`__triton_gemm`, `__triton_nested_gemm_fusion`), or another kCustom fusion
  holding a `dot` (cuDNN / custom fusions: kind "other"),
* a `dot` still present in the entry computation or in an ordinary fusion,
* a grouped (ragged) GEMM kernel: a Mosaic GPU custom call that
  `fp8jax.lowering.grouped_gemms` recognizes (MoE experts; kind "grouped").

Each operand is traced backwards from the GEMM through bitcasts, copies,
get-tuple-element, elementwise ops (following the one full-size operand, not
broadcast scales) and into fusions, collecting transposes, converts and pads.
The trace stops at a parameter, at another GEMM or reduction, or, once it has
passed the cast to FP8, at the boundary of the fusion that quantizes (so a
transpose fused into the quantize is seen, what produced its input is not).
"""
from __future__ import annotations

import dataclasses

from fp8jax.lowering.grouped_gemms import grouped_gemm
from fp8jax.lowering.hlo_text import ArrayShape, HloModule, Instruction
from fp8jax.lowering.report import Convert, Gemm, GemmKind, Operand, Transpose, is_fp8

FP8_GEMM_TARGET = "__cublas$lt$matmul$f8"
# The name of fp8jax's fused cast-transpose-amax Pallas kernel in HLO op names.
FUSED_QUANTIZE_KERNEL = "cast_transpose_amax"
_TRITON_GEMM_KINDS = ("__triton_gemm", "__triton_nested_gemm_fusion")
_PASS_THROUGH = {
    "bitcast", "reshape", "copy", "transpose", "convert", "pad", "slice", "multiply", "divide",
    "add", "subtract", "clamp", "maximum", "minimum", "negate", "abs", "select", "round-nearest-even",
    "round-nearest-afz", "floor", "ceil", "sign", "bitcast-convert", "copy-start", "copy-done",
    "optimization-barrier",
}
_SCALE_LIKE = {"broadcast", "constant", "iota"}
_MAX_STEPS = 400


def find_gemms(module: HloModule, ptx_mma: dict[str, tuple[str, ...]] | None = None
               ) -> tuple[Gemm, ...]:
  """All GEMMs of `module`, in the order they appear in the entry computation.

  Args:
    module: the parsed optimized HLO.
    ptx_mma: optional {kernel name: matrix instructions in its PTX} (see `fp8jax.lowering.ptx`).

  Returns:
    A tuple of `Gemm`.
  """
  gemms = []
  seen = set()

  def visit(computation_name, stack):
    for instr in module.computations[computation_name].instructions.values():
      gemm = _as_gemm(module, instr, stack, ptx_mma or {})
      if gemm is not None:
        # Where it is used: the roles come from the call path (`Gemm.role`).
        gemms.append(dataclasses.replace(
            gemm, caller_op_names=tuple(caller.op_name for caller in stack)))
        continue
      callee = module.called(instr) if instr.opcode in ("fusion", "call", "while",
                                                        "conditional") else None
      for body in _bodies(module, instr) if callee is None else [callee.name]:
        if (body, instr.name) not in seen:
          seen.add((body, instr.name))
          visit(body, stack + [instr])

  visit(module.entry, [])
  return tuple(gemms)


def _bodies(module, instr):
  names = []
  for key in ("body", "condition", "branch_computations", "true_computation",
              "false_computation"):
    raw = instr.attributes.get(key, "")
    for part in raw.strip("{}").split(","):
      part = part.strip().lstrip("%")
      if part in module.computations:
        names.append(part)
  return names


def _fusion_kind(instr: Instruction) -> str:
  return instr.backend_config().get("fusion_backend_config", {}).get("kind", "")


def dot_inside(module, computation) -> Instruction | None:
  """The dot (or scaled dot) in a GEMM fusion, looking into nested fusions; None if none."""
  for instr in computation.instructions.values():
    if instr.opcode in ("dot", "scaled-dot"):
      return instr
    if instr.opcode == "fusion":
      inner = module.called(instr)
      found = dot_inside(module, inner) if inner is not None else None
      if found is not None:
        return found
  return None


def _as_gemm(module, instr, stack, ptx_mma) -> Gemm | None:
  if instr.opcode == "custom-call":
    target = instr.attributes.get("custom_call_target", "")
    if not target.startswith("__cublas$"):
      return _as_grouped_gemm(module, instr, stack, target)
    kind = GemmKind.CUBLASLT_FP8 if target == FP8_GEMM_TARGET else GemmKind.CUBLAS
    dims = instr.backend_config().get("gemm_backend_config", {}).get("dot_dimension_numbers", {})
    contracting = ([int(d) for d in dims.get("lhs_contracting_dimensions", [])],
                   [int(d) for d in dims.get("rhs_contracting_dimensions", [])])
    lhs = _trace(module, instr, 0, stack, contracting[0] if dims else None)
    rhs = _trace(module, instr, 1, stack, contracting[1] if dims else None)
    output = str(instr.shapes[0]) if instr.shapes else "?"
    return _finish(instr, kind, target, lhs, rhs, output, ())

  if instr.opcode == "fusion" and instr.attributes.get("kind") == "kCustom":
    callee = module.called(instr)
    dot = dot_inside(module, callee) if callee is not None else None
    if dot is None:
      return None
    fusion_kind = _fusion_kind(instr)
    kind = GemmKind.TRITON if fusion_kind in _TRITON_GEMM_KINDS else GemmKind.OTHER
    lhs = _trace(module, dot, 0, stack + [instr], list(dot.int_list("lhs_contracting_dims")))
    rhs = _trace(module, dot, 1, stack + [instr], list(dot.int_list("rhs_contracting_dims")))
    output = str(instr.shapes[0]) if instr.shapes else "?"
    mma = ptx_mma.get(_kernel_name(instr.name), ())
    return _finish(instr, kind, fusion_kind or "kCustom fusion", lhs, rhs, output, mma,
                   op_name=dot.op_name or instr.op_name)

  if instr.opcode == "dot":
    lhs = _trace(module, instr, 0, stack, list(instr.int_list("lhs_contracting_dims")))
    rhs = _trace(module, instr, 1, stack, list(instr.int_list("rhs_contracting_dims")))
    name = instr.name if not stack else f"{stack[-1].name}/{instr.name}"
    return _finish(dataclasses.replace(instr, name=name), GemmKind.DOT, "dot", lhs, rhs,
                   str(instr.shape), ())
  return None


def _as_grouped_gemm(module, instr, stack, target) -> Gemm | None:
  grouped = grouped_gemm(module, instr)
  if grouped is None:
    return None
  lhs = _trace(module, instr, grouped.lhs_index, stack, [grouped.lhs_contracting])
  rhs = _trace(module, instr, grouped.rhs_index, stack, [grouped.rhs_contracting])
  return _finish(instr, GemmKind.GROUPED, f"{target} ({grouped.kernel})", lhs, rhs,
                 str(instr.shapes[0]), ())


def _kernel_name(instruction_name: str) -> str:
  """The PTX entry name XLA gives the kernel of an instruction ('a.1' -> 'a_1')."""
  return instruction_name.replace(".", "_").replace("-", "_")


def _finish(instr, kind, target, lhs, rhs, output, mma, op_name=None) -> Gemm:
  runs_in_fp8, why = _fp8_verdict(kind, lhs, rhs, mma)
  return Gemm(name=instr.name, kind=kind, target=target, lhs=lhs, rhs=rhs, output=output,
              op_name=op_name if op_name is not None else instr.op_name, ptx_mma=tuple(mma),
              runs_in_fp8=runs_in_fp8, why_not_fp8=why)


def fp8_mma(instruction: str) -> bool:
  """True for a PTX matrix instruction that takes FP8 operands (e4m3 / e5m2)."""
  return "e4m3" in instruction or "e5m2" in instruction


def _fp8_verdict(kind, lhs, rhs, mma) -> tuple[bool, str]:
  dtypes = f"{lhs.dtype} x {rhs.dtype}"
  upcast = [str(c) for op in (lhs, rhs) for c in op.converts if c.upcasts_fp8]
  if kind == GemmKind.CUBLASLT_FP8:
    return True, ""
  if kind == GemmKind.GROUPED and is_fp8(lhs.dtype) and is_fp8(rhs.dtype) and not upcast:
    # fp8jax's grouped kernels multiply their FP8 operands with e4m3 wgmma only (their
    # PTX is checked in a deviceless compile: tests/test_ragged_matmul_ptx.py); a
    # Mosaic kernel's PTX is not among XLA's dumped kernels.
    return True, ""
  if kind == GemmKind.TRITON:
    if not (is_fp8(lhs.dtype) and is_fp8(rhs.dtype)):
      reason = f"Triton GEMM on {dtypes}"
      return False, reason + (f" (FP8 upcast before it: {', '.join(upcast)})" if upcast else "")
    if not mma:
      return False, (f"Triton GEMM with {dtypes} operands in HLO, but no PTX was inspected to "
                     "show FP8 tensor-core instructions (compile with ptx=True)")
    # Every matrix instruction must be FP8: a kernel that mixes in f16 mma.sync
    # runs part of the product off the FP8 tensor cores.
    if mma and all(fp8_mma(m) for m in mma):
      return True, ""
    return False, (f"Triton GEMM with {dtypes} operands in HLO, but its PTX upcasts them: "
                   f"{', '.join(mma)}")
  if upcast:
    return False, f"{kind.value} GEMM on {dtypes}; FP8 data upcast before it ({', '.join(upcast)})"
  if lhs.dtype == rhs.dtype == "f8e5m2" or "f8e5m2" in {c.source for op in (lhs, rhs)
                                                       for c in op.converts}:
    return False, f"{kind.value} GEMM on {dtypes} (E5M2 x E5M2 has no FP8 GEMM)"
  return False, f"{kind.value} GEMM on {dtypes}"


@dataclasses.dataclass
class _Frame:
  """A fusion the trace has entered: its caller instruction and the transposes seen inside."""

  fusion: Instruction
  transposes: list
  quantizes: bool = False


def _trace(module: HloModule, gemm: Instruction, operand_index: int, stack: list,
           contracting: list[int] | None) -> Operand:
  """Follows operand `operand_index` of `gemm` backwards (see the module docstring)."""
  comp = gemm.computation
  first = module.instruction(comp, gemm.operands[operand_index])
  gemm_shape = first.shape
  contracting_minor = _contracting_minor(gemm_shape, contracting)

  frames = [_Frame(f, []) for f in stack if f.opcode == "fusion"]
  # Frames of the GEMM's own fusion(s) (e.g. Triton): the trace may leave them through
  # their parameters; transposes inside them are not materialized buffers.
  base_depth = len(frames)
  transposes: list[Transpose] = []
  converts: list[Convert] = []
  pads: list[str] = []
  quantized_in = None
  quantize_depth = None
  tuple_index = None
  cur = first
  source = "?"

  def context_name():
    return frames[-1].fusion.name if len(frames) > base_depth else None

  for _ in range(_MAX_STEPS):
    op = cur.opcode
    if op == "get-tuple-element":
      tuple_index = int(cur.attributes.get("index", "0"))
      cur = module.instruction(comp, cur.operands[0])
      continue
    if op == "tuple":
      if tuple_index is None:
        source = f"tuple {cur.name}"
        break
      cur = module.instruction(comp, cur.operands[tuple_index])
      tuple_index = None
      continue
    if op == "parameter":
      if not frames:
        source = f"{_shape(cur)} parameter {cur.name}"
        break
      frame = frames.pop()
      if len(frames) >= base_depth:
        transposes.extend(_materialized(frame))
      # Leaving the GEMM's own fusion: from here on every fusion is a materialized step.
      base_depth = min(base_depth, len(frames))
      number = int(cur.attributes["_operand_text"].strip().split(",")[0])
      comp = frame.fusion.computation
      cur = module.instruction(comp, frame.fusion.operands[number])
      if quantize_depth is not None and len(frames) < quantize_depth:
        source = _describe(module, comp, cur)
        break
      continue
    if op == "fusion":
      if _is_gemm_instruction(module, cur):
        source = f"output of GEMM {cur.name}"
        break
      callee = module.called(cur)
      if callee is None or callee.root is None:
        source = f"fusion {cur.name}"
        break
      if quantize_depth is not None:
        source = f"{_shape(cur)} {cur.name}"
        break
      frames.append(_Frame(cur, []))
      comp = callee.name
      cur = callee.instructions[callee.root]
      continue
    if op == "custom-call":
      target = cur.attributes.get("custom_call_target", "")
      if FUSED_QUANTIZE_KERNEL in cur.op_name and cur.operands:
        # fp8jax's cast-transpose-amax kernel: output 0 is the FP8 copy, output 1
        # the transposed FP8 copy, both written in the one pass that reads the input.
        quantized_in = cur.name
        if tuple_index == 1:
          transposes.append(Transpose(cur.name, dtype=cur.shapes[1].dtype, in_quantize=True))
        source = _describe(module, comp, module.instruction(comp, cur.operands[0]))
        break
      source = (f"output of GEMM {cur.name}" if target.startswith("__cublas$")
                else f"custom-call {cur.name} ({target})")
      break
    if op not in _PASS_THROUGH:
      source = f"{op} {cur.name}" + (f" in {context_name()}" if context_name() else "")
      break

    if op == "convert":
      src_dtype = _dtype(module.instruction(comp, cur.operands[0]))
      dst_dtype = _dtype(cur)
      where = context_name() or cur.name
      converts.append(Convert(src_dtype, dst_dtype, where))
      if is_fp8(dst_dtype) and not is_fp8(src_dtype) and quantized_in is None:
        quantized_in = where
        quantize_depth = len(frames)
        if len(frames) > base_depth:
          frames[-1].quantizes = True
        else:
          # The cast is not inside a fusion: it is the boundary itself.
          source = _describe(module, comp, module.instruction(comp, cur.operands[0]))
          break
    elif op in ("transpose", "copy"):
      perm = _physical_permutation(module.instruction(comp, cur.operands[0]), cur)
      if perm is not None:
        if len(frames) > base_depth:
          frames[-1].transposes.append((perm, cur))
        else:
          transposes.append(Transpose(cur.name, _dtype(cur), in_quantize=False))
    elif op == "pad":
      operand_shape = module.instruction(comp, cur.operands[0]).shape
      if operand_shape is not None and cur.shape is not None:
        changed = [f"{a}->{b}" for a, b in zip(operand_shape.dims, cur.shape.dims) if a != b]
        pads.append(f"dims {', '.join(changed)} in {context_name() or cur.name}")

    nxt = _main_operand(module, comp, cur)
    if nxt is None:
      source = f"{op} {cur.name}" + (f" in {context_name()}" if context_name() else "")
      break
    cur = nxt
  else:
    source = "trace too long"

  # Fusions still open (the trace stopped inside them) may hold transposes too.
  while len(frames) > base_depth:
    transposes.extend(_materialized(frames.pop()))

  shape = gemm_shape
  dtype = shape.dtype if shape is not None else "?"
  return Operand(shape=str(shape) if shape is not None else "?", dtype=dtype,
                 contracting_minor=contracting_minor, transposes=tuple(transposes),
                 converts=tuple(reversed(converts)), pads=tuple(reversed(pads)),
                 quantized_in=quantized_in, source=source)


def _describe(module, comp, instr) -> str:
  """'bf16[64,128] x.1', or 'output of GEMM cublas-gemm.3' for a GEMM result."""
  producer = instr
  while producer.opcode in ("get-tuple-element", "bitcast") and producer.operands:
    producer = module.instruction(comp, producer.operands[0])
  if (producer.opcode == "custom-call" and
      producer.attributes.get("custom_call_target", "").startswith("__cublas$")) or (
          _is_gemm_instruction(module, producer)):
    return f"{_shape(instr)} output of GEMM {producer.name}"
  return f"{_shape(instr)} {instr.name}"


def _materialized(frame: _Frame) -> list[Transpose]:
  """The transposes one fusion writes on the traced path, after composing them.

  Two transposes that undo each other inside one fusion (XLA does this when it
  writes one output in each layout) leave the buffer in its input order: none.
  """
  if not frame.transposes:
    return []
  perms = [p for p, _ in reversed(frame.transposes)]  # in execution order
  if len({len(p) for p in perms}) == 1:
    total = list(range(len(perms[0])))
    for p in perms:
      total = [total[i] for i in p]
    if total == sorted(total):
      return []
    perms_kept = [frame.transposes[0][1]]
  else:
    perms_kept = [instr for _, instr in frame.transposes]
  return [Transpose(frame.fusion.name, _dtype(instr), in_quantize=frame.quantizes)
          for instr in perms_kept]


def _physical_permutation(operand: Instruction, instr: Instruction) -> tuple[int, ...] | None:
  """How a transpose / copy reorders memory, on dims larger than 1; None if it does not.

  Returns `p` with `out_order[i] = in_order[p[i]]`, where the orders list the
  operand's logical dims from outermost to innermost in memory.
  """
  a, b = operand.shape, instr.shape
  if a is None or b is None:
    return None
  in_order = list(a.major_to_minor)
  if instr.opcode == "transpose":
    d = instr.int_list("dimensions")
    out_order = [d[j] for j in b.major_to_minor]
  else:  # copy: same logical dims, maybe another layout
    out_order = list(b.major_to_minor)
  keep = {i for i, n in enumerate(a.dims) if n > 1}
  in_order = [i for i in in_order if i in keep]
  out_order = [i for i in out_order if i in keep]
  if in_order == out_order:
    return None
  return tuple(in_order.index(i) for i in out_order)


def _main_operand(module, comp, instr) -> Instruction | None:
  """The operand carrying the tensor (not a broadcast scale, bound or padding value)."""
  operands = [module.instruction(comp, name) for name in instr.operands]
  if instr.opcode in ("pad", "slice", "bitcast", "reshape", "copy", "transpose", "convert",
                      "copy-start", "copy-done", "bitcast-convert", "optimization-barrier"):
    return operands[0] if operands else None
  full = [o for o in operands
          if o.opcode not in _SCALE_LIKE and o.shape is not None and any(d > 1 for d in o.shape.dims)]
  if instr.opcode == "select":
    full = [o for o in full if o.shape.dtype != "pred"]
  if len(full) == 1:
    return full[0]
  return None


def _is_gemm_instruction(module, instr) -> bool:
  if instr.opcode == "fusion" and instr.attributes.get("kind") == "kCustom":
    callee = module.called(instr)
    return callee is not None and dot_inside(module, callee) is not None
  return False


def _contracting_minor(shape: ArrayShape | None, contracting: list[int] | None) -> bool | None:
  if shape is None or contracting is None or shape.minor_to_major is None:
    return None
  for dim in shape.minor_to_major:  # innermost first
    if shape.dims[dim] > 1:
      return dim in contracting
  return None


def _dtype(instr: Instruction) -> str:
  return instr.shape.dtype if instr.shape is not None else "?"


def _shape(instr: Instruction) -> str:
  return str(instr.shape) if instr.shape is not None else instr.name
