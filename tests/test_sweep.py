"""`fp8jax sweep`: the grid, the runs it trains, sweep.json, the plots and the user errors.

One small sweep (the tiny model, 8 steps of 4 x 32 tokens) runs through the
function, once per test run (tests/run_once.py), and again, with the same settings,
through the command line: the same programs compiled from the same settings give the
same losses, and in the process that ran the first sweep the second reuses its compiled
steps (`fp8jax.runs.steps`).
"""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

import fp8jax
from fp8jax import runs
from fp8jax.cli import main
from fp8jax.deviceless import deviceless_toolchain_missing
from fp8jax.runs import metrics, sweep
from fp8jax.runs.grid import grid_points
from run_once import shared

# Only settings the command line can also give, so both paths compile the same steps.
SETTINGS = dict(size="tiny", steps=8, batch=4, seq=32, eval_every=8)
ARGV = ["--size", "tiny", "--steps", "8", "--batch", "4", "--seq", "32", "--eval-every", "8"]
# history applies to delayed only: rowwise runs once; bf16 always runs, first. (One
# history value keeps the test fast; the grid's products are checked without training.)
GRID = {"recipes": ["delayed", "rowwise"], "history": [1]}
GRID_ARGV = ["--recipes", "delayed,rowwise", "--history", "1"]
NAMES = ["bf16", "delayed,history=1", "rowwise"]
TELEMETRY_EVERY = 2


@pytest.fixture(scope="module")
def swept():
  """(its directory, what `sweep.sweep` returned): once per test run (run_once.py)."""
  return shared("sweep", lambda out: sweep.sweep(
      GRID, runs.RunConfig(**SETTINGS), out, progress=False, predict=False,
      telemetry_every=TELEMETRY_EVERY))


def test_a_knob_multiplies_only_the_recipes_whose_dataclass_has_its_field():
  points = grid_points({"recipes": ["current", "delayed", "rowwise"], "history": [1, 4],
                        "margin": [0, 2]})
  assert [p.name for p in points] == [
      "bf16", "current,margin=0", "current,margin=2", "delayed,history=1,margin=0",
      "delayed,history=1,margin=2", "delayed,history=4,margin=0", "delayed,history=4,margin=2",
      "rowwise"]
  built = {p.name: runs.RunConfig(recipe=p.recipe, recipe_options=p.options or None)
           for p in points}
  assert built["delayed,history=4,margin=2"].recipe_object == fp8jax.DelayedScaling(
      amax_history_len=4, margin=2)
  assert built["current,margin=2"].recipe_object == fp8jax.CurrentScaling(margin=2)
  assert built["rowwise"].recipe_object == fp8jax.RowwiseScaling()
  assert built["bf16"].recipe_object is None


def test_the_mxfp8_and_nvfp4_knobs_multiply_only_their_recipes():
  points = grid_points({"recipes": ["delayed", "mxfp8", "nvfp4"],
                        "scale_rounding": ["floor", "round_up"],
                        "stochastic_rounding": [False, True], "hadamard": [True]})
  assert [p.name for p in points] == [
      "bf16", "delayed", "mxfp8,scale-rounding=floor", "mxfp8,scale-rounding=round_up",
      "nvfp4,stochastic-rounding=0,hadamard=1", "nvfp4,stochastic-rounding=1,hadamard=1"]
  built = {p.name: runs.RunConfig(recipe=p.recipe, recipe_options=p.options or None)
           for p in points}
  assert built["mxfp8,scale-rounding=round_up"].recipe_object == fp8jax.MXFP8Scaling(
      scale_rounding="round_up")
  assert built["nvfp4,stochastic-rounding=0,hadamard=1"].recipe_object == (
      fp8jax.NVFP4Scaling(stochastic_rounding=False))
  # The named recipes of the demo: NVIDIA's MXFP8 rule and NVFP4 as NVIDIA trains with it.
  assert runs.RunConfig(recipe="mxfp8_round_up").recipe_object == fp8jax.MXFP8Scaling(
      scale_rounding="round_up")
  assert runs.RunConfig(recipe="nvfp4").recipe_object == fp8jax.NVFP4Scaling()


