"""Which dense layers of an existing model run in FP8: `LayerInfo` and the default filter.

`fp8jax.flax.intercept` (linen) and `fp8jax.flax.convert` (nnx) ask a
`layer_filter(layer: LayerInfo) -> bool` about every dense layer of a model
(`Dense` / `DenseGeneral` / `Einsum`, `Linear` / `LinearGeneral` / `Einsum`).
The default, `default_layer_filter`, follows the idea of torchao's
`module_filter_fn` (skip layers whose dims are not multiples of 16, and layers
too small to gain), with the choice made by fp8jax's cost model instead of a
hand-picked size:

* cuBLASLt's FP8 GEMM wants its dims in multiples of 16: the layer's contracting
  size K and output size N (each the product of its dims, as the layer folds into
  one GEMM) must be multiples of `DIM_MULTIPLE`;
* the layer's train step must be predicted no slower in FP8 than in bf16:
  `fp8jax.lowering.break_even.layer_times(DECISION_TOKENS, K, N)` puts FP8's three
  GEMMs and its casts of x, the kernel and the output gradient beside bf16's GEMMs
  and kernel convert, with the calibrated H100 constants (`CostConstants()`).

The filter sees only K and N, not the number of tokens M: a model is usually
initialized with a dummy batch, and the choice must be the same at init and in
training. It decides at M = `DECISION_TOKENS` (4096 rows of x per device and
step); a layer chosen there gains at every larger step too. `CostModelFilter`
decides at another M, or with other constants (an H200's, `fp8jax.lowering.cost.H200`).

The choice is per layer: all three GEMMs (fprop, dgrad, wgrad) in FP8, or none.
A layer with only some GEMMs in FP8 (a recipe's `high_precision`) is slower than
both on an H100 at every shape where one GEMM alone could pay (the numbers are in
`fp8jax.lowering.break_even`), so the default never makes one.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable

import numpy as np

from fp8jax.lowering.break_even import DECISION_TOKENS, DIM_MULTIPLE, LayerTimes, layer_times
from fp8jax.lowering.cost import CostConstants

# The smallest side n (a multiple of 16) of a square dense layer, K = N = n, that the
# default filter converts: `fp8jax.lowering.break_even.break_even_size()`, the cost
# model at M = DECISION_TOKENS = 4096 with the default `CostConstants()` (calibrated on
# an H100 SXM: FP8 GEMMs 1330 TFLOP/s, bf16 725 TFLOP/s, HBM 2.7 TB/s, 1.3 us per
# launch at the top level), the same prediction as deviceless H100 compiles of the
# layer's step (jax 0.10.2, delayed scaling's lean path). Layer speedups it predicts
# (bf16 time / FP8 time of the layer's kernels): n = 1024: 0.996, 1040: 1.004, 1280:
# 1.100, 1536: 1.181, 2048: 1.297, 4096: 1.505, 8192: 1.622. The demo GPT's shapes
# (qkv [d, 3d], out [d, d], up [d, 4d], down [4d, d]): d = 768: 1.074, 0.861, 1.113,
# 1.113; d = 1024: 1.199, 0.996, 1.234, 1.234; d = 512: all below 0.92. With M = K = N
# (the old definition) the break-even is 1360; at M = 4096 on an H200 800, inside a
# rolled layer loop (3.25 us a launch) 1296. tests/test_layer_filter.py recomputes it.
BREAK_EVEN_SIZE = 1040


@dataclasses.dataclass(frozen=True)
class LayerInfo:
  """What a layer filter knows about one dense layer.

  Attributes:
    path: where the layer is in the model: linen module names from the root,
      e.g. ("Block_0", "Dense_1"); nnx attribute names and list indices, e.g.
      ("layers", 0, "linear").
    kind: the layer's class name: "Dense", "DenseGeneral", "Einsum" (linen) or
      "Linear", "LinearGeneral", "Einsum" (nnx).
    kernel_shape: the kernel parameter's shape.
    in_features: the kernel dims contracted with the input (their product is K).
    out_features: the kernel dims that only the output has (their product is N).
      Kernel dims that are neither are batch dims (`batch_dims` of DenseGeneral).
    input_shape: the input's shape when the layer is called (linen); None when
      not known (nnx conversion happens before any call). Do not base the
      choice on the batch dims: init usually sees a dummy batch.
  """

  path: tuple
  kind: str
  kernel_shape: tuple[int, ...]
  in_features: tuple[int, ...]
  out_features: tuple[int, ...]
  input_shape: tuple[int, ...] | None = None

  @property
  def k(self) -> int:
    """The contracting size K of the layer's GEMM."""
    return math.prod(self.in_features)

  @property
  def n(self) -> int:
    """The output size N of the layer's GEMM."""
    return math.prod(self.out_features)


