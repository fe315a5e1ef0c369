"""Benchmark: the demo GPT's train step in bf16 and FP8: tokens/s, memory, where the time goes.

Times the jitted train step that `fp8jax compare` runs (`fp8jax.runs.steps`: the model of
`fp8jax.models.gpt`, AdamW after gradient clipping, `fp8jax.value_and_grad` over the whole
model) on random tokens, chaining each step's state into the next as training does. A row
per (model, recipe, optimizer, saved activations, attention backend); "auto" attention is
what fp8jax chooses (what the demo runs), a named backend is forced.

    python -m benchmarks.gpt --size 350m,1b              # GPU: bf16 and delayed, each size
    python -m benchmarks.gpt --size 350m --recipes bf16,delayed,current --budget-s 200
    python -m benchmarks.gpt --size 125m --batch 32 --experts 8 --top-k 2    # MoE
    python -m benchmarks.gpt --smoke                     # CPU: one-block tiny model

Each row compiles its step once; that one executable is measured, timed and profiled:

  tokens_per_s    batch * seq / the median step time (samples of back-to-back steps)
  memory          XLA's memory analysis of the step (arguments, temp, outputs, aliased,
                  total: what `fp8jax cost --gpt` predicts without a GPU); and the device's
                  `peak_bytes_in_use` before and after the row (the process's peak so far:
                  a row raised it when "after" is larger)
  categories      a profiler trace of a few more steps, each kernel's device time summed by
                  what it does (`benchmarks.trace_categories`), beside the cost model's
                  prediction of the same categories
  predicted       `fp8jax.lowering.cost.cost_hlo` of the executable's HLO: the predicted step
                  time with the device's calibrated constants (`H200` on an H200, the H100
                  defaults elsewhere) and measured over predicted
  kernel_classes  `benchmarks.step_calibration.kernel_classes` of the same report: what the
                  cost model's calibration needs of the exact program measured
  seconds         the row's wall clock: build and init, compile, timed steps, trace, analysis

Rows run in order while they fit the time given (`--budget-s`, `benchmarks.gpt_plan.Budget`);
the others are listed as dropped, with why.
"""
from __future__ import annotations

import argparse
import dataclasses
import re
import statistics
import time
import traceback

import jax
import jax.numpy as jnp

from benchmarks import device_trace, gpt_plan, step_calibration, trace_categories
from benchmarks.gpt_plan import Row
from benchmarks.timing import environment, write_report
from fp8jax.lowering.cost import H200, CostConstants, cost_hlo
from fp8jax.lowering.memory import memory_of
from fp8jax.models import gpt
from fp8jax.runs import steps
from fp8jax.runs.config import RunConfig


@dataclasses.dataclass(frozen=True)
class Timing:
  """How many steps a row runs: `warmup`, then `repeats` samples of `steps_per_sample`
  back-to-back steps (their median is the step time), then `trace_steps` under the profiler."""

  warmup: int = 1
  repeats: int = 3
  steps_per_sample: int = 3
  trace_steps: int = 2


SMOKE_TIMING = Timing(warmup=1, repeats=1, steps_per_sample=1, trace_steps=1)


def constants_for(device_kind: str) -> tuple[str, CostConstants]:
  """The cost model's constants for a device: ("H200", H200) or the H100 defaults."""
  if "H200" in device_kind:
    return "H200", H200
  if "H100" in device_kind:
    return "H100", CostConstants()
  return f"H100 (no constants for {device_kind})", CostConstants()


def time_steps(train_step, state, tokens, timing: Timing) -> tuple[dict, tuple]:
  """Seconds per train step: the median over `timing.repeats` samples.

  Returns:
    ({"median_s", "min_s", "max_s", "repeats", "steps_per_sample", "final_loss"}, the state
    after the last step).
  """
  state, loss = _steps(train_step, state, tokens, timing.warmup)
  jax.block_until_ready(loss)
  times = []
  for _ in range(timing.repeats):
    start = time.perf_counter()
    state, loss = _steps(train_step, state, tokens, timing.steps_per_sample)
    jax.block_until_ready(loss)
    times.append((time.perf_counter() - start) / timing.steps_per_sample)
  return ({"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times),
           "repeats": timing.repeats, "steps_per_sample": timing.steps_per_sample,
           "final_loss": float(loss)}, state)


