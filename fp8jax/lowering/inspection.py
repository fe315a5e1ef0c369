"""`inspect`: compile a function for Hopper and report what each GEMM became."""
from __future__ import annotations

from typing import Callable, Mapping, Sequence

from fp8jax.lowering.compile import compile_text
from fp8jax.lowering.gemms import find_gemms
from fp8jax.lowering.hlo_text import parse_hlo_module
from fp8jax.lowering.ptx import mma_by_kernel
from fp8jax.lowering.report import LoweringReport

#: XLA options under which every fp8jax GEMM is a cuBLASLt FP8 GEMM. With Triton
#: GEMMs enabled, XLA may give an FP8 dot to a Triton kernel instead (see the
#: package docstring for what that kernel does with FP8 operands).
CUBLAS_ONLY_OPTIONS = {"xla_gpu_enable_triton_gemm": False}


def inspect(fn: Callable, *args, compiler_options: Mapping | None = None, target: str = "auto",
            static_argnums: Sequence[int] = (), ptx: bool = True) -> LoweringReport:
  """Compiles `jax.jit(fn)(*args)` for Hopper and lists every GEMM in the optimized HLO.

  Nothing runs; only shapes and dtypes of `args` are used. Without a GPU the
  compile is deviceless (an H100 SXM target; needs the 'hopper' extra).

  Args:
    fn: the function, e.g. a train step (jitted or not).
    *args: example arguments: pytrees of arrays or `jax.ShapeDtypeStruct`s.
    compiler_options: XLA options; None means XLA's defaults. Pass
      `CUBLAS_ONLY_OPTIONS` to keep Triton from taking GEMMs.
    target: "auto" (the local GPU if JAX has one, else deviceless), "deviceless" or "device".
    static_argnums: arguments of `fn` that are static under `jax.jit`.
    ptx: also read the PTX of the kernels XLA generates, which shows whether a
      Triton GEMM uses FP8 tensor-core instructions.

  Returns:
    A `LoweringReport`; `print(report)` shows a table, `report.all_fp8` is the verdict.
  """
  options = dict(compiler_options or {})
  compiled = compile_text(fn, *args, compiler_options=options, target=target,
                          static_argnums=static_argnums, collect_ptx=ptx)
  return inspect_hlo(compiled.hlo, ptx_texts=compiled.ptx.values(), target=compiled.target,
                     compiler_options=options)


def inspect_hlo(hlo: str, ptx_texts=(), target: str = "given HLO",
                compiler_options: Mapping | None = None) -> LoweringReport:
  """The report for optimized HLO text you already have (e.g. an XLA dump of a GPU run).

  Args:
    hlo: optimized HLO text: `compiled.as_text()`, or the
      `*.sm_9.0a_gpu_after_optimizations.txt` file `XLA_FLAGS=--xla_dump_to=DIR` writes.
    ptx_texts: optional PTX texts (the `*.ptx` files of the same dump).
    target: a label for the report.
    compiler_options: the options it was compiled with, for the report's header
      (None: not known).

  Returns:
    A `LoweringReport`.
  """
  if not isinstance(hlo, str):
    raise TypeError(f"hlo must be the HLO text (str), got {type(hlo).__name__}.")
  module = parse_hlo_module(hlo)
  gemms = find_gemms(module, mma_by_kernel(ptx_texts))
  options = dict(compiler_options) if compiler_options is not None else None
  return LoweringReport(target=target, compiler_options=options,
                        gemms=gemms, hlo=hlo)
