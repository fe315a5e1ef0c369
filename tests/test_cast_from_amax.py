"""Current scaling's cast in one launch: the kernel makes the scale from the tensor's amax.

`pallas_kernels.cast_transpose_from_amax` takes max|x| (measured before it, by whoever
wrote x or by a reduction) and makes, in the kernel, what XLA made in a kernel of a few
bytes each: the scale `fmt_max / 2**margin / amax` (or the fallback scale), its
reciprocal, the GEMMs' combined descales and the running amax. Here the kernel runs in
the Pallas interpreter against its plain-jnp definition (bit for bit), the definition
against float64 numpy and `fp8jax`'s own scale rule, and the compiled H100 kernel is
checked for an IEEE division (Triton's own float32 `/` is approximate).
"""
from __future__ import annotations

import glob
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp8jax
import pallas_kernels
from fp8jax import deviceless
from fp8jax.core.quantize import scale_from_amax
from fp8jax.ops import fused_kernels
from pallas_kernels import (CastTransposeBlockSizes, cast_transpose_amax_in_chain_reference,
                            cast_transpose_amax_reference, cast_transpose_from_amax,
                            cast_transpose_from_amax_reference)
from pallas_kernels.activations import GELU, GELU_BACKWARD, RMS_NORM
from pallas_kernels.rotary_gradient import rotary_qkv_gradient
from bitwise import assert_bitwise
from test_cast_chain import _rng
from test_norm_qkv_rope import _gradients, _rotary_inputs

FORMATS = {"e4m3": (fp8jax.E4M3, jnp.float8_e4m3fn, 448.0),
           "e5m2": (fp8jax.E5M2, jnp.float8_e5m2, 57344.0)}
# Ragged in both dimensions (7 x 3 tiles of 16 x 32), smaller than one tile, aligned.
SHAPES = [(100, 72), (1, 16), (256, 128)]
BLOCKS = CastTransposeBlockSizes(block_rows=16, block_cols=32)
# What x's cast copies through for the state update (scales, histories, an amax).
STATE = (jnp.float32(3.0), jnp.arange(16, dtype=jnp.float32) / 7, jnp.float32(0.125))


def _tensor(rng, shape, dtype, magnitude):
  return jnp.asarray(rng.standard_normal(shape) * magnitude, dtype)


def _amax64(x) -> np.float32:
  return np.float32(np.max(np.abs(np.asarray(x, np.float64))))  # exact for these dtypes


def _both(x, amax, fallback, amax_in, fmt, **options):
  _, dtype, fp8_max = FORMATS[fmt]
  kwargs = dict(fp8_dtype=dtype, fp8_max=fp8_max, **options)
  got = cast_transpose_from_amax(x, amax, fallback, amax_in, block_sizes=BLOCKS,
                                 interpret=True, **kwargs)
  want = cast_transpose_from_amax_reference(x, amax, fallback, amax_in, **kwargs)
  return got, want


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32],
                         ids=["bf16", "f16", "f32"])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_kernel_is_bitwise_its_definition_with_every_output(shape, dtype, fmt):
  rng = _rng("kernel", shape, jnp.dtype(dtype).name, fmt)
  x = _tensor(rng, shape, dtype, 3.0)
  amax = _amax64(x)
  for margin, power_of_two in ((0, False), (2, True)):
    got, want = _both(x, amax, jnp.float32(0.5), jnp.float32(amax / 4), fmt, margin=margin,
                      power_of_two=power_of_two, partner_descales=(jnp.float32(0.37),
                                                                    jnp.float32(3e38)),
                      pass_through=STATE)
    assert_bitwise(got, want)
    assert got.passed[1].shape == (16,)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_definition_makes_the_float64_scale_and_casts_with_it(fmt):
  """The scale is the correctly rounded float32 quotient (float64 division of two
  float32 values rounded once to float32 is exact: 53 >= 2 * 24 + 2 bits), the descale
  1 / scale likewise, and q is `cast_transpose_amax_reference`'s cast with that scale,
  itself checked against float64 FP8 rounding in test_cast_transpose."""
  fp8_format, dtype, fp8_max = FORMATS[fmt]
  x = _tensor(_rng("float64", fmt), (100, 72), jnp.bfloat16, 5.0)
  amax = _amax64(x)
  for margin in (0, 3):
    got = cast_transpose_from_amax_reference(
        x, amax, jnp.float32(1), jnp.float32(0), fp8_dtype=dtype, fp8_max=fp8_max,
        margin=margin, partner_descales=(jnp.float32(0.25),))
    scale = np.float32(np.float64(fp8_max) / 2.0**margin / np.float64(amax))
    assert float(got.descale) == np.float32(1.0 / np.float64(scale))
    q, q_t, _ = cast_transpose_amax_reference(x, scale, jnp.float32(0), fp8_dtype=dtype,
                                              fp8_max=fp8_max)
    assert_bitwise((got.q, got.q_t), (q, q_t))
    # The product is the float32 product of two float32 values: exact in float64.
    assert float(got.products[0]) == np.float32(np.float64(got.descale) * 0.25)
    # fp8jax's own rule for the same scale (`scale_from_amax`) agrees bit for bit.
    rule = scale_from_amax(jnp.float32(amax), fp8_format, margin, fallback=jnp.float32(1))
    assert_bitwise(got.descale, jnp.float32(1) / rule)
    assert float(got.amax) == amax


