"""One demo training run: the GPT on the embedded corpus, with checkpoints, metrics and resume.

    result = train(RunConfig(recipe="delayed"), "out/delayed")

writes into the run directory `metrics.jsonl` (`fp8jax.runs.metrics`),
`checkpoints/step_NNNNNNN` (`fp8jax.runs.checkpoints`) and `run.json` (the
settings, the corpus, the attention backend and the results).

`resume=True` continues from the newest complete checkpoint and gives exactly the
losses an uninterrupted run gives (same batches, same compiled step, same
learning-rate schedule). Ctrl-C is taken between steps: the step in progress
finishes (with its metrics, evaluation and checkpoint if due) and `RunInterrupted`
names the newest complete checkpoint, from which `resume=True` continues.
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import math
import pathlib
import signal
import statistics
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

from fp8jax.core.calibration import is_fresh
from fp8jax.data import corpus as corpus_lib
from fp8jax.models import gpt
from fp8jax.runs import checkpoints, metrics
from fp8jax.runs.config import RunConfig, RunError
from fp8jax.runs.steps import (build, calibration_step, compiled_steps, init_state,
                               model_config, state_stats, telemetry_step)


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
    losses: list[float], the training loss of every step in the run directory's
      metrics, in order (from step 1; after `init_from`, from the step after the
      checkpoint's).
    val_losses: dict[int, float], validation loss by step.
    tokens_per_s: training tokens per second over this call's steps, its first
      (compiling) step excluded; NaN with fewer than two steps.
    step_time_s: median wall time of those steps.
    attention_backend: the attention backend the model used.
    checkpoint: the final checkpoint.
    peak_memory_bytes: the most device memory the run's process held (the GPU
      allocator's peak, `jax.Device.memory_stats()["peak_bytes_in_use"]`); None where the
      device does not report it (a CPU).
  """

  config: RunConfig
  out_dir: pathlib.Path
  losses: list
  val_losses: dict
  tokens_per_s: float
  step_time_s: float
  attention_backend: str
  checkpoint: pathlib.Path | None
  peak_memory_bytes: int | None = None

  def final_loss(self) -> float:
    """Mean training loss over the last 10% of steps (at least one)."""
    tail = max(1, len(self.losses) // 10)
    return float(np.mean(self.losses[-tail:]))


def load_corpus(config: RunConfig) -> corpus_lib.Corpus:
  """The run's text: the standard library's source, or `config.data`."""
  if config.data is None:
    return corpus_lib.stdlib_corpus(max_bytes=config.max_data_bytes)
  return corpus_lib.text_file_corpus(config.data, max_bytes=config.max_data_bytes)


def train(config: RunConfig, out_dir, *, resume: bool = False, init_from=None,
          progress: bool | str = True, stop_after: int | None = None,
          telemetry_every: int | None = None) -> RunResult:
  """Trains (or continues) the run in `out_dir`.

  Args:
    config: the settings (`schedule_steps` None: fixed to `steps` when the run
      starts, or taken from the checkpoint when it resumes).
    out_dir: the run directory (created).
    resume: continue from the newest complete checkpoint in `out_dir`; `config`
      must agree with it on everything but `steps` and the intervals.
    init_from: start a new run from another run's checkpoint (e.g. a bf16 run's,
      to continue in FP8): its params and optimizer state, its FP8 state when it
      has one of this recipe, else fresh FP8 state; counting continues from its step.
      A fresh delayed-scaling state is calibrated on the first batch before the first
      step (`fp8jax.calibrate`: its first scales come from that batch's tensors).
    progress: show a progress bar (a str: with this label instead of the recipe's name).
    stop_after: stop after this step (and its checkpoint, if one is due) as if
      killed: for tests.
    telemetry_every: in FP8, every this many steps (and at the first and last
      step) a separate jitted logging step (`fp8jax.runs.steps.telemetry_step`) measures how
      the step's operands quantize, and `metrics.jsonl` gets a "telemetry" line
      (`metrics.telemetry_records`); None: no telemetry. The train step itself
      is the same either way.

  Returns:
    A `RunResult`.

  Raises:
    RunError: bad settings, data, output directory or checkpoint (one-line message).
    RunInterrupted: Ctrl-C; the newest complete checkpoint is loadable.
  """
  out_dir = pathlib.Path(out_dir)
  _check_ready(out_dir, progress, resume, init_from)
  if telemetry_every is not None and (isinstance(telemetry_every, bool) or not isinstance(
      telemetry_every, int) or telemetry_every < 1):
    raise RunError(f"--telemetry-every {telemetry_every!r} must be a positive integer (or "
                   "None for no telemetry).")
  corpus = load_corpus(config)
  if resume:
    found = checkpoints.complete(out_dir)
    if not found:
      raise RunError(f"--resume: no complete checkpoint in {str(out_dir / 'checkpoints')!r}; "
                     "start without --resume.")
    saved, _ = checkpoints.saved_config(found[-1])
    if config.schedule_steps is None:
      config = config.replace(schedule_steps=saved.schedule_length)
    params, opt_state, fp8_state, start = checkpoints.restore(found[-1], config, corpus,
                                                              continuing=True)
    history = metrics.read(out_dir / metrics.FILE) if (out_dir / metrics.FILE).exists() else []
    history = [line for line in history if line["step"] <= start]
  else:
    if config.schedule_steps is None:
      config = config.replace(schedule_steps=config.steps)
    model, tx, _ = build(config)
    if init_from is not None:
      params, opt_state, fp8_state, start = checkpoints.restore(init_from, config, corpus,
                                                                continuing=False)
    else:
      params, opt_state, fp8_state = init_state(model, tx, config)
      start = 0
    history = []
    if is_fresh(fp8_state):  # delayed scaling: seed the scales the first step uses
      fp8_state = calibration_step(config)(params, fp8_state, _batch(corpus, config, start + 1))
  if start >= config.steps:
    raise RunError(f"the checkpoint is at step {start}, which is not before --steps "
                   f"{config.steps}; ask for more steps.")

  out_dir.mkdir(parents=True, exist_ok=True)
  metrics.rewrite(out_dir / metrics.FILE, history)
  with _stop_on_ctrl_c() as stop_requested:
    result = _loop(config, out_dir, corpus, (params, opt_state, fp8_state), start, history,
                   progress, stop_after, stop_requested, telemetry_every)
  _write_summary(result, corpus)
  return result


def _check_ready(out_dir: pathlib.Path, progress: bool, resume: bool, init_from) -> None:
  """One-line errors for what would otherwise fail later (or with a traceback)."""
  if resume and init_from is not None:
    raise RunError("--resume and --init-from exclude each other: resume continues this "
                   "run's own checkpoints, --init-from starts from another run's.")
  needed = [("orbax.checkpoint", "orbax-checkpoint")] + ([("tqdm", "tqdm")] if progress else [])
  for module, package in needed:
    try:
      found = importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
      found = False
    if not found:
      raise RunError(f"a training run needs {package}: pip install 'fp8jax[examples]'.")
  if out_dir.exists() and not out_dir.is_dir():
    raise RunError(f"--out {str(out_dir)!r} is a file; pass a directory.")
  if not resume and checkpoints.complete(out_dir):
    raise RunError(f"{str(out_dir)!r} already holds a run's checkpoints; pass --resume to "
                   "continue it, or choose another --out.")


@contextlib.contextmanager
def _stop_on_ctrl_c():
  """Within: Ctrl-C sets a flag (checked between steps) instead of raising mid-step."""
  requested = threading.Event()
  if threading.current_thread() is not threading.main_thread():
    yield requested  # signal handlers live in the main thread: Ctrl-C raises as usual
    return
  previous = signal.signal(signal.SIGINT, lambda signum, frame: requested.set())
  try:
    yield requested
  finally:
    signal.signal(signal.SIGINT, previous)


def _loop(config, out_dir, corpus, state, start, history, progress, stop_after,
          stop_requested, telemetry_every) -> RunResult:
  # A fresh state comes out of jit uncommitted and a restored one committed to its
  # device, and jit compiles a step once for each: committed alike where each array
  # already is (no copy), a resumed run reuses the programs compiled for a fresh one in
  # the same process (compiled_steps).
  params, opt_state, fp8_state = jax.device_put(state, jax.tree.map(lambda x: x.sharding,
                                                                    state))
  model, _, schedule = build(config)
  train_step, eval_step = compiled_steps(config)
  fp8 = config.recipe_object is not None
  log_step = telemetry_step(config) if fp8 and telemetry_every else None
  backend = gpt.attention_backend(model.config, config.recipe_object, config.batch, config.seq)
  validation = corpus_lib.validation_batches(corpus.validation, config.batch, config.seq,
                                            config.eval_batches)
  tokens_per_step = config.batch * config.seq
  losses = [line["loss"] for line in history if "loss" in line]
  val_losses = {line["step"]: line["val_loss"] for line in history if "val_loss" in line}
  step_times, newest = [], (checkpoints.complete(out_dir) or [None])[-1]
  bar = _progress(progress, config, start)
  step = start
  with (out_dir / metrics.FILE).open("a") as log:
    try:
      for step in range(start + 1, config.steps + 1):
        batch = _batch(corpus, config, step)
        logging = log_step is not None and (
            step % telemetry_every == 0 or step in (start + 1, config.steps))
        if logging:  # the operands as this step quantizes them: before it runs
          tensor_stats = log_step(params, fp8_state, batch)
        began = time.perf_counter()
        params, opt_state, fp8_state, loss, stats = train_step(params, opt_state, fp8_state,
                                                               batch)
        loss = float(loss)
        elapsed = time.perf_counter() - began
        if step > start + 1:
          step_times.append(elapsed)
        losses.append(loss)
        # optax counts updates from 0: step s used the schedule's value at s - 1.
        line = {"step": step, "loss": loss, "lr": float(schedule(step - 1)),
                **{name: float(value) for name, value in stats.items()},
                "step_time_s": elapsed, "tokens_per_s": tokens_per_step / elapsed}
        if fp8:
          line["fp8"] = metrics.fp8_records(fp8_state)
        log.write(metrics.dumps(line) + "\n")
        if logging:  # headroom: this step's amax under the scales it leaves for the next
          records = metrics.telemetry_records(tensor_stats, state_stats(fp8_state))
          log.write(metrics.dumps({"step": step, "telemetry": records}) + "\n")
        if step % config.eval_every == 0 or step == config.steps:
          val = float(np.mean([float(eval_step(params, fp8_state, jnp.asarray(b)))
                               for b in validation]))
          val_losses[step] = val
          log.write(metrics.dumps({"step": step, "val_loss": val}) + "\n")
        log.flush()
        if step % config.checkpoint_every == 0 or step == config.steps:
          newest = checkpoints.save(out_dir, step, params, opt_state, fp8_state, config, corpus)
        if bar is not None:
          bar.update(1)
          bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tokens_per_step / elapsed:,.0f}")
        if stop_requested.is_set():
          raise RunInterrupted(step, newest)
        if stop_after is not None and step >= stop_after:
          break
    except KeyboardInterrupt:  # outside the main thread, or during the first compile
      raise RunInterrupted(step - 1 if step > start else start,
                           (checkpoints.complete(out_dir) or [None])[-1]) from None
    finally:
      if bar is not None:
        bar.close()
  step_time = statistics.median(step_times) if step_times else math.nan
  return RunResult(config=config, out_dir=out_dir, losses=losses, val_losses=val_losses,
                   tokens_per_s=tokens_per_step / step_time if step_times else math.nan,
                   step_time_s=step_time, attention_backend=backend, checkpoint=newest,
                   peak_memory_bytes=peak_device_memory())


