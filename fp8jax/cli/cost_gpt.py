"""`fp8jax cost --gpt SIZE`: the demo GPT's train step for an H100, FP8 beside bf16, with memory.

    fp8jax cost --gpt 1b --batch 8 --seq 2048             # time and memory, FP8 vs bf16
    fp8jax cost --gpt 1b --seq 2048 --fit 80GiB           # the largest batch of each that fits
    fp8jax cost --gpt 125m --fp8-layers auto              # FP8 only where it pays

The FP8 step uses the memory features by default (FP8 Adam moments, FP8 saved
activations); `--optimizer adamw --saved-activations default` gives the plain FP8 model.
The baseline is always the bf16 twin with float32 AdamW. Both are the demo's step
(`fp8jax.runs.gpt_program`), compiled without a GPU for an H100 unless --target device.
"""
from __future__ import annotations

import importlib.util
import json

from fp8jax.cli.errors import CommandError


def add_gpt_options(parser, recipes) -> None:
  """The options of the GPT program (beside the built-in example's --recipe/--batch/--seq)."""
  group = parser.add_argument_group("the demo GPT (fp8jax.models.gpt)")
  group.add_argument("--gpt", metavar="SIZE", default=None,
                     help="the demo GPT's train step at this size (tiny, small, 125m, 350m, "
                          "1b) instead of the example; --batch (default 8) and --seq "
                          "(default: the size's) apply; prints memory beside time")
  group.add_argument("--optimizer", choices=("adamw", "adamw_fp8"), default=None,
                     help="with --gpt: the FP8 step's optimizer (default adamw_fp8: FP8 "
                          "moments); the bf16 baseline keeps float32 AdamW")
  group.add_argument("--saved-activations", choices=("default", "fp8"), default=None,
                     help="with --gpt: what the FP8 step's backward keeps of norms, GELU and "
                          "attention output (default fp8)")
  group.add_argument("--fp8-layers", choices=("all", "auto"), default=None,
                     help="with --gpt: the FP8 step's projections in FP8: all (default), or "
                          "auto: where the cost model predicts FP8 no slower than bf16 "
                          "(GptConfig.fp8_layers)")
  group.add_argument("--experts", type=int, metavar="E", default=None,
                     help="with --gpt: each block's MLP a mixture of E experts (both steps; "
                          "the FP8 one runs its expert GEMMs on the grouped FP8 kernels)")
  group.add_argument("--top-k", type=int, metavar="K", default=None,
                     help="with --gpt --experts: experts per token (default 2)")
  group.add_argument("--fit", metavar="MEMORY", default=None,
                     help="with --gpt: find by compiles (shown on a progress bar) the "
                          "largest batch of each step that fits this much device memory, "
                          "e.g. 80GiB; at least the steps' parameters and optimizer state")


def gpt_flags_without_gpt(args) -> list[str]:
  """The GPT-only options given without --gpt (each is an error)."""
  return [flag for flag, value in (("--optimizer", args.optimizer),
                                   ("--saved-activations", args.saved_activations),
                                   ("--fp8-layers", args.fp8_layers),
                                   ("--experts", args.experts), ("--top-k", args.top_k),
                                   ("--fit", args.fit)) if value is not None]


