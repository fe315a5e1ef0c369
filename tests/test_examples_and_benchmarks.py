"""The example and the benchmark run end to end on CPU (small settings)."""
import json

import numpy as np
import pytest

import examples.train_mlp as train_mlp
from benchmarks import dense, gpu_check, trace_categories

# The GPU check's smoke run in four parts, each a test of its own (of about 12, 25, 12
# and 5 s) so the suite's workers share them; together they are every section.
SMOKE_PARTS = {"kernels": ("tests", "dense", "grouped_gemm", "attention"),
               "attention_tools": ("attention_accuracy", "attention_tuning"),
               "gpt": ("gpt", "demo"), "moe_gpt": ("moe_gpt",)}
SECTION_FILES = {"tests": "gpu_tests", "demo": "demo_compare"}


def test_train_mlp_example_learns_in_bf16_and_fp8(tmp_path):
  results = train_mlp.main(["--steps", "150", "--width", "128", "--batch", "128", "--lr", "1e-2",
                            "--out", str(tmp_path)])
  for label, run in results.items():
    losses = run["losses"]
    assert np.all(np.isfinite(losses)), label
    # Learning happened: the last losses are well below the first ones.
    assert np.mean(losses[-10:]) < 0.6 * np.mean(losses[:10]), label
  saved = json.loads((tmp_path / "train_mlp.json").read_text())
  assert set(saved["runs"]) == {"bf16", "fp8 delayed", "fp8 current"}
  assert all(s > 0 for s in saved["runs"]["fp8 delayed"]["fp8_scales"].values())


def test_dense_benchmark_smoke_writes_json(tmp_path):
  out = tmp_path / "dense.json"
  report = dense.main(["--smoke", "--out", str(out)])
  saved = json.loads(out.read_text())
  assert saved["results"] == json.loads(json.dumps(report["results"]))
  for row in saved["results"]:
    for name in ("bf16", "fp8_delayed", "fp8_current"):
      assert row[name]["median_s"] > 0 and row[name]["tflops"] > 0
      # The same step timed as several steps in one call (no host dispatch between them).
      assert row[f"{name}_in_loop"]["median_s"] > 0 and row["loop_steps"] == 2


def test_the_smoke_parts_are_every_section_of_the_gpu_check_once():
  sections = [name for part in SMOKE_PARTS.values() for name in part]
  assert sorted(sections) == sorted(gpu_check.SECTIONS)


@pytest.mark.parametrize("part", sorted(SMOKE_PARTS))
def test_gpu_check_smoke_runs_its_sections_and_writes_their_json(part, tmp_path):
  """`python -m benchmarks.gpu_check --smoke --sections ...`: the one-call GPU check on
  CPU, tiny shapes, one part of its sections."""
  sections = SMOKE_PARTS[part]
  code = gpu_check.main(["--smoke", "--sections", ",".join(sections), "--out", str(tmp_path)])
  summary = json.loads((tmp_path / "summary.json").read_text())
  assert code == 0, summary["failed"]
  assert {name: s["status"] for name, s in summary["sections"].items()} == {
      name: "ok" for name in sections}
  for name in sections:
    assert (tmp_path / f"{SECTION_FILES.get(name, name)}.json").exists(), name
  if "tests" in sections:
    # On a CPU every GPU test is collected and skipped (none may fail or error), the
    # grouped FP8 GEMMs' among them; skipped is not validated.
    tests = json.loads((tmp_path / "gpu_tests.json").read_text())
    assert tests["skipped"] > 0 and tests["failed"] == 0 and tests["passed"] == 0
    grouped_tests = summary["highlights"]["grouped_gemm_gpu_tests"]
    assert set(grouped_tests["outcomes"].values()) == {"skipped"}, grouped_tests
    assert not grouped_tests["all_passed"]
  if "dense" in sections:
    # The dense benchmark's speedups over bf16 for both recipes, per size.
    for by_recipe in summary["highlights"]["dense_fp8_speedup"].values():
      assert {recipe: sorted(row) for recipe, row in by_recipe.items()} == {
          "delayed": ["in_loop", "wall"], "current": ["in_loop", "wall"]}, by_recipe
  if "grouped_gemm" in sections:
    # The grouped GEMM rows: the FP8 kernels' jnp twins and XLA's ragged_dot on a CPU,
    # each with its speedup over the best bf16 row that ran and its verdict against the
    # targets.
    (row,) = summary["highlights"]["grouped_gemm"].values()
    assert row["best_bf16"] == "xla_bf16" and row["fp8_tensor"] > 0 and row["fp8_block"] > 0
    assert isinstance(row["fp8_tensor_meets_target"], bool), row
  if "attention" in sections:
    # Each attention row has numbers and numerics, or says why it cannot run here.
    for result in json.loads((tmp_path / "attention.json").read_text())["results"]:
      rows = result["implementations"]
      assert rows["bf16/xla"]["numerics_ok"] and rows["fp8/xla"]["numerics_ok"], rows
      assert "GPU" in rows["bf16/cudnn"]["skipped"]
      assert "Hopper" in rows["fp8/pallas_hopper_fp8"]["skipped"] or "GPU" in (
          rows["fp8/pallas_hopper_fp8"]["skipped"])
    # Unvalidated (no GPU test ran): the Hopper kernels never enter the selection table.
    table = json.loads((tmp_path / "attention_speeds.json").read_text())
    assert all(not entry["validated"] for masks in table.values()
               for by_precision in masks.values() for rows in by_precision.values()
               for name, entry in rows.items() if name.startswith("pallas_hopper"))
  if "attention_accuracy" in sections:
    # The FP8 kernels' arithmetic (jnp, on a CPU): Gaussian inputs at E4M3's floor (about
    # 5%: q, k, v and P each rounded with 2.6% rms), and the rotation at least halving the
    # error where q and k have channel outliers.
    (result,) = json.loads((tmp_path / "attention_accuracy.json").read_text())["results"]
    errors = {kind: {mode: max(e.values()) for mode, e in modes.items()}
              for kind, modes in result["errors"].items()}
    assert 0.02 < errors["gaussian"]["per_tensor"] < 0.1, errors
    assert errors["channels"]["blocks+rotate"] < errors["channels"]["per_tensor"] / 2, errors
  if "attention_tuning" in sections:
    # Two forward variants (ping-pong on and off) and one backward variant of the bf16
    # kernels in Mosaic GPU's interpreter, each timed, and a pick among them; a smoke
    # run's pick never becomes a table.
    tuning = json.loads((tmp_path / "attention_tuning.json").read_text())
    (result,) = tuning["results"]
    assert all(e["median_s"] > 0 for e in result["forward"] + result["backward"]), result
    assert {e["blocks"]["ping_pong"] for e in result["forward"]} == {True, False}
    assert tuning["best"]["bf16"]["none"]["64"] == result["best"]
    assert json.loads((tmp_path / "attention_tuned.json").read_text()) == {}
  if "gpt" in sections:
    # The dense rows (a one-block tiny model): bf16, delayed and current scaling, each
    # timed, profiled and predicted.
    gpt = json.loads((tmp_path / "gpt.json").read_text())["results"]
    assert [row["variant"] for row in gpt["rows"]] == ["bf16", "delayed", "current"]
    assert [entry["status"] for entry in gpt["plan"]] == ["ran"] * 3
    for row in gpt["rows"]:
      _check_profiled_row(row)
    highlight = summary["highlights"]["gpt"]["tiny, 1 layer"]
    assert set(highlight["fp8_speedup_vs_bf16"]) == {"delayed", "current"}
    assert all(step["predicted"] > 0 for step in highlight["step_ms"].values())
  if "demo" in sections:
    demo = json.loads((tmp_path / "demo_compare.json").read_text())
    assert demo["exit_code"] == 0
    assert [run["recipe"] for run in demo["runs"]] == ["bf16", "delayed"]
  if "moe_gpt" in sections:
    # The MoE GPT's rows, bf16 and FP8 with the memory features, profiled like the others.
    moe = json.loads((tmp_path / "moe_gpt.json").read_text())["results"]
    assert [(row["experts"], row["variant"]) for row in moe["rows"]] == [
        (4, "bf16"), (4, "delayed, adamw_fp8, fp8 saved")]
    for row in moe["rows"]:
      _check_profiled_row(row)
    highlight = summary["highlights"]["moe_gpt"]["tiny, 4 experts top-2, 1 layer"]
    assert set(highlight["memory_gib"]) == {"bf16", "delayed, adamw_fp8, fp8 saved"}


