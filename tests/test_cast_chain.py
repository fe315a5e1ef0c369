"""An FP8 layer's casts as a chain that launches nothing for its amax buffers.

The cast kernel folds its tiles' maxima into one float32 with atomics, so that buffer
must hold its start value before the launch; given a running amax XLA cannot overwrite
(a jit parameter, a constant), XLA copies it first, a launch for 4 bytes per tensor.
`pallas_kernels.cast_transpose_amax_in_chain` lets a layer's launches hand each other
what they need instead: the first writes its tile maxima, the second reduces them and
writes zeroed accumulators, the third accumulates into one.

Here the kernel runs in the Pallas interpreter against its plain-jnp definition (bit for
bit: a max has no rounding; FP8 values as bytes, float32 as bit patterns), the amaxes
against float64 numpy, and `fp8_dense` steps on the kernel path (the kernels
interpreted) against the jnp path that CPUs run: the FP8 state, outputs and gradients
must agree bit for bit. The tests marked `hopper` compile for an H100 without a GPU.
"""
from __future__ import annotations

import contextlib
import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bitwise import assert_bitwise, bits
import fp8jax
import pallas_kernels
from fp8jax import deviceless
from fp8jax.lowering.cost import cost
from fp8jax.ops import fused_kernels
from pallas_kernels import (CastTransposeBlockSizes, cast_transpose_amax_in_chain,
                            cast_transpose_amax_in_chain_reference, tile_count)

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
# Ragged in both dimensions (7 x 3 tiles of 16 x 32, partial last row and column), one
# tile smaller than the minimum, and tile-aligned.
SHAPES = [(100, 72), (1, 16), (256, 128)]
BLOCKS = CastTransposeBlockSizes(block_rows=16, block_cols=32)


def _rng(*key) -> np.random.Generator:
  return np.random.default_rng(zlib.crc32("/".join(map(str, key)).encode()))


def _tensor(rng, shape, magnitude):
  return jnp.asarray(rng.standard_normal(shape) * magnitude, jnp.bfloat16)


def _max_abs(*tensors) -> np.float32:
  """float64 max|t| over tensors (exact for bf16 values), as float32."""
  return np.float32(max(np.max(np.abs(np.asarray(t, np.float64))) for t in tensors))


# What x's cast copies through for the state update: scales, amax histories, an amax.
STATE = (jnp.float32(3.0), jnp.arange(16, dtype=jnp.float32) / 7, jnp.float32(0.125),
         jnp.arange(1500, dtype=jnp.float32))


def _chain(run, k, x, g, k_running, x_running, g_running):
  """The three casts of an FP8 dense layer as `fp8jax.ops.dot` chains them."""
  first = run(k, jnp.float32(2.0), None, fp8_dtype=E4M3, fp8_max=448.0, tile_amaxes=True,
              seeds=1)
  second = run(x, jnp.float32(3.0), x_running, fp8_dtype=E4M3, fp8_max=448.0,
               accumulator=first.seeds[0], reduce=(first.amax, k_running), seeds=1,
               descale=jnp.float32(1 / 3), partner_descales=(jnp.float32(0.5),),
               pass_through=STATE)
  third = run(g, jnp.float32(512.0), g_running, fp8_dtype=E5M2, fp8_max=57344.0,
              accumulator=second.seeds[0], descale=jnp.float32(1 / 512),
              partner_descales=(jnp.float32(0.5), jnp.float32(1 / 3)))
  return first, second, third


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_chained_launches_are_bitwise_their_definition_and_give_each_tensors_amax(shape):
  rng = _rng("chain", shape)
  k, x, g = _tensor(rng, shape, 3.0), _tensor(rng, shape, 40.0), _tensor(rng, shape, 1e-3)
  # Running amaxes below each tensor's own, so each result must come from the tensor.
  running = (jnp.float32(0.25), jnp.float32(0.5), jnp.float32(1e-5))
  kernel = functools.partial(cast_transpose_amax_in_chain, block_sizes=BLOCKS, interpret=True)
  reference = functools.partial(cast_transpose_amax_in_chain_reference, block_sizes=BLOCKS)
  got = _chain(kernel, k, x, g, *running)
  assert_bitwise(got, _chain(reference, k, x, g, *running))
  first, second, third = got
  assert first.amax.shape == (tile_count(shape, BLOCKS),)
  assert np.float32(jnp.max(first.amax)) == _max_abs(k)
  assert np.float32(second.reduced) == _max_abs(k)
  assert np.float32(second.amax) == _max_abs(x)
  assert np.float32(third.amax) == _max_abs(g)
  assert [float(s) for s in first.seeds + second.seeds] == [0.0, 0.0]
  assert third.seeds == () and third.reduced is None
  # The copies the state update reads: the arrays themselves, shapes and bits.
  assert_bitwise(second.passed, STATE)
  assert first.passed == () == third.passed


