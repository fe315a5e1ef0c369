"""Optimizers whose state is stored in FP8: Adam and AdamW with one-byte moments.

    tx = fp8jax.optim.adamw(learning_rate=3e-4, weight_decay=0.1)   # as optax.adamw
    params, opt_state = fp8jax.optim.update_and_apply(tx, grads, opt_state, params)

Both Adam moments of every large leaf are stored as E4M3 codes with a range expansion
per 1x128 block (`moment_codec`): about 2.1 bytes of optimizer state per parameter
instead of 8. On a GPU each large leaf's step is one kernel (`fused_adam`,
`pallas_kernels.adam_fp8`: 12 bytes moved a parameter), the jnp form's numbers to float32
rounding; `update_and_apply` has that kernel write the new parameter too, where
`tx.update` then `optax.apply_updates` write the update and add it in a pass of its own. The
layer imports optax and, of fp8jax, `fp8jax.mesh` (to read a leaf's sharding on explicit
meshes, and to run the kernel on each device's shard) and `fp8jax.ops.fused_kernels` (where
the kernels may run). The state may come back from a container in nodes of its own
(Flax's `nnx.Optimizer` hands each moment back as an `nnx.State`): the optimizer reads the
moments by their fields.
"""
from fp8jax.optim.adam import (MomentStorage, ScaleByAdamFp8State, adam, adamw,
                               scale_by_adam_fp8)
from fp8jax.optim.apply import update_and_apply
from fp8jax.optim.moment_codec import Fp8Moment

__all__ = ["MomentStorage", "ScaleByAdamFp8State", "Fp8Moment", "adam", "adamw",
           "scale_by_adam_fp8", "update_and_apply"]
