"""A roofline cost model of a compiled program: its kernels, their bytes and FLOPs, a time.

Reads the optimized HLO (the same reader as the GEMM report) and lists every
kernel the GPU would launch, in program order:

* GEMMs: cuBLAS / cuBLASLt custom calls, fusions holding a `dot` (Triton), and the
  grouped GEMM kernels of MoE layers (Mosaic GPU custom calls recognized by name and
  shape, `fp8jax.lowering.grouped_gemms`: fp8jax's FP8 `ragged_matmul` /
  `transposed_ragged_matmul`, JAX's bf16 `ragged_dot_mgpu` / `transposed_ragged_dot_mgpu`);
* fusions and the other ops XLA emits as kernels (copies, sorts, scatters, ...);
* Pallas / Mosaic / Triton kernels (custom calls);
* collectives: their launch and the bytes each device sends over NVLink.

Each kernel's time is a roofline plus a fixed cost per launch:

    t = max(flops / gemm_rate(dtype), (bytes_in + bytes_out) / hbm_bandwidth) + overhead

and the program's time is the sum (kernels of one program run one after another
on one stream). The fixed cost is `kernel_overhead` for a kernel of the program's
top level and `loop_kernel_overhead` for one inside a `while` loop, whose kernels
the GPU runtime launches one by one, iteration after iteration (the demo GPT's
steps on an H200 cost about 3 us per launch in their layer loop, against 1.3 us
in the dense layer's program). A `while` body counts as many times as its trip
count (XLA's `known_trip_count`; with a known count the GPU runtime never runs the
loop's condition). A loop of unknown count is counted as one iteration: its body
once, its condition twice. Of a `conditional`, the costliest branch counts. The
constants are `CostConstants`; override any of them for another chip or to match
your own measurements (`python -m benchmarks.roofline` measures them on a GPU).

Bytes are what a kernel must move at least: each operand read once (only the
sliced part of an operand the kernel slices), each result written once (only
the update of an in-place dynamic-update-slice). FLOPs are counted for GEMMs
only; elementwise work is assumed to hide under its memory traffic. A GEMM's
rate follows its operand dtype in the HLO, so a Triton GEMM on FP8 operands
(`--xla-defaults`) gets the FP8 rate even where its PTX widens them to f16
(see `fp8jax.lowering`; `fp8jax inspect` shows which GEMMs really run in FP8).
A grouped kernel's FLOPs are one dense GEMM's over all its rows (2 M K N, each row
with its own expert's weights), charged at the same calibrated rates as cuBLASLt's
(FP8 or bf16 by its operands): the grouped kernels' own rates are not measured yet
(`python -m benchmarks.grouped_gemm` measures them on a GPU), so a grouped kernel
slower than cuBLASLt on the same FLOPs makes the prediction optimistic for both
precisions alike. Other Pallas / Mosaic kernels (casts, attention) count bytes only.
"""
from __future__ import annotations

import dataclasses
import json
import math
import numbers
import re
from typing import Callable, Mapping, Sequence

from fp8jax.lowering.compile import compile_text
from fp8jax.lowering.gemms import dot_inside
from fp8jax.lowering.grouped_gemms import grouped_gemm
from fp8jax.lowering.hlo_text import ArrayShape, Computation, HloModule, Instruction, parse_hlo_module
from fp8jax.lowering.inspection import CUBLAS_ONLY_OPTIONS
from fp8jax.lowering.report import is_fp8

# Ops that launch nothing: buffers, views and bookkeeping.
_NO_KERNEL = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all",
              "add-dependency", "optimization-barrier", "domain", "partition-id", "replica-id",
              "copy-done", "send-done", "recv-done", "all-reduce-done", "all-gather-done",
              "collective-permute-done", "async-done", "async-update"}
_COLLECTIVES = {"all-reduce", "all-reduce-start", "all-gather", "all-gather-start",
                "reduce-scatter", "all-to-all", "collective-permute", "collective-permute-start",
                "send", "recv"}
_SLICING = {"slice", "dynamic-slice", "gather"}
# Element-by-element ops: a fusion computes them only for the elements its results need.
_ELEMENTWISE = {"convert", "negate", "abs", "exponential", "log", "sqrt", "rsqrt", "tanh",
                "logistic", "multiply", "add", "subtract", "divide", "maximum", "minimum",
                "clamp", "sign", "copy"}
