"""Benchmark: fp8_dense forward+backward vs the same dense layer in bf16.

Times one jitted forward+backward of y = x @ kernel (M = K = N) including all
FP8 work: amax reductions, quantization, the three FP8 GEMMs and the meta
update (begin/end of a step), for delayed and current scaling, next to the
same computation in bf16. FLOPs counted: 3 GEMMs x 2*M*N*K.

    python -m benchmarks.dense                  # GPU: sizes 2048, 4096, 8192
    python -m benchmarks.dense --smoke          # CPU: tiny sizes, proves it runs
    python -m benchmarks.dense --out benchmarks/results/h100_dense.json

Target on an H100: fp8 >= 1.6x bf16 at 8192 (2x is the hardware limit).

Each step is timed twice: called back to back from Python (`median_s`: what a
training loop of one-layer steps sees; at 2048 the host's dispatch, about 200 us a
call, is slower than the GPU), and `--loop-steps` steps run inside one jitted call
(`<name>_in_loop`, per step: the GPU's time with the gaps it leaves between
kernels and no host in the way; the FP8 state threads from step to step). The
second is a device time for `fp8jax.lowering.cost` to predict at every size: cost
`steps_in_one_call(step, n, ...)` itself, whose loop also carries the state
(tests/test_cost_calibration.py holds the model to the measurements there are).
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


def steps_in_one_call(step, n_steps: int, threads_state: bool):
  """`n_steps` calls of `step` inside one jitted function (a device loop), the last
  one's outputs returned. With `threads_state` the last argument (the FP8 state) is
  replaced by the step's last output, as a training loop threads it."""

  def run(*args):
    def body(_, carry):
      # The barrier keeps XLA from hoisting a step whose inputs do not change out
      # of the loop: every iteration runs the whole step.
      args = jax.lax.optimization_barrier(carry[0])
      out = step(*args)
      return ((*args[:-1], out[-1]) if threads_state else args), out

    shapes = jax.eval_shape(step, *args)
    first = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    return jax.lax.fori_loop(0, n_steps, body, (args, first))[1]

  return jax.jit(run)


def run(sizes, repeats, calls_per_sample=10, loop_steps=20):
  results = []
  for n in tqdm(sizes, desc="sizes"):
    keys = jax.random.split(jax.random.key(n), 3)
    x, kernel, g = (jax.random.normal(k, (n, n), jnp.bfloat16) for k in keys)
    flops = 3 * 2 * n**3
    row = {"M": n, "K": n, "N": n, "dtype": "bfloat16", "flops": flops,
           "loop_steps": loop_steps}
    timed = {"bf16": (bf16_step, (x, kernel, g))}
    for name, recipe in (("fp8_delayed", fp8jax.DelayedScaling()),
                         ("fp8_current", fp8jax.CurrentScaling())):
      timed[name] = (fp8_step, (x, kernel, g, fp8jax.init_dot_meta(recipe)))
    for name, (step, args) in timed.items():
      stats = median_seconds(jax.jit(step), *args, repeats=repeats,
                             calls_per_sample=calls_per_sample)
      row[name] = {**stats, "tflops": flops / stats["median_s"] / 1e12}
      looped = steps_in_one_call(step, loop_steps, threads_state=name != "bf16")
      stats = median_seconds(looped, *args, repeats=repeats)
      stats = {k: (v / loop_steps if k.endswith("_s") else v) for k, v in stats.items()}
      row[f"{name}_in_loop"] = {**stats, "tflops": flops / stats["median_s"] / 1e12}
    for name in ("fp8_delayed", "fp8_current"):
      row[f"{name}_speedup_vs_bf16"] = row["bf16"]["median_s"] / row[name]["median_s"]
      row[f"{name}_in_loop_speedup_vs_bf16"] = (row["bf16_in_loop"]["median_s"]
                                                / row[f"{name}_in_loop"]["median_s"])
    results.append(row)
    print(f"M=K=N={n}: bf16 {row['bf16']['tflops']:.1f} TFLOP/s, "
          f"fp8 delayed {row['fp8_delayed']['tflops']:.1f} ({row['fp8_delayed_speedup_vs_bf16']:.2f}x), "
          f"fp8 current {row['fp8_current']['tflops']:.1f} ({row['fp8_current_speedup_vs_bf16']:.2f}x); "
          f"in one call: {row['fp8_delayed_in_loop_speedup_vs_bf16']:.2f}x, "
          f"{row['fp8_current_in_loop_speedup_vs_bf16']:.2f}x")
  return results


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--smoke", action="store_true", help="tiny sizes, few repeats (CPU)")
  parser.add_argument("--sizes", type=int, nargs="*", default=[2048, 4096, 8192])
  parser.add_argument("--repeats", type=int, default=50)
  parser.add_argument("--loop-steps", type=int, default=20,
                      help="steps per call for the in-one-call timing (default 20)")
  parser.add_argument("--out", default=None, help="JSON path (default: print only)")
  args = parser.parse_args(argv)
  sizes, repeats, calls, loop_steps = (([128, 256], 3, 1, 2) if args.smoke else
                                       (args.sizes, args.repeats, 10, args.loop_steps))
  report = {**environment(), "benchmark": "dense_fwd_bwd", "smoke": args.smoke,
            "results": run(sizes, repeats, calls, loop_steps)}
  write_report(report, args.out)
  return report


if __name__ == "__main__":
  main()
