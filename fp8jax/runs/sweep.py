"""`fp8jax sweep`: the demo GPT trained once per point of a grid of recipes and knobs.

    report = sweep({"recipes": ["delayed", "current"], "history": [1, 16]},
                   RunConfig(steps=100), "out/sweep")

The grid (`fp8jax.runs.grid`) is expanded into runs that share every setting,
seed and batch of `base_config` (only the recipe differs); bf16 runs once,
first, as the baseline. Each run is an `fp8jax.runs.train` run in
`<out>/<name>/` (metrics.jsonl, run.json, checkpoints) with FP8 telemetry
every `telemetry_every` steps. Written to `<out>`:

* `sweep.json`:

      {"config": {base settings, "telemetry_every", "predict_size"},
       "runs": [{"name", "recipe": {"kind": "DelayedScaling" | ... | "bf16", fields...},
                 "knobs": {knob: value}, "final_loss", "rel_gap_vs_bf16", "val_loss",
                 "tokens_per_s", "step_time_s",
                 "telemetry": {role kind: {"median_headroom", "min_headroom",
                                           "max_saturated", "max_flushed", "max_subnormal",
                                           "max_underflow", "min_snr_db"}},
                 "predicted_speedup", "predicted_speedup_note"}, ...],
       "files": [what was written]}

  `final_loss` is the mean training loss over the last 10% of steps and
  `rel_gap_vs_bf16 = final_loss / bf16's final_loss - 1` (as in `fp8jax compare`);
  `val_loss` is the last validation loss. `telemetry` summarizes every logging
  step and layer per role kind ("x", "kernel", "grad" of the projections and the
  output head; "attention_q", ... of FP8 attention): headroom (binades below the
  format's max, `fp8jax.telemetry.state_stats`) for every role; saturated,
  flushed, subnormal and underflow (= flushed + subnormal) fractions and SNR in
  dB (`fp8jax.telemetry.tensor_stats`) for x and kernel. A value is null where
  it was not measured or not finite (an SNR of +inf: no error; a headroom of
  +inf: the role saw only zeros). bf16 has no telemetry ({}).
  `predicted_speedup`: the cost model's bf16 time / FP8 time of one `fp8_dense`
  layer's forward and backward pass with x [n, n], kernel [n, n], n =
  `predict_size`, compiled for an H100 (`fp8jax.lowering.break_even`); 1.0 for
  bf16; null with the reason in `predicted_speedup_note` when it was not asked
  for or the deviceless toolchain is missing.
* `sweep_loss.png`: the loss curves of every run.
* `sweep_numerics.png`: saturated and underflow fractions per layer over the
  logging steps, per FP8 run (`fp8jax.runs.plots.numerics_heatmaps`).

(The PNGs need matplotlib.)
"""
from __future__ import annotations

import dataclasses
import json
import pathlib
import statistics

import jax

from fp8jax.core.recipes import recipe_kind
from fp8jax.deviceless import deviceless_toolchain_missing
from fp8jax.lowering.break_even import predicted_speedup
from fp8jax.runs import checkpoints, metrics, plots
from fp8jax.runs.config import RunConfig, RunError
from fp8jax.runs.grid import GridPoint, grid_points
from fp8jax.runs.train import train

SUMMARY_FIELDS = ("median_headroom", "min_headroom", "max_saturated", "max_flushed",
                  "max_subnormal", "max_underflow", "min_snr_db")


