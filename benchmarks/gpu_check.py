"""The GPU check: everything that needs a Hopper GPU, in one command, in under 8 minutes.

    PYTHONPATH=. python -m benchmarks.gpu_check --out benchmarks/results/h100_gpu_check
    python -m benchmarks.gpu_check --smoke --out /tmp/gpu_check    # CPU: same code, tiny shapes

Sections, in this order (each writes one JSON into --out; summary.json lists them all):
  tests         every test marked `gpu` (pytest -m gpu on the files that hold them): the
                Hopper kernels against float64 references, per test passed / failed /
                skipped -> gpu_tests.json;
                among them the grouped FP8 GEMMs' (tests/test_ragged_matmul.py), whose
                passing is what may set pallas_kernels.RAGGED_GEMM_VALIDATED_ON_GPU
  gpt           benchmarks.gpt over benchmarks.gpt_plan.GPT_ROWS: the demo GPT's train step
                at 350m (batch 8 x 1024) and 1b (batch 8 x 2048) in bf16, FP8 delayed,
                FP8 delayed with the memory features and FP8 current scaling: tokens/s,
                memory, device time by kernel category from a profiler trace, the cost
                model's prediction of the same executable and its kernel classes -> gpt.json
  moe_gpt       the same for the MoE GPT (125m, 8 experts, top-2, batch 32): its bf16 step
                on JAX's Mosaic grouped GEMMs against FP8 on fp8jax's grouped kernels
                (the target: FP8 >= 1.3x bf16) -> moe_gpt.json
  grouped_gemm  benchmarks.grouped_gemm: the MoE expert GEMMs, per-tensor and block-scaled
                FP8 grouped kernels vs JAX's bf16 Mosaic grouped GEMM (and XLA's
                ragged_dot) at DeepSeek-like shapes -> grouped_gemm.json
  dense         benchmarks.dense: fp8_dense forward+backward vs bf16 at M = K = N = 2048, 4096
                and 8192, delayed and current scaling, each step timed alone (wall clock)
                and in one call of several steps (device time) -> dense.json
  attention     benchmarks.attention: every backend, bf16 and FP8, causal and not, speed and
                numerics (jax's cuDNN FP8 attention with calibrated and with unit scales
                among them) -> attention.json; and the backend table fp8jax selects from,
                derived from it and the tests -> attention_speeds.json
  attention_accuracy  benchmarks.attention_accuracy: the Hopper FP8 kernels' error against
                bf16's reference per scaling mode (per tensor; per block with q and k
                rotated) on Gaussian, channel-outlier and outlier inputs, Gaussian first,
                within its time -> attention_accuracy.json
  attention_tuning  benchmarks.attention --tune: the Hopper kernels' variants (tiles,
                stages, ping-pong, intra-warpgroup overlap), FP8 first, within the time
                left (a whole tuning is its own command) -> attention_tuning.json, and the
                tiles to commit -> attention_tuned.json (`python -m
                benchmarks.attention_speeds ... --tuning` writes them into
                fp8jax/ops/attention_speeds.json)
  demo          `fp8jax compare` at a GPU size for a few steps (its table names each run's
                attention backend) -> demo_compare.json

Time: the check plans for --budget-s (450 s: the one call must stay under 8 minutes). The
order is the priority: a section whose usual time (SECTION_SECONDS, from the H200 checks)
does not fit what is left is skipped and says so; the two GPT sections share at most
--gpt-budget-s (300 s) and drop rows in benchmarks.gpt_plan's order. All of them take about
10 minutes, so a full run at the default budget skips the last ones: name the sections a
session needs (`--sections tests,gpt,moe_gpt` measures the whole GPT steps; `--sections
dense,attention,demo` the rest).

A section that fails is recorded with its error and the check goes on; the exit status is
1 if any section failed or any GPU test failed (a section skipped for time is neither). The
tests run first, in a subprocess, before this process initializes the GPU (each process
takes most of its memory). With --smoke everything runs on the CPU at toy sizes (the GPU
tests then skip, no section or row is dropped for time): the test suite runs it, so the
check cannot rot between GPU sessions.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import subprocess
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ElementTree

from benchmarks import gpt_plan

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
# In the order they run, which is their priority when time is short (--budget-s).
SECTIONS = ("tests", "gpt", "moe_gpt", "grouped_gemm", "dense", "attention",
            "attention_accuracy", "attention_tuning", "demo")
# What each section took in the first H200 check (benchmarks/results/h200_gpu_check/, and
# the tests in its rerun, where more of them ran): a section is skipped when this does
# not fit the time left. The GPT sections plan their rows themselves (benchmarks.gpt_plan).
SECTION_SECONDS = {"tests": 100, "grouped_gemm": 35, "dense": 120, "attention": 105,
                   "demo": 41,
                   # Not yet run on a GPU: what their own budgets allow (compiles included).
                   "attention_accuracy": 45, "attention_tuning": 60}
# The attention accuracy section's own budget: no configuration starts after it.
ACCURACY_BUDGET_S = 35.0
# The GPU tests of the grouped FP8 GEMM kernels (their file in tests/).
GROUPED_GEMM_TESTS = "test_ragged_matmul"


def gpu_test_files() -> list[str]:
  """The test files that hold tests marked `gpu` or taking the `hopper_device` fixture
  (which marks them; tests/test_gpu_check_selection.py checks that these files hold all of
  the suite's GPU tests): collecting only them spares the check importing the other 80."""
  return sorted(str(path.relative_to(REPO_ROOT))
                for path in (REPO_ROOT / "tests").glob("test_*.py")
                if any(mark in path.read_text() for mark in ("pytest.mark.gpu", "hopper_device")))


def run_gpu_tests(out: pathlib.Path, smoke: bool) -> dict:
  """pytest -m gpu in a subprocess; the per-test outcomes from its JUnit XML."""
  junit = out / "gpu_tests.xml"
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(
      filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))
  # tests/conftest.py defaults JAX_PLATFORMS to cpu; on a GPU the tests must see it.
  env["JAX_PLATFORMS"] = "cpu" if smoke else ""
  # -n 0: one process; workers of their own would share the GPU's memory.
  command = [sys.executable, "-m", "pytest", "-q", "-n", "0", "-m", "gpu", "-p",
             "no:cacheprovider", f"--junitxml={junit}", *gpu_test_files()]
  proc = subprocess.run(command, env=env, capture_output=True, text=True, cwd=REPO_ROOT)
  tests = _junit_outcomes(junit) if junit.exists() else []
  junit.unlink(missing_ok=True)
  counts = {k: sum(t["outcome"] == k for t in tests) for k in ("passed", "failed", "skipped")}
  return {"command": " ".join(command[1:]), "returncode": proc.returncode, **counts,
          "tests": tests, "output_tail": proc.stdout[-3000:] + proc.stderr[-2000:]}


