"""FP8 training on an 8-device mesh gives the one-device FP8 state: amaxes are global.

The mesh tests run on the 8 CPU devices every test process has (tests/multidevice.py).

What "the same" means, and why:
* A max does not depend on reduction order, so the amax of a tensor is exact
  whenever the tensor itself is bit-identical. Then the FP8 state is compared
  with `assert_array_equal`.
* Tensors computed by a sum over a *sharded* axis (the row-parallel layer's
  output, summed over "model" with a psum, and everything downstream of it:
  the loss and its gradient dL/dy) add the same float32 terms in another order
  than one device does, and can differ in the last bit. Their amaxes (the
  gradient role of that layer) are compared with rtol 2**-20 (a few float32
  ulps; a local or summed amax would be off by a factor of 1.1 to 8).
* Over several free-running steps the parameters also differ in the last
  bits (gradients are summed across devices in another order), so trajectories
  compare losses and FP8 state with rtol 1e-5: float32 rounding of ~1e-7 per
  step, over 6 steps, with a wide margin.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import fp8jax
import pallas_kernels
from fp8jax.ops import fused_kernels
from multidevice import multidevice


# A two-layer MLP in the Megatron layout: layer 1 column-parallel (kernel split
# over "model" on its output axis), layer 2 row-parallel (split on its input axis).
B, K, H, N = 32, 16, 32, 8
DELAYED = fp8jax.DelayedScaling(amax_history_len=4)
PARAM_SPECS = {"w1": P(None, "model"), "b1": P("model"), "w2": P("model", None)}
REPLICATED_SPECS = {name: P() for name in PARAM_SPECS}
FSDP_SPECS = {"w1": P("data", None), "b1": P(), "w2": P("data", None)}
# Roles whose tensor is downstream of the row-parallel sum over "model".
DOWNSTREAM_OF_SHARDED_SUM = {"l2.grad"}


def init(recipe):
  k1, k2 = jax.random.split(jax.random.key(0))
  params = {"w1": jax.random.normal(k1, (K, H)) / 4, "b1": jnp.zeros(H),
            "w2": jax.random.normal(k2, (H, N)) / 6}
  return params, {"l1": fp8jax.init_dot_meta(recipe), "l2": fp8jax.init_dot_meta(recipe)}


def batches(n_steps=6):
  # Different input gains per step, so the histories hold different amaxes.
  return [(jax.random.normal(jax.random.key(10 + i), (B, K)) * (1 + i % 3),
           jax.random.normal(jax.random.key(100 + i), (B, N))) for i in range(n_steps)]


def loss_fn(params, fp8_state, x, t, model_axis=None):
  h, m1 = fp8jax.fp8_dense(x, params["w1"], params["b1"], fp8_state["l1"])
  y, m2 = fp8jax.fp8_dense(jax.nn.gelu(h), params["w2"], None, fp8_state["l2"])
  if model_axis is not None:  # shard_map: the row-parallel layer's partial sums
    y = jax.lax.psum(y, model_axis)
  # Normalized by the *global* batch, so per-device gradients dL/dy equal the
  # one-device ones (a per-shard mean would make them n_data times larger).
  return jnp.sum((y - t) ** 2) / (B * N), {"l1": m1, "l2": m2}


TX = optax.adam(1e-2)


def one_device_step(params, opt_state, fp8_state, x, t):
  loss, grads, fp8_state = fp8jax.value_and_grad(loss_fn)(params, fp8_state, x, t)
  updates, opt_state = TX.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state, fp8_state, loss


def _mesh(data, model):
  auto = (jax.sharding.AxisType.Auto,) * 2
  return jax.make_mesh((data, model), ("data", "model"), axis_types=auto)


def gspmd_step(mesh, param_specs=PARAM_SPECS):
  """Plain jit: batch over "data", kernels as `param_specs`, FP8 state replicated."""
  shard = lambda spec: NamedSharding(mesh, spec)
  step = jax.jit(one_device_step, out_shardings=(
      {k: shard(s) for k, s in param_specs.items()}, None, shard(P()), shard(P())))

  def run(params, opt_state, fp8_state, x, t):
    params = {k: jax.device_put(v, shard(param_specs[k])) for k, v in params.items()}
    return step(params, opt_state, jax.device_put(fp8_state, shard(P())),
                jax.device_put(x, shard(P("data"))), jax.device_put(t, shard(P("data"))))
  return run


def shard_map_step(mesh, param_specs, model_axis, check_vma=True, axis_name=None):
  """shard_map for forward + backward (per-device code), the optimizer under jit."""

  def per_device(params, fp8_state, x, t):
    loss, grads, fp8_state = fp8jax.value_and_grad(
        functools.partial(loss_fn, model_axis=model_axis), axis_name=axis_name)(
            params, fp8_state, x, t)
    if not check_vma:  # without types JAX does not sum replicated parameters' gradients
      grads = jax.lax.psum(grads, "data")
    return jax.lax.psum(loss, "data"), grads, fp8_state

  grads_fn = jax.shard_map(per_device, mesh=mesh, check_vma=check_vma,
                           in_specs=(param_specs, P(), P("data"), P("data")),
                           out_specs=(P(), param_specs, P()))

  @jax.jit
  def step(params, opt_state, fp8_state, x, t):
    loss, grads, fp8_state = grads_fn(params, fp8_state, x, t)
    updates, opt_state = TX.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, fp8_state, loss

  shard = lambda spec: NamedSharding(mesh, spec)
  return lambda p, o, s, x, t: step(p, o, s, jax.device_put(x, shard(P("data"))),
                                    jax.device_put(t, shard(P("data"))))


def trajectory(step, recipe=DELAYED, teacher=None):
  """Runs 6 steps. With `teacher` (a one-device trajectory), every step starts
  from the teacher's previous state, so each step is compared on equal inputs."""
  params, fp8_state = init(recipe)
  opt_state = TX.init(params)
  out = []
  for i, (x, t) in enumerate(batches()):
    if teacher is not None and i > 0:
      params, opt_state, fp8_state, _ = teacher[i - 1]
    params, opt_state, fp8_state, loss = step(params, opt_state, fp8_state, x, t)
    out.append((params, opt_state, fp8_state, loss))
  return out