def test_tile_maxima_are_each_tiles_own_in_program_order():
  # 16 x 32 tiles over [100, 72]: a 7 x 3 grid, row-major. Tile (r, c) holds r * 3 + c + 1
  # at one place, so each tile's maximum names the tile.
  x = np.zeros((100, 72), np.float32)
  for r in range(7):
    for c in range(3):
      x[min(16 * r + 5, 99), min(32 * c + 7, 71)] = -(r * 3 + c + 1)
  first = cast_transpose_amax_in_chain(jnp.asarray(x, jnp.bfloat16), jnp.float32(1.0), None,
                                       fp8_dtype=E4M3, fp8_max=448.0, tile_amaxes=True,
                                       block_sizes=BLOCKS, interpret=True)
  np.testing.assert_array_equal(np.asarray(first.amax), np.arange(1, 22, dtype=np.float32))


def test_a_row_limit_keeps_padding_rows_out_of_the_tile_maxima_and_the_fp8_copy():
  """The grouped GEMM's casts (`valid_rows`): the tiles past the limit hold max 0, the
  tile the limit cuts (rows 48..63, limit 50) the max of its rows in use; NaN and 1e6
  in the padding reach neither the maxima nor the FP8 copy (its rows there are +0)."""
  x = np.asarray(_tensor(_rng("limit"), (100, 72), 1.0), np.float32)
  x[50:] = 1e6
  x[60, 5] = np.nan
  runs = [functools.partial(cast_transpose_amax_in_chain, interpret=True),
          cast_transpose_amax_in_chain_reference]
  got, want = (run(jnp.asarray(x, jnp.bfloat16), jnp.float32(1.0), None, fp8_dtype=E4M3,
                   fp8_max=448.0, tile_amaxes=True, valid_rows=jnp.int32(50),
                   block_sizes=BLOCKS) for run in runs)
  assert_bitwise(got, want)
  tiles = np.asarray(got.amax).reshape(7, 3)  # 16 x 32 tiles, row-major
  in_use = np.abs(x[:50])
  for r in range(7):
    for c in range(3):
      tile = in_use[16 * r:16 * r + 16, 32 * c:32 * c + 32]
      assert tiles[r, c] == (tile.max() if tile.size else 0.0), (r, c)
  assert np.all(bits(got.q)[50:] == 0) and np.all(bits(got.q_t)[:, 50:] == 0)


def test_scales_read_in_place_from_one_packed_vector_give_the_same_bits():
  """A chain whose scales and descales are elements of one vector (`VectorElement`, as
  `fp8jax.ops.fused_kernels.packed_scalars` hands them over) casts as with each its own
  array, in the interpreter and in jnp."""
  rng = _rng("packed")
  k, x, g = (_tensor(rng, (100, 72), m) for m in (3.0, 40.0, 1e-3))
  running = (jnp.float32(0.25), jnp.float32(0.5), jnp.float32(1e-5))
  # Each scalar of `_chain` at its own index, among other values the casts must not read.
  values = jnp.asarray([7.0, 2.0, 3.0, 1 / 3, 0.5, 512.0, 1 / 512, 9.0], jnp.float32)
  at = {float(v): pallas_kernels.VectorElement(values, i) for i, v in enumerate(values)}

  def packed_chain(run, *args):
    def with_elements(t, scale, running, descale=None, partner_descales=None, **kw):
      element = lambda v: at[float(np.float32(v))]
      if descale is not None:
        descale, partner_descales = element(descale), tuple(map(element, partner_descales))
      return run(t, element(scale), running, descale=descale,
                 partner_descales=partner_descales, **kw)
    return _chain(with_elements, *args)

  for run in (functools.partial(cast_transpose_amax_in_chain, block_sizes=BLOCKS,
                                interpret=True),
              functools.partial(cast_transpose_amax_in_chain_reference, block_sizes=BLOCKS)):
    assert_bitwise(packed_chain(run, k, x, g, *running), _chain(run, k, x, g, *running))


