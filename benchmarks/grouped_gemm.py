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
kernel shows as wrong. The FP8 speedups are over the faster of the two bf16 rows that ran
("best_bf16"). Targets (issue: FP8 MoE): fp8_tensor >= 1.6x bf16 and >= 1000 TFLOP/s;
fp8_block >= 1.4x and >= 900 TFLOP/s (`TARGETS`; each row says whether it met them).
XLA's expansion needs an [M, G K] copy of x: where that would not fit comfortably in the
GPU's memory (32 experts) its row says so instead of running.

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
# JAX's tuned configuration of its bf16 kernel (ragged_dot_mgpu's own sweep), the one the
# MoE layers' bf16 expert GEMMs (fp8jax.bf16_ragged_dot) run it with.
from fp8jax.ops.bf16_ragged_dot import MOSAIC_BLOCKS

try:
  from benchmarks.timing import environment, median_seconds, write_report
except ImportError:  # run as a script from benchmarks/
  from timing import environment, median_seconds, write_report

E4M3 = jnp.float8_e4m3fn
SHAPES = [(experts, k, n) for experts in (8, 32) for k, n in ((7168, 2048), (2048, 7168))]
ROWS_PER_EXPERT = 4096
# name: (least speedup over the best bf16 grouped GEMM, least TFLOP/s)
TARGETS = {"fp8_tensor": (1.6, 1000.0), "fp8_block": (1.4, 900.0)}
_EXPANSION_BYTES_LIMIT = 16e9


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


def _exact(x, w, sizes):
  """float32 ragged product of the unquantized operands, one slice per expert (lax.ragged_dot
  would expand G-fold: more memory than a GPU has at 32 experts)."""
  rows, start = [], 0
  for g, size in enumerate(jax.device_get(sizes).tolist()):
    rows.append(x[start:start + size].astype(jnp.float32) @ w[g].astype(jnp.float32))
    start += size
  tail = jnp.zeros((x.shape[0] - start, w.shape[2]), jnp.float32)
  return jnp.concatenate(rows + [tail])


def _relative_error(y, want):
  y, want = y.astype(jnp.float32), want.astype(jnp.float32)
  return float(jnp.linalg.norm(y - want) / jnp.linalg.norm(want))


def run(shapes, rows_per_expert, repeats, smoke, skip_fp8_kernels: str | None = None):
  """The rows, one per shape; `skip_fp8_kernels`: a reason not to run the FP8 kernels
  (their rows say it instead), e.g. that their GPU tests did not pass."""
  results = []
  on_gpu = jax.default_backend() == "gpu"
  for experts, k, n in tqdm(shapes, desc="shapes"):
    x, w, sizes = _operands(experts, k, n, rows_per_expert)
    m = x.shape[0]
    flops = 2 * m * k * n
    row = {"experts": experts, "M": m, "K": k, "N": n, "flops": flops}
    fp8_ops = {"fp8_tensor": (_fp8_tensor(x, w), "tensor"),
               "fp8_block": (_fp8_block(x, w), "block")}
    timed = {}
    expansion_bytes = m * experts * k * x.dtype.itemsize
    if expansion_bytes <= _EXPANSION_BYTES_LIMIT:
      timed["xla_bf16"] = (jax.jit(jax.lax.ragged_dot), (x, w, sizes), None)
    else:
      row["xla_bf16"] = {"skipped": f"XLA's dense expansion needs a {expansion_bytes / 1e9:.0f} "
                                    "GB copy of x"}
    if on_gpu:
      from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu
      timed["bf16"] = (jax.jit(lambda x, w, s: ragged_dot_mgpu.ragged_dot(
          x, w, group_sizes=s, **MOSAIC_BLOCKS)), (x, w, sizes), None)
    grouped = pallas_kernels.ragged_matmul if on_gpu else pallas_kernels.ragged_matmul_reference
    for name, ((x8, w8t, xd, wd), mode) in fp8_ops.items():
      if skip_fp8_kernels:
        row[name] = {"skipped": skip_fp8_kernels}
        continue
      kernel = jax.jit(lambda a, b, s, ad, bd, mode=mode: grouped(
          a, b, s, ad, bd, scale_mode=mode, out_dtype=jnp.bfloat16))
      timed[name] = (kernel, (x8, w8t, sizes, xd, wd),
                     _reference(x8, w8t, sizes, xd, wd, mode))
    exact = _exact(x, w, sizes)
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
    ran = [name for name in ("bf16", "xla_bf16") if "median_s" in row.get(name, {})]
    if ran:
      best = min(ran, key=lambda name: row[name]["median_s"])
      row["best_bf16"] = best
      for name, (speedup, tflops) in TARGETS.items():
        if "median_s" in row.get(name, {}):
          row[f"{name}_speedup_vs_bf16"] = row[best]["median_s"] / row[name]["median_s"]
          row[f"{name}_meets_target"] = (row[f"{name}_speedup_vs_bf16"] >= speedup
                                         and row[name]["tflops"] >= tflops)
    results.append(row)
  return results


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--smoke", action="store_true", help="tiny shapes, few repeats (CPU)")
  parser.add_argument("--repeats", type=int, default=20)
  parser.add_argument("--out", default=None, help="JSON path (default: print only)")
  parser.add_argument("--skip-fp8-kernels", metavar="REASON", default=None,
                      help="time the bf16 rows only, the FP8 rows saying REASON (the GPU "
                           "check passes this when the kernels' GPU tests did not pass)")
  args = parser.parse_args(argv)
  if args.smoke:
    shapes, rows, repeats = [(4, 256, 128)], 64, 2
  else:
    shapes, rows, repeats = SHAPES, ROWS_PER_EXPERT, args.repeats
  report = {**environment(), "benchmark": "grouped_gemm", "smoke": args.smoke,
            "validated_on_gpu_before": pallas_kernels.RAGGED_GEMM_VALIDATED_ON_GPU,
            "results": run(shapes, rows, repeats, args.smoke, args.skip_fp8_kernels)}
  for row in report["results"]:
    print({k: (round(v["tflops"], 1) if isinstance(v, dict) and "tflops" in v else v)
           for k, v in row.items()})
  write_report(report, args.out)
  return report


if __name__ == "__main__":
  main()
