"""The roofline cost model (`fp8jax.lowering.cost`) and the `fp8jax cost` command.

Most tests read small optimized-HLO modules written by hand in the form XLA
prints for an H100 (see the deviceless compiles below for the real thing), so
every expected byte, FLOP and microsecond is counted by hand from the shapes,
independently of the reader. The deviceless tests check the same facts on
programs XLA really compiled, and the command line end to end.
"""
from __future__ import annotations

import dataclasses
import json
import math
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp8jax import lowering
from fp8jax.cli import main
from fp8jax.deviceless import deviceless_toolchain_missing
from fp8jax.lowering import CostConstants, compare, cost, cost_hlo
from fp8jax.lowering.cost import to_json

_MISSING = deviceless_toolchain_missing()
hopper = pytest.mark.hopper
needs_toolchain = pytest.mark.skipif(_MISSING is not None, reason=_MISSING or "")

# Round numbers so that the expected times below are easy to check by hand.
CONSTANTS = CostConstants(fp8_gemm_flops_per_s=2e15, bf16_gemm_flops_per_s=1e15,
                          f32_gemm_flops_per_s=5e14, hbm_bytes_per_s=2e12,
                          kernel_overhead_s=3e-6, loop_kernel_overhead_s=5e-6)


def roofline(flops, nbytes, rate, c=CONSTANTS, in_loop=False):
  """The model's formula, written out: max(compute, memory) + launch overhead (dearer for
  a kernel inside a while loop)."""
  overhead = c.loop_kernel_overhead_s if in_loop else c.kernel_overhead_s
  return max(flops / rate, nbytes / c.hbm_bytes_per_s) + overhead


def _gemm_config(lhs_contracting, rhs_contracting):
  return ('{"gemm_backend_config":{"alpha_real":1,"beta":0,"dot_dimension_numbers":{'
          f'"lhs_contracting_dimensions":["{lhs_contracting}"],'
          f'"rhs_contracting_dimensions":["{rhs_contracting}"],'
          '"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]},"epilogue":"DEFAULT",'
          '"autotune_workspace_size":"4194304"}}')


