"""Benchmark: fp8_dense forward+backward vs the same dense layer in bf16.

Times one jitted forward+backward of y = x @ kernel (M = K = N) including all
FP8 work: amax reductions, quantization, the three FP8 GEMMs and the meta
update (begin/end of a step), for delayed and current scaling, next to the
same computation in bf16. FLOPs counted: 3 GEMMs x 2*M*N*K.

    python -m benchmarks.dense                  # GPU: sizes 2048, 4096, 8192
    python -m benchmarks.dense --smoke          # CPU: tiny sizes, proves it runs
    python -m benchmarks.dense --out benchmarks/results/h100_dense.json

Target on an H100: fp8 >= 1.6x bf16 at 8192 (2x is the hardware limit).
"""
from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
from tqdm import tqdm

import fp8jax

try:
  from benchmarks.timing import environment, median_seconds, write_report
except ImportError:  # run as a script from benchmarks/
  from timing import environment, median_seconds, write_report


def bf16_step(x, kernel, g):
  y, vjp = jax.vjp(lambda x, k: x @ k, x, kernel)
  return y, vjp(g)


def fp8_step(x, kernel, g, meta):
  meta = fp8jax.begin_step(meta)
  (y, meta), vjp = jax.vjp(lambda x, k, m: fp8jax.fp8_dense(x, k, None, m), x, kernel, meta)
  dx, dk, meta_cotangent = vjp((g, jax.tree.map(jnp.zeros_like, meta)))
  return y, (dx, dk), fp8jax.close_step(meta, meta_cotangent)


def run(sizes, repeats, calls_per_sample=10):
  results = []
  for n in tqdm(sizes, desc="sizes"):
    keys = jax.random.split(jax.random.key(n), 3)
    x, kernel, g = (jax.random.normal(k, (n, n), jnp.bfloat16) for k in keys)
    flops = 3 * 2 * n**3
    row = {"M": n, "K": n, "N": n, "dtype": "bfloat16", "flops": flops}
    timed = {"bf16": (jax.jit(bf16_step), (x, kernel, g))}
    for name, recipe in (("fp8_delayed", fp8jax.DelayedScaling()),
                         ("fp8_current", fp8jax.CurrentScaling())):
      timed[name] = (jax.jit(fp8_step), (x, kernel, g, fp8jax.init_dot_meta(recipe)))
    for name, (fn, args) in timed.items():
      stats = median_seconds(fn, *args, repeats=repeats, calls_per_sample=calls_per_sample)
      row[name] = {**stats, "tflops": flops / stats["median_s"] / 1e12}
    for name in ("fp8_delayed", "fp8_current"):
      row[f"{name}_speedup_vs_bf16"] = row["bf16"]["median_s"] / row[name]["median_s"]
    results.append(row)
    print(f"M=K=N={n}: bf16 {row['bf16']['tflops']:.1f} TFLOP/s, "
          f"fp8 delayed {row['fp8_delayed']['tflops']:.1f} ({row['fp8_delayed_speedup_vs_bf16']:.2f}x), "
          f"fp8 current {row['fp8_current']['tflops']:.1f} ({row['fp8_current_speedup_vs_bf16']:.2f}x)")
  return results


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--smoke", action="store_true", help="tiny sizes, few repeats (CPU)")
  parser.add_argument("--sizes", type=int, nargs="*", default=[2048, 4096, 8192])
  parser.add_argument("--repeats", type=int, default=50)
  parser.add_argument("--out", default=None, help="JSON path (default: print only)")
  args = parser.parse_args(argv)
  sizes, repeats, calls = ([128, 256], 3, 1) if args.smoke else (args.sizes, args.repeats, 10)
  report = {**environment(), "benchmark": "dense_fwd_bwd", "smoke": args.smoke,
            "results": run(sizes, repeats, calls)}
  write_report(report, args.out)
  return report


if __name__ == "__main__":
  main()
