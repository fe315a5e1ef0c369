"""Which dots of an existing model run in FP8, and with which recipe: `Fp8Rule`.

A model converted by `Fp8Model` (linen) or `convert_to_fp8` (nnx) has
*candidate dots*: its dense layers (`Dense` / `DenseGeneral` / `Einsum`,
`Linear` / `LinearGeneral` / `Einsum`) and, in linen, every `lax.dot_general`,
`jnp.einsum`, `jnp.matmul` and `jnp.dot` that its modules call themselves.
Rules are data, read in order; the first rule that names a dot decides:

    rules = (
        Fp8Rule(path=r"head", recipe=None),                  # the head stays bf16
        Fp8Rule(path=r".*mlp.*", recipe=fp8jax.BlockScaling()),
        Fp8Rule(op=r"einsum", where=lambda dot: dot.k >= 64),  # delayed scaling
    )
    fp8_model = Fp8Model(model, rules=rules)

A dot that no rule names goes by the filter: `layer_filter` for the dense layers
(the cost model's `default_layer_filter` unless you pass your own) and always
`default_layer_filter` for the dots a module calls itself, so that passing a
filter written for layers does not also convert every attention product. Where a
cost-model filter decides (`default_layer_filter`, a `CostModelFilter`), the
decision carries its predicted times and says them.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Callable

from fp8jax.flax.layer_filter import LayerInfo, chosen, cost_model_of
from fp8jax.flax.dot_report import OP_KINDS
from fp8jax.core.recipes import DelayedScaling, Recipe, check_recipe
from fp8jax.lowering.break_even import LayerTimes

# The kinds of the dots a module calls itself (the kinds of dense layers are their class names).


@dataclasses.dataclass(frozen=True)
class Fp8Rule:
  """Names some candidate dots of a model and says how they run.

  Attributes:
    path: a regular expression matched (in full) against the module path joined by "/",
      e.g. "encoder/layer_0/mlp/up"; "" is the model itself. For a dot that a module
      calls itself, this is the path of that module.
    op: a regular expression matched (in full) against the dot's kind ("Dense",
      "DenseGeneral", "Einsum", "Linear", "LinearGeneral", or "dot_general", "einsum",
      "matmul", "dot") or against its name ("einsum_1": the second einsum that module
      calls).
    where: optional `(LayerInfo) -> bool` on the dot's shapes; the rule names only the
      dots it returns True for (e.g. `lambda dot: dot.k >= 1024`, or
      `default_layer_filter` to keep the cost model's choice inside a rule).
    recipe: the FP8 recipe of the dots named; None keeps them in high precision.
  """

  path: str = ".*"
  op: str = ".*"
  where: Callable[[LayerInfo], bool] | None = None
  recipe: Recipe | None = DelayedScaling()

  def names(self, dot: LayerInfo) -> bool:
    """Whether this rule names `dot`."""
    module_path = dot.path[:-1] if dot.kind in OP_KINDS else dot.path
    if not re.fullmatch(self.path, "/".join(str(p) for p in module_path)):
      return False
    name = str(dot.path[-1]) if dot.kind in OP_KINDS and dot.path else dot.kind
    if not (re.fullmatch(self.op, dot.kind) or re.fullmatch(self.op, name)):
      return False
    return self.where is None or chosen(self.where, dot)


@dataclasses.dataclass(frozen=True)
class Decision:
  """How one candidate dot runs: `recipe` None for high precision, and why; `predicted`:
  the cost model's times where a cost-model filter decided, else None."""

  recipe: Recipe | None
  reason: str
  predicted: LayerTimes | None = None


def check_rules(rules) -> tuple[Fp8Rule, ...]:
  """`rules` as a tuple, each checked; raises TypeError / ValueError naming the bad rule."""
  if isinstance(rules, Fp8Rule) or not isinstance(rules, (tuple, list)):
    raise TypeError(f"rules must be a tuple of fp8jax.flax.Fp8Rule, got "
                    f"{type(rules).__name__}: {rules!r}. Wrap one rule as (rule,).")
  for index, rule in enumerate(rules):
    if not isinstance(rule, Fp8Rule):
      raise TypeError(f"rules[{index}] must be an fp8jax.flax.Fp8Rule, got "
                      f"{type(rule).__name__}: {rule!r}.")
    for field in ("path", "op"):
      try:
        re.compile(getattr(rule, field))
      except (re.error, TypeError) as error:
        raise ValueError(f"rules[{index}].{field}={getattr(rule, field)!r} is not a regular "
                         f"expression: {error}.") from None
    if rule.where is not None and not callable(rule.where):
      raise TypeError(f"rules[{index}].where must be a function (LayerInfo) -> bool or None, "
                      f"got {type(rule.where).__name__}.")
    if rule.recipe is not None:
      check_recipe(rule.recipe)
  return tuple(rules)


def decide(rules: tuple[Fp8Rule, ...], dot: LayerInfo, dot_filter: Callable[[LayerInfo], bool],
           recipe: Recipe, filter_name: str) -> Decision:
  """The first rule that names `dot` decides; else `dot_filter` with `recipe`."""
  for index, rule in enumerate(rules):
    if rule.names(dot):
      how = "high precision" if rule.recipe is None else type(rule.recipe).__name__
      return Decision(rule.recipe, f"rules[{index}] (path={rule.path!r}, op={rule.op!r}): {how}")
  fp8 = chosen(dot_filter, dot)
  verdict = f"{filter_name}: {'chosen' if fp8 else 'not chosen'}"
  cost_model = cost_model_of(dot_filter)
  if cost_model is None:
    return Decision(recipe if fp8 else None, verdict)
  return Decision(recipe if fp8 else None, f"{verdict} {cost_model.explain(dot)}",
                  cost_model.times(dot))
