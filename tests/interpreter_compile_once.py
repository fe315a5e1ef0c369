"""Mosaic GPU's CPU interpreter, with each kernel thread's program compiled once.

JAX's interpreter runs the threads of a CTA (`_run_jaxpr` in
jax/_src/pallas/mosaic/interpret/thread_map.py) by compiling the thread's program with
`jit(...).trace(...).lower().compile()` in every thread of every CTA: the same program,
compiled CTAs x threads times per kernel call, which was most of the time of the
interpreter tests (2 s of XLA per compile, ~50 compiles per test). Its comment expects
JAX's caches to compile it once; they do not (an explicit `.compile()` bypasses them, and
the program's callbacks keep it out of the persistent cache).

`install()` replaces `_run_jaxpr` with the same steps, keeping the compiled program per
(jaxpr, argument types): every thread still runs the whole program with its own thread id
and the same callbacks, so the interpreter (its race detection too) does what it did.
"""
from __future__ import annotations

import collections
import inspect
import threading

# The line of JAX's `_run_jaxpr` this replaces: a JAX whose function differs keeps its own.
_COMPILED_PER_CALL = "traced.lower().compile()(consts, *args)"
# Compiled thread programs kept per process: a test's kernels need a few.
_KEEP = 64


def install() -> bool:
  """Replaces JAX's `_run_jaxpr` where it has the known form; returns whether it did."""
  try:
    from jax._src.pallas.mosaic.interpret import thread_map
  except ImportError:
    return False
  original = getattr(thread_map, "_run_jaxpr", None)
  if original is None or _COMPILED_PER_CALL not in inspect.getsource(original):
    return False
  thread_map._run_jaxpr = _run_jaxpr_compiled_once()
  return True


def _run_jaxpr_compiled_once():
  import jax

  compiled = collections.OrderedDict()
  lock = threading.Lock()

  def run(jaxpr, consts, *args):
    jax.core.eval_jaxpr(jaxpr, consts, *args)

  def run_jaxpr(jaxpr, consts, *args):
    # The jaxpr itself is in the key (equal only to itself, and kept alive here), so a
    # new kernel never runs an old one's program.
    key = (jaxpr, tuple(jax.typeof(x) for x in jax.tree.leaves((consts, args))))
    with lock:   # a CTA's threads arrive together: the first compiles, the others wait
      program = compiled.pop(key, None)
      if program is None:
        program = jax.jit(run, static_argnums=(0,)).trace(jaxpr, consts, *args).lower().compile()
      compiled[key] = program
      while len(compiled) > _KEEP:
        compiled.popitem(last=False)
    program(consts, *args)

  return run_jaxpr
