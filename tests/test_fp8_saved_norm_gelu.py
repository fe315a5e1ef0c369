"""RMSNorm and GELU that keep their input in FP8 for the backward, against float64.

Forward: the output is the float64 formula's rounded once to the output dtype (bf16:
half an ulp, 2**-8 relative with its 8 significant bits; float32 math before it adds
~1e-6 relative). Backward:
without FP8 the gradients are the float64 VJP's to float32 accuracy; with FP8 the saved
input n_hat (or h_hat) is within e = max(2**-4 |n|, 2**-10 / s) of the true one
(`fp8jax.ops.saved_activations`), and the gradients move by what the closed forms say
e can move them (derived beside each test).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp8jax.ops.gelu import gelu, gelu_derivative
from fp8jax.ops.rms_norm import add_rms_norm, rms_norm
from test_saved_activations import _group_bound

EPS = 1e-6
# float32 evaluation of the closed forms (sums over C = 256 features, rsqrt, tanh):
# well within 1e-5 of the largest gradient entry.
F32_SLACK = 1e-5


def _inputs(shape=(4, 16, 256), seed=0):
  keys = jax.random.split(jax.random.key(seed), 4)
  # Features of different sizes, as a residual stream has, so groups differ in scale.
  gains = jnp.exp(jax.random.normal(keys[0], shape[-1:]))
  x = jax.random.normal(keys[1], shape) * gains
  w = 1.0 + 0.3 * jax.random.normal(keys[2], shape[-1:])
  g = jax.random.normal(keys[3], shape)
  return x.astype(jnp.float32), w.astype(jnp.float32), g.astype(jnp.float32)


def _norm64(x, w):
  x = np.asarray(x, np.float64)
  r = 1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + EPS)
  return x * r * np.asarray(w, np.float64), x * r, r


def _norm_vjp64(n, r, w, g):
  g = np.asarray(g, np.float64)
  gn = g * np.asarray(w, np.float64)
  ds = r * (gn - n * np.mean(gn * n, axis=-1, keepdims=True))
  return ds, np.sum((g * n).reshape(-1, n.shape[-1]), axis=0)


@pytest.mark.parametrize("out_dtype", [jnp.bfloat16, jnp.float32])
def test_rms_norm_output_and_amax_are_the_float64_norm_rounded_once(out_dtype):
  x, w, _ = _inputs()
  y, y_amax = rms_norm(x.astype(jnp.bfloat16), w, eps=EPS, out_dtype=out_dtype,
                       save_fp8=True, return_amax=True)
  want, _, _ = _norm64(np.asarray(x.astype(jnp.bfloat16), np.float64), w)
  rtol = 2.0**-8 + 2.0**-18 if out_dtype == jnp.bfloat16 else 2.0**-18
  np.testing.assert_allclose(np.asarray(y, np.float64), want, rtol=rtol, atol=1e-30)
  assert float(y_amax) == float(np.max(np.abs(np.asarray(y, np.float32))))


def test_rms_norm_gradients_without_fp8_are_the_float64_vjp():
  x, w, g = _inputs(seed=1)
  _, vjp = jax.vjp(lambda x, w: rms_norm(x, w, eps=EPS, out_dtype=jnp.float32), x, w)
  dx, dw = vjp(g)
  _, n, r = _norm64(x, w)
  want_dx, want_dw = _norm_vjp64(n, r, w, g)
  np.testing.assert_allclose(dx, want_dx, rtol=0, atol=F32_SLACK * np.abs(want_dx).max())
  np.testing.assert_allclose(dw, want_dw, rtol=0, atol=F32_SLACK * np.abs(want_dw).max())


def test_rms_norm_gradients_from_fp8_stay_within_the_derived_bound():
  x, w, g = _inputs(seed=2)
  _, vjp = jax.vjp(lambda x, w: rms_norm(x, w, eps=EPS, out_dtype=jnp.float32, save_fp8=True),
                   x, w)
  dx, dw = vjp(g)
  _, n, r = _norm64(x, w)
  want_dx, want_dw = _norm_vjp64(n, r, w, g)
  e, _ = _group_bound(n, 128)
  gn = np.abs(np.asarray(g, np.float64) * np.asarray(w, np.float64))
  # ds = r (gn - n_hat mean(gn n_hat)) with n_hat = n + d, |d| <= e:
  # |ds - ds_true| <= r (e |mean(gn n_hat)| + |n| mean(|gn| e)),
  # |mean(gn n_hat)| <= |mean(gn n)| + mean(|gn| e).
  spread = np.mean(gn * e, axis=-1, keepdims=True)
  center = np.abs(np.mean(np.asarray(g, np.float64) * np.asarray(w, np.float64) * n, axis=-1,
                          keepdims=True))
  bound_dx = r * (e * (center + spread) + np.abs(n) * spread)
  error_dx = np.abs(np.asarray(dx, np.float64) - want_dx)
  assert np.all(error_dx <= bound_dx + F32_SLACK * np.abs(want_dx).max())
  # dw = sum_rows g n_hat: |dw - dw_true| <= sum_rows |g| e.
  bound_dw = np.sum((np.abs(np.asarray(g, np.float64)) * e).reshape(-1, n.shape[-1]), axis=0)
  error_dw = np.abs(np.asarray(dw, np.float64) - want_dw)
  assert np.all(error_dw <= bound_dw + F32_SLACK * np.abs(want_dw).max())
  # The FP8 copy is really used (the gradients differ from the exact ones), and the
  # error is small against the gradients: E4M3's 2**-4 times a few.
  assert error_dx.max() > 0
  assert np.linalg.norm(error_dx) <= 0.1 * np.linalg.norm(want_dx)


def test_add_rms_norm_adds_in_the_stream_dtype_and_passes_the_sum_gradient_to_both():
  x, w, g = _inputs(seed=3)
  x16, d16 = x.astype(jnp.bfloat16), (0.5 * x[::-1]).astype(jnp.bfloat16)
  g_s = jax.random.normal(jax.random.key(9), x.shape, jnp.bfloat16)

  def f(x, d, w):
    return add_rms_norm(x, d, w, eps=EPS, out_dtype=jnp.float32)

  (s, y), vjp = jax.vjp(f, x16, d16, w)
  np.testing.assert_array_equal(np.asarray(s), np.asarray(x16 + d16))
  dx, dd, dw = vjp((g_s, g))
  np.testing.assert_array_equal(np.asarray(dx), np.asarray(dd))
  _, n, r = _norm64(np.asarray(s, np.float64), w)
  want_ds, want_dw = _norm_vjp64(n, r, w, g)
  want = want_ds + np.asarray(g_s, np.float64)
  # dx is rounded to bf16 (the stream's dtype): half an ulp of 2**-8.
  np.testing.assert_allclose(np.asarray(dx, np.float64), want, rtol=2.0**-8,
                             atol=F32_SLACK * np.abs(want).max())
  np.testing.assert_allclose(dw, want_dw, rtol=0, atol=F32_SLACK * np.abs(want_dw).max())


def _gelu64(h):
  c, a = math.sqrt(2 / math.pi), 0.044715
  h = np.asarray(h, np.float64)
  t = np.tanh(c * (h + a * h**3))
  return 0.5 * h * (1 + t), 0.5 * (1 + t) + 0.5 * h * (1 - t * t) * c * (1 + 3 * a * h * h)


def test_gelu_second_derivative_is_at_most_0_80():
  # The constant of the FP8 bound: |y'(a) - y'(b)| <= max|y''| |a - b|. y'' decays
  # like exp(-h**2 / 2) away from 0, so [-12, 12] holds its maximum.
  h = np.linspace(-12, 12, 2_400_001)
  _, derivative = _gelu64(h)
  second = np.abs(np.diff(derivative) / np.diff(h))
  assert 0.79 < second.max() <= 0.80


def test_gelu_output_amax_and_exact_gradient_are_the_float64_formula():
  h = (jax.random.normal(jax.random.key(4), (8, 512)) * 3).astype(jnp.bfloat16)
  y, y_amax = gelu(h, return_amax=True)
  want, derivative = _gelu64(np.asarray(h, np.float64))
  # float32's 1 + tanh(u) cancels for negative h: an absolute error of |h| 2**-24 there.
  np.testing.assert_allclose(np.asarray(y, np.float64), want, rtol=2.0**-8 + 2.0**-18,
                             atol=2.0**-23 * float(jnp.max(jnp.abs(h.astype(jnp.float32)))))
  assert float(y_amax) == float(np.max(np.abs(np.asarray(y, np.float32))))
  # float32's 1 - tanh(u)**2 cancels to an absolute 2**-23 where |u| is large; the
  # factor |h| c (1 + 3 a h**2) / 2 that multiplies it scales that up.
  h64 = np.abs(np.asarray(h, np.float64))
  amplification = np.max(0.5 * h64 * math.sqrt(2 / math.pi) * (1 + 3 * 0.044715 * h64**2))
  np.testing.assert_allclose(gelu_derivative(h), derivative, rtol=0,
                             atol=2.0**-23 * (1 + amplification) + 1e-6)
  g = jax.random.normal(jax.random.key(5), h.shape, jnp.float32)
  h32 = h.astype(jnp.float32)
  _, vjp = jax.vjp(lambda h: gelu(h), h32)
  np.testing.assert_allclose(vjp(g)[0], np.asarray(g, np.float64) * derivative, rtol=0,
                             atol=F32_SLACK * np.abs(np.asarray(g)).max())


def test_gelu_gradient_from_fp8_stays_within_the_derived_bound():
  h = jax.random.normal(jax.random.key(6), (8, 512)) * 2.5
  g = jax.random.normal(jax.random.key(7), h.shape)
  _, vjp = jax.vjp(lambda h: gelu(h, save_fp8=True), h)
  (dh,) = vjp(g)
  _, derivative = _gelu64(h)
  want = np.asarray(g, np.float64) * derivative
  e, _ = _group_bound(np.asarray(h, np.float64), 128)
  bound = 0.80 * np.abs(np.asarray(g, np.float64)) * e
  error = np.abs(np.asarray(dh, np.float64) - want)
  assert np.all(error <= bound + F32_SLACK * np.abs(want).max())
  assert error.max() > 0
