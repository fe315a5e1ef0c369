"""The grid of a sweep: recipes times the knobs that apply to each, as named run settings.

A grid is a dict: "recipes" (names of `RECIPES`) and, for any of the knobs of
`KNOBS`, a list of values, e.g.

    {"recipes": ["bf16", "delayed", "current"], "history": [1, 16], "margin": [0, 1]}

Each recipe runs once for every combination of the values of the knobs that
are fields of its dataclass; a knob that is not (e.g. history for current
scaling) is not multiplied for it. "bf16" has no knobs and is always a point
(the baseline), whether named or not.
"""
from __future__ import annotations

import dataclasses
import itertools
from typing import NamedTuple

from fp8jax.runs.config import RECIPES, RunError, base_recipe

# knob -> the recipe dataclass field it sets.
KNOBS = {
    "history": "amax_history_len",
    "margin": "margin",
    "amax_algo": "amax_compute_algo",
    "format": "fp8_format",
    "power_of_two": "power_of_two",
    "high_precision": "high_precision",
    "block_size": "block_size",
    "scale_rounding": "scale_rounding",
    "weight_blocks": "weight_blocks",
    "hadamard": "hadamard",
    "stochastic_rounding": "stochastic_rounding",
}


class GridPoint(NamedTuple):
  """One run of a sweep.

  Attributes:
    name: unique, also its directory: the recipe, then "flag=value" for each knob
      of the grid that applies to it (the knob as its command-line flag, the value
      as the command line writes it), joined by ",", e.g.
      "delayed,history=1,power-of-two=1,high-precision=dgrad+wgrad".
    recipe: the name in `RECIPES`, or "module:Class" for a recipe of your own.
    knobs: {knob: value} of this point.
    options: `RunConfig.recipe_options`: {recipe field: value}.
  """

  name: str
  recipe: str
  knobs: dict
  options: dict


def knobs_of(recipe: str) -> list[str]:
  """The knobs that apply to a recipe (those whose field its dataclass has)."""
  base = base_recipe(recipe)
  if base is None:
    return []
  fields = {f.name for f in dataclasses.fields(base)}
  return [knob for knob, field in KNOBS.items() if field in fields]


def grid_points(grid: dict) -> list[GridPoint]:
  """The runs of a grid, bf16 first; every recipe is built, so bad values fail here.

  Raises:
    RunError: a grid that is not a dict with "recipes", an unknown recipe or knob,
      an empty or repeated value list, a knob that applies to none of the
      recipes, or a value a recipe rejects (the message names the knob).
  """
  if not isinstance(grid, dict) or "recipes" not in grid:
    raise RunError(f"grid={grid!r} must be a dict with 'recipes' and knob value lists, e.g. "
                   "{'recipes': ['bf16', 'delayed'], 'history': [1, 16]}.")
  values = {key: _values(key, grid[key]) for key in grid}
  for recipe in values["recipes"]:
    base_recipe(recipe, "--recipes: ")  # a RunError for an unknown or unimportable name
  unknown = [key for key in values if key != "recipes" and key not in KNOBS]
  if unknown:
    raise RunError(f"grid: unknown knob {unknown[0]!r}; the knobs are {list(KNOBS)}.")
  recipes = ["bf16"] + [r for r in values.pop("recipes") if r != "bf16"]
  for knob in values:
    if not any(knob in knobs_of(recipe) for recipe in recipes):
      takers = [r for r in RECIPES if knob in knobs_of(r)]
      raise RunError(f"--{_flag(knob)} applies to none of the recipes {recipes} (only to "
                     f"{takers or 'none of the known recipes'}); add one of them to --recipes "
                     f"or drop --{_flag(knob)}.")
  points = []
  for recipe in recipes:
    knobs = [k for k in values if k in knobs_of(recipe)]
    for combination in itertools.product(*(values[k] for k in knobs)):
      chosen = dict(zip(knobs, combination))
      for knob, value in chosen.items():  # one at a time, so an error names its knob
        _build(recipe, {KNOBS[knob]: value}, f"--{_flag(knob)} {_text(value)}")
      options = {KNOBS[k]: v for k, v in chosen.items()}
      if options:
        _build(recipe, options, " ".join(f"--{_flag(k)} {_text(v)}" for k, v in chosen.items()))
      name = ",".join([recipe] + [f"{_flag(k)}={_text(v)}" for k, v in chosen.items()])
      points.append(GridPoint(name, recipe, chosen, options))
  return points


def _values(key, given) -> list:
  if isinstance(given, (str, bytes)) or not hasattr(given, "__iter__"):
    example = "['bf16', 'delayed']" if key == "recipes" else "[1, 16]"
    raise RunError(f"grid[{key!r}]={given!r} must be a list of values, e.g. {example}.")
  values = [tuple(v) if isinstance(v, list) else v for v in given]  # lists from JSON
  if not values:
    raise RunError(f"grid[{key!r}] is empty; give at least one value or leave it out.")
  if len(set(values)) != len(values):
    raise RunError(f"--{_flag(key)} {','.join(map(_text, values))} names a value twice.")
  return values


def _build(recipe: str, options: dict, given: str) -> None:
  try:
    dataclasses.replace(base_recipe(recipe), **options)
  except (TypeError, ValueError) as error:
    raise RunError(f"{given} is not valid for {recipe}: {error}") from None


def _flag(knob: str) -> str:
  return knob.replace("_", "-")


def _text(value) -> str:
  """A knob value as the command line writes it: 1, max, none, dgrad+wgrad."""
  if isinstance(value, bool):
    return str(int(value))
  if isinstance(value, tuple):
    return "+".join(value) if value else "none"
  return str(value)
