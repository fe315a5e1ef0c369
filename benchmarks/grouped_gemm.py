"""Benchmark: fp8jax's grouped FP8 GEMMs (MoE experts) vs the best bf16 grouped GEMM in JAX.

At DeepSeek-like expert shapes (8 and 32 experts, K=7168 N=2048 and K=2048 N=7168, 4096
rows per expert), one grouped GEMM `y = ragged_dot(x, w, group_sizes)`:

  bf16        JAX's own Mosaic GPU grouped GEMM for Hopper
              (jax.experimental.pallas.ops.gpu.ragged_dot_mgpu), bf16 operands
  xla_bf16    jax.lax.ragged_dot in bf16 (XLA's G-fold dense expansion), for reference
  fp8_tensor  pallas_kernels.ragged_matmul, E4M3 operands, per-tensor x and per-expert w
              descales in the epilogue
  fp8_block   the same kernel with DeepSeek-V3's 1x128 / 128x128 block descales promoted
              per 128 of K

Each row records seconds (median over repeats), TFLOP/s (2 M K N / t) and the relative
error against a float32 product of the same (dequantized) operands, so a fast wrong
kernel shows as wrong. Targets (issue: FP8 MoE): fp8_tensor >= 1.6x bf16 and >= 1000
TFLOP/s; fp8_block >= 1.4x and >= 900 TFLOP/s.

    python -m benchmarks.grouped_gemm --out benchmarks/results/h100_grouped_gemm.json
    python -m benchmarks.grouped_gemm --smoke        # CPU: tiny shapes, the jnp paths
"""
from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
from tqdm import tqdm

import fp8jax  # noqa: F401  (first: keeps JAX's CUDA plugin quiet where there is no GPU)
import pallas_kernels

try:
  from benchmarks.timing import environment, median_seconds, write_report
except ImportError:  # run as a script from benchmarks/
  from timing import environment, median_seconds, write_report

E4M3 = jnp.float8_e4m3fn
SHAPES = [(experts, k, n) for experts in (8, 32) for k, n in ((7168, 2048), (2048, 7168))]
ROWS_PER_EXPERT = 4096


