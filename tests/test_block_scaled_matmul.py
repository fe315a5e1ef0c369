"""Block-scaled FP8 GEMM: the reference's math, the kernel's PTX, the kernel's numerics.

* The reference (`block_scaled_matmul_reference`) against float64 numpy, with
  error bounds derived from float32 accumulation.
* The Mosaic GPU kernel compiled for sm_90a without a GPU: its PTX has only
  `wgmma ... e4m3.e4m3` tensor-core instructions, ptxas reports no spills, and the
  kernel's dynamic shared memory fits a Hopper block. As in
  test_hopper_attention_ptx.py, all compiles run in one fresh subprocess with
  Mosaic GPU printing its PTX / ptxas report (and here its MLIR, which holds the
  launch's dynamic shared-memory size) to stdout after a marker line per config.
* The kernel's logic in Mosaic GPU's CPU interpreter against the reference (B is
  fed untransposed there; see the kernel module's docstring), and the compiled
  kernel against the reference on a Hopper GPU when one is present.
"""
import collections
import importlib
import os
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest

from fp8jax import deviceless

_TOOLCHAIN_MISSING = deviceless.deviceless_toolchain_missing()
_needs_toolchain = pytest.mark.skipif(_TOOLCHAIN_MISSING is not None,
                                      reason=str(_TOOLCHAIN_MISSING))

# name -> (M, N, K, out dtype name, BlockScaledMatmulBlockSizes kwargs). Every K
# is several times num_stages * 128, so the ring of slots wraps around.
_COMPILE_CONFIGS = {
    "bf16_1024": (1024, 1024, 1024, "bfloat16", {}),
    "f32_2048x1024x4096": (2048, 1024, 4096, "float32", {}),
    "bf16_bm256_bn64": (1024, 1024, 2048, "bfloat16", dict(block_m=256, block_n=64)),
}
_BEGIN = "=== deviceless compile: "
_WGMMA_OR_MMA = re.compile(r"\b(wgmma\.mma_async\.[\w.]+|mma\.sync\.[\w.]+)")
_HOPPER_SMEM_PER_BLOCK = 227 * 1024  # the opt-in maximum per thread block on sm_90


def _kernel_module():
  # The package exports the function under the module's name, so `from
  # pallas_kernels import block_scaled_matmul` would give the function.
  return importlib.import_module("pallas_kernels.block_scaled_matmul")


