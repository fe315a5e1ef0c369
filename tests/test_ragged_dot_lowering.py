"""What a grouped FP8 matmul compiles to on an H100 (deviceless compile), and what
`fp8jax inspect` and `fp8jax cost` read from it.

* fp8_ragged_dot: its three GEMMs (fprop, dgrad, wgrad) are the grouped FP8 Mosaic GPU
  kernels (whose PTX is proved e4m3 wgmma in tests/test_ragged_matmul_ptx.py), for
  per-tensor, per-row and DeepSeek-V3 block recipes: no dense GEMM at all. The report
  says "grouped kernel" for each, the cost model charges each one dense GEMM's FLOPs.
* Where the kernels do not tile the shapes, the jnp twin: a loop of per-tile cuBLASLt FP8
  GEMMs ("per-tile loop").
* XLA's own `lax.ragged_dot` on f8 operands: one cuBLASLt FP8 GEMM whose contraction is
  G * K, a dense expansion that costs G times the FLOPs (README, "Mixture of experts").
* A DeepSeek-V3-sized expert layer's step is predicted >= 1.5x the same step on JAX's own
  bf16 Mosaic grouped GEMMs (benchmarks/moe_expert_layer.py).
"""
import re

import jax
import jax.numpy as jnp
import pytest

import fp8jax
from fp8jax import deviceless, lowering
from fp8jax.cli import main
from fp8jax.lowering import ExpertPath, GemmKind
from fp8jax.lowering.compile import compile_text

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

  # What `fp8jax inspect` says of them: the three roles, each a grouped FP8 kernel.
  report = lowering.inspect_hlo(hlo)
  assert sorted(g.role for g in report.gemms) == ["dgrad", "fprop", "wgrad"], str(report)
  assert report.all_fp8 and all(g.kind is GemmKind.GROUPED for g in report.gemms)
  assert all(g.expert_path is ExpertPath.GROUPED_KERNEL for g in report.gemms)
  # And `fp8jax cost`: each one dense GEMM's FLOPs (every row with its expert only) at the
  # FP8 rate; the kernels are the program's only GEMMs.
  costs = lowering.cost_hlo(hlo)
  grouped = [k for k in costs.kernels if k.is_gemm]
  assert sorted(k.grouped_kernel for k in grouped) == [
      "ragged_matmul", "ragged_matmul", "transposed_ragged_matmul"], costs.table()
  assert all(k.flops == 2 * M * K * N and k.gemm_dtype == "f8e4m3fn" for k in grouped)


def test_fp8jax_inspect_and_cost_commands_name_the_path_of_each_expert_gemm(
    tmp_path, monkeypatch, capsys):
  (tmp_path / "moe_factories.py").write_text(_FACTORIES)
  monkeypatch.syspath_prepend(str(tmp_path))
  assert main(["inspect", "--factory", "moe_factories:delayed_step", "--no-ptx",
               "--strict"]) == 0
  out = capsys.readouterr().out
  assert "3 of 3 GEMMs run in FP8 (3 grouped)" in out, out
  assert "3 expert GEMMs (grouped matmuls): 3 grouped kernel" in out, out
  rows = [line for line in out.splitlines() if line.lstrip().startswith(("0 ", "1 ", "2 "))]
  assert len(rows) == 3 and all("grouped kernel" in row for row in rows), out
  assert main(["cost", "--factory", "moe_factories:delayed_step"]) == 0
  out = capsys.readouterr().out
  assert out.count(" grouped f8e4m3fn ") == 3 and "(3 GEMM," in out, out


_FACTORIES = f'''
import jax, jax.numpy as jnp
import fp8jax

def delayed_step():
  def loss(params, meta, sizes, target):
    y, meta = fp8jax.fp8_ragged_dot(params["x"], params["w"], sizes, meta)
    return jnp.sum((y * target).astype(jnp.float32)), meta
  spec = jax.ShapeDtypeStruct
  params = {{"x": spec(({M}, {K}), jnp.bfloat16), "w": spec(({G}, {K}, {N}), jnp.bfloat16)}}
  return fp8jax.value_and_grad(loss), (params, fp8jax.init_ragged_dot_meta(
      fp8jax.DelayedScaling(), {G}), spec(({G},), jnp.int32), spec(({M}, {N}), jnp.bfloat16))
'''


def test_shapes_off_the_kernels_tiles_take_the_jnp_twin_a_loop_of_cublaslt_fp8_gemms():
  """K = 1000 (not a multiple of the kernels' 128): the twin's tile products, one GEMM per
  (expert, row tile) work item inside a loop, which XLA makes cuBLASLt FP8 GEMMs."""
  k = 1000
  x = jax.ShapeDtypeStruct((M, k), jnp.bfloat16)
  w = jax.ShapeDtypeStruct((G, k, N), jnp.bfloat16)
  _, _, sizes, target = _specs()

  def loss(params, meta, sizes, target):
    y, meta = fp8jax.fp8_ragged_dot(params["x"], params["w"], sizes, meta)
    return jnp.sum((y * target).astype(jnp.float32)), meta

  report = lowering.inspect(fp8jax.value_and_grad(loss), {"x": x, "w": w},
                            fp8jax.init_ragged_dot_meta(fp8jax.DelayedScaling(), G), sizes,
                            target, compiler_options=lowering.CUBLAS_ONLY_OPTIONS, ptx=False)
  assert sorted(g.role for g in report.gemms) == ["dgrad", "fprop", "wgrad"], str(report)
  assert all(g.expert_path is ExpertPath.TILE_LOOP and g.kind is GemmKind.CUBLASLT_FP8
             for g in report.gemms), str(report)
  assert "3 expert GEMMs (grouped matmuls): 3 per-tile loop" in str(report)