@functools.cache
def reference(recipe=DELAYED):
  return trajectory(jax.jit(one_device_step), recipe)


def roles(fp8_state):
  return {f"{layer}.{role}": getattr(fp8_state[layer], role)
          for layer in ("l1", "l2") for role in ("x", "kernel", "grad")}


def assert_same_fp8_state(got, want, inexact=frozenset(), rtol=0.0):
  for name, meta in roles(got).items():
    ref = roles(want)[name]
    for field in ("scale", "amax_history"):
      a, b = np.asarray(getattr(meta, field)), np.asarray(getattr(ref, field))
      if name in inexact or rtol:
        np.testing.assert_allclose(a, b, rtol=max(rtol, 2.0**-20), err_msg=f"{name}.{field}")
      else:
        np.testing.assert_array_equal(a, b, err_msg=f"{name}.{field}")


LAYOUTS = {
    # name: (step factory, roles that may differ in the last bit)
    "gspmd data=4 x model=2": (lambda: gspmd_step(_mesh(4, 2)), DOWNSTREAM_OF_SHARDED_SUM),
    "gspmd data=8": (lambda: gspmd_step(_mesh(8, 1), REPLICATED_SPECS), set()),
    "gspmd data=8 FSDP": (lambda: gspmd_step(_mesh(8, 1), FSDP_SPECS), set()),
    "shard_map data=8": (lambda: shard_map_step(_mesh(8, 1), REPLICATED_SPECS, None), set()),
    "shard_map data=4 x model=2": (
        lambda: shard_map_step(_mesh(4, 2), PARAM_SPECS, "model"), DOWNSTREAM_OF_SHARDED_SUM),
    "shard_map data=8 check_vma=False axis_name='data'": (
        lambda: shard_map_step(_mesh(8, 1), REPLICATED_SPECS, None, check_vma=False,
                               axis_name="data"), set()),
}


