"""`fp8jax compare`: the demo GPT trained in bf16 and in each FP8 recipe, side by side."""
from __future__ import annotations

from fp8jax.cli.runs import add_run_options, config_from, run_guarded


def add_parser(commands) -> None:
  parser = commands.add_parser(
      "compare", help="train the demo GPT in bf16 and in FP8 (delayed, current) and compare",
      description="Train the byte-level GPT with the same seed and data in bf16 and in each "
                  "FP8 recipe; print a table and write compare.json, compare.png and "
                  "fp8_scales.png to --out.")
  add_run_options(parser, default_out="out/compare")
  parser.add_argument("--recipes", default="bf16,delayed,current",
                      help="comma-separated recipes, bf16 first (default bf16,delayed,current)")


def run(args) -> int:
  from fp8jax import runs

  def work():
    recipes = tuple(r.strip() for r in args.recipes.split(",") if r.strip())
    for recipe in recipes:
      if recipe not in runs.RECIPES:
        raise runs.RunError(f"--recipes: {recipe!r} is not one of {sorted(runs.RECIPES)}.")
    config = config_from(args, recipe=recipes[0] if recipes else "bf16")
    report = runs.compare(config, args.out, recipes=recipes)
    print(runs.table(report))
    print(f"wrote {args.out}/compare.json, {args.out}/compare.png, {args.out}/fp8_scales.png")
    return 0

  return run_guarded(work)
