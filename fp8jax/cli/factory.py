"""`--factory MODULE:FUNCTION`: a user's program to compile, loaded with one-line errors."""
from __future__ import annotations

import importlib
import os
import sys

from fp8jax.cli.errors import CommandError


def factory_label(spec: str) -> str:
  """The FUNCTION part of 'MODULE:FUNCTION' (a name for tables)."""
  return spec.partition(":")[2] or spec


def load_factory(spec: str, flag: str = "--factory"):
  """(fn, args) from the function of no arguments `spec` ('MODULE:FUNCTION') names.

  Raises `CommandError` naming `flag` when `spec` cannot be loaded or returns no (fn, args).
  """
  module_name, sep, attr = spec.partition(":")
  if not sep or not module_name or not attr:
    raise CommandError(f"{flag} {spec!r}: expected MODULE:FUNCTION, e.g. mypkg.train:example.")
  sys.path.insert(0, os.getcwd())
  try:
    module = importlib.import_module(module_name)
  except ImportError as e:
    raise CommandError(f"{flag} {spec!r}: cannot import {module_name!r} ({e}).") from None
  factory = getattr(module, attr, None)
  if not callable(factory):
    raise CommandError(f"{flag} {spec!r}: {module_name} has no function {attr!r}.")
  result = factory()
  if not (isinstance(result, tuple) and len(result) == 2 and callable(result[0])):
    raise CommandError(f"{flag} {spec!r} must return (fn, args), got {type(result).__name__}.")
  fn, fn_args = result
  if not isinstance(fn_args, (tuple, list)):
    raise CommandError(f"{flag} {spec!r} must return (fn, args) with args a tuple of the "
                       f"arguments, got args of type {type(fn_args).__name__}.")
  check_leaves(fn_args, f"{flag} {spec!r}")
  return fn, tuple(fn_args)


def check_leaves(fn_args, where: str) -> None:
  import jax

  for path, leaf in jax.tree_util.tree_leaves_with_path(tuple(fn_args)):
    if not (hasattr(leaf, "shape") and hasattr(leaf, "dtype")):
      raise CommandError(f"{where}: args{jax.tree_util.keystr(path)} is a {type(leaf).__name__} "
                         f"({leaf!r}); every leaf must be an array or a jax.ShapeDtypeStruct "
                         "(close over Python values in fn instead).")
