"""Compiled for a Blackwell GPU without one: `gemm="native"` recipes run cuDNN's block-scaled
GEMM for all three GEMMs of a matmul; the emulation runs everywhere else.

The target is `fp8jax.deviceless.b200_mesh()` (an H100 description with Blackwell's compute
capability). What is checked is the compiled program's custom calls: cuDNN's block-scaled
dot (`__cudnn$blockScaledDot`) is what `jax.nn.scaled_matmul` becomes for MXFP8 and NVFP4
operands on Blackwell.
"""
import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import fp8jax
from fp8jax.deviceless import b200_mesh, deviceless_toolchain_missing

_MISSING = deviceless_toolchain_missing()
BLOCK_SCALED_DOT = "__cudnn$blockScaledDot"


def _custom_calls(recipe):
  mesh = b200_mesh()
  replicated = NamedSharding(mesh, P())

  def loss(params, fp8_state):
    y, fp8_state = fp8jax.fp8_dense(params["x"], params["k"], None, fp8_state)
    return jnp.sum(jnp.square(y.astype(jnp.float32))), fp8_state

  spec = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=replicated)
  state = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=replicated),
                       fp8jax.init_dot_meta(recipe))
  with jax.set_mesh(mesh):
    compiled = jax.jit(fp8jax.value_and_grad(loss)).lower(
        {"x": spec(128, 256), "k": spec(256, 128)}, state).compile()
  return re.findall(r'custom_call_target="([^"]+)"', compiled.as_text())


@pytest.mark.hopper
@pytest.mark.skipif(_MISSING is not None, reason=_MISSING or "")
@pytest.mark.parametrize("recipe, native", [
    (fp8jax.NVFP4Scaling(gemm="native"), 3),
    (fp8jax.MXFP8Scaling(scale_rounding="round_up", gemm="native"), 3),
    (fp8jax.NVFP4Scaling(), 0),
], ids=["nvfp4_native", "mxfp8_native", "nvfp4_emulated"])
def test_native_recipes_compile_every_gemm_to_cudnns_block_scaled_dot_on_blackwell(recipe,
                                                                                   native):
  calls = _custom_calls(recipe)
  assert calls.count(BLOCK_SCALED_DOT) == native, calls
