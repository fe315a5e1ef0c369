"""`fp8jax cost`: the predicted H100 time of a compiled program, kernel by kernel."""
from __future__ import annotations

import dataclasses
import os

from fp8jax.cli import cost_gpt
from fp8jax.cli.compile_options import add_compile_options, check_target
from fp8jax.cli.cost_gpt import add_gpt_options
from fp8jax.cli.errors import CommandError, add_traceback_option, report_user_errors
from fp8jax.cli.factory import factory_label, load_factory

# `fp8jax cost --recipe NAME`: the public recipe each name builds.
_RECIPES = {"delayed": "DelayedScaling", "current": "CurrentScaling"}


def add_parser(commands) -> None:
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
  cost_parser.add_argument("--chip", choices=("h100", "h200"), default="h100",
                           help="the GPU to predict for: its calibrated constants and its "
                                "memory (the program is compiled for Hopper either way; "
                                "default: h100)")
  cost_parser.add_argument("--constant", action="append", default=[], metavar="NAME=VALUE",
                           help=f"override a machine constant (repeatable); one of: {names}")
  example.add_argument("--mesh", metavar="AXIS=N,...", default=None,
                       help="compile for one host of N H100s (e.g. data=8, or data=4,model=2): "
                            "the batch split over the first axis, the rest replicated; the "
                            "report is per device, collectives over NVLink included")
  example.add_argument("--fsdp", action="store_true",
                       help="with --mesh: also split each weight's rows over the first axis")
  add_gpt_options(cost_parser, _RECIPES)
  cost_parser.add_argument("--json", metavar="PATH", help="also write the report as JSON")
  cost_parser.add_argument("--summary", action="store_true",
                           help="print the totals only, not the per-kernel tables")
  add_compile_options(cost_parser)
  add_traceback_option(cost_parser)


def run(args) -> int:
  return report_user_errors(lambda: _predict(args), show_traceback=args.traceback)


def _predict(args) -> int:
  """Compiles the programs, prints their predicted times (and writes --json); the status."""
  # By name: the package's `cost` is the function, which hides the module.
  from fp8jax.lowering.cost import compare, cost, to_json

  constants = _parse_constants(args.constant, args.chip)
  if args.json:
    folder = os.path.dirname(os.path.abspath(args.json))
    if not os.path.isdir(folder):
      raise CommandError(f"--json {args.json!r}: the folder {folder!r} does not exist.")
  if args.gpt is not None:
    if args.factory or args.mesh or args.widths:
      raise CommandError("--gpt compiles the demo GPT's step; drop --factory, --mesh and "
                         "--widths (they describe other programs).")
    check_target(args.target)
    return cost_gpt.predict(args, constants)
  misplaced = cost_gpt.gpt_flags_without_gpt(args)
  if misplaced:
    raise CommandError(f"{misplaced[0]} applies to the demo GPT: add --gpt SIZE.")
  programs = _cost_programs(args)
  check_target(args.target)
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
                                            ("--batch", args.batch), ("--seq", args.seq),
                                            ("--mesh", args.mesh),
                                            ("--fsdp", True if args.fsdp else None))
                   if value is not None]
  if args.fsdp and not args.mesh:
    raise CommandError("--fsdp needs --mesh (e.g. --mesh data=8 --fsdp).")
  if args.factory:
    if example_flags:
      raise CommandError(f"{example_flags[0]} applies to the built-in example, not to "
                         "--factory (set up your program in its factory).")
    programs = [(factory_label(args.factory), *load_factory(args.factory, "--factory"))]
    if args.baseline:
      label = factory_label(args.baseline)
      if label == programs[0][0]:
        programs[0] = (args.factory, *programs[0][1:])
        label = args.baseline
      programs.append((label, *load_factory(args.baseline, "--baseline")))
    return programs
  if args.baseline:
    raise CommandError("--baseline needs --factory: the built-in example brings its own bf16 "
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
    raise CommandError(f"the built-in example: {e}") from None
  if args.mesh:
    mesh = _parse_mesh(args.mesh)
    fp8 = (fp8[0], lowering.example.on_mesh(fp8[1], mesh, fsdp=args.fsdp))
    bf16 = (bf16[0], lowering.example.on_mesh(bf16[1], mesh, fsdp=args.fsdp))
  return [(f"fp8_train_step ({recipe_name})", *fp8), ("bf16_train_step", *bf16)]


def _parse_mesh(text: str):
  """`--mesh data=8` or `data=4,model=2` as a deviceless H100 mesh."""
  from fp8jax import deviceless

  axes = {}
  for item in text.split(","):
    name, sep, size = item.partition("=")
    if not sep or not name.strip().isidentifier() or not size.strip().isdigit():
      raise CommandError(f"--mesh {text!r}: expected AXIS=N pairs separated by commas, e.g. "
                         "data=8 or data=4,model=2.")
    axes[name.strip()] = int(size)
  total = 1
  for size in axes.values():
    total *= size
  if not 1 <= total <= 8:
    raise CommandError(f"--mesh {text!r}: {total} devices; one H100 host has 1 to 8 GPUs.")
  try:
    return deviceless.h100_mesh(**axes)
  except (ValueError, RuntimeError) as e:
    raise CommandError(f"--mesh {text!r}: {e}") from None


def _parse_widths(text: str) -> tuple[int, ...]:
  try:
    return tuple(int(part) for part in text.split(","))
  except ValueError:
    raise CommandError(f"--widths {text!r}: expected comma-separated integers, e.g. "
                       "512,1024,512.") from None


def _parse_constants(items: list[str], chip: str = "h100"):
  """The chip's `CostConstants` with the `--constant NAME=VALUE` overrides."""
  from fp8jax.lowering.cost import CHIP_CONSTANTS, CostConstants

  names = [f.name for f in dataclasses.fields(CostConstants)]
  overrides = {}
  for item in items:
    name, sep, value = item.partition("=")
    name = name.strip()
    if not sep or name not in names:
      raise CommandError(f"--constant {item!r}: expected NAME=VALUE with NAME one of "
                         f"{', '.join(names)}.")
    try:
      overrides[name] = float(value)
    except ValueError:
      raise CommandError(f"--constant {item!r}: {value!r} is not a number (e.g. "
                         f"{name}={getattr(CostConstants, name):g}).") from None
  try:
    return dataclasses.replace(CHIP_CONSTANTS[chip], **overrides)
  except ValueError as e:
    raise CommandError(f"--constant: {e}") from None
