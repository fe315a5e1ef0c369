"""Scaling recipes: how the scale of each FP8 tensor is chosen.

A recipe is a frozen, hashable dataclass, so it can be a static argument of
`jax.jit` and part of a pytree's static structure.

* `DelayedScaling`: the scale used at step t comes from the amaxes of earlier
  steps (an amax history of length L); step t's amax enters the history after.
* `CurrentScaling`: the scale comes from the tensor's own amax, just in time.

In both, `scale = fp8_max / amax / 2**margin` and quantization is
`q = saturate(x * scale)`.
"""
from __future__ import annotations

import dataclasses

from fp8jax.formats import Fp8Format, formats_for
from fp8jax.validation import check_int

AMAX_COMPUTE_ALGOS = ("max", "most_recent")


@dataclasses.dataclass(frozen=True)
class DelayedScaling:
  """Delayed scaling from a window of past amaxes.

  Attributes:
    amax_history_len: L, how many steps of amax the history keeps (>= 1).
    amax_compute_algo: "max" (largest amax in the window) or "most_recent"
      (the newest amax only).
    margin: the scale is divided by 2**margin, leaving headroom (>= 0).
    fp8_format: "hybrid" (E4M3 forward, E5M2 gradients) or "e4m3".
  """

  amax_history_len: int = 16
  amax_compute_algo: str = "max"
  margin: int = 0
  fp8_format: str = "hybrid"

  def __post_init__(self):
    check_int("amax_history_len", self.amax_history_len, minimum=1)
    if self.amax_compute_algo not in AMAX_COMPUTE_ALGOS:
      raise ValueError(
          f"amax_compute_algo={self.amax_compute_algo!r} is not supported; "
          f"use one of {AMAX_COMPUTE_ALGOS}.")
    check_int("margin", self.margin, minimum=0)
    formats_for(self.fp8_format)

  @property
  def history_len(self) -> int:
    return self.amax_history_len

  @property
  def forward_format(self) -> Fp8Format:
    return formats_for(self.fp8_format)[0]

  @property
  def gradient_format(self) -> Fp8Format:
    return formats_for(self.fp8_format)[1]


@dataclasses.dataclass(frozen=True)
class CurrentScaling:
  """Just-in-time scaling from each tensor's own amax (no history).

  Attributes:
    margin: the scale is divided by 2**margin (>= 0).
    fp8_format: "hybrid" (E4M3 forward, E5M2 gradients) or "e4m3".
  """

  margin: int = 0
  fp8_format: str = "hybrid"

  def __post_init__(self):
    check_int("margin", self.margin, minimum=0)
    formats_for(self.fp8_format)

  @property
  def history_len(self) -> int:
    # One slot: the amax of the current step, kept for reporting.
    return 1

  amax_compute_algo = "most_recent"

  @property
  def forward_format(self) -> Fp8Format:
    return formats_for(self.fp8_format)[0]

  @property
  def gradient_format(self) -> Fp8Format:
    return formats_for(self.fp8_format)[1]


Recipe = DelayedScaling | CurrentScaling


def check_recipe(recipe, argname: str = "recipe") -> None:
  """Raises TypeError unless `recipe` is a scaling recipe object."""
  if not isinstance(recipe, (DelayedScaling, CurrentScaling)):
    raise TypeError(
        f"{argname} must be a fp8jax recipe (DelayedScaling or CurrentScaling), "
        f"got {type(recipe).__name__}: {recipe!r}.")
