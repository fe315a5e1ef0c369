"""Which projections of the demo GPT run in FP8 under a recipe: `GptConfig.fp8_layers`.

* "all" (the default): every projection, qkv, out, the MLP's up and down and the tied
  head, runs in FP8. The CPU demo (`fp8jax compare`, the tiny model) is there to show
  FP8's numerics, and does.
* "auto": each projection runs in FP8 where `fp8jax.flax.default_layer_filter` chooses
  its shape, the choice `Fp8Model` and `convert_to_fp8` make for a model you did not
  write (the cost model predicts its train step no slower in FP8 than in bf16 at 4096
  tokens on an H100), and in bf16 (`nn.Dense` / `nn.DenseGeneral`, no FP8 state)
  elsewhere. It asks for speed on a GPU. The choice follows the shapes alone, never
  the platform, so a config has one parameter and state tree everywhere.

What "auto" runs in FP8 (`fp8_projections`), by size: tiny, small: none (a warning
says so); 125m (d = 768): qkv, up, down (out, [768, 768], is predicted 0.86x); 350m:
qkv, up, down (out, [1024, 1024]: 0.996x at 4096 tokens); 1b: qkv, out, up, down. The
tied head (N = 256, the byte vocabulary) stays in bf16 at every size. Attention follows
`GptConfig.fp8_attention`, and with `GptConfig.experts` the experts' grouped GEMMs
follow the recipe: "auto" decides the dense projections. Whole train steps, deviceless
H100, `fp8jax cost --gpt SIZE --optimizer adamw --saved-activations default` ("all",
then "auto", over bf16): small at 16 x 256: 1.01x, 0.99x; 125m at 8 x 1024: 1.23x,
1.24x; 350m at 8 x 1024: 1.29x, 1.29x. At small "all" is ahead: its qkv backward casts dq,
dk, dv unstacked (`fp8jax.fp8_rms_norm_qkv_rope`), a saving of the whole step that the
per-GEMM choice does not count.
"""
from __future__ import annotations

import warnings

from fp8jax.core.recipes import Recipe
from fp8jax.flax.layer_filter import LayerInfo, default_layer_filter

#: The values of `GptConfig.fp8_layers`.
FP8_LAYERS = ("all", "auto")
#: The GPT's projections, in the order of a block and then the tied head.
PROJECTIONS = ("qkv", "out", "up", "down", "head")


def check_fp8_layers(value) -> None:
  """Raises ValueError unless `value` is one of `FP8_LAYERS`.

  Returns:
    None; a bad value raises.
  """
  if value not in FP8_LAYERS:
    raise ValueError(f"GptConfig.fp8_layers={value!r} is not one of {FP8_LAYERS}: \"all\" "
                     "runs every projection in FP8 under a recipe, \"auto\" those where the "
                     "cost model predicts FP8 no slower than bf16.")


def projection(config, name: str) -> LayerInfo:
  """The `LayerInfo` the default filter sees for projection `name` of `PROJECTIONS`.

  Returns:
    Its path (e.g. ("blocks", "attention", "qkv")), kind and kernel dims: qkv [d] x
    [heads, 3, head_dim], out [heads, head_dim] x [d], up [d] x [d_ff], down [d_ff] x
    [d], head [d] x [vocab].
  """
  d, heads, head_dim = config.d_model, config.n_heads, config.head_dim
  shapes = {"qkv": ("attention", "DenseGeneral", (d,), (heads, 3, head_dim)),
            "out": ("attention", "DenseGeneral", (heads, head_dim), (d,)),
            "up": ("mlp", "Dense", (d,), (config.d_ff,)),
            "down": ("mlp", "Dense", (config.d_ff,), (d,)),
            "head": ("", "Einsum", (d,), (config.vocab_size,))}
  if name not in shapes:
    raise ValueError(f"projection {name!r} is not one of {PROJECTIONS}.")
  module, kind, k, n = shapes[name]
  path = ("head",) if name == "head" else ("blocks", module, name)
  return LayerInfo(path=path, kind=kind, kernel_shape=k + n, in_features=k, out_features=n)


def projection_recipe(config, recipe: Recipe | None, name: str) -> Recipe | None:
  """The recipe projection `name` of `PROJECTIONS` runs with.

  Returns:
    `recipe`, or None (bf16) where `config.fp8_layers` is "auto" and the default layer
    filter does not choose the projection's shape.
  """
  if recipe is None or config.fp8_layers == "all":
    return recipe
  return recipe if default_layer_filter(projection(config, name)) else None


def fp8_projections(config, recipe: Recipe | None) -> tuple[str, ...]:
  """Which projections run in FP8.

  Returns:
    Their names, of `PROJECTIONS` in that order (() without a recipe).
  """
  return tuple(name for name in PROJECTIONS
               if projection_recipe(config, recipe, name) is not None)


def warn_if_no_projection_in_fp8(config, recipe: Recipe | None) -> None:
  """Warns when a recipe is given but "auto" keeps every projection in bf16.

  Returns:
    None.
  """
  if recipe is not None and config.fp8_layers == "auto" and not fp8_projections(config, recipe):
    warnings.warn(
        f"fp8jax: GptConfig.fp8_layers='auto' runs none of this d_model={config.d_model} "
        "model's projections in FP8 (the cost model predicts each slower in FP8 than in "
        "bf16 at 4096 tokens); fp8_layers='all' (fp8jax train --fp8-layers all) runs them "
        "in FP8, e.g. to show FP8's numerics.", stacklevel=2)
