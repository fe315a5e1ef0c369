"""Whole train steps measured on a GPU, and the cost model's constants they give.

A whole step's time is what `fp8jax cost` must predict: the demo GPT's step on an H200
(`benchmarks.gpt`) runs thousands of kernels, most of them small, and a model fitted to
one dense layer (three GEMMs and their casts) undercounts what those cost. This module
keeps what a measured step compiled to, and fits the constants to it:

    classes = kernel_classes(report)          # a CostReport of the measured step
    seconds = predicted_seconds(classes, constants)
    constants = fit_h200(dense, gpt, programs)

`kernel_classes` reduces a compiled step to its kernels' (FLOPs, bytes, GEMM dtype, in a
loop or not) with their launch counts: what the roofline needs and nothing of the HLO,
small enough to commit beside the step's measured time (`python -m
benchmarks.step_calibration --size 350m --out FILE` writes them for the code checked out,
compiled for an H100 without a GPU: the same program a Hopper GPU compiles). Classes and
measurement must come from the same code: the committed ones are of the rolled layer loop
the H200 ran (its file's note names the commits), so a fit to a new measurement compiles the
code that was measured.

`fit_h200` derives the H200's constants the way tests/test_cost_calibration.py derives
the H100's: the GEMM rates from `fp8_dense` at 8192 (bf16: three GEMMs; FP8: three
GEMMs less the three casts and ten launches), then the bandwidth and the launch cost of a
kernel inside the layer loop from two whole GPT steps, bf16 and FP8 (two equations, two
unknowns; the top-level launch cost is the H100's). tests/test_step_calibration.py holds
`fp8jax.lowering.cost.H200` to what it gives.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import math

from fp8jax.lowering.cost import CostConstants, CostReport

# The dense benchmark's size whose wall clock gives the GEMM rates (as for the H100).
DENSE_N = 8192
# All launches of the dense FP8 step: its 3 GEMMs, 3 casts and 4 small kernels
# (tests/test_cost_calibration.py counts them).
DENSE_FP8_LAUNCHES = 3 + 3 + 4


def kernel_classes(report: CostReport) -> list[dict]:
  """The kernels of `report` grouped by (FLOPs, bytes, GEMM dtype, in a loop), with counts.

  Returns:
    A list of {"flops", "bytes", "gemm_dtype", "in_loop", "launches"}, sorted.
  """
  counts: collections.Counter = collections.Counter()
  for k in report.kernels:
    if k.category == "collective":
      raise ValueError(f"kernel_classes: {k.name} is a collective; a whole step measured on "
                       "one GPU has none (calibrate on single-device steps).")
    counts[(k.flops, k.bytes_in + k.bytes_out, k.gemm_dtype, k.in_loop)] += k.launches
  return [{"flops": flops, "bytes": nbytes, "gemm_dtype": dtype, "in_loop": in_loop,
           "launches": launches}
          for (flops, nbytes, dtype, in_loop), launches in sorted(counts.items())]


def predicted_seconds(classes: list[dict], constants: CostConstants) -> float:
  """The roofline time of a step given as `kernel_classes`."""
  return sum(c["launches"] * constants.kernel_time(c["flops"], c["bytes"], c["gemm_dtype"],
                                                   c["in_loop"]) for c in classes)


def dense_gemm_rates(dense: dict, hbm: float, overhead: float) -> tuple[float, float]:
  """(bf16, FP8) GEMM FLOP/s from the dense benchmark's wall clock at 8192."""
  row = next(r for r in dense["results"] if r["M"] == DENSE_N)
  flops = 3 * 2 * DENSE_N**3
  bf16 = flops / (row["bf16"]["median_s"] - 3 * overhead)
  casts = 3 * 4 * DENSE_N * DENSE_N / hbm
  fp8 = flops / (row["fp8_delayed"]["median_s"] - casts - DENSE_FP8_LAUNCHES * overhead)
  return bf16, fp8


def measured_step_seconds(gpt: dict, recipe: str, backend: str) -> float:
  """The median step time of one row of `benchmarks.gpt`'s results."""
  for row in gpt["results"]["rows"]:
    if row["recipe"] == recipe and row["requested_backend"] == backend and "step" in row:
      return row["step"]["median_s"]
  raise KeyError(f"no measured row for recipe={recipe!r}, backend={backend!r}")