def sweep(grid: dict, base_config: RunConfig, out_dir, *, progress: bool = True,
          predict: bool = True, predict_size: int = 4096,
          telemetry_every: int | None = None) -> dict:
  """Trains one run per grid point (bf16 first) and writes the sweep's table and plots.

  Args:
    grid: {"recipes": [...], knob: [values], ...} (see `fp8jax.runs.grid`).
    base_config: the settings every run shares (its recipe is replaced).
    out_dir: the sweep's directory; each run goes to `<out_dir>/<point name>`.
    progress: a progress bar over the runs and one per run.
    predict: predict each recipe's speedup with the cost model (deviceless H100
      compiles, a few seconds per recipe); False leaves it null.
    predict_size: n of the [n, n] x [n, n] layer of the prediction (a multiple of 16).
    telemetry_every: logging steps every this many steps (and the first and
      last); None: about 20 over the run.

  Returns:
    The `sweep.json` contents.

  Raises:
    RunError: a bad grid or setting, or an `out_dir` that already holds a sweep
      (before anything trains).
  """
  points = grid_points(grid)
  if isinstance(predict_size, bool) or not isinstance(predict_size, int) or (
      predict_size < 16 or predict_size % 16):
    raise RunError(f"--predict-size {predict_size!r} must be a positive multiple of 16 "
                   "(cuBLASLt's FP8 GEMM wants multiples of 16), e.g. 4096.")
  every = telemetry_every if telemetry_every is not None else max(1, base_config.steps // 20)
  out_dir = pathlib.Path(out_dir)
  _check_out(out_dir, points)
  configs = {p.name: base_config.replace(recipe=p.recipe, recipe_options=p.options or None)
             for p in points}
  predictions = _predictions(configs, predict, predict_size)  # compile errors before training
  bar = _bar(progress, len(points))
  results = {}
  for point in points:
    if bar is not None:
      bar.set_postfix_str(point.name)
    results[point.name] = train(configs[point.name], out_dir / point.name,
                                progress=point.name if progress else False,
                                telemetry_every=every)
    if bar is not None:
      bar.update(1)
  if bar is not None:
    bar.close()
  baseline = results["bf16"].final_loss()
  runs = []
  for point in points:
    result = results[point.name]
    speedup, note = predictions[point.name]
    runs.append({
        "name": point.name, "recipe": _recipe_fields(configs[point.name]),
        "knobs": dict(point.knobs), "final_loss": result.final_loss(),
        "rel_gap_vs_bf16": result.final_loss() / baseline - 1.0,
        "val_loss": result.val_losses[max(result.val_losses)],
        "tokens_per_s": result.tokens_per_s, "step_time_s": result.step_time_s,
        "telemetry": summarize_telemetry(result.out_dir / metrics.FILE),
        "predicted_speedup": speedup, "predicted_speedup_note": note})
  config = {k: v for k, v in base_config.to_dict().items() if k not in ("recipe",
                                                                        "recipe_options")}
  report = {"config": {**config, "telemetry_every": every, "predict_size": predict_size},
            "runs": runs}
  written = [plots.loss_curves({p.name: [out_dir / p.name / metrics.FILE] for p in points},
                               out_dir / "sweep_loss.png"),
             plots.numerics_heatmaps({p.name: out_dir / p.name / metrics.FILE
                                      for p in points if p.recipe != "bf16"},
                                     out_dir / "sweep_numerics.png")]
  report["files"] = ["sweep.json"] + [path.name for path in written if path is not None]
  (out_dir / "sweep.json").write_text(json.dumps(metrics.finite(report), indent=1))
  return report


def summarize_telemetry(metrics_path) -> dict:
  """{role kind: {SUMMARY_FIELDS...}} over every "telemetry" line and layer of a run.

  A role's kind is its last name ("x", "kernel", "grad"), "attention_" before it
  for FP8 attention's roles. Headroom: median and min over the finite values;
  fractions: max; SNR: min over the finite values. None where nothing was measured.
  """
  values: dict[str, dict[str, list]] = {}
  for line in metrics.read(metrics_path):
    for key, record in line.get("telemetry", {}).items():
      parts = key.split("@")[0].split("/")
      kind = ("attention_" if "attention_meta" in parts else "") + parts[-1]
      found = values.setdefault(kind, {f: [] for f in ("headroom", "saturated", "flushed",
                                                       "subnormal", "underflow", "snr_db")})
      for field in ("headroom", "saturated", "flushed", "subnormal", "snr_db"):
        found[field] += [v for v in record.get(field, []) if v is not None]
      if "flushed" in record:
        found["underflow"] += [f + s for f, s in zip(record["flushed"], record["subnormal"])
                               if f is not None and s is not None]
  return {kind: {
      "median_headroom": statistics.median(found["headroom"]) if found["headroom"] else None,
      "min_headroom": min(found["headroom"], default=None),
      "max_saturated": max(found["saturated"], default=None),
      "max_flushed": max(found["flushed"], default=None),
      "max_subnormal": max(found["subnormal"], default=None),
      "max_underflow": max(found["underflow"], default=None),
      "min_snr_db": min(found["snr_db"], default=None)} for kind, found in values.items()}


def table(report: dict) -> str:
  """The sweep as a text table: loss, gap, numerics extremes and predicted speedup per run."""
  width = max([4] + [len(run["name"]) for run in report["runs"]])
  header = (f"{'name':<{width}} {'final loss':>10} {'vs bf16':>9} {'val loss':>9} "
            f"{'min SNR dB':>10} {'max sat.':>9} {'pred. speedup':>13}")
  lines = [header, "-" * len(header)]
  for run in report["runs"]:
    kinds = run["telemetry"].values()
    snr = min((k["min_snr_db"] for k in kinds if k["min_snr_db"] is not None), default=None)
    saturated = max((k["max_saturated"] for k in kinds if k["max_saturated"] is not None),
                    default=None)
    speedup = run["predicted_speedup"]
    lines.append(f"{run['name']:<{width}} {run['final_loss']:>10.4f} "
                 f"{100 * run['rel_gap_vs_bf16']:>+8.2f}% {run['val_loss']:>9.4f} "
                 f"{_or_dash(snr, '.1f'):>10} {_or_dash(saturated, '.2e'):>9} "
                 f"{_or_dash(speedup, '.3f'):>13}")
  return "\n".join(lines)


def _or_dash(value, spec: str) -> str:
  return "-" if value is None else format(value, spec)


def _check_out(out_dir: pathlib.Path, points: list[GridPoint]) -> None:
  if out_dir.exists() and not out_dir.is_dir():
    raise RunError(f"--out {str(out_dir)!r} is a file; pass a directory.")
  started = [p.name for p in points if checkpoints.complete(out_dir / p.name)]
  if started:
    raise RunError(f"{str(out_dir)!r} already holds a sweep ({started[0]}/ has checkpoints); "
                   "choose another --out.")


def _recipe_fields(config: RunConfig) -> dict:
  """The run's recipe as sweep.json records it; a recipe of your own is "module:Class"."""
  recipe = config.recipe_object
  if recipe is None:
    return {"kind": "bf16"}
  # "DelayedScaling", or "module:Class"
  return {"kind": recipe_kind(type(recipe)), **dataclasses.asdict(recipe)}


def _predictions(configs: dict, predict: bool, size: int) -> dict:
  """{name: (predicted speedup or None, why it is None or None)}; one compile per recipe."""
  missing = _toolchain_missing() if predict else "not asked for (predict=False, --no-predict)"
  by_recipe, found = {}, {}
  for name, config in configs.items():
    recipe = config.recipe_object
    if recipe is None:
      found[name] = (1.0, None)  # bf16 against itself
    elif missing:
      found[name] = (None, missing)
    else:
      if recipe not in by_recipe:
        by_recipe[recipe] = predicted_speedup(size, size, size, recipe=recipe, target="auto")
      found[name] = (by_recipe[recipe], None)
  return found


def _toolchain_missing() -> str | None:
  """Why the cost model cannot compile for an H100 here (None: it can)."""
  if jax.default_backend() == "gpu":
    return None
  missing = deviceless_toolchain_missing()
  return f"cannot compile for an H100 without a GPU: {missing}" if missing else None


def _bar(progress: bool, total: int):
  if not progress:
    return None
  from tqdm import tqdm  # optional (the 'examples' extra): only for a progress bar
  return tqdm(total=total, desc="sweep", unit="run", position=0, dynamic_ncols=True)
