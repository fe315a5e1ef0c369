"""One demo training run: the GPT on the embedded corpus, with checkpoints, metrics and resume.

    result = train(RunConfig(recipe="delayed"), "out/delayed")

writes into the run directory:

* `metrics.jsonl`: one line per step (`step`, `loss`, `lr`, `grad_norm`,
  `step_time_s`, `tokens_per_s`, and per FP8 layer and role its `amax` and
  `scale`), plus a line per evaluation (`val_loss`);
* `checkpoints/step_NNNNNNN`: params, optimizer state and FP8 state
  (`fp8jax.checkpoint`), with the run's settings and the step (the data
  position: batches are a function of seed and step) as metadata;
* `run.json`: the settings, the corpus, the attention backend, and the results.

`resume=True` continues from the newest complete checkpoint and gives exactly the
losses an uninterrupted run gives (same batches, same compiled step). A Ctrl-C
stops between steps: the newest complete checkpoint stays loadable (saves are
atomic) and `RunInterrupted` says which it is.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import pathlib
import shutil
import statistics
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import fp8jax
import fp8jax.checkpoint  # noqa: F401  (orbax: the "examples" and "checkpoint" extras)
from fp8jax.data import corpus as corpus_lib
from fp8jax.runs.config import DATA_FIELDS, MODEL_FIELDS, RunConfig, RunError

CHECKPOINTS = "checkpoints"
METRICS = "metrics.jsonl"
KEEP_CHECKPOINTS = 3


class RunInterrupted(Exception):
  """Ctrl-C during a run; `step` is the last finished step, `checkpoint` the newest saved."""

  def __init__(self, step: int, checkpoint: pathlib.Path | None):
    super().__init__(f"interrupted after step {step}; newest complete checkpoint: "
                     f"{checkpoint if checkpoint else 'none'}")
    self.step, self.checkpoint = step, checkpoint


@dataclasses.dataclass
class RunResult:
  """What a finished run measured.

  Attributes:
    config: the settings.
    out_dir: the run directory.
    losses: training loss of every step, in order (index 0 is step 1).
    val_losses: {step: validation loss}.
    tokens_per_s: training tokens per second, steps after the first (compile) one.
    step_time_s: median wall time of a step, the first one excluded.
    attention_backend: the attention backend the model used.
    checkpoint: the final checkpoint.
  """

  config: RunConfig
  out_dir: pathlib.Path
  losses: list
  val_losses: dict
  tokens_per_s: float
  step_time_s: float
  attention_backend: str
  checkpoint: pathlib.Path

  def final_loss(self) -> float:
    """Mean training loss over the last 10% of steps (at least one)."""
    tail = max(1, len(self.losses) // 10)
    return float(np.mean(self.losses[-tail:]))


def load_corpus(config: RunConfig) -> corpus_lib.Corpus:
  """The run's text: the standard library's source, or `config.data`."""
  if config.data is None:
    return corpus_lib.stdlib_corpus(max_bytes=config.max_data_bytes)
  return corpus_lib.text_file_corpus(config.data, max_bytes=config.max_data_bytes)


def build(config: RunConfig):
  """(model, optimizer, learning-rate schedule) of a run."""
  return _build(config.recipe, config.size, config.seq, config.lr, config.warmup_steps,
                config.weight_decay, config.steps)[:3]


def compiled_steps(config: RunConfig):
  """(train_step, eval_step) of a run, shared by runs whose model and optimizer agree
  (so a resumed or compared run reuses the compiled programs)."""
  return _build(config.recipe, config.size, config.seq, config.lr, config.warmup_steps,
                config.weight_decay, config.steps)[3:]


@functools.lru_cache(maxsize=8)
def _build(recipe, size, seq, lr, warmup_steps, weight_decay, steps):
  from fp8jax.models import gpt
  config = RunConfig(recipe=recipe, size=size, seq=seq, lr=lr, warmup_steps=warmup_steps,
                     weight_decay=weight_decay, steps=steps)
  model = gpt.Gpt(gpt.config_for(config.size, seq_len=config.seq), recipe=config.recipe_object)
  schedule = optax.warmup_cosine_decay_schedule(
      config.lr / max(config.warmup_steps, 1), config.lr, max(config.warmup_steps, 1), max(config.steps, config.warmup_steps + 1),
      end_value=config.lr / 10)
  tx = optax.chain(optax.clip_by_global_norm(1.0),
                   optax.adamw(schedule, b2=0.95, weight_decay=config.weight_decay))
  fp8 = config.recipe_object is not None
  return model, tx, schedule, make_train_step(model, tx, fp8), make_eval_step(model, fp8)


def init_state(model, tx, config: RunConfig):
  """(params, opt_state, fp8_state) of a fresh run."""
  tokens = jnp.zeros((1, config.seq), jnp.int32)
  variables = model.init(jax.random.key(config.seed), tokens)
  params = variables["params"]
  return params, tx.init(params), variables.get("fp8_meta", {})


def make_train_step(model, tx, fp8: bool):
  """The jitted `(params, opt_state, fp8_state, tokens) -> (..., loss, grad_norm)`."""

  def loss_fn(params, fp8_state, tokens):
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    if fp8:
      logits, updates = model.apply({"params": params, "fp8_meta": fp8_state}, inputs,
                                    mutable=["fp8_meta"])
      fp8_state = updates["fp8_meta"]
    else:
      logits = model.apply({"params": params}, inputs)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()
    return loss, fp8_state

  @jax.jit
  def train_step(params, opt_state, fp8_state, tokens):
    loss, grads, fp8_state = fp8jax.value_and_grad(loss_fn)(params, fp8_state, tokens)
    updates, opt_state = tx.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state, fp8_state, loss,
            optax.global_norm(grads))

  return train_step


def make_eval_step(model, fp8: bool):
  """The jitted validation loss of one batch (FP8 state used, not updated)."""

  @jax.jit
  def eval_step(params, fp8_state, tokens):
    variables = {"params": params, "fp8_meta": fp8_state} if fp8 else {"params": params}
    logits = model.apply(variables, tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

  return eval_step


def fp8_records(fp8_state) -> dict:
  """{"<layer path>.<role>": {"amax": [...], "scale": [...]}} of a closed step's FP8 state.

  For metas stacked over layers (scanned blocks) the lists have one entry per layer.
  """
  records = {}
  metas = jax.tree_util.tree_leaves_with_path(
      fp8_state, is_leaf=lambda n: isinstance(n, fp8jax.Fp8Meta))
  for path, meta in jax.device_get(metas):
    records[_path_name(path)] = {"amax": np.ravel(meta.amax_history[..., 0]).tolist(),
                     "scale": np.ravel(meta.scale).tolist()}
  return records


def _path_name(path) -> str:
  """'blocks/attention/attention_meta/q' for a tree path of dict keys and attributes."""
  parts = []
  for key in path:
    for attribute in ("key", "name", "idx"):
      if hasattr(key, attribute):
        parts.append(str(getattr(key, attribute)))
        break
  return "/".join(parts)


def checkpoint_dirs(out_dir: pathlib.Path) -> list[pathlib.Path]:
  """The run's complete checkpoints, oldest first."""
  root = pathlib.Path(out_dir) / CHECKPOINTS
  if not root.is_dir():
    return []
  found = [p for p in root.iterdir() if p.name.startswith("step_") and
           fp8jax.checkpoint.is_complete(p)]
  return sorted(found, key=lambda p: int(p.name.split("_")[1]))


