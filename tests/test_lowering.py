"""The Hopper lowering contract, checked by compiling for an H100 without a GPU.

Every FP8 GEMM of fp8jax (fprop, dgrad, wgrad of each dense / einsum) must be
the cuBLASLt FP8 custom call `__cublas$lt$matmul$f8`. Negative controls show
the check can fail. The reference for "FP8 or not" is independent of
fp8jax's own claims: it is what XLA wrote into the optimized HLO (and PTX).
"""
from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

import fp8jax
from fp8jax import lowering
from fp8jax.deviceless import deviceless_toolchain_missing
from fp8jax.lowering import GemmKind
from fp8jax.lowering.gemms import fp8_mma

_MISSING = deviceless_toolchain_missing()
hopper = pytest.mark.hopper
needs_toolchain = pytest.mark.skipif(_MISSING is not None, reason=_MISSING or "")

E4M3, E5M2 = "f8e4m3fn", "f8e5m2"
BF16 = jnp.bfloat16
CUBLAS_ONLY = lowering.CUBLAS_ONLY_OPTIONS


def spec(*shape, dtype=BF16):
  return jax.ShapeDtypeStruct(shape, dtype)


def dense_fwd_bwd(x, kernel, bias, meta):
  """Gradients of a scalar loss through one fp8_dense: fprop, dgrad and wgrad GEMMs."""

  def loss(x, kernel, bias, meta):
    y, meta = fp8jax.fp8_dense(x, kernel, bias, meta)
    return jnp.sum(jnp.square(y.astype(jnp.float32))), meta

  return jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(x, kernel, bias, meta)


def meta():
  return fp8jax.init_dot_meta(fp8jax.DelayedScaling())


def pad16(n):
  return -(-n // 16) * 16


def dense_role(gemm, m, k, n):
  """'fprop' / 'dgrad' / 'wgrad' from the GEMM's output dims (XLA pads dims to 16)."""
  out = sorted(int(d) for d in gemm.output.split("[")[1].rstrip("]").split(","))
  for role, dims in (("fprop", (m, n)), ("dgrad", (m, k)), ("wgrad", (k, n))):
    if out == sorted(dims) or out == sorted(pad16(d) for d in dims):
      return role
  raise AssertionError(f"cannot tell the role of {gemm.name} with output {gemm.output}")


# The operand formats each role must see (HYBRID: E4M3 forward, E5M2 gradient).
ROLE_DTYPES = {"fprop": {E4M3}, "dgrad": {E4M3, E5M2}, "wgrad": {E4M3, E5M2}}


def assert_all_cublaslt_fp8(report, expected_gemms):
  assert len(report.gemms) == expected_gemms, str(report)
  assert report.all_fp8, str(report)
  assert report.summary() == f"{expected_gemms} of {expected_gemms} GEMMs run in FP8"
  for gemm in report.gemms:
    assert gemm.kind is GemmKind.CUBLASLT_FP8, str(report)
    for operand in (gemm.lhs, gemm.rhs):
      assert operand.dtype in (E4M3, E5M2)
      assert not operand.upcast_fp8
      # cuBLASLt FP8 on Hopper takes "TN" operands only: K innermost in memory.
      assert operand.contracting_minor is True, str(report)
      assert operand.quantized_in is not None, str(report)


# (x shape, kernel shape): 2-D and 3-D inputs; dims that are and are not multiples of 16.
DENSE_CASES = {
    "2d_mult16": ((64, 128), (128, 256)),
    "2d_K_N_not16": ((64, 100), (100, 200)),
    "2d_M_not16": ((60, 128), (128, 256)),
    "2d_tiny": ((8, 32), (32, 48)),
    "3d_mult16": ((4, 32, 96), (96, 192)),
    "3d_not16": ((3, 20, 72), (72, 40)),
}


@hopper
@needs_toolchain
@pytest.mark.parametrize("case", DENSE_CASES, ids=list(DENSE_CASES))
def test_fp8_dense_fprop_dgrad_wgrad_are_cublaslt_fp8_gemms(case):
  x_shape, k_shape = DENSE_CASES[case]
  report = lowering.inspect(dense_fwd_bwd, spec(*x_shape), spec(*k_shape), spec(k_shape[1]),
                            meta(), compiler_options=CUBLAS_ONLY, target="deviceless")
  assert_all_cublaslt_fp8(report, expected_gemms=3)
  m = 1
  for d in x_shape[:-1]:
    m *= d
  k, n = k_shape
  roles = {dense_role(g, m, k, n): g for g in report.gemms}
  assert set(roles) == {"fprop", "dgrad", "wgrad"}, str(report)
  for role, gemm in roles.items():
    assert set(gemm.operand_dtypes) == ROLE_DTYPES[role], (role, str(report))
    assert gemm.is_backward == (role != "fprop")
    # fp8jax's named scopes label the same GEMM with the role found from its shapes.
    assert gemm.role == role, (role, gemm.op_name)

  # cuBLASLt FP8 wants every dim a multiple of 16. XLA pads the operands (inside the
  # quantize fusion, in FP8) and slices the f32 product; it never falls back to bf16.
  padded = [op for g in report.gemms for op in (g.lhs, g.rhs) if op.pads]
  needs_padding = any(d % 16 for d in (m, k, n))
  assert bool(padded) == needs_padding, str(report)
  for gemm in report.gemms:
    for operand in (gemm.lhs, gemm.rhs):
      dims = [int(d) for d in operand.shape.split("[")[1].rstrip("]").split(",")]
      assert all(d % 16 == 0 for d in dims), str(report)


@hopper
@needs_toolchain
def test_fp8_einsum_attention_projections_are_cublaslt_fp8_gemms():
  batch, seq, model, heads, head_dim = 2, 64, 128, 4, 32

  def projections(x, w_q, w_o, meta_q, meta_o):
    def loss(x, w_q, w_o, meta_q, meta_o):
      q, meta_q = fp8jax.fp8_einsum("bsd,dhk->bshk", x, w_q, meta_q)
      o, meta_o = fp8jax.fp8_einsum("bshk,hkd->bsd", q, w_o, meta_o)
      return jnp.sum(jnp.square(o.astype(jnp.float32))), (meta_q, meta_o)
    return jax.grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True)(x, w_q, w_o, meta_q, meta_o)

  report = lowering.inspect(
      projections, spec(batch, seq, model), spec(model, heads, head_dim),
      spec(heads, head_dim, model), meta(), meta(), compiler_options=CUBLAS_ONLY,
      target="deviceless")
  # Two einsums x (fprop, dgrad, wgrad).
  assert_all_cublaslt_fp8(report, expected_gemms=6)
  assert sum(not g.is_backward for g in report.gemms) == 2


