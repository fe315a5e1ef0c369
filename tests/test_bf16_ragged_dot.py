"""`fp8jax.bf16_ragged_dot` (JAX's bf16 Hopper grouped GEMMs, else lax.ragged_dot) against float64.

* On a CPU the op is `lax.ragged_dot` and JAX's own gradients of it, bit for bit, and all
  three products (y, dx, dw) match a float64 oracle written from the definition, with
  empty groups, group boundaries inside 128-row tiles and rows past the groups' sum.
* JAX's forward kernel (ragged_dot_mgpu) runs in Mosaic GPU's CPU interpreter against the
  same oracle, through the op's own wrapper (size clipping, zeroed tail rows). Its dgrad
  (`transpose_rhs`: a transposed shared-memory view as wgmma operand) and JAX's wgrad
  kernel (transposed_ragged_dot_mgpu: `plgpu.layout_cast` and a transposed view) cannot run
  in that interpreter (jax 0.10.2 and 0.11); they are compiled for an H100 here
  (deviceless) and checked against float64 by the `gpu` test on a Hopper GPU.

Error bound, per element (u = 2**-24, S = the float64 sum of |terms| of that element, T
its number of terms): products of two bf16 (or f16) values are exact in float32; their sum
in float32 is off by at most (T - 1) u S; a 16-bit output adds its rounding to nearest,
at most 2**-8 (bf16) or 2**-11 (f16) of the value. Rows without terms (past the groups'
sum) and empty experts' weight gradients have S = 0: they must be exactly 0.
"""
import functools
import types
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp8jax
from fp8jax import deviceless, lowering
from fp8jax.lowering import ExpertPath, GemmKind
from fp8jax.ops import bf16_ragged_dot as op

U = 2.0**-24
ROUNDING = {jnp.dtype(jnp.bfloat16): 2.0**-8, jnp.dtype(jnp.float16): 2.0**-11,
            jnp.dtype(jnp.float32): 0.0}
# Boundaries inside 128-row tiles (150, 350, 450), an empty expert, 62 tail rows.
SIZES = (150, 0, 200, 100)


def _operands(m, k, n, dtype, seed=0):
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.standard_normal((m, k)), dtype)
  w = jnp.asarray(rng.standard_normal((len(SIZES), k, n)) * k**-0.5, dtype)
  dy = jnp.asarray(rng.standard_normal((m, n)), dtype)
  return x, w, jnp.asarray(SIZES, jnp.int32), dy


def _oracle(x, w, sizes, dy):
  """float64 (y, dx, dw), each with its S and T, from the definition (sizes clipped as
  lax.ragged_dot reads them)."""
  x, w, dy = (np.asarray(jnp.asarray(a, jnp.float32), np.float64) for a in (x, w, dy))
  m, k = x.shape
  ends = np.minimum(np.cumsum(np.maximum(np.asarray(sizes), 0)), m)
  starts = np.concatenate([[0], ends[:-1]])
  y, y_abs = np.zeros((m, w.shape[2])), np.zeros((m, w.shape[2]))
  dx, dx_abs = np.zeros_like(x), np.zeros_like(x)
  dw, dw_abs = np.zeros_like(w), np.zeros_like(w)
  for g, (start, end) in enumerate(zip(starts, ends)):
    rows = slice(start, end)
    y[rows], y_abs[rows] = x[rows] @ w[g], np.abs(x[rows]) @ np.abs(w[g])
    dx[rows], dx_abs[rows] = dy[rows] @ w[g].T, np.abs(dy[rows]) @ np.abs(w[g]).T
    dw[g], dw_abs[g] = x[rows].T @ dy[rows], np.abs(x[rows]).T @ np.abs(dy[rows])
  longest_group = int(np.max(ends - starts))
  return {"y": (y, y_abs, k), "dx": (dx, dx_abs, w.shape[2]), "dw": (dw, dw_abs, longest_group)}


