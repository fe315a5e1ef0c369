"""FP8 training on an explicit-axis mesh (`AxisType.Explicit`) gives the one-device result.

On such a mesh an array's sharding is part of its type, and JAX refuses a
contraction over a split dimension unless told where the product lives: the
wgrad GEMM of data parallelism contracts the batch, split over "data".

The mesh tests run on the 8 CPU devices every test process has (tests/multidevice.py).

What "the same" means, and why:
* Every tensor whose amax the FP8 state records (x, kernel, the hidden
  activation, dL/dy) is computed row by row, with no sum over the sharded
  batch, so it is bit-identical to one device, and so is its amax (a max does
  not depend on the order it is taken in). Steps that start from the same
  parameters therefore give a bit-identical FP8 state.
* The loss and the gradients of the kernels and bias are sums over the batch,
  which the mesh adds in another order (each device sums its 4 rows, then an
  all-reduce). Two orders of a float32 sum of n terms differ by at most about
  n * 2**-24 * sum|terms|, ~2e-6 of sum|terms| for n = 32 (the loss: 256): rtol
  1e-5, and atol 1e-7 for entries that cancel to near 0 (measured: at most
  3e-8 absolute on the gradients, 1e-7 relative on the loss).
* Three free-running steps then start from parameters that differ in those
  last bits (measured: at most 4e-9), and so may every tensor computed from
  them and its amax: loss, parameters and FP8 state are compared with the same
  tolerances.
"""
from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import fp8jax
from multidevice import N_DEVICES, multidevice


B, K, H, N = 32, 16, 32, 8
N_STEPS = 3
DELAYED = fp8jax.DelayedScaling(amax_history_len=4)
TX = optax.sgd(0.1)
LAYOUTS = {
    "data parallel": {"w1": P(), "b1": P(), "w2": P()},
    "FSDP": {"w1": P("data", None), "b1": P(), "w2": P("data", None)},  # kernels on their rows
}


def init(recipe):
  k1, k2 = jax.random.split(jax.random.key(0))
  params = {"w1": jax.random.normal(k1, (K, H)) / 4, "b1": jnp.zeros(H),
            "w2": jax.random.normal(k2, (H, N)) / 6}
  return params, {"l1": fp8jax.init_dot_meta(recipe), "l2": fp8jax.init_dot_meta(recipe)}


def batches():
  # Different input gains per step, so the histories hold different amaxes.
  return [(jax.random.normal(jax.random.key(10 + i), (B, K)) * (1 + i),
           jax.random.normal(jax.random.key(100 + i), (B, N))) for i in range(N_STEPS)]


def loss_fn(params, fp8_state, x, t):
  h, m1 = fp8jax.fp8_dense(x, params["w1"], params["b1"], fp8_state["l1"])
  y, m2 = fp8jax.fp8_dense(jax.nn.gelu(h), params["w2"], None, fp8_state["l2"])
  return jnp.sum((y - t) ** 2) / (B * N), {"l1": m1, "l2": m2}


@jax.jit
def train_step(params, opt_state, fp8_state, x, t):
  loss, grads, fp8_state = fp8jax.value_and_grad(loss_fn)(params, fp8_state, x, t)
  updates, opt_state = TX.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state, fp8_state, loss, grads


def explicit_mesh():
  return jax.make_mesh((N_DEVICES,), ("data",), axis_types=(AxisType.Explicit,))


def on_mesh(mesh, param_specs):
  """`train_step` with params as `param_specs`, batch on "data", FP8 state replicated."""
  put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))

  def step(params, opt_state, fp8_state, x, t):
    params = {k: put(v, param_specs[k]) for k, v in params.items()}
    with jax.set_mesh(mesh):
      return train_step(params, TX.init(params) if opt_state is None else opt_state,
                        put(fp8_state, P()), put(x, P("data")), put(t, P("data")))
  return step


def one_device(params, opt_state, fp8_state, x, t):
  return train_step(params, TX.init(params) if opt_state is None else opt_state, fp8_state,
                    x, t)


def trajectory(step, teacher=None):
  """N_STEPS steps of `step`. With `teacher` (a one-device trajectory) each step
  starts from the teacher's previous parameters and state: equal inputs."""
  params, fp8_state = init(DELAYED)
  opt_state, out = None, []
  for i, (x, t) in enumerate(batches()):
    if teacher is not None and i > 0:
      params, opt_state, fp8_state = teacher[i - 1][:3]
    params, opt_state, fp8_state, loss, grads = step(params, opt_state, fp8_state, x, t)
    out.append((params, opt_state, fp8_state, loss, grads))
  return out


