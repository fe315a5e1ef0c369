"""fp8_dense / fp8_dot_general / fp8_einsum forward and gradients vs float64 references.

Two references:
* exact-arithmetic: the float64 reference quantizer applied with the scales the
  library used, then float64 matmuls. Only float32 accumulation and the output
  cast separate the library from it, so the tolerance is tight.
* unquantized float64 math, with an element-wise error bound derived from the
  formats: each operand element carries a relative error of at most
  u = 2**-(mantissa_bits+1) (2**-4 for E4M3, 2**-3 for E5M2) or, in the
  subnormal range, an absolute error of min_subnormal / 2 / scale. For a dot
  product sum_i a_i b_i that bounds the error by
  sum_i (ea_i |b_i| + |a_i| eb_i + ea_i eb_i).
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp8jax
from fp8jax.ops.dot import dgrad_dimension_numbers, wgrad_dimension_numbers
from fp8_reference import FORMAT_TABLE, quantize_reference


def _element_error(values, scale, name):
  table = FORMAT_TABLE[name]
  u = 2.0**-(table["mantissa_bits"] + 1)
  return np.maximum(u * np.abs(values), table["min_subnormal"] / 2 / scale)


def _dense_problem(seed, batch_shape, k, n, dtype):
  keys = jax.random.split(jax.random.key(seed), 4)
  x = jax.random.normal(keys[0], (*batch_shape, k), jnp.float32).astype(dtype)
  kernel = (jax.random.normal(keys[1], (k, n), jnp.float32) / np.sqrt(k)).astype(dtype)
  bias = jax.random.normal(keys[2], (n,), jnp.float32).astype(dtype)
  target = jax.random.normal(keys[3], (*batch_shape, n), jnp.float32).astype(dtype)
  return x, kernel, bias, target


def _warm_meta(recipe, x, kernel, g):
  """A meta whose delayed scales come from the tensors' own amaxes (as after warm-up)."""
  meta = fp8jax.init_dot_meta(recipe)
  for role, t in (("x", x), ("kernel", kernel), ("grad", g)):
    r = getattr(meta, role)
    scale = fp8jax.scale_from_amax(fp8jax.amax(t), r.fmt, recipe.margin, r.scale)
    meta = dataclasses.replace(meta, **{role: r.with_scale(scale)})
  return meta


RECIPES = [fp8jax.DelayedScaling(amax_history_len=4), fp8jax.CurrentScaling(),
           fp8jax.DelayedScaling(fp8_format="e4m3")]


@pytest.mark.parametrize("recipe", RECIPES, ids=["delayed", "current", "delayed-e4m3"])
@pytest.mark.parametrize("batch_shape,k,n", [((64,), 96, 48), ((3, 20), 72, 40), ((2, 3, 5), 33, 17)])
def test_fp8_dense_forward_and_grads_within_format_bound(recipe, batch_shape, k, n):
  x, kernel, bias, target = _dense_problem(0, batch_shape, k, n, jnp.float32)
  g = target  # loss = sum(y * target) makes the output gradient exactly `target`
  meta = _warm_meta(recipe, x, kernel, g)

  def loss(x, kernel, bias):
    y, _ = fp8jax.fp8_dense(x, kernel, bias, meta)
    return jnp.sum(y * target), y

  (_, y), (dx, dk, db) = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(x, kernel, bias)

  x64, k64, g64 = (np.asarray(t, np.float64) for t in (x, kernel, g))
  x2, g2 = x64.reshape(-1, k), g64.reshape(-1, n)
  fwd_name, grad_name = recipe.forward_format.name, recipe.gradient_format.name
  s_x, s_k = float(fp8jax.amax(x)), float(fp8jax.amax(kernel))
  sx = float(meta.x.scale) if isinstance(recipe, fp8jax.DelayedScaling) else 448.0 / s_x
  sk = float(meta.kernel.scale) if isinstance(recipe, fp8jax.DelayedScaling) else 448.0 / s_k
  sg = float(meta.grad.scale) if isinstance(recipe, fp8jax.DelayedScaling) else (
      recipe.gradient_format.max / float(fp8jax.amax(g)))
  ex, ek, eg = (_element_error(x2, sx, fwd_name), _element_error(k64, sk, fwd_name),
                _element_error(g2, sg, grad_name))

  def bound(a, ea, b, eb):
    return ea @ np.abs(b) + np.abs(a) @ eb + ea @ eb

  # float32 accumulation and output rounding add far less than 1e-5 of |a|@|b|.
  f32_slack = lambda a, b: 1e-5 * (np.abs(a) @ np.abs(b))
  checks = [
      (np.asarray(y).reshape(-1, n), x2 @ k64 + np.asarray(bias, np.float64),
       bound(x2, ex, k64, ek) + f32_slack(x2, k64)),
      (np.asarray(dx).reshape(-1, k), g2 @ k64.T, bound(g2, eg, k64.T, ek.T) + f32_slack(g2, k64.T)),
      (np.asarray(dk), x2.T @ g2, bound(x2.T, ex.T, g2, eg) + f32_slack(x2.T, g2)),
  ]
  for got, want, tol in checks:
    assert np.all(np.abs(got - want) <= tol), np.max(np.abs(got - want) / tol)
    # The bound is not vacuous: the FP8 error is visible but far below the signal.
    assert 0 < np.linalg.norm(got - want) / np.linalg.norm(want) < 0.1
  # dbias involves no quantization: sum of the output gradient over the batch.
  np.testing.assert_allclose(np.asarray(db), g2.sum(0), rtol=1e-5, atol=1e-5)


