"""Benchmark: the demo GPT's train step in bf16 and in FP8, tokens/s, naming each attention backend.

Times the jitted train step that `fp8jax compare` runs (`fp8jax.runs.steps`: the model of
`fp8jax.models.gpt`, AdamW after gradient clipping, `fp8jax.value_and_grad` over the whole
model) on random tokens, chaining each step's state into the next as training does. A row
per (recipe, attention backend): "auto" is what fp8jax chooses (what the demo runs); named
backends are forced, to compare them inside the same model.

    python -m benchmarks.gpt                                 # GPU: 1b, batch 8, seq 2048
    python -m benchmarks.gpt --size 350m --batch 16 --seq 1024
    python -m benchmarks.gpt --smoke                         # CPU: tiny, proves it runs
    python -m benchmarks.gpt --size 125m --batch 32 --experts 8 --top-k 2    # MoE

tokens/s = batch * seq / median step time. The acceptance target on an H100: FP8 (delayed
scaling, automatic attention) >= 1.25x bf16 (automatic attention) at the 1b size.

Memory, per row: what XLA's analysis gives the step compiled for this device (`memory`:
arguments, temp, outputs, aliased and their total in bytes, as `fp8jax cost --gpt`
predicts without a GPU) and the device's peak bytes in use after the row
(`peak_bytes_in_use`: the process's peak so far, over every row and anything the process
ran before; the analysis is the step's own). `--optimizer adamw_fp8 --saved-activations
fp8` measures the memory-saving variant (for every row, bf16 included).
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import jax
import jax.numpy as jnp
from tqdm import tqdm

from fp8jax.lowering.memory import memory_of
from fp8jax.models import gpt
from fp8jax.runs import steps
from fp8jax.runs.config import RunConfig

try:
  from benchmarks.timing import environment, write_report
except ImportError:  # run as a script from benchmarks/
  from timing import environment, write_report


def time_steps(train_step, state, tokens, *, warmup: int, repeats: int,
               steps_per_sample: int) -> dict:
  """Seconds per train step: median over `repeats` samples of `steps_per_sample` chained steps.

  Returns:
    {"median_s", "min_s", "max_s", "repeats", "steps_per_sample"}.
  """
  params, opt_state, fp8_state = state
  for _ in range(warmup):
    params, opt_state, fp8_state, loss, _ = train_step(params, opt_state, fp8_state, tokens)
  jax.block_until_ready(loss)
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    for _ in range(steps_per_sample):
      params, opt_state, fp8_state, loss, _ = train_step(params, opt_state, fp8_state, tokens)
    jax.block_until_ready(loss)
    times.append((time.perf_counter() - start) / steps_per_sample)
  return {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times),
          "repeats": repeats, "steps_per_sample": steps_per_sample,
          "final_loss": float(loss)}


def run_one(size: str, recipe: str, backend: str | None, batch: int, seq: int, *,
            warmup: int, repeats: int, steps_per_sample: int, optimizer: str = "adamw",
            saved_activations: str = "default", experts: int = 0, top_k: int = 2) -> dict:
  """One row: the demo's train step for `recipe` ("bf16", "delayed", ...) with `backend`."""
  moe = dict(experts=experts, top_k=top_k) if experts else {}
  config = RunConfig(recipe=recipe, size=size, seq=seq, batch=batch, optimizer=optimizer,
                     saved_activations=saved_activations, **moe)
  model, tx, _ = steps.build(config)
  model = model.clone(config=dataclasses.replace(model.config, attention_backend=backend))
  fp8 = config.recipe_object is not None
  chosen = gpt.attention_backend(model.config, config.recipe_object, batch, seq)
  params, opt_state, fp8_state = steps.init_state(model, tx, config)
  tokens = jax.random.randint(jax.random.key(1), (batch, seq + 1), 0, gpt.VOCAB_SIZE, jnp.int32)
  train_step = steps.train_step_for(model, tx, fp8)
  compiled = train_step.lower(params, opt_state, fp8_state, tokens).compile()
  memory = memory_of(compiled, label=recipe, target=str(jax.devices()[0].device_kind))
  # The compiled step is the one timed: calling the jitted function would compile it again.
  stats = time_steps(compiled, (params, opt_state, fp8_state),
                     tokens, warmup=warmup, repeats=repeats, steps_per_sample=steps_per_sample)
  device_stats = jax.devices()[0].memory_stats() or {}   # None on some platforms (CPU)
  return {"recipe": recipe, "requested_backend": backend or "auto", "attention_backend": chosen,
          "optimizer": optimizer, "saved_activations": saved_activations, **moe,
          "step": stats, "tokens_per_s": batch * seq / stats["median_s"],
          "memory": memory.to_dict(), "peak_bytes_in_use": device_stats.get("peak_bytes_in_use")}