@hopper
@needs_toolchain
def test_example_train_step_runs_every_gemm_in_fp8():
  train_step, args = lowering.example_train_step(widths=(64, 128, 64), batch_size=2, seq_len=32)
  report = lowering.inspect(train_step, *args, compiler_options=CUBLAS_ONLY,
                            target="deviceless")
  # 2 layers x 3 GEMMs, minus the first layer's dgrad (no gradient for the input batch).
  assert_all_cublaslt_fp8(report, expected_gemms=5)
  assert sum(not g.is_backward for g in report.gemms) == 2


@hopper
@needs_toolchain
def test_default_xla_flags_keep_fp8_operands_but_triton_upcasts_in_registers():
  """Records what XLA's default flags do to fp8jax's GEMMs (deviceless, so untuned).

  The Triton GEMM emitter claims every FP8 dot. In HLO the operands stay FP8
  (no convert to bf16/f16 before the GEMM), but the generated kernel widens
  them to f16 in registers: its PTX uses `mma.sync...f16.f16`, not FP8
  `wgmma`. If this test starts failing because the PTX shows e4m3/e5m2 MMA,
  XLA has changed: update the advice on `xla_gpu_enable_triton_gemm` (docs/guides/lowering.md).
  """
  report = lowering.inspect(dense_fwd_bwd, spec(64, 128), spec(128, 256), spec(256), meta(),
                            compiler_options={}, target="deviceless")
  assert len(report.gemms) == 3, str(report)
  for gemm in report.gemms:
    assert gemm.kind in (GemmKind.TRITON, GemmKind.CUBLASLT_FP8), str(report)
    for operand in (gemm.lhs, gemm.rhs):
      assert operand.dtype in (E4M3, E5M2), str(report)
      assert not operand.upcast_fp8, str(report)
  triton = report.gemms_by_kind().get(GemmKind.TRITON, ())
  assert triton, "XLA defaults no longer pick Triton for FP8 GEMMs; update the docs."
  for gemm in triton:
    assert gemm.ptx_mma, str(report)
    assert not any(fp8_mma(m) for m in gemm.ptx_mma), str(report)
    assert not gemm.runs_in_fp8 and "upcasts" in gemm.why_not_fp8


