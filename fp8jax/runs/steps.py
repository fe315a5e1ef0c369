"""The compiled pieces of a run: model, optimizer, initial state, train and eval steps."""
from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

import fp8jax
from fp8jax import telemetry
from fp8jax.flax.linen_telemetry import linen_tensor_stats
from fp8jax.models import gpt, gpt_moe
from fp8jax.runs.config import RunConfig, RunError


def build(config: RunConfig) -> tuple[Any, optax.GradientTransformation, Callable]:
  """(model, optimizer, learning-rate schedule) of a run.

  AdamW (b2 0.95, decoupled weight decay; its moments in float32, or in FP8 with
  `optimizer="adamw_fp8"`) after clipping the gradient norm to 1; the learning rate
  warms up linearly to `lr`, then decays along a cosine to `lr / 10` at
  `schedule_length` steps and stays there.
  """
  return _build(*_key(config))[:3]


def compiled_steps(config: RunConfig) -> tuple[Callable, Callable]:
  """(train_step, eval_step) of a run: jitted, and shared by every run whose model and
  optimizer agree (a resumed or compared run reuses the compiled programs).

  train_step: `(params, opt_state, fp8_state, tokens [B, S + 1]) -> (params, opt_state,
  fp8_state, loss, stats)`, one FP8 (or bf16) step with `fp8jax.value_and_grad`
  (`train_step_for`); it donates its params, optimizer state and FP8 state (pass each
  only once).
  eval_step: `(params, fp8_state, tokens) -> loss`, the FP8 state used, not updated.
  """
  return _build(*_key(config))[3:5]


def telemetry_step(config: RunConfig) -> Callable:
  """The jitted logging step of an FP8 run (shared like `compiled_steps`).

  `(params, fp8_state, tokens) -> tensor_stats`, the "fp8_telemetry" collection
  of one forward pass under `fp8jax.flax.linen_telemetry.linen_tensor_stats`
  ({layer path: {"x" | "kernel": (TensorStats,)}}, stacked over the layers of
  `nn.scan`): how the input and kernel of every FP8 projection quantize with the
  scales that a train step on the same arguments uses. Nothing is updated: the
  ordinary steps stay as they are. (The output gradients exist only in the
  backward pass: `state_stats` has their amax and headroom.)
  """
  if config.recipe_object is None:
    raise RunError(f"telemetry needs an FP8 recipe; {config.recipe!r} has no FP8 state.")
  return _build(*_key(config))[5]


def _key(config: RunConfig) -> tuple:
  # Everything the model, the optimizer and the two steps close over.
  return (config.recipe_object, model_config(config), config.lr, config.warmup_steps,
          config.weight_decay, config.schedule_length, config.optimizer)


def model_config(config: RunConfig) -> gpt.GptConfig:
  """The `GptConfig` of a run: its size, sequence length, saved activations, experts and
  FP8 layers."""
  return gpt.config_for(config.size, seq_len=config.seq,
                        saved_activations=config.saved_activations, experts=config.experts,
                        top_k=config.top_k, fp8_layers=config.fp8_layers)


@functools.lru_cache(maxsize=8)
def _build(recipe, model_settings, lr, warmup_steps, weight_decay, schedule_length, optimizer):
  model = gpt.Gpt(model_settings, recipe=recipe)
  warmup = max(warmup_steps, 1)
  schedule = optax.warmup_cosine_decay_schedule(
      lr / warmup, lr, warmup, max(schedule_length, warmup + 1), end_value=lr / 10)
  tx = make_optimizer(optimizer, schedule, weight_decay)
  fp8 = recipe is not None
  return (model, tx, schedule, train_step_for(model, tx, fp8), _eval_step(model, fp8),
          _telemetry_step(model) if fp8 else None)


def make_optimizer(name: str, learning_rate, weight_decay: float) -> optax.GradientTransformation:
  """The demo's optimizer: global-norm clipping to 1, then AdamW (b2 0.95) with float32
  moments ("adamw", optax) or FP8 moments ("adamw_fp8", `fp8jax.optim.adamw`, whose
  kernel also writes the new parameters under `fp8jax.optim.update_and_apply`). Either
  state is `(clip's, AdamW's)`."""
  if name == "adamw_fp8":
    return fp8jax.optim.adamw(learning_rate, b2=0.95, weight_decay=weight_decay,
                              max_grad_norm=1.0)
  return optax.chain(optax.clip_by_global_norm(1.0),
                     optax.adamw(learning_rate, b2=0.95, weight_decay=weight_decay))


def init_state(model, tx: optax.GradientTransformation, config: RunConfig):
  """(params, opt_state, fp8_state) of a fresh run (fp8_state is {} in bf16)."""
  tokens = jnp.zeros((1, config.seq), jnp.int32)
  variables = _init(model)(jax.random.key(config.seed), tokens)
  params = variables["params"]
  return params, tx.init(params), variables.get("fp8_meta", {})