def _steps(train_step, state, tokens, count: int):
  loss = None
  for _ in range(count):
    *state, loss, _ = train_step(*state, tokens)
  return tuple(state), loss


class _Inits:
  """The jitted init of each model, shared by the rows that have the same parameters and
  FP8 state (the memory features change neither)."""

  def __init__(self):
    self.compiled = {}

  def __call__(self, model, seq: int):
    # Parameters and FP8 state are stacked over the blocks whether the block loop is
    # unrolled or not (`GptConfig.scan_unroll`); the rolled init compiles in a fraction
    # of the time (350m: 1.9 s against 10.5 s on a CPU).
    rolled = model.clone(config=dataclasses.replace(model.config, scan_unroll=1,
                                                    saved_activations="default"))
    key = (rolled.config, rolled.recipe)
    if key not in self.compiled:
      self.compiled[key] = jax.jit(rolled.init)
    variables = self.compiled[key](jax.random.key(0), jnp.zeros((1, seq), jnp.int32))
    return variables["params"], variables.get("fp8_meta", {})


def run_row(row: Row, backend: str | None = None, timing: Timing = Timing(),
            inits: _Inits | None = None) -> dict:
  """One row: compile the step once, then time it, profile it and read its program."""
  clock = _Clock()
  moe = dict(experts=row.experts, top_k=row.top_k) if row.experts else {}
  config = RunConfig(recipe=row.recipe, size=row.size, seq=row.seq, batch=row.batch,
                     optimizer=row.optimizer, saved_activations=row.saved_activations, **moe)
  model, tx, _ = steps.build(config)
  model = model.clone(config=dataclasses.replace(
      model.config, attention_backend=backend,
      **({"n_layers": row.layers} if row.layers else {})))
  recipe = config.recipe_object
  params, fp8_state = (inits or _Inits())(model, row.seq)
  opt_state = jax.jit(tx.init)(params)
  tokens = jax.random.randint(jax.random.key(1), (row.batch, row.seq + 1), 0, gpt.VOCAB_SIZE,
                              jnp.int32)
  jax.block_until_ready((params, opt_state, fp8_state, tokens))
  clock.lap("build_and_init")
  compiled = steps.train_step_for(model, tx, recipe is not None).lower(
      params, opt_state, fp8_state, tokens).compile()
  clock.lap("compile")
  device = jax.devices()[0]
  device_kind = str(device.device_kind)
  peak_before = (device.memory_stats() or {}).get("peak_bytes_in_use")  # None on a CPU
  # The compiled step is the one timed: calling the jitted function would compile it again.
  stats, state = time_steps(compiled, (params, opt_state, fp8_state), tokens, timing)
  clock.lap("timed_steps")
  result = {**_describe(row), "requested_backend": backend or "auto",
            "attention_backend": gpt.attention_backend(model.config, recipe, row.batch, row.seq),
            "step": stats, "tokens_per_s": row.batch * row.seq / stats["median_s"],
            "memory": memory_of(compiled, label=row.label, target=device_kind).to_dict(),
            "peak_bytes_in_use": {"before": peak_before,
                                  "after": (device.memory_stats() or {}).get("peak_bytes_in_use")}}
  try:
    (state, _), trace = device_trace.record(
        lambda: _blocked(_steps(compiled, state, tokens, timing.trace_steps)))
  except Exception as error:  # noqa: BLE001 - the timing stands without a trace
    trace = None
    result["categories"] = {"error": _error(error)}
    traceback.print_exc()
  clock.lap("trace")
  del state
  try:
    result.update(_program(compiled.as_text(), row, device, stats["median_s"], trace,
                           timing.trace_steps, result.get("categories")))
  except Exception as error:  # noqa: BLE001 - the timing stands without its analysis
    result["analysis_error"] = _error(error)
    traceback.print_exc()
  clock.lap("analysis")
  result["seconds"] = clock.laps
  return result


def _blocked(out):
  jax.block_until_ready(out)
  return out


