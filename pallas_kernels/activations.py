"""Elementwise functions a cast kernel applies to its tile before quantizing it.

The cast-transpose kernel (`pallas_kernels.cast_transpose`) can take the tensor it
casts as the output of an elementwise function of tensors it reads (`Prologue`): the
GELU of a GEMM's output, the GELU's backward of an output gradient, or the RMSNorm of
a projection's input (its rows' reciprocal RMS and its columns' gains given). Then the
function's result is never written in bf16 for the cast to read back: one pass over the
inputs writes the FP8 copies and the amax of the result. The functions here are that
math, in float32, written once for the kernels and for fp8jax's jnp ops
(`fp8jax.ops.gelu`), so both compute the same numbers.

GELU, tanh approximation (`jax.nn.gelu(h, approximate=True)`):

    u = c (h + a h**3),  c = sqrt(2 / pi),  a = 0.044715
    gelu(h)  = h (1 + tanh u) / 2
    gelu'(h) = (1 + tanh u) / 2 + h (1 - tanh(u)**2) c (1 + 3 a h**2) / 2
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable

import jax
import jax.numpy as jnp

from pallas_kernels.cast_transpose_tiling import GROUP_COLUMNS

GELU_C = math.sqrt(2.0 / math.pi)
GELU_A = 0.044715


def gelu_tanh(h: jax.Array) -> jax.Array:
  """gelu(h), tanh approximation, in float32 (h float32)."""
  return 0.5 * h * (1.0 + jnp.tanh(GELU_C * (h + GELU_A * h * h * h)))


def gelu_tanh_derivative(h: jax.Array) -> jax.Array:
  """gelu'(h), tanh approximation, in float32 (h float32)."""
  # Past |h| = 10 tanh is exactly +-1 in float32, so the second term is 0 there; the
  # clip keeps h*h finite for huge h, where 0 * inf would make the derivative NaN.
  h = jnp.clip(h, -10.0, 10.0)
  t = jnp.tanh(GELU_C * (h + GELU_A * h * h * h))
  return 0.5 * (1.0 + t) + 0.5 * h * (1.0 - t * t) * GELU_C * (1.0 + 3.0 * GELU_A * h * h)


def gelu_tanh_backward(g: jax.Array, h: jax.Array) -> jax.Array:
  """dh = g gelu'(h) in float32: the backward of `gelu_tanh` (g, h float32)."""
  return g * gelu_tanh_derivative(h)


def per_group(values: jax.Array, columns: int) -> jax.Array:
  """One value per row and group of `GROUP_COLUMNS` columns, [R, ceil(C / GROUP_COLUMNS)],
  as the [R, columns] it covers; a cast kernel's tile is one group wide and reads the
  tile's [rows, 1] values, which broadcast as they are.

  Returns:
    [R, columns] (or the [R, 1] values as they are).
  """
  if values.shape[-1] == 1:
    return values
  return jnp.repeat(values, GROUP_COLUMNS, axis=-1)[..., :columns]


def gelu_tanh_backward_from_fp8(g: jax.Array, codes: jax.Array,
                                scale_inv: jax.Array) -> jax.Array:
  """`gelu_tanh_backward(g, h)` with h kept in FP8, one power-of-two descale per row and
  group of columns (`fp8jax.ops.saved_activations`): h = codes * scale_inv, exact in
  float32 (all float32).

  Returns:
    dh, float32 of g's shape.
  """
  return gelu_tanh_backward(g, codes * per_group(scale_inv, codes.shape[-1]))


