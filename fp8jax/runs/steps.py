"""The compiled pieces of a run: model, optimizer, initial state, train and eval steps."""
from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

import fp8jax
from fp8jax.runs.config import RunConfig


def build(config: RunConfig) -> tuple[Any, optax.GradientTransformation, Callable]:
  """(model, optimizer, learning-rate schedule) of a run.

  AdamW (b2 0.95, decoupled weight decay) after clipping the gradient norm to 1;
  the learning rate warms up linearly to `lr`, then decays along a cosine to
  `lr / 10` at `schedule_length` steps and stays there.
  """
  return _build(*_key(config))[:3]


def compiled_steps(config: RunConfig) -> tuple[Callable, Callable]:
  """(train_step, eval_step) of a run: jitted, and shared by every run whose model and
  optimizer agree (a resumed or compared run reuses the compiled programs).

  train_step: `(params, opt_state, fp8_state, tokens [B, S + 1]) -> (params, opt_state,
  fp8_state, loss, grad_norm)`, one FP8 (or bf16) step with `fp8jax.value_and_grad`.
  eval_step: `(params, fp8_state, tokens) -> loss`, the FP8 state used, not updated.
  """
  return _build(*_key(config))[3:]


def _key(config: RunConfig) -> tuple:
  # Everything the model, the optimizer and the two steps close over.
  return (config.recipe, config.size, config.seq, config.lr, config.warmup_steps,
          config.weight_decay, config.schedule_length)


@functools.lru_cache(maxsize=8)
def _build(recipe, size, seq, lr, warmup_steps, weight_decay, schedule_length):
  from fp8jax.models import gpt
  config = RunConfig(recipe=recipe, size=size, seq=seq)
  model = gpt.Gpt(gpt.config_for(size, seq_len=seq), recipe=config.recipe_object)
  warmup = max(warmup_steps, 1)
  schedule = optax.warmup_cosine_decay_schedule(
      lr / warmup, lr, warmup, max(schedule_length, warmup + 1), end_value=lr / 10)
  tx = optax.chain(optax.clip_by_global_norm(1.0),
                   optax.adamw(schedule, b2=0.95, weight_decay=weight_decay))
  fp8 = config.recipe_object is not None
  return model, tx, schedule, _train_step(model, tx, fp8), _eval_step(model, fp8)


def init_state(model, tx: optax.GradientTransformation, config: RunConfig):
  """(params, opt_state, fp8_state) of a fresh run (fp8_state is {} in bf16)."""
  tokens = jnp.zeros((1, config.seq), jnp.int32)
  variables = model.init(jax.random.key(config.seed), tokens)
  params = variables["params"]
  return params, tx.init(params), variables.get("fp8_meta", {})


def _loss(model, fp8: bool):
  def loss_fn(params, fp8_state, tokens):
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    if fp8:
      logits, updates = model.apply({"params": params, "fp8_meta": fp8_state}, inputs,
                                    mutable=["fp8_meta"])
      fp8_state = updates["fp8_meta"]
    else:
      logits = model.apply({"params": params}, inputs)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()
    return loss, fp8_state

  return loss_fn


def _train_step(model, tx, fp8: bool):
  loss_fn = _loss(model, fp8)

  @jax.jit
  def train_step(params, opt_state, fp8_state, tokens):
    loss, grads, fp8_state = fp8jax.value_and_grad(loss_fn)(params, fp8_state, tokens)
    updates, opt_state = tx.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state, fp8_state, loss,
            optax.global_norm(grads))

  return train_step


def _eval_step(model, fp8: bool):
  @jax.jit
  def eval_step(params, fp8_state, tokens):
    variables = {"params": params, "fp8_meta": fp8_state} if fp8 else {"params": params}
    logits = model.apply(variables, tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

  return eval_step