def predict(args, constants) -> int:
  """Compiles the FP8 and bf16 GPT steps; prints time, memory and (--fit) largest batches."""
  from fp8jax.lowering import memory as memory_lib
  from fp8jax.lowering.cost import compare
  from fp8jax.models import gpt
  from fp8jax.runs import gpt_program
  from fp8jax.runs.config import RunError

  capacity = None
  if args.fit is not None:
    try:
      capacity = memory_lib.parse_bytes(args.fit)
    except ValueError as e:
      raise CommandError(f"--fit: {e}") from None
    check_progress_bar("--fit")
  if args.top_k is not None and not args.experts:
    raise CommandError(f"--top-k {args.top_k} routes tokens among experts, and this GPT's MLP "
                       "is dense; add --experts N (N >= --top-k).")
  try:
    size = gpt.SIZES.get(args.gpt)
    # None is "not given"; 0 is a value, which GptProgram refuses.
    seq = args.seq if args.seq is not None else (size.seq_len if size is not None else 1)
    moe = dict(experts=args.experts or 0, top_k=2 if args.top_k is None else args.top_k)
    fp8 = gpt_program.GptProgram(size=args.gpt, batch=8 if args.batch is None else args.batch,
                                 seq=seq,
                                 recipe=args.recipe or "delayed",
                                 optimizer=args.optimizer or "adamw_fp8",
                                 saved_activations=args.saved_activations or "fp8",
                                 fp8_layers=args.fp8_layers or "all", **moe)
    bf16 = gpt_program.GptProgram(size=args.gpt, batch=fp8.batch, seq=seq, recipe="bf16",
                                  optimizer="adamw", saved_activations="default", **moe)
  except RunError as e:
    raise CommandError(str(e)) from None
  if capacity is not None:
    _check_capacity(args.fit, capacity, args.gpt, (fp8, bf16))
  target = args.target
  measured = [gpt_program.measure(p, target=target, constants=constants) for p in (fp8, bf16)]
  (fp8_time, fp8_memory, fp8_attention), (bf16_time, bf16_memory, bf16_attention) = measured
  blocks = [] if args.summary else [fp8_time.table(), bf16_time.table()]
  experts = f", {fp8.experts} experts (top {fp8.top_k})" if fp8.experts else ""
  chip = "" if args.chip == "h100" else f", predicted for an {args.chip.upper()}"
  blocks.append(f"the demo GPT {args.gpt}{experts}, batch {fp8.batch} x seq {seq}, train step "
                f"(params, optimizer and FP8 state donated), on {fp8_time.target}{chip}")
  blocks.append(str(compare(fp8_time, bf16_time)))
  blocks.append(memory_table(fp8_memory, bf16_memory, args.chip))
  blocks.append(attention_lines({fp8.label: fp8_attention, bf16.label: bf16_attention}))
  if fp8.fp8_layers == "auto":
    blocks.append(fp8_layers_line(fp8))
  report = {"program": {"gpt": args.gpt, "batch": fp8.batch, "seq": seq, **moe,
                       "fp8_layers": fp8.fp8_layers},
            "target": fp8_time.target, "chip": args.chip,
            "time": {"predicted_speedup": compare(fp8_time, bf16_time).speedup,
                     "fp8": fp8_time.summary(), "bf16": bf16_time.summary()},
            "memory": {"fp8": fp8_memory.to_dict(), "bf16": bf16_memory.to_dict()},
            "attention": {"fp8": _choice_dict(fp8_attention),
                          "bf16": _choice_dict(bf16_attention)}}
  if capacity is not None:
    fits = largest_batches((fp8, bf16), capacity, target)
    blocks.append(fit_lines(fits, capacity))
    report["fit"] = {"capacity": capacity,
                     **{label: {"batch": batch, "memory": m.to_dict() if m else None}
                        for label, (batch, m) in fits.items()}}
  print("\n\n".join(blocks))
  if args.json:
    with open(args.json, "w") as f:
      json.dump(report, f, indent=1)
      f.write("\n")
    print(f"wrote {args.json}")
  return 0


def check_progress_bar(flag: str) -> None:
  """A one-line error now, not at the end of the first compile, when tqdm is missing."""
  if importlib.util.find_spec("tqdm") is None:
    raise CommandError(f"{flag} shows its compiles on a progress bar, which needs tqdm: "
                       "pip install 'fp8jax[examples]'.")


def _check_capacity(text: str, capacity: int, size: str, programs) -> None:
  """Refuses a capacity that holds neither step's parameters and optimizer state, before
  anything compiles (a batch can only add to them)."""
  from fp8jax.runs import gpt_program

  state = {program.label: gpt_program.state_bytes(program) for program in programs}
  if capacity < min(state.values()):
    steps = " and ".join(f"{_amount(b)} ({label})" for label, b in state.items())
    raise CommandError(f"--fit {text}: the {size} GPT's parameters, optimizer state and FP8 "
                       f"state alone take {steps}; give more than "
                       f"{_amount(min(state.values()))} (an H100 has 80GiB).")


