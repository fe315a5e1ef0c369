"""The demo GPT's FP8 weights cast before its loop over layers (`GptConfig.cast_weights_first`).

Under delayed scaling every layer's weight scale is known when the step starts, so the
`Gpt` casts the weights of all its layers there, one launch per projection
(`fp8jax.ops.stacked_weights.cast_layers`), and hands each block its layer's copies as
the loop's scanned input; inside the block each FP8 op takes the copies paired with its
kernel (`stacked_weights.supplying`) instead of slicing the layer's float32 weight out of
the stack and casting it (two launches a projection and layer). The numbers are the same
bit for bit. The 350m step (deviceless H100, `fp8jax cost`): 188 launches fewer.

Which projections: those in FP8 under delayed scaling on the matrix path (qkv, out, and
the dense MLP's up and down), not the MoE experts (grouped GEMMs, their own casts). Not
under `fp8jax.accumulate_gradients`, which casts each weight once for all microbatches
itself (`fp8jax.ops.weight_reuse`), nor while the model is initialized.
"""
from __future__ import annotations

from typing import Any

from fp8jax.flax.linen import FP8_COLLECTION
from fp8jax.models import gpt_fp8_layers
from fp8jax.ops import stacked_weights, weight_reuse

# A block's projections: (module path in the block, contracted axes of the kernel).
_PROJECTIONS = {
    "qkv": (("attention", "qkv"), 1),   # [d] x [heads, 3, head_dim]
    "out": (("attention", "out"), 2),   # [heads, head_dim] x [d]
    "up": (("mlp", "up"), 1),           # [d] x [d_ff]
    "down": (("mlp", "down"), 1),       # [d_ff] x [d]
}


def cast_before_loop(config, recipe, variables) -> dict | None:
  """{projection: `LayerWeights` of every layer} for the blocks' loop, or None.

  Args:
    config: the model's `GptConfig`.
    recipe: its recipe (None: bf16).
    variables: the `Gpt`'s variables (`module.variables`): the stacked params and FP8
      state under "blocks".
  """
  if recipe is None or not config.cast_weights_first or weight_reuse.current() is not None:
    return None
  params = _get(variables, ("params", "blocks"))
  state = _get(variables, (FP8_COLLECTION, "blocks"))
  if params is None or state is None:  # being initialized
    return None
  weights = {}
  for name, (path, n_contract) in _PROJECTIONS.items():
    projection_recipe = gpt_fp8_layers.projection_recipe(config, recipe, name)
    if projection_recipe is None or (config.experts and name in ("up", "down")):
      continue
    if (projection_recipe.scales_from_tensor or projection_recipe.per_operand
        or projection_recipe.high_precision):
      continue
    kernel, meta = _get(params, path + ("kernel",)), _get(state, path + ("dot_meta",))
    if kernel is not None and meta is not None:
      weights[name] = stacked_weights.cast_layers(kernel, n_contract, meta.kernel)
  return weights or None


def pairs(block_params: Any, weights: dict | None) -> list:
  """(kernel, its layer's copies) for `stacked_weights.supplying` in one block.

  Args:
    block_params: the block's params (`module.variables["params"]` in the block).
    weights: this layer's slice of `cast_before_loop`'s result, or None.
  """
  if not weights:
    return []
  return [(_get(block_params, _PROJECTIONS[name][0] + ("kernel",)), layer_weights)
          for name, layer_weights in weights.items()]


def _get(tree: Any, path: tuple):
  for key in path:
    if tree is None or key not in tree:
      return None
    tree = tree[key]
  return tree
