"""`fp8_dense`: `x @ kernel + bias` with the matmul in FP8."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from fp8jax.core.meta import DotMeta
from fp8jax.core.validation import check_floating
from fp8jax.ops.dot import fp8_dot_general


def fp8_dense(x: jax.Array, kernel: jax.Array, bias: jax.Array | None,
              meta: DotMeta, *, x_amax: jax.Array | None = None) -> tuple[jax.Array, DotMeta]:
  """Dense layer `x @ kernel + bias` with FP8 fprop, dgrad and wgrad GEMMs.

  Args:
    x: [..., K] floating array; any number of leading batch dims.
    kernel: [K, N] floating array.
    bias: [N] array or None.
    meta: the layer's `DotMeta`.
    x_amax: optional float32[] max|x| from the op that wrote x (see `fp8_dot_general`):
      current scaling then reads x once instead of twice.

  Returns:
    (y, new_meta): y is [..., N] in x's dtype; new_meta has this use's amaxes.
  """
  check_floating(x, "x")
  check_floating(kernel, "kernel")
  if x.ndim < 1 or kernel.ndim != 2:
    raise ValueError(
        f"fp8_dense wants x of shape [..., K] and kernel of shape [K, N]; got x "
        f"{x.shape} and kernel {kernel.shape}. Reshape the kernel to 2-D "
        "(or use fp8jax.fp8_dot_general for other layouts).")
  if x.shape[-1] != kernel.shape[0]:
    raise ValueError(
        f"x's last dimension ({x.shape[-1]}) must equal kernel's first ({kernel.shape[0]}); "
        f"got x {x.shape} and kernel {kernel.shape}.")
  if bias is not None and jnp.shape(bias) != (kernel.shape[1],):
    raise ValueError(
        f"bias has shape {jnp.shape(bias)}, expected ({kernel.shape[1]},) to match the "
        f"kernel {kernel.shape}.")
  # A 2-D GEMM is what cuBLASLt runs; folding the batch dims is a free reshape.
  batch_shape = x.shape[:-1]
  x2d = x.reshape(-1, x.shape[-1])
  y, new_meta = fp8_dot_general(x2d, kernel, meta, (((1,), (0,)), ((), ())), x_amax=x_amax)
  y = y.reshape(*batch_shape, kernel.shape[1])
  if bias is not None:
    y = y + bias.astype(y.dtype)
  return y, new_meta
