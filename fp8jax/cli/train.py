"""`fp8jax train`: one training run of the demo GPT (bf16 or an FP8 recipe)."""
from __future__ import annotations

from fp8jax.cli.run_options import add_run_options, config_from, run_guarded


def add_parser(commands) -> None:
  parser = commands.add_parser(
      "train", help="train the demo GPT with one recipe (progress, metrics, checkpoints)",
      description="Train the byte-level GPT on the embedded corpus (the Python standard "
                  "library's source) or --data; writes metrics.jsonl, checkpoints and run.json "
                  "to --out. With --resume, settings not given are the run's own.")
  add_run_options(parser, default_out="out/train")
  parser.add_argument("--recipe", default=None,
                      help="bf16, delayed, current, rowwise, block, mxfp8, mxfp8_round_up "
                           "or nvfp4 (default: delayed)")
  start = parser.add_mutually_exclusive_group()
  start.add_argument("--resume", action="store_true",
                     help="continue the run in --out from its newest complete checkpoint")
  start.add_argument("--init-from", metavar="CHECKPOINT",
                     help="start from another run's checkpoint (e.g. a bf16 run's, to continue "
                          "in FP8; with fresh FP8 state unless it was calibrated)")


def run(args) -> int:
  from fp8jax import runs
  from fp8jax.runs import checkpoints

  def work():
    if args.resume:
      found = checkpoints.complete(args.out)
      base = checkpoints.saved_config(found[-1])[0] if found else None
      config = config_from(args, args.recipe, base=base)
    else:
      config = config_from(args, args.recipe or "delayed")
    result = runs.train(config, args.out, resume=args.resume, init_from=args.init_from)
    val = result.val_losses[max(result.val_losses)] if result.val_losses else float("nan")
    print(f"{config.recipe}: final loss {result.final_loss():.4f} (mean of the last 10% of "
          f"steps), validation loss {val:.4f}, {result.tokens_per_s:,.0f} tokens/s, "
          f"attention: {result.attention_backend}")
    print(f"wrote {args.out}/metrics.jsonl, {args.out}/run.json, checkpoint "
          f"{result.checkpoint}")
    return 0

  return run_guarded(work, resume_hint=f"fp8jax train --resume --out {args.out}")
