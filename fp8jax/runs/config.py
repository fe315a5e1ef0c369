"""What a demo training run is: its settings, its recipe, and the errors a user can meet.

A run trains the byte-level GPT of `fp8jax.models.gpt` on an embedded corpus
(`fp8jax.data`) with one recipe: "bf16" (no FP8) or an FP8 recipe of `RECIPES`
("delayed", "current", "rowwise", "block", "mxfp8", "mxfp8_round_up", "nvfp4"), or a
recipe of your own named
"module:Class" (a frozen-dataclass `fp8jax.Recipe` whose defaults make a recipe),
whose fields `recipe_options` may change (e.g. `{"amax_history_len": 1}`).
Every setting lives in `RunConfig`, which is saved with each checkpoint and in
the run's `run.json`, so a run can be resumed and compared exactly.
"""
from __future__ import annotations

import dataclasses

import fp8jax
from fp8jax.core.recipes import import_recipe_class
from fp8jax.models import gpt, gpt_fp8_layers

#: The demo's recipes by name (`--recipe`); "bf16" is no recipe.
RECIPES = {
    "bf16": None,
    "delayed": fp8jax.DelayedScaling(amax_history_len=16),
    "current": fp8jax.CurrentScaling(),
    "rowwise": fp8jax.RowwiseScaling(),
    "block": fp8jax.BlockScaling(),
    "mxfp8": fp8jax.MXFP8Scaling(),  # OCP's scale rule (rounded down)
    "mxfp8_round_up": fp8jax.MXFP8Scaling(scale_rounding="round_up"),  # NVIDIA's
    "nvfp4": fp8jax.NVFP4Scaling(),
}


# `--optimizer`: AdamW with float32 moments (optax) or with FP8 moments (fp8jax.optim).
OPTIMIZERS = ("adamw", "adamw_fp8")


class RunError(ValueError):
  """A run that cannot start or continue; the message is one line naming the cause and fix."""


def recipe_with(name: str, options: dict | None = None):
  """`RECIPES[name]` with the fields in `options` replaced (None for "bf16").

  Raises:
    RunError: an unknown recipe, options that are not a dict of the recipe's
      fields, or values the recipe rejects.
  """
  base = base_recipe(name)
  if not options:
    return base
  if not isinstance(options, dict):
    raise RunError(f"recipe_options={options!r} must be a dict of recipe fields, e.g. "
                   "{'margin': 1}.")
  if base is None:
    raise RunError(f"recipe_options={options!r}: bf16 has no recipe to change; drop them.")
  fields = [f.name for f in dataclasses.fields(base)]
  unknown = sorted(set(options) - set(fields))
  if unknown:
    raise RunError(f"recipe_options: {type(base).__name__} has no field {unknown[0]!r}; "
                   f"its fields are {fields}.")
  try:
    return dataclasses.replace(base, **options)
  except (TypeError, ValueError) as error:
    raise RunError(f"recipe_options={options!r} for {name}: {error}") from None


def base_recipe(name: str, flag: str = "--recipe "):
  """`RECIPES[name]`, or for "module:Class" that class with its defaults.

  `flag` starts the error message (the option the name came from).

  Raises:
    RunError: an unknown name, a class that cannot be imported, or one that is not
      a recipe or has no defaults.
  """
  if ":" not in name:
    if name not in RECIPES:
      raise RunError(f"{flag}{name!r} is not one of {sorted(RECIPES)}, nor a recipe of "
                     "your own named module:Class.")
    return RECIPES[name]
  try:
    return import_recipe_class(name)()
  except (ValueError, TypeError) as error:
    raise RunError(f"{flag}{name!r}: {error}") from None