@functools.lru_cache(maxsize=8)
def _init(model):
  # Jitted and kept per model: run eagerly, `init` compiles the model's layer scan
  # again on every call (seconds), once per run of a sweep or comparison.
  return jax.jit(model.init)


def _loss(model, fp8: bool):
  """`(params, fp8_state, tokens) -> ((objective, (lm_loss, aux_loss)), fp8_state)`.

  lm_loss is the next-byte cross-entropy, the loss the demo reports. An MoE model
  (`GptConfig.experts`) also returns aux_loss, its layers' load-balancing losses summed
  (`gpt_moe.load_balancing_loss`), and differentiates objective = lm_loss +
  aux_loss_weight * aux_loss; a dense model's objective is lm_loss (aux_loss None).
  """
  moe = bool(model.config.experts)
  mutable = (["fp8_meta"] if fp8 else []) + ([gpt_moe.AUX_COLLECTION] if moe else [])

  def loss_fn(params, fp8_state, tokens):
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    variables = {"params": params, "fp8_meta": fp8_state} if fp8 else {"params": params}
    if mutable:
      logits, updates = model.apply(variables, inputs, mutable=mutable)
    else:
      logits, updates = model.apply(variables, inputs), {}
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()
    fp8_state = updates["fp8_meta"] if fp8 else fp8_state
    if not moe:
      return (loss, (loss, None)), fp8_state
    aux = gpt_moe.load_balancing_loss(updates)
    return (loss + model.config.aux_loss_weight * aux, (loss, aux)), fp8_state

  return loss_fn


def train_step_for(model, tx: optax.GradientTransformation, fp8: bool) -> Callable:
  """The demo's jitted train step for `model` (an `fp8jax.models.gpt.Gpt`) and optimizer `tx`.

  `(params, opt_state, fp8_state, tokens [B, S + 1]) -> (params, opt_state, fp8_state,
  loss, stats)`; `fp8` says whether the model keeps FP8 state. `loss` is the
  cross-entropy (float32[]); `stats` a dict of float32[]: "grad_norm", the global norm
  of the gradient before clipping, and for an MoE model "aux_loss", the load-balancing
  loss (summed over the layers) whose `aux_loss_weight` multiple the step added to the
  loss it differentiated.

  The step donates params, optimizer state and FP8 state: XLA writes the new ones into
  their buffers, so they exist once on the device, not twice at the step's end (at the
  `1b` size that is 13.5 GB of fp32 params and Adam moments). The arrays passed in are
  deleted by the call; keep using the ones it returns.
  """
  loss_fn = _loss(model, fp8)

  @functools.partial(jax.jit, donate_argnums=(0, 1, 2))
  def train_step(params, opt_state, fp8_state, tokens):
    (_, (loss, aux)), grads, fp8_state = fp8jax.value_and_grad(loss_fn, has_aux=True)(
        params, fp8_state, tokens)
    stats = {"grad_norm": _global_norm(grads)}
    if aux is not None:
      stats["aux_loss"] = aux
    params, opt_state = fp8jax.optim.update_and_apply(tx, grads, opt_state, params)
    return params, opt_state, fp8_state, loss, stats

  return train_step


def calibration_step(config: RunConfig) -> Callable:
  """The jitted calibration step of a run: `(params, fp8_state, tokens) -> fp8_state`.

  `fp8jax.calibrate` of the train step's loss: its forward and backward pass with every
  delayed role scaling from the tensor itself, closed into one history entry each,
  without the parameter update. A run calibrates its fresh FP8 state once on its first
  batch (`fp8jax.runs.train`); `fp8jax calibrate` runs it on a bf16 checkpoint. It
  donates the FP8 state only, so the same params serve every calibration step.
  """
  model = _build(*_key(config))[0]
  return _calibration_step(model)


@functools.lru_cache(maxsize=8)
def _calibration_step(model):
  return jax.jit(fp8jax.calibrate(_loss(model, fp8=True), has_aux=True), donate_argnums=(1,))


# optax.global_norm is deprecated in favour of optax.tree.norm, which older optax lacks.
_global_norm = getattr(getattr(optax, "tree", None), "norm", None) or optax.global_norm


def _eval_step(model, fp8: bool):
  @jax.jit
  def eval_step(params, fp8_state, tokens):
    variables = {"params": params, "fp8_meta": fp8_state} if fp8 else {"params": params}
    logits = model.apply(variables, tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

  return eval_step


def _telemetry_step(model):
  @jax.jit
  def telemetry_step(params, fp8_state, tokens):
    # The interceptor acts while JAX traces, so it must be entered inside the jitted function.
    with linen_tensor_stats():
      _, updates = model.apply({"params": params, "fp8_meta": fp8_state}, tokens[:, :-1],
                               mutable=["fp8_meta", telemetry.TELEMETRY_COLLECTION])
    return updates[telemetry.TELEMETRY_COLLECTION]

  return telemetry_step


# `fp8jax.telemetry.state_stats`, jitted: every role's amax, scale and headroom.
state_stats = jax.jit(telemetry.state_stats)