def _compile_all() -> None:
  """Runs in the subprocess: compiles every config; Mosaic GPU prints after each marker."""
  import jax
  import jax.numpy as jnp

  bsm = _kernel_module()

  f8 = jnp.float8_e4m3fn
  for name, (m, n, k, out_dtype, blocks) in _COMPILE_CONFIGS.items():
    blocks = bsm.BlockScaledMatmulBlockSizes(**blocks)

    def gemm(a, a_s, b_t, b_s, out_dtype=out_dtype, blocks=blocks):
      return bsm.block_scaled_matmul(a, a_s, b_t, b_s, out_dtype=out_dtype,
                                     block_sizes=blocks)
    print(f"{_BEGIN}{name}", flush=True)
    deviceless.compile_for_h100(
        gemm,
        jax.ShapeDtypeStruct((m, k), f8), jax.ShapeDtypeStruct((m, k // 128), jnp.float32),
        jax.ShapeDtypeStruct((n, k), f8),
        jax.ShapeDtypeStruct((n // 128, k // 128), jnp.float32))
    sys.stdout.flush()


@pytest.fixture(scope="module")
def compiled():
  """{config name: its PTX, ptxas report and MLIR} from one deviceless compile subprocess."""
  repo_root = pathlib.Path(__file__).resolve().parents[1]
  env = dict(os.environ, JAX_PLATFORMS="cpu", MOSAIC_GPU_DUMP_PTX="1", MOSAIC_GPU_DUMP_PTXAS="1",
             MOSAIC_GPU_DUMP_MLIR_PASSES="1",
             PYTHONPATH=os.pathsep.join(filter(None, [str(repo_root), os.environ.get("PYTHONPATH")])))
  env.pop("MOSAIC_GPU_DUMP_TO", None)  # would also dump SASS, via a temp dir it never removes
  script = ("import sys; sys.path.insert(0, sys.argv[1]); "
            "import test_block_scaled_matmul as t; t._compile_all()")
  proc = subprocess.run([sys.executable, "-c", script, str(pathlib.Path(__file__).parent)],
                        env=env, capture_output=True, text=True, timeout=900)
  if proc.returncode:
    pytest.fail(f"deviceless compile failed:\n{proc.stderr[-6000:]}")
  blocks = proc.stdout.split(_BEGIN)[1:]
  return dict(block.split("\n", 1) for block in blocks)


def _instructions(text: str) -> collections.Counter:
  return collections.Counter(_WGMMA_OR_MMA.findall(text))


@pytest.mark.hopper
@_needs_toolchain
@pytest.mark.parametrize("config, wgmma", [
    ("bf16_1024", "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3"),
    ("f32_2048x1024x4096", "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3"),
    ("bf16_bm256_bn64", "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3"),
])
def test_gemm_is_only_e4m3_wgmma_with_no_f16_fallback(compiled, config, wgmma):
  instructions = _instructions(compiled[config])
  # One chunk is K=128 = 4 wgmma k32 steps per 64 rows of a warpgroup's tile.
  assert instructions[wgmma] > 0, f"{config}: no {wgmma}; found {dict(instructions)}"
  others = sorted(i for i in instructions if i != wgmma)
  assert not others, f"{config}: other MMA instructions (f16 fallback?) {others}"


@pytest.mark.hopper
@_needs_toolchain
@pytest.mark.parametrize("config", sorted(_COMPILE_CONFIGS))
def test_gemm_compiles_without_register_spills(compiled, config):
  spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", compiled[config])
  assert spills, f"no ptxas report for {config}"
  assert all(s == ("0", "0") for s in spills), f"{config} spills registers: {spills}"


@pytest.mark.hopper
@_needs_toolchain
@pytest.mark.parametrize("config", sorted(_COMPILE_CONFIGS))
def test_gemm_fits_hopper_shared_memory(compiled, config):
  sizes = {int(s) for s in re.findall(r"dynamic_shared_memory_size %c(\d+)_i32",
                                      compiled[config])}
  assert len(sizes) == 1, f"{config}: expected one launch's shared-memory size, got {sizes}"
  smem = sizes.pop()
  bsm = _kernel_module()
  m, n, k, out_dtype, blocks = _COMPILE_CONFIGS[config]
  blocks = bsm.BlockScaledMatmulBlockSizes(**blocks)
  block_m, block_n, stages = blocks.block_m, blocks.block_n, blocks.num_stages
  # The ring (A, B^T, row descales) and the output staging tile must all be there:
  # a size below this means a buffer was dropped, not that the kernel is lean.
  out_bytes = 2 if out_dtype == "bfloat16" else 4
  expected = stages * (block_m * 128 + block_n * 128 + block_m * 4) + block_m * block_n * out_bytes
  assert expected <= smem <= _HOPPER_SMEM_PER_BLOCK, (
      f"{config}: {smem} bytes of dynamic shared memory; expected >= {expected} "
      f"and <= {_HOPPER_SMEM_PER_BLOCK}")


# ----- CPU: the reference against float64 numpy -----------------------------------------


def _problem(seed, m, n, k):
  """FP8 operands quantized from random normals; descales spanning 2**-8 .. 2**8."""
  import jax.numpy as jnp
  rng = np.random.default_rng(seed)
  chunks, n_blocks = -(-k // 128), -(-n // 128)
  # The gain spreads magnitudes over E4M3's normal range (and a few subnormals).
  a = jnp.asarray(np.clip(rng.normal(size=(m, k)) * 32, -448, 448), jnp.float8_e4m3fn)
  b_t = jnp.asarray(np.clip(rng.normal(size=(n, k)) * 32, -448, 448), jnp.float8_e4m3fn)
  a_s = jnp.asarray(2.0 ** rng.uniform(-8, 8, size=(m, chunks)), jnp.float32)
  b_s = jnp.asarray(2.0 ** rng.uniform(-8, 8, size=(n_blocks, chunks)), jnp.float32)
  return a, a_s, b_t, b_s


def _float64_gemm(a, a_s, b_t, b_s):
  """out and sum of |terms|, in float64, written from the definition (no chunk reshapes)."""
  import jax.numpy as jnp
  a64 = np.asarray(a.astype(jnp.float32), np.float64)
  b64 = np.asarray(b_t.astype(jnp.float32), np.float64)
  a_s64, b_s64 = np.asarray(a_s, np.float64), np.asarray(b_s, np.float64)
  m, k = a64.shape
  n = b64.shape[0]
  k_idx = np.arange(k)
  # Descale of every (m, k) and (n, k) element: chunk k // 128, B block n // 128.
  a_desc = a_s64[:, k_idx // 128]
  b_desc = b_s64[np.arange(n)[:, None] // 128, k_idx[None, :] // 128]
  out = np.zeros((m, n))
  abs_sum = np.zeros((m, n))
  for i in range(k):  # exact products in float64, summed term by term
    term = np.outer(a64[:, i] * a_desc[:, i], b64[:, i] * b_desc[:, i])
    out += term
    abs_sum += np.abs(term)
  return out, abs_sum


def _f32_bound(k, abs_sum):
  """|f32 result - exact| for the chunked algorithm.

  A chunk's products of two E4M3 values are exact in float32; summing 128 of
  them in any order errs by <= 127 u * sum|terms| (u = 2**-24); the two descale
  multiplications add 2 u, the promotion sum over C chunks (C - 1) u, all
  relative to the same sum of |terms|. First-order bound: (128 + C + 2) u.
  """
  chunks = -(-k // 128)
  return (128 + chunks + 2) * 2.0**-24 * abs_sum


@pytest.mark.parametrize("m, n, k", [(256, 384, 512),   # multiples of 128
                                     (200, 150, 300)])  # partial last chunk and B block
def test_reference_f32_matches_float64_within_accumulation_bound(m, n, k):
  import jax.numpy as jnp
  bsm = _kernel_module()
  a, a_s, b_t, b_s = _problem(0, m, n, k)
  got = np.asarray(bsm.block_scaled_matmul_reference(a, a_s, b_t, b_s, jnp.float32), np.float64)
  want, abs_sum = _float64_gemm(a, a_s, b_t, b_s)
  err = np.abs(got - want)
  bound = _f32_bound(k, abs_sum)
  assert np.all(err <= bound), f"max excess {np.max(err - bound)}"
  # The bound is not vacuous: it is far below the result's own size, so a wrong
  # descale (any entry off by >= 2**-8 .. 2**8) could not hide inside it.
  assert np.median(bound / np.maximum(np.abs(want), 1e-30)) < 1e-3


def test_reference_bf16_output_is_the_rounded_f32_result():
  import jax.numpy as jnp
  bsm = _kernel_module()
  a, a_s, b_t, b_s = _problem(1, 200, 150, 300)
  got = np.asarray(bsm.block_scaled_matmul_reference(a, a_s, b_t, b_s).astype(jnp.float32),
                   np.float64)
  want, abs_sum = _float64_gemm(a, a_s, b_t, b_s)
  # bfloat16 rounding to nearest: relative 2**-8 (half an ulp of an 8-bit significand).
  bound = _f32_bound(300, abs_sum) * (1 + 2**-8) + 2**-8 * np.abs(want)
  assert np.all(np.abs(got - want) <= bound)


# ----- CPU: argument checks ------------------------------------------------------------


def _specs(m=256, n=256, k=512, a_dtype=None, scale_chunks=None):
  import jax
  import jax.numpy as jnp
  f8 = jnp.float8_e4m3fn
  chunks = -(-k // 128) if scale_chunks is None else scale_chunks
  return (jax.ShapeDtypeStruct((m, k), a_dtype or f8),
          jax.ShapeDtypeStruct((m, chunks), jnp.float32),
          jax.ShapeDtypeStruct((n, k), f8),
          jax.ShapeDtypeStruct((-(-n // 128), chunks), jnp.float32))


@pytest.mark.parametrize("kwargs, match", [
    (dict(m=200), r"M=200 .*pad M up to 256"),
    (dict(n=192), r"N=192 .*block_n"),
    (dict(k=300), r"K=300 .*pad K up to 384 with zero columns"),
    (dict(a_dtype="bfloat16"), r"a must be float8_e4m3fn"),
    (dict(scale_chunks=2), r"a_scale_inv must be \[M, ceil\(K/128\)\]"),
])
def test_kernel_rejects_bad_inputs_with_the_fix(kwargs, match):
  bsm = _kernel_module()
  with pytest.raises(ValueError, match=match):
    bsm.block_scaled_matmul(*_specs(**kwargs))


def test_rejects_b_that_was_not_transposed():
  import jax
  import jax.numpy as jnp
  bsm = _kernel_module()
  a, a_s, _, _ = _specs(m=256, n=384, k=512)
  b_kn = jax.ShapeDtypeStruct((512, 384), jnp.float8_e4m3fn)  # [K, N]: not K-major
  with pytest.raises(ValueError, match=r"b_t must be B transposed.*pass b\.T"):
    bsm.block_scaled_matmul_reference(a, a_s, b_kn, jax.ShapeDtypeStruct((3, 4), jnp.float32))


@pytest.mark.parametrize("kwargs", [dict(block_m=64), dict(block_n=256),
                                    dict(block_m=256, block_n=128), dict(num_stages=1)])
def test_block_sizes_reject_tiles_the_kernel_cannot_run(kwargs):
  bsm = _kernel_module()
  with pytest.raises(ValueError):
    bsm.BlockScaledMatmulBlockSizes(**kwargs)


# ----- CPU: the kernel in Mosaic GPU's interpreter ---------------------------------------


def _interpret_params(detect_races):
  try:
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
  except ImportError:
    pytest.skip("this jax has no Mosaic GPU CPU interpreter")
  return InterpretGPUParams(detect_races=detect_races)


@pytest.mark.parametrize("out_dtype, blocks, n, detect_races", [
    ("float32", dict(num_stages=2), 256, False),
    # block_n=64: two N tiles per B scale block, so the block index n0 // 128 is tested.
    ("bfloat16", dict(block_n=64, num_stages=2), 384, True),
])
def test_kernel_logic_matches_reference_in_cpu_interpreter(out_dtype, blocks, n, detect_races):
  import jax.numpy as jnp
  from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks
  bsm = _kernel_module()
  params = _interpret_params(detect_races)
  m, k = 256, 640  # 5 chunks through a 2-slot ring
  a, a_s, b_t, b_s = _problem(2, m, n, k)
  try:
    got = bsm.block_scaled_matmul(a, a_s, b_t, b_s, out_dtype=out_dtype, interpret=params,
                                  block_sizes=bsm.BlockScaledMatmulBlockSizes(**blocks))
  except Exception:
    gpu_callbacks.reset_gpu_interpret_mode_state()  # the interpreter asks for this after errors
    raise
  if detect_races:
    assert not gpu_callbacks.get_races().races_found, "the interpreter found a data race"
  want = bsm.block_scaled_matmul_reference(a, a_s, b_t, b_s, out_dtype)
  # Same chunks, same promotion order, float32 throughout: the interpreter's
  # per-chunk matmul and the reference's may sum a chunk in different orders,
  # so allow twice the float32 bound; bfloat16 outputs may then round to
  # neighbouring values (one bf16 ulp: 2**-7 relative).
  _, abs_sum = _float64_gemm(a, a_s, b_t, b_s)
  got64 = np.asarray(got.astype(jnp.float32), np.float64)
  want64 = np.asarray(want.astype(jnp.float32), np.float64)
  bound = 2 * _f32_bound(k, abs_sum)
  if out_dtype == "bfloat16":
    bound = bound + 2**-7 * np.abs(want64)
  assert np.all(np.abs(got64 - want64) <= bound), f"max excess {np.max(np.abs(got64 - want64) - bound)}"


# ----- On a real Hopper GPU: the compiled kernel vs the reference -----------------------


@pytest.mark.gpu
@pytest.mark.parametrize("out_dtype", ["float32", "bfloat16"])
def test_kernel_matches_reference_on_hopper(out_dtype, hopper_device):
  import jax
  import jax.numpy as jnp
  bsm = _kernel_module()
  device = hopper_device
  m, n, k = 1024, 512, 2048
  operands = jax.device_put(_problem(3, m, n, k), device)
  got = jax.jit(bsm.block_scaled_matmul, static_argnames=("out_dtype",))(
      *operands, out_dtype=out_dtype)
  want, abs_sum = _float64_gemm(*operands)
  # The FP8 wgmma adds inside a chunk with fewer bits than float32 (NVIDIA does
  # not document the width; DeepSeek-V3 reports about 14): allow 2**-10 of the
  # sum of |terms| for it, 8x that per-add width over a handful of adds, on top of
  # the float32 bound, plus the bfloat16 output rounding (half an ulp: 2**-8
  # relative). Still tight: for these random inputs a typical |out| is about
  # sum|terms| / sqrt(K) = 2**-5.5 of it, so a wrong tile, layout or descale
  # (an O(|out|) error) exceeds the bound by ~45x.
  bound = _f32_bound(k, abs_sum) + 2**-10 * abs_sum
  if out_dtype == "bfloat16":
    bound = bound + 2**-8 * np.abs(want)
  got64 = np.asarray(got.astype(jnp.float32), np.float64)
  assert np.all(np.abs(got64 - want) <= bound), f"max excess {np.max(np.abs(got64 - want) - bound)}"
