"""Routing the dot functions a model calls to a handler while it is traced.

`lax.dot_general`, `jnp.einsum`, `jnp.matmul`, `jnp.dot` and `lax.ragged_dot` (the
grouped matmul of mixture-of-experts layers) are looked up on
their modules when a model calls them (`from jax import lax; lax.dot_general(...)`,
`jnp.einsum(...)`), so replacing those module attributes for the length of a
trace reaches every such call, in Flax's layers and in code written without
Flax's layers alike. Outside `dot_calls_routed_to`, and in other threads, the
functions are JAX's own. A call through a name bound before (`from jax.numpy
import einsum`) or through the `@` operator is not seen, nor one inside a `jax.jit`
function already traced outside the block (its cached trace is reused), nor
the products of `jax.nn.dot_product_attention` (JAX calls its internal einsum).
"""
from __future__ import annotations

import contextlib
import functools
import sys
import threading
from typing import Callable

import jax
import jax.numpy as jnp

# kind -> (module, attribute) of each function routed.
_FUNCTIONS = {"dot_general": (jax.lax, "dot_general"), "einsum": (jnp, "einsum"),
              "matmul": (jnp, "matmul"), "dot": (jnp, "dot"),
              "ragged_dot": (jax.lax, "ragged_dot")}

# JAX's own functions, as imported (before any routing).
ORIGINALS = {kind: getattr(module, name) for kind, (module, name) in _FUNCTIONS.items()}

_handlers = threading.local()
_install_lock = threading.Lock()
_installed = {"count": 0, "originals": {}}


@contextlib.contextmanager
def dot_calls_routed_to(handler: Callable):
  """Within the block, in this thread, calls of the dot functions go to `handler`.

  Args:
    handler: `handler(kind, original, args, kwargs)`, kind one of "dot_general",
      "einsum", "matmul", "dot"; it returns the call's result (calling `original`
      itself to leave the call as it is).
  """
  stack = _handler_stack()
  stack.append(handler)
  _install()
  try:
    yield
  finally:
    stack.pop()
    _uninstall()


def _handler_stack() -> list:
  if not hasattr(_handlers, "stack"):
    _handlers.stack = []
  return _handlers.stack


def _install() -> None:
  with _install_lock:
    if _installed["count"] == 0:
      for kind, (module, name) in _FUNCTIONS.items():
        original = getattr(module, name)
        _installed["originals"][kind] = original
        setattr(module, name, _routed(kind, original))
    _installed["count"] += 1


def _uninstall() -> None:
  with _install_lock:
    _installed["count"] -= 1
    if _installed["count"] == 0:
      for kind, (module, name) in _FUNCTIONS.items():
        setattr(module, name, _installed["originals"].pop(kind))


# Dots that fp8jax's own code calls are its GEMMs, not the model's, also where JAX traces
# them later than the call that made them (the backward pass of a custom VJP under remat).
_OWN_PACKAGES = ("fp8jax", "pallas_kernels")


def is_jax_function(function, kind: str) -> bool:
  """Whether `function` is JAX's own `kind` function, routed or not."""
  return getattr(function, "__wrapped__", function) is ORIGINALS[kind]


def _from_own_package(module_name: str) -> bool:
  return any(module_name == p or module_name.startswith(p + ".") for p in _OWN_PACKAGES)


def _routed(kind: str, original: Callable) -> Callable:
  @functools.wraps(original)
  def call(*args, **kwargs):
    stack = _handler_stack()
    if not stack or _from_own_package(sys._getframe(1).f_globals.get("__name__", "")):
      return original(*args, **kwargs)
    return stack[-1](kind, original, args, kwargs)
  return call
