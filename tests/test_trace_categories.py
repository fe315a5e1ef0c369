"""A step's device time by kernel category (`benchmarks.trace_categories`).

The trace is written by hand in the form JAX writes a GPU profile (Chrome trace events:
"/device:GPU:0" with "Stream #" threads, kernels named as XLA, Pallas, cuBLAS and cuDNN
name them), so every expected category, second and gap is counted by hand. The program's
side is a small optimized-HLO module in the form XLA prints for an H100.
"""
from __future__ import annotations

import re
import textwrap

import pytest

from benchmarks import trace_categories as tc
from benchmarks.device_trace import kernel_events, read_trace
from fp8jax.lowering import cost_hlo

# An FP8 cuBLASLt GEMM with an E4M3 and an E5M2 operand (a dgrad); a loop fusion that
# writes E4M3 inside the MLP (an XLA-fused quantize); a norm's reduction; the optimizer's
# update (top-level op path); the Pallas cast kernel (a Triton custom call).
_HLO = textwrap.dedent("""\
    HloModule jit_train_step, is_scheduled=true

    %fused_quantize (p0: bf16[256,512]) -> f8e4m3fn[256,512] {
      %p0 = bf16[256,512]{1,0} parameter(0)
      ROOT %convert.1 = f8e4m3fn[256,512]{1,0} convert(%p0)
    }

    %fused_norm (p1: bf16[256,512]) -> f32[256] {
      %p1 = bf16[256,512]{1,0} parameter(0)
      %convert.2 = f32[256,512]{1,0} convert(%p1)
      %zero = f32[] constant(0)
      ROOT %reduce.1 = f32[256] reduce(%convert.2, %zero), dimensions={1}, to_apply=%add
    }

    %fused_update (p2: f32[512,1024], p3: f32[512,1024]) -> f32[512,1024] {
      %p2 = f32[512,1024]{1,0} parameter(0)
      %p3 = f32[512,1024]{1,0} parameter(1)
      ROOT %add.9 = f32[512,1024]{1,0} add(%p2, %p3)
    }

    %add (a: f32[], b: f32[]) -> f32[] {
      %a = f32[] parameter(0)
      %b = f32[] parameter(1)
      ROOT %sum = f32[] add(%a, %b)
    }

    ENTRY %main (x: bf16[256,512], qg: f8e5m2[256,1024], qw: f8e4m3fn[512,1024], s: f32[], w: f32[512,1024], u: f32[512,1024]) -> (bf16[256,512], f8e4m3fn[256,512], f32[256], f32[512,1024], f8e4m3fn[256,512]) {
      %x = bf16[256,512]{1,0} parameter(0)
      %qg = f8e5m2[256,1024]{1,0} parameter(1)
      %qw = f8e4m3fn[512,1024]{1,0} parameter(2)
      %s = f32[] parameter(3)
      %w = f32[512,1024]{1,0} parameter(4)
      %u = f32[512,1024]{1,0} parameter(5)
      %cublas-gemm.1 = (bf16[256,512]{1,0}, s8[4194304]{0}) custom-call(%qg, %qw, %s, %s), custom_call_target="__cublas$lt$matmul$f8", metadata={op_name="jit(train_step)/transpose(jvp(Gpt))/blocks/mlp/up/fp8_dgrad/dot_general"}, backend_config=GEMM_CONFIG
      %get-tuple-element.1 = bf16[256,512]{1,0} get-tuple-element(%cublas-gemm.1), index=0
      %loop_convert_fusion.3 = f8e4m3fn[256,512]{1,0} fusion(%x), kind=kLoop, calls=%fused_quantize, metadata={op_name="jit(train_step)/jvp(Gpt)/blocks/mlp/convert_element_type"}
      %input_reduce_fusion.5 = f32[256]{0} fusion(%x), kind=kInput, calls=%fused_norm, metadata={op_name="jit(train_step)/jvp(Gpt)/blocks/attention_norm/reduce_sum"}
      %loop_add_fusion.2 = f32[512,1024]{1,0} fusion(%w, %u), kind=kLoop, calls=%fused_update, metadata={op_name="jit(train_step)/add"}
      %pallas_call.7 = f8e4m3fn[256,512]{1,0} custom-call(%x), custom_call_target="__gpu$xla.gpu.triton", metadata={op_name="jit(train_step)/jvp(Gpt)/blocks/mlp/up/jit(launch)/cast_transpose_amax/pallas_call"}
      ROOT %tuple = (bf16[256,512]{1,0}, f8e4m3fn[256,512]{1,0}, f32[256]{0}, f32[512,1024]{1,0}, f8e4m3fn[256,512]{1,0}) tuple(%get-tuple-element.1, %loop_convert_fusion.3, %input_reduce_fusion.5, %loop_add_fusion.2, %pallas_call.7)
    }
    """).replace("GEMM_CONFIG", '{"gemm_backend_config":{"dot_dimension_numbers":{'
                 '"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["1"],'
                 '"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]}}}')