def _junit_outcomes(path: pathlib.Path) -> list[dict]:
  outcomes = []
  for case in ElementTree.parse(path).getroot().iter("testcase"):
    name = f"{case.get('classname')}::{case.get('name')}"
    failure = case.find("failure")
    if failure is None:
      failure = case.find("error")
    skipped = case.find("skipped")
    if failure is not None:
      outcome = {"outcome": "failed", "message": (failure.get("message") or "")[:1000]}
    elif skipped is not None:
      outcome = {"outcome": "skipped", "message": (skipped.get("message") or "")[:300]}
    else:
      outcome = {"outcome": "passed"}
    outcomes.append({"test": name, "seconds": float(case.get("time") or 0.0), **outcome})
  return outcomes


def run_dense(smoke: bool) -> dict:
  from benchmarks import dense
  return dense.main(["--smoke"] if smoke else ["--repeats", "30"])


def run_grouped_gemm(smoke: bool, tests: dict | None) -> dict:
  """benchmarks.grouped_gemm. The FP8 kernels have run on no GPU before
  (RAGGED_GEMM_VALIDATED_ON_GPU): on a GPU they are timed only after their GPU tests
  passed in this check, so a kernel that is wrong or hangs (those tests run under
  pytest's time limit in their own process) cannot take the check down with it."""
  from benchmarks import grouped_gemm
  if smoke:
    return grouped_gemm.main(["--smoke"])
  argv = ["--repeats", "10"]
  if tests is not None and not _grouped_gemm_tests(tests)["all_passed"]:
    argv += ["--skip-fp8-kernels", f"their GPU tests ({GROUPED_GEMM_TESTS}) did not all "
             "pass in this check"]
  return grouped_gemm.main(argv)


