"""Converting an existing nnx model's dense layers (and its own dots) to FP8, in place.

`convert_to_fp8(model)` walks the model's graph and replaces every
`nnx.Linear`, `nnx.LinearGeneral` and `nnx.Einsum` that `layer_filter` chooses
by fp8jax's `Fp8Linear`, `Fp8LinearGeneral` or `Fp8Einsum`, on every parent that
holds it (module attributes, `nnx.List`, `nnx.Dict`, lists and dicts; a layer
held twice, e.g. tied, is replaced in both places by one FP8 layer). The FP8
layer takes over the old layer's `nnx.Param` objects, so parameter values (and
their sharding metadata) are unchanged, and gets a fresh `Fp8MetaVariable`:

    paths = convert_to_fp8(model)           # default_layer_filter, DelayedScaling()
    graphdef, params, fp8_state = nnx.split(model, nnx.Param, Fp8MetaVariable)

then train as in `fp8jax.flax.nnx`. `precision` is ignored (FP8 GEMMs
accumulate in float32). With `example_inputs`, the `lax.dot_general` /
`jnp.einsum` / `jnp.matmul` / `jnp.dot` calls of the model's own modules (a
GPT-2 Conv1D, attention products) are found by one abstract call and the chosen
ones run in FP8 too (`fp8jax.flax.nnx_dots`). Rules (`fp8jax.flax.rules`) pick
layers and dots as for linen's `Fp8Model`.

A chosen layer that cannot become an FP8 layer stays as it is, with a warning
that names it: one with its own `dot_general` / `dot_general_cls` / `einsum_op`
/ `promote_dtype`, or `preferred_element_type`; an `Einsum` with a bias, with an
ellipsis, or whose contraction is not a matrix product; a computation dtype that
is not bf16, f16, f32 or f64; a layer held in a tuple (which cannot be changed in
place: hold it in an `nnx.List` or an attribute). An `Einsum` whose equation
comes with each call (`einsum_str=None` at construction) has no K and N before a
call, so the filter leaves it; a rule that names it converts it, and `Fp8Einsum`
takes the equation at each call as `nnx.Einsum` does. Every FP8 layer accepts the
call arguments of the layer it replaces (`out_sharding` included).
"""
from __future__ import annotations

import dataclasses
import warnings
from typing import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

from fp8jax.ops.einsum import parse_two_operand_subscripts
from fp8jax.flax.layer_filter import LayerInfo, check_layer_filter, default_layer_filter
from fp8jax.flax.dot_report import DotRecord, Fp8Report, nothing_converted_message
from fp8jax.flax.dot_calls import init_call_meta
from fp8jax.flax.nnx_dots import convert_dots, find_dots, routable
from fp8jax.flax.rules import OP_KINDS, Fp8Rule, check_rules, decide
from fp8jax.flax.nnx import Fp8Einsum, Fp8Linear, Fp8LinearGeneral, Fp8MetaVariable
from fp8jax.core.meta import init_dot_meta
from fp8jax.core.recipes import DelayedScaling, Recipe, check_recipe


def convert_to_fp8(model: nnx.Module, *,
                   layer_filter: Callable[[LayerInfo], bool] = default_layer_filter,
                   recipe: Recipe = DelayedScaling(),
                   rules: tuple[Fp8Rule, ...] = (),
                   example_inputs: tuple | None = None,
                   report: bool = False) -> tuple[tuple, ...] | Fp8Report:
  """Replaces the chosen dense layers of `model` by FP8 layers, in place; with
  `example_inputs`, also runs the chosen dots its modules call themselves in FP8.

  Args:
    model: an `nnx.Module`; changed in place.
    layer_filter: `(LayerInfo) -> bool`, True for the layers no rule names that
      should run in FP8 (`LayerInfo.input_shape` is None: nothing has been called yet).
    recipe: the FP8 recipe of what a filter chooses.
    rules: `Fp8Rule`s, read in order; the first that names a layer or dot decides, with
      its own recipe (see `fp8jax.flax.rules`; the same rules as for linen's `Fp8Model`).
    example_inputs: the positional arguments of one call of `model` (arrays or
      `jax.ShapeDtypeStruct`s: only shapes and dtypes matter). The model is called with
      them abstractly to find the `lax.dot_general` / `jnp.einsum` / `jnp.matmul` /
      `jnp.dot` calls of its modules (`fp8jax.flax.nnx_dots`); those that no rule names
      go by `default_layer_filter`. None: dense layers only.
    report: return the `Fp8Report` of every candidate instead of the converted paths.

  Returns:
    The paths of the converted layers, in the order of `nnx.iter_graph`, then those of
    the converted dots (a module's path and the dot's name, e.g. ("attn", "einsum_0"));
    or, with `report=True`, the `Fp8Report`. Warns when the model has candidates but
    none was converted.
  """
  _check_nnx_module(model)
  check_layer_filter(layer_filter)
  check_recipe(recipe)
  rules = check_rules(rules)
  filter_name = "default_layer_filter" if layer_filter is default_layer_filter else "layer_filter"
  records = _convert_layers(model, layer_filter, recipe, rules, filter_name)
  if example_inputs is not None:
    records += _convert_dots(model, recipe, rules, tuple(example_inputs))
  result = Fp8Report(tuple(records))
  if result.rows and not result.converted:
    warnings.warn(nothing_converted_message(
        result, "convert_to_fp8", filter_passed=layer_filter is not default_layer_filter) +
        " convert_to_fp8(..., report=True) lists every candidate and why.", stacklevel=2)
  return result if report else tuple(row.path for row in result.converted)


