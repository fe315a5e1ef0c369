"""RMSNorm (optionally after a residual add) whose backward keeps the normalized input in FP8.

    y = rms_norm(x, scale, eps=1e-6, save_fp8=True)               # x [..., C] -> y [..., C]
    s, y = add_rms_norm(x, delta, scale, eps=1e-6, save_fp8=True)  # s = x + delta, y = norm(s)
    y, y_amax = rms_norm(x, scale, return_amax=True)               # max|y|, for current scaling

Math, per row of C features, in float32 (s = x, or x + delta rounded to x's dtype as the
residual stream stores it):

    r = rsqrt(mean(s**2) + eps),   n = s r,   y = n * scale          (y in out_dtype)
    backward, g = dL/dy:   gn = g * scale
                           ds = r (gn - n mean(gn n)) [+ dL/ds from s's other uses]
                           dscale = sum over rows of g n

(ds: differentiating n_i = s_i r with dr/ds_j = -r**3 s_j / C gives
ds_j = r gn_j - r n_j mean_i(gn_i n_i); eps enters through r only.)

What the backward keeps: r (float32 per row) and, with `save_fp8=True`, n as E4M3 with a
power-of-two scale per 1 x 128 group (`fp8jax.ops.saved_activations`: 1.03 bytes per
element); otherwise s itself, in x's dtype (n = s r is recomputed, exactly). Plain
autodiff of the float32 norm keeps three float32 tensors per row (12 bytes per element).
The FP8 copy only feeds the gradients: the forward output is the same either way. Its error in n (<= 2**-4
relative, 2**-10 / s absolute per group) reaches ds and dscale linearly (the tests
bound it).

`return_amax=True` also returns max|y| of the output as written (out_dtype), exact, for
current scaling of the projection y feeds (`fp8jax.fp8_dense(..., x_amax=...)`): on a GPU
the fused kernel computes it while it writes y, so no pass over y is needed for it.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

import pallas_kernels.activations as activations
from fp8jax.core.quantize import amax as tensor_amax
from fp8jax.core.validation import check_floating
from fp8jax.ops import saved_activations


@dataclasses.dataclass(frozen=True)
class _Norm:
  """The static configuration of one call (a custom_vjp nondiff argument)."""

  eps: float
  out_dtype: jnp.dtype
  save_fp8: bool
  return_amax: bool
  add: bool


def rms_norm(x: jax.Array, scale: jax.Array, *, eps: float = 1e-6, out_dtype=None,
             save_fp8: bool = False, return_amax: bool = False):
  """RMSNorm of x [..., C] with a learned `scale` [C], computed in float32.

  Args:
    x: floating [..., C].
    scale: [C], the learned gain (its gradient has its dtype).
    eps: added to the mean square.
    out_dtype: y's dtype (default: x's).
    save_fp8: keep the normalized input for the backward in FP8 (see the module).
    return_amax: also return max|y| (float32[]).

  Returns:
    y [..., C] in out_dtype; (y, amax) with `return_amax`.
  """
  call = config(x, scale, eps, out_dtype, save_fp8, return_amax, add=False)
  _, y, y_amax = _norm(x, jnp.zeros((), x.dtype), scale, call)
  return (y, y_amax) if return_amax else y


def add_rms_norm(x: jax.Array, delta: jax.Array, scale: jax.Array, *, eps: float = 1e-6,
                 out_dtype=None, save_fp8: bool = False, return_amax: bool = False):
  """The residual add and the next RMSNorm: `s = x + delta` (in x's dtype), `y = rms_norm(s)`.

  One pass over x and delta on a GPU; the backward adds the norm's ds to s's cotangent
  and passes the sum to both x and delta.

  Args:
    x, delta: floating [..., C] of one dtype (the residual stream and a block's output).
    scale, eps, out_dtype, save_fp8, return_amax: as for `rms_norm`.

  Returns:
    (s, y), or (s, y, amax) with `return_amax`.
  """
  if jnp.shape(delta) != jnp.shape(x) or jnp.result_type(delta) != jnp.result_type(x):
    raise ValueError(f"delta {jnp.shape(delta)} {jnp.result_type(delta)} must have x's shape "
                     f"and dtype, {jnp.shape(x)} {jnp.result_type(x)}.")
  call = config(x, scale, eps, out_dtype, save_fp8, return_amax, add=True)
  s, y, y_amax = _norm(x, delta, scale, call)
  return (s, y, y_amax) if return_amax else (s, y)


def config(x, scale, eps, out_dtype, save_fp8, return_amax, add,
           names: tuple[str, str] = ("scale", "eps")) -> _Norm:
  """The static configuration of one call, its arguments checked (named in each error:
  `names` are what the caller calls scale and eps, such as "norm_scale", "norm_eps")."""
  scale_name, eps_name = names
  check_floating(x, "x")
  check_floating(scale, scale_name)
  if jnp.ndim(scale) != 1 or jnp.shape(scale)[0] != jnp.shape(x)[-1]:
    raise ValueError(f"{scale_name} must be [C] = [{jnp.shape(x)[-1]}] (x's last axis); got "
                     f"shape {jnp.shape(scale)}.")
  if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0:
    raise ValueError(f"{eps_name}={eps!r} must be a non-negative number.")
  return _Norm(float(eps), jnp.dtype(out_dtype or x.dtype), bool(save_fp8), bool(return_amax),
               add)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _norm(x, delta, scale, call):
  return _forward(x, delta, scale, call)[0]


def _forward(x, delta, scale, call):
  s = x + delta if call.add else x
  r = reciprocal_rms(s, call.eps)
  # The math the FP8 casts' norm prologue runs (`fp8jax.ops.norm_dense`): the same numbers.
  y = activations.rms_normalize(s.astype(jnp.float32), r,
                                scale.astype(jnp.float32)).astype(call.out_dtype)
  y_amax = tensor_amax(y) if call.return_amax else None
  # Without FP8 the input itself is kept (exact: n = s r again in the backward).
  kept = kept_for_backward(s, r, call.save_fp8)
  return (s, y, y_amax), (kept, r, scale)


def _norm_fwd(x, delta, scale, call):
  return _forward(x, delta, scale, call)


def reciprocal_rms(s: jax.Array, eps: float) -> jax.Array:
  """r = rsqrt(mean(s**2) + eps) per row of s [..., C]: float32 [..., 1]."""
  return jax.lax.rsqrt(jnp.mean(jnp.square(s.astype(jnp.float32)), axis=-1, keepdims=True)
                       + eps)


def kept_for_backward(s: jax.Array, r: jax.Array, save_fp8: bool):
  """What the backward keeps of the norm's input s: n = s r in FP8 (`save_fp8`), else s."""
  return saved_activations.save(s.astype(jnp.float32) * r, "norm") if save_fp8 else s


def backward(g_y: jax.Array, kept, r: jax.Array, scale: jax.Array, save_fp8: bool):
  """The norm's backward from dL/dy (see the module): (ds float32, dscale in scale's dtype).

  `kept`, `r`: `kept_for_backward`'s and the forward's r.
  """
  # The barrier keeps XLA from sharing the forward's float32 n = s r with this one: it
  # would store it (4 bytes per element) for the backward instead of recomputing it from
  # the 2-byte s (see fp8jax.ops.gelu).
  kept, r, scale = jax.lax.optimization_barrier((kept, r, scale))
  n = saved_activations.restore(kept) if save_fp8 else kept.astype(jnp.float32) * r
  g = g_y.astype(jnp.float32)
  gn = g * scale.astype(jnp.float32)
  ds = r * (gn - n * jnp.mean(gn * n, axis=-1, keepdims=True))
  dscale = jnp.sum((g * n).reshape(-1, n.shape[-1]), axis=0).astype(scale.dtype)
  return ds, dscale


def _norm_bwd(call, residuals, cotangents):
  kept, r, scale = residuals
  g_s, g_y, _ = cotangents  # the amax is not differentiated
  ds, dscale = backward(g_y, kept, r, scale, call.save_fp8)
  dx = (ds + g_s.astype(jnp.float32)).astype(g_s.dtype)
  # Without the add, delta is a zero scalar placeholder: its cotangent is a zero scalar.
  return dx, (dx if call.add else jnp.zeros((), dx.dtype)), dscale


_norm.defvjp(_norm_fwd, _norm_bwd)
