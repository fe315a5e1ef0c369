"""`fp8jax.optim.update_and_apply`: an optimizer's step written into the parameters.

For any optax transformation it is `tx.update` then `optax.apply_updates`. For
`fp8jax.optim.adamw` the FP8 moments' kernel (`pallas_kernels.adam_fp8`) clips the
gradient, steps the moments and writes the new parameter in one pass on a GPU. The
references: optax's own chain (bit for bit where the jnp form runs, on a CPU), the kernel
in the Pallas interpreter against it (to float32 rounding), and the compiled H100 step's
bytes.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fp8jax.optim as optim
from fp8jax import deviceless
from bitwise import assert_bitwise

SCHEDULE = optax.warmup_cosine_decay_schedule(1e-4, 1e-3, 2, 10)


def _problem(seed=0):
  """Parameters (a stored 2-D leaf, a stack of 3 layers, a bf16 leaf whose moments the
  kernel steps but whose parameter optax's bf16 arithmetic writes, a float32 gain that
  stays out of the kernel) and 4 steps of gradients whose magnitudes span 10 binades."""
  rng = np.random.default_rng(seed)
  shapes = {"w": (70, 300), "stack": (3, 40, 128), "half": (40, 256), "gain": (300,)}
  dtype = lambda name: jnp.bfloat16 if name == "half" else jnp.float32
  params = {name: jnp.asarray(rng.standard_normal(shape), dtype(name))
            for name, shape in shapes.items()}
  grads = [{name: jnp.asarray(rng.standard_normal(shape) * np.exp2(rng.uniform(-8, 2, shape)),
                              dtype(name)) for name, shape in shapes.items()}
           for _ in range(4)]
  return params, grads


def _fp8_adamw(max_grad_norm):
  # The decay masked off the gain (a callable mask), a learning-rate schedule.
  return optim.adamw(SCHEDULE, b2=0.95, weight_decay=0.1,
                     mask=lambda params: {"w": True, "stack": True, "half": True,
                                          "gain": False},
                     storage=optim.MomentStorage(min_size=1024), max_grad_norm=max_grad_norm)


def _steps(step, tx, params, grads):
  """(params, state) after each of the steps, from tx's initial state."""
  state, out = jax.jit(tx.init)(params), []
  for step_grads in grads:
    params, state = step(step_grads, state, params)
    out.append((params, state))
  return out


def _chain_step(tx):
  # A function of its own each time: jit's cache would hand back a program traced before
  # the kernels were switched on.
  def step(grads, state, params):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state
  return jax.jit(step)


def _fused_step(tx):
  return jax.jit(lambda grads, state, params: optim.update_and_apply(tx, grads, state, params))


# Clipping on (the gradients' norm is about 30) and off (never reached; no clipping).
@pytest.mark.parametrize("max_grad_norm", [1.0, 1e6, None])
def test_on_a_cpu_it_is_tx_update_then_apply_updates_bit_for_bit(max_grad_norm):
  params, grads = _problem()
  tx = _fp8_adamw(max_grad_norm)
  want = _steps(_chain_step(tx), tx, params, grads)
  got = _steps(_fused_step(tx), tx, params, grads)
  for (_, got_state), (_, want_state) in zip(got, want):
    assert jax.tree.structure(got_state) == jax.tree.structure(want_state)
  assert_bitwise(got, want)
  # The parameters moved, and the clipping did something where it was asked to.
  assert not np.array_equal(got[-1][0]["w"], params["w"])


def _nested(params):
  """The problem's parameters one level deeper: {"blocks": {...}, "gain": ...}."""
  return {"blocks": {k: v for k, v in params.items() if k != "gain"}, "gain": params["gain"]}


# A constant learning rate with no decay (optax adds none: not even 0 * p); a decay masked
# by a prefix of the parameters' tree.
@pytest.mark.parametrize("options", [
    dict(learning_rate=1e-3, weight_decay=0.0),
    dict(learning_rate=SCHEDULE, weight_decay=0.1, mask={"blocks": True, "gain": False})],
    ids=["constant_lr_no_decay", "prefix_mask"])
def test_other_learning_rates_decays_and_masks_are_optax_s_bit_for_bit(options):
  params, grads = _problem(4)
  params, grads = _nested(params), [_nested(g) for g in grads]
  tx = optim.adamw(**options, b2=0.95, storage=optim.MomentStorage(min_size=1024),
                   max_grad_norm=1.0)
  assert_bitwise(_steps(_fused_step(tx), tx, params, grads),
                 _steps(_chain_step(tx), tx, params, grads))


