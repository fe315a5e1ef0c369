"""RowwiseScaling, BlockScaling and MXFP8Scaling: numerics vs float64, lowering, training.

Numerics of `fp8_dense` (forward, dx, dk) are checked against two float64 references:

* exact arithmetic: the float64 reference quantizer of tests/test_block_quantize.py
  applied with the layout the recipe specifies (each GEMM quantizes both operands
  along its own contraction axis), then float64 matmuls of the dequantized
  operands. What separates the library from it is float32 arithmetic only: a
  dequantized operand is rounded to float32 (relative 2**-24 each, emulated
  GEMMs), the K-term float32 accumulation ((K - 1) * 2**-24 of sum |a||b| to
  first order) and the descale / output roundings (3 * 2**-24). The tolerance
  is twice (K + 4) * 2**-24 * (|A| @ |B|): the factor 2 covers second-order terms.
* unquantized float64 math with a bound derived from the formats: an element x
  of a block with scale s carries an error of at most
  max(u |x|, min_subnormal / 2 / s, |x| - fmt.max / s), u = 2**-(mantissa_bits + 1)
  (2**-4 for E4M3, 2**-3 for E5M2); the last term is saturation (MX's largest
  element may exceed fmt.max by up to 2**(emax+1) / fmt.max). For a dot product
  sum_i a_i b_i the error is then at most sum_i (ea_i |b_i| + |a_i| eb_i + ea_i eb_i),
  as in tests/test_dense_numerics.py, plus the float32 slack above.
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fp8jax
import fp8jax.checkpoint as ckpt
from fp8jax.core import blocks as bq
from fp8jax import lowering
from fp8jax.deviceless import deviceless_toolchain_missing
from fp8jax.core.blocks import emulated_block_gemm
from fp8jax.flax import linen as fp8nn
from fp8jax.lowering import GemmKind
from fp8_reference import FORMAT_TABLE
from test_block_quantize import reference_quantize, rows_of_different_magnitudes
from pallas_kernels.block_scaled_matmul import block_scaled_matmul_reference

RECIPES = {
    "rowwise": fp8jax.RowwiseScaling(),
    "rowwise_e4m3_pow2": fp8jax.RowwiseScaling(fp8_format="e4m3", power_of_two=True),
    "block": fp8jax.BlockScaling(block_size=32),
    "block_hybrid_pow2": fp8jax.BlockScaling(block_size=16, fp8_format="hybrid",
                                             power_of_two=True),
    "mxfp8": fp8jax.MXFP8Scaling(),
    "mxfp8_e5m2": fp8jax.MXFP8Scaling(fp8_format="e5m2"),
    "mxfp8_round_up": fp8jax.MXFP8Scaling(scale_rounding="round_up"),
}


def gemm_blocks(recipe, role, shape, axis):
  """The block shape the recipe specifies for `role` of shape [R, C] contracted along `axis`."""
  rows, cols = shape
  if isinstance(recipe, fp8jax.RowwiseScaling):
    return (1, cols) if axis == -1 else (rows, 1)
  size = 32 if isinstance(recipe, fp8jax.MXFP8Scaling) else recipe.block_size
  if isinstance(recipe, fp8jax.BlockScaling) and role == "kernel":
    return (size, size)
  return (1, size) if axis == -1 else (size, 1)


def reference_operand(recipe, role, t, axis):
  """(dequantized float64 values, per-element float64 error bound) of one GEMM operand."""
  fmt = (recipe.gradient_format if role == "grad" else recipe.forward_format).name
  block = gemm_blocks(recipe, role, t.shape, axis)
  rule = ({"floor": "mx", "round_up": "mx_round_up"}[recipe.scale_rounding]
          if isinstance(recipe, fp8jax.MXFP8Scaling)
          else "power_of_two" if recipe.power_of_two else "float32")
  _, scale_inv, deq = reference_quantize(t, block, fmt, rule)
  inv = np.asarray(bq.expand_blocks(jnp.asarray(scale_inv), block, t.shape), np.float64)
  table = FORMAT_TABLE[fmt]
  u = 2.0**-(table["mantissa_bits"] + 1)
  a = np.abs(t.astype(np.float64))
  error = np.maximum.reduce([u * a, table["min_subnormal"] / 2 * inv,
                             a - table["max"] * inv])
  return deq.astype(np.float64), error


def problem(seed, m, k, n):
  """x with rows of very different magnitudes, a kernel, an output gradient (float32)."""
  x = rows_of_different_magnitudes((m, k), seed)
  rng = np.random.default_rng(seed + 1)
  kernel = (rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float32)
  g = rows_of_different_magnitudes((m, n), seed + 2)
  return x, kernel, g


@jax.jit
def _dense_vjp(x, kernel, g, meta):
  y, vjp = jax.vjp(lambda x, k: fp8jax.fp8_dense(x, k, None, meta)[0], x, kernel)
  return (y, *vjp(g))


def dense_and_grads(recipe, x, kernel, g):
  """fp8_dense's output and the gradients of sum(y * g) (so the output gradient is g)."""
  outs = _dense_vjp(jnp.asarray(x), jnp.asarray(kernel), jnp.asarray(g),
                    fp8jax.init_dot_meta(recipe))
  return [np.asarray(t, np.float64) for t in outs]