def test_a_moe_layers_tile_gemms_get_the_roles_of_the_loops_that_run_them():
  """An Fp8MoE whose widths the kernels do not tile (d = hidden = 200) runs the jnp twin:
  per-tile GEMMs in loops, whose bodies are the same for fprop and dgrad when K == N.
  JAX lowers that body once, with fprop's names, for both loops; the roles come from
  the loops (each named where it runs): fprop of both layers' GEMMs, dgrad of w_out (x's
  own gradient is not asked for, so w_in's dgrad is dropped), wgrad of both."""
  from fp8jax.flax.linen_moe import Fp8MoE
  layer = Fp8MoE(num_experts=2, top_k=1, hidden=200)
  x = jax.ShapeDtypeStruct((64, 200), jnp.bfloat16)
  variables = jax.eval_shape(layer.init, jax.random.key(0), x)

  def loss(params, fp8_state, x):
    y, state = layer.apply({"params": params, "fp8_meta": fp8_state}, x,
                           mutable=["fp8_meta", "intermediates"])
    return jnp.sum(y.astype(jnp.float32) ** 2), state["fp8_meta"]

  report = lowering.inspect(fp8jax.value_and_grad(loss), variables["params"],
                            variables["fp8_meta"], x,
                            compiler_options=lowering.CUBLAS_ONLY_OPTIONS, ptx=False)
  experts = report.expert_gemms()
  assert all(g.expert_path is ExpertPath.TILE_LOOP for g in experts), str(report)
  assert sorted(g.role for g in experts) == ["dgrad", "fprop", "fprop", "wgrad", "wgrad"], (
      str(report))
  # The body's own names say fprop (what misled the report before) for the dgrad GEMM.
  dgrad, = [g for g in experts if g.role == "dgrad"]
  assert "fp8_grouped_fprop" in dgrad.op_name and dgrad.is_backward
  assert all(g.is_backward == (g.role != "fprop") for g in experts)


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
  # `fp8jax inspect` calls it what it is, and `fp8jax cost` charges its G-fold FLOPs.
  (gemm,) = lowering.inspect_hlo(hlo).gemms
  assert gemm.expert_path is ExpertPath.DENSE_EXPANSION and gemm.runs_in_fp8
  (charged,) = [k for k in lowering.cost_hlo(hlo).kernels if k.is_gemm]
  assert charged.flops == G * 2 * M * K * N and not charged.grouped_kernel


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


def test_deepseek_sized_expert_layer_step_is_predicted_at_least_1_5x_jax_bf16_grouped_gemms():
  """DeepSeek-V3's expert MLP (8 experts x 4096 rows, d_model 7168, SwiGLU hidden 2048: the
  GEMMs K=7168 N=2x2048 and K=2048 N=7168), forward and backward, float32 masters: FP8
  with delayed scaling against the same step on JAX's own bf16 Hopper grouped GEMMs
  (ragged_dot_mgpu for fprop and dgrad, transposed_ragged_dot_mgpu for wgrad, the best
  bf16 grouped GEMMs JAX offers; all compiled, none charged by hand)."""
  from benchmarks import moe_expert_layer as layer

  def compiled(made):
    fn, args = made
    return compile_text(fn, *args, compiler_options=dict(lowering.CUBLAS_ONLY_OPTIONS),
                        target="deviceless", collect_ptx=False).hlo

  fp8_hlo, bf16_hlo = compiled(layer.fp8_step("swiglu")), compiled(layer.bf16_step("swiglu"))
  # Every expert GEMM of the FP8 step (two matmuls x fprop, dgrad, wgrad) is a grouped FP8
  # kernel: none bf16, none a dense expansion, and no other GEMM in the step.
  report = lowering.inspect_hlo(fp8_hlo)
  assert len(report.gemms) == 6 and report.all_fp8, str(report)
  assert sorted(g.role for g in report.gemms) == ["dgrad"] * 2 + ["fprop"] * 2 + ["wgrad"] * 2
  assert all(g.expert_path is ExpertPath.GROUPED_KERNEL for g in report.gemms), str(report)

  fp8, bf16 = lowering.cost_hlo(fp8_hlo, label="fp8"), lowering.cost_hlo(bf16_hlo, label="bf16")
  tokens, d, hidden = layer.EXPERTS * layer.ROWS_PER_EXPERT, layer.D_MODEL, layer.HIDDEN
  # fprop, dgrad and wgrad of each matmul: 2 x tokens x K x N each, from the layer's shapes.
  flops = 3 * 2 * tokens * (d * 2 * hidden + hidden * d)
  for step, dtype, kernels in ((fp8, "f8e4m3fn", ["ragged_matmul"] * 4
                                + ["transposed_ragged_matmul"] * 2),
                               (bf16, "bf16", ["ragged_dot_mgpu"] * 4
                                + ["transposed_ragged_dot_mgpu"] * 2)):
    gemms = [k for k in step.kernels if k.is_gemm]
    assert sorted(k.grouped_kernel for k in gemms) == kernels, step.table()
    assert {k.gemm_dtype for k in gemms} == {dtype} and step.flops == flops, step.table()
    # Each grouped GEMM is compute-bound: its FLOPs at its rate plus one launch.
    constants = step.constants
    for k in gemms:
      assert k.time_s == pytest.approx(
          k.flops / constants.gemm_rate(dtype) + constants.kernel_overhead_s, rel=1e-12)
  speedup = lowering.compare(fp8, bf16).speedup
  # The target for the expert layer's step (predicted; the GPU check measures).
  assert speedup >= 1.5, (speedup, fp8.table(), bf16.table())
