"""Tensor-level FP8 telemetry for linen models: every FP8 layer call sows its stats.

See `fp8jax.telemetry` for what the stats are and what they cost.
"""
from __future__ import annotations

import flax.linen as nn

from fp8jax.ops.einsum import parse_two_operand_subscripts
from fp8jax.flax import linen as fp8nn
from fp8jax.flax.master_kernel import master_kernel
from fp8jax.telemetry import TELEMETRY_COLLECTION, dot_stats


def linen_tensor_stats():
  """A context in which fp8jax's linen FP8 layers sow `dot_stats` of each call.

  Inside it, every call of `Fp8Dense`, `Fp8DenseGeneral`, `Fp8Einsum` and
  `Fp8DotGeneral` (from `fp8jax.flax.linen`, subclasses too), and of the
  `nn.Dense`, `nn.DenseGeneral` and `nn.Einsum` layers an `fp8jax.flax.Fp8Model`
  runs in FP8, whose module can write the "fp8_telemetry" collection sows
  `tensor_stats(x, meta.x)` under the name "x" and `tensor_stats(kernel,
  meta.kernel)` under "kernel" (x and kernel after the layer's dtype
  promotion, i.e. the tensors its FP8 op quantizes). Linen's `sow` keeps a
  tuple with one entry per call. It does nothing while the collection is not
  mutable and during `init`, so it can stay on for every step:

    with linen_tensor_stats():
      y, updates = model.apply({"params": p, "fp8_meta": s}, x,
                               mutable=["fp8_meta", "fp8_telemetry"])
    telemetry = updates["fp8_telemetry"]   # {"Fp8Dense_0": {"x": (TensorStats,), ...}}

  Enter it around the `apply` inside the traced loss function (an interceptor
  acts while JAX traces). Under `nn.scan`, add "fp8_telemetry" to
  `variable_axes` to get per-layer stats.

  Returns:
    A context manager (`flax.linen.intercept_methods` with fp8jax's interceptor).
  """
  return nn.intercept_methods(_sow_dot_stats)


def _sow_dot_stats(next_fun, args, kwargs, context):
  """The `linen_tensor_stats` interceptor: runs the layer, then sows its operands' stats."""
  module = context.module
  out = next_fun(*args, **kwargs)
  if (context.method_name != "__call__" or not _runs_in_fp8(module)
      or module.is_initializing() or not module.is_mutable_collection(TELEMETRY_COLLECTION)):
    return out
  # Within a step only the running amax of a meta changes, so the meta read
  # after the call has the scale the call quantized with.
  meta = module.get_variable(fp8nn.FP8_COLLECTION, "dot_meta")
  if isinstance(module, fp8nn.Fp8DotGeneral):
    x = args[0] if len(args) > 0 else kwargs["lhs"]
    kernel = args[1] if len(args) > 1 else kwargs["rhs"]
    dimension_numbers = args[2] if len(args) > 2 else kwargs["dimension_numbers"]
  else:
    x = args[0] if args else kwargs.get("x", kwargs.get("inputs"))
    kernel = nn.meta.unbox(module.get_variable("params", "kernel"))
    x, promoted = nn.dtypes.promote_dtype(x, kernel, dtype=module.dtype)
    kernel = master_kernel(kernel, promoted)  # what the layer quantizes
    dimension_numbers = _contraction(module, x, kernel)
  for role, stats in dot_stats(x, kernel, meta, dimension_numbers=dimension_numbers).items():
    module.sow(TELEMETRY_COLLECTION, role, stats)
  return out


_FP8_LAYERS = (fp8nn.Fp8Dense, fp8nn.Fp8DenseGeneral, fp8nn.Fp8Einsum, fp8nn.Fp8DotGeneral)
# The Flax layers `fp8jax.flax.Fp8Model` converts; FP8 where they hold FP8 state.
_CONVERTED_LAYERS = (nn.Dense, nn.DenseGeneral, nn.Einsum)


def _runs_in_fp8(module) -> bool:
  if isinstance(module, _FP8_LAYERS):
    return True
  return (isinstance(module, _CONVERTED_LAYERS)
          and module.has_variable(fp8nn.FP8_COLLECTION, "dot_meta")
          and getattr(module, "einsum_str", "") is not None)  # nn.Einsum's given at init


def _contraction(module, x, kernel):
  """The layer's contracting axes as dot_general dimension numbers ((x axes, kernel axes),
  ((), ())): what the per-row / per-block stats fold x and the kernel along."""
  if isinstance(module, (fp8nn.Fp8DenseGeneral, nn.DenseGeneral)):
    axis = module.axis if isinstance(module.axis, (tuple, list)) else (module.axis,)
    x_axes = tuple(a % x.ndim for a in axis)
    return (x_axes, tuple(range(len(x_axes)))), ((), ())
  if isinstance(module, (fp8nn.Fp8Einsum, nn.Einsum)):
    x_labels, k_labels, out_labels = parse_two_operand_subscripts(module.einsum_str, x.ndim,
                                                                  kernel.ndim)
    contracted = [label for label in x_labels if label in k_labels and label not in out_labels]
    return ((tuple(x_labels.index(l) for l in contracted),
             tuple(k_labels.index(l) for l in contracted)), ((), ()))
  return ((x.ndim - 1,), (0,)), ((), ())
