"""Per-device layouts that would change the FP8 numbers are told, not silent.

Three layouts of `jax.shard_map` (or `pmap`) give other numbers than one device,
and fp8jax sees them while it traces:

* `check_vma=False` / `pmap` without `axis_name=`: the FP8 state keeps one
  device's amaxes (a warning names `axis_name=` and `check_vma=True`);
* FP8 state given a sharded in_spec (each device a slice of the amax history):
  the error says the state must be replicated, not that its length is wrong;
* per-row / per-block recipes on operands split over a manual axis: the scales
  of a split contraction are per shard (a warning names the recipe and plain jit).

Each test checks the message and that the layout it names really changes the
numbers (or, where fp8jax reduces, that nothing is said). The mesh tests run on the 8
CPU devices every test process has (tests/multidevice.py).
"""
from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import fp8jax
from multidevice import N_DEVICES, multidevice


B, K, N = 32, 16, 8
DELAYED = fp8jax.DelayedScaling(amax_history_len=16)
LOCAL_AMAXES = "the FP8 state that comes out is one device's"


def _mesh():
  return jax.make_mesh((N_DEVICES,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))


def _data():
  # The largest rows sit on the last device, so a local amax is visibly smaller.
  x = jax.random.normal(jax.random.key(1), (B, K)) * jnp.linspace(0.5, 2.0, B)[:, None]
  w = jax.random.normal(jax.random.key(2), (K, N)) / 4
  t = jax.random.normal(jax.random.key(3), (B, N))
  return w, x, t


def loss_fn(w, fp8_state, x, t):
  y, fp8_state = fp8jax.fp8_dense(x, w, None, fp8_state)
  return jnp.sum((y - t) ** 2) / (B * N), fp8_state  # normalized by the global batch


def _shard_map_step(check_vma=True, axis_name=None, state_spec=P(), batch_spec=P("data")):
  def per_device(w, fp8_state, x, t):
    loss, grads, fp8_state = fp8jax.value_and_grad(loss_fn, axis_name=axis_name)(
        w, fp8_state, x, t)
    if not check_vma:  # untyped: JAX does not sum a replicated parameter's gradient
      grads = jax.lax.psum(grads, "data")
    return jax.lax.psum(loss, "data"), grads, fp8_state

  return jax.jit(jax.shard_map(per_device, mesh=_mesh(), check_vma=check_vma,
                               in_specs=(P(), state_spec, batch_spec, batch_spec),
                               out_specs=(P(), P(), P())))


def _messages(record, text):
  return [str(w.message) for w in record if text in str(w.message)]


# ----- shard_map(check_vma=False) / pmap without axis_name ---------------------------------


