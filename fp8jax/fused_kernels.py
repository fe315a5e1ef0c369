"""Old path of `fp8jax.ops.fused_kernels` (where the fused FP8 kernels run)."""
from fp8jax.mesh.axes import inside_shard_map  # noqa: F401
from fp8jax.ops.fused_kernels import (cast_transpose_amax, choose, close_steps,  # noqa: F401
                                      fused_kernels, kernels_allowed, tensor_amax)
