"""Reads fp8jax's docstrings as they are written: plain text with `code` in single
backticks, Google-style sections (napoleon), and indented blocks of code or tables.

In reStructuredText each of these means something else: an indented block is a block
quote or a definition list (and warns about the indentation inside it), `code` right
before a letter ("`ShapeDtypeStruct`s") is not markup, napoleon splits a Returns line
at a colon inside `code`, and |x| (an absolute value) is a substitution. Before
napoleon reads a docstring, this extension
- marks each indented block of free text (outside a Google section) as a literal block,
  shown as written;
- writes each `code` span as :py:obj:`code` (shown as code, linked where it names a
  documented object; napoleon leaves colons inside a role alone), with the escaped
  space reStructuredText needs next to a letter;
- escapes bars outside code;
- writes a Returns (or Yields) section that opens with a parenthesized tuple,
  "(y, new_meta): y ...", as the field it is, all description: napoleon would read the
  text before the first colon as the return type.

A constant's documentation is its `#:` comment (or the string after it) where it is
assigned, found through the package's modules when the reference names it where it is
imported (`fp8jax.E4M3`, assigned in `fp8jax.core.formats`): `attribute_doc`.
"""
import inspect
import re
import sys

from sphinx.pycode import ModuleAnalyzer
from sphinx.errors import PycodeError

# The section headers napoleon understands: their indented bodies are its to parse.
_SECTIONS = re.compile(
    r"^\s*(Args|Arguments|Attention|Attributes|Caution|Danger|Error|Example|Examples|Hint|"
    r"Important|Keyword Args|Keyword Arguments|Methods|Note|Notes|Other Parameters|"
    r"Parameters|Receives?|Returns?|Raises?|References|See Also|Tip|Todo|Warnings?|Warns|"
    r"Yields?)\s*:\s*$")
_BULLET = re.compile(r"^(\s*)([*+-]|\d+[.)])\s+")
# A Returns / Yields section header, and its field's name in reStructuredText.
_RETURNS = re.compile(r"^(\s*)(Returns?|Yields?)\s*:\s*$")
_RETURNS_FIELD = {"Return": "returns", "Returns": "returns", "Yield": "Yields",
                  "Yields": "Yields"}
# A `code` span (not ``literal``, not a :role:`target`), or a bar.
_CODE_OR_BAR = re.compile(r"(?<![`:\\])`([^`]+)`(?!`)|\\?\|")


def _indent(line: str) -> int:
  return len(line) - len(line.lstrip())


def literal_block_lines(lines: list[str]) -> tuple[list[str], list[bool]]:
  """`lines` with every indented block of free text marked as a literal block, and for
  each output line whether it is inside such a block."""
  out: list[str] = []
  literal: list[bool] = []
  base = None          # indentation of the free text around us
  section = None       # indentation of the Google section header we are in, if any
  code = None          # indentation of the literal block we are in, if any
  bullet = None        # indentation of the text of the list item we are in, if any

  def emit(line, is_code=False):
    out.append(line)
    literal.append(is_code)

  for line in lines:
    if not line.strip():
      emit(line, code is not None)
      continue
    indent = _indent(line)
    if code is not None:
      if indent >= code:
        emit(line, True)
        continue
      code = None
      if out[-1].strip():
        emit("")
    if section is not None:
      if indent > section:
        emit(line)
        continue
      section = None
    if base is None:
      base = indent
    item = _BULLET.match(line)
    if item:
      bullet = len(item.group(0))
    elif bullet is not None and indent != bullet:
      bullet = None
    if _SECTIONS.match(line):
      section = indent
    elif indent > base and not item and indent != bullet:
      # Code or a table: a literal block (the lone "::" paragraph disappears).
      if out and out[-1].strip():
        emit("")
      emit(" " * base + "::")
      emit("")
      code = indent
      emit(line, True)
      continue
    emit(line)
  return out, literal


def _markup(text: str) -> str:
  """`code` as :py:obj:`code` and bars escaped, in text that may span lines."""

  def replace(match):
    if match.group(1) is None:
      return "\\|"
    before = text[match.start() - 1] if match.start() else " "
    after = text[match.end()] if match.end() < len(text) else " "
    role = f":py:obj:`{match.group(1)}`"
    # Inline markup must stand apart from letters: an escaped space does, invisibly.
    return ("\\ " if before.isalnum() else "") + role + ("\\ " if after.isalnum() else "")

  return _CODE_OR_BAR.sub(replace, text)


def tuple_returns_as_fields(lines: list[str]) -> list[str]:
  """Each Returns / Yields section whose text opens with "(" (a tuple described in prose,
  not a type) as a `:returns:` field: napoleon leaves a field as it is."""
  out: list[str] = []
  i = 0
  while i < len(lines):
    header = _RETURNS.match(lines[i])
    if not header:
      out.append(lines[i])
      i += 1
      continue
    indent = len(header.group(1))
    end = i + 1
    while end < len(lines) and (not lines[end].strip() or _indent(lines[end]) > indent):
      end += 1
    body = lines[i + 1:end]
    while body and not body[-1].strip():
      body.pop()
    if not body or not body[0].lstrip().startswith("("):
      out += lines[i:end]
    else:
      margin = min(_indent(line) for line in body if line.strip())
      field = f"{header.group(1)}:{_RETURNS_FIELD[header.group(2)]}: "
      out.append(field + body[0][margin:])
      out += [(" " * (indent + 3) + line[margin:]) if line.strip() else "" for line in body[1:]]
      out += lines[i + 1 + len(body):end]
    i = end
  return out


def attribute_doc(name: str, obj) -> list[str]:
  """The documentation of the constant `name` (`package.module.NAME`) is `obj`: its `#:`
  comment where it is assigned, read in the module that names it or else in the first
  module of its package that holds the same object under that name; [] if none has one."""
  module_name, attr = name.rsplit(".", 1)
  package = module_name.split(".")[0]
  candidates = [module_name] + sorted(
      m for m in list(sys.modules) if m == package or m.startswith(package + "."))
  for candidate in candidates:
    module = sys.modules.get(candidate)
    if module is None or getattr(module, attr, None) is not obj:
      continue
    try:
      docs = ModuleAnalyzer.for_module(candidate).find_attr_docs()
    except PycodeError:
      continue
    if ("", attr) in docs:
      return list(docs[("", attr)])
  return []


def rewrite(lines: list[str]) -> list[str]:
  lines, literal = literal_block_lines(lines)
  out: list[str] = []
  run: list[str] = []   # consecutive lines of free text: a `code` span may cross lines
  for line, is_code in zip(lines, literal):
    if is_code:
      if run:
        out += _markup("\n".join(run)).split("\n")
        run = []
      out.append(line)
    else:
      run.append(line)
  if run:
    out += _markup("\n".join(run)).split("\n")
  return tuple_returns_as_fields(out)


def process(app, what, name, obj, options, lines):
  if what in ("data", "attribute") and (not lines or "\n".join(lines).strip() == (
      inspect.getdoc(type(obj)) or "").strip()):
    # A constant's own docstring is its type's (a dict's, a tuple's): its `#:` comment
    # where it is assigned, if the module that names it is not that one.
    lines[:] = attribute_doc(name, obj) if what == "data" else []
  lines[:] = rewrite(lines)


def setup(app):
  # Before napoleon (priority 500) turns the Google sections into fields.
  app.connect("autodoc-process-docstring", process, priority=100)
  return {"parallel_read_safe": True, "parallel_write_safe": True}
