"""A run's checkpoints: `<run>/checkpoints/step_NNNNNNN`, written atomically, checked on load.

Each holds the parameters, the optimizer state and the FP8 state
(`fp8jax.checkpoint`), and as metadata the run's settings, the step (the data
position: batches are a function of seed and step) and the corpus's sha256.
"""
from __future__ import annotations

import logging
import os
import pathlib
import shutil

import jax

import fp8jax
import fp8jax.checkpoint  # noqa: F401  (orbax: the "examples" and "checkpoint" extras)
from fp8jax.runs.config import (DATA_FIELDS, MODEL_FIELDS, OPTIMIZER_FIELDS, RunConfig,
                                RunError)
from fp8jax.runs.steps import build, init_state

DIRECTORY = "checkpoints"
KEEP = 3


def complete(run_dir) -> list[pathlib.Path]:
  """The run's complete checkpoints, oldest first."""
  root = pathlib.Path(run_dir) / DIRECTORY
  if not root.is_dir():
    return []
  found = [p for p in root.iterdir() if p.name.startswith("step_") and
           fp8jax.checkpoint.is_complete(p)]
  return sorted(found, key=lambda p: int(p.name.split("_")[1]))


def save(run_dir, step: int, params, opt_state, fp8_state, config: RunConfig,
         corpus) -> pathlib.Path:
  """Writes step `step`'s checkpoint, then removes all but the newest `KEEP`."""
  path = pathlib.Path(run_dir) / DIRECTORY / f"step_{step:07d}"
  fp8jax.checkpoint.save(path, params=params, opt_state=opt_state, fp8_state=fp8_state,
                         overwrite=True, metadata={"step": step, "config": config.to_dict(),
                                                   "corpus_sha256": corpus.description["sha256"]})
  for old in complete(run_dir)[:-KEEP]:
    # Renamed first (atomically) so no reader ever takes a half-deleted checkpoint.
    doomed = old.with_name(".deleting-" + old.name)
    os.rename(old, doomed)
    shutil.rmtree(doomed, onerror=lambda *args: logging.warning("could not remove %s", args[1]))
  return path


def saved_config(path) -> tuple[RunConfig, int]:
  """(settings, step) of an fp8jax run's checkpoint; RunError for anything else."""
  path = pathlib.Path(path)
  try:
    description = fp8jax.checkpoint.read_description(path)
  except (FileNotFoundError, ValueError) as error:
    raise RunError(f"checkpoint {str(path)!r}: {error}") from None
  metadata = description.get("metadata") or {}
  if "config" not in metadata or "step" not in metadata:
    raise RunError(f"checkpoint {str(path)!r} was not written by an fp8jax run (no run "
                   "settings in it); pass a checkpoints/step_* directory of an fp8jax run.")
  return RunConfig.from_dict(metadata["config"]), int(metadata["step"])


def check_same_run(path, config: RunConfig) -> None:
  """Raises RunError unless `config` continues the run that wrote checkpoint `path`: the
  same model, data, optimizer and recipe (the step count and intervals may differ)."""
  saved, _ = saved_config(path)
  for field in MODEL_FIELDS + DATA_FIELDS + OPTIMIZER_FIELDS + ("recipe", "fp8_layers"):
    if getattr(saved, field) != getattr(config, field):
      raise RunError(
          f"checkpoint {str(path)!r} is from a run with {field}={getattr(saved, field)!r}, "
          f"this run has {field}={getattr(config, field)!r}; pass the same "
          f"--{field.replace('_', '-')} (or start another --out directory).")


def restore(path, config: RunConfig, corpus, continuing: bool):
  """(params, opt_state, fp8_state, step) from an fp8jax run's checkpoint for `config`.

  Args:
    path: a checkpoints/step_* directory.
    config: the settings of the run that continues from it.
    corpus: that run's corpus (must be the text the checkpoint trained on).
    continuing: True to continue the same run (`--resume`: every setting but the
      step count and intervals must agree); False to start a new run from it
      (`--init-from`: model and data must agree; a bf16 checkpoint then continues
      in FP8 with fresh FP8 state).

  Raises:
    RunError: a checkpoint that does not fit, named with what differs.
  """
  saved, step = saved_config(path)
  if continuing:
    check_same_run(path, config)
  for field in MODEL_FIELDS + DATA_FIELDS:
    if getattr(saved, field) != getattr(config, field):
      raise RunError(
          f"checkpoint {str(path)!r} is from a run with {field}={getattr(saved, field)!r}, "
          f"this run has {field}={getattr(config, field)!r}; pass the same "
          f"--{field.replace('_', '-')} (or start another --out directory).")
  if saved.recipe_object is not None and config.recipe_object is not None and (
      saved.fp8_layers != config.fp8_layers):
    raise RunError(f"checkpoint {str(path)!r} holds the FP8 state of --fp8-layers "
                   f"{saved.fp8_layers} and this run is --fp8-layers {config.fp8_layers}; pass "
                   f"--fp8-layers {saved.fp8_layers} (or --recipe bf16).")
  if corpus.description["sha256"] != _metadata(path).get("corpus_sha256"):
    raise RunError(f"checkpoint {str(path)!r} was trained on other text than this run's "
                   "corpus (its sha256 differs); pass the same --data.")
  if saved.recipe_object is not None and config.recipe_object is not None and (
      saved.recipe_object != config.recipe_object):
    raise RunError(f"checkpoint {str(path)!r} holds {saved.recipe_object} FP8 state and this "
                   f"run is {config.recipe_object}; continue with --recipe {saved.recipe} and "
                   "its options (or --recipe bf16).")
  model, tx, _ = build(config)
  params, opt_state, _ = jax.eval_shape(lambda: init_state(model, tx, config))
  saved_model, saved_tx, _ = build(saved)
  saved_fp8 = jax.eval_shape(lambda: init_state(saved_model, saved_tx, saved)[2])
  try:
    restored = fp8jax.checkpoint.restore(path, params=params, opt_state=opt_state,
                                         fp8_state=saved_fp8)
  except fp8jax.checkpoint.CheckpointCorrupted as error:
    raise RunError(" ".join(str(error).split())) from None
  except ValueError as error:
    text = str(error).splitlines()[0]
    raise RunError(f"checkpoint {str(path)!r} does not fit this run's {config.size} model: "
                   f"{text}") from None
  if config.recipe_object is None:
    fp8_state = {}
  elif saved.recipe_object is None:
    fp8_state = init_state(model, tx, config)[2]
  else:
    fp8_state = restored["fp8_state"]
  return restored["params"], restored["opt_state"], fp8_state, step


def _metadata(path) -> dict:
  return fp8jax.checkpoint.read_description(path).get("metadata") or {}
