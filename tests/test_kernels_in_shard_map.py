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

import functools
import itertools

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import pallas_kernels
from fp8jax.ops import fused_kernels
from multidevice import N_DEVICES, multidevice
from pallas_kernels.varying import varying_axes


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


def _trace_in_shard_map(per_device, *args, in_specs=P()):
  """Traces `per_device` inside a type-checked shard_map over "data" (nothing runs)."""
  jax.jit(jax.shard_map(per_device, mesh=_mesh(), in_specs=in_specs,
                        out_specs=in_specs)).trace(*args)


def _type_mismatches(layout, got, want) -> list:
  """[(layout, the kernel's output types, its definition's)] where they differ, else []."""
  got_types, want_types = (jax.tree.map(varying_axes, out) for out in (got, want))
  return [] if got_types == want_types else [(layout, got_types, want_types)]


def _varying_if(on: bool, x):
  return jax.lax.pcast(x, ("data",), to="varying") if on else x


@multidevice
def test_cast_kernel_outputs_vary_as_its_definitions_do_for_every_input_layout():
  """Types, from the trace: each of x, scale, running amax, descale and partner
  replicated or split, 32 layouts; a narrower declaration than the jnp
  definition's (a per-device value typed as replicated) fails here."""
  x, scalars = _cast_inputs(11)
  mismatches, layouts = [], list(itertools.product([False, True], repeat=5))

  def per_device(x):
    for layout in layouts:
      x_l, *rest = (_varying_if(on, a) for on, a in zip(layout, (x, *scalars.values())))
      got, want = _cast_both(x_l, dict(zip(scalars, rest)), with_products=True)
      mismatches.extend(_type_mismatches(layout, got, want))
    amax_of_split_x = pallas_kernels.running_amax(_varying_if(True, x), scalars["running"],
                                                  interpret=True)
    mismatches.extend([] if varying_axes(amax_of_split_x) == {"data"} else ["running_amax"])
    return x

  _trace_in_shard_map(per_device, x)
  assert not mismatches, mismatches


@multidevice
def test_chained_cast_outputs_vary_as_their_definitions_do_for_every_input_layout():
  """The launches of a layer's cast chain (`cast_transpose_amax_in_chain`): tile maxima,
  their reduction, zeroed seeds, an accumulator written in place and copies of the
  state, with the kernel's tensor, the earlier launch's tensor and the running amaxes
  each replicated or split."""
  x, scalars = _cast_inputs(13)
  options = dict(fp8_dtype=jnp.float8_e4m3fn, fp8_max=448.0)
  mismatches = []

  def chain(run, first_x, second_x, running):
    first = run(first_x, scalars["scale"], None, tile_amaxes=True, seeds=1, **options)
    second = run(second_x, scalars["scale"], running, accumulator=first.seeds[0],
                 reduce=(first.amax, running), seeds=1,
                 pass_through=(running, jnp.stack([running] * 16)), **options)
    third = run(first_x, scalars["scale"], running, accumulator=second.seeds[0], **options)
    return first, second, third

  def per_device(x):
    for layout in itertools.product([False, True], repeat=3):
      args = [_varying_if(on, a) for on, a in zip(layout, (x, x * 2, scalars["running"]))]
      got = chain(functools.partial(pallas_kernels.cast_transpose_amax_in_chain,
                                    interpret=True), *args)
      want = chain(pallas_kernels.cast_transpose_amax_in_chain_reference, *args)
      mismatches.extend(_type_mismatches(layout, got, want))
    return x

  _trace_in_shard_map(per_device, x)
  assert not mismatches, mismatches


@multidevice
def test_cast_from_amax_outputs_vary_as_its_definitions_do_for_every_input_layout():
  """Current scaling's cast (`cast_transpose_from_amax`): x, the amax its scale comes
  from, the fallback scale, the running amax, the amax recorded and a partner descale
  each replicated or split, 64 layouts, with a state vector copied through."""
  x, scalars = _cast_inputs(17)
  options = dict(fp8_dtype=jnp.float8_e4m3fn, fp8_max=448.0, margin=1, power_of_two=True)
  mismatches = []

  def per_device(x):
    for layout in itertools.product([False, True], repeat=6):
      x_l, amax, fallback, running, recorded, partner = (
          _varying_if(on, a) for on, a in zip(layout, (
              x, scalars["running"], scalars["scale"], scalars["running"] / 2,
              scalars["descale"], scalars["partner"])))
      kwargs = dict(recorded_amax=recorded, partner_descales=(partner,),
                    pass_through=(jnp.stack([running] * 3),), **options)
      got = pallas_kernels.cast_transpose_from_amax(x_l, amax, fallback, running,
                                                    interpret=True, **kwargs)
      want = pallas_kernels.cast_transpose_from_amax_reference(x_l, amax, fallback, running,
                                                               **kwargs)
      mismatches.extend(_type_mismatches(layout, got, want))
    return x

  _trace_in_shard_map(per_device, x)
  assert not mismatches, mismatches


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


def _pallas_operand_counts(jaxpr) -> list[int]:
  """How many operands each pallas_call in `jaxpr` (and its sub-jaxprs) takes."""
  counts = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "pallas_call":
      counts.append(len(eqn.invars))
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      counts += _pallas_operand_counts(sub)
  return counts


