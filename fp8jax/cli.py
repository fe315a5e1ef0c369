"""The `fp8jax` command.

    fp8jax inspect                       # the built-in example: an fp8_dense MLP train step
    fp8jax inspect --xla-defaults        # the same with XLA's default GEMM flags (Triton on)
    fp8jax inspect --factory mypkg.train:lowering_example --strict
    fp8jax inspect --hlo dump/module_0001.jit_step.sm_9.0a_gpu_after_optimizations.txt

    fp8jax cost                          # predicted H100 time: the example in FP8 vs its bf16 twin
    fp8jax cost --summary --recipe current --widths 4096,16384,4096 --batch 4 --seq 2048
    fp8jax cost --factory mypkg.train:fp8_step --baseline mypkg.train:bf16_step --json cost.json
    fp8jax cost --constant hbm_bytes_per_s=2.6e12 --constant kernel_overhead_s=4e-6

`inspect` lists every GEMM of a compiled function and what it lowered to.
`--strict` exits with status 1 unless every GEMM runs in FP8, for use in CI.
`python -m fp8jax.lowering` is `fp8jax inspect`.

`cost` predicts the time of a compiled program kernel by kernel with the
roofline of `fp8jax.lowering.cost` (one table per program, then the comparison
and the predicted speedup of the FP8 program over its bf16 baseline).
`--constant NAME=VALUE` (repeatable) overrides a `CostConstants` field, e.g.
with your own GPU's measurements (`python -m benchmarks.roofline`); `--summary`
prints the totals only; `--json PATH` also writes the full report.

`--factory MODULE:FUNCTION` (and `--baseline`) names a function of no arguments
that returns `(fn, args)`: the function to compile and a tuple of example
arguments (arrays or `jax.ShapeDtypeStruct`s). Both commands compile for an
H100 without a GPU ("deviceless", the 'hopper' extra) unless JAX has a GPU
backend (`--target` chooses), with every GEMM on cuBLAS unless `--xla-defaults`.
"""
from __future__ import annotations

import argparse
import dataclasses
import glob
import importlib
import os
import sys

from fp8jax import platform_guard as _platform_guard  # noqa: F401  (before any backend use)


def main(argv: list[str] | None = None) -> int:
  """Runs the command line; returns the exit status."""
  parser = argparse.ArgumentParser(prog="fp8jax", description=__doc__.split("\n\n")[0])
  commands = parser.add_subparsers(dest="command", required=True)
  _add_inspect_parser(commands)
  _add_cost_parser(commands)
  args = parser.parse_args(argv)
  return _inspect(args) if args.command == "inspect" else _cost(args)


def _add_compile_options(parser) -> None:
  parser.add_argument("--xla-defaults", action="store_true",
                      help="compile with XLA's default flags instead of "
                           "xla_gpu_enable_triton_gemm=False")
  parser.add_argument("--target", choices=("auto", "deviceless", "device"), default="auto",
                      help="where to compile for (default: auto)")


def _add_inspect_parser(commands) -> None:
  inspect_parser = commands.add_parser(
      "inspect", help="show what every GEMM of a compiled function lowers to on Hopper",
      description="Compile for Hopper (deviceless without a GPU) and list every GEMM.")
  source = inspect_parser.add_mutually_exclusive_group()
  source.add_argument("--factory", metavar="MODULE:FUNCTION",
                      help="a function of no arguments returning (fn, args) to compile")
  source.add_argument("--hlo", metavar="FILE",
                      help="read optimized HLO text from FILE instead of compiling "
                           "(PTX files next to it are read too)")
  _add_compile_options(inspect_parser)
  inspect_parser.add_argument("--no-ptx", action="store_true",
                              help="do not read the generated PTX")
  inspect_parser.add_argument("--strict", action="store_true",
                              help="exit with status 1 unless every GEMM runs in FP8")


