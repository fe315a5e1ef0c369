"""Flax linen and nnx layers give the same outputs and FP8 state as the pure functions."""
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import fp8jax
from fp8jax.flax import linen as fp8nn
from fp8jax.flax import nnx as fp8nnx

RECIPE = fp8jax.DelayedScaling(amax_history_len=4)


def assert_trees_equal(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _inputs(shape=(3, 5, 16), seed=0):
  return jax.random.normal(jax.random.key(seed), shape)


def _pure_dense_step(params, x, target):
  """The reference: one value_and_grad step of fp8_dense on fresh state, loss sum(y * target)."""
  def loss_fn(params, meta, x):
    y, meta = fp8jax.fp8_dense(x, params["kernel"], params["bias"], meta)
    return jnp.sum(y * target), meta
  return jax.jit(fp8jax.value_and_grad(loss_fn))(params, fp8jax.init_dot_meta(RECIPE), x)


def _linen_step(model, variables, x, target):
  def loss_fn(params, fp8_state, x):
    y, updates = model.apply({"params": params, "fp8_meta": fp8_state}, x, mutable=["fp8_meta"])
    return jnp.sum(y * target), updates["fp8_meta"]
  return jax.jit(fp8jax.value_and_grad(loss_fn))(variables["params"], variables["fp8_meta"], x)


def test_linen_fp8_dense_matches_pure_function_in_a_train_step():
  x = _inputs()
  model = fp8nn.Fp8Dense(8, recipe=RECIPE, bias_init=nn.initializers.normal(1.0))
  variables = model.init(jax.random.key(1), x)
  # init creates fresh state and does not record the init pass's amaxes.
  assert_trees_equal(variables["fp8_meta"]["dot_meta"], fp8jax.init_dot_meta(RECIPE))
  target = _inputs((3, 5, 8), seed=2)
  loss, grads, state = _linen_step(model, variables, x, target)

  want_loss, want_grads, want_state = _pure_dense_step(variables["params"], x, target)
  assert float(loss) == float(want_loss)
  assert_trees_equal(grads, want_grads)
  assert_trees_equal(state["dot_meta"], want_state)


def test_linen_eval_apply_leaves_state_alone():
  x = _inputs()
  model = fp8nn.Fp8Dense(8, recipe=RECIPE)
  variables = model.init(jax.random.key(1), x)
  y = model.apply(variables, x)  # fp8_meta not mutable: inference with stored scales
  want, _ = fp8jax.fp8_dense(x, variables["params"]["kernel"], variables["params"]["bias"],
                             variables["fp8_meta"]["dot_meta"])
  np.testing.assert_array_equal(np.asarray(y), np.asarray(want))


def test_linen_dense_with_fp8_dot_general_cls_matches_fp8_dense():
  x = _inputs()
  model = nn.Dense(8, dot_general_cls=functools.partial(fp8nn.Fp8DotGeneral, recipe=RECIPE))
  variables = model.init(jax.random.key(1), x)
  y, updates = model.apply(variables, x, mutable=["fp8_meta"])
  meta = fp8jax.begin_step(fp8jax.init_dot_meta(RECIPE))
  state = {"fp8_meta": jax.tree.map(lambda m: m, variables["fp8_meta"])}
  state["fp8_meta"]["Fp8DotGeneral_0"]["dot_meta"] = meta
  y, updates = model.apply({**variables, **state}, x, mutable=["fp8_meta"])
  want, want_meta = fp8jax.fp8_dense(x, variables["params"]["kernel"], variables["params"]["bias"], meta)
  np.testing.assert_array_equal(np.asarray(y), np.asarray(want))
  assert_trees_equal(updates["fp8_meta"]["Fp8DotGeneral_0"]["dot_meta"], want_meta)


def test_linen_dense_general_and_einsum_match_pure_functions():
  x = _inputs((2, 5, 4, 8))
  meta = fp8jax.begin_step(fp8jax.init_dot_meta(RECIPE))
  general = fp8nn.Fp8DenseGeneral((6, 3), axis=(-2, -1), recipe=RECIPE, use_bias=False)
  v = general.init(jax.random.key(0), x)
  y, upd = general.apply({"params": v["params"], "fp8_meta": {"dot_meta": meta}}, x,
                         mutable=["fp8_meta"])
  want, want_meta = fp8jax.fp8_dot_general(x, v["params"]["kernel"], meta, (((2, 3), (0, 1)), ((), ())))
  assert y.shape == (2, 5, 6, 3)
  np.testing.assert_array_equal(np.asarray(y), np.asarray(want))
  assert_trees_equal(upd["fp8_meta"]["dot_meta"], want_meta)

  einsum = fp8nn.Fp8Einsum((4, 8, 12), "bshk,hkd->bsd", recipe=RECIPE)
  v = einsum.init(jax.random.key(0), x)
  y, upd = einsum.apply({"params": v["params"], "fp8_meta": {"dot_meta": meta}}, x,
                        mutable=["fp8_meta"])
  want, want_meta = fp8jax.fp8_einsum("bshk,hkd->bsd", x, v["params"]["kernel"], meta)
  np.testing.assert_array_equal(np.asarray(y), np.asarray(want))
  assert_trees_equal(upd["fp8_meta"]["dot_meta"], want_meta)


class _Layer(nn.Module):
  @nn.compact
  def __call__(self, h, _):
    return jnp.tanh(fp8nn.Fp8Dense(16, use_bias=False, recipe=SCAN_RECIPE)(h)), None


SCAN_RECIPE = fp8jax.DelayedScaling(amax_history_len=16)


@pytest.mark.parametrize("shared", [False, True], ids=["per-layer", "shared"])
def test_linen_scan_over_layers_matches_pure_scan(shared):
  def net(scan_kwargs):
    stack = nn.scan(_Layer, split_rngs={"params": True}, length=4, **scan_kwargs)

    class Net(nn.Module):
      @nn.compact
      def __call__(self, x):
        return stack()(x, None)[0]
    return Net()

  per_layer = net(dict(variable_axes={"params": 0, "fp8_meta": 0}))
  x = _inputs((8, 16))
  variables = per_layer.init(jax.random.key(0), x)
  if shared:
    model = net(dict(variable_axes={"params": 0}, variable_carry="fp8_meta"))
    variables = {"params": variables["params"],
                 "fp8_meta": fp8jax.merge_stacked_metas(variables["fp8_meta"])}
  else:
    model = per_layer
  target = _inputs((8, 16), seed=3)
  loss, grads, state = _linen_step(model, variables, x, target)

  kernels = variables["params"]["Scan_Layer_0"]["Fp8Dense_0"]["kernel"]
  meta0 = variables["fp8_meta"]["Scan_Layer_0"]["Fp8Dense_0"]["dot_meta"]

  def pure_loss(kernels, meta, x):
    def layer(carry, inputs):
      if shared:
        h, meta = carry
        y, meta = fp8jax.fp8_dense(h, inputs, None, meta)
        return (jnp.tanh(y), meta), None
      kernel, meta = inputs
      y, meta = fp8jax.fp8_dense(carry, kernel, None, meta)
      return jnp.tanh(y), meta
    if shared:
      (h, meta), _ = jax.lax.scan(layer, (x, meta), kernels)
    else:
      h, meta = jax.lax.scan(layer, x, (kernels, meta))
    return jnp.sum(h * target), meta

  want_loss, want_grads, want_state = jax.jit(fp8jax.value_and_grad(pure_loss))(kernels, meta0, x)
  assert float(loss) == float(want_loss)
  np.testing.assert_array_equal(np.asarray(grads["Scan_Layer_0"]["Fp8Dense_0"]["kernel"]),
                                np.asarray(want_grads))
  assert_trees_equal(state["Scan_Layer_0"]["Fp8Dense_0"]["dot_meta"], want_state)
  assert want_state.x.amax_history.shape == ((16,) if shared else (4, 16))


def test_linen_remat_gives_same_loss_grads_and_state():
  x = _inputs()
  target = _inputs((3, 5, 8), seed=4)
  plain = fp8nn.Fp8Dense(8, recipe=RECIPE)
  rematted = nn.remat(fp8nn.Fp8Dense)(8, recipe=RECIPE)
  variables = plain.init(jax.random.key(1), x)
  (loss, grads, state), (r_loss, r_grads, r_state) = (
      _linen_step(plain, variables, x, target), _linen_step(rematted, variables, x, target))
  assert_trees_equal(state, r_state)  # amaxes and scales: bit-identical
  # Recomputation lets XLA reorder float32 reductions (the bias gradient's sum):
  # a few ulps (2**-23 relative each) at most.
  np.testing.assert_allclose(float(r_loss), float(loss), rtol=1e-6)
  for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(r_grads)):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-6, atol=1e-6)