def test_fp8_dense_matches_exact_arithmetic_reference():
  x, kernel, bias, g = _dense_problem(1, (48,), 64, 80, jnp.float32)
  meta = _warm_meta(fp8jax.DelayedScaling(), x, kernel, g)

  def loss(x, kernel):
    y, _ = fp8jax.fp8_dense(x, kernel, None, meta)
    return jnp.sum(y * g), y

  (_, y), (dx, dk) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(x, kernel)
  sx, sk, sg = (float(meta.x.scale), float(meta.kernel.scale), float(meta.grad.scale))
  qx = quantize_reference(np.asarray(x), sx, "e4m3")
  qk = quantize_reference(np.asarray(kernel), sk, "e4m3")
  qg = quantize_reference(np.asarray(g), sg, "e5m2")
  inv = lambda *s: np.float64(np.float32(1.0) / (np.float32(s[0]) * np.float32(s[1])))
  # Quantized operands are exact; only float32 accumulation (K <= 80 terms,
  # relative error < 80 * 2**-24 ~ 5e-6 of sum |a||b|) separates the results.
  for got, want, mag in [
      (y, (qx @ qk) * inv(sx, sk), (np.abs(qx) @ np.abs(qk)) * inv(sx, sk)),
      (dx, (qg @ qk.T) * inv(sg, sk), (np.abs(qg) @ np.abs(qk.T)) * inv(sg, sk)),
      (dk, (qx.T @ qg) * inv(sx, sg), (np.abs(qx.T) @ np.abs(qg)) * inv(sx, sg)),
  ]:
    assert np.all(np.abs(np.asarray(got, np.float64) - want) <= 1e-5 * mag + 1e-30)


def test_bf16_inputs_give_bf16_outputs_and_grads():
  x, kernel, bias, g = _dense_problem(2, (4, 8), 32, 16, jnp.bfloat16)
  meta = fp8jax.init_dot_meta(fp8jax.CurrentScaling())
  y, _ = fp8jax.fp8_dense(x, kernel, bias, meta)
  grads = jax.grad(lambda x, k, b: jnp.sum(fp8jax.fp8_dense(x, k, b, meta)[0].astype(jnp.float32)),
                   argnums=(0, 1, 2))(x, kernel, bias)
  assert y.dtype == jnp.bfloat16 and all(t.dtype == jnp.bfloat16 for t in grads)
  ref = np.asarray(x, np.float64) @ np.asarray(kernel, np.float64) + np.asarray(bias, np.float64)
  # E4M3 inputs (2 x 2**-4 relative) plus a bf16 output (2**-8): a few percent at most.
  assert np.linalg.norm(np.asarray(y, np.float64) - ref) / np.linalg.norm(ref) < 0.06


DIMENSION_NUMBERS = [
    ((3, 4), (4, 5), (((1,), (0,)), ((), ()))),
    ((4, 3), (4, 5), (((0,), (0,)), ((), ()))),
    ((3, 4), (5, 4), (((1,), (1,)), ((), ()))),
    ((2, 3, 4), (2, 4, 5), (((2,), (1,)), ((0,), (0,)))),
    ((3, 2, 4, 6), (6, 5, 4, 2), (((2, 3), (2, 0)), ((1,), (3,)))),
    ((2, 6, 3), (3, 7, 2), (((2,), (0,)), ((0,), (2,)))),
]


