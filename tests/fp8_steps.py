"""Helpers for tests that train a few exact FP8 steps: a warmed-up `DotMeta` and the steps."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

import fp8jax


def warm_dot_meta(recipe, scales) -> fp8jax.DotMeta:
  """A meta whose delayed scales are set (as after warm-up), one per role (x, kernel, grad)."""
  meta = fp8jax.init_dot_meta(recipe)
  return dataclasses.replace(meta, **{role: getattr(meta, role).with_scale(s)
                                      for role, s in zip(("x", "kernel", "grad"), scales)})


def exact_steps(loss, params, state, steps: int) -> list:
  """`steps` jitted `fp8jax.value_and_grad(loss)` steps, `loss(params, state, factor)` with
  factor = 1, 2, ... (float32), compiled without excess precision (so that two programs
  doing the same float32 arithmetic agree bit for bit). Returns (loss, grads, state) of
  every step, the state threaded."""
  step = jax.jit(fp8jax.value_and_grad(loss)).lower(params, state, jnp.float32(1)).compile(
      compiler_options={"xla_allow_excess_precision": False})
  trajectory = []
  for i in range(steps):
    loss_value, grads, state = step(params, state, jnp.float32(i + 1))
    trajectory.append((loss_value, grads, state))
  return trajectory
