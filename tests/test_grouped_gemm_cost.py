"""Grouped (MoE expert) GEMM kernels in the cost model and the GEMM report.

A hand-written optimized-HLO module in the form XLA prints for Mosaic GPU calls (the
deviceless compiles of tests/test_ragged_dot_lowering.py check the same facts on programs
XLA really compiled): every expected FLOP, byte and microsecond below is counted by hand
from the shapes, independently of the reader.
"""
from __future__ import annotations

import dataclasses
import textwrap

import pytest

from fp8jax import lowering
from fp8jax.lowering import CostConstants, ExpertPath, GemmKind, cost_hlo, inspect_hlo
from fp8jax.lowering.grouped_gemms import UNNAMED

# Round numbers, so the expected times are easy to check by hand.
CONSTANTS = CostConstants(fp8_gemm_flops_per_s=2e15, bf16_gemm_flops_per_s=1e15,
                          f32_gemm_flops_per_s=5e14, hbm_bytes_per_s=2e12,
                          kernel_overhead_s=3e-6)
M, K, N, G = 8192, 4096, 2048, 8

# 0 fp8jax's fprop kernel (named by its scope), the operands fp8_ragged_dot gives it: the
#   schedule (int32), a [M, K] and b_t [G, N, K] in E4M3, the descales (f32);
# 1 JAX's bf16 kernel, w [G, K, N] as stored, named only by the source its module records;
# 2 a transposed (wgrad) kernel with token-major operands and no name anywhere;
# 3 a cast kernel (one matrix operand); 4 a dense block-scaled GEMM (no group operand,
#   rank-2 weights); 5 a call in a grouped scope whose shapes are no grouped GEMM's.
_MODULE = textwrap.dedent(f"""\
    HloModule jit_step, is_scheduled=true

    ENTRY %main (s: s32[{G}], a: f8e4m3fn[{M},{K}], bt: f8e4m3fn[{G},{N},{K}], d: f32[{G + 1}], x: bf16[{M},{K}], w: bf16[{G},{K},{N}], dy: bf16[{M},{N}]) -> (bf16[{M},{N}], bf16[{M},{N}], bf16[{G},{K},{N}], f8e4m3fn[{M},{K}], bf16[{M},{N}], bf16[{M},{K}]) {{
      %s = s32[{G}]{{0}} parameter(0)
      %a = f8e4m3fn[{M},{K}]{{1,0}} parameter(1)
      %bt = f8e4m3fn[{G},{N},{K}]{{2,1,0}} parameter(2)
      %d = f32[{G + 1}]{{0}} parameter(3)
      %x = bf16[{M},{K}]{{1,0}} parameter(4)
      %w = bf16[{G},{K},{N}]{{2,1,0}} parameter(5)
      %dy = bf16[{M},{N}]{{1,0}} parameter(6)
      %fprop = bf16[{M},{N}]{{1,0}} custom-call(%s, %a, %bt, %d), custom_call_target="mosaic_gpu_v2", api_version=API_VERSION_TYPED_FFI, metadata={{op_name="jit(step)/jvp(fp8_grouped_fprop)/cond/branch_0_fun/jit(_run)/ragged_matmul/entry/mpmd_map"}}, backend_config={{kernel_hash = "\\01", module = "ML\\EFR\\00entry_mosaic_gpu\\00"}}
      %bf16 = bf16[{M},{N}]{{1,0}} custom-call(%s, %x, %w), custom_call_target="mosaic_gpu_v2", api_version=API_VERSION_TYPED_FFI, metadata={{op_name="jit(step)/jvp()/body/mpmd_map"}}, backend_config={{kernel_hash = "\\02", module = "ML\\EFR\\00jax/experimental/pallas/ops/gpu/ragged_dot_mgpu.py\\00ragged_dot.<locals>.body\\00"}}
      %wgrad = bf16[{G},{K},{N}]{{2,1,0}} custom-call(%s, %x, %dy), custom_call_target="mosaic_gpu_v2", api_version=API_VERSION_TYPED_FFI, metadata={{op_name="jit(step)/transpose(jvp())/body/mpmd_map"}}, backend_config={{kernel_hash = "\\03", module = "ML\\EFR\\00"}}
      %cast = f8e4m3fn[{M},{K}]{{1,0}} custom-call(%x, %d), custom_call_target="mosaic_gpu_v2", api_version=API_VERSION_TYPED_FFI, metadata={{op_name="jit(step)/cast/pallas_call"}}
      %dense = bf16[{M},{N}]{{1,0}} custom-call(%a, %a, %d), custom_call_target="mosaic_gpu_v2", api_version=API_VERSION_TYPED_FFI, metadata={{op_name="jit(step)/block_scaled_matmul/pallas_call"}}
      %odd = bf16[{M},{K}]{{1,0}} custom-call(%s, %a, %bt), custom_call_target="mosaic_gpu_v2", api_version=API_VERSION_TYPED_FFI, metadata={{op_name="jit(step)/ragged_matmul/entry/mpmd_map"}}
      ROOT %out = (bf16[{M},{N}]{{1,0}}, bf16[{M},{N}]{{1,0}}, bf16[{G},{K},{N}]{{2,1,0}}, f8e4m3fn[{M},{K}]{{1,0}}, bf16[{M},{N}]{{1,0}}, bf16[{M},{K}]{{1,0}}) tuple(%fprop, %bf16, %wgrad, %cast, %dense, %odd)
    }}
    """)