@pytest.mark.parametrize("amax", [0.75, 0.0], ids=["scale-from-amax", "fallback"])
def test_a_fallback_scale_and_running_amax_read_from_a_packed_vector_give_the_same_bits(amax):
  """`VectorElement`s (as `fp8jax.ops.fused_kernels.packed_scalars` hands a stacked state's
  scalars over) for the fallback scale and the running amax: the kernel and its definition
  read the same numbers as from arrays of their own; the other elements are not read."""
  x = _tensor(_rng("packed"), (100, 72), jnp.bfloat16, 2.0)
  vector = jnp.asarray([9.0, 8.0, 1.5, -3.0], jnp.float32)
  fallback, amax_in = (pallas_kernels.VectorElement(vector, i) for i in (1, 2))
  x_amax = jnp.float32(_amax64(x)) if amax else jnp.float32(0.0)
  for got, want in zip(_both(x, x_amax, fallback, amax_in, "e4m3"),
                       _both(x, x_amax, jnp.float32(8.0), jnp.float32(1.5), "e4m3")):
    assert_bitwise(got, want)


@pytest.mark.parametrize("amax", [0.0, np.inf, np.nan, 1e-45], ids=["zero", "inf", "nan",
                                                                    "quotient-overflows"])
def test_an_amax_that_gives_no_scale_keeps_the_fallback(amax):
  """0, inf, NaN give no finite positive scale; so does the smallest subnormal, whose
  quotient overflows to inf. The fallback scale is used and recorded amaxes keep NaN."""
  x = _tensor(_rng("fallback"), (100, 72), jnp.bfloat16, 2.0)
  fallback = jnp.float32(8.0)
  got, want = _both(x, jnp.float32(amax), fallback, jnp.float32(1.5), "e4m3")
  assert_bitwise(got, want)
  assert float(got.descale) == 0.125
  q, _, _ = cast_transpose_amax_reference(x, fallback, jnp.float32(0),
                                          fp8_dtype=jnp.float8_e4m3fn, fp8_max=448.0)
  assert_bitwise(got.q, q)
  # The running amax is max(amax_in, recorded), NaN winning.
  assert np.isnan(got.amax) if np.isnan(amax) else float(got.amax) == max(1.5, amax)


def test_power_of_two_rounds_the_scale_down():
  """The scale keeps its float32 exponent: the largest power of two <= 448 / 2**margin /
  amax, checked in float64. (A quotient below the smallest normal float32 is flushed to
  zero by XLA on CPU, the interpreter's platform, and then gives the fallback; a GPU
  keeps it, and the kernel then keeps its highest set bit as
  `fp8jax.core.quantize.round_down_to_power_of_two` does.)"""
  x = _tensor(_rng("pow2"), (64, 64), jnp.bfloat16, 3.0)
  amax = np.float32(12.0)
  for margin, power in ((0, 2.0**5), (100, 2.0**-95)):
    got, want = _both(x, amax, jnp.float32(1), jnp.float32(0), "e4m3", margin=margin,
                      power_of_two=True)
    assert_bitwise(got, want)
    assert 2 * power > np.float64(448.0) / 2.0**margin / np.float64(amax) >= power
    assert float(got.descale) == 1 / power


def test_recorded_amax_is_what_the_running_amax_records():
  """Inside shard_map the scale comes from the whole tensor's amax and the state records
  this shard's: two amaxes, one launch."""
  x = _tensor(_rng("recorded"), (100, 72), jnp.bfloat16, 2.0)
  amax = _amax64(x)
  got, want = _both(x, jnp.float32(2 * amax), jnp.float32(1), jnp.float32(0), "e4m3",
                    recorded_amax=jnp.float32(amax))
  assert_bitwise(got, want)
  scale = np.float32(448.0 / np.float64(np.float32(2 * amax)))
  assert float(got.amax) == amax and float(got.descale) == np.float32(1 / np.float64(scale))


@pytest.mark.parametrize("kwargs, message", [
    (dict(margin=-1), "margin=-1 must be an int >= 0"),
    (dict(margin=1.5), "margin=1.5 must be an int >= 0"),
    (dict(power_of_two=1), "power_of_two must be True or False"),
    (dict(amax=jnp.ones(2)), "amax must be a float32 scalar"),
    (dict(recorded_amax=jnp.int32(1)), "recorded_amax must be a float32 scalar"),
    (dict(fallback_scale=jnp.ones((1,))), "fallback_scale must be a float32 scalar"),
    (dict(partner_descales=(jnp.float32(1),) * 5), "partner_descales must be a tuple of 1 to 4"),
    (dict(pass_through=(jnp.ones((2, 2)),)), r"pass_through\[0\] must be a non-empty float32"),
])
def test_bad_arguments_raise_errors_that_name_them(kwargs, message):
  arguments = dict(x=jnp.ones((32, 32), jnp.bfloat16), amax=jnp.float32(1),
                   fallback_scale=jnp.float32(1), amax_in=jnp.float32(0))
  options = dict(fp8_dtype=jnp.float8_e4m3fn, fp8_max=448.0, interpret=True)
  for name in list(kwargs):
    (arguments if name in arguments else options)[name] = kwargs[name]
  with pytest.raises((ValueError, TypeError), match=message):
    cast_transpose_from_amax(**arguments, **options)