@dataclasses.dataclass(frozen=True)
class CostModelFilter:
  """A layer filter: FP8 where the cost model predicts the layer's train step no slower.

  `CostModelFilter()` is `default_layer_filter`; pass one with your own tokens or
  constants as `layer_filter`, e.g. `Fp8Model(model, layer_filter=CostModelFilter(
  tokens=16384))` for steps of 16k tokens per device, or `CostModelFilter(
  constants=fp8jax.lowering.cost.H200)` for an H200. The report of `Fp8Model` /
  `convert_to_fp8` gives each layer's predicted times.

  Attributes:
    tokens: M, the rows of x per device and step the choice is made for (the
      batch dims of x multiplied; default `DECISION_TOKENS`). More tokens favour
      FP8: a layer chosen for M gains at every larger M too.
    constants: the cost model's machine constants (default: the H100 SXM ones).
  """

  tokens: int = DECISION_TOKENS
  constants: CostConstants = CostConstants()

  def __post_init__(self):
    if isinstance(self.tokens, bool) or not isinstance(self.tokens, int) or self.tokens < 1:
      raise ValueError(f"CostModelFilter.tokens={self.tokens!r} must be a positive int: the "
                       "rows of x per device and step (batch x sequence length).")
    if not isinstance(self.constants, CostConstants):
      raise TypeError(f"CostModelFilter.constants must be a fp8jax.lowering.CostConstants, "
                      f"got {type(self.constants).__name__}.")

  def times(self, layer: LayerInfo) -> LayerTimes | None:
    """The layer's predicted kernel times at `tokens`; None when its K or N is not a
    multiple of `DIM_MULTIPLE` (no FP8 GEMM for it)."""
    if layer.k % DIM_MULTIPLE or layer.n % DIM_MULTIPLE:
      return None
    return layer_times(self.tokens, layer.k, layer.n, self.constants)

  def __call__(self, layer: LayerInfo) -> bool:
    """True where FP8 is predicted no slower than bf16 (and K, N are multiples of 16)."""
    times = self.times(layer)
    return times is not None and times.fp8_pays

  def explain(self, layer: LayerInfo) -> str:
    """Why the filter decides as it does, in one parenthesis, for the report."""
    k, n = layer.k, layer.n
    times = self.times(layer)
    if times is None:
      return f"(K={k}, N={n}: not multiples of {DIM_MULTIPLE})"
    why = "" if times.fp8_pays else ": its casts cost more than its GEMMs save"
    return (f"(K={k}, N={n}: {times.fp8_s * 1e6:.1f} us in FP8, {times.bf16_s * 1e6:.1f} us "
            f"in bf16 at {self.tokens} tokens, {times.speedup:.3f}x{why})")


_DEFAULT = CostModelFilter()


def default_layer_filter(layer: LayerInfo) -> bool:
  """True for layers predicted to gain from FP8 (see the module docstring).

  K and N multiples of `DIM_MULTIPLE`, and the layer's train step predicted no
  slower in FP8 than in bf16 at `DECISION_TOKENS` tokens on an H100
  (`CostModelFilter()`).

  Returns:
    Whether the layer runs in FP8 (all three of its GEMMs).
  """
  return _DEFAULT(layer)


def cost_model_of(layer_filter) -> CostModelFilter | None:
  """The `CostModelFilter` that `layer_filter` is (the default filter's for
  `default_layer_filter`), or None for a filter of your own."""
  if layer_filter is default_layer_filter:
    return _DEFAULT
  return layer_filter if isinstance(layer_filter, CostModelFilter) else None


def check_layer_filter(layer_filter) -> None:
  """Raises TypeError unless `layer_filter` is callable."""
  if not callable(layer_filter):
    raise TypeError(
        f"layer_filter must be a function (layer: LayerInfo) -> bool, got "
        f"{type(layer_filter).__name__}: {layer_filter!r}. Pass e.g. "
        "`lambda layer: layer.path[-1] != 'head'`, or leave it out for "
        "fp8jax.flax.layer_filter.default_layer_filter.")


def chosen(layer_filter: Callable[[LayerInfo], bool], layer: LayerInfo) -> bool:
  """`layer_filter(layer)`, checked to be a bool."""
  decision = layer_filter(layer)
  if not isinstance(decision, (bool, np.bool_)):
    raise TypeError(
        f"layer_filter returned {type(decision).__name__} {decision!r} for layer "
        f"{layer.path} ({layer.kind}); it must return True (FP8) or False (high "
        "precision), a Python bool decided from the layer's path and shapes.")
  return bool(decision)
