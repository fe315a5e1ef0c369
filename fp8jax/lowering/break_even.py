"""Where FP8 starts to pay for one dense layer, by the cost model: `break_even_size`.

`predicted_speedup(m, k, n, recipe=...)` compiles one `fp8_dense` layer's forward
and backward pass (delayed scaling unless a recipe is given) and its bf16 twin
for an H100 (deviceless by default) and divides their predicted times
(`fp8jax.lowering.cost`); `break_even_size()` bisects for
the smallest square layer predicted at least as fast in FP8. The default layer
filter of `fp8jax.flax.layer_filter` takes its threshold from it.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from fp8jax.lowering.cost import compare, cost
from fp8jax.lowering.example import bf16_mlp_loss, mlp_loss
from fp8jax.core.meta import init_dot_meta
from fp8jax.core.recipes import DelayedScaling
from fp8jax.step.training import value_and_grad

# cuBLASLt's FP8 GEMM wants dims in multiples of 16; the search steps by it.
DIM_MULTIPLE = 16


@dataclasses.dataclass(frozen=True)
class BreakEven:
  """The result of `break_even_size`.

  Attributes:
    size: the smallest side (a multiple of `multiple`) predicted at least as fast in FP8.
    speedups: the predicted FP8 speedup at every side the search compiled.
  """

  size: int
  speedups: dict


def predicted_speedup(m: int, k: int, n: int, constants=None,
                      target: str = "deviceless", recipe=None) -> float:
  """Predicted bf16 time / FP8 time of one dense layer's forward and backward pass.

  The FP8 step is `fp8jax.value_and_grad` over the built-in example's
  `mlp_loss` with one `fp8_dense` layer; the bf16 twin is `jax.value_and_grad`
  over its `bf16_mlp_loss` (`fp8jax.lowering.example`). The input x is
  differentiated too, so both steps have the fprop, dgrad and wgrad GEMMs of a
  layer inside a model.

  Args:
    m, k, n: x is bf16 [m, k], the kernel float32 [k, n] (with a bias [n]).
    constants: `fp8jax.lowering.CostConstants` (default: the H100 SXM ones).
    target: as for `fp8jax.lowering.cost`.
    recipe: the FP8 layer's scaling recipe (default `DelayedScaling()`).

  Returns:
    The predicted speedup (> 1: FP8 is faster).
  """
  recipe = DelayedScaling() if recipe is None else recipe
  def fp8_layer_step(params, fp8_state, y):
    loss = lambda p, s, y: mlp_loss([p["layer"]], s, {"x": p["x"], "y": y})
    return value_and_grad(loss)(params, fp8_state, y)

  def bf16_layer_step(params, fp8_state, y):
    loss = lambda p, s, y: bf16_mlp_loss([p["layer"]], s, {"x": p["x"], "y": y})
    return jax.value_and_grad(loss, has_aux=True)(params, fp8_state, y)

  spec = jax.ShapeDtypeStruct
  params = {"x": spec((m, k), jnp.bfloat16),
            "layer": {"kernel": spec((k, n), jnp.float32), "bias": spec((n,), jnp.float32)}}
  y = spec((m, n), jnp.bfloat16)
  fp8_state = jax.eval_shape(lambda: [init_dot_meta(recipe)])
  fp8 = cost(fp8_layer_step, params, fp8_state, y, target=target, constants=constants)
  bf16 = cost(bf16_layer_step, params, [], y, target=target, constants=constants)
  return compare(fp8, bf16).speedup


def break_even_size(low: int = DIM_MULTIPLE, high: int = 8192, multiple: int = DIM_MULTIPLE,
                    constants=None, target: str = "deviceless") -> BreakEven:
  """The smallest square layer side n in [low, high] with predicted FP8 time <= bf16 time.

  Bisects over multiples of `multiple`, with M = K = N = n in `predicted_speedup`
  (two compiles per side tried), assuming the speedup grows with n.
  `break_even_size()` gives `fp8jax.flax.layer_filter.BREAK_EVEN_SIZE`.

  Args:
    low, high: the sides to search between (multiples of `multiple`).
    multiple: the step of the search.
    constants, target: as for `predicted_speedup`.

  Returns:
    A `BreakEven` with the size and the speedup at every side compiled.
  """
  for name, value in (("low", low), ("high", high), ("multiple", multiple)):
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
      raise ValueError(f"{name}={value!r} must be a positive integer.")
  if low % multiple or high % multiple or low > high:
    raise ValueError(f"low={low} and high={high} must be multiples of multiple={multiple} "
                     "with low <= high.")
  speedups = {}

  def gains(side):
    speedups[side] = predicted_speedup(side, side, side, constants, target)
    return speedups[side] >= 1.0

  if not gains(high):
    raise ValueError(f"FP8 is not predicted to gain even at n={high} "
                     f"(speedup {speedups[high]:.3f}); search up to a larger high.")
  if gains(low):
    return BreakEven(low, speedups)
  lo, hi = low // multiple, high // multiple  # gains(lo * multiple) is False, gains(hi * ...) True
  while hi - lo > 1:
    mid = (lo + hi) // 2
    if gains(mid * multiple):
      hi = mid
    else:
      lo = mid
  return BreakEven(hi * multiple, speedups)