# A bf16 cuBLAS GEMM [256,512] x [512,1024]; an FP8 cuBLASLt GEMM [256,512] x
# [1024,512]^T with scalar scales; a Triton GEMM fusion (split-K, batched dot);
# a fusion that slices 4 rows out of a [1024,128] f32 buffer; an in-place
# dynamic-update-slice of 4 rows into that buffer. Parameters, a constant,
# get-tuple-elements, a bitcast and the root tuple launch nothing.
_PROGRAM_HLO = textwrap.dedent("""\
    HloModule jit_step, is_scheduled=true

    %gemm_fusion_dot_computation (parameter_0: bf16[256,4,128], parameter_1: bf16[4,128,1024]) -> f32[4,256,1024] {
      %parameter_0 = bf16[256,4,128]{2,1,0} parameter(0)
      %parameter_1 = bf16[4,128,1024]{2,1,0} parameter(1)
      ROOT %dot.1 = f32[4,256,1024]{2,1,0} dot(%parameter_0, %parameter_1), lhs_batch_dims={1}, lhs_contracting_dims={2}, rhs_batch_dims={0}, rhs_contracting_dims={1}
    }

    %fused_slice (param_0: f32[1024,128], param_1: s32[]) -> f32[4,128] {
      %param_0 = f32[1024,128]{1,0} parameter(0)
      %param_1 = s32[] parameter(1)
      %constant_0 = s32[] constant(0)
      %dynamic-slice.1 = f32[4,128]{1,0} dynamic-slice(%param_0, %param_1, %constant_0), dynamic_slice_sizes={4,128}
      %constant_1 = f32[] constant(2)
      %broadcast.1 = f32[4,128]{1,0} broadcast(%constant_1), dimensions={}
      ROOT %multiply.1 = f32[4,128]{1,0} multiply(%dynamic-slice.1, %broadcast.1), metadata={op_name="jit(step)/mul"}
    }

    %fused_dynamic_update_slice (param_0.1: f32[1024,128], param_1.1: f32[4,128], param_2.1: s32[]) -> f32[1024,128] {
      %param_0.1 = f32[1024,128]{1,0} parameter(0)
      %param_1.1 = f32[4,128]{1,0} parameter(1)
      %param_2.1 = s32[] parameter(2)
      %constant_2 = s32[] constant(0)
      ROOT %dynamic-update-slice.1 = f32[1024,128]{1,0} dynamic-update-slice(%param_0.1, %param_1.1, %param_2.1, %constant_2)
    }

    ENTRY %main (x: bf16[256,512], w: bf16[512,1024], qx: f8e4m3fn[256,512], qw_t: f8e4m3fn[1024,512], s: f32[], big: f32[1024,128], i: s32[]) -> (bf16[1024,256], bf16[256,1024], f32[4,256,1024], f32[1024,128]) {
      %x = bf16[256,512]{1,0} parameter(0)
      %w = bf16[512,1024]{1,0} parameter(1)
      %qx = f8e4m3fn[256,512]{1,0} parameter(2)
      %qw_t = f8e4m3fn[1024,512]{1,0} parameter(3)
      %s = f32[] parameter(4)
      %big = f32[1024,128]{1,0} parameter(5)
      %i = s32[] parameter(6)
      %constant.9 = f32[] constant(1)
      %cublas-gemm.1 = (bf16[256,1024]{1,0}, s8[4194304]{0}) custom-call(%x, %w), custom_call_target="__cublas$lt$matmul", metadata={op_name="jit(step)/dot_general"}, backend_config=BF16_CONFIG
      %get-tuple-element.1 = bf16[256,1024]{1,0} get-tuple-element(%cublas-gemm.1), index=0
      %bitcast.1 = bf16[1024,256]{0,1} bitcast(%get-tuple-element.1)
      %cublas-gemm.2 = (bf16[256,1024]{1,0}, s8[4194304]{0}) custom-call(%qx, %qw_t, %s, %s), custom_call_target="__cublas$lt$matmul$f8", backend_config=FP8_CONFIG
      %get-tuple-element.2 = bf16[256,1024]{1,0} get-tuple-element(%cublas-gemm.2), index=0
      %bitcast.2 = bf16[256,4,128]{2,1,0} bitcast(%x)
      %bitcast.3 = bf16[4,128,1024]{2,1,0} bitcast(%w)
      %gemm_fusion_dot = f32[4,256,1024]{2,1,0} fusion(%bitcast.2, %bitcast.3), kind=kCustom, calls=%gemm_fusion_dot_computation
      %loop_slice_fusion = f32[4,128]{1,0} fusion(%big, %i), kind=kLoop, calls=%fused_slice
      %loop_dynamic_update_slice_fusion = f32[1024,128]{1,0} fusion(%big, %loop_slice_fusion, %i), kind=kLoop, calls=%fused_dynamic_update_slice
      ROOT %tuple = (bf16[1024,256]{0,1}, bf16[256,1024]{1,0}, f32[4,256,1024]{2,1,0}, f32[1024,128]{1,0}) tuple(%bitcast.1, %get-tuple-element.2, %gemm_fusion_dot, %loop_dynamic_update_slice_fusion)
    }
    """).replace("BF16_CONFIG", _gemm_config(1, 0)).replace("FP8_CONFIG", _gemm_config(1, 1))

M, K, N = 256, 512, 1024
GEMM_FLOPS = 2 * M * N * K
BF16_GEMM_BYTES_IN = (M * K + K * N) * 2
FP8_GEMM_BYTES_IN = (M * K + N * K) * 1 + 2 * 4  # two f32 scales
SLICE_BYTES = 4 * 128 * 4


def kernels_by_name(report):
  return {k.name: k for k in report.kernels}


# ----- which instructions are kernels -------------------------------------------------


def test_kernels_are_listed_in_program_order_without_parameters_constants_or_views():
  report = cost_hlo(_PROGRAM_HLO, CONSTANTS)
  assert [k.name for k in report.kernels] == [
      "cublas-gemm.1", "cublas-gemm.2", "gemm_fusion_dot", "loop_slice_fusion",
      "loop_dynamic_update_slice_fusion"]
  assert [k.category for k in report.kernels] == ["gemm", "gemm", "gemm", "fusion", "fusion"]
  assert report.kernel_launches == 5 and report.gemm_launches == 3
  assert report.kernels[0].op_name == "jit(step)/dot_general"


