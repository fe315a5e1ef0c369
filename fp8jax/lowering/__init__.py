"""Proves the Hopper lowering: which GEMMs of a compiled function run in FP8.

    from fp8jax import lowering
    report = lowering.inspect(train_step, params, opt_state, fp8_state, batch,
                              compiler_options=lowering.CUBLAS_ONLY_OPTIONS)
    print(report)            # one row per GEMM, then how each operand was produced
    assert report.all_fp8    # every GEMM is __cublas$lt$matmul$f8

Without a GPU the function is compiled for an H100 SXM ("deviceless", needs the
'hopper' extra); with a GPU backend, for the local device. `fp8jax inspect`
(or `python -m fp8jax.lowering`) does the same from the command line.

What XLA does with fp8jax's GEMMs (jax 0.10.2, deviceless sm_90a):

* With `xla_gpu_enable_triton_gemm=False` every fprop, dgrad and wgrad GEMM of
  `fp8_dense` / `fp8_einsum` is `__cublas$lt$matmul$f8`, 2-D or batched input.
  Dims that are not multiples of 16 (which cuBLASLt FP8 needs) are padded by
  XLA in FP8, and the GEMM's output is sliced.
* With XLA's default flags (and no autotuner, as deviceless) Triton takes every
  FP8 GEMM. Its HLO operands stay FP8, but the kernel widens them to f16 in
  registers (`mma.sync...f16.f16`, no FP8 `wgmma`): not FP8 tensor cores. On an
  H100 the autotuner chose cuBLASLt FP8 for all of them (jax 0.11.2); only the
  flag makes it certain.
* cuBLASLt FP8 on Hopper takes "TN" operands: the contracted dim innermost in
  memory. For `y = x @ W` (x [M, K], W [K, N], g = dy [M, N]) that needs
  fprop: W^T; dgrad (g @ W^T): nothing; wgrad (x^T @ g): x^T and g^T. On a GPU
  fp8jax's cast-transpose-amax kernel writes each of them in the pass that
  quantizes the tensor (`Transpose.in_quantize`); XLA on its own added separate
  f8 transposes for dgrad's W and wgrad's g^T.
* Grouped matmuls (MoE experts): `fp8_ragged_dot`'s three GEMMs are fp8jax's grouped
  FP8 Mosaic GPU kernels (`GemmKind.GROUPED`, recognized by name and shape in
  `fp8jax.lowering.grouped_gemms`); XLA's own `lax.ragged_dot` is a dense expansion
  (every row against every expert: G times the FLOPs); where the kernels do not tile the
  shapes, the jnp twin is a loop of per-tile cuBLASLt FP8 GEMMs. `Gemm.expert_path` says
  which, and the cost model charges a grouped kernel one dense GEMM's FLOPs.
* `xla_allow_excess_precision` (on by default) lets XLA drop a cast to FP8 that
  is followed by a widening cast: `dequantize(quantize(x))` then does no FP8
  rounding at all on GPU.

The cost model reads the same optimized HLO and predicts the program's time on
an H100 kernel by kernel: a roofline `max(GEMM FLOPs / rate, bytes / HBM
bandwidth)` plus a fixed cost per kernel launch, summed over the kernels (loop
bodies times their trip count). The machine constants are `CostConstants`
(measured H100 SXM defaults; `H200` the H200's, fitted to whole train steps;
`CHIP_CONSTANTS` by chip name; override them for another GPU):

    fp8 = lowering.cost(fp8_step, *fp8_args)          # a CostReport; print(fp8) for its table
    bf16 = lowering.cost(bf16_step, *bf16_args)
    print(lowering.compare(fp8, bf16))                # .speedup: bf16 time / FP8 time

`example_train_step(precision="bf16")` is the built-in example's bf16 twin, and
`fp8jax cost` compares the two. It is a model, not a measurement: it counts
each kernel's minimum traffic and ignores overlap, caches and tile effects.
"""
from fp8jax import platform_guard as _platform_guard  # noqa: F401  (before any backend use)
from fp8jax.lowering.cost import (CHIP_CONSTANTS, H200, CostComparison, CostConstants,
                                  CostReport, KernelCost, compare, cost, cost_hlo)
from fp8jax.lowering.example import example_train_step
from fp8jax.lowering.inspection import CUBLAS_ONLY_OPTIONS, inspect, inspect_hlo
from fp8jax.lowering.report import (Convert, ExpertPath, Gemm, GemmKind, LoweringReport,
                                    Operand, Transpose)

__all__ = [
    "inspect", "inspect_hlo", "CUBLAS_ONLY_OPTIONS", "example_train_step",
    "LoweringReport", "Gemm", "GemmKind", "ExpertPath", "Operand", "Transpose", "Convert",
    "cost", "cost_hlo", "compare", "CostConstants", "CostReport", "CostComparison", "KernelCost",
    "H200", "CHIP_CONSTANTS",
]