@multidevice
def test_untyped_shard_map_without_axis_name_warns_that_the_state_keeps_local_amaxes():
  w, x, t = _data()
  fp8_state = fp8jax.init_dot_meta(DELAYED)
  with pytest.warns(UserWarning, match=LOCAL_AMAXES) as record:
    _, _, state = _shard_map_step(check_vma=False)(w, fp8_state, x, t)
  (message,) = _messages(record, LOCAL_AMAXES)  # one step traced, one warning
  assert "fp8jax.value_and_grad" in message and "over the mesh axis 'data'" in message
  assert "Pass axis_name='data'" in message and "check_vma=True" in message
  # What it warns of: the state holds device 0's amax (its 4 rows), not the batch's.
  assert float(state.x.amax_history[0]) == float(jnp.max(jnp.abs(x[:B // N_DEVICES])))
  assert float(state.x.amax_history[0]) < float(jnp.max(jnp.abs(x)))


@multidevice
def test_pmap_and_accumulate_gradients_without_axis_name_warn_too():
  w, x, t = _data()
  fp8_state = fp8jax.init_dot_meta(DELAYED)
  xs, ts = x.reshape(N_DEVICES, B // N_DEVICES, K), t.reshape(N_DEVICES, B // N_DEVICES, N)
  step = jax.pmap(fp8jax.value_and_grad(loss_fn), axis_name="data", in_axes=(None, None, 0, 0))
  with pytest.warns(UserWarning, match=LOCAL_AMAXES):
    step(w, fp8_state, xs, ts)

  def per_device(w, s, xs, ts):
    _, _, s = fp8jax.accumulate_gradients(lambda w, s, b: loss_fn(w, s, *b), w, s, (xs, ts))
    return s

  micro = lambda a: a.reshape(2, B // 2, -1)
  accumulate = jax.jit(jax.shard_map(per_device, mesh=_mesh(), check_vma=False,
                                     in_specs=(P(), P(), P(None, "data"), P(None, "data")),
                                     out_specs=P()))
  with pytest.warns(UserWarning, match=LOCAL_AMAXES) as record:
    accumulate(w, fp8_state, micro(x), micro(t))
  assert "fp8jax.accumulate_gradients" in _messages(record, LOCAL_AMAXES)[0]


@multidevice
@pytest.mark.parametrize("layout", ["check_vma=True", "check_vma=False axis_name='data'",
                                    "pmap axis_name='data'", "jit on the mesh"])
def test_no_local_amax_warning_where_the_amaxes_become_global(layout):
  w, x, t = _data()
  fp8_state = fp8jax.init_dot_meta(DELAYED)
  with warnings.catch_warnings(record=True) as record:
    warnings.simplefilter("always")
    if layout == "check_vma=True":
      _, _, state = _shard_map_step()(w, fp8_state, x, t)
    elif layout == "check_vma=False axis_name='data'":
      _, _, state = _shard_map_step(check_vma=False, axis_name="data")(w, fp8_state, x, t)
    elif layout == "pmap axis_name='data'":
      step = jax.pmap(fp8jax.value_and_grad(loss_fn, axis_name="data"), axis_name="data",
                      in_axes=(None, None, 0, 0))
      _, _, state = step(w, fp8_state, x.reshape(N_DEVICES, -1, K), t.reshape(N_DEVICES, -1, N))
      state = jax.tree.map(lambda a: a[0], state)
    else:
      put = lambda a: jax.device_put(a, NamedSharding(_mesh(), P("data")))
      _, _, state = jax.jit(fp8jax.value_and_grad(loss_fn))(w, fp8_state, put(x), put(t))
  assert not _messages(record, LOCAL_AMAXES)
  # Silent because right: the input amax is that of the whole batch (a max is exact).
  assert float(state.x.amax_history[0]) == float(jnp.max(jnp.abs(x)))


# ----- FP8 state split by shard_map's in_specs ---------------------------------------------


def _split_histories(fp8_state):
  # What a "shard every array's first axis" rule does to FP8 state: the scalars stay
  # replicated (they have no axis), each history is split over "data".
  return jax.tree.map(lambda a: P("data") if jnp.ndim(a) else P(), fp8_state)


@multidevice
def test_fp8_state_split_by_in_specs_is_refused_as_not_replicated():
  w, x, t = _data()
  fp8_state = fp8jax.init_dot_meta(DELAYED)
  step = _shard_map_step(state_spec=_split_histories(fp8_state))
  with pytest.raises(ValueError) as error:
    step(w, fp8_state, x, t)
  message = str(error.value)
  # Each device sees 16 / 8 = 2 entries of the history.
  assert "meta.x.amax_history has shape (2,) on each device" in message
  assert "split over the mesh axis 'data' (8 devices)" in message
  assert "FP8 state must be replicated: give it in_specs P()" in message
  assert "resize_history" not in message  # the length is right; the layout is not


@multidevice
def test_end_step_by_hand_on_a_split_history_says_the_state_must_be_replicated():
  fp8_state = {"l1": fp8jax.init_dot_meta(DELAYED)}
  close = jax.jit(jax.shard_map(fp8jax.end_step, mesh=_mesh(),
                                in_specs=(_split_histories(fp8_state),), out_specs=P()))
  with pytest.raises(ValueError, match=r"fp8_state\['l1'\]\.x\.amax_history has shape \(2,\) "
                                       r"on each device.*FP8 state must be replicated"):
    close(fp8_state)


# ----- per-row / per-block recipes on split operands ---------------------------------------

FINE_GRAINED = [fp8jax.RowwiseScaling(), fp8jax.BlockScaling(block_size=16),
                fp8jax.MXFP8Scaling()]
PER_SHARD = "scales each GEMM operand per row / per block"


def _relative_difference(a, b):
  return float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))


@multidevice
@pytest.mark.parametrize("recipe", FINE_GRAINED, ids=lambda r: type(r).__name__)
def test_per_row_and_block_recipes_under_shard_map_warn_that_split_contractions_differ(recipe):
  w, x, t = _data()
  fp8_state = fp8jax.init_dot_meta(recipe)
  _, want_grads, _ = jax.jit(fp8jax.value_and_grad(loss_fn))(w, fp8_state, x, t)
  with pytest.warns(UserWarning, match=PER_SHARD) as record:
    _, grads, _ = _shard_map_step()(w, fp8_state, x, t)
  (message,) = set(_messages(record, PER_SHARD))
  assert message.startswith(type(recipe).__name__)
  assert "split over the mesh axis 'data'" in message
  assert "plain jax.jit" in message and "keep contracted axes unsplit" in message
  # What it warns of: the weight gradient contracts the batch, split over "data",
  # so its operands are scaled per shard. Float32 reduction order alone moves the
  # gradient by ~1e-7 relative; per-shard scales by 1e-3 or more.
  assert _relative_difference(grads, want_grads) > 1e-3


@multidevice
@pytest.mark.parametrize("recipe", FINE_GRAINED, ids=lambda r: type(r).__name__)
def test_per_row_and_block_recipes_are_silent_and_match_one_device_where_nothing_is_split(
    recipe):
  w, x, t = _data()
  fp8_state = fp8jax.init_dot_meta(recipe)
  _, want_grads, _ = jax.jit(fp8jax.value_and_grad(loss_fn))(w, fp8_state, x, t)
  put = lambda a: jax.device_put(a, NamedSharding(_mesh(), P("data")))
  with warnings.catch_warnings(record=True) as record:
    warnings.simplefilter("always")
    # Plain jit over the mesh: XLA's amaxes are of whole rows.
    _, jit_grads, _ = jax.jit(fp8jax.value_and_grad(loss_fn))(w, fp8_state, put(x), put(t))
    # shard_map with a replicated batch: every device holds whole rows.
    _, replicated_grads, _ = _shard_map_step(batch_spec=P())(w, fp8_state, x, t)
  assert not _messages(record, PER_SHARD)
  # The same quantized operands as one device; only float32 sum order may differ (a
  # few ulps of the gradient, far below the 1e-3 that per-shard scales give). Every
  # device of the replicated shard_map computes the whole one-device step.
  np.testing.assert_allclose(jit_grads, want_grads, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(replicated_grads, want_grads, rtol=1e-5, atol=1e-6)