@pytest.mark.parametrize("recipe", RECIPES.values(), ids=list(RECIPES))
@pytest.mark.parametrize("m,k,n", [(64, 96, 48), (40, 70, 36)], ids=["multiple", "partial"])
def test_fp8_dense_forward_and_grads_match_float64_references(recipe, m, k, n):
  x, kernel, g = problem(0, m, k, n)
  y, dx, dk = dense_and_grads(recipe, x, kernel, g)
  # Each GEMM's operands (role, tensor, contraction axis of the tensor as stored,
  # used transposed?): quantized along that GEMM's contraction axis.
  gemms = [
      (y, ("x", x, -1, False), ("kernel", kernel, -2, False)),      # x @ k
      (dx, ("grad", g, -1, False), ("kernel", kernel, -1, True)),   # g @ k^T
      (dk, ("x", x, -2, True), ("grad", g, -2, False)),             # x^T @ g
  ]
  for got, *operands in gemms:
    (a, a_deq, a_err), (b, b_deq, b_err) = (
        [t.T if transposed else t
         for t in (tensor, *reference_operand(recipe, role, tensor, axis))]
        for role, tensor, axis, transposed in operands)
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    contraction = a.shape[1]
    f32_slack = 2 * (contraction + 4) * 2.0**-24 * (np.abs(a_deq) @ np.abs(b_deq))
    exact = a_deq @ b_deq
    assert np.all(np.abs(got - exact) <= f32_slack), np.max(np.abs(got - exact) / f32_slack)
    bound = a_err @ np.abs(b64) + np.abs(a64) @ b_err + a_err @ b_err + f32_slack
    want = a64 @ b64
    assert np.all(np.abs(got - want) <= bound), np.max(np.abs(got - want) / bound)
    # Not vacuous: the FP8 error is there, but well below the signal.
    assert 0 < np.linalg.norm(got - want) / np.linalg.norm(want) < 0.15


@pytest.mark.parametrize("name", ["rowwise", "block", "mxfp8"])
def test_fine_grained_scaling_beats_per_tensor_current_scaling_on_rows_of_different_magnitudes(
    name):
  """Rows spanning 10**-4..10**4: one per-tensor scale flushes the small rows to (near) zero."""
  x, kernel, g = problem(3, 64, 96, 48)
  want = x.astype(np.float64) @ kernel.astype(np.float64)

  def worst_row_error(recipe):
    y = dense_and_grads(recipe, x, kernel, g)[0]
    return np.max(np.linalg.norm(y - want, axis=1) / np.linalg.norm(want, axis=1))

  fine, per_tensor = worst_row_error(RECIPES[name]), worst_row_error(fp8jax.CurrentScaling())
  # E4M3 on both operands gives a few percent per row; per-tensor loses whole rows.
  assert fine < 0.1 and fine < per_tensor / 4, (fine, per_tensor)


@pytest.mark.parametrize("recipe", [RECIPES["rowwise"], RECIPES["block"], RECIPES["mxfp8"]],
                         ids=["rowwise", "block", "mxfp8"])