def run_attention(smoke: bool) -> dict:
  from benchmarks import attention
  return attention.main(["--smoke"] if smoke else ["--repeats", "10"])


def run_attention_accuracy(smoke: bool) -> dict:
  from benchmarks import attention_accuracy
  if smoke:
    return attention_accuracy.main(["--smoke", "--inputs", "gaussian,channels", "--masks",
                                    "none", "--modes", "per_tensor,blocks+rotate"])
  # Gaussian per tensor first (the benchmark's metric), then what rotation and block
  # scales buy with outliers; the block-scaled kernels' correctness is a GPU test.
  return attention_accuracy.main(["--inputs", "gaussian,channels,outliers", "--modes",
                                  "per_tensor,blocks+rotate",
                                  "--budget-s", str(ACCURACY_BUDGET_S)])


def run_attention_tuning(smoke: bool, seconds_left: float) -> dict:
  from benchmarks import attention
  if smoke:
    return attention.main(["--tune", "--smoke"])
  # A whole tuning takes minutes (`python -m benchmarks.attention --tune`); the check times
  # what fits, FP8 first, each pass's default variant before the others.
  budget = max(10.0, min(90.0, seconds_left - 20.0))
  return attention.main(["--tune", "--repeats", "5", "--budget-s", str(round(budget))])


def run_gpt(smoke: bool, budget) -> dict:
  """The dense GPT rows of `benchmarks.gpt_plan.GPT_ROWS` (350m and 1b: bf16, FP8 delayed,
  FP8 delayed with the memory features, FP8 current) while `budget` lasts, automatic
  attention (what the demo runs)."""
  rows = gpt_plan.smoke_rows(moe=False) if smoke else gpt_plan.GPT_ROWS
  return _gpt_report(rows, budget, smoke)


def moe_rows(smoke: bool, tests: dict | None) -> tuple[tuple, str | None]:
  """The MoE GPT's rows (`benchmarks.gpt_plan.MOE_ROWS`): bf16 (float32 AdamW, JAX's Mosaic
  grouped GEMMs) and FP8 delayed scaling with FP8 Adam moments and FP8 saved activations,
  the pair `fp8jax cost --gpt 125m --experts 8 --top-k 2 --batch 32` predicts. The FP8
  step runs the grouped FP8 kernels, so (as in run_grouped_gemm) only after their GPU
  tests passed in this check: otherwise the bf16 row alone, and why (else None)."""
  if smoke:
    return gpt_plan.smoke_rows(moe=True), None
  if tests is None or not _grouped_gemm_tests(tests)["all_passed"]:
    return (tuple(r for r in gpt_plan.MOE_ROWS if r.recipe == "bf16"),
            f"their GPU tests ({GROUPED_GEMM_TESTS}) did not all pass in this check")
  return gpt_plan.MOE_ROWS, None


def run_moe_gpt(smoke: bool, tests: dict | None, budget) -> dict:
  """The MoE GPT's rows (`moe_rows`) while `budget` lasts."""
  rows, fp8_skipped = moe_rows(smoke, tests)
  report = _gpt_report(rows, budget, smoke)
  return {**report, "fp8_skipped": fp8_skipped} if fp8_skipped else report


