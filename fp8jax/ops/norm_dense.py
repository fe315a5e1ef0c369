"""`fp8_rms_norm_dense`: an RMSNorm and the FP8 projection after it, the norm done by the cast.

    y, meta = fp8_rms_norm_dense(x, scale, kernel, meta, eps=1e-6)
    # y = rms_norm(x, scale) @ kernel:  x [..., D], scale [D], kernel [D, features...]

Math (`fp8jax.ops.rms_norm`'s, in float32), with `q` the role's FP8 cast under `meta`:

    r = rsqrt(mean(x**2) + eps) per row,   n = x r,   h = n * scale
    y = q(h) . q(kernel)                       in x's dtype
    backward, g = dL/dy:
    dh = q(g) . q(kernel)^T,   dkernel = q(h)^T . q(g)
    dx = r (dh scale - n mean(dh scale n)),   dscale = sum over rows of dh n

What this saves over `fp8_dense(rms_norm(x, scale), kernel)`: there the norm writes h in
bf16 and the projection's cast reads it back. Here the cast reads x and each row's r (a
float32 per row, from a reduction XLA fuses into the kernel that writes x, such as a
residual add) and makes h itself: the cast writes h's FP8 copies and records its amax,
and h is never written in bf16 (as TransformerEngine's LayerNormLinear). The 350m GPT: 48
launches and 0.7 ms of its step on an H100 (deviceless estimate). The backward keeps x
(or n in FP8 with `save_fp8=True`, as `fp8jax.ops.rms_norm`) and r.

Numerics: h is cast to FP8 from float32, not rounded to bf16 first (in the composition
it is), and its amax is that of the float32 values. The fused form needs h's scale before
h exists: delayed scaling's is the state's, current scaling's is made from max|h| reduced
first from x and r (one more read of x; h is still never written). So it runs where the
projection takes fp8jax's lean matrix path under either recipe; elsewhere (per-row and
per-block recipes, high-precision GEMMs, an explicitly sharded or shard_map-varying
operand, weight reuse) `fp8_rms_norm_dense` is that composition, with the same state.
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
from fp8jax.ops import saved_activations, stacked_weights, weight_reuse
from fp8jax.ops.dot import (MatrixLayout, fp8_dot_general, matrix_bwd, matrix_fwd,
                            matrix_layout, prologue_path)
from fp8jax.ops.guards import check_threaded, refuse_split_state, reverse_mode_only

# The eps of an RMSNorm made by an FP8 cast, unless given (`fp8jax.rms_norm`'s default).
NORM_EPS = 1e-6


def fp8_rms_norm_dense(x: jax.Array, scale: jax.Array, kernel: jax.Array, meta: DotMeta, *,
                       eps: float = NORM_EPS,
                       save_fp8: bool = False) -> tuple[jax.Array, DotMeta]:
  """An RMSNorm and the FP8 projection after it, the norm made by the projection's cast.

  Args:
    x: [..., D] floating.
    scale: [D], the norm's learned gain.
    kernel: [D, features...] floating, contracted on its first axis with x's last.
    meta: the projection's `DotMeta`.
    eps: added to the mean square.
    save_fp8: keep the normalized input for the backward in FP8
      (`fp8jax.ops.saved_activations`) instead of x itself.

  Returns:
    (y = rms_norm(x, scale) @ kernel, [..., features...] in x's dtype; the new meta with
    this use's amaxes).
  """
  check_floating(x, "x")
  check_floating(scale, "scale")
  check_floating(kernel, "kernel")
  if x.ndim < 1 or kernel.ndim < 2 or kernel.shape[0] != x.shape[-1]:
    raise ValueError(f"fp8_rms_norm_dense wants x [..., D] and kernel [D, features...]; got x "
                     f"{x.shape} and kernel {kernel.shape}: kernel's first dimension must be "
                     "x's last.")
  call = norm_math.config(x, scale, eps, None, save_fp8, False, add=False)
  refuse_split_state(meta, "meta")
  check_dot_meta(meta, "meta")
  dims = (((x.ndim - 1,), (0,)), ((), ()))
  layout = fused_layout(x, kernel, meta, dims, scale)
  if layout is None:
    normed = norm_math.rms_norm(x, scale, eps=call.eps, save_fp8=call.save_fp8)
    return fp8_dot_general(normed, kernel, meta, dims)
  check_threaded(meta, "fp8_rms_norm_dense")
  with reverse_mode_only("fp8jax.fp8_rms_norm_dense", "fp8jax.rms_norm and jnp.dot"):
    # A kernel cast before a loop over layers (`fp8jax.ops.stacked_weights`), or None.
    reused = stacked_weights.supplied(kernel, layout)
    return _norm_dense(x, scale, kernel, meta, reused,
                       Static(layout, jnp.dtype(kernel.dtype), call.eps, call.save_fp8))


def fused_layout(x, kernel, meta: DotMeta, dims, *others) -> MatrixLayout | None:
  """The layout of `x . kernel` where a cast can run a prologue (see the module), else None.

  `others`: further arrays the fused op reads (a norm's gains, a residual): the fused form
  runs only where none of them varies over a `shard_map` axis or is explicitly sharded.
  """
  if not prologue_path(meta.recipe):
    return None
  operands = (x, kernel) + tuple(o for o in others if o is not None)
  if varying_axes(*operands) or weight_reuse.current() is not None:
    return None
  if explicit_mesh.is_explicitly_sharded(*operands):
    return None
  return matrix_layout(dims, x.shape, kernel.shape)


def quantized_input(x: jax.Array, scale: jax.Array, eps: float = NORM_EPS) -> jax.Array:
  """What the fused cast quantizes: rms_norm(x, scale) in float32, never rounded to x's
  dtype (for telemetry of that operand)."""
  return norm_math.rms_norm(x, scale, eps=eps, out_dtype=jnp.float32)


def normalizing_prologue(x: jax.Array, scale: jax.Array, eps: float):
  """What a cast of x [..., D] needs to cast rms_norm(x, scale) instead: (r [..., 1] float32,
  the prologue's inputs: r as [M, 1] and the gains as [1, D], float32)."""
  r = norm_math.reciprocal_rms(x, eps)
  gains = scale.astype(jnp.float32).reshape(1, -1)
  return r, (r.reshape(-1, 1), gains)


@dataclasses.dataclass(frozen=True)
class Static:
  """A fused call's static facts: the GEMM layout, the kernel's dtype and the norm's."""

  layout: MatrixLayout
  kernel_dtype: jnp.dtype
  eps: float
  save_fp8: bool


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _norm_dense(x, scale, kernel, meta, reused, static):
  return forward(x, scale, kernel, meta, reused, static, differentiated=False)[0]


def forward(x, scale, kernel, meta, reused, static, differentiated=True):
  """`_norm_dense`'s forward: ((y, the new meta), residuals). With `save_fp8` (and
  `differentiated`: a backward will read the residuals) the cast also writes the norm's
  FP8 copy for the backward, in its one pass over x."""
  r, prologue_inputs = normalizing_prologue(x, scale, static.eps)
  keep = static.save_fp8 and differentiated
  y, new_meta, residuals, kept = matrix_fwd(x, kernel, meta, reused, static.layout,
                                            x_prologue=activations.RMS_NORM,
                                            x_prologue_inputs=prologue_inputs, keep_x=keep)
  kept = (saved_activations.from_cast(kept, x.shape, "norm") if keep
          else norm_math.kept_for_backward(x, r, static.save_fp8))
  # Under jax.vmap with one state: the whole batch's amaxes (as fp8_dot_general).
  return (y, amaxes_unbatched_like(meta, new_meta)), (residuals, kept, r, scale)


def _backward(static, residuals, cotangents):
  g, meta_cotangent = cotangents
  return backward(static, residuals, g, meta_cotangent)


def backward(static, residuals, g, meta_cotangent, g_prologue=None, g_prologue_inputs=()):
  """`_norm_dense`'s backward from the output gradient g, or from what its cast makes g of
  (`g_prologue`, `g_prologue_inputs`: see `fp8jax.ops.dot.matrix_bwd`): (dx, dscale,
  dkernel, the meta's cotangent, None for the supplied FP8 copies of the kernel)."""
  residuals, kept, r, scale = residuals
  dh, dkernel, grad = matrix_bwd(static.layout, residuals, g, meta_cotangent.grad,
                                 static.kernel_dtype, g_prologue, g_prologue_inputs)
  dx, dscale = norm_math.backward(dh, kept, r, scale, static.save_fp8)
  meta_in = amaxes_unbatched_like(meta_cotangent, dataclasses.replace(meta_cotangent, grad=grad))
  # The supplied FP8 copies of the kernel get no gradient (the kernel's is dkernel): None.
  return dx.astype(dh.dtype), dscale, dkernel, meta_in, None


_norm_dense.defvjp(forward, _backward)
