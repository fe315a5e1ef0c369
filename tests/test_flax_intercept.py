"""An unmodified linen model runs with FP8 dense layers through `Fp8Model` (fp8jax.flax.intercept).

The model below is plain Flax (nn.Dense, nn.DenseGeneral, nn.Einsum). The
references are the same model without FP8 (parameters, outputs), fp8jax's pure
functions applied by hand (exact outputs and state), and max|kernel| / max|x|
computed with numpy (the recorded amaxes).
"""
import json
import math
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx, serialization

import fp8jax
from fp8jax.deviceless import deviceless_toolchain_missing
from fp8jax.flax.intercept import Fp8Model, fp8_dense_layers
from fp8jax.flax.layer_filter import BREAK_EVEN_SIZE
from fp8jax.lowering.break_even import layer_times

RECIPE = fp8jax.DelayedScaling(amax_history_len=4)
FEATURES, HEADS, HEAD_DIM, HIDDEN = 64, 4, 16, 128
X_SHAPE = (2, 8, FEATURES)


class Attention(nn.Module):
  @nn.compact
  def __call__(self, x):
    project = lambda name: nn.DenseGeneral((HEADS, HEAD_DIM), name=name)(x)
    q, k, v = project("query"), project("key"), project("value")
    weights = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(HEAD_DIM))
    out = jnp.einsum("bhqk,bkhd->bqhd", weights, v)
    return nn.DenseGeneral(x.shape[-1], axis=(-2, -1), name="out")(out)


class Net(nn.Module):
  """A small transformer-like block written without fp8jax."""

  @nn.compact
  def __call__(self, x):
    x = x + Attention(name="attn")(x)
    h = nn.gelu(nn.Dense(HIDDEN, name="up")(x))
    x = x + nn.Einsum((HIDDEN, FEATURES), "bsf,fd->bsd", name="down")(h)
    return nn.Dense(16, name="head")(x)


NOT_HEAD = lambda layer: layer.path[-1] != "head"
CHOSEN = {("attn", "query"), ("attn", "key"), ("attn", "value"), ("attn", "out"), ("up",),
          ("down",)}


def _normal(shape, seed):
  return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


def _meta_paths(fp8_state):
  """The module paths that hold a "dot_meta"."""
  paths = set()
  for path, _ in jax.tree_util.tree_flatten_with_path(
      fp8_state, is_leaf=lambda v: isinstance(v, fp8jax.DotMeta))[0]:
    keys = tuple(k.key for k in path)
    assert keys[-1] == "dot_meta"
    paths.add(keys[:-1])
  return paths


def _by_path(tree, path):
  for key in path:
    tree = tree[key]
  return tree


