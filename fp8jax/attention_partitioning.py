"""Old path of `fp8jax.mesh.partitioning`'s attention rule (per-shard attention kernels)."""
from fp8jax.mesh.partitioning import (LAYOUTS, OUTPUT_LAYOUTS,  # noqa: F401
                                      shard_local_attention)
