"""Measured attention speeds: what automatic backend selection ranks GPU backends by.

`MEASURED` is derived (by `table_from_results`) from a GPU benchmark committed under
benchmarks/results/ (`SOURCE`); a test re-derives it from that file, so the two cannot
drift apart. Its layout:

  {gpu_arch: {mask: {precision: {backend: {"forward_tflops", "backward_tflops",
                                           "validated"}}}}}

mask is "none" or "causal" (what the benchmark measures; segment ids rank as the mask
without them), precision "bf16" or "fp8". `validated` holds when the row's numerics
matched the float64 reference within the benchmark's tolerance and the GPU tests
that cover the backend's kernels passed (a backend whose tests did not run is not
validated). Selection never picks an unvalidated backend.

`python -m benchmarks.gpu_check` writes the table for a new measurement
(attention_speeds.json); commit its attention.json as `SOURCE` and the table here.
"""
from __future__ import annotations

SOURCE = "benchmarks/results/h100_attention.json"
# A backward pass does 2.5x the forward's FLOPs (five products instead of two).
BACKWARD_FLOP_RATIO = 2.5

# Backends whose kernels only the GPU tests of these test modules validate.
_GPU_TESTS_OF = {
    "pallas_hopper": "test_hopper_attention",
    "pallas_hopper_fp8": "test_hopper_attention",
}
# Row names of the first attention benchmark (before rows were named precision/backend).
_EARLY_ROW_NAMES = {"pallas_bf16": "bf16/pallas", "pallas_fp8": "fp8/pallas",
                    "hopper_fp8": "fp8/pallas_hopper_fp8", "xla": "bf16/xla",
                    "cudnn": "bf16/cudnn"}

MEASURED = {
    "sm_90": {
        "none": {
            "bf16": {
                "cudnn": {"forward_tflops": 542.0, "backward_tflops": 489.4, "validated": True},
                "pallas": {"forward_tflops": 275.9, "backward_tflops": 157.0, "validated": True},
                "xla": {"forward_tflops": 108.7, "backward_tflops": 129.6, "validated": True},
            },
            "fp8": {
                "pallas": {"forward_tflops": 160.1, "backward_tflops": 157.0, "validated": True},
                "pallas_hopper_fp8": {"forward_tflops": 467.0, "backward_tflops": 154.6,
                                      "validated": False},
            },
        },
    },
}


def _passed_gpu_tests(gpu_tests: dict | None, module: str) -> bool:
  """Whether the GPU tests of test module `module` ran and none failed."""
  if not gpu_tests:
    return False
  # Tests are named "<package>.<module>::<test>" (JUnit's classname and name).
  outcomes = [t["outcome"] for t in gpu_tests.get("tests", [])
              if t["test"].split("::")[0].rpartition(".")[2] == module]
  return "passed" in outcomes and all(o in ("passed", "skipped") for o in outcomes)


def table_from_results(attention: dict, gpu_tests: dict | None = None, *,
                       gpu_arch: str = "sm_90", failed_checks: tuple[str, ...] = ()) -> dict:
  """The `MEASURED` layout from one attention benchmark JSON (benchmarks/attention.py).

  Args:
    attention: the benchmark's JSON: "results" is one measurement (a dict) or one per
      mask (a list); rows are named "<precision>/<backend>" (rows "auto", "cudnn_jax"
      and "jnp_reference" compare only) or by the first benchmark's names.
    gpu_tests: gpu_check's gpu_tests.json (outcome per test), or None.
    gpu_arch: the GPU the benchmark ran on.
    failed_checks: rows ("fp8/pallas_hopper_fp8") a separate check found wrong.

  Returns:
    {gpu_arch: {mask: {precision: {backend: {...}}}}}, TFLOP/s rounded to 0.1.
  """
  from fp8jax.attention_backend import BACKENDS
  results = attention["results"]
  table = {}
  for result in results if isinstance(results, list) else [results]:
    mask = "causal" if result["causal"] else "none"
    for name, row in result["implementations"].items():
      name = _EARLY_ROW_NAMES.get(name, name)
      precision, _, backend = name.partition("/")
      if backend not in BACKENDS or "skipped" in row:
        continue
      validated = row.get("numerics_ok", True) and name not in failed_checks
      if backend in _GPU_TESTS_OF:
        validated = validated and _passed_gpu_tests(gpu_tests, _GPU_TESTS_OF[backend])
      table.setdefault(mask, {}).setdefault(precision, {})[backend] = {
          "forward_tflops": round(row["forward"]["tflops"], 1),
          "backward_tflops": round(row["backward_tflops"], 1),
          "validated": bool(validated)}
  return {gpu_arch: table}


def seconds_per_forward_flop(entry: dict) -> float:
  """Forward plus backward time per forward FLOP (1e-12 s), the rank of a table entry."""
  return 1.0 / entry["forward_tflops"] + BACKWARD_FLOP_RATIO / entry["backward_tflops"]


def measured(gpu_arch: str | None, mask: str, precision: str) -> dict:
  """{backend: entry} measured for this GPU, mask ("causal" ranks as "causal", anything
  else as "none") and precision; {} when nothing was measured."""
  by_mask = MEASURED.get(gpu_arch or "", {})
  kind = "causal" if "causal" in mask else "none"
  return by_mask.get(kind, by_mask.get("none", {})).get(precision, {})