def test_linen_recipe_mismatch_with_stored_state_is_explained():
  x = _inputs()
  variables = fp8nn.Fp8Dense(8, recipe=RECIPE).init(jax.random.key(1), x)
  other = fp8nn.Fp8Dense(8, recipe=fp8jax.CurrentScaling())
  with pytest.raises(ValueError, match="state was made for recipe"):
    other.apply(variables, x)


def _nnx_step(model, x, target):
  graphdef, params, fp8_state, rest = nnx.split(model, nnx.Param, fp8nnx.Fp8MetaVariable, ...)

  def loss_fn(params, fp8_state, x):
    m = nnx.merge(graphdef, params, fp8_state, rest)
    return jnp.sum(m(x) * target), nnx.state(m, fp8nnx.Fp8MetaVariable)

  return jax.jit(fp8jax.value_and_grad(loss_fn))(params, fp8_state, x), params, fp8_state


def test_nnx_fp8_linear_matches_pure_function_and_splits_out_its_state():
  x = _inputs()
  target = _inputs((3, 5, 8), seed=2)
  model = fp8nnx.Fp8Linear(16, 8, recipe=RECIPE, bias_init=nnx.initializers.normal(1.0),
                           rngs=nnx.Rngs(0))
  (loss, grads, state), params, fp8_state = _nnx_step(model, x, target)
  # The optimizer's tree (nnx.Param) holds no FP8 state.
  assert [leaf.shape for leaf in jax.tree.leaves(params)] == [(8,), (16, 8)]
  assert len(jax.tree.leaves(fp8_state)) == 12  # 3 roles x (scale, scale_inv, history, amax)

  want_loss, want_grads, want_state = _pure_dense_step(
      {"kernel": model.kernel.get_value(), "bias": model.bias.get_value()}, x, target)
  assert float(loss) == float(want_loss)
  np.testing.assert_array_equal(np.asarray(grads["kernel"].get_value()), np.asarray(want_grads["kernel"]))
  assert_trees_equal(state["fp8_meta"].get_value(), want_state)


