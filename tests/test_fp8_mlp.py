"""`fp8_mlp` and `Fp8Mlp`: the GELU done by the FP8 casts around it.

The cast kernel with a prologue runs in the Pallas interpreter against its plain-jnp
definition (bit for bit) and against float64 numpy; `fp8_mlp` against the composition it
replaces, `fp8_dense(gelu(fp8_dense(x, w_in)), w_out)`, which tests/test_dense_numerics.py
holds to float64: in float32 the two are the same arithmetic (the composition's GELU is
float32 too, so nothing is rounded to bf16 between them), so they must agree bit for bit,
forward and backward, and in the state to the last bit of an amax. The test marked `hopper` compiles for an H100 without a GPU.
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
from fp8jax.flax.linen import Fp8Dense
from fp8jax.flax.linen_mlp import Fp8Mlp
from fp8jax.lowering.cost import cost
from fp8jax.lowering.compile import compile_program
from fp8jax.lowering.gemms import find_gemms
from fp8jax.lowering.hlo_text import parse_hlo_module
from fp8jax.lowering.inspection import CUBLAS_ONLY_OPTIONS
from fp8jax.lowering.report import GemmKind
from fp8jax.ops import saved_activations
from fp8jax.ops.gelu import gelu
from fp8jax.ops.mlp import fp8_mlp
from fp8_reference import FORMAT_TABLE, quantize_reference
from multidevice import multidevice
from pallas_kernels import (CastTransposeBlockSizes, cast_transpose_amax_in_chain,
                            cast_transpose_amax_in_chain_reference)
from pallas_kernels.activations import GELU, GELU_BACKWARD, GELU_BACKWARD_FROM_FP8, RMS_NORM

BLOCKS = CastTransposeBlockSizes(block_rows=16, block_cols=32)
DELAYED = fp8jax.DelayedScaling()


def _rng(*key) -> np.random.Generator:
  return np.random.default_rng(zlib.crc32("/".join(map(str, key)).encode()))


def _gelu64(h):
  c, a = math.sqrt(2 / math.pi), 0.044715
  return 0.5 * h * (1 + np.tanh(c * (h + a * h**3)))


def _gelu64_derivative(h):
  c, a = math.sqrt(2 / math.pi), 0.044715
  t = np.tanh(c * (h + a * h**3))
  return 0.5 * (1 + t) + 0.5 * h * (1 - t * t) * c * (1 + 3 * a * h * h)


@pytest.mark.parametrize("shape", [(100, 72), (256, 128)], ids=["ragged", "aligned"])
@pytest.mark.parametrize("backward", [False, True], ids=["gelu", "gelu_backward"])
def test_a_cast_with_a_prologue_is_bitwise_its_definition_and_near_float64(shape, backward):
  rng = _rng("prologue", shape, backward)
  h = jnp.asarray(rng.standard_normal(shape) * 3, jnp.bfloat16)
  g = jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
  x, prologue, inputs, fmt = ((g, GELU_BACKWARD, (h,), jnp.float8_e5m2) if backward
                              else (h, GELU, (), jnp.float8_e4m3fn))
  fp8_max = float(jnp.finfo(fmt).max)
  scale = jnp.float32(fp8_max / 16)
  args = dict(fp8_dtype=fmt, fp8_max=fp8_max, prologue=prologue, prologue_inputs=inputs,
              tile_amaxes=True, seeds=1, block_sizes=BLOCKS)
  got = cast_transpose_amax_in_chain(x, scale, None, interpret=True, **args)
  want = cast_transpose_amax_in_chain_reference(x, scale, None, **args)
  assert_bitwise(got, want)
  # Against float64: the function in float64, then the format's rounding (tests/
  # fp8_reference.py). The kernel evaluates the function in float32, where 1 + tanh(u)
  # and 1 - tanh(u)**2 cancel for large |h|: its value is off by up to
  # (|h| + 2 |g| (1 + |h| (1 + 3 a h**2))) float32 ulps of 1 (2**-23 each; the GELU's
  # term is |h| of them, its derivative's the rest). Where that moves a value across a
  # rounding boundary of the FP8 grid the element is off by that error plus one grid
  # step (2**-3 relative in E4M3, 2**-2 in E5M2, or the subnormal step).
  h64, g64 = np.asarray(h, np.float64), np.asarray(g, np.float64)
  value64 = g64 * _gelu64_derivative(h64) if backward else _gelu64(h64)
  ulps = (2 * np.abs(g64) * (1 + np.abs(h64) * (1 + 3 * 0.044715 * h64**2)) if backward
          else np.abs(h64))
  float32_error = ulps * 2.0**-23 * float(scale)
  name = "e5m2" if backward else "e4m3"
  expected = quantize_reference(value64, float(scale), name)
  q = np.asarray(got.q, np.float64)
  table = FORMAT_TABLE[name]
  step = np.maximum(np.maximum(np.abs(expected), np.abs(q)) * 2.0**-table["mantissa_bits"],
                    table["min_subnormal"])
  assert np.all(np.abs(q - expected) <= step + float32_error)
  # Where the float32 error is negligible, only values at a rounding boundary differ.
  clean = float32_error < step * 2.0**-8
  assert clean.mean() > 0.5 and np.mean((q != expected)[clean]) < 1e-3
  np.testing.assert_array_equal(np.asarray(got.q_t, np.float64), q.T)
  # The amax is the float32 function's: max|value| within its float32 error.
  amax = float(jnp.max(got.amax))
  assert abs(amax - np.max(np.abs(value64))) <= np.max(float32_error) / float(scale) + 2.0**-20


@pytest.mark.parametrize("shape", [(100, 300), (40, 128)], ids=["three_groups", "one_group"])
@pytest.mark.parametrize("interpret", [True, False], ids=["kernel", "jnp"])
def test_the_gelu_backward_from_the_kept_fp8_copy_casts_the_bits_of_the_restored_copy(
    shape, interpret):
  """The GELU's backward reading h as the forward's FP8 copy (codes and one descale per row
  and group of 128 columns, the last group ragged here) casts what the backward of the
  bf16 h that copy restores to casts: codes times a power of two are exact in float32 and
  in bf16, so the two prologues compute the same function of the same numbers. In jnp the
  bits are the same; in the kernel XLA may contract the product h = codes * descale into
  the GELU's multiply-adds (a float32 ulp or two of a value, as between the kernel and
  its jnp definition), so there a value may round to the neighbouring FP8 number."""
  rng = _rng("from_fp8", shape)
  h = jnp.asarray(rng.standard_normal(shape) * 3, jnp.bfloat16)
  g = jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
  kept = saved_activations.save(h, "gelu")
  restored = saved_activations.restore(kept, jnp.bfloat16)
  assert kept.scale_inv.shape == (shape[0], -(-shape[1] // 128))
  # One group per tile: the descales are read a row of a tile at a time.
  args = dict(fp8_dtype=jnp.float8_e5m2, fp8_max=57344.0, tile_amaxes=True, seeds=1,
              block_sizes=CastTransposeBlockSizes(block_rows=16, block_cols=128))
  cast = (functools.partial(cast_transpose_amax_in_chain, interpret=True) if interpret
          else cast_transpose_amax_in_chain_reference)
  scale = jnp.float32(3584.0)
  got = cast(g, scale, None, prologue=GELU_BACKWARD_FROM_FP8,
             prologue_inputs=tuple(kept), **args)
  want = cast(g, scale, None, prologue=GELU_BACKWARD, prologue_inputs=(restored,), **args)
  if not interpret:
    assert_bitwise(got, want)
  # A few float32 ulps (2**-20 relative) of the function's value.
  np.testing.assert_allclose(np.asarray(got.amax), np.asarray(want.amax), rtol=2.0**-20)
  q, q_want = np.asarray(got.q, np.float64), np.asarray(want.q, np.float64)
  # One E5M2 step (2**-2 relative, or the subnormal step 2**-16) where they differ.
  step = np.maximum(np.maximum(np.abs(q), np.abs(q_want)) * 2.0**-2, 2.0**-16)
  assert np.all(np.abs(q - q_want) <= step) and np.mean(q != q_want) < 1e-3
  np.testing.assert_array_equal(np.asarray(got.q_t, np.float64), q.T)
  assert float(jnp.max(got.amax)) > 0


def test_a_prologue_input_per_group_needs_tiles_one_group_wide():
  h = jnp.ones((32, 256), jnp.bfloat16)
  kept = saved_activations.save(h, "gelu")
  with pytest.raises(ValueError, match="block_cols=128"):
    cast_transpose_amax_in_chain(h, jnp.float32(1), None, fp8_dtype=jnp.float8_e5m2,
                                 fp8_max=57344.0, prologue=GELU_BACKWARD_FROM_FP8,
                                 prologue_inputs=tuple(kept), tile_amaxes=True,
                                 block_sizes=BLOCKS, interpret=True)


def _problem(dtype, seed=0):
  rng = _rng("mlp", seed)
  x = jnp.asarray(rng.standard_normal((2, 48, 96)), dtype)
  w_in = jnp.asarray(rng.standard_normal((96, 160)) / math.sqrt(96), jnp.float32)
  w_out = jnp.asarray(rng.standard_normal((160, 80)) / math.sqrt(160), jnp.float32)
  target = jnp.asarray(rng.standard_normal((2, 48, 80)), jnp.float32)
  return x, w_in, w_out, target


def _steps(fn, recipe, dtype, steps=2):
  """`steps` jitted value_and_grad steps of loss = sum(y * target) through `fn`: the loss,
  the gradients of x and both kernels, and the FP8 state, of every step."""
  x, w_in, w_out, target = _problem(dtype)
  state = {"in": warm_dot_meta(recipe, (60.0, 200.0, 3000.0)),
           "out": warm_dot_meta(recipe, (100.0, 300.0, 2000.0))}

  def loss(params, state, factor):
    y, meta_in, meta_out = fn(params["x"] * factor.astype(dtype), params["in"],
                              params["out"], state["in"], state["out"])
    return jnp.sum(y.astype(jnp.float32) * target), {"in": meta_in, "out": meta_out}

  params = {"in": w_in, "out": w_out, "x": x}
  return exact_steps(loss, params, state, steps)


def _composition(x, w_in, w_out, meta_in, meta_out):
  h, meta_in = fp8jax.fp8_dense(x, w_in, None, meta_in)
  y, meta_out = fp8jax.fp8_dense(gelu(h), w_out, None, meta_out)
  return y, meta_in, meta_out


@pytest.mark.parametrize("recipe", [DELAYED, fp8jax.CurrentScaling()],
                         ids=["delayed", "current"])
def test_fp8_mlp_is_bitwise_the_composition_in_float32(recipe):
  (loss, grads, state), = _steps(fp8_mlp, recipe, jnp.float32, steps=1)
  (want_loss, want_grads, want_state), = _steps(_composition, recipe, jnp.float32, steps=1)
  assert_bitwise((loss, grads), (want_loss, want_grads))
  # The state: the same, but the two programs fuse the float32 GELU differently.
  _assert_state_close(state, want_state)
  # Every role recorded an amax, the output gradients' in the backward pass.
  for meta in jax.tree.leaves(state, is_leaf=fp8jax.core.meta.is_meta):
    assert float(meta.amax_history[0]) > 0


@pytest.mark.parametrize("recipe", [DELAYED, fp8jax.CurrentScaling()],
                         ids=["delayed", "current"])
def test_fp8_mlp_on_the_kernel_path_gives_the_jnp_paths_bits(request, recipe):
  """bf16 activations, the prologue casts on the Pallas kernels (interpreted) against the
  jnp path a CPU runs (under current scaling each cast makes its scale from the GELU's
  amax, reduced before it)."""
  want = _steps(fp8_mlp, recipe, jnp.bfloat16)
  request.getfixturevalue("interpreted_kernels")
  got = _steps(fp8_mlp, recipe, jnp.bfloat16)
  for (loss, grads, state), (want_loss, want_grads, want_state) in zip(got, want):
    assert_bitwise((loss, grads), (want_loss, want_grads))
    _assert_state_close(state, want_state)


@pytest.mark.parametrize("norm", [False, True], ids=["mlp", "norm_mlp"])
@pytest.mark.parametrize("recipe", [DELAYED, fp8jax.CurrentScaling()],
                         ids=["delayed", "current"])
def test_fp8_mlp_with_its_gelu_input_kept_in_fp8_gives_the_jnp_paths_numbers_on_the_kernels(
    request, recipe, norm, reduced_prologues):
  """`save_fp8` on the Pallas kernels (interpreted) against the jnp path: the casts that
  read the norm's and the GELU's inputs write their FP8 copies (two groups of columns, the
  second ragged), the GELU's backward cast reads its copy's codes and descales."""
  gain = jnp.asarray(_rng("gain").uniform(0.5, 1.5, 96), jnp.float32) if norm else None
  mlp = functools.partial(fp8_mlp, save_fp8=True, norm_scale=gain)
  want = _steps(mlp, recipe, jnp.bfloat16)
  request.getfixturevalue("interpreted_kernels")
  got = _steps(mlp, recipe, jnp.bfloat16)
  if recipe.scales_from_tensor:
    assert GELU_BACKWARD_FROM_FP8 in reduced_prologues, reduced_prologues
  for (loss, grads, state), (want_loss, want_grads, want_state) in zip(got, want):
    assert_bitwise((loss, grads), (want_loss, want_grads))
    _assert_state_close(state, want_state)


def _assert_state_close(state, want):
  """The same FP8 state, but for the last bit of an amax (and a scale made from it): the
  kernel's float32 GELU and the jnp path's XLA fusion may contract multiply-adds
  differently, which can round the largest value of a tensor one ulp apart."""
  assert jax.tree.structure(state) == jax.tree.structure(want)
  for got, expected in zip(jax.tree.leaves(state), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=2.0**-22, atol=0)


@pytest.mark.parametrize("kwargs, message", [
    (dict(activation="relu"), "activation='relu' is not one of"),
    (dict(w_in=jnp.zeros((95, 160))), "the shapes do not chain"),
    (dict(w_out=jnp.zeros((160, 80, 1))), "w_out \\[F, N\\]"),
    (dict(meta_out=fp8jax.init_dot_meta(fp8jax.CurrentScaling())), "share a recipe"),
])
def test_bad_arguments_are_refused_by_name(kwargs, message):
  x, w_in, w_out, _ = _problem(jnp.float32)
  args = dict(x=x, w_in=w_in, w_out=w_out, meta_in=fp8jax.init_dot_meta(DELAYED),
              meta_out=fp8jax.init_dot_meta(DELAYED))
  args.update(kwargs)
  activation = args.pop("activation", "gelu")
  with pytest.raises(ValueError, match=message):
    fp8_mlp(**args, activation=activation)


def test_gelu_derivative_stays_finite_where_h_squared_overflows():
  """Past |h| ~ 1.8e19 (a bf16 value) h*h is inf in float32; gelu' is 1 above, 0 below."""
  from pallas_kernels.activations import gelu_tanh_derivative
  h = jnp.array([1e20, -1e20, 3e38, -3e38, 12.0, -12.0], jnp.float32)
  np.testing.assert_array_equal(np.asarray(gelu_tanh_derivative(h)), [1, 0, 1, 0, 1, 0])
  # Where nothing overflows it is the float64 formula's, within the float32 error the
  # prologue test above allows for g = 1: 1 - tanh(u)**2 cancels, so a few ulps of tanh
  # (XLA's float32 tanh is off by up to ~4 ulps of 2**-24) become
  # 2 (1 + |h| (1 + 3 a h**2)) ulps of 2**-23 in the derivative.
  h = _rng("derivative").normal(scale=4.0, size=4096).astype(np.float32)
  h64 = h.astype(np.float64)
  bound = 2 * (1 + np.abs(h64) * (1 + 3 * 0.044715 * h64**2)) * 2.0**-23
  error = np.abs(np.asarray(gelu_tanh_derivative(jnp.asarray(h)), np.float64)
                 - _gelu64_derivative(h64))
  assert np.all(error <= bound)


