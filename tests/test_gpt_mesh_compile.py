"""The demo GPT's FP8 train step on a data x model mesh of 8 H100s: what each GPU runs.

Compiled without a GPU (`fp8jax.deviceless.h100_mesh(data=4, model=2)`) at the
`125m` width (two of its blocks), 8 sequences of 1024 tokens per data shard, with the Megatron-style
layout of `fp8jax.models.gpt_sharding` (qkv/up column-parallel, out/down
row-parallel, embedding and FP8 state replicated). Compared with the bf16 twin
under the same sharding:

* every projection's three GEMMs (fprop, dgrad, wgrad) are cuBLASLt FP8 GEMMs
  on the local shard: 8192 local rows times the layer's per-"model" slice;
* FP8 sends nothing the bf16 step does not, beyond a few amax scalars;
* the predicted step speedup (the cost model's kernel time per device) is
  printed; docs/guides/scaling_out.md quotes it.

Attention is what an H100 runs (the compile target's choice, `fp8jax.mesh.target`):
cuDNN there, which a compile without a GPU cannot build, so fp8jax's Hopper flash
kernel ("pallas_hopper") stands in, per shard, in both steps.
"""
from __future__ import annotations

import collections

import jax
import jax.numpy as jnp
import optax
import pytest

import fp8jax
from fp8jax import deviceless
from fp8jax.lowering.compile import compile_text
from fp8jax.lowering.cost import compare, cost_hlo
from fp8jax.lowering.inspection import CUBLAS_ONLY_OPTIONS, inspect_hlo

_MISSING = deviceless.deviceless_toolchain_missing()
pytestmark = [pytest.mark.hopper, pytest.mark.skipif(_MISSING is not None, reason=str(_MISSING))]

DATA, MODEL = 4, 2
SEQUENCES_PER_SHARD, SEQ = 8, 1024
LOCAL_ROWS = SEQUENCES_PER_SHARD * SEQ
PROJECTIONS = ("attention/qkv", "attention/out", "mlp/up", "mlp/down", "head")
ROLES = ("fp8_fprop", "fp8_dgrad", "fp8_wgrad")
AMAX_BYTES = 1024  # the amax all-reduces carry a few float32 scalars each


@pytest.fixture(scope="module")
def compiled():
  from fp8jax.models import gpt
  from fp8jax.models.gpt_sharding import shard_train_state
  from fp8jax.runs.steps import train_step_for

  mesh = deviceless.h100_mesh(data=DATA, model=MODEL)
  # Two of the 125m's blocks: every block compiles to the same kernels (the layers are
  # unrolled), and two show that the state and GEMMs of each are its own.
  config = gpt.config_for("125m", seq_len=SEQ, n_layers=2)
  programs = {}
  for label, recipe in (("fp8", fp8jax.DelayedScaling()), ("bf16", None)):
    model = gpt.Gpt(config, recipe=recipe)
    tx = optax.adamw(1e-3)
    variables = jax.eval_shape(model.init, jax.random.key(0),
                               jax.ShapeDtypeStruct((1, SEQ), jnp.int32))
    params = variables["params"]
    tokens = jax.ShapeDtypeStruct((DATA * SEQUENCES_PER_SHARD, SEQ + 1), jnp.int32)
    args = shard_train_state(mesh, params, jax.eval_shape(tx.init, params),
                             variables.get("fp8_meta", {}), tokens)
    step = train_step_for(model, tx, fp8=recipe is not None)
    programs[label] = compile_text(step, *args, compiler_options=dict(CUBLAS_ONLY_OPTIONS),
                                   target="deviceless", collect_ptx=False).hlo
  return config, programs


def test_every_projection_gemm_is_cublaslt_fp8(compiled):
  config, programs = compiled
  report = inspect_hlo(programs["fp8"])
  by_projection = collections.Counter()
  for gemm in report.gemms:
    if gemm.runs_in_fp8:
      assert gemm.target == "__cublas$lt$matmul$f8", str(report)
    projection = _projection(gemm.op_name)
    if projection is not None:
      assert gemm.runs_in_fp8, str(report)
      by_projection[projection] += 1
  # fprop, dgrad and wgrad of each block's projection in each (unrolled) layer; the head once.
  assert by_projection == {name: 3 * (1 if name == "head" else config.n_layers)
                           for name in PROJECTIONS}, by_projection


def test_every_projection_gemm_works_on_the_local_shard(compiled):
  config, programs = compiled
  d, d_ff, vocab = config.d_model, config.d_ff, config.vocab_size
  local_shape = {  # (in, out) of each projection's per-device GEMM
      "attention/qkv": (d, 3 * d // MODEL), "attention/out": (d // MODEL, d),
      "mlp/up": (d, d_ff // MODEL), "mlp/down": (d_ff // MODEL, d),
      # The tied embedding is replicated, so the head runs whole on each "model"
      # shard: the bf16 step does the same.
      "head": (d, vocab)}
  report = cost_hlo(programs["fp8"])
  seen = collections.Counter()
  for kernel in report.kernels:
    projection = _projection(kernel.op_name) if kernel.is_gemm else None
    if projection is None:
      continue
    fan_in, fan_out = local_shape[projection]
    assert kernel.flops == 2 * LOCAL_ROWS * fan_in * fan_out, (projection, kernel)
    seen[projection] += 1
  assert set(seen) == set(PROJECTIONS), seen


def test_fp8_sends_only_amax_scalars_beyond_the_bf16_step(compiled):
  _, programs = compiled
  fp8, bf16 = cost_hlo(programs["fp8"], label="fp8"), cost_hlo(programs["bf16"], label="bf16")

  def large_collectives(report):
    return collections.Counter(
        (k.name.split(".")[0], k.bytes_out, k.launches) for k in report.kernels
        if k.category == "collective" and k.bytes_out > AMAX_BYTES)

  assert not [k for k in fp8.kernels if k.category == "collective" and "all-gather" in k.name]
  assert large_collectives(fp8) == large_collectives(bf16)
  comparison = compare(fp8, bf16)
  print(f"\nGPT 125m train step on data={DATA} x model={MODEL}, per device: {comparison}")


def _projection(op_name: str) -> str | None:
  """'attention/qkv' for a GEMM of the qkv projection's FP8 dot (None otherwise)."""
  if not any(f"/{role}/" in op_name for role in ROLES):
    return None
  for name in PROJECTIONS:
    if f"/{name}/fp8_" in op_name:
      return name
  return None
