"""`fp8jax train`: one training run of the demo GPT (bf16 or an FP8 recipe)."""
from __future__ import annotations

from fp8jax.cli.runs import add_run_options, config_from, run_guarded


def add_parser(commands) -> None:
  parser = commands.add_parser(
      "train", help="train the demo GPT with one recipe (progress, metrics, checkpoints)",
      description="Train the byte-level GPT on the embedded corpus (the Python standard "
                  "library's source) or --data; writes metrics.jsonl, checkpoints and run.json "
                  "to --out.")
  add_run_options(parser, default_out="out/train")
  parser.add_argument("--recipe", default="delayed",
                      help="bf16, delayed or current (default: delayed)")
  start = parser.add_mutually_exclusive_group()
  start.add_argument("--resume", action="store_true",
                     help="continue from the newest complete checkpoint in --out")
  start.add_argument("--init-from", metavar="CHECKPOINT",
                     help="start from another run's checkpoint (e.g. a bf16 run's, to continue "
                          "in FP8; with fresh FP8 state unless it was calibrated)")


def run(args) -> int:
  from fp8jax import runs

  def work():
    config = config_from(args, recipe=args.recipe)
    result = runs.train(config, args.out, resume=args.resume, init_from=args.init_from)
    val = result.val_losses[max(result.val_losses)]
    print(f"{config.recipe}: final loss {result.final_loss():.4f} (mean of the last 10% of "
          f"steps), validation loss {val:.4f}, {result.tokens_per_s:,.0f} tokens/s, "
          f"attention: {result.attention_backend}")
    print(f"wrote {args.out}/metrics.jsonl, {args.out}/run.json, checkpoint "
          f"{result.checkpoint}")
    return 0

  return run_guarded(work)


