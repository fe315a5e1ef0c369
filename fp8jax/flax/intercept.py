"""FP8 dense layers in a linen model you did not write, without editing its code.

`Fp8Model` runs an unmodified `flax.linen` module with the `nn.Dense`,
`nn.DenseGeneral` and `nn.Einsum` layers that `layer_filter` chooses doing their
matmul in FP8 (`fp8jax.fp8_dense` / `fp8_dot_general` / `fp8_einsum`):

    fp8_model = Fp8Model(model)        # default_layer_filter, DelayedScaling()
    variables = fp8_model.init(rng, x)
    # {"params": the tree model.init gives, "fp8_meta": one DotMeta per chosen layer}

    def loss_fn(params, fp8_state, x, y):
      out, updates = fp8_model.apply({"params": params, "fp8_meta": fp8_state}, x,
                                     mutable=["fp8_meta"])
      return jnp.mean((out - y) ** 2), updates["fp8_meta"]

    loss, grads, fp8_state = fp8jax.value_and_grad(loss_fn)(params, fp8_state, x, y)

The layers keep their parameters (names, shapes, initializers, values), so a
checkpoint of the model trained without FP8 loads as it is, and each chosen
layer keeps its `DotMeta` in the "fp8_meta" collection at its own module path,
by the conventions of `fp8jax.flax.linen` (evaluation: apply without
`mutable`). The layer's own attributes are respected: `use_bias`, `dtype`,
`param_dtype`, `promote_dtype`, `axis` and `batch_dims`, einsum strings with
an ellipsis; `precision` is ignored (FP8 GEMMs accumulate in float32).

A chosen layer that cannot run in FP8 stays in high precision, with a warning
that names it: one with its own `dot_general` / `dot_general_cls`, an `Einsum`
with `preferred_element_type` or a contraction that is not a matrix product
(a label summed over one operand, a trace, nothing contracted), and a
computation dtype that is not bf16, f16, f32 or f64.

How: `nn.intercept_methods` catches the layers' `__call__`. A chosen layer
still creates its parameters with its own code (at init); its output is then
computed by fp8jax from those parameters. Interception acts while a function
is traced, which `Fp8Model.init` / `apply` ensure; with `fp8_dense_layers`
directly, trace the jitted function inside the `with` block. Layers under
`nn.scan` need "fp8_meta" in the scan's `variable_axes` (see
`fp8jax.flax.linen`); a filter can leave them out otherwise.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import warnings
from typing import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import opt_einsum
from flax import nnx

from fp8jax.dense import fp8_dense
from fp8jax.dot import fp8_dot_general
from fp8jax.einsum import fp8_einsum, parse_two_operand_subscripts
from fp8jax.flax.layer_filter import LayerInfo, check_layer_filter, chosen, default_layer_filter
from fp8jax.flax.linen import FP8_COLLECTION, dot_meta_variable, read_meta, store_dot_meta
from fp8jax.recipes import DelayedScaling, Recipe, check_recipe


@contextlib.contextmanager
def fp8_dense_layers(layer_filter: Callable[[LayerInfo], bool] = default_layer_filter,
                     recipe: Recipe = DelayedScaling()):
  """Linen `Dense` / `DenseGeneral` / `Einsum` layers traced inside run in FP8 where chosen.

  Use it around `model.init` and inside the loss function around
  `model.apply` (so that it is active while `jax.jit` traces); `Fp8Model` does
  both for you.

  Args:
    layer_filter: `(LayerInfo) -> bool`, True for the layers to run in FP8.
    recipe: the FP8 recipe of every chosen layer.
  """
  check_layer_filter(layer_filter)
  check_recipe(recipe)
  with nn.intercept_methods(functools.partial(_intercept, layer_filter, recipe)):
    yield


@dataclasses.dataclass(frozen=True)
class Fp8Model:
  """An unmodified linen module whose chosen dense layers run in FP8.

  `init`, `init_with_output` and `apply` take the arguments of the module's own
  and return what they return, with an "fp8_meta" collection besides "params".

  Attributes:
    module: the `flax.linen.Module` (an instance, as you would call `.init` on).
    layer_filter: `(LayerInfo) -> bool`, True for the layers to run in FP8.
    recipe: the FP8 recipe of every chosen layer.
  """

  module: nn.Module
  layer_filter: Callable[[LayerInfo], bool] = default_layer_filter
  recipe: Recipe = DelayedScaling()

  def __post_init__(self):
    _check_linen_module(self.module)
    check_layer_filter(self.layer_filter)
    check_recipe(self.recipe)

  def init(self, rngs, *args, **kwargs):
    """`module.init(rngs, *args, **kwargs)` with the chosen layers in FP8."""
    with fp8_dense_layers(self.layer_filter, self.recipe):
      return self.module.init(rngs, *args, **kwargs)

  def init_with_output(self, rngs, *args, **kwargs):
    """`module.init_with_output(rngs, *args, **kwargs)` with the chosen layers in FP8."""
    with fp8_dense_layers(self.layer_filter, self.recipe):
      return self.module.init_with_output(rngs, *args, **kwargs)

  def apply(self, variables, *args, **kwargs):
    """`module.apply(variables, *args, **kwargs)` with the chosen layers in FP8."""
    with fp8_dense_layers(self.layer_filter, self.recipe):
      return self.module.apply(variables, *args, **kwargs)


def _check_linen_module(module) -> None:
  if isinstance(module, type) and issubclass(module, nn.Module):
    raise TypeError(f"module is the class {module.__name__}, not a module: pass an instance, "
                    f"e.g. Fp8Model({module.__name__}(...)).")
  if isinstance(module, nnx.Module):
    raise TypeError(f"module is a flax.nnx module ({type(module).__name__}); Fp8Model takes "
                    "flax.linen modules. Convert an nnx model in place with "
                    "fp8jax.flax.convert.convert_to_fp8(model).")
  if not isinstance(module, nn.Module):
    raise TypeError(f"module must be a flax.linen Module, got {type(module).__name__}: "
                    f"{module!r}.")


# ----- the interceptor ---------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Plan:
  """One call of a dense layer: what the filter sees, why FP8 cannot run (or None), and the
  FP8 computation `fp8(kernel, bias, meta) -> (y, new_meta)` from the layer's parameters."""

  layer: LayerInfo
  blocker: str | None
  fp8: Callable


