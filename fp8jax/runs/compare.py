"""`fp8jax compare`: the same run in bf16 and in each FP8 recipe, side by side.

Every run uses the same settings, seed and data (only the recipe differs), in
`<out>/<recipe>/`. The comparison is written to `<out>/compare.json`:

    {"config": {...}, "runs": [{"recipe", "final_loss", "rel_gap_vs_bf16", "val_loss",
                                "tokens_per_s", "step_time_s", "attention_backend"}, ...],
     "versions": {"python", "jax", "jaxlib", "flax", "optax", "numpy"},
     "machine": {"device", "cpu", "cores", "isa", "xla_flags"},
     "corpus": {"source", "python_version", "sha256"}, "files": [...]}

with `final_loss` the mean training loss over the last 10% of steps and
`rel_gap_vs_bf16 = final_loss / bf16's final_loss - 1`. A recorded result is reproduced
bit for bit only with the same `versions` (Python and libraries), `machine` (on a CPU,
the processor: XLA compiles for its instruction set; `fp8jax.runs.machine`) and `corpus`
(the sha256 of the bytes trained on: the standard library differs between Python builds).
`files` is what was written; drawn as `<out>/compare.png` (loss curves) and
`<out>/fp8_scales.png` (per-layer scales over the steps of the first FP8 run), when
matplotlib is installed.
"""
from __future__ import annotations

import importlib.metadata
import json
import pathlib
import platform

from fp8jax.runs import checkpoints, machine, metrics, plots
from fp8jax.runs.config import RunConfig, RunError
from fp8jax.runs.train import RunResult, train

DEFAULT_RECIPES = ("bf16", "delayed", "current")
# The distributions whose versions decide a comparison's numbers (compare.json "versions").
VERSIONED = ("jax", "jaxlib", "flax", "optax", "numpy")


def compare(config: RunConfig, out_dir, recipes=DEFAULT_RECIPES, progress: bool = True,
            resume: bool = False) -> dict:
  """Trains `config` once per recipe and writes the comparison.

  Args:
    config: the shared settings (its `recipe` is replaced by each of `recipes`).
    out_dir: the comparison's directory; each run goes to `<out_dir>/<recipe>`.
    recipes: distinct recipe names, "bf16" (the baseline) among them.
    progress: progress bars.
    resume: continue an interrupted comparison: each run resumes from its newest
      checkpoint (a finished run only reloads its results).

  Returns:
    The `compare.json` contents.
  """
  recipes = tuple(recipes)
  if "bf16" not in recipes:
    raise RunError(f"compare needs the bf16 baseline among its recipes, got {recipes}.")
  if len(set(recipes)) != len(recipes):
    raise RunError(f"--recipes {','.join(recipes)} names a recipe twice.")
  out_dir = pathlib.Path(out_dir)
  started = [r for r in recipes if checkpoints.complete(out_dir / r)]
  if started and not resume:
    raise RunError(f"{str(out_dir)!r} already holds a comparison ({started[0]}/ has "
                   "checkpoints); pass --resume to continue it, or choose another --out.")
  results: dict[str, RunResult] = {}
  for recipe in recipes:
    run_config = config.replace(recipe=recipe)
    found = checkpoints.complete(out_dir / recipe)
    if found and checkpoints.saved_config(found[-1])[1] >= config.steps:
      # A finished run is only reloaded: it must be the run these options describe.
      checkpoints.check_same_run(found[-1], run_config)
      finished_at = checkpoints.saved_config(found[-1])[1]
      if finished_at != config.steps:
        raise RunError(f"{str(out_dir / recipe)!r} finished at step {finished_at}; pass "
                       f"--steps {finished_at} to report it (or more steps to continue it).")
      results[recipe] = _finished(run_config, out_dir / recipe)
    else:
      results[recipe] = train(run_config, out_dir / recipe, progress=progress,
                              resume=bool(found))
  baseline = results["bf16"].final_loss()
  runs = []
  for recipe, result in results.items():
    final = result.final_loss()
    runs.append({"recipe": recipe, "final_loss": final,
                 "rel_gap_vs_bf16": final / baseline - 1.0,
                 "val_loss": result.val_losses[max(result.val_losses)],
                 "tokens_per_s": result.tokens_per_s, "step_time_s": result.step_time_s,
                 "attention_backend": result.attention_backend})
  settings = {k: v for k, v in config.to_dict().items() if k != "recipe"}
  if settings.get("schedule_steps") == config.steps:
    settings["schedule_steps"] = None  # the default (the run's steps), as a fresh run says
  report = {"config": settings, "runs": runs, "versions": versions(),
            "machine": machine.describe(), "corpus": recorded_corpus(results["bf16"].out_dir)}
  curves = {recipe: [result.out_dir / metrics.FILE] for recipe, result in results.items()}
  written = [plots.loss_curves(curves, out_dir / "compare.png")]
  fp8_runs = [r for r in recipes if r != "bf16"]
  if fp8_runs:
    written.append(plots.scale_heatmap(
        results[fp8_runs[0]].out_dir / metrics.FILE, out_dir / "fp8_scales.png",
        title=f"FP8 scales per layer and role ({fp8_runs[0]} scaling)"))
  report["files"] = ["compare.json"] + [path.name for path in written if path is not None]
  (out_dir / "compare.json").write_text(json.dumps(metrics.finite(report), indent=1))
  return report


def recorded_corpus(run_dir) -> dict:
  """The corpus a run trained on, as its run.json records it.

  Returns:
    `{"source": "python-stdlib", "python_version": "3.11.7", "sha256": ...}` (a key the
    run did not record is None).
  """
  corpus = json.loads((pathlib.Path(run_dir) / "run.json").read_text())["corpus"]
  return {key: corpus.get(key) for key in ("source", "python_version", "sha256")}


def versions() -> dict[str, str]:
  """The Python version and the installed version of each of `VERSIONED`.

  Returns:
    `{"python": "3.11.7", "jax": ..., "jaxlib": ..., "flax": ..., "optax": ..., "numpy": ...}`.
  """
  return {"python": platform.python_version(),
          **{name: importlib.metadata.version(name) for name in VERSIONED}}


def _finished(config: RunConfig, run_dir: pathlib.Path) -> RunResult:
  """The results of a run that already reached its last step (from its files)."""
  lines = metrics.read(run_dir / metrics.FILE)
  summary = json.loads((run_dir / "run.json").read_text())
  return RunResult(config=config, out_dir=run_dir,
                   losses=[line["loss"] for line in lines if "loss" in line],
                   val_losses={line["step"]: line["val_loss"] for line in lines
                               if "val_loss" in line},
                   tokens_per_s=summary["tokens_per_s"], step_time_s=summary["step_time_s"],
                   attention_backend=summary["attention_backend"],
                   checkpoint=checkpoints.complete(run_dir)[-1])


def table(report: dict) -> str:
  """The comparison as a text table."""
  header = (f"{'recipe':<9} {'final loss':>10} {'vs bf16':>9} {'val loss':>9} "
            f"{'tokens/s':>10} {'step ms':>8}  attention")
  lines = [header, "-" * len(header)]
  for run in report["runs"]:
    lines.append(f"{run['recipe']:<9} {run['final_loss']:>10.4f} "
                 f"{100 * run['rel_gap_vs_bf16']:>+8.2f}% {run['val_loss']:>9.4f} "
                 f"{run['tokens_per_s']:>10,.0f} {1000 * run['step_time_s']:>8.1f}  "
                 f"{run['attention_backend']}")
  return "\n".join(lines)
