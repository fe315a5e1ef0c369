"""What a grouped FP8 matmul compiles to on an H100 (deviceless compile).

* fp8_ragged_dot: its three GEMMs (fprop, dgrad, wgrad) are the grouped FP8 Mosaic GPU
  kernels (whose PTX is proved e4m3 wgmma in tests/test_ragged_matmul_ptx.py), for
  per-tensor, per-row and DeepSeek-V3 block recipes: no dense GEMM at all.
* XLA's own `lax.ragged_dot` on f8 operands: one cuBLASLt FP8 GEMM whose contraction is
  G * K, a dense expansion that costs G times the FLOPs (README, "Mixture of experts").
"""
import re

import jax
import jax.numpy as jnp
import pytest

import fp8jax
from fp8jax import deviceless

_MISSING = deviceless.deviceless_toolchain_missing()
pytestmark = [pytest.mark.hopper,
              pytest.mark.skipif(_MISSING is not None, reason=str(_MISSING))]

M, K, N, G = 4096, 1024, 512, 8


def _specs():
  return (jax.ShapeDtypeStruct((M, K), jnp.bfloat16), jax.ShapeDtypeStruct((G, K, N), jnp.bfloat16),
          jax.ShapeDtypeStruct((G,), jnp.int32), jax.ShapeDtypeStruct((M, N), jnp.bfloat16))


@pytest.mark.parametrize("recipe", [fp8jax.DelayedScaling(), fp8jax.RowwiseScaling(),
                                    fp8jax.BlockScaling()], ids=["delayed", "rowwise", "block"])
def test_all_three_grouped_gemms_are_the_fp8_mosaic_kernels(recipe):
  x, w, sizes, target = _specs()

  def loss(params, meta, sizes, target):
    y, meta = fp8jax.fp8_ragged_dot(params["x"], params["w"], sizes, meta)
    return jnp.sum((y * target).astype(jnp.float32)), meta

  hlo = deviceless.compile_for_h100(fp8jax.value_and_grad(loss), {"x": x, "w": w},
                                    fp8jax.init_ragged_dot_meta(recipe, G), sizes,
                                    target).as_text()
  calls = [line for line in hlo.splitlines() if " custom-call(" in line]
  grouped = [line for line in calls if 'custom_call_target="mosaic_gpu' in line]
  assert len(grouped) == 3, grouped  # fprop, dgrad, wgrad
  results = [line.split(" custom-call(")[0] for line in grouped]
  assert sum(f"bf16[{M},{N}]" in r for r in results) == 1  # y
  assert sum(f"bf16[{M},{K}]" in r for r in results) == 1  # dx
  assert sum(f"[{G},{K},{N}]" in r for r in results) == 1  # dw, one per expert
  # No GEMM besides them: neither cuBLAS nor a dot of any kind.
  assert not any("cublas" in line for line in calls)
  assert not re.search(r"\sdot\(", hlo)


def test_xla_ragged_dot_on_fp8_is_a_dense_expansion_of_g_times_the_flops():
  x, w, sizes, _ = _specs()

  def plain(x, w, sizes):
    return jax.lax.ragged_dot(x.astype(jnp.float8_e4m3fn), w.astype(jnp.float8_e4m3fn), sizes,
                              preferred_element_type=jnp.bfloat16)

  hlo = deviceless.compile_for_h100(
      plain, x, w, sizes, compiler_options={"xla_gpu_enable_triton_gemm": False}).as_text()
  gemms = [line for line in hlo.splitlines()
           if 'custom_call_target="__cublas$lt$matmul$f8"' in line]
  assert len(gemms) == 1
  # Its left operand is the masked copy of x: every row against all G experts' K inputs.
  shapes = set(re.findall(r"f8e4m3fn\[([\d,]+)\]", hlo))
  assert f"{M},{G * K}" in shapes or f"{M},{G},{K}" in shapes, shapes