def test_cublas_gemm_flops_are_2mnk_and_its_workspace_is_not_traffic():
  k = kernels_by_name(cost_hlo(_PROGRAM_HLO, CONSTANTS))
  bf16, fp8 = k["cublas-gemm.1"], k["cublas-gemm.2"]
  assert (bf16.gemm_dtype, fp8.gemm_dtype) == ("bf16", "f8e4m3fn")
  assert bf16.flops == fp8.flops == GEMM_FLOPS
  assert bf16.bytes_in == BF16_GEMM_BYTES_IN
  assert fp8.bytes_in == FP8_GEMM_BYTES_IN
  # The bf16 [256,1024] result only: the s8[4194304] workspace is scratch.
  assert bf16.bytes_out == fp8.bytes_out == M * N * 2


def test_triton_gemm_fusion_counts_the_flops_of_its_batched_dot():
  k = kernels_by_name(cost_hlo(_PROGRAM_HLO, CONSTANTS))["gemm_fusion_dot"]
  # Split-K into 4 batches of K/4: the same 2*M*N*K in total.
  assert k.gemm_dtype == "bf16" and k.flops == GEMM_FLOPS
  assert k.bytes_in == BF16_GEMM_BYTES_IN and k.bytes_out == 4 * M * N * 4


def test_a_fusion_that_slices_a_big_parameter_reads_only_the_slice():
  k = kernels_by_name(cost_hlo(_PROGRAM_HLO, CONSTANTS))["loop_slice_fusion"]
  assert k.bytes_in == SLICE_BYTES + 4  # 4 rows of the [1024,128] f32 buffer, and the s32 index
  assert k.bytes_out == SLICE_BYTES


def test_an_in_place_dynamic_update_slice_moves_only_the_update():
  k = kernels_by_name(cost_hlo(_PROGRAM_HLO, CONSTANTS))["loop_dynamic_update_slice_fusion"]
  assert k.bytes_in == SLICE_BYTES + 4  # the update and the index; not the 512 KiB buffer
  assert k.bytes_out == SLICE_BYTES


def test_a_multi_output_fusion_writes_only_the_update_of_its_in_place_output():
  hlo = textwrap.dedent("""\
      HloModule m

      %fused (p0: f32[1024,128], p1: f32[4,128], p2: s32[]) -> (f32[1024,128], f32[4,128]) {
        %p0 = f32[1024,128]{1,0} parameter(0)
        %p1 = f32[4,128]{1,0} parameter(1)
        %p2 = s32[] parameter(2)
        %c = s32[] constant(0)
        %neg = f32[4,128]{1,0} negate(%p1)
        %dus = f32[1024,128]{1,0} dynamic-update-slice(%p0, %neg, %p2, %c)
        ROOT %t = (f32[1024,128]{1,0}, f32[4,128]{1,0}) tuple(%dus, %neg)
      }

      ENTRY %main (a: f32[1024,128], u: f32[4,128], i: s32[]) -> (f32[1024,128], f32[4,128]) {
        %a = f32[1024,128]{1,0} parameter(0)
        %u = f32[4,128]{1,0} parameter(1)
        %i = s32[] parameter(2)
        ROOT %f = (f32[1024,128]{1,0}, f32[4,128]{1,0}) fusion(%a, %u, %i), kind=kLoop, calls=%fused
      }
      """)
  (k,) = cost_hlo(hlo, CONSTANTS).kernels
  assert k.bytes_in == SLICE_BYTES + 4
  assert k.bytes_out == 2 * SLICE_BYTES  # the update in place, and the second output


def test_a_kernel_writes_every_element_of_a_long_tuple_its_numbered_ones_too():
  # XLA numbers every fifth element of a long tuple (/*index=5*/): a custom call's sixth
  # output (a Pallas cast's FP8 copy of its input, say) is written like the others.
  shapes = ", ".join(["f32[1]{0}"] * 5) + ", /*index=5*/f8e4m3fn[1024,128]{1,0}"
  hlo = textwrap.dedent(f"""\
      HloModule m

      ENTRY %main (x: bf16[1024,128]) -> ({shapes}) {{
        %x = bf16[1024,128]{{1,0}} parameter(0)
        ROOT %pallas_call.1 = ({shapes}) custom-call(%x), custom_call_target="__gpu$xla.gpu.triton"
      }}
      """)
  (k,) = cost_hlo(hlo, CONSTANTS).kernels
  assert k.bytes_in == 1024 * 128 * 2 and k.bytes_out == 5 * 4 + 1024 * 128


