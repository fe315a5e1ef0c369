"""`fp8jax cost` against the H100: its constants and predictions from the measurements in
benchmarks/results/.

The steps measured are `benchmarks.dense`'s: one square layer's forward and backward,
M = K = N = 2048, 4096 and 8192, in bf16 and in FP8 with delayed and current scaling
(every quantization and the state update included), on an H100 80GB HBM3 (SXM), jax
0.11.2:

* h100_dense.json: wall clock per step, the median of 20 samples of 10 back-to-back
  calls. At 4096 and 8192 the host enqueues a step faster than the GPU runs one, so the
  GPU never waits: this is what a whole step takes on it, under sustained load, with
  whatever gaps it leaves between kernels. At 2048 it is the host's dispatch, about
  200 us per call whatever the kernels (bf16's GPU work is 80 us), which no model of
  the GPU predicts.
* h100_dense_device_time.json: a profiler trace of single steps, kernel by kernel
  (bf16, and FP8 with current scaling, at 2048 and 8192). At 2048 it is what the GPU
  takes; at 8192 its GEMMs ran 13-14% faster than they do back to back (the sustained
  wall clock above), so the wall clock is the reference there.

Each constant of `CostConstants()` is derived from those files here, and the model's
time for each measured program is held to 10% of the measurement. The programs are
described as they ran (the trace lists the kernels): since then fp8jax no longer
launches the three 4-byte copies of the delayed steps' running amaxes, so the compiled
steps are checked against the described ones less those launches.
"""
from __future__ import annotations

import json
import pathlib
import statistics

import jax
import jax.numpy as jnp
import pytest

import fp8jax
from benchmarks.dense import bf16_step, fp8_step
from fp8jax import deviceless
from fp8jax.lowering.cost import CostConstants, cost

RESULTS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "results"
WALL = {row["M"]: row for row in json.loads((RESULTS / "h100_dense.json").read_text())["results"]}
TRACE = json.loads((RESULTS / "h100_dense_device_time.json").read_text())["results"]
DEFAULT = CostConstants()
SIZES = (2048, 4096, 8192)
# Trace kernels that read or write whole tensors; every other one moves a few bytes.
TENSOR_KERNELS = ("amax", "cast_transpose_amax", "gemm", "nvjet")
# Kernels of the measured FP8 steps besides GEMMs, casts and amax passes: the three
# 4-byte copies of the running amaxes and the state update, and for current scaling the
# three scalar kernels per tensor that make its scale.
SMALL_LAUNCHES = {"fp8_delayed": 3 + 1, "fp8_current": 3 + 1 + 9}


def _us(seconds):
  return seconds * 1e6


def _tiny_kernel_seconds() -> list[float]:
  return [k["us"] * 1e-6 for n in ("2048", "8192") for k in TRACE[n]["fp8_current"]["kernels"]
          if not k["name"].startswith(TENSOR_KERNELS)]


def derived_kernel_overhead() -> float:
  """What a launch costs besides its bytes and FLOPs: the mean duration of the traced
  kernels that move almost nothing (copies, scalar fusions, memsets, the state update),
  plus the mean gap the GPU left between launches (span less the kernels' durations)."""
  gaps = []
  for n in ("2048", "8192"):
    row = TRACE[n]["fp8_current"]
    durations = [k["us"] for k in row["kernels"]]
    gaps.append((row["median_span_us"] - sum(durations)) / (len(durations) - 1) * 1e-6)
  return statistics.mean(_tiny_kernel_seconds()) + statistics.mean(gaps)


def derived_hbm_bytes_per_s(overhead: float) -> float:
  """The median rate of the memory-bound kernels of the 8192 trace: each cast reads
  2 bytes and writes 2 (its FP8 copy and the transposed copy) per element, each amax
  pass reads 2."""
  n = 8192
  rates = []
  for k in TRACE[str(n)]["fp8_current"]["kernels"]:
    per_element = 4 if k["name"].startswith("cast_transpose_amax") else (
        2 if k["name"] == "amax" else None)
    if per_element:
      rates.append(per_element * n * n / (k["us"] * 1e-6 - overhead))
  assert len(rates) == 6
  return statistics.median(rates)


def derived_bf16_gemm_flops_per_s(overhead: float) -> float:
  """The bf16 step at 8192 is its three GEMMs: their FLOPs over its time less 3 launches."""
  n = 8192
  return 3 * 2 * n**3 / (WALL[n]["bf16"]["median_s"] - 3 * overhead)


def derived_fp8_gemm_flops_per_s(overhead: float, hbm: float) -> float:
  """The delayed FP8 step at 8192 less its casts (by `hbm`) and every launch's
  overhead: its three GEMMs' time."""
  n = 8192
  casts = 3 * 4 * n * n / hbm
  launches = 3 + 3 + SMALL_LAUNCHES["fp8_delayed"]
  return 3 * 2 * n**3 / (WALL[n]["fp8_delayed"]["median_s"] - casts - launches * overhead)


