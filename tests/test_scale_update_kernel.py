"""The end-of-step scale update kernel (`pallas_kernels.close_steps`) against its jnp definition.

Bitwise: the kernel and `close_steps_reference` do the same float32 operations
(IEEE divisions, a max, selects), so every output must match bit for bit, in the
Pallas interpreter on CPU. The reference itself is checked against the delayed
scaling contract simulated in float64 (`tests/fp8_reference.py`). The hopper test
compiles the kernel for an H100 and reads its PTX for the IEEE division.
"""
from __future__ import annotations

import glob
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp8_reference import simulate_delayed_scaling
from fp8jax import deviceless
from pallas_kernels import amax_max, close_steps, close_steps_reference

_MISSING = deviceless.deviceless_toolchain_missing()


def _roles(rng, rows, history_len):
  """Random roles: amaxes spanning many binades, with 0, NaN and inf among them."""
  amaxes, histories, scales = [], [], []
  for n in rows:
    amax = (2.0 ** rng.uniform(-20, 20, n)).astype(np.float32)
    special = rng.integers(0, 6, n)
    amax[special == 0] = 0.0
    amax[special == 1] = np.nan
    amax[special == 2] = np.inf
    amaxes.append(jnp.asarray(amax))
    histories.append(jnp.asarray((2.0 ** rng.uniform(-10, 10, n * history_len)).astype(
        np.float32)))
    scales.append(jnp.asarray((2.0 ** rng.uniform(-8, 8, n)).astype(np.float32)))
  return amaxes, histories, scales


def _assert_bitwise(got, want):
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(np.asarray(g).view(np.uint32), np.asarray(w).view(np.uint32))


@pytest.mark.parametrize("packed", [False, True, "in_place", "written_over"],
                         ids=["per_role", "packed", "in_place", "written_over"])
@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("history_len", [1, 5, 16])
def test_kernel_is_bitwise_equal_to_reference(algo, history_len, packed):
  # "in_place": per role, the stacked roles' histories and scales written over the old
  # ones (the roll reads a whole history before it writes it back shifted);
  # "written_over": their scale_invs and amaxes too, over arrays the kernel never reads.
  in_place = [True, True, False, True] if packed in ("in_place", "written_over") else None
  written_over = packed == "written_over"
  packed = packed is True
  rng = np.random.default_rng(history_len * 10 + (algo == "max"))
  # Unstacked roles (1 row) and stacked ones (3 and 9 rows: not powers of two).
  amaxes, histories, scales = _roles(rng, [1, 3, 1, 9], history_len)
  others = [jnp.asarray((2.0 ** rng.uniform(-20, 20, a.shape[0])).astype(np.float32))
            for a in amaxes]
  numerators = [448.0, 57344.0 / 4, 448.0, 57344.0]
  for other_amaxes in (None, others):
    kwargs = dict(numerators=numerators, history_len=history_len, amax_compute_algo=algo,
                  other_amaxes=other_amaxes)
    # Old arrays unlike any output (NaN scale_invs, amaxes at 3x the scales): nothing of
    # them may show.
    old = ([jnp.full_like(s, np.nan) for s in scales], [s * 3.0 for s in scales])
    got = close_steps(amaxes, histories, scales, packed=packed, in_place=in_place,
                      written_over=old if written_over else None, interpret=True, **kwargs)
    want = close_steps_reference(amaxes, histories, scales, **kwargs)
    _assert_bitwise(got, want)


@pytest.mark.parametrize("packed", [False, True], ids=["per_role", "packed"])
def test_more_roles_than_one_launch_takes_are_all_updated(packed):
  rng = np.random.default_rng(7)
  # 40 roles of 1 to 3 rows: two launches, each packing its own roles.
  amaxes, histories, scales = _roles(rng, [1 + i % 3 for i in range(40)], 4)
  kwargs = dict(numerators=[448.0] * 40, history_len=4, amax_compute_algo="max")
  _assert_bitwise(close_steps(amaxes, histories, scales, packed=packed, interpret=True,
                              **kwargs),
                  close_steps_reference(amaxes, histories, scales, **kwargs))


def test_reference_follows_the_delayed_scaling_contract():
  # One role over several steps, against the float64 simulation of DESIGN.md's rule.
  steps = [3.0, 0.0, np.nan, 7.5, np.inf, 1e-3, 2.0]
  history_len, margin = 3, 1
  want_scales, want_histories = simulate_delayed_scaling(steps + [1.0], history_len, "max",
                                                         margin, 448.0)
  history = jnp.zeros(history_len, jnp.float32)
  scale = jnp.ones(1, jnp.float32)
  for t, amax in enumerate(steps):
    (scale,), (scale_inv,), (history,), (zero,) = close_steps_reference(
        [jnp.full(1, amax, jnp.float32)], [history], [scale],
        numerators=[448.0 / 2**margin], history_len=history_len, amax_compute_algo="max")
    np.testing.assert_array_equal(np.asarray(history), np.float32(want_histories[t]))
    assert float(scale[0]) == np.float32(want_scales[t + 1])
    assert float(scale_inv[0]) == np.float32(1) / np.float32(want_scales[t + 1])
    assert float(zero[0]) == 0.0


