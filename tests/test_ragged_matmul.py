"""The grouped FP8 GEMMs (pallas_kernels.ragged_matmul / transposed_ragged_matmul) against float64.

* The kernels run in Mosaic GPU's CPU interpreter with race detection: the same kernel
  code (persistent schedule, ring of slots carried across work items, barriers, group
  boundary masking, store ladder, epilogues) as on a GPU, with tile products in float32
  (pallas_kernels/mosaic_target.py). Each case uses 2-4 CTAs and 2-3 ring slots, so
  every CTA runs several work items and the ring wraps within and across items.
* The plain-jnp references (the CPU path) run the same cases and more.
* Both are compared with a float64 oracle written from the definition: per group, the
  dequantized rows (x8 * descale, per element) times the group's dequantized weights.

Error bound, per element (u = 2**-24, S = the float64 sum of |terms| of that element):
the products of two E4M3 values are exact in float32; a 128-deep step sums 128 of them
in float32 (<= 127 u S), the C steps' sums are added (<= (C - 1) u S), and the descales
cost at most 3 roundings (their product, the multiply, the promotion add): <= (128 + C +
3) u S in all. A bfloat16 output adds its rounding to nearest: half an ulp of an 8-bit
significand, at most 2**-8 of the float32 value (which is itself off by the bound above).
Measured in the interpreter: float32 outputs err by < 1% of the bound (it is a worst
case); bfloat16 ones reach 0.99 of it (the rounding bound is exact). Rows and groups
without terms (tail rows, empty groups) have S = 0: they must be exactly 0. The rows of `a`
(tokens of `a_t`) past the groups hold NaN, which no product may read.
"""
import importlib

import numpy as np
import pytest

U = 2.0**-24
BF16 = 2.0**-8


def _modules():
  # The package exports the functions under the modules' names.
  return (importlib.import_module("pallas_kernels.ragged_matmul"),
          importlib.import_module("pallas_kernels.transposed_ragged_matmul"),
          importlib.import_module("pallas_kernels.ragged_tiling"))


def _e4m3(rng, shape):
  """E4M3 values over the format's normal range (normal * 32, clipped at 448)."""
  import jax.numpy as jnp
  return jnp.asarray(np.clip(rng.normal(size=shape) * 32, -448, 448), jnp.float8_e4m3fn)


def _descale(rng, shape):
  import jax.numpy as jnp
  return jnp.asarray(2.0 ** rng.uniform(-8, 8, size=shape), jnp.float32)


def _f64(x):
  import jax.numpy as jnp
  return np.asarray(jnp.asarray(x).astype(jnp.float32), np.float64)


def _bound(abs_sum, want, chunks, out_dtype):
  bound = (128 + chunks + 3) * U * abs_sum
  if out_dtype == "bfloat16":
    bound = bound * (1 + BF16) + BF16 * np.abs(want)
  return bound


def _assert_within(got, want, bound, typical_bound=1e-2):
  got = np.asarray(np.asarray(got, np.float32), np.float64)
  excess = np.abs(got - want) - bound
  assert np.all(excess <= 0), (f"max excess {excess.max():.3g} at "
                               f"{np.unravel_index(np.argmax(excess), excess.shape)}")
  # Not vacuous: typically ~1e-4 (float32) or ~2**-8 (bfloat16) of the values, so a
  # wrong group, row, descale or block (an O(|value|) error) cannot hide inside it.
  nonzero = want != 0
  assert np.median(bound[nonzero] / np.abs(want[nonzero])) < typical_bound


# ----- the forward / dgrad form ---------------------------------------------------------


