"""Work a test file's tests share, done once per test run whichever worker asks first.

A module-scoped fixture runs once per pytest-xdist worker, and the workers split a
file's tests between them when one runs out of work: an expensive fixture (a sweep that
trains three runs) then ran twice. `shared(name, make)` runs `make(directory)` in the
first process of the run that asks for `name` (again in the next one to ask, if it
failed); the others wait for it and get the same directory and an unpickled copy of
what `make` returned. It lives in the run's directory, which the run removes at its end.
"""
from __future__ import annotations

import fcntl
import os
import pathlib
import pickle
import shutil

# The run's directory, which tests/conftest.py makes for each run (its processes inherit it).
RUN_DIR = "FP8JAX_TEST_RUN_DIR"
_DONE = "result.pickle"


def shared(name: str, make):
  """`(directory, make(directory))`, made once in this test run's directory."""
  run_dir = os.environ.get(RUN_DIR)
  if not run_dir:
    raise RuntimeError(f"{RUN_DIR} is not set: run the tests with pytest, whose "
                       "tests/conftest.py makes the run's directory.")
  root = pathlib.Path(run_dir) / "shared"
  root.mkdir(exist_ok=True)
  place = root / name
  with open(root / f"{name}.lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)   # released when the file closes
    if not (place / _DONE).exists():
      shutil.rmtree(place, ignore_errors=True)   # what a failed attempt left
      (place / "work").mkdir(parents=True)
      result = make(place / "work")
      (place / _DONE).write_bytes(pickle.dumps(result))
    return place / "work", pickle.loads((place / _DONE).read_bytes())