def _gpt_report(rows, budget, smoke: bool) -> dict:
  from benchmarks import gpt
  from benchmarks.timing import environment
  print(gpt_plan.format_plan(rows, budget.remaining_s, budget.reserve_s), flush=True)
  timing = gpt.SMOKE_TIMING if smoke else gpt.Timing()
  seconds = round(budget.remaining_s, 1) if math.isfinite(budget.remaining_s) else None
  return {**environment(), "benchmark": "gpt_train_step", "smoke": smoke,
          "results": {"budget_s": seconds, **gpt.run_rows(rows, budget=budget, timing=timing)}}


def run_demo(smoke: bool) -> dict:
  """`fp8jax compare` in this process (a second process would find the GPU's memory taken)."""
  from fp8jax.cli import main as cli
  with tempfile.TemporaryDirectory() as scratch:
    args = (["--size", "tiny", "--steps", "2", "--batch", "2", "--seq", "32"] if smoke else
            ["--size", "125m", "--steps", "30", "--batch", "8", "--seq", "1024"])
    code = cli(["compare", *args, "--recipes", "bf16,delayed", "--eval-every", "1000",
                "--checkpoint-every", "1000", "--out", scratch])
    result = json.loads((pathlib.Path(scratch) / "compare.json").read_text())
  return {"exit_code": code, **result}


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", required=True, help="directory for the JSON files")
  parser.add_argument("--smoke", action="store_true", help="CPU, toy sizes (for the tests)")
  parser.add_argument("--sections", default=",".join(SECTIONS),
                      help=f"comma-separated subset of {','.join(SECTIONS)}")
  parser.add_argument("--budget-s", type=float, default=450.0,
                      help="seconds the whole check may take: a section that does not fit "
                           "what is left is skipped (see SECTION_SECONDS)")
  parser.add_argument("--gpt-budget-s", type=float, default=gpt_plan.GPT_BUDGET_S,
                      help="most seconds for the gpt and moe_gpt sections together")
  args = parser.parse_args(argv)
  sections = args.sections.split(",")
  unknown = sorted(set(sections) - set(SECTIONS))
  if unknown:
    parser.error(f"--sections: unknown {unknown}; choose from {','.join(SECTIONS)}")
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  start = time.perf_counter()

  def left() -> float:
    return args.budget_s - (time.perf_counter() - start)

  summary = {"command": " ".join(["python -m benchmarks.gpu_check", *(argv or sys.argv[1:])]),
             "smoke": args.smoke, "budget_s": args.budget_s, "sections": {}}
  print(format_plan(sections, args.budget_s, args.gpt_budget_s), flush=True)

  def section(name, fn):
    if name not in sections:
      return None
    if not args.smoke and SECTION_SECONDS.get(name, 0) > left():
      reason = (f"not enough time: {max(left(), 0):.0f} s left of --budget-s, the section "
                f"takes about {SECTION_SECONDS[name]} s")
      summary["sections"][name] = {"status": "skipped", "reason": reason}
      print(f"=== {name}: skipped, {reason} ===", flush=True)
      return None
    began = time.perf_counter()
    print(f"=== {name} ===", flush=True)
    try:
      result = fn()
      status = "ok"
    except Exception as error:  # noqa: BLE001 - record it and go on with the other sections
      result, status = None, f"error: {type(error).__name__}: {str(error)[:500]}"
      traceback.print_exc()
    summary["sections"][name] = {"status": status,
                                 "seconds": round(time.perf_counter() - began, 1)}
    if result is not None:
      file = out / ("gpu_tests.json" if name == "tests" else
                    "demo_compare.json" if name == "demo" else f"{name}.json")
      file.write_text(json.dumps(result, indent=1))
      summary["sections"][name]["file"] = file.name
    return result

  tests = section("tests", lambda: run_gpu_tests(out, args.smoke))
  # Only now may this process touch the GPU.
  from benchmarks.timing import environment
  summary.update(environment())
  summary["command"] = " ".join(["python -m benchmarks.gpu_check", *(argv or sys.argv[1:])])
  # One budget for the two GPT sections: the MoE rows' time is kept while the dense rows
  # run, and both see how long rows take against their estimates. The smoke run (CPU)
  # drops nothing: its rows are what the test checks.
  moe = moe_rows(args.smoke, tests)[0] if "moe_gpt" in sections else ()
  budget = gpt_plan.Budget(math.inf if args.smoke else min(args.gpt_budget_s, left()),
                           reserve_s=sum(r.estimate_s for r in moe))
  gpt = section("gpt", lambda: run_gpt(args.smoke, budget))
  budget.reserve_s = 0.0
  moe_gpt = section("moe_gpt", lambda: run_moe_gpt(args.smoke, tests, budget))
  grouped = section("grouped_gemm", lambda: run_grouped_gemm(args.smoke, tests))
  dense = section("dense", lambda: run_dense(args.smoke))
  attention = section("attention", lambda: run_attention(args.smoke))
  if attention is not None:
    from benchmarks import attention_speeds
    table = attention_speeds.table_from_results(attention, tests)
    (out / "attention_speeds.json").write_text(json.dumps(table, indent=1))
  accuracy = section("attention_accuracy", lambda: run_attention_accuracy(args.smoke))
  tuning = section("attention_tuning", lambda: run_attention_tuning(args.smoke, left()))
  if tuning is not None:
    from benchmarks import attention_speeds
    (out / "attention_tuned.json").write_text(
        json.dumps(attention_speeds.tuned_from_tuning(tuning), indent=1))
  demo = section("demo", lambda: run_demo(args.smoke))

  summary["seconds"] = round(time.perf_counter() - start, 1)
  summary["highlights"] = _highlights(tests, dense, grouped, attention, gpt, moe_gpt, demo)
  summary["highlights"].update(_attention_highlights(accuracy, tuning))
  failed = [n for n, s in summary["sections"].items() if s["status"].startswith("error")]
  if tests is not None and tests["failed"]:
    failed.append("tests: " + ", ".join(t["test"] for t in tests["tests"]
                                        if t["outcome"] == "failed"))
  summary["failed"] = failed
  (out / "summary.json").write_text(json.dumps(summary, indent=1))
  print(json.dumps(summary["highlights"], indent=1))
  skipped = [n for n, s in summary["sections"].items() if s["status"] == "skipped"]
  print(f"gpu_check: {len(failed)} failure(s) in {summary['seconds']} s"
        + (f", skipped for time: {', '.join(skipped)}" if skipped else "") + f"; wrote {out}")
  return 1 if failed else 0


