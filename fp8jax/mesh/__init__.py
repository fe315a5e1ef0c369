"""Meshes: what fp8jax reads of JAX's device meshes, and how its kernels split over them.

* `axes`: reading the mesh and shard_map types of a trace: manual axes, the axes
  a value varies along, marking values varying, a max over the axes a tensor is
  split along.
* `explicit`: GEMMs and reshapes on explicit-axis meshes (shardings in the types).
* `partitioning`: the per-shard rules of fp8jax's kernels (cast, amax, state
  update, GEMM, weight cast, attention) for XLA's partitioner.

May import: JAX, `pallas_kernels.varying` (the kernels read the same types) and
`fp8jax.core`'s plain helpers; knows no FP8 state (imports no `fp8jax.core.meta`
or `fp8jax.core.recipes`): what it does applies to any array or pytree.
"""