def test_a_fusion_whose_result_is_an_elementwise_op_of_a_parameter_reads_all_of_it():
  # A weight's bf16 copy (XLA's `wrapped_convert`): every element of the result is
  # computed, so every element of the f32 parameter is read.
  hlo = textwrap.dedent("""\
      HloModule m

      %wrapped_convert_computation (p0: f32[1024,128]) -> bf16[1024,128] {
        %p0 = f32[1024,128]{1,0} parameter(0)
        ROOT %convert.1 = bf16[1024,128]{1,0} convert(%p0)
      }

      ENTRY %main (w: f32[1024,128]) -> bf16[1024,128] {
        %w = f32[1024,128]{1,0} parameter(0)
        ROOT %wrapped_convert = bf16[1024,128]{1,0} fusion(%w), kind=kLoop, calls=%wrapped_convert_computation
      }
      """)
  (k,) = cost_hlo(hlo, CONSTANTS).kernels
  assert k.bytes_in == 1024 * 128 * 4
  assert k.bytes_out == 1024 * 128 * 2


# ----- loops ---------------------------------------------------------------------------

_LOOP_HLO = textwrap.dedent("""\
    HloModule jit_loop, is_scheduled=true

    %fused_sine (param_0: bf16[256,256]) -> bf16[256,256] {
      %param_0 = bf16[256,256]{1,0} parameter(0)
      ROOT %sine.1 = bf16[256,256]{1,0} sine(%param_0)
    }

    %fused_add (param_0.1: s32[]) -> s32[] {
      %param_0.1 = s32[] parameter(0)
      %constant_1 = s32[] constant(1)
      ROOT %add.1 = s32[] add(%param_0.1, %constant_1)
    }

    %body (arg_tuple.1: (s32[], bf16[256,256])) -> (s32[], bf16[256,256]) {
      %arg_tuple.1 = (s32[], bf16[256,256]{1,0}) parameter(0)
      %get-tuple-element.1 = s32[] get-tuple-element(%arg_tuple.1), index=0
      %loop_add_fusion = s32[] fusion(%get-tuple-element.1), kind=kLoop, calls=%fused_add
      %get-tuple-element.2 = bf16[256,256]{1,0} get-tuple-element(%arg_tuple.1), index=1
      %loop_sine_fusion = bf16[256,256]{1,0} fusion(%get-tuple-element.2), kind=kLoop, calls=%fused_sine
      %cublas-gemm.1 = (bf16[256,256]{1,0}, s8[4194304]{0}) custom-call(%loop_sine_fusion, %get-tuple-element.2), custom_call_target="__cublas$lt$matmul", backend_config=GEMM_CONFIG
      %get-tuple-element.3 = bf16[256,256]{1,0} get-tuple-element(%cublas-gemm.1), index=0
      ROOT %tuple.1 = (s32[], bf16[256,256]{1,0}) tuple(%loop_add_fusion, %get-tuple-element.3)
    }

    %fused_compare (param_0.2: s32[]) -> pred[] {
      %param_0.2 = s32[] parameter(0)
      %constant_2 = s32[] constant(5)
      ROOT %lt.1 = pred[] compare(%param_0.2, %constant_2), direction=LT
    }

    %cond (arg_tuple.2: (s32[], bf16[256,256])) -> pred[] {
      %arg_tuple.2 = (s32[], bf16[256,256]{1,0}) parameter(0)
      %get-tuple-element.4 = s32[] get-tuple-element(%arg_tuple.2), index=0
      ROOT %loop_compare_fusion = pred[] fusion(%get-tuple-element.4), kind=kLoop, calls=%fused_compare
    }

    ENTRY %main (x: bf16[256,256]) -> bf16[256,256] {
      %constant_0 = s32[] constant(0)
      %copy.1 = s32[] copy(%constant_0)
      %x = bf16[256,256]{1,0} parameter(0)
      %tuple = (s32[], bf16[256,256]{1,0}) tuple(%copy.1, %x)
      %while.1 = (s32[], bf16[256,256]{1,0}) while(%tuple), condition=%cond, body=%body, backend_config=WHILE_CONFIG
      ROOT %get-tuple-element.5 = bf16[256,256]{1,0} get-tuple-element(%while.1), index=1
    }
    """).replace("GEMM_CONFIG", _gemm_config(1, 0))


