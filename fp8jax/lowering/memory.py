"""The device memory a compiled program needs, measured like its time: from the compile.

    time, memory = measure(step, *args, label="fp8")        # one compile for both reports
    print(memory)   # fp8: arguments 6.89 GiB, temp 23.71 GiB, total 30.61 GiB (38% of 80 GiB)
    batch, at = largest_batch(lambda b: (step, args_for(b)), capacity=80 * GIB)

XLA's memory analysis of the compiled program (deviceless for an H100 without a GPU, the
same numbers a GPU's compile gives) splits what the program holds at its peak into:

* arguments: its inputs (params, optimizer state, FP8 state, the batch);
* outputs: its results; those written into donated arguments are counted there once
  (`aliased`), so a train step that donates its state adds only its loss;
* temp: everything else live at the peak: the activations the backward keeps, the
  gradients, workspaces.

`total = arguments + temp + outputs - aliased` is what the GPU must hold; the program
fits a GPU whose memory is at least that (the CUDA context and allocator slack aside).
"""
from __future__ import annotations

import dataclasses
import re
from typing import Callable, Mapping

from fp8jax.lowering.compile import compile_program
from fp8jax.lowering.cost import CostConstants, CostReport, cost_hlo
from fp8jax.lowering.inspection import CUBLAS_ONLY_OPTIONS

GIB = 2**30
H100_MEMORY = 80 * GIB
# Each chip's device memory (`fp8jax cost --chip`), as NVIDIA states it: 80 and 141 GB
# (read here, as for the H100 until now, as GiB).
CHIP_MEMORY = {"h100": H100_MEMORY, "h200": 141 * GIB}
_UNITS = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
          "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}


@dataclasses.dataclass(frozen=True)
class MemoryReport:
  """Device memory of one compiled program, in bytes (see the module docstring).

  Attributes:
    label: what was compiled.
    target: what it was compiled for.
    arguments, outputs, aliased, temp: XLA's memory analysis.
  """

  label: str
  target: str
  arguments: int
  outputs: int
  aliased: int
  temp: int

  @property
  def total(self) -> int:
    """What the device holds at the program's peak."""
    return self.arguments + self.temp + self.outputs - self.aliased

  def fits(self, capacity: int = H100_MEMORY) -> bool:
    """Whether `total` is at most `capacity` bytes."""
    return self.total <= capacity

  def to_dict(self) -> dict:
    return {**dataclasses.asdict(self), "total": self.total}

  def __str__(self) -> str:
    return (f"{self.label}: arguments {self.arguments / GIB:.2f} GiB, temp "
            f"{self.temp / GIB:.2f} GiB, total {self.total / GIB:.2f} GiB "
            f"({100 * self.total / H100_MEMORY:.0f}% of 80 GiB)")


def memory_of(compiled, label: str = "program", target: str = "") -> MemoryReport:
  """The memory XLA's analysis gives a compiled program.

  Args:
    compiled: a `jax.stages.Compiled`.
    label, target: names for the report.

  Returns:
    A `MemoryReport`.
  """
  stats = compiled.memory_analysis()
  return MemoryReport(label=label, target=target,
                      arguments=int(stats.argument_size_in_bytes),
                      outputs=int(stats.output_size_in_bytes),
                      aliased=int(stats.alias_size_in_bytes),
                      temp=int(stats.temp_size_in_bytes))


def measure(fn: Callable, *args, compiler_options: Mapping | None = None,
            target: str = "auto", constants: CostConstants | None = None,
            label: str | None = None) -> tuple[CostReport, MemoryReport]:
  """Compiles `fn(*args)` once for Hopper: its predicted time and its memory.

  Args:
    fn: the program (a jitted one keeps its donated arguments).
    *args: arrays or `jax.ShapeDtypeStruct`s.
    compiler_options: XLA options; None means every GEMM on cuBLAS, as `fp8jax.lowering.cost`.
    target: "auto", "deviceless" or "device" (`fp8jax.lowering.compile`).
    constants: the cost model's machine constants.
    label: a name for tables.

  Returns:
    (`CostReport`, `MemoryReport`).
  """
  options = dict(CUBLAS_ONLY_OPTIONS if compiler_options is None else compiler_options)
  compiled, target_name = compile_program(fn, *args, compiler_options=options, target=target)
  name = label or getattr(fn, "__name__", "program")
  return (cost_hlo(compiled.as_text(), constants, label=name, target=target_name),
          memory_of(compiled, name, target_name))


def largest_batch(program: Callable[[int], MemoryReport], capacity: int = H100_MEMORY, *,
                  probes: tuple[int, int] = (8, 16),
                  limit: int = 4096) -> tuple[int, MemoryReport | None]:
  """The largest batch whose program fits `capacity` bytes, found by compiling.

  Memory grows about linearly with the batch (the activations), so two compiles
  (`probes`) place the boundary; compiles at the estimate and next to it then find the
  exact one (each compile is the judge: XLA's own rematerialization bends the line
  near a device's capacity).

  Args:
    program: batch -> the `MemoryReport` of the program at that batch (a compile).
    capacity: bytes available.
    probes: the two batches the line is drawn through.
    limit: the largest batch considered.

  Returns:
    (batch, its report); (0, None) when not even a batch of 1 fits.
  """
  reports: dict[int, MemoryReport] = {}

  def report(batch: int) -> MemoryReport:
    if batch not in reports:
      reports[batch] = program(batch)
    return reports[batch]

  def fits(batch: int) -> bool:
    return batch == 0 or (batch <= limit and report(batch).fits(capacity))

  low, high = probes
  slope = (report(high).total - report(low).total) / (high - low)
  guess = limit if slope <= 0 else int((capacity - report(low).total) // slope) + low
  guess = max(1, min(limit, guess))
  # Bracket the boundary from the estimate by doubling steps (fits(low), not
  # fits(high)), then bisect: a handful of compiles when the line is right.
  step = 1
  if fits(guess):
    low = guess
    while fits(low + step):
      low, step = low + step, step * 2
    high = low + step
  else:
    high = guess
    while not fits(max(high - step, 0)):
      high, step = high - step, step * 2
    low = max(high - step, 0)
  while high - low > 1:
    middle = (low + high) // 2
    low, high = (middle, high) if fits(middle) else (low, middle)
  return (low, reports[low]) if low else (0, None)


def parse_bytes(text: str) -> int:
  """Bytes of an amount written as "80GiB", "80 GiB", "79.5GB" or "1073741824".

  Returns:
    The int number of bytes.

  Raises:
    ValueError: `text` is not an amount of memory.
  """
  match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
  unit = match.group(2).lower() if match else None
  if match is None or unit not in _UNITS:
    raise ValueError(f"{text!r} is not an amount of memory; write e.g. 80GiB, 79.5GB or a "
                     "number of bytes.")
  return int(float(match.group(1)) * _UNITS[unit])