def test_batched_einsum_matches_float64(recipe):
  x = jax.random.normal(jax.random.key(0), (3, 20, 40))
  k = jax.random.normal(jax.random.key(1), (3, 40, 24))
  g = jax.random.normal(jax.random.key(2), (3, 20, 24))

  @jax.jit
  def einsum_vjp(x, k, g, meta):
    out, vjp = jax.vjp(lambda x, k: fp8jax.fp8_einsum("bij,bjk->bik", x, k, meta)[0], x, k)
    return (out, *vjp(g))

  got_all = einsum_vjp(x, k, g, fp8jax.init_dot_meta(recipe))
  x64, k64, g64 = (np.asarray(t, np.float64) for t in (x, k, g))
  want_all = (np.einsum("bij,bjk->bik", x64, k64), np.einsum("bik,bjk->bij", g64, k64),
              np.einsum("bij,bik->bjk", x64, g64))
  # Relative norm error of FP8 dots of normal data: a few percent per operand
  # (E4M3 2**-4, E5M2 2**-3 at most per element); below 10% for the product.
  for got, want in zip(got_all, want_all):
    err = np.linalg.norm(np.asarray(got, np.float64) - np.asarray(want)) / np.linalg.norm(want)
    assert got.shape == want.shape and err < 0.1, err


def test_amaxes_of_every_role_are_recorded_in_value_and_grad():
  x, kernel, g = problem(4, 32, 48, 16)
  target = jnp.asarray(g)

  def loss(params, fp8_state):
    y, meta = fp8jax.fp8_dense(params["x"], params["k"], None, fp8_state)
    return jnp.sum(y * target), meta  # the output gradient is exactly `target`

  params = {"x": jnp.asarray(x), "k": jnp.asarray(kernel)}
  for recipe in (RECIPES["rowwise"], RECIPES["block"], RECIPES["mxfp8"]):
    _, _, state = jax.jit(fp8jax.value_and_grad(loss))(params, fp8jax.init_dot_meta(recipe))
    for role, t in (("x", x), ("kernel", kernel), ("grad", g)):
      assert float(getattr(state, role).amax_history[0]) == np.max(np.abs(t)), (recipe, role)


# ----- Block GEMM: the emulation and the block-scaled kernel's reference ---------------------


def test_block_emulation_equals_block_scaled_matmul_reference_on_the_same_operands():
  # K = 300 (a partial last 128 chunk), N = 200 (a partial last 128 block).
  x, kernel, _ = problem(5, 48, 300, 200)
  recipe = fp8jax.BlockScaling()
  a = recipe.quantize_operand(jnp.asarray(x), fp8jax.E4M3, axis=-1, weight=False)
  b = recipe.quantize_operand(jnp.asarray(kernel), fp8jax.E4M3, axis=-2, weight=True)
  got = np.asarray(emulated_block_gemm(a, b, jnp.float32), np.float64)
  want = np.asarray(block_scaled_matmul_reference(a.q, a.scale_inv, b.q.T, b.scale_inv.T,
                                                  jnp.float32), np.float64)
  # Same products, other float32 order: the emulation rounds each dequantized
  # element (2 * 2**-24 per term) and sums all K at once; the reference sums each
  # 128-chunk of raw FP8 products exactly (4-bit x 4-bit mantissas), scales it and
  # adds the chunks. Both are within (K + 4) * 2**-24 of the exact sum of |terms|.
  magnitude = np.abs(np.asarray(bq.dequantize_blocks(a), np.float64)) @ np.abs(
      np.asarray(bq.dequantize_blocks(b), np.float64))
  assert np.all(np.abs(got - want) <= 2 * (300 + 4) * 2.0**-24 * magnitude)
  # And fp8_dense under BlockScaling() runs exactly that GEMM.
  meta = fp8jax.init_dot_meta(recipe)
  y, _ = fp8jax.fp8_dense(jnp.asarray(x), jnp.asarray(kernel), None, meta)
  np.testing.assert_array_equal(np.asarray(y, np.float64), got)


def test_pallas_hopper_gemm_on_cpu_is_refused_naming_the_option():
  meta = fp8jax.init_dot_meta(fp8jax.BlockScaling(gemm="pallas_hopper"))
  x, kernel = jnp.ones((128, 128)), jnp.ones((128, 128))
  with pytest.raises(ValueError, match="gemm='pallas_hopper'.*needs a GPU.*gemm='emulated'"):
    fp8jax.fp8_dense(x, kernel, None, meta)


# ----- Deviceless H100: rowwise GEMMs are cuBLASLt FP8 -----------------------------------------

_MISSING = deviceless_toolchain_missing()


