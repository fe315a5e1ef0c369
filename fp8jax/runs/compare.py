"""`fp8jax compare`: the same run in bf16 and in each FP8 recipe, side by side.

Every run uses the same settings, seed and data (only the recipe differs), in
`<out>/<recipe>/`. The comparison is written to `<out>/compare.json`:

    {"config": {...}, "runs": [{"recipe", "final_loss", "rel_gap_vs_bf16", "val_loss",
                                "tokens_per_s", "step_time_s", "attention_backend"}, ...]}

with `final_loss` the mean training loss over the last 10% of steps and
`rel_gap_vs_bf16 = final_loss / bf16's final_loss - 1`, and drawn as
`<out>/compare.png` (loss curves) and `<out>/fp8_scales.png` (per-layer scales
over the steps of the first FP8 run).
"""
from __future__ import annotations

import json
import pathlib

from fp8jax.runs import plots
from fp8jax.runs.config import RunConfig, RunError
from fp8jax.runs.train import METRICS, RunResult, train

DEFAULT_RECIPES = ("bf16", "delayed", "current")


def compare(config: RunConfig, out_dir, recipes=DEFAULT_RECIPES, progress: bool = True) -> dict:
  """Trains `config` once per recipe and writes the comparison.

  Args:
    config: the shared settings (its `recipe` is replaced by each of `recipes`).
    out_dir: the comparison's directory; each run goes to `<out_dir>/<recipe>`.
    recipes: recipe names; "bf16" first is the baseline (it must be among them).
    progress: progress bars.

  Returns:
    The `compare.json` contents.
  """
  recipes = tuple(recipes)
  if "bf16" not in recipes:
    raise RunError(f"compare needs the bf16 baseline among its recipes, got {recipes}.")
  out_dir = pathlib.Path(out_dir)
  for recipe in recipes:
    existing = out_dir / recipe
    if (existing / "checkpoints").exists():
      raise RunError(f"{str(out_dir)!r} already holds a comparison ({existing.name}/ has "
                     "checkpoints); choose another --out or remove it.")
  results: dict[str, RunResult] = {}
  for recipe in recipes:
    results[recipe] = train(config.replace(recipe=recipe), out_dir / recipe, progress=progress)
  baseline = results["bf16"].final_loss()
  runs = []
  for recipe, result in results.items():
    final = result.final_loss()
    runs.append({"recipe": recipe, "final_loss": final,
                 "rel_gap_vs_bf16": final / baseline - 1.0,
                 "val_loss": result.val_losses[max(result.val_losses)],
                 "tokens_per_s": result.tokens_per_s, "step_time_s": result.step_time_s,
                 "attention_backend": result.attention_backend})
  report = {"config": {k: v for k, v in config.to_dict().items() if k != "recipe"},
            "runs": runs}
  (out_dir / "compare.json").write_text(json.dumps(report, indent=1))
  curves = {recipe: [result.out_dir / METRICS] for recipe, result in results.items()}
  plots.loss_curves(curves, out_dir / "compare.png")
  fp8_runs = [r for r in recipes if r != "bf16"]
  if fp8_runs:
    plots.scale_heatmap(results[fp8_runs[0]].out_dir / METRICS, out_dir / "fp8_scales.png",
                        title=f"FP8 scales per layer and role ({fp8_runs[0]} scaling)")
  return report


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