@pytest.fixture(scope="module")
def program():
  report = cost_hlo(_HLO)
  return report, tc.program_kernels(_HLO, report)


def test_the_program_says_what_each_kernel_is(program):
  _, kernels = program
  assert set(kernels) == {"cublas-gemm.1", "loop_convert_fusion.3", "input_reduce_fusion.5",
                          "loop_add_fusion.2", "pallas_call.7"}
  assert kernels["cublas-gemm.1"].gemm == "f8e5m2,f8e4m3fn"
  assert kernels["loop_convert_fusion.3"].hlo == "fusion -> f8e4m3fn"
  assert kernels["pallas_call.7"].hlo == "custom-call __gpu$xla.gpu.triton -> f8e4m3fn"
  assert kernels["loop_add_fusion.2"].op == "jit(train_step)/add"
  assert all(k.gemm == "" for name, k in kernels.items() if name != "cublas-gemm.1")


def test_each_program_kernel_gets_its_category(program):
  report, kernels = program
  got = {name: tc.categorize(tc.kernel_name(name), k) for name, k in kernels.items()}
  assert got == {"cublas-gemm.1": "gemm_fp8_e5m2",  # an E5M2 operand, whatever the other
                 "loop_convert_fusion.3": "fp8_cast",  # writes FP8, in no norm
                 "input_reduce_fusion.5": "norm",
                 "loop_add_fusion.2": "optimizer",  # outside jvp / transpose
                 "pallas_call.7": "fp8_cast"}  # by its op path (the name is the HLO's)
  # The cost model's prediction in the same categories: its kernels' own times.
  predicted = tc.predicted_table(report, kernels)
  by_kernel = {k.name: k for k in report.kernels}
  assert predicted["fp8_cast"]["kernels"] == 2
  assert predicted["fp8_cast"]["seconds"] == pytest.approx(
      by_kernel["loop_convert_fusion.3"].time_s + by_kernel["pallas_call.7"].time_s)
  assert list(predicted) == [c for c in tc.CATEGORIES if c in predicted]


