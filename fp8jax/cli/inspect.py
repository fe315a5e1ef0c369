"""`fp8jax inspect`: what every GEMM of a compiled function lowers to on Hopper."""
from __future__ import annotations

import glob
import os
import sys

from fp8jax.cli.compile_options import add_compile_options
from fp8jax.cli.errors import CommandError, add_traceback_option, report_user_errors
from fp8jax.cli.factory import load_factory


def add_parser(commands) -> None:
  inspect_parser = commands.add_parser(
      "inspect", help="show what every GEMM of a compiled function lowers to on Hopper",
      description="Compile for Hopper (deviceless without a GPU) and list every GEMM.")
  source = inspect_parser.add_mutually_exclusive_group()
  source.add_argument("--factory", metavar="MODULE:FUNCTION",
                      help="a function of no arguments returning (fn, args) to compile")
  source.add_argument("--hlo", metavar="FILE",
                      help="read optimized HLO text from FILE instead of compiling "
                           "(PTX files next to it are read too)")
  add_compile_options(inspect_parser)
  add_traceback_option(inspect_parser)
  inspect_parser.add_argument("--no-ptx", action="store_true",
                              help="do not read the generated PTX")
  inspect_parser.add_argument("--strict", action="store_true",
                              help="exit with status 1 unless every GEMM runs in FP8")


def run(args) -> int:
  return report_user_errors(lambda: _inspect(args), show_traceback=args.traceback)


def _inspect(args) -> int:
  """Prints what every GEMM lowers to; status 1 with --strict unless all run in FP8."""
  from fp8jax import lowering

  if args.hlo:
    if not os.path.isfile(args.hlo):
      raise CommandError(f"--hlo {args.hlo!r}: no such file; pass an optimized HLO text file "
                         "(XLA_FLAGS=--xla_dump_to=DIR writes *after_optimizations.txt).")
    with open(args.hlo) as f:
      hlo = f.read()
    ptx = []
    if not args.no_ptx:
      for path in sorted(glob.glob(os.path.join(os.path.dirname(os.path.abspath(args.hlo)),
                                                "*.ptx"))):
        with open(path) as f:
          ptx.append(f.read())
    report = lowering.inspect_hlo(hlo, ptx_texts=ptx, target=os.path.basename(args.hlo))
  else:
    fn, fn_args = (load_factory(args.factory, "--factory") if args.factory
                   else lowering.example_train_step())
    options = {} if args.xla_defaults else dict(lowering.CUBLAS_ONLY_OPTIONS)
    report = lowering.inspect(fn, *fn_args, compiler_options=options, target=args.target,
                              ptx=not args.no_ptx)
  print(report)
  if args.strict and not report.gemms:
    print("\nfp8jax: --strict: the program has no GEMMs, so none runs in FP8; inspect the "
          "function that does the matmuls (e.g. the train step, not a helper).",
          file=sys.stderr)
    return 1
  if args.strict and not report.all_fp8:
    print(f"\nnot every GEMM runs in FP8: {report.summary()}", file=sys.stderr)
    return 1
  return 0
