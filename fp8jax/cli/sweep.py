"""`fp8jax sweep`: the demo GPT trained over a grid of FP8 recipes and knobs, one table."""
from __future__ import annotations

from fp8jax.cli.run_options import add_run_options, config_from, run_guarded

# knob -> (flag help, parser of one value, example)
_KNOB_FLAGS = {
    "history": ("amax history lengths of delayed scaling", "int", "1,16"),
    "margin": ("margins: scales divided by 2**margin", "int", "0,1"),
    "amax_algo": ("amax of the history window: max, most_recent", "str", "max,most_recent"),
    "format": ("FP8 formats: hybrid (E4M3 forward, E5M2 gradients), e4m3", "str",
               "hybrid,e4m3"),
    "power_of_two": ("scales rounded down to powers of two: 0, 1", "bool", "0,1"),
    "high_precision": ("GEMMs kept in bf16: none, or fprop, dgrad, wgrad joined by +", "tuple",
                       "none,wgrad,dgrad+wgrad"),
    "block_size": ("tile sizes of block scaling", "int", "64,128"),
    "scale_rounding": ("MXFP8 shared-scale rules: floor (OCP), round_up (NVIDIA)", "str",
                       "floor,round_up"),
    "weight_blocks": ("NVFP4 weight blocks: 16x16, 1x16", "str", "16x16,1x16"),
    "hadamard": ("NVFP4's Hadamard transform of the wgrad inputs: 0, 1", "bool", "0,1"),
    "stochastic_rounding": ("NVFP4's stochastic rounding of gradients: 0, 1", "bool", "0,1"),
}


def add_parser(commands) -> None:
  parser = commands.add_parser(
      "sweep", help="train the demo GPT over a grid of FP8 recipes and knobs and compare",
      description="Train the byte-level GPT once per combination of recipe and knob values "
                  "(a knob multiplies only the recipes it applies to; bf16 runs once as the "
                  "baseline); print a table and write sweep.json, sweep_loss.png, "
                  "sweep_numerics.png and each run's metrics to --out.")
  add_run_options(parser, default_out="out/sweep")
  parser.add_argument("--recipes", default="bf16,delayed,current",
                      help="comma-separated recipes (default bf16,delayed,current)")
  for knob, (help_text, _, example) in _KNOB_FLAGS.items():
    parser.add_argument(f"--{knob.replace('_', '-')}", dest=f"knob_{knob}", metavar="V,V,...",
                        default=None, help=f"{help_text}, e.g. {example}")
  parser.add_argument("--telemetry-every", type=int, default=None, metavar="N",
                      help="FP8 telemetry every N steps (default: about 20 per run)")
  parser.add_argument("--predict-size", type=int, default=4096, metavar="N",
                      help="layer size n of the predicted speedup (x and kernel [n, n]; "
                           "default 4096)")
  parser.add_argument("--no-predict", action="store_true",
                      help="skip the cost model's predicted speedup (deviceless compiles)")


def run(args) -> int:
  from fp8jax.runs import sweep

  def work():
    grid = {"recipes": _split("--recipes", args.recipes)}
    for knob, (_, kind, example) in _KNOB_FLAGS.items():
      text = getattr(args, f"knob_{knob}")
      if text is not None:
        flag = f"--{knob.replace('_', '-')}"
        grid[knob] = [_parse(flag, value, kind, example) for value in _split(flag, text)]
    report = sweep.sweep(grid, config_from(args, "bf16"), args.out,
                         predict=not args.no_predict, predict_size=args.predict_size,
                         telemetry_every=args.telemetry_every)
    print(sweep.table(report))
    notes = {run["predicted_speedup_note"] for run in report["runs"]} - {None}
    for note in sorted(notes):
      print(f"predicted speedup: {note}")
    print(f"wrote {', '.join(f'{args.out}/{name}' for name in report['files'])} and one "
          f"directory per run")
    return 0

  # A sweep does not resume: the hint says to start it again elsewhere.
  return run_guarded(work, resume_hint=f"fp8jax sweep ... with another --out than {args.out}")


def _split(flag: str, text: str) -> list[str]:
  from fp8jax.runs import RunError

  values = [part.strip() for part in text.split(",")]
  if not all(values):
    raise RunError(f"{flag} {text!r}: expected comma-separated values with none empty.")
  return values


def _parse(flag: str, value: str, kind: str, example: str):
  """One knob value from its text; RunError naming the flag and an example."""
  from fp8jax.runs import RunError

  if kind == "int":
    try:
      return int(value)
    except ValueError:
      raise RunError(f"{flag} {value!r} is not an integer; e.g. {flag} {example}.") from None
  if kind == "bool":
    truth = {"0": False, "false": False, "no": False, "1": True, "true": True, "yes": True}
    if value.lower() not in truth:
      raise RunError(f"{flag} {value!r}: expected 0 or 1; e.g. {flag} {example}.")
    return truth[value.lower()]
  if kind == "tuple":
    return () if value.lower() == "none" else tuple(part.strip() for part in value.split("+"))
  return value