@pytest.mark.parametrize("wrapped", ["decay_schedule", "inject_hyperparams"])
def test_a_wrapped_adamw_takes_the_unfused_step_and_says_so(wrapped):
  """What the fused step does not know (a weight-decay schedule, the numbers
  inject_hyperparams makes arrays) takes tx.update then apply_updates, with a warning
  that says how to get the fused step."""
  params, grads = _problem(6)
  # No bf16 leaf: optax's clipping by a norm inject_hyperparams made an array mixes dtypes.
  params, grads = ({k: v for k, v in tree.items() if k != "half"} for tree in (params, grads[0]))
  storage = optim.MomentStorage(min_size=1024)
  if wrapped == "decay_schedule":
    tx = optim.adamw(1e-3, weight_decay=lambda count: 0.1 / (1 + count), storage=storage,
                     max_grad_norm=1.0)
  else:
    tx = optax.inject_hyperparams(optim.adamw)(learning_rate=1e-3, weight_decay=0.1,
                                               max_grad_norm=1.0, storage=storage)
  state = tx.init(params)
  with pytest.warns(UserWarning, match="not fp8jax.optim.adamw's own"):  # when traced
    got = _fused_step(tx)(grads, state, params)
  want = _chain_step(tx)(grads, state, params)
  assert_bitwise(got, want)


def test_clipping_in_the_fused_step_is_clip_by_global_norm_chained_before_adamw():
  """max_grad_norm is `chain(optax.clip_by_global_norm(n), adamw(...))`: the same numbers
  and the same state tree, so a checkpoint of either restores into the other."""
  params, grads = _problem(1)
  clipped = _fp8_adamw(1.0)
  chained = optax.chain(optax.clip_by_global_norm(1.0), _fp8_adamw(None))
  got = _steps(_fused_step(clipped), clipped, params, grads)
  want = _steps(_chain_step(chained), chained, params, grads)
  assert_bitwise(got, want)
  assert jax.tree.structure(got[-1][1]) == jax.tree.structure(want[-1][1])
  unclipped = _steps(_fused_step(_fp8_adamw(None)), _fp8_adamw(None), params, grads)
  assert not np.array_equal(unclipped[-1][0]["w"], got[-1][0]["w"])


def test_any_other_transformation_is_its_update_then_apply_updates():
  params, grads = _problem(2)
  tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3, weight_decay=0.1))
  for (a_params, a_state), (b_params, b_state) in zip(
      _steps(_fused_step(tx), tx, params, grads), _steps(_chain_step(tx), tx, params, grads)):
    for a, b in zip(jax.tree.leaves((a_params, a_state)), jax.tree.leaves((b_params, b_state))):
      np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("max_grad_norm", [1.0, None])
def test_the_kernel_writing_the_parameters_is_the_jnp_step(interpreted_kernels, monkeypatch,
                                                             max_grad_norm):
  """The interpreted kernel against the jnp form (optax's numbers), each step from the
  jnp form's state. The kernel does the same float32 operations in their order, but
  XLA:CPU fuses some multiply-adds of the jnp form into FMAs (test_fp8_adam_kernel.py:
  up to 3 ulps of the Adam direction, 1 of a block's offset). A float32 parameter is p +
  lr * (direction + decay * p), rounded once more to p's ulp: within one ulp of p (|p| <
  8: 2**-20) plus lr (at most 1e-3) times 2**-20; the bf16 one, rounded to bf16 after
  each of optax's steps, within one bf16 ulp (2**-7 relative); codes and k move one step
  in at most 1 element in 10**3, offsets within 2**-20 relative."""
  import pallas_kernels
  calls, launch = [], pallas_kernels.adam_fp8_update

  def counted(*args, **kwargs):
    calls.append(kwargs.get("param") is not None)
    return launch(*args, **kwargs)

  monkeypatch.setattr(pallas_kernels, "adam_fp8_update", counted)
  params, grads = _problem(3)
  tx = _fp8_adamw(max_grad_norm)
  state = jax.jit(tx.init)(params)
  jnp_step, kernel_step = _chain_step(tx), _fused_step(tx)
  with monkeypatch.context() as undo:
    from fp8jax.ops import fused_kernels
    undo.setattr(fused_kernels, "choose", lambda args, kernel, reference: reference(*args))
    states = [state]
    for step_grads in grads[:-1]:
      states.append(jnp_step(step_grads, states[-1], params)[1])
    wants = [jnp_step(g, s, params) for g, s in zip(grads, states)]
  for step_grads, state, (want_params, want_state) in zip(grads, states, wants):
    got_params, got_state = kernel_step(step_grads, state, params)
    for name in ("w", "stack", "gain"):
      np.testing.assert_allclose(got_params[name], want_params[name], rtol=0,
                                 atol=2.0 ** -20 + 1e-3 * 2.0 ** -20)
    np.testing.assert_allclose(np.asarray(got_params["half"], np.float32),
                               np.asarray(want_params["half"], np.float32), rtol=2.0 ** -7)
    got_adam, want_adam = (_adam_state(s) for s in (got_state, want_state))
    for moment in ("mu", "nu"):
      for name in ("w", "stack", "half"):
        got, want = getattr(got_adam, moment)[name], getattr(want_adam, moment)[name]
        codes = [np.asarray(m.codes).view(np.uint8).astype(int) for m in (got, want)]
        assert np.mean(codes[0] != codes[1]) <= 1e-3 and np.all(abs(codes[0] - codes[1]) <= 1)
        assert np.mean(np.asarray(got.k) != np.asarray(want.k)) <= 1e-3
        np.testing.assert_allclose(got.offset, want.offset, rtol=2.0 ** -20)
      np.testing.assert_array_equal(getattr(got_adam, moment)["gain"],
                                    getattr(want_adam, moment)["gain"])
  # The float32 stored leaves took the kernel that writes the parameter; the bf16 one the
  # kernel that returns the update (traced once: the same program every step).
  assert sorted(calls) == [False, True, True], calls