@pytest.mark.parametrize("x_shape,k_shape,dims", DIMENSION_NUMBERS)
def test_backward_dimension_numbers_pass_check_grads_on_high_precision_path(x_shape, k_shape, dims):
  """The dgrad/wgrad layouts fp8jax uses, run in float64, are the true VJP of dot_general."""
  from jax.test_util import check_grads

  @jax.custom_vjp
  def dot(x, k):
    return jax.lax.dot_general(x, k, dims)

  def fwd(x, k):
    return dot(x, k), (x, k)

  def bwd(res, g):
    x, k = res
    d_dims, d_perm = dgrad_dimension_numbers(dims, x.ndim, k.ndim)
    w_dims, w_perm = wgrad_dimension_numbers(dims, x.ndim, k.ndim)
    return (jnp.transpose(jax.lax.dot_general(g, k, d_dims), d_perm),
            jnp.transpose(jax.lax.dot_general(x, g, w_dims), w_perm))

  dot.defvjp(fwd, bwd)
  with jax.enable_x64():
    x = jax.random.normal(jax.random.key(0), x_shape, jnp.float64)
    k = jax.random.normal(jax.random.key(1), k_shape, jnp.float64)
    check_grads(dot, (x, k), order=1, modes=["rev"])


@pytest.mark.parametrize("x_shape,k_shape,dims", DIMENSION_NUMBERS)
def test_fp8_dot_general_matches_float64_dot_general(x_shape, k_shape, dims):
  x = jax.random.normal(jax.random.key(3), x_shape)
  k = jax.random.normal(jax.random.key(4), k_shape)
  meta = fp8jax.init_dot_meta(fp8jax.CurrentScaling())
  out, vjp = jax.vjp(lambda x, k: fp8jax.fp8_dot_general(x, k, meta, dims)[0], x, k)
  g = jax.random.normal(jax.random.key(5), out.shape)
  dx, dk = vjp(g)
  with jax.enable_x64():
    x64, k64, g64 = (jnp.asarray(np.asarray(t), jnp.float64) for t in (x, k, g))
    ref, ref_vjp = jax.vjp(lambda a, b: jax.lax.dot_general(a, b, dims), x64, k64)
    rdx, rdk = ref_vjp(g64)
  # Relative norm error of FP8 dots of normal data: each operand ~2-3% RMS
  # (E4M3) or ~5% (E5M2); products of two stay below 10%.
  for got, want in ((out, ref), (dx, rdx), (dk, rdk)):
    assert got.shape == want.shape
    err = np.linalg.norm(np.asarray(got, np.float64) - np.asarray(want)) / np.linalg.norm(want)
    assert err < 0.1, err


@pytest.mark.parametrize("spec,x_shape,k_shape", [
    ("bsd,dhk->bshk", (2, 5, 32), (32, 4, 8)),
    ("bshk,hkd->bsd", (2, 5, 4, 8), (4, 8, 32)),
    ("btd,dn->bnt", (2, 6, 16), (16, 24)),
    ("bij,bjk->bik", (3, 8, 16), (3, 16, 12)),
])
def test_fp8_einsum_matches_jnp_einsum(spec, x_shape, k_shape):
  x = jax.random.normal(jax.random.key(0), x_shape)
  k = jax.random.normal(jax.random.key(1), k_shape)
  meta = fp8jax.init_dot_meta(fp8jax.CurrentScaling())
  out, vjp = jax.vjp(lambda x, k: fp8jax.fp8_einsum(spec, x, k, meta)[0], x, k)
  # A fixed random cotangent: a loss like sum(sin(out)) would feed the forward
  # FP8 error back into the gradient and test the loss, not the library.
  g = jax.random.normal(jax.random.key(2), out.shape)
  dx, dk = vjp(g)
  with jax.enable_x64():
    x64, k64 = jnp.asarray(np.asarray(x), jnp.float64), jnp.asarray(np.asarray(k), jnp.float64)
    ref, ref_vjp = jax.vjp(lambda x, k: jnp.einsum(spec, x, k), x64, k64)
    rdx, rdk = ref_vjp(jnp.asarray(np.asarray(g), jnp.float64))
  # Same 10% relative-norm budget as the dot_general test above.
  for got, want in ((out, ref), (dx, rdx), (dk, rdk)):
    err = np.linalg.norm(np.asarray(got, np.float64) - np.asarray(want)) / np.linalg.norm(want)
    assert got.shape == want.shape and err < 0.1, err