def _convert_layers(model, layer_filter, recipe, rules, filter_name) -> list[DotRecord]:
  nodes = list(nnx.iter_graph(model))
  in_tuples = {id(child) for _, node in nodes if isinstance(node, tuple) for child in node}
  replacements, records = {}, []
  for path, node in nodes:
    plan = _plan(tuple(path), node)
    if plan is None:
      continue
    if plan.equation_at_call and not any(rule.names(plan.layer) for rule in rules):
      records.append(DotRecord.of(plan.layer, None, _EQUATION_AT_CALL))
      continue
    decision = decide(rules, plan.layer, layer_filter, recipe, filter_name)
    if decision.recipe is None:
      records.append(DotRecord.of(plan.layer, None, decision.reason, decision.predicted))
      continue
    blocker = plan.blocker
    if blocker is None and not path:
      blocker = "it is the model itself; build the FP8 layer directly (fp8jax.flax.nnx)"
    if blocker is None and id(node) in in_tuples:
      blocker = ("it is held in a tuple, which cannot be changed in place (hold it in an "
                 "nnx.List or an attribute)")
    if blocker is not None:
      records.append(_stays_high_precision(plan.layer, blocker))
      continue
    replacements[id(node)] = _fp8_layer(node, decision.recipe)
    records.append(DotRecord.of(plan.layer, decision.recipe, decision.reason,
                                decision.predicted))
  for _, node in nodes:
    _replace_children(node, replacements)
  return records


_EQUATION_AT_CALL = (
    "not chosen: its einsum_str comes with each call, so its K and N are unknown before a "
    "call; name it with an Fp8Rule to run it in FP8")


def _convert_dots(model, recipe, rules, example_inputs) -> list[DotRecord]:
  modules = {tuple(path): node for path, node in nnx.iter_graph(model) if routable(node)}
  metas, records = {}, []
  for (path, name), call in find_dots(model, modules, example_inputs).items():
    dot = call.info(path + (name,))
    decision = decide(rules, dot, default_layer_filter, recipe, "default_layer_filter")
    if decision.recipe is None:
      records.append(DotRecord.of(dot, None, decision.reason, decision.predicted))
    elif call.blocker is not None:
      records.append(_stays_high_precision(dot, call.blocker))
    else:
      metas.setdefault(path, {})[name] = init_call_meta(call, decision.recipe)
      records.append(DotRecord.of(dot, decision.recipe, decision.reason, decision.predicted))
  convert_dots(modules, metas)
  return records


def _stays_high_precision(dot: LayerInfo, why: str) -> DotRecord:
  what = "dot" if dot.kind in OP_KINDS else "layer"
  warnings.warn(f"fp8jax: {what} {dot.path} ({dot.kind}) was chosen for FP8 but stays in high "
                f"precision: {why.rstrip('.')}.", stacklevel=4)
  return DotRecord.of(dot, None, f"unsupported: {why.rstrip('.')}")


def _check_nnx_module(model) -> None:
  if isinstance(model, type) and issubclass(model, nnx.Module):
    raise TypeError(f"model is the class {model.__name__}, not a module: pass the model you "
                    f"built, e.g. convert_to_fp8({model.__name__}(..., rngs=nnx.Rngs(0))).")
  if isinstance(model, nn.Module):
    raise TypeError(f"model is a flax.linen module ({type(model).__name__}); convert_to_fp8 "
                    "changes flax.nnx modules in place. Run a linen model with FP8 layers "
                    "through fp8jax.flax.intercept.Fp8Model(model).")
  if not isinstance(model, nnx.Module):
    raise TypeError(f"model must be a flax.nnx Module, got {type(model).__name__}: {model!r}.")


def _replace_children(node, replacements: dict) -> None:
  """Points every child of `node` that is a replaced layer to its FP8 layer."""
  if isinstance(node, (nnx.List, list)):
    for i, child in enumerate(node):
      if id(child) in replacements:
        node[i] = replacements[id(child)]
  elif isinstance(node, nnx.Module):
    for name, child in list(vars(node).items()):
      if id(child) in replacements:
        setattr(node, name, replacements[id(child)])
  elif isinstance(node, dict):
    for key, child in list(node.items()):
      if id(child) in replacements:
        node[key] = replacements[id(child)]