def largest_batches(programs, capacity: int, target: str) -> dict:
  """{label: (batch, report)}: each program's largest batch that fits, its compiles shown
  on a progress bar (each is a deviceless compile of the whole step: seconds to minutes)."""
  from fp8jax.runs import gpt_program
  from tqdm import tqdm  # optional (the 'examples' extra): only for a progress bar

  fits = {}
  with tqdm(desc=f"--fit {_amount(capacity)}", unit="compile", dynamic_ncols=True) as bar:
    for program in programs:
      def compiled(batch, report, label=program.label):
        verdict = "fits" if report.fits(capacity) else "does not fit"
        bar.set_postfix_str(f"{label}: batch {batch} {verdict} ({_amount(report.total)})")
        bar.update(1)

      bar.set_postfix_str(f"{program.label}: compiling")
      fits[program.label] = gpt_program.largest_batch(program, capacity, target=target,
                                                      on_compile=compiled)
  return fits


def _amount(n_bytes: int) -> str:
  from fp8jax.lowering.memory import GIB

  return f"{n_bytes / GIB:.2f} GiB" if n_bytes >= GIB // 10 else f"{n_bytes / 2**20:.1f} MiB"


def memory_table(fp8, bf16, chip: str = "h100") -> str:
  """Arguments, temp and total of both steps, their ratio, and the share of the chip's memory."""
  from fp8jax.lowering.memory import CHIP_MEMORY, GIB

  capacity = CHIP_MEMORY[chip]

  width = max(32, len(fp8.label), len(bf16.label))  # labels whole, never cut
  header = (f"{'memory':<{width}} {'arguments':>10} {'temp':>10} {'total':>10}  "
            f"of {capacity // GIB} GiB")
  lines = [header, "-" * len(header)]
  for report in (fp8, bf16):
    note = "" if report.fits(capacity) else "  (does not fit)"
    lines.append(f"{report.label:<{width}} {report.arguments / GIB:>6.2f} GiB "
                 f"{report.temp / GIB:>6.2f} GiB {report.total / GIB:>6.2f} GiB  "
                 f"{100 * report.total / capacity:>5.0f}%{note}")
  ratio = lambda a, b: f"{a / b:.2f}x" if b else "-"
  lines.append(f"{'FP8 / bf16':<{width}} {ratio(fp8.arguments, bf16.arguments):>10} "
               f"{ratio(fp8.temp, bf16.temp):>10} {ratio(fp8.total, bf16.total):>10}")
  return "\n".join(lines)


def attention_lines(choices: dict) -> str:
  lines = []
  for label, choice in choices.items():
    lines.append(f"attention ({label}): {choice.name}" +
                 (f": {choice.reason}" if choice.reason else ""))
  return "\n".join(lines)


def fit_lines(fits: dict, capacity: int) -> str:
  from fp8jax.lowering.memory import GIB

  lines = [f"largest batch that fits {capacity / GIB:.1f} GiB (by deviceless compiles):"]
  for label, (batch, report) in fits.items():
    where = f" (total {report.total / GIB:.2f} GiB)" if report else ""
    lines.append(f"  {label:<32} {batch:>5}{where}")
  (fp8_batch, _), (bf16_batch, _) = fits.values()
  if bf16_batch:
    lines.append(f"  FP8 / bf16: {fp8_batch / bf16_batch:.2f}x")
  return "\n".join(lines)


def fp8_layers_line(program) -> str:
  """Which projections the FP8 step runs in FP8 under --fp8-layers auto."""
  from fp8jax.models import gpt_fp8_layers
  from fp8jax.runs.config import base_recipe

  fp8 = gpt_fp8_layers.fp8_projections(program.config(), base_recipe(program.recipe))
  bf16 = [name for name in gpt_fp8_layers.PROJECTIONS if name not in fp8]
  return (f"projections (--fp8-layers auto): in FP8 {', '.join(fp8) or 'none'}; in bf16 "
          f"{', '.join(bf16) or 'none'} (the cost model at 4096 tokens)")


def _choice_dict(choice) -> dict:
  return {"backend": choice.name, "reason": choice.reason}
