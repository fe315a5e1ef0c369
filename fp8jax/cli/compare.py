"""`fp8jax compare`: the demo GPT trained in bf16 and in each FP8 recipe, side by side."""
from __future__ import annotations

import sys

from fp8jax.cli.run_options import add_run_options, config_from, run_guarded


def add_parser(commands) -> None:
  parser = commands.add_parser(
      "compare", help="train the demo GPT in bf16 and in FP8 (delayed, current) and compare",
      description="Train the byte-level GPT with the same seed and data in bf16 and in each "
                  "FP8 recipe; print a table and write compare.json, compare.png and "
                  "fp8_scales.png to --out.")
  add_run_options(parser, default_out="out/compare")
  parser.add_argument("--recipes", default="bf16,delayed,current",
                      help="comma-separated recipes, bf16 among them (default "
                           "bf16,delayed,current)")
  parser.add_argument("--resume", action="store_true",
                      help="continue an interrupted comparison in --out")


def run(args) -> int:
  from fp8jax import runs
  from fp8jax.runs import checkpoints

  def work():
    recipes = tuple(r.strip() for r in args.recipes.split(",") if r.strip())
    for recipe in recipes:
      runs.config.base_recipe(recipe, "--recipes: ")  # a RunError for an unknown name
    base = None
    if args.resume:
      found = [c for r in recipes for c in checkpoints.complete(f"{args.out}/{r}")[-1:]]
      base = checkpoints.saved_config(found[0])[0] if found else None
      if not found:
        print(f"fp8jax: --resume: {args.out!r} holds no comparison yet; starting one.",
              file=sys.stderr)
    config = config_from(args, "bf16", base=base)
    report = runs.compare(config, args.out, recipes=recipes, resume=args.resume)
    print(runs.table(report))
    print(f"on {runs.machine.summary(report['machine'])}, corpus sha256 "
          f"{report['corpus']['sha256'][:12]}")
    print(f"wrote {', '.join(f'{args.out}/{name}' for name in report['files'])}")
    return 0

  return run_guarded(work, resume_hint=f"fp8jax compare --resume --out {args.out}")