@multidevice
@pytest.mark.parametrize("packed", [False, True], ids=["per_role", "packed"])
def test_state_update_outputs_vary_as_its_definitions_do_for_every_input_layout(packed):
  """Types, from the trace: amaxes, other amaxes, histories and scales each
  replicated or split (16 layouts, with and without other amaxes). Packing is
  taken only where all of them vary alike, as one operand."""
  rows, history_len = [1, 2], 3
  kwargs = dict(numerators=[448.0, 57344.0], history_len=history_len, amax_compute_algo="max")
  mismatches, operand_counts = [], {}

  def per_device(x):
    for layout in itertools.product([False, True], repeat=4):
      for with_other in (False, True):
        kinds = [[_varying_if(on, jnp.full((n * size,), 0.5 + i, jnp.float32))
                  for i, n in enumerate(rows)]
                 for on, size in zip(layout, (1, 1, history_len, 1))]
        amaxes, others, histories, scales = kinds
        others = others if with_other else None
        call = lambda: pallas_kernels.close_steps(amaxes, histories, scales, other_amaxes=others,
                                                  packed=packed, interpret=True, **kwargs)
        got = call()
        want = pallas_kernels.close_steps_reference(amaxes, histories, scales,
                                                    other_amaxes=others, **kwargs)
        got_types, want_types = (jax.tree.map(varying_axes, out) for out in (got, want))
        if got_types != want_types:
          mismatches.append((layout, with_other, got_types, want_types))
        operand_counts[layout, with_other] = _pallas_operand_counts(jax.make_jaxpr(call)().jaxpr)
    return x

  _trace_in_shard_map(per_device, jnp.ones(N_DEVICES, jnp.float32), in_specs=P("data"))
  assert not mismatches, mismatches
  for (layout, with_other), counts in operand_counts.items():
    per_role = len(rows) * (4 if with_other else 3)
    used = (0, 1, 2, 3) if with_other else (0, 2, 3)  # amaxes, others, histories, scales
    alike = len({layout[k] for k in used}) == 1
    assert counts == [1 if packed and alike else per_role], (layout, with_other, counts)


@multidevice
def test_kernels_run_in_shard_map_only_over_every_mesh_axis():
  """A shard_map that leaves an axis of several devices automatic gets the jnp form:
  there XLA would gather what that axis splits to feed a kernel."""
  mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  seen = {}

  def per_device(name):
    def record(x):
      seen[name] = fused_kernels.kernels_allowed(x)
      return x
    return record

  x = jnp.ones((8, 8), jnp.bfloat16)
  jax.shard_map(per_device("all axes"), mesh=mesh, in_specs=P("data", "model"),
                out_specs=P("data", "model"))(x)
  jax.shard_map(per_device("data only"), mesh=mesh, in_specs=P("data"), out_specs=P("data"),
                axis_names={"data"})(x)
  # An automatic axis of one device splits nothing.
  single = jax.make_mesh((8, 1), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  jax.shard_map(per_device("data, model of 1"), mesh=single, in_specs=P("data"),
                out_specs=P("data"), axis_names={"data"})(x)
  assert seen == {"all axes": True, "data only": False, "data, model of 1": True}, seen


@multidevice
def test_kernels_refuse_a_partial_sum():
  """An unreduced input (a sum not yet taken over devices) gives per-device outputs no
  declaration describes: a clear error instead."""
  x, scalars = _cast_inputs(13)

  def per_device(x):
    # Each device's own value, typed as a term of a sum over "data" not yet taken.
    local = jnp.max(jnp.abs(x)).astype(jnp.float32)
    partial = jax.lax.pcast(local, ("data",), to="unreduced")
    with pytest.raises(ValueError, match="partial sum"):
      pallas_kernels.cast_transpose_amax(x, partial, scalars["running"], interpret=True,
                                         fp8_dtype=jnp.float8_e4m3fn, fp8_max=448.0)
    with pytest.raises(ValueError, match="partial sum"):
      pallas_kernels.close_steps([partial.reshape(1)], [jnp.ones(2, jnp.float32)],
                                 [jnp.ones(1, jnp.float32)], [448.0], history_len=2,
                                 amax_compute_algo="max", interpret=True)
    return x

  _trace_in_shard_map(per_device, x, in_specs=P("data"))


@multidevice
def test_state_update_packed_in_shard_map_gives_its_definitions_bits():
  rng = np.random.default_rng(5)
  rows, history_len = [1, 3, 1], 4
  amaxes, others = ([jnp.asarray(2.0 ** rng.uniform(-10, 10, (N_DEVICES, n)), jnp.float32)
                     for n in rows] for _ in range(2))
  histories = [jnp.asarray(2.0 ** rng.uniform(-10, 10, n * history_len), jnp.float32)
               for n in rows]
  scales = [jnp.asarray(2.0 ** rng.uniform(-4, 4, n), jnp.float32) for n in rows]
  kwargs = dict(numerators=[448.0, 57344.0, 448.0], history_len=history_len,
                amax_compute_algo="max")

  def run(amaxes, others, histories, scales):  # check_vma=False: see the cast's test above
    amaxes, others = ([a[0] for a in kind] for kind in (amaxes, others))
    got = pallas_kernels.close_steps(amaxes, histories, scales, other_amaxes=others,
                                     packed=True, interpret=True, **kwargs)
    want = pallas_kernels.close_steps_reference(amaxes, histories, scales, other_amaxes=others,
                                                **kwargs)
    return jax.tree.map(lambda a: a[None], (got, want))

  got, want = jax.jit(jax.shard_map(run, mesh=_mesh(), in_specs=(P("data"), P("data"), P(), P()),
                                    out_specs=P("data"), check_vma=False))(
                                        amaxes, others, histories, scales)
  _assert_same(got, want)