def test_amax_max_keeps_nan_from_either_side():
  a = jnp.asarray([1.0, np.nan, 2.0, 0.0], jnp.float32)
  b = jnp.asarray([np.nan, 1.0, 3.0, 0.0], jnp.float32)
  out = np.asarray(amax_max(a, b))
  assert np.isnan(out[0]) and np.isnan(out[1]) and out[2] == 3.0 and out[3] == 0.0


def test_mismatched_roles_raise_clear_errors():
  one = [jnp.zeros(1, jnp.float32)]
  with pytest.raises(ValueError, match="same roles"):
    close_steps(one, one * 2, one, [448.0], history_len=1, amax_compute_algo="max")
  with pytest.raises(ValueError, match="\\[n \\* 4\\]"):
    close_steps(one, one, one, [448.0], history_len=4, amax_compute_algo="max")
  with pytest.raises(ValueError, match="amax_compute_algo"):
    close_steps(one, one, one, [448.0], history_len=1, amax_compute_algo="mean")
  with pytest.raises(ValueError, match="in_place has 2 entries for 1 roles"):
    close_steps(one, one, one, [448.0], history_len=1, amax_compute_algo="max",
                in_place=[True, False])
  with pytest.raises(ValueError, match="written_over must be a pair"):
    close_steps(one, one, one, [448.0], history_len=1, amax_compute_algo="max",
                in_place=[True], written_over=(one,))
  with pytest.raises(ValueError, match="written_over's amaxes must have the shapes"):
    close_steps(one, one, one, [448.0], history_len=1, amax_compute_algo="max",
                in_place=[True], written_over=(one, [jnp.zeros(2, jnp.float32)]))


@pytest.mark.parametrize("with_other", [False, True], ids=["amaxes", "two_amaxes"])
def test_roles_written_in_place_alias_their_old_arrays(with_other):
  """The input/output aliases of the launch (so a donated state is updated where it is):
  an in-place role's history and scale are written over its own, and its scale_inv and
  amax over the old arrays `written_over` hands it (only the in-place roles' are passed,
  in role order); a role not in place aliases nothing."""
  spec = jax.ShapeDtypeStruct
  rows = [1, 3, 5]  # not in place, then two stacked roles in place
  amaxes = [spec((n,), jnp.float32) for n in rows]
  histories = [spec((n * 16,), jnp.float32) for n in rows]
  others = amaxes if with_other else None

  def aliases(in_place, written_over):
    jaxpr = str(jax.make_jaxpr(lambda a, o, h, s, w: close_steps(
        a, h, s, [448.0] * 3, history_len=16, amax_compute_algo="max", other_amaxes=o,
        in_place=in_place, written_over=w))(amaxes, others, histories, amaxes, written_over))
    declared = re.search(r"input_output_aliases=(\(\)|\(\(.*?\)\))", jaxpr).group(1)
    return {(int(a), int(b)) for a, b in re.findall(r"\((\d+), (\d+)\)", declared)}

  # Inputs: amaxes 0-2, [other amaxes 3-5,] histories, scales, the spares; outputs:
  # scales 0-2, scale_invs 3-5, histories 6-8, amaxes 9-11.
  h, s = (3, 6) if not with_other else (6, 9)
  spares = s + 3
  want = {(h + 1, 7), (s + 1, 1), (h + 2, 8), (s + 2, 2)}
  assert aliases([False, True, True], None) == want
  assert aliases([False, True, True], (amaxes, amaxes)) == want | {
      (spares, 4), (spares + 1, 5), (spares + 2, 10), (spares + 3, 11)}
  assert aliases(None, (amaxes, amaxes)) == set()