@hopper
@needs_toolchain
def test_transposes_xla_inserts_for_the_tn_layout_of_fp8_dense():
  """Counts the transposes on each operand path of fprop, dgrad and wgrad (2-D, no padding).

  TN needs K innermost: fprop must transpose the kernel ([K, N] has N innermost),
  dgrad needs nothing (g [M, N] and kernel [K, N] both have N innermost), wgrad
  must transpose x and g (both have M outermost). fp8jax's cast-transpose-amax
  kernel writes every transposed copy in the pass that quantizes the tensor,
  so no GEMM operand passes through a separate transpose kernel:
    fprop: kernel^T from the kernel's quantize; dgrad: nothing;
    wgrad: x^T and g^T from their quantizes.
  (XLA on its own, jax 0.10.2, added a separate f8 transpose for dgrad's kernel
  and for wgrad's g^T.)
  """
  m, k, n = 64, 128, 256
  report = lowering.inspect(dense_fwd_bwd, spec(m, k), spec(k, n), spec(n), meta(),
                            compiler_options=CUBLAS_ONLY, target="deviceless")
  roles = {dense_role(g, m, k, n): g for g in report.gemms}

  def count(gemm):
    return (len(gemm.transposes), sum(not t.in_quantize for t in gemm.transposes))

  assert count(roles["fprop"]) == (1, 0), str(report)
  assert count(roles["dgrad"]) == (0, 0), str(report)
  assert count(roles["wgrad"]) == (2, 0), str(report)
  fused = {t.dtype for g in report.gemms for t in g.transposes}
  assert fused <= {E4M3, E5M2}, "transposed copies are written in FP8 (1 byte per element)"


# ----- negative controls: the check must be able to say "not FP8" -----

def dequantize_channel_scales_then_dot(x, kernel, x_scale, k_scale):
  """Quantizes to E4M3 with per-K-channel scales, dequantizes to bf16, then a bf16 dot.

  A scale that varies along the contracted dim cannot move past the dot, so no
  FP8 GEMM can compute this: XLA must run the dot in bf16.
  """
  qx = jnp.clip(x * x_scale[None, :], -448, 448).astype(jnp.float8_e4m3fn)
  qk = jnp.clip(kernel * k_scale[:, None], -448, 448).astype(jnp.float8_e4m3fn)
  return jnp.dot(qx.astype(BF16) / x_scale[None, :].astype(BF16),
                 qk.astype(BF16) / k_scale[:, None].astype(BF16))


def dequantize_scalar_scales_then_dot(x, kernel, x_scale, k_scale):
  qx = jnp.clip(x * x_scale, -448, 448).astype(jnp.float8_e4m3fn)
  qk = jnp.clip(kernel * k_scale, -448, 448).astype(jnp.float8_e4m3fn)
  return jnp.dot(qx.astype(BF16) / x_scale.astype(BF16), qk.astype(BF16) / k_scale.astype(BF16))