def _add_cost_parser(commands) -> None:
  from fp8jax.lowering.cost import CostConstants

  names = ", ".join(f.name for f in dataclasses.fields(CostConstants))
  cost_parser = commands.add_parser(
      "cost", help="predict the H100 time of a compiled program and its speedup over bf16",
      description="Compile for Hopper (deviceless without a GPU) and predict each kernel's "
                  "time with a roofline; compare an FP8 program with its bf16 baseline.")
  example = cost_parser.add_argument_group("the built-in example (an MLP train step)")
  example.add_argument("--recipe", choices=sorted(_RECIPES), default=None,
                       help="FP8 scaling recipe (default: delayed)")
  example.add_argument("--widths", metavar="N,N,...", default=None,
                       help="layer sizes, comma-separated (default: 512,1024,1024,512)")
  example.add_argument("--batch", type=int, metavar="B", default=None,
                       help="batch size (default: 8)")
  example.add_argument("--seq", type=int, metavar="S", default=None,
                       help="sequence length (default: 256)")
  cost_parser.add_argument("--factory", metavar="MODULE:FUNCTION",
                           help="a function of no arguments returning (fn, args) to compile "
                                "instead of the example")
  cost_parser.add_argument("--baseline", metavar="MODULE:FUNCTION",
                           help="with --factory: the baseline (e.g. bf16) to compare with")
  cost_parser.add_argument("--constant", action="append", default=[], metavar="NAME=VALUE",
                           help=f"override a machine constant (repeatable); one of: {names}")
  cost_parser.add_argument("--json", metavar="PATH", help="also write the report as JSON")
  cost_parser.add_argument("--summary", action="store_true",
                           help="print the totals only, not the per-kernel tables")
  _add_compile_options(cost_parser)


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
    fn, fn_args = (_load_factory(args.factory, "--factory") if args.factory
                   else lowering.example_train_step())
    options = {} if args.xla_defaults else dict(lowering.CUBLAS_ONLY_OPTIONS)
    report = lowering.inspect(fn, *fn_args, compiler_options=options, target=args.target,
                              ptx=not args.no_ptx)
  print(report)
  if args.strict and not report.all_fp8:
    print(f"\nnot every GEMM runs in FP8: {report.summary()}", file=sys.stderr)
    return 1
  return 0


# `fp8jax cost --recipe NAME`: the public recipe each name builds.
_RECIPES = {"delayed": "DelayedScaling", "current": "CurrentScaling"}


def _cost(args) -> int:
  # By name: the package's `cost` is the function, which hides the module.
  from fp8jax.lowering.cost import compare, cost, to_json

  constants = _parse_constants(args.constant)
  if args.json:
    folder = os.path.dirname(os.path.abspath(args.json))
    if not os.path.isdir(folder):
      raise SystemExit(f"--json {args.json!r}: the folder {folder!r} does not exist.")
  programs = _cost_programs(args)
  _check_target(args.target)
  options = {} if args.xla_defaults else None  # None: every GEMM on cuBLAS
  reports = [cost(fn, *fn_args, compiler_options=options, target=args.target,
                  constants=constants, label=label)
             for label, fn, fn_args in programs]
  result = compare(*reports) if len(reports) == 2 else reports[0]
  blocks = [] if args.summary else [report.table() for report in reports]
  if len(reports) == 2:
    blocks.append(str(result))
  elif args.summary:
    blocks.append(f"{result.label}: predicted on {result.target}\ntotal: {result.totals()}")
  print("\n\n".join(blocks))
  if args.json:
    with open(args.json, "w") as f:
      f.write(to_json(result) + "\n")
    print(f"wrote {args.json}")
  return 0


def _cost_programs(args) -> list[tuple[str, object, tuple]]:
  """[(label, fn, args)]: the program, then its baseline if there is one."""
  example_flags = [flag for flag, value in (("--recipe", args.recipe), ("--widths", args.widths),
                                            ("--batch", args.batch), ("--seq", args.seq))
                   if value is not None]
  if args.factory:
    if example_flags:
      raise SystemExit(f"{example_flags[0]} applies to the built-in example, not to "
                       "--factory (set up your program in its factory).")
    programs = [(_factory_label(args.factory), *_load_factory(args.factory, "--factory"))]
    if args.baseline:
      label = _factory_label(args.baseline)
      if label == programs[0][0]:
        programs[0] = (args.factory, *programs[0][1:])
        label = args.baseline
      programs.append((label, *_load_factory(args.baseline, "--baseline")))
    return programs
  if args.baseline:
    raise SystemExit("--baseline needs --factory: the built-in example brings its own bf16 "
                     "baseline.")
  import fp8jax
  from fp8jax import lowering

  sizes = {"widths": _parse_widths(args.widths) if args.widths is not None else None,
           "batch_size": args.batch, "seq_len": args.seq}
  sizes = {name: value for name, value in sizes.items() if value is not None}
  recipe_name = args.recipe or "delayed"
  try:
    fp8 = lowering.example_train_step(recipe=getattr(fp8jax, _RECIPES[recipe_name])(), **sizes)
    bf16 = lowering.example_train_step(precision="bf16", **sizes)
  except ValueError as e:  # --widths, --batch or --seq out of range
    raise SystemExit(f"the built-in example: {e}") from None
  return [(f"fp8_train_step ({recipe_name})", *fp8), ("bf16_train_step", *bf16)]