def format_plan(sections, budget_s: float, gpt_budget_s: float) -> str:
  """The sections in the order they run, with the seconds each is expected to take."""
  lines = [f"gpu_check plan: {budget_s:.0f} s; sections in order (a section that does not fit "
           "what is left is skipped):"]
  for name in SECTIONS:
    if name in sections:
      seconds = {"gpt": f"up to {gpt_budget_s:.0f} s with moe_gpt, by rows (benchmarks.gpt_plan)",
                 "moe_gpt": "in the gpt section's time"}.get(name,
                                                             f"~{SECTION_SECONDS.get(name)} s")
      lines.append(f"  {name:<13} {seconds}")
  return "\n".join(lines)


def _highlights(tests, dense, grouped, attention, gpt, moe_gpt, demo) -> dict:
  """The numbers a reader looks for first, gathered from the sections' results."""
  found = {}
  if tests is not None:
    found["gpu_tests"] = {k: tests[k] for k in ("passed", "failed", "skipped")}
    found["grouped_gemm_gpu_tests"] = _grouped_gemm_tests(tests)
  if dense is not None:
    found["dense_fp8_speedup"] = {
        row["M"]: {recipe: {"wall": round(row[f"fp8_{recipe}_speedup_vs_bf16"], 3),
                            "in_loop": round(row[f"fp8_{recipe}_in_loop_speedup_vs_bf16"], 3)}
                   for recipe in ("delayed", "current")}
        for row in dense["results"]}
  if grouped is not None:
    found["grouped_gemm"] = {f"G={row['experts']} K={row['K']} N={row['N']}":
                             _grouped_gemm_row(row) for row in grouped["results"]}
  if attention is not None:
    for result in attention["results"]:
      mask = "causal" if result["causal"] else "none"
      found[f"attention_{mask}"] = {
          name: {"fwd_tflops": round(row["forward"]["tflops"], 1),
                 "bwd_tflops": round(row["backward_tflops"], 1), "ok": row["numerics_ok"]}
          for name, row in result["implementations"].items() if "forward" in row}
  for name, result in (("gpt", gpt), ("moe_gpt", moe_gpt)):
    if result is not None:
      found[name] = _gpt_highlights(result["results"])
  if demo is not None:
    found["demo"] = {r["recipe"]: {"tokens_per_s": round(r["tokens_per_s"]),
                                   "attention": r["attention_backend"]} for r in demo["runs"]}
  return found