def test_under_current_scaling_the_casts_make_the_norm_and_the_gelu_from_their_amaxes(
    reduced_prologues):
  """The fused form runs under current scaling too: the up projection's cast makes the
  norm and the GELU's backward, the down projection's the GELU, each after a reduction of
  that function's amax from its inputs (three, none of x itself)."""
  x, w_in, w_out, _ = _problem(jnp.float32)
  meta = fp8jax.init_dot_meta(fp8jax.CurrentScaling())

  def loss(x, w_in, w_out):
    y, *_ = fp8_mlp(x, w_in, w_out, meta, meta, norm_scale=jnp.ones((96,)))
    return jnp.sum(y.astype(jnp.float32))

  jax.grad(loss)(x, w_in, w_out)
  assert reduced_prologues == [RMS_NORM, GELU, GELU_BACKWARD], reduced_prologues


@multidevice
def test_current_scaling_s_fused_casts_on_a_data_mesh_give_the_one_device_step(
    interpreted_kernels, reduced_prologues):
  """The fused MLP with its norm under current scaling, its rows split over 8 devices,
  its casts on the (interpreted) kernels: each device casts its rows of the norm, the GELU
  and the GELU's backward with the prologue's inputs split alike (the per-row 1/rms with
  them, the gains whole), with the scale of the whole tensor's amax. The step is the
  one-device step's within float32 summation order: XLA on CPU compiles the sharded
  program's row reductions and 12-row products unlike the 96-row ones (a last bit of a
  norm's 1/rms, of a GEMM's output), and the weight gradients sum rows across devices.
  A prologue input split unlike its rows, or a scale from one shard's amax, is off by far
  more."""
  from jax.sharding import NamedSharding, PartitionSpec as P
  # float32 activations: in bf16 a last-bit difference of a GEMM's accumulation is
  # rounded up to 2**-8 of a value.
  x, w_in, w_out, target = _problem(jnp.float32)
  x, target = x.reshape(-1, 96), target.reshape(-1, 80)   # 96 rows: 12 per device
  gain = jnp.asarray(_rng("gain").uniform(0.5, 1.5, 96), jnp.float32)
  state = {"in": warm_dot_meta(fp8jax.CurrentScaling(), (60.0, 200.0, 3000.0)),
           "out": warm_dot_meta(fp8jax.CurrentScaling(), (100.0, 300.0, 2000.0))}

  def loss(params, state, x):
    y, meta_in, meta_out = fp8_mlp(x, params["in"], params["out"], state["in"], state["out"],
                                   norm_scale=gain)
    return jnp.sum(y.astype(jnp.float32) * target), {"in": meta_in, "out": meta_out}

  step = jax.jit(fp8jax.value_and_grad(loss))
  params = {"in": w_in, "out": w_out}
  want = step(params, state, x)
  rows = NamedSharding(jax.sharding.Mesh(np.array(jax.devices()[:8]), ("data",)), P("data"))
  got = step(params, state, jax.device_put(x, rows))
  assert reduced_prologues, "the fused casts did not run"
  _assert_mesh_step_close(got, want)


