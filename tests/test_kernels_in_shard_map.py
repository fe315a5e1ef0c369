"""fp8jax's fused FP8 kernels inside `jax.shard_map`: their outputs vary as their jnp
definitions' do, with the same bits.

Inside `shard_map` (`check_vma=True`) each value's type records the mesh axes it
varies over, and a Pallas kernel must declare them for its outputs
(`pallas_kernels.varying`). A declaration that is too narrow would be a silent
error: an amax typed replicated while each device holds its own shard's amax. So
each kernel runs in the Pallas interpreter on 8 CPU devices next to its jnp
definition, and both the types (from the trace) and the bits (run, with
`check_vma=False`: JAX's Pallas interpreter cannot run in a type-checked
shard_map) of every output must agree; the amax, made global with `pmax`, must
equal max|x| of the whole tensor in float64 numpy. (On CPU fp8jax itself lowers the jnp form; the deviceless H100 budgets of
`test_fp8_mesh_budgets.py` show the kernels in a compiled shard_map step.)
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import pallas_kernels
from multidevice import N_DEVICES, multidevice, run_mesh_tests_in_subprocess
from pallas_kernels.varying import varying_axes

N_MESH_TESTS = 5


def test_mesh_tests_pass_on_8_devices():
  run_mesh_tests_in_subprocess(__file__, N_MESH_TESTS)


def _mesh():
  return jax.make_mesh((N_DEVICES,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))


def _bits(a):
  a = np.asarray(a)
  return a.view(np.uint8 if a.dtype.itemsize == 1 else np.uint32)


def _assert_same(got, want):
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert g.shape == w.shape and g.dtype == w.dtype, (g, w)
    np.testing.assert_array_equal(_bits(g), _bits(w))


def _cast_inputs(seed):
  rng = np.random.default_rng(seed)
  # Each device's rows at their own magnitude: the local amaxes all differ.
  x = rng.standard_normal((N_DEVICES * 24, 40)) * np.repeat(
      2.0 ** rng.uniform(-6, 6, N_DEVICES), 24)[:, None]
  scalars = dict(scale=rng.uniform(1, 8), running=rng.uniform(0, 1e-3), descale=1 / 3,
                 partner=rng.uniform(0.1, 2))
  return jnp.asarray(x, jnp.bfloat16), {k: jnp.float32(v) for k, v in scalars.items()}


def _cast_both(x, s, with_products):
  """The kernel (interpreted) and its jnp definition on the same arguments."""
  options = dict(fp8_dtype=jnp.float8_e4m3fn, fp8_max=448.0)
  if with_products:
    options.update(descale=s["descale"], partner_descales=(s["partner"],))
  got = pallas_kernels.cast_transpose_amax(x, s["scale"], s["running"], interpret=True,
                                           **options)
  want = pallas_kernels.cast_transpose_amax_reference(x, s["scale"], s["running"], **options)
  return got, want


@multidevice
@pytest.mark.parametrize("with_products", [False, True], ids=["cast", "cast_and_descales"])
def test_cast_transpose_amax_outputs_vary_as_its_definitions_do(with_products):
  """Types, from the trace: x split over "data", every scalar replicated."""
  x, scalars = _cast_inputs(11)
  types = {}

  def per_device(x):
    got, want = _cast_both(x, scalars, with_products)
    types["got"], types["want"] = (jax.tree.map(varying_axes, out) for out in (got, want))
    return x

  jax.jit(jax.shard_map(per_device, mesh=_mesh(), in_specs=P("data"),
                        out_specs=P("data"))).trace(x)
  assert types["got"] == types["want"], types
  assert types["got"][:3] == (frozenset({"data"}),) * 3, types  # each device's own amax
  if with_products:
    assert types["got"][3] == (frozenset(),), types  # products of replicated scalars


@multidevice
@pytest.mark.parametrize("with_products", [False, True], ids=["cast", "cast_and_descales"])
def test_cast_transpose_amax_in_shard_map_gives_its_definitions_bits(with_products):
  """Values, run: JAX's Pallas interpreter cannot run inside a type-checked shard_map
  (it mixes its grid indices with device-varying blocks), so this runs with
  check_vma=False; the types are the trace's, above."""
  x, scalars = _cast_inputs(12)

  def per_device(x):
    got, want = _cast_both(x, scalars, with_products)
    whole_amax = jax.lax.pmax(got[2], "data")
    # Each device's amax (and products) as one element of a [devices] vector.
    expose = lambda out: jax.tree.map(lambda a: a[None] if a.ndim == 0 else a, out)
    return expose(got), expose(want), whole_amax

  specs = (P("data"), P(None, "data"), P("data")) + (((P("data"),),) if with_products else ())
  got, want, whole_amax = jax.jit(jax.shard_map(
      per_device, mesh=_mesh(), in_specs=P("data"), out_specs=(specs, specs, P()),
      check_vma=False))(x)
  _assert_same(got, want)
  # The shards' amaxes made global are the whole tensor's (a max, so exact).
  expected = max(float(scalars["running"]), np.max(np.abs(np.asarray(x, np.float64))))
  assert float(whole_amax) == expected


@multidevice
def test_state_update_packed_in_shard_map_has_its_definitions_types_and_bits():
  rng = np.random.default_rng(5)
  rows, history_len = [1, 3, 1], 4
  amaxes = [jnp.asarray(2.0 ** rng.uniform(-10, 10, (N_DEVICES, n)), jnp.float32)
            for n in rows]
  histories = [jnp.asarray(2.0 ** rng.uniform(-10, 10, n * history_len), jnp.float32)
               for n in rows]
  scales = [jnp.asarray(2.0 ** rng.uniform(-4, 4, n), jnp.float32) for n in rows]
  kwargs = dict(numerators=[448.0, 57344.0, 448.0], history_len=history_len,
                amax_compute_algo="max")
  types = {}

  def both(amaxes, histories, scales):
    got = pallas_kernels.close_steps(amaxes, histories, scales, packed=True, interpret=True,
                                     **kwargs)
    want = pallas_kernels.close_steps_reference(amaxes, histories, scales, **kwargs)
    return got, want

  def trace_types(amaxes, histories, scales):
    # Amaxes split over "data", histories and scales replicated (these are not
    # packed: the update runs per role), or all varying (packed).
    amaxes = [a[0] for a in amaxes]
    vary = lambda arrays: [jax.lax.pcast(a, ("data",), to="varying") for a in arrays]
    for name, args in (("mixed", (amaxes, histories, scales)),
                       ("alike", (amaxes, vary(histories), vary(scales)))):
      got, want = both(*args)
      types[name] = [jax.tree.map(varying_axes, out) for out in (got, want)]
    return amaxes

  def run(amaxes, histories, scales):  # check_vma=False: see the cast's test above
    got, want = both([a[0] for a in amaxes], histories, scales)
    return jax.tree.map(lambda a: a[None], (got, want))

  args = (amaxes, histories, scales)
  jax.jit(jax.shard_map(trace_types, mesh=_mesh(), in_specs=(P("data"), P(), P()),
                        out_specs=P("data"))).trace(*args)
  for got_types, want_types in types.values():
    assert got_types == want_types, types
    # Every output is computed from an amax, so every output is device-varying.
    assert all(axes == frozenset({"data"}) for axes in jax.tree.leaves(got_types)), types
  got, want = jax.jit(jax.shard_map(run, mesh=_mesh(), in_specs=(P("data"), P(), P()),
                                    out_specs=P("data"), check_vma=False))(*args)
  _assert_same(got, want)