def assert_trees_equal(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _train_step(fp8_model, variables, x, target):
  def loss_fn(params, fp8_state, x):
    out, updates = fp8_model.apply({"params": params, "fp8_meta": fp8_state}, x,
                                   mutable=["fp8_meta"])
    return jnp.mean((out - target) ** 2), updates["fp8_meta"]
  return jax.jit(fp8jax.value_and_grad(loss_fn))(variables["params"], variables["fp8_meta"], x)


def test_params_are_those_of_the_unmodified_model_and_state_is_at_the_chosen_layers():
  x = _normal(X_SHAPE, 0)
  plain = Net().init(jax.random.key(1), x)
  variables = Fp8Model(Net(), layer_filter=NOT_HEAD, recipe=RECIPE).init(jax.random.key(1), x)
  assert set(variables) == {"params", "fp8_meta"}
  assert_trees_equal(variables["params"], plain["params"])  # same keys, shapes and values
  assert _meta_paths(variables["fp8_meta"]) == CHOSEN
  for path in CHOSEN:  # fresh state: init does not record the init pass
    assert_trees_equal(_by_path(variables["fp8_meta"], path)["dot_meta"],
                       fp8jax.init_dot_meta(RECIPE))


def test_filter_sees_each_layers_path_kind_and_shapes():
  x = _normal(X_SHAPE, 0)
  seen = {}

  def record(layer):
    seen[layer.path] = layer
    return True

  params = Fp8Model(Net(), layer_filter=record).init(jax.random.key(1), x)["params"]
  assert set(seen) == CHOSEN | {("head",)}
  for path, layer in seen.items():
    assert layer.kernel_shape == _by_path(params, path)["kernel"].shape, path
  want = {("attn", "query"): ("DenseGeneral", (FEATURES,), (HEADS, HEAD_DIM), X_SHAPE),
          ("attn", "out"): ("DenseGeneral", (HEADS, HEAD_DIM), (FEATURES,),
                            X_SHAPE[:2] + (HEADS, HEAD_DIM)),
          ("up",): ("Dense", (FEATURES,), (HIDDEN,), X_SHAPE),
          ("down",): ("Einsum", (HIDDEN,), (FEATURES,), X_SHAPE[:2] + (HIDDEN,))}
  for path, (kind, in_features, out_features, input_shape) in want.items():
    layer = seen[path]
    assert (layer.kind, layer.in_features, layer.out_features, layer.input_shape) == (
        kind, in_features, out_features, input_shape), layer


def test_a_train_step_records_the_amaxes_of_exactly_the_chosen_layers():
  x, target = _normal(X_SHAPE, 0), _normal(X_SHAPE[:2] + (16,), 2)
  fp8_model = Fp8Model(Net(), layer_filter=NOT_HEAD, recipe=RECIPE)
  variables = fp8_model.init(jax.random.key(1), x)
  loss, grads, state = _train_step(fp8_model, variables, x, target)
  assert jax.tree.structure(grads) == jax.tree.structure(variables["params"])
  assert _meta_paths(state) == CHOSEN
  for path in CHOSEN:
    meta = _by_path(state, path)["dot_meta"]
    kernel = np.asarray(_by_path(variables["params"], path)["kernel"])
    # History slot 0 holds this step's amax: the kernel's max |value| exactly.
    assert float(meta.kernel.amax_history[0]) == np.max(np.abs(kernel)), path
    assert float(meta.x.amax_history[0]) > 0 and float(meta.grad.amax_history[0]) > 0, path
  for path in [("attn", "query"), ("attn", "key"), ("attn", "value")]:  # they read x itself
    meta = _by_path(state, path)["dot_meta"]
    assert float(meta.x.amax_history[0]) == np.max(np.abs(np.asarray(x))), path


def _rel_error(y, want):
  y, want = np.asarray(y, np.float64), np.asarray(want, np.float64)
  return np.linalg.norm(y - want) / np.linalg.norm(want)


def test_outputs_and_gradients_are_close_to_the_high_precision_model():
  x, target = _normal(X_SHAPE, 0), _normal(X_SHAPE[:2] + (16,), 2)
  fp8_model = Fp8Model(Net(), layer_filter=NOT_HEAD, recipe=RECIPE)
  variables = fp8_model.init(jax.random.key(1), x)
  _, grads, state = _train_step(fp8_model, variables, x, target)
  # After one step the scales come from this data's amaxes: E4M3's full range is used.
  y = fp8_model.apply({"params": variables["params"], "fp8_meta": state}, x)
  want = Net().apply({"params": variables["params"]}, x)  # float32, no FP8
  want_grads = jax.grad(lambda p: jnp.mean((Net().apply({"params": p}, x) - target) ** 2))(
      variables["params"])
  # E4M3 keeps 3 mantissa bits: rounding errs by at most 2^-4 relative, about 2^-4/sqrt(3)
  # rms. A GEMM of two rounded operands then errs by about sqrt(2) * 2^-4/sqrt(3) ~ 0.05
  # (norm-wise, random data), and independent errors of the 6 FP8 GEMMs add in quadrature:
  # ~ sqrt(6) * 0.05 ~ 0.12 at most (the residual paths only dilute it); seen: ~0.046.
  error = _rel_error(y, want)
  assert 2**-9 < error < 2**-3, error  # above bf16's rounding: the GEMMs really ran in FP8
  # Output gradients are E5M2 (2 mantissa bits: ~2^-3/sqrt(3) ~ 0.07 rms), so a dgrad or
  # wgrad GEMM errs by ~ sqrt(0.07^2 + 0.036^2) ~ 0.08, and the deepest kernel gradient
  # (query's) passes through 4 FP8 GEMMs: ~ sqrt(4) * 0.08 ~ 0.16 < 2^-2; seen: <= 0.135.
  for path in CHOSEN:
    grad_error = _rel_error(_by_path(grads, path)["kernel"], _by_path(want_grads, path)["kernel"])
    assert grad_error < 2**-2, (path, grad_error)


def test_chosen_layers_compute_exactly_what_fp8jax_functions_compute():
  # DenseGeneral with batch_dims and a bias; an Einsum with an ellipsis and a bias.
  class Layers(nn.Module):
    @nn.compact
    def __call__(self, x):
      h = nn.DenseGeneral((4, 8), axis=-1, batch_dims=(0,), name="general",
                          bias_init=nn.initializers.normal(1.0))(x)
      return nn.Einsum((4, 8, 16), "...hk,hkd->...d", name="einsum",
                       bias_init=nn.initializers.normal(1.0))(h)

  x = _normal((3, 5, 32), 0)
  fp8_model = Fp8Model(Layers(), layer_filter=lambda layer: True, recipe=RECIPE)
  variables = fp8_model.init(jax.random.key(1), x)
  state = jax.tree.map(fp8jax.begin_step, variables["fp8_meta"],
                       is_leaf=lambda v: isinstance(v, fp8jax.DotMeta))
  y, updates = fp8_model.apply({"params": variables["params"], "fp8_meta": state}, x,
                               mutable=["fp8_meta"])

  p = variables["params"]
  h, meta_general = fp8jax.fp8_dot_general(
      x, p["general"]["kernel"], state["general"]["dot_meta"], (((2,), (1,)), ((0,), (0,))))
  h = h + p["general"]["bias"][:, None, :, :]  # bias [3, 4, 8] along x's batch dim 0
  want, meta_einsum = fp8jax.fp8_einsum("abhk,hkd->abd", h, p["einsum"]["kernel"],
                                        state["einsum"]["dot_meta"])
  want = want + p["einsum"]["bias"]
  np.testing.assert_array_equal(np.asarray(y), np.asarray(want))
  assert_trees_equal(updates["fp8_meta"]["general"]["dot_meta"], meta_general)
  assert_trees_equal(updates["fp8_meta"]["einsum"]["dot_meta"], meta_einsum)


def test_dtype_and_use_bias_of_the_layer_are_respected():
  x = _normal((4, 32), 0).astype(jnp.bfloat16)
  model = nn.Dense(48, use_bias=False, dtype=jnp.float32, param_dtype=jnp.bfloat16)
  fp8_model = Fp8Model(model, layer_filter=lambda layer: True, recipe=RECIPE)
  variables = fp8_model.init(jax.random.key(1), x)
  assert_trees_equal(variables["params"], model.init(jax.random.key(1), x)["params"])
  y = fp8_model.apply(variables, x)
  kernel = variables["params"]["kernel"]
  want, _ = fp8jax.fp8_dense(x.astype(jnp.float32), kernel.astype(jnp.float32), None,
                             variables["fp8_meta"]["dot_meta"])
  assert y.dtype == jnp.float32
  np.testing.assert_array_equal(np.asarray(y), np.asarray(want))


def test_a_checkpoint_trained_without_fp8_loads_into_the_fp8_model():
  x, target = _normal(X_SHAPE, 0), _normal(X_SHAPE[:2] + (16,), 2)
  # "Trained" without FP8: one SGD step of the plain model, parameters saved as bytes.
  params = Net().init(jax.random.key(7), x)["params"]
  grads = jax.grad(lambda p: jnp.mean((Net().apply({"params": p}, x) - target) ** 2))(params)
  params = jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)
  saved = serialization.to_bytes(params)

  fp8_model = Fp8Model(Net(), layer_filter=NOT_HEAD, recipe=RECIPE)
  variables = fp8_model.init(jax.random.key(1), x)  # other values, same tree
  restored = serialization.from_bytes(variables["params"], saved)
  assert_trees_equal(restored, params)
  _, _, state = _train_step(fp8_model, {"params": restored, "fp8_meta": variables["fp8_meta"]},
                            x, target)
  y = fp8_model.apply({"params": restored, "fp8_meta": state}, x)
  # The same bound as in test_outputs_and_gradients_are_close_to_the_high_precision_model.
  assert _rel_error(y, Net().apply({"params": params}, x)) < 2**-3


