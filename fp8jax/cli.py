"""The `fp8jax` command.

    fp8jax inspect                       # the built-in example: an fp8_dense MLP train step
    fp8jax inspect --xla-defaults        # the same with XLA's default GEMM flags (Triton on)
    fp8jax inspect --factory mypkg.train:lowering_example --strict
    fp8jax inspect --hlo dump/module_0001.jit_step.sm_9.0a_gpu_after_optimizations.txt

`--factory MODULE:FUNCTION` names a function of no arguments that returns
`(fn, args)`: the function to compile and a tuple of example arguments (arrays
or `jax.ShapeDtypeStruct`s). `--strict` exits with status 1 unless every GEMM
runs in FP8, for use in CI. `python -m fp8jax.lowering` is `fp8jax inspect`.
"""
from __future__ import annotations

import argparse
import glob
import importlib
import os
import sys

from fp8jax import platform_guard as _platform_guard  # noqa: F401  (before any backend use)


def main(argv: list[str] | None = None) -> int:
  """Runs the command line; returns the exit status."""
  parser = argparse.ArgumentParser(prog="fp8jax", description=__doc__.split("\n\n")[0])
  commands = parser.add_subparsers(dest="command", required=True)
  inspect_parser = commands.add_parser(
      "inspect", help="show what every GEMM of a compiled function lowers to on Hopper",
      description="Compile for Hopper (deviceless without a GPU) and list every GEMM.")
  source = inspect_parser.add_mutually_exclusive_group()
  source.add_argument("--factory", metavar="MODULE:FUNCTION",
                      help="a function of no arguments returning (fn, args) to compile")
  source.add_argument("--hlo", metavar="FILE",
                      help="read optimized HLO text from FILE instead of compiling "
                           "(PTX files next to it are read too)")
  inspect_parser.add_argument("--xla-defaults", action="store_true",
                              help="compile with XLA's default flags instead of "
                                   "xla_gpu_enable_triton_gemm=False")
  inspect_parser.add_argument("--target", choices=("auto", "deviceless", "device"),
                              default="auto", help="where to compile for (default: auto)")
  inspect_parser.add_argument("--no-ptx", action="store_true",
                              help="do not read the generated PTX")
  inspect_parser.add_argument("--strict", action="store_true",
                              help="exit with status 1 unless every GEMM runs in FP8")
  args = parser.parse_args(argv)
  return _inspect(args)


def _inspect(args) -> int:
  from fp8jax import lowering

  if args.hlo:
    if not os.path.isfile(args.hlo):
      raise SystemExit(f"--hlo {args.hlo!r}: no such file; pass an optimized HLO text file "
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
    fn, fn_args = _load_factory(args.factory) if args.factory else lowering.example_train_step()
    options = {} if args.xla_defaults else dict(lowering.CUBLAS_ONLY_OPTIONS)
    report = lowering.inspect(fn, *fn_args, compiler_options=options, target=args.target,
                              ptx=not args.no_ptx)
  print(report)
  if args.strict and not report.all_fp8:
    print(f"\nnot every GEMM runs in FP8: {report.summary()}", file=sys.stderr)
    return 1
  return 0


def _load_factory(spec: str):
  module_name, sep, attr = spec.partition(":")
  if not sep or not module_name or not attr:
    raise SystemExit(f"--factory {spec!r}: expected MODULE:FUNCTION, e.g. mypkg.train:example.")
  sys.path.insert(0, os.getcwd())
  try:
    module = importlib.import_module(module_name)
  except ImportError as e:
    raise SystemExit(f"--factory {spec!r}: cannot import {module_name!r} ({e}).") from None
  factory = getattr(module, attr, None)
  if not callable(factory):
    raise SystemExit(f"--factory {spec!r}: {module_name} has no function {attr!r}.")
  result = factory()
  if not (isinstance(result, tuple) and len(result) == 2 and callable(result[0])):
    raise SystemExit(f"--factory {spec!r} must return (fn, args), got {type(result).__name__}.")
  fn, fn_args = result
  return fn, tuple(fn_args)


if __name__ == "__main__":
  sys.exit(main())
