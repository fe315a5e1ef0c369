"""Flax layers over fp8jax's pure functions: `linen` and `nnx`.

Import the flavour you use: `from fp8jax.flax import linen as fp8nn` or
`from fp8jax.flax import nnx as fp8nnx`. Also here: `TrainState` (a Flax
TrainState that carries the FP8 state beside params and optimizer state) and the
conversions of Flax `fp8_ops` state (`from_flax_fp8_ops`, `to_flax_fp8_ops`); FP8
for a model you did not write: `Fp8Model` / `fp8_dense_layers` (linen, by
interception of dense layers and of every dot its modules call) and `convert_to_fp8`
(nnx, in place), choosing dots with `Fp8Rule`s, `default_layer_filter` (the cost model's
choice; `CostModelFilter` for other tokens or constants) or your own predicate over a
`LayerInfo`; `Fp8Report`: what runs in FP8 and why; `nnx_value_and_grad`:
an nnx train step's FP8 `value_and_grad` that carries dropout rngs and batch statistics;
`nnx_calibrate`: `fp8jax.calibrate` for an nnx model, before its first step.
`fp8jax.flax.linen_mlp.Fp8Mlp`: a transformer's MLP with the GELU done by its FP8 casts.
"""
from fp8jax.flax.train_state import TrainState
from fp8jax.flax.fp8_ops_state import from_flax_fp8_ops, to_flax_fp8_ops
from fp8jax.flax.layer_filter import CostModelFilter, LayerInfo, default_layer_filter
from fp8jax.flax.rules import Fp8Rule
from fp8jax.flax.dot_report import DotRecord, Fp8Report
from fp8jax.flax.intercept import Fp8Model, fp8_dense_layers
from fp8jax.flax.convert import convert_to_fp8
from fp8jax.flax.nnx_step import nnx_calibrate, nnx_value_and_grad

__all__ = ["TrainState", "from_flax_fp8_ops", "to_flax_fp8_ops", "LayerInfo",
           "default_layer_filter", "CostModelFilter", "Fp8Rule", "Fp8Report", "DotRecord",
           "Fp8Model", "fp8_dense_layers", "convert_to_fp8", "nnx_value_and_grad",
           "nnx_calibrate"]