@multidevice
def test_the_gelu_backward_from_fp8_on_a_data_and_model_mesh_gives_the_one_device_step(
    interpreted_kernels):
  """`save_fp8` with the hidden features split over a model axis (2 x 128 columns) and
  the rows over a data axis (4): each device's GELU-backward cast reads its own codes and
  its own groups' descales, split as the codes' columns in whole groups. The step is the
  one-device step's within float32 summation order (the split contractions' partial sums
  add in another order); a descale read from another device's group would be off by a
  power of two."""
  from jax.sharding import NamedSharding, PartitionSpec as P
  rng = _rng("model_mesh")
  x = jnp.asarray(rng.standard_normal((64, 96)), jnp.float32)
  w_in = jnp.asarray(rng.standard_normal((96, 256)) / math.sqrt(96), jnp.float32)
  w_out = jnp.asarray(rng.standard_normal((256, 80)) / math.sqrt(256), jnp.float32)
  target = jnp.asarray(rng.standard_normal((64, 80)), jnp.float32)
  state = {"in": warm_dot_meta(DELAYED, (60.0, 200.0, 3000.0)),
           "out": warm_dot_meta(DELAYED, (100.0, 300.0, 2000.0))}

  def loss(params, state, x):
    y, meta_in, meta_out = fp8_mlp(x, params["in"], params["out"], state["in"], state["out"],
                                   save_fp8=True)
    return jnp.sum(y.astype(jnp.float32) * target), {"in": meta_in, "out": meta_out}

  step = jax.jit(fp8jax.value_and_grad(loss))
  want = step({"in": w_in, "out": w_out}, state, x)
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("data", "model"))
  put = lambda a, *spec: jax.device_put(a, NamedSharding(mesh, P(*spec)))
  got = step({"in": put(w_in, None, "model"), "out": put(w_out, "model", None)}, state,
             put(x, "data"))
  _assert_mesh_step_close(got, want)


