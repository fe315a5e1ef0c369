"""What FP8 memory costs in accuracy: the demo GPT on several seeds with FP8 Adam moments and
FP8 saved activations, beside bf16 and plain FP8.

    python examples/fp8_memory_accuracy.py                      # tiny, 250 steps, seeds 0 1 2
    python examples/fp8_memory_accuracy.py --size small --steps 600 --seeds 0 \\
        --variants delayed "delayed, FP8 moments" --out out/small

Each variant is `fp8jax train` with the same settings, seed and data but for the recipe,
`--optimizer` and `--saved-activations`. The JSON (default
`examples/results/fp8_memory_3_seeds.json`) holds per variant and seed the final loss (the
mean training loss over the last 10% of steps) and the last validation loss, the mean over
seeds, the gap to bf16 of the same seed, whether the variant's mean is within bf16's seed
spread of bf16's mean (|mean - bf16 mean| <= bf16's max - min over the seeds), what the
variant keeps per token and layer for the backward of the non-GEMM ops and in optimizer
state per parameter, and the machine, versions and corpus the runs had (a CPU's numbers
depend on its processor). `--summarize JSON` recomputes those comparisons in a written file.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys

import numpy as np

VARIANTS = {
    "bf16": dict(recipe="bf16"),
    "delayed": dict(recipe="delayed"),
    "delayed, FP8 moments": dict(recipe="delayed", optimizer="adamw_fp8"),
    "delayed, FP8 saved activations": dict(recipe="delayed", saved_activations="fp8"),
    "delayed, FP8 moments + saved activations": dict(recipe="delayed", optimizer="adamw_fp8",
                                                     saved_activations="fp8"),
    "bf16, FP8 moments": dict(recipe="bf16", optimizer="adamw_fp8"),
}
DEFAULT_OUT = pathlib.Path(__file__).resolve().parent / "results" / "fp8_memory_3_seeds.json"


def kept_bytes(d_model: int, d_ff: int, saved_activations: str) -> float:
  """Bytes per token and layer the backward keeps for the two RMSNorms, the GELU and
  attention's output (`fp8jax.ops.saved_activations`; the GEMM inputs, FP8 either way,
  are not counted): autodiff keeps 3 float32 tensors per norm, 5 bf16 ones for the GELU
  and a bf16 output; FP8 keeps 1 byte per element and a float32 scale per 128, plus
  each norm's float32 row factor."""
  if saved_activations == "default":
    return 2 * 12 * d_model + 5 * 2 * d_ff + 2 * d_model
  group = lambda n: n + 4 * -(-n // 128)
  return 2 * (group(d_model) + 4) + group(d_ff) + group(d_model)


def optimizer_bytes(optimizer: str) -> float:
  """Adam's two moments per parameter of a large leaf: 4 + 4 bytes, or 1 + 1 with two
  float32 per 128-element block each (`fp8jax.optim`)."""
  return 8.0 if optimizer == "adamw" else 2 * (1 + 8 / 128)


def summarize(variants: dict) -> None:
  """Adds, in place, each run's gap to bf16 of its seed and each variant's comparison of
  its mean with bf16's mean against bf16's seed spread (needs a "bf16" variant)."""
  if "bf16" not in variants:
    return
  bf16 = {r["seed"]: r["final_loss"] for r in variants["bf16"]["runs"]}
  low, high = min(bf16.values()), max(bf16.values())
  bf16_mean = float(np.mean(list(bf16.values())))
  variants["bf16"]["seed_spread"] = [low, high]
  for entry in variants.values():
    for run in entry["runs"]:
      run["rel_gap_vs_bf16"] = run["final_loss"] / bf16[run["seed"]] - 1.0
    entry["mean_gap_vs_bf16"] = entry["mean_final_loss"] - bf16_mean
    entry["within_bf16_seed_spread"] = bool(abs(entry["mean_gap_vs_bf16"]) <= high - low)


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--size", default="tiny")
  parser.add_argument("--steps", type=int, default=250)
  parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
  parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
  parser.add_argument("--runs", default="out/fp8_memory", help="directory of the runs")
  parser.add_argument("--out", default=str(DEFAULT_OUT), help="the JSON to write")
  parser.add_argument("--summarize", metavar="JSON", default=None,
                      help="only recompute the comparisons of an existing JSON, in place")
  args = parser.parse_args(argv)
  if args.summarize:
    report = json.loads(pathlib.Path(args.summarize).read_text())
    summarize(report["variants"])
    pathlib.Path(args.summarize).write_text(json.dumps(report, indent=1) + "\n")
    return report

  from fp8jax.models import gpt
  from fp8jax.runs import RunConfig, machine, train
  from fp8jax.runs.compare import recorded_corpus, versions

  results = {}
  for name in args.variants:
    settings = VARIANTS[name]
    runs = []
    for seed in args.seeds:
      config = RunConfig(size=args.size, steps=args.steps, seed=seed, **settings)
      run_dir = pathlib.Path(args.runs) / args.size / name.replace(", ", "_").replace(
          " + ", "_").replace(" ", "_") / f"seed_{seed}"
      result = train(config, run_dir, progress=f"{name[:24]} s{seed}")
      runs.append({"seed": seed, "final_loss": result.final_loss(),
                   "val_loss": result.val_losses[max(result.val_losses)],
                   "step_time_s": result.step_time_s})
      print(f"{name}, seed {seed}: final loss {result.final_loss():.4f}", file=sys.stderr)
    config = gpt.config_for(args.size)
    results[name] = {"settings": settings, "runs": runs,
                     "mean_final_loss": float(np.mean([r["final_loss"] for r in runs])),
                     "kept_bytes_per_token_per_layer": kept_bytes(
                         config.d_model, config.d_ff, settings.get("saved_activations",
                                                                   "default")),
                     "optimizer_state_bytes_per_parameter": optimizer_bytes(
                         settings.get("optimizer", "adamw"))}
  summarize(results)
  report = {"size": args.size, "steps": args.steps, "seeds": args.seeds, "variants": results,
            "machine": machine.describe(), "versions": versions(),
            "corpus": recorded_corpus(run_dir)}
  pathlib.Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
  print(f"wrote {args.out}")
  return report


if __name__ == "__main__":
  main()
