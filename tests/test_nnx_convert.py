"""An existing nnx model's dense layers become FP8 layers in place (fp8jax.flax.convert).

References: the model before conversion (parameters bit for bit, outputs), fp8jax's
pure functions applied by hand (exact outputs), numpy's max |kernel| (recorded
amaxes), and nnx.LinearGeneral itself (Fp8LinearGeneral's initialization).
"""
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import fp8jax
from fp8jax.flax.convert import convert_to_fp8
from fp8jax.flax.layer_filter import BREAK_EVEN_SIZE
from fp8jax.lowering.break_even import layer_times
from fp8jax.flax.nnx import Fp8Einsum, Fp8Linear, Fp8LinearGeneral, Fp8MetaVariable

RECIPE = fp8jax.DelayedScaling(amax_history_len=4)
FEATURES, HEADS, HEAD_DIM, HIDDEN = 64, 4, 16, 128
X_SHAPE = (2, 8, FEATURES)


class Net(nnx.Module):
  """A small transformer-like block written without fp8jax: layers in attributes, an
  nnx.Dict, an nnx.List, a plain list, and one layer held twice (tied)."""

  def __init__(self, rngs):
    self.attn = nnx.Dict({
        "qkv": nnx.LinearGeneral(FEATURES, (3, HEADS, HEAD_DIM), rngs=rngs),
        "out": nnx.LinearGeneral((HEADS, HEAD_DIM), FEATURES, axis=(-2, -1), rngs=rngs)})
    self.mlp = nnx.List([nnx.Linear(FEATURES, HIDDEN, rngs=rngs),
                         nnx.Einsum("bsf,fd->bsd", (HIDDEN, FEATURES), rngs=rngs)])
    self.extra = nnx.data([nnx.Linear(FEATURES, FEATURES, rngs=rngs)])
    self.head = nnx.Linear(FEATURES, 16, rngs=rngs)
    self.head_again = self.extra[0]

  def __call__(self, x):
    qkv = self.attn["qkv"](x)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    weights = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k) / HEAD_DIM**0.5)
    x = x + self.attn["out"](jnp.einsum("bhqk,bkhd->bqhd", weights, v))
    x = x + self.mlp[1](jax.nn.gelu(self.mlp[0](x)))
    x = self.head_again(self.extra[0](x))
    return self.head(x)


NOT_HEAD = lambda layer: layer.path[-1] != "head"
CHOSEN = {("attn", "qkv"), ("attn", "out"), ("mlp", 0), ("mlp", 1), ("extra", 0)}


def _normal(shape, seed):
  return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


def _meta_paths(fp8_state):
  return {path[:-1] for path, _ in nnx.to_flat_state(fp8_state)}


def _rel_error(y, want):
  y, want = np.asarray(y, np.float64), np.asarray(want, np.float64)
  return np.linalg.norm(y - want) / np.linalg.norm(want)


def assert_states_equal(a, b):
  a, b = dict(nnx.to_flat_state(a)), dict(nnx.to_flat_state(b))
  assert a.keys() == b.keys()
  for path in a:
    np.testing.assert_array_equal(np.asarray(a[path].get_value()),
                                  np.asarray(b[path].get_value()), err_msg=str(path))


def _train_step(model, x, target):
  graphdef, params, fp8_state = nnx.split(model, nnx.Param, Fp8MetaVariable)

  def loss_fn(params, fp8_state, x):
    model = nnx.merge(graphdef, params, fp8_state)
    return jnp.mean((model(x) - target) ** 2), nnx.state(model, Fp8MetaVariable)

  return jax.jit(fp8jax.value_and_grad(loss_fn))(params, fp8_state, x)


def test_chosen_layers_become_fp8_layers_that_keep_the_same_param_objects():
  model = Net(nnx.Rngs(0))
  before = nnx.state(model, nnx.Param)
  old = {"qkv": model.attn["qkv"], "up": model.mlp[0], "down": model.mlp[1]}
  paths = convert_to_fp8(model, layer_filter=NOT_HEAD, recipe=RECIPE)
  assert set(paths) == CHOSEN and len(paths) == len(CHOSEN)
  assert isinstance(model.attn["qkv"], Fp8LinearGeneral)
  assert isinstance(model.attn["out"], Fp8LinearGeneral)
  assert isinstance(model.mlp[0], Fp8Linear) and isinstance(model.mlp[1], Fp8Einsum)
  assert isinstance(model.extra[0], Fp8Linear) and type(model.head) is nnx.Linear
  assert model.attn["qkv"].kernel is old["qkv"].kernel and model.mlp[0].bias is old["up"].bias
  assert model.mlp[1].kernel is old["down"].kernel
  assert_states_equal(nnx.state(model, nnx.Param), before)  # same paths, bit for bit


