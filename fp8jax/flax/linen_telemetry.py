"""Tensor-level FP8 telemetry for linen models: every FP8 layer call sows its stats.

See `fp8jax.telemetry` for what the stats are and what they cost.
"""
from __future__ import annotations

import functools

import flax.linen as nn

from fp8jax.ops.einsum import parse_two_operand_subscripts
from fp8jax.flax import linen as fp8nn
from fp8jax.flax.linen_mlp import Fp8Mlp, MlpWeights
from fp8jax.flax.linen_qkv import Fp8NormQkvRope
from fp8jax.flax.master_kernel import master_kernel
from fp8jax.ops.dot import fp8_dot_general
from fp8jax.ops.mlp import quantized_activation
from fp8jax.ops.norm_dense import NORM_EPS, quantized_input
from fp8jax.telemetry import TELEMETRY_COLLECTION, dot_stats


def linen_tensor_stats():
  """A context in which fp8jax's linen FP8 layers sow `dot_stats` of each call.

  Inside it, every call of `Fp8Dense`, `Fp8DenseGeneral`, `Fp8Einsum` and
  `Fp8DotGeneral` (from `fp8jax.flax.linen`, subclasses too), of `Fp8NormQkvRope`
  (`fp8jax.flax.linen_qkv`: its normalized x and kernel), of `Fp8Mlp` (its
  "up" and "down" projections each, the down projection's x being the float32 GELU
  its cast quantizes), and of the
  `nn.Dense`, `nn.DenseGeneral` and `nn.Einsum` layers an `fp8jax.flax.Fp8Model`
  runs in FP8, whose module can write the "fp8_telemetry" collection sows
  `tensor_stats(x, meta.x)` under the name "x" and `tensor_stats(kernel,
  meta.kernel)` under "kernel" (x and kernel after the layer's dtype
  promotion, x normalized where the call passes `norm_scale`, i.e. the tensors its FP8
  op quantizes). Linen's `sow` keeps a
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
  return nn.intercept_methods(functools.partial(_sow_dot_stats, mlp_projections=[]))


def _sow_dot_stats(next_fun, args, kwargs, context, mlp_projections):
  """The `linen_tensor_stats` interceptor: runs the layer, then sows its operands' stats.

  `mlp_projections`: a stack, one list per `Fp8Mlp` call in progress, of the projection
  modules ("up", "down") its call creates, seen as they are called.
  """
  module = context.module
  if isinstance(module, Fp8Mlp) and context.method_name == "__call__":
    mlp_projections.append([])
    try:
      out = next_fun(*args, **kwargs)
    finally:
      projections = mlp_projections.pop()
    _sow_mlp_stats(module, args[0] if args else kwargs["inputs"], kwargs, projections)
    return out
  if isinstance(module, MlpWeights) and mlp_projections:
    mlp_projections[-1].append(module)
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
    x = _normalized(x, kwargs)
  for role, stats in dot_stats(x, kernel, meta, dimension_numbers=dimension_numbers).items():
    module.sow(TELEMETRY_COLLECTION, role, stats)
  return out


def _normalized(x, kwargs):
  """x as an FP8 layer's cast quantizes it: normalized where the call passed `norm_scale`
  (`fp8jax.fp8_rms_norm_dense`), after the residual add where it passed `residual`."""
  if kwargs.get("residual") is not None:
    x = x + kwargs["residual"].astype(x.dtype)
  if kwargs.get("norm_scale") is None:
    return x
  return quantized_input(x, kwargs["norm_scale"], kwargs.get("norm_eps", NORM_EPS))


def _sow_mlp_stats(module, inputs, kwargs, projections) -> None:
  """An `Fp8Mlp`'s stats, sown by its "up" and "down" modules: each projection's x and
  kernel as its casts quantize them (the normalized input where the call passed
  `norm_scale`; the up projection's output recomputed here, in FP8 with the step's scales,
  for the GELU the down projection's cast computes)."""
  if (module.is_initializing() or not module.is_mutable_collection(TELEMETRY_COLLECTION)
      or len(projections) != 2):
    return
  up, down = projections
  metas = [p.get_variable(fp8nn.FP8_COLLECTION, "dot_meta") for p in projections]
  stored = [nn.meta.unbox(p.get_variable("params", "kernel")) for p in projections]
  x, *promoted = nn.dtypes.promote_dtype(inputs, *stored, dtype=module.dtype)
  kernels = [master_kernel(k, p) for k, p in zip(stored, promoted)]
  x = _normalized(x, kwargs)
  dims = (((x.ndim - 1,), (0,)), ((), ()))
  h, _ = fp8_dot_general(x, kernels[0], metas[0], dims)
  activation = quantized_activation(h)
  for projection, operand, kernel, meta in zip(projections, (x, activation), kernels, metas):
    for role, stats in dot_stats(operand, kernel, meta).items():
      projection.sow(TELEMETRY_COLLECTION, role, stats)


_FP8_LAYERS = (fp8nn.Fp8Dense, fp8nn.Fp8DenseGeneral, fp8nn.Fp8Einsum, fp8nn.Fp8DotGeneral,
               Fp8NormQkvRope)
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
