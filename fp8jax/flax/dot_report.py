"""What runs in FP8 in a converted model, and why: `Fp8Report`.

`Fp8Model.report(rngs, *args)` (linen) and `convert_to_fp8(..., report=True)` (nnx)
return one; `print(report)` shows a table with one row per candidate dot (dense
layers and the dots modules call themselves): which of its GEMMs run in FP8 and
why, with the cost model's predicted times where it decided. `report.rows` holds
the same as `DotRecord`s and `report.to_json()` writes it for a file.
"""
from __future__ import annotations

import dataclasses
import json

from fp8jax.core.recipes import GEMMS
from fp8jax.lowering.break_even import LayerTimes

# The kinds of dots a module calls itself (the others are dense layers).
OP_KINDS = ("dot_general", "einsum", "matmul", "dot", "ragged_dot")


@dataclasses.dataclass(frozen=True)
class DotRecord:
  """One candidate dot of a model.

  Attributes:
    path: module path; for a dot that a module calls itself, ending with the dot's
      name ("einsum_0").
    kind: "Dense", "DenseGeneral", "Einsum" (layers) or "dot_general", "einsum",
      "matmul", "dot", "ragged_dot" (calls; a ragged_dot is the experts' grouped matmul).
    lhs_shape, rhs_shape: the input's and the kernel's (or second operand's) shape.
    k, n: the GEMM's contracting and output sizes.
    recipe: the recipe's class name when the dot runs in FP8, else None.
    reason: the rule or filter that decided, or why FP8 cannot run.
    fp8_gemms: the dot's GEMMs that run in FP8, of ("fprop", "dgrad", "wgrad"): all
      three under a recipe, less those its `high_precision` names; () when the dot
      runs in high precision.
    predicted: where the cost model decided (`default_layer_filter`, a
      `CostModelFilter`), its predicted kernel times of the dot's train step in bf16
      and in FP8 (`fp8jax.lowering.break_even.LayerTimes`); else None.
  """

  path: tuple
  kind: str
  lhs_shape: tuple | None
  rhs_shape: tuple
  k: int
  n: int
  recipe: str | None
  reason: str
  fp8_gemms: tuple[str, ...] = ()
  predicted: LayerTimes | None = None

  @property
  def fp8(self) -> bool:
    return self.recipe is not None

  @classmethod
  def of(cls, dot, recipe, reason: str, predicted: LayerTimes | None = None) -> "DotRecord":
    """The record of a `LayerInfo`, run with `recipe` (None: high precision)."""
    gemms = () if recipe is None else tuple(g for g in GEMMS if g not in recipe.high_precision)
    return cls(tuple(dot.path), dot.kind, dot.input_shape, tuple(dot.kernel_shape), dot.k,
               dot.n, None if recipe is None else type(recipe).__name__, reason, gemms,
               predicted)


@dataclasses.dataclass(frozen=True)
class Fp8Report:
  """Every candidate dot of a model, in the order the model first calls them."""

  rows: tuple[DotRecord, ...]

  @property
  def converted(self) -> tuple[DotRecord, ...]:
    """The rows that run in FP8."""
    return tuple(row for row in self.rows if row.fp8)

  def __str__(self) -> str:
    header = ("path", "kind", "x", "kernel", "K", "N", "FP8", "GEMMs in FP8", "why")
    lines = [header] + [
        ("/".join(str(p) for p in row.path) or "(model)", row.kind, _shape(row.lhs_shape),
         _shape(row.rhs_shape), str(row.k), str(row.n), row.recipe or "-",
         _gemms(row.fp8_gemms), row.reason)
        for row in self.rows]
    widths = [max(len(line[i]) for line in lines) for i in range(len(header) - 1)]
    text = ["  ".join(cell.ljust(width) for cell, width in zip(line, widths)) + "  " + line[-1]
            for line in lines]
    text.append(f"{len(self.converted)} of {len(self.rows)} dots run in FP8.")
    return "\n".join(text)

  def to_json(self) -> str:
    rows = [dict(dataclasses.asdict(row), path=[str(p) for p in row.path],
                 predicted=_times(row.predicted)) for row in self.rows]
    return json.dumps({"dots": rows, "fp8": len(self.converted), "total": len(self.rows)},
                      indent=1)


def nothing_converted_message(report: Fp8Report, who: str, filter_passed: bool) -> str:
  """The warning for a model none of whose candidates runs in FP8, with the fix that applies.

  A `layer_filter` decides only the dense layers no rule names; the dots a module
  calls itself go by rules (and the cost model's default filter) only.
  """
  first = report.rows[0]
  layers = [row for row in report.rows if row.kind not in OP_KINDS]
  calls = [row for row in report.rows if row.kind in OP_KINDS]
  fixes = []
  if layers and filter_passed:
    fixes.append(f"the layer_filter you passed chose none of the {len(layers)} dense layers: "
                 "check it, or name layers with rules=(fp8jax.flax.Fp8Rule(path=...),)")
  elif layers:
    fixes.append(f"name the {len(layers)} dense layers with "
                 "rules=(fp8jax.flax.Fp8Rule(path=...),) or pass a layer_filter")
  if calls:
    fixes.append(f"the {len(calls)} dots that modules call themselves go by rules only (a "
                 "layer_filter does not decide them): name them with "
                 "rules=(fp8jax.flax.Fp8Rule(path=..., op=...),)")
  return (f"fp8jax: {who} runs none of the model's {len(report.rows)} candidate dots in FP8 "
          f"(the first: {first.path} {first.kind}, {first.reason}). To fix: "
          + "; ".join(fixes) + ".")


def _times(times: LayerTimes | None) -> dict | None:
  """The predicted kernel times in seconds, with both totals."""
  if times is None:
    return None
  return dict(dataclasses.asdict(times), bf16_s=times.bf16_s, fp8_s=times.fp8_s)


def _gemms(gemms: tuple[str, ...]) -> str:
  if tuple(gemms) == GEMMS:
    return "all 3"
  return "+".join(gemms) or "-"


def _shape(shape) -> str:
  return "?" if shape is None else "x".join(str(s) for s in shape) or "()"
