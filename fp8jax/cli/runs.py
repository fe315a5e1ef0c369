"""Options and error handling the run subcommands (train, compare) share."""
from __future__ import annotations

import sys


def add_run_options(parser, default_out: str) -> None:
  """The settings of `fp8jax.runs.RunConfig` as options (defaults: the CPU demo)."""
  parser.add_argument("--size", default="tiny",
                      help="model size: tiny (CPU default), small, 125m, 350m, 1b")
  parser.add_argument("--steps", type=int, default=250, help="training steps (default 250)")
  parser.add_argument("--batch", type=int, default=16, help="sequences per step (default 16)")
  parser.add_argument("--seq", type=int, default=128, help="tokens per sequence (default 128)")
  parser.add_argument("--seed", type=int, default=0, help="initialization and batch order")
  parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (AdamW)")
  parser.add_argument("--eval-every", type=int, default=100, help="validation every N steps")
  parser.add_argument("--checkpoint-every", type=int, default=100,
                      help="checkpoint every N steps (and at the end)")
  parser.add_argument("--data", metavar="PATH",
                      help="train on this text file instead of the standard library's source")
  parser.add_argument("--out", default=default_out, help=f"output directory (default {default_out})")


def config_from(args, recipe: str):
  """The `RunConfig` the options describe."""
  from fp8jax.runs import RunConfig

  return RunConfig(recipe=recipe, size=args.size, steps=args.steps, batch=args.batch,
                   seq=args.seq, seed=args.seed, lr=args.lr, eval_every=args.eval_every,
                   checkpoint_every=args.checkpoint_every, data=args.data)


def run_guarded(work) -> int:
  """Runs `work()`; a user error becomes one line on stderr, Ctrl-C a message and status 130."""
  from fp8jax.data.corpus import CorpusError
  from fp8jax.runs import RunError, RunInterrupted

  try:
    return work()
  except (RunError, CorpusError) as error:
    print(f"fp8jax: {error}", file=sys.stderr)
    return 2
  except RunInterrupted as stop:
    where = f"{stop.checkpoint}" if stop.checkpoint else "none yet"
    print(f"\nfp8jax: interrupted after step {stop.step}; the newest complete checkpoint "
          f"({where}) is loadable: continue with --resume.", file=sys.stderr)
    return 130