class TwoLayers(nn.Module):
  """K = N = BREAK_EVEN_SIZE, converted by the default filter; then K = n, N = n - 16, not."""

  @nn.compact
  def __call__(self, x):
    n, dtype = BREAK_EVEN_SIZE, jnp.bfloat16  # dtype: bf16 GEMMs where not FP8
    return nn.Dense(n - 16, dtype=dtype, name="small")(nn.Dense(n, dtype=dtype, name="big")(x))


def test_default_filter_converts_a_layer_at_the_break_even_size_and_not_a_smaller_one():
  x = _normal((1, BREAK_EVEN_SIZE), 0)
  variables = Fp8Model(TwoLayers()).init(jax.random.key(1), x)
  assert _meta_paths(variables["fp8_meta"]) == {("big",)}


def test_the_report_names_each_layers_fp8_gemms_and_the_predicted_times_that_chose_them():
  n = BREAK_EVEN_SIZE
  report = Fp8Model(TwoLayers()).report(jax.random.key(1), _normal((1, n), 0))
  big, small = report.rows
  assert (big.path, big.fp8_gemms, big.recipe) == (("big",), ("fprop", "dgrad", "wgrad"),
                                                   "DelayedScaling")
  assert (small.path, small.fp8_gemms, small.recipe) == (("small",), (), None)
  # The times are the cost model's at 4096 tokens, whatever batch init saw (1 row here).
  assert big.predicted == layer_times(4096, n, n)
  assert small.predicted == layer_times(4096, n, n - 16)
  assert big.predicted.fp8_pays and not small.predicted.fp8_pays
  assert big.reason.startswith(f"default_layer_filter: chosen (K={n}, N={n}: ")
  assert small.reason.startswith(f"default_layer_filter: not chosen (K={n}, N={n - 16}: ")
  assert small.reason.endswith("its casts cost more than its GEMMs save)")
  lines = str(report).splitlines()
  assert lines[0].split()[6:9] == ["FP8", "GEMMs", "in"]
  assert lines[1].split()[6:9] == ["DelayedScaling", "all", "3"]
  assert lines[2].split()[6:8] == ["-", "-"]
  row = json.loads(report.to_json())["dots"][0]
  assert row["fp8_gemms"] == ["fprop", "dgrad", "wgrad"]
  assert row["predicted"]["fp8_s"] == pytest.approx(big.predicted.fp8_s)