def _assert_mesh_step_close(got, want):
  """A sharded step's (loss, grads, state) against the one-device step's: each amax within
  a few float32 ulps (2**-20), and its scale with it; the loss and gradients within float32
  summation order (rows and split contractions summed across devices)."""
  (got_loss, got_grads, got_state), (want_loss, want_grads, want_state) = got, want
  for a, b in zip(jax.tree.leaves(got_state), jax.tree.leaves(want_state)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2.0**-20)
  np.testing.assert_allclose(float(got_loss), float(want_loss), rtol=1e-5)
  for a, b in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


def test_a_prologue_with_a_known_amax_of_x_is_refused():
  """x_amax is max|x|; the cast quantizes the prologue's result, whose amax differs."""
  from fp8jax.ops import dot
  x, w_in, _, _ = _problem(jnp.float32)
  meta = fp8jax.init_dot_meta(fp8jax.CurrentScaling())
  with pytest.raises(ValueError, match=r"x_amax is max\|x\|, not the amax of the x_prologue"):
    dot.matrix_fwd(x, w_in, meta, None, None, x_amax=jnp.float32(1), x_prologue=GELU)


class _DensePair(nn.Module):
  """The same MLP written with two `Fp8Dense` layers and the GELU between them."""

  @nn.compact
  def __call__(self, x):
    h = Fp8Dense(160, use_bias=False, name="up")(x)
    return Fp8Dense(80, use_bias=False, name="down")(gelu(h))


