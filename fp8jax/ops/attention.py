"""Attention: fused flash attention in bf16, and in FP8 with explicit `AttentionMeta`.

    out = attention(q, k, v, causal=True)                         # bf16/f16/f32
    out, meta = fp8_attention(q, k, v, meta, causal=True)         # FP8 q, k, v and P

Layout [batch, seq, heads, head_dim]; k and v may have fewer heads than q
(grouped-query / multi-query attention).

Semantics, the same on every backend:
  * Segment ids: query i attends to key j only if q_segment_ids[b, i] ==
    kv_segment_ids[b, j] (padding: give padded tokens an id of their own).
  * Causal masks are aligned bottom-right, as in FlashAttention >= 2.1: query i
    attends to keys j <= i + (kv_len - q_len), so the last query sees every key
    (decoding with a KV cache). For q_len == kv_len this is j <= i.
  * A query row that sees no key (all keys masked by segment ids or causality,
    e.g. the first q_len - kv_len rows of a causal call with q_len > kv_len)
    outputs 0 and passes no gradient: its dq row is 0 and it adds nothing to dk
    or dv.

FP8 (`fp8_attention`): q, k, v are quantized to E4M3 with their roles' scales
(delayed or current, as the recipe says), or with one current scale per 128 rows of
each head (`block_scales`), optionally after turning q and k by a random orthogonal
matrix (`rotate`, `fp8jax.ops.attention_rotation`); the kernel multiplies the descales
back in, quantizes the softmax probabilities P to E4M3 with a fixed scale for
the P.V product, and returns a bf16 output and max|O|. The forward records the
amaxes of q, k, v and o in the returned meta; the backward records the output
gradient's amax in the meta's cotangent (role `grad`), as `fp8jax.fp8_dot_general`
does, so `fp8jax.value_and_grad` threads it the same way. The backward is
straight-through: exact-attention gradients at the dequantized q, k, v. The
"xla" FP8 path does the Pallas kernel's arithmetic, E4M3 rounding of P
included (`pallas_kernels.fp8_forward_reference`), so the two
agree up to float32 summation order (on a GPU also up to the kernel's
approximate exp2, which can move a probability across an E4M3 rounding edge).

The backend is chosen once per static configuration by
`fp8jax.ops.attention_backend.select_backend`; off the fast path it warns once.
The FP8 state is `fp8jax.core.meta.AttentionMeta`.
"""
from __future__ import annotations

import dataclasses
import functools
import warnings

import jax
import jax.numpy as jnp

import pallas_kernels
from fp8jax.core.meta import (AttentionMeta, amaxes_unbatched_like, check_attention_meta,
                              record_amax)
from fp8jax.core.quantize import amax
from fp8jax.core.recipes import Recipe
from fp8jax.core.validation import check_floating
from fp8jax.mesh.axes import inside_shard_map
from fp8jax.mesh.explicit import is_explicitly_sharded
from fp8jax.mesh.partitioning import shard_local_attention, vmapped_as
from fp8jax.mesh.target import compile_target
from fp8jax.ops.attention_backend import (DEQUANTIZING_FP8_BACKENDS, BackendChoice, make_key,
                                          select_backend, tuned_block_sizes)
from fp8jax.ops.cast import quantize_with_meta
from fp8jax.ops import attention_rotation, saved_activations
from fp8jax.ops.guards import check_threaded, refuse_split_state, reverse_mode_only


@dataclasses.dataclass(frozen=True)
class _Call:
  """Static configuration of one attention call (hashable: a custom_vjp nondiff arg)."""

  backend: str
  causal: bool
  sm_scale: float | None
  # Pallas interpreter: None decides by the default backend (CPU -> interpret);
  # False compiles the kernels for a GPU, also from a CPU process (deviceless).
  interpret: bool | None = None
  # Keep the output for the backward kernel in FP8 (1 x head_dim groups) instead of bf16.
  save_output_fp8: bool = False
  # FP8: one current scale per 128 rows of each head (else the roles' per-tensor scales).
  block_scales: bool = False
  # FP8: q and k turned by `attention_rotation.rotate` before they are quantized.
  rotate: bool = False
  # The Hopper kernels' tiles: the tuned ones for this GPU (`_hopper_blocks`) or None for
  # the kernels' defaults.
  hopper_blocks: pallas_kernels.HopperAttentionBlockSizes | None = None

  @property
  def block_sizes(self) -> pallas_kernels.HopperAttentionBlockSizes:
    return self.hopper_blocks or pallas_kernels.HopperAttentionBlockSizes()