@pytest.mark.hopper
@pytest.mark.skipif(_MISSING is not None, reason=_MISSING or "")
def test_rowwise_gemms_are_cublaslt_fp8_with_the_scales_applied_after_the_product():
  m, k, n = 64, 128, 256

  def loss(params, fp8_state):
    y, meta = fp8jax.fp8_dense(params["x"], params["k"], None, fp8_state)
    return jnp.sum(jnp.square(y.astype(jnp.float32))), meta

  spec = lambda *s: jax.ShapeDtypeStruct(s, jnp.bfloat16)
  report = lowering.inspect(fp8jax.value_and_grad(loss), {"x": spec(m, k), "k": spec(k, n)},
                            fp8jax.init_dot_meta(fp8jax.RowwiseScaling()),
                            compiler_options=lowering.CUBLAS_ONLY_OPTIONS, target="deviceless")
  assert len(report.gemms) == 3 and report.all_fp8, str(report)
  assert {g.role for g in report.gemms} == {"fprop", "dgrad", "wgrad"}, str(report)
  for gemm in report.gemms:
    assert gemm.kind is GemmKind.CUBLASLT_FP8, str(report)
    for operand in (gemm.lhs, gemm.rhs):
      # Raw FP8 operands: a row/column scale applied before the dot would have
      # made them bf16/f32 (and the GEMM not FP8).
      assert operand.dtype in ("f8e4m3fn", "f8e5m2") and not operand.upcast_fp8, str(report)
    # The GEMM writes its float32 product; the outer product of the descale
    # vectors is applied to it afterwards (cuBLASLt takes scalar scales only).
    assert gemm.output.startswith("f32["), str(report)


# ----- Training, Flax layers, checkpoints ----------------------------------------------------


TRAIN_RECIPES = {
    "rowwise": fp8jax.RowwiseScaling(),
    "block": fp8jax.BlockScaling(block_size=16),
    "mxfp8": fp8jax.MXFP8Scaling(),
    "mxfp8_round_up": fp8jax.MXFP8Scaling(scale_rounding="round_up"),
}


def linen_train_step(model, tx, x, y):
  """A jitted Adam step `(params, opt_state, fp8_state) -> (..., loss)` of a linen model
  (or `Fp8Model`) with FP8 state, on the mean squared error of `model(x)` to `y`."""

  def loss_fn(params, fp8_state):
    out, updated = model.apply({"params": params, fp8nn.FP8_COLLECTION: fp8_state}, x,
                               mutable=[fp8nn.FP8_COLLECTION])
    return jnp.mean((out - y) ** 2), updated[fp8nn.FP8_COLLECTION]

  @jax.jit
  def step(params, opt_state, fp8_state):
    loss, grads, fp8_state = fp8jax.value_and_grad(loss_fn)(params, fp8_state)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, fp8_state, loss

  return step


@pytest.mark.parametrize("recipe", TRAIN_RECIPES.values(), ids=list(TRAIN_RECIPES))
def test_two_layer_flax_mlp_trains_under_the_recipe(recipe):
  import flax.linen as nn

  class TwoLayer(nn.Module):
    @nn.compact
    def __call__(self, x):
      h = nn.relu(fp8nn.Fp8Dense(32, recipe=recipe)(x))
      return fp8nn.Fp8Dense(1, recipe=recipe)(h)

  model = TwoLayer()
  x = jax.random.normal(jax.random.key(0), (64, 16))
  y = jnp.sin(x[:, :1] * 2) + x[:, 1:2] ** 2
  variables = model.init(jax.random.key(1), x)
  params, fp8_state = variables["params"], variables[fp8nn.FP8_COLLECTION]
  tx = optax.adam(1e-2)
  opt_state = tx.init(params)
  step = linen_train_step(model, tx, x, y)
  losses = []
  for _ in range(30):
    params, opt_state, fp8_state, loss = step(params, opt_state, fp8_state)
    losses.append(float(loss))
  # Adam at 1e-2 on this smooth regression halves the loss well within 30 steps in
  # float32; a broken gradient (wrong scale, transposed layout) does not.
  assert np.all(np.isfinite(losses)) and losses[-1] < 0.5 * losses[0], losses


