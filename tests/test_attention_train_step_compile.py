"""The whole FP8 attention train step compiles for an H100 without a GPU.

`fp8_attention` on Hopper pairs the Mosaic GPU FP8 forward (its FP8 wgmma is
proved from its PTX in test_attention_fp8_ptx.py) with the Pallas backward
kernels, which recompute P from the forward's log-sum-exp. This compiles that
pairing through `fp8jax.value_and_grad` at the target shape (S = 4096, D = 128):
the compile fails if a kernel does not fit the chip's shared memory or the two
kernels disagree on shapes, and the backward kernels' PTX must be bf16 wgmma.
"""
import glob
import os
import re
import tempfile

import jax
import jax.numpy as jnp
import pytest

import fp8jax
from fp8jax import deviceless
from fp8jax.fused_attention import _Call, _fp8_attention

_MISSING = deviceless.deviceless_toolchain_missing()
pytestmark = [pytest.mark.hopper,
              pytest.mark.skipif(_MISSING is not None, reason=str(_MISSING))]


def test_fp8_attention_train_step_compiles_for_h100_with_hopper_forward_and_pallas_backward():
  batch, seq, heads, kv_heads, head_dim = 1, 4096, 16, 4, 128
  call = _Call("pallas_hopper_fp8", causal=True, sm_scale=None, interpret=False)
  meta = fp8jax.init_attention_meta(fp8jax.DelayedScaling())

  def loss_fn(qkv, meta):
    out, meta = _fp8_attention(*qkv, meta, None, None, call)
    return jnp.sum(out.astype(jnp.float32)), meta

  q = jax.ShapeDtypeStruct((batch, seq, heads, head_dim), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((batch, seq, kv_heads, head_dim), jnp.bfloat16)
  with tempfile.TemporaryDirectory() as dump:
    compiled = deviceless.compile_for_h100(fp8jax.value_and_grad(loss_fn), (q, kv, kv), meta,
                                           dump_dir=dump)
    ptx = "\n".join(open(p).read() for p in glob.glob(os.path.join(dump, "*.ptx")))
  hlo = compiled.as_text()
  targets = re.findall(r'custom_call_target="([^"]+)"', hlo)
  # One Hopper FP8 forward kernel (Mosaic GPU), the dK/dV and dQ backward kernels
  # and the end-of-step scale update of the attention's FP8 state.
  assert sum(t.startswith("mosaic_gpu") for t in targets) == 1, targets
  assert targets.count("__gpu$xla.gpu.triton") == 3, targets
  assert "fp8_scale_update" in hlo
  # The backward kernels run on Hopper tensor cores in bf16.
  assert re.search(r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k16\.f32\.bf16\.bf16", ptx)