def test_fp8_mlp_layer_keeps_its_params_and_state_where_a_dense_pair_does():
  x, *_ = _problem(jnp.float32)
  mlp = Fp8Mlp(hidden=160, features=80)
  variables = mlp.init(jax.random.key(0), x)
  pair = _DensePair().init(jax.random.key(1), x)
  assert jax.tree.structure(variables) == jax.tree.structure(pair)
  assert jax.tree.map(jnp.shape, variables) == jax.tree.map(jnp.shape, pair)
  # Loaded into either, the same variables give the same output and state.
  y, new = mlp.apply(pair, x, mutable=["fp8_meta"])
  y_pair, new_pair = _DensePair().apply(pair, x, mutable=["fp8_meta"])
  assert_bitwise((y, new), (y_pair, new_pair))


_MISSING = deviceless.deviceless_toolchain_missing()


@pytest.mark.hopper
@pytest.mark.skipif(_MISSING is not None, reason=str(_MISSING))
@pytest.mark.parametrize("save_fp8", [False, True], ids=["bf16_h", "fp8_h"])
def test_h100_mlp_step_writes_no_activation_or_its_gradient_in_bf16(save_fp8):
  """On an H100 the GELU and its backward run inside the casts: besides the six GEMMs,
  the step launches the six casts (x, both weights, the activation; both output
  gradients) and the state update, and no other kernel moves a [tokens, F] tensor. With
  the GELU's input kept in FP8 (`save_fp8`) no other kernel makes or restores that copy
  either: the activation's cast writes it, the gradient's cast reads it."""
  tokens, d, f = 8192, 512, 2048
  params = (jax.ShapeDtypeStruct((tokens, d), jnp.bfloat16),  # x too: its gradient runs
            jax.ShapeDtypeStruct((d, f), jnp.float32), jax.ShapeDtypeStruct((f, d), jnp.float32))
  meta = jax.eval_shape(lambda: fp8jax.init_dot_meta(DELAYED))

  def loss(params, state):
    y, meta_in, meta_out = fp8_mlp(*params, state["in"], state["out"], save_fp8=save_fp8)
    return jnp.mean(y.astype(jnp.float32) ** 2), {"in": meta_in, "out": meta_out}

  report = cost(fp8jax.value_and_grad(loss), params, {"in": meta, "out": meta},
                target="deviceless")
  casts = [k for k in report.kernels if "cast_transpose_amax" in k.op_name]
  assert len(casts) == 6 and len([k for k in report.kernels if k.is_gemm]) == 6, report.table()
  hidden = tokens * f * 2  # one [tokens, F] tensor in bf16
  movers = [k for k in report.kernels if not k.is_gemm and k not in casts
            and k.bytes_in + k.bytes_out >= hidden]
  assert not movers, report.table()
  # The activation's cast reads h once; the gradient's reads da and h (h's FP8 copy with
  # save_fp8: half of h's bytes, which the activation's cast writes besides its own).
  reads = sorted(k.bytes_in / hidden for k in casts if k.bytes_in >= hidden)
  writes = max(k.bytes_out / hidden for k in casts)
  if save_fp8:
    assert reads[0] == pytest.approx(1, rel=1e-3) and reads[1] == pytest.approx(1.5, rel=0.02)
    assert writes == pytest.approx(1.5, rel=0.02), writes
  else:
    assert reads == pytest.approx([1, 2], rel=1e-3) and writes == pytest.approx(1, rel=1e-3)