def test_sweep_json_has_one_run_per_point_with_the_loss_and_gap_of_compare(swept):
  out, report = swept
  saved = json.loads((out / "sweep.json").read_text())
  assert saved == json.loads(json.dumps(metrics.finite(report)))
  assert [run["name"] for run in saved["runs"]] == NAMES
  assert saved["config"]["steps"] == 8 and saved["config"]["telemetry_every"] == TELEMETRY_EVERY
  by_name = {run["name"]: run for run in saved["runs"]}
  assert by_name["delayed,history=1"]["recipe"] == {
      "kind": "DelayedScaling", "amax_history_len": 1, "amax_compute_algo": "max", "margin": 0,
      "fp8_format": "hybrid", "power_of_two": False, "high_precision": []}
  assert by_name["rowwise"]["recipe"]["kind"] == "RowwiseScaling"
  assert by_name["bf16"]["recipe"] == {"kind": "bf16"}
  baseline = by_name["bf16"]["final_loss"]
  for run in saved["runs"]:
    lines = metrics.read(out / run["name"] / metrics.FILE)
    losses = [line["loss"] for line in lines if "loss" in line]
    assert len(losses) == 8
    # As in `fp8jax compare`: the mean training loss over the last 10% of the steps
    # (at least one step: 8 // 10 = 0, so the last one).
    assert run["final_loss"] == pytest.approx(losses[-1], rel=1e-12)
    assert run["rel_gap_vs_bf16"] == pytest.approx(losses[-1] / baseline - 1, rel=1e-12)
    assert run["val_loss"] == [line["val_loss"] for line in lines if "val_loss" in line][-1]
    assert run["tokens_per_s"] > 0 and losses[-1] < losses[0]
    assert run["predicted_speedup"] == (1.0 if run["name"] == "bf16" else None)
    if run["name"] != "bf16":
      assert "not asked" in run["predicted_speedup_note"]


def test_telemetry_is_logged_at_the_logging_steps_and_its_summaries_are_in_range(swept):
  out, report = swept
  for run in report["runs"]:
    lines = metrics.read(out / run["name"] / metrics.FILE)
    logged = [line["step"] for line in lines if "telemetry" in line]
    if run["name"] == "bf16":
      assert logged == [] and run["telemetry"] == {}
      continue
    assert logged == [1, 2, 4, 6, 8]  # every 2 steps, and the first
    # 4 blocks of qkv, out, up, down: x and kernel measured per layer of the scan.
    record = [line for line in lines if "telemetry" in line][-1]["telemetry"]
    measured = [key for key, fields in record.items() if "saturated" in fields]
    assert len(measured) == 8 and all(len(record[key]["saturated"]) == 4 for key in measured)
    summary = run["telemetry"]
    assert {"x", "kernel", "grad"} <= set(summary)
    for kind in ("x", "kernel"):
      s = summary[kind]
      for field in ("max_saturated", "max_flushed", "max_subnormal", "max_underflow"):
        assert 0.0 <= s[field] <= 1.0, (run["name"], kind, field, s[field])
      assert s["max_underflow"] <= s["max_flushed"] + s["max_subnormal"] + 1e-12
      assert s["max_underflow"] >= max(s["max_flushed"], s["max_subnormal"])
      # E4M3 keeps 3 mantissa bits: about 30 dB on a well-scaled tensor; well above 0
      # for any tensor that is not mostly flushed.
      assert 10.0 < s["min_snr_db"] < 60.0, (run["name"], kind, s["min_snr_db"])
    for kind, s in summary.items():
      assert math.isfinite(s["min_headroom"]) and s["min_headroom"] <= s["median_headroom"]
    # The gradients have only state-level stats (they exist in the backward pass only).
    assert summary["grad"]["max_saturated"] is None