def test_nnx_scan_and_remat_over_layers_match_pure_scan():
  @nnx.split_rngs(splits=4)
  @nnx.vmap(in_axes=(0,), out_axes=0)
  def make_layers(rngs):
    return fp8nnx.Fp8Linear(16, 16, use_bias=False, recipe=RECIPE, rngs=rngs)

  class Stack(nnx.Module):
    def __init__(self):
      self.layers = make_layers(nnx.Rngs(0))

    def __call__(self, x):
      @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
      @nnx.remat
      def body(h, layer):
        return jnp.tanh(layer(h))
      return body(x, self.layers)

  model = Stack()
  x, target = _inputs((8, 16)), _inputs((8, 16), seed=5)
  kernels = model.layers.kernel.get_value()
  metas = model.layers.fp8_meta.get_value()
  (loss, grads, state), _, _ = _nnx_step(model, x, target)

  def pure_loss(kernels, metas, x):
    def layer(h, inputs):
      y, meta = fp8jax.fp8_dense(h, inputs[0], None, inputs[1])
      return jnp.tanh(y), meta
    h, metas = jax.lax.scan(layer, x, (kernels, metas))
    return jnp.sum(h * target), metas
  want_loss, want_grads, want_state = jax.jit(fp8jax.value_and_grad(pure_loss))(kernels, metas, x)
  assert float(loss) == float(want_loss)
  assert_trees_equal(state["layers"]["fp8_meta"].get_value(), want_state)
  # Four layers, four separate histories, each advanced by one entry.
  assert state["layers"]["fp8_meta"].get_value().x.amax_history.shape == (4, 4)


def test_nnx_eval_mode_uses_stored_scales_and_records_nothing():
  model = fp8nnx.Fp8Linear(16, 8, recipe=RECIPE, rngs=nnx.Rngs(0))
  x, target = _inputs(), _inputs((3, 5, 8), seed=2)
  (_, _, state), params, _ = _nnx_step(model, x, target)
  nnx.update(model, state)
  before = jax.tree.map(jnp.array, nnx.state(model, fp8nnx.Fp8MetaVariable))  # a copy
  model.eval()
  y = model(100 * x)  # an out-of-step call with much larger inputs
  after = nnx.state(model, fp8nnx.Fp8MetaVariable)
  assert_trees_equal(after, before)
  meta = before["fp8_meta"].get_value()
  want, _ = fp8jax.fp8_dense(100 * x, model.kernel.get_value(), model.bias.get_value(), meta)
  np.testing.assert_array_equal(np.asarray(y), np.asarray(want))  # the stored scales were used
  model.train()
  model(x)
  assert float(model.fp8_meta.get_value().x.amax_history[0]) == float(jnp.max(jnp.abs(x)))


def test_linen_einsum_with_bias_explains_a_malformed_spec():
  with pytest.raises(ValueError, match="explicit two-operand form"):
    fp8nn.Fp8Einsum((8, 4), "ab,bc", use_bias=True, recipe=RECIPE).init(
        jax.random.key(0), jnp.ones((2, 8)))
