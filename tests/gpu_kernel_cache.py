"""XLA's kernel cache for the test processes' deviceless H100 compiles.

About a third of a deviceless compile of the tiny demo GPT's step was ptxas, once per
kernel (80 calls, 5 s), and the budget tests compile dozens of programs whose kernels are
mostly the same (2 and 3 layers, bf16, delayed and current scaling). Given
`xla_gpu_kernel_cache_file`, XLA compiles a kernel it finds in that file only once: a
second program of the same step took 7 s instead of 13. `install(path)` passes it to
every `fp8jax.deviceless.compile_for_h100` of this process (through its compiler options,
not XLA_FLAGS, which JAX's persistent cache keys the CPU programs by). XLA rewrites the
file whole after a compile, so each process has a file of its own. A compile that dumps
its PTX leaves the cache out (`compile_for_h100` does): a cached kernel is not compiled
again, so its PTX would be missing from the dump.
"""
from __future__ import annotations

import functools

_OPTION = "xla_gpu_kernel_cache_file"


def install(path: str) -> None:
  """Every deviceless H100 compile of this process without a dump uses the cache at `path`."""
  from fp8jax import deviceless
  original = deviceless.compile_for_h100
  if getattr(original, "kernel_cache", None):
    return

  @functools.wraps(original)
  def compile_for_h100(fn, *args, compiler_options=None, dump_dir=None, **kwargs):
    options = dict(compiler_options or {})
    if dump_dir is None:
      options.setdefault(_OPTION, path)
    return original(fn, *args, compiler_options=options, dump_dir=dump_dir, **kwargs)

  compile_for_h100.kernel_cache = path
  deviceless.compile_for_h100 = compile_for_h100
