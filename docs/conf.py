"""Sphinx configuration of fp8jax's documentation (MyST markdown, API from docstrings).

Build: python -m sphinx -W --keep-going -b html docs docs/_build/html
"""
import importlib.util
import os
import pathlib
import sys
import tomllib

DOCS = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(DOCS / "_ext"))
# The docs document the source tree they sit in, installed or not.
sys.path.insert(0, str(DOCS.parent))
# Importing fp8jax must not try to open a GPU on a documentation machine.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

project = "fp8jax"
author = "fp8jax authors"
copyright = "fp8jax authors"
with open(DOCS.parent / "pyproject.toml", "rb") as f:
  release = version = tomllib.load(f)["project"]["version"]

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "plain_docstrings",
    "api_reference",
    "cli_help",
]

source_suffix = {".md": "markdown"}
exclude_patterns = ["_build"]
root_doc = "index"

# Markdown: `page.md#anchor` links to headings down to level 3.
myst_heading_anchors = 3

# Docstrings are Google style, with `code` in single backticks: shown as code, linked
# when it names a documented object.
napoleon_google_docstring = True
napoleon_numpy_docstring = False
default_role = "py:obj"
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_default_options = {"members": False}
autosummary_generate = False

html_theme = "furo" if importlib.util.find_spec("furo") else "alabaster"
html_title = "fp8jax"
pygments_style = "sphinx"