@pytest.mark.hopper
@pytest.mark.skipif(_MISSING is not None, reason=str(_MISSING))
def test_h100_compile_is_one_kernel_with_ieee_divisions(tmp_path):
  """All roles in one Triton kernel, whose divisions are IEEE (`div.rn.f32`).

  Triton's own float32 `/` compiles to the approximate `div.full.f32`; the
  scales must be the same numbers XLA computes on any other platform.
  """
  spec = jax.ShapeDtypeStruct
  roles = 6
  amaxes = [spec((1,), jnp.float32)] * roles
  histories = [spec((16,), jnp.float32)] * roles
  compiled = deviceless.compile_for_h100(
      lambda a, h, s: close_steps(a, h, s, [448.0] * roles, history_len=16,
                                  amax_compute_algo="max"),
      amaxes, histories, amaxes, dump_dir=str(tmp_path))
  targets = re.findall(r'custom_call_target="([^"]+)"', compiled.as_text())
  assert targets.count("__gpu$xla.gpu.triton") == 1, targets
  ptx = "\n".join(open(p).read() for p in glob.glob(os.path.join(tmp_path, "*.ptx")))
  divisions = set(re.findall(r"\bdiv\.[\w.]+", ptx))
  assert "div.rn.f32" in divisions and "div.full.f32" not in divisions, divisions


@pytest.mark.hopper
@pytest.mark.skipif(_MISSING is not None, reason=str(_MISSING))
def test_a_history_rolled_in_place_is_aliased_and_read_whole_before_it_is_written(tmp_path):
  """`in_place`: the PTX has a barrier between the roll's loads and its stores (the threads
  of the launch read the whole history before any writes over it); the aliases themselves:
  `test_roles_written_in_place_alias_their_old_arrays`."""
  spec = jax.ShapeDtypeStruct
  rows = [3, 1]  # a stacked role, rolled in place, and one that is not
  amaxes = [spec((n,), jnp.float32) for n in rows]
  histories = [spec((n * 16,), jnp.float32) for n in rows]
  close = lambda in_place: (lambda a, h, s: close_steps(
      a, h, s, [448.0] * 2, history_len=16, amax_compute_algo="max", in_place=in_place))
  barriers = {}
  for in_place in (None, [True, False]):
    dump = tmp_path / str(bool(in_place))
    deviceless.compile_for_h100(close(in_place), amaxes, histories, amaxes,
                                dump_dir=str(dump))
    ptx = "\n".join(open(p).read() for p in glob.glob(os.path.join(dump, "*.ptx")))
    barriers[bool(in_place)] = len(re.findall(r"\bbar\.sync\b|\bbarrier\.sync\b", ptx))
  assert barriers[True] > barriers[False], barriers


@pytest.mark.gpu
@pytest.mark.parametrize("with_other", [False, True], ids=["amaxes", "two_amaxes"])
def test_the_compiled_update_written_over_a_donated_state_is_bitwise_its_definition(
    with_other, hopper_device):
  """On a GPU, three steps of a jitted update that donates its state and writes the stacked
  roles' new history, scale, scale_inv and amax over their old arrays, against the jnp
  definition run by XLA: the same bits every step (each step reads what the one before
  wrote in place), and each stacked role's new arrays in the donated buffers themselves.
  With two amaxes per role as `fp8jax.close_step` passes them (forward and backward)."""
  rng = np.random.default_rng(11)
  rows, history_len = [24, 1, 24, 3], 16
  numerators = [448.0, 57344.0, 448.0, 57344.0 / 4]
  in_place = [n > 1 for n in rows]
  kwargs = dict(numerators=numerators, history_len=history_len, amax_compute_algo="max")

  @jax.jit
  def reference_step(state, amaxes, others):
    _, histories, scales, _ = state
    return close_steps_reference(amaxes, histories, scales, other_amaxes=others, **kwargs)

  @jax.jit(donate_argnums=0)
  def kernel_step(state, amaxes, others):
    scale_invs, histories, scales, old_amaxes = state
    new_scales, new_scale_invs, new_histories, zeros = close_steps(
        amaxes, histories, scales, other_amaxes=others, in_place=in_place,
        written_over=(scale_invs, old_amaxes), **kwargs)
    return new_scale_invs, new_histories, new_scales, zeros

  _, histories, scales = _roles(rng, rows, history_len)
  state = jax.device_put(([1.0 / s for s in scales], histories, scales,
                          [jnp.zeros_like(s) for s in scales]), hopper_device)
  want = jax.tree.map(jnp.copy, state)
  for _ in range(3):
    amaxes, others = (jax.device_put(_roles(rng, rows, history_len)[0], hopper_device)
                      for _ in range(2))
    others = others if with_other else None
    new_scales, new_scale_invs, new_histories, zeros = reference_step(want, amaxes, others)
    want = (new_scale_invs, new_histories, new_scales, zeros)
    stacked_buffers = [[kind[i].unsafe_buffer_pointer() for kind in state]
                       for i, here in enumerate(in_place) if here]
    state = kernel_step(state, amaxes, others)
    _assert_bitwise(state, want)
    assert [[kind[i].unsafe_buffer_pointer() for kind in state]
            for i, here in enumerate(in_place) if here] == stacked_buffers
