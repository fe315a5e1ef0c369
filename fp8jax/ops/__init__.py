"""The differentiable FP8 ops, each a custom VJP that takes and returns its FP8 state.

* `dot` (`fp8_dot_general`), `dense` (`fp8_dense`), `einsum` (`fp8_einsum`);
  `fine_grained_dot`: the same under per-row / per-block recipes.
* `attention` (`attention`, `fp8_attention`) and `attention_backend` (which
  kernel runs, from the measured table `attention_speeds.json`).
* `cast`: casting a tensor with its role's state (the scale of the whole tensor).
* `fused_kernels`: where the fused cast / amax / state-update kernels run.
* `weight_reuse`: FP8 weights quantized once per step under gradient accumulation.
* `guards`: the threading check, forward-mode and state-gradient errors, state
  split over devices.

May import: `fp8jax.core`, `fp8jax.mesh`, `pallas_kernels`, JAX. An op asks its
recipe (the `Recipe` protocol); it never tests a recipe's type.
"""
