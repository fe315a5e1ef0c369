"""`fp8_rms_norm_dense` and the norm in `fp8_mlp`: an RMSNorm made by the FP8 cast after it.

The cast kernel with the norm's prologue (x times each row's r and each column's gain)
runs in the Pallas interpreter against its plain-jnp definition (bit for bit) and
against float64 numpy. The ops are held to the compositions they replace,
`fp8_dot_general(rms_norm(x, scale), kernel)` and `fp8_mlp(rms_norm(x, scale), ...)`,
which tests/test_dense_numerics.py and tests/test_fp8_saved_norm_gelu.py hold to float64:
in float32 nothing is rounded between the norm and the cast in either, so the two must
agree bit for bit, forward and backward. In bf16 they differ by design (the fused cast
reads the float32 norm, the composition its bf16 rounding); there the kernel path is
held to the jnp path a CPU runs, bit for bit. The test marked `hopper` compiles for an
H100 without a GPU.
"""
from __future__ import annotations

import functools
import math
import zlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bitwise import assert_bitwise
from fp8_steps import exact_steps, warm_dot_meta
import fp8jax
from fp8jax import deviceless
from fp8jax.flax.linen import Fp8Dense, Fp8DenseGeneral
from fp8jax.flax.linen_mlp import Fp8Mlp
from fp8jax.lowering.cost import cost
from fp8jax.ops.mlp import fp8_mlp
from fp8jax.flax.linen_telemetry import linen_tensor_stats
from fp8jax.ops.norm_dense import fp8_rms_norm_dense, quantized_input
from fp8jax.telemetry import TELEMETRY_COLLECTION, dot_stats
from fp8_reference import FORMAT_TABLE, quantize_reference
from pallas_kernels import (CastTransposeBlockSizes, cast_transpose_amax_in_chain,
                            cast_transpose_amax_in_chain_reference)
from pallas_kernels.activations import RMS_NORM

BLOCKS = CastTransposeBlockSizes(block_rows=16, block_cols=32)
DELAYED = fp8jax.DelayedScaling()
EPS = 1e-6


def _rng(*key) -> np.random.Generator:
  return np.random.default_rng(zlib.crc32("/".join(map(str, key)).encode()))


@pytest.mark.parametrize("shape", [(100, 72), (256, 128)], ids=["ragged", "aligned"])
def test_the_norm_prologue_is_bitwise_its_definition_and_near_float64(shape):
  rng = _rng("norm prologue", shape)
  x = jnp.asarray(rng.standard_normal(shape) * 3, jnp.bfloat16)
  r = jnp.asarray(rng.uniform(0.2, 2.0, (shape[0], 1)), jnp.float32)
  gain = jnp.asarray(rng.uniform(0.5, 1.5, (1, shape[1])), jnp.float32)
  scale = jnp.float32(448 / 64)
  args = dict(fp8_dtype=jnp.float8_e4m3fn, fp8_max=448.0, prologue=RMS_NORM,
              prologue_inputs=(r, gain), tile_amaxes=True, seeds=1, block_sizes=BLOCKS)
  got = cast_transpose_amax_in_chain(x, scale, None, interpret=True, **args)
  want = cast_transpose_amax_in_chain_reference(x, scale, None, **args)
  assert_bitwise(got, want)
  # Against float64: two float32 products, each within half an ulp (2**-24 relative),
  # then the product with the scale: |error| <= 3 * 2**-24 |value| before the FP8
  # rounding. Where that moves a value across a rounding boundary of the E4M3 grid the
  # element is off by one grid step (2**-3 relative, or the subnormal step).
  value64 = (np.asarray(x, np.float64) * np.asarray(r, np.float64)
             * np.asarray(gain, np.float64))
  expected = quantize_reference(value64, float(scale), "e4m3")
  q = np.asarray(got.q, np.float64)
  table = FORMAT_TABLE["e4m3"]
  step = np.maximum(np.maximum(np.abs(expected), np.abs(q)) * 2.0**-table["mantissa_bits"],
                    table["min_subnormal"])
  assert np.all(np.abs(q - expected) <= step)
  assert np.mean(q != expected) < 1e-3  # only values at a rounding boundary
  np.testing.assert_array_equal(np.asarray(got.q_t, np.float64), q.T)
  amax = float(jnp.max(got.amax))
  assert abs(amax - np.max(np.abs(value64))) <= 3 * 2.0**-24 * amax


