"""fp8jax's fused GPU kernels compute what fp8jax's own jnp computes, bit for bit.

On a GPU `fp8jax.fused_kernels` runs Pallas kernels where elsewhere it runs the
jnp definitions of `fp8jax.quantize` and `fp8jax.step.close`. Here the kernels run
in the Pallas interpreter (CPU) on the same inputs and must match fp8jax's jnp
results exactly: every FP8 byte and every float32 bit. The module's policy (which
programs get the kernels) and its fallbacks are checked too.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp8jax
import pallas_kernels
from fp8jax.ops import fused_kernels


def _bits(a):
  return np.asarray(a, np.float32).view(np.uint32)


@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_end_step_kernel_matches_fp8jax_end_step(algo):
  rng = np.random.default_rng(0 if algo == "max" else 1)
  recipe = fp8jax.DelayedScaling(amax_history_len=5, amax_compute_algo=algo, margin=1)
  # Roles with different formats, an unstacked and a stacked (3 layers) one, and
  # amaxes that are 0, NaN, inf or span many binades.
  metas = [fp8jax.init_meta(recipe, fp8jax.E4M3), fp8jax.init_meta(recipe, fp8jax.E5M2),
           jax.tree.map(lambda a: jnp.stack([a] * 3), fp8jax.init_meta(recipe, fp8jax.E4M3))]
  for step in range(4):
    amaxes = []
    for meta in metas:
      a = (2.0 ** rng.uniform(-20, 20, np.shape(meta.amax))).astype(np.float32)
      if step == 1:
        a = np.where(rng.integers(0, 3, np.shape(a)) == 0, np.nan, 0.0 * a).astype(np.float32)
      amaxes.append(jnp.asarray(a))
    metas = [dataclasses.replace(m, amax=a) for m, a in zip(metas, amaxes)]
    want = fp8jax.end_step(metas)  # CPU: fp8jax's jnp update
    numerators = [m.fmt.max / 2.0**recipe.margin for m in metas]
    got = pallas_kernels.close_steps(
        [jnp.ravel(m.amax) for m in metas], [jnp.ravel(m.amax_history) for m in metas],
        [jnp.ravel(m.scale) for m in metas], numerators, history_len=5,
        amax_compute_algo=algo, interpret=True)
    for i, meta in enumerate(want):
      for field, value in zip(("scale", "scale_inv", "amax_history", "amax"), got):
        np.testing.assert_array_equal(_bits(value[i]), _bits(jnp.ravel(getattr(meta, field))),
                                      err_msg=f"step {step} role {i} {field}")
    metas = want


def test_close_step_written_over_the_given_state_gives_the_jnp_update(request):
  """`close_step(..., written_over=)` on the kernel path (Pallas interpreter, under `jit`):
  the stacked role's new scale_inv and amax are written over the given state's arrays,
  which hold NaN here, so any of them read would show; the numbers are the jnp update's,
  bit for bit. A given state of other shapes (a loss that resized its state) is not
  written over, and the step still closes."""
  rng = np.random.default_rng(3)
  recipe = fp8jax.DelayedScaling(amax_history_len=4)
  stack = lambda meta, n: jax.tree.map(lambda a: jnp.stack([a] * n), meta)
  metas = [fp8jax.init_meta(recipe, fp8jax.E4M3), stack(fp8jax.init_meta(recipe, fp8jax.E5M2), 6)]
  record = lambda ms: [dataclasses.replace(m, amax=jnp.asarray(
      (2.0 ** rng.uniform(-10, 10, np.shape(m.amax))).astype(np.float32))) for m in ms]
  forward, cotangent = record(metas), record(metas)
  given = [dataclasses.replace(m, scale_inv=jnp.full_like(m.scale_inv, np.nan),
                               amax=jnp.full_like(m.amax, np.nan)) for m in metas]
  want = jax.jit(fp8jax.close_step)(forward, cotangent)  # CPU: the jnp update
  request.getfixturevalue("interpreted_kernels")  # from here on, the kernel
  for written_over in (None, given, [stack(given[0], 2), given[1]]):
    got = jax.jit(lambda f, c, w: fp8jax.close_step(f, c, written_over=w))(
        forward, cotangent, written_over)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      np.testing.assert_array_equal(_bits(g), _bits(w))


@pytest.mark.parametrize("fmt", [fp8jax.E4M3, fp8jax.E5M2], ids=["e4m3", "e5m2"])
def test_cast_kernel_matches_fp8jax_quantize_amax_and_descale_products(fmt):
  rng = np.random.default_rng(7)
  x = jnp.asarray(rng.standard_normal((100, 72)) * 30, jnp.bfloat16)
  scale, running = jnp.float32(fmt.max / 90.0), jnp.float32(2.5)
  partners = (jnp.float32(0.03), jnp.float32(7.0))
  with fused_kernels.fused_kernels(False):
    want = fused_kernels.cast_transpose_amax(x, scale, running, fmt, 1 / scale, partners)
  got = pallas_kernels.cast_transpose_amax(x, scale, running, fp8_dtype=fmt.dtype,
                                           fp8_max=fmt.max, descale=1 / scale,
                                           partner_descales=partners, interpret=True)
  np.testing.assert_array_equal(np.asarray(got[0]).view(np.uint8),
                                np.asarray(want[0]).view(np.uint8))
  np.testing.assert_array_equal(np.asarray(got[1]).view(np.uint8),
                                np.asarray(want[1]).view(np.uint8))
  np.testing.assert_array_equal(_bits(got[2]), _bits(want[2]))
  for g, w in zip(got[3], want[3]):
    np.testing.assert_array_equal(_bits(g), _bits(w))
  # fp8jax's definition is fp8jax.quantize and fp8jax.amax themselves.
  np.testing.assert_array_equal(np.asarray(want[0]).view(np.uint8),
                                np.asarray(fp8jax.quantize(x, scale, fmt)).view(np.uint8))
  assert float(want[2]) == max(2.5, float(fp8jax.amax(x)))


def test_policy_plain_jit_and_shard_map_yes_forced_off_no_and_inputs_the_kernels_cannot_take():
  x = jnp.ones((16, 16), jnp.bfloat16)
  # Whatever the number of devices: the kernels partition over a mesh.
  assert fused_kernels.kernels_allowed(x)
  mesh = jax.make_mesh((1,), ("data",))
  seen = []

  def per_device(x):
    seen.append(fused_kernels.kernels_allowed(x))
    return x

  jax.shard_map(per_device, mesh=mesh, in_specs=jax.P(), out_specs=jax.P())(x)
  # Inside shard_map the kernels declare how their outputs vary over the mesh
  # (tests/test_kernels_in_shard_map.py; every supported JAX can).
  assert seen == [True]
  with fused_kernels.fused_kernels(False):
    assert not fused_kernels.kernels_allowed(x)
  with fused_kernels.fused_kernels(True):
    assert fused_kernels.kernels_allowed(x)
  with pytest.raises(TypeError, match="True or False"):
    with fused_kernels.fused_kernels("yes"):
      pass
  assert not fused_kernels._takes(jnp.ones((0, 16), jnp.bfloat16))     # empty
  assert not fused_kernels._takes(jnp.ones((2, 4, 16), jnp.bfloat16))  # not 2-D


def test_float64_inputs_take_the_jnp_path_under_jit_with_x64():
  with jax.enable_x64(True):
    x = jnp.asarray(np.random.default_rng(3).standard_normal((8, 16)), jnp.float64)
    kernel = jnp.asarray(np.random.default_rng(4).standard_normal((16, 4)), jnp.float64)
    y, meta = jax.jit(fp8jax.fp8_dense)(x, kernel, None, fp8jax.init_dot_meta(
        fp8jax.DelayedScaling()))
    assert y.dtype == jnp.float64 and bool(jnp.all(jnp.isfinite(y)))
    assert float(meta.x.amax) == float(np.abs(np.asarray(x)).max().astype(np.float32))


def test_a_scale_changed_without_its_reciprocal_is_refused_where_values_are_known():
  meta = fp8jax.init_dot_meta(fp8jax.DelayedScaling())
  stale = dataclasses.replace(meta, x=dataclasses.replace(meta.x, scale=jnp.float32(2.0)))
  x, kernel = jnp.ones((4, 8)), jnp.ones((8, 4))
  with pytest.raises(ValueError, match="with_scale"):
    fp8jax.fp8_dense(x, kernel, None, stale)
  fixed = dataclasses.replace(meta, x=meta.x.with_scale(jnp.float32(2.0)))
  fp8jax.fp8_dense(x, kernel, None, fixed)  # consistent: accepted


def test_end_step_names_a_meta_whose_history_does_not_fit_its_recipe():
  meta = fp8jax.init_meta(fp8jax.DelayedScaling(amax_history_len=4), fp8jax.E4M3)
  bad = {"layer": dataclasses.replace(meta, amax_history=jnp.zeros(3))}
  with pytest.raises(ValueError, match=r"fp8_state\['layer'\].amax_history has shape \(3,\)"):
    fp8jax.end_step(bad)