def _program(hlo: str, row: Row, device, measured_s: float, trace, trace_steps: int,
             categories: dict | None) -> dict:
  """What the executable's HLO and trace say: its prediction, categories and kernel classes."""
  name, constants = constants_for(str(device.device_kind))
  report = cost_hlo(hlo, constants, label=row.label, target=str(device.device_kind))
  found = {"predicted": {"constants": name, "step_s": report.time_s,
                         "measured_over_predicted": measured_s / report.time_s,
                         "kernel_launches": report.kernel_launches},
           "kernel_classes": step_calibration.kernel_classes(report)}
  kernels = trace_categories.program_kernels(hlo, report)
  predicted = trace_categories.predicted_table(report, kernels)
  if trace is None:
    found["categories"] = {**(categories or {}), "predicted": predicted}
    return found
  module = re.match(r"\s*HloModule\s+([^\s,]+)", hlo)
  events, source = device_trace.kernel_events(trace, module.group(1) if module else None)
  measured = trace_categories.category_table(events, trace_steps, kernels)
  found["categories"] = {"source": source, **measured, "predicted": predicted}
  if device.platform == "gpu" and source != "gpu":
    found["categories"]["error"] = ("the trace holds no GPU kernels: the device tracer "
                                    "(CUPTI) recorded nothing")
  print(trace_categories.format_table(
      measured, predicted, title=f"{row.label}: {trace_steps} steps traced ({source}), "
      f"predicted with the {name} constants"))
  return found


def _describe(row: Row) -> dict:
  described = {"label": row.label, "model": row.model, "variant": row.variant, "size": row.size,
               "batch": row.batch, "seq": row.seq, "recipe": row.recipe,
               "optimizer": row.optimizer, "saved_activations": row.saved_activations}
  if row.experts:
    described.update(experts=row.experts, top_k=row.top_k)
  if row.layers:
    described["layers"] = row.layers
  return described


class _Clock:
  """Seconds between laps, by name, and their total."""

  def __init__(self):
    self.start = self.last = time.perf_counter()
    self.seconds = {}

  def lap(self, name: str) -> None:
    now = time.perf_counter()
    self.seconds[name] = round(now - self.last, 2)
    self.last = now

  @property
  def laps(self) -> dict:
    return {**self.seconds, "total": round(self.last - self.start, 2)}


def _error(error: Exception) -> str:
  return f"{type(error).__name__}: {str(error).splitlines()[0][:300] if str(error) else ''}"


def run_rows(rows, backends=(None,), *, budget: gpt_plan.Budget | None = None,
             timing: Timing = Timing()) -> dict:
  """Every row with every backend while the budget lasts; a row that cannot run says why.

  Returns:
    {"plan": [{"label", "backend", "estimate_s", "status": "ran" | "failed" | "dropped",
    "seconds" | "reason"}], "rows": [...], "models": {model: `summarize`}}.
  """
  inits = _Inits()
  plan, results = [], []
  for index, row in enumerate(rows):
    for backend in backends:
      entry = {"label": row.label, "backend": backend or "auto", "estimate_s": row.estimate_s}
      partner = gpt_plan.fp8_partner(rows, index) if backend == backends[0] else None
      if budget is not None and not budget.fits(row, partner):
        reason = budget.drop_reason(row, partner)
        plan.append({**entry, "status": "dropped", "reason": reason})
        results.append({**_describe(row), "requested_backend": backend or "auto",
                        "dropped": reason})
        print(f"{row.label} ({backend or 'auto'}): dropped: {reason}", flush=True)
        continue
      began = time.perf_counter()
      try:
        result = run_row(row, backend, timing, inits)
      except Exception as error:  # noqa: BLE001 - record why a combination cannot run here
        traceback.print_exc()
        result = {**_describe(row), "requested_backend": backend or "auto",
                  "skipped": _error(error)}
        print(f"{row.label} ({backend or 'auto'}): skipped: {result['skipped']}", flush=True)
      else:
        print(f"{row.label} ({backend or 'auto'}, attention {result['attention_backend']}): "
              f"{result['tokens_per_s']:,.0f} tokens/s, "
              f"{1e3 * result['step']['median_s']:.1f} ms/step (predicted "
              f"{1e3 * result['predicted']['step_s']:.1f}), "
              f"{result['memory']['total'] / 2**30:.2f} GiB, "
              f"{result['seconds']['total']:.0f} s", flush=True)
      seconds = time.perf_counter() - began
      if budget is not None:
        budget.ran(row, seconds)
      plan.append({**entry, "status": "failed" if "skipped" in result else "ran",
                   "seconds": round(seconds, 1),
                   **({"reason": result["skipped"]} if "skipped" in result else {})})
      results.append(result)
  return {"plan": plan, "rows": results, "models": summarize(results)}


