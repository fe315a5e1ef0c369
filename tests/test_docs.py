"""The documentation cannot rot: it builds without a warning, its API reference names
every public name, and every Python example in it runs.

Examples run in page order, the examples of one page sharing a namespace, in a
temporary working directory. A page whose first line is
`<!-- examples continue from PAGE.md -->` runs that page's examples first (the text
says so too). An example that cannot run in a CPU test carries a visible marker right
before it, `<!-- not run: why -->`; each one is a skipped test here, with the reason.
An example marked `<!-- needs the hopper extra -->` compiles for an H100 and is skipped,
with that reason, where the deviceless toolchain is not installed. A block of output
marked `<!-- output of the example above -->` must equal what that example prints.
"""
from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import pathlib
import re
import subprocess
import sys
import types

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = sorted(p for p in DOCS.rglob("*.md") if "_build" not in p.parts)

_FENCE = re.compile(r"^(`{3,})([^\n`]*)\n(.*?)^\1[ \t]*$", re.M | re.S)
_MARKER = re.compile(r"<!--\s*(.*?)\s*-->\s*$", re.S)
_CONTINUES = re.compile(r"\A<!--\s*examples continue from (\S+\.md)\s*-->")


@dataclasses.dataclass(frozen=True)
class Block:
  page: pathlib.Path
  line: int
  language: str
  code: str
  marker: str       # the HTML comment right before the block ("" if none)

  @property
  def where(self) -> str:
    return f"{self.page.relative_to(DOCS)}:{self.line}"

  @property
  def not_run(self) -> str | None:
    match = re.match(r"not run:\s*(.+)", self.marker, re.S)
    return match.group(1).strip() if match else None


def blocks(page: pathlib.Path) -> list[Block]:
  """The fenced blocks of a markdown page, each with the comment that precedes it."""
  text = page.read_text()
  found, end = [], 0
  for fence in _FENCE.finditer(text):
    between = text[end:fence.start()].rstrip()
    marker = _MARKER.search(between)
    # Only a comment that is the last thing before the fence marks it.
    comment = marker.group(1) if marker and between.endswith("-->") else ""
    info = fence.group(2).split()
    found.append(Block(page, text.count("\n", 0, fence.start()) + 1, info[0] if info else "",
                       fence.group(3), comment))
    end = fence.end()
  return found


def python_blocks(page: pathlib.Path) -> list[Block]:
  return [b for b in blocks(page) if b.language in ("python", "py")]


def continued_page(page: pathlib.Path) -> pathlib.Path | None:
  match = _CONTINUES.match(page.read_text())
  return (page.parent / match.group(1)).resolve() if match else None


def _hopper_missing() -> str | None:
  from fp8jax.deviceless import deviceless_toolchain_missing
  return deviceless_toolchain_missing()


def run_page(page: pathlib.Path, namespace: dict) -> int:
  """Runs a page's examples in `namespace`; returns how many ran."""
  ran = 0
  if (before := continued_page(page)) is not None:
    ran += run_page(before, namespace)
  page_blocks = blocks(page)
  printed = None
  for i, block in enumerate(page_blocks):
    if block.marker == "output of the example above":
      assert printed is not None, f"{block.where}: no example right before this output"
      assert printed.strip() == block.code.strip(), (
          f"{block.where}: the example above prints\n{printed}")
      continue
    printed = None
    if block.language not in ("python", "py") or block.not_run:
      continue
    if block.marker == "needs the hopper extra" and _hopper_missing():
      continue
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
      exec(compile(block.code, str(block.page.relative_to(ROOT)) + f":{block.line}", "exec"),
           namespace)
    printed = out.getvalue()
    ran += 1
  return ran


def _page_id(page: pathlib.Path) -> str:
  return str(page.relative_to(DOCS))


PAGES_WITH_EXAMPLES = [p for p in PAGES if python_blocks(p)]


@pytest.mark.parametrize("page", PAGES_WITH_EXAMPLES, ids=_page_id)
def test_docs_page_examples_run(page, tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)   # examples write files (checkpoints) where they run
  name = "docs_examples_" + re.sub(r"\W", "_", _page_id(page))
  module = types.ModuleType(name)   # a real module: dataclasses and pickling look it up
  monkeypatch.setitem(sys.modules, name, module)
  ran = run_page(page, module.__dict__)
  assert ran > 0


def _not_run_here() -> list[tuple[Block, str]]:
  """The examples that do not run in this test session, each with why."""
  found = [(b, f"marked not run: {b.not_run}") for p in PAGES for b in python_blocks(p)
           if b.not_run]
  if (missing := _hopper_missing()):
    found += [(b, f"needs the hopper extra: {missing}") for p in PAGES
              for b in python_blocks(p) if b.marker == "needs the hopper extra"]
  return found


NOT_RUN = _not_run_here()

if NOT_RUN:  # each example that does not run is a skipped test, with its reason

  @pytest.mark.parametrize("block, reason", NOT_RUN, ids=[b.where for b, _ in NOT_RUN])
  def test_docs_example_not_run_is_skipped_with_its_reason(block, reason):
    pytest.skip(f"{block.where}: {reason}")


def test_docs_examples_are_all_python_or_marked():
  """Every example a reader might paste is either run here or says why not."""
  unknown = [b.where for p in PAGES for b in blocks(p)
             if b.marker and b.marker not in ("output of the example above",
                                              "needs the hopper extra")
             and not b.not_run]
  assert not unknown, f"blocks with an unknown marker: {unknown}"
  counts = {"run": 0, "not run": 0}
  for p in PAGES:
    for b in python_blocks(p):
      counts["not run" if b.not_run else "run"] += 1
  print(f"docs Python examples: {counts['run']} run, {counts['not run']} marked not run",
        *(f"{b.where}: {reason}" for b, reason in NOT_RUN), sep="\n  ")
  assert counts["run"] > 0


