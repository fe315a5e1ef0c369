"""One FP8 state under `jax.vmap`: the amax of the whole batch, as the folded batch records.

A model written for one example and vmapped over the batch threads one FP8
state (`in_axes=None`). Each op reduces the per-example amaxes it records by a
max over the vmapped axis (`fp8jax.core.quantize.unbatched_like`), in the forward pass
and in the output gradient's cotangent, where JAX would otherwise *sum* the
per-example cotangents of an unbatched input. Current scaling takes its scale
from the whole batch's amax too. So the state after a step is bit for bit the
state of the same step on the batch folded into the rows: maxes of the same
numbers, in any order.

A state per vmapped instance (`in_axes=0` for the state) keeps one amax per
instance.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp8jax

M, K, N = 4, 32, 16
RECIPES = {"delayed": fp8jax.DelayedScaling(), "current": fp8jax.CurrentScaling()}


def _inputs(batch):
  kx, kw = jax.random.split(jax.random.key(batch))
  # Gains that grow along the batch: the largest amax sits in the last example.
  gains = jnp.linspace(0.5, 4.0, batch)[:, None, None]
  x = jax.random.normal(kx, (batch, M, K), jnp.float32) * gains
  kernel = jax.random.normal(kw, (K, N), jnp.float32) / 4
  return x, kernel


def _per_example(kernel, meta, x):
  y, meta = fp8jax.fp8_dense(x, kernel, None, meta)
  return jnp.sum(y.astype(jnp.float32) ** 2), meta


def _vmapped(kernel, meta, x):
  losses, meta = jax.vmap(_per_example, in_axes=(None, None, 0), out_axes=(0, None))(
      kernel, meta, x)
  return jnp.sum(losses), meta


def _folded(kernel, meta, x):
  return _per_example(kernel, meta, x.reshape(-1, K))


def _assert_same_state(got, want):
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b),
                                  err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("recipe", list(RECIPES))
@pytest.mark.parametrize("batch", [1, 8, 32])
def test_vmapped_step_records_the_folded_batch_state(recipe, batch):
  x, kernel = _inputs(batch)
  meta = fp8jax.init_dot_meta(RECIPES[recipe])
  _, _, want = jax.jit(fp8jax.value_and_grad(_folded))(kernel, meta, x)
  _, _, got = jax.jit(fp8jax.value_and_grad(_vmapped))(kernel, meta, x)
  _assert_same_state(got, want)
  # Independent of the folded run: the newest history entries are the maxes over
  # the whole batch (x's and the kernel's computed here; the gradient's is not a sum).
  assert float(got.x.amax_history[0]) == float(jnp.max(jnp.abs(x)))
  assert float(got.kernel.amax_history[0]) == float(jnp.max(jnp.abs(kernel)))


def test_vmapped_gradient_amax_is_the_max_not_the_sum():
  batch = 8
  x, kernel = _inputs(batch)
  meta = fp8jax.init_dot_meta(RECIPES["delayed"])

  def dropping_state(kernel, meta, x):
    # The forward state is not returned: only the backward's record reaches the step.
    loss, _ = _vmapped(kernel, meta, x)
    return loss, meta

  _, _, state = jax.jit(fp8jax.value_and_grad(dropping_state))(kernel, meta, x)
  # dL/dy = 2 y per example; y = x @ kernel up to FP8 rounding of x and the kernel.
  y = np.einsum("bmk,kn->bmn", np.asarray(x, np.float64), np.asarray(kernel, np.float64))
  want = np.max(np.abs(2 * y))
  # Within the FP8 (E4M3, 3 mantissa bits) rounding of the GEMM's inputs: 2**-3 relative;
  # the sum over 8 examples would be several times larger.
  np.testing.assert_allclose(float(state.grad.amax_history[0]), want, rtol=2 ** -3)


def test_a_state_per_vmapped_instance_keeps_its_own_amaxes():
  batch = 4
  x, kernel = _inputs(batch)
  metas = jax.vmap(lambda _: fp8jax.init_dot_meta(RECIPES["delayed"]))(jnp.arange(batch))
  _, new_metas = jax.jit(jax.vmap(_per_example, in_axes=(None, 0, 0)))(kernel, metas, x)
  np.testing.assert_array_equal(np.asarray(new_metas.x.amax),
                                np.max(np.abs(np.asarray(x)), axis=(1, 2)))


def test_a_state_returned_batched_gets_a_clear_error():
  x, kernel = _inputs(8)
  meta = fp8jax.init_dot_meta(RECIPES["delayed"])

  def default_out_axes(kernel, meta, x):
    losses, meta = jax.vmap(_per_example, in_axes=(None, None, 0))(kernel, meta, x)
    return jnp.sum(losses), meta

  with pytest.raises(ValueError, match=r"extra leading axis of size 8.*out_axes=\(0, None\)"):
    fp8jax.value_and_grad(default_out_axes)(kernel, meta, x)


def test_vmapped_fp8_attention_records_the_folded_batch_state():
  batch, seq, heads, head_dim = 4, 32, 2, 64
  keys = jax.random.split(jax.random.key(3), 3)
  gains = jnp.linspace(0.5, 3.0, batch)[:, None, None, None, None]
  q, k, v = (jax.random.normal(key, (batch, 1, seq, heads, head_dim), jnp.bfloat16) * gains
             for key in keys)
  meta = fp8jax.init_attention_meta(RECIPES["delayed"])

  def per_example(qkv, meta):
    out, meta = fp8jax.fp8_attention(*qkv, meta, causal=True, backend="xla")
    return jnp.sum(out.astype(jnp.float32) ** 2), meta

  def vmapped(qkv, meta):
    losses, meta = jax.vmap(per_example, in_axes=(0, None), out_axes=(0, None))(qkv, meta)
    return jnp.sum(losses), meta

  def folded(qkv, meta):
    return per_example(tuple(a.reshape((batch,) + a.shape[2:]) for a in qkv), meta)

  _, _, want = jax.jit(fp8jax.value_and_grad(folded))((q, k, v), meta)
  _, _, got = jax.jit(fp8jax.value_and_grad(vmapped))((q, k, v), meta)
  _assert_same_state(got, want)