def _hopper_blocks(backend: str, causal: bool, head_dim: int):
  """The tuned tiles of a Hopper backend on the compile target's GPU, or None."""
  if not backend.startswith("pallas_hopper"):
    return None
  precision = "fp8" if backend == "pallas_hopper_fp8" else "bf16"
  tuned = tuned_block_sizes(compile_target().gpu_arch, precision, causal, head_dim)
  return pallas_kernels.HopperAttentionBlockSizes(**tuned) if tuned else None


def _interpret() -> bool | None:
  """The Pallas kernels' interpret flag: never when compiling for a GPU (also from a
  CPU process, deviceless); otherwise (None) the kernels decide by the platform."""
  return False if compile_target().platform == "gpu" else None


def choose_backend(q, k, *, fp8: bool, causal: bool, has_segments: bool,
                   recipe: Recipe | None = None, backend: str | None = None,
                   block_scales: bool = False) -> BackendChoice:
  """The backend `attention` / `fp8_attention` will use for these arguments.

  Selection sees the compile target (`fp8jax.mesh.target.compile_target`): under
  `jax.set_mesh` of deviceless H100s it is what an H100 runs. On an explicit-axis mesh only "xla" runs: the kernels' Pallas calls take
  unsharded types only. Asked for another backend there, raises ValueError.
  """
  explicit = is_explicitly_sharded(q, k)
  if explicit and backend not in (None, "xla"):
    raise ValueError(
        f"backend={backend!r}: the attention kernels do not run on arrays sharded over an "
        f"explicit-axis mesh (q {jax.typeof(q)}). Pass backend='xla' (or None) there, or make "
        "the mesh with jax.sharding.AxisType.Auto axes, where each device runs the kernel on "
        "its batch rows and heads.")
  # The compile target's platform (`fp8jax.mesh.target`): a deviceless compile for an
  # H100 selects what the H100 runs, not what this process's CPU would.
  target = compile_target()
  key = make_key(q.shape, k.shape, jnp.dtype(q.dtype).name, fp8=fp8, causal=causal,
                 has_segments=has_segments,
                 recipe_type=type(recipe).__name__ if recipe is not None else None,
                 platform=target.platform, gpu_arch=target.gpu_arch,
                 compile_only=target.compile_only, block_scaled=block_scales)
  choice = select_backend(key, backend)
  if explicit and choice.name != "xla":
    reason = (f"the {choice.name!r} kernel does not run on arrays sharded over an "
              "explicit-axis mesh; make the mesh with AxisType.Auto axes to use it")
    warnings.warn(f"fp8jax attention uses the 'xla' backend: {reason}.", stacklevel=3)
    return BackendChoice("xla", reason)
  return choice


def _check_qkv(q, k, v, q_segment_ids, kv_segment_ids):
  for name, x in (("q", q), ("k", k), ("v", v)):
    check_floating(x, name)
    if x.ndim != 4:
      raise ValueError(f"{name} must be [batch, seq, heads, head_dim]; got shape {x.shape}.")
  if not q.dtype == k.dtype == v.dtype:
    raise TypeError(f"q, k and v must share a dtype; got {q.dtype}, {k.dtype} and {v.dtype}.")
  if k.shape != v.shape:
    raise ValueError(f"k and v must have the same shape; got {k.shape} and {v.shape}.")
  if k.shape[0] != q.shape[0] or k.shape[3] != q.shape[3]:
    raise ValueError(f"k {k.shape} must share batch and head_dim with q {q.shape}.")
  if q.shape[2] % k.shape[2]:
    raise ValueError(f"q's {q.shape[2]} heads must be a multiple of k's {k.shape[2]} heads.")
  if (q_segment_ids is None) != (kv_segment_ids is None):
    raise ValueError("pass both q_segment_ids and kv_segment_ids, or neither.")
  if q_segment_ids is not None:
    for name, ids, x in (("q_segment_ids", q_segment_ids, q),
                         ("kv_segment_ids", kv_segment_ids, k)):
      if jnp.shape(ids) != x.shape[:2]:
        raise ValueError(f"{name} must have shape [batch, seq] = {x.shape[:2]}; "
                         f"got {jnp.shape(ids)}.")


