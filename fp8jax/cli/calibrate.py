"""`fp8jax calibrate CKPT`: FP8 state for a bf16 checkpoint, ready for FP8 training."""
from __future__ import annotations

from fp8jax.cli.run_options import run_guarded


def add_parser(commands) -> None:
  parser = commands.add_parser(
      "calibrate", help="fill the FP8 amax histories of a bf16 checkpoint (no weight change)",
      description="Run forward and backward passes that only record amaxes on a bf16 run's "
                  "checkpoint, and save it with FP8 state in --out; continue there with "
                  "'fp8jax train --resume --out OUT --recipe RECIPE'.")
  parser.add_argument("checkpoint", metavar="CKPT", help="a checkpoints/step_* directory")
  parser.add_argument("--out", required=True, help="directory of the FP8 continuation")
  parser.add_argument("--recipe", default="delayed", help="FP8 recipe (default delayed)")
  parser.add_argument("--steps", type=int, default=16, help="calibration steps (default 16)")


def run(args) -> int:
  from fp8jax import runs

  def work():
    path = runs.calibrate(args.checkpoint, args.out, recipe=args.recipe, steps=args.steps)
    print(f"wrote {path}: the parameters and optimizer state of {args.checkpoint} with "
          f"{args.steps} steps of calibrated {args.recipe} FP8 state; continue with: fp8jax "
          f"train --resume --out {args.out} --steps N")
    return 0

  return run_guarded(work, resume_hint=f"fp8jax calibrate {args.checkpoint} --out {args.out}")
