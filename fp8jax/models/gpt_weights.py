"""The demo GPT's FP8 weights cast before its loop over layers (`GptConfig.cast_weights_first`).

Under delayed scaling every layer's weight scale is known when the step starts (under
current scaling one amax reduction of each stack there makes them), so the
`Gpt` casts the weights of all its layers there, one launch per projection
(`fp8jax.flax.linen_stacked`, `fp8jax.ops.stacked_weights`), and hands each block its
layer's copies as the loop's scanned input; inside the block each FP8 op takes the copies
paired with its kernel instead of slicing the layer's float32 weight out of the stack and
casting it (two launches a projection and layer). The numbers are the same bit for bit.
The 350m step (deviceless H100, `fp8jax cost`): 192 launches fewer under delayed scaling,
368 under current scaling (each layer's weight amax too).

Which projections: those in FP8 (`GptConfig.fp8_layers`) under delayed or current scaling, qkv, out,
and the dense MLP's up and down; not the MoE experts (grouped GEMMs, their own casts).
"""
from __future__ import annotations

from fp8jax.flax.linen_stacked import cast_scanned_weights
from fp8jax.models import gpt_fp8_layers

# A block's projections (the tied head is not in the loop).
_BLOCK_PROJECTIONS = ("qkv", "out", "up", "down")


def cast_before_loop(module, config, recipe) -> dict | None:
  """{projection path: `LayerWeights` of every layer} for the blocks' loop, or None.

  Args:
    module: the `Gpt` (in its `nn.compact` call, before the blocks).
    config: the model's `GptConfig`.
    recipe: its recipe (None: bf16).
  """
  if recipe is None or not config.cast_weights_first:
    return None
  projections = {}
  for name in _BLOCK_PROJECTIONS:
    if (gpt_fp8_layers.projection_recipe(config, recipe, name) is None
        or (config.experts and name in ("up", "down"))):
      continue
    # Its path below "blocks" and the kernel axes it contracts, as the layer filter sees it.
    info = gpt_fp8_layers.projection(config, name)
    projections["/".join(info.path[1:])] = len(info.in_features)
  return cast_scanned_weights(module, "blocks", projections) if projections else None
