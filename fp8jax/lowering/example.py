"""The built-in example: one jitted train step of an MLP made of `fp8_dense` layers.

Forward and backward run through `fp8jax.value_and_grad`; optax's Adam updates
the parameters (never the FP8 state). Every `fp8_dense` gives three GEMMs
(fprop, dgrad, wgrad), except that the first layer has no dgrad: the gradient
with respect to the input batch is not needed, so XLA removes it.
"""
from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import optax

import fp8jax


def mlp_loss(params, fp8_state, batch):
  """Mean squared error of the MLP `x -> dense -> gelu -> ... -> dense` on `batch`.

  Args:
    params: list of {"kernel": [K, N], "bias": [N]} per layer.
    fp8_state: list of `DotMeta`, one per layer.
    batch: {"x": [B, S, widths[0]] bf16, "y": [B, S, widths[-1]] bf16}.

  Returns:
    (loss float32[], new fp8_state).
  """
  h = batch["x"]
  new_state = []
  for i, (layer, meta) in enumerate(zip(params, fp8_state)):
    h, meta = fp8jax.fp8_dense(h, layer["kernel"], layer["bias"], meta)
    new_state.append(meta)
    if i + 1 < len(params):
      h = jax.nn.gelu(h)
  loss = jnp.mean(jnp.square(h.astype(jnp.float32) - batch["y"].astype(jnp.float32)))
  return loss, new_state


def make_train_step(optimizer: optax.GradientTransformation) -> Callable:
  """`step(params, opt_state, fp8_state, batch) -> (params, opt_state, fp8_state, loss)`, jitted."""
  grad_fn = fp8jax.value_and_grad(mlp_loss)

  @jax.jit
  def train_step(params, opt_state, fp8_state, batch):
    loss, grads, fp8_state = grad_fn(params, fp8_state, batch)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, fp8_state, loss

  return train_step


def example_train_step(widths: Sequence[int] = (512, 1024, 1024, 512), batch_size: int = 8,
                       seq_len: int = 256, recipe=None) -> tuple[Callable, tuple]:
  """The example train step and argument specs (shapes and dtypes only) to compile it with.

  Args:
    widths: feature sizes; layer i maps widths[i] -> widths[i + 1].
    batch_size, seq_len: the leading dims of the [B, S, features] batch.
    recipe: the FP8 recipe (default `fp8jax.DelayedScaling()`).

  Returns:
    (train_step, (params, opt_state, fp8_state, batch)) with `jax.ShapeDtypeStruct` leaves.
  """
  if len(widths) < 2:
    raise ValueError(f"widths={tuple(widths)!r} needs at least two sizes (one layer).")
  recipe = recipe if recipe is not None else fp8jax.DelayedScaling()
  optimizer = optax.adam(1e-3)

  def init():
    keys = jax.random.split(jax.random.key(0), len(widths) - 1)
    params = [{"kernel": jax.random.normal(k, (n_in, n_out), jnp.float32) / n_in**0.5,
               "bias": jnp.zeros((n_out,), jnp.float32)}
              for k, n_in, n_out in zip(keys, widths[:-1], widths[1:])]
    fp8_state = [fp8jax.init_dot_meta(recipe) for _ in params]
    batch = {"x": jnp.zeros((batch_size, seq_len, widths[0]), jnp.bfloat16),
             "y": jnp.zeros((batch_size, seq_len, widths[-1]), jnp.bfloat16)}
    return params, optimizer.init(params), fp8_state, batch

  return make_train_step(optimizer), jax.eval_shape(init)