_KERNEL_CALL_TARGETS = ("__gpu$xla.gpu.triton", "mosaic_gpu", "triton_kernel_call",
                        "__gpu$xla.gpu.mosaic")

_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "s32": 4,
          "u32": 4, "s64": 8, "u64": 8, "f16": 2, "bf16": 2, "f32": 4, "f64": 8, "c64": 8,
          "c128": 16}


@dataclasses.dataclass(frozen=True)
class CostConstants:
  """The machine constants of the roofline (defaults: one H100 SXM, dense, no sparsity).

  Attributes:
    fp8_gemm_flops_per_s: FP8 GEMM rate (cuBLASLt e4m3/e5m2, f32 accumulation).
    bf16_gemm_flops_per_s: bf16 / f16 GEMM rate.
    f32_gemm_flops_per_s: f32 GEMM rate (XLA's default precision on Hopper uses TF32).
    hbm_bytes_per_s: device memory bandwidth, bytes read + written per second.
    kernel_overhead_s: fixed cost per kernel launch at the program's top level: the
      time of a kernel that moves almost nothing plus the gap the GPU leaves before
      the next one.
    loop_kernel_overhead_s: the same for a kernel inside a `while` loop (a layer scan),
      which the GPU runtime launches one at a time, iteration after iteration.
    link_bytes_per_s: what one GPU sends (and receives) per second to the others
      of its host in a collective: NVLink 4 on an H100 SXM, 450 GB/s each way
      (datasheet; not measured here). A collective costs its launch plus the
      bytes each device must send over this link (ring algorithms: an
      all-reduce sends 2 (n-1)/n of its buffer, an all-gather or a
      reduce-scatter (n-1)/n of the whole buffer), with no overlap with compute.

  The defaults are calibrated to train steps measured on an H100 80GB HBM3 (SXM), jax
  0.11.2: `fp8_dense` forward+backward and its bf16 twin at M = K = N = 2048, 4096 and
  8192 (benchmarks/results/h100_dense.json, wall clock of back-to-back steps;
  h100_dense_device_time.json, a profiler trace kernel by kernel).
  tests/test_cost_calibration.py derives each one from those files again:

  * kernel_overhead_s 1.3 us: in the traces, the kernels that move almost nothing
    (4-byte copies, scalar fusions, memsets, the state update) took 0.74 to 2.75 us,
    1.26 us on average, and the GPU left 0.06 us on average between launches (trace
    span minus the kernels' durations, per launch).
  * hbm_bytes_per_s 2.7 TB/s: the memory-bound kernels of the 8192 trace (FP8
    casts, amax passes), bytes over duration less the launch cost (2.6 to 3.0 TB/s;
    `benchmarks.roofline` measured 2.76 TB/s; the datasheet says 3.35).
  * bf16_gemm_flops_per_s 725 TFLOP/s: the bf16 step at 8192 (three GEMMs, 4.55 ms
    per step when steps run back to back). A single GEMM in the trace ran at 829
    TFLOP/s: under sustained load the GPU runs its GEMMs about 13% slower.
  * fp8_gemm_flops_per_s 1330 TFLOP/s: the delayed-scaling FP8 step at 8192 (2.79
    ms per step) less its casts and launches, over its three GEMMs (the trace:
    1512 TFLOP/s for a single GEMM; datasheet peaks are 1979 and 989).
  * loop_kernel_overhead_s 3.25 us: the launch cost that, with the bandwidth, makes the
    whole steps of the demo GPT (350m, its 24 layers in a loop, bf16 and FP8) come out
    as measured on an H200 (`H200`; tests/test_step_calibration.py fits both from
    benchmarks/results/h200_gpu_check/). The launches are the runtime's, the same on
    both chips; an H100's own whole steps have not been measured yet.

  The 2048 steps' wall clock is the host's dispatch (about 200 us per call, whatever
  the kernels); there the device trace (80 us bf16, 96 us current scaling) is what
  the model predicts. The f32 rate is not measured (XLA runs f32 dots in TF32 on
  Hopper; datasheet 494 TFLOP/s).
  """

  fp8_gemm_flops_per_s: float = 1330e12
  bf16_gemm_flops_per_s: float = 725e12
  f32_gemm_flops_per_s: float = 400e12
  hbm_bytes_per_s: float = 2.7e12
  kernel_overhead_s: float = 1.3e-6
  loop_kernel_overhead_s: float = 3.25e-6
  link_bytes_per_s: float = 450e9

  def __post_init__(self):
    for field in dataclasses.fields(self):
      value = getattr(self, field.name)
      if (isinstance(value, bool) or not isinstance(value, numbers.Real)
          or not math.isfinite(value) or value <= 0):
        raise ValueError(f"CostConstants.{field.name}={value!r} must be a positive finite number.")

  def gemm_rate(self, dtype: str) -> float:
    """FLOP/s of a GEMM whose operands are `dtype` (an XLA dtype name)."""
    if is_fp8(dtype):
      return self.fp8_gemm_flops_per_s
    if dtype in ("bf16", "f16"):
      return self.bf16_gemm_flops_per_s
    return self.f32_gemm_flops_per_s

  def launch_overhead(self, in_loop: bool = False) -> float:
    """The fixed seconds of one launch: at the top level, or inside a `while` loop."""
    return self.loop_kernel_overhead_s if in_loop else self.kernel_overhead_s

  def kernel_time(self, flops: float, nbytes: float, gemm_dtype: str = "",
                  in_loop: bool = False) -> float:
    """Seconds of one launch: `max(flops / gemm_rate, nbytes / hbm) + launch_overhead`.

    Args:
      flops: GEMM FLOPs (0 for other kernels).
      nbytes: bytes read plus bytes written.
      gemm_dtype: the GEMM's operand dtype (an XLA dtype name), for its rate.
      in_loop: whether the kernel runs inside a `while` loop.
    """
    compute = flops / self.gemm_rate(gemm_dtype) if flops else 0.0
    return max(compute, nbytes / self.hbm_bytes_per_s) + self.launch_overhead(in_loop)