def _adam_state(state) -> optim.ScaleByAdamFp8State:
  """The FP8 Adam state inside the chain's state."""
  (found,) = [node for node in jax.tree.leaves(
      state, is_leaf=lambda node: isinstance(node, optim.ScaleByAdamFp8State))
      if isinstance(node, optim.ScaleByAdamFp8State)]
  return found


@pytest.mark.parametrize("max_grad_norm", [0, -1.0, "1", True])
def test_a_max_grad_norm_that_is_not_a_positive_number_is_refused(max_grad_norm):
  with pytest.raises(ValueError, match="max_grad_norm=.*positive number"):
    optim.adamw(1e-3, max_grad_norm=max_grad_norm)


_MISSING = deviceless.deviceless_toolchain_missing()


@pytest.mark.hopper
@pytest.mark.skipif(_MISSING is not None, reason=str(_MISSING))
def test_h100_step_writes_the_parameter_in_the_moments_kernel_and_moves_8_bytes_less():
  """The clipped AdamW step of a [4096, 4096] float32 leaf, params and state donated, on
  an H100: under update_and_apply the moments' kernel reads the gradient (4 bytes), the
  parameter (4) and both codes (2), and writes the parameter (4) and both codes (2), in
  place; no other pass reads the parameter. tx.update then apply_updates writes the
  update (4) and adds it in a pass of its own (12); the clipped gradient is written
  either way, by the pass that reduces its norm here (fused) or by its own (unfused)."""
  from fp8jax.lowering.cost import cost
  shape = (4096, 4096)
  params = {"w": jax.ShapeDtypeStruct(shape, jnp.float32)}
  tx = optim.adamw(1e-3, max_grad_norm=1.0)
  state = jax.eval_shape(tx.init, params)

  def report(step):
    return cost(jax.jit(step, donate_argnums=(1, 2)), params, state, params,
                target="deviceless")

  def unfused_step(grads, state, params):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  fused = report(lambda g, s, p: optim.update_and_apply(tx, g, s, p))
  unfused = report(unfused_step)
  kernels = [k for k in fused.kernels if "adam_fp8_update" in k.op_name]
  assert len(kernels) == 1, fused.table()
  # Beside the codes, each row's two numbers per block: 8 bytes a 128-column block.
  per_parameter = (kernels[0].bytes_in + kernels[0].bytes_out) / np.prod(shape)
  assert per_parameter == pytest.approx(16 + 4 * 8 / 128, rel=1e-3), fused.table()
  assert not [k for k in fused.kernels if k.category == "copy"], fused.table()
  big = [k for k in fused.kernels if k.bytes_in + k.bytes_out >= np.prod(shape)]
  assert len(big) == 2, fused.table()  # the norm's pass (writing the gradient) and the kernel
  assert unfused.bytes - fused.bytes >= 8 * np.prod(shape), (fused.table(), unfused.table())


@pytest.mark.gpu
def test_on_a_gpu_the_kernel_writing_the_parameters_steps_as_xla_runs_the_jnp_step(
    hopper_device):
  """Four clipped steps on a Hopper GPU, the kernel against XLA's jnp form
  (`fused_kernels(False)`) from the same state and parameters each step: Triton's and
  XLA's log2 and exp2 may differ in a float32 ulp, which moves a code only where y lies
  that close to a rounding boundary (a few in 10**4 at most, by one step), and the
  direction with it; the parameter moves by lr (1e-3) times the direction, so a
  parameter differs by far less than lr * 1e-3 on average."""
  from fp8jax.ops import fused_kernels
  params, grads = _problem(5)
  tx = optim.adamw(1e-3, weight_decay=0.1, max_grad_norm=1.0,
                   storage=optim.MomentStorage(min_size=16))
  put = lambda tree: jax.device_put(tree, hopper_device)
  # Two functions, so that each jit traces its own program (the flag is read when tracing).
  kernel_step, jnp_step = _fused_step(tx), _fused_step(tx)
  state = jax.jit(tx.init)(put(params))
  for step_grads in grads:
    with fused_kernels.fused_kernels(False):
      want_params, want_state = jnp_step(put(step_grads), state, put(params))
    got_params, got_state = kernel_step(put(step_grads), state, put(params))
    for moment in ("mu", "nu"):
      got, want = (np.asarray(getattr(_adam_state(s), moment)["w"].codes).view(np.uint8)
                   .astype(int) for s in (got_state, want_state))
      assert np.mean(got != want) < 1e-3 and np.max(np.abs(got - want)) <= 1, moment
    moved = np.abs(np.asarray(want_params["w"]) - np.asarray(params["w"]))
    error = np.abs(np.asarray(got_params["w"]) - np.asarray(want_params["w"]))
    assert np.mean(moved) > 1e-4 and np.mean(error) < 1e-3 * np.mean(moved)
    state = want_state
