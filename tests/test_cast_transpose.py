"""Fused FP8 cast + transpose + amax kernel: bitwise against its plain-jnp definition.

Every comparison is bitwise (no tolerance): the kernel computes the same float32
product, the same saturation and the same round-to-nearest-even cast as
`cast_transpose_amax_reference`, and an amax is a max, which has no rounding. FP8
values are compared as uint8 bit patterns (so -0 and +0 differ), float32 amaxes as
bit patterns, and NaNs only as "both NaN" (their payloads are not part of the contract).

The kernel runs in the Pallas interpreter on CPU. There the interpreter pads a ragged
edge tile with NaN, so an amax that read an out-of-range element would come out NaN:
every ragged shape below checks the masking of the amax.

Inputs are normal numbers: XLA on CPU flushes float32 (and bf16) subnormals to zero
in both the reference and the interpreter, while the GPU kernel keeps them.

The tests marked `hopper` compile the kernel for an H100 without a GPU and read the
optimized HLO and the PTX.
"""
from __future__ import annotations

import glob
import os
import re
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp8_reference import quantize_reference
from fp8jax import deviceless
from pallas_kernels import (CastTransposeBlockSizes, cast_transpose_amax,
                            cast_transpose_amax_reference, running_amax)

E4M3, E5M2 = jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2)
FORMATS = {"e4m3": (E4M3, 448.0), "e5m2": (E5M2, 57344.0)}
INPUT_DTYPES = {"bf16": jnp.bfloat16, "f16": jnp.float16, "f32": jnp.float32}
# Not multiples of the 64x128 default tile (100x72, 130x260: ragged rows and columns),
# smaller than a tile in both dimensions (1x16), and a multiple of it (256x128, the
# unmasked code path).
SHAPES = [(100, 72), (130, 260), (1, 16), (256, 128)]
# Largest dynamic shared memory one thread block may use on an H100 (227 KiB), as in
# test_flash_attention_compile.py.
H100_MAX_SHARED_MEMORY = 232448


def _rng(*key) -> np.random.Generator:
  # A seed fixed across processes (str hashing is salted per process).
  return np.random.default_rng(zlib.crc32("/".join(map(str, key)).encode()))


def _random_x(rng, shape, dtype, fp8: str, scale: float) -> np.ndarray:
  """Signed values whose products with `scale` run from below the smallest FP8
  subnormal (they round to +-0) through subnormals and normals to past fp8_max
  (they saturate)."""
  fp8_dtype, fp8_max = FORMATS[fp8]
  smallest = float(jnp.finfo(fp8_dtype).smallest_subnormal)
  low, high = np.log2(smallest) - 3, np.log2(fp8_max) + 2
  magnitude = 2.0**rng.uniform(low, high, shape) / scale
  x = rng.choice([-1.0, 1.0], shape) * magnitude
  return np.array(jnp.asarray(x, jnp.float32).astype(dtype))  # a writable copy


def _assert_fp8_bitwise_equal(actual, expected, what: str):
  actual, expected = np.asarray(actual), np.asarray(expected)
  assert actual.shape == expected.shape and actual.dtype == expected.dtype, (
      what, actual.shape, actual.dtype, expected.shape, expected.dtype)
  nan = np.isnan(expected.astype(np.float32))
  np.testing.assert_array_equal(np.isnan(actual.astype(np.float32)), nan, err_msg=what)
  np.testing.assert_array_equal(actual.view(np.uint8)[~nan], expected.view(np.uint8)[~nan],
                                err_msg=what)


def _assert_f32_bitwise_equal(actual, expected, what: str):
  actual, expected = np.float32(actual), np.float32(expected)
  if np.isnan(expected):
    assert np.isnan(actual), (what, actual)
  else:
    assert actual.view(np.uint32) == expected.view(np.uint32), (what, actual, expected)


