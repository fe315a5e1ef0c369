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
- escapes bars outside code.
"""
import inspect
import re

# The section headers napoleon understands: their indented bodies are its to parse.
_SECTIONS = re.compile(
    r"^\s*(Args|Arguments|Attention|Attributes|Caution|Danger|Error|Example|Examples|Hint|"
    r"Important|Keyword Args|Keyword Arguments|Methods|Note|Notes|Other Parameters|"
    r"Parameters|Receives?|Returns?|Raises?|References|See Also|Tip|Todo|Warnings?|Warns|"
    r"Yields?)\s*:\s*$")
_BULLET = re.compile(r"^(\s*)([*+-]|\d+[.)])\s+")
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
  return out


def process(app, what, name, obj, options, lines):
  if what in ("data", "attribute") and lines and "\n".join(lines).strip() == (
      inspect.getdoc(type(obj)) or "").strip():
    lines[:] = []  # a constant's own docstring is its type's (a dict's, a tuple's): none
    return
  lines[:] = rewrite(lines)


def setup(app):
  # Before napoleon (priority 500) turns the Google sections into fields.
  app.connect("autodoc-process-docstring", process, priority=100)
  return {"parallel_read_safe": True, "parallel_write_safe": True}