def test_row_and_column_inputs_of_the_wrong_shape_are_refused_by_name():
  x = jnp.ones((32, 64), jnp.bfloat16)
  args = dict(fp8_dtype=jnp.float8_e4m3fn, fp8_max=448.0, prologue=RMS_NORM)
  for bad in [jnp.ones((32, 2)), jnp.ones((64, 1)), jnp.ones((32,))]:
    with pytest.raises(ValueError, match=r"prologue_inputs\[0\] has shape"):
      cast_transpose_amax_in_chain(x, jnp.float32(1), jnp.float32(0), interpret=True,
                                   prologue_inputs=(bad, jnp.ones((1, 64))), **args)


def _problem(dtype, seed=0):
  rng = _rng("norm dense", seed)
  # Rows of different magnitudes, so that each row's r differs.
  x = jnp.asarray(rng.standard_normal((2, 48, 96)) * rng.uniform(0.3, 3, (2, 48, 1)), dtype)
  scale = jnp.asarray(rng.uniform(0.5, 1.5, (96,)), jnp.float32)
  kernel = jnp.asarray(rng.standard_normal((96, 4, 40)) / math.sqrt(96), jnp.float32)
  w_out = jnp.asarray(rng.standard_normal((160, 80)) / math.sqrt(160), jnp.float32)
  return x, scale, kernel, w_out


def _dense_steps(fn, recipe, dtype, steps=2):
  """`steps` jitted value_and_grad steps of loss = sum(y * target) through
  `fn(x, scale, kernel, meta)`: the loss, the gradients of x, scale and kernel, and the
  state, of every step."""
  x, scale, kernel, _ = _problem(dtype)
  target = jnp.asarray(_rng("target").standard_normal((2, 48, 4, 40)), jnp.float32)

  def loss(params, meta, factor):
    y, meta = fn(params["x"] * factor.astype(dtype), params["scale"], params["kernel"], meta)
    return jnp.sum(y.astype(jnp.float32) * target), meta

  params = {"x": x, "scale": scale, "kernel": kernel}
  return exact_steps(loss, params, warm_dot_meta(recipe, (60.0, 200.0, 3000.0)), steps)


def _composed_dense(x, scale, kernel, meta):
  return fp8jax.fp8_dot_general(fp8jax.rms_norm(x, scale, eps=EPS), kernel, meta,
                                (((x.ndim - 1,), (0,)), ((), ())))


@pytest.mark.parametrize("recipe", [DELAYED, fp8jax.CurrentScaling()],
                         ids=["delayed", "current"])
def test_fp8_rms_norm_dense_is_bitwise_the_composition_in_float32(recipe):
  got = _dense_steps(fp8_rms_norm_dense, recipe, jnp.float32)
  want = _dense_steps(_composed_dense, recipe, jnp.float32)
  assert_bitwise(got, want)
  (_, _, state), = got[-1:]
  for meta in jax.tree.leaves(state, is_leaf=fp8jax.core.meta.is_meta):
    assert float(meta.amax_history[0]) > 0


@pytest.mark.parametrize("save_fp8", [False, True], ids=["bf16_x", "fp8_x"])
@pytest.mark.parametrize("recipe", [DELAYED, fp8jax.CurrentScaling()],
                         ids=["delayed", "current"])
def test_fp8_rms_norm_dense_on_the_kernel_path_gives_the_jnp_paths_bits(request, recipe,
                                                                         save_fp8):
  """With `save_fp8` the norm's FP8 copy for the backward is written by the cast."""
  dense = functools.partial(fp8_rms_norm_dense, save_fp8=save_fp8)
  want = _dense_steps(dense, recipe, jnp.bfloat16)
  request.getfixturevalue("interpreted_kernels")
  got = _dense_steps(dense, recipe, jnp.bfloat16)
  assert_bitwise(got, want)


