"""Old path of `fp8jax.ops.weight_reuse` (FP8 weights quantized once per step)."""
from fp8jax.ops.weight_reuse import (QuantizedKernel, WeightCache, collecting,  # noqa: F401
                                     current, primal, replaying)
