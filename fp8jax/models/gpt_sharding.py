"""How the demo GPT shards over a data x model mesh (Megatron-style tensor parallelism, FSDP).

Each block's qkv projection and the MLP's up projection are
column-parallel (their output features, the heads or d_ff, split over
"model"); the attention output and the MLP's down projection are row-parallel
(their input features split over "model"), so a block needs one sum over
"model" after each of its two halves and nothing else. The embedding (tied to
the output head), the norms, and the FP8 state are replicated; the batch is
split over "data". An MoE MLP's experts (`fp8jax.models.gpt_moe`: a leading expert
axis after the layer axis) split their d_ff over "model" like the dense MLP's up and
down projections, and its router is replicated (experts split over devices, with an
all-to-all dispatch, are `fp8jax.ops.expert_parallel` inside `shard_map`). With
`fsdp_axis` every projection's d_model axis is also split over that axis (FSDP: XLA
gathers each weight where it is used, in FP8 under a recipe).

The embedding stays whole under FSDP. Its lookup's output is the residual stream: with
the table's d_model split over "data", XLA's sharding propagation split the stream's
features over "data" instead of its batch, then moved activations back and forth between
the two layouts. Compiled for 8 H100s (data=4 x model=2, the 125m width, two blocks,
deviceless) that added 10 all-to-alls of float32 activations and gathered
output gradients over the whole batch (collectives sent 349 MiB per device and FP8 step
instead of 112), and with FP8 saved activations 15 float32 activation all-gathers (2,149
MiB); the predicted FP8 step was 2.5x (3.2x) what it is now (`fp8jax.lowering.cost`). A
byte vocabulary's table is 256 rows: whole on every device it is 0.8 MB of float32 at that
width, 2.1 MB at the 1b's.

`param_specs` works on any tree that holds the params by their names: the params
themselves, and optimizer states that mirror them, float32 (optax's Adam moments) or
compressed (`fp8jax.optim`'s `Fp8Moment(codes, k, offset)` under each param's path:
every field gets the param's spec, since each keeps the param's rank). A leaf is known
by the deepest pair of consecutive path names that names a param (e.g. ("up", "kernel")),
not by its last two names, which for a compressed moment end in "codes".
"""
from __future__ import annotations

from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

# A param's (module, name) -> (its tensor-parallel spec, the axis FSDP splits, or None).
_LAYOUT = {
    ("qkv", "kernel"): (P(None, None, "model", None, None), 1),  # [L, d, heads, 3, head_dim]
    ("out", "kernel"): (P(None, "model", None, None), 3),     # [L, heads, head_dim, d]
    ("up", "kernel"): (P(None, None, "model"), 1),            # [L, d, d_ff]
    ("down", "kernel"): (P(None, "model", None), 2),          # [L, d_ff, d]
    ("embed", "embedding"): (P(None, None), None),            # [vocab, d]; whole (above)
    # The MoE MLP (GptConfig.experts): each expert split like the dense MLP, its d_ff over
    # "model" (every device holds a slice of every expert, so routing moves no token).
    # Its router ([L, d, E], tiny) stays replicated.
    ("mlp", "w_in"): (P(None, None, None, "model"), 2),       # [L, E, d, d_ff]
    ("mlp", "w_out"): (P(None, None, "model", None), 3),      # [L, E, d_ff, d]
}


def param_specs(tree: Any, model_axis: str = "model", fsdp_axis: str | None = None) -> Any:
  """A `PartitionSpec` per leaf of `tree` (params, or an optimizer state that mirrors them).

  Args:
    tree: the params, or any tree holding leaves under the params' paths.
    model_axis: the tensor-parallel mesh axis.
    fsdp_axis: also split each projection's d_model axis over this mesh axis (None: no
      FSDP); the embedding stays whole (see the module).

  Returns:
    The tree of `PartitionSpec`s (`P()` for what is replicated).
  """
  return jax.tree_util.tree_map_with_path(
      lambda path, leaf: _spec(path, leaf, model_axis, fsdp_axis), tree)


def _spec(path, leaf, model_axis: str, fsdp_axis: str | None = None) -> P:
  names = [str(getattr(key, "key", getattr(key, "name", ""))) for key in path]
  found = None
  for i in range(len(names) - 1):
    found = _LAYOUT.get((names[i], names[i + 1]), found)
  if found is None:
    return P()
  spec, d_axis = found
  if getattr(leaf, "ndim", 0) != len(spec):
    return P()
  entries = [model_axis if entry == "model" else entry for entry in spec]
  if fsdp_axis is not None and d_axis is not None:
    entries[d_axis] = fsdp_axis
  return P(*entries)


def shard_train_state(mesh, params, opt_state, fp8_state, tokens, *, data_axis: str = "data",
                      model_axis: str = "model", fsdp: bool = False):
  """A train step's arguments placed on `mesh`: params and optimizer state as
  `param_specs` (with `fsdp`, d_model split over `data_axis` too), the FP8 state
  replicated, the tokens split over `data_axis`.

  Arrays are put on the mesh with `jax.device_put`; `ShapeDtypeStruct`s get the
  sharding (for compiling, e.g. on `fp8jax.deviceless.h100_mesh`). An axis a leaf's
  dimension does not divide stays whole on that dimension (e.g. the per-block scales of
  an FP8 moment, 1/128 of its param's length, on a small model).
  """

  def place(tree, spec_of):
    def one(path, leaf):
      sharding = NamedSharding(mesh, _divisible(spec_of(path, leaf), leaf.shape, mesh))
      if isinstance(leaf, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)
      return jax.device_put(leaf, sharding)
    return jax.tree_util.tree_map_with_path(one, tree)

  tensor_parallel = lambda path, leaf: _spec(path, leaf, model_axis,
                                             data_axis if fsdp else None)
  return (place(params, tensor_parallel), place(opt_state, tensor_parallel),
          place(fp8_state, lambda path, leaf: P()),
          place(tokens, lambda path, leaf: P(data_axis)))


def _divisible(spec: P, shape, mesh) -> P:
  """`spec` without the mesh axes that do not divide their dimension of `shape`."""
  entries = []
  for size, entry in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))):
    axes = (entry,) if isinstance(entry, str) else tuple(entry or ())
    count = 1
    for axis in axes:
      count *= mesh.shape[axis]
    entries.append(entry if size % count == 0 else None)
  return P(*entries)
