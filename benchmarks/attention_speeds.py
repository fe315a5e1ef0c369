"""The measured attention speeds fp8jax selects backends by, derived from a GPU benchmark.

    python -m benchmarks.attention_speeds benchmarks/results/h100_attention.json \
        [--gpu-tests gpu_tests.json] [--failed-check fp8/pallas_hopper_fp8 ...] \
        [--tuning benchmarks/results/h100_attention_tuning.json]

writes `fp8jax/ops/attention_speeds.json` (the table `fp8jax.ops.attention_backend`
reads; its docstring describes the layout) from one attention benchmark JSON
(`python -m benchmarks.attention`, or the attention.json of `benchmarks.gpu_check`,
which also writes the derived table beside it) and, with --tuning, the Hopper kernels'
tuned tiles from `python -m benchmarks.attention --tune` (the gpu_check's
attention_tuning.json). Commit the JSON files under benchmarks/results/ with the table:
a test re-derives the table from the sources it names.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys

from fp8jax.ops import attention_backend

# Backends whose kernels only the GPU tests of these test modules validate.
_GPU_TESTS_OF = {
    "pallas_hopper": "test_hopper_attention",
    "pallas_hopper_fp8": "test_hopper_attention",
}
# Row names of the first attention benchmark (before rows were named precision/backend).
_EARLY_ROW_NAMES = {"pallas_bf16": "bf16/pallas", "pallas_fp8": "fp8/pallas",
                    "hopper_fp8": "fp8/pallas_hopper_fp8", "xla": "bf16/xla",
                    "cudnn": "bf16/cudnn"}


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
  """The "measured" table from one attention benchmark JSON (benchmarks/attention.py).

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
  results = attention["results"]
  table = {}
  for result in results if isinstance(results, list) else [results]:
    mask = "causal" if result["causal"] else "none"
    for name, row in result["implementations"].items():
      name = _EARLY_ROW_NAMES.get(name, name)
      precision, _, backend = name.partition("/")
      if backend not in attention_backend.BACKENDS or "skipped" in row:
        continue
      validated = row.get("numerics_ok", True) and name not in failed_checks
      if backend in _GPU_TESTS_OF:
        validated = validated and _passed_gpu_tests(gpu_tests, _GPU_TESTS_OF[backend])
      table.setdefault(mask, {}).setdefault(precision, {})[backend] = {
          "forward_tflops": round(row["forward"]["tflops"], 1),
          "backward_tflops": round(row["backward_tflops"], 1),
          "validated": bool(validated)}
  return {gpu_arch: table}


def tuned_from_tuning(tuning: dict, gpu_arch: str = "sm_90") -> dict:
  """The "tuned" table ({gpu_arch: {precision: {mask: {head_dim: tiles}}}}) from one
  tuning JSON (`python -m benchmarks.attention --tune`); {} for a smoke run."""
  if tuning.get("smoke"):
    return {}
  return {gpu_arch: tuning["best"]} if tuning["best"] else {}


def speeds_file(source: str, measured: dict, failed_checks: tuple[str, ...],
                tuning_source: str | None = None, tuned: dict | None = None) -> dict:
  """The contents of `fp8jax/ops/attention_speeds.json`."""
  return {"source": source, "failed_checks": list(failed_checks), "measured": measured,
          "tuning_source": tuning_source, "tuned": tuned or {}}


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("source", help="the attention benchmark JSON, as committed under "
                      "benchmarks/results/ (its path is recorded in the table)")
  parser.add_argument("--gpu-tests", help="gpu_tests.json of the same benchmarks.gpu_check run")
  parser.add_argument("--failed-check", action="append", default=[],
                      help="a row (precision/backend) a separate GPU check found wrong")
  parser.add_argument("--tuning", help="the tuning JSON (python -m benchmarks.attention --tune) "
                      "whose best tiles the Hopper backends should run with")
  parser.add_argument("--gpu-arch", default="sm_90")
  parser.add_argument("--out", default=str(attention_backend.SPEEDS_FILE))
  args = parser.parse_args(argv)
  attention = json.loads(pathlib.Path(args.source).read_text())
  gpu_tests = json.loads(pathlib.Path(args.gpu_tests).read_text()) if args.gpu_tests else None
  failed = tuple(args.failed_check)
  measured = table_from_results(attention, gpu_tests, gpu_arch=args.gpu_arch,
                                failed_checks=failed)
  tuned = (tuned_from_tuning(json.loads(pathlib.Path(args.tuning).read_text()), args.gpu_arch)
           if args.tuning else {})
  out = pathlib.Path(args.out)
  out.write_text(json.dumps(speeds_file(args.source, measured, failed, args.tuning, tuned),
                            indent=1) + "\n")
  print(f"wrote {out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
