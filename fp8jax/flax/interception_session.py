"""One trace of a linen model under `Fp8Model`: which dots run in FP8 and where their state is.

A `Session` follows the module calls of the trace (Flax's method interceptor
calls `enter` / `exit`) and sees every dot: a stock dense layer's call
(`run_layer`, planned by `fp8jax.flax.intercept`) and every `lax.dot_general`,
`jnp.einsum`, `jnp.matmul`, `jnp.dot` and `lax.ragged_dot` a module calls itself (`run_op`, routed
by `fp8jax.flax.op_routing`). Each dot is decided once by the rules and filters
(`fp8jax.flax.rules`) and recorded for the report.

Where the state of a dot lives, in the "fp8_meta" collection:
* a dense layer: "dot_meta" at the layer's path, as `fp8jax.flax.linen` layers keep it;
* a dot a module calls itself: at the module's path, named by kind and call order
  within one call of the module: "einsum_0", "einsum_1", "dot_general_0". The names
  restart with every call of the module, so they are the same in every trace and a
  module called twice shares its state, as a layer called twice does;
* a nested apply (`self.decoder.apply({"params": {"kernel": emb.T}}, h)`, the tied
  heads of BERT, GPT-2 and OPT): the inner apply has variables of its own, without
  FP8 state, so its dots keep theirs in the module that calls `apply`, under
  "<name>_apply" ("decoder_apply/dot_meta"), and follow that module's init and
  mutability;
* where the state cannot live (inside `nn.scan` / `nn.vmap` whose `variable_axes`
  leave out "fp8_meta"), the dot stays in high precision with a warning.
"""
from __future__ import annotations

import contextlib
import dataclasses
import warnings

import flax.linen as nn
from flax.core.tracers import current_trace

from fp8jax.flax.dot_calls import fp8_dot_call, init_call_meta, read_dot_call
from fp8jax.flax.dot_report import DotRecord, Fp8Report
from fp8jax.flax.layer_filter import LayerInfo, default_layer_filter
from fp8jax.flax.linen import FP8_COLLECTION
from fp8jax.flax.rules import OP_KINDS, decide
from fp8jax.core.calibration import training_recipe
from fp8jax.core.meta import init_dot_meta
from fp8jax.ops.guards import detach_outside_step, guard_fp8_state


@dataclasses.dataclass
class _Frame:
  """One module call being traced.

  Attributes:
    module: the bound module.
    layer: a stock dense layer, decided as a whole: the dots inside are its own.
    home: in a nested apply, the module of the enclosing apply that keeps the state.
    prefix: in a nested apply, the scope names under `home` where the inner apply's
      root keeps its state.
    counts: calls of each dot kind so far in this call of the module.
  """

  module: nn.Module
  layer: bool
  home: nn.Module | None
  prefix: tuple
  counts: dict

  @property
  def path(self) -> tuple:
    """The module's path in the model whose variables hold the state."""
    if self.home is None:
      return tuple(self.module.path)
    return tuple(self.home.path) + self.prefix + tuple(self.module.path)

  def next_name(self, kind: str) -> str:
    index = self.counts.get(kind, 0)
    self.counts[kind] = index + 1
    return f"{kind}_{index}"