def _forward_values_the_backward_reads(save_fp8: bool, tokens: int, d: int, f: int,
                                       remat: bool = False) -> tuple[list, int]:
  """One H100-compiled fp8_mlp step (its norm made by the up projection's cast; `remat`:
  under `jax.checkpoint` with the saved-activations policy): the arrays a forward
  instruction writes and a backward one reads, as 'dtype[dims]', and its FP8 GEMMs."""
  params = (jax.ShapeDtypeStruct((tokens, d), jnp.bfloat16),
            jax.ShapeDtypeStruct((d, f), jnp.float32), jax.ShapeDtypeStruct((f, d), jnp.float32),
            jax.ShapeDtypeStruct((d,), jnp.float32))
  meta = jax.eval_shape(lambda: fp8jax.init_dot_meta(DELAYED))

  def mlp(x, w_in, w_out, gain, meta_in, meta_out):
    return fp8_mlp(x, w_in, w_out, meta_in, meta_out, save_fp8=save_fp8, norm_scale=gain)

  if remat:
    mlp = jax.checkpoint(mlp, policy=saved_activations.policy())

  def loss(params, state):
    y, meta_in, meta_out = mlp(*params, state["in"], state["out"])
    return jnp.mean(y.astype(jnp.float32) ** 2), {"in": meta_in, "out": meta_out}

  compiled, _ = compile_program(fp8jax.value_and_grad(loss), params,
                                {"in": meta, "out": meta}, target="deviceless",
                                compiler_options=dict(CUBLAS_ONLY_OPTIONS))
  module = parse_hlo_module(compiled.as_text())
  entry = module.computations[module.entry].instructions
  backward = lambda instr: "transpose(" in instr.op_name
  read_backward = {name for instr in entry.values() if backward(instr)
                   for name in instr.operands}
  kept = sorted(str(instr.shape) for name, instr in entry.items()
                if name in read_backward and not backward(instr) and instr.op_name
                and instr.shape is not None and instr.opcode != "parameter")
  return kept, sum(gemm.kind is GemmKind.CUBLASLT_FP8 for gemm in find_gemms(module))


@pytest.mark.hopper
@pytest.mark.skipif(_MISSING is not None, reason=str(_MISSING))
def test_h100_mlp_step_with_fp8_saved_activations_keeps_the_gelu_input_only_in_fp8():
  """`save_fp8`: the backward reads the GELU's input h [tokens, F] as its FP8 copy made in
  the forward, and no bf16 h. With `save_fp8=False` it reads the bf16 h: the check sees
  both. Under the saved-activations remat policy the step keeps the copy too and
  recomputes no GEMM (six FP8 GEMMs, as without remat)."""
  tokens, d, f = 4096, 256, 1024
  hidden, codes = f"bf16[{tokens},{f}]", f"f8e4m3fn[{tokens},{f}]"
  kept, gemms = _forward_values_the_backward_reads(True, tokens, d, f)
  assert hidden not in kept and codes in kept and gemms == 6, (kept, gemms)
  kept_remat, gemms_remat = _forward_values_the_backward_reads(True, tokens, d, f, remat=True)
  assert hidden not in kept_remat and codes in kept_remat and gemms_remat == 6, (
      kept_remat, gemms_remat)
  assert hidden in _forward_values_the_backward_reads(False, tokens, d, f)[0]