def fit_h200(dense: dict, gpt: dict, programs: dict, *, backend: str = "pallas_hopper",
             top_overhead: float = CostConstants().kernel_overhead_s) -> CostConstants:
  """The constants that predict both measured GPT steps exactly (see the module docstring).

  Args:
    dense: `benchmarks.dense`'s results on the GPU.
    gpt: `benchmarks.gpt`'s results on the GPU (rows for "bf16" and "delayed").
    programs: {"bf16": classes, "delayed": classes} of the same steps (`kernel_classes`).
    backend: the attention backend of the rows fitted (the one a compile without a GPU
      builds too).
    top_overhead: the launch cost at the program's top level (not fitted here).

  Returns:
    `CostConstants` with the fitted GEMM rates, bandwidth and loop launch cost.
  """
  measured = {r: measured_step_seconds(gpt, r, backend) for r in ("bf16", "delayed")}

  def constants_for(hbm: float) -> CostConstants:
    bf16, fp8 = dense_gemm_rates(dense, hbm, top_overhead)
    trial = CostConstants(fp8_gemm_flops_per_s=fp8, bf16_gemm_flops_per_s=bf16,
                          hbm_bytes_per_s=hbm, kernel_overhead_s=top_overhead)
    # The bf16 step is linear in the loop's launch cost: solve it for that.
    classes = programs["bf16"]
    without = predicted_seconds(classes, dataclasses.replace(trial, loop_kernel_overhead_s=1e-30))
    loop_launches = sum(c["launches"] for c in classes if c["in_loop"])
    if not loop_launches:
      raise ValueError("fit_h200: programs['bf16'] has no kernel inside a loop, so the loop's "
                       "launch cost is not determined; give the kernel classes of the step "
                       "the GPU measured (with its layer loop rolled, as gpt.json's).")
    loop = (measured["bf16"] - without) / loop_launches
    # None: at this bandwidth the bf16 step leaves no time for its launches (too low).
    return dataclasses.replace(trial, loop_kernel_overhead_s=loop) if loop > 0 else None

  def fp8_error(hbm: float) -> float:
    constants = constants_for(hbm)
    if constants is None:
      return -math.inf
    return predicted_seconds(programs["delayed"], constants) - measured["delayed"]

  # More bandwidth leaves more of the bf16 step to launches, which the FP8 step has more
  # of: its error rises with the bandwidth. Bisect for the root.
  low, high = 1.5e12, 8e12
  if fp8_error(low) > 0 or fp8_error(high) < 0:
    raise ValueError("fit_h200: no bandwidth in [1.5, 8] TB/s predicts both steps; check "
                     "that `programs` are the kernel classes of the steps `gpt` measured "
                     "(same size, batch and code) and that `dense` is the same GPU's.")
  for _ in range(60):
    middle = (low + high) / 2
    low, high = (middle, high) if fp8_error(middle) < 0 else (low, middle)
  return constants_for((low + high) / 2)


def main(argv=None) -> dict:
  """Writes the kernel classes of the demo GPT's bf16 and FP8 steps (deviceless compile)."""
  from fp8jax.runs import gpt_program

  parser = argparse.ArgumentParser(description=main.__doc__)
  parser.add_argument("--size", default="350m")
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--seq", type=int, default=None)
  parser.add_argument("--recipes", default="bf16,delayed")
  parser.add_argument("--out", required=True)
  args = parser.parse_args(argv)
  from fp8jax.models import gpt
  seq = args.seq or gpt.SIZES[args.size].seq_len
  programs = {}
  for recipe in args.recipes.split(","):
    program = gpt_program.GptProgram(size=args.size, batch=args.batch, seq=seq, recipe=recipe,
                                     optimizer="adamw", saved_activations="default")
    report, _, _ = gpt_program.measure(program)
    programs[recipe] = kernel_classes(report)
  result = {"size": args.size, "batch": args.batch, "seq": seq,
            "compiled_for": "H100 SXM, sm_90a (deviceless)", "programs": programs}
  with open(args.out, "w") as f:
    json.dump(result, f, indent=1)
    f.write("\n")
  return result


if __name__ == "__main__":
  main()