#: An H200 (141 GB HBM3e; the same Hopper chip as the H100 SXM with faster memory),
#: calibrated on the measurements in benchmarks/results/h200_gpu_check/ (jax 0.11.2):
#: the GEMM rates from `fp8_dense` at 8192 (the H100's derivation, tests/
#: test_cost_calibration.py), the bandwidth and the launch cost inside a loop from the
#: demo GPT's whole train steps (350m, bf16 and FP8 delayed scaling, fp8jax's Hopper
#: attention kernel, which a compile without a GPU can build): tests/
#: test_step_calibration.py derives each of them again. The top-level launch cost is
#: the H100's (not measured on the H200).
H200 = CostConstants(fp8_gemm_flops_per_s=1.3e15, bf16_gemm_flops_per_s=690e12,
                     hbm_bytes_per_s=4.0e12, loop_kernel_overhead_s=3.25e-6)

#: The chips `fp8jax cost --chip` predicts for: a compile for the H100 (sm_90a) is the
#: H200's program too, run at the H200's constants.
CHIP_CONSTANTS = {"h100": CostConstants(), "h200": H200}


@dataclasses.dataclass(frozen=True)
class KernelCost:
  """One kernel of the program.

  Attributes:
    name: the HLO instruction.
    category: "gemm" (FP8 or not, see `gemm_dtype`; grouped or not, see
      `grouped_kernel`), "fusion", "pallas", "copy", "collective" or the opcode of
      another op that runs as a kernel.
    gemm_dtype: the operand dtype of a GEMM ('f8e4m3fn', 'bf16', ...); '' otherwise.
    bytes_in, bytes_out: device-memory traffic.
    flops: GEMM FLOPs (0 for other kernels).
    launches: how many times it runs per call of the program (trip counts of loops around it).
    time_s: predicted seconds for all its launches.
    op_name: the JAX op it comes from (HLO metadata), for reading the table.
    grouped_kernel: for a grouped GEMM (MoE experts), which kernel it is
      ('ragged_matmul', 'transposed_ragged_matmul', 'ragged_dot_mgpu',
      'transposed_ragged_dot_mgpu'); '' for every other kernel.
    in_loop: whether it runs inside a `while` loop (its launches then cost
      `CostConstants.loop_kernel_overhead_s` each).
  """

  name: str
  category: str
  gemm_dtype: str
  bytes_in: int
  bytes_out: int
  flops: int
  launches: int
  time_s: float
  op_name: str
  grouped_kernel: str = ""
  in_loop: bool = False

  @property
  def is_gemm(self) -> bool:
    return self.category == "gemm"


