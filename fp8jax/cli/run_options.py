"""The options of the run subcommands (train, compare), and their one-line errors.

Every option defaults to "not given": a new run takes `RunConfig`'s defaults
(the CPU demo) for what is not given; a resumed run takes the settings it was
started with, so `fp8jax train --resume --out DIR` alone continues it exactly.
"""
from __future__ import annotations

import dataclasses
import sys

from fp8jax.cli.errors import report_user_errors

# option -> (RunConfig field, type, help)
OPTIONS = {
    "--size": ("size", str, "model size: tiny (CPU default), small, 125m, 350m, 1b"),
    "--steps": ("steps", int, "train until this step (default 250)"),
    "--batch": ("batch", int, "sequences per step (default 16)"),
    "--seq": ("seq", int, "tokens per sequence (default 128)"),
    "--seed": ("seed", int, "initialization and batch order (default 0)"),
    "--lr": ("lr", float, "peak learning rate of AdamW (default 3e-3)"),
    "--eval-every": ("eval_every", int, "validation every N steps (default 100)"),
    "--checkpoint-every": ("checkpoint_every", int, "checkpoint every N steps (default 100)"),
    "--data": ("data", str, "train on this text file instead of the standard library's source"),
    "--optimizer": ("optimizer", str, "adamw (float32 moments, default) or adamw_fp8 (FP8 "
                    "moments, fp8jax.optim)"),
    "--saved-activations": ("saved_activations", str, "what the backward keeps of the norms, "
                            "GELU and attention output: default, or fp8 (E4M3, 1x128 scales)"),
    "--experts": ("experts", int, "make each block's MLP a dropless mixture of N experts, "
                  "FP8 expert GEMMs under an FP8 recipe (default 0: the dense MLP)"),
    "--top-k": ("top_k", int, "with --experts, the experts each token is routed to "
                "(default 2)"),
    "--fp8-layers": ("fp8_layers", str, "under an FP8 recipe, the projections in FP8: all "
                     "(default), or auto: where the cost model predicts FP8 no slower than "
                     "bf16 on an H100 (none at the tiny and small sizes)"),
}


def add_run_options(parser, default_out: str) -> None:
  """The `RunConfig` settings as options, and --out."""
  for flag, (field, kind, help_text) in OPTIONS.items():
    parser.add_argument(flag, dest=field, type=kind, default=None,
                        metavar=field.upper() if flag != "--data" else "PATH", help=help_text)
  parser.add_argument("--out", default=default_out, help=f"output directory (default {default_out})")


def config_from(args, recipe: str | None, base=None):
  """The `RunConfig` the options describe: given options over `base` (a saved run's
  settings) or over the defaults."""
  from fp8jax.runs import RunConfig, RunError

  given = {field: getattr(args, field) for field, _, _ in OPTIONS.values()
           if getattr(args, field, None) is not None}
  if recipe is not None:
    given["recipe"] = recipe
  config = RunConfig(**given) if base is None else dataclasses.replace(base, **given)
  if "top_k" in given and not config.experts:
    raise RunError(f"--top-k {given['top_k']} routes tokens among experts, and this run's "
                   "MLP is dense; add --experts N (N >= --top-k).")
  return config


def run_guarded(work, resume_hint: str) -> int:
  """Runs `work()`; user errors become one line on stderr (status 2), Ctrl-C status 130.

  `resume_hint` is the command that continues after Ctrl-C.
  """
  from fp8jax.runs import RunInterrupted

  try:
    return report_user_errors(work)
  except RunInterrupted as stop:
    where = f"{stop.checkpoint}" if stop.checkpoint else "none yet"
    print(f"\nfp8jax: interrupted after step {stop.step}; the newest complete checkpoint "
          f"({where}) is loadable; continue with: {resume_hint}", file=sys.stderr)
    return 130
  except KeyboardInterrupt:
    print("\nfp8jax: interrupted before training started; nothing was written.",
          file=sys.stderr)
    return 130