def _prologue_case(name, rng):
  """(x, prologue, its inputs, FP8 format) of each prologue fp8jax's fused ops cast with."""
  if name == "rotary":
    dq, dk, dv = _gradients(rng, 32)
    return dq, rotary_qkv_gradient(32, jnp.bfloat16), (dk, dv, *_rotary_inputs(32)), "e5m2"
  h = _tensor(rng, (100, 72), jnp.bfloat16, 3.0)
  if name == "gelu":
    return h, GELU, (), "e4m3"
  if name == "gelu_backward":
    return _tensor(rng, (100, 72), jnp.bfloat16, 1.0), GELU_BACKWARD, (h,), "e5m2"
  r = jnp.asarray(rng.uniform(0.2, 2.0, (100, 1)), jnp.float32)  # 1 / rms of each row
  return h, RMS_NORM, (r, jnp.asarray(rng.uniform(0.5, 1.5, (1, 72)), jnp.float32)), "e4m3"


@pytest.mark.parametrize("name", ["gelu", "gelu_backward", "rms_norm", "rotary"])
def test_a_cast_with_a_prologue_casts_the_function_with_the_scale_of_its_amax(name):
  """Current scaling's cast of a prologue's result (the fused MLP, norm and qkv casts):
  the kernel is bitwise its definition, and that is the delayed-scaling chain's cast of the
  same function (itself checked against float64 in test_fp8_mlp and test_norm_qkv_rope)
  with the scale made from the function's amax."""
  x, prologue, inputs, fmt = _prologue_case(name, _rng("prologue", name))
  fp8_format, dtype, fp8_max = FORMATS[fmt]
  value = prologue.fn(x.astype(jnp.float32), *(t.astype(jnp.float32) for t in inputs))
  amax = jnp.max(jnp.abs(value))
  # What fp8jax reduces before the cast.
  assert_bitwise(fused_kernels.prologue_amax(x, prologue, inputs), amax)
  options = dict(margin=1, prologue=prologue, prologue_inputs=inputs,
                 partner_descales=(jnp.float32(0.37),), pass_through=STATE)
  got, want = _both(x, amax, jnp.float32(0.5), jnp.float32(0), fmt, **options)
  assert_bitwise(got, want)
  assert got.q.shape == value.shape and float(got.amax) == float(amax)
  scale = scale_from_amax(amax, fp8_format, 1, fallback=jnp.float32(0.5))
  chained = cast_transpose_amax_in_chain_reference(
      x, scale, jnp.float32(0), fp8_dtype=dtype, fp8_max=fp8_max, prologue=prologue,
      prologue_inputs=inputs)
  assert_bitwise((got.q, got.q_t), (chained.q, chained.q_t))


# ----- What an H100 runs ------------------------------------------------------------------

_MISSING = deviceless.deviceless_toolchain_missing()


@pytest.mark.hopper
@pytest.mark.skipif(_MISSING is not None, reason=str(_MISSING))
def test_h100_kernel_divides_exactly_and_is_the_one_launch(tmp_path):
  """The division is PTX `div.rn.f32` (Triton's float32 `/` would be `div.full.f32`, an
  approximation off by up to 2 ulp), and nothing else launches: the running amax is not
  updated in place, so XLA has no parameter to copy for it."""
  spec = jax.ShapeDtypeStruct((2048, 2048), jnp.bfloat16)
  scalar = jax.ShapeDtypeStruct((), jnp.float32)

  def fn(x, amax, fallback, amax_in, partner):
    return cast_transpose_from_amax(x, amax, fallback, amax_in, fp8_dtype=jnp.float8_e4m3fn,
                                    fp8_max=448.0, power_of_two=True,
                                    partner_descales=(partner,))

  deviceless.compile_for_h100(fn, spec, scalar, scalar, scalar, scalar, dump_dir=str(tmp_path))
  ptx = "".join(open(p).read() for p in glob.glob(os.path.join(tmp_path, "*.ptx")))
  kernels = re.findall(r"\.entry\s+(\w+)", ptx)
  assert kernels == ["cast_transpose_amax"], kernels
  assert "div.rn.f32" in ptx and not re.search(r"div\.(full|approx)", ptx)
  assert "cvt.rn.satfinite.e4m3x2.f32" in ptx
  [thunks] = glob.glob(os.path.join(tmp_path, "*thunk_sequence.txt"))
  assert "kCopy" not in open(thunks).read()