def _assert_within_bound(name, got, want, abs_sum, terms, dtype):
  got = np.asarray(jnp.asarray(got, jnp.float32), np.float64)
  rounding = ROUNDING[jnp.dtype(dtype)]
  bound = max(terms - 1, 0) * U * abs_sum * (1 + rounding) + rounding * np.abs(want)
  err = np.abs(got - want)
  assert (err <= bound).all(), (name, float((err - bound).max()))
  assert (got[abs_sum == 0] == 0).all(), f"{name}: an element without terms is not 0"


def _loss(op_fn, x, w, sizes, dy):
  return jnp.sum(op_fn(x, w, sizes).astype(jnp.float32) * dy.astype(jnp.float32))


@pytest.mark.parametrize("m, k, n, dtype", [
    (512, 256, 384, jnp.bfloat16),   # the kernels' shapes: the custom VJP
    (512, 256, 384, jnp.float16),
    (512, 96, 384, jnp.bfloat16),    # K off the 128 tiles: lax.ragged_dot itself
    (512, 256, 384, jnp.float32),    # not a kernel dtype: lax.ragged_dot itself
], ids=["bf16", "f16", "bf16-untiled", "f32"])
def test_forward_and_both_gradients_match_float64_on_cpu(m, k, n, dtype):
  x, w, sizes, dy = _operands(m, k, n, dtype)
  y = jax.jit(fp8jax.bf16_ragged_dot)(x, w, sizes)
  # The loss sum(y * dy) has gradient dy with respect to y (exact: dy holds 16-bit values).
  dx, dw = jax.jit(jax.grad(functools.partial(_loss, fp8jax.bf16_ragged_dot),
                            argnums=(0, 1)))(x, w, sizes, dy)
  assert y.dtype == dx.dtype == dw.dtype == jnp.dtype(dtype)
  want = _oracle(x, w, sizes, dy)
  for name, got in (("y", y), ("dx", dx), ("dw", dw)):
    _assert_within_bound(name, got, *want[name], dtype)


@pytest.mark.parametrize("sizes, all_rows_grouped", [(SIZES, False), ((150, 0, 200, 162), True)],
                         ids=["tail", "all-rows-grouped"])
def test_on_a_cpu_it_is_lax_ragged_dot_and_its_gradients_bit_for_bit(sizes, all_rows_grouped):
  """The MoE layers' bf16 numbers on a CPU are what they were with lax.ragged_dot."""
  x, w, _, dy = _operands(512, 256, 384, jnp.bfloat16, seed=1)
  sizes = jnp.asarray(sizes, jnp.int32)
  ours_op = functools.partial(fp8jax.bf16_ragged_dot, all_rows_grouped=all_rows_grouped)
  ours = jax.jit(jax.value_and_grad(functools.partial(_loss, ours_op),
                                    argnums=(0, 1)))(x, w, sizes, dy)
  jaxs = jax.jit(jax.value_and_grad(functools.partial(_loss, jax.lax.ragged_dot),
                                    argnums=(0, 1)))(x, w, sizes, dy)
  for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(jaxs)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_under_vmap_each_example_is_its_own_ragged_dot():
  """Batched operands (all three: lax.ragged_dot batches no other way) run lax.ragged_dot
  vmapped, a Mosaic kernel having no batching rule."""
  x, w, sizes, _ = _operands(512, 256, 384, jnp.bfloat16, seed=2)
  xs, ws = jnp.stack([x, -x]), jnp.stack([w, 2 * w])
  all_sizes = jnp.stack([sizes, sizes[::-1]])
  got = jax.vmap(fp8jax.bf16_ragged_dot)(xs, ws, all_sizes)
  for i in range(2):
    np.testing.assert_array_equal(np.asarray(got[i]),
                                  np.asarray(jax.lax.ragged_dot(xs[i], ws[i], all_sizes[i])))