def _intercept(layer_filter, recipe, next_fun, args, kwargs, context):
  module = context.module
  plan = _plan(module, context.method_name, args, kwargs)
  if plan is None or not chosen(layer_filter, plan.layer):
    return next_fun(*args, **kwargs)
  if plan.blocker is not None:
    warnings.warn(f"fp8jax: layer {plan.layer.path} ({plan.layer.kind}) was chosen for FP8 "
                  f"but stays in high precision: {plan.blocker.rstrip('.')}.")
    return next_fun(*args, **kwargs)
  if not module.has_variable("params", "kernel"):
    next_fun(*args, **kwargs)  # the layer creates its parameters with its own code
  _check_state_present(module, plan.layer)
  kernel = nn.meta.unbox(module.get_variable("params", "kernel"))
  bias = nn.meta.unbox(module.get_variable("params", "bias")) if module.use_bias else None
  variable = dot_meta_variable(module, recipe)
  y, new_meta = plan.fp8(kernel, bias, read_meta(module, variable))
  store_dot_meta(module, variable, new_meta)
  return y


def _check_state_present(module, layer: LayerInfo) -> None:
  if (module.is_initializing() or module.is_mutable_collection(FP8_COLLECTION)
      or module.has_variable(FP8_COLLECTION, "dot_meta")):
    return
  raise ValueError(
      f"layer {layer.path} ({layer.kind}) was chosen for FP8 by layer_filter, but the "
      f"variables given to apply have no '{FP8_COLLECTION}' state for it. Pass the "
      f"'{FP8_COLLECTION}' collection that init made with the same layer_filter "
      "(variables = fp8_model.init(...)), and do not base the filter's choice on the batch "
      "size.")


def _plan(module, method_name, args, kwargs) -> _Plan | None:
  """The plan of a stock Dense / DenseGeneral / Einsum `__call__`, else None (left alone)."""
  if method_name != "__call__":
    return None
  for kind, plan in ((nn.Dense, _dense_plan), (nn.DenseGeneral, _dense_general_plan),
                     (nn.Einsum, _einsum_plan)):
    # A subclass with its own __call__ computes something else: leave it alone.
    if isinstance(module, kind) and type(module).__call__ is kind.__call__:
      return plan(module, args, kwargs)
  return None


def _call_args(args, kwargs, names):
  """The call's arguments by name (None for those not given), or None if unexpected."""
  if len(args) > len(names) or set(kwargs) - set(names):
    return None
  values = dict(zip(names, args))
  if set(values) & set(kwargs):
    return None
  values.update(kwargs)
  if getattr(values.get(names[0]), "ndim", 0) < 1:
    return None  # no array input: the layer handles (or rejects) it itself
  return [values.get(name) for name in names]


def _dtype_blocker(module, x) -> str | None:
  dtype = jnp.dtype(module.dtype if module.dtype is not None
                    else jnp.result_type(x, module.param_dtype))
  if not jnp.issubdtype(dtype, jnp.floating) or dtype.itemsize < 2:
    return f"its computation dtype is {dtype}, not bfloat16, float16, float32 or float64"
  return None


def _dot_blocker(module) -> str | None:
  if module.dot_general is not None or module.dot_general_cls is not None:
    return "it has its own dot_general (or dot_general_cls)"
  return None