def _run_both(x, scale, amax_in, fp8: str, transpose=True, valid_rows=None,
              **kernel_options):
  fp8_dtype, fp8_max = FORMATS[fp8]
  got = cast_transpose_amax(jnp.asarray(x), jnp.float32(scale), jnp.float32(amax_in),
                            fp8_dtype=fp8_dtype, fp8_max=fp8_max, transpose=transpose,
                            valid_rows=valid_rows, interpret=True, **kernel_options)
  want = cast_transpose_amax_reference(jnp.asarray(x), jnp.float32(scale),
                                       jnp.float32(amax_in), fp8_dtype=fp8_dtype,
                                       fp8_max=fp8_max, transpose=transpose,
                                       valid_rows=valid_rows)
  return got, want


def _assert_matches(got, want):
  (q, q_t, amax_out), (q_ref, q_t_ref, amax_ref) = got, want
  _assert_fp8_bitwise_equal(q, q_ref, "q")
  if q_t_ref is None:
    assert q_t is None
  else:
    _assert_fp8_bitwise_equal(q_t, q_t_ref, "q_t")
  _assert_f32_bitwise_equal(amax_out, amax_ref, "amax_out")


# ---------------------------------------------------------------------------
# Numerics on CPU (interpret mode).
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("fp8", ["e4m3", "e5m2"])
@pytest.mark.parametrize("in_dtype", ["bf16", "f16", "f32"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_kernel_is_bitwise_equal_to_reference(shape, in_dtype, fp8):
  rng = _rng(shape, in_dtype, fp8)
  # Not a power of two, so the float32 product rounds before the FP8 cast does.
  scale = 1.37 if fp8 == "e4m3" else 1.37 * 2.0**5
  x = _random_x(rng, shape, INPUT_DTYPES[in_dtype], fp8, scale)
  # However small the shape, it holds a value that saturates and one that underflows
  # to zero (the random ones cover the range in between, and more of both ends).
  fp8_max = FORMATS[fp8][1]
  x[0, 0] = -4 * fp8_max / scale
  x[-1, -1] = float(jnp.finfo(FORMATS[fp8][0]).smallest_subnormal) / 4 / scale
  max_abs = float(np.max(np.abs(x.astype(np.float32))))
  # amax_in below max|x|: the result must come from x (from the right tile).
  got, want = _run_both(x, scale, 0.5 * max_abs, fp8)
  _assert_matches(got, want)
  _assert_f32_bitwise_equal(got[2], max_abs, "amax_out vs numpy max|x|")
  q = np.asarray(got[0]).astype(np.float32)
  assert q[0, 0] == -fp8_max and q[-1, -1] == 0


@pytest.mark.parametrize("fp8", ["e4m3", "e5m2"])
def test_many_ragged_tiles_are_bitwise_equal_and_the_corner_tile_counts(fp8):
  # 16x32 tiles over 100x72: a 7x3 grid whose last row and column of tiles are
  # partial, so every program folds its own max into the shared amax.
  rng = _rng("ragged", fp8)
  x = _random_x(rng, (100, 72), jnp.bfloat16, fp8, scale=2.0)
  # The largest magnitude sits in the last (partial, corner) tile.
  x[99, 71] = -2.0 * np.max(np.abs(x.astype(np.float32)))
  blocks = CastTransposeBlockSizes(block_rows=16, block_cols=32, num_warps=4)
  got, want = _run_both(x, 2.0, 0.0, fp8, block_sizes=blocks)
  _assert_matches(got, want)
  _assert_f32_bitwise_equal(got[2], abs(float(x[99, 71].astype(np.float32))), "corner max")


def test_amax_in_larger_than_max_abs_x_is_returned_unchanged():
  x = _random_x(_rng("amax_in"), (130, 260), jnp.bfloat16, "e4m3", scale=1.0)
  amax_in = 3.0 * float(np.max(np.abs(x.astype(np.float32))))
  got, want = _run_both(x, 1.0, amax_in, "e4m3")
  _assert_matches(got, want)
  _assert_f32_bitwise_equal(got[2], amax_in, "amax_in kept")


@pytest.mark.parametrize("fp8, in_dtype", [("e4m3", "f16"), ("e5m2", "f32")])
def test_nan_in_x_stays_nan_in_q_and_q_t_and_makes_amax_nan(fp8, in_dtype):
  # float32 included: XLA's own CPU max reduction of a 2-D float32 array this size
  # drops the NaN; the kernel (a max over bit patterns) and the reference must not.
  x = _random_x(_rng("nan", fp8), (130, 260), INPUT_DTYPES[in_dtype], fp8, scale=1.0)
  # One NaN inside a full tile, one in the ragged corner tile; both must stay NaN in
  # q and q_t, and the amax must be NaN even though amax_in is large and finite.
  x[5, 7] = np.nan
  x[129, 259] = -np.nan
  got, want = _run_both(x, 1.0, 1e30, fp8)
  _assert_matches(got, want)
  q, q_t, amax_out = (np.asarray(v).astype(np.float32) for v in got)
  assert np.isnan(q[5, 7]) and np.isnan(q[129, 259])
  assert np.isnan(q_t[7, 5]) and np.isnan(q_t[259, 129])
  assert np.sum(np.isnan(q)) == 2
  assert np.isnan(amax_out)


def test_nan_amax_in_stays_nan():
  # A running amax that is already NaN (an earlier step saw a NaN) stays NaN.
  x = _random_x(_rng("nan_amax_in"), (100, 72), jnp.bfloat16, "e4m3", scale=1.0)
  got, want = _run_both(x, 1.0, np.nan, "e4m3")
  _assert_matches(got, want)
  assert np.isnan(np.float32(got[2]))


@pytest.mark.parametrize("valid_rows", [70, 64, 0, 100])
def test_rows_past_valid_rows_read_as_zero_whatever_they_hold(valid_rows):
  """A grouped GEMM's padding rows: huge, inf and NaN there enter no amax and cast to
  +0, in the kernel (16-row tiles: the limit falls inside tile 4 at 70, on a tile edge
  at 64) as in its definition, and the rows in use cast as they would alone."""
  x = _random_x(_rng("valid_rows", valid_rows), (100, 72), jnp.bfloat16, "e4m3", scale=1.0)
  clean = x[:valid_rows].copy()
  x[valid_rows:] = 1e6
  if valid_rows < 100:
    x[valid_rows, 3], x[-1, -1] = np.nan, -np.inf
  blocks = CastTransposeBlockSizes(block_rows=16, block_cols=32, num_warps=4)
  got, want = _run_both(x, 1.0, 0.0, "e4m3", block_sizes=blocks,
                        valid_rows=jnp.int32(valid_rows))
  _assert_matches(got, want)
  q = np.asarray(got[0])
  assert np.all(q[valid_rows:].view(np.uint8) == 0)  # +0 bits
  if valid_rows:
    alone, _ = _run_both(clean, 1.0, 0.0, "e4m3", block_sizes=blocks)
    _assert_fp8_bitwise_equal(q[:valid_rows], alone[0], "rows in use")
  _assert_f32_bitwise_equal(got[2], np.max(np.abs(clean.astype(np.float32)), initial=0.0),
                            "amax of the rows in use")


@pytest.mark.parametrize("fp8", ["e4m3", "e5m2"])
def test_inf_saturates_to_fp8_max_and_makes_amax_inf(fp8):
  x = _random_x(_rng("inf", fp8), (100, 72), jnp.bfloat16, fp8, scale=1.0)
  x[0, 0], x[99, 71] = np.inf, -np.inf
  got, want = _run_both(x, 1.0, 0.0, fp8)
  _assert_matches(got, want)
  fp8_max = FORMATS[fp8][1]
  q = np.asarray(got[0]).astype(np.float32)
  # The clip saturates +-inf to +-fp8_max instead of producing inf or NaN.
  assert q[0, 0] == fp8_max and q[99, 71] == -fp8_max
  assert np.float32(got[2]) == np.inf


@pytest.mark.parametrize("fp8", ["e4m3", "e5m2"])
def test_special_values_match_the_reference_and_the_fp8_tables(fp8):
  fp8_dtype, fp8_max = FORMATS[fp8]
  smallest = float(jnp.finfo(fp8_dtype).smallest_subnormal)
  normal = float(jnp.finfo(fp8_dtype).smallest_normal)
  mantissa_bits = 3 if fp8 == "e4m3" else 2
  quantum = normal * 2.0**-mantissa_bits
  values = [
      0.0, -0.0,                                  # signed zeros keep their sign
      smallest / 3, -smallest / 3,                # underflow to +0 / -0
      smallest / 2, 1.5 * smallest,               # ties: to even (0, then 2 * smallest)
      3 * smallest, -5 * smallest,                # subnormals
      normal + quantum / 2, normal + 1.5 * quantum,  # ties between normals: to even
      fp8_max, -fp8_max, fp8_max * 1.01, -fp8_max * 4,  # at and beyond max: saturate
      np.inf, -np.inf, 1.0, -1.0,
  ]
  x = np.tile(np.asarray(values, np.float32), (3, 2))  # [3, 36], one ragged tile
  got, want = _run_both(x, 1.0, 0.0, fp8)
  _assert_matches(got, want)
  # Independently of jnp: the float64 FP8 rounding written out from the format tables.
  expected = quantize_reference(x, 1.0, fp8)
  np.testing.assert_array_equal(np.asarray(got[0]).view(np.uint8),
                                expected.astype(fp8_dtype).view(np.uint8))


@pytest.mark.parametrize("fp8", ["e4m3", "e5m2"])
def test_reference_matches_float64_fp8_rounding(fp8):
  # The reference is the definition the kernel is held to; it in turn must be the
  # correctly rounded saturating cast of the float32 product (tests/fp8_reference.py).
  scale = 0.73
  x = _random_x(_rng("reference", fp8), (64, 96), jnp.float32, fp8, scale)
  fp8_dtype, fp8_max = FORMATS[fp8]
  q, q_t, amax_out = cast_transpose_amax_reference(
      jnp.asarray(x), jnp.float32(scale), jnp.float32(0.0), fp8_dtype=fp8_dtype,
      fp8_max=fp8_max)
  expected = quantize_reference(x, scale, fp8).astype(fp8_dtype)
  np.testing.assert_array_equal(np.asarray(q).view(np.uint8), expected.view(np.uint8))
  np.testing.assert_array_equal(np.asarray(q_t).view(np.uint8), expected.T.view(np.uint8))
  assert np.float32(amax_out) == np.max(np.abs(x))


def test_transpose_false_returns_none_and_writes_one_fp8_copy():
  x = _random_x(_rng("no_transpose"), (100, 72), jnp.bfloat16, "e5m2", scale=1.0)
  got, want = _run_both(x, 1.0, 0.0, "e5m2", transpose=False)
  _assert_matches(got, want)
  assert got[1] is None

  # The kernel itself has two outputs (q and the amax), not a discarded third.
  def fn(x):
    return cast_transpose_amax(x, jnp.float32(1.0), jnp.float32(0.0), fp8_dtype=E5M2,
                               fp8_max=57344.0, transpose=False, interpret=True)

  jaxpr = jax.make_jaxpr(fn)(jnp.asarray(x))
  calls = _find_eqns(jaxpr.jaxpr, "pallas_call")
  assert len(calls) == 1
  assert [v.aval.shape for v in calls[0].outvars] == [(100, 72), (1,)]


def _find_eqns(jaxpr, name):
  """The equations of primitive `name` in `jaxpr` and in the jaxprs of its calls."""
  found = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == name:
      found.append(eqn)
    for param in eqn.params.values():
      inner = getattr(param, "jaxpr", None)
      if inner is not None and hasattr(inner, "eqns"):
        found += _find_eqns(inner, name)
  return found


@pytest.mark.parametrize("shape", [(130, 260), (1, 16), (256, 128)],
                         ids=lambda s: f"{s[0]}x{s[1]}")
def test_running_amax_kernel_is_bitwise_equal_to_reference(shape):
  x = _random_x(_rng("amax", shape), shape, jnp.bfloat16, "e4m3", scale=1.0)
  max_abs = float(np.max(np.abs(x.astype(np.float32))))
  for amax_in in (0.0, 0.5 * max_abs, 2.0 * max_abs):
    got = running_amax(jnp.asarray(x), jnp.float32(amax_in), interpret=True)
    want = cast_transpose_amax_reference(jnp.asarray(x), jnp.float32(1.0),
                                         jnp.float32(amax_in), fp8_dtype=E4M3,
                                         fp8_max=448.0)[2]
    _assert_f32_bitwise_equal(got, want, f"amax_in={amax_in}")
  x[shape[0] - 1, 0] = np.nan  # a NaN in the last row tile makes the amax NaN
  assert np.isnan(np.float32(running_amax(jnp.asarray(x), jnp.float32(1.0), interpret=True)))


def test_kernel_composes_under_jit_with_a_computed_amax_in():
  # Inside a step the running amax comes from other ops (here: an amax history).
  x = _random_x(_rng("jit"), (130, 260), jnp.bfloat16, "e4m3", scale=1.0)
  history = jnp.asarray([0.5, 2.0, 1.0], jnp.float32)

  @jax.jit
  def step(x, history):
    return cast_transpose_amax(x, jnp.float32(1.0), jnp.max(history), fp8_dtype=E4M3,
                               fp8_max=448.0, interpret=True)

  want = cast_transpose_amax_reference(jnp.asarray(x), jnp.float32(1.0), jnp.float32(2.0),
                                       fp8_dtype=E4M3, fp8_max=448.0)
  _assert_matches(step(jnp.asarray(x), history), want)


# ---------------------------------------------------------------------------
# Input checks.
# ---------------------------------------------------------------------------

_X = jnp.ones((32, 32), jnp.bfloat16)
_S = jnp.float32(1.0)


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(x=jnp.ones((2, 3, 4), jnp.bfloat16)), ValueError, r"x must be a 2-D .*\(2, 3, 4\).*reshape"),
    (dict(x=jnp.ones((0, 4), jnp.bfloat16)), ValueError, r"x has shape \(0, 4\), with no elements"),
    (dict(x=jnp.ones((4, 4), jnp.int32)), TypeError, r"x has dtype int32; pass bfloat16"),
    (dict(x=jnp.ones((4, 4), jnp.float8_e4m3fn)), TypeError, r"x has dtype float8_e4m3fn"),
    (dict(scale=jnp.ones((2,), jnp.float32)), ValueError, r"scale must be a float32 scalar.*\(2,\)"),
    (dict(scale=jnp.bfloat16(1.0)), ValueError, r"scale must be a float32 scalar.*bfloat16.*astype"),
    (dict(amax_in=jnp.zeros((1,), jnp.float32)), ValueError, r"amax_in must be a float32 scalar.*\(1,\)"),
    (dict(fp8_dtype=jnp.float16), TypeError, r"fp8_dtype=.*float16.*not supported.*float8_e4m3fn"),
    (dict(fp8_dtype=jnp.float8_e4m3fnuz), TypeError, r"fp8_dtype=.*float8_e4m3fnuz"),
    (dict(fp8_dtype=E5M2, fp8_max=448.0), ValueError, r"fp8_max=448.0 does not match .*float8_e5m2.*pass fp8_max=57344.0"),
    (dict(fp8_max=240.0), ValueError, r"fp8_max=240.0 does not match .*float8_e4m3fn.*pass fp8_max=448.0"),
    (dict(transpose="yes"), TypeError, r"transpose must be True or False, got 'yes'"),
    (dict(block_sizes=(128, 128)), TypeError, r"block_sizes must be a CastTransposeBlockSizes"),
    (dict(valid_rows=jnp.ones(2, jnp.int32)), ValueError, r"valid_rows must be one integer.*\(2,\)"),
    (dict(valid_rows=jnp.float32(3)), ValueError, r"valid_rows must be one integer.*float32"),
])
def test_bad_inputs_raise_errors_that_name_the_argument(kwargs, error, message):
  args = dict(x=_X, scale=_S, amax_in=jnp.float32(0.0), fp8_dtype=E4M3, fp8_max=448.0)
  args.update(kwargs)
  with pytest.raises(error, match=message):
    cast_transpose_amax(args.pop("x"), args.pop("scale"), args.pop("amax_in"), **args,
                        interpret=True)


