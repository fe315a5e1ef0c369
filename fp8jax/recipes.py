"""Old path of `fp8jax.core.recipes`; checkpoints may name "fp8jax.recipes:DelayedScaling"."""
from fp8jax.core.recipes import (AMAX_COMPUTE_ALGOS, GEMMS, RECIPE_CLASSES,  # noqa: F401
                                 BlockScaling, CurrentScaling, DelayedScaling, MXFP8Scaling,
                                 Recipe, RowwiseScaling, check_recipe, import_recipe_class,
                                 is_fine_grained, recipe_kind)