def _check_profiled_row(row):
  """A GPT row of the check: timed, its memory, its trace by category, its prediction."""
  assert row["tokens_per_s"] > 0 and row["memory"]["total"] > 0, row["label"]
  assert set(row["seconds"]) == {"build_and_init", "compile", "timed_steps", "trace",
                                 "analysis", "total"}
  categories = row["categories"]
  # On a CPU the kernels are XLA:CPU's thunks, each naming its HLO instruction.
  assert categories["source"] == "cpu" and categories["kernels"] > 0
  assert categories["resolved"].get("hlo_op", 0) > 0
  assert set(categories["by_category"]) <= set(trace_categories.CATEGORIES)
  assert sum(c["seconds"] for c in categories["by_category"].values()) == pytest.approx(
      categories["kernel_s"])
  # The cost model's view of the same executable: one kernel list behind the predicted
  # categories, the kernel classes and the predicted time.
  launches = row["predicted"]["kernel_launches"]
  assert sum(c["kernels"] for c in categories["predicted"].values()) == launches
  assert sum(c["launches"] for c in row["kernel_classes"]) == launches
  assert row["predicted"]["step_s"] > 0 and row["predicted"]["measured_over_predicted"] > 0


def test_gpu_check_times_the_fp8_grouped_kernels_only_after_their_gpu_tests_passed():
  """Never run on a GPU before: a wrong or hanging kernel must not take the check down."""
  from benchmarks import gpu_check, grouped_gemm
  tests = {"tests": [
      {"test": "tests.test_ragged_matmul::test_compiled_kernels_match_float64_on_hopper[tensor]",
       "outcome": "passed"},
      {"test": "tests.test_ragged_matmul::test_compiled_kernels_match_float64_on_hopper[block]",
       "outcome": "failed"},
      {"test": "tests.test_dense::test_other", "outcome": "passed"}]}
  verdict = gpu_check._grouped_gemm_tests(tests)
  assert verdict["outcomes"] == {"test_compiled_kernels_match_float64_on_hopper[tensor]":
                                 "passed",
                                 "test_compiled_kernels_match_float64_on_hopper[block]":
                                 "failed"}
  assert not verdict["all_passed"]
  assert gpu_check._grouped_gemm_tests({"tests": tests["tests"][:1]})["all_passed"]
  (row,) = grouped_gemm.run([(4, 256, 128)], 64, 1, True, skip_fp8_kernels="tests failed")
  assert row["fp8_tensor"] == row["fp8_block"] == {"skipped": "tests failed"}
  assert row["xla_bf16"]["median_s"] > 0 and "fp8_tensor_speedup_vs_bf16" not in row
  highlight = gpu_check._grouped_gemm_row(row)
  assert highlight["fp8_tensor"] == "tests failed" and "fp8_tensor_speedup" not in highlight
