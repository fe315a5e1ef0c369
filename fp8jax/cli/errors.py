"""The one-line errors of every subcommand: `fp8jax: MESSAGE` on stderr and exit status 2.

A subcommand raises `CommandError` (or the library's `RunError` / `CorpusError`) for input
it cannot use, and runs its work through `report_user_errors`, so that `fp8jax train`,
`fp8jax cost` and `fp8jax inspect` fail the same way: one line, never a traceback, the
status argparse also uses for bad arguments.
"""
from __future__ import annotations

import sys

# The exit status of a user error; argparse exits with it too.
USER_ERROR_STATUS = 2


class CommandError(ValueError):
  """A command-line input that cannot be used; the message names the flag, the value and
  the fix."""


def report_user_errors(work) -> int:
  """Runs `work()` and returns its status; a user error is one line on stderr, status 2.

  User errors are `CommandError`, `fp8jax.runs.RunError`, `fp8jax.data.corpus.CorpusError`
  and `OSError` (a file that cannot be read or written). Anything else propagates: it is
  a bug, and its traceback is what a report of it needs.
  """
  from fp8jax.data.corpus import CorpusError
  from fp8jax.runs import RunError

  try:
    return work()
  except (CommandError, RunError, CorpusError) as error:
    return _print_error(str(error))
  except OSError as error:  # e.g. --out not writable, a disk full
    where = f" {error.filename}" if error.filename else ""
    return _print_error(f"cannot use{where}: {error.strerror or error}")


def _print_error(message: str) -> int:
  print(f"fp8jax: {message}", file=sys.stderr)
  return USER_ERROR_STATUS
