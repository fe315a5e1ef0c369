"""The whole FP8 attention train step compiles for an H100 without a GPU.

`fp8_attention` on Hopper ("pallas_hopper_fp8") runs the Mosaic GPU FP8 forward and
its FP8 backward (a dQ and a dK/dV kernel, which recompute P from the forward's
log-sum-exp); their wgmma types are proved from their PTX in
test_hopper_attention_ptx.py. This compiles the pairing through
`fp8jax.value_and_grad` at the target shape (S = 4096, D = 128, GQA 4:1, causal): the
compile fails if a kernel does not fit the chip's shared memory or the kernels disagree
on shapes.
"""
import re

import jax
import jax.numpy as jnp
import pytest

import fp8jax
from fp8jax import deviceless
from fp8jax.ops.attention import _Call, _fp8_attention

_MISSING = deviceless.deviceless_toolchain_missing()
pytestmark = [pytest.mark.hopper,
              pytest.mark.skipif(_MISSING is not None, reason=str(_MISSING))]


def test_fp8_attention_train_step_compiles_for_h100_with_hopper_forward_and_backward():
  batch, seq, heads, kv_heads, head_dim = 1, 4096, 16, 4, 128
  call = _Call("pallas_hopper_fp8", causal=True, sm_scale=None, interpret=False)
  meta = fp8jax.init_attention_meta(fp8jax.DelayedScaling())

  def loss_fn(qkv, meta):
    out, meta = _fp8_attention(*qkv, meta, None, None, call)
    return jnp.sum(out.astype(jnp.float32)), meta

  q = jax.ShapeDtypeStruct((batch, seq, heads, head_dim), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((batch, seq, kv_heads, head_dim), jnp.bfloat16)
  compiled = deviceless.compile_for_h100(fp8jax.value_and_grad(loss_fn), (q, kv, kv), meta)
  hlo = compiled.as_text()
  targets = re.findall(r'custom_call_target="([^"]+)"', hlo)
  # Three Mosaic GPU kernels (the FP8 forward, dQ and dK/dV) and the end-of-step
  # scale update of the attention's FP8 state (Triton-lowered).
  assert sum(t.startswith("mosaic_gpu") for t in targets) == 3, targets
  assert targets.count("__gpu$xla.gpu.triton") == 1, targets
  assert "fp8_scale_update" in hlo


@pytest.mark.parametrize("finer", [False, True], ids=["per_tensor", "block_scales_rotated"])
def test_fp8_attention_kernels_run_on_each_gpus_batch_rows_and_heads_on_a_mesh(finer):
  """On 8 H100s (data=4 x model=2, the batch over "data", the heads over "model")
  each GPU's three Mosaic kernels take its own 4 of 16 sequences and 8 of 16
  query heads (2 of 4 kv heads); nothing is gathered (XLA would otherwise
  gather q, k and v whole to every GPU, unable to split a custom kernel). With block
  scales the kernels also take their shard's block descales, split the same way."""
  from jax.sharding import NamedSharding, PartitionSpec as P

  mesh = deviceless.h100_mesh(data=4, model=2)
  batch, seq, heads, kv_heads, head_dim = 16, 2048, 16, 4, 128
  call = _Call("pallas_hopper_fp8", causal=True, sm_scale=None, interpret=False,
               block_scales=finer, rotate=finer)
  split = NamedSharding(mesh, P("data", None, "model"))
  replicated = NamedSharding(mesh, P())
  meta = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=replicated),
                      fp8jax.init_attention_meta(fp8jax.DelayedScaling()))

  def loss_fn(qkv, meta):
    out, meta = _fp8_attention(*qkv, meta, None, None, call)
    return jnp.sum(out.astype(jnp.float32)), meta

  q = jax.ShapeDtypeStruct((batch, seq, heads, head_dim), jnp.bfloat16, sharding=split)
  kv = jax.ShapeDtypeStruct((batch, seq, kv_heads, head_dim), jnp.bfloat16, sharding=split)
  hlo = deviceless.compile_for_h100(fp8jax.value_and_grad(loss_fn), (q, kv, kv), meta).as_text()
  assert "all-gather" not in hlo
  kernels = [line for line in hlo.splitlines()
             if 'custom_call_target="mosaic_gpu' in line and " custom-call(" in line]
  assert len(kernels) == 3, kernels
  local_q = f"bf16[{batch // 4},{seq},{heads // 2},{head_dim}]"
  local_kv = f"bf16[{batch // 4},{seq},{kv_heads // 2},{head_dim}]"
  # Each kernel's results (the text before its operands) have the local shapes.
  results = [line.split(" custom-call(")[0] for line in kernels]
  assert sum(local_q in r for r in results) == 2, results  # the forward's output, and dq
  assert sum(local_kv in r for r in results) == 1, results  # dk and dv
  assert not any(f"[{batch}," in r for r in results), results  # no global batch
  if finer:  # each kernel's operands include the shard's [4, 8 or 2, 16] block descales
    operands = [line.split(" custom-call(")[1] for line in kernels]
    assert all(f"f32[{batch // 4},{heads // 2},{seq // 128}]" in o for o in operands), operands


@pytest.mark.parametrize("backend,target", [("pallas", "__gpu$xla.gpu.triton"),
                                            ("pallas_hopper", "mosaic_gpu")])
def test_bf16_attention_kernels_run_on_each_gpus_batch_rows_and_heads_on_a_mesh(backend,
                                                                                target):
  """The bf16 kernels get the FP8 kernels' per-shard rule: on 8 H100s (data=4 x model=2)
  each GPU's forward and backward kernels take its own sequences and heads, and no
  collective gathers q, k or v."""
  from jax.sharding import NamedSharding, PartitionSpec as P
  from fp8jax.ops.attention import _fused_bf16_attention

  mesh = deviceless.h100_mesh(data=4, model=2)
  batch, seq, heads, kv_heads, head_dim = 16, 2048, 16, 4, 128
  call = _Call(backend, causal=True, sm_scale=None, interpret=False)
  split = NamedSharding(mesh, P("data", None, "model"))

  def loss_fn(q, k, v):
    return jnp.sum(_fused_bf16_attention(q, k, v, None, None, call).astype(jnp.float32))

  q = jax.ShapeDtypeStruct((batch, seq, heads, head_dim), jnp.bfloat16, sharding=split)
  kv = jax.ShapeDtypeStruct((batch, seq, kv_heads, head_dim), jnp.bfloat16, sharding=split)
  hlo = deviceless.compile_for_h100(jax.grad(loss_fn, argnums=(0, 1, 2)), q, kv, kv).as_text()
  assert "all-gather" not in hlo
  kernels = [line for line in hlo.splitlines()
             if f'custom_call_target="{target}' in line and " custom-call(" in line]
  assert len(kernels) == 3, kernels  # the forward, and the backward's dQ and dK/dV kernels
  local_q = f"bf16[{batch // 4},{seq},{heads // 2},{head_dim}]"
  results = [line.split(" custom-call(")[0] for line in kernels]
  assert any(local_q in r for r in results), results
  assert not any(f"[{batch}," in r for r in results), results  # no global batch
