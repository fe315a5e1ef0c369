"""The demo GPT's train step as a program to compile for an H100: its time and its memory.

    program = GptProgram(size="1b", batch=8, seq=2048, recipe="delayed",
                         optimizer="adamw_fp8", saved_activations="fp8")
    time, memory, attention = measure(program)      # one deviceless compile
    batch, memory = largest_batch(program, capacity=80 * GIB)
    state_bytes(program)    # params, optimizer and FP8 state: the least any batch needs

The step is the demo's own (`fp8jax.runs.steps.train_step_for`: `fp8jax.value_and_grad`,
the demo's clipped AdamW, params, optimizer state and FP8 state donated), compiled from
shapes only. Traced under the H100 mesh, attention is what an H100 runs
(`fp8jax.mesh.target`); where that is cuDNN, which a compile without a GPU cannot build,
fp8jax's Hopper flash kernel stands in, and `measure` returns that choice with its reason.
"""
from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Callable

import jax
import jax.numpy as jnp

from fp8jax import deviceless
from fp8jax.lowering.cost import CostConstants, CostReport
from fp8jax.lowering.memory import H100_MEMORY, MemoryReport
from fp8jax.lowering import memory as memory_lib
from fp8jax.models import gpt
from fp8jax.ops.attention_backend import BackendChoice
from fp8jax.runs.config import OPTIMIZERS, RunError, base_recipe
from fp8jax.runs.steps import make_optimizer, train_step_for

# The demo's settings that do not change the program's shape.
_LEARNING_RATE, _WEIGHT_DECAY = 1e-3, 0.1


@dataclasses.dataclass(frozen=True)
class GptProgram:
  """One demo GPT train step to compile.

  Attributes:
    size: a size of `fp8jax.models.gpt.SIZES`.
    batch, seq: sequences per step and tokens per sequence.
    recipe: "bf16" or a recipe name of `fp8jax.runs.config.RECIPES`.
    optimizer: "adamw" or "adamw_fp8".
    saved_activations: "default" or "fp8" (`GptConfig.saved_activations`).
    experts, top_k: the MLP of each block as a mixture of `experts` experts, each token
      routed to `top_k` (`GptConfig.experts`; 0 keeps the dense MLP).
    fp8_layers: "all" or "auto", the projections that run in FP8 under the recipe
      (`GptConfig.fp8_layers`).
  """

  size: str
  batch: int
  seq: int
  recipe: str = "delayed"
  optimizer: str = "adamw"
  saved_activations: str = "default"
  experts: int = 0
  top_k: int = 2
  fp8_layers: str = "all"

  def __post_init__(self):
    if self.size not in gpt.SIZES:
      raise RunError(f"--gpt {self.size!r} is not one of {list(gpt.SIZES)}.")
    for name in ("batch", "seq"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise RunError(f"--{name} {value!r} must be a positive integer.")
    base_recipe(self.recipe)
    if self.optimizer not in OPTIMIZERS:
      raise RunError(f"--optimizer {self.optimizer!r} is not one of {list(OPTIMIZERS)}.")
    if self.saved_activations not in gpt.SAVED_ACTIVATIONS:
      raise RunError(f"--saved-activations {self.saved_activations!r} is not one of "
                     f"{list(gpt.SAVED_ACTIVATIONS)}.")
    try:
      self.config()
    except ValueError as e:   # the MoE fields, named as GptConfig's
      raise RunError(str(e)) from None

  @property
  def label(self) -> str:
    """E.g. "delayed, adamw_fp8, fp8 saved" or "bf16, adamw"."""
    parts = [self.recipe, self.optimizer]
    if self.saved_activations != "default":
      parts.append(f"{self.saved_activations} saved")
    if self.fp8_layers != "all" and self.recipe != "bf16":
      parts.append(f"{self.fp8_layers} FP8 layers")
    return ", ".join(parts)

  def config(self) -> gpt.GptConfig:
    return gpt.config_for(self.size, seq_len=self.seq,
                          saved_activations=self.saved_activations, experts=self.experts,
                          top_k=self.top_k, fp8_layers=self.fp8_layers)


def train_step(program: GptProgram):
  """(step, args): the jitted demo train step and `ShapeDtypeStruct`s of its arguments."""
  recipe = base_recipe(program.recipe)
  model = gpt.Gpt(program.config(), recipe=recipe)
  tx = make_optimizer(program.optimizer, _LEARNING_RATE, _WEIGHT_DECAY)
  variables = jax.eval_shape(model.init, jax.random.key(0),
                             jax.ShapeDtypeStruct((1, program.seq), jnp.int32))
  params = variables["params"]
  args = (params, jax.eval_shape(tx.init, params), variables.get("fp8_meta", {}),
          jax.ShapeDtypeStruct((program.batch, program.seq + 1), jnp.int32))
  return train_step_for(model, tx, recipe is not None), args


def attention_choice(program: GptProgram, target: str = "deviceless") -> BackendChoice:
  """The attention backend the step compiles with for `target`, and why (its warning)."""
  recipe = base_recipe(program.recipe)
  choose = lambda: gpt.attention_choice(program.config(), recipe, program.batch, program.seq)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # the reason is returned instead
    if _resolved(target) == "device":
      return choose()
    with jax.set_mesh(deviceless.h100_mesh(x=1)):
      return choose()


def _resolved(target: str) -> str:
  if target != "auto":
    return target
  try:
    return "device" if jax.default_backend() == "gpu" else "deviceless"
  except RuntimeError:
    return "deviceless"


def measure(program: GptProgram, *, target: str = "deviceless",
            constants: CostConstants | None = None
            ) -> tuple[CostReport, MemoryReport, BackendChoice]:
  """Compiles the step once: its predicted time, its memory and its attention backend."""
  step, args = train_step(program)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # the attention backend's reason is in the result
    time, memory = memory_lib.measure(step, *args, target=target, constants=constants,
                                      label=program.label)
  return time, memory, attention_choice(program, target)


@functools.lru_cache(maxsize=8)
def state_bytes(program: GptProgram) -> int:
  """Bytes of the step's parameters, optimizer state and FP8 state, from their shapes (no
  compile): what the device holds at any batch before the first activation."""
  _, (params, opt_state, fp8_state, _) = train_step(program)
  return sum(leaf.size * jnp.dtype(leaf.dtype).itemsize
             for leaf in jax.tree.leaves((params, opt_state, fp8_state)))


def largest_batch(program: GptProgram, capacity: int = H100_MEMORY, *,
                  target: str = "deviceless",
                  on_compile: Callable[[int, MemoryReport], None] | None = None,
                  ) -> tuple[int, MemoryReport | None]:
  """The largest batch of `program`'s step that fits `capacity` bytes (by compiles).

  Args:
    on_compile: called with (batch, its report) after each compile (a progress bar).

  Returns:
    (batch, its report); (0, None) when not even a batch of 1 fits, at once (no compile)
    when the step's state alone (`state_bytes`) exceeds `capacity`.
  """
  if state_bytes(program) > capacity:
    return 0, None

  def at(batch: int) -> MemoryReport:
    report = measure(dataclasses.replace(program, batch=batch), target=target)[1]
    if on_compile is not None:
      on_compile(batch, report)
    return report

  return memory_lib.largest_batch(at, capacity)
