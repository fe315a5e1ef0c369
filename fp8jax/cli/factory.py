"""`--factory MODULE:FUNCTION`: a user's program to compile, loaded with one-line errors.

The factory and the function it returns are the user's code: when either raises
(the factory when called, the function while it is traced for the compile), the
command prints one line naming the factory and the exception (`UserCodeError`);
`--traceback` prints the exception's traceback instead.
"""
from __future__ import annotations

import functools
import importlib
import os
import sys

from fp8jax.cli.errors import CommandError, UserCodeError


def factory_label(spec: str) -> str:
  """The FUNCTION part of 'MODULE:FUNCTION' (a name for tables)."""
  return spec.partition(":")[2] or spec


def load_factory(spec: str, flag: str = "--factory"):
  """(fn, args) from the function of no arguments `spec` ('MODULE:FUNCTION') names.

  Raises `CommandError` naming `flag` when `spec` cannot be loaded or returns no (fn, args),
  and `UserCodeError` when the factory raises. The returned `fn` raises `UserCodeError`
  when the user's function raises while it is traced.
  """
  module_name, sep, attr = spec.partition(":")
  if not sep or not module_name or not attr:
    raise CommandError(f"{flag} {spec!r}: expected MODULE:FUNCTION, e.g. mypkg.train:example.")
  sys.path.insert(0, os.getcwd())
  try:
    module = importlib.import_module(module_name)
  except ImportError as e:
    raise CommandError(f"{flag} {spec!r}: cannot import {module_name!r} ({e}).") from None
  except Exception as error:  # the module's own code raised while it was imported
    raise UserCodeError(f"{flag} {spec!r}: importing {module_name!r} raised "
                        f"{_one_line(error)}", error) from None
  factory = getattr(module, attr, None)
  if not callable(factory):
    raise CommandError(f"{flag} {spec!r}: {module_name} has no function {attr!r}.")
  try:
    result = factory()
  except Exception as error:  # the user's code: any exception is theirs to see
    raise UserCodeError(f"{flag} {spec!r} raised {_one_line(error)}", error) from None
  if not (isinstance(result, tuple) and len(result) == 2 and callable(result[0])):
    raise CommandError(f"{flag} {spec!r} must return (fn, args), got {type(result).__name__}.")
  fn, fn_args = result
  if not isinstance(fn_args, (tuple, list)):
    raise CommandError(f"{flag} {spec!r} must return (fn, args) with args a tuple of the "
                       f"arguments, got args of type {type(fn_args).__name__}.")
  check_leaves(fn_args, f"{flag} {spec!r}")
  return _reporting_trace_errors(fn, f"{flag} {spec!r}"), tuple(fn_args)


def _reporting_trace_errors(fn, where: str):
  """`fn`, raising `UserCodeError` for an exception of its own while it is traced.

  Only what `fn`'s call raises is reported so: a failure of the compile after the
  trace is fp8jax's or XLA's, and keeps its traceback.
  """

  @functools.wraps(fn)
  def traced(*args, **kwargs):
    try:
      return fn(*args, **kwargs)
    except Exception as error:
      raise UserCodeError(f"{where}: the function it returned failed to trace: "
                          f"{_one_line(error)}", error) from None

  return traced


def _one_line(error: BaseException) -> str:
  """'TypeError: first line of the message', with ' ...' where more lines follow, and
  where to see the rest."""
  lines = [line for line in str(error).splitlines() if line.strip()]
  text = type(error).__name__ + (f": {lines[0].strip()}" if lines else "")
  return text + (" ..." if len(lines) > 1 else "") + " (--traceback prints the traceback)"


def check_leaves(fn_args, where: str) -> None:
  import jax

  for path, leaf in jax.tree_util.tree_leaves_with_path(tuple(fn_args)):
    if not (hasattr(leaf, "shape") and hasattr(leaf, "dtype")):
      raise CommandError(f"{where}: args{jax.tree_util.keystr(path)} is a {type(leaf).__name__} "
                         f"({leaf!r}); every leaf must be an array or a jax.ShapeDtypeStruct "
                         "(close over Python values in fn instead).")
