"""Tuning: time the Hopper attention kernels' variants in one call and pick the fastest.

    python -m benchmarks.attention --tune --out benchmarks/results/h100_attention_tuning.json
    python -m benchmarks.attention_speeds benchmarks/results/h100_attention.json \
        --tuning benchmarks/results/h100_attention_tuning.json      # writes the table

For bf16 and FP8 (per-tensor scales), causal and not, at the benchmark's shape, the
forward kernel is timed for each `HopperAttentionBlockSizes` forward variant (keys per
step, pipeline stages, ping-pong on or off, intra-warpgroup overlap on or off) and the
backward kernels (dQ and dK/dV) for each backward variant (keys per dQ step, queries per
dK/dV step, stages). The stage count
is shared by both passes, so the pick is the stage count with the least forward plus
backward time (the backward counts 2.5x the forward's FLOPs, as the benchmark does), each
pass at its fastest variant for it. Variants that do not fit (shared memory) or fail are
recorded with the reason; `--budget-s` stops the timing in time (defaults first, so the
default is always measured) and lists what was not reached.

`best` in the JSON is {precision: {mask: {head_dim: block sizes}}}: what
`benchmarks.attention_speeds --tuning` writes into fp8jax/ops/attention_speeds.json, which
`fp8jax.ops.attention_backend.tuned_block_sizes` reads and the Hopper backends run with.
"""
from __future__ import annotations

import dataclasses
import importlib
import itertools
import time

import jax
import jax.numpy as jnp

import pallas_kernels

try:
  from benchmarks.timing import median_seconds
except ImportError:  # run as a script from benchmarks/
  from timing import median_seconds

hopper = importlib.import_module("pallas_kernels.hopper_attention")
DEFAULT = pallas_kernels.HopperAttentionBlockSizes()
# (block_kv, num_stages, ping_pong, overlap): the default first, then what is most likely
# to win (FlashAttention-3's intra-warpgroup overlap wants 3 stages), then the rest.
_FIRST = [(DEFAULT.block_kv, DEFAULT.num_stages, DEFAULT.ping_pong, DEFAULT.overlap),
          (128, 3, True, True), (64, 3, True, True), (128, 2, True, True), (128, 2, False, False)]
FORWARD_VARIANTS = _FIRST + [v for v in itertools.product((128, 64), (2, 3, 4), (True, False),
                                                          (False, True)) if v not in _FIRST]
# (block_kv_dq, block_q_dkv, num_stages): the default first.
BACKWARD_VARIANTS = [(DEFAULT.block_kv_dq, DEFAULT.block_q_dkv, DEFAULT.num_stages)] + [
    v for v in itertools.product((64, 128), (64, 128), (2, 3))
    if v != (DEFAULT.block_kv_dq, DEFAULT.block_q_dkv, DEFAULT.num_stages)]
BACKWARD_FLOP_RATIO = 2.5


def forward_blocks(variant) -> pallas_kernels.HopperAttentionBlockSizes:
  block_kv, stages, ping_pong, overlap = variant
  return dataclasses.replace(DEFAULT, block_kv=block_kv, num_stages=stages, ping_pong=ping_pong,
                             overlap=overlap)


def backward_blocks(variant) -> pallas_kernels.HopperAttentionBlockSizes:
  block_kv_dq, block_q_dkv, stages = variant
  return dataclasses.replace(DEFAULT, block_kv_dq=block_kv_dq, block_q_dkv=block_q_dkv,
                             num_stages=stages)