def test_a_while_body_counts_its_known_trip_count_and_its_condition_never_runs():
  hlo = _LOOP_HLO.replace("WHILE_CONFIG", '{"known_trip_count":{"n":"5"}}')
  report = cost_hlo(hlo, CONSTANTS)
  launches = {k.name: k.launches for k in report.kernels}
  # XLA's GPU runtime runs a loop of known trip count without evaluating its condition.
  assert launches == {"copy.1": 1, "loop_add_fusion": 5, "loop_sine_fusion": 5,
                      "cublas-gemm.1": 5}
  gemm = kernels_by_name(report)["cublas-gemm.1"]
  assert gemm.flops == 2 * 256**3
  assert report.flops == 5 * 2 * 256**3
  one_gemm = roofline(2 * 256**3, 3 * 256 * 256 * 2, CONSTANTS.bf16_gemm_flops_per_s,
                      in_loop=True)
  assert gemm.time_s == pytest.approx(5 * one_gemm, rel=1e-12)
  # Inside the loop each launch costs the loop's overhead, outside it the top level's.
  in_loop = {k.name: k.in_loop for k in report.kernels}
  assert in_loop == {"copy.1": False, "loop_add_fusion": True, "loop_sine_fusion": True,
                     "cublas-gemm.1": True}
  copy = kernels_by_name(report)["copy.1"]
  assert copy.time_s == pytest.approx(roofline(0, 8, 1.0), rel=1e-12)
  assert report.bytes == sum((k.bytes_in + k.bytes_out) * k.launches for k in report.kernels)


def test_a_while_of_unknown_trip_count_counts_one_iteration_and_two_conditions():
  hlo = _LOOP_HLO.replace(", backend_config=WHILE_CONFIG", "")
  launches = {k.name: k.launches for k in cost_hlo(hlo, CONSTANTS).kernels}
  assert launches == {"copy.1": 1, "loop_add_fusion": 1, "loop_sine_fusion": 1,
                      "cublas-gemm.1": 1, "loop_compare_fusion": 2}


# ----- the time ------------------------------------------------------------------------


def expected_times(c):
  """Each kernel of _PROGRAM_HLO by the formula, from hand-counted bytes and FLOPs."""
  return {
      "cublas-gemm.1": roofline(GEMM_FLOPS, BF16_GEMM_BYTES_IN + M * N * 2,
                                c.bf16_gemm_flops_per_s, c),
      "cublas-gemm.2": roofline(GEMM_FLOPS, FP8_GEMM_BYTES_IN + M * N * 2,
                                c.fp8_gemm_flops_per_s, c),
      "gemm_fusion_dot": roofline(GEMM_FLOPS, BF16_GEMM_BYTES_IN + 4 * M * N * 4,
                                  c.bf16_gemm_flops_per_s, c),
      "loop_slice_fusion": roofline(0, 2 * SLICE_BYTES + 4, 1.0, c),
      "loop_dynamic_update_slice_fusion": roofline(0, 2 * SLICE_BYTES + 4, 1.0, c),
  }


def test_time_is_max_of_compute_and_memory_plus_overhead_per_kernel():
  report = cost_hlo(_PROGRAM_HLO, CONSTANTS)
  expected = expected_times(CONSTANTS)
  for k in report.kernels:
    assert k.time_s == pytest.approx(expected[k.name], rel=1e-12), k.name
  assert report.time_s == pytest.approx(sum(expected.values()), rel=1e-12)
  # Spelled out once: the bf16 cuBLAS GEMM is memory-bound at these constants.
  assert expected["cublas-gemm.1"] == pytest.approx(1835008 / 2e12 + 3e-6, rel=1e-12)


@pytest.mark.parametrize("override", [
    {"kernel_overhead_s": 1e-5},
    {"hbm_bytes_per_s": 1e11},           # everything memory-bound
    {"bf16_gemm_flops_per_s": 1e11},     # bf16 GEMMs compute-bound
    {"fp8_gemm_flops_per_s": 1e11},      # the FP8 GEMM compute-bound
])
def test_overriding_a_constant_changes_the_prediction_as_the_formula_says(override):
  constants = dataclasses.replace(CONSTANTS, **override)
  report = cost_hlo(_PROGRAM_HLO, constants)
  expected = expected_times(constants)
  assert {k.name: k.time_s for k in report.kernels} == pytest.approx(expected, rel=1e-12)
  assert report.time_s != pytest.approx(cost_hlo(_PROGRAM_HLO, CONSTANTS).time_s, rel=1e-3)


