"""The demo GPT's mixture-of-experts train step compiled for an H100 (deviceless): what its
expert GEMMs are, in FP8 and in the bf16 baseline FP8 is compared with.

The tiny GPT with 4 experts, top 2, batch 16 x 128 tokens: each of its n_layers blocks
has two grouped matmuls (w_in [4, 128, 512], w_out [4, 512, 128]) of M = 16 x 128 x 2 =
4096 sorted rows, each with three GEMMs (fprop, dgrad, wgrad). Its layers are unrolled
(`scan_unroll` = n_layers), so every layer's GEMMs are in the program.

* FP8 (delayed scaling): every expert GEMM is a grouped FP8 kernel (E4M3 operands) or a
  cuBLASLt FP8 GEMM; none is bf16, none a dense expansion.
* bf16: every expert GEMM is one of JAX's Mosaic GPU grouped kernels (`fp8jax.bf16_ragged_dot`),
  not XLA's dense expansion of `lax.ragged_dot`, which would multiply each row by all 4
  experts; `fp8jax inspect` and `fp8jax cost` know them, and the cost model charges each
  the FLOPs of one dense GEMM over its rows at the bf16 rate, as it charges the FP8 ones
  at the FP8 rate: both steps do the same expert FLOPs.
"""
import jax
import pytest

import run_once

from fp8jax import deviceless, lowering
from fp8jax.lowering import ExpertPath, GemmKind
from fp8jax.runs import gpt_program

_MISSING = deviceless.deviceless_toolchain_missing()
pytestmark = [pytest.mark.hopper,
              pytest.mark.skipif(_MISSING is not None, reason=str(_MISSING))]

EXPERTS, TOP_K, BATCH, SEQ = 4, 2, 16, 128


def _program(recipe: str) -> gpt_program.GptProgram:
  return gpt_program.GptProgram(size="tiny", batch=BATCH, seq=SEQ, recipe=recipe,
                                experts=EXPERTS, top_k=TOP_K)


@pytest.fixture(scope="module", params=["delayed", "bf16"])
def compiled(request):
  """(program, optimized HLO) of the step under `request.param`'s recipe."""
  program = _program(request.param)
  # Once per test run and recipe: the two workers may split this file's tests.
  return program, run_once.shared(f"gpt_moe_lowering_{request.param}",
                                  lambda _: _optimized_hlo(program))[1]


def _optimized_hlo(program) -> str:
  step, args = gpt_program.train_step(program)
  with jax.set_mesh(deviceless.h100_mesh(x=1)):
    return deviceless.compile_for_h100(
        step, *args, compiler_options=lowering.CUBLAS_ONLY_OPTIONS).as_text()


def _expert_gemm_flops(config) -> int:
  """2 M K N for each of the 3 GEMMs of each of the 2 grouped matmuls of each layer, each
  row with its own expert only."""
  rows = BATCH * SEQ * TOP_K
  per_layer = 3 * (2 * rows * config.d_model * config.d_ff + 2 * rows * config.d_ff
                   * config.d_model)
  return config.n_layers * per_layer


def test_every_expert_gemm_is_a_grouped_kernel_of_the_steps_precision_never_an_expansion(
    compiled):
  program, hlo = compiled
  config = program.config()
  # The layers unrolled (scan_unroll None: all of them): every layer's GEMMs are in the HLO.
  assert (config.scan_unroll or config.n_layers) >= config.n_layers
  report = lowering.inspect_hlo(hlo)
  experts = report.expert_gemms()
  assert len(experts) == 3 * 2 * config.n_layers, str(report)
  assert not any(g.expert_path is ExpertPath.DENSE_EXPANSION for g in experts), str(report)
  if program.recipe == "bf16":
    assert all(g.kind is GemmKind.GROUPED and g.expert_path is ExpertPath.GROUPED_KERNEL
               and g.operand_dtypes == ("bf16", "bf16") for g in experts), str(report)
  else:
    assert all(g.runs_in_fp8 and g.operand_dtypes == ("f8e4m3fn", "f8e4m3fn") and (
        (g.kind is GemmKind.GROUPED and g.expert_path is ExpertPath.GROUPED_KERNEL)
        or g.kind is GemmKind.CUBLASLT_FP8) for g in experts), str(report)
    assert sorted(g.role for g in experts) == sorted(
        ["fprop", "dgrad", "wgrad"] * 2 * config.n_layers), str(report)


def test_the_cost_model_charges_each_expert_gemm_one_dense_gemm_at_its_precisions_rate(
    compiled):
  program, hlo = compiled
  costs = lowering.cost_hlo(hlo)
  grouped = [k for k in costs.kernels if k.grouped_kernel]
  dtype = "bf16" if program.recipe == "bf16" else "f8e4m3fn"
  layers = program.config().n_layers
  # Per layer: fprop and dgrad of both matmuls in the ragged form, their wgrads transposed.
  names = (["ragged_dot_mgpu"] * 4 + ["transposed_ragged_dot_mgpu"] * 2 if dtype == "bf16"
           else ["ragged_matmul"] * 4 + ["transposed_ragged_matmul"] * 2)
  assert sorted(k.grouped_kernel for k in grouped) == sorted(names * layers), costs.table()
  assert sum(k.flops for k in grouped) == _expert_gemm_flops(program.config())
  for k in grouped:
    assert k.category == "gemm" and k.gemm_dtype == dtype, k
    assert k.time_s == pytest.approx(
        costs.constants.kernel_time(k.flops, k.bytes_in + k.bytes_out, dtype) * k.launches,
        rel=1e-12), k
