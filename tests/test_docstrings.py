"""Every documented public function says what it returns; every public class says what it is.

The documented surface is the API reference's: every name listed in an `{api}` block of
docs/api/*.md. A function's docstring needs a Google-style `Returns:` (or `Yields:`)
section; whether it states shapes and dtypes is left to review.

`RETURNS_NOT_YET_DOCUMENTED` is the list of functions whose docstrings lacked that section
when this test was written: the test fails when another function joins them, and when one
of them gains its section (then delete its line), so the list only shrinks.
"""
import inspect
import pathlib
import re
import sys
import types

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "docs" / "_ext"))
from api_reference import resolve  # noqa: E402  (the reference's own name resolution)

RETURNS_NOT_YET_DOCUMENTED = {
    "fp8jax.amax",
    "fp8jax.ops.attention_backend.make_key",
    "fp8jax.checkpoint.check_complete",
    "fp8jax.checkpoint.describe",
    "fp8jax.checkpoint.describe_recipe",
    "fp8jax.checkpoint.is_complete",
    "fp8jax.checkpoint.read_description",
    "fp8jax.checkpoint.recipe_from_description",
    "fp8jax.dequantize",
    "fp8jax.deviceless.compile_ptx",
    "fp8jax.deviceless.cuda_plugin_module",
    "fp8jax.deviceless.deviceless_toolchain_missing",
    "fp8jax.deviceless.h100_devices",
    "fp8jax.deviceless.h100_mesh",
    "fp8jax.deviceless.h100_spec",
    "fp8jax.deviceless.h100_target_description",
    "fp8jax.deviceless.on_h100",
    "fp8jax.differentiating_fp8_state",
    "fp8jax.flax.linen.dot_meta_variable",
    "fp8jax.flax.linen.fp8_variable",
    "fp8jax.flax.linen.read_meta",
    "fp8jax.flax.linen.store_dot_meta",
    "fp8jax.formats_for",
    "fp8jax.ops.fused_kernels.choose",
    "fp8jax.ops.fused_kernels.close_steps",
    "fp8jax.ops.fused_kernels.fused_kernels",
    "fp8jax.mesh.axes.inside_shard_map",
    "fp8jax.ops.fused_kernels.kernels_allowed",
    "fp8jax.ops.fused_kernels.tensor_amax",
    "fp8jax.init_attention_meta",
    "fp8jax.init_dot_meta",
    "fp8jax.init_meta",
    "fp8jax.lowering.compare",
    "fp8jax.merge_step",
    "fp8jax.models.gpt.attention_backend",
    "fp8jax.models.gpt.config_for",
    "fp8jax.models.gpt.parameter_count",
    "fp8jax.runs.table",
    "fp8jax.mesh.axes.global_amax",
    "fp8jax.mesh.axes.match_operand_axes",
    "fp8jax.mesh.axes.normalize_axis_name",
    "fp8jax.step.all_reduce.replicated",
    "fp8jax.mesh.axes.vary_like",
}

_SECTION = re.compile(r"^\s*(Returns?|Yields?)\s*:", re.M)


def documented_names() -> list[str]:
  names = []
  for page in sorted((ROOT / "docs" / "api").glob("*.md")):
    for block in re.findall(r"```\{api\}\n(.*?)```", page.read_text(), re.S):
      names += block.split()
  return names


def _callables():
  for name in documented_names():
    obj = resolve(name)
    if not isinstance(obj, types.ModuleType) and callable(obj):
      yield name, obj


def test_every_documented_class_has_its_own_docstring():
  missing = [name for name, obj in _callables()
             if inspect.isclass(obj) and not (obj.__dict__.get("__doc__") or "").strip()]
  assert not missing, f"public classes without a docstring: {missing}"


def test_every_documented_function_says_what_it_returns():
  lacking = {name for name, obj in _callables()
             if not inspect.isclass(obj) and not _SECTION.search(inspect.getdoc(obj) or "")}
  new = sorted(lacking - RETURNS_NOT_YET_DOCUMENTED)
  fixed = sorted(RETURNS_NOT_YET_DOCUMENTED - lacking)
  assert not new, f"public functions whose docstring has no Returns section: {new}"
  assert not fixed, f"these no longer lack a Returns section (or left the reference): delete them from the list: {fixed}"