def _batch(corpus, config: RunConfig, step: int) -> jax.Array:
  """The tokens [batch, seq + 1] that training step `step` (from 1) trains on."""
  return jnp.asarray(corpus_lib.train_batch(corpus.train, step, config.batch, config.seq,
                                            config.seed))


def peak_device_memory() -> int | None:
  """The peak bytes the first local device's allocator held so far; None on a CPU.

  Returns:
    `memory_stats()["peak_bytes_in_use"]` (a GPU), or None where it is not reported.
  """
  stats = jax.local_devices()[0].memory_stats()
  peak = (stats or {}).get("peak_bytes_in_use")
  return int(peak) if peak is not None else None


def _progress(enabled: bool | str, config: RunConfig, start: int):
  if not enabled:
    return None
  from tqdm import tqdm  # optional (the 'examples' extra): only for a progress bar
  label = enabled if isinstance(enabled, str) else f"{config.recipe:>7}"
  return tqdm(total=config.steps, initial=start, desc=label, unit="step",
              dynamic_ncols=True)


def _write_summary(result: RunResult, corpus) -> None:
  settings = model_config(result.config)
  summary = {"config": result.config.to_dict(), "corpus": corpus.description,
             "model": {**dataclasses.asdict(settings),
                       "parameters": gpt.parameter_count(settings)},
             "attention_backend": result.attention_backend,
             "peak_memory_bytes": result.peak_memory_bytes,
             "final_loss": result.final_loss(), "val_losses": result.val_losses,
             "tokens_per_s": result.tokens_per_s, "step_time_s": result.step_time_s,
             "checkpoint": result.checkpoint.name if result.checkpoint else None,
             "device": jax.devices()[0].device_kind, "jax_version": jax.__version__}
  (result.out_dir / "run.json").write_text(
      json.dumps(metrics.finite(summary), indent=1, default=str))