@dataclasses.dataclass(frozen=True)
class CostReport:
  """The predicted cost of one compiled program.

  Attributes:
    label: what was compiled (a name for tables).
    target: what it was compiled for.
    constants: the `CostConstants` used.
    kernels: one `KernelCost` per kernel, in program order.
  """

  label: str
  target: str
  constants: CostConstants
  kernels: tuple[KernelCost, ...]

  @property
  def time_s(self) -> float:
    return sum(k.time_s for k in self.kernels)

  @property
  def link_time_s(self) -> float:
    """The part of `time_s` spent sending collectives' bytes over NVLink."""
    return sum(k.time_s - self.constants.launch_overhead(k.in_loop) * k.launches
               for k in self.kernels if k.category == "collective")

  @property
  def compute_time_s(self) -> float:
    """`time_s` without `link_time_s`: what the kernels themselves take."""
    return self.time_s - self.link_time_s

  @property
  def kernel_launches(self) -> int:
    return sum(k.launches for k in self.kernels)

  @property
  def gemm_launches(self) -> int:
    return sum(k.launches for k in self.kernels if k.is_gemm)

  @property
  def non_gemm_launches(self) -> int:
    return self.kernel_launches - self.gemm_launches

  @property
  def bytes(self) -> int:
    return sum((k.bytes_in + k.bytes_out) * k.launches for k in self.kernels)

  @property
  def flops(self) -> int:
    return sum(k.flops * k.launches for k in self.kernels)

  def summary(self) -> dict:
    """Totals as a dict (what the JSON and the comparison show)."""
    return {"label": self.label, "predicted_time_s": self.time_s,
            "predicted_link_time_s": self.link_time_s,
            "kernel_launches": self.kernel_launches, "gemm_launches": self.gemm_launches,
            "non_gemm_launches": self.non_gemm_launches, "bytes": self.bytes,
            "gemm_flops": self.flops}

  def to_dict(self) -> dict:
    return {"target": self.target, "constants": dataclasses.asdict(self.constants),
            **self.summary(), "kernels": [dataclasses.asdict(k) for k in self.kernels]}

  def table(self) -> str:
    """One row per kernel, then the totals."""
    header = (f"{'#':>4} {'kernel':<40} {'kind':<16} {'x':>4} {'MB in':>9} {'MB out':>9} "
              f"{'GFLOP':>9} {'us':>9}  op")
    lines = [f"{self.label}: predicted on {self.target}", header, "-" * len(header)]
    for i, k in enumerate(self.kernels):
      kind = (f"{'grouped' if k.grouped_kernel else 'gemm'} {k.gemm_dtype}" if k.is_gemm
              else k.category)
      lines.append(f"{i:>4} {k.name[:40]:<40} {kind[:16]:<16} {k.launches:>4} "
                   f"{k.bytes_in / 1e6:>9.2f} {k.bytes_out / 1e6:>9.2f} {k.flops / 1e9:>9.2f} "
                   f"{k.time_s * 1e6:>9.2f}  {_short_op(k.op_name)}")
    lines.append(f"total: {self.totals()}")
    return "\n".join(lines)

  def totals(self) -> str:
    """One line: kernel launches, bytes, GEMM FLOPs and the predicted time."""
    return (f"{self.kernel_launches} kernel launches ({self.gemm_launches} GEMM, "
            f"{self.non_gemm_launches} other), {self.bytes / 1e6:.1f} MB moved, "
            f"{self.flops / 1e9:.1f} GEMM GFLOP, predicted {self.time_s * 1e6:.1f} us")

  def __str__(self) -> str:
    return self.table()