@multidevice
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_each_mesh_step_gives_the_one_device_fp8_state(layout):
  make_step, inexact = LAYOUTS[layout]
  step = make_step()
  teacher = reference()
  forced = trajectory(step, teacher=teacher)
  for i, ((_, _, state, loss), (_, _, want_state, want_loss)) in enumerate(zip(forced, teacher)):
    assert_same_fp8_state(state, want_state, inexact)
    # The loss is a sum over the batch (and, row-parallel, over "model"): reduction order.
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-6, err_msg=f"step {i}")

  # Free-running: the mesh run's own trajectory stays on the one-device one.
  free = trajectory(step)
  for (params, _, state, loss), (want_params, _, want_state, want_loss) in zip(free, teacher):
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-5)
    assert_same_fp8_state(state, want_state, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(want_params)):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)

  # Independent of the one-device run, and exact in any layout: layer 1's input
  # amax is the max over the *global* batch, and each kernel amax is the max of
  # the whole (sharded) kernel the step started from.
  params, _ = init(DELAYED)
  for i, (x, _) in enumerate(batches()):
    state = free[i][2]
    assert float(state["l1"].x.amax_history[0]) == float(jnp.max(jnp.abs(x)))
    for layer, w in (("l1", "w1"), ("l2", "w2")):
      assert float(state[layer].kernel.amax_history[0]) == float(jnp.max(jnp.abs(params[w])))
    params = free[i][0]
    # The FP8 state is replicated: every device holds the same bytes.
    for leaf in jax.tree.leaves(state):
      shards = [np.asarray(s.data) for s in leaf.addressable_shards]
      assert all(np.array_equal(shards[0], s) for s in shards[1:])


@multidevice
def test_current_scaling_inside_shard_map_uses_the_global_amax():
  recipe = fp8jax.CurrentScaling()
  teacher = reference(recipe)
  forced = trajectory(shard_map_step(_mesh(8, 1), REPLICATED_SPECS, None), recipe, teacher)
  for (_, _, state, loss), (_, _, want_state, want_loss) in zip(forced, teacher):
    assert_same_fp8_state(state, want_state)
    # Same scales in the casts -> same FP8 operands -> same losses up to sum order.
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-6)