@pytest.fixture
def jax_kernels_interpreted(monkeypatch):
  """JAX's Mosaic GPU kernels take no `interpret` option: while this fixture holds,
  `plgpu.kernel` runs every kernel in Mosaic GPU's CPU interpreter."""
  from jax.experimental.pallas import mosaic_gpu as plgpu

  from pallas_kernels.mosaic_target import interpret_params
  if op._mosaic_kernels() is None:
    pytest.skip("this JAX has no Mosaic GPU grouped GEMMs")
  monkeypatch.setattr(plgpu, "kernel", functools.partial(plgpu.kernel,
                                                         interpret=interpret_params(True)))


@pytest.mark.parametrize("sizes, all_rows_grouped", [
    (SIZES, False), ((-3, 300, 500, 100), False), ((150, 0, 200, 162), True)],
    ids=["tail-and-empty-expert", "negative-and-past-m", "all-rows-grouped"])
def test_jax_forward_kernel_in_the_interpreter_matches_float64(sizes, all_rows_grouped,
                                                               jax_kernels_interpreted):
  """The kernel path's forward (the cuda branch of the op): sizes clipped as lax.ragged_dot
  reads them (-3 -> 0, 500 -> the 212 rows left), and the tail rows, which the kernel leaves
  unwritten (NaN in the interpreter), zero; with all rows grouped, the kernel's output."""
  x, w, _, dy = _operands(512, 256, 384, jnp.bfloat16, seed=3)
  sizes = jnp.asarray(sizes, jnp.int32)
  y = op._kernel_fprop(x, w, sizes, all_rows_grouped=all_rows_grouped)
  _assert_within_bound("y", y, *_oracle(x, w, sizes, dy)["y"], jnp.bfloat16)


def test_bad_arguments_are_named():
  x, w, sizes, _ = _operands(512, 256, 384, jnp.bfloat16)
  with pytest.raises(ValueError, match=r"group_sizes must be an int32 array of shape \(4,\)"):
    fp8jax.bf16_ragged_dot(x, w, sizes.astype(jnp.float32))
  with pytest.raises(ValueError, match=r"group_sizes must be an int32 array of shape \(4,\)"):
    fp8jax.bf16_ragged_dot(x, w, sizes[:3])
  with pytest.raises(ValueError, match="has a negative size"):
    fp8jax.bf16_ragged_dot(x, w, jnp.asarray([-1, 2, 3, 4], jnp.int32))
  with pytest.raises(ValueError, match="sums to 1000, more than the 512 rows of x"):
    fp8jax.bf16_ragged_dot(x, w, jnp.asarray([250] * 4, jnp.int32))
  with pytest.raises(ValueError, match=r"bf16_ragged_dot takes x \[M, K\] and w \[G, K, N\]"):
    fp8jax.bf16_ragged_dot(x[:, :128], w, sizes)
  with pytest.raises(TypeError, match="x has dtype int32"):
    fp8jax.bf16_ragged_dot(x.astype(jnp.int32), w, sizes)
  with pytest.raises(ValueError, match="all_rows_grouped=True, but group_sizes sums to 450, "
                     "not the 512 rows of x"):
    fp8jax.bf16_ragged_dot(x, w, sizes, all_rows_grouped=True)
  with pytest.raises(TypeError, match="all_rows_grouped=1 must be True or False"):
    fp8jax.bf16_ragged_dot(x, w, sizes, all_rows_grouped=1)


def test_forward_mode_is_refused_by_name_where_the_kernels_may_run():
  x, w, sizes, _ = _operands(512, 256, 384, jnp.bfloat16)
  with pytest.raises(fp8jax.ForwardModeError, match="bf16_ragged_dot supports reverse-mode"):
    jax.jvp(lambda x: fp8jax.bf16_ragged_dot(x, w, sizes), (x,), (x,))