def run(size: str, batch: int, seq: int, recipes, backends, *, warmup: int = 2,
        repeats: int = 5, steps_per_sample: int = 3, optimizer: str = "adamw",
        saved_activations: str = "default", experts: int = 0, top_k: int = 2) -> dict:
  """Every (recipe, backend) row; a row that cannot run says why instead of a number."""
  rows = []
  for recipe in tqdm(recipes, desc="recipes"):
    for backend in backends:
      try:
        row = run_one(size, recipe, backend, batch, seq, warmup=warmup, repeats=repeats,
                      steps_per_sample=steps_per_sample, optimizer=optimizer,
                      saved_activations=saved_activations, experts=experts, top_k=top_k)
      except Exception as error:  # noqa: BLE001 - record why a combination cannot run here
        row = {"recipe": recipe, "requested_backend": backend or "auto",
               "skipped": f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"}
        print(f"{recipe:8s} {backend or 'auto':18s} skipped: {row['skipped']}")
      else:
        print(f"{recipe:8s} {backend or 'auto':18s} ({row['attention_backend']}): "
              f"{row['tokens_per_s']:,.0f} tokens/s, {1e3 * row['step']['median_s']:.1f} ms/step, "
              f"{row['memory']['total'] / 2**30:.2f} GiB")
      rows.append(row)
  moe = dict(experts=experts, top_k=top_k) if experts else {}
  return {"size": size, "parameters": gpt.parameter_count(gpt.config_for(size, **moe)),
          "batch": batch, "seq": seq, **moe, "rows": rows,
          "fp8_speedup_vs_bf16": _auto_speedup(rows)}


def _auto_speedup(rows) -> dict:
  """tokens/s of each FP8 recipe over bf16's, both with automatic attention."""
  auto = {r["recipe"]: r["tokens_per_s"] for r in rows
          if r["requested_backend"] == "auto" and "tokens_per_s" in r}
  if "bf16" not in auto:
    return {}
  return {recipe: tps / auto["bf16"] for recipe, tps in auto.items() if recipe != "bf16"}


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--smoke", action="store_true", help="tiny model, few steps (CPU)")
  parser.add_argument("--size", default="1b", choices=list(gpt.SIZES))
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--seq", type=int, default=None, help="default: the size's seq_len")
  parser.add_argument("--recipes", default="bf16,delayed")
  parser.add_argument("--backends", default="auto",
                      help="comma-separated attention backends; 'auto' lets fp8jax choose")
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--optimizer", default="adamw", help="adamw or adamw_fp8")
  parser.add_argument("--saved-activations", default="default", help="default or fp8")
  parser.add_argument("--experts", type=int, default=0,
                      help="each block's MLP a mixture of this many experts (0: dense)")
  parser.add_argument("--top-k", type=int, default=2, help="with --experts: experts per token")
  parser.add_argument("--out", default=None, help="JSON path (default: print only)")
  args = parser.parse_args(argv)
  if args.smoke:
    args.size, args.batch, args.seq, args.repeats = "tiny", 2, 128, 1
  seq = args.seq or gpt.SIZES[args.size].seq_len
  backends = [None if b == "auto" else b for b in args.backends.split(",")]
  report = {**environment(), "benchmark": "gpt_train_step", "smoke": args.smoke,
            "results": run(args.size, args.batch, seq, args.recipes.split(","), backends,
                           warmup=1 if args.smoke else 2, repeats=args.repeats,
                           steps_per_sample=1 if args.smoke else 3,
                           optimizer=args.optimizer,
                           saved_activations=args.saved_activations,
                           experts=args.experts, top_k=args.top_k)}
  write_report(report, args.out)
  return report


if __name__ == "__main__":
  main()
