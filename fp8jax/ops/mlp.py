"""`fp8_mlp`: two FP8 projections with a GELU between them, the GELU done by the FP8 casts.

    y, meta_in, meta_out = fp8_mlp(x, w_in, w_out, meta_in, meta_out)
    # y = gelu(x @ w_in) @ w_out:  x [..., D], w_in [D, F], w_out [F, N], y [..., N]

Math (GELU: tanh approximation, `pallas_kernels.activations`):

    h  = q(x) . q(w_in)             the first projection, in x's dtype
    a  = gelu(h)                    float32
    y  = q(a) . q(w_out)            the second projection, in x's dtype
    backward, g = dL/dy:
    da = q(g) . q(w_out)^T          dgrad of the second projection
    dh = da gelu'(h)                float32
    dx = q(dh) . q(w_in)^T,  dw_in = q(x)^T . q(dh),  dw_out = q(a)^T . q(g)

with each `q` the role's FP8 cast under its `DotMeta` (as `fp8jax.fp8_dot_general`).

What this saves over `fp8_dense(gelu(fp8_dense(x, w_in)), w_out)`: there the GELU writes
`a` in bf16 and the second projection's cast reads it back; the GELU's backward writes
`dh` in bf16 and the first projection's gradient cast reads it back. Here the second
projection's cast makes gelu(h) from h itself, and the first projection's gradient cast
makes da gelu'(h) from da and h (`fp8jax.ops.fused_kernels.cast_in_chain`'s prologue):
two launches and 8 bytes per element of [tokens, F] a step (the 350m GPT: 2.4 ms of its
step on an H100). Only h is kept for the backward (in x's dtype, or in FP8 with
`save_fp8=True`, as `fp8jax.ops.gelu`), beside what the two projections keep (and, with a
norm, what `fp8jax.ops.rms_norm` keeps: x, or n in FP8, and r). Kept in FP8, h's copy is
written in the forward by the cast that makes gelu(h) (`keep_groups`, in the same pass
over h) and read by the output gradient's cast as its codes and descales
(`activations.GELU_BACKWARD_FROM_FP8`): no other pass makes the copy, and no bf16 h is
restored for the backward (the 350m GPT: 142 launches and 8.1 GB a step, the two
together).

With `norm_scale`, x is first RMS-normalized, by the first projection's cast
(`fp8jax.ops.norm_dense`): the MLP block of a pre-norm transformer, its norm never written
in bf16 either. With `residual` too it is the whole sublayer, `s + mlp(rms_norm(s))` with
`s = x + residual`: the gradient reaching s through the norm and through the skip
connection is summed in float32 and rounded once (as `fp8jax.add_rms_norm`).

Numerics: a and dh are cast to FP8 from float32, not rounded to bf16 first (in the
composition they are), and their amaxes are those of the float32 values. Under
delayed scaling their scales are known before they exist; under current scaling each
cast's scale is made from an amax reduced first from the cast's inputs (max|gelu(h)|
from h, max|da gelu'(h)| from da and h: a reduction reading them), so the
fused form runs where both projections take fp8jax's lean matrix path under either
recipe; elsewhere (per-row and per-block recipes, high-precision GEMMs, an explicitly
sharded or shard_map-varying operand, weight reuse) `fp8_mlp` is that composition, with
the same state.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

import pallas_kernels.activations as activations
from fp8jax.core.meta import DotMeta, amaxes_unbatched_like, check_dot_meta
from fp8jax.core.validation import check_floating
from fp8jax.mesh import explicit as explicit_mesh
from fp8jax.mesh.axes import varying_axes
from fp8jax.ops import rms_norm as norm_math
from fp8jax.ops import saved_activations, stacked_weights
from fp8jax.ops.dot import MatrixLayout, fp8_dot_general, matrix_bwd, matrix_fwd, matrix_layout
from fp8jax.ops.gelu import gelu
from fp8jax.ops.norm_dense import NORM_EPS, fused_layout, normalizing_prologue
from fp8jax.ops.guards import check_threaded, refuse_split_state, reverse_mode_only

ACTIVATIONS = ("gelu",)


def fp8_mlp(x: jax.Array, w_in: jax.Array, w_out: jax.Array, meta_in: DotMeta,
            meta_out: DotMeta, *, activation: str = "gelu", save_fp8: bool = False,
            norm_scale: jax.Array | None = None, norm_eps: float = NORM_EPS,
            residual: jax.Array | None = None) -> tuple[jax.Array, DotMeta, DotMeta]:
  """`gelu(x @ w_in) @ w_out` with both matmuls in FP8 and the GELU done by their casts.

  Args:
    x: [..., D] floating, the input.
    w_in: [D, F] floating, the first projection's kernel.
    w_out: [F, N] floating, the second projection's kernel.
    meta_in, meta_out: the two projections' `DotMeta`s.
    activation: "gelu" (the tanh approximation).
    save_fp8: keep the GELU's input (and the norm's, with `norm_scale`) for the backward
      in FP8 (`fp8jax.ops.saved_activations`) instead of in x's dtype.
    norm_scale: [D], an RMSNorm's gain: the MLP of `rms_norm(x, norm_scale, eps=norm_eps)`,
      the norm made by the first projection's cast (`fp8jax.ops.norm_dense`).
    norm_eps: that norm's eps.
    residual: with `norm_scale`, [..., D] of x's dtype: the pre-norm MLP sublayer of a
      transformer, `s + mlp(rms_norm(s))` with `s = x + residual` (in x's dtype, as
      `fp8jax.add_rms_norm`): the gradient reaching s from both uses is summed in float32
      and rounded once, as `add_rms_norm`'s backward does.

  Returns:
    (y [..., N] in x's dtype, new meta_in, new meta_out), each meta with this use's amaxes;
    with `residual`, y is `s + mlp(rms_norm(s))` (N must be D).
  """
  check_floating(x, "x")
  check_floating(w_in, "w_in")
  check_floating(w_out, "w_out")
  if activation not in ACTIVATIONS:
    raise ValueError(f"activation={activation!r} is not one of {ACTIVATIONS}.")
  if x.ndim < 1 or w_in.ndim != 2 or w_out.ndim != 2:
    raise ValueError(f"fp8_mlp wants x [..., D], w_in [D, F] and w_out [F, N]; got x {x.shape}, "
                     f"w_in {w_in.shape} and w_out {w_out.shape}.")
  if x.shape[-1] != w_in.shape[0] or w_in.shape[1] != w_out.shape[0]:
    raise ValueError(f"the shapes do not chain: x {x.shape} . w_in {w_in.shape} . w_out "
                     f"{w_out.shape}; x's last dimension must be w_in's first and w_in's last "
                     "w_out's first.")
  for name, meta in (("meta_in", meta_in), ("meta_out", meta_out)):
    refuse_split_state(meta, name)
    check_dot_meta(meta, name)
  if meta_in.recipe != meta_out.recipe:
    raise ValueError(f"meta_in follows {meta_in.recipe} and meta_out {meta_out.recipe}; the "
                     "two projections of one fp8_mlp share a recipe: init both metas with "
                     "the same one.")
  norm = (None if norm_scale is None else
          norm_math.config(x, norm_scale, norm_eps, None, save_fp8, False, add=False,
                           names=("norm_scale", "norm_eps")))
  _check_residual(residual, norm, x, w_out)
  dims = (((x.ndim - 1,), (0,)), ((), ()))
  layouts = _fused_layouts(x, w_in, w_out, meta_in, dims, norm_scale, residual)
  if layouts is None:
    s = x
    if residual is not None:
      s, x = norm_math.add_rms_norm(x, residual, norm_scale, eps=norm.eps,
                                    save_fp8=norm.save_fp8)
    elif norm is not None:
      x = norm_math.rms_norm(x, norm_scale, eps=norm.eps, save_fp8=norm.save_fp8)
    h, meta_in = fp8_dot_general(x, w_in, meta_in, dims)
    y, meta_out = fp8_dot_general(gelu(h, save_fp8=save_fp8), w_out, meta_out, dims)
    return (y if residual is None else s + y), meta_in, meta_out
  check_threaded(meta_in, "fp8_mlp")
  check_threaded(meta_out, "fp8_mlp")
  with reverse_mode_only("fp8jax.fp8_mlp", "jnp.dot and jax.nn.gelu"):
    # Weights cast before a loop over layers (`fp8jax.ops.stacked_weights`), or None.
    reused = (stacked_weights.supplied(w_in, layouts[0]),
              stacked_weights.supplied(w_out, layouts[1]))
    return _mlp(x, w_in, w_out, meta_in, meta_out, norm_scale, residual, reused,
                _Static(*layouts, jnp.dtype(w_in.dtype), jnp.dtype(w_out.dtype),
                        bool(save_fp8), None if norm is None else norm.eps,
                        residual is not None))


def _check_residual(residual, norm, x, w_out) -> None:
  if residual is None:
    return
  if norm is None:
    raise ValueError("residual is the add before the MLP's norm: pass norm_scale too, or "
                     "add the residual to x yourself.")
  if jnp.shape(residual) != x.shape or jnp.result_type(residual) != x.dtype:
    raise ValueError(f"residual {jnp.shape(residual)} {jnp.result_type(residual)} must have "
                     f"x's shape and dtype, {x.shape} {x.dtype}.")
  if w_out.shape[1] != x.shape[-1]:
    raise ValueError(f"with residual the output is added to x + residual: w_out's last "
                     f"dimension must be x's, {x.shape[-1]}; got w_out {w_out.shape}.")


def quantized_activation(h: jax.Array) -> jax.Array:
  """What the second projection's cast quantizes on the fused path: gelu(h) in float32,
  from the first projection's output h (for telemetry of that operand)."""
  return activations.gelu_tanh(h.astype(jnp.float32))


def _fused_layouts(x, w_in, w_out, meta, dims, *others):
  """(layout_in, layout_out) when the fused form runs (see the module), else None.
  `others`: the norm's gains and the residual, where given."""
  layout_in = fused_layout(x, w_in, meta, dims, *others)
  if layout_in is None or varying_axes(w_out) or explicit_mesh.is_explicitly_sharded(w_out):
    return None
  layout_out = matrix_layout(dims, x.shape[:-1] + (w_in.shape[1],), w_out.shape)
  return None if layout_out is None else (layout_in, layout_out)


@dataclasses.dataclass(frozen=True)
class _Static:
  layout_in: MatrixLayout
  layout_out: MatrixLayout
  w_in_dtype: jnp.dtype
  w_out_dtype: jnp.dtype
  save_fp8: bool
  norm_eps: float | None  # None: no norm before the first projection
  residual: bool = False  # the sublayer s + mlp(rms_norm(s)), s = x + residual


@functools.partial(jax.custom_vjp, nondiff_argnums=(8,))
def _mlp(x, w_in, w_out, meta_in, meta_out, norm_scale, residual, reused, static):
  return _forward(x, w_in, w_out, meta_in, meta_out, norm_scale, residual, reused, static,
                  differentiated=False)[0]


def _forward(x, w_in, w_out, meta_in, meta_out, norm_scale, residual, reused, static,
             differentiated=True):
  if residual is not None:  # the sublayer: s + mlp(rms_norm(s)), s = x + residual
    x = x + residual
  # With save_fp8 the casts that read the norm's input and the GELU's write their FP8
  # copies for the backward too: the one pass over each makes both.
  keep = static.save_fp8 and differentiated
  r, with_norm = None, {}
  if static.norm_eps is not None:
    r, prologue_inputs = normalizing_prologue(x, norm_scale, static.norm_eps)
    with_norm = dict(x_prologue=activations.RMS_NORM, x_prologue_inputs=prologue_inputs,
                     keep_x=keep)
  # The projections' kernels are named "up" and "down" in the program (their op names,
  # which `fp8jax inspect` and `fp8jax cost` read), as `Fp8Mlp` names their variables.
  with jax.named_scope("up"):
    h, new_in, residuals_in, kept_n = matrix_fwd(x, w_in, meta_in, reused[0],
                                                 static.layout_in, **with_norm)
  norm_residuals = None
  if r is not None:
    kept_x = (saved_activations.from_cast(kept_n, x.shape, "norm") if keep
              else norm_math.kept_for_backward(x, r, static.save_fp8))
    norm_residuals = (kept_x, r, norm_scale)
  with jax.named_scope("down"):
    y, new_out, residuals_out, kept_h = matrix_fwd(h, w_out, meta_out, reused[1],
                                                   static.layout_out,
                                                   x_prologue=activations.GELU, keep_x=keep)
  if residual is not None:
    y = x + y
  kept = h
  if keep:
    # h's FP8 copy is tied to the output, then named (so a remat policy keeps the copy,
    # not the barrier): else, where the copy is made in jnp, XLA moves the quantization
    # into the backward beside its one reader and keeps h in bf16 until then (2 bytes
    # per d_ff element instead of 1.03).
    kept_h, y = jax.lax.optimization_barrier((kept_h, y))
    kept = saved_activations.from_cast(kept_h, h.shape, "gelu")
  # Under jax.vmap with one state: the whole batch's amaxes (as fp8_dot_general).
  outputs = (y, amaxes_unbatched_like(meta_in, new_in), amaxes_unbatched_like(meta_out, new_out))
  return outputs, (residuals_in, residuals_out, kept, norm_residuals)


def _backward(static, residuals, cotangents):
  residuals_in, residuals_out, kept, norm_residuals = residuals
  g, cotangent_in, cotangent_out = cotangents
  with jax.named_scope("down"):
    da, dw_out, grad_out = matrix_bwd(static.layout_out, residuals_out, g,
                                      cotangent_out.grad, static.w_out_dtype)
  # With h kept in FP8 the cast reads its codes and descales: h is never restored in bf16.
  prologue, prologue_inputs = ((activations.GELU_BACKWARD_FROM_FP8, tuple(kept))
                               if static.save_fp8 else (activations.GELU_BACKWARD, (kept,)))
  with jax.named_scope("up"):
    dx, dw_in, grad_in = matrix_bwd(static.layout_in, residuals_in, da, cotangent_in.grad,
                                    static.w_in_dtype, g_prologue=prologue,
                                    g_prologue_inputs=prologue_inputs)
  meta_in = amaxes_unbatched_like(cotangent_in,
                                  dataclasses.replace(cotangent_in, grad=grad_in))
  meta_out = amaxes_unbatched_like(cotangent_out,
                                   dataclasses.replace(cotangent_out, grad=grad_out))
  dscale, d_residual = None, None
  if norm_residuals is not None:
    ds, dscale = norm_math.backward(dx, *norm_residuals, static.save_fp8)
    if static.residual:  # s's two uses summed in float32, rounded once
      ds = ds + g.astype(jnp.float32)
    dx = ds.astype(dx.dtype)
    d_residual = dx if static.residual else None
  # The supplied FP8 copies of the weights get no gradient (the weights' is dw): None.
  return dx, dw_in, dw_out, meta_in, meta_out, dscale, d_residual, None


_mlp.defvjp(_forward, _backward)