def test_in_bf16_the_fused_norm_is_cast_from_float32_not_from_its_bf16_rounding():
  """The difference the fusion makes, and only that: the composition's FP8 input is
  the norm rounded to bf16 (2**-9 relative) before the cast, so its amax is the bf16
  value's; the fused cast's is the float32 value's."""
  (_, _, fused), = _dense_steps(fp8_rms_norm_dense, DELAYED, jnp.bfloat16, steps=1)
  (_, _, composed), = _dense_steps(_composed_dense, DELAYED, jnp.bfloat16, steps=1)
  x, scale, _, _ = _problem(jnp.bfloat16)
  x64 = np.asarray(x, np.float64)
  normed64 = (x64 / np.sqrt(np.mean(x64**2, -1, keepdims=True) + EPS)
              * np.asarray(scale, np.float64))
  # float32 arithmetic, u = 2**-24: the mean of D = 96 squares within D u (relative, a
  # sum's worst case), the rsqrt within half that plus 2 u, and the two products 2 u:
  # (D / 2 + 4) u in all. The composition rounds that value to bf16 too (2**-9 relative).
  amax64 = np.max(np.abs(normed64))
  float32_error = (96 / 2 + 4) * 2.0**-24 * amax64
  assert abs(float(fused.x.amax_history[0]) - amax64) <= float32_error
  assert abs(float(composed.x.amax_history[0]) - amax64) <= 2.0**-9 * amax64 + float32_error
  np.testing.assert_array_equal(np.asarray(composed.x.amax_history[0]),
                                np.asarray(jnp.asarray(fused.x.amax_history[0],
                                                       jnp.bfloat16), np.float32))


def _mlp_steps(fn, dtype):
  """One step of loss = sum(y * target) through `fn(x, residual, scale, w_in, w_out,
  meta_in, meta_out)`: the loss, the gradients of x, the residual, scale and both
  kernels, and the state."""
  x, scale, _, _ = _problem(dtype)
  rng = _rng("mlp weights")
  residual = jnp.asarray(rng.standard_normal(x.shape), dtype)
  w_in = jnp.asarray(rng.standard_normal((96, 160)) / math.sqrt(96), jnp.float32)
  w_out = jnp.asarray(rng.standard_normal((160, 96)) / math.sqrt(160), jnp.float32)
  target = jnp.asarray(rng.standard_normal((2, 48, 96)), jnp.float32)

  def loss(params, state):
    y, meta_in, meta_out = fn(params["x"], params["residual"], params["scale"], params["in"],
                              params["out"], state["in"], state["out"])
    return jnp.sum(y.astype(jnp.float32) * target), {"in": meta_in, "out": meta_out}

  params = {"x": x, "residual": residual, "scale": scale, "in": w_in, "out": w_out}
  state = {"in": warm_dot_meta(DELAYED, (60.0, 200.0, 3000.0)),
           "out": warm_dot_meta(DELAYED, (100.0, 300.0, 2000.0))}
  step = jax.jit(fp8jax.value_and_grad(loss)).lower(params, state).compile(
      compiler_options={"xla_allow_excess_precision": False})
  return step(params, state)


def _fused_sublayer(x, residual, scale, *args):
  return fp8_mlp(x, *args, norm_scale=scale, norm_eps=EPS, residual=residual)


def _composed_sublayer(x, residual, scale, *args):
  s, h = fp8jax.add_rms_norm(x, residual, scale, eps=EPS)
  y, meta_in, meta_out = fp8_mlp(h, *args)
  return s + y, meta_in, meta_out


@pytest.mark.parametrize("with_residual", [False, True], ids=["norm", "add-norm-sublayer"])
def test_fp8_mlp_with_a_norm_is_bitwise_the_norm_then_fp8_mlp_in_float32(with_residual):
  if with_residual:
    fused, composed = _fused_sublayer, _composed_sublayer
  else:
    fused = lambda x, _, scale, *args: fp8_mlp(x, *args, norm_scale=scale, norm_eps=EPS)
    composed = lambda x, _, scale, *args: fp8_mlp(fp8jax.rms_norm(x, scale, eps=EPS), *args)
  assert_bitwise(_mlp_steps(fused, jnp.float32), _mlp_steps(composed, jnp.float32))