@pytest.mark.parametrize("element, message", [
    (lambda: pallas_kernels.VectorElement(jnp.ones(3), 3), r"scale: .* 0 <= index < n"),
    (lambda: pallas_kernels.VectorElement(jnp.ones(3, jnp.int32), 0), r"dtype int32"),
    (lambda: pallas_kernels.VectorElement(jnp.ones((2, 2)), 0), r"shape \(2, 2\)"),
])
def test_a_bad_vector_element_is_refused_naming_the_argument(element, message):
  with pytest.raises(ValueError, match=message):
    cast_transpose_amax_in_chain(jnp.ones((32, 32), jnp.bfloat16), element(), jnp.float32(0),
                                 fp8_dtype=E4M3, fp8_max=448.0, interpret=True)


def test_a_running_amax_cannot_be_a_vector_element():
  """The kernel maxes into its running amax in place: it must be its own array."""
  with pytest.raises(ValueError, match="amax_in cannot be a VectorElement"):
    pallas_kernels.cast_transpose_amax(
        jnp.ones((32, 32), jnp.bfloat16), jnp.float32(1.0),
        pallas_kernels.VectorElement(jnp.zeros(2), 0), fp8_dtype=E4M3, fp8_max=448.0,
        interpret=True)


@pytest.mark.parametrize("where", ["tile", "running"])
def test_a_nan_in_the_tiles_or_the_running_amax_makes_the_reduced_amax_nan(where):
  rng = _rng("nan", where)
  k, x = _tensor(rng, (100, 72), 1.0), _tensor(rng, (100, 72), 1.0)
  if where == "tile":
    k = k.at[99, 71].set(jnp.nan)  # in the ragged corner tile
  running = jnp.float32(jnp.nan if where == "running" else 0.5)
  for run in (functools.partial(cast_transpose_amax_in_chain, interpret=True),
              cast_transpose_amax_in_chain_reference):
    first = run(k, jnp.float32(1.0), None, fp8_dtype=E4M3, fp8_max=448.0, tile_amaxes=True,
                block_sizes=BLOCKS, seeds=1)
    second = run(x, jnp.float32(1.0), jnp.float32(0.0), fp8_dtype=E4M3, fp8_max=448.0,
                 accumulator=first.seeds[0], reduce=(first.amax, running), block_sizes=BLOCKS)
    assert np.isnan(np.float32(second.reduced)), run
    assert np.float32(second.amax) == _max_abs(x), run


def test_an_accumulator_keeps_a_nan_running_amax_and_a_larger_one():
  x = _tensor(_rng("acc"), (130, 260), 1.0)
  for amax_in in (np.nan, 10.0 * float(_max_abs(x))):
    got = cast_transpose_amax_in_chain(x, jnp.float32(1.0), jnp.float32(amax_in),
                                       fp8_dtype=E4M3, fp8_max=448.0,
                                       accumulator=jnp.float32(0.0), interpret=True)
    want = np.float32(amax_in)
    assert (np.isnan(want) and np.isnan(got.amax)) or np.float32(got.amax) == want


@pytest.mark.parametrize("kwargs, message", [
    (dict(tile_amaxes=True), r"tile_amaxes=True .* pass amax_in=None"),
    (dict(amax_in=None, tile_amaxes=True, accumulator=jnp.float32(0)), r"no accumulator"),
    (dict(reduce=jnp.ones(3)), r"reduce must be \(tiles, running\)"),
    (dict(reduce=(jnp.ones((2, 2)), jnp.float32(0))), r"reduce\[0\] must be a non-empty float32"),
    (dict(reduce=(jnp.ones(3), jnp.ones(2))), r"reduce\[1\] must be a float32 scalar"),
    (dict(accumulator=jnp.zeros(1)), r"accumulator must be a float32 scalar"),
    (dict(seeds=5), r"seeds=5 must be an int from 0 to 4"),
    (dict(pass_through=jnp.ones(3)), r"pass_through must be a tuple"),
    (dict(pass_through=(jnp.ones((2, 2)),)), r"pass_through\[0\] must be a non-empty float32"),
    (dict(pass_through=(jnp.ones(2, jnp.bfloat16),)), r"pass_through\[0\] .* bfloat16"),
])
def test_bad_chain_arguments_raise_errors_that_name_them(kwargs, message):
  args = dict(amax_in=jnp.float32(0.0))
  args.update(kwargs)
  with pytest.raises(ValueError, match=message):
    cast_transpose_amax_in_chain(jnp.ones((32, 32), jnp.bfloat16), jnp.float32(1.0),
                                 args.pop("amax_in"), fp8_dtype=E4M3, fp8_max=448.0,
                                 interpret=True, **args)


