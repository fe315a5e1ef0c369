"""The layout is the architecture: fp8jax's folders are layers that import only downward.

* `lint-imports` (import-linter) keeps the contracts in pyproject.toml: the layers
  contract (cli, runs, models, flax / data, lowering / telemetry / checkpoint, step,
  ops, mesh, core), pallas_kernels imports no fp8jax and no Flax, core imports no
  ops, mesh, step or Flax, and mesh knows no FP8 state.
* No module of fp8jax/ or pallas_kernels/ imports fp8jax or pallas_kernels inside a
  function (outside fp8jax/cli/, which keeps `fp8jax --help` fast that way): an
  import placed there to dodge a cycle hides a layer in the wrong place. Optional
  third-party dependencies may be imported where they are used, with a comment that
  says why.
* Below the demo, no module imports the `fp8jax` package itself: it re-exports every
  layer, so such an import reaches up.
"""
from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
# Optional dependencies a library module may import where it needs them: orbax for
# checkpoints, tqdm for progress bars, matplotlib for plots. Anything else of the
# standard library or JAX is imported at the top like every other import.
OPTIONAL_THIRD_PARTY = ("orbax", "tqdm", "matplotlib")
# The demo and the CLI are written as a user writes: against the public package.
USES_THE_PUBLIC_PACKAGE = ("fp8jax/runs/", "fp8jax/cli/")


def _modules():
  for package in ("fp8jax", "pallas_kernels"):
    yield from sorted((ROOT / package).rglob("*.py"))


def _imported_names(node: ast.AST) -> list[str]:
  if isinstance(node, ast.Import):
    return [alias.name for alias in node.names]
  if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
    return [node.module]
  if isinstance(node, ast.ImportFrom):  # relative: always fp8jax's own code
    return ["fp8jax"]
  return []


def _function_imports(tree: ast.AST):
  """(line, imported module) for every import inside a function body."""
  for function in ast.walk(tree):
    if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
      for node in ast.walk(function):
        for name in _imported_names(node):
          yield node.lineno, name


def _is_module_of_fp8jax(name: str) -> bool:
  return (ROOT / "fp8jax" / f"{name}.py").exists() or (ROOT / "fp8jax" / name).is_dir()


def _root(name: str) -> str:
  return name.split(".")[0]


def test_lint_imports_keeps_every_layer_contract():
  # The console script next to this interpreter: the one of the environment running the tests.
  lint_imports = pathlib.Path(sys.executable).with_name("lint-imports")
  if not lint_imports.exists():
    pytest.fail(f"{lint_imports} is missing: install the test extra (pip install -e '.[test]').")
  result = subprocess.run([str(lint_imports), "--no-cache"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
  assert result.returncode == 0, result.stdout + result.stderr
  assert "0 broken" in result.stdout, result.stdout


def test_no_fp8jax_or_kernel_import_inside_a_function_outside_the_cli():
  found = []
  for path in _modules():
    relative = path.relative_to(ROOT).as_posix()
    if relative.startswith("fp8jax/cli/"):
      continue
    lines = path.read_text().splitlines()
    for line, name in _function_imports(ast.parse(path.read_text())):
      root = _root(name)
      if root in ("fp8jax", "pallas_kernels"):
        found.append(f"{relative}:{line} imports {name} inside a function")
      elif root in OPTIONAL_THIRD_PARTY and "#" not in lines[line - 1] and (
          "#" not in lines[line - 2]):
        found.append(f"{relative}:{line} imports the optional {name} without a comment "
                     "that says why it is imported there")
  assert not found, "\n".join(found)


def test_no_layer_below_the_demo_imports_the_fp8jax_package_itself():
  found = []
  for path in _modules():
    relative = path.relative_to(ROOT).as_posix()
    if relative.startswith(USES_THE_PUBLIC_PACKAGE) or not relative.startswith("fp8jax/"):
      continue
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.Import) and any(a.name == "fp8jax" for a in node.names):
        found.append(f"{relative}:{node.lineno} imports fp8jax")
      if isinstance(node, ast.ImportFrom) and node.module == "fp8jax" and (
          relative != "fp8jax/__init__.py"):
        # `from fp8jax import deviceless` names a module; `from fp8jax import fp8_dense`
        # takes a name the package re-exports from its layers.
        names = [a.name for a in node.names if not _is_module_of_fp8jax(a.name)]
        if names:
          found.append(f"{relative}:{node.lineno} imports {names} from the fp8jax package")
  assert not found, "\n".join(found)


def test_no_module_only_re_exports_another():
  # A module of imports alone is another module's old path: one name too many for each
  # thing (fp8jax 0.1 kept seven at the top of fp8jax/). A package's __init__ gathers its
  # layer's names and is exempt.
  found = []
  for path in _modules():
    if path.name == "__init__.py":
      continue
    body = ast.parse(path.read_text()).body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
      body = body[1:]  # the docstring
    if body and all(isinstance(node, (ast.Import, ast.ImportFrom)) for node in body):
      found.append(path.relative_to(ROOT).as_posix())
  assert not found, f"modules that only re-export: {found}"