# Library kernels that no HLO instruction names: the GEMM dtype comes from the name.
@pytest.mark.parametrize("name, category", [
    ("nvjet_sm90_qqtst_256x128_128x4_1x2_v_bz_coopA_TNN", "gemm_fp8_e4m3"),
    ("nvjet_sm90_qrtst_256x128_128x4_1x2_v_bz_coopA_TNN", "gemm_fp8_e5m2"),
    ("nvjet_sm90_rqtst_256x128_128x4_1x2_v_bz_coopA_TNN", "gemm_fp8_e5m2"),
    ("nvjet_sm90_tst_176x128_64x5_1x2_h_bz_TNN", "gemm_bf16"),
    ("sm90_xmma_gemm_e4m3e4m3_e4m3f32_f32_tn_n_tilesize128x128x128", "gemm_fp8_e4m3"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64", "gemm_bf16"),
    ("splitKreduce_kernel", "gemm_other"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x128", "attention"),
    ("flash_attention_bwd_dkdv", "attention"),
    ("cast_transpose_amax__2", "fp8_cast"),
    ("amax", "fp8_cast"),
    ("fp8_scale_update", "fp8_state"),
    ("wrapped_slice_745", "slice_copy"),
    ("loop_dynamic_update_slice_fusion_2", "slice_copy"),
    ("input_concatenate_fusion", "slice_copy"),
    ("copy_7", "slice_copy"),
    ("memcpy32_post", "slice_copy"),
    ("Memset", "slice_copy"),
    ("loop_add_fusion_3", "elementwise"),
    ("input_reduce_fusion", "elementwise"),
    ("loop_add_slice_fusion", "elementwise"),  # an add: arithmetic, not only movement
    ("mosaic_gpu_kernel", "other"),
])
def test_a_kernel_known_by_name_alone_gets_its_category(name, category):
  assert tc.categorize(name, None) == category


def test_every_category_is_documented_with_what_its_rules_match():
  for rule in tc.RULES:
    re.compile(rule.pattern)
    assert rule.field in ("name", "op", "hlo", "gemm") and rule.matches, rule
  for category in tc.CATEGORIES:
    assert re.search(rf"^  {category}\s", tc.__doc__, re.MULTILINE), category
  assert tc.CATEGORIES[-1] == "other"


def _trace(kernels, host=(), derived=()):
  """A GPU trace: the device's kernels on stream threads, and other events beside them."""
  events = [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/host:CPU"}},
            {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/device:GPU:0"}},
            {"ph": "M", "pid": 2, "tid": 7, "name": "thread_name",
             "args": {"name": "Stream #7(Compute,Memset)"}},
            {"ph": "M", "pid": 2, "tid": 8, "name": "thread_name",
             "args": {"name": "Stream #8(MemcpyD2D)"}},
            {"ph": "M", "pid": 2, "tid": 99, "name": "thread_name", "args": {"name": "XLA Ops"}}]
  for tid, name, ts, dur, args in kernels:
    events.append({"ph": "X", "pid": 2, "tid": tid, "name": name, "ts": ts, "dur": dur,
                   "args": args})
  for name, ts, dur, args in host:
    events.append({"ph": "X", "pid": 1, "tid": 1, "name": name, "ts": ts, "dur": dur,
                   "args": args})
  for name, ts, dur in derived:
    events.append({"ph": "X", "pid": 2, "tid": 99, "name": name, "ts": ts, "dur": dur})
  return {"displayTimeUnit": "ns", "traceEvents": events}


def _op(hlo_op):
  return {"hlo_op": hlo_op, "hlo_module": "jit_train_step"}


# Two steps, 100 us apart. Per step (us from the step's start): the FP8 GEMM 0-40 (in a
# CUDA graph: its hlo_op names the graph's command buffer, so its name decides), the
# cast 45-55 (by name), a fusion the trace names by HLO instruction 55-60, the norm
# 60-70 (by its kernel name: 'input_reduce_fusion_5'), a memcpy on a second stream 62-66
# (overlapping the norm), an unknown kernel 80-81. Busy per step: 40 + 10 + 5 + 10 + 1 = 66 us
# (the memcpy inside the norm's time); the step spans 81 us in the first step and from
# the first step's 0 to the second's 81 (181 us) over the two.
_STEP = [(7, "nvjet_sm90_qrtst_256x128_128x4_1x2_v_bz_coopA_TNN", 0, 40, _op("command_buffer.1")),
         (7, "cast_transpose_amax__1", 45, 10, _op("command_buffer.1")),
         (7, "loop_convert_fusion_3", 55, 5, _op("loop_convert_fusion.3")),
         (7, "input_reduce_fusion_5", 60, 10, {}),
         (8, "MemcpyD2D", 62, 4, {}),
         (7, "mystery_kernel", 80, 1, _op("mystery.1"))]
_TWO_STEPS = [(tid, name, ts + offset, dur, args) for offset in (1000.0, 1100.0)
              for tid, name, ts, dur, args in _STEP]


def test_the_kernels_are_the_gpu_streams_events():
  # Host events with an hlo_op (the CPU runtime's, or launches) and a derived line that
  # repeats the kernels by op are not kernels of the device's streams.
  trace = _trace(_TWO_STEPS, host=[("cuLaunchKernel", 999.0, 2.0, _op("x"))],
                 derived=[("loop_convert_fusion.3", 1055.0, 5.0)])
  events, source = kernel_events(trace, module="jit_train_step")
  assert source == "gpu"
  assert [e.name for e in events] == [k[1] for k in sorted(_TWO_STEPS, key=lambda k: k[2])]
  assert events[0].stream == "Stream #7(Compute,Memset)" and events[0].duration_us == 40
  # A kernel of another program in the same trace is left out.
  other = _trace(_TWO_STEPS + [(7, "other_fusion", 1090.0, 3.0,
                                {"hlo_op": "f.1", "hlo_module": "jit_other"})])
  assert len(kernel_events(other, module="jit_train_step")[0]) == len(_TWO_STEPS)


def test_the_table_adds_each_category_per_step_and_the_gaps(program):
  _, kernels = program
  events, _ = kernel_events(_trace(_TWO_STEPS), module="jit_train_step")
  table = tc.category_table(events, steps=2, kernels=kernels)
  seconds = {c: round(row["seconds"] * 1e6, 6) for c, row in table["by_category"].items()}
  assert seconds == {"gemm_fp8_e5m2": 40, "fp8_cast": 15, "norm": 10, "slice_copy": 4,
                     "other": 1}
  assert {c: row["kernels"] for c, row in table["by_category"].items()} == {
      "gemm_fp8_e5m2": 1, "fp8_cast": 2, "norm": 1, "slice_copy": 1, "other": 1}
  assert table["kernels"] == 6
  assert table["span_s"] * 1e6 == pytest.approx(181 / 2)
  assert table["busy_s"] * 1e6 == pytest.approx(66)
  assert table["gaps_s"] * 1e6 == pytest.approx(181 / 2 - 66)
  assert table["kernel_s"] * 1e6 == pytest.approx(70)  # the memcpy overlaps the norm
  # Per step, one kernel matched by hlo_op, one by name, four by neither.
  assert table["resolved"] == {"hlo_op": 2, "name": 2, "unresolved": 8}
  assert table["by_category"]["other"]["top"] == [["mystery_kernel", pytest.approx(1e-6), 1]]
  text = tc.format_table(table, tc.predicted_table(*program), title="t")
  assert "gemm_fp8_e5m2" in text and "other: mystery_kernel (0.001 ms)" in text


def test_a_table_needs_a_positive_number_of_steps():
  with pytest.raises(ValueError, match="steps=0"):
    tc.category_table([], steps=0)


def test_on_a_cpu_the_kernels_are_the_runtime_s_innermost_thunk_events():
  """XLA:CPU records each thunk as a host event with its hlo_op; a while loop's event
  spans the thunks of its body, which are the kernels."""
  thunk = lambda name, ts, dur, tid=5: {"ph": "X", "pid": 1, "tid": tid, "name": name,
                                        "ts": ts, "dur": dur, "args": _op(name)}
  trace = {"traceEvents": [
      {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/host:CPU"}},
      {"ph": "X", "pid": 1, "tid": 5, "name": "PjitFunction(train_step)", "ts": 0, "dur": 50},
      thunk("while.3", 10, 30), thunk("fusion.1", 12, 5), thunk("fusion.2", 20, 5),
      thunk("copy.4", 40, 2), thunk("fusion.9", 11, 4, tid=6)]}
  events, source = kernel_events(trace)
  assert source == "cpu"
  assert [e.name for e in events] == ["fusion.9", "fusion.1", "fusion.2", "copy.4"]
  assert kernel_events({"traceEvents": []}) == ([], "none")


def test_reading_a_folder_without_a_trace_says_what_is_missing(tmp_path):
  with pytest.raises(FileNotFoundError, match=r"trace\.json\.gz"):
    read_trace(str(tmp_path))
