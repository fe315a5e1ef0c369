"""Scaling recipes: how the scale of each FP8 tensor is chosen.

A recipe is a frozen, hashable dataclass, so it can be a static argument of
`jax.jit` and part of a pytree's static structure.

* `DelayedScaling`: the scale used at step t comes from the amaxes of earlier
  steps (an amax history of length L); step t's amax enters the history after.
* `CurrentScaling`: the scale comes from the tensor's own amax, just in time.

In both, `scale = fp8_max / amax / 2**margin` and quantization is
`q = saturate(x * scale)`. Both take two options: `power_of_two` rounds every
scale down to a power of two (so `amax * scale <= fp8_max` still holds and the
descale `1 / scale` is exact), and `high_precision` names GEMMs ("fprop",
"dgrad", "wgrad") that run in the input dtype on the unquantized operands.

Finer-grained recipes scale each operand of each GEMM along that GEMM's
contraction axis, from the tensor itself (no history), with the quantization and
GEMMs of `fp8jax.core.blocks` (the op is `fp8jax.ops.fine_grained_dot`):

* `RowwiseScaling`: one scale per row of the left operand and per column of the
  right one; the scales multiply the GEMM's float32 product (an epilogue).
* `BlockScaling`: DeepSeek-V3 style, 1 x B tiles for activations and gradients,
  B x B blocks for weights.
* `MXFP8Scaling`: OCP MX, 32-element blocks with power-of-two (E8M0) scales,
  rounded OCP's way (down) or NVIDIA's (up).
* `NVFP4Scaling`: NVIDIA's NVFP4 training recipe: E2M1 values in 16-element
  blocks with E4M3 scales and a float32 scale per tensor, 16 x 16 blocks for
  weights, a random Hadamard transform on the weight-gradient GEMM's inputs and
  stochastic rounding of output gradients (its key kept in the FP8 state).

Every recipe is a `Recipe`: the ops ask it everything through the protocol
that class documents and test no recipe's type, so a recipe written outside
fp8jax (a frozen dataclass subclassing `Recipe` or a built-in one) works
wherever a built-in one does. docs/guides/recipes.md, "Write your own recipe", has an example.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib

import jax
import jax.numpy as jnp

from fp8jax.core import blocks, native_gemm, nvfp4, rounding_keys
from fp8jax.core.formats import E2M1, E4M3, E5M2, Fp8Format, formats_for
from fp8jax.core.validation import check_int

AMAX_COMPUTE_ALGOS = ("max", "most_recent")
# The three GEMMs of a matmul's training step: out = x @ k, dx = g @ k^T, dk = x^T @ g.
GEMMS = ("fprop", "dgrad", "wgrad")
BLOCK_GEMMS = ("emulated", "pallas_hopper")
# MXFP8 and NVFP4: emulated everywhere, or jax.nn.scaled_matmul where the program is
# compiled for a Blackwell GPU (fp8jax.core.native_gemm) and emulated elsewhere.
MICROSCALED_GEMMS = ("emulated", "native")
NVFP4_WEIGHT_BLOCKS = ("16x16", "1x16")
# MX element formats: the same format for every role.
MX_FORMAT_CHOICES = {"e4m3": (E4M3, E4M3), "e5m2": (E5M2, E5M2)}


def _check_bool(name: str, value) -> None:
  if not isinstance(value, bool):
    raise ValueError(f"{name}={value!r} must be True or False.")


def _normalized_high_precision(value) -> tuple[str, ...]:
  """`value` as a tuple of GEMM names (a list, as JSON gives it back, is accepted)."""
  if isinstance(value, str) or not isinstance(value, (tuple, list)):
    raise ValueError(
        f"high_precision={value!r} must be a tuple of GEMM names from {GEMMS}, e.g. "
        "('wgrad',) for a high-precision weight gradient; a single name needs a tuple "
        "('wgrad',), not 'wgrad'.")
  for name in value:
    if name not in GEMMS:
      raise ValueError(
          f"high_precision={tuple(value)!r} names {name!r}, which is not a GEMM of a "
          f"matmul; use names from {GEMMS}.")
  if len(set(value)) != len(value):
    raise ValueError(f"high_precision={tuple(value)!r} names a GEMM twice; name each once.")
  return tuple(value)


def _set_high_precision(recipe) -> None:
  # A frozen dataclass sets its own normalized field through object.__setattr__.
  object.__setattr__(recipe, "high_precision",
                     _normalized_high_precision(recipe.high_precision))


class Recipe:
  """The scaling-recipe protocol: what fp8jax's ops ask a recipe, and nothing else.

  Subclass it (or a built-in recipe) as a frozen dataclass, so a recipe is
  hashable (a static `jit` argument) and its fields describe it (checkpoints
  save them with the class's importable name); give every field a default
  (`fp8jax sweep` builds a recipe from its class). The defaults are per-tensor
  delayed scaling with nothing optional. `history_len`, `forward_format` and
  `gradient_format` are properties: override them as properties, not fields.

  Formats per role:
    forward_format, gradient_format: the `Fp8Format` of x and the kernel, and of
      output gradients (by default from the `fp8_format` name: "hybrid" is E4M3
      forward, E5M2 gradients; "e4m3" is E4M3 everywhere).

  State (an `Fp8Meta` per role: scale, amax history, the step's running amax):
    history_len: L, the amax history each role keeps.

  How an operand is quantized:
    scales_from_tensor: False: with the stored scale (delayed scaling); True:
      with a scale from the tensor's own amax, taken just before the cast.
    per_operand: True for recipes that quantize each GEMM operand along that
      GEMM's contraction axis (per row, per block); they implement
      `quantize_operand` and `operand_gemm`, and may set
      `kernel_blocks_serve_dgrad`, `stochastic_rounding` and override
      `element_format`, `target_gemm` and `check_op`.
    stochastic_rounding: output gradients are rounded stochastically: each
      matmul's gradient role then keeps a PRNG key in its meta (`Fp8Meta.rng`,
      `fp8jax.core.rounding_keys`), and `quantize_operand` gets a key for each
      gradient it quantizes.
    margin, power_of_two: `scale = fmt.max / amax / 2**margin`, rounded down to
      a power of two if `power_of_two`.
    high_precision: GEMMs among ("fprop", "dgrad", "wgrad") that run in the
      input dtype on the unquantized operands.

  How the next scale comes from the amaxes:
    window_amax(history): the amax the next scale is made from, per row of a
      [rows, L] history whose column 0 is the newest step. The default takes
      the max ("max") or the newest ("most_recent") by `amax_compute_algo`, and
      runs in the fused end-of-step kernel; a recipe that overrides it is
      closed by jnp, as written. A non-finite step amax is recorded as 0 and
      keeps the old scale, whatever the recipe.
  """

  fp8_format = "hybrid"
  amax_compute_algo = "max"
  margin = 0
  power_of_two = False
  high_precision = ()
  scales_from_tensor = False
  per_operand = False
  kernel_blocks_serve_dgrad = False
  stochastic_rounding = False

  @property
  def forward_format(self) -> Fp8Format:
    return formats_for(self.fp8_format)[0]

  @property
  def gradient_format(self) -> Fp8Format:
    return formats_for(self.fp8_format)[1]

  @property
  def history_len(self) -> int:
    return 1

  def window_amax(self, history):
    """float32 [rows]: the amax each row's next scale is made from ([rows, L] history)."""
    return history.max(axis=1) if self.amax_compute_algo == "max" else history[:, 0]

  @property
  def fused_update(self) -> bool:
    """Whether the end-of-step kernel can close this recipe (its `window_amax` is the default)."""
    return type(self).window_amax is Recipe.window_amax

  def quantize_operand(self, t, fmt: Fp8Format, axis: int, weight: bool, key=None):
    """`t [..., R, C]` as a `fp8jax.core.blocks.BlockQuantized` along the contraction
    `axis` (-1: C, -2: R); `weight` marks the kernel. For `per_operand` recipes.

    `axis=-2` with `weight=False` is an input of the weight-gradient GEMM (x or the
    output gradient, contracted over the tokens). `key` (uint32 [2]) is passed only
    for output gradients under `stochastic_rounding`: the randomness of this
    operand's rounding (a recipe without that option need not take the argument)."""
    raise NotImplementedError(f"{type(self).__name__} scales whole tensors (per_operand=False).")

  def operand_gemm(self, a, b, out_dtype):
    """The GEMM of `quantize_operand` results `a [..., P, C]`, `b [..., C, Q]` in
    `out_dtype`. Default: dequantize both and multiply in float32."""
    return blocks.emulated_block_gemm(a, b, out_dtype)

  def target_gemm(self, a, b, out_dtype, gpu_arch: str | None):
    """`operand_gemm` as compiled for a GPU of architecture `gpu_arch` ("sm_90",
    "sm_100"; None off GPUs): a recipe may lower to that target's own block-scaled
    GEMM there. Default: `operand_gemm` on every target."""
    del gpu_arch
    return self.operand_gemm(a, b, out_dtype)

  def element_format(self, fmt: Fp8Format) -> Fp8Format:
    """The format of the values `quantize_operand` writes for a role of format `fmt`
    (telemetry's saturation and underflow thresholds). Default: `fmt` itself."""
    return fmt

  def check_op(self, op: str) -> None:
    """Raises ValueError when this recipe cannot quantize the op named `op`
    (e.g. "fp8_ragged_dot"), naming the fix. Default: every op."""
    del op

  def operand_scales(self, t, quantized, fmt: Fp8Format):
    """The multipliers `quantize_operand` applied per block of `t` (for telemetry):
    `fmt.max / amax` of each block, as `fp8jax.core.blocks` forms it."""
    return blocks.block_scales(blocks.block_amax(t, quantized.block), fmt, self.power_of_two)


@dataclasses.dataclass(frozen=True)
class DelayedScaling(Recipe):
  """Delayed scaling from a window of past amaxes.

  Attributes:
    amax_history_len: L, how many steps of amax the history keeps (>= 1).
    amax_compute_algo: "max" (largest amax in the window) or "most_recent"
      (the newest amax only).
    margin: the scale is divided by 2**margin, leaving headroom (>= 0).
    fp8_format: "hybrid" (E4M3 forward, E5M2 gradients) or "e4m3".
    power_of_two: round each scale down to a power of two (its float32
      mantissa bits cleared), so `amax * scale <= fp8_max` still holds and
      `scale_inv` is exact.
    high_precision: GEMMs among ("fprop", "dgrad", "wgrad") that run in the
      input dtype on the unquantized operands (e.g. ("wgrad",)); amaxes are
      still recorded for every role.
  """

  amax_history_len: int = 16
  amax_compute_algo: str = "max"
  margin: int = 0
  fp8_format: str = "hybrid"
  power_of_two: bool = False
  high_precision: tuple[str, ...] = ()

  def __post_init__(self):
    check_int("amax_history_len", self.amax_history_len, minimum=1)
    if self.amax_compute_algo not in AMAX_COMPUTE_ALGOS:
      raise ValueError(
          f"amax_compute_algo={self.amax_compute_algo!r} is not supported; "
          f"use one of {AMAX_COMPUTE_ALGOS}.")
    check_int("margin", self.margin, minimum=0)
    formats_for(self.fp8_format)
    _check_bool("power_of_two", self.power_of_two)
    _set_high_precision(self)

  @property
  def history_len(self) -> int:
    return self.amax_history_len


@dataclasses.dataclass(frozen=True)
class CurrentScaling(Recipe):
  """Just-in-time scaling from each tensor's own amax (no history).

  Attributes:
    margin: the scale is divided by 2**margin (>= 0).
    fp8_format: "hybrid" (E4M3 forward, E5M2 gradients) or "e4m3".
    power_of_two: round each scale down to a power of two (as in `DelayedScaling`).
    high_precision: GEMMs that run in the input dtype (as in `DelayedScaling`).
  """

  margin: int = 0
  fp8_format: str = "hybrid"
  power_of_two: bool = False
  high_precision: tuple[str, ...] = ()

  def __post_init__(self):
    check_int("margin", self.margin, minimum=0)
    formats_for(self.fp8_format)
    _check_bool("power_of_two", self.power_of_two)
    _set_high_precision(self)

  amax_compute_algo = "most_recent"
  scales_from_tensor = True  # history_len 1: the step's amax, kept for reporting


class _FineGrained(Recipe):
  """What the per-row / per-block recipes share: scales come from the tensor itself.

  The meta keeps a one-entry amax history of each role's whole tensor, for
  reporting (like `CurrentScaling`); the scales a GEMM uses are computed from
  its operands, per row or per block, and are not stored.
  """

  amax_compute_algo = "most_recent"
  scales_from_tensor = True
  per_operand = True


@dataclasses.dataclass(frozen=True)
class RowwiseScaling(_FineGrained):
  """Current scaling per row of each GEMM's left operand and per column of its right one.

  Every GEMM `A [P, C] @ B [C, Q]` quantizes A with one scale per row (amax over
  the contraction axis C) and B with one per column, and multiplies its float32
  product by the outer product of the two descale vectors:
  `out[p, q] = (q(A) @ q(B))[p, q] * a_inv[p] * b_inv[q]`. So x is scaled per
  row for fprop and per column (over M) for wgrad, the kernel per column for
  fprop and per row (over N) for dgrad, g per row for dgrad and per column for wgrad.

  Attributes:
    fp8_format: "hybrid" (E4M3 forward, E5M2 gradients) or "e4m3".
    power_of_two: round each scale down to a power of two.
    high_precision: GEMMs among ("fprop", "dgrad", "wgrad") run in the input dtype.
  """

  fp8_format: str = "hybrid"
  power_of_two: bool = False
  high_precision: tuple[str, ...] = ()

  def __post_init__(self):
    formats_for(self.fp8_format)
    _check_bool("power_of_two", self.power_of_two)
    _set_high_precision(self)

  def quantize_operand(self, t, fmt, axis, weight):
    return blocks.quantize_rows(t, fmt, axis, self.power_of_two)

  def operand_gemm(self, a, b, out_dtype):
    return blocks.rowwise_gemm(a, b, out_dtype)


@dataclasses.dataclass(frozen=True)
class BlockScaling(_FineGrained):
  """DeepSeek-V3 block scaling: 1 x B tiles for activations and gradients, B x B for weights.

  Each GEMM quantizes its operands along its contraction axis: x in 1 x B tiles
  along K (fprop) and along M (wgrad), g along N (dgrad) and along M (wgrad),
  one float32 scale `fmt.max / amax(tile)` per tile; the kernel in B x B
  blocks, which serve fprop and dgrad alike. A partial last tile or block has
  its own scale from its own elements.

  Attributes:
    block_size: B, a positive multiple of 16 (default 128).
    fp8_format: "e4m3" (E4M3 everywhere, the default) or "hybrid".
    power_of_two: round each scale down to a power of two.
    high_precision: GEMMs among ("fprop", "dgrad", "wgrad") run in the input dtype.
    gemm: "emulated" (dequantize per tile, float32 dot at HIGHEST precision;
      every platform) or "pallas_hopper" (fprop and dgrad on the block-scaled
      Mosaic GPU kernel of `pallas_kernels.block_scaled_matmul`; a GPU only,
      block_size 128, fp8_format "e4m3").
  """

  block_size: int = 128
  fp8_format: str = "e4m3"
  power_of_two: bool = False
  high_precision: tuple[str, ...] = ()
  gemm: str = "emulated"

  def __post_init__(self):
    if (isinstance(self.block_size, bool) or not isinstance(self.block_size, int)
        or self.block_size <= 0 or self.block_size % 16):
      raise ValueError(
          f"block_size={self.block_size!r} must be a positive multiple of 16 (FP8 GEMM "
          "tiles are multiples of 16); DeepSeek-V3 uses 128.")
    formats_for(self.fp8_format)
    _check_bool("power_of_two", self.power_of_two)
    _set_high_precision(self)
    if self.gemm not in BLOCK_GEMMS:
      raise ValueError(f"gemm={self.gemm!r} is not supported; use one of {BLOCK_GEMMS}.")
    if self.gemm == "pallas_hopper" and (self.block_size, self.fp8_format) != (128, "e4m3"):
      raise ValueError(
          f"gemm='pallas_hopper' runs the block-scaled kernel, which takes 128-wide blocks "
          f"of E4M3 only; got block_size={self.block_size}, fp8_format={self.fp8_format!r}. "
          "Use block_size=128, fp8_format='e4m3', or gemm='emulated'.")

  kernel_blocks_serve_dgrad = True  # B x B blocks of k are the B x B blocks of k^T

  def quantize_operand(self, t, fmt, axis, weight):
    size = self.block_size
    block = (size, size) if weight else ((1, size) if axis == -1 else (size, 1))
    return blocks.quantize_blocks(t, fmt, block, self.power_of_two)

  def operand_gemm(self, a, b, out_dtype):
    if self.gemm == "pallas_hopper" and b.block == (self.block_size, self.block_size):
      return blocks.pallas_block_gemm(a, b, out_dtype)
    return blocks.emulated_block_gemm(a, b, out_dtype)


@dataclasses.dataclass(frozen=True)
class MXFP8Scaling(_FineGrained):
  """OCP MX (MXFP8): 32-element blocks along each GEMM's contraction axis, E8M0 scales.

  Per block, the shared exponent is `clip(floor(log2(amax)) - emax, -127, 127)` with
  emax 8 for E4M3 and 15 for E5M2 (OCP MX v1.0, `scale_rounding="floor"`), or
  `clip(ceil(log2(amax / fmt.max)), -127, 127)` (NVIDIA's MXFP8 training recipe,
  `scale_rounding="round_up"`), and the elements are `saturate(x / 2**shared_exp)` in
  the element format (`fp8jax.core.blocks.quantize_mx`). Every operand of every GEMM,
  weights included, is quantized in 1 x 32 blocks along that GEMM's contraction axis.

  Attributes:
    fp8_format: the element format of every role: "e4m3" (default) or "e5m2".
    high_precision: GEMMs among ("fprop", "dgrad", "wgrad") run in the input dtype.
    scale_rounding: "floor" (OCP's rule: a block's largest elements land in
      [2**emax, 2**(emax+1)) and those above fmt.max saturate) or "round_up"
      (NVIDIA's: the smallest power-of-two scale that saturates nothing; where amax's
      significand exceeds 1.75 the scale is twice OCP's, so its elements keep one bit
      less). The two agree for every other block.
    gemm: "emulated" (dequantize, float32 GEMM; every target) or "native"
      (`jax.nn.scaled_matmul`, cuDNN's block-scaled GEMM, where the program is compiled
      for a Blackwell GPU; emulated on every other target).
  """

  fp8_format: str = "e4m3"
  high_precision: tuple[str, ...] = ()
  scale_rounding: str = "floor"
  gemm: str = "emulated"

  block_size = blocks.MX_BLOCK  # fixed by the MX specification
  power_of_two = True  # E8M0 scales are powers of two

  def __post_init__(self):
    if self.fp8_format not in MX_FORMAT_CHOICES:
      raise ValueError(
          f"fp8_format={self.fp8_format!r} is not an MXFP8 element format; use one of "
          f"{sorted(MX_FORMAT_CHOICES)} (MX uses one element format for every role).")
    _set_high_precision(self)
    blocks.check_scale_rounding(self.scale_rounding)
    _check_microscaled_gemm(self.gemm)

  @property
  def forward_format(self) -> Fp8Format:
    return MX_FORMAT_CHOICES[self.fp8_format][0]

  @property
  def gradient_format(self) -> Fp8Format:
    return MX_FORMAT_CHOICES[self.fp8_format][1]

  def quantize_operand(self, t, fmt, axis, weight, key=None):
    return blocks.quantize_mx(t, fmt, axis, self.scale_rounding)

  def target_gemm(self, a, b, out_dtype, gpu_arch):
    if self.gemm == "native" and native_gemm.is_blackwell(gpu_arch):
      return native_gemm.blackwell_gemm(a, b, out_dtype, jnp.float8_e8m0fnu,
                                        "MXFP8Scaling(gemm='native')")
    return self.operand_gemm(a, b, out_dtype)

  def operand_scales(self, t, quantized, fmt):
    return 1.0 / quantized.scale_inv  # powers of two: their reciprocals are exact


@dataclasses.dataclass(frozen=True)
class NVFP4Scaling(_FineGrained):
  """NVIDIA's NVFP4 training recipe: 4-bit E2M1 values, E4M3 block scales, a float32 tensor scale.

  Every operand of every GEMM is quantized by `fp8jax.core.nvfp4.quantize_nvfp4`:
  E2M1 values in 16-element blocks along that GEMM's contraction axis, one E4M3
  scale per block and one float32 scale per operand from its own amax
  (`448 * 6 / amax`). By default, as NVIDIA trained with it:

  * weights in 16 x 16 blocks, so the kernel and its transpose quantize alike and
    one quantization serves fprop and dgrad;
  * the weight-gradient GEMM's inputs (x and the output gradient, contracted over
    the tokens) multiplied by the random Hadamard transform, 16 x 16 with one fixed
    sign vector (`fp8jax.core.nvfp4.hadamard_rows`): the product is unchanged, the
    blocks' outliers are spread before they are rounded to 4 bits;
  * output gradients rounded stochastically (unbiased); x and weights to nearest
    even. The randomness comes from a key in each matmul's gradient-role state
    (`Fp8Meta.rng`, advanced by `fp8jax.end_step`): steps are reproducible and pure.

  NVIDIA also kept the last layers in bf16: with `fp8jax.flax` rules, or by giving
  those layers no recipe. Everything is emulated exactly (quantize, dequantize,
  multiply in float32) unless `gemm="native"` and the target is a Blackwell GPU.
  The meta's roles are E4M3 (the block scales' format); attention, which takes one
  scale per tensor, runs FP8 E4M3 scaled from each tensor's own amax, as under the
  other per-block recipes. Grouped (expert) matmuls are refused: the transform
  would mix the tokens of different experts.

  Attributes:
    weight_blocks: "16x16" (the default) or "1x16" (weights in 16-element blocks along
      each GEMM's contraction, quantized apart for fprop and dgrad).
    hadamard: apply the random Hadamard transform to the weight-gradient GEMM's inputs.
    stochastic_rounding: round output gradients stochastically (else to nearest even).
    high_precision: GEMMs among ("fprop", "dgrad", "wgrad") run in the input dtype.
    gemm: "emulated" (every target) or "native" (`jax.nn.scaled_matmul`, cuDNN's
      NVFP4 GEMM, where the program is compiled for a Blackwell GPU; emulated elsewhere).
  """

  weight_blocks: str = "16x16"
  hadamard: bool = True
  stochastic_rounding: bool = True
  high_precision: tuple[str, ...] = ()
  gemm: str = "emulated"

  block_size = nvfp4.BLOCK  # fixed by the format: one E4M3 scale per 16 values
  fp8_format = "e4m3"  # the roles' format: the block scales'

  def __post_init__(self):
    if self.weight_blocks not in NVFP4_WEIGHT_BLOCKS:
      raise ValueError(
          f"weight_blocks={self.weight_blocks!r} is not a block NVFP4 can scale: the format "
          "has one E4M3 scale per 16 values. Use '16x16' (a weight and its transpose "
          "quantize alike, NVIDIA's choice) or '1x16'.")
    _check_bool("hadamard", self.hadamard)
    _check_bool("stochastic_rounding", self.stochastic_rounding)
    _set_high_precision(self)
    _check_microscaled_gemm(self.gemm)

  @property
  def kernel_blocks_serve_dgrad(self) -> bool:
    return self.weight_blocks == "16x16"  # 16 x 16 blocks of k are those of k^T

  def element_format(self, fmt):
    return E2M1

  def quantize_operand(self, t, fmt, axis, weight, key=None):
    size = nvfp4.BLOCK
    if weight and self.weight_blocks == "16x16":
      block = (size, size)
    else:
      block = (1, size) if axis == -1 else (size, 1)
    if self.hadamard and axis == -2 and not weight:  # the weight-gradient GEMM's inputs
      t = nvfp4.hadamard_rows(t)
    uniform = (rounding_keys.uniform(key, t.shape)
               if key is not None and self.stochastic_rounding else None)
    return nvfp4.quantize_nvfp4(t, block, uniform)

  def operand_scales(self, t, quantized, fmt):
    return nvfp4.multipliers(quantized.block_scale, quantized.tensor_scale)

  def target_gemm(self, a, b, out_dtype, gpu_arch):
    if self.gemm == "native" and native_gemm.is_blackwell(gpu_arch):
      return native_gemm.blackwell_gemm(a, b, out_dtype, jnp.float8_e4m3fn,
                                        "NVFP4Scaling(gemm='native')")
    return self.operand_gemm(a, b, out_dtype)

  def check_op(self, op):
    if op == "fp8_ragged_dot":
      raise ValueError(
          "NVFP4Scaling cannot quantize fp8_ragged_dot (the experts of a mixture-of-experts "
          "layer): its weight-gradient GEMM sums each expert's tokens apart, and the "
          "Hadamard transform and the 16-token blocks would mix the tokens of different "
          "experts. Give the expert layers another recipe (MXFP8Scaling, BlockScaling) or "
          "none (bf16).")


def _check_microscaled_gemm(gemm) -> None:
  if gemm not in MICROSCALED_GEMMS:
    raise ValueError(
        f"gemm={gemm!r} is not supported; use 'emulated' (every target) or 'native' "
        "(jax.nn.scaled_matmul where the program is compiled for a Blackwell GPU, the "
        "emulation elsewhere).")


RECIPE_CLASSES = (DelayedScaling, CurrentScaling, RowwiseScaling, BlockScaling, MXFP8Scaling,
                  NVFP4Scaling)


def is_fine_grained(recipe) -> bool:
  """True for recipes that quantize per GEMM operand (`Recipe.per_operand`), which
  `fp8jax.ops.fine_grained_dot` runs."""
  return bool(recipe.per_operand)


def check_recipe(recipe, argname: str = "recipe") -> None:
  """Raises unless `recipe` is a hashable `Recipe` dataclass with valid protocol values
  (TypeError for the kind of object, ValueError for a value)."""
  if not isinstance(recipe, Recipe) or not dataclasses.is_dataclass(recipe):
    names = ", ".join(cls.__name__ for cls in RECIPE_CLASSES)
    raise TypeError(
        f"{argname} must be a fp8jax recipe ({names}, or your own subclass of "
        f"fp8jax.Recipe declared as a frozen dataclass), got {type(recipe).__name__}: "
        f"{recipe!r}.")
  try:
    hash(recipe)
  except TypeError:
    raise TypeError(
        f"{argname}={recipe!r} is not hashable; declare your recipe with "
        "@dataclasses.dataclass(frozen=True) so it can be a static jit argument.") from None
  _check_protocol_values(recipe)


def _check_protocol_values(recipe) -> None:
  """The protocol's values (a recipe of your own has no `__post_init__` of fp8jax's)."""
  name = type(recipe).__name__
  if recipe.fused_update and recipe.amax_compute_algo not in AMAX_COMPUTE_ALGOS:
    raise ValueError(f"{name}.amax_compute_algo={recipe.amax_compute_algo!r} is not one of "
                     f"{AMAX_COMPUTE_ALGOS} (override window_amax for another rule).")
  check_int(f"{name}.margin", recipe.margin, minimum=0)
  check_int(f"{name}.history_len", recipe.history_len, minimum=1)
  _check_bool(f"{name}.power_of_two", recipe.power_of_two)
  _normalized_high_precision(recipe.high_precision)
  for role in ("forward_format", "gradient_format"):
    if not isinstance(getattr(recipe, role), Fp8Format):
      raise TypeError(f"{name}.{role} must be an fp8jax.Fp8Format (E4M3 or E5M2), got "
                      f"{getattr(recipe, role)!r}.")
  if not recipe.fused_update:
    _check_window_amax(recipe)


# Rows of the abstract history a recipe's own window_amax is tried on: more than one, so
# a window that drops or keeps the wrong axis shows.
_PROBE_ROWS = 3


@functools.lru_cache(maxsize=256)
def _check_window_amax(recipe) -> None:
  """A recipe's own `window_amax` maps a float32 [rows, L] history to float32 [rows].

  Checked on shapes only (`jax.eval_shape`), once per recipe, where the recipe is
  first used, so a wrong shape names the method instead of failing a step later.
  """
  name = type(recipe).__name__
  history = jax.ShapeDtypeStruct((_PROBE_ROWS, recipe.history_len), jnp.float32)
  try:
    window = jax.eval_shape(recipe.window_amax, history)
  except Exception as error:  # the user's method: any failure is theirs to see
    raise TypeError(
        f"{name}.window_amax(history) failed on a float32 history of shape "
        f"{history.shape} ([rows, history_len]): {type(error).__name__}: {error}") from error
  want = (_PROBE_ROWS,)
  if not isinstance(window, jax.ShapeDtypeStruct) or window.shape != want or not (
      jnp.issubdtype(window.dtype, jnp.floating)):
    got = (f"shape {window.shape} and dtype {window.dtype}"
           if isinstance(window, jax.ShapeDtypeStruct) else repr(window))
    raise ValueError(
        f"{name}.window_amax(history) must return one float per row of the [rows, "
        f"history_len] history: given shape {history.shape} it must return shape {want}, "
        f"but it returned {got}. Reduce over axis 1 (e.g. history.max(axis=1)).")


def recipe_kind(cls: type) -> str:
  """How a checkpoint names a recipe class: "DelayedScaling", or "module:QualifiedName"."""
  if cls in RECIPE_CLASSES:
    return cls.__name__
  return f"{cls.__module__}:{cls.__qualname__}"


def import_recipe_class(name: str) -> type:
  """The recipe class `name` ("module:QualifiedName") names, imported.

  Raises:
    ValueError: the module or class cannot be found, or it is not a recipe class.
  """
  module_name, _, qualname = name.partition(":")
  try:
    found = importlib.import_module(module_name)
    for attribute in qualname.split("."):
      found = getattr(found, attribute)
  except (ImportError, AttributeError) as error:
    raise ValueError(
        f"the FP8 recipe {name!r} cannot be imported ({type(error).__name__}: {error}); "
        "make its module importable (installed, or on sys.path / PYTHONPATH) and define "
        "the class at module level.") from None
  if not (isinstance(found, type) and issubclass(found, Recipe)):
    raise ValueError(f"{name!r} is {found!r}, not a subclass of fp8jax.Recipe.")
  return found


def is_flax_fp8_ops_recipe(recipe) -> bool:
  """Whether Flax's `fp8_ops` run `recipe` exactly: plain delayed scaling, max over the
  history, no margin, hybrid formats, no power-of-two scales, no high-precision GEMM
  (no subclass: its rules may differ)."""
  return (type(recipe) is DelayedScaling and recipe.amax_compute_algo == "max"
          and recipe.margin == 0 and recipe.fp8_format == "hybrid"
          and not recipe.power_of_two and not recipe.high_precision)