@dataclasses.dataclass(frozen=True)
class Prologue:
  """An elementwise function a cast kernel applies before it quantizes (static).

  Attributes:
    fn: float32 tiles -> the float32 tile to cast: `fn(x)` with `inputs` 0, else
      `fn(x, *others)`. `fn` of zeros must be 0 (a masked edge tile reads zeros).
    inputs: how many more tensors it reads (0, 1 or 2), each of x's shape [R, C] or
      broadcast along one axis: [R, 1] (a value per row) or [1, C] (per column), or one
      value per row and group of columns, [R, ceil(C / GROUP_COLUMNS)] (`per_group`).
    rotary: None, or the head_dim of the qkv output gradient made from (dq, dk, dv) and
      RoPE's transpose (`pallas_kernels.rotary_gradient`): then `fn` is not elementwise
      (it maps x [R, C] and 4 inputs to [R, 3 C]) and the kernel computes it its own way.
    rotary_dtype: with `rotary`, the gradients' dtype name, which the result is rounded to.
    kept: what a cast that keeps its input for a backward pass (`keep_groups`) keeps:
      `kept(x, *others)` of float32 tiles, or None to keep x itself. It must map a zero
      x to zero: a tile's elements past x's edge are zeros, and they enter the amax of
      the last group, which sets its descale.
  """

  fn: Callable[..., jax.Array]
  inputs: int = 0
  rotary: int | None = None
  rotary_dtype: str | None = None
  kept: Callable[..., jax.Array] | None = None

  def __post_init__(self):
    if not callable(self.fn):
      raise TypeError(f"Prologue.fn={self.fn!r} must be a function of float32 tiles.")
    if self.inputs not in ((4,) if self.rotary is not None else (0, 1, 2)):
      raise ValueError(f"Prologue.inputs={self.inputs!r} must be 0, 1 or 2 (4 with rotary).")
    if self.rotary is not None and (
        isinstance(self.rotary, bool) or not isinstance(self.rotary, int) or self.rotary < 2
        or self.rotary % 2 or self.rotary_dtype is None):
      raise ValueError(f"Prologue.rotary={self.rotary!r} must be an even head_dim >= 2, with "
                       f"rotary_dtype (got {self.rotary_dtype!r}).")

  def applied_to(self, x: jax.Array, inputs) -> jax.Array:
    """`fn` of x and the further tensors, each taken in float32: what a cast quantizes, in
    the jnp form the kernels are checked against.

    Returns:
      float32, x's shape ([R, 3 C] for a rotary prologue).
    """
    return self.fn(x.astype(jnp.float32), *(t.astype(jnp.float32) for t in inputs))

  def kept_of(self, x: jax.Array, inputs) -> jax.Array:
    """What a cast keeping its input keeps (`kept`, or x), in float32, in jnp.

    Returns:
      float32, x's shape.
    """
    x = x.astype(jnp.float32)
    if self.kept is None:
      return x
    return self.kept(x, *(t.astype(jnp.float32) for t in inputs))


def rms_normalize(x: jax.Array, reciprocal_rms: jax.Array, gain: jax.Array) -> jax.Array:
  """RMSNorm's output `(x r) g` in float32, from x [R, C], each row's r = 1 / rms [R, 1] and
  the gains g [1, C] (float32), in the order `fp8jax.ops.rms_norm` multiplies them."""
  return x * reciprocal_rms * gain


def rms_normalized(x: jax.Array, reciprocal_rms: jax.Array, gain: jax.Array) -> jax.Array:
  """`x r` before the gains, what RMSNorm's backward keeps (`fp8jax.ops.rms_norm`).

  Returns:
    float32, x's shape.
  """
  del gain
  return x * reciprocal_rms


# The prologues fp8jax's ops use: the GELU before a projection's cast, its backward
# before the cast of the projection's output gradient before it, and an RMSNorm before
# the cast of the projection it feeds.
GELU = Prologue(gelu_tanh)
GELU_BACKWARD = Prologue(gelu_tanh_backward, inputs=1)
# The GELU's backward reading its input as the FP8 copy the forward kept: the codes
# [R, C] and one descale per row and group of columns [R, ceil(C / GROUP_COLUMNS)].
GELU_BACKWARD_FROM_FP8 = Prologue(gelu_tanh_backward_from_fp8, inputs=2)
RMS_NORM = Prologue(rms_normalize, inputs=2, kept=rms_normalized)