def test_both_plots_are_drawn(swept):
  out, report = swept
  import matplotlib.image
  assert report["files"] == ["sweep.json", "sweep_loss.png", "sweep_numerics.png"]
  for name, min_height in (("sweep_loss.png", 200), ("sweep_numerics.png", 500)):
    image = matplotlib.image.imread(out / name)
    # A drawn figure: many distinct colours (every 3rd pixel: np.unique is slow), not blank.
    assert image.shape[0] > min_height
    assert len(np.unique(image[::3, ::3].reshape(-1, image.shape[-1]), axis=0)) > 20


def test_the_command_line_runs_the_same_sweep_and_prints_the_table(swept, tmp_path, capsys):
  _, report = swept
  status = main(["sweep", "--out", str(tmp_path), *ARGV, *GRID_ARGV, "--no-predict",
                 "--telemetry-every", str(TELEMETRY_EVERY)])
  printed = capsys.readouterr().out
  assert status == 0
  saved = json.loads((tmp_path / "sweep.json").read_text())
  assert [run["name"] for run in saved["runs"]] == NAMES
  # Same settings, seed and compiled steps as the function's sweep: the same losses.
  for mine, theirs in zip(saved["runs"], report["runs"]):
    assert mine["final_loss"] == theirs["final_loss"]
  for name in NAMES + ["min SNR dB", "pred. speedup", "not asked"]:
    assert name in printed


@pytest.mark.parametrize("argv,message", [
    (["--recipes", "delayed,fp4"], "--recipes: 'fp4' is not one of"),
    (["--recipes", "current", "--history", "1,16"], "--history applies to none of the recipes"),
    (["--recipes", "delayed", "--history", "1,x"], "--history 'x' is not an integer"),
    (["--recipes", "delayed", "--amax-algo", "mean"], "--amax-algo mean is not valid for delayed"),
    (["--recipes", "delayed", "--margin", "0,0"], "--margin 0,0 names a value twice"),
    (["--recipes", "delayed", "--power-of-two", "maybe"],
     "--power-of-two 'maybe': expected 0 or 1"),
    (["--predict-size", "100"], "--predict-size 100 must be a positive multiple of 16"),
    (["--recipes", "delayed", "--scale-rounding", "floor"],
     "--scale-rounding applies to none of the recipes"),
    (["--recipes", "nvfp4", "--weight-blocks", "32x32"],
     "--weight-blocks 32x32 is not valid for nvfp4: weight_blocks='32x32'"),
    (["--recipes", "mxfp8", "--scale-rounding", "nearest"],
     "--scale-rounding nearest is not valid for mxfp8: scale_rounding='nearest'"),
])
def test_a_bad_grid_is_one_line_before_anything_trains(argv, message, tmp_path, capsys):
  status = main(["sweep", "--out", str(tmp_path / "sweep"), *ARGV, *argv])
  err = capsys.readouterr().err.strip()
  assert status == 2
  assert message in err and len(err.splitlines()) == 1 and "Traceback" not in err
  assert not (tmp_path / "sweep").exists()


def test_an_unknown_knob_given_to_the_function_is_named():
  with pytest.raises(runs.RunError, match="unknown knob 'histroy'; the knobs are"):
    sweep.sweep({"recipes": ["delayed"], "histroy": [1]}, runs.RunConfig(**SETTINGS), "unused")


@pytest.mark.hopper
@pytest.mark.skipif(deviceless_toolchain_missing() is not None,
                    reason=deviceless_toolchain_missing() or "")
def test_predicted_speedup_is_a_positive_float_per_recipe():
  configs = {name: runs.RunConfig(recipe=recipe) for name, recipe in (
      ("bf16", "bf16"), ("delayed", "delayed"), ("current", "current"))}
  found = sweep._predictions(configs, predict=True, size=256)
  assert found["bf16"] == (1.0, None)
  for name in ("delayed", "current"):
    speedup, note = found[name]
    assert isinstance(speedup, float) and speedup > 0 and note is None
  # Current scaling reads each tensor once more (its amax before the cast): never faster.
  assert found["current"][0] <= found["delayed"][0]