def attention(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool = False,
              q_segment_ids: jax.Array | None = None, kv_segment_ids: jax.Array | None = None,
              sm_scale: float | None = None, backend: str | None = None) -> jax.Array:
  """Fused attention in bf16/f16 (f32 inputs are computed in bf16 by the fused kernel).

  Every backend computes the same attention (see the module docstring): segment ids
  and a bottom-right aligned causal mask select the keys each query sees, and a
  query row that sees no key outputs 0 and gets no gradient.

  Args:
    q: [batch, q_len, heads, head_dim]; k, v: [batch, kv_len, kv_heads, head_dim].
    causal: query i attends to keys j <= i + kv_len - q_len (bottom-right aligned).
    q_segment_ids, kv_segment_ids: optional int [batch, seq]; attend within equal ids.
    sm_scale: logit multiplier (default 1/sqrt(head_dim)).
    backend: force "pallas", "pallas_hopper", "cudnn" or "xla"; None chooses.

  Returns:
    [batch, q_len, heads, head_dim] in q's dtype.
  """
  _check_qkv(q, k, v, q_segment_ids, kv_segment_ids)
  choice = choose_backend(q, k, fp8=False, causal=causal,
                          has_segments=q_segment_ids is not None, backend=backend)
  if choice.name in ("pallas", "pallas_hopper"):
    with reverse_mode_only(f"fp8jax.attention with backend {choice.name!r}",
                           "fp8jax.attention with backend='xla'",
                           why="its derivative is the fused kernel's own backward pass"):
      return _bf16_attention(choice.name, q, k, v, causal, q_segment_ids, kv_segment_ids,
                             sm_scale)
  return _bf16_attention(choice.name, q, k, v, causal, q_segment_ids, kv_segment_ids,
                         sm_scale).astype(q.dtype)


def _bf16_attention(backend, q, k, v, causal, q_segment_ids, kv_segment_ids, sm_scale):
  """16-bit attention on one backend ("pallas", "pallas_hopper", "cudnn" or "xla")."""
  if backend in ("pallas", "pallas_hopper"):
    return _fused_bf16_attention(q, k, v, q_segment_ids, kv_segment_ids,
                                 _Call(backend, causal, sm_scale, _interpret(),
                                       hopper_blocks=_hopper_blocks(backend, causal,
                                                                    q.shape[-1])))
  return _xla_like_attention(q, k, v, causal, q_segment_ids, kv_segment_ids, sm_scale,
                             implementation=backend)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _fused_bf16_attention(q, k, v, q_seg, kv_seg, call):
  """A fused 16-bit kernel pair, each pass run on every device's batch rows and heads
  (`fp8jax.mesh.partitioning`), as the FP8 kernels are: XLA would otherwise gather
  q, k and v whole to every device."""
  return _fused_bf16_attention_fwd(q, k, v, q_seg, kv_seg, call)[0]


def _fused_bf16_attention_fwd(q, k, v, q_seg, kv_seg, call):
  if call.backend == "pallas_hopper":
    def kernel(q, k, v, q_seg, kv_seg):  # lse is base 2 here, as the backward takes it
      return pallas_kernels.hopper_bf16_attention_forward(
          q, k, v, causal=call.causal, sm_scale=call.sm_scale, q_segment_ids=q_seg,
          kv_segment_ids=kv_seg, block_sizes=call.block_sizes)
  else:
    def kernel(q, k, v, q_seg, kv_seg):
      result = pallas_kernels.flash_attention_forward(
          q, k, v, q_segment_ids=q_seg, kv_segment_ids=kv_seg, causal=call.causal,
          sm_scale=call.sm_scale, interpret=call.interpret)
      return result.out, result.lse
  out, lse = _per_shard(kernel, ("bshd", "btkd", "btkd", "bs", "bt"), ("bshd", "bhs"))(
      q, k, v, q_seg, kv_seg)
  return out, (q, k, v, out, lse, q_seg, kv_seg)