def _operands(experts, k, n, rows_per_expert):
  keys = jax.random.split(jax.random.key(experts * k + n), 2)
  m = experts * rows_per_expert
  x = jax.random.normal(keys[0], (m, k), jnp.bfloat16)
  w = (jax.random.normal(keys[1], (experts, k, n), jnp.float32) * k ** -0.5).astype(
      jnp.bfloat16)
  # Uneven loads, as a router gives: sizes around rows_per_expert, summing to M.
  sizes = jnp.full((experts,), rows_per_expert, jnp.int32)
  sizes = sizes.at[::2].add(rows_per_expert // 4).at[1::2].add(-(rows_per_expert // 4))
  return x, w, sizes


def _fp8_tensor(x, w):
  x_scale = 448.0 / jnp.max(jnp.abs(x.astype(jnp.float32)))
  w_scale = 448.0 / jnp.max(jnp.abs(w.astype(jnp.float32)), axis=(1, 2))
  x8 = (x.astype(jnp.float32) * x_scale).astype(E4M3)
  w8t = jnp.swapaxes((w.astype(jnp.float32) * w_scale[:, None, None]).astype(E4M3), 1, 2)
  return x8, w8t, 1.0 / x_scale, 1.0 / w_scale


def _fp8_block(x, w):
  m, k = x.shape
  xb = x.astype(jnp.float32).reshape(m, k // 128, 128)
  x_scale = 448.0 / jnp.maximum(jnp.max(jnp.abs(xb), axis=2), 1e-30)      # [M, K/128]
  x8 = (xb * x_scale[..., None]).astype(E4M3).reshape(m, k)
  g, _, n = w.shape
  wb = w.astype(jnp.float32).reshape(g, k // 128, 128, n // 128, 128)
  w_scale = 448.0 / jnp.maximum(jnp.max(jnp.abs(wb), axis=(2, 4)), 1e-30)  # [G, K/128, N/128]
  w8 = (wb * w_scale[:, :, None, :, None]).astype(E4M3).reshape(g, k, n)
  return x8, jnp.swapaxes(w8, 1, 2), 1.0 / x_scale, jnp.swapaxes(1.0 / w_scale, 1, 2)


def _reference(x8, w8t, sizes, x_descale, w_descale, mode):
  """float32 ragged product of the dequantized FP8 operands (the kernel's job)."""
  return pallas_kernels.ragged_matmul_reference(x8, w8t, sizes, x_descale, w_descale,
                                                scale_mode=mode, out_dtype=jnp.float32)


def _relative_error(y, want):
  y, want = y.astype(jnp.float32), want.astype(jnp.float32)
  return float(jnp.linalg.norm(y - want) / jnp.linalg.norm(want))


def run(shapes, rows_per_expert, repeats, smoke):
  results = []
  on_gpu = jax.default_backend() == "gpu"
  for experts, k, n in tqdm(shapes, desc="shapes"):
    x, w, sizes = _operands(experts, k, n, rows_per_expert)
    m = x.shape[0]
    flops = 2 * m * k * n
    row = {"experts": experts, "M": m, "K": k, "N": n, "flops": flops}
    fp8_ops = {"fp8_tensor": (_fp8_tensor(x, w), "tensor"),
               "fp8_block": (_fp8_block(x, w), "block")}
    timed = {"xla_bf16": (jax.jit(jax.lax.ragged_dot), (x, w, sizes), None)}
    if on_gpu:
      from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu
      timed["bf16"] = (jax.jit(lambda x, w, s: ragged_dot_mgpu.ragged_dot(
          x, w, s, block_m=128, block_n=128, block_k=64, max_concurrent_steps=4,
          grid_block_n=1)), (x, w, sizes), None)
    grouped = pallas_kernels.ragged_matmul if on_gpu else pallas_kernels.ragged_matmul_reference
    for name, ((x8, w8t, xd, wd), mode) in fp8_ops.items():
      kernel = jax.jit(lambda a, b, s, ad, bd, mode=mode: grouped(
          a, b, s, ad, bd, scale_mode=mode, out_dtype=jnp.bfloat16))
      timed[name] = (kernel, (x8, w8t, sizes, xd, wd),
                     _reference(x8, w8t, sizes, xd, wd, mode))
    exact = jax.lax.ragged_dot(x.astype(jnp.float32), w.astype(jnp.float32), sizes)
    for name, (fn, args, want) in timed.items():
      try:
        stats = median_seconds(fn, *args, repeats=repeats, calls_per_sample=1 if smoke else 5)
      except Exception as error:  # noqa: BLE001 - a kernel that cannot run here is a row
        row[name] = {"error": f"{type(error).__name__}: {str(error)[:300]}"}
        continue
      y = fn(*args)
      row[name] = {**stats, "tflops": flops / stats["median_s"] / 1e12,
                   # against the same FP8 operands (the kernel's arithmetic) and against
                   # the unquantized bf16 product (what FP8 costs in accuracy)
                   "error_vs_same_operands": _relative_error(y, want) if want is not None
                   else _relative_error(y, exact),
                   "error_vs_unquantized": _relative_error(y, exact)}
    baseline = row.get("bf16", row.get("xla_bf16"))
    for name in ("fp8_tensor", "fp8_block"):
      if "median_s" in row.get(name, {}) and "median_s" in baseline:
        row[f"{name}_speedup_vs_bf16"] = baseline["median_s"] / row[name]["median_s"]
    results.append(row)
  return results


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--smoke", action="store_true", help="tiny shapes, few repeats (CPU)")
  parser.add_argument("--repeats", type=int, default=20)
  parser.add_argument("--out", default=None, help="JSON path (default: print only)")
  args = parser.parse_args(argv)
  if args.smoke:
    shapes, rows, repeats = [(4, 256, 128)], 64, 2
  else:
    shapes, rows, repeats = SHAPES, ROWS_PER_EXPERT, args.repeats
  report = {**environment(), "benchmark": "grouped_gemm", "smoke": args.smoke,
            "validated_on_gpu_before": pallas_kernels.RAGGED_GEMM_VALIDATED_ON_GPU,
            "results": run(shapes, rows, repeats, args.smoke)}
  for row in report["results"]:
    print({k: (round(v["tflops"], 1) if isinstance(v, dict) and "tflops" in v else v)
           for k, v in row.items()})
  write_report(report, args.out)
  return report


if __name__ == "__main__":
  main()