def test_a_layer_held_twice_becomes_one_fp8_layer_in_both_places():
  model = Net(nnx.Rngs(0))
  convert_to_fp8(model, layer_filter=NOT_HEAD, recipe=RECIPE)
  assert isinstance(model.head_again, Fp8Linear) and model.head_again is model.extra[0]


def test_split_gives_fp8_state_for_exactly_the_chosen_layers():
  model = Net(nnx.Rngs(0))
  convert_to_fp8(model, layer_filter=NOT_HEAD, recipe=RECIPE)
  _, params, fp8_state = nnx.split(model, nnx.Param, Fp8MetaVariable)
  assert _meta_paths(fp8_state) == CHOSEN
  assert_states_equal(params, nnx.state(Net(nnx.Rngs(0)), nnx.Param))


def test_a_train_step_records_amaxes_and_outputs_stay_close_to_the_unconverted_model():
  x, target = _normal(X_SHAPE, 0), _normal(X_SHAPE[:2] + (16,), 2)
  reference = Net(nnx.Rngs(0))
  want = reference(x)
  model = Net(nnx.Rngs(0))
  convert_to_fp8(model, layer_filter=NOT_HEAD, recipe=RECIPE)
  loss, grads, fp8_state = _train_step(model, x, target)
  assert jax.tree.structure(grads) == jax.tree.structure(nnx.state(model, nnx.Param))
  flat = dict(nnx.to_flat_state(fp8_state))
  for path in CHOSEN:
    meta = flat[path + ("fp8_meta",)].get_value()
    kernel = np.asarray(nnx.to_pure_dict(nnx.state(model, nnx.Param))[path[0]][path[1]]["kernel"])
    assert float(meta.kernel.amax_history[0]) == np.max(np.abs(kernel)), path
    assert float(meta.x.amax_history[0]) > 0 and float(meta.grad.amax_history[0]) > 0, path
  nnx.update(model, fp8_state)
  model.eval()  # the stored (now calibrated) scales; nothing recorded
  # As in tests/test_flax_intercept.py: each FP8 GEMM errs by ~ sqrt(2) * 2^-4/sqrt(3) ~
  # 0.05 (E4M3's rms rounding on both operands); 6 FP8 GEMMs (extra[0] runs twice) in
  # quadrature ~ 0.12 < 2^-3 (seen: ~0.063).
  error = _rel_error(model(x), want)
  assert 2**-9 < error < 2**-3, error  # above bf16's rounding: the GEMMs really ran in FP8


def test_converted_layers_compute_exactly_what_fp8jax_functions_compute():
  rngs = nnx.Rngs(0)
  general = nnx.LinearGeneral(32, (4, 8), batch_axis={0: 3}, rngs=rngs,
                              bias_init=nnx.initializers.normal(1.0))
  einsum = nnx.Einsum("abhk,hkd->abd", (4, 8, 16), rngs=rngs)

  class Pair(nnx.Module):
    def __init__(self):
      self.general, self.einsum = general, einsum

    def __call__(self, x):
      return self.einsum(self.general(x))

  model = Pair()
  convert_to_fp8(model, layer_filter=lambda layer: True, recipe=RECIPE)
  x = _normal((3, 5, 32), 1)
  y = model(x)
  meta = fp8jax.init_dot_meta(RECIPE)
  h, _ = fp8jax.fp8_dot_general(x, general.kernel.get_value(), meta,
                                (((2,), (1,)), ((0,), (0,))))
  h = h + general.bias.get_value()[:, None]  # bias [3, 4, 8] along x's batch axis 0
  want, _ = fp8jax.fp8_einsum("abhk,hkd->abd", h, einsum.kernel.get_value(), meta)
  np.testing.assert_array_equal(np.asarray(y), np.asarray(want))


def test_fp8_linear_general_is_initialized_like_nnx_linear_general():
  kwargs = dict(axis=(-2, -1), batch_axis={0: 3}, bias_init=nnx.initializers.normal(1.0))
  ours = Fp8LinearGeneral((4, 8), (2, 16), rngs=nnx.Rngs(5), **kwargs)
  theirs = nnx.LinearGeneral((4, 8), (2, 16), rngs=nnx.Rngs(5), **kwargs)
  for name in ("kernel", "bias"):
    np.testing.assert_array_equal(np.asarray(getattr(ours, name).get_value()),
                                  np.asarray(getattr(theirs, name).get_value()))


