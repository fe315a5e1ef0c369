"""The demo's command line in a subprocess that compiles its CPU programs as the test
processes do (`cpu_compile_fast.py`: for compile time, about twice as fast to compile).

`python -m fp8jax.cli ...` compiles with XLA's defaults, as a user's run does; a test that
starts it only to see what the command line does (its files, its exit status, its
messages) starts `cli_command(...)` instead: the same module run as `__main__`, after
`cpu_compile_fast.install()`, unless FP8JAX_TEST_CPU_DEFAULT_COMPILE=1 keeps XLA's defaults.
"""
from __future__ import annotations

import os
import sys

_TESTS = os.path.dirname(os.path.abspath(__file__))
_BOOT = ("import os, runpy, sys\n"
         "if os.environ.get('FP8JAX_TEST_CPU_DEFAULT_COMPILE') != '1':\n"
         "  sys.path.insert(0, {tests!r})\n"
         "  import cpu_compile_fast\n"
         "  cpu_compile_fast.install()\n"
         "runpy.run_module('fp8jax.cli', run_name='__main__', alter_sys=True)\n")


def cli_command(*args: str) -> list[str]:
  """The argv of `python -m fp8jax.cli *args`, compiling for compile time."""
  return [sys.executable, "-c", _BOOT.format(tests=_TESTS), *args]
