"""The test suite's CPU programs compiled for compile time, not run time.

Most of the suite's time was XLA compiling for the CPU: eleven thousand programs, most of
them single eager operations (about 25 ms each), the rest train steps and the Mosaic
interpreter's thread programs, nearly all of which then run for milliseconds. `install()`
makes every CPU compile in this process use LLVM without optimization
(`xla_backend_optimization_level=0`) and XLA's older CPU loop emitters
(`xla_cpu_use_fusion_emitters=false`), which compile about twice as fast.

What a program computes does not depend on either option, only how fast it runs; the
deviceless H100 compiles (another backend) keep XLA's defaults, so the lowering facts the
tests prove (HLO, PTX, kernels and their costs) are those of a default compile. An option
given by the caller (`compiler_options=`) wins, and a test that runs more than it compiles
(a demo run of many steps) is marked `cpu_optimized`: its programs get XLA's defaults
(`optimized()`; a program an earlier test compiled keeps its compile).
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import re
import warnings

FAST_CPU_OPTIONS = {"xla_backend_optimization_level": 0, "xla_cpu_use_fusion_emitters": False}
_UNKNOWN_OPTION = re.compile(r"No such compile option: '(\w+)'")
_optimizing = [False]


@contextlib.contextmanager
def optimized():
  """Within it, CPU programs compile with XLA's defaults."""
  _optimizing.append(True)
  try:
    yield
  finally:
    _optimizing.pop()


def install() -> bool:
  """Wraps JAX's compile options where they have the known form; returns whether it did."""
  try:
    from jax._src import compiler
  except ImportError:
    return False
  original = getattr(compiler, "get_compile_options", None)
  if original is None or getattr(original, "fast_cpu", False):
    return original is not None
  signature = inspect.signature(original)
  if not {"env_options_overrides", "backend"} <= set(signature.parameters):
    return False
  fast = known_options(FAST_CPU_OPTIONS)

  @functools.wraps(original)
  def get_compile_options(*args, **kwargs):
    bound = signature.bind(*args, **kwargs)
    backend = bound.arguments.get("backend")
    if getattr(backend, "platform", None) == "cpu" and not _optimizing[-1]:
      overrides = dict(bound.arguments.get("env_options_overrides") or {})
      bound.arguments["env_options_overrides"] = {**fast, **overrides}
    return original(*bound.args, **bound.kwargs)

  get_compile_options.fast_cpu = True
  compiler.get_compile_options = get_compile_options
  return True


def known_options(options: dict) -> dict:
  """The options this XLA knows: each one it names as unknown is dropped (JAX 0.11's
  XLA no longer has `xla_cpu_use_fusion_emitters`, and refuses every compile given it)."""
  import jax
  import jax.numpy as jnp
  known = dict(options)
  with jax.default_device(jax.devices("cpu")[0]):
    lowered = jax.jit(lambda x: x + 1).lower(jnp.float32(1))
  while known:
    try:
      lowered.compile(known)
      return known
    except Exception as error:  # noqa: BLE001 - XLA's errors have no narrower type
      unknown = _UNKNOWN_OPTION.search(str(error))
      if unknown is None or unknown.group(1) not in known:
        raise
      warnings.warn(f"this XLA has no compile option {unknown.group(1)!r}: the suite's CPU "
                    "programs compile without it")
      del known[unknown.group(1)]
  return known
