"""What the GPU check's GPT sections time, in what order, and what they drop when short of time.

A row is one demo GPT train step to compile, time and profile (`benchmarks.gpt.run_row`).
`GPT_ROWS` and `MOE_ROWS` are the check's rows in the order they run, which is also their
priority: with too little time left for a row, `Budget` drops it (and goes on with the
rows after it that still fit), so the first rows are the last to go:

  1. 350m (batch 8 x 1024) bf16 and FP8 delayed scaling: the pair of the 1.15x target
  2. 1b (batch 8 x 2048) bf16 and FP8 delayed: the pair of the 1.35x target
  3. the MoE GPT (125m, 8 experts, top-2, batch 32): bf16 (JAX's grouped GEMMs) and FP8
     delayed with the memory features (fp8jax's grouped kernels); its section runs after
     the dense rows, which leave it its estimated time (only the two pairs may take it)
  4. 350m FP8 delayed with the memory features (FP8 AdamW moments, FP8 saved activations),
     then 350m FP8 current scaling
  5. the same two at 1b

So when time is short the 1b variants go first, then the 350m ones, then the MoE rows.
A bf16 row runs only if its FP8 partner fits too (`fp8_partner`).

A row's seconds are the device machine's wall clock for it: building and compiling the
step, initializing the model, the timed steps, the profiled steps and reading the trace
and the program. `estimate_s` is what a row is expected to take on an H200's host; the
estimates are (deviceless H100 compile CPU-seconds of the same step on a 2-core CPU)
x 2 + its steps at the cost model's predicted step time, the factor 2 from the
first H200 check (its 350m rows with the layers rolled took 14 s each where their
deviceless compiles took 5-9 CPU-seconds). The deviceless compiles of the unrolled steps:
350m bf16 12.4 s, delayed 18.9 s, current 25.8 s, delayed with the memory features 31.2 s;
1b bf16 13.1 s, delayed 21.3 s. `Budget` scales every estimate by what the rows that ran
took over what they were expected to take, so a faster or slower host changes how many
rows run, not whether the check finishes in time.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Callable


@dataclasses.dataclass(frozen=True)
class Row:
  """One train step to time.

  Attributes:
    size: a size of `fp8jax.models.gpt.SIZES`.
    batch, seq: sequences per step and tokens per sequence.
    recipe: "bf16" or an FP8 recipe name of `fp8jax.runs.config.RECIPES`.
    optimizer: "adamw" or "adamw_fp8".
    saved_activations: "default" or "fp8".
    experts, top_k: MoE layers (0 experts: dense).
    layers: the number of blocks, None for the size's (smoke runs use 1).
    estimate_s: the seconds the row is expected to take on the device machine.
    essential: whether the row may take the time kept for the MoE rows (`Budget`).
  """

  size: str
  batch: int
  seq: int
  recipe: str
  optimizer: str = "adamw"
  saved_activations: str = "default"
  experts: int = 0
  top_k: int = 2
  layers: int | None = None
  estimate_s: float = 0.0
  essential: bool = False

  @property
  def variant(self) -> str:
    """'bf16', 'delayed', 'current' or e.g. 'delayed, adamw_fp8, fp8 saved'."""
    parts = [self.recipe]
    if self.optimizer != "adamw":
      parts.append(self.optimizer)
    if self.saved_activations != "default":
      parts.append(f"{self.saved_activations} saved")
    return ", ".join(parts)

  @property
  def model(self) -> str:
    """'350m' or '125m, 8 experts top-2' (with ', 1 layer' for a cut-down model)."""
    name = self.size + (f", {self.experts} experts top-{self.top_k}" if self.experts else "")
    return name + (f", {self.layers} layer{'s' * (self.layers != 1)}" if self.layers else "")

  @property
  def label(self) -> str:
    return f"{self.model} {self.variant}"


MEMORY = dict(optimizer="adamw_fp8", saved_activations="fp8")


def _pair_and_variants(size: str, batch: int, seq: int, estimates: dict) -> dict:
  return {name: Row(size, batch, seq, recipe, **options, estimate_s=estimates[name],
                    essential=name in ("bf16", "delayed"))
          for name, recipe, options in (("bf16", "bf16", {}), ("delayed", "delayed", {}),
                                        ("memory", "delayed", MEMORY),
                                        ("current", "current", {}))}


_350M = _pair_and_variants("350m", 8, 1024, {"bf16": 25, "delayed": 38, "memory": 62,
                                             "current": 52})
_1B = _pair_and_variants("1b", 8, 2048, {"bf16": 30, "delayed": 45, "memory": 68,
                                         "current": 58})
GPT_ROWS: tuple[Row, ...] = (_350M["bf16"], _350M["delayed"], _1B["bf16"], _1B["delayed"],
                             _350M["memory"], _350M["current"], _1B["memory"], _1B["current"])
# The first H200 check's MoE row (12 layers rolled) took 18 s; unrolled, about twice that.
MOE_ROWS: tuple[Row, ...] = (
    Row("125m", 32, 1024, "bf16", experts=8, estimate_s=35),
    Row("125m", 32, 1024, "delayed", **MEMORY, experts=8, estimate_s=50))
# The GPT and MoE sections together.
GPT_BUDGET_S = 300.0


def smoke_rows(moe: bool) -> tuple[Row, ...]:
  """The rows of a CPU smoke run: the tiny model cut to one block, 64 tokens, one step each.

  The dense rows are bf16, delayed and current scaling; the MoE rows bf16 and FP8 with the
  memory features (so the smoke compiles each code path of the check once)."""
  if moe:
    return (Row("tiny", 2, 64, "bf16", experts=4, layers=1),
            Row("tiny", 2, 64, "delayed", **MEMORY, experts=4, layers=1))
  return tuple(Row("tiny", 2, 64, recipe, layers=1) for recipe in ("bf16", "delayed", "current"))


def fp8_partner(rows, index: int) -> Row | None:
  """For a bf16 row, the first FP8 row of the same model after it (a bf16 row alone gives
  no speedup, so it runs only when both fit); None for other rows."""
  row = rows[index]
  if row.recipe != "bf16":
    return None
  return next((r for r in rows[index + 1:] if r.model == row.model and r.recipe != "bf16"), None)


class Budget:
  """Seconds left for rows, and whether the next row fits.

  A row fits when its estimate (with its FP8 partner's, for a bf16 row: `fp8_partner`),
  scaled by what the rows so far took over their estimates, is within the seconds left.
  `reserve_s` of them are kept for what comes after (the MoE rows), except for an
  `essential` row, which may take them.
  """

  def __init__(self, seconds: float, reserve_s: float = 0.0,
               clock: Callable[[], float] = time.perf_counter):
    self.seconds, self.reserve_s, self.clock = seconds, reserve_s, clock
    self.start = clock()
    self.spent = self.expected = 0.0

  @property
  def remaining_s(self) -> float:
    """Seconds left, the reserve included."""
    return self.seconds - (self.clock() - self.start)

  def left_s(self, row: Row) -> float:
    """Seconds left for `row`: the reserve kept unless the row is essential."""
    return self.remaining_s - (0.0 if row.essential else self.reserve_s)

  @property
  def scale(self) -> float:
    """Measured over estimated seconds of the rows so far (1 before any ran)."""
    return self.spent / self.expected if self.expected > 0 else 1.0

  def needs_s(self, row: Row, partner: Row | None = None) -> float:
    return (row.estimate_s + (partner.estimate_s if partner else 0.0)) * self.scale

  def fits(self, row: Row, partner: Row | None = None) -> bool:
    return self.needs_s(row, partner) <= self.left_s(row)

  def ran(self, row: Row, seconds: float) -> None:
    """Records that `row` took `seconds`."""
    self.spent += seconds
    self.expected += row.estimate_s

  def drop_reason(self, row: Row, partner: Row | None = None) -> str:
    what = f"the row{' and ' + partner.variant if partner else ''}"
    return (f"not enough time: {max(self.left_s(row), 0):.0f} s left, {what} need about "
            f"{self.needs_s(row, partner):.0f} s (estimates x {self.scale:.2f}, what the rows "
            "so far took over their estimates)")


def expected_to_run(rows, seconds: float, reserve_s: float = 0.0) -> list[bool]:
  """Which rows `Budget(seconds, reserve_s)` runs if every row takes its estimate."""
  clock = [0.0]
  budget = Budget(seconds, reserve_s, clock=lambda: clock[0])
  runs = []
  for index, row in enumerate(rows):
    runs.append(budget.fits(row, fp8_partner(rows, index)))
    if runs[-1]:
      clock[0] += row.estimate_s
      budget.ran(row, row.estimate_s)
  return runs


def format_plan(rows, seconds: float, reserve_s: float = 0.0) -> str:
  """The rows in order with their estimates, and which fit `seconds` if the estimates hold."""
  kept = f", {reserve_s:.0f} s of them kept for the MoE rows" if reserve_s else ""
  lines = [f"plan: {len(rows)} rows in {seconds:.0f} s{kept} (estimated seconds; rows run in "
           "this order while they fit)"]
  total = 0.0
  for row, runs in zip(rows, expected_to_run(rows, seconds, reserve_s)):
    total += row.estimate_s if runs else 0.0
    lines.append(f"  {row.label:<45} ~{row.estimate_s:4.0f} s  "
                 + (f"total ~{total:4.0f} s" if runs else "dropped if the estimates hold"))
  return "\n".join(lines)