def test_in_bf16_fp8_mlp_casts_the_norm_from_float32_and_the_sublayer_is_add_rms_norm_s():
  """What tells the fused sublayer from `add_rms_norm` then `fp8_mlp`: the up projection's
  FP8 input is cast from the float32 norm (the composition's from its bf16 rounding), so
  its amax is the float32 value's, which rounds to the composition's."""
  _, grads, state = _mlp_steps(_fused_sublayer, jnp.bfloat16)
  _, want_grads, want_state = _mlp_steps(_composed_sublayer, jnp.bfloat16)
  fused, composed = state["in"].x.amax_history[0], want_state["in"].x.amax_history[0]
  assert float(fused) != float(composed)
  np.testing.assert_array_equal(np.asarray(composed),
                                np.asarray(jnp.asarray(fused, jnp.bfloat16), np.float32))
  # Both sum the residual stream's gradient from the skip connection and the norm in
  # float32 and round it once: x and the residual get the same gradient, and it is the
  # composition's but where the bf16 norm moved an FP8 value (a few elements of the
  # up projection's input, each by one E4M3 step: 2**-3 of its size, carried through
  # the GEMMs to ds; bounded here by 2**-3 of the largest gradient element).
  assert_bitwise(grads["x"], grads["residual"])
  got, want = (np.asarray(g["x"], np.float32) for g in (grads, want_grads))
  assert np.max(np.abs(got - want)) <= 2.0**-3 * np.max(np.abs(want))


def test_fp8_mlp_with_a_norm_on_the_kernel_path_gives_the_jnp_paths_bits(request):
  want = _mlp_steps(_fused_sublayer, jnp.bfloat16)
  request.getfixturevalue("interpreted_kernels")
  got = _mlp_steps(_fused_sublayer, jnp.bfloat16)
  assert_bitwise(got, want)


@pytest.mark.parametrize("call, message", [
    (lambda x, s, k, m: fp8_rms_norm_dense(x, s, k[:95], m), "kernel's first dimension"),
    (lambda x, s, k, m: fp8_rms_norm_dense(x, s[:95], k, m), "scale must be"),
    (lambda x, s, k, m: fp8_rms_norm_dense(x, s, k, m, eps=-1.0), "eps=-1.0"),
])
def test_bad_arguments_are_refused_by_name(call, message):
  x, scale, kernel, _ = _problem(jnp.float32)
  with pytest.raises(ValueError, match=message):
    call(x, scale, kernel, fp8jax.init_dot_meta(DELAYED))


@pytest.mark.parametrize("kwargs, message", [
    (dict(norm_scale=None), "residual is the add before the MLP's norm"),
    (dict(residual=jnp.zeros((2, 48, 95))), "residual \\(2, 48, 95\\) float32 must have"),
    (dict(w_out=jnp.zeros((160, 80))), "w_out's last dimension must be x's, 96"),
])
def test_a_bad_residual_is_refused_by_name(kwargs, message):
  x, scale, _, _ = _problem(jnp.float32)
  args = dict(w_in=jnp.zeros((96, 160)), w_out=jnp.zeros((160, 96)), norm_scale=scale,
              residual=x, meta_in=fp8jax.init_dot_meta(DELAYED),
              meta_out=fp8jax.init_dot_meta(DELAYED))
  args.update(kwargs)
  with pytest.raises(ValueError, match=message):
    fp8_mlp(x, **args)


class _NormThenDense(nn.Module):
  fused: bool

  @nn.compact
  def __call__(self, x):
    scale = self.param("scale", nn.initializers.ones_init(), (x.shape[-1],))
    scale = scale * jnp.linspace(0.5, 1.5, x.shape[-1])  # gains that differ per column
    layer = Fp8DenseGeneral((4, 40), use_bias=False, name="qkv")
    if self.fused:
      return layer(x, norm_scale=scale, norm_eps=EPS)
    return layer(fp8jax.rms_norm(x, scale, eps=EPS))


def test_flax_layers_take_the_norm_with_the_same_variables_and_numbers_in_float32():
  x, *_ = _problem(jnp.float32)
  variables = _NormThenDense(fused=True).init(jax.random.key(0), x)
  assert jax.tree.map(jnp.shape, variables) == jax.tree.map(
      jnp.shape, _NormThenDense(fused=False).init(jax.random.key(0), x))
  got = _NormThenDense(fused=True).apply(variables, x, mutable=["fp8_meta"])
  want = _NormThenDense(fused=False).apply(variables, x, mutable=["fp8_meta"])
  assert_bitwise(got, want)