def save_checkpoint(out_dir, step, params, opt_state, fp8_state, config, corpus) -> pathlib.Path:
  path = pathlib.Path(out_dir) / CHECKPOINTS / f"step_{step:07d}"
  fp8jax.checkpoint.save(path, params=params, opt_state=opt_state, fp8_state=fp8_state,
                         overwrite=True, metadata={"step": step, "config": config.to_dict(),
                                                   "corpus_sha256": corpus.description["sha256"]})
  for old in checkpoint_dirs(out_dir)[:-KEEP_CHECKPOINTS]:
    shutil.rmtree(old, ignore_errors=True)
  return path


def restore_checkpoint(path, model, tx, config: RunConfig, corpus):
  """(params, opt_state, fp8_state, step) from an fp8jax run's checkpoint, checked
  against `config`.

  A bf16 checkpoint continues in FP8 with fresh FP8 state (or calibrated state,
  see `fp8jax.runs.calibrate`); an FP8 checkpoint continues with its own state
  under its own recipe, or drops it to continue in bf16.
  """
  path = pathlib.Path(path)
  try:
    description = fp8jax.checkpoint.read_description(path)
  except (FileNotFoundError, ValueError) as error:
    raise RunError(f"checkpoint {str(path)!r}: {error}") from None
  metadata = description.get("metadata") or {}
  if "config" not in metadata or "step" not in metadata:
    raise RunError(f"checkpoint {str(path)!r} was not written by an fp8jax run (no run "
                   "settings in it); pass a checkpoints/step_* directory of an fp8jax run.")
  saved = RunConfig.from_dict(metadata["config"])
  for field in MODEL_FIELDS + DATA_FIELDS:
    if getattr(saved, field) != getattr(config, field):
      raise RunError(
          f"checkpoint {str(path)!r} is from a run with {field}={getattr(saved, field)!r}, "
          f"this run has {field}={getattr(config, field)!r}; pass the same --{field} "
          "(or start a new --out directory).")
  if metadata.get("corpus_sha256") != corpus.description["sha256"]:
    raise RunError(f"checkpoint {str(path)!r} was trained on other text than this run's "
                   "corpus (its sha256 differs); pass the same --data.")
  if saved.recipe_object is not None and config.recipe_object is not None and (
      saved.recipe != config.recipe):
    raise RunError(f"checkpoint {str(path)!r} holds {saved.recipe} FP8 state and this run is "
                   f"{config.recipe}; continue with --recipe {saved.recipe} (or --recipe bf16).")
  params, opt_state, _ = jax.eval_shape(lambda: init_state(model, tx, config))
  saved_model = build(saved)[0]
  saved_fp8 = jax.eval_shape(lambda: init_state(saved_model, tx, saved)[2])
  try:
    restored = fp8jax.checkpoint.restore(path, params=params, opt_state=opt_state,
                                         fp8_state=saved_fp8)
  except ValueError as error:
    raise RunError(f"checkpoint {str(path)!r} does not fit this run's {config.size} model: "
                   f"{str(error).splitlines()[0]}") from None
  if config.recipe_object is None:
    fp8_state = {}
  elif saved.recipe_object is None:
    fp8_state = init_state(model, tx, config)[2]
  else:
    fp8_state = restored["fp8_state"]
  return restored["params"], restored["opt_state"], fp8_state, int(metadata["step"])