def _fused_bf16_attention_bwd(call, residuals, g):
  q, k, v, out, lse, q_seg, kv_seg = residuals
  if call.backend == "pallas_hopper":
    def kernel(q, k, v, out, lse, g, q_seg, kv_seg):
      return pallas_kernels.hopper_bf16_attention_backward(
          q, k, v, out, lse, g, causal=call.causal, sm_scale=call.sm_scale,
          q_segment_ids=q_seg, kv_segment_ids=kv_seg, block_sizes=call.block_sizes)
  else:
    def kernel(q, k, v, out, lse, g, q_seg, kv_seg):
      return pallas_kernels.flash_attention_backward(
          q, k, v, out, lse, g, q_segment_ids=q_seg, kv_segment_ids=kv_seg,
          causal=call.causal, sm_scale=call.sm_scale, interpret=call.interpret)
  operands = ("bshd", "btkd", "btkd", "bshd", "bhs", "bshd", "bs", "bt")
  dq, dk, dv = _per_shard(kernel, operands, ("bshd", "btkd", "btkd"))(
      q, k, v, out, lse, g.astype(out.dtype), q_seg, kv_seg)
  # The cotangent's dtype is the output's, which is q's.
  return dq.astype(g.dtype), dk.astype(g.dtype), dv.astype(g.dtype), None, None


_fused_bf16_attention.defvjp(_fused_bf16_attention_fwd, _fused_bf16_attention_bwd)


def _visible_keys(q_len, kv_len, causal, q_segment_ids, kv_segment_ids):
  """Boolean [batch or 1, 1, q_len, kv_len]: which keys each query sees, or None if all."""
  mask = None
  if causal:
    offset = kv_len - q_len  # bottom-right alignment
    mask = (jnp.arange(kv_len)[None, :] <= jnp.arange(q_len)[:, None] + offset)[None, None]
  if q_segment_ids is not None:
    same = q_segment_ids[:, None, :, None] == kv_segment_ids[:, None, None, :]
    mask = same if mask is None else mask & same
  return mask


def _xla_like_attention(q, k, v, causal, q_segment_ids, kv_segment_ids, sm_scale,
                        implementation):
  q_len, kv_len = q.shape[1], k.shape[1]
  # jax's is_causal is aligned top-left (key j <= query i): right for equal lengths
  # only (where cuDNN gets its causal kernel from it); otherwise the mask carries it.
  native_causal = causal and q_len == kv_len
  mask = _visible_keys(q_len, kv_len, causal and not native_causal, q_segment_ids,
                       kv_segment_ids)
  out = jax.nn.dot_product_attention(q, k, v, mask=mask, scale=sm_scale,
                                     is_causal=native_causal, implementation=implementation)
  if q_segment_ids is None and not (causal and q_len > kv_len):
    return out  # every row sees at least one key
  # jax gives a row that sees no key the mean of v; the semantics say 0. The product
  # also zeroes that row's cotangent, hence its dq and its share of dk and dv.
  visible = _visible_keys(q_len, kv_len, causal, q_segment_ids, kv_segment_ids)
  has_key = jnp.any(visible, axis=-1)  # [batch or 1, 1, q_len]
  return out * jnp.moveaxis(has_key, 1, 2)[..., None].astype(out.dtype)