@dataclasses.dataclass(frozen=True)
class RunConfig:
  """The settings of one training run.

  Attributes:
    recipe: "bf16", "delayed", "current", "rowwise", "block" or "mxfp8" (see `RECIPES`).
    recipe_options: fields of the recipe that differ from `RECIPES[recipe]`'s, by
      the recipe dataclass's field names, e.g. {"amax_history_len": 1, "margin": 1};
      None (or {}) for the recipe as `RECIPES` has it. Not for "bf16".
    size: a model size of `fp8jax.models.gpt.SIZES` ("tiny" on a CPU).
    steps: optimizer steps to train (the last step's number).
    schedule_steps: the length of the learning-rate schedule, fixed when the run
      starts (None: `steps`); a run resumed with more steps continues past it at
      the schedule's final learning rate.
    batch: sequences per step.
    seq: tokens per sequence (the model sees `seq`, predicts the next `seq`).
    seed: parameter initialization and batch order.
    lr: peak learning rate of AdamW (linear warm-up, then cosine decay to 10%).
    warmup_steps: warm-up length.
    weight_decay: AdamW decoupled weight decay.
    eval_every: validation loss every this many steps (and at the end).
    eval_batches: validation batches per evaluation.
    checkpoint_every: a checkpoint every this many steps (and at the end).
    data: a text file to train on, or None for the Python standard library's source.
    max_data_bytes: how much of the text to use.
    optimizer: "adamw" (optax, float32 moments: 8 bytes per parameter) or "adamw_fp8"
      (`fp8jax.optim.adamw`: both moments in FP8 with 1x128-block scales, ~2.1 bytes).
    saved_activations: what the backward keeps of the norms, the GELU and attention's
      output: "default" (what autodiff keeps) or "fp8" (`GptConfig.saved_activations`).
    experts: 0 for the dense GPT, or E >= 1: each block's MLP a dropless mixture of E
      experts (`fp8jax.models.gpt_moe`), whose expert GEMMs run in FP8 under the recipe.
    top_k: with experts, the experts each token is routed to (1 <= top_k <= experts).
    fp8_layers: under an FP8 recipe, which projections run in FP8: "all", or "auto"
      (where the cost model predicts FP8 no slower than bf16 on an H100;
      `GptConfig.fp8_layers`).
  """

  recipe: str = "delayed"
  recipe_options: dict | None = None
  size: str = "tiny"
  steps: int = 250
  schedule_steps: int | None = None
  batch: int = 16
  seq: int = 128
  seed: int = 0
  lr: float = 3e-3
  warmup_steps: int = 30
  weight_decay: float = 0.1
  eval_every: int = 100
  eval_batches: int = 8
  checkpoint_every: int = 100
  data: str | None = None
  max_data_bytes: int = 4 * 2**20
  optimizer: str = "adamw"
  saved_activations: str = "default"
  experts: int = 0
  top_k: int = 2
  fp8_layers: str = "all"

  def __post_init__(self):
    self.recipe_object  # builds the recipe: RunError for options it does not take
    if self.size not in gpt.SIZES:
      raise RunError(f"--size {self.size!r} is not one of {list(gpt.SIZES)}.")
    if self.optimizer not in OPTIMIZERS:
      raise RunError(f"--optimizer {self.optimizer!r} is not one of {list(OPTIMIZERS)}.")
    if self.saved_activations not in gpt.SAVED_ACTIVATIONS:
      raise RunError(f"--saved-activations {self.saved_activations!r} is not one of "
                     f"{list(gpt.SAVED_ACTIVATIONS)}.")
    if self.fp8_layers not in gpt_fp8_layers.FP8_LAYERS:
      raise RunError(f"--fp8-layers {self.fp8_layers!r} is not one of "
                     f"{list(gpt_fp8_layers.FP8_LAYERS)}.")
    for name in ("steps", "batch", "seq", "eval_every", "eval_batches", "checkpoint_every",
                 "max_data_bytes"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise RunError(f"--{name.replace('_', '-')} {value!r} must be a positive integer.")
    for name in ("seed", "warmup_steps"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise RunError(f"--{name.replace('_', '-')} {value!r} must be a non-negative integer.")
    if self.schedule_steps is not None and (
        isinstance(self.schedule_steps, bool) or not isinstance(self.schedule_steps, int)
        or self.schedule_steps < 1):
      raise RunError(f"schedule_steps={self.schedule_steps!r} must be a positive integer.")
    for name in ("lr", "weight_decay"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0 or (
          name == "lr" and value == 0):
        raise RunError(f"--{name.replace('_', '-')} {value!r} must be a "
                       f"{'positive' if name == 'lr' else 'non-negative'} number.")
    if isinstance(self.experts, bool) or not isinstance(self.experts, int) or self.experts < 0:
      raise RunError(f"--experts {self.experts!r} must be a non-negative integer (0: the "
                     "dense MLP; N: a mixture of N experts in each block).")
    if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 1 or (
        self.experts and self.top_k > self.experts):
      limit = f"--experts {self.experts}" if self.experts else "the number of experts"
      raise RunError(f"--top-k {self.top_k!r} must be an integer from 1 to {limit} (the "
                     "experts each token is routed to).")

  @property
  def schedule_length(self) -> int:
    """The learning-rate schedule's length in steps."""
    return self.schedule_steps if self.schedule_steps is not None else self.steps

  @property
  def recipe_object(self):
    """The fp8jax recipe (None for bf16): `RECIPES[recipe]` with `recipe_options` applied."""
    return recipe_with(self.recipe, self.recipe_options)

  def replace(self, **changes) -> "RunConfig":
    return dataclasses.replace(self, **changes)

  def to_dict(self) -> dict:
    return dataclasses.asdict(self)

  @classmethod
  def from_dict(cls, values: dict) -> "RunConfig":
    known = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in values.items() if k in known})


# Settings that must agree for a checkpoint to continue a run. The rest may change:
# more steps (past `schedule_steps` at the final learning rate), evaluation and
# checkpoint intervals, the recipe when continuing a bf16 run in FP8, and what the
# backward keeps (saved_activations: the parameters are the same).
MODEL_FIELDS = ("size", "seq", "experts", "top_k")
DATA_FIELDS = ("batch", "seed", "data", "max_data_bytes")
OPTIMIZER_FIELDS = ("optimizer", "lr", "warmup_steps", "weight_decay", "schedule_steps")