def sharded_as(a, mesh, spec) -> bool:
  return a.sharding.is_equivalent_to(NamedSharding(mesh, spec), a.ndim)


def assert_close(got, want, rtol, atol=0.0, what=""):
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=atol, err_msg=what)


def assert_equal(got, want, what=""):
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=what)


@multidevice
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_explicit_mesh_steps_give_the_one_device_fp8_state_loss_and_grads(layout):
  specs, mesh = LAYOUTS[layout], explicit_mesh()
  step = on_mesh(mesh, specs)
  teacher = trajectory(one_device)

  for i, (got, want) in enumerate(zip(trajectory(step, teacher), teacher)):
    _, _, state, loss, grads = got
    _, _, want_state, want_loss, want_grads = want
    assert_equal(state, want_state, f"step {i}: FP8 state")
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-5, err_msg=f"step {i}")
    assert_close(grads, want_grads, rtol=1e-5, atol=1e-7, what=f"step {i}: grads")
    # Each gradient keeps its parameter's sharding (FSDP: reduce-scattered onto rows).
    for name, g in grads.items():
      assert sharded_as(g, mesh, specs[name]), (name, g.sharding)

  for i, (got, want) in enumerate(zip(trajectory(step), teacher)):
    params, _, state, loss, _ = got
    want_params, _, want_state, want_loss, _ = want
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-5, err_msg=f"step {i}")
    assert_close(params, want_params, rtol=1e-5, atol=1e-7, what=f"step {i}: params")
    assert_close(state, want_state, rtol=1e-5, what=f"step {i}: FP8 state")