@pytest.mark.parametrize("recipe", [
    fp8jax.RowwiseScaling(power_of_two=True, high_precision=("wgrad",)),
    fp8jax.BlockScaling(block_size=64, high_precision=["dgrad", "wgrad"]),
    fp8jax.MXFP8Scaling(fp8_format="e5m2", high_precision=("fprop",)),
    fp8jax.MXFP8Scaling(scale_rounding="round_up", gemm="native"),
    fp8jax.NVFP4Scaling(weight_blocks="1x16", hadamard=False, high_precision=("wgrad",)),
], ids=["rowwise", "block", "mxfp8", "mxfp8_round_up", "nvfp4"])
def test_checkpoint_restores_the_same_recipe_with_tuple_fields(tmp_path, recipe):
  fp8_state = {"l1": fp8jax.init_dot_meta(recipe)}
  params = {"w": jnp.arange(6.0).reshape(2, 3)}
  path = ckpt.save(tmp_path / "c", params=params, opt_state={}, fp8_state=fp8_state)
  restored = ckpt.restore(path, params=params, opt_state={}, fp8_state=fp8_state)
  assert restored["fp8_state"]["l1"].x.recipe == recipe
  kept = ckpt.restore(path, params=params, opt_state={},
                      fp8_state={"l1": fp8jax.init_dot_meta(fp8jax.DelayedScaling())},
                      keep_saved_recipes=True)
  assert kept["fp8_state"]["l1"].grad.recipe == recipe
  assert isinstance(kept["fp8_state"]["l1"].grad.recipe.high_precision, tuple)


@pytest.mark.parametrize("recipe", [fp8jax.RowwiseScaling(), fp8jax.BlockScaling(),
                                    fp8jax.MXFP8Scaling()], ids=lambda r: type(r).__name__)
def test_fp8_attention_under_fine_grained_recipes_scales_each_tensor_from_its_own_amax(recipe):
  # The fused attention takes one scale per tensor: under the per-row / per-block
  # recipes it is current scaling, so a stale stored scale must not matter.
  q = jax.random.normal(jax.random.key(0), (1, 64, 2, 64), jnp.bfloat16) * 30
  fresh = fp8jax.init_attention_meta(recipe)
  stale = jax.tree.map(lambda m: m.with_scale(jnp.float32(1e-3)), fresh,
                       is_leaf=lambda n: isinstance(n, fp8jax.Fp8Meta))
  out_fresh, _ = fp8jax.fp8_attention(q, q, q, fresh, causal=True, backend="xla")
  out_stale, _ = fp8jax.fp8_attention(q, q, q, stale, causal=True, backend="xla")
  np.testing.assert_array_equal(np.asarray(out_fresh, np.float32),
                                np.asarray(out_stale, np.float32))


def test_pallas_hopper_gemm_hands_the_kernel_its_layout(monkeypatch):
  # On a GPU, BlockScaling(gemm="pallas_hopper") calls the Mosaic GPU kernel with A,
  # its [M, K/128] descales, B^T [N, K] and [N/128, K/128] descales. The kernel needs a
  # GPU; its reference has the same signature and semantics, so with the reference in
  # the kernel's place (and the backend reported as a GPU) the dispatch must give the
  # emulation's result: the same quantized operands, only the summation order differs
  # (f32 sums of 256 products: 2 * 256 * 2^-24 relative to sum |a||b|).
  import pallas_kernels
  from fp8jax.core import blocks
  monkeypatch.setattr(pallas_kernels, "block_scaled_matmul", block_scaled_matmul_reference)
  monkeypatch.setattr(blocks.jax, "default_backend", lambda: "gpu")
  rng = np.random.default_rng(7)
  x = jnp.asarray(rng.standard_normal((128, 256)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((256, 256)), jnp.float32)
  a = bq.quantize_blocks(x, fp8jax.E4M3, (1, 128))
  b = bq.quantize_blocks(w, fp8jax.E4M3, (128, 128))
  recipe = fp8jax.BlockScaling(gemm="pallas_hopper")
  with pytest.warns(UserWarning, match="not yet been validated"):
    got = recipe.operand_gemm(a, b, jnp.float32)
  want = emulated_block_gemm(a, b, jnp.float32)
  bound = 2 * 256 * 2.0**-24 * (np.abs(bq.dequantize_blocks(a)) @ np.abs(bq.dequantize_blocks(b)))
  assert np.all(np.abs(np.asarray(got) - np.asarray(want)) <= bound)
  assert float(jnp.max(jnp.abs(want))) > 1.0  # a real product, not zeros
