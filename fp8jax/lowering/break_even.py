"""Where FP8 pays for one dense layer, by the cost model: `layer_times`, `break_even_size`.

A dense layer `x [M, K] @ kernel [K, N]` (a float32 master kernel) costs a train step
three GEMMs, fprop, dgrad and wgrad, of 2 M K N FLOPs each. In bf16 it also converts
the kernel to bf16 once; in FP8 (delayed scaling, fp8jax's lean path: `fp8_dense`,
`Fp8Dense`, the layers `Fp8Model` and `convert_to_fp8` make) it runs the three GEMMs
at the FP8 rate and pays for them with passes that quantize: the kernel (one pass
over its float32 master that writes both FP8 layouts, as long as bf16's convert), x
and the output gradient (each read once, written twice in FP8: as is and transposed),
and the step's one launch that updates every scale. `layer_times(m, k, n)` predicts
each of those kernels with `fp8jax.lowering.cost`'s roofline and constants, and
`break_even_size` finds the smallest square layer that FP8 makes no slower.

The prediction is the cost model's own, only faster: compiled for an H100 without a
GPU (`compiled_layer_steps`), the FP8 and bf16 steps of one layer differ by exactly
these kernels (their loss and bias kernels are the same in both), and
tests/test_layer_filter.py holds `layer_times` to the compiled programs' difference.
It takes microseconds, so the default layer filter of `fp8jax.flax.layer_filter` asks
it about every layer of a model.

Launches cost `CostConstants.kernel_overhead_s`, the program's top level: a layer of a
model whose layers are unrolled (the demo GPT's default, and what XLA does with a
Python loop over layers). Inside a rolled `nn.scan` / `lax.scan` each launch costs
`loop_kernel_overhead_s` (3.25 us, not 1.3 us), and FP8's three extra launches move the
square break-even at 4096 tokens from 1040 to 1296; pass constants with
`kernel_overhead_s=loop_kernel_overhead_s` to predict that case.

Why all three GEMMs or none (a recipe's `high_precision` can keep some in bf16): a
GEMM left in high precision takes `fp8_dot_general`'s general path, which keeps the
unquantized operand for the backward, quantizes with separate amax passes and lets
XLA place the transposes. Compiled for an H100, such a layer is slower than both its
bf16 and its all-FP8 step at every shape where one GEMM alone could pay: the FP8
fprop alone (dgrad and wgrad in bf16) at M x K x N = 8192 x 512 x 2048 predicts
211.1 us against bf16's 152.4 and all-FP8's 156.5; 8192 x 384 x 1536: 144.0 against
103.7 and 116.1; 32768 x 512 x 2048: 746.3 against 552.3 and 555.8; the FP8 dgrad
alone at 8192 x 2048 x 512: 172.1 against 105.6 and 109.7 (whole one-layer steps).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from fp8jax.lowering.cost import CostConstants, CostReport, compare, cost
from fp8jax.lowering.example import bf16_mlp_loss, mlp_loss
from fp8jax.core.meta import init_dot_meta
from fp8jax.core.recipes import GEMMS, DelayedScaling
from fp8jax.core.validation import check_int
from fp8jax.step.training import value_and_grad

#: cuBLASLt's FP8 GEMM wants dims in multiples of 16; the search steps by it.
DIM_MULTIPLE = 16
#: The tokens M of a layer's GEMMs (rows of x per device and step) that the default layer
#: filter decides at, since a model is initialized before it sees a training batch.
#: FP8's extra launches are fixed while what its GEMMs save and what its casts of x and
#: the gradient cost grow with M, so a layer predicted to gain at 4096 tokens gains at
#: every larger step too (tests/test_layer_filter.py checks it over a grid of K and N):
#: 2 x 2048, 4 x 1024, 8 x 1024 (the demo GPT's 350m). Below 4096 tokens some layers it
#: chooses are slower in FP8.
DECISION_TOKENS = 4096
_FP8, _BF16 = "f8e4m3fn", "bf16"


@dataclasses.dataclass(frozen=True)
class LayerTimes:
  """The predicted seconds one dense layer adds to a train step, kernel by kernel.

  Attributes:
    m, k, n: x is [m, k], the kernel [k, n].
    bf16: {"weight": the kernel's f32 -> bf16 convert, "fprop", "dgrad", "wgrad": the
      bf16 GEMMs}.
    fp8: {"weight", "x", "grad": the casts of the kernel (from its f32 master), x and
      the output gradient, "scale_update": the step's one update of every scale
      (charged to each layer: a model with one FP8 layer pays all of it), "fprop",
      "dgrad", "wgrad": the FP8 GEMMs}.
  """

  m: int
  k: int
  n: int
  bf16: dict
  fp8: dict

  @property
  def bf16_s(self) -> float:
    return sum(self.bf16.values())

  @property
  def fp8_s(self) -> float:
    return sum(self.fp8.values())

  @property
  def speedup(self) -> float:
    """bf16 time / FP8 time (> 1: FP8 is faster)."""
    return self.bf16_s / self.fp8_s

  @property
  def fp8_pays(self) -> bool:
    """Whether FP8 is predicted no slower than bf16."""
    return self.fp8_s <= self.bf16_s


def layer_times(m: int, k: int, n: int, constants: CostConstants | None = None) -> LayerTimes:
  """The kernels one dense layer adds to a train step, in bf16 and in FP8, predicted.

  Each kernel is `constants.kernel_time(flops, bytes)` (see `fp8jax.lowering.cost`):

  * bf16: convert the kernel (4 K N bytes read, 2 K N written); fprop, dgrad, wgrad
    read two bf16 operands and write a bf16 result, 2 M K N FLOPs each.
  * FP8: cast the kernel (4 K N read; 2 K N written: both layouts), x (2 M K read,
    2 M K written) and the output gradient (2 M N, 2 M N); one scale update (a launch);
    the GEMMs read FP8 operands (1 byte an element) and write bf16.

  What both steps share (the layer's input, bias and the optimizer's f32 gradient) is
  left out: `fp8_s - bf16_s` is what FP8 changes.

  Args:
    m, k, n: x [m, k], kernel [k, n] (positive ints).
    constants: `CostConstants` (default: the H100 SXM ones).

  Returns:
    A `LayerTimes`.
  """
  for name, value in (("m", m), ("k", k), ("n", n)):
    check_int(name, value, minimum=1)
  if constants is not None and not isinstance(constants, CostConstants):
    raise TypeError(f"constants must be a fp8jax.lowering.CostConstants (or None for the "
                    f"H100 defaults), got {type(constants).__name__}.")
  c = constants or CostConstants()
  flops = 2 * m * k * n
  # (rows, contracted, columns) of each GEMM's operands [rows, contracted] x [contracted,
  # columns] -> [rows, columns].
  shapes = {"fprop": (m, k, n), "dgrad": (m, n, k), "wgrad": (k, m, n)}

  def gemm(shape, itemsize, dtype):
    rows, inner, cols = shape
    return c.kernel_time(flops, itemsize * (rows * inner + inner * cols) + 2 * rows * cols,
                         dtype)

  bf16 = {"weight": c.kernel_time(0, 6 * k * n)}
  bf16.update({g: gemm(shapes[g], 2, _BF16) for g in GEMMS})
  fp8 = {"weight": c.kernel_time(0, 6 * k * n), "x": c.kernel_time(0, 4 * m * k),
         "grad": c.kernel_time(0, 4 * m * n), "scale_update": c.kernel_time(0, 0)}
  fp8.update({g: gemm(shapes[g], 1, _FP8) for g in GEMMS})
  return LayerTimes(m=m, k=k, n=n, bf16=bf16, fp8=fp8)


def break_even_size(tokens: int | None = DECISION_TOKENS,
                    constants: CostConstants | None = None, high: int = 65536) -> int:
  """The smallest square layer side n (a multiple of 16) that FP8 makes no slower.

  `layer_times(tokens, n, n, constants).fp8_pays`, searched over n = 16, 32, ...;
  `tokens=None` takes M = n (a square GEMM, x as large as the kernel).
  `break_even_size()` is `fp8jax.flax.layer_filter.BREAK_EVEN_SIZE`.

  Args:
    tokens: M, the rows of x (default `DECISION_TOKENS`), or None for M = n.
    constants: `CostConstants` (default: the H100 SXM ones).
    high: the largest side tried.

  Returns:
    The side n.

  Raises:
    ValueError: FP8 does not pay at any side up to `high`.
  """
  if tokens is not None:
    check_int("tokens", tokens, minimum=1)
  check_int("high", high, minimum=DIM_MULTIPLE)
  for side in range(DIM_MULTIPLE, high + 1, DIM_MULTIPLE):
    if layer_times(side if tokens is None else tokens, side, side, constants).fp8_pays:
      return side
  raise ValueError(f"FP8 is not predicted to pay for any square layer up to n={high} at "
                   f"tokens={tokens}; search up to a larger high.")


def compiled_layer_steps(m: int, k: int, n: int, constants=None, target: str = "deviceless",
                         recipe=None) -> tuple[CostReport, CostReport]:
  """(FP8, bf16): the cost reports of one dense layer's forward and backward pass, compiled.

  The FP8 step is `fp8jax.value_and_grad` over the built-in example's `mlp_loss` with
  one `fp8_dense` layer; the bf16 twin is `jax.value_and_grad` over its `bf16_mlp_loss`
  (`fp8jax.lowering.example`). The input x is differentiated too, so both steps have
  the fprop, dgrad and wgrad GEMMs of a layer inside a model.

  Args:
    m, k, n: x is bf16 [m, k], the kernel float32 [k, n] (with a bias [n]).
    constants: `fp8jax.lowering.CostConstants` (default: the H100 SXM ones).
    target: as for `fp8jax.lowering.cost`.
    recipe: the FP8 layer's scaling recipe (default `DelayedScaling()`).

  Returns:
    The two `CostReport`s.
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
  return fp8, bf16


def predicted_speedup(m: int, k: int, n: int, constants=None,
                      target: str = "deviceless", recipe=None) -> float:
  """Predicted bf16 time / FP8 time of one dense layer's compiled forward and backward pass.

  The whole programs of `compiled_layer_steps` (their loss and bias kernels included,
  which `layer_times` leaves out).

  Args:
    m, k, n, constants, target, recipe: as for `compiled_layer_steps`.

  Returns:
    The predicted speedup (> 1: FP8 is faster).
  """
  return compare(*compiled_layer_steps(m, k, n, constants, target, recipe)).speedup