@multidevice
def test_without_types_or_axis_name_shard_map_keeps_local_amaxes():
  # Documents why `axis_name` exists: with check_vma=False JAX cannot tell
  # fp8jax what is sharded, and each device keeps the amax of its own shard.
  step = shard_map_step(_mesh(8, 1), REPLICATED_SPECS, None, check_vma=False, axis_name=None)
  params, fp8_state = init(DELAYED)
  x, t = batches()[0]
  x = x * jnp.linspace(0.5, 2.0, B)[:, None]  # the largest rows sit on the last device
  _, _, state, _ = step(params, TX.init(params), fp8_state, x, t)
  # What comes back is device 0's view: the amax of its 4 rows, not of all 32.
  assert float(state["l1"].x.amax_history[0]) == float(jnp.max(jnp.abs(x[:B // 8])))
  assert float(state["l1"].x.amax_history[0]) < float(jnp.max(jnp.abs(x)))


@multidevice
def test_microbatch_accumulation_inside_shard_map_matches_one_device():
  params, fp8_state = init(DELAYED)
  xs = jnp.stack([x for x, _ in batches(4)])
  ts = jnp.stack([t for _, t in batches(4)])
  accumulate = lambda p, s, xs, ts: fp8jax.accumulate_gradients(
      lambda p, s, b: loss_fn(p, s, *b), p, s, (xs, ts))
  want_loss, want_grads, want_state = jax.jit(accumulate)(params, fp8_state, xs, ts)

  mesh = _mesh(8, 1)

  def per_device(p, s, xs, ts):
    loss, grads, s = accumulate(p, s, xs, ts)
    return jax.lax.psum(loss, "data"), grads, s

  sharded = jax.jit(jax.shard_map(per_device, mesh=mesh,
                                  in_specs=(P(), P(), P(None, "data"), P(None, "data")),
                                  out_specs=(P(), P(), P())))
  put = lambda a: jax.device_put(a, NamedSharding(mesh, P(None, "data")))
  loss, grads, state = sharded(params, fp8_state, put(xs), put(ts))
  assert_same_fp8_state(state, want_state)
  np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-6)
  for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)


@multidevice
@pytest.mark.parametrize("rows_in_use", [150, 0, 256])
def test_a_row_limited_cast_runs_per_shard_with_each_shards_own_count(monkeypatch, rows_in_use):
  """fp8_ragged_dot's casts read only the rows within the groups (`valid_rows` counts
  them in the whole x). Split over 8 devices by rows (32 each), every device's kernel
  (the Pallas one, interpreted) gets its shard's count: 150 rows in use leave devices
  0-3 whole, device 4 with 22 rows and devices 5-7 none. FP8 copies and amax are the
  unsplit definition's bits, and x is not gathered."""
  monkeypatch.setattr(pallas_kernels, "cast_transpose_amax_in_chain", functools.partial(
      pallas_kernels.cast_transpose_amax_in_chain, interpret=True))
  monkeypatch.setattr(fused_kernels, "choose", lambda args, kernel, reference: kernel(*args))
  x = jax.random.normal(jax.random.key(3), (256, 64), jnp.float32)
  x = x.at[rows_in_use:].set(1e6)
  if rows_in_use < 256:
    x = x.at[rows_in_use + 7].set(jnp.nan)
  x = x.astype(jnp.bfloat16)
  cast = jax.jit(lambda x, rows: fused_kernels.cast_transpose_amax(
      x, jnp.float32(4.0), jnp.float32(0.0), fp8jax.E4M3, valid_rows=rows)[:3])
  with fused_kernels.fused_kernels(False):
    want = cast(x, rows_in_use)  # fp8jax's jnp definition, one device
  sharded = jax.device_put(x, NamedSharding(_mesh(8, 1), P("data", None)))
  assert "all-gather" not in cast.lower(sharded, rows_in_use).compile().as_text()
  got = cast(sharded, rows_in_use)
  bits = lambda a: np.asarray(a).view(np.uint8 if a.dtype.itemsize == 1 else np.uint32)
  for g, w in zip(got, want):
    np.testing.assert_array_equal(bits(g), bits(w))
  assert float(got[2]) == (float(jnp.max(jnp.abs(x[:rows_in_use].astype(jnp.float32))))
                           if rows_in_use else 0.0)


@multidevice
@pytest.mark.parametrize("spec", [P("data"), P("data", None, "model")],
                         ids=["batch over data=8", "batch over data=4, heads over model=2"])
def test_fp8_attention_kernel_runs_per_shard_and_matches_one_device(spec):
  """The fused FP8 attention kernel (the Pallas one, interpreted on CPU) runs on
  each device's batch rows and heads: nothing is gathered, output and FP8 state
  are bit-identical to one device (each (row, head) is computed by the same kernel
  arithmetic; the amaxes are maxes) and the input gradients equal up to float32
  rounding order."""
  mesh = _mesh(8, 1) if spec == P("data") else _mesh(4, 2)
  batch, seq, heads, kv_heads, head_dim = 8, 64, 4, 2, 64
  keys = jax.random.split(jax.random.key(1), 4)
  q = jax.random.normal(keys[0], (batch, seq, heads, head_dim), jnp.bfloat16)
  k, v = (jax.random.normal(key, (batch, seq, kv_heads, head_dim), jnp.bfloat16)
          for key in keys[1:3])
  # The loss weights the output: its gradient dL/dout = weights, whatever the sum order.
  weights = jax.random.normal(keys[3], q.shape, jnp.float32)
  meta = fp8jax.init_attention_meta(DELAYED)

  def loss_fn(qkv, meta):
    out, meta = fp8jax.fp8_attention(*qkv, meta, causal=True, backend="pallas")
    return (jnp.sum(out.astype(jnp.float32) * weights), out), meta

  step = jax.jit(fp8jax.value_and_grad(loss_fn, has_aux=True))
  (_, want_out), want_grads, want_meta = step((q, k, v), meta)
  sharded = tuple(jax.device_put(a, NamedSharding(mesh, spec)) for a in (q, k, v))
  assert "all-gather" not in step.lower(sharded, meta).compile().as_text()
  (_, out), grads, new_meta = step(sharded, meta)
  np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(want_out, np.float32))
  for got, want in zip(grads, want_grads):
    # The interpreted backward kernel is plain XLA on CPU, which may contract its
    # multiply-adds into FMAs differently for one batch row per device than for the
    # whole batch (it does on some CPUs): the float32 sums then round
    # differently. That can move a bf16 gradient by one bf16 ulp (2^-8 relative), and
    # turn an exact cancellation (dq of the first query, which attends one key: P = 1,
    # dP - D = 0) into float32 residue, ~1e-7 against gradients of order 1, below
    # 2^-16 of the largest. A wrong shard (a masked row, a wrong scale) is off by the
    # gradients' own size.
    want = np.asarray(want, np.float32)
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=2**-8,
                               atol=2**-16 * np.abs(want).max())
  for got, want in zip(jax.tree.leaves(new_meta), jax.tree.leaves(want_meta)):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@multidevice
