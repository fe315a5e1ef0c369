"""Old path of `fp8jax.mesh.partitioning` (the per-shard rules of fp8jax's kernels)."""
from fp8jax.mesh.partitioning import (OUTPUT_KINDS, shard_local, shard_local_gemm,  # noqa: F401
                                      shard_local_weight_cast, vmapped_as)