@dataclasses.dataclass(frozen=True)
class CostComparison:
  """A program and its baseline (e.g. an FP8 train step and its bf16 twin)."""

  program: CostReport
  baseline: CostReport

  @property
  def speedup(self) -> float:
    """Predicted baseline time / program time (> 1: the program is faster)."""
    return self.baseline.time_s / self.program.time_s

  def to_dict(self) -> dict:
    return {"predicted_speedup": self.speedup, "program": self.program.to_dict(),
            "baseline": self.baseline.to_dict()}

  def __str__(self) -> str:
    rows = [self.baseline.summary(), self.program.summary()]
    width = max(24, *(len(row["label"]) for row in rows))  # labels whole, never cut
    header = (f"{'program':<{width}} {'kernels':>8} {'GEMMs':>6} {'other':>6} {'MB moved':>10} "
              f"{'us':>10}")
    lines = [header, "-" * len(header)]
    for row in rows:
      lines.append(f"{row['label']:<{width}} {row['kernel_launches']:>8} {row['gemm_launches']:>6} "
                   f"{row['non_gemm_launches']:>6} {row['bytes'] / 1e6:>10.1f} "
                   f"{row['predicted_time_s'] * 1e6:>10.1f}")
    if self.program.link_time_s or self.baseline.link_time_s:
      lines.append(f"of which collectives' bytes over NVLink: {self.baseline.link_time_s * 1e6:.1f} "
                   f"us and {self.program.link_time_s * 1e6:.1f} us")
    lines.append(f"predicted speedup of {self.program.label} over {self.baseline.label}: "
                 f"{self.speedup:.2f}x")
    return "\n".join(lines)


def cost_hlo(hlo: str, constants: CostConstants | None = None, label: str = "program",
             target: str = "given HLO") -> CostReport:
  """The cost report of optimized HLO text you already have.

  Args:
    hlo: optimized HLO (`compiled.as_text()` or an XLA dump's `*after_optimizations.txt`).
    constants: machine constants (default `CostConstants()`).
    label: a name for the program in tables.
    target: what the HLO was compiled for.

  Returns:
    A `CostReport`.
  """
  if not isinstance(hlo, str):
    raise TypeError(f"hlo must be the HLO text (str), got {type(hlo).__name__}.")
  _check_constants(constants)
  constants = constants if constants is not None else CostConstants()
  module = parse_hlo_module(hlo)
  kernels = []
  _collect(module, module.computations[module.entry], 1, constants, kernels)
  return CostReport(label=label, target=target, constants=constants, kernels=tuple(kernels))


def cost(fn: Callable, *args, compiler_options: Mapping | None = None, target: str = "auto",
         static_argnums: Sequence[int] = (), constants: CostConstants | None = None,
         label: str | None = None) -> CostReport:
  """Compiles `jax.jit(fn)(*args)` for Hopper and predicts its time kernel by kernel.

  Nothing runs; only shapes and dtypes of `args` are used. Without a GPU the
  compile is deviceless (an H100 SXM; needs the 'hopper' extra).

  Args:
    fn: the function, e.g. a train step.
    *args: example arguments (arrays or `jax.ShapeDtypeStruct`s).
    compiler_options: XLA options; None means `CUBLAS_ONLY_OPTIONS` (every GEMM
      on cuBLAS, as the lowering report assumes).
    target: "auto", "deviceless" or "device" (see `fp8jax.lowering.inspect`).
    static_argnums: static arguments of `fn`.
    constants: machine constants (default `CostConstants()`).
    label: a name for tables (default: the function's name).

  Returns:
    A `CostReport`.
  """

  _check_constants(constants)  # before a compile that takes seconds
  options = dict(CUBLAS_ONLY_OPTIONS if compiler_options is None else compiler_options)
  compiled = compile_text(fn, *args, compiler_options=options, target=target,
                          static_argnums=static_argnums, collect_ptx=False)
  name = label or getattr(fn, "__name__", "program")
  return cost_hlo(compiled.hlo, constants, label=name, target=compiled.target)


def compare(program: CostReport, baseline: CostReport) -> CostComparison:
  """Puts a program beside its baseline; `.speedup` is baseline time / program time."""
  for name, report in (("program", program), ("baseline", baseline)):
    if not isinstance(report, CostReport):
      raise TypeError(f"{name} must be a CostReport (from fp8jax.lowering.cost), got "
                      f"{type(report).__name__}.")
    if not report.kernels:
      raise ValueError(f"{name} {report.label!r} launches no kernel (predicted 0 s), so there "
                       "is no speedup to compute; compare programs that do some work.")
  return CostComparison(program=program, baseline=baseline)


