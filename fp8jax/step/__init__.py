"""The training step around the ops: opening and closing it, and differentiating it.

* `close`: `begin_step`, `merge_step`, `end_step`, `close_step`: from the step's
  amaxes to the next scales (the delayed-scaling update).
* `all_reduce`: the step's amaxes made global over devices (`all_reduce_amax`),
  replicated state, and the warning when per-device code would keep local amaxes.
* `training`: `value_and_grad` and `accumulate_gradients`.

May import: `fp8jax.ops`, `fp8jax.mesh`, `fp8jax.core`, JAX.
"""
