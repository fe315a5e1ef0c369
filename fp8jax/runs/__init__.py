"""The demo: training runs of `fp8jax.models.gpt` on `fp8jax.data`'s corpus (the `fp8jax` command).

* `train` (`fp8jax train`): one run with checkpoints, per-step metrics and resume.
* `compare` (`fp8jax compare`): the same run in bf16 and in each FP8 recipe.
* `calibrate` (`fp8jax calibrate`): FP8 state for a bf16 checkpoint.
* `machine`: the machine a comparison's numbers come from (recorded in compare.json).
"""
from fp8jax.runs import machine  # noqa: F401  (fp8jax.runs.machine.summary)
from fp8jax.runs.calibrate import calibrate
from fp8jax.runs.compare import compare, table
from fp8jax.runs.config import RECIPES, RunConfig, RunError
from fp8jax.runs.train import RunInterrupted, RunResult, train

__all__ = ["RECIPES", "RunConfig", "RunError", "RunInterrupted", "RunResult", "calibrate",
           "compare", "table", "train"]