def test_compare_speedup_is_baseline_time_over_program_time():
  program = cost_hlo(_PROGRAM_HLO, CONSTANTS, label="fast")
  baseline = cost_hlo(_PROGRAM_HLO, dataclasses.replace(CONSTANTS, hbm_bytes_per_s=1e12),
                      label="slow")
  comparison = compare(program, baseline)
  assert comparison.speedup == pytest.approx(baseline.time_s / program.time_s, rel=1e-12)
  assert comparison.speedup > 1
  assert f"speedup of fast over slow: {comparison.speedup:.2f}x" in str(comparison)
  loaded = json.loads(to_json(comparison))
  assert loaded["predicted_speedup"] == pytest.approx(comparison.speedup)
  assert [k["name"] for k in loaded["program"]["kernels"]] == [k.name for k in program.kernels]
  assert loaded["baseline"]["constants"]["hbm_bytes_per_s"] == 1e12


def test_the_comparison_and_memory_tables_print_long_labels_whole_in_aligned_columns():
  from fp8jax.cli.cost_gpt import memory_table
  from fp8jax.lowering.memory import MemoryReport

  label = "delayed, adamw_fp8, fp8 saved, 8 experts (top 2)"  # 49 characters
  comparison = str(compare(cost_hlo(_PROGRAM_HLO, CONSTANTS, label=label),
                           cost_hlo(_PROGRAM_HLO, CONSTANTS, label="bf16, adamw")))
  memory = memory_table(*(MemoryReport(name, "H100", arguments=2**30, outputs=0, aliased=0,
                                       temp=2**30) for name in (label, "bf16, adamw")))
  for table, first_column in ((comparison, "kernels"), (memory, "arguments")):
    header, _, *rows = table.splitlines()
    # Each row's first number ends under its column's (right-aligned) header.
    end = header.index(first_column) + len(first_column)
    for name in (label, "bf16, adamw"):
      row = next(line for line in rows if line.startswith(name + " "))
      assert row[end - 1] != " " and row[end] == " ", table


def test_chip_h200_predicts_with_the_h200_constants_and_its_memory():
  from fp8jax.cli.cost import _parse_constants
  from fp8jax.cli.cost_gpt import memory_table
  from fp8jax.lowering.cost import H200
  from fp8jax.lowering.memory import MemoryReport

  assert _parse_constants([], "h200") == H200
  assert _parse_constants([], "h100") == CostConstants()
  # --constant overrides the chip's value, and only it.
  assert _parse_constants(["kernel_overhead_s=2e-6"], "h200") == dataclasses.replace(
      H200, kernel_overhead_s=2e-6)
  # 100 GiB does not fit an H100's 80 GiB and is 71% of an H200's 141.
  reports = [MemoryReport(name, "H100", arguments=50 * 2**30, outputs=0, aliased=0,
                          temp=50 * 2**30) for name in ("fp8", "bf16")]
  assert "of 80 GiB" in memory_table(*reports) and "does not fit" in memory_table(*reports)
  h200 = memory_table(*reports, "h200")
  assert "of 141 GiB" in h200 and "71%" in h200 and "does not fit" not in h200


# ----- bad inputs ----------------------------------------------------------------------


@pytest.mark.parametrize("value", [0, -1.0, math.inf, math.nan, True, "3e12"])
def test_cost_constants_must_be_positive_finite_numbers(value):
  with pytest.raises(ValueError, match=r"CostConstants\.hbm_bytes_per_s=.*positive finite"):
    CostConstants(hbm_bytes_per_s=value)


def test_cost_hlo_rejects_what_is_not_hlo_text():
  with pytest.raises(TypeError, match="hlo must be the HLO text"):
    cost_hlo(_PROGRAM_HLO.encode())
  with pytest.raises(ValueError, match="ENTRY"):
    cost_hlo("HloModule empty\n")
  with pytest.raises(TypeError, match="constants must be a fp8jax.lowering.CostConstants"):
    cost_hlo(_PROGRAM_HLO, {"hbm_bytes_per_s": 1e12})


def test_compare_rejects_non_reports_and_programs_without_kernels():
  report = cost_hlo(_PROGRAM_HLO, CONSTANTS)
  with pytest.raises(TypeError, match="baseline must be a CostReport"):
    compare(report, report.time_s)
  empty = cost_hlo("HloModule m\n\nENTRY %main (a: f32[4]) -> f32[4] {\n"
                   "  ROOT %a = f32[4]{0} parameter(0)\n}\n", label="identity")
  assert empty.kernels == () and empty.time_s == 0
  with pytest.raises(ValueError, match="'identity' launches no kernel"):
    compare(empty, report)


