"""`{api}` directive: a summary table and the docstring of each listed public name.

    ```{api}
    fp8jax.fp8_dense
    fp8jax.DelayedScaling
    ```

Each line is a name as users import it (`fp8jax.fp8_dense`, never the module that
defines it today), so the reference stays right while fp8jax's internal modules
move. The kind of documentation (function, class, exception, data) follows from
the object; a name that does not import fails the build.
"""
import importlib
import inspect
import types

from docutils import nodes
from docutils.statemachine import StringList
from sphinx.util.docutils import SphinxDirective

import plain_docstrings


def resolve(name: str):
  """The object a public dotted name refers to, read as users read it: attribute first.

  `fp8jax.quantize` is the function `fp8jax` exports, not the module of that name.
  """
  parts = name.split(".")
  obj = importlib.import_module(parts[0])
  for i, attr in enumerate(parts[1:], start=1):
    if hasattr(obj, attr):
      obj = getattr(obj, attr)
    else:
      obj = importlib.import_module(".".join(parts[:i + 1]))
  return obj


def directive_for(obj) -> str:
  if isinstance(obj, types.ModuleType):
    return ""
  if inspect.isclass(obj):
    return "autoexception" if issubclass(obj, BaseException) else "autoclass"
  if callable(obj):
    return "autofunction"
  return "data"


def public_name(cls: type) -> str:
  """`fp8jax.Fp8Format` for a class fp8jax exports, else the class's own path."""
  import fp8jax
  import fp8jax.flax
  for package in (fp8jax, fp8jax.flax):
    if getattr(package, cls.__name__, None) is cls:
      return f"{package.__name__}.{cls.__name__}"
  if cls.__module__ == "builtins":
    return cls.__qualname__
  return f"{cls.__module__}.{cls.__qualname__}"


def data_entry(name: str, obj) -> list[str]:
  """A constant: its type, value and `#:` comment (an instance's docstring is its class's,
  not its own; `plain_docstrings.attribute_doc`)."""
  value = repr(obj)
  if len(value) > 200:
    value = value[:197] + "..."
  type_name = public_name(type(obj))
  module, attr = name.rsplit(".", 1)
  doc = plain_docstrings.rewrite(plain_docstrings.attribute_doc(name, obj))
  return [f".. py:data:: {attr}", f"   :module: {module}", f"   :type: {type_name}",
          f"   :value: {value}", "", *(f"   {line}" if line else "" for line in doc),
          ""]


class Api(SphinxDirective):
  has_content = True

  def run(self):
    names = [line.strip() for line in self.content if line.strip()]
    # The page is MyST markdown: the directives are written as fences.
    # autosummary wants names relative to the page's current module (if any).
    module = self.env.ref_context.get("py:module")
    relative = [name.removeprefix(f"{module}.") if module else name for name in names]
    # autodoc writes reStructuredText, so the page (MyST markdown) hands it an eval-rst block.
    rst = [".. autosummary::", "   :nosignatures:", "", *(f"   {name}" for name in relative), ""]
    for name in names:
      try:
        obj = resolve(name)
      except (ImportError, AttributeError) as error:
        raise self.error(f"{name}: {error}")
      kind = directive_for(obj)
      if not kind:  # a module: documented on its own page, linked from the table
        continue
      if kind == "data":
        rst += data_entry(name, obj)
        continue
      rst.append(f".. {kind}:: {name}")
      if kind in ("autoclass", "autoexception"):
        rst.append("   :members:")
      rst.append("")
    lines = ["```{eval-rst}", *rst, "```"]
    container = nodes.container()
    self.state.nested_parse(StringList(lines, self.get_source_info()[0]), self.content_offset,
                            container)
    return container.children


def setup(app):
  app.add_directive("api", Api)
  return {"parallel_read_safe": True, "parallel_write_safe": True}