# ----- fp8_dense on the kernel path, interpreted, against the jnp path ---------------------


def _two_layer_steps(recipe, steps=3, stacked=False):
  """`steps` jitted train steps of two `fp8_dense` layers, the second used twice with
  one threaded meta (its running amaxes carry from one use to the next). Returns every
  step's loss, gradients and FP8 state. `stacked`: traced inside
  `fused_kernels.stacked_state()`, where the casts read each layer's scales as elements
  of one packed vector (`fused_kernels.packed_scalars`)."""
  rng = _rng("steps", type(recipe).__name__)
  params = {"k1": jnp.asarray(rng.standard_normal((80, 48)) * 0.3, jnp.bfloat16),
            "k2": jnp.asarray(rng.standard_normal((48, 48)) * 0.2, jnp.bfloat16)}
  x = jnp.asarray(rng.standard_normal((96, 80)) * 3, jnp.bfloat16)

  def loss_fn(params, state, x):
    with fused_kernels.stacked_state() if stacked else contextlib.nullcontext():
      h, m1 = fp8jax.fp8_dense(x, params["k1"], None, state["l1"])
      h, m2 = fp8jax.fp8_dense(jax.nn.gelu(h), params["k2"], None, state["l2"])
      h, m2 = fp8jax.fp8_dense(h, params["k2"], None, m2)
    return jnp.mean(jnp.square(h.astype(jnp.float32))), {"l1": m1, "l2": m2}

  state = {"l1": fp8jax.init_dot_meta(recipe), "l2": fp8jax.init_dot_meta(recipe)}
  # XLA may keep bf16 intermediates (the gelu) in float32 where its fusions allow
  # (`xla_allow_excess_precision`), and the two paths fuse the model's own ops
  # differently: rounded as written, both compute the same bf16 values.
  step = jax.jit(fp8jax.value_and_grad(loss_fn)).lower(params, state, x).compile(
      compiler_options={"xla_allow_excess_precision": False})
  trajectory = []
  for i in range(steps):
    loss, grads, state = step(params, state, x * (i + 1))
    trajectory.append((loss, grads, state))
  return trajectory


@pytest.mark.parametrize("recipe, stacked", [
    (fp8jax.DelayedScaling(amax_history_len=4), False),
    (fp8jax.DelayedScaling(amax_history_len=4), True),
    (fp8jax.CurrentScaling(), False),
    (fp8jax.CurrentScaling(), True)], ids=["delayed", "delayed-stacked", "current",
                                           "current-stacked"])
def test_fp8_dense_steps_on_the_kernel_path_give_the_jnp_paths_bits(recipe, stacked, request):
  want = _two_layer_steps(recipe)
  request.getfixturevalue("interpreted_kernels")
  got = _two_layer_steps(recipe, stacked=stacked)
  assert_bitwise(got, want)
  # The state moved: every role recorded a non-zero amax in its history.
  for meta in jax.tree.leaves(got[-1][2], is_leaf=fp8jax.core.meta.is_meta):
    assert float(meta.amax_history[0]) > 0


# ----- What an H100 runs ------------------------------------------------------------------

_MISSING = deviceless.deviceless_toolchain_missing()


@pytest.mark.hopper
@pytest.mark.skipif(_MISSING is not None, reason=str(_MISSING))
def test_h100_dense_step_launches_its_three_casts_and_no_buffer_copy():
  """One `fp8_dense` forward+backward with its state update (the running amaxes are
  parameters and constants of the program): no copy, and the tile maxima, the seeds
  and the reduction add no launch."""
  spec = jax.ShapeDtypeStruct((1024, 1024), jnp.bfloat16)
  meta = jax.eval_shape(lambda: fp8jax.init_dot_meta(fp8jax.DelayedScaling()))

  def step(x, kernel, g, meta):
    (y, new), vjp = jax.vjp(lambda x, k, m: fp8jax.fp8_dense(x, k, None, m), x, kernel, meta)
    dx, dk, cotangent = vjp((g, jax.tree.map(jnp.zeros_like, new)))
    return y, dx, dk, fp8jax.close_step(new, cotangent)

  report = cost(step, spec, spec, spec, meta, target="deviceless")
  kinds = sorted(k.category for k in report.kernels if not k.is_gemm)
  assert kinds == ["pallas"] * 4, report.table()
  casts = [k for k in report.kernels if "cast_transpose_amax" in k.op_name]
  assert len(casts) == 3 and all(k.bytes_in >= 1024 * 1024 * 2 for k in casts), report.table()