@multidevice
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_explicit_mesh_amaxes_are_those_of_the_global_tensors(layout):
  # Independent of the one-device run: the recorded amax of layer 1's input is
  # max|x| over the whole batch (numpy), not over one device's 4 rows, and the
  # kernel's is that of the whole (FSDP: sharded) kernel the step started from.
  params, fp8_state = init(DELAYED)
  x, t = batches()[0]
  x = x * jnp.linspace(0.5, 2.0, B)[:, None]  # the largest rows sit on the last device
  mesh = explicit_mesh()
  _, _, state, _, _ = on_mesh(mesh, LAYOUTS[layout])(params, None, fp8_state, x, t)
  assert float(state["l1"].x.amax_history[0]) == np.max(np.abs(np.asarray(x)))
  assert float(state["l1"].x.amax_history[0]) > np.max(np.abs(np.asarray(x[:B // 8])))
  for layer, w in (("l1", "w1"), ("l2", "w2")):
    assert float(state[layer].kernel.amax_history[0]) == np.max(np.abs(np.asarray(params[w])))
  # The FP8 state is replicated: every device holds the same bytes.
  for leaf in jax.tree.leaves(state):
    assert sharded_as(leaf, mesh, P()), leaf.sharding
    shards = [np.asarray(s.data) for s in leaf.addressable_shards]
    assert all(np.array_equal(shards[0], s) for s in shards[1:])


@multidevice
def test_per_head_einsum_on_explicit_mesh_gives_the_one_device_grads_and_fp8_state():
  # A batch dim (heads) takes fp8_dot_general's general path, not one 2-D GEMM;
  # its wgrad contracts the batch rows, split over "data". x's gradient and
  # every amax involve one row at a time: bit-identical. The loss and the
  # kernel's gradient sum over the rows: tolerances as in the module docstring.
  x = jax.random.normal(jax.random.key(0), (4, B, K))
  kernel = jax.random.normal(jax.random.key(1), (4, K, N)) / 4

  def loss_fn(params, meta, t):
    y, meta = fp8jax.fp8_einsum("hbk,hkn->hbn", *params, meta)
    return jnp.sum((y - t) ** 2) / y.size, meta

  t = jax.random.normal(jax.random.key(2), (4, B, N))
  step = jax.jit(fp8jax.value_and_grad(loss_fn))
  meta = fp8jax.init_dot_meta(fp8jax.CurrentScaling())
  want_loss, (want_dx, want_dk), want_meta = step((x, kernel), meta, t)
  mesh = explicit_mesh()
  put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))
  rows = P(None, "data")
  with jax.set_mesh(mesh):
    loss, (dx, dk), new_meta = step((put(x, rows), put(kernel, P())), put(meta, P()),
                                    put(t, rows))
  np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-5)
  assert_equal(dx, want_dx, "dx")
  assert_close(dk, want_dk, rtol=1e-5, atol=1e-7, what="dkernel")
  assert_equal(new_meta, want_meta, "FP8 state")
  assert sharded_as(dx, mesh, rows) and sharded_as(dk, mesh, P())


@multidevice
def test_per_row_recipe_on_explicit_mesh_raises_a_clear_error():
  mesh = explicit_mesh()
  meta = fp8jax.init_dot_meta(fp8jax.RowwiseScaling())
  x = jax.device_put(jnp.ones((B, K)), NamedSharding(mesh, P("data")))
  with pytest.raises(ValueError, match=r"RowwiseScaling.*explicit-axis mesh.*DelayedScaling"):
    with jax.set_mesh(mesh):
      jax.jit(fp8jax.fp8_dense)(x, jnp.ones((K, H)), None, meta)


@multidevice
def test_attention_kernel_on_explicit_mesh_raises_a_clear_error():
  mesh = explicit_mesh()
  q = jax.device_put(jnp.ones((N_DEVICES, 64, 2, 64), jnp.bfloat16),
                     NamedSharding(mesh, P("data")))
  meta = fp8jax.init_attention_meta(DELAYED)
  with pytest.raises(ValueError, match=r"backend='pallas'.*explicit-axis mesh.*backend='xla'"):
    with jax.set_mesh(mesh):
      jax.jit(lambda q, meta: fp8jax.fp8_attention(q, q, q, meta, backend="pallas"))(q, meta)


@multidevice
def test_forcing_fused_kernels_on_explicit_mesh_raises_a_clear_error():
  mesh = explicit_mesh()
  x = jax.device_put(jnp.ones((B, K)), NamedSharding(mesh, P("data")))
  meta = fp8jax.init_dot_meta(DELAYED)
  with pytest.raises(ValueError, match=r"fused_kernels\(True\).*explicit-axis mesh"):
    with jax.set_mesh(mesh), fp8jax.fused_kernels.fused_kernels(True):
      jax.jit(fp8jax.fp8_dense)(x, jnp.ones((K, H)), None, meta)


@multidevice
def test_out_sharding_is_honoured_on_an_explicit_mesh():
  """Flax's `out_sharding` call argument: the FP8 layers' outputs carry the asked sharding,
  and a converted nnx.MultiHeadAttention (which passes it to its projections) runs."""
  from flax import nnx
  from fp8jax.flax import Fp8Rule, convert_to_fp8
  from fp8jax.flax import nnx as fp8_nnx
  mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
  x = jax.random.normal(jax.random.key(0), (4, 8, 64), jnp.float32)
  with jax.set_mesh(mesh):
    x = jax.device_put(x, P("data", None, None))
    layers = {
        "linear": fp8_nnx.Fp8Linear(64, 64, rngs=nnx.Rngs(0)),
        "general": fp8_nnx.Fp8LinearGeneral(64, (4, 16), rngs=nnx.Rngs(0)),
        "einsum": fp8_nnx.Fp8Einsum("bsd,de->bse", (64, 64), rngs=nnx.Rngs(0)),
    }
    specs = {"linear": P("data", None, "model"), "general": P("data", None, "model", None),
             "einsum": P("data", None, "model")}
    for name, layer in layers.items():
      y = layer(x, out_sharding=specs[name])
      assert jax.typeof(y).sharding.spec == specs[name], (name, jax.typeof(y))
    mha = nnx.MultiHeadAttention(num_heads=4, in_features=64, decode=False,
                                 rngs=nnx.Rngs(0))
    want = mha(x, out_sharding=P("data", None, None), qkv_sharding=P("data", None, "model"))
    convert_to_fp8(mha, rules=(Fp8Rule(),))
    got = mha(x, out_sharding=P("data", None, None), qkv_sharding=P("data", None, "model"))
    assert jax.typeof(got).sharding.spec == P("data", None, None)
    # E4M3 rounding (3 mantissa bits) of 4 chained GEMMs: ~0.1 relative error at most;
    # a wrong layout or scale gives ~1.
    error = np.linalg.norm(np.asarray(got - want)) / np.linalg.norm(np.asarray(want))
    assert error < 0.15