def _attention_highlights(accuracy, tuning) -> dict:
  """The FP8 kernels' errors (largest of out, dq, dk, dv) per input kind and mode, and the
  tuned tiles."""
  found = {}
  if accuracy is not None:
    for result in accuracy["results"]:
      mask = "causal" if result["causal"] else "none"
      found[f"attention_fp8_error_{mask}"] = {
          f"{kind}/{mode}": round(max(errors.values()), 4)
          for kind, modes in result["errors"].items() for mode, errors in modes.items()
          if "skipped" not in errors}
  if tuning is not None:
    found["attention_tuned"] = tuning["best"]
  return found


def _gpt_highlights(results: dict) -> dict:
  """Per model: tokens/s of each variant, FP8 over bf16, the step measured against the cost
  model's prediction, memory; and the rows that did not run, with why."""
  found = {}
  for model, summary in results["models"].items():
    found[model] = {
        "tokens_per_s": {v: round(t) for v, t in summary["tokens_per_s"].items()},
        "fp8_speedup_vs_bf16": {v: round(x, 3) for v, x in summary["fp8_speedup_vs_bf16"].items()},
        "step_ms": {v: {key: (round(value, 3) if value is not None else None)
                        for key, value in step.items()} for v, step in summary["step_ms"].items()},
        "memory_gib": {v: round(g, 2) for v, g in summary["memory_gib"].items()}}
  missing = {entry["label"]: entry.get("reason") or entry["status"]
             for entry in results["plan"] if entry["status"] != "ran"}
  if missing:
    found["not_run"] = missing
  return found


def _grouped_gemm_tests(tests: dict) -> dict:
  """The grouped kernels' GPU tests: their outcomes, and whether every one of them ran and
  passed (then RAGGED_GEMM_VALIDATED_ON_GPU may become True)."""
  mine = [t for t in tests["tests"] if GROUPED_GEMM_TESTS in t["test"]]
  outcomes = {t["test"].rsplit("::", 1)[-1]: t["outcome"] for t in mine}
  return {"outcomes": outcomes,
          "all_passed": bool(mine) and all(t["outcome"] == "passed" for t in mine)}


def _grouped_gemm_row(row: dict) -> dict:
  """One shape: TFLOP/s of each implementation that ran (or why it did not), the FP8
  speedups over the best bf16 grouped GEMM, and whether each FP8 mode met its target."""
  found = {}
  for name in ("bf16", "xla_bf16", "fp8_tensor", "fp8_block"):
    result = row.get(name, {})
    if "tflops" in result:
      found[name] = float(f"{result['tflops']:.3g}")   # 3 digits: a CPU smoke is < 0.1
    elif "skipped" in result or "error" in result:
      found[name] = result.get("skipped") or result["error"]
  found["best_bf16"] = row.get("best_bf16")
  for name in ("fp8_tensor", "fp8_block"):
    if f"{name}_speedup_vs_bf16" in row:
      found[f"{name}_speedup"] = round(row[f"{name}_speedup_vs_bf16"], 3)
      found[f"{name}_meets_target"] = row[f"{name}_meets_target"]
  return found


if __name__ == "__main__":
  sys.exit(main())