def fp8_attention(q: jax.Array, k: jax.Array, v: jax.Array, meta: AttentionMeta, *,
                  causal: bool = False, q_segment_ids: jax.Array | None = None,
                  kv_segment_ids: jax.Array | None = None, sm_scale: float | None = None,
                  backend: str | None = None, save_output_fp8: bool = False,
                  block_scales: bool | None = None,
                  rotate: bool = False) -> tuple[jax.Array, AttentionMeta]:
  """FP8 fused attention with explicit FP8 state.

  Args:
    q: [batch, q_len, heads, head_dim], bf16/f16/f32 (quantized here with `meta.q`).
    k, v: [batch, kv_len, kv_heads, head_dim] (quantized with `meta.k`, `meta.v`).
    meta: this attention's `AttentionMeta` (from `init_attention_meta(recipe)`).
    causal: as for `attention`: query i attends to keys j <= i + kv_len - q_len
      (bottom-right aligned); a query row that sees no key outputs 0 and gets no gradient.
    q_segment_ids: optional int [batch, q_len], as for `attention`.
    kv_segment_ids: optional int [batch, kv_len], as for `attention`.
    sm_scale: logit multiplier, as for `attention` (default 1/sqrt(head_dim)).
    backend: force "pallas", "pallas_hopper_fp8", "pallas_hopper", "cudnn" or "xla";
      None chooses. "xla" does the "pallas" kernel's arithmetic, E4M3 rounding of P
      included; "pallas_hopper" and "cudnn" run bf16 attention on the dequantized
      inputs.
    save_output_fp8: keep the output the backward kernel reads (for its row sums
      rowsum(dO * O)) as E4M3 with a power-of-two scale per token and head
      (`fp8jax.ops.saved_activations`: 1.03 bytes per element instead of 2) on the fused
      FP8 kernels ("pallas_hopper_fp8", "pallas"); the other backends recompute the
      forward in the backward and keep no output.
    block_scales: quantize q, k and v with one current scale per 128 rows of each head
      (each block's amax maps to E4M3's max; the roles' stored scales are not used, their
      amaxes are still recorded). None: as the recipe scales GEMM operands (per row or
      per block: True; per tensor: False). Runs on "pallas_hopper_fp8", "xla" and the
      dequantizing backends, not on "pallas".
    rotate: turn q and k by a fixed random orthogonal matrix along head_dim before they
      are quantized ("incoherent processing", `fp8jax.ops.attention_rotation`; head_dim
      a power of two): q k^T is unchanged, while channel outliers no longer dominate E4M3's
      rounding. The recorded q and k amaxes are then those of the turned tensors.

  Returns:
    (out, new_meta): out [batch, q_len, heads, head_dim] in q's dtype (bf16
    accuracy); new_meta with this call's amaxes of q, k, v and o recorded.
  """
  _check_qkv(q, k, v, q_segment_ids, kv_segment_ids)
  refuse_split_state(meta, "meta")
  check_attention_meta(meta, "meta")
  check_threaded(meta, "fp8_attention", init="fp8jax.init_attention_meta")
  if block_scales is None:
    block_scales = bool(meta.recipe.per_operand)
  if rotate:
    attention_rotation.check_rotatable(q.shape[-1])
  choice = choose_backend(q, k, fp8=True, causal=causal,
                          has_segments=q_segment_ids is not None, recipe=meta.recipe,
                          backend=backend, block_scales=bool(block_scales))
  call = _Call(choice.name, causal, sm_scale, _interpret(), bool(save_output_fp8),
               bool(block_scales), bool(rotate),
               _hopper_blocks(choice.name, causal, q.shape[-1]))
  with reverse_mode_only("fp8jax.fp8_attention", "fp8jax.attention (bf16)"):
    return _fp8_attention(q, k, v, meta, q_segment_ids, kv_segment_ids, call)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _fp8_attention(q, k, v, meta, q_seg, kv_seg, call):
  out, new_meta, _ = _fp8_forward(q, k, v, meta, q_seg, kv_seg, call)
  return out, new_meta


def _quantize(x, role_meta, call):
  """(x8, descale, role meta with x's amax recorded): per tensor as the role's recipe
  says, or (`call.block_scales`) per 128 rows of each head."""
  if not call.block_scales:
    x8, scale, recorded = quantize_with_meta(x, role_meta)
    return x8, 1.0 / scale, recorded
  x8, descale = pallas_kernels.quantize_head_blocks(x)
  return x8, descale, record_amax(role_meta, amax(x))


