"""Which dense layers of an existing model run in FP8: `LayerInfo` and the default filter.

`fp8jax.flax.intercept` (linen) and `fp8jax.flax.convert` (nnx) ask a
`layer_filter(layer: LayerInfo) -> bool` about every dense layer of a model
(`Dense` / `DenseGeneral` / `Einsum`, `Linear` / `LinearGeneral` / `Einsum`).
The default, `default_layer_filter`, follows the idea of torchao's
`module_filter_fn` (skip layers whose dims are not multiples of 16, and layers
too small to gain), with the size threshold taken from fp8jax's cost model
instead of a hand-picked one:

* cuBLASLt's FP8 GEMM wants its dims in multiples of 16: the layer's contracting
  size K and output size N (each the product of its dims, as the layer folds into
  one GEMM) must be multiples of `DIM_MULTIPLE`;
* the layer must be large enough that FP8's extra passes (quantizing x, the kernel
  and the output gradient) cost less than the GEMM time it saves: the harmonic
  mean `2 K N / (K + N)` must be at least `BREAK_EVEN_SIZE`.

Why the harmonic mean: per token, the GEMMs' work grows with K * N while FP8's
extra passes over x and the output gradient grow with K + N; their ratio,
K N / (K + N), is half the harmonic mean. For a square layer the harmonic mean
is the side, so the threshold is the break-even side of a square layer.

The filter sees only K and N, not the number of tokens M: a model is usually
initialized with a dummy batch, and the choice must be the same at init and in
training. More tokens per step favour FP8 (the kernel's quantization is shared
by all of them), so the threshold, found at M = K = N, is on the safe side for
large training batches.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable

import numpy as np

from fp8jax.lowering.break_even import DIM_MULTIPLE

# The smallest side n (a multiple of 16) of a square dense layer, M = K = N = n,
# whose forward + backward pass is predicted at least as fast in FP8 as in bf16:
# `fp8jax.lowering.break_even.break_even_size()`, i.e. `fp8jax.lowering.cost` with the default
# `CostConstants()` (calibrated on an H100 SXM: FP8 GEMMs 1330 TFLOP/s, bf16 725 TFLOP/s,
# HBM 2.7 TB/s, 1.3 us per kernel) on deviceless H100 compiles (jax 0.10.2), with
# delayed scaling's lean path (3 cast kernels per layer, one state update per step).
# The speedups it predicted on its way (bf16 time / FP8 time): n = 1024: 0.998,
# 1040: 1.004, 1056: 1.010, 1088: 1.021, 1152: 1.045, 1280: 1.092, 1536: 1.182,
# 2048: 1.301, 4096: 1.513, 8192: 1.652.
# Non-square layers at M = 1040 (`break_even.predicted_speedup`): those of the ones tried
# that the harmonic-mean rule converts are predicted faster: (720, 1872), harmonic mean 1040
# exactly: 1.019; (1152, 960): 1.007; (4096, 640): 1.096. The rule is on the safe side:
# it skips some layers just below the threshold that are predicted to gain a little,
# (768, 1536): 1.007, (2048, 688): 1.022, (640, 2560): 1.028, (512, 4096): 1.013, and
# skips (256, 16384): 0.959, which a product rule (K * N >= 1040**2) would convert.
# tests/test_layer_filter.py recomputes the speedups at 1024 and 1040.
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


def default_layer_filter(layer: LayerInfo) -> bool:
  """True for layers predicted to gain from FP8 (see the module docstring).

  K and N multiples of `DIM_MULTIPLE`, and the harmonic mean of K and N at
  least `BREAK_EVEN_SIZE`.
  """
  k, n = layer.k, layer.n
  if k % DIM_MULTIPLE or n % DIM_MULTIPLE:
    return False
  return 2 * k * n >= BREAK_EVEN_SIZE * (k + n)  # integers: no rounding at the boundary


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