def to_json(report: CostReport | CostComparison) -> str:
  """The report as JSON text."""
  if not isinstance(report, (CostReport, CostComparison)):
    raise TypeError(f"report must be a CostReport or CostComparison, got "
                    f"{type(report).__name__}.")
  return json.dumps(report.to_dict(), indent=1)


def _check_constants(constants) -> None:
  if constants is not None and not isinstance(constants, CostConstants):
    raise TypeError(f"constants must be a fp8jax.lowering.CostConstants (or None for the "
                    f"H100 defaults), got {type(constants).__name__}.")


# ----- walking the program -------------------------------------------------------------


def _collect(module: HloModule, computation: Computation, launches: int,
             constants: CostConstants, out: list, in_loop: bool = False) -> None:
  for instr in computation.instructions.values():
    op = instr.opcode
    if op in _NO_KERNEL:
      continue
    if op == "while":
      trips = _trip_count(instr)
      # With a known trip count XLA's GPU runtime (WhileThunk) runs the body
      # `trips` times and never the condition. Otherwise the condition runs
      # before each iteration and once more to exit; one iteration is assumed.
      repeats = {"body": 1 if trips is None else trips,
                 "condition": 2 if trips is None else 0}
      for key, count in repeats.items():
        callee = module.computations.get(instr.attributes.get(key, "").lstrip("%"))
        if callee is not None and count:
          _collect(module, callee, launches * count, constants, out, in_loop=True)
      continue
    if op == "call":
      callee = module.called(instr)
      if callee is not None:
        _collect(module, callee, launches, constants, out, in_loop)
      continue
    if op == "conditional":
      _collect_costliest_branch(module, instr, launches, constants, out, in_loop)
      continue
    out.append(_kernel(module, instr, launches, constants, in_loop))


def _collect_costliest_branch(module, instr, launches, constants, out, in_loop) -> None:
  best: list = []
  raw = instr.attributes.get("branch_computations", "")
  names = [n.strip().lstrip("%") for n in raw.strip("{}").split(",") if n.strip()]
  names += [instr.attributes.get(k, "").lstrip("%") for k in ("true_computation",
                                                              "false_computation")]
  for name in names:
    if name in module.computations:
      branch: list = []
      _collect(module, module.computations[name], launches, constants, branch, in_loop)
      if sum(k.time_s for k in branch) >= sum(k.time_s for k in best):
        best = branch
  out.extend(best)


def _trip_count(instr: Instruction) -> int | None:
  """The loop's known trip count (XLA's backend_config), or None when not known."""
  known = instr.backend_config().get("known_trip_count")
  if not isinstance(known, dict):
    return None
  try:
    return max(int(known.get("n")), 0)
  except (TypeError, ValueError):
    return None


def _kernel(module: HloModule, instr: Instruction, launches: int,
            constants: CostConstants, in_loop: bool) -> KernelCost:
  grouped = grouped_gemm(module, instr)
  if grouped is not None:
    category, gemm_dtype, flops = "gemm", grouped.dtype, grouped.flops
  else:
    category, gemm_dtype, flops = _classify(module, instr)
  bytes_in, bytes_out = _traffic(module, instr, category)
  if category == "collective":
    seconds = (constants.launch_overhead(in_loop)
               + _link_bytes(instr) / constants.link_bytes_per_s)
  else:
    seconds = constants.kernel_time(flops, bytes_in + bytes_out, gemm_dtype, in_loop)
  return KernelCost(name=instr.name, category=category, gemm_dtype=gemm_dtype,
                    bytes_in=int(bytes_in), bytes_out=int(bytes_out), flops=int(flops),
                    launches=launches, time_s=seconds * launches, op_name=instr.op_name,
                    grouped_kernel=grouped.kernel if grouped is not None else "",
                    in_loop=in_loop)


