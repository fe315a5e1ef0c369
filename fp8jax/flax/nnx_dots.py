"""The dots that nnx modules call themselves, in FP8: `find_dots` and `convert_dots`.

`convert_to_fp8(model, example_inputs=(x,))` calls the model once, abstractly,
to find every `lax.dot_general`, `jnp.einsum`, `jnp.matmul` and `jnp.dot` that a
module's `__call__` calls itself (GPT-2's Conv1D, attention products; routed by
`fp8jax.flax.op_routing`). Each dot chosen for FP8 gets an `Fp8MetaVariable` in
an `Fp8DotStates` held by its module as `fp8_dot_states`, named by kind and call
order within one call of the module ("einsum_0", "dot_general_1"), and the module
becomes an instance of a subclass of its class whose `__call__` routes those dots
to fp8jax (`Fp8Dots[Conv1D]`); its parameters and everything else stay.

So `nnx.split(model, nnx.Param, Fp8MetaVariable)` separates the new state like
that of the FP8 layers, and training is as in `fp8jax.flax.nnx`. `model.eval()`
sets `use_running_average=True` on each `Fp8DotStates`: the dots then use the
stored scales and record nothing. A dot is seen in the `__call__` of the module
whose method calls it (directly or through plain functions); one in another
method, called from outside, is not.
"""
from __future__ import annotations

import contextlib
import dataclasses
import sys
import threading

import jax
from flax import nnx

from fp8jax.flax.dot_calls import DotCall, fp8_dot_call, read_dot_call
from fp8jax.flax.nnx import Fp8MetaVariable
from fp8jax.flax.op_routing import dot_calls_routed_to
from fp8jax.core.meta import DotMeta
from fp8jax.ops.guards import NNX_FIX, detach_outside_step, guard_fp8_state

STATES_ATTRIBUTE = "fp8_dot_states"


class Fp8DotStates(nnx.Module):
  """The FP8 state of the dots one module calls itself: an `Fp8MetaVariable` per dot name.

  `use_running_average=True` (what `model.eval()` sets) uses the stored scales and
  records no amaxes.
  """

  def __init__(self, metas: dict[str, DotMeta], use_running_average: bool = False):
    for name, meta in metas.items():
      setattr(self, name, Fp8MetaVariable(meta))
    self.use_running_average = use_running_average


@dataclasses.dataclass
class _Frame:
  module: nnx.Module
  counts: dict

  def next_name(self, kind: str) -> str:
    index = self.counts.get(kind, 0)
    self.counts[kind] = index + 1
    return f"{kind}_{index}"


class _Calls(threading.local):
  def __init__(self):
    self.frames: list[_Frame] = []
    self.found: dict | None = None  # while finding: (module id, name) -> DotCall
    self.handled = False  # inside a dot already decided: its inner dots are its own


_calls = _Calls()
_subclasses: dict[type, type] = {}


def routing_class(cls: type) -> type:
  """The subclass of `cls` whose `__call__` routes the module's own dots (one per class)."""
  if cls in _subclasses.values():
    return cls
  if cls not in _subclasses:
    def __call__(self, *args, **kwargs):
      _calls.frames.append(_Frame(self, {}))
      try:
        with dot_calls_routed_to(_run_dot):
          return cls.__call__(self, *args, **kwargs)
      finally:
        _calls.frames.pop()

    _subclasses[cls] = type(f"Fp8Dots[{cls.__name__}]", (cls,),
                            {"__call__": __call__, "__module__": cls.__module__,
                             "__qualname__": f"Fp8Dots[{cls.__qualname__}]"})
  return _subclasses[cls]


def find_dots(model: nnx.Module, modules: dict, example_inputs: tuple) -> dict:
  """Calls `model(*example_inputs)` abstractly; returns {(path, name): DotCall} of the dots
  that the modules in `modules` ({path: module}) call themselves, in call order."""
  graphdef, state = nnx.split(model)
  found = {}

  def call(state, example_inputs):
    copy = nnx.merge(graphdef, state)
    copies = {path: node for path, node in nnx.iter_graph(copy) if tuple(path) in modules}
    for node in copies.values():
      node.__class__ = routing_class(type(node))
    by_id = {id(node): tuple(path) for path, node in copies.items()}
    _calls.found = {}
    try:
      copy(*example_inputs)
      for (module_id, name), dot in _calls.found.items():
        found[(by_id[module_id], name)] = dot
    finally:
      _calls.found = None

  jax.eval_shape(call, state, tuple(example_inputs))
  return found


def routable(node) -> bool:
  """Whether `node` is a module whose own dots can be routed: not a dense layer (converted,
  or decided, as a whole) and not one of fp8jax's modules."""
  return (isinstance(node, nnx.Module)
          and type(node) not in (nnx.Linear, nnx.LinearGeneral, nnx.Einsum)
          and not type(node).__module__.startswith("fp8jax."))


def convert_dots(modules: dict, metas: dict) -> None:
  """Gives each module its dots' state ({path: {name: DotMeta}}) and the routing class."""
  for path, named in metas.items():
    module = modules[path]
    if hasattr(module, STATES_ATTRIBUTE):
      raise ValueError(f"module {path} ({type(module).__name__}) already has an attribute "
                       f"{STATES_ATTRIBUTE!r}; convert_to_fp8 keeps the FP8 state of its dots "
                       "there. Rename the attribute, or leave the module out with a rule "
                       "(Fp8Rule(path=..., recipe=None)).")
    setattr(module, STATES_ATTRIBUTE, Fp8DotStates(named))
    module.__class__ = routing_class(type(module))


def _run_dot(kind, original, args, kwargs):
  frames = _calls.frames
  if not frames or _calls.handled or _caller_module() is not frames[-1].module:
    return original(*args, **kwargs)  # not this module's own dot
  call = read_dot_call(kind, args, kwargs)
  frame = frames[-1]
  if call is not None:
    name = frame.next_name(kind)
    if _calls.found is not None:
      _calls.found.setdefault((id(frame.module), name), call)
    else:
      states = getattr(frame.module, STATES_ATTRIBUTE, None)
      variable = getattr(states, name, None)
      if variable is not None and call.blocker is None:
        return _fp8(call, states, variable, f"'{STATES_ATTRIBUTE}.{name}' of a "
                    f"{type(frame.module).__name__}")
  # JAX's own function; dots it makes inside (an einsum's pairwise products through its
  # routed _dot_general) belong to it.
  with _handled():
    return original(*args, **kwargs)


@contextlib.contextmanager
def _handled():
  _calls.handled = True
  try:
    yield
  finally:
    _calls.handled = False


def _fp8(call: DotCall, states: Fp8DotStates, variable, where: str):
  value = variable.get_value() if hasattr(variable, "get_value") else variable.value
  with _handled():
    y, new_meta = fp8_dot_call(call, guard_fp8_state(value, where, fix=NNX_FIX))
  if not states.use_running_average:
    new_value = detach_outside_step(new_meta)
    if hasattr(variable, "set_value"):
      variable.set_value(new_value)
    else:
      variable.value = new_value
  return y


def _caller_module():
  """The innermost nnx module whose method is running (the dot's caller), or None."""
  frame = sys._getframe(2)
  while frame is not None:
    candidate = frame.f_locals.get("self")
    if isinstance(candidate, nnx.Module) and frame.f_globals.get("__name__") != __name__:
      return candidate
    frame = frame.f_back
  return None
