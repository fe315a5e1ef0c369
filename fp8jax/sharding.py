"""Old path of `fp8jax.step.all_reduce` and `fp8jax.mesh.axes` (FP8 state on a mesh)."""
from fp8jax.mesh.axes import (AxisName, global_amax, match_operand_axes,  # noqa: F401
                              normalize_axis_name, vary, vary_like, varying_axes)
from fp8jax.step.all_reduce import all_reduce_amax, replicated  # noqa: F401
