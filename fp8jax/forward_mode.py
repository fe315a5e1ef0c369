"""fp8jax's own error for forward-mode differentiation of an FP8 op.

An FP8 op's derivative is its custom backward pass: it quantizes the output
gradient to FP8 with the op's gradient scale and records its amax in the FP8
state. Forward mode (`jax.jvp`, `jax.jacfwd`)
has no such pass, and JAX's generic message for it ("can't apply forward-mode
autodiff (jvp) to a custom_vjp function") does not say what to do instead.

The translation happens where the op is traced: `jax.jvp(f)` or `jax.jacfwd(f)`
of a function that calls the op. When the op was traced earlier into a program
that forward mode then transforms (`jax.jvp(jax.jit(f))`, an op inside
`lax.scan` / `nn.scan`), JAX raises its own TypeError, whose cause is the same.
"""
from __future__ import annotations

import contextlib


FP8_BACKWARD = ("its backward pass quantizes the output gradient to FP8 and records its amax "
                "in the FP8 state")


class ForwardModeError(TypeError):
  """Forward-mode differentiation was applied to an FP8 op, which supports reverse mode only."""


@contextlib.contextmanager
def reverse_mode_only(op: str, high_precision_twin: str, why: str = FP8_BACKWARD):
  """Turns JAX's forward-mode error, raised while `op` is traced, into `ForwardModeError`.

  Args:
    op: the public op's name, e.g. "fp8jax.fp8_dot_general".
    high_precision_twin: what computes the same thing with plain JAX ops, for the message.
    why: what the op's own backward pass does that forward mode cannot.
  """
  try:
    yield
  except TypeError as error:
    if "forward-mode autodiff" not in str(error):
      raise
    raise ForwardModeError(
        f"{op} supports reverse-mode differentiation only (jax.grad, jax.vjp, "
        f"jax.jacrev, fp8jax.value_and_grad): {why}, which forward mode "
        "(jax.jvp, jax.jacfwd) cannot do. Use jax.jacrev for "
        f"Jacobians, or for forward-mode derivatives evaluate {high_precision_twin} on the "
        "same arrays.") from None
