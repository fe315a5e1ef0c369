"""Token routing of a dropless mixture-of-experts layer: top-k choice, sort, unsort, combine.

    routing = route_top_k(router_logits, k)              # each token's k experts, weights
    x_sorted, group_sizes, order = sort_by_expert(tokens, routing.experts, num_experts)
    y_sorted = expert MLP of x_sorted (grouped matmuls: fp8jax.fp8_ragged_dot)
    y = combine(y_sorted, order, routing.weights)

Every token is processed by all k of its experts (no capacity, nothing dropped): the
T * k (token, expert) pairs are sorted by expert, so each expert's rows are contiguous
and `group_sizes` counts them, which is the layout `jax.lax.ragged_dot` and the grouped
FP8 kernels take. The weights are the top-k router probabilities renormalized to sum to
1 per token (Mixtral's rule); `load_balancing_loss` is the Switch Transformer auxiliary
loss that keeps the experts' loads even.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class Routing(NamedTuple):
  """Where each token goes.

  Attributes:
    experts: int32 [T, k], each token's chosen experts, best first.
    weights: float32 [T, k], their combine weights (sum 1 per token).
    probs: float32 [T, E], the router's probabilities (for the balancing loss).
  """

  experts: jax.Array
  weights: jax.Array
  probs: jax.Array


def route_top_k(logits: jax.Array, k: int) -> Routing:
  """Each token's top-k experts by router probability.

  Args:
    logits: [T, E] router logits (any float dtype; the softmax is float32).
    k: experts per token, 1 <= k <= E.

  Returns:
    `Routing`: experts int32 [T, k], weights float32 [T, k], probs float32 [T, E].
  """
  num_experts = logits.shape[-1]
  if not isinstance(k, int) or not 1 <= k <= num_experts:
    raise ValueError(f"top_k={k!r} must be an int in [1, {num_experts}] (the number of "
                     "experts).")
  probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
  top_probs, experts = jax.lax.top_k(probs, k)
  weights = top_probs / jnp.sum(top_probs, axis=-1, keepdims=True)
  return Routing(experts=experts.astype(jnp.int32), weights=weights, probs=probs)


def load_balancing_loss(routing: Routing) -> jax.Array:
  """The Switch Transformer auxiliary loss (Fedus et al. 2021) of one routing.

  f_e is the fraction of (token, expert) assignments that go to expert e, P_e the mean
  router probability of e. It is 1 when both are uniform, and its gradient (through P)
  pushes probability away from overloaded experts.

  Returns:
    float32[]: num_experts * sum_e f_e * P_e.
  """
  num_experts = routing.probs.shape[-1]
  assigned = jax.nn.one_hot(routing.experts, num_experts, dtype=jnp.float32)  # [T, k, E]
  fraction = jnp.mean(jnp.sum(assigned, axis=1), axis=0) / routing.experts.shape[-1]
  mean_prob = jnp.mean(routing.probs, axis=0)
  return num_experts * jnp.sum(jax.lax.stop_gradient(fraction) * mean_prob)


def sort_by_expert(tokens: jax.Array, experts: jax.Array,
                   num_experts: int) -> tuple[jax.Array, jax.Array, jax.Array]:
  """The (token, expert) pairs sorted by expert.

  Args:
    tokens: [T, d].
    experts: int32 [T, k].
    num_experts: E.

  Returns:
    (x_sorted [T * k, d]: each pair's token, rows grouped by expert in expert order;
    group_sizes int32 [E]: rows per expert; order int32 [T * k]: pair i of the sorted
    rows is pair order[i] of experts.reshape(-1), i.e. token order[i] // k).
  """
  k = experts.shape[-1]
  flat = experts.reshape(-1)
  order = jnp.argsort(flat, stable=True).astype(jnp.int32)
  group_sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
  return tokens[order // k], group_sizes, order


def combine(y_sorted: jax.Array, order: jax.Array, weights: jax.Array) -> jax.Array:
  """Each token's experts' outputs, unsorted, weighted and summed.

  Args:
    y_sorted: [T * k, d], the experts' outputs in `sort_by_expert`'s order.
    order: int32 [T * k] from `sort_by_expert`.
    weights: [T, k] combine weights.

  Returns:
    [T, d] in y_sorted's dtype.
  """
  tokens, k = weights.shape
  unsorted = jnp.zeros_like(y_sorted).at[order].set(y_sorted, unique_indices=True)
  unsorted = unsorted.reshape(tokens, k, -1)
  return jnp.einsum("tkd,tk->td", unsorted, weights.astype(unsorted.dtype))