# ----- one layer -------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Plan:
  layer: LayerInfo
  blocker: str | None
  equation_at_call: bool = False  # an Einsum given its einsum_str by each call


def _plan(path: tuple, node) -> _Plan | None:
  """What the filter sees of a stock Linear / LinearGeneral / Einsum, else None."""
  # Exact types: a subclass may compute something else in its __call__.
  if type(node) is nnx.Linear:
    k, n = node.in_features, node.out_features
    layer = LayerInfo(path, "Linear", (k, n), (k,), (n,))
    return _Plan(layer, _blocker(node, {"dot_general": jax.lax.dot_general}))
  if type(node) is nnx.LinearGeneral:
    layer = LayerInfo(path, "LinearGeneral", tuple(_get(node.kernel).shape),
                      tuple(node.in_features), tuple(node.out_features))
    return _Plan(layer, _blocker(node, {"dot_general": None, "dot_general_cls": None}))
  if type(node) is nnx.Einsum:
    return _einsum_plan(path, node)
  return None


def _einsum_plan(path, node) -> _Plan:
  shape = tuple(node.kernel_shape)
  spec = node.einsum_str
  if spec is None:
    # The equation comes with each call: K and N are unknown here, but a rule may name it.
    layer = LayerInfo(path, "Einsum", shape, (), ())
    blocker = _blocker(node, {"einsum_op": jnp.einsum})
    if blocker is None and node.bias is not None:
      blocker = "it has a bias, which fp8jax.flax.nnx.Fp8Einsum does not have"
    return _Plan(layer, blocker, equation_at_call=True)
  x_labels, k_labels, out_labels = "", "", ""
  if "..." not in spec:
    (x_labels, k_labels), out_labels = spec.split("->")[0].split(","), spec.split("->")[1]
  in_features = tuple(s for c, s in zip(k_labels, shape) if c in x_labels and c not in out_labels)
  out_features = tuple(s for c, s in zip(k_labels, shape) if c in out_labels and c not in x_labels)
  layer = LayerInfo(path, "Einsum", shape, in_features, out_features)
  blocker = _blocker(node, {"einsum_op": jnp.einsum})
  if blocker is None and node.bias is not None:
    blocker = "it has a bias, which fp8jax.flax.nnx.Fp8Einsum does not have"
  if blocker is None:
    try:
      parse_two_operand_subscripts(spec, len(x_labels), len(shape))
    except ValueError as error:
      blocker = str(error)
  if blocker is None and not in_features:
    blocker = f"{spec!r} contracts no dimension, so it is not a matrix product"
  return _Plan(layer, blocker)


def _blocker(node, stock: dict) -> str | None:
  """Why fp8jax's layer would not compute what `node` computes, or None.

  `stock` maps the layer's injectable functions to their defaults.
  """
  for name, default in stock.items():
    if getattr(node, name) is not default:
      return f"it has its own {name}"
  if node.promote_dtype is not nnx.nn.dtypes.promote_dtype:
    return "it has its own promote_dtype"
  if node.preferred_element_type is not None:
    dtype = jnp.dtype(node.preferred_element_type)
    return (f"preferred_element_type={dtype} asks for an output dtype that the "
            "FP8 GEMM does not give")
  dtype = jnp.dtype(node.dtype if node.dtype is not None else _get(node.kernel).dtype)
  if not jnp.issubdtype(dtype, jnp.floating) or dtype.itemsize < 2:
    return f"its computation dtype is {dtype}, not bfloat16, float16, float32 or float64"
  return None


def _fp8_layer(node, recipe: Recipe) -> nnx.Module:
  """The FP8 layer that takes over `node`'s parameters (built abstractly: no initialization)."""
  common = dict(recipe=recipe, dtype=node.dtype, param_dtype=node.param_dtype)
  if isinstance(node, nnx.Linear):
    build = lambda: Fp8Linear(node.in_features, node.out_features,
                              use_bias=node.bias is not None, rngs=nnx.Rngs(0), **common)
  elif isinstance(node, nnx.LinearGeneral):
    build = lambda: Fp8LinearGeneral(node.in_features, node.out_features, axis=node.axis,
                                     batch_axis=dict(node.batch_axis),
                                     use_bias=node.bias is not None, rngs=nnx.Rngs(0), **common)
  else:
    build = lambda: Fp8Einsum(node.einsum_str, node.kernel_shape, rngs=nnx.Rngs(0), **common)
  # Built abstractly outside any mesh context: its placeholder parameters are replaced by
  # node's below, and nnx.eval_shape under jax.set_mesh would give them a sharding of
  # their own (which fails for variables without sharding metadata).
  with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), ())):
    layer = nnx.eval_shape(build)
  layer.kernel = node.kernel
  if hasattr(layer, "bias"):
    layer.bias = node.bias
  layer.fp8_meta = Fp8MetaVariable(init_dot_meta(recipe))
  return layer


def _get(variable):
  return variable.get_value() if hasattr(variable, "get_value") else variable.value