def _ragged_problem(seed, m, kc, nout, sizes, mode):
  """(a [M, Kc], b_t [G, Nout, Kc], group_sizes, a_descale, b_descale); a's rows past
  the groups (if any) are NaN: no product may read them (ragged_dot's semantics)."""
  import jax.numpy as jnp
  rng = np.random.default_rng(seed)
  g, chunks = len(sizes), -(-kc // 128)
  a_d, b_d = {"tensor": ((), (g,)), "rowwise": ((m,), (g, nout)),
              "block": ((m, chunks), (g, -(-nout // 128), chunks))}[mode]
  a = _e4m3(rng, (m, kc)).at[sum(sizes):].set(jnp.nan)
  return (a, _e4m3(rng, (g, nout, kc)), jnp.asarray(sizes, jnp.int32),
          _descale(rng, a_d), _descale(rng, b_d))


def _ragged_float64(a, b_t, sizes, a_d, b_d, mode):
  """out [M, Nout] and its sums of |terms|, group by group, from the dequantized values."""
  a, b_t, a_d, b_d = _f64(a), _f64(b_t), _f64(a_d), _f64(b_d)
  m, kc = a.shape
  cols, rows = np.arange(kc) // 128, np.arange(b_t.shape[1]) // 128
  if mode == "tensor":
    a, b_t = a * a_d, b_t * b_d[:, None, None]
  elif mode == "rowwise":
    a, b_t = a * a_d[:, None], b_t * b_d[:, :, None]
  else:  # 1x128 tiles of a, 128x128 blocks of each group's weight
    a, b_t = a * a_d[:, cols], b_t * b_d[:, rows[:, None], cols[None, :]]
  out, abs_sum = np.zeros((m, b_t.shape[1])), np.zeros((m, b_t.shape[1]))
  start = 0
  for g, size in enumerate(sizes):
    rows_g = slice(start, start + size)
    out[rows_g] = a[rows_g] @ b_t[g].T
    abs_sum[rows_g] = np.abs(a[rows_g]) @ np.abs(b_t[g]).T
    start += size
  return out, abs_sum


# 16 groups: empty ones first, inside and last; sizes not sorted; boundaries mid tile.
SIZES_16 = [0, 37, 0, 64, 5, 128, 0, 1, 90, 0, 33, 70, 0, 0, 41, 0]   # sum 469

# name -> (scale_mode, M, Kc, Nout, group sizes, out dtype, block sizes, num_sms)
RAGGED_CASES = {
    # Empty first, middle and last groups; unsorted sizes; boundaries at rows 70 and 115
    # (tile 0: one warpgroup has no row of group 3 and only passes its slots) and 195;
    # tail rows 195..327 (sum < M), M not a multiple of the 128-row tile.
    "fprop_tensor": ("tensor", 328, 256, 128, [0, 70, 0, 45, 80, 0], "bfloat16",
                     dict(num_stages=2), 3),
    # dgrad: a = dy8 [M, N], b_t = w8 [G, K, N] as stored; 16 groups, two N tiles.
    "dgrad_rowwise_g16": ("rowwise", 512, 128, 256, SIZES_16, "float32",
                          dict(num_stages=2), 2),
    # G = 1 with rows past the group (tail): the rows of the group are a plain
    # block-scaled GEMM. block_n = 64: two N tiles share one 128-row weight block.
    "fprop_block_g1": ("block", 256, 384, 192, [156], "bfloat16",
                       dict(block_n=64, num_stages=2), 2),
}


def _interpreter():
  try:
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
  except ImportError:
    pytest.skip("this jax has no Mosaic GPU CPU interpreter")
  return InterpretGPUParams(detect_races=True)


def _run_interpreted(fn, *args, **kwargs):
  from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks
  try:
    out = np.asarray(fn(*args, interpret=_interpreter(), **kwargs).astype("float32"))
  except Exception:
    gpu_callbacks.reset_gpu_interpret_mode_state()  # the interpreter asks for this
    raise
  assert not gpu_callbacks.get_races().races_found, "the interpreter found a data race"
  return out


@pytest.mark.parametrize("case", sorted(RAGGED_CASES))
def test_ragged_kernel_in_interpreter_matches_float64(case):
  rm, _, tiling = _modules()
  mode, m, kc, nout, sizes, out_dtype, blocks, num_sms = RAGGED_CASES[case]
  operands = _ragged_problem(1, m, kc, nout, sizes, mode)
  got = _run_interpreted(rm.ragged_matmul, *operands, scale_mode=mode, out_dtype=out_dtype,
                         block_sizes=tiling.RaggedMatmulBlockSizes(**blocks),
                         num_sms=num_sms)
  want, abs_sum = _ragged_float64(*operands[:2], sizes, *operands[3:], mode)
  _assert_within(got, want, _bound(abs_sum, want, -(-kc // 128), out_dtype))
  if case == "fprop_block_g1":  # G = 1: the group's rows are one block-scaled GEMM
    import jax.numpy as jnp
    from pallas_kernels import block_scaled_matmul_reference
    a, b_t, _, a_d, b_d = operands
    plain = _f64(block_scaled_matmul_reference(a, a_d, b_t[0], b_d[0], jnp.float32))
    rows = sizes[0]
    _assert_within(got[:rows], plain[:rows],
                   2 * _bound(abs_sum[:rows], want[:rows], 3, out_dtype))


@pytest.mark.parametrize("case", sorted(RAGGED_CASES) + ["fprop_tensor_f32", "rowwise_g1",
                                                         "block_bf16_tail"])
def test_ragged_reference_matches_float64(case):
  rm, _, tiling = _modules()
  extra = {"fprop_tensor_f32": ("tensor", 300, 200, 96, [0, 120, 7, 0, 100], "float32"),
           "rowwise_g1": ("rowwise", 64, 128, 64, [64], "bfloat16"),
           "block_bf16_tail": ("block", 200, 300, 150, [10, 0, 90, 3], "bfloat16")}
  mode, m, kc, nout, sizes, out_dtype = (RAGGED_CASES[case][:6] if case in RAGGED_CASES
                                         else extra[case])
  operands = _ragged_problem(2, m, kc, nout, sizes, mode)
  got = rm.ragged_matmul_reference(*operands, scale_mode=mode, out_dtype=out_dtype)
  want, abs_sum = _ragged_float64(*operands[:2], sizes, *operands[3:], mode)
  _assert_within(got, want, _bound(abs_sum, want, -(-kc // 128), out_dtype))


def test_ragged_reference_has_ragged_dot_semantics():
  """Against jax.lax.ragged_dot on the dequantized operands: rows past the groups' sum
  are zero, as JAX defines (per-tensor descales multiply exactly: powers of two)."""
  import jax
  import jax.numpy as jnp
  rm, _, _ = _modules()
  rng = np.random.default_rng(3)
  sizes = jnp.asarray([30, 0, 100, 20], jnp.int32)
  a, b_t = _e4m3(rng, (200, 128)), _e4m3(rng, (4, 64, 128))
  a_d, b_d = jnp.float32(2.0**-6), jnp.asarray([2.0**-3, 1.0, 2.0**5, 0.5], jnp.float32)
  got = rm.ragged_matmul_reference(a, b_t, sizes, a_d, b_d, scale_mode="tensor",
                                   out_dtype=jnp.float32)
  want = jax.lax.ragged_dot(a.astype(jnp.float32) * a_d,
                            jnp.swapaxes(b_t.astype(jnp.float32), 1, 2) * b_d[:, None, None],
                            sizes, precision=jax.lax.Precision.HIGHEST)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=1e-3)
  assert np.all(np.asarray(got)[150:] == 0)


# ----- the transposed (wgrad) form -------------------------------------------------------


def _transposed_problem(seed, m, ka, nb, sizes, mode):
  """(a_t [Ka, M], b_t [Nb, M], group_sizes, a_descale, b_descale); a_t's tokens past the
  groups (if any) are NaN (the kernel masks a_t; b_t there must be finite, as
  fp8_ragged_dot's casts write it: zeros)."""
  import jax.numpy as jnp
  rng = np.random.default_rng(seed)
  blocks = -(-m // 128)
  a_d, b_d = {"tensor": ((), ()), "rowwise": ((ka,), (nb,)),
              "block": ((ka, blocks), (nb, blocks))}[mode]
  a_t = _e4m3(rng, (ka, m)).at[:, sum(sizes):].set(jnp.nan)
  return (a_t, _e4m3(rng, (nb, m)), jnp.asarray(sizes, jnp.int32),
          _descale(rng, a_d), _descale(rng, b_d))


def _transposed_float64(a_t, b_t, sizes, a_d, b_d, mode):
  """out [G, Ka, Nb] and its sums of |terms|, group by group, from the dequantized values."""
  a_t, b_t, a_d, b_d = _f64(a_t), _f64(b_t), _f64(a_d), _f64(b_d)
  if mode == "tensor":
    a_t, b_t = a_t * a_d, b_t * b_d
  elif mode == "rowwise":
    a_t, b_t = a_t * a_d[:, None], b_t * b_d[:, None]
  else:  # one descale per row and 128-token block
    blocks = np.arange(a_t.shape[1]) // 128
    a_t, b_t = a_t * a_d[:, blocks], b_t * b_d[:, blocks]
  out = np.zeros((len(sizes), a_t.shape[0], b_t.shape[0]))
  abs_sum = np.zeros_like(out)
  start = 0
  for g, size in enumerate(sizes):
    tokens = slice(start, start + size)
    out[g] = a_t[:, tokens] @ b_t[:, tokens].T
    abs_sum[g] = np.abs(a_t[:, tokens]) @ np.abs(b_t[:, tokens]).T
    start += size
  return out, abs_sum


# name -> (scale_mode, M tokens, Ka, Nb, group sizes, out dtype, block sizes, num_sms)
TRANSPOSED_CASES = {
    # G = 1 over every token: x^T dy of a plain GEMM. M = 400: a partial last block.
    "wgrad_tensor_g1": ("tensor", 400, 128, 128, [400], "float32", dict(num_stages=2), 3),
    # 16 groups (empty first / middle / last, unsorted, boundaries mid block, 43 tokens
    # past the sum); two Ka tiles; block_n = 64; bf16 output.
    "wgrad_rowwise_g16": ("rowwise", 512, 256, 64, SIZES_16, "bfloat16",
                          dict(block_n=64, num_stages=3), 4),
    # An empty first group, a boundary at token 200 inside block 1, 16 tokens past the
    # sum in a partial last block (M = 272): the block scales of a shared block.
    "wgrad_block": ("block", 272, 128, 128, [0, 200, 56], "float32", dict(num_stages=2), 2),
}


@pytest.mark.parametrize("case", sorted(TRANSPOSED_CASES))
def test_transposed_kernel_in_interpreter_matches_float64(case):
  _, tr, tiling = _modules()
  mode, m, ka, nb, sizes, out_dtype, blocks, num_sms = TRANSPOSED_CASES[case]
  operands = _transposed_problem(4, m, ka, nb, sizes, mode)
  got = _run_interpreted(tr.transposed_ragged_matmul, *operands, scale_mode=mode,
                         out_dtype=out_dtype,
                         block_sizes=tiling.TransposedRaggedMatmulBlockSizes(**blocks),
                         num_sms=num_sms)
  want, abs_sum = _transposed_float64(*operands[:2], sizes, *operands[3:], mode)
  _assert_within(got, want, _bound(abs_sum, want, -(-m // 128), out_dtype))


@pytest.mark.parametrize("case", sorted(TRANSPOSED_CASES) + ["tensor_bf16_unsorted",
                                                             "block_small_m"])
def test_transposed_reference_matches_float64(case):
  _, tr, _ = _modules()
  extra = {"tensor_bf16_unsorted": ("tensor", 300, 64, 96, [0, 120, 7, 0, 100], "bfloat16"),
           "block_small_m": ("block", 40, 128, 64, [13, 0, 27], "float32")}
  mode, m, ka, nb, sizes, out_dtype = (TRANSPOSED_CASES[case][:6] if case in TRANSPOSED_CASES
                                       else extra[case])
  operands = _transposed_problem(5, m, ka, nb, sizes, mode)
  got = tr.transposed_ragged_matmul_reference(*operands, scale_mode=mode, out_dtype=out_dtype)
  want, abs_sum = _transposed_float64(*operands[:2], sizes, *operands[3:], mode)
  _assert_within(got, want, _bound(abs_sum, want, -(-m // 128), out_dtype))


# ----- the schedules ---------------------------------------------------------------------


@pytest.mark.parametrize("m, sizes", [(328, [0, 70, 0, 45, 80, 0]), (512, SIZES_16),
                                      (256, [256]), (100, [0, 0]), (384, [128, 128, 128])])
def test_row_tile_schedule_visits_every_row_once_in_its_own_group(m, sizes):
  import jax.numpy as jnp
  _, _, tiling = _modules()
  sched = tiling.row_tile_schedule(jnp.asarray(sizes, jnp.int32), m, 128)
  group, tile = np.asarray(sched.group), np.asarray(sched.m_tile)
  count = int(sched.num_items[0])
  assert len(group) == tiling.max_row_items(m, len(sizes), 128)
  assert np.all(group[count:] == -1) and np.all(group[:count] >= 0)
  owner = np.repeat(np.arange(len(sizes) + 1), np.diff(np.asarray(sched.offsets)))
  assert len(owner) == m
  seen = np.zeros(m, int)
  for g, t in zip(group[:count], tile[:count]):
    rows = np.arange(t * 128, min(t * 128 + 128, m))
    mine = rows[owner[rows] == g]
    assert len(mine), f"item ({g}, {t}) holds no row of its group"
    seen[mine] += 1
  assert np.all(seen == 1)


def test_token_block_schedule_covers_each_groups_tokens():
  import jax.numpy as jnp
  _, _, tiling = _modules()
  sched = tiling.token_block_schedule(jnp.asarray(SIZES_16, jnp.int32), 512)
  offsets = np.asarray(sched.offsets)
  for g, (first, count) in enumerate(zip(np.asarray(sched.first_block),
                                         np.asarray(sched.num_blocks))):
    start, stop = offsets[g], offsets[g + 1]
    if stop == start:
      assert count == 0
    else:
      assert first * 128 <= start and stop <= (first + count) * 128
      assert (first + 1) * 128 > start and (first + count - 1) * 128 < stop


# ----- argument checks ---------------------------------------------------------------------


def _ragged_specs(m=256, kc=256, nout=128, g=4, a_dtype=None, gs_shape=None, gs_dtype=None,
                  mode="tensor", a_d_shape=None):
  import jax
  import jax.numpy as jnp
  f8 = jnp.float8_e4m3fn
  a_d, b_d = {"tensor": ((), (g,)), "rowwise": ((m,), (g, nout)),
              "block": ((m, -(-kc // 128)), (g, -(-nout // 128), -(-kc // 128)))}[mode]
  return (jax.ShapeDtypeStruct((m, kc), a_dtype or f8),
          jax.ShapeDtypeStruct((g, nout, kc), f8),
          jax.ShapeDtypeStruct(gs_shape or (g,), gs_dtype or jnp.int32),
          jax.ShapeDtypeStruct(a_d_shape if a_d_shape is not None else a_d, jnp.float32),
          jax.ShapeDtypeStruct(b_d, jnp.float32))


@pytest.mark.parametrize("kwargs, call, match", [
    (dict(a_dtype="bfloat16"), {}, r"a must be float8_e4m3fn .*quantize it to E4M3"),
    (dict(gs_shape=(3,)), {}, r"group_sizes must be int32 \[G\] with G = 4"),
    (dict(gs_dtype="float32"), {}, r"group_sizes must be int32 .*astype\(jnp.int32\)"),
    (dict(mode="rowwise", a_d_shape=(255,)), dict(scale_mode="rowwise"),
     r"scale_mode='rowwise', a_descale must be float32 \[256\]"),
    (dict(kc=200, mode="block"), dict(scale_mode="block"), r"Kc=200 .*pad a and b_t with zero "
     r"columns up to 256"),
    (dict(nout=96), {}, r"Nout=96 .*block_n"),
    ({}, dict(scale_mode="per_channel"), r"scale_mode='per_channel' must be one of"),
    (dict(mode="block"), dict(scale_mode="block", block_n=256), r"block_n=256 must be 64 or "
     r"128 with scale_mode='block'"),
    (dict(kc=1024, nout=256), dict(block_n=256, num_stages=4, out_dtype="float32"),
     r"needs \d+ bytes of shared memory.*lower num_stages"),
])
def test_ragged_matmul_rejects_bad_inputs_with_the_fix(kwargs, call, match):
  rm, _, tiling = _modules()
  call = dict(call)
  blocks = {k: call.pop(k) for k in ("block_n", "num_stages") if k in call}
  call.setdefault("scale_mode", "tensor")
  with pytest.raises(ValueError, match=match):
    rm.ragged_matmul(*_ragged_specs(**kwargs), block_sizes=tiling.RaggedMatmulBlockSizes(
        **blocks), num_sms=132, **call)


def test_ragged_matmul_rejects_weights_not_transposed():
  import jax
  import jax.numpy as jnp
  rm, _, _ = _modules()
  a, _, gs, a_d, b_d = _ragged_specs(kc=256, nout=128)
  w = jax.ShapeDtypeStruct((4, 256, 128), jnp.float8_e4m3fn)   # [G, K, N]: not K-major
  with pytest.raises(ValueError, match=r"b_t must be \[G, Nout, Kc\] with Kc = 256.*transposed"):
    rm.ragged_matmul_reference(a, w, gs, a_d, b_d, scale_mode="tensor")


@pytest.mark.parametrize("shapes, match", [
    (((128, 200), (128, 200)), r"M=200 must be a positive multiple of 16.*up to 208"),
    (((100, 256), (128, 256)), r"Ka=100 .*pad a_t with zero rows up to 128"),
    (((128, 256), (128, 240)), r"b_t must be \[Nb, M\] with M = 256 tokens"),
])
def test_transposed_ragged_matmul_rejects_bad_shapes_with_the_fix(shapes, match):
  import jax
  import jax.numpy as jnp
  _, tr, _ = _modules()
  f8, f32 = jnp.float8_e4m3fn, jnp.float32
  a_t, b_t = (jax.ShapeDtypeStruct(s, f8) for s in shapes)
  with pytest.raises(ValueError, match=match):
    tr.transposed_ragged_matmul(a_t, b_t, jax.ShapeDtypeStruct((4,), jnp.int32),
                                jax.ShapeDtypeStruct((), f32), jax.ShapeDtypeStruct((), f32),
                                scale_mode="tensor", num_sms=132)


def test_block_sizes_reject_tiles_the_kernels_cannot_run():
  _, _, tiling = _modules()
  for cls in (tiling.RaggedMatmulBlockSizes, tiling.TransposedRaggedMatmulBlockSizes):
    for kwargs in (dict(block_m=64), dict(block_n=96), dict(num_stages=1)):
      with pytest.raises(ValueError):
        cls(**kwargs)


# ----- on a real Hopper GPU: the compiled kernels against float64 --------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["tensor", "rowwise", "block"])
def test_compiled_kernels_match_float64_on_hopper(mode, hopper_device):
  import jax
  rm, tr, _ = _modules()
  sizes = [0, 200, 37, 0, 300, 128, 90, 0]   # sum 755 of 1000 rows: tail, empty groups
  fwd = jax.device_put(_ragged_problem(6, 1000, 1024, 512, sizes, mode), hopper_device)
  got = jax.jit(lambda *x: rm.ragged_matmul(*x, scale_mode=mode))(*fwd)
  want, abs_sum = _ragged_float64(*fwd[:2], sizes, *fwd[3:], mode)
  # The FP8 wgmma accumulator keeps fewer bits than float32 (about 14, DeepSeek-V3
  # reports): about one rounding of 2**-14 of the running sum per k32 instruction it
  # chains. Over a 128-deep step ("block": promoted every step) that is 4 roundings,
  # allowed 2**-10 of the sum of |terms|; over all of K = 1024 ("tensor", "rowwise")
  # 32 roundings, allowed 2**-8. With |value| ~ sum|terms| / sqrt(K) for these random
  # terms, that is typically ~1/8 of |value|: a wrong tile's O(|value|) error still fails.
  chained = 2.0**-10 if mode == "block" else 2.0**-8
  _assert_within(got, want, _bound(abs_sum, want, 8, "bfloat16") + chained * abs_sum,
                 typical_bound=0.25)
  wgrad = jax.device_put(_transposed_problem(7, 1008, 512, 256, sizes, mode), hopper_device)
  got = jax.jit(lambda *x: tr.transposed_ragged_matmul(*x, scale_mode=mode))(*wgrad)
  want, abs_sum = _transposed_float64(*wgrad[:2], sizes, *wgrad[3:], mode)
  _assert_within(got, want, _bound(abs_sum, want, 8, "float32") + chained * abs_sum,
                 typical_bound=0.25)
