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

import run_once

import fp8jax
from fp8jax import deviceless
from fp8jax.lowering.compile import compile_text
from fp8jax.lowering.cost import compare, cost_hlo
from fp8jax.lowering.hlo_text import ArrayShape, parse_hlo_module
from fp8jax.lowering.inspection import CUBLAS_ONLY_OPTIONS, inspect_hlo

_MISSING = deviceless.deviceless_toolchain_missing()
pytestmark = [pytest.mark.hopper, pytest.mark.skipif(_MISSING is not None, reason=str(_MISSING))]

DATA, MODEL = 4, 2
SEQUENCES_PER_SHARD, SEQ = 8, 1024
LOCAL_ROWS = SEQUENCES_PER_SHARD * SEQ
PROJECTIONS = ("attention/qkv", "attention/out", "mlp/up", "mlp/down", "head")
ROLES = ("fp8_fprop", "fp8_dgrad", "fp8_wgrad")
AMAX_BYTES = 1024  # the amax all-reduces carry a few float32 scalars each
COLLECTIVE_KINDS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all",
                    "collective-permute")


def _compile(config, recipe, fsdp: bool = False) -> str:
  """The optimized HLO of the train step on the data x model mesh, per device."""
  from fp8jax.models import gpt
  from fp8jax.models.gpt_sharding import shard_train_state
  from fp8jax.runs.steps import train_step_for

  mesh = deviceless.h100_mesh(data=DATA, model=MODEL)
  model = gpt.Gpt(config, recipe=recipe)
  tx = optax.adamw(1e-3)
  variables = jax.eval_shape(model.init, jax.random.key(0),
                             jax.ShapeDtypeStruct((1, SEQ), jnp.int32))
  params = variables["params"]
  tokens = jax.ShapeDtypeStruct((DATA * SEQUENCES_PER_SHARD, SEQ + 1), jnp.int32)
  args = shard_train_state(mesh, params, jax.eval_shape(tx.init, params),
                           variables.get("fp8_meta", {}), tokens, fsdp=fsdp)
  step = train_step_for(model, tx, fp8=recipe is not None)
  return compile_text(step, *args, compiler_options=dict(CUBLAS_ONLY_OPTIONS),
                      target="deviceless", collect_ptx=False).hlo


@pytest.fixture(scope="module")
def compiled():
  from fp8jax.models import gpt

  # Two of the 125m's blocks: every block compiles to the same kernels (the layers are
  # unrolled), and two show that the state and GEMMs of each are its own.
  config = gpt.config_for("125m", seq_len=SEQ, n_layers=2)
  # Once per test run (the two workers may split this file's tests).
  return config, run_once.shared("gpt_mesh_compiled", lambda _: {
      label: _compile(config, recipe)
      for label, recipe in (("fp8", fp8jax.DelayedScaling()), ("bf16", None))})[1]


@pytest.fixture(scope="module")
def fsdp_compiled():
  """The FP8 step with FSDP (every projection's d_model split over "data" too) and FP8
  saved activations: before the embedding stayed whole under FSDP, this step moved
  activations between devices (`fp8jax.models.gpt_sharding`)."""
  from fp8jax.models import gpt

  config = gpt.config_for("125m", seq_len=SEQ, n_layers=2, saved_activations="fp8")
  return config, run_once.shared(
      "gpt_mesh_fsdp_compiled",
      lambda _: _compile(config, fp8jax.DelayedScaling(), fsdp=True))[1]


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
  _check_local_gemms(config, programs["fp8"])