# ----- the example's bf16 twin (CPU) ---------------------------------------------------


def test_bf16_twin_has_the_fp8_steps_params_optimizer_and_batch_and_no_fp8_state():
  _, fp8_args = lowering.example_train_step(widths=(32, 64, 16), batch_size=2, seq_len=8)
  _, bf16_args = lowering.example_train_step(widths=(32, 64, 16), batch_size=2, seq_len=8,
                                             precision="bf16")
  for i in (0, 1, 3):  # params, opt_state, batch
    assert jax.tree.structure(fp8_args[i]) == jax.tree.structure(bf16_args[i])
    assert jax.tree.leaves(fp8_args[i]) == jax.tree.leaves(bf16_args[i])
  assert bf16_args[2] == [] and len(fp8_args[2]) == 2


def _gelu_tanh(x):
  return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))


def test_bf16_twin_step_computes_the_mlp_loss_of_a_float64_reference():
  step, (params, opt_state, fp8_state, batch) = lowering.example_train_step(
      widths=(32, 64, 16), batch_size=2, seq_len=8, precision="bf16")
  rng = np.random.default_rng(0)
  params = [{"kernel": rng.normal(size=p["kernel"].shape) / p["kernel"].shape[0]**0.5,
             "bias": rng.normal(size=p["bias"].shape)} for p in params]
  batch = {k: rng.normal(size=v.shape) for k, v in batch.items()}
  opt_state = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), opt_state)
  to_jax = lambda tree, dtype: jax.tree.map(lambda a: jnp.asarray(a, dtype), tree)
  new_params, _, new_state, loss = step(to_jax(params, jnp.float32), opt_state, fp8_state,
                                        to_jax(batch, jnp.bfloat16))
  # Reference on the same bf16-rounded batch, in float64, with JAX's tanh gelu.
  h = np.asarray(to_jax(batch["x"], jnp.bfloat16), np.float64)
  y = np.asarray(to_jax(batch["y"], jnp.bfloat16), np.float64)
  h = _gelu_tanh(h @ params[0]["kernel"] + params[0]["bias"])
  reference = np.mean((h @ params[1]["kernel"] + params[1]["bias"] - y) ** 2)
  # bf16 GEMMs and activations (8-bit mantissa, rel. 2^-9 per rounding) over two
  # layers and a mean of squares: a few 1e-3 relative; 2% still fails for a
  # missing bias or activation (each moves this loss by more than 10%).
  assert float(loss) == pytest.approx(reference, rel=2e-2)
  assert new_state == []
  assert jax.tree.structure(new_params) == jax.tree.structure(to_jax(params, jnp.float32))


def test_example_rejects_a_recipe_for_the_bf16_twin_and_unknown_precisions():
  import fp8jax
  with pytest.raises(ValueError, match="recipe=.*precision='fp8' only"):
    lowering.example_train_step(recipe=fp8jax.DelayedScaling(), precision="bf16")
  with pytest.raises(ValueError, match="precision='fp16' is not one of"):
    lowering.example_train_step(precision="fp16")
  with pytest.raises(ValueError, match="batch_size=0 must be a positive integer"):
    lowering.example_train_step(batch_size=0)


# ----- the command line: errors before any compile -------------------------------------


@pytest.mark.parametrize("argv, message", [
    (["--constant", "bogus=1"], "NAME one of fp8_gemm_flops_per_s, bf16_gemm_flops_per_s"),
    (["--constant", "hbm_bytes_per_s=fast"], "'fast' is not a number"),
    (["--constant", "kernel_overhead_s=0"], "kernel_overhead_s=0.0 must be a positive"),
    (["--baseline", "m:f"], "--baseline needs --factory"),
    (["--factory", "m:f", "--recipe", "current"], "--recipe applies to the built-in example"),
    (["--widths", "64,x"], "--widths '64,x': expected comma-separated integers"),
    (["--json", "/no/such/folder/cost.json"], "does not exist"),
    (["--fsdp"], "--fsdp needs --mesh"),
    (["--mesh", "data8"], "expected AXIS=N pairs"),
    (["--mesh", "data=16"], "one H100 host has 1 to 8 GPUs"),
])
def test_cli_cost_user_errors_are_one_line_messages(argv, message, capsys):
  status = main(["cost", *argv])
  err = capsys.readouterr().err
  assert status == 2, err
  assert err.startswith("fp8jax: ") and len(err.splitlines()) == 1 and message in err, err


