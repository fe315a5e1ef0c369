"""Holes at the edges: an empty batch, and forward-mode differentiation of FP8 ops."""
import jax
import ml_dtypes
import jax.numpy as jnp
import numpy as np
import pytest

import fp8jax
from fp8jax.ops.guards import ForwardModeError

RECIPES = [fp8jax.DelayedScaling(), fp8jax.CurrentScaling()]


def _kernel(shape=(32, 16)):
  return jax.random.normal(jax.random.key(0), shape, jnp.bfloat16)


def _bits(tree):
  return [np.asarray(leaf).tobytes() for leaf in jax.tree.leaves(tree)]


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: type(r).__name__)
def test_empty_batch_gives_an_empty_output_and_records_no_amax(recipe):
  meta = fp8jax.init_dot_meta(recipe)
  # A running amax from earlier uses in the step: an empty batch must leave it as it is.
  earlier = fp8jax.fp8_dense(jax.random.normal(jax.random.key(1), (4, 32), jnp.bfloat16),
                             _kernel(), None, meta)[1]
  x = jnp.zeros((0, 32), jnp.bfloat16)
  y, new_meta = jax.jit(fp8jax.fp8_dense)(x, _kernel(), jnp.ones((16,), jnp.bfloat16), earlier)
  assert y.shape == (0, 16) and y.dtype == jnp.bfloat16
  assert float(new_meta.x.amax) == float(earlier.x.amax) > 0
  assert _bits(new_meta) == _bits(earlier)


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: type(r).__name__)
def test_empty_batch_train_step_gives_zero_grads_and_keeps_the_state_finite(recipe):
  kernel, meta = _kernel(), fp8jax.init_dot_meta(recipe)

  def loss_fn(kernel, meta, x):
    y, meta = fp8jax.fp8_dense(x, kernel, None, meta)
    return jnp.sum(y.astype(jnp.float32)), meta

  for x in (jnp.zeros((0, 32), jnp.bfloat16), jnp.zeros((2, 0, 32), jnp.bfloat16)):
    loss, grads, next_meta = jax.jit(fp8jax.value_and_grad(loss_fn))(kernel, meta, x)
    assert float(loss) == 0.0
    np.testing.assert_array_equal(grads, np.zeros_like(grads))
    # Nothing observed: x and grad record amax 0, so their scales stay where they were.
    np.testing.assert_array_equal(next_meta.x.scale, meta.x.scale)
    np.testing.assert_array_equal(next_meta.grad.scale, meta.grad.scale)
    assert all(np.all(np.isfinite(leaf)) for leaf in jax.tree.leaves(next_meta))


def test_empty_batch_through_general_dot_and_einsum():
  meta = fp8jax.init_dot_meta(fp8jax.DelayedScaling())
  kernel = jax.random.normal(jax.random.key(2), (4, 8, 16), jnp.bfloat16)
  x = jnp.zeros((0, 5, 4, 8), jnp.bfloat16)
  y, new_meta = fp8jax.fp8_einsum("bshk,hkd->bsd", x, kernel, meta)
  assert y.shape == (0, 5, 16)
  assert float(new_meta.x.amax) == 0.0 and float(new_meta.kernel.amax) > 0
  batched = jax.random.normal(jax.random.key(3), (3, 8, 16), jnp.bfloat16)
  out, _ = fp8jax.fp8_dot_general(jnp.zeros((3, 0, 8), jnp.bfloat16), batched, meta,
                                  (((2,), (1,)), ((0,), (0,))))
  assert out.shape == (3, 0, 16)


def _dense(x):
  meta = fp8jax.init_dot_meta(fp8jax.DelayedScaling())
  return fp8jax.fp8_dense(x, _kernel(), None, meta)[0]


@pytest.mark.parametrize("transform", [
    lambda f, x: jax.jvp(f, (x,), (jnp.ones_like(x),)),
    lambda f, x: jax.jacfwd(f)(x),
], ids=["jvp", "jacfwd"])
def test_forward_mode_gets_fp8jax_message_with_what_to_use_instead(transform):
  x = jax.random.normal(jax.random.key(4), (2, 32), jnp.float32)
  with pytest.raises(ForwardModeError, match=r"An FP8 matmul \(fp8jax.fp8_dot_general.*\) supports "
                     r"reverse-mode differentiation only.*jax.jacrev.*jax.lax.dot_general"):
    transform(_dense, x)


def test_reverse_mode_jacobian_still_works_and_is_the_e4m3_kernel():
  # jax.jacrev is what the message offers. Row n of d(x @ k)/dx is column n of the
  # kernel as the FP8 backward pass sees it: the one-hot cotangent is exact in E5M2
  # (its scale maps 1 to E5M2's max, a power of two), so the Jacobian is the kernel
  # rounded to E4M3 at its scale (1, fresh delayed state), up to the float32
  # product of the two descales (exact: both are powers of two here).
  x = jax.random.normal(jax.random.key(5), (1, 32), jnp.float32)
  jacobian = jax.jacrev(_dense)(x)  # [1, 16, 1, 32]
  kernel_e4m3 = np.asarray(_kernel(), np.float32).astype(ml_dtypes.float8_e4m3fn)
  np.testing.assert_array_equal(np.asarray(jacobian[0, :, 0, :]),
                                kernel_e4m3.astype(np.float32).T)


def test_forward_mode_through_fp8_attention_gets_fp8jax_message():
  q = jax.random.normal(jax.random.key(6), (1, 16, 2, 64), jnp.bfloat16)
  meta = fp8jax.init_attention_meta(fp8jax.DelayedScaling())
  f = lambda q: fp8jax.fp8_attention(q, q, q, meta, causal=True, backend="xla")[0]
  with pytest.raises(ForwardModeError, match="fp8jax.fp8_attention supports reverse-mode"):
    jax.jvp(f, (q,), (jnp.ones_like(q),))


def test_empty_batch_through_fp8_attention():
  q = jnp.zeros((0, 16, 2, 64), jnp.bfloat16)
  meta = fp8jax.init_attention_meta(fp8jax.DelayedScaling())
  out, new_meta = fp8jax.fp8_attention(q, q, q, meta, causal=True, backend="xla")
  assert out.shape == q.shape
  assert float(new_meta.q.amax) == 0.0 and float(new_meta.o.amax) == 0.0