def _dense_plan(module, args, kwargs) -> _Plan | None:
  call = _call_args(args, kwargs, ("inputs",))
  if call is None:
    return None
  (x,) = call
  k, n = x.shape[-1], module.features
  layer = LayerInfo(path=module.path, kind="Dense", kernel_shape=(k, n), in_features=(k,),
                    out_features=(n,), input_shape=tuple(x.shape))

  def fp8(kernel, bias, meta):
    x_, kernel_, bias_ = module.promote_dtype(x, kernel, bias, dtype=module.dtype)
    return fp8_dense(x_, kernel_, bias_, meta)

  return _Plan(layer, _dot_blocker(module) or _dtype_blocker(module, x), fp8)


def _dense_general_plan(module, args, kwargs) -> _Plan | None:
  call = _call_args(args, kwargs, ("inputs",))
  if call is None:
    return None
  (x,) = call
  features = _as_tuple(module.features)
  axis = tuple(a % x.ndim for a in _as_tuple(module.axis))
  batch_dims = tuple(a % x.ndim for a in _as_tuple(module.batch_dims))
  if set(batch_dims) != set(range(len(batch_dims))):
    return None  # not consecutive leading dims: the layer raises its own error
  in_features = tuple(x.shape[a] for a in axis)
  batch_shape = tuple(x.shape[a] for a in batch_dims)
  layer = LayerInfo(path=module.path, kind="DenseGeneral",
                    kernel_shape=batch_shape + in_features + features,
                    in_features=in_features, out_features=features, input_shape=tuple(x.shape))

  def fp8(kernel, bias, meta):
    x_, kernel_, bias_ = module.promote_dtype(x, kernel, bias, dtype=module.dtype)
    n_batch = len(batch_dims)
    dims = ((axis, tuple(range(n_batch, n_batch + len(axis)))),
            (batch_dims, tuple(range(n_batch))))
    y, new_meta = fp8_dot_general(x_, kernel_, meta, dims)
    if bias_ is not None:
      # y is [batch dims, x's other dims, features]; the bias varies along the batch dims.
      expanded = tuple(x.shape[a] if a in batch_dims else 1
                       for a in range(x.ndim) if a not in axis)
      y = y + jnp.reshape(bias_, expanded + features).astype(y.dtype)
    return y, new_meta

  return _Plan(layer, _dot_blocker(module) or _dtype_blocker(module, x), fp8)


def _einsum_plan(module, args, kwargs) -> _Plan | None:
  call = _call_args(args, kwargs, ("inputs", "einsum_str"))
  if call is None:
    return None
  x, call_str = call
  if (call_str is None) == (module.einsum_str is None):
    return None  # neither or both given: the layer raises its own error
  spec = (call_str if call_str is not None else module.einsum_str).replace(" ", "")
  shape = tuple(module.shape)
  try:
    operands, out_labels, _ = opt_einsum.parser.parse_einsum_input(
        (spec, jax.ShapeDtypeStruct(x.shape, x.dtype),
         jax.ShapeDtypeStruct(shape, jnp.float32)))
    x_labels, k_labels = operands.split(",")
  except ValueError:
    return None  # a malformed equation: the layer raises its own error
  spec = f"{x_labels},{k_labels}->{out_labels}"  # the ellipsis spelled out
  in_features = tuple(s for c, s in zip(k_labels, shape) if c in x_labels and c not in out_labels)
  out_features = tuple(s for c, s in zip(k_labels, shape) if c in out_labels and c not in x_labels)
  layer = LayerInfo(path=module.path, kind="Einsum", kernel_shape=shape, in_features=in_features,
                    out_features=out_features, input_shape=tuple(x.shape))

  def fp8(kernel, bias, meta):
    x_, kernel_, bias_ = module.promote_dtype(x, kernel, bias, dtype=module.dtype)
    y, new_meta = fp8_einsum(spec, x_, kernel_, meta)
    if bias_ is not None:
      # The bias has the kernel's dims that the output keeps, in the output's order.
      broadcast = tuple(shape[k_labels.index(c)] if c in k_labels else 1 for c in out_labels)
      y = y + jnp.reshape(bias_, broadcast).astype(y.dtype)
    return y, new_meta

  return _Plan(layer, _einsum_blocker(module, spec, x, shape, in_features), fp8)


def _einsum_blocker(module, spec, x, shape, in_features) -> str | None:
  if module.preferred_element_type is not None:
    dtype = jnp.dtype(module.preferred_element_type)
    return (f"preferred_element_type={dtype} asks for an output dtype that the "
            "FP8 GEMM does not give")
  try:
    parse_two_operand_subscripts(spec, x.ndim, len(shape))
  except ValueError as error:
    return str(error)
  if not in_features:
    return f"{spec!r} contracts no dimension, so it is not a matrix product"
  return _dtype_blocker(module, x)


def _as_tuple(value) -> tuple:
  return tuple(value) if isinstance(value, (tuple, list)) else (value,)