def test_a_rule_with_high_precision_gemms_is_reported_with_the_others_in_fp8():
  recipe = fp8jax.DelayedScaling(high_precision=("wgrad",))
  rules = (fp8jax.flax.Fp8Rule(path="big", recipe=recipe),)
  report = Fp8Model(TwoLayers(), rules=rules).report(jax.random.key(1),
                                                     _normal((1, BREAK_EVEN_SIZE), 0))
  assert report.rows[0].fp8_gemms == ("fprop", "dgrad")
  assert report.rows[0].predicted is None  # a rule decided, not the cost model
  assert str(report).splitlines()[1].split()[7] == "fprop+dgrad"


def test_a_chosen_layer_that_cannot_run_in_fp8_stays_in_high_precision_with_a_warning():
  def own_dot(lhs, rhs, dims, precision=None, preferred_element_type=None):
    return jax.lax.dot_general(lhs, rhs, dims, precision=precision)

  class Odd(nn.Module):
    @nn.compact
    def __call__(self, x):
      h = nn.Dense(32, dot_general=own_dot, name="own_dot")(x)
      h = nn.Einsum((32, 32), "bf,fd->bd", preferred_element_type=jnp.float32,
                    name="preferred")(h)
      return nn.Einsum((32, 8), "bf,fd->d", name="summed")(h)  # b summed over x only

  x = _normal((4, 32), 0)
  fp8_model = Fp8Model(Odd(), layer_filter=lambda layer: True, recipe=RECIPE)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    variables = fp8_model.init(jax.random.key(1), x)
  messages = "\n".join(str(w.message) for w in caught)
  for name, reason in [("own_dot", "its own dot_general"),
                       ("preferred", "preferred_element_type"),
                       ("summed", "summed over one operand only")]:
    assert f"('{name}',)" in messages and reason in messages, messages
  assert "fp8_meta" not in variables
  want = Odd().apply(variables, x)
  with pytest.warns(UserWarning, match="stays in high precision"):
    y = fp8_model.apply(variables, x)
  np.testing.assert_array_equal(np.asarray(y), np.asarray(want))


def test_context_manager_keys_the_state_by_the_full_path_inside_an_outer_module():
  class Outer(nn.Module):
    @nn.compact
    def __call__(self, x):
      return Net(name="backbone")(x)

  x = _normal(X_SHAPE, 0)
  with fp8_dense_layers(NOT_HEAD, RECIPE):
    variables = Outer().init(jax.random.key(1), x)
  assert _meta_paths(variables["fp8_meta"]) == {("backbone",) + path for path in CHOSEN}