def _link_bytes(instr: Instruction) -> float:
  """Bytes one device sends in a collective (ring algorithms; 0 for a group of one)."""
  n = _group_size(instr)
  if n <= 1:
    return 0.0
  op = instr.opcode.removesuffix("-start")
  shapes = list(instr.shapes)
  if op == "all-gather" and instr.is_tuple and len(shapes) % 2 == 0:
    shapes = shapes[len(shapes) // 2:]  # the async form lists the operands, then the results
  payload = sum(_nbytes(s) for s in shapes)
  if op == "all-reduce":
    return 2 * (n - 1) / n * payload
  if op == "reduce-scatter":
    return (n - 1) * payload  # the result is 1/n of the buffer each device reduces
  if op in ("all-gather", "all-to-all"):
    return (n - 1) / n * payload
  return payload  # collective-permute, send, recv


def _group_size(instr: Instruction) -> int:
  """Devices per replica group: `{{0,1,..}}`, `[groups,size]<=[n]` or `mesh[..] {axes}`."""
  raw = instr.attributes.get("replica_groups", "")
  mesh = re.match(r"mesh\[(.*?)\]\s*\{(.*?)\}", raw)
  if mesh:
    sizes = {k.strip("' "): int(v) for k, v in re.findall(r"('[^']*')=(\d+)", mesh.group(1))}
    axes = [a.strip("' ") for a in mesh.group(2).split(",") if a.strip()]
    return math.prod(sizes.get(a, 1) for a in axes)
  iota = re.match(r"\[(\d+),(\d+)\]", raw)
  if iota:
    return int(iota.group(2))
  first = re.match(r"\{\{([^}]*)\}", raw)
  if first:
    return len([v for v in first.group(1).split(",") if v.strip()])
  pairs = instr.attributes.get("source_target_pairs")
  return 2 if pairs else 1


def _classify(module: HloModule, instr: Instruction) -> tuple[str, str, int]:
  """(category, GEMM operand dtype, GEMM FLOPs) of one kernel."""
  op = instr.opcode
  if op == "custom-call":
    target = instr.attributes.get("custom_call_target", "")
    if target.startswith("__cublas$"):
      dims = instr.backend_config().get("gemm_backend_config", {}).get(
          "dot_dimension_numbers", {})
      contracting = [int(d) for d in dims.get("lhs_contracting_dimensions", [])]
      out = instr.shapes[0] if instr.shapes else None
      return ("gemm",) + _gemm_dtype_and_flops(_operand_shape(module, instr, 0), out,
                                               contracting)
    if any(target.startswith(t) for t in _KERNEL_CALL_TARGETS):
      return "pallas", "", 0
    return "custom-call", "", 0
  dot = None
  if op in ("dot", "scaled-dot"):  # a dot XLA left to its own emitter
    dot = instr
  elif op == "fusion":  # a Triton (or cuDNN) GEMM fusion holds the dot
    callee = module.called(instr)
    dot = dot_inside(module, callee) if callee is not None else None
    if dot is None:
      return "fusion", "", 0
  if dot is not None:
    lhs = _shape_in(module.computations[dot.computation], dot.operands[0])
    return ("gemm",) + _gemm_dtype_and_flops(lhs, dot.shape, dot.int_list("lhs_contracting_dims"))
  if op in _COLLECTIVES:
    return "collective", "", 0
  if op in ("copy", "copy-start"):
    return "copy", "", 0
  return op, "", 0


def _gemm_dtype_and_flops(lhs: ArrayShape | None, out: ArrayShape | None,
                          contracting) -> tuple[str, int]:
  """2 * (output elements) * (contracted size): one multiply and one add per term."""
  if lhs is None or out is None:
    return (lhs.dtype if lhs is not None else ""), 0
  return lhs.dtype, 2 * math.prod(out.dims) * math.prod(lhs.dims[d] for d in contracting)


def _shape_in(computation: Computation, name: str) -> ArrayShape | None:
  instr = computation.instructions.get(name)
  return instr.shape if instr is not None else None


def _operand_shape(module: HloModule, instr: Instruction, index: int) -> ArrayShape | None:
  if index >= len(instr.operands):
    return None
  return _shape_in(module.computations[instr.computation], instr.operands[index])


def _nbytes(shape: ArrayShape | None) -> float:
  if shape is None:
    return 0
  return math.prod(shape.dims) * _BYTES.get(shape.dtype, 1)


def _traffic(module: HloModule, instr: Instruction, category: str) -> tuple[float, float]:
  """(bytes read, bytes written) of one kernel."""
  computation = module.computations[instr.computation]
  operand_shapes = []
  for name in instr.operands:
    producer = computation.instructions.get(name)
    operand_shapes.append(producer.shapes if producer is not None else ())
  outputs = list(instr.shapes)
  if (category == "gemm" and instr.opcode == "custom-call" and instr.is_tuple
      and len(outputs) > 1 and outputs[-1].dtype in ("s8", "u8")):
    outputs = outputs[:-1]  # cuBLAS's scratch workspace, not data the GEMM writes
  reads = [sum(_nbytes(s) for s in shapes) for shapes in operand_shapes]
  writes = [_nbytes(s) for s in outputs]

  callee = module.called(instr) if instr.opcode == "fusion" else None
  if callee is not None:
    # A multi-output fusion's root is a tuple: each element is one output.
    root = callee.instructions.get(callee.root) if callee.root else None
    results = ([callee.instructions.get(n) for n in root.operands]
               if root is not None and root.opcode == "tuple" else [root])
    in_place = set()
    if len(results) == len(writes):
      for index, result in enumerate(results):
        if result is None or result.opcode != "dynamic-update-slice":
          continue
        update = callee.instructions.get(result.operands[1])
        if _parameter_behind(callee, result.operands[0]) is not None and update is not None:
          # Updated in place: the buffer is not rewritten, only the update.
          in_place.add(result.name)
          writes[index] = _nbytes(update.shape)
    for number, param_name in callee.parameters.items():
      if number < len(reads):
        reads[number] = _read_bytes(callee, param_name, reads[number], in_place)
  return sum(reads), sum(writes)


def _read_bytes(computation: Computation, name: str, whole: float, in_place: set) -> float:
  """Bytes a fusion reads of its value `name` (a parameter): the slices it takes,
  nothing for the buffer of an in-place dynamic-update-slice, else all of it.

  A fusion computes each element of its results from the elements they need, so a
  slice behind an elementwise op (a `convert` of a whole stacked weight, then one
  layer's slice of it) reads only the sliced part too. The fusion's result is
  written whole, so a value that is its root is read whole."""
  if name == computation.root:
    return whole
  total = 0.0
  for user in computation.instructions.values():
    if name not in user.operands:
      continue
    if user.name in in_place and user.operands[0] == name:
      if name in user.operands[1:]:
        return whole  # also the update or an index: read
      continue
    if user.opcode == "bitcast" or _elementwise_of(computation, user, name):
      # A view, or the same elements transformed: follow it.
      total += _read_bytes(computation, user.name, whole, in_place)
    elif user.opcode in _SLICING and user.operands[0] == name and name not in user.operands[1:]:
      total += whole * _fraction(user.shape, _shape_in(computation, name))
    else:
      return whole
  return min(total, whole)


def _elementwise_of(computation: Computation, user: Instruction, name: str) -> bool:
  """Whether `user` maps `name` element by element to a result of the same shape (its
  other operands scalars or constants), so it needs the elements its users need."""
  if user.opcode not in _ELEMENTWISE or user.shape is None:
    return False
  source = _shape_in(computation, name)
  if source is None or tuple(source.dims) != tuple(user.shape.dims):
    return False
  for other in user.operands:
    shape = _shape_in(computation, other)
    if other != name and (shape is None or math.prod(shape.dims) != 1):
      return False
  return True


def _fraction(part: ArrayShape | None, whole: ArrayShape | None) -> float:
  """Elements of `part` over elements of `whole` (1 where either is unknown)."""
  if part is None or whole is None or not math.prod(whole.dims):
    return 1.0
  return min(math.prod(part.dims) / math.prod(whole.dims), 1.0)


def _parameter_behind(computation: Computation, name: str) -> int | None:
  """The parameter number `name` is (through bitcasts), or None."""
  seen = 0
  while seen < 16:
    instr = computation.instructions.get(name)
    if instr is None:
      return None
    if instr.opcode == "parameter":
      for number, param in computation.parameters.items():
        if param == name:
          return number
      return None
    if instr.opcode != "bitcast" or not instr.operands:
      return None
    name = instr.operands[0]
    seen += 1
  return None


def _short_op(op_name: str, limit: int = 60) -> str:
  return op_name if len(op_name) <= limit else "..." + op_name[-(limit - 3):]