def test_a_recipe_of_your_own_on_a_mesh_gives_the_one_device_state():
  from test_recipe_protocol import EmaAmaxScaling  # defined outside fp8jax, as a user would

  recipe = EmaAmaxScaling(amax_history_len=4)
  teacher = reference(recipe)
  forced = trajectory(gspmd_step(_mesh(4, 2)), recipe, teacher)
  for (_, _, state, _), (_, _, want_state, _) in zip(forced, teacher):
    assert_same_fp8_state(state, want_state, DOWNSTREAM_OF_SHARDED_SUM)


def _moment_leaves(opt_state):
  """{(field, param path): Fp8Moment} of the FP8 Adam state inside the demo's chain."""
  from fp8jax.optim import Fp8Moment, ScaleByAdamFp8State

  (adam,) = [s for s in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(
      x, ScaleByAdamFp8State)) if isinstance(s, ScaleByAdamFp8State)]
  found = {}
  for field in ("mu", "nu"):
    for path, leaf in jax.tree_util.tree_leaves_with_path(
        getattr(adam, field), is_leaf=lambda x: isinstance(x, Fp8Moment)):
      if isinstance(leaf, Fp8Moment):
        found[(field, jax.tree_util.keystr(path))] = leaf
  return found


@multidevice
def test_fp8_optimizer_state_is_sharded_like_the_params_and_steps_like_one_device():
  from fp8jax.models import gpt, gpt_sharding
  from fp8jax.runs.steps import make_optimizer, train_step_for

  # Two layers (the tiny demo's four, unrolled, compile twice as long): the layers stay a
  # stacked axis of every weight and moment, as at any depth.
  model = gpt.Gpt(gpt.config_for("tiny", seq_len=32, n_layers=2, scan_unroll=2),
                  recipe=DELAYED)
  tx = make_optimizer("adamw_fp8", 1e-3, 0.1)
  tokens = jax.random.randint(jax.random.key(1), (8, 33), 0, 256)
  variables = model.init(jax.random.key(0), tokens[:, :-1])
  params, fp8_state = variables["params"], variables["fp8_meta"]
  opt_state = tx.init(params)
  copy = lambda tree: jax.tree.map(jnp.array, tree)  # the step donates its arguments
  step = train_step_for(model, tx, fp8=True)
  want = step(copy(params), copy(opt_state), copy(fp8_state), tokens)

  # FSDP over 8 devices: every weight's d_model axis split (the Megatron "model" axis of
  # the same layout sums bf16 partial outputs, which rounds differently from one device).
  mesh = _mesh(8, 1)
  args = gpt_sharding.shard_train_state(mesh, copy(params), copy(opt_state), copy(fp8_state),
                                        tokens, fsdp=True)
  param_spec = {jax.tree_util.keystr(path): leaf.sharding.spec
                for path, leaf in jax.tree_util.tree_leaves_with_path(args[0])}
  moments = _moment_leaves(args[1])
  assert len(moments) == 2 * 5  # qkv, out, up, down kernels and the embedding
  for (_, path), moment in moments.items():
    # The codes carry the param's spec; before the fix they were matched by their
    # last two path names (".../kernel", "codes") and silently replicated.
    assert moment.codes.sharding.spec == param_spec[path], path
    if "embed" in path:  # whole under FSDP, as its table (fp8jax.models.gpt_sharding)
      assert moment.codes.addressable_shards[0].data.size == moment.codes.size, path
      continue
    assert any(entry is not None for entry in moment.codes.sharding.spec), path
    assert moment.codes.addressable_shards[0].data.size < moment.codes.size, path
  got = step(*args)
  new_params = {jax.tree_util.keystr(path): leaf
                for path, leaf in jax.tree_util.tree_leaves_with_path(got[0])}
  for (field, path), moment in _moment_leaves(got[1]).items():
    param = new_params[path]
    assert moment.codes.sharding.is_equivalent_to(param.sharding, param.ndim), (field, path)
    whole = moment.codes.addressable_shards[0].data.size == moment.codes.size
    assert whole == ("embed" in path), path

  # Same numbers as one device. The train step's gradients themselves differ in the
  # last bits between layouts (float32 sums in another order), so the optimizer is
  # compared on equal gradients: its update is elementwise but for each 1x128 block's
  # min and max (exact in any order), and its stochastic rounding bits come from (seed,
  # step, leaf), not from the layout. XLA:CPU compiles the elementwise float32 math of
  # a shard's shape with other fused multiply-adds than the whole array's (measured:
  # updates 3 float32 ulps apart, rtol 2**-20 covers 8); a stored code can then move by
  # one E4M3 step where a moment sat within those ulps of a rounding edge, which a
  # float32 ulp (2**-23) against the E4M3 step (2**-3 relative) makes rarer than 1e-4.
  keys = iter(jax.random.split(jax.random.key(2), 64))
  grads = jax.tree.map(lambda p: jax.random.normal(next(keys), p.shape) * 10.0 ** jax.random.uniform(
      next(keys), p.shape, minval=-6, maxval=0), params)
  # Without the demo's global-norm clipping, a sum over every element whose order
  # depends on the layout.
  update = jax.jit(fp8jax.optim.adamw(1e-3, b2=0.95, weight_decay=0.1).update)
  state = fp8jax.optim.adamw(1e-3).init(params)
  sharded_params, sharded_state = gpt_sharding.shard_train_state(
      mesh, copy(params), copy(state), copy(fp8_state), tokens, fsdp=True)[:2]
  sharded_grads = jax.tree.map(lambda g, p: jax.device_put(g, p.sharding), grads, sharded_params)
  for _ in range(2):
    updates, state = update(grads, state, params)
    sharded_updates, sharded_state = update(sharded_grads, sharded_state, sharded_params)
    for got_leaf, want_leaf in zip(jax.tree.leaves((sharded_updates, sharded_state)),
                                   jax.tree.leaves((updates, state))):
      assert got_leaf.dtype == want_leaf.dtype
      got_np, want_np = np.asarray(got_leaf, np.float32), np.asarray(want_leaf, np.float32)
      if got_leaf.dtype == jnp.float8_e4m3fn:
        assert np.mean(got_np != want_np) <= 1e-4
      else:
        np.testing.assert_allclose(got_np, want_np, rtol=2**-20, atol=0)
  for (_, path), moment in _moment_leaves(sharded_state).items():
    param = new_params[path]
    assert moment.codes.sharding.is_equivalent_to(param.sharding, param.ndim), path