def test_default_constants_are_the_ones_the_h100_measurements_give():
  overhead = derived_kernel_overhead()
  assert DEFAULT.kernel_overhead_s == pytest.approx(overhead, rel=0.02)  # 1.32 us
  hbm = derived_hbm_bytes_per_s(DEFAULT.kernel_overhead_s)
  assert DEFAULT.hbm_bytes_per_s == pytest.approx(hbm, rel=0.02)  # 2.73 TB/s
  bf16 = derived_bf16_gemm_flops_per_s(DEFAULT.kernel_overhead_s)
  assert DEFAULT.bf16_gemm_flops_per_s == pytest.approx(bf16, rel=0.01)  # 725 TFLOP/s
  fp8 = derived_fp8_gemm_flops_per_s(DEFAULT.kernel_overhead_s, DEFAULT.hbm_bytes_per_s)
  assert DEFAULT.fp8_gemm_flops_per_s == pytest.approx(fp8, rel=0.01)  # 1333 TFLOP/s
  # Launch cost is ~1.3 us, not 2: the trace's tiny kernels took 0.74-2.75 us and the
  # GPU left ~0.06 us between them; what costs ~200 us a call at 2048 is the host.
  assert max(_tiny_kernel_seconds()) < 3e-6 and overhead < 1.5e-6


def measured_program(n: int, recipe: str) -> list[tuple[float, float, str]]:
  """(FLOPs, bytes, GEMM operand dtype) of each kernel of the step as it was measured."""
  gemm = 2 * n**3
  if recipe == "bf16":  # reads two bf16 operands, writes a bf16 product
    return [(gemm, 6 * n * n, "bf16")] * 3
  kernels = [(gemm, 4 * n * n, "f8e4m3fn")] * 3   # reads two FP8 operands, writes bf16
  kernels += [(0, 4 * n * n, "")] * 3              # the casts
  kernels += [(0, 0, "")] * SMALL_LAUNCHES[recipe]
  if recipe == "fp8_current":
    kernels += [(0, 2 * n * n, "")] * 3            # the amax passes
  return kernels


def predicted(n: int, recipe: str, constants: CostConstants = DEFAULT) -> float:
  return sum(constants.kernel_time(*kernel) for kernel in measured_program(n, recipe))


def measured(n: int, recipe: str) -> tuple[float, str]:
  """(seconds, which measurement) of a whole step, as the module docstring says."""
  if n == 2048:
    row = TRACE["2048"][recipe]
    # bf16's three GEMMs were traced one by one (the same kernel three times).
    return (row.get("step_us_3_gemms") or row["median_span_us"]) * 1e-6, "device trace"
  return WALL[n][recipe]["median_s"], "wall clock"


CHECKED = [(n, r) for n in SIZES for r in ("bf16", "fp8_delayed", "fp8_current")
           # At 2048 only bf16 and current scaling were traced.
           if not (n == 2048 and r == "fp8_delayed")]


@pytest.mark.parametrize("n, recipe", CHECKED, ids=[f"{r}-{n}" for n, r in CHECKED])
def test_each_measured_step_is_predicted_within_10_percent(n, recipe):
  seconds, source = measured(n, recipe)
  guess = predicted(n, recipe)
  if (n, recipe) == (4096, "fp8_current"):
    # This sample is noisy (461 to 2218 us, median 537): its median sits 116 us above
    # delayed scaling's, where current scaling's extra work is three 34 MB amax passes
    # and 9 tiny kernels (~50 us; 144 us at 8192, four times the bytes). The prediction
    # must fall within 10% of the span of the samples' minimum and median.
    low, high = WALL[n][recipe]["min_s"], seconds
    assert 0.9 * low <= guess <= 1.1 * high, (_us(guess), _us(low), _us(high))
    return
  assert guess == pytest.approx(seconds, rel=0.10), (source, _us(guess), _us(seconds))


def test_predicted_speedups_match_the_measured_ones_at_8192():
  for recipe in ("fp8_delayed", "fp8_current"):
    want = WALL[8192][f"{recipe}_speedup_vs_bf16"]
    assert predicted(8192, "bf16") / predicted(8192, recipe) == pytest.approx(want, rel=0.03)


_MISSING = deviceless.deviceless_toolchain_missing()


@pytest.mark.hopper
@pytest.mark.skipif(_MISSING is not None, reason=str(_MISSING))
@pytest.mark.parametrize("n", SIZES)
def test_fp8jax_cost_of_the_benchmark_steps_is_the_measured_programs_cost(n):
  """`fp8jax.lowering.cost` on a deviceless compile of the same steps: bf16 is the
  measured program; delayed scaling is it less the three copies since removed, so
  it too is predicted within 10% of the measurement (where one exists); current
  scaling costs at most what was measured."""
  x = jax.ShapeDtypeStruct((n, n), jnp.bfloat16)
  bf16 = cost(bf16_step, x, x, x, target="deviceless")
  assert bf16.time_s == pytest.approx(predicted(n, "bf16"), rel=0.01), bf16.table()
  for name, recipe in (("fp8_delayed", fp8jax.DelayedScaling()),
                       ("fp8_current", fp8jax.CurrentScaling())):
    meta = jax.eval_shape(lambda: fp8jax.init_dot_meta(recipe))
    fp8 = cost(fp8_step, x, x, x, meta, target="deviceless")
    assert fp8.time_s <= predicted(n, name) * 1.005, fp8.table()
  delayed_now = predicted(n, "fp8_delayed") - 3 * DEFAULT.kernel_overhead_s
  meta = jax.eval_shape(lambda: fp8jax.init_dot_meta(fp8jax.DelayedScaling()))
  fp8 = cost(fp8_step, x, x, x, meta, target="deviceless")
  assert fp8.time_s == pytest.approx(delayed_now, rel=0.01), fp8.table()
  if n != 2048:
    assert fp8.time_s == pytest.approx(WALL[n]["fp8_delayed"]["median_s"], rel=0.10)