# ----- deviceless H100 compiles --------------------------------------------------------


@hopper
@needs_toolchain
def test_bf16_gemm_2048_cubed_is_one_kernel_of_2n3_flops_reading_and_writing_each_matrix_once():
  n = 2048
  spec = jax.ShapeDtypeStruct((n, n), jnp.bfloat16)
  report = cost(lambda x, w: x @ w, spec, spec, target="deviceless")
  (k,) = report.kernels
  assert k.is_gemm and k.gemm_dtype == "bf16"
  assert k.flops == 2 * n**3
  assert k.bytes_in + k.bytes_out == 3 * n * n * 2  # x and w read, the product written
  assert report.time_s == pytest.approx(
      roofline(2 * n**3, 3 * n * n * 2, report.constants.bf16_gemm_flops_per_s,
               report.constants), rel=1e-12)


@hopper
@needs_toolchain
def test_cli_cost_summary_compares_the_example_with_its_bf16_twin_and_writes_json(
    tmp_path, capsys):
  path = tmp_path / "cost.json"
  assert main(["cost", "--summary", "--json", str(path)]) == 0
  out = capsys.readouterr().out
  assert "fp8_train_step (delayed)" in out and "bf16_train_step" in out
  assert "predicted speedup of fp8_train_step (delayed) over bf16_train_step:" in out
  assert " MB in " not in out  # --summary: no per-kernel table
  loaded = json.loads(path.read_text())
  assert loaded["predicted_speedup"] > 0
  assert loaded["program"]["gemm_launches"] == loaded["baseline"]["gemm_launches"] == 8
  assert loaded["program"]["gemm_flops"] == loaded["baseline"]["gemm_flops"]


_FACTORY_MODULE = '''
import jax
import jax.numpy as jnp

SPEC = jax.ShapeDtypeStruct((256, 256), jnp.bfloat16)

def double_matmul():
  return (lambda x, w: (x @ w) @ w), (SPEC, SPEC)

def single_matmul():
  return (lambda x, w: x @ w), (SPEC, SPEC)
'''


@hopper
@needs_toolchain
def test_cli_cost_factory_prints_its_table_and_with_a_baseline_the_comparison(
    tmp_path, monkeypatch, capsys):
  (tmp_path / "cost_cli_factories.py").write_text(_FACTORY_MODULE)
  monkeypatch.syspath_prepend(str(tmp_path))
  assert main(["cost", "--factory", "cost_cli_factories:double_matmul",
               "--constant", "kernel_overhead_s=1e-6"]) == 0
  out = capsys.readouterr().out
  assert out.startswith("double_matmul: predicted on ")
  assert "total: 2 kernel launches (2 GEMM, 0 other)" in out and "speedup" not in out

  assert main(["cost", "--summary", "--factory", "cost_cli_factories:single_matmul",
               "--baseline", "cost_cli_factories:double_matmul"]) == 0
  out = capsys.readouterr().out
  assert "predicted speedup of single_matmul over double_matmul:" in out


@hopper
@needs_toolchain
def test_cli_cost_mesh_reports_per_device_with_the_collectives_over_nvlink(tmp_path, capsys):
  path = tmp_path / "cost.json"
  assert main(["cost", "--summary", "--mesh", "data=8", "--fsdp", "--json", str(path)]) == 0
  out = capsys.readouterr().out
  assert "of which collectives' bytes over NVLink:" in out
  loaded = json.loads(path.read_text())
  fp8, bf16 = loaded["program"], loaded["baseline"]
  # Both steps all-reduce the same bf16 gradients; FP8 gathers its weights in FP8.
  assert 0 < fp8["predicted_link_time_s"] < bf16["predicted_link_time_s"]
  # Per device: each GPU runs the GEMMs of its 1/8 of the batch (batch 8, so 1 row of it).
  one = json.loads(_cost_json(tmp_path, capsys))
  assert fp8["gemm_flops"] * 8 == pytest.approx(one["program"]["gemm_flops"], rel=0.01)


def _cost_json(tmp_path, capsys):
  path = tmp_path / "one_device.json"
  assert main(["cost", "--summary", "--json", str(path)]) == 0
  capsys.readouterr()
  return path.read_text()