@functools.lru_cache(maxsize=1)
def _moe_gpt_one_device():
  """(step, params, optimizer state, FP8 state, tokens, the one-device step's outputs) of
  a small MoE GPT (shared by the layouts: one compile of the one-device step)."""
  from fp8jax.models import gpt
  from fp8jax.runs.steps import make_optimizer, train_step_for

  config = gpt.GptConfig(d_model=64, n_layers=2, n_heads=1, seq_len=32, experts=4, top_k=2)
  model = gpt.Gpt(config, recipe=DELAYED)
  tx = make_optimizer("adamw", 1e-3, 0.1)
  tokens = jax.random.randint(jax.random.key(1), (8, 33), 0, 256)
  variables = model.init(jax.random.key(0), tokens[:, :-1])
  state = (variables["params"], tx.init(variables["params"]), variables["fp8_meta"])
  train_step = train_step_for(model, tx, fp8=True)

  def step(*args):
    # Every bf16 intermediate rounded where the model rounds it (no excess precision):
    # otherwise XLA may keep one in float32 in one program's fusions and not in the
    # other's (the one-device and the sharded programs fuse the unrolled blocks
    # differently), and compare roundings instead of the sharding.
    return train_step.lower(*args).compile(
        compiler_options={"xla_allow_excess_precision": False})(*args)

  return step, state, tokens, step(*_copy(state), tokens)


