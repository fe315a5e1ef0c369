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


def test_expert_parallel_step_on_8_h100s_dispatches_fp8_rows_and_runs_only_local_experts():
  """Experts split 8 ways (2 per GPU) inside shard_map: the tokens' rows travel to their
  experts in FP8 by ragged all-to-all, each GPU's grouped kernels take only its experts'
  weights, and nothing gathers the batch."""
  import functools
  from jax.sharding import NamedSharding, PartitionSpec as P
  from fp8jax.ops import expert_parallel, moe_routing

  experts, d, hidden, tokens_per_gpu, k = 16, 1024, 2048, 2048, 2
  mesh = deviceless.h100_mesh(expert=8)
  recipe = fp8jax.DelayedScaling()

  def per_device(params, tokens, metas):
    def loss_fn(params, metas):
      routing = moe_routing.route_top_k(tokens.astype(jnp.float32) @ params["router"], k)
      x_sorted, sizes, order = moe_routing.sort_by_expert(tokens, routing.experts, experts)
      y_sorted, meta_in, meta_out = expert_parallel.expert_parallel_mlp(
          x_sorted, sizes, params["w_in"], params["w_out"], metas["in"], metas["out"],
          axis_name="expert")
      y = moe_routing.combine(y_sorted, order, routing.weights)
      return jnp.sum(y.astype(jnp.float32) ** 2), {"in": meta_in, "out": meta_out}
    loss, grads, metas = fp8jax.value_and_grad(loss_fn)(params, metas)
    return jax.lax.psum(loss, "expert"), grads, metas

  params_spec = {"router": P(), "w_in": P("expert"), "w_out": P("expert")}
  step = jax.shard_map(per_device, mesh=mesh, in_specs=(params_spec, P("expert"), P()),
                       out_specs=(P(), params_spec, P()))
  place = lambda shape, dtype, spec: jax.ShapeDtypeStruct(shape, dtype,
                                                          sharding=NamedSharding(mesh, spec))
  params = {"router": place((d, experts), jnp.float32, P()),
            "w_in": place((experts, d, hidden), jnp.bfloat16, P("expert")),
            "w_out": place((experts, hidden, d), jnp.bfloat16, P("expert"))}
  metas = jax.tree.map(lambda a: place(a.shape, a.dtype, P()),
                       {"in": fp8jax.init_ragged_dot_meta(recipe, experts),
                        "out": fp8jax.init_ragged_dot_meta(recipe, experts)})
  tokens = place((8 * tokens_per_gpu, d), jnp.bfloat16, P("expert"))
  hlo = deviceless.compile_for_h100(step, params, tokens, metas).as_text()

  rows = tokens_per_gpu * k
  dispatches = [line for line in hlo.splitlines() if "ragged-all-to-all-start(" in line]
  # The dispatch sends this GPU's rows (its tokens' pairs) in FP8; the returns are bf16.
  assert any(f"(f8e4m3fn[{rows},{d}]" in line for line in dispatches), dispatches
  assert "all-gather" not in hlo
  grouped = [line for line in hlo.splitlines()
             if 'custom_call_target="mosaic_gpu' in line and " custom-call(" in line]
  # 2 grouped matmuls x (fprop, dgrad, wgrad), less the first one's dgrad: the tokens
  # are not differentiated here.
  assert len(grouped) == 5, len(grouped)
  results = " ".join(line.split(" custom-call(")[0] for line in grouped)
  assert f"[2,{d},{hidden}]" in results and f"[2,{hidden},{d}]" in results  # local experts
  assert f"[{experts}," not in results  # no GPU computes all experts