class Session:
  """The decisions and state of one traced call of a model (see the module docstring)."""

  def __init__(self, layer_filter, recipe, rules):
    self.layer_filter, self.recipe, self.rules = layer_filter, recipe, rules
    self.frames: list[_Frame] = []
    self.records: dict[tuple, DotRecord] = {}
    self._handled = False  # inside a dot already decided: its inner dots are its own

  # ----- module calls ------------------------------------------------------------------

  def enter(self, module: nn.Module, layer: bool) -> None:
    top = self.frames[-1] if self.frames else None
    if top is None:
      frame = _Frame(module, layer, None, (), {})
    elif module is top.module:  # a method calling another method of the same module
      frame = dataclasses.replace(top, layer=top.layer or layer)
    elif not module.path and module.scope.root is not top.module.scope.root:
      # the root of an apply nested in a module's call (not a module shared into the
      # root's scope, nn.share_scope, whose path is empty too)
      name = f"{module.name or type(module).__name__}_apply"
      home = top.home or top.module
      prefix = top.prefix + (tuple(top.module.path) if top.home is not None else ()) + (name,)
      frame = _Frame(module, layer, home, prefix, {})
    else:
      frame = _Frame(module, layer, top.home, top.prefix, {})
    self.frames.append(frame)

  def exit(self) -> None:
    self.frames.pop()

  def report(self) -> Fp8Report:
    return Fp8Report(tuple(self.records.values()))

  # ----- dense layers ------------------------------------------------------------------

  def run_layer(self, plan, next_fun, args, kwargs):
    """A stock dense layer's call, `plan` from `fp8jax.flax.intercept`."""
    frame = self.frames[-1]
    layer = dataclasses.replace(plan.layer, path=frame.path)
    filter_name = ("default_layer_filter" if self.layer_filter is default_layer_filter
                   else "layer_filter")
    decision = decide(self.rules, layer, self.layer_filter, self.recipe, filter_name)
    if decision.recipe is None:
      self._record(layer, None, decision.reason, decision.predicted)
      return next_fun(*args, **kwargs)
    if plan.blocker is not None:
      return self._stays_high_precision(layer, plan.blocker, next_fun(*args, **kwargs))
    module = frame.module
    out = None
    if not module.has_variable("params", "kernel"):
      out = next_fun(*args, **kwargs)  # the layer creates its parameters with its own code
    meta, why_not = self._read_state(frame, "dot_meta", decision.recipe, layer)
    if meta is None:
      out = next_fun(*args, **kwargs) if out is None else out
      return self._stays_high_precision(layer, why_not, out)
    kernel = nn.meta.unbox(module.get_variable("params", "kernel"))
    bias = nn.meta.unbox(module.get_variable("params", "bias")) if module.use_bias else None
    with self._fp8_op():
      y, new_meta = plan.fp8(kernel, bias, meta)
    self._write_state(frame, "dot_meta", new_meta)
    self._record(layer, decision.recipe, decision.reason, decision.predicted)
    return y

  # ----- dots a module calls itself ----------------------------------------------------

  def run_op(self, kind, original, args, kwargs):
    """A call of `lax.dot_general` / `jnp.einsum` / `jnp.matmul` / `jnp.dot`."""
    if not self.frames or self._handled or self.frames[-1].layer:
      return original(*args, **kwargs)
    call = read_dot_call(kind, args, kwargs)
    if call is None:
      return self._pass_on(original, args, kwargs)
    frame = self.frames[-1]
    name = frame.next_name(kind)
    dot = call.info(frame.path + (name,))
    decision = decide(self.rules, dot, default_layer_filter, self.recipe,
                      "default_layer_filter")
    if decision.recipe is None:
      self._record(dot, None, decision.reason, decision.predicted)
      return self._pass_on(original, args, kwargs)
    if call.blocker is not None:
      return self._stays_high_precision(dot, call.blocker,
                                        self._pass_on(original, args, kwargs))
    meta, why_not = self._read_state(frame, name, decision.recipe, dot,
                                     init=lambda recipe: init_call_meta(call, recipe))
    if meta is None:
      return self._stays_high_precision(dot, why_not, self._pass_on(original, args, kwargs))
    with self._fp8_op():
      y, new_meta = fp8_dot_call(call, meta)
    self._write_state(frame, name, new_meta)
    self._record(dot, decision.recipe, decision.reason, decision.predicted)
    return y

  # ----- state -------------------------------------------------------------------------

  def _scope(self, frame: _Frame):
    if frame.home is None:
      return frame.module.scope
    scope = frame.home.scope
    for name in frame.prefix + tuple(frame.module.path):
      scope = scope.push(name, reuse=True)
    return scope

  def _initializing(self, frame: _Frame) -> bool:
    return (frame.home or frame.module).is_initializing()

  def _read_state(self, frame: _Frame, name: str, recipe, dot: LayerInfo,
                  init=init_dot_meta):
    """(the dot's state, None), made fresh where the collection is mutable; or (None, why)
    where no state can live; raises where the state should have been passed."""
    owner = (frame.home or frame.module).scope
    if current_trace() != owner.trace_level:
      return None, _INNER_TRACE
    scope = self._scope(frame)
    outer = self.frames[0].module.scope
    if scope.has_variable(FP8_COLLECTION, name):
      meta = scope.get_variable(FP8_COLLECTION, name)
      if training_recipe(meta.recipe) != recipe:  # fp8jax.calibrate's step follows it too
        raise ValueError(
            f"{_named(dot)} runs with recipe={recipe} but its '{FP8_COLLECTION}' state was "
            f"made for recipe={meta.recipe}. Initialize fresh FP8 state for the new recipe "
            "(fp8_model.init) or convert it with fp8jax.resize_history.")
    elif scope.is_mutable_collection(FP8_COLLECTION):
      meta = init(recipe)
      scope.put_variable(FP8_COLLECTION, name, meta)
    elif scope.root is not outer.root and (outer.is_mutable_collection(FP8_COLLECTION) or
                                           not outer.is_collection_empty(FP8_COLLECTION)):
      return None, _NOT_CARRIED  # the model has FP8 state, but this lift does not carry it
    else:
      raise ValueError(
          f"{_named(dot)} was chosen for FP8, but the variables given to apply have no "
          f"'{FP8_COLLECTION}' state for it. Pass the '{FP8_COLLECTION}' collection that "
          "init made with the same layer_filter and rules (variables = fp8_model.init(...)), "
          "and do not base the filter's choice on the batch size. (If the dot is inside "
          "nn.scan / nn.vmap whose variable_axes leave out the collection, add it there.)")
    where = "/".join([FP8_COLLECTION, *map(str, frame.path), name])
    return guard_fp8_state(meta, f"'{where}'"), None

  def _write_state(self, frame: _Frame, name: str, new_meta) -> None:
    # The init pass must not record amaxes: the first training step would then
    # start from an observation of the random initialization.
    scope = self._scope(frame)
    if scope.is_mutable_collection(FP8_COLLECTION) and not self._initializing(frame):
      scope.put_variable(FP8_COLLECTION, name, detach_outside_step(new_meta))

  # ----- bookkeeping -------------------------------------------------------------------

  @contextlib.contextmanager
  def _fp8_op(self):
    """While fp8jax's own op runs: its dots are its own, not the model's."""
    self._handled = True
    try:
      yield
    finally:
      self._handled = False

  def _pass_on(self, original, args, kwargs):
    """JAX's own function for a dot decided for high precision. Dots it makes inside
    (an einsum's pairwise products through its routed `_dot_general`) belong to it."""
    with self._fp8_op():
      return original(*args, **kwargs)

  def _stays_high_precision(self, dot: LayerInfo, why: str, out):
    key = tuple(dot.path) + (dot.kind,)
    if key not in self.records:
      warnings.warn(f"fp8jax: {_named(dot)} was chosen for FP8 but stays in high precision: "
                    f"{why.rstrip('.')}.", stacklevel=2)
    self._record(dot, None, f"unsupported: {why.rstrip('.')}")
    return out

  def _record(self, dot: LayerInfo, recipe, reason: str, predicted=None) -> None:
    key = tuple(dot.path) + (dot.kind,)
    if key not in self.records:
      self.records[key] = DotRecord.of(dot, recipe, reason, predicted)


_NOT_CARRIED = (f"it runs inside a lifted transform (nn.scan, nn.vmap, ...) that does not carry "
             f"the '{FP8_COLLECTION}' collection; add '{FP8_COLLECTION}' to its variable_axes "
             f"(e.g. variable_axes={{'params': 0, '{FP8_COLLECTION}': 0}}) for FP8 there")
_INNER_TRACE = ("it runs inside a JAX transform called within the module (jax.checkpoint, "
                "jax.lax.scan, a jax.jit function, ...), where its state cannot be kept; use "
                "Flax's lifted form (nn.remat, nn.scan, nn.jit) for FP8 there")


def _named(dot: LayerInfo) -> str:
  what = "dot" if dot.kind in OP_KINDS else "layer"
  return f"{what} {dot.path} ({dot.kind})"
