"""Benchmark: fused attention (bf16 and FP8) vs XLA, cuDNN and plain jnp, forward and backward.

Default shapes follow the attention targets: B*S = 16k tokens, H*D = 2048,
S = 4096, D = 128, non-causal. Forward TFLOP/s = 4*B*S^2*H*D / t_fwd; backward
TFLOP/s = 10*B*S^2*H*D / t_bwd (2.5x the forward's FLOPs, the usual
FlashAttention count), with t_bwd = t(forward+backward) - t(forward).

    python -m benchmarks.attention                       # GPU, default shapes
    python -m benchmarks.attention --smoke               # CPU: tiny shapes, interpreter
    python -m benchmarks.attention --out benchmarks/results/h100_attention.json

Implementations (each skipped with a note where it cannot run here):
  pallas_bf16         fp8jax.attention, fused Pallas kernel
  pallas_fp8          fp8jax.fp8_attention, fused Pallas kernel (Triton-lowered)
  hopper_fp8          fp8jax.fp8_attention on the Mosaic GPU FP8-wgmma kernel (Hopper only)
  xla, cudnn          jax.nn.dot_product_attention(implementation=...)
  jnp_reference       softmax(q k^T) v written in jnp
"""
from __future__ import annotations

import argparse
import math

import jax
import jax.numpy as jnp
from tqdm import tqdm

import fp8jax

try:
  from benchmarks.timing import environment, median_seconds, write_report
except ImportError:  # run as a script from benchmarks/
  from timing import environment, median_seconds, write_report


def jnp_reference(q, k, v, causal):
  logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
  if causal:
    logits = jnp.where(jnp.tril(jnp.ones(logits.shape[-2:], bool)), logits, -jnp.inf)
  return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits.astype(jnp.float32), -1).astype(q.dtype), v)


def implementations(causal):
  recipe = fp8jax.DelayedScaling()
  meta = fp8jax.init_attention_meta(recipe)

  def fp8(backend):
    return lambda q, k, v: fp8jax.fp8_attention(q, k, v, meta, causal=causal, backend=backend)[0]

  return {
      "pallas_bf16": lambda q, k, v: fp8jax.attention(q, k, v, causal=causal, backend="pallas"),
      "pallas_fp8": fp8("pallas"),
      "hopper_fp8": fp8("pallas_hopper_fp8"),
      "xla": lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal,
                                                          implementation="xla"),
      "cudnn": lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal,
                                                            implementation="cudnn"),
      "jnp_reference": lambda q, k, v: jnp_reference(q, k, v, causal),
  }


def forward_and_backward(fn):
  def step(q, k, v, g):
    out, vjp = jax.vjp(fn, q, k, v)
    return out, vjp(g)
  return step


def run(batch, seq, heads, head_dim, causal, repeats, only):
  keys = jax.random.split(jax.random.key(0), 4)
  shape = (batch, seq, heads, head_dim)
  q, k, v, g = (jax.random.normal(key, shape, jnp.float32).astype(jnp.bfloat16) for key in keys)
  flops = 4 * batch * seq**2 * heads * head_dim * (0.5 if causal else 1.0)
  rows = {}
  for name, fn in tqdm(implementations(causal).items(), desc="implementations"):
    if only and name not in only:
      continue
    try:
      fwd = median_seconds(jax.jit(fn), q, k, v, repeats=repeats)
      both = median_seconds(jax.jit(forward_and_backward(fn)), q, k, v, g, repeats=repeats)
    except Exception as error:  # noqa: BLE001 - record why an implementation cannot run here
      rows[name] = {"skipped": f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"}
      print(f"{name:14s} skipped: {rows[name]['skipped']}")
      continue
    bwd_s = max(both["median_s"] - fwd["median_s"], 1e-12)
    rows[name] = {"forward": {**fwd, "tflops": flops / fwd["median_s"] / 1e12},
                  "forward_backward": both,
                  "backward_s": bwd_s, "backward_tflops": 2.5 * flops / bwd_s / 1e12}
    print(f"{name:14s} fwd {rows[name]['forward']['tflops']:7.1f} TFLOP/s   "
          f"bwd {rows[name]['backward_tflops']:7.1f} TFLOP/s")
  return {"batch": batch, "seq": seq, "heads": heads, "head_dim": head_dim, "causal": causal,
          "dtype": "bfloat16", "forward_flops": flops, "implementations": rows}


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--smoke", action="store_true", help="tiny shapes, few repeats (CPU)")
  parser.add_argument("--batch", type=int, default=4)
  parser.add_argument("--seq", type=int, default=4096)
  parser.add_argument("--heads", type=int, default=16)
  parser.add_argument("--head-dim", type=int, default=128)
  parser.add_argument("--causal", action="store_true")
  parser.add_argument("--repeats", type=int, default=20)
  parser.add_argument("--only", nargs="*", default=None, help="implementation names to run")
  parser.add_argument("--out", default=None, help="JSON path (default: print only)")
  args = parser.parse_args(argv)
  if args.smoke:
    args.batch, args.seq, args.heads, args.head_dim, args.repeats = 1, 128, 2, 64, 2
  report = {**environment(), "benchmark": "attention", "smoke": args.smoke,
            "results": run(args.batch, args.seq, args.heads, args.head_dim, args.causal,
                           args.repeats, args.only)}
  write_report(report, args.out)
  return report


if __name__ == "__main__":
  main()
