"""FP8 for a linen model you did not write, without editing its code: `Fp8Model`.

`Fp8Model` runs an unmodified `flax.linen` module with its dots in FP8 where
rules and filters choose them: its `nn.Dense`, `nn.DenseGeneral` and `nn.Einsum`
layers (as `fp8jax.fp8_dense` / `fp8_dot_general` / `fp8_einsum`) and every
`lax.dot_general`, `jnp.einsum`, `jnp.matmul` and `jnp.dot` its modules call
themselves (custom layers such as GPT-2's `Conv1D`, attention products written
with `jnp.einsum`), as `fp8jax.fp8_dot_general`:

    fp8_model = Fp8Model(model)        # default_layer_filter, DelayedScaling()
    variables = fp8_model.init(rng, x)
    # {"params": the tree model.init gives, "fp8_meta": the state of each FP8 dot}
    print(fp8_model.report(rng, x))    # every candidate dot: FP8 or not, and why

    def loss_fn(params, fp8_state, x, y):
      out, updates = fp8_model.apply({"params": params, "fp8_meta": fp8_state}, x,
                                     mutable=["fp8_meta"])
      return jnp.mean((out - y) ** 2), updates["fp8_meta"]

    loss, grads, fp8_state = fp8jax.value_and_grad(loss_fn)(params, fp8_state, x, y)

What runs in FP8 (`fp8jax.flax.rules`): the first `Fp8Rule` that names a dot (by
module path, kind and shape) decides, with the rule's own recipe; a layer no rule
names goes by `layer_filter` with `recipe`, and a dot a module calls itself that no
rule names by the cost model's `default_layer_filter`. Where each dot keeps its
state (a layer: "dot_meta" at its path; a call: "einsum_0" & co at its module's
path; a nested `apply`: in the module that calls it) is in
`fp8jax.flax.interception_session`. `init` warns when no dot at all was converted.

The layers keep their parameters (names, shapes, initializers, values), so a
checkpoint of the model trained without FP8 loads as it is (evaluation: apply
without `mutable`). The layer's own attributes are respected: `use_bias`, `dtype`,
`param_dtype`, `promote_dtype`, `axis` and `batch_dims`, einsum strings with an
ellipsis; `precision` is ignored (FP8 GEMMs accumulate in float32). A call's
`preferred_element_type` is its output dtype (the GEMM's output rounds to the
operands' dtype first).

A chosen dot that cannot run in FP8 stays in high precision, with a warning that
names it: a layer with its own `dot_general` / `dot_general_cls`, an `Einsum`
with `preferred_element_type`, a contraction that is not a matrix product (a
label summed over one operand, a trace, nothing contracted), integer or 8-bit
operands, a call with an `out_sharding`, and a dot inside `nn.scan` / `nn.vmap`
whose `variable_axes` leave out "fp8_meta" (add it there for FP8).

How: `nn.intercept_methods` catches the modules' methods, and the dot functions
are routed to fp8jax while the model is traced (`fp8jax.flax.op_routing`; a dot
written with `@`, through a name imported before, inside a `jax.jit` function traced
before, or inside `jax.nn.dot_product_attention` is not seen). Interception acts
while a function is traced, which `Fp8Model.init` / `apply` ensure; with
`fp8_dense_layers` directly, trace the jitted function inside the `with` block.
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

from fp8jax.ops.dense import fp8_dense
from fp8jax.ops.dot import fp8_dot_general
from fp8jax.ops.einsum import fp8_einsum, parse_two_operand_subscripts
from fp8jax.flax.dot_report import Fp8Report, nothing_converted_message
from fp8jax.flax.interception_session import Session
from fp8jax.flax.master_kernel import master_kernel
from fp8jax.flax.layer_filter import LayerInfo, check_layer_filter, default_layer_filter
from fp8jax.flax.op_routing import dot_calls_routed_to
from fp8jax.flax.rules import Fp8Rule, check_rules
from fp8jax.core.recipes import DelayedScaling, Recipe, check_recipe


@contextlib.contextmanager
def fp8_dense_layers(layer_filter: Callable[[LayerInfo], bool] = default_layer_filter,
                     recipe: Recipe = DelayedScaling(), rules: tuple[Fp8Rule, ...] = ()):
  """The dots of linen modules traced inside run in FP8 where chosen.

  Use it around `model.init` and inside the loss function around
  `model.apply` (so that it is active while `jax.jit` traces); `Fp8Model` does
  both for you.

  Args:
    layer_filter: `(LayerInfo) -> bool`, True for the dense layers no rule names that
      should run in FP8.
    recipe: the FP8 recipe of the dots chosen by a filter.
    rules: `Fp8Rule`s, read in order (see `fp8jax.flax.rules`).

  Yields:
    A function that returns the `Fp8Report` of what was traced so far.
  """
  check_layer_filter(layer_filter)
  check_recipe(recipe)
  session = Session(layer_filter, recipe, check_rules(rules))
  with nn.intercept_methods(functools.partial(_intercept, session)), \
      dot_calls_routed_to(session.run_op):
    yield session.report


@dataclasses.dataclass(frozen=True)
class Fp8Model:
  """An unmodified linen module whose chosen dots run in FP8.

  `init`, `init_with_output` and `apply` take the arguments of the module's own
  and return what they return, with an "fp8_meta" collection besides "params".

  Attributes:
    module: the `flax.linen.Module` (an instance, as you would call `.init` on).
    layer_filter: `(LayerInfo) -> bool`, True for the dense layers no rule names that
      should run in FP8.
    recipe: the FP8 recipe of the dots chosen by a filter.
    rules: `Fp8Rule`s, read in order; the first that names a dot decides.
  """

  module: nn.Module
  layer_filter: Callable[[LayerInfo], bool] = default_layer_filter
  recipe: Recipe = DelayedScaling()
  rules: tuple[Fp8Rule, ...] = ()

  def __post_init__(self):
    _check_linen_module(self.module)
    check_layer_filter(self.layer_filter)
    check_recipe(self.recipe)
    object.__setattr__(self, "rules", check_rules(self.rules))

  def init(self, rngs, *args, **kwargs):
    """`module.init(rngs, *args, **kwargs)` with the chosen dots in FP8.

    Warns when the model has dots but none of them was chosen for FP8.
    """
    with fp8_dense_layers(self.layer_filter, self.recipe, self.rules) as report:
      variables = self.module.init(rngs, *args, **kwargs)
    _warn_if_nothing_converted(report(), self.layer_filter)
    return variables

  def init_with_output(self, rngs, *args, **kwargs):
    """`module.init_with_output(rngs, *args, **kwargs)` with the chosen dots in FP8."""
    with fp8_dense_layers(self.layer_filter, self.recipe, self.rules) as report:
      result = self.module.init_with_output(rngs, *args, **kwargs)
    _warn_if_nothing_converted(report(), self.layer_filter)
    return result

  def apply(self, variables, *args, **kwargs):
    """`module.apply(variables, *args, **kwargs)` with the chosen dots in FP8."""
    with fp8_dense_layers(self.layer_filter, self.recipe, self.rules):
      return self.module.apply(variables, *args, **kwargs)

  def report(self, rngs, *args, **kwargs) -> Fp8Report:
    """Every candidate dot of the model and how it runs, from an abstract `init`.

    Takes `init`'s arguments (shapes only matter); `print` it for a table.
    """
    def init():
      with fp8_dense_layers(self.layer_filter, self.recipe, self.rules) as report:
        self.module.init(rngs, *args, **kwargs)
      return report()

    found = []
    jax.eval_shape(lambda: found.append(init()))
    return found[0]


def _warn_if_nothing_converted(report: Fp8Report, layer_filter) -> None:
  if report.rows and not report.converted:
    warnings.warn(nothing_converted_message(
        report, "Fp8Model", filter_passed=layer_filter is not default_layer_filter) +
        " fp8_model.report(rng, *inputs) lists every dot and why.", stacklevel=3)


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


def _intercept(session: Session, next_fun, args, kwargs, context):
  module = context.module
  stock = _stock_layer_kind(module)
  plan = (_PLANS[stock](module, args, kwargs)
          if stock is not None and context.method_name == "__call__" else None)
  session.enter(module, layer=stock is not None)
  try:
    if plan is None:  # not a stock layer's call, or a call it handles (or rejects) itself
      return next_fun(*args, **kwargs)
    return session.run_layer(plan, next_fun, args, kwargs)
  finally:
    session.exit()


def _stock_layer_kind(module) -> type | None:
  """nn.Dense, nn.DenseGeneral or nn.Einsum when `module` computes as that layer, else None.

  A subclass with its own __call__ computes something else: its dots are its own.
  """
  for kind in (nn.Dense, nn.DenseGeneral, nn.Einsum):
    if isinstance(module, kind) and type(module).__call__ is kind.__call__:
      return kind
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
    kernel_ = master_kernel(kernel, kernel_)
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
    kernel_ = master_kernel(kernel, kernel_)
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
    kernel_ = master_kernel(kernel, kernel_)
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


_PLANS = {nn.Dense: _dense_plan, nn.DenseGeneral: _dense_general_plan, nn.Einsum: _einsum_plan}
