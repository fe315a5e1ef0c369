"""The example and the benchmark run end to end on CPU (small settings)."""
import json

import numpy as np

import examples.train_mlp as train_mlp
from benchmarks import dense


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


def test_attention_benchmark_smoke_records_each_implementation(tmp_path):
  from benchmarks import attention
  out = tmp_path / "attention.json"
  attention.main(["--smoke", "--only", "pallas_bf16", "xla", "hopper_fp8", "--out", str(out)])
  rows = json.loads(out.read_text())["results"]["implementations"]
  for name in ("pallas_bf16", "xla"):
    assert rows[name]["forward"]["tflops"] > 0 and rows[name]["backward_s"] > 0
  # Where the Hopper kernel cannot run (any machine but a Hopper GPU) the report
  # says why instead of giving a number; on a Hopper GPU it runs.
  hopper = rows["hopper_fp8"]
  assert ("forward" in hopper and hopper["forward"]["tflops"] > 0) or "Hopper" in hopper["skipped"]
