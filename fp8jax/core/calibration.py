"""Calibration: one step in which delayed-scaling roles scale from the tensor itself.

A fresh delayed-scaling state has scale 1 and an empty history: its first step casts
every tensor with scale 1, and a gradient of ~1e-5 (under E5M2's 2**-16 subnormals, let
alone E4M3's 2**-9) flushes to zero, with every GEMM behind it. Choosing the scale
inside the step from "has this history seen an amax?" would be a data-dependent
branch (or an amax pass) per cast in every step; a static freshness mark in the
state's tree structure would change the structure after the first step (a `lax.scan`
carry, a donated or checkpointed state would all see two structures). So the first
scales come from a step of their own instead, run once before training:

    state with Calibrating(recipe) roles  --loss forward and backward-->  amaxes
                                          --close, unwrapped-->  history seeded

`Calibrating` answers the recipe protocol as the recipe it wraps does, except that it
scales from the tensor (`scales_from_tensor=True`, what current scaling does), so the
ops record the amax of tensors that were cast well: nothing flushes, and the gradients
reaching earlier layers are the true ones. Its window, margin, formats and history
length are the wrapped recipe's, so the close pushes the same entries and makes the
scales the wrapped recipe would. The ops see no difference from any other recipe that
scales from the tensor; the compiled train step (with the plain recipe) does not change.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from fp8jax.core.formats import Fp8Format
from fp8jax.core.meta import Fp8Meta, check_fp8_state, is_meta, map_metas
from fp8jax.core.recipes import Recipe


@dataclasses.dataclass(frozen=True)
class Calibrating(Recipe):
  """`recipe` during calibration: the same protocol answers, but scales from the tensor.

  Attributes:
    recipe: the recipe the state follows in training (one that keeps a history:
      `scales_from_tensor` False).
  """

  recipe: Recipe

  scales_from_tensor = True

  @property
  def fp8_format(self) -> str:
    return self.recipe.fp8_format

  @property
  def forward_format(self) -> Fp8Format:
    return self.recipe.forward_format

  @property
  def gradient_format(self) -> Fp8Format:
    return self.recipe.gradient_format

  @property
  def history_len(self) -> int:
    return self.recipe.history_len

  @property
  def amax_compute_algo(self) -> str:
    return self.recipe.amax_compute_algo

  @property
  def margin(self) -> int:
    return self.recipe.margin

  @property
  def power_of_two(self) -> bool:
    return self.recipe.power_of_two

  @property
  def high_precision(self) -> tuple[str, ...]:
    return self.recipe.high_precision

  @property
  def fused_update(self) -> bool:
    return self.recipe.fused_update

  def window_amax(self, history):
    return self.recipe.window_amax(history)


def needs_calibration(recipe: Recipe) -> bool:
  """Whether a role of `recipe` casts with a stored scale (delayed scaling): the roles that
  calibration seeds. Recipes that scale from the tensor need none."""
  return not recipe.scales_from_tensor and not recipe.per_operand


def is_fresh(fp8_state: Any) -> bool:
  """Whether `fp8_state` has roles that calibration seeds and none of them has a history
  entry yet: a delayed-scaling state as `init_dot_meta` makes it. Reads the histories'
  values (concrete arrays: call it outside `jit`)."""
  seeded = [meta.amax_history for meta in jax.tree.leaves(fp8_state, is_leaf=is_meta)
            if is_meta(meta) and needs_calibration(meta.recipe)]
  return bool(seeded) and not any(np.any(np.asarray(history)) for history in seeded)


def calibrating(fp8_state: Any) -> Any:
  """`fp8_state` with every delayed role's recipe wrapped in `Calibrating`."""
  check_fp8_state(fp8_state, "fp8_state")

  def wrap(meta: Fp8Meta) -> Fp8Meta:
    if not needs_calibration(meta.recipe):
      return meta
    return dataclasses.replace(meta, recipe=Calibrating(meta.recipe))
  return map_metas(wrap, fp8_state)


def calibrated(fp8_state: Any) -> Any:
  """`fp8_state` with each `Calibrating` recipe replaced by the recipe it wraps."""
  return map_metas(lambda meta: dataclasses.replace(meta, recipe=training_recipe(meta.recipe)),
                   fp8_state)


def training_recipe(recipe: Recipe) -> Recipe:
  """The recipe a state of `recipe` follows in training: the one `Calibrating` wraps, else
  `recipe` itself. A layer built for recipe R accepts state whose training recipe is R."""
  return recipe.recipe if isinstance(recipe, Calibrating) else recipe