def _check_local_gemms(config, hlo: str) -> None:
  d, d_ff, vocab = config.d_model, config.d_ff, config.vocab_size
  local_shape = {  # (in, out) of each projection's per-device GEMM
      "attention/qkv": (d, 3 * d // MODEL), "attention/out": (d // MODEL, d),
      "mlp/up": (d, d_ff // MODEL), "mlp/down": (d_ff // MODEL, d),
      # The tied embedding is replicated, so the head runs whole on each "model"
      # shard: the bf16 step does the same.
      "head": (d, vocab)}
  report = cost_hlo(hlo)
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


def test_each_device_casts_the_qkv_gradient_of_its_own_heads_from_dq_dk_dv(compiled):
  """The qkv projection's output gradient is cast straight from attention's dq, dk, dv
  (`fp8jax.ops.norm_qkv_rope`) by each device for its heads (split over "model"): one
  cast per layer reads the local dq, dk, dv and writes the local [8192, 3 d / 2] FP8
  gradient, and no kernel writes that gradient in bf16."""
  config, programs = compiled
  module = parse_hlo_module(programs["fp8"])
  local_heads = config.n_heads // MODEL
  local = (LOCAL_ROWS, 3 * config.d_model // MODEL)
  per_head = (LOCAL_ROWS, config.d_model // MODEL)  # dq, dk or dv of this device's heads
  entry = next(c for c in module.computations.values() if c.is_entry).instructions
  casts = [i for i in entry.values() if i.opcode == "custom-call"
           and any(s.dtype == "f8e5m2" and s.dims == local for s in i.shapes)]
  assert len(casts) == config.n_layers, [i.name for i in casts]
  for cast in casts:
    # Partitioned per device (`custom_partitioning`).
    assert "/attention/qkv/" in cast.op_name, cast.op_name
    read = [entry[name].shape for name in cast.operands if name in entry]
    assert sum(s is not None and s.dtype == "bf16" and s.dims == per_head for s in read) == 3, read
  stacked = (local, (SEQUENCES_PER_SHARD, SEQ, local_heads, 3, config.head_dim))
  stacked_in_bf16 = [i.name for i in entry.values() if i.opcode == "fusion"
                     and any(s.dtype == "bf16" and s.dims in stacked for s in i.shapes)]
  assert not stacked_in_bf16, stacked_in_bf16


def test_fsdp_moves_fp8_weights_and_gradients_but_no_activations(fsdp_compiled):
  """Per device: FSDP gathers each projection's FP8 weight shard and reduce-scatters its
  gradient; the activations move only in the tensor-parallel sums over "model", and every
  GEMM works on the local tokens. Before the embedding stayed whole, this step also ran 15
  all-gathers of float32 activations (the whole batch's 32 sequences) and output gradients
  gathered over all 32,768 tokens."""
  config, hlo = fsdp_compiled
  _check_local_gemms(config, hlo)
  collectives = _collectives(hlo)
  kinds = collections.Counter(kind for kind, _ in collectives)
  assert kinds["all-to-all"] == kinds["collective-permute"] == 0, kinds
  assert kinds["all-gather"] >= 1 and kinds["reduce-scatter"] >= 1, kinds
  whole_batch = DATA * SEQUENCES_PER_SHARD
  for kind, shapes in collectives:
    for shape in shapes:
      # Nothing of the whole batch: no dimension of all its tokens or all its sequences.
      assert DATA * LOCAL_ROWS not in shape.dims, (kind, shapes)
      assert shape.dims[:2] != (whole_batch, SEQ), (kind, shapes)
      if kind == "all-gather":
        assert shape.dtype == "f8e4m3fn", (kind, shapes)  # the weights' FP8 copies
  # The Megatron sums: out and down in the forward, qkv and up (dgrad) in the backward.
  activation_sums = [shapes for kind, shapes in collectives if kind == "all-reduce"
                     and any(shape.dims == (LOCAL_ROWS, config.d_model) for shape in shapes)]
  assert len(activation_sums) == 4 * config.n_layers, activation_sums


def _collectives(hlo: str) -> list[tuple[str, tuple[ArrayShape, ...]]]:
  """(kind, the shapes of its operands and results) of every collective the program runs."""
  module = parse_hlo_module(hlo)
  found = []
  for computation in module.computations.values():
    for instruction in computation.instructions.values():
      kind = instruction.opcode.removesuffix("-start")
      if kind in COLLECTIVE_KINDS:
        found.append((kind, instruction.shapes))
  return found


def _projection(op_name: str) -> str | None:
  """'attention/qkv' for a GEMM of the qkv projection's FP8 dot (None otherwise)."""
  if not any(f"/{role}/" in op_name for role in ROLES):
    return None
  for name in PROJECTIONS:
    if f"/{name}/fp8_" in op_name:
      return name
  return None