def test_on_a_hopper_gpu_a_call_the_kernels_cannot_take_warns_once_with_the_reason(monkeypatch):
  """Made to look like a Hopper GPU process: K = 96 is off the kernels' tiles."""
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  hopper = types.SimpleNamespace(compute_capability="9.0", core_count=132)
  monkeypatch.setattr(jax, "devices", lambda *args, **kwargs: [hopper])
  monkeypatch.setattr(op, "_WARNED", set())
  x, w, sizes, _ = _operands(512, 96, 384, jnp.bfloat16)
  with pytest.warns(UserWarning, match=r"dense expansion.*\{'K': 96\} not positive multiples"):
    fp8jax.bf16_ragged_dot(x, w, sizes)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    fp8jax.bf16_ragged_dot(x, w, sizes)


_MISSING = deviceless.deviceless_toolchain_missing()


@pytest.mark.hopper
@pytest.mark.skipif(_MISSING is not None, reason=str(_MISSING))
def test_for_an_h100_its_three_gemms_are_jax_grouped_kernels_off_tiles_a_dense_expansion():
  m, k, n, g = 512, 256, 384, len(SIZES)

  def step(k):
    specs = (jax.ShapeDtypeStruct((m, k), jnp.bfloat16),
             jax.ShapeDtypeStruct((g, k, n), jnp.bfloat16),
             jax.ShapeDtypeStruct((g,), jnp.int32), jax.ShapeDtypeStruct((m, n), jnp.bfloat16))
    grad = jax.value_and_grad(functools.partial(_loss, fp8jax.bf16_ragged_dot), argnums=(0, 1))
    return deviceless.compile_for_h100(
        grad, *specs, compiler_options=lowering.CUBLAS_ONLY_OPTIONS).as_text()

  hlo = step(k)
  report = lowering.inspect_hlo(hlo)
  assert len(report.gemms) == 3, str(report)
  assert all(gemm.kind is GemmKind.GROUPED and gemm.expert_path is ExpertPath.GROUPED_KERNEL
             and gemm.operand_dtypes == ("bf16", "bf16") for gemm in report.gemms), str(report)
  costs = lowering.cost_hlo(hlo)
  gemms = [kernel for kernel in costs.kernels if kernel.is_gemm]
  assert sorted(kernel.grouped_kernel for kernel in gemms) == [
      "ragged_dot_mgpu", "ragged_dot_mgpu", "transposed_ragged_dot_mgpu"], costs.table()
  # Each one dense GEMM's FLOPs (every row with its own expert), at the bf16 rate.
  assert all(kernel.flops == 2 * m * k * n and kernel.gemm_dtype == "bf16"
             for kernel in gemms), costs.table()

  untiled = lowering.inspect_hlo(step(96))
  assert untiled.expert_gemms() and all(
      gemm.expert_path is ExpertPath.DENSE_EXPANSION for gemm in untiled.expert_gemms())


@pytest.mark.gpu
@pytest.mark.parametrize("sizes, all_rows_grouped", [(SIZES, False), ((150, 0, 200, 162), True)],
                         ids=["tail", "all-rows-grouped"])
def test_compiled_jax_kernels_match_float64_forward_and_backward_on_hopper(
    sizes, all_rows_grouped, hopper_device):
  x, w, _, dy = _operands(512, 256, 384, jnp.bfloat16, seed=4)
  sizes = jnp.asarray(sizes, jnp.int32)
  x, w, sizes, dy = jax.device_put((x, w, sizes, dy), hopper_device)
  grouped = functools.partial(fp8jax.bf16_ragged_dot, all_rows_grouped=all_rows_grouped)
  y = jax.jit(grouped)(x, w, sizes)
  dx, dw = jax.jit(jax.grad(functools.partial(_loss, grouped), argnums=(0, 1)))(x, w, sizes, dy)
  want = _oracle(x, w, sizes, dy)
  for name, got in (("y", y), ("dx", dx), ("dw", dw)):
    _assert_within_bound(name, got, *want[name], jnp.bfloat16)