def _copy(tree):
  return jax.tree.map(jnp.array, tree)  # the demo's step donates its arguments


@multidevice
@pytest.mark.parametrize("fsdp", [False, True], ids=["tensor_parallel", "fsdp"])
def test_moe_gpt_step_splits_each_expert_and_gives_the_one_device_state(fsdp):
  """The demo GPT with an MoE MLP under `gpt_sharding`: each expert's d_ff split over
  "model" (2 x 4 mesh) or, with FSDP, its d_model over "data" too (8 x 1)."""
  from fp8jax.models import gpt_sharding

  step, state, tokens, want = _moe_gpt_one_device()
  mesh = _mesh(8, 1) if fsdp else _mesh(2, 4)
  args = gpt_sharding.shard_train_state(mesh, *_copy(state), tokens, fsdp=fsdp)
  for name in ("w_in", "w_out"):
    weight = args[0]["blocks"]["mlp"][name]
    assert weight.addressable_shards[0].data.size == weight.size // (8 if fsdp else 4)
  got = step(*args)
  # The loss sums over the batch in another order (and over the "model" partial sums).
  np.testing.assert_allclose(float(got[3]), float(want[3]), rtol=1e-6)
  metas = lambda state: jax.tree_util.tree_leaves_with_path(
      state, is_leaf=lambda node: isinstance(node, fp8jax.Fp8Meta))
  pairs = [(jax.tree_util.keystr(path), np.asarray(a.amax_history), np.asarray(b.amax_history),
            np.asarray(a.scale), np.asarray(b.scale))
           for (path, a), (_, b) in zip(metas(got[2]), metas(want[2]))]
  assert any("w_in_meta" in path for path, *_ in pairs)
  for path, amax, want_amax, scale, want_scale in pairs:
    if path.endswith("['qkv']['dot_meta'].x"):
      # qkv's cast quantizes the float32 norm (fp8jax.fp8_rms_norm_dense), whose mean of
      # d_model = 64 squares the two programs may sum in another order: within 64 float32
      # ulps (2**-24 each, relative) in the mean, half that in r, so in the amax and in
      # the scale made from it.
      np.testing.assert_allclose(amax, want_amax, rtol=64 * 2.0**-24, err_msg=path)
      np.testing.assert_allclose(scale, want_scale, rtol=64 * 2.0**-24, err_msg=path)
    elif not fsdp or not path.endswith(".grad"):
      # Exact: every other role on the 2 x 4 mesh; under FSDP the other forward roles (the
      # inputs, the weights, each expert's).
      np.testing.assert_array_equal(amax, want_amax, err_msg=path)
      np.testing.assert_array_equal(scale, want_scale, err_msg=path)
    else:
      # FSDP's gradients: the experts' products contract d_model, split over "data", in
      # another order, and a last-bit change of a bf16 cotangent can move an FP8-quantized
      # gradient element by an E4M3 step (6-12%); downstream of both MoE layers the
      # attention projections' gradient amaxes move by up to 2.1% (measured): 5% bounds it.
      np.testing.assert_allclose(amax, want_amax, rtol=0.05, err_msg=path)
