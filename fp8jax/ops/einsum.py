"""`fp8_einsum`: two-operand einsum (as used in transformer projections) in FP8."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from fp8jax.core.meta import DotMeta
from fp8jax.ops.dot import fp8_dot_general


def fp8_einsum(subscripts: str, x: jax.Array, kernel: jax.Array,
               meta: DotMeta) -> tuple[jax.Array, DotMeta]:
  """`jnp.einsum(subscripts, x, kernel)` with the contraction run as an FP8 GEMM.

  Every label must appear in the output or in both operands (labels that appear
  in one operand only and not in the output would be a plain sum, not a GEMM).
  Labels in both operands and in the output are batch dims; labels in both but
  not in the output are contracted.

  Args:
    subscripts: explicit form "ab,bc->ac" (no ellipsis, no repeated labels).
    x: the activation operand; quantized with `meta.x`.
    kernel: the weight operand; quantized with `meta.kernel`.
    meta: this contraction's `DotMeta`.

  Returns:
    (out, new_meta), out in x's dtype.
  """
  x_labels, k_labels, out_labels = parse_two_operand_subscripts(subscripts, x.ndim, kernel.ndim)
  batch = [c for c in x_labels if c in k_labels and c in out_labels]
  contract = [c for c in x_labels if c in k_labels and c not in out_labels]
  dims = ((tuple(x_labels.index(c) for c in contract), tuple(k_labels.index(c) for c in contract)),
          (tuple(x_labels.index(c) for c in batch), tuple(k_labels.index(c) for c in batch)))
  out, new_meta = fp8_dot_general(x, kernel, meta, dims)
  # dot_general lays out [batch, x free, kernel free]; permute to the requested order.
  produced = batch + [c for c in x_labels if c not in k_labels] + [
      c for c in k_labels if c not in x_labels]
  out = jnp.transpose(out, tuple(produced.index(c) for c in out_labels))
  return out, new_meta


def parse_two_operand_subscripts(subscripts: str, x_ndim: int, k_ndim: int):
  """Splits "ab,bc->ac" into label strings and checks them against operand ranks."""
  spec = subscripts.replace(" ", "")
  if "..." in spec or "->" not in spec or spec.count(",") != 1:
    raise ValueError(
        f"subscripts={subscripts!r}: fp8_einsum takes the explicit two-operand form "
        "'xy,yz->xz' without ellipsis.")
  inputs, out_labels = spec.split("->")
  x_labels, k_labels = inputs.split(",")
  for name, labels, ndim in (("x", x_labels, x_ndim), ("kernel", k_labels, k_ndim)):
    if len(labels) != ndim:
      raise ValueError(
          f"subscripts={subscripts!r} gives {name} {len(labels)} labels but {name} has rank {ndim}.")
    if len(set(labels)) != len(labels):
      raise ValueError(f"subscripts={subscripts!r}: repeated label in {name}'s term (a trace).")
  for c in x_labels + k_labels:
    if c not in out_labels and not (c in x_labels and c in k_labels):
      raise ValueError(
          f"subscripts={subscripts!r}: label {c!r} is summed over one operand only; "
          "sum that operand first, then call fp8_einsum.")
  for c in out_labels:
    if c not in x_labels and c not in k_labels:
      raise ValueError(f"subscripts={subscripts!r}: output label {c!r} is in no operand.")
  if len(set(out_labels)) != len(out_labels):
    raise ValueError(f"subscripts={subscripts!r}: repeated label in the output.")
  return list(x_labels), list(k_labels), list(out_labels)
