"""How the demo GPT shards over a data x model mesh (Megatron-style tensor parallelism).

Each block's q, k and v projections and the MLP's up projection are
column-parallel (their output features, the heads or d_ff, split over
"model"); the attention output and the MLP's down projection are row-parallel
(their input features split over "model"), so a block needs one sum over
"model" after each of its two halves and nothing else. The embedding (tied to
the output head), the norms, and the FP8 state are replicated; the batch is
split over "data".

`param_specs` works on any tree that holds the params by their names (the
params themselves, and optax states such as Adam's moments, which mirror them).
"""
from __future__ import annotations

from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

# The last two names of a stacked ([n_layers, ...]) kernel's path -> its spec.
_TENSOR_PARALLEL = {
    ("query", "kernel"): P(None, None, "model", None),   # [L, d, heads, head_dim]
    ("key", "kernel"): P(None, None, "model", None),
    ("value", "kernel"): P(None, None, "model", None),
    ("out", "kernel"): P(None, "model", None, None),     # [L, heads, head_dim, d]
    ("up", "kernel"): P(None, None, "model"),            # [L, d, d_ff]
    ("down", "kernel"): P(None, "model", None),          # [L, d_ff, d]
}


def param_specs(tree: Any, model_axis: str = "model") -> Any:
  """A `PartitionSpec` per leaf of `tree` (params, or an optimizer state that mirrors them)."""
  return jax.tree_util.tree_map_with_path(
      lambda path, leaf: _spec(path, leaf, model_axis), tree)


def _spec(path, leaf, model_axis: str) -> P:
  names = tuple(str(getattr(key, "key", getattr(key, "name", ""))) for key in path[-2:])
  found = _TENSOR_PARALLEL.get(names)
  if found is None or getattr(leaf, "ndim", 0) != len(found):
    return P()
  return P(*(model_axis if entry == "model" else entry for entry in found))


def shard_train_state(mesh, params, opt_state, fp8_state, tokens, *, data_axis: str = "data",
                      model_axis: str = "model"):
  """A train step's arguments placed on `mesh`: params and optimizer state as
  `param_specs`, the FP8 state replicated, the tokens split over `data_axis`.

  Arrays are put on the mesh with `jax.device_put`; `ShapeDtypeStruct`s get the
  sharding (for compiling, e.g. on `fp8jax.deviceless.h100_mesh`).
  """

  def place(tree, spec_of):
    def one(path, leaf):
      sharding = NamedSharding(mesh, spec_of(path, leaf))
      if isinstance(leaf, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)
      return jax.device_put(leaf, sharding)
    return jax.tree_util.tree_map_with_path(one, tree)

  tensor_parallel = lambda path, leaf: _spec(path, leaf, model_axis)
  return (place(params, tensor_parallel), place(opt_state, tensor_parallel),
          place(fp8_state, lambda path, leaf: P()),
          place(tokens, lambda path, leaf: P(data_axis)))