def _passes(precision: str, causal: bool, q, k, v, g, interpret):
  """(forward(blocks) -> fn(), backward(blocks) -> fn()): jitted calls of one pass each."""
  if precision == "fp8":
    quantized = [pallas_kernels.quantize_gradient(x) for x in (q, k, v)]
    (q, dq), (k, dk), (v, dv) = quantized
    descales = (dq, dk, dv)

    def forward(blocks):
      fn = jax.jit(lambda q, k, v, *d: hopper.hopper_fp8_attention_forward(
          q, k, v, *d, causal=causal, block_sizes=blocks, interpret=interpret))
      return lambda: fn(q, k, v, *descales)
    out, _, lse2 = forward(DEFAULT)()

    def backward(blocks):
      fn = jax.jit(lambda q, k, v, out, lse2, g, *d: hopper.hopper_fp8_attention_backward(
          q, k, v, out, lse2, g, *d, causal=causal, block_sizes=blocks, interpret=interpret))
      return lambda: fn(q, k, v, out, lse2, g, *descales)
    return forward, backward

  def forward(blocks):
    fn = jax.jit(lambda q, k, v: hopper.hopper_bf16_attention_forward(
        q, k, v, causal=causal, block_sizes=blocks, interpret=interpret))
    return lambda: fn(q, k, v)
  out, lse2 = forward(DEFAULT)()

  def backward(blocks):
    fn = jax.jit(lambda q, k, v, out, lse2, g: hopper.hopper_bf16_attention_backward(
        q, k, v, out, lse2, g, causal=causal, block_sizes=blocks, interpret=interpret))
    return lambda: fn(q, k, v, out, lse2, g)
  return forward, backward


def _time(make, blocks, flops, repeats, warmup, deadline) -> dict:
  entry = {"blocks": dataclasses.asdict(blocks)}
  if time.perf_counter() > deadline:
    return {**entry, "skipped": "not reached: the tuning's time budget was spent"}
  try:
    timing = median_seconds(make(blocks), repeats=repeats, warmup=warmup)
  except Exception as error:  # noqa: BLE001 - a variant that does not fit says why
    return {**entry, "skipped": f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"}
  return {**entry, **timing, "tflops": flops / timing["median_s"] / 1e12}


def _best(forward: list, backward: list):
  """The block sizes of the fastest forward plus backward, per shared stage count."""
  candidates = []
  for stages in sorted({e["blocks"]["num_stages"] for e in forward + backward}):
    fwd = [e for e in forward if "median_s" in e and e["blocks"]["num_stages"] == stages]
    bwd = [e for e in backward if "median_s" in e and e["blocks"]["num_stages"] == stages]
    if fwd and bwd:
      f = min(fwd, key=lambda e: e["median_s"])
      b = min(bwd, key=lambda e: e["median_s"])
      blocks = dict(f["blocks"], block_kv_dq=b["blocks"]["block_kv_dq"],
                    block_q_dkv=b["blocks"]["block_q_dkv"])
      candidates.append((f["median_s"] + b["median_s"], blocks))
  return min(candidates, key=lambda c: c[0])[1] if candidates else None


def tune(batch, seq, heads, head_dim, masks, precisions, repeats, budget_s,
         forward_variants=None, backward_variants=None, interpret=False, warmup=1) -> dict:
  """Times every variant (module docstring); returns the tuning JSON's body."""
  deadline = time.perf_counter() + budget_s
  keys = jax.random.split(jax.random.key(0), 4)
  shape = (batch, seq, heads, head_dim)
  q, k, v, g = (jax.random.normal(key, shape, jnp.float32).astype(jnp.bfloat16) for key in keys)
  results, best = [], {}
  for precision, mask in itertools.product(precisions, masks):
    causal = mask == "causal"
    flops = 4 * batch * seq**2 * heads * head_dim * (0.5 if causal else 1.0)
    forward, backward = _passes(precision, causal, q, k, v, g, interpret)
    fwd = [_time(forward, forward_blocks(variant), flops, repeats, warmup, deadline)
           for variant in forward_variants or FORWARD_VARIANTS]
    bwd = [_time(backward, backward_blocks(variant), BACKWARD_FLOP_RATIO * flops, repeats,
                 warmup, deadline) for variant in backward_variants or BACKWARD_VARIANTS]
    chosen = _best(fwd, bwd)
    if chosen is not None:
      best.setdefault(precision, {}).setdefault(mask, {})[str(head_dim)] = chosen
    results.append({"precision": precision, "mask": mask, "forward": fwd, "backward": bwd,
                    "best": chosen})
    print(f"tune {precision} {mask}: best {chosen}", flush=True)
  return {"batch": batch, "seq": seq, "heads": heads, "head_dim": head_dim,
          "budget_s": budget_s, "results": results, "best": best}
