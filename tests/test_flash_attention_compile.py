"""Deviceless H100 compile of the flash-attention kernels (no GPU needed).

Triton refuses a kernel whose tiles do not fit the H100's shared memory or
registers, so a successful compile at a realistic size (S=4096, head_dim 128)
is the proof that the default `BlockSizes` fit. The tests then read what was
built: one PTX entry per kernel, its tensor-core instructions, and the shared
memory XLA launches it with.

Run with JAX_PLATFORMS=cpu: the kernels must be lowered for the GPU
(`interpret=False`) from a process whose default backend is the CPU.
"""
from __future__ import annotations

import glob
import os
import re

import jax
import jax.numpy as jnp
import pytest

from fp8jax import deviceless
from pallas_kernels.flash_attention import (
    flash_attention, flash_attention_forward, flash_attention_fp8)

_MISSING = deviceless.deviceless_toolchain_missing()
pytestmark = [pytest.mark.hopper,
              pytest.mark.skipif(_MISSING is not None, reason=str(_MISSING))]

BATCH, SEQ, HEADS, KV_HEADS = 1, 4096, 16, 4
# Largest dynamic shared memory one thread block may use on an H100 (227 KiB).
H100_MAX_SHARED_MEMORY = 232448
KERNELS = ("flash_attention_fwd", "flash_attention_bwd_dkdv", "flash_attention_bwd_dq")


def _compile(fn, args, dump_dir):
  """Compiles for an H100; returns ({kernel: PTX}, {kernel: shared memory bytes})."""
  deviceless.compile_for_h100(fn, *args, dump_dir=str(dump_dir))
  ptx = {}
  for path in glob.glob(os.path.join(dump_dir, "*.ptx")):
    with open(path) as f:
      text = f.read()
    for entry in re.findall(r"\.entry\s+(\w+)", text):
      ptx[entry] = text
  shared = {}
  for path in glob.glob(os.path.join(dump_dir, "*thunk_sequence.txt")):
    with open(path) as f:
      for line in f:
        found = re.search(r"\b(flash_attention_\w+)\b.*shared_memory:\s*(\d+)", line)
        if found:
          shared[found.group(1)] = int(found.group(2))
  return ptx, shared


def _mma_kinds(ptx: str) -> list[str]:
  return sorted(set(re.findall(r"(wgmma\.mma_async[\w.]*|mma\.sync[\w.]*)", ptx)))


def _qkv_specs(head_dim, dtype):
  return (jax.ShapeDtypeStruct((BATCH, SEQ, HEADS, head_dim), dtype),
          jax.ShapeDtypeStruct((BATCH, SEQ, KV_HEADS, head_dim), dtype),
          jax.ShapeDtypeStruct((BATCH, SEQ, KV_HEADS, head_dim), dtype))


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_bf16_forward_and_backward_fit_an_h100_and_use_wgmma(head_dim, tmp_path, record_property):
  def forward_and_backward(q, k, v, dout):
    out, vjp = jax.vjp(
        lambda q, k, v: flash_attention(q, k, v, causal=True, interpret=False), q, k, v)
    return out, vjp(dout)

  q, k, v = _qkv_specs(head_dim, jnp.bfloat16)
  ptx, shared = _compile(forward_and_backward, (q, k, v, q), tmp_path)

  for kernel in KERNELS:
    assert kernel in ptx, f"no PTX for {kernel}; built: {sorted(ptx)}"
    kinds = _mma_kinds(ptx[kernel])
    record_property(f"{kernel}_d{head_dim}_mma", kinds)
    record_property(f"{kernel}_d{head_dim}_shared_memory", shared.get(kernel))
    assert any(kind.startswith("wgmma") and "bf16" in kind for kind in kinds), (kernel, kinds)
    assert 0 < shared[kernel] <= H100_MAX_SHARED_MEMORY, (kernel, shared[kernel])


def test_fp8_forward_and_backward_fit_an_h100(tmp_path, record_property):
  head_dim = 128

  def fp8_forward(q8, k8, v8, scales):
    return flash_attention_forward(q8, k8, v8, descale_q=scales[0], descale_k=scales[1],
                                   descale_v=scales[2], out_scale=scales[3], causal=True,
                                   interpret=False)

  def fp8_forward_and_backward(q, k, v, scales, dout):
    (out, out_amax), vjp = jax.vjp(
        lambda q, k, v: flash_attention_fp8(q, k, v, scales[0], scales[1], scales[2],
                                            causal=True, interpret=False), q, k, v)
    return out, out_amax, vjp((dout, jnp.zeros((), jnp.float32)))

  scales = jax.ShapeDtypeStruct((4,), jnp.float32)
  ptx, shared = _compile(fp8_forward, (*_qkv_specs(head_dim, jnp.float8_e4m3fn), scales),
                         tmp_path / "forward")
  forward_ptx = ptx["flash_attention_fwd"]
  kinds = _mma_kinds(forward_ptx)
  # What the Triton lowering makes of the E4M3 products (jax 0.10.2: the E4M3 tiles are
  # converted to f16 and run on mma.sync). Recorded, not asserted: FP8 wgmma is a
  # separate kernel's job.
  record_property("fp8_forward_mma", kinds)
  record_property("fp8_forward_shared_memory", shared.get("flash_attention_fwd"))
  assert kinds, "the FP8 forward kernel has no tensor-core product"
  # P is quantized to E4M3 inside the kernel, and so is the output (out_scale given).
  assert "cvt.rn.satfinite.e4m3x2.f32" in forward_ptx
  assert 0 < shared["flash_attention_fwd"] <= H100_MAX_SHARED_MEMORY

  q, k, v = _qkv_specs(head_dim, jnp.bfloat16)
  ptx, shared = _compile(fp8_forward_and_backward, (q, k, v, scales, q), tmp_path / "backward")
  for kernel in KERNELS:
    assert kernel in ptx, f"no PTX for {kernel}; built: {sorted(ptx)}"
    assert 0 < shared[kernel] <= H100_MAX_SHARED_MEMORY, (kernel, shared[kernel])
  # The FP8 backward runs in bf16 on the dequantized inputs: bf16 wgmma.
  for kernel in KERNELS[1:]:
    assert any(k.startswith("wgmma") and "bf16" in k for k in _mma_kinds(ptx[kernel])), kernel
