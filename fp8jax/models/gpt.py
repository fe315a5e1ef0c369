"""A byte-level decoder-only transformer (GPT) in bf16 or FP8, from fp8jax's Flax layers.

    config = gpt.config_for("tiny", seq_len=128)
    model = gpt.Gpt(config, recipe=fp8jax.DelayedScaling())   # recipe=None: the bf16 twin
    variables = model.init(jax.random.key(0), tokens)          # tokens int32 [batch, seq]
    logits, updates = model.apply(variables, tokens, mutable=["fp8_meta"])  # FP8 training
    logits = model.apply(variables, tokens)                    # FP8 evaluation: no recording
    logits = gpt.Gpt(config).apply({"params": variables["params"]}, tokens)  # the bf16 twin

Architecture (pre-norm, GPT-2 shaped, no biases, no learned positions):

    x = embed[tokens]                                          # bf16 [B, S, d]
    for each of n_layers blocks (nn.scan, one stacked set of params and FP8 state):
      q, k, v = qkv(h)                                               h = rms_norm(x)
      x = x + out(attention(rope(q), rope(k), v, causal))
      x = x + down(gelu(up(h)))                                      h = rms_norm(x)
    logits = rms_norm(x) @ embed^T                             # float32 [B, S, 256]

`rms_norm(x) = x / sqrt(mean(x**2) + eps) * scale`, computed in float32 (a
learned `scale` per feature). q, k and v are one projection of h (`qkv`, its kernel
[d, heads, 3, head_dim]): one GEMM, and in FP8 one cast of h and of the kernel. The
norms and the GELU are fp8jax's (`fp8jax.ops.rms_norm`, `fp8jax.ops.gelu`), whose
backward keeps their input alone (autodiff keeps float32 intermediates). The MLP width
is d_ff = 4 d and its GELU is the tanh approximation (with `GptConfig.experts` = E, a dropless mixture of E such
MLPs, each token routed to `top_k` of them: `fp8jax.models.gpt_moe`). The output
projection is tied to the input embedding: the embedding table [256, d] is its
kernel. Parameters are float32; activations, the residual stream included, are
bfloat16.

FP8 (`recipe` given): the qkv and attention-output projections are
`fp8jax.flax.linen.Fp8DenseGeneral`, the MLP is one `fp8jax.flax.linen_mlp.Fp8Mlp`
(both projections and the GELU, done by their casts; two `Fp8Dense` where a projection
stays in bf16); under delayed and current scaling the qkv projection is
`fp8jax.flax.linen_qkv.Fp8NormQkvRope` (the same variables; its gradient cast reads dq,
dk, dv as attention returns them) and each norm is made by the
FP8 cast of the projection after it (`norm_scale=`, `fp8jax.fp8_rms_norm_dense`; the MLP's
together with the residual add before it, `Fp8Mlp(residual=)`) and never written in bf16
(current scaling first reduces each cast function's amax from its inputs);
the tied output projection is an `fp8jax.fp8_einsum` on the embedding table with its own
`DotMeta`, and attention is `fp8jax.fp8_attention` with an `AttentionMeta` where its
backend computes in FP8
(`GptConfig.fp8_attention`; `runs_fp8_attention`). With `recipe=None`
the same places run `nn.DenseGeneral` / `nn.Dense`, `jnp.einsum` and
`fp8jax.attention`, under the same parameter names and shapes, so parameters
move freely between the two (a bf16 checkpoint loads into the FP8 model).
`GptConfig.fp8_layers="auto"` keeps in bf16 the projections where the cost model
predicts FP8 slower (`fp8jax.models.gpt_fp8_layers`); their state is then absent.

The "fp8_meta" collection follows `fp8jax.flax.linen`'s conventions:

    {"blocks": {"attention": {"qkv"|"out": {"dot_meta": DotMeta},
                              "attention_meta": AttentionMeta},
                "mlp": {"up"|"down": {"dot_meta": DotMeta}}},
     "head": {"dot_meta": DotMeta}}

(with `GptConfig.experts`, "mlp" holds "w_in_meta" and "w_out_meta" instead, the
`RaggedDotMeta`s of the mixture of experts of `fp8jax.models.gpt_moe`), where every
array under "blocks" has a leading axis of n_layers (each layer
owns its state; `nn.scan` slices it). Apply with `mutable=["fp8_meta"]` to
record amaxes (training, with `fp8jax.value_and_grad`); without it the stored
scales are used and nothing is recorded (evaluation).

Initialization (GPT-2): every embedding and projection kernel is drawn from
normal(0, 0.02); the two residual projections of each block (attention "out",
MLP "down") from normal(0, 0.02 / sqrt(2 n_layers)), so that the residual
stream's variance does not grow with depth (2 n_layers residual additions).
RMSNorm scales start at 1.

Sizes (`SIZES`; parameters = 256 d + n_layers (12 d^2 + 2 d) + d, the
embedding counted once since it is tied):

    name   d_model  layers  heads  head_dim  seq_len  parameters
    tiny       128       4      2        64      128     820,352
    small      384       6      6        64      256  10,720,128
    125m       768      12     12        64     1024  85,150,464
    350m      1024      24     16        64     1024  302,302,208
    1b        2048      24     16       128     2048  1,208,584,192

"125m" and "350m" name the GPT-2 / GPT-3 shapes they borrow; with a 256-byte
vocabulary the embedding is small, so they hold fewer parameters than their
names. Every head_dim is one the fused attention kernels support (64, 128, 256).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from fp8jax.core.meta import init_attention_meta
from fp8jax.core.recipes import Recipe, check_recipe
from fp8jax.flax.linen import (FP8_COLLECTION, Fp8Dense, Fp8DenseGeneral, dot_meta_variable,
                               fp8_variable, read_meta, store_dot_meta)
from fp8jax.flax.linen_mlp import Fp8Mlp
from fp8jax.flax.linen_qkv import Fp8NormQkvRope
from fp8jax.flax.linen_stacked import layer_weights
from fp8jax.models import gpt_fp8_layers, gpt_moe, gpt_weights
from fp8jax.ops.attention import attention, choose_backend, fp8_attention
from fp8jax.ops.attention_backend import BACKENDS, DEQUANTIZING_FP8_BACKENDS, BackendChoice
from fp8jax.ops import fused_kernels, saved_activations
from fp8jax.ops.dot import prologue_path
from fp8jax.ops.einsum import fp8_einsum
from fp8jax.ops.gelu import gelu
from fp8jax.ops.rms_norm import add_rms_norm, rms_norm
from fp8jax.ops.rotary import rope, split_qkv_rope  # rope: part of this module's API
from fp8jax.telemetry import TELEMETRY_COLLECTION

SAVED_ACTIVATIONS = ("default", "fp8")
ACTIVATION_DTYPE = jnp.bfloat16
PARAM_DTYPE = jnp.float32
#: Token ids are bytes: 256 of them.
VOCAB_SIZE = 256


@dataclasses.dataclass(frozen=True)
class GptConfig:
  """The shape and knobs of a `Gpt` (frozen and hashable: safe as a static `jit` argument).

  Attributes:
    d_model: width of the residual stream.
    n_layers: transformer blocks.
    n_heads: attention heads; head_dim = d_model // n_heads (even, for RoPE).
    seq_len: the longest sequence the model takes (the training length; RoPE
      itself has no limit, but it is not trained beyond it).
    vocab_size: token ids are in [0, vocab_size); 256 for bytes.
    mlp_ratio: d_ff = mlp_ratio * d_model.
    rope_base: RoPE's base b: pair i of a head rotates by position * b**(-2i / head_dim).
    norm_eps: RMSNorm's epsilon.
    init_std: standard deviation of the embedding and projection initializers.
    remat: recompute each block's activations in the backward pass (`nn.remat`),
      trading compute for memory.
    scan_unroll: blocks per iteration of the `nn.scan` loop; None (the default)
      unrolls it fully. Parameters and FP8 state stay stacked either way (one array
      per weight over the layers, which the optimizer updates in few kernels). A
      rolled loop costs a train step much more than its compile time saves: it
      zero-fills a stacked buffer for every activation the backward keeps, copies
      each layer's into it and slices it back out, and its kernels are launched one
      at a time (the 350m step, batch 8 x 1024, on an H100 by `fp8jax cost`: bf16
      71 ms rolled against 36 ms unrolled). On XLA:CPU the tiny model's train step
      (batch 16 x 128, a 2-core CPU) takes 349 ms in FP8 and 192 ms in bf16 rolled,
      220 and 149 ms unrolled.
    fp8_attention: with a recipe, run attention in FP8 (`fp8jax.fp8_attention`) where
      the backend chosen for it computes in FP8 (an FP8 kernel; on a CPU, XLA's
      emulation of one). Where it would only dequantize the FP8 inputs into a bf16
      kernel (on Hopper today: cuDNN's bf16 attention is faster than every validated
      FP8 kernel), the block runs that bf16 attention itself, without the passes that
      quantize q, k, v and record their amaxes (1.8 ms of the 350m step); its
      AttentionMeta is kept but not updated (`runs_fp8_attention` says which).
      False keeps attention in bf16 (`fp8jax.attention`) beside the FP8 projections.
    attention_backend: force an attention backend ("pallas", "xla", ...; see
      `fp8jax.ops.attention_backend`); None lets fp8jax choose for the compile target.
    saved_activations: what the backward keeps of the non-GEMM ops. "default": their
      inputs in bf16 (each RMSNorm's, 2 bytes per feature; the GELU's, 2 bytes per d_ff
      element; attention's output). "fp8": those inputs in E4M3 with one
      scale per 1 x 128 group (`fp8jax.ops.saved_activations`): RMSNorm
      (`fp8jax.ops.rms_norm`, the residual add fused into the MLP's norm), GELU
      (`fp8jax.ops.gelu`) and, on the fused FP8 attention kernels, attention's output.
      With `remat`, the blocks keep exactly these FP8 copies
      (`fp8jax.ops.saved_activations.policy()`).
    experts: 0 for the dense MLP; E >= 1 makes each block's MLP a dropless mixture of E
      experts, each d_ff wide (`fp8jax.models.gpt_moe`; FP8 expert GEMMs under a recipe).
    top_k: with experts, the experts each token is routed to (1 <= top_k <= experts).
    aux_loss_weight: with experts, the weight of the load-balancing loss (summed over the
      layers) in the training objective (`gpt_moe.load_balancing_loss`).
    fp8_layers: with a recipe, which projections run in FP8: "all" (the default), or
      "auto", those where the cost model predicts FP8 no slower than bf16 (the default
      layer filter's choice; `fp8jax.models.gpt_fp8_layers`), the others in bf16.
    cast_weights_first: with a delayed- or current-scaling recipe, cast every layer's FP8
      weights when the step starts, one launch per projection (and under current scaling
      one amax reduction of the stack), instead of layer by layer in the loop
      (`fp8jax.models.gpt_weights`): the same numbers, 192 launches fewer a 350m step
      under delayed scaling, 368 under current scaling.
  """

  d_model: int
  n_layers: int
  n_heads: int
  seq_len: int
  vocab_size: int = VOCAB_SIZE
  mlp_ratio: int = 4
  rope_base: float = 10000.0
  norm_eps: float = 1e-6
  init_std: float = 0.02
  remat: bool = False
  scan_unroll: int | None = None
  fp8_attention: bool = True
  attention_backend: str | None = None
  saved_activations: str = "default"
  experts: int = 0
  top_k: int = 2
  aux_loss_weight: float = 0.01
  fp8_layers: str = "all"
  cast_weights_first: bool = True

  def __post_init__(self):
    for field in ("d_model", "n_layers", "n_heads", "seq_len", "vocab_size", "mlp_ratio",
                  "scan_unroll"):
      value = getattr(self, field)
      if field == "scan_unroll" and value is None:
        continue
      if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"GptConfig.{field}={value!r}: expected a positive int"
                         + (" or None (fully unrolled)." if field == "scan_unroll" else "."))
    if self.d_model % self.n_heads or (self.d_model // self.n_heads) % 2:
      raise ValueError(
          f"GptConfig: d_model={self.d_model} must split into n_heads={self.n_heads} heads "
          "of an even head_dim (RoPE rotates pairs of features); change d_model or n_heads.")
    if self.saved_activations not in SAVED_ACTIVATIONS:
      raise ValueError(f"GptConfig.saved_activations={self.saved_activations!r} is not one of "
                       f"{SAVED_ACTIVATIONS}.")
    if self.attention_backend is not None and self.attention_backend not in BACKENDS:
      raise ValueError(f"GptConfig.attention_backend={self.attention_backend!r} is not one of "
                       f"{BACKENDS} (or None to let fp8jax choose).")
    if not isinstance(self.cast_weights_first, bool):
      raise ValueError(f"GptConfig.cast_weights_first={self.cast_weights_first!r}: expected "
                       "True or False.")
    gpt_moe.check_fields(self.experts, self.top_k, self.aux_loss_weight)
    gpt_fp8_layers.check_fp8_layers(self.fp8_layers)

  @property
  def head_dim(self) -> int:
    return self.d_model // self.n_heads

  @property
  def d_ff(self) -> int:
    return self.mlp_ratio * self.d_model

  @property
  def fp8_saved(self) -> bool:
    """Whether the backward keeps the norm, GELU and attention-output inputs in FP8."""
    return self.saved_activations == "fp8"


#: The demo sizes by name: `config_for(name)`.
SIZES: dict[str, GptConfig] = {
    # tiny: the CPU demo size. Measured on 2 shared CPU cores (jax 0.10.2, batch
    # 16 x 128, jitted adamw train step, median after compile): 138 ms per step in
    # bf16, 172 ms in FP8 (delayed scaling), 174 ms (current): 300 steps take 40-50 s.
    "tiny": GptConfig(d_model=128, n_layers=4, n_heads=2, seq_len=128),
    "small": GptConfig(d_model=384, n_layers=6, n_heads=6, seq_len=256),
    "125m": GptConfig(d_model=768, n_layers=12, n_heads=12, seq_len=1024),
    "350m": GptConfig(d_model=1024, n_layers=24, n_heads=16, seq_len=1024),
    "1b": GptConfig(d_model=2048, n_layers=24, n_heads=16, seq_len=2048),
}


def config_for(size: str, **overrides: Any) -> GptConfig:
  """The `GptConfig` of a named size, with fields overridden (e.g. `seq_len=128`).

  Raises:
    ValueError: an unknown size or field.
  """
  if size not in SIZES:
    raise ValueError(f"size={size!r} is not a known GPT size; choose one of {sorted(SIZES)} "
                     f"(in order: {', '.join(SIZES)}).")
  fields = {f.name for f in dataclasses.fields(GptConfig)}
  unknown = sorted(set(overrides) - fields)
  if unknown:
    raise ValueError(f"config_for({size!r}, ...): unknown GptConfig field(s) {unknown}; "
                     f"the fields are {sorted(fields)}.")
  return dataclasses.replace(SIZES[size], **overrides)


def parameter_count(config: GptConfig) -> int:
  """Number of parameters: embedding (tied, counted once), blocks, final norm (with
  experts, all of them: `gpt_moe.mlp_parameters`)."""
  d = config.d_model
  per_block = 4 * d * d + gpt_moe.mlp_parameters(config) + 2 * d  # qkv, out; MLP; norms
  return config.vocab_size * d + config.n_layers * per_block + d


def attention_backend(config: GptConfig, recipe: Recipe | None, batch_size: int,
                      seq_len: int) -> str:
  """The attention backend `Gpt(config, recipe)` runs for [batch_size, seq_len].

  It is the selection fp8jax's attention makes for the model's q, k, v (same
  static key: compile target, bf16, head_dim, causal mask, recipe type), so it names
  what the model's jitted step really uses: "xla" on a CPU; on a GPU "pallas"
  (or "pallas_hopper_fp8" / "cudnn") as `fp8jax.ops.attention_backend` explains;
  under `jax.set_mesh` of deviceless H100s, what an H100 runs (`attention_choice`
  says when a kernel stands in for cuDNN there).
  """
  return attention_choice(config, recipe, batch_size, seq_len).name


def attention_choice(config: GptConfig, recipe: Recipe | None, batch_size: int,
                     seq_len: int) -> BackendChoice:
  """`attention_backend`'s choice with its reason.

  Returns:
    The `fp8jax.ops.attention_backend.BackendChoice`: its `name`, and its `reason` (None
    on the fast path; under a deviceless compile, e.g. that a kernel stands in for cuDNN).
  """
  fp8 = recipe is not None and config.fp8_attention
  qkv = jax.ShapeDtypeStruct((batch_size, seq_len, config.n_heads, config.head_dim),
                             ACTIVATION_DTYPE)
  return choose_backend(qkv, qkv, fp8=fp8, causal=True, has_segments=False,
                        recipe=recipe if fp8 else None, backend=config.attention_backend)


def runs_fp8_attention(config: GptConfig, recipe: Recipe | None, batch_size: int,
                       seq_len: int) -> bool:
  """Whether `Gpt(config, recipe)`'s attention computes in FP8 for [batch_size, seq_len].

  Returns:
    True when FP8 attention is asked for and its backend is not one that dequantizes
    FP8 inputs into a bf16 kernel (see `GptConfig.fp8_attention`).
  """
  if recipe is None or not config.fp8_attention:
    return False
  choice = attention_choice(config, recipe, batch_size, seq_len)
  return choice.name not in DEQUANTIZING_FP8_BACKENDS


class RMSNorm(nn.Module):
  """`x / sqrt(mean(x**2, -1) + eps) * scale` in float32, returned in `out_dtype`.

  Called with `delta`, the residual add before it: `(x + delta, rms_norm(x + delta))`.
  `save_fp8`: the backward keeps the normalized input in FP8 (`fp8jax.ops.rms_norm`).
  """

  eps: float
  out_dtype: Any = ACTIVATION_DTYPE
  save_fp8: bool = False

  # The FP8 projection after the norm normalizes (its cast does, `fp8jax.ops.norm_dense`):
  # the call returns the gain alone and normalizes nothing.
  in_projection: bool = False

  @nn.compact
  def __call__(self, x: jax.Array, delta: jax.Array | None = None):
    scale = self.param("scale", nn.initializers.ones_init(), (x.shape[-1],), PARAM_DTYPE)
    if self.in_projection:
      return scale
    options = dict(eps=self.eps, out_dtype=self.out_dtype, save_fp8=self.save_fp8)
    if delta is None:
      return rms_norm(x, scale, **options)
    return add_rms_norm(x, delta, scale, **options)


def _dense_general(recipe: Recipe | None, features, *, std: float, axis=-1, name: str):
  """A bias-free projection: FP8 under a recipe, plain Flax otherwise; same params either way."""
  kwargs = dict(features=features, axis=axis, use_bias=False, dtype=ACTIVATION_DTYPE,
                param_dtype=PARAM_DTYPE, kernel_init=nn.initializers.normal(std), name=name)
  if recipe is None:
    return nn.DenseGeneral(**kwargs)
  return Fp8DenseGeneral(recipe=recipe, **kwargs)


def _dense(recipe: Recipe | None, features: int, *, std: float, name: str):
  kwargs = dict(features=features, use_bias=False, dtype=ACTIVATION_DTYPE,
                param_dtype=PARAM_DTYPE, kernel_init=nn.initializers.normal(std), name=name)
  if recipe is None:
    return nn.Dense(**kwargs)
  return Fp8Dense(recipe=recipe, **kwargs)


def _norm_in_cast(config: GptConfig, recipe: Recipe | None, projection: str) -> bool:
  """Whether the norm before `projection` ("qkv", or "up" of the fused MLP) is made by its
  FP8 cast (`fp8jax.ops.norm_dense`): where it reads its input in FP8 under delayed or
  current scaling. Saves the norm's bf16 output and the pass writing it (both norms of
  the 350m step: 48 launches and 0.7 ms, deviceless H100)."""
  recipe = _projection_recipe(config, recipe, projection)
  return recipe is not None and prologue_path(recipe)


# The recipe of one projection under GptConfig.fp8_layers (None: bf16).
_projection_recipe = gpt_fp8_layers.projection_recipe


def _residual_std(config: GptConfig) -> float:
  return config.init_std / math.sqrt(2 * config.n_layers)


class CausalSelfAttention(nn.Module):
  """The qkv projection, RoPE on q and k, causal attention, output projection.

  Not `Fp8MultiHeadAttention`: RoPE has to act between the projection and the
  attention. The state follows that layer's conventions (a `DotMeta` per
  projection, an `AttentionMeta` named "attention_meta").
  """

  config: GptConfig
  recipe: Recipe | None = None

  @nn.compact
  def __call__(self, x: jax.Array, norm: dict | None = None) -> jax.Array:
    """x [batch, seq, d_model] -> [batch, seq, d_model], bf16; `norm`: the norm the qkv
    projection's cast applies to x (`_apply_norm`)."""
    c, recipe = self.config, self.recipe
    # One projection reads h once (in FP8: one cast of h and of the kernel, one GEMM).
    # Heads outermost in its features (kernel [d, heads, 3, head_dim]), so that heads
    # split over a tensor-parallel axis stay whole blocks of the flattened GEMM.
    qkv_recipe = _projection_recipe(c, recipe, "qkv")
    if norm is not None:  # only under an FP8 recipe (`_norm_in_cast`)
      # The norm made by the cast, and dq, dk, dv cast by the backward without a pass
      # that stacks them (`fp8jax.ops.norm_qkv_rope`).
      q, k, v = Fp8NormQkvRope(c.n_heads, c.head_dim, c.rope_base, qkv_recipe,
                               dtype=ACTIVATION_DTYPE, param_dtype=PARAM_DTYPE,
                               kernel_init=nn.initializers.normal(c.init_std),
                               name="qkv")(x, **norm)
    else:
      qkv = _dense_general(qkv_recipe, (c.n_heads, 3, c.head_dim), std=c.init_std,
                           name="qkv")(x)
      q, k, v = split_qkv_rope(qkv, c.rope_base)
    if recipe is not None and c.fp8_attention:
      # The state exists whichever attention runs, so the tree is the same on every target.
      variable = fp8_variable(self, "attention_meta", init_attention_meta, recipe)
    if runs_fp8_attention(c, recipe, x.shape[0], x.shape[1]):
      out, new_meta = fp8_attention(q, k, v, read_meta(self, variable), causal=True,
                                    backend=c.attention_backend, save_output_fp8=c.fp8_saved)
      store_dot_meta(self, variable, new_meta)
    else:
      out = attention(q, k, v, causal=True, backend=c.attention_backend)
    return _dense_general(_projection_recipe(c, recipe, "out"), c.d_model, axis=(-2, -1),
                          std=_residual_std(c), name="out")(out)


class Mlp(nn.Module):
  """`down(gelu(up(x)))` with d_ff = mlp_ratio * d_model, bias-free.

  The block's MLP (under the name "mlp") where a projection is in bf16 (`fp8_layers`);
  otherwise `Block` builds `Fp8Mlp`, with the same variables (the GELU fused into its
  casts where the recipe allows, `fp8jax.fp8_mlp`).
  """

  config: GptConfig
  recipe: Recipe | None = None

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    c = self.config
    h = _dense(_projection_recipe(c, self.recipe, "up"), c.d_ff, std=c.init_std, name="up")(x)
    h = gelu(h, save_fp8=c.fp8_saved)
    return _dense(_projection_recipe(c, self.recipe, "down"), c.d_model,
                  std=_residual_std(c), name="down")(h)


class Block(nn.Module):
  """One pre-norm transformer block; `(x, weights) -> (x, None)` for `nn.scan`, `weights`
  its layer's FP8 weights cast before the loop (`fp8jax.models.gpt_weights`) or None."""

  config: GptConfig
  recipe: Recipe | None = None

  @nn.compact
  def __call__(self, x: jax.Array, weights: dict | None) -> tuple[jax.Array, None]:
    with layer_weights(self, weights):  # its FP8 projections take their layer's copies
      return self._sublayers(x), None

  def _sublayers(self, x: jax.Array) -> jax.Array:
    c, recipe = self.config, self.recipe
    # Both MLP projections and the GELU as one op, the GELU done by the FP8 casts.
    fused_mlp = not c.experts and None not in {
        _projection_recipe(c, recipe, name) for name in ("up", "down")}
    norm = lambda name, in_cast: RMSNorm(c.norm_eps, save_fp8=c.fp8_saved,
                                         in_projection=in_cast, name=name)
    _, h, fused = _apply_norm(norm("attention_norm", _norm_in_cast(c, recipe, "qkv")), c, x)
    attended = CausalSelfAttention(c, recipe, name="attention")(h, fused)
    if fused_mlp and _norm_in_cast(c, recipe, "up"):
      # The whole MLP sublayer, x + attended + mlp(norm(x + attended)), as one op.
      *_, fused = _apply_norm(norm("mlp_norm", True), c, x)
      return _fp8_mlp(c, recipe, x, residual=attended, **fused)
    x, h, _ = _apply_norm(norm("mlp_norm", False), c, x, attended)
    if c.experts:  # the router and the expert GEMMs read h itself
      return x + gpt_moe.moe_mlp(c, recipe, dtype=ACTIVATION_DTYPE,
                                 param_dtype=PARAM_DTYPE, output_std=_residual_std(c),
                                 name="mlp")(h)
    if not fused_mlp:
      return x + Mlp(c, recipe, name="mlp")(h)
    return x + _fp8_mlp(c, recipe, h)


def _apply_norm(norm: RMSNorm, config: GptConfig, x: jax.Array, delta: jax.Array | None = None):
  """A block's norm of x (x + delta with delta) for the projection after it.

  Returns:
    (s, h, fused): the residual stream (x + delta, or x), the projection's input, and the
    norm the projection's cast applies to h (its `norm_*` arguments, `norm.in_projection`;
    else None: h is normalized).
  """
  if norm.in_projection:
    if delta is not None:  # the MLP sublayer takes its residual itself (`Fp8Mlp`)
      raise ValueError("a norm made by the projection's cast adds no delta here.")
    return x, x, dict(norm_scale=norm(x), norm_eps=config.norm_eps,
                      norm_save_fp8=config.fp8_saved)
  if delta is None:
    return x, norm(x), None
  s, h = norm(x, delta)
  return s, h, None


def _fp8_mlp(config: GptConfig, recipe: Recipe, h: jax.Array, **norm) -> jax.Array:
  """The block's MLP as one op (`Fp8Mlp`, named "mlp"), the GELU done by the casts; `norm`:
  the norm its up projection's cast applies to h and the residual added before it
  (`Fp8Mlp`'s norm_* and residual arguments)."""
  c = config
  return Fp8Mlp(c.d_ff, recipe=recipe, dtype=ACTIVATION_DTYPE,
                param_dtype=PARAM_DTYPE, kernel_init=nn.initializers.normal(c.init_std),
                output_kernel_init=nn.initializers.normal(_residual_std(c)),
                save_fp8=c.fp8_saved, name="mlp")(h, **norm)


class TiedOutput(nn.Module):
  """The FP8 output projection `h @ table^T` on the (tied) embedding table, with its own DotMeta."""

  recipe: Recipe

  @nn.compact
  def __call__(self, h: jax.Array, table: jax.Array) -> jax.Array:
    variable = dot_meta_variable(self, self.recipe)
    # table.T makes it a plain [d, vocab] matrix product, the form of fp8jax's lean
    # FP8 GEMM path (a kernel contracted on its last axis would take the general path).
    logits, new_meta = fp8_einsum("bsd,dv->bsv", h, table.T, read_meta(self, variable))
    store_dot_meta(self, variable, new_meta)
    return logits


class Gpt(nn.Module):
  """The decoder-only transformer: int tokens [batch, seq] -> float32 logits [batch, seq, vocab].

  Attributes:
    config: the model's `GptConfig` (see `SIZES`, `config_for`).
    recipe: an fp8jax recipe (`DelayedScaling()`, `CurrentScaling()`) for the FP8
      model, or None for its bf16 twin (no "fp8_meta" collection).
  """

  config: GptConfig
  recipe: Recipe | None = None

  @nn.compact
  def __call__(self, tokens: jax.Array) -> jax.Array:
    """tokens: int [batch, seq] in [0, vocab_size), seq <= config.seq_len.

    Returns:
      float32 logits [batch, seq, vocab_size]; position t sees tokens 0..t only.
      The logits GEMM accumulates and is written in float32 (in FP8 its inputs
      are E4M3, in bf16 they are bf16).
    """
    c, recipe = self.config, self.recipe
    if recipe is not None:
      check_recipe(recipe, "recipe")
      gpt_fp8_layers.warn_if_no_projection_in_fp8(c, recipe)
    _check_tokens(tokens, c)
    embed = nn.Embed(c.vocab_size, c.d_model, dtype=ACTIVATION_DTYPE, param_dtype=PARAM_DTYPE,
                     embedding_init=nn.initializers.normal(c.init_std), name="embed")
    x = embed(tokens)
    # With FP8 saved activations, remat keeps exactly those (and recomputes the rest).
    policy = saved_activations.policy() if c.fp8_saved else None
    block = nn.remat(Block, prevent_cse=False, policy=policy) if c.remat else Block
    # Telemetry (`fp8jax.flax.linen_telemetry`) and the MoE layers' load-balancing losses
    # are sown per layer, stacked like the state.
    blocks = nn.scan(block, variable_axes={"params": 0, FP8_COLLECTION: 0,
                                           TELEMETRY_COLLECTION: 0,
                                           gpt_moe.AUX_COLLECTION: 0},
                     split_rngs={"params": True}, length=c.n_layers,
                     unroll=min(c.scan_unroll or c.n_layers, c.n_layers))
    # Every layer's FP8 weights, cast before the loop (None: each block casts its own).
    weights = gpt_weights.cast_before_loop(self, c, recipe)
    with fused_kernels.stacked_state():  # the blocks' FP8 state is sliced from a stack
      x, _ = blocks(c, recipe, name="blocks")(x, weights)
    h = RMSNorm(c.norm_eps, out_dtype=jnp.float32, save_fp8=c.fp8_saved, name="final_norm")(x)
    table = embed.embedding
    if _projection_recipe(c, recipe, "head") is None:
      return jnp.einsum("bsd,vd->bsv", h.astype(ACTIVATION_DTYPE),
                        table.astype(ACTIVATION_DTYPE), preferred_element_type=jnp.float32)
    return TiedOutput(recipe, name="head")(h, table)


def _check_tokens(tokens, config: GptConfig) -> None:
  dtype = jnp.result_type(tokens)
  if not jnp.issubdtype(dtype, jnp.integer):
    raise TypeError(f"tokens has dtype {dtype}; Gpt takes integer token ids (e.g. "
                    "tokens.astype(jnp.int32)).")
  if jnp.ndim(tokens) != 2:
    raise ValueError(f"tokens must be [batch, seq]; got shape {jnp.shape(tokens)}.")
  if jnp.shape(tokens)[1] > config.seq_len:
    raise ValueError(
        f"tokens has {jnp.shape(tokens)[1]} positions but config.seq_len={config.seq_len}; "
        "make the config with config_for(size, seq_len=...) for longer sequences.")