def _fp8_forward(q, k, v, meta, q_seg, kv_seg, call):
  if call.rotate:
    q, k = attention_rotation.rotate(q), attention_rotation.rotate(k)
  q8, descale_q, meta_q = _quantize(q, meta.q, call)
  k8, descale_k, meta_k = _quantize(k, meta.k, call)
  v8, descale_v, meta_v = _quantize(v, meta.v, call)
  descales = (descale_q, descale_k, descale_v)
  if call.backend in DEQUANTIZING_FP8_BACKENDS:
    # A bf16 backend measured faster than every FP8 kernel: FP8 rounding of the
    # inputs (and their amaxes) as always, bf16 attention on the dequantized values.
    out = _bf16_attention(call.backend, *_dequantized((q8, k8, v8), descales, jnp.bfloat16),
                          call.causal, q_seg, kv_seg, call.sm_scale)
    out_amax, lse = amax(out), None
  elif call.backend == "xla":
    # The FP8 kernel's arithmetic in plain jnp; it lives beside the kernel because it
    # follows the kernel's tiling.
    result = pallas_kernels.fp8_forward_reference(
        q8, k8, v8, descale_q=descales[0], descale_k=descales[1], descale_v=descales[2],
        q_segment_ids=q_seg, kv_segment_ids=kv_seg, causal=call.causal,
        sm_scale=call.sm_scale)
    out, out_amax, lse = result.out, result.out_amax, None
  else:
    out, out_amax, lse = _fused_fp8_forward(call.backend, q8, k8, v8, descales, q_seg, kv_seg,
                                            call)
  new_meta = dataclasses.replace(meta, q=meta_q, k=meta_k, v=meta_v,
                                 o=record_amax(meta.o, out_amax))
  kept = out
  if call.save_output_fp8 and lse is not None:  # only the fused FP8 kernels read it back
    # One scale per token and head (a head_dim under 128 is one padded group).
    kept = saved_activations.save(out, "attention_out")
  residuals = (q8, k8, v8, descales, kept, lse, q_seg, kv_seg)
  return out.astype(q.dtype), amaxes_unbatched_like(meta, new_meta), residuals


def _descale_layouts(call) -> tuple[str, str, str]:
  """The `_per_shard` layouts of (descale_q, descale_k, descale_v): replicated scalars, or
  block descales split with their heads and batch rows."""
  return ("bhn", "bkm", "bkm") if call.block_scales else ("", "", "")


def _fused_fp8_forward(backend, q8, k8, v8, descales, q_seg, kv_seg, call):
  """(out, out_amax, lse) from an FP8 forward kernel, run on each device's batch rows and heads."""
  if backend == "pallas_hopper_fp8":
    def kernel(q8, k8, v8, descale_q, descale_k, descale_v, q_seg, kv_seg):
      # lse is base 2 here: hopper_fp8_attention_backward takes it as it is.
      return pallas_kernels.hopper_fp8_attention_forward(
          q8, k8, v8, descale_q, descale_k, descale_v, causal=call.causal,
          sm_scale=call.sm_scale, q_segment_ids=q_seg, kv_segment_ids=kv_seg,
          block_sizes=call.block_sizes)
  else:
    def kernel(q8, k8, v8, descale_q, descale_k, descale_v, q_seg, kv_seg):
      result = pallas_kernels.flash_attention_forward(
          q8, k8, v8, descale_q=descale_q, descale_k=descale_k, descale_v=descale_v,
          q_segment_ids=q_seg, kv_segment_ids=kv_seg, causal=call.causal,
          sm_scale=call.sm_scale, interpret=call.interpret)
      return result.out, result.out_amax, result.lse
  per_shard = _per_shard(kernel, ("bshd", "btkd", "btkd", *_descale_layouts(call), "bs", "bt"),
                         ("bshd", "amax", "bhs"))
  return per_shard(q8, k8, v8, *descales, q_seg, kv_seg)