@pytest.fixture(scope="module")
def built_site(tmp_path_factory):
  """The site, built as the README says (HTML, warnings as errors), into a temp dir."""
  out = tmp_path_factory.mktemp("docs") / "html"
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  result = subprocess.run(
      [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-j", "2", "-b", "html",
       str(DOCS), str(out)], capture_output=True, text=True, env=env, cwd=ROOT)
  return result, out


def test_docs_site_builds_without_a_warning(built_site):
  result, _ = built_site
  assert result.returncode == 0 and not result.stderr.strip(), result.stderr[-5000:]


def _documented_objects(out: pathlib.Path) -> set[str]:
  from sphinx.util.inventory import InventoryFile
  with open(out / "objects.inv", "rb") as f:
    inventory = InventoryFile.load(f, "", os.path.join)
  return {name for kind, entries in inventory.items() if kind.startswith("py:")
          for name in entries}


def _public_names(module_name: str) -> list[str]:
  """A module's public names: its `__all__`, else the functions and classes it defines."""
  import importlib
  module = importlib.import_module(module_name)
  if hasattr(module, "__all__"):
    return list(module.__all__)
  return [name for name, obj in vars(module).items()
          if not name.startswith("_") and callable(obj)
          and getattr(obj, "__module__", None) == module_name]


def _reference_name(module_name: str, name: str) -> str:
  """Where the reference documents `module_name.name`: there, or a submodule (the
  package's `fp8jax.attention_backend` is `fp8jax.ops.attention_backend`) on its page."""
  import importlib
  obj = getattr(importlib.import_module(module_name), name)
  return obj.__name__ if isinstance(obj, types.ModuleType) else f"{module_name}.{name}"


DOCUMENTED_MODULES = ["fp8jax", "fp8jax.flax", "fp8jax.flax.linen", "fp8jax.flax.nnx",
                      "fp8jax.checkpoint", "fp8jax.lowering", "fp8jax.deviceless",
                      "fp8jax.telemetry", "fp8jax.optim", "fp8jax.flax.linen_moe",
                      "fp8jax.flax.nnx_moe", "fp8jax.ops.moe_routing",
                      "fp8jax.ops.expert_parallel", "fp8jax.models.gpt", "fp8jax.models.gpt_moe",
                      "fp8jax.data",
                      "fp8jax.runs"]


def test_docs_api_reference_names_every_public_name(built_site):
  result, out = built_site
  assert result.returncode == 0, result.stderr[-5000:]
  documented = _documented_objects(out)
  missing = {module: [name for name in _public_names(module)
                      if _reference_name(module, name) not in documented]
             for module in DOCUMENTED_MODULES}
  missing = {module: names for module, names in missing.items() if names}
  assert not missing, f"public names missing from the API reference: {missing}"


def test_docs_cli_reference_shows_every_command(built_site):
  from fp8jax.cli import SUBCOMMANDS
  _, out = built_site
  page = (out / "cli.html").read_text()
  for command in SUBCOMMANDS:
    assert f"usage: fp8jax {command}" in page, command


def _text(html: str) -> str:
  import html as html_lib
  return html_lib.unescape(re.sub(r"<[^>]+>", "", html))


def _api_names(kind: str) -> list[tuple[pathlib.Path, str]]:
  """(page, name) of every name an `{api}` block lists whose entry is of `kind`."""
  sys.path.insert(0, str(DOCS / "_ext"))
  try:
    from api_reference import directive_for, resolve
  finally:
    sys.path.pop(0)
  return [(page, name) for page in PAGES for block in blocks(page) if block.language == "{api}"
          for name in block.code.split() if directive_for(resolve(name)) == kind]


def test_docs_api_reference_summarizes_and_describes_every_constant(built_site):
  # A constant's docstring is its type's; its `#:` comment where it is assigned is its own.
  _, out = built_site
  constants = _api_names("data")
  assert {"fp8jax.E4M3", "fp8jax.E5M2"} <= {name for _, name in constants}
  for page, name in constants:
    html = (out / page.relative_to(DOCS).with_suffix(".html")).read_text()
    row = re.search(rf'<tr[^>]*><td><p><a [^>]*title="{re.escape(name)}".*?</tr>', html, re.S)
    summary = _text(row.group(0)).strip().split("\n")[-1] if row else ""
    assert row and summary and summary != name.rsplit(".", 1)[1], (page.name, name)
    entry = re.search(rf'id="{re.escape(name)}".*?</dt>\s*<dd>(.*?)</dd>', html, re.S)
    assert entry and _text(entry.group(1)).strip(), (page.name, name)


def test_docs_api_reference_reads_tuples_returned_as_descriptions_not_types(built_site):
  # "Returns: (y, new_meta): y ..." is prose: before the fix its "(y, new_meta)" was shown
  # as the return type, and the text after its first colon as the description.
  _, out = built_site
  for page in sorted((out / "api").glob("*.html")):
    fields = re.findall(r'>Return type<span class="colon">:</span></dt>\s*<dd[^>]*>(.*?)</dd>',
                        page.read_text(), re.S)
    assert not [f for f in fields if _text(f).strip().startswith("(")], page.name
  html = (out / "api" / "fp8jax.html").read_text()
  attention = html[html.index('id="fp8jax.fp8_attention"'):]
  attention = attention[:attention.index("</dl>\n</dd>")]
  assert _text(attention).count("bottom-right") == 1  # causal's, not every parameter's
  assert "(out, new_meta): out [batch, q_len, heads, head_dim]" in _text(attention)
