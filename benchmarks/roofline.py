"""Benchmark: the machine constants behind `fp8jax cost`'s predictions, measured.

Measures, on the default device:
  hbm_bytes_per_s      a large elementwise pass (bytes read + bytes written) / time
  bf16_gemm_flops      x @ w in bfloat16 (bf16 out), M = K = N = size
  fp8_gemm_flops       e4m3 x e4m3 with both scales and a bf16 output, operands
                       already in the K-major layout cuBLASLt's FP8 GEMM reads
  kernel_overhead_s    time per kernel of a chain of tiny dependent reductions
                       (launch + scheduling gap; nothing to compute)

    python -m benchmarks.roofline --out benchmarks/results/h100_roofline.json
    python -m benchmarks.roofline --smoke          # CPU: tiny sizes, proves it runs
"""
from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

try:
  from benchmarks.timing import environment, median_seconds, write_report
except ImportError:  # run as a script from benchmarks/
  from timing import environment, median_seconds, write_report

_KERNEL_CHAIN = 200


def _hbm(n_bytes, repeats):
  x = jax.random.normal(jax.random.key(0), (n_bytes // 2,), jnp.bfloat16)
  stats = median_seconds(jax.jit(lambda x: x * 3 + 1), x, repeats=repeats, calls_per_sample=5)
  return {**stats, "bytes": 2 * n_bytes, "hbm_bytes_per_s": 2 * n_bytes / stats["median_s"]}


def _gemms(n, repeats):
  keys = jax.random.split(jax.random.key(n), 2)
  a, b = (jax.random.normal(k, (n, n), jnp.bfloat16) for k in keys)
  flops = 2 * n**3
  bf16 = median_seconds(jax.jit(lambda a, b: a @ b), a, b, repeats=repeats, calls_per_sample=5)
  qa, qb_t = a.astype(jnp.float8_e4m3fn), b.T.astype(jnp.float8_e4m3fn)

  def fp8(qa, qb_t, sa, sb):
    # Dequantize-then-dot with scalar scales: XLA folds both scales into the
    # cuBLASLt FP8 GEMM and writes bf16 directly.
    lhs = qa.astype(jnp.bfloat16) * sa.astype(jnp.bfloat16)
    rhs = qb_t.astype(jnp.bfloat16) * sb.astype(jnp.bfloat16)
    return jax.lax.dot_general(lhs, rhs, (((1,), (1,)), ((), ())),
                               preferred_element_type=jnp.bfloat16)

  scales = (jnp.float32(0.5), jnp.float32(0.25))
  f8 = median_seconds(jax.jit(fp8), qa, qb_t, *scales, repeats=repeats, calls_per_sample=5)
  return {"M": n, "K": n, "N": n, "flops": flops,
          "bf16": {**bf16, "tflops": flops / bf16["median_s"] / 1e12},
          "fp8": {**f8, "tflops": flops / f8["median_s"] / 1e12}}


def _kernel_overhead(repeats):
  def chain(x):
    for _ in range(_KERNEL_CHAIN):
      # A reduction cannot fuse with its own consumer: one kernel per link.
      x = x * 0.5 + jnp.max(x)
    return x
  x = jax.random.normal(jax.random.key(1), (16,), jnp.float32)
  stats = median_seconds(jax.jit(chain), x, repeats=repeats, calls_per_sample=5)
  return {**stats, "kernels": _KERNEL_CHAIN, "kernel_overhead_s": stats["median_s"] / _KERNEL_CHAIN}


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--smoke", action="store_true", help="tiny sizes, few repeats (CPU)")
  parser.add_argument("--sizes", type=int, nargs="*", default=[2048, 4096, 8192])
  parser.add_argument("--repeats", type=int, default=30)
  parser.add_argument("--out", default=None, help="JSON path (default: print only)")
  args = parser.parse_args(argv)
  sizes, repeats, hbm_bytes = (([128], 2, 1 << 20) if args.smoke
                               else (args.sizes, args.repeats, 1 << 30))
  hbm = _hbm(hbm_bytes, repeats)
  overhead = _kernel_overhead(repeats)
  gemms = [_gemms(n, repeats) for n in sizes]
  print(f"HBM {hbm['hbm_bytes_per_s'] / 1e12:.2f} TB/s; "
        f"{overhead['kernel_overhead_s'] * 1e6:.2f} us per tiny kernel")
  for g in gemms:
    print(f"GEMM {g['M']}^3: bf16 {g['bf16']['tflops']:.0f} TFLOP/s, fp8 {g['fp8']['tflops']:.0f} TFLOP/s")
  report = {**environment(), "benchmark": "roofline", "smoke": args.smoke,
            "results": {"hbm": hbm, "kernel_overhead": overhead, "gemms": gemms}}
  write_report(report, args.out)
  return report


if __name__ == "__main__":
  main()
