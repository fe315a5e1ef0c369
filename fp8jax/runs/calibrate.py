"""`fp8jax calibrate`: FP8 state for a bf16 checkpoint, so FP8 training starts without a spike.

A bf16 run has no FP8 state. Continuing it in FP8 from fresh state would start every
scale at 1 (small gradients flush to zero, large activations saturate); `fp8jax train
--init-from` therefore calibrates a fresh state on its first batch (one history entry).
This command fills more of the history ahead: it runs `steps` calibration steps
(`fp8jax.calibrate`: forward and backward with every tensor scaled from itself, the
parameters and the optimizer state not touched) on the run's next training batches,
each closed as training would, and saves a checkpoint with the same parameters,
optimizer state and step, and the filled FP8 state.
"""
from __future__ import annotations

import importlib.util
import json
import pathlib

import jax.numpy as jnp

from fp8jax.data import corpus as corpus_lib
from fp8jax.runs import checkpoints
from fp8jax.runs.config import RunError
from fp8jax.runs.steps import calibration_step
from fp8jax.runs.train import load_corpus


def calibrate(checkpoint, out_dir, recipe: str = "delayed", steps: int = 16,
              progress: bool = True) -> pathlib.Path:
  """Writes `<out_dir>/checkpoints/step_N`: `checkpoint` plus calibrated FP8 state.

  Args:
    checkpoint: a checkpoints/step_* directory of a bf16 fp8jax run.
    out_dir: the run directory of the FP8 continuation (`fp8jax train --resume`
      there continues it).
    recipe: the FP8 recipe to calibrate for ("delayed" or "current").
    steps: calibration steps (fills up to that many history entries).
    progress: show progress.

  Returns:
    The new checkpoint's path.
  """
  checkpoint = pathlib.Path(checkpoint)
  if recipe == "bf16":
    raise RunError("--recipe bf16 has no FP8 state to calibrate; pick an FP8 recipe.")
  if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
    raise RunError(f"--steps {steps!r} must be a positive integer.")
  saved, _ = checkpoints.saved_config(checkpoint)
  if saved.recipe != "bf16":
    raise RunError(f"checkpoint {str(checkpoint)!r} is from a {saved.recipe} run, which has "
                   "FP8 state already; calibrate a bf16 run's checkpoint.")
  config = saved.replace(recipe=recipe)
  out_dir = pathlib.Path(out_dir)
  if out_dir.exists() and not out_dir.is_dir():
    raise RunError(f"--out {str(out_dir)!r} is a file; pass a directory.")
  if (out_dir / checkpoints.DIRECTORY).exists():
    raise RunError(f"{str(out_dir)!r} already holds checkpoints; choose another --out.")
  corpus = load_corpus(config)
  params, opt_state, fp8_state, step = checkpoints.restore(checkpoint, config, corpus,
                                                           continuing=False)
  # The training step's own forward and backward, without its parameter update.
  step_fn = calibration_step(config)
  iterator = range(steps)
  if progress and importlib.util.find_spec("tqdm") is not None:
    from tqdm import tqdm  # optional (the 'examples' extra): only for a progress bar
    iterator = tqdm(iterator, desc="calibrate", unit="step")
  for i in iterator:
    batch = jnp.asarray(corpus_lib.train_batch(corpus.train, step + 1 + i, config.batch,
                                               config.seq, config.seed))
    fp8_state = step_fn(params, fp8_state, batch)
  out_dir.mkdir(parents=True, exist_ok=True)
  path = checkpoints.save(out_dir, step, params, opt_state, fp8_state, config, corpus)
  (out_dir / "calibration.json").write_text(json.dumps(
      {"from": str(checkpoint.name), "recipe": recipe, "steps": steps, "step": step,
       "config": config.to_dict()}, indent=1))
  return path