def test_apply_without_the_fp8_state_of_a_chosen_layer_is_explained():
  x = _normal(X_SHAPE, 0)
  fp8_model = Fp8Model(Net(), layer_filter=NOT_HEAD)
  params = fp8_model.init(jax.random.key(1), x)["params"]
  with pytest.raises(ValueError, match=r"\('attn', 'query'\).*no 'fp8_meta' state"):
    fp8_model.apply({"params": params}, x)


@pytest.mark.parametrize("module, message", [
    (Net, "the class Net, not a module: pass an instance"),
    (nnx.Linear(4, 4, rngs=nnx.Rngs(0)), "convert_to_fp8"),
    ("Net", "module must be a flax.linen Module, got str"),
])
def test_fp8_model_rejects_what_is_not_a_linen_module_instance(module, message):
  with pytest.raises(TypeError, match=message):
    Fp8Model(module)


def test_fp8_model_rejects_a_filter_that_is_not_a_function_or_returns_no_bool():
  with pytest.raises(TypeError, match="layer_filter must be a function"):
    Fp8Model(Net(), layer_filter="head")
  with pytest.raises(TypeError, match="layer_filter returned str"):
    Fp8Model(Net(), layer_filter=lambda layer: "yes").init(jax.random.key(0),
                                                           _normal(X_SHAPE, 0))


_MISSING = deviceless_toolchain_missing()


def _h100_gemms(fp8_model, x, target):
  """The lowering report of an FP8 train step of `fp8_model`, compiled for an H100."""
  variables = jax.eval_shape(fp8_model.init, jax.random.key(1), x)

  def step(params, fp8_state, x, target):
    def loss_fn(params, fp8_state):
      out, updates = fp8_model.apply({"params": params, "fp8_meta": fp8_state}, x,
                                     mutable=["fp8_meta"])
      return jnp.mean((out.astype(jnp.float32) - target) ** 2), updates["fp8_meta"]
    return fp8jax.value_and_grad(loss_fn)(params, fp8_state)

  return fp8jax.lowering.inspect(step, variables["params"], variables["fp8_meta"], x, target,
                                 target="deviceless", ptx=False,
                                 compiler_options=fp8jax.lowering.CUBLAS_ONLY_OPTIONS)


@pytest.mark.hopper
@pytest.mark.skipif(_MISSING is not None, reason=str(_MISSING))
def test_on_h100_the_chosen_layers_gemms_are_fp8_and_the_others_are_not():
  x = jax.ShapeDtypeStruct(X_SHAPE, jnp.bfloat16)
  target = jax.ShapeDtypeStruct(X_SHAPE[:2] + (16,), jnp.bfloat16)
  report = _h100_gemms(Fp8Model(Net(), layer_filter=NOT_HEAD), x, target)
  # 6 chosen layers x (fprop, dgrad, wgrad), less the dgrads of query, key and value
  # (x is not differentiated). The head and the attention's two einsums stay high precision.
  assert report.num_fp8 == 6 * 3 - 3, str(report)
  assert len(report.not_fp8()) >= 3, str(report)


@pytest.mark.hopper
@pytest.mark.skipif(_MISSING is not None, reason=str(_MISSING))
def test_on_h100_the_default_filter_runs_the_chosen_layers_gemms_in_fp8_and_the_others_in_bf16():
  n = BREAK_EVEN_SIZE
  x = jax.ShapeDtypeStruct((16, n), jnp.bfloat16)
  target = jax.ShapeDtypeStruct((16, n - 16), jnp.bfloat16)
  report = _h100_gemms(Fp8Model(TwoLayers()), x, target)
  # "big" (K = N = n): its fprop and wgrad as cuBLASLt FP8 GEMMs (x is not differentiated,
  # so it has no dgrad). "small" (N = n - 16): its three GEMMs in bf16.
  fp8 = sorted(g.role for g in report.gemms if g.runs_in_fp8)
  assert fp8 == ["fprop", "wgrad"], str(report)
  assert all(g.kind == fp8jax.lowering.GemmKind.CUBLASLT_FP8 for g in report.gemms
             if g.runs_in_fp8), str(report)
  bf16 = report.not_fp8()
  assert len(bf16) == 3 and all(g.operand_dtypes == ("bf16", "bf16") for g in bf16), str(report)