def summarize(rows) -> dict:
  """Per model: its size, tokens/s of each variant, the FP8 speedups over bf16 and measured
  against predicted step times (rows with automatic attention; the first of a variant)."""
  models = {}
  for row in rows:
    if "tokens_per_s" not in row or row["requested_backend"] != "auto":
      continue
    model = models.setdefault(row["model"], {
        "size": row["size"], "batch": row["batch"], "seq": row["seq"],
        "parameters": gpt.parameter_count(gpt.config_for(
            row["size"], **({"n_layers": row["layers"]} if "layers" in row else {}),
            **({"experts": row["experts"], "top_k": row["top_k"]} if "experts" in row else {}))),
        "tokens_per_s": {}, "step_ms": {}, "memory_gib": {}})
    variant = row["variant"]
    if variant in model["tokens_per_s"]:
      continue
    model["tokens_per_s"][variant] = row["tokens_per_s"]
    model["memory_gib"][variant] = row["memory"]["total"] / 2**30
    predicted = row.get("predicted", {}).get("step_s")
    model["step_ms"][variant] = {
        "measured": 1e3 * row["step"]["median_s"],
        "predicted": 1e3 * predicted if predicted else None,
        "measured_over_predicted": row.get("predicted", {}).get("measured_over_predicted")}
  for model in models.values():
    bf16 = model["tokens_per_s"].get("bf16")
    model["fp8_speedup_vs_bf16"] = ({v: tps / bf16 for v, tps in model["tokens_per_s"].items()
                                     if v != "bf16"} if bf16 else {})
  return models


def rows_from_args(args) -> tuple[Row, ...]:
  """The rows of a command line: every size with every recipe."""
  if args.smoke:
    return gpt_plan.smoke_rows(moe=bool(args.experts))
  rows = []
  for size in args.size.split(","):
    seq = args.seq or gpt.SIZES[size].seq_len
    for recipe in args.recipes.split(","):
      fp8 = recipe != "bf16"
      rows.append(Row(size, args.batch, seq, recipe,
                      optimizer=args.optimizer if fp8 or args.memory_for_bf16 else "adamw",
                      saved_activations=(args.saved_activations
                                         if fp8 or args.memory_for_bf16 else "default"),
                      experts=args.experts, top_k=args.top_k))
  return tuple(rows)


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--smoke", action="store_true", help="tiny one-block model, 1 step (CPU)")
  parser.add_argument("--size", default="1b", help=f"comma-separated sizes of {list(gpt.SIZES)}")
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--seq", type=int, default=None, help="default: each size's seq_len")
  parser.add_argument("--recipes", default="bf16,delayed")
  parser.add_argument("--backends", default="auto",
                      help="comma-separated attention backends; 'auto' lets fp8jax choose")
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--trace-steps", type=int, default=2, help="steps under the profiler")
  parser.add_argument("--optimizer", default="adamw", help="adamw or adamw_fp8 (FP8 rows)")
  parser.add_argument("--saved-activations", default="default", help="default or fp8 (FP8 rows)")
  parser.add_argument("--memory-for-bf16", action="store_true",
                      help="--optimizer and --saved-activations for the bf16 rows too")
  parser.add_argument("--experts", type=int, default=0,
                      help="each block's MLP a mixture of this many experts (0: dense)")
  parser.add_argument("--top-k", type=int, default=2, help="with --experts: experts per token")
  parser.add_argument("--budget-s", type=float, default=None,
                      help="run rows while they fit this many seconds (default: all)")
  parser.add_argument("--out", default=None, help="JSON path (default: print only)")
  args = parser.parse_args(argv)
  rows = rows_from_args(args)
  timing = (SMOKE_TIMING if args.smoke else
            Timing(repeats=args.repeats, trace_steps=args.trace_steps))
  backends = tuple(None if b == "auto" else b for b in args.backends.split(","))
  budget = gpt_plan.Budget(args.budget_s) if args.budget_s is not None else None
  if budget is not None:
    print(gpt_plan.format_plan(rows, args.budget_s), flush=True)
  report = {**environment(), "benchmark": "gpt_train_step", "smoke": args.smoke,
            "results": run_rows(rows, backends, budget=budget, timing=timing)}
  write_report(report, args.out)
  return report


if __name__ == "__main__":
  main()
