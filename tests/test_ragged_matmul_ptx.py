"""The grouped FP8 GEMMs run on Hopper FP8 tensor cores, proved without a GPU.

Every configuration of pallas_kernels.ragged_matmul (the fprop / dgrad form) and
pallas_kernels.transposed_ragged_matmul (the wgrad form), per scale mode, is compiled for
sm_90a (deviceless) at DeepSeek-like expert shapes (8 experts, 8192 routed rows, hidden
7168, expert width 2048) with a 132-CTA persistent grid, and Mosaic GPU's PTX, ptxas
report and MLIR are read:

* the only tensor-core instruction is E4M3 `wgmma` (no `mma.sync` upcast to f16);
* warp specialization: `setmaxnreg` raises the compute warpgroups' registers and lowers
  the producer's; TMA copies (`cp.async.bulk.tensor`) feed the ring;
* ptxas spills no registers;
* the launch's dynamic shared memory fits a Hopper block (227 KiB) and holds the whole
  ring (a smaller size would mean a buffer was dropped).

As in test_hopper_attention_ptx.py, Mosaic GPU prints its dumps when a kernel is
compiled, once per process, so one fresh subprocess compiles every configuration; it
captures each compile's dump (tens of MB of MLIR) and prints a few facts per config.
"""
import importlib
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

import run_once

from fp8jax import deviceless

_TOOLCHAIN_MISSING = deviceless.deviceless_toolchain_missing()
_needs_toolchain = pytest.mark.skipif(_TOOLCHAIN_MISSING is not None,
                                      reason=str(_TOOLCHAIN_MISSING))

G, ROWS, HIDDEN, WIDTH = 8, 8192, 7168, 2048
NUM_SMS = 132   # an H100 SXM

# name -> (form, scale_mode, block sizes). fprop: x [ROWS, HIDDEN] times w^T [G, WIDTH,
# HIDDEN]; dgrad: dy [ROWS, WIDTH] times w [G, HIDDEN, WIDTH] as stored; wgrad: x^T
# [HIDDEN, ROWS] and dy^T [WIDTH, ROWS].
CONFIGS = {
    "fprop_tensor": ("fprop", "tensor", {}),
    "fprop_rowwise": ("fprop", "rowwise", {}),
    "fprop_block": ("fprop", "block", {}),
    "fprop_tensor_bn256": ("fprop", "tensor", dict(block_n=256, num_stages=3)),
    "dgrad_block": ("dgrad", "block", {}),
    "wgrad_tensor": ("wgrad", "tensor", {}),
    "wgrad_rowwise": ("wgrad", "rowwise", {}),
    "wgrad_block": ("wgrad", "block", {}),
}
_BEGIN = "=== ragged compile: "
_MMA = re.compile(r"\b(wgmma\.mma_async\.[\w.]+|mma\.sync\.[\w.]+)")
_HOPPER_SMEM_PER_BLOCK = 227 * 1024