def _read_metrics(out_dir: pathlib.Path, up_to_step: int) -> list[dict]:
  path = out_dir / METRICS
  if not path.exists():
    return []
  lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
  return [line for line in lines if line["step"] <= up_to_step]


def train(config: RunConfig, out_dir, *, resume: bool = False, init_from=None,
          progress: bool = True, stop_after: int | None = None) -> RunResult:
  """Trains (or continues) the run in `out_dir`.

  Args:
    config: the settings.
    out_dir: the run directory (created).
    resume: continue from the newest complete checkpoint in `out_dir`.
    init_from: a checkpoint to start from instead (e.g. a bf16 run's, to continue
      in FP8): its params and optimizer state, its FP8 state when it has one of
      this recipe, else fresh FP8 state; counting continues from its step.
    progress: show a progress bar.
    stop_after: stop after this step (and its checkpoint, if one is due) as if killed:
      for tests.

  Returns:
    A `RunResult`.

  Raises:
    RunError: bad settings, data or checkpoint (one-line message).
    RunInterrupted: Ctrl-C; the newest complete checkpoint is loadable.
  """
  out_dir = pathlib.Path(out_dir)
  if resume and init_from is not None:
    raise RunError("--resume and --init-from exclude each other: resume continues this "
                   "run's own checkpoints, --init-from starts from another run's.")
  corpus = load_corpus(config)
  model, tx, schedule = build(config)
  fp8 = config.recipe_object is not None
  from fp8jax.models import gpt
  backend = gpt.attention_backend(model.config, config.recipe_object, config.batch, config.seq)

  start, history = 0, []
  if resume:
    found = checkpoint_dirs(out_dir)
    if not found:
      raise RunError(f"--resume: no complete checkpoint in {str(out_dir / CHECKPOINTS)!r}; "
                     "start without --resume.")
    params, opt_state, fp8_state, start = restore_checkpoint(found[-1], model, tx, config, corpus)
    history = _read_metrics(out_dir, start)
  elif init_from is not None:
    params, opt_state, fp8_state, start = restore_checkpoint(init_from, model, tx, config,
                                                             corpus)
  else:
    if checkpoint_dirs(out_dir):
      raise RunError(f"{str(out_dir)!r} already holds a run's checkpoints; pass --resume to "
                     "continue it, or choose another --out.")
    params, opt_state, fp8_state = init_state(model, tx, config)
  if start >= config.steps:
    raise RunError(f"the checkpoint is at step {start}, which is not before --steps "
                   f"{config.steps}; ask for more steps.")

  out_dir.mkdir(parents=True, exist_ok=True)
  (out_dir / METRICS).write_text("".join(json.dumps(line) + "\n" for line in history))
  train_step, eval_step = compiled_steps(config)
  validation = corpus_lib.validation_batches(corpus.validation, config.batch, config.seq,
                                            config.eval_batches)
  tokens_per_step = config.batch * config.seq
  losses = [line["loss"] for line in history if "loss" in line]
  val_losses = {line["step"]: line["val_loss"] for line in history if "val_loss" in line}
  step_times, last_checkpoint = [], (checkpoint_dirs(out_dir) or [None])[-1]

  bar = _progress(progress, config, start)
  metrics = (out_dir / METRICS).open("a")
  step = start
  try:
    for step in range(start + 1, config.steps + 1):
      batch = jnp.asarray(corpus_lib.train_batch(corpus.train, step, config.batch, config.seq,
                                                 config.seed))
      began = time.perf_counter()
      params, opt_state, fp8_state, loss, grad_norm = train_step(params, opt_state, fp8_state,
                                                                 batch)
      loss = float(loss)
      elapsed = time.perf_counter() - began
      if step > start + 1:
        step_times.append(elapsed)
      losses.append(loss)
      line = {"step": step, "loss": loss, "lr": float(schedule(step - 1)),
              "grad_norm": float(grad_norm), "step_time_s": elapsed,
              "tokens_per_s": tokens_per_step / elapsed}
      if fp8:
        line["fp8"] = fp8_records(fp8_state)
      metrics.write(json.dumps(line) + "\n")
      if step % config.eval_every == 0 or step == config.steps:
        val = float(np.mean([float(eval_step(params, fp8_state, jnp.asarray(b)))
                             for b in validation]))
        val_losses[step] = val
        metrics.write(json.dumps({"step": step, "val_loss": val}) + "\n")
      metrics.flush()
      if step % config.checkpoint_every == 0 or step == config.steps:
        last_checkpoint = save_checkpoint(out_dir, step, params, opt_state, fp8_state, config,
                                          corpus)
      if stop_after is not None and step >= stop_after:
        break
      if bar is not None:
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tokens_per_step / elapsed:,.0f}")
  except KeyboardInterrupt:
    raise RunInterrupted(step - 1, last_checkpoint) from None
  finally:
    metrics.close()
    if bar is not None:
      bar.close()

  step_time = statistics.median(step_times) if step_times else math.nan
  result = RunResult(config=config, out_dir=out_dir, losses=losses, val_losses=val_losses,
                     tokens_per_s=tokens_per_step / step_time if step_times else math.nan,
                     step_time_s=step_time, attention_backend=backend,
                     checkpoint=last_checkpoint)
  _write_summary(result, corpus, model)
  return result


def _progress(enabled: bool, config: RunConfig, start: int):
  if not enabled:
    return None
  from tqdm import tqdm
  return tqdm(total=config.steps, initial=start, desc=f"{config.recipe:>7}", unit="step",
              dynamic_ncols=True)


def _write_summary(result: RunResult, corpus, model) -> None:
  from fp8jax.models import gpt
  summary = {"config": result.config.to_dict(), "corpus": corpus.description,
             "model": {**dataclasses.asdict(model.config),
                       "parameters": gpt.parameter_count(model.config)},
             "attention_backend": result.attention_backend,
             "final_loss": result.final_loss(), "val_losses": result.val_losses,
             "tokens_per_s": result.tokens_per_s, "step_time_s": result.step_time_s,
             "checkpoint": str(result.checkpoint.name if result.checkpoint else None),
             "device": jax.devices()[0].device_kind, "jax_version": jax.__version__}
  (result.out_dir / "run.json").write_text(json.dumps(summary, indent=1, default=str))