def test_running_amax_rejects_a_non_scalar_amax_in():
  with pytest.raises(ValueError, match=r"amax_in must be a float32 scalar.*\(3,\)"):
    running_amax(_X, jnp.zeros((3,), jnp.float32), interpret=True)


@pytest.mark.parametrize("kwargs, message", [
    (dict(block_rows=48), r"block_rows=48 must be a power of two >= 16"),
    (dict(block_cols=8), r"block_cols=8 must be a power of two >= 16"),
    (dict(num_warps=3), r"num_warps=3 must be a power of two"),
    (dict(num_stages=0), r"num_stages=0 must be a positive int"),
    (dict(block_rows=64.0), r"block_rows=64.0 must be a positive int"),
])
def test_block_sizes_reject_values_triton_cannot_tile(kwargs, message):
  with pytest.raises(ValueError, match=message):
    CastTransposeBlockSizes(**kwargs)


# ---------------------------------------------------------------------------
# On a GPU (skipped elsewhere): the compiled Triton kernel against the definition.
# ---------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
@pytest.mark.parametrize("fp8", ["e4m3", "e5m2"])
@pytest.mark.parametrize("in_dtype", ["bf16", "f16", "f32"])
def test_gpu_kernel_is_bitwise_equal_to_cpu_reference(in_dtype, fp8):
  fp8_dtype, fp8_max = FORMATS[fp8]
  cpu = jax.devices("cpu")[0]
  for shape in SHAPES + [(1000, 8200), (4096, 4096)]:
    scale = 1.37 if fp8 == "e4m3" else 1.37 * 2.0**5
    x = _random_x(_rng("gpu", shape, in_dtype, fp8), shape, INPUT_DTYPES[in_dtype], fp8,
                  scale)
    x[shape[0] // 2, shape[1] // 3] = np.nan if shape == (130, 260) else x[0, 0]
    x[shape[0] - 1, shape[1] - 1] = -np.inf if shape == (100, 72) else x[0, 0]
    amax_in = np.float32(0.5 * np.nanmax(np.abs(x.astype(np.float32))))
    got = cast_transpose_amax(jnp.asarray(x), jnp.float32(scale), jnp.asarray(amax_in),
                              fp8_dtype=fp8_dtype, fp8_max=fp8_max)
    with jax.default_device(cpu):
      want = cast_transpose_amax_reference(
          jax.device_put(x, cpu), jax.device_put(np.float32(scale), cpu),
          jax.device_put(amax_in, cpu), fp8_dtype=fp8_dtype, fp8_max=fp8_max)
    _assert_matches(jax.device_get(got), jax.device_get(want))


# ---------------------------------------------------------------------------
# Deviceless H100 compile: what the kernel becomes.
# ---------------------------------------------------------------------------

_MISSING = deviceless.deviceless_toolchain_missing()
requires_toolchain = pytest.mark.skipif(_MISSING is not None, reason=str(_MISSING))


def _compile_h100(fn, args, dump_dir, donate_argnums=()):
  """Compiles for an H100; returns (optimized HLO, thunk sequence, {kernel: PTX})."""
  dump_dir = str(dump_dir)
  if donate_argnums:  # a jitted function keeps its donations
    fn = jax.jit(fn, donate_argnums=donate_argnums)
  compiled = deviceless.compile_for_h100(fn, *args, dump_dir=dump_dir)
  ptx = {}
  for path in glob.glob(os.path.join(dump_dir, "*.ptx")):
    with open(path) as f:
      text = f.read()
    for entry in re.findall(r"\.entry\s+(\w+)", text):
      ptx[entry] = text
  [thunks] = glob.glob(os.path.join(dump_dir, "*thunk_sequence.txt"))
  with open(thunks) as f:
    return compiled.as_text(), f.read(), ptx


def _kernels(thunks: str) -> list[tuple[str, int]]:
  """(name, shared memory bytes) of every kernel launch in a thunk sequence."""
  return [(m.group(1), int(m.group(2))) for m in
          re.finditer(r"kCustomKernel\s*\[[^\]]*\]\s*(\w+).*shared_memory:\s*(\d+)", thunks)]


def _specs(shape):
  return (jax.ShapeDtypeStruct(shape, jnp.bfloat16), jax.ShapeDtypeStruct((), jnp.float32),
          jax.ShapeDtypeStruct((), jnp.float32))


@pytest.mark.hopper
@requires_toolchain
@pytest.mark.parametrize("fp8", ["e4m3", "e5m2"])
@pytest.mark.parametrize("size", [8192, 2048])
def test_h100_compile_is_one_triton_kernel_with_fp8_converts_and_16_byte_accesses(
    size, fp8, tmp_path, record_property):
  fp8_dtype, fp8_max = FORMATS[fp8]

  def fn(x, scale, amax_in):
    return cast_transpose_amax(x, scale, amax_in, fp8_dtype=fp8_dtype, fp8_max=fp8_max)

  hlo, thunks, ptx = _compile_h100(fn, _specs((size, size)), tmp_path)
  # One Triton custom call and no XLA fusion: reshaping the scalars to [1] is a
  # bitcast. What remains around it is a 4-byte copy of amax_in (kCopy, not a kernel),
  # because a jit parameter that is not donated cannot be updated in place.
  assert hlo.count('custom_call_target="__gpu$xla.gpu.triton"') == 1
  assert "fusion" not in hlo, hlo
  kernels = _kernels(thunks)
  assert [name for name, _ in kernels] == ["cast_transpose_amax"], thunks
  assert len([line for line in thunks.splitlines() if "kCopy" in line]) <= 1, thunks
  shared = kernels[0][1]
  record_property("shared_memory", shared)
  assert 0 < shared <= H100_MAX_SHARED_MEMORY

  kernel_ptx = ptx["cast_transpose_amax"]
  # The saturating FP8 convert of two float32 values at a time.
  assert f"cvt.rn.satfinite.{fp8}x2.f32" in kernel_ptx
  # Tile-aligned shapes compile without masks: every global load of X and every store
  # of Q and Q^T is 16 bytes wide (8 bf16 / 16 FP8 values); the only narrower global
  # accesses are the 4-byte scale load and the amax atomic.
  accesses = re.findall(r"\b((?:ld|st)\.global[.\w]*)", kernel_ptx)
  record_property("global_accesses", sorted(set(accesses)))
  assert "ld.global.v4.b32" in accesses and "st.global.v4.b32" in accesses
  assert set(accesses) == {"ld.global.v4.b32", "st.global.v4.b32", "ld.global.b32"}
  assert accesses.count("ld.global.b32") == 1
  # One atomic max per program, issued by one thread: a signed 32-bit max on the bit
  # pattern (Triton's float atomic max for non-negative values), plus the branch for
  # negative values, which |x| never takes.
  atomics = re.findall(r"(@%p\d+\s+)?(atom\.[\w.]+)", kernel_ptx)
  assert ("@" in atomics[0][0]) and any(a[1].endswith("max.s32") for a in atomics), atomics


@pytest.mark.hopper
@requires_toolchain
def test_h100_compile_with_a_donated_amax_in_is_the_kernel_alone(tmp_path):

  def fn(x, scale, amax_in):
    return cast_transpose_amax(x, scale, amax_in, fp8_dtype=E4M3, fp8_max=448.0)

  _, thunks, _ = _compile_h100(fn, _specs((2048, 2048)), tmp_path, donate_argnums=(2,))
  # amax_in's buffer is updated in place: no copy, no initialising kernel.
  assert "kCopy" not in thunks, thunks
  assert [name for name, _ in _kernels(thunks)] == ["cast_transpose_amax"], thunks


@pytest.mark.hopper
@requires_toolchain
def test_h100_compile_of_a_ragged_shape_masks_every_store(tmp_path):

  def fn(x, scale, amax_in):
    return cast_transpose_amax(x, scale, amax_in, fp8_dtype=E4M3, fp8_max=448.0)

  _, _, ptx = _compile_h100(fn, _specs((130, 260)), tmp_path)
  kernel_ptx = ptx["cast_transpose_amax"]
  # Out-of-range elements of the edge tiles must not be written: without a mask a
  # column past 260 would land in the next row. Every global store is predicated.
  stores = re.findall(r"(@!?%p\d+\s+)?(st\.global[.\w]*)", kernel_ptx)
  assert stores and all(predicate for predicate, _ in stores), stores


@pytest.mark.hopper
@requires_toolchain
def test_h100_compile_of_running_amax_is_one_kernel_that_only_reads(tmp_path):

  def fn(x, amax_in):
    return running_amax(x, amax_in)

  hlo, thunks, ptx = _compile_h100(
      fn, (jax.ShapeDtypeStruct((8192, 8192), jnp.bfloat16),
           jax.ShapeDtypeStruct((), jnp.float32)), tmp_path)
  assert "fusion" not in hlo
  assert [name for name, _ in _kernels(thunks)] == ["amax"], thunks
  accesses = set(re.findall(r"\b((?:ld|st)\.global[.\w]*)", ptx["amax"]))
  assert accesses == {"ld.global.v4.b32"}, accesses


# ----- The GEMMs' combined descales, written by the same kernel ---------------------------


def test_partner_descale_products_are_bitwise_the_float32_products_and_capped():
  x = jnp.asarray(_random_x(_rng("products"), (100, 72), jnp.bfloat16, "e4m3", 0.25))
  descale = jnp.float32(4.0)
  # An ordinary partner, and one whose product overflows float32: capped at its max so
  # that a zero row of the GEMM stays 0 (0 * inf would be NaN).
  partners = (jnp.float32(0.7), jnp.float32(3e38))
  got = cast_transpose_amax(x, jnp.float32(0.25), jnp.float32(0.0), fp8_dtype=E4M3,
                            fp8_max=448.0, descale=descale, partner_descales=partners,
                            interpret=True)
  want = cast_transpose_amax_reference(x, jnp.float32(0.25), jnp.float32(0.0), fp8_dtype=E4M3,
                                       fp8_max=448.0, descale=descale,
                                       partner_descales=partners)
  assert len(got) == len(want) == 4
  for a, b, what in zip(got[:2], want[:2], ("q", "q_t")):
    _assert_fp8_bitwise_equal(a, b, what)
  _assert_f32_bitwise_equal(got[2], want[2], "amax")
  first, capped = got[3]
  _assert_f32_bitwise_equal(first, np.float32(4.0) * np.float32(0.7), "product")
  _assert_f32_bitwise_equal(capped, np.finfo(np.float32).max, "capped product")


def test_partner_descales_need_a_descale_and_scalars():
  x = jnp.ones((16, 16), jnp.bfloat16)
  with pytest.raises(ValueError, match="go together"):
    cast_transpose_amax(x, 1.0, 0.0, fp8_dtype=E4M3, fp8_max=448.0,
                        partner_descales=(jnp.float32(1),), interpret=True)
  with pytest.raises(ValueError, match="partner_descales\\[0\\]"):
    cast_transpose_amax(x, 1.0, 0.0, fp8_dtype=E4M3, fp8_max=448.0, descale=1.0,
                        partner_descales=(jnp.ones(2),), interpret=True)