def _parse_widths(text: str) -> tuple[int, ...]:
  try:
    return tuple(int(part) for part in text.split(","))
  except ValueError:
    raise SystemExit(f"--widths {text!r}: expected comma-separated integers, e.g. "
                     "512,1024,512.") from None


def _parse_constants(items: list[str]):
  """`CostConstants` with the `--constant NAME=VALUE` overrides."""
  from fp8jax.lowering.cost import CostConstants

  names = [f.name for f in dataclasses.fields(CostConstants)]
  overrides = {}
  for item in items:
    name, sep, value = item.partition("=")
    name = name.strip()
    if not sep or name not in names:
      raise SystemExit(f"--constant {item!r}: expected NAME=VALUE with NAME one of "
                       f"{', '.join(names)}.")
    try:
      overrides[name] = float(value)
    except ValueError:
      raise SystemExit(f"--constant {item!r}: {value!r} is not a number (e.g. "
                       f"{name}={getattr(CostConstants, name):g}).") from None
  try:
    return CostConstants(**overrides)
  except ValueError as e:
    raise SystemExit(f"--constant: {e}") from None


def _check_target(target: str) -> None:
  """Exits with one line when the compile target cannot be used here."""
  import jax

  from fp8jax import deviceless

  try:
    has_gpu = jax.default_backend() == "gpu"
  except RuntimeError:
    has_gpu = False
  if target == "device" and not has_gpu:
    raise SystemExit(f"--target device needs a JAX GPU backend, but the default backend is "
                     f"{jax.default_backend()!r}; use --target deviceless (or auto) to compile "
                     "for an H100 without a GPU.")
  if target == "deviceless" or (target == "auto" and not has_gpu):
    missing = deviceless.deviceless_toolchain_missing()
    if missing:
      raise SystemExit(f"cannot compile for an H100 without a GPU: {missing}")


def _factory_label(spec: str) -> str:
  return spec.partition(":")[2] or spec


def _load_factory(spec: str, flag: str = "--factory"):
  """(fn, args) from the function of no arguments `spec` ('MODULE:FUNCTION') names."""
  module_name, sep, attr = spec.partition(":")
  if not sep or not module_name or not attr:
    raise SystemExit(f"{flag} {spec!r}: expected MODULE:FUNCTION, e.g. mypkg.train:example.")
  sys.path.insert(0, os.getcwd())
  try:
    module = importlib.import_module(module_name)
  except ImportError as e:
    raise SystemExit(f"{flag} {spec!r}: cannot import {module_name!r} ({e}).") from None
  factory = getattr(module, attr, None)
  if not callable(factory):
    raise SystemExit(f"{flag} {spec!r}: {module_name} has no function {attr!r}.")
  result = factory()
  if not (isinstance(result, tuple) and len(result) == 2 and callable(result[0])):
    raise SystemExit(f"{flag} {spec!r} must return (fn, args), got {type(result).__name__}.")
  fn, fn_args = result
  if not isinstance(fn_args, (tuple, list)):
    raise SystemExit(f"{flag} {spec!r} must return (fn, args) with args a tuple of the "
                     f"arguments, got args of type {type(fn_args).__name__}.")
  _check_leaves(fn_args, f"{flag} {spec!r}")
  return fn, tuple(fn_args)


def _check_leaves(fn_args, where: str) -> None:
  import jax

  for path, leaf in jax.tree_util.tree_leaves_with_path(tuple(fn_args)):
    if not (hasattr(leaf, "shape") and hasattr(leaf, "dtype")):
      raise SystemExit(f"{where}: args{jax.tree_util.keystr(path)} is a {type(leaf).__name__} "
                       f"({leaf!r}); every leaf must be an array or a jax.ShapeDtypeStruct "
                       "(close over Python values in fn instead).")


if __name__ == "__main__":
  sys.exit(main())