def _specs(form, mode):
  """(function, argument specs) of one configuration."""
  import jax
  import jax.numpy as jnp
  rm = importlib.import_module("pallas_kernels.ragged_matmul")
  tr = importlib.import_module("pallas_kernels.transposed_ragged_matmul")
  f8, f32, spec = jnp.float8_e4m3fn, jnp.float32, jax.ShapeDtypeStruct
  sizes = spec((G,), jnp.int32)
  if form == "wgrad":
    blocks = ROWS // 128
    a_d, b_d = {"tensor": ((), ()), "rowwise": ((HIDDEN,), (WIDTH,)),
                "block": ((HIDDEN, blocks), (WIDTH, blocks))}[mode]
    return tr.transposed_ragged_matmul, (spec((HIDDEN, ROWS), f8), spec((WIDTH, ROWS), f8),
                                         sizes, spec(a_d, f32), spec(b_d, f32))
  kc, nout = (HIDDEN, WIDTH) if form == "fprop" else (WIDTH, HIDDEN)
  a_d, b_d = {"tensor": ((), (G,)), "rowwise": ((ROWS,), (G, nout)),
              "block": ((ROWS, kc // 128), (G, nout // 128, kc // 128))}[mode]
  return rm.ragged_matmul, (spec((ROWS, kc), f8), spec((G, nout, kc), f8), sizes,
                            spec(a_d, f32), spec(b_d, f32))


def _facts(dump: str) -> dict:
  """What the tests check, from one compile's dump (MLIR passes, PTX, ptxas report)."""
  ptx_start = dump.rfind("\n.version")
  ptx = dump[ptx_start:dump.find("ptxas", ptx_start)] if ptx_start >= 0 else ""
  mma = {}
  for name in _MMA.findall(ptx):
    mma[name] = mma.get(name, 0) + 1
  return dict(
      mma=mma,
      setmaxnreg=sorted({re.sub(r"\s+", " ", x) for x in
                         re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+\d+", ptx)}),
      tma_loads=len(re.findall(r"cp\.async\.bulk\.tensor\.\w+\.shared::cluster\.global", ptx)),
      # The store ladder's 1-row box is a plain bulk copy.
      tma_stores=len(re.findall(r"cp\.async\.bulk(?:\.tensor\.\w+)?\.global\.shared::cta", ptx)),
      spills=re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", dump),
      registers=[int(r) for r in re.findall(r"Used (\d+) registers", dump)],
      smem=sorted({int(s) for s in re.findall(r"dynamic_shared_memory_size %c(\d+)_i32", dump)}),
  )


def _compile_all() -> None:
  """Runs in the subprocess: compiles each config with Mosaic GPU's dumps captured at fd 1."""
  import ctypes
  import tempfile
  import jax  # noqa: F401 (initialized before stdout is redirected)

  libc = ctypes.CDLL(None)

  tiling = importlib.import_module("pallas_kernels.ragged_tiling")
  for name, (form, mode, blocks) in CONFIGS.items():
    fn, args = _specs(form, mode)
    block_cls = (tiling.TransposedRaggedMatmulBlockSizes if form == "wgrad"
                 else tiling.RaggedMatmulBlockSizes)

    def call(*a, fn=fn, mode=mode, blocks=block_cls(**blocks)):
      return fn(*a, scale_mode=mode, block_sizes=blocks, num_sms=NUM_SMS)
    with tempfile.TemporaryFile() as dump:
      sys.stdout.flush()
      saved = os.dup(1)
      os.dup2(dump.fileno(), 1)
      try:
        deviceless.compile_for_h100(call, *args)
      finally:
        sys.stdout.flush()
        libc.fflush(None)  # the C++ side's buffered dump goes to the file too
        os.dup2(saved, 1)
        os.close(saved)
      dump.seek(0)
      facts = _facts(dump.read().decode(errors="replace"))
    print(f"{_BEGIN}{name}\n{json.dumps(facts)}", flush=True)


@pytest.fixture(scope="module")
def compiled():
  """{config name: facts} from one deviceless compile subprocess."""
  # Once per test run: the two workers may split this file's tests.
  return run_once.shared("ragged_matmul_ptx", lambda _: _compile_in_a_subprocess())[1]


def _compile_in_a_subprocess():
  repo_root = pathlib.Path(__file__).resolve().parents[1]
  env = dict(os.environ, JAX_PLATFORMS="cpu", MOSAIC_GPU_DUMP_PTX="1", MOSAIC_GPU_DUMP_PTXAS="1",
             MOSAIC_GPU_DUMP_MLIR_PASSES="1",
             PYTHONPATH=os.pathsep.join(filter(None, [str(repo_root),
                                                      os.environ.get("PYTHONPATH")])))
  env.pop("MOSAIC_GPU_DUMP_TO", None)  # would also dump SASS, via a temp dir it never removes
  script = ("import sys; sys.path.insert(0, sys.argv[1]); "
            "import test_ragged_matmul_ptx as t; t._compile_all()")
  proc = subprocess.run([sys.executable, "-c", script, str(pathlib.Path(__file__).parent)],
                        env=env, capture_output=True, text=True, timeout=900)
  if proc.returncode:
    pytest.fail(f"deviceless compile failed:\n{proc.stderr[-6000:]}")
  blocks = proc.stdout.split(_BEGIN)[1:]
  return {name: json.loads(facts) for name, facts, *_ in (b.split("\n", 2) for b in blocks)}


def _expected_wgmma(blocks) -> str:
  # Each warpgroup's product is 64 rows by block_n, 32 FP8 values deep per instruction.
  return f"wgmma.mma_async.sync.aligned.m64n{blocks.get('block_n', 128)}k32.f32.e4m3.e4m3"


@pytest.mark.hopper
@_needs_toolchain
@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_only_e4m3_wgmma_and_no_f16_fallback(compiled, config):
  mma = compiled[config]["mma"]
  want = _expected_wgmma(CONFIGS[config][2])
  # A 128-deep step is 4 k32 instructions; the loop body holds at least one step.
  assert mma.get(want, 0) >= 4, f"{config}: no {want}; found {mma}"
  assert set(mma) == {want}, f"{config}: other MMA instructions (f16 fallback?) {mma}"


@pytest.mark.hopper
@_needs_toolchain
@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_warp_specialized_with_tma(compiled, config):
  facts, form = compiled[config], CONFIGS[config][0]
  assert facts["setmaxnreg"] == ["setmaxnreg.dec.sync.aligned.u32 40",
                                 "setmaxnreg.inc.sync.aligned.u32 232"], facts["setmaxnreg"]
  assert facts["tma_loads"] >= 2, facts
  # fprop / dgrad: the store ladder's 7 boxes (64, 32, ..., 1 rows); wgrad: whole tiles.
  assert facts["tma_stores"] == (1 if form == "wgrad" else 7), facts


@pytest.mark.hopper
@_needs_toolchain
@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_no_register_spills(compiled, config):
  spills = compiled[config]["spills"]
  assert spills and all(s == ["0", "0"] for s in spills), f"{config} spills: {spills}"


@pytest.mark.hopper
@_needs_toolchain
@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_fits_hopper_shared_memory_and_holds_the_ring(compiled, config):
  form, mode, blocks = CONFIGS[config]
  smem = compiled[config]["smem"]
  assert len(smem) == 1, f"{config}: expected one launch's shared-memory size, got {smem}"
  tiling = importlib.import_module("pallas_kernels.ragged_tiling")
  block_cls = (tiling.TransposedRaggedMatmulBlockSizes if form == "wgrad"
               else tiling.RaggedMatmulBlockSizes)
  b = block_cls(**blocks)
  out_bytes = 4 if form == "wgrad" else 2   # default outputs: f32 dW, bf16 y / dx
  ring = b.num_stages * (b.block_m + b.block_n) * 128     # FP8 A and B^T tiles
  expected = ring + b.block_m * b.block_n * out_bytes     # + the output staging tiles
  assert expected <= smem[0] <= _HOPPER_SMEM_PER_BLOCK, (
      f"{config}: {smem[0]} bytes; expected >= {expected} and <= {_HOPPER_SMEM_PER_BLOCK}")