def _fused_fp8_backward(backend, q8, k8, v8, descales, out, lse, g, q_seg, kv_seg, call):
  """(dq, dk, dv) from an FP8 backward kernel, run on each device's batch rows and heads."""
  if backend == "pallas_hopper_fp8":
    # dO's E4M3 scale comes from the whole dO under jit (one scale, as on one device);
    # inside shard_map, where the kernel is per device, from the device's dO.
    g8, descale_g = pallas_kernels.quantize_gradient(g)

    def kernel(q8, k8, v8, out, lse, g8, descale_q, descale_k, descale_v, descale_g, q_seg,
               kv_seg):
      return pallas_kernels.hopper_fp8_attention_backward(
          q8, k8, v8, out, lse, g8, descale_q, descale_k, descale_v, causal=call.causal,
          sm_scale=call.sm_scale, q_segment_ids=q_seg, kv_segment_ids=kv_seg,
          g_descale=descale_g, block_sizes=call.block_sizes)
    operands = ("bshd", "btkd", "btkd", "bshd", "bhs", "bshd", *_descale_layouts(call), "",
                "bs", "bt")
    args = (q8, k8, v8, out, lse, g8, *descales, descale_g, q_seg, kv_seg)
  else:
    def kernel(q8, k8, v8, out, lse, g, descale_q, descale_k, descale_v, q_seg, kv_seg):
      return pallas_kernels.flash_attention_backward(
          q8, k8, v8, out, lse, g, descale_q=descale_q, descale_k=descale_k,
          descale_v=descale_v, q_segment_ids=q_seg, kv_segment_ids=kv_seg,
          causal=call.causal, sm_scale=call.sm_scale, interpret=call.interpret)
    operands = ("bshd", "btkd", "btkd", "bshd", "bhs", "bshd", "", "", "", "bs", "bt")
    args = (q8, k8, v8, out, lse, g.astype(out.dtype), *descales, q_seg, kv_seg)
  return _per_shard(kernel, operands, ("bshd", "btkd", "btkd"))(*args)


def _per_shard(kernel, operands, outputs):
  """`kernel` partitioned over batch rows and heads (`fp8jax.mesh.partitioning`);
  as it is inside `shard_map`, whose code is per device already."""
  if inside_shard_map():
    return kernel
  # Under jax.vmap the kernel runs unpartitioned (Pallas batches it).
  return vmapped_as(shard_local_attention(kernel, operands, outputs), kernel)


def _dequantized(tensors8, descales, dtype):
  """x8 * descale in `dtype`; a block descale [batch, heads, blocks] applies to its rows."""
  def per_row(x8, d):
    if jnp.ndim(d) == 0:
      return d
    rows = jnp.repeat(jnp.swapaxes(d, 1, 2), pallas_kernels.ATTENTION_SCALE_BLOCK, axis=1)
    return rows[:, :x8.shape[1], :, None]
  return [(x8.astype(jnp.float32) * per_row(x8, d)).astype(dtype)
          for x8, d in zip(tensors8, descales)]


def _fp8_attention_fwd(q, k, v, meta, q_seg, kv_seg, call):
  out, new_meta, residuals = _fp8_forward(q, k, v, meta, q_seg, kv_seg, call)
  return (out, new_meta), residuals


def _fp8_attention_bwd(call, residuals, cotangents):
  q8, k8, v8, descales, out, lse, q_seg, kv_seg = residuals
  g, meta_cotangent = cotangents
  if isinstance(out, saved_activations.SavedFp8):
    out = saved_activations.restore(out, g.dtype)
  if call.backend in ("xla",) + DEQUANTIZING_FP8_BACKENDS:
    dtype = jnp.float32 if call.backend == "xla" else jnp.bfloat16
    _, vjp = jax.vjp(lambda q, k, v: _bf16_attention(
        call.backend, q, k, v, call.causal, q_seg, kv_seg, call.sm_scale),
        *_dequantized((q8, k8, v8), descales, dtype))
    dq, dk, dv = vjp(g.astype(dtype))
  else:
    dq, dk, dv = _fused_fp8_backward(call.backend, q8, k8, v8, descales, out, lse, g, q_seg,
                                     kv_seg, call)
  if call.rotate:  # the gradients with respect to q R and k R, turned back
    dq, dk = attention_rotation.unrotate(dq), attention_rotation.unrotate(dk)
  meta_in_cotangent = amaxes_unbatched_like(meta_cotangent, dataclasses.replace(
      meta_cotangent, grad=record_amax(meta_cotangent.grad, amax(g))))
  # q, k, v share a dtype, and the output (hence g) has it too.
  return (dq.astype(g.dtype), dk.astype(g.dtype), dv.astype(g.dtype),
          meta_in_cotangent, None, None)


_fp8_attention.defvjp(_fp8_attention_fwd, _fp8_attention_bwd)
