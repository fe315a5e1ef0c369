"""`fp8jax compare` over several seeds, recorded in one JSON: how far FP8 lands from bf16.

    python examples/compare_seeds.py --out examples/results/compare_cpu_3_seeds.json \\
        --table examples/results/compare_cpu.json          # the README's record
    python examples/compare_seeds.py --experts 4 --top-k 2 \\
        --out examples/results/compare_moe_cpu_3_seeds.json

Each seed is the command a user runs, `fp8jax compare --seed S --out RUNS/seed_S` followed
by the options given here that this script does not take itself (e.g. `--experts 4
--top-k 2`), in a process of its own, so `wall_s` is what the user waits (compiles
included). The JSON holds:

    command, machine (compare.json's: the processor, its cores and instruction sets),
    wall_s {seed: s}, config (compare.json's settings but the seed, which is each key
    of seeds), seeds {seed: compare.json's runs}, versions and corpus (compare.json's),
    <recipe>_rel_gap_vs_bf16_mean / _max   over the seeds, each seed's gap against its own
                                           bf16 run (final_loss / bf16's - 1),
    <recipe>_final_loss_mean, <recipe>_final_loss_spread [min, max] over the seeds
                                           (bf16's too),
    <recipe>_within_bf16_seed_spread       |recipe's mean - bf16's mean| <= bf16's max - min

where a final loss is the mean training loss over the last 10% of the steps. `--table
PATH` also keeps the first seed's compare.json there (the table `fp8jax compare` prints,
`fp8jax.runs.table`) and its loss curves beside it (PATH with .png).
"""
from __future__ import annotations

import argparse
import json
import pathlib
import shutil
import subprocess
import sys
import time

import numpy as np


def summarize(seeds: dict) -> dict:
  """The comparisons over the seeds of `{seed: compare.json runs}` (see the module)."""
  finals = {}
  for runs in seeds.values():
    for run in runs:
      finals.setdefault(run["recipe"], []).append(run["final_loss"])
  bf16 = finals["bf16"]
  summary = {"bf16_final_loss_spread": [min(bf16), max(bf16)],
             "bf16_final_loss_mean": float(np.mean(bf16))}
  for recipe, losses in finals.items():
    if recipe == "bf16":
      continue
    gaps = [next(r["rel_gap_vs_bf16"] for r in runs if r["recipe"] == recipe)
            for runs in seeds.values()]
    summary[f"{recipe}_rel_gap_vs_bf16_mean"] = float(np.mean(gaps))
    summary[f"{recipe}_rel_gap_vs_bf16_max"] = max(gaps)
    summary[f"{recipe}_final_loss_mean"] = float(np.mean(losses))
    summary[f"{recipe}_final_loss_spread"] = [min(losses), max(losses)]
    summary[f"{recipe}_within_bf16_seed_spread"] = bool(
        abs(np.mean(losses) - np.mean(bf16)) <= max(bf16) - min(bf16))
  return summary


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
  parser.add_argument("--runs", default="out/compare_seeds",
                      help="directory of the comparisons (one per seed, seed_S)")
  parser.add_argument("--out", required=True, help="the JSON to write")
  parser.add_argument("--table", default=None,
                      help="also copy the first seed's compare.json (and compare.png) here")
  args, compare_options = parser.parse_known_args(argv)
  taken = [option for option in compare_options if option.split("=")[0] in ("--seed", "--out")]
  if taken:
    parser.error(f"{taken[0]} is this script's to set (--seeds, --runs); drop it.")

  wall, seeds, report = {}, {}, None
  for seed in args.seeds:
    run_dir = pathlib.Path(args.runs) / f"seed_{seed}"
    command = [sys.executable, "-m", "fp8jax.cli", "compare", "--seed", str(seed), "--out",
               str(run_dir), *compare_options]
    began = time.perf_counter()
    subprocess.run(command, check=True)
    wall[str(seed)] = round(time.perf_counter() - began)
    report = json.loads((run_dir / "compare.json").read_text())
    seeds[str(seed)] = report["runs"]
    print(f"seed {seed}: {wall[str(seed)]} s", file=sys.stderr)

  shown = " ".join(compare_options + ["--seed", "S"])
  record = {"command": f"fp8jax compare {shown} (S = {', '.join(map(str, args.seeds))}), "
                       "defaults otherwise",
            "machine": report["machine"], "wall_s": wall,
            "config": {k: v for k, v in report["config"].items() if k != "seed"},
            "seeds": seeds, **summarize(seeds), "versions": report["versions"],
            "corpus": report["corpus"]}
  pathlib.Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
  if args.table:
    first = pathlib.Path(args.runs) / f"seed_{args.seeds[0]}"
    table = pathlib.Path(args.table)
    shutil.copyfile(first / "compare.json", table)
    shutil.copyfile(first / "compare.png", table.with_suffix(".png"))
  print(f"wrote {args.out}")
  return record


if __name__ == "__main__":
  main()