def test_flax_layers_refuse_a_norm_they_cannot_apply():
  x, scale, *_ = _problem(jnp.float32)
  with pytest.raises(ValueError, match="norm_scale normalizes x's last axis"):
    Fp8DenseGeneral(8, axis=(-2, -1)).init(jax.random.key(0), x, norm_scale=scale)
  with pytest.raises(ValueError, match=r"x_amax is max\|inputs\|"):
    Fp8Dense(8).init(jax.random.key(0), x, jnp.float32(1), norm_scale=scale)
  with pytest.raises(ValueError, match="norm_save_fp8=True differs"):
    Fp8Mlp(hidden=32).init(jax.random.key(0), x, norm_scale=scale, norm_save_fp8=True)
  with pytest.raises(ValueError, match="features=8 must be the inputs' width 96"):
    Fp8Mlp(hidden=32, features=8).init(jax.random.key(0), x, norm_scale=scale, residual=x)
  # The norm's arguments are named as the layers take them.
  with pytest.raises(ValueError, match=r"norm_scale must be \[C\] = \[96\]"):
    Fp8Dense(8).init(jax.random.key(0), x, norm_scale=scale[:95])
  with pytest.raises(ValueError, match="norm_eps=-1.0 must be a non-negative number"):
    Fp8DenseGeneral(8).init(jax.random.key(0), x, norm_scale=scale, norm_eps=-1.0)
  with pytest.raises(ValueError, match="norm_eps=-1.0 must be a non-negative number"):
    Fp8Mlp(hidden=32).init(jax.random.key(0), x, norm_scale=scale, norm_eps=-1.0)


def test_telemetry_of_a_layer_with_the_norm_is_that_of_the_normalized_input_it_casts():
  x, *_ = _problem(jnp.float32)
  model = _NormThenDense(fused=True)
  variables = model.init(jax.random.key(0), x)
  with linen_tensor_stats():
    _, updates = model.apply(variables, x, mutable=["fp8_meta", TELEMETRY_COLLECTION])
  sown = updates[TELEMETRY_COLLECTION]["qkv"]["x"][0]
  gains = variables["params"]["scale"] * jnp.linspace(0.5, 1.5, x.shape[-1])
  want = dot_stats(quantized_input(x, gains, EPS), variables["params"]["qkv"]["kernel"],
                   variables["fp8_meta"]["qkv"]["dot_meta"])["x"]
  # The stats of the un-normalized x differ (its amax is another), so this can fail.
  assert float(sown.amax) == float(want.amax) != float(jnp.max(jnp.abs(x)))
  for field in ("scale", "saturated", "flushed", "subnormal"):
    assert float(getattr(sown, field)) == float(getattr(want, field))


_MISSING = deviceless.deviceless_toolchain_missing()


@pytest.mark.hopper
@pytest.mark.skipif(_MISSING is not None, reason=str(_MISSING))
def test_h100_norm_and_projection_write_no_normalized_tensor():
  """On an H100 the forward of norm + projection reads x and writes no [tokens, D] tensor
  but the FP8 copies: the norm's reduction writes one float32 per row, the cast kernels
  read x, r and the gains. The composition writes the normalized x in bf16 (the test's
  other half, so the check can fail)."""
  tokens, d, n = 8192, 1024, 3072
  x = jax.ShapeDtypeStruct((tokens, d), jnp.bfloat16)
  scale, kernel = jax.ShapeDtypeStruct((d,), jnp.float32), jax.ShapeDtypeStruct((d, n),
                                                                               jnp.float32)
  meta = jax.eval_shape(lambda: fp8jax.init_dot_meta(DELAYED))
  normalized = tokens * d * 2  # the normalized x in bf16

  def writers(fn):
    report = cost(lambda *args: fn(*args)[0], x, scale, kernel, meta, target="deviceless")
    casts = [k for k in report.kernels if "cast_transpose_amax" in k.op_name]
    assert len(casts) == 2, report.table()
    return [k for k in report.kernels if not k.is_gemm and k not in casts
            and k.bytes_out >= normalized]

  assert writers(fp8_rms_norm_dense) == []
  assert len(writers(_composed_dense)) == 1
