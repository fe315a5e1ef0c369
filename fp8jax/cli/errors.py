"""The one-line errors of every subcommand: `fp8jax: MESSAGE` on stderr and exit status 2.

A subcommand raises `CommandError` (or the library's `RunError` / `CorpusError`) for input
it cannot use, and runs its work through `report_user_errors`, so that `fp8jax train`,
`fp8jax cost` and `fp8jax inspect` fail the same way: one line, never a traceback, the
status argparse also uses for bad arguments. Code of the user's own that fails (a
`--factory` function, or the program it returned while it is traced) is one line too,
naming the function and the exception; `--traceback` prints that exception's full
traceback instead, which is where its cause is.
"""
from __future__ import annotations

import sys
import traceback

# The exit status of a user error; argparse exits with it too.
USER_ERROR_STATUS = 2


class CommandError(ValueError):
  """A command-line input that cannot be used; the message names the flag, the value and
  the fix."""


class UserCodeError(CommandError):
  """The user's own code raised (a `--factory` function or the program it returned).

  The message is one line naming the function and the exception; `original` is that
  exception, whose traceback `--traceback` prints.
  """

  def __init__(self, message: str, original: BaseException):
    super().__init__(message)
    self.original = original


def add_traceback_option(parser) -> None:
  """--traceback: the full traceback of an exception in the user's code, not one line."""
  parser.add_argument("--traceback", action="store_true",
                      help="when your --factory code raises, print its full traceback "
                           "instead of one line")


def report_user_errors(work, show_traceback: bool = False) -> int:
  """Runs `work()` and returns its status; a user error is one line on stderr, status 2.

  User errors are `CommandError`, `fp8jax.runs.RunError`, `fp8jax.data.corpus.CorpusError`
  and `OSError` (a file that cannot be read or written). Anything else propagates: it is
  a bug, and its traceback is what a report of it needs. With `show_traceback`, a
  `UserCodeError` prints the full traceback of the user's exception instead of its line.
  """
  from fp8jax.data.corpus import CorpusError
  from fp8jax.runs import RunError

  try:
    return work()
  except UserCodeError as error:
    if not show_traceback:
      return _print_error(str(error))
    traceback.print_exception(error.original, file=sys.stderr)
    return USER_ERROR_STATUS
  except (CommandError, RunError, CorpusError) as error:
    return _print_error(str(error))
  except OSError as error:  # e.g. --out not writable, a disk full
    where = f" {error.filename}" if error.filename else ""
    return _print_error(f"cannot use{where}: {error.strerror or error}")


def _print_error(message: str) -> int:
  print(f"fp8jax: {message}", file=sys.stderr)
  return USER_ERROR_STATUS