def test_default_filter_converts_a_layer_at_the_break_even_size_and_not_a_smaller_one():
  n = BREAK_EVEN_SIZE

  class TwoLayers(nnx.Module):
    def __init__(self, rngs):
      # K = N = n: FP8 pays at 4096 tokens. K = n, N = n - 16: predicted just slower.
      self.big = nnx.Linear(n, n, rngs=rngs)
      self.small = nnx.Linear(n, n - 16, rngs=rngs)

  model = TwoLayers(nnx.Rngs(0))
  report = convert_to_fp8(model, report=True)
  assert tuple(row.path for row in report.converted) == (("big",),)
  assert isinstance(model.big, Fp8Linear) and type(model.small) is nnx.Linear
  # The report names each layer's GEMMs in FP8 and the cost model's times at 4096 tokens.
  big, small = report.rows
  assert (big.fp8_gemms, small.fp8_gemms) == (("fprop", "dgrad", "wgrad"), ())
  assert big.predicted == layer_times(4096, n, n)
  assert small.predicted == layer_times(4096, n, n - 16)
  assert big.reason.startswith(f"default_layer_filter: chosen (K={n}, N={n}: ")
  assert small.reason.startswith(f"default_layer_filter: not chosen (K={n}, N={n - 16}: ")


def test_a_chosen_layer_that_cannot_become_fp8_stays_with_a_warning():
  def own_dot(lhs, rhs, dims, precision=None, **kwargs):
    return jax.lax.dot_general(lhs, rhs, dims, precision=precision)

  class Odd(nnx.Module):
    def __init__(self, rngs):
      self.own_dot = nnx.Linear(32, 32, dot_general=own_dot, rngs=rngs)
      self.preferred = nnx.Linear(32, 32, preferred_element_type=jnp.float32, rngs=rngs)
      self.biased = nnx.Einsum("bf,fd->bd", (32, 32), (32,), rngs=rngs)
      self.ellipsis = nnx.Einsum("...f,fd->...d", (32, 32), rngs=rngs)
      self.in_tuple = nnx.data((nnx.Linear(32, 32, rngs=rngs),))

  model = Odd(nnx.Rngs(0))
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    assert convert_to_fp8(model, layer_filter=lambda layer: True) == ()
  messages = "\n".join(str(w.message) for w in caught)
  for path, reason in [("('own_dot',)", "its own dot_general"),
                       ("('preferred',)", "preferred_element_type=float32"),
                       ("('biased',)", "has a bias"),
                       ("('ellipsis',)", "without ellipsis"),
                       ("('in_tuple', 0)", "held in a tuple")]:
    assert path in messages and reason in messages, (path, messages)
  assert not nnx.state(model, Fp8MetaVariable)


@pytest.mark.parametrize("model, message", [
    (Net, "the class Net, not a module"),
    (nn.Dense(4), "Fp8Model"),
    ({"layer": 1}, "model must be a flax.nnx Module, got dict"),
])
def test_convert_rejects_what_is_not_an_nnx_module_instance(model, message):
  with pytest.raises(TypeError, match=message):
    convert_to_fp8(model)


def test_convert_rejects_a_filter_that_is_not_a_function():
  with pytest.raises(TypeError, match="layer_filter must be a function"):
    convert_to_fp8(Net(nnx.Rngs(0)), layer_filter=("attn", "qkv"))


def test_rules_give_two_recipes_to_two_parts_of_the_model_as_for_linen():
  model = Net(nnx.Rngs(0))
  rules = (fp8jax.flax.Fp8Rule(path="attn/.*", recipe=fp8jax.CurrentScaling()),
           fp8jax.flax.Fp8Rule(path="mlp/.*", op="Linear", recipe=fp8jax.BlockScaling()),
           fp8jax.flax.Fp8Rule(path="head", recipe=None))
  paths = convert_to_fp8(model, rules=rules, layer_filter=lambda layer: True, recipe=RECIPE)
  assert set(paths) == CHOSEN  # the head by rules[2]; mlp/1 and extra/0 by the filter
  assert model.attn["qkv"].fp8_meta.get_value().recipe == fp8jax.CurrentScaling()
  assert model.attn["out"].fp8_meta.get_value().recipe == fp8jax.CurrentScaling()
  assert model.mlp[0].fp8_meta.get_value().recipe == fp8jax.BlockScaling()
  assert model.mlp[1].fp8_meta.get_value().recipe == RECIPE  # an Einsum: not rules[1]'s op
  assert isinstance(model.head, nnx.Linear) and not isinstance(model.head, Fp8Linear)
  loss, _, _ = _train_step(model, _normal(X_SHAPE, 0), _normal(X_SHAPE[:2] + (16,), 1))
  assert np.isfinite(loss)


def test_converting_no_layer_at_all_is_said():
  with pytest.warns(UserWarning, match=r"convert_to_fp8 runs none of the model.s 6 candidate "
                                       r"dots.*"
                                       r"default_layer_filter: not chosen \(K=64"):
    assert convert_to_fp8(Net(nnx.Rngs(0))) == ()