def e5m2_dot(x, kernel):
  return jax.lax.dot_general(x.astype(jnp.float8_e5m2), kernel.astype(jnp.float8_e5m2),
                             (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)


# With XLA's default xla_allow_excess_precision=True, the GPU compiler may drop a
# cast to FP8 that is followed by a widening cast (f32->f8->bf16 becomes f32->bf16),
# so the optimized HLO of these controls holds no FP8 at all. With the option off,
# the FP8 data and its upcast stay visible. Both must be reported as "not FP8".
EXCESS_PRECISION = {"default": CUBLAS_ONLY,
                    "exact": dict(CUBLAS_ONLY, xla_allow_excess_precision=False)}


@hopper
@needs_toolchain
@pytest.mark.parametrize("precision", EXCESS_PRECISION)
def test_dequantize_then_bf16_dot_is_reported_not_fp8(precision):
  report = lowering.inspect(dequantize_channel_scales_then_dot, spec(64, 128), spec(128, 256),
                            spec(128, dtype=jnp.float32), spec(128, dtype=jnp.float32),
                            compiler_options=EXCESS_PRECISION[precision], target="deviceless")
  assert report.summary() == "0 of 1 GEMMs run in FP8", str(report)
  (gemm,) = report.gemms
  assert gemm.kind is GemmKind.CUBLAS
  assert gemm.operand_dtypes == ("bf16", "bf16")
  if precision == "exact":
    # The report shows the FP8 data being widened on the way to the GEMM.
    assert gemm.lhs.upcast_fp8 and gemm.rhs.upcast_fp8, str(report)
    assert "upcast" in gemm.why_not_fp8
  else:
    # The FP8 rounding itself was optimized away.
    assert gemm.lhs.quantized_in is None and gemm.rhs.quantized_in is None, str(report)


@hopper
@needs_toolchain
def test_dequantize_with_scalar_scales_is_rewritten_by_xla_into_an_fp8_gemm():
  """The opposite of the negative control: XLA moves scalar scales past the dot."""
  report = lowering.inspect(dequantize_scalar_scales_then_dot, spec(64, 128), spec(128, 256),
                            spec(dtype=jnp.float32), spec(dtype=jnp.float32),
                            compiler_options=CUBLAS_ONLY, target="deviceless")
  assert report.summary() == "1 of 1 GEMMs run in FP8", str(report)
  assert report.gemms[0].kind is GemmKind.CUBLASLT_FP8


@hopper
@needs_toolchain
@pytest.mark.parametrize("precision", EXCESS_PRECISION)
def test_e5m2_x_e5m2_dot_is_reported_not_fp8_with_cublas(precision):
  report = lowering.inspect(e5m2_dot, spec(64, 128), spec(128, 256),
                            compiler_options=EXCESS_PRECISION[precision], target="deviceless")
  (gemm,) = report.gemms
  assert gemm.kind is GemmKind.CUBLAS and not gemm.runs_in_fp8, str(report)
  assert gemm.operand_dtypes == ("f16", "f16")  # E5M2 x E5M2 runs as an f16 GEMM
  if precision == "exact":
    upcasts = {str(c) for op in (gemm.lhs, gemm.rhs) for c in op.converts if c.upcasts_fp8}
    assert upcasts == {"f8e5m2->f16"}, str(report)


@hopper
@needs_toolchain
def test_e5m2_x_e5m2_dot_is_reported_not_fp8_with_triton_from_its_ptx():
  # With Triton the HLO shows f8e5m2 operands at the dot; only the PTX tells.
  report = lowering.inspect(e5m2_dot, spec(64, 128), spec(128, 256), compiler_options={},
                            target="deviceless")
  (gemm,) = report.gemms
  assert gemm.kind is GemmKind.TRITON, str(report)
  assert gemm.operand_dtypes == (E5M2, E5M2)
  assert gemm.ptx_mma and not gemm.runs_in_fp8, str(report)


# ----- the command line, and a CPU-only machine with the CUDA plugin installed -----

@hopper
@needs_toolchain
def test_cli_reports_the_example_without_a_cudnn_traceback():
  env = dict(os.environ)
  env.pop("JAX_PLATFORMS", None)  # what a user gets by default
  env.pop("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", None)
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env["PYTHONPATH"] = os.pathsep.join(filter(None, [repo, env.get("PYTHONPATH")]))
  result = subprocess.run([sys.executable, "-m", "fp8jax.lowering", "--strict"], env=env,
                          capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stdout + result.stderr
  assert "8 of 8 GEMMs run in FP8" in result.stdout
  assert "cuDNN" not in result.stderr and "Traceback" not in result.stderr, result.stderr


# ----- the HLO reader on a hand-written module (no toolchain needed) -----

_SMALL_HLO = """\
HloModule jit_f, is_scheduled=true

%fused_transpose (param_0: f32[], param_1: bf16[128,256]) -> f8e4m3fn[256,128] {
  %param_1 = bf16[128,256]{1,0} parameter(1)
  %convert.5 = f32[128,256]{1,0} convert(%param_1)
  %transpose.3 = f32[256,128]{1,0} transpose(%convert.5), dimensions={1,0}
  %param_0 = f32[] parameter(0)
  %broadcast.49 = f32[256,128]{1,0} broadcast(%param_0), dimensions={}
  %multiply.8 = f32[256,128]{1,0} multiply(%transpose.3, %broadcast.49)
  ROOT %convert.1 = f8e4m3fn[256,128]{1,0} convert(%multiply.8)
}

%wrapped_transpose_computation (param_0.1: f8e4m3fn[256,128]) -> f8e4m3fn[128,256] {
  %param_0.1 = f8e4m3fn[256,128]{1,0} parameter(0)
  ROOT %transpose.4 = f8e4m3fn[128,256]{1,0} transpose(%param_0.1), dimensions={1,0}
}

ENTRY %main (x: f8e4m3fn[64,128], k: bf16[128,256], s: f32[], h: f16[64,256]) -> (f32[64,256], f32[64,128], f32[64,64]) {
  %s = f32[] parameter(2)
  %k = bf16[128,256]{1,0} parameter(1)
  %x = f8e4m3fn[64,128]{1,0} parameter(0)
  %h = f16[64,256]{1,0} parameter(3)
  %input_transpose_fusion = f8e4m3fn[256,128]{1,0} fusion(%s, %k), kind=kInput, calls=%fused_transpose
  %bitcast.29 = f8e4m3fn[128,256]{0,1} bitcast(%input_transpose_fusion)
  %gemm = (f32[64,256]{1,0}, s8[1024]{0}) custom-call(%x, %bitcast.29, %s, %s), custom_call_target="__cublas$lt$matmul$f8", backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"],"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]}}}
  %wrapped_transpose = f8e4m3fn[128,256]{1,0} fusion(%input_transpose_fusion), kind=kInput, calls=%wrapped_transpose_computation
  %bitcast.31 = f8e4m3fn[256,128]{0,1} bitcast(%wrapped_transpose)
  %gemm.2 = (f32[64,128]{1,0}, s8[1024]{0}) custom-call(%h, %h), custom_call_target="__cublas$gemm", backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["1"],"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]}}}
  %dot.7 = f32[64,64]{1,0} dot(%h, %h), lhs_contracting_dims={1}, rhs_contracting_dims={1}
  %out.0 = f32[64,256]{1,0} get-tuple-element(%gemm), index=0
  %out.1 = f32[64,128]{1,0} get-tuple-element(%gemm.2), index=0
  ROOT %tuple = (f32[64,256]{1,0}, f32[64,128]{1,0}, f32[64,64]{1,0}) tuple(%out.0, %out.1, %dot.7)
}
"""


def test_inspect_hlo_classifies_gemms_and_finds_the_fused_transpose():
  report = lowering.inspect_hlo(_SMALL_HLO)
  kinds = [g.kind for g in report.gemms]
  assert kinds == [GemmKind.CUBLASLT_FP8, GemmKind.CUBLAS, GemmKind.DOT]
  assert report.summary() == "1 of 3 GEMMs run in FP8"
  fp8_gemm = report.gemms[0]
  assert fp8_gemm.operand_dtypes == (E4M3, E4M3) and fp8_gemm.output_dtype == "f32"
  assert fp8_gemm.lhs.transposes == () and fp8_gemm.lhs.source.endswith("parameter x")
  (transpose,) = fp8_gemm.rhs.transposes
  assert transpose.instruction == "input_transpose_fusion" and transpose.in_quantize
  assert transpose.dtype == "f32"  # transposed before the cast, inside one fusion
  assert fp8_gemm.rhs.contracting_minor is True
  assert [str(c) for c in fp8_gemm.rhs.converts] == ["bf16->f32", "f32->f8e4m3fn"]
  assert report.gemms[1].why_not_fp8 == "cublas GEMM on f16 x f16"
  assert "1 of 3 GEMMs run in FP8" in str(report)


def test_inspect_rejects_python_scalars_naming_the_argument():
  with pytest.raises(TypeError, match=r"args\[1\]"):
    lowering.inspect(lambda a, b: a * b, spec(4), 2.0, target="deviceless")


def test_inspect_rejects_an_unknown_target():
  with pytest.raises(ValueError, match="target='h100'"):
    lowering.inspect(lambda a: a, spec(4), target="h100")


def test_inspect_hlo_rejects_text_without_an_entry_computation():
  with pytest.raises(ValueError, match="ENTRY"):
    lowering.inspect_hlo("HloModule empty\n")
