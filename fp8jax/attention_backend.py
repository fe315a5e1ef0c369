"""Old path of `fp8jax.ops.attention_backend` (which attention kernel runs)."""
from fp8jax.ops.attention_backend import (BACKENDS, DEQUANTIZING_FP8_BACKENDS,  # noqa: F401
                                          MEASURED, SOURCE, TUNED, BackendChoice, BackendKey,
                                          make_key, measured, seconds_per_forward_flop,
                                          select_backend, tuned_block_sizes)
