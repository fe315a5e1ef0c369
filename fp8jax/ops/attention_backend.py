"""Which attention implementation runs: a pure, cached function of a small static key.

The key holds only what decides the backend (platform, dtypes, head_dim, mask
kind, recipe *type*, GQA ratio, a size class). Scale and amax values never
enter it, so new FP8 state never re-runs selection; the selection itself is
cached, so it runs once per distinct key and warns once per fallback.

Backends:
  "pallas"            the fused Pallas flash-attention kernels (Triton-lowered on
                      GPUs), bf16 and FP8. On a CPU only when asked for: the
                      Pallas interpreter runs them there, correct but slow.
  "pallas_hopper"     bf16/f16 FlashAttention-3 style kernels on Hopper (Mosaic GPU,
                      warp-specialized wgmma), forward and backward
                      (pallas_kernels.hopper_attention).
  "pallas_hopper_fp8" their FP8 form: E4M3 wgmma forward and backward.
  "cudnn"             `jax.nn.dot_product_attention(implementation="cudnn")`, bf16.
                      FP8 attention may run here too, on dequantized inputs, when it
                      is faster than every FP8 kernel (see below).
                      Not for causal attention with q_len != kv_len: jax drives
                      cuDNN's causal mask top-left aligned, fp8jax's is
                      bottom-right (see fp8jax.ops.attention).
  "xla"               plain XLA attention (`jax.nn.dot_product_attention` with
                      implementation="xla"): the reference path, and the
                      automatic choice on a CPU (bf16 and FP8).

On a GPU the automatic choice is the fastest *validated* backend in the measured
table that can run the call, ranked by forward plus backward time. An FP8 backend is chosen only when it beats the best bf16 one;
otherwise FP8 attention runs that bf16 backend on dequantized inputs (the FP8 state
is still recorded) and the warning gives both measurements. Without a measurement
for the GPU, bf16 goes to cuDNN where it applies and FP8 to the "pallas" kernel.

The measured table is data, `attention_speeds.json` beside this module:

  {"source": the GPU benchmark it is derived from (benchmarks/results/),
   "failed_checks": rows a separate GPU check found wrong,
   "measured": {gpu_arch: {mask: {precision: {backend: {"forward_tflops",
                                                       "backward_tflops", "validated"}}}}},
   "tuning_source": the tuning run the next entry is from (or null),
   "tuned": {gpu_arch: {precision: {mask: {head_dim: HopperAttentionBlockSizes fields}}}}}

"tuned" holds the fastest tiles, pipeline depth and ping-pong setting of the Hopper
kernels found by `python -m benchmarks.attention --tune` on that GPU; the Hopper backends
run with them (`tuned_block_sizes`), and with the kernels' defaults where none is listed.

mask is "none" or "causal" (what the benchmark measures; segment ids rank as the mask
without them), precision "bf16" or "fp8". `validated` holds when the row's numerics
matched the float64 reference within the benchmark's tolerance and the GPU tests
that cover the backend's kernels passed (a backend whose tests did not run is not
validated). Selection never picks an unvalidated backend. `benchmarks/attention_speeds.py`
derives the table from a benchmark's JSON (a test re-derives it from `source`, so the
two cannot drift apart) and writes this file for a new measurement.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import pathlib
import warnings

from pallas_kernels import SUPPORTED_HEAD_DIMS as PALLAS_HEAD_DIMS

#: The attention backends a call may force (`backend=`); None lets fp8jax choose.
BACKENDS = ("pallas", "pallas_hopper", "pallas_hopper_fp8", "cudnn", "xla")
# The Hopper kernels' constraints (pallas_kernels/hopper_attention_tiling.py).
HOPPER_HEAD_DIMS = (64, 128)
HOPPER_SEQ_MULTIPLE = 128
#: Backends that run FP8 attention as bf16 attention on dequantized inputs.
DEQUANTIZING_FP8_BACKENDS = ("pallas_hopper", "cudnn")
# What jax.nn.dot_product_attention(implementation="cudnn") accepts.
CUDNN_DTYPES = ("bfloat16", "float16")
CUDNN_MAX_HEAD_DIM = 256
# A backward pass does 2.5x the forward's FLOPs (five products instead of two).
BACKWARD_FLOP_RATIO = 2.5

SPEEDS_FILE = pathlib.Path(__file__).with_name("attention_speeds.json")
_SPEEDS = json.loads(SPEEDS_FILE.read_text())
SOURCE = _SPEEDS["source"]
MEASURED = _SPEEDS["measured"]
TUNED = _SPEEDS.get("tuned", {})


def seconds_per_forward_flop(entry: dict) -> float:
  """Forward plus backward time per forward FLOP (1e-12 s), the rank of a table entry."""
  return 1.0 / entry["forward_tflops"] + BACKWARD_FLOP_RATIO / entry["backward_tflops"]


def measured(gpu_arch: str | None, mask: str, precision: str) -> dict:
  """{backend: entry} measured for this GPU, mask ("causal" ranks as "causal", anything
  else as "none") and precision; {} when nothing was measured."""
  by_mask = MEASURED.get(gpu_arch or "", {})
  kind = "causal" if "causal" in mask else "none"
  return by_mask.get(kind, by_mask.get("none", {})).get(precision, {})


def tuned_block_sizes(gpu_arch: str | None, precision: str, causal: bool,
                      head_dim: int) -> dict | None:
  """The Hopper kernels' tuned tiles for a GPU, precision, mask and head_dim.

  Args:
    gpu_arch: e.g. "sm_90" (None: no GPU).
    precision: "bf16" or "fp8" (which kernels).
    causal: the mask.
    head_dim: the head dimension.

  Returns:
    The `pallas_kernels.HopperAttentionBlockSizes` fields from the table's "tuned"
    entry, or None (the kernels' defaults) when none was measured.
  """
  by_mask = TUNED.get(gpu_arch or "", {}).get(precision, {})
  return by_mask.get("causal" if causal else "none", {}).get(str(head_dim))


@dataclasses.dataclass(frozen=True)
class BackendKey:
  """Everything backend selection may depend on, and nothing else.

  Attributes:
    platform: "cpu", "gpu" or "tpu" (the default JAX backend).
    gpu_arch: e.g. "sm_90" on a Hopper GPU; None elsewhere.
    dtype: the inputs' dtype name ("bfloat16", "float16", "float32").
    fp8: whether q, k, v are quantized to FP8.
    head_dim: the head dimension.
    mask: "none", "causal", "segments" or "causal+segments".
    recipe_type: the scaling recipe's class name, or None for bf16 attention.
    gqa_ratio: query heads per key/value head.
    size_class: "aligned" when both sequence lengths are multiples of 128 (what the
      Hopper kernels need), else "unaligned".
    equal_lengths: q_len == kv_len (a causal mask is then the same whether
      aligned top-left or bottom-right).
    compile_only: the platform is the compile target's, and this process has no such
      device (a deviceless compile, `fp8jax.mesh.target`): what needs the device to
      compile (cuDNN's fused attention) cannot be built; a kernel of fp8jax's stands in.
    block_scaled: FP8 inputs with one scale per 128 rows of each head (which the
      Triton-lowered "pallas" kernel does not take).
  """

  platform: str
  gpu_arch: str | None
  dtype: str
  fp8: bool
  head_dim: int
  mask: str
  recipe_type: str | None
  gqa_ratio: int
  size_class: str
  equal_lengths: bool
  compile_only: bool = False
  block_scaled: bool = False


@dataclasses.dataclass(frozen=True)
class BackendChoice:
  """The selected backend and, when it is not the fast path, why."""

  name: str
  reason: str | None = None


def make_key(q_shape, k_shape, dtype, *, fp8: bool, causal: bool, has_segments: bool,
             recipe_type: str | None, platform: str, gpu_arch: str | None,
             compile_only: bool = False, block_scaled: bool = False) -> BackendKey:
  """Builds the `BackendKey` for q [b, q_len, heads, d] and k [b, kv_len, kv_heads, d]."""
  mask = "+".join(m for m, on in (("causal", causal), ("segments", has_segments)) if on) or "none"
  q_len, kv_len = q_shape[1], k_shape[1]
  aligned = q_len % HOPPER_SEQ_MULTIPLE == 0 and kv_len % HOPPER_SEQ_MULTIPLE == 0
  return BackendKey(platform=platform, gpu_arch=gpu_arch, dtype=str(dtype), fp8=fp8,
                    head_dim=int(q_shape[-1]), mask=mask, recipe_type=recipe_type,
                    gqa_ratio=int(q_shape[2] // k_shape[2]),
                    size_class="aligned" if aligned else "unaligned",
                    equal_lengths=q_len == kv_len, compile_only=compile_only,
                    block_scaled=block_scaled)


def _why_not_hopper(key: BackendKey) -> str | None:
  if key.gpu_arch != "sm_90":
    return f"the GPU is {key.gpu_arch}, not Hopper (sm_90)"
  if key.head_dim not in HOPPER_HEAD_DIMS:
    return f"head_dim {key.head_dim} is not one of {HOPPER_HEAD_DIMS}"
  if key.size_class != "aligned":
    return f"q and kv lengths must be multiples of {HOPPER_SEQ_MULTIPLE}"
  return None


@functools.lru_cache(maxsize=None)
def select_backend(key: BackendKey, requested: str | None = None) -> BackendChoice:
  """Chooses the attention backend for `key`; warns once when off the fast path.

  Args:
    key: the static description of the call.
    requested: a backend name the caller insists on, or None to choose.

  Returns:
    The `BackendChoice`.

  Raises:
    ValueError: an unknown backend name, or a requested backend that cannot run `key`.
  """
  if requested is not None:
    if requested not in BACKENDS:
      raise ValueError(f"backend={requested!r} is not one of {BACKENDS} (or None to choose).")
    problem = _cannot_run(requested, key)
    if problem:
      raise ValueError(f"backend={requested!r} cannot run this attention: {problem}.")
    return BackendChoice(requested)
  choice = _choose(key)
  if choice.reason:
    warnings.warn(f"fp8jax attention uses the {choice.name!r} backend: {choice.reason}.",
                  stacklevel=4)
  return choice


def _cannot_run(name: str, key: BackendKey) -> str | None:
  if name == "pallas" and key.head_dim not in PALLAS_HEAD_DIMS:
    return f"head_dim {key.head_dim} is not one of {PALLAS_HEAD_DIMS}"
  if name == "pallas" and key.fp8 and key.block_scaled:
    return ("the Triton-lowered FP8 kernel takes one scale per tensor, not block scales; "
            "use block_scales=False, or backend 'pallas_hopper_fp8' or 'xla'")
  if name == "pallas_hopper_fp8":
    if not key.fp8:
      return "it is an FP8 kernel and the inputs are not quantized"
    return _why_not_hopper(key)
  if name == "pallas_hopper":
    if not key.fp8 and key.dtype not in CUDNN_DTYPES:
      return f"the bf16 Hopper kernels take {CUDNN_DTYPES}, not {key.dtype}"
    return _why_not_hopper(key)
  if name == "cudnn":
    if key.platform != "gpu":
      return f"cuDNN needs a GPU, the platform is {key.platform}"
    if key.compile_only:
      return ("cuDNN's fused attention cannot be compiled without a GPU (a deviceless "
              "compile); fp8jax's own kernels can")
    if "segments" in key.mask:
      return "segment ids are not expressible as cuDNN sequence lengths"
    if key.dtype not in CUDNN_DTYPES and not key.fp8:  # FP8 runs dequantized to bf16
      return f"cuDNN attention takes {CUDNN_DTYPES}, not {key.dtype}"
    if key.head_dim % 8 or key.head_dim > CUDNN_MAX_HEAD_DIM:
      return (f"cuDNN attention needs head_dim a multiple of 8 and at most "
              f"{CUDNN_MAX_HEAD_DIM}, got {key.head_dim}")
    if "causal" in key.mask and not key.equal_lengths:
      return ("causal attention with q_len != kv_len is aligned bottom-right in fp8jax "
              "(query i sees keys j <= i + kv_len - q_len), but jax drives cuDNN's causal "
              "mask top-left (j <= i); use backend='pallas' or 'xla', or None to choose")
  return None


def _choose(key: BackendKey) -> BackendChoice:
  if key.platform == "cpu":
    # The fused kernels run on a CPU only through the Pallas interpreter: correct,
    # but slower than XLA's own attention (forward+backward of [16, 128, 2, 64],
    # causal, on 2 cores: bf16 40 ms vs 8 ms, FP8 55 ms vs 8 ms). XLA is the fast
    # path here, for any head_dim, hence no warning. Its FP8 form
    # (fp8jax.ops.attention._fp8_forward) does the kernel's arithmetic in plain jnp
    # (E4M3 rounding of P included) and records the same amaxes.
    return BackendChoice("xla")
  if key.head_dim not in PALLAS_HEAD_DIMS:
    reason = f"head_dim {key.head_dim} is not one of the fused kernel's {PALLAS_HEAD_DIMS}"
    why_not_cudnn = _cannot_run("cudnn", key)
    if why_not_cudnn is None:
      return BackendChoice("cudnn", reason)
    return BackendChoice("xla", f"{reason}, and cuDNN cannot run it ({why_not_cudnn})")
  if key.platform != "gpu":
    return BackendChoice("xla", f"no fused kernel for the {key.platform} platform")
  if not key.compile_only:
    return _choose_by_measurement(key)
  # What the GPU itself would choose, then a kernel that compiles here in place of cuDNN.
  choice = _choose_by_measurement(dataclasses.replace(key, compile_only=False))
  return _stand_in_for_cudnn(key, choice) if choice.name == "cudnn" else choice


def _stand_in_for_cudnn(key: BackendKey, choice: BackendChoice) -> BackendChoice:
  """A GPU would run cuDNN, which a compile without a GPU cannot build: the Hopper flash
  kernel (or the Pallas one off Hopper) compiles in its place, in the same precision."""
  name = next(name for name in ("pallas_hopper", "pallas", "xla")
              if _cannot_run(name, key) is None)
  why = (f"a GPU would run 'cudnn' here, which cannot be compiled without a GPU; "
         f"fp8jax's {name!r} kernel stands in for it in this deviceless compile")
  return BackendChoice(name, f"{why} ({choice.reason})" if choice.reason else why)


def _fastest(key: BackendKey, precision: str):
  """(backend, entry) of the fastest validated measured backend that runs `key`, or None."""
  entries = measured(key.gpu_arch, key.mask, precision)
  runnable = [(seconds_per_forward_flop(entry), name, entry)
              for name, entry in entries.items()
              if entry["validated"] and _cannot_run(name, key) is None
              and (precision == "fp8" or not key.fp8 or name in DEQUANTIZING_FP8_BACKENDS)]
  return min(runnable)[1:] if runnable else None


def _describe(name: str, entry: dict) -> str:
  return (f"{name!r}: {entry['forward_tflops']:.0f} TFLOP/s forward, "
          f"{entry['backward_tflops']:.0f} backward")


def _choose_by_measurement(key: BackendKey) -> BackendChoice:
  best_bf16 = _fastest(key, "bf16")
  if not key.fp8:
    if best_bf16 is not None:
      return BackendChoice(best_bf16[0])
    return BackendChoice("cudnn" if _cannot_run("cudnn", key) is None else "pallas")
  best_fp8 = _fastest(key, "fp8")
  if best_fp8 is not None and (best_bf16 is None or (
      seconds_per_forward_flop(best_fp8[1]) < seconds_per_forward_flop(best_bf16[1]))):
    return BackendChoice(best_fp8[0])
  if best_bf16 is not None:
    if best_fp8 is None:
      why = (f"no FP8 attention kernel is validated and measured on {key.gpu_arch} for "
             f"this call")
    else:
      why = (f"the fastest validated FP8 attention, {_describe(*best_fp8)}, is slower than "
             f"bf16 {_describe(*best_bf16)}")
    return BackendChoice(best_bf16[0], f"{why}; FP8 inputs run dequantized through "
                         f"{best_bf16[0]!r} (FP8 state still recorded; measurements: "
                         f"{SOURCE})")
  why = f"no validated attention measurement for {key.gpu_arch}"
  problem = _cannot_run("pallas", key)
  if problem is not None:
    return BackendChoice("xla", f"{why}, and the 'pallas' kernel cannot run this ({problem})")
  return BackendChoice(
      "pallas", f"{why}; the Triton-lowered FP8 kernel's dots run as f16 mma.sync, slower "
      "than bf16")