def _expected_time(flops, nbytes, rate):
  """The roofline written out: max(compute, memory) + one launch."""
  return max(flops / rate, nbytes / CONSTANTS.hbm_bytes_per_s) + CONSTANTS.kernel_overhead_s


def test_grouped_kernels_are_gemms_of_one_dense_gemms_flops_at_their_operands_rate():
  report = cost_hlo(_MODULE, CONSTANTS)
  kernels = {k.name: k for k in report.kernels}
  flops = 2 * M * K * N  # each row with its own expert only: no G-fold expansion
  want = {  # name: (kernel, dtype, bytes in, bytes out, rate)
      "fprop": ("ragged_matmul", "f8e4m3fn", 4 * G + M * K + G * N * K + 4 * (G + 1),
                2 * M * N, CONSTANTS.fp8_gemm_flops_per_s),
      "bf16": ("ragged_dot_mgpu", "bf16", 4 * G + 2 * M * K + 2 * G * K * N, 2 * M * N,
               CONSTANTS.bf16_gemm_flops_per_s),
      "wgrad": (UNNAMED, "bf16", 4 * G + 2 * M * K + 2 * M * N, 2 * G * K * N,
                CONSTANTS.bf16_gemm_flops_per_s)}
  for name, (kernel, dtype, bytes_in, bytes_out, rate) in want.items():
    got = kernels[name]
    assert (got.category, got.grouped_kernel, got.gemm_dtype) == ("gemm", kernel, dtype), got
    assert (got.flops, got.bytes_in, got.bytes_out) == (flops, bytes_in, bytes_out), got
    assert got.time_s == pytest.approx(_expected_time(flops, bytes_in + bytes_out, rate),
                                       rel=1e-12), got
  # Mosaic calls that are not grouped GEMMs keep moving bytes only.
  for name in ("cast", "dense", "odd"):
    assert (kernels[name].category, kernels[name].flops) == ("pallas", 0), kernels[name]
  assert report.gemm_launches == 3 and report.flops == 3 * flops
  table = report.table()
  assert "grouped f8e4m3fn" in table and "grouped bf16" in table


def test_gemm_report_lists_grouped_kernels_with_their_fp8_verdict_role_and_expert_path():
  report = inspect_hlo(_MODULE)
  assert [g.name for g in report.gemms] == ["fprop", "bf16", "wgrad"]
  assert all(g.kind is GemmKind.GROUPED for g in report.gemms)
  assert all(g.expert_path is ExpertPath.GROUPED_KERNEL for g in report.gemms)
  fprop, bf16, wgrad = report.gemms
  assert fprop.runs_in_fp8 and fprop.role == "fprop" and "(ragged_matmul)" in fprop.target
  assert (fprop.lhs.shape, fprop.rhs.shape) == (f"f8e4m3fn[{M},{K}]", f"f8e4m3fn[{G},{N},{K}]")
  # Both operands K-major: what FP8 wgmma reads.
  assert fprop.lhs.contracting_minor and fprop.rhs.contracting_minor
  assert not bf16.runs_in_fp8 and bf16.why_not_fp8 == "grouped GEMM on bf16 x bf16"
  assert bf16.rhs.contracting_minor is False  # w [G, K, N] as stored: N innermost
  assert wgrad.role == "backward" and wgrad.output == f"bf16[{G},{K},{N}]"
  text = str(report)
  assert "expert path" in text and "3 expert GEMMs (grouped matmuls): 3 grouped kernel" in text


def test_expert_path_tells_xla_dense_expansion_and_the_jnp_tile_loop_apart():
  gemm = inspect_hlo(_MODULE).gemms[0]
  cublas = dataclasses.replace(gemm, kind=GemmKind.CUBLASLT_FP8)
  cases = {"jit(step)/transpose(jvp())/ragged_dot_general": ExpertPath.DENSE_EXPANSION,
           "jit(step)/jvp(fp8_grouped_fprop)/while/body/closed_call/dot_general":
               ExpertPath.TILE_LOOP,
           "jit(step)/jvp(fp8_fprop)/dot_general": None,
           "jit(step)/dot_general": None}
  for op_name, path in cases.items():
    assert dataclasses.replace(cublas, op_name=op_name).expert_path is path, op_name


def test_a_program_without_expert_gemms_prints_no_expert_column():
  plain = _MODULE.replace('custom_call_target="mosaic_gpu_v2"', 'custom_call_target="other"')
  assert "expert path" not in str(lowering.inspect_hlo(plain))
