"""A small reader for XLA's optimized HLO text (`jax.stages.Compiled.as_text()`).

It keeps what the GEMM analysis needs: every computation, and for each
instruction its name, opcode, result shape(s) with layout, operand names and
raw attributes (`calls=`, `custom_call_target=`, `backend_config=`, ...).
It does not try to be a full HLO parser; unknown syntax is kept as raw text.
"""
from __future__ import annotations

import dataclasses
import json
import re

_ARRAY_SHAPE = re.compile(r"^(?P<dtype>[a-z][a-z0-9]*)\[(?P<dims>[^\]]*)\](?:\{(?P<layout>[^}]*)\})?$")


@dataclasses.dataclass(frozen=True)
class ArrayShape:
  """One array shape: dtype name as XLA prints it, dims, and minor-to-major layout."""

  dtype: str
  dims: tuple[int, ...]
  minor_to_major: tuple[int, ...] | None

  def __str__(self) -> str:
    return f"{self.dtype}[{','.join(map(str, self.dims))}]"

  @property
  def major_to_minor(self) -> tuple[int, ...]:
    """Logical dims from outermost to innermost in memory (row-major when no layout)."""
    if self.minor_to_major is None:
      return tuple(range(len(self.dims)))
    return tuple(reversed(self.minor_to_major))


@dataclasses.dataclass
class Instruction:
  """One HLO instruction."""

  name: str
  opcode: str
  shapes: tuple[ArrayShape, ...]  # one per tuple element; one entry for an array result
  is_tuple: bool
  operands: tuple[str, ...]
  attributes: dict[str, str]
  computation: str
  is_root: bool = False

  @property
  def shape(self) -> ArrayShape | None:
    """The array result shape, or None for a tuple result."""
    return None if self.is_tuple or not self.shapes else self.shapes[0]

  def backend_config(self) -> dict:
    """`backend_config` parsed as JSON ({} when absent or unparsable)."""
    raw = self.attributes.get("backend_config")
    if not raw:
      return {}
    try:
      return json.loads(raw)
    except json.JSONDecodeError:
      return {}

  def int_list(self, attribute: str) -> tuple[int, ...]:
    """An attribute such as `dimensions={1,0}` as a tuple of ints."""
    raw = self.attributes.get(attribute, "").strip("{}")
    return tuple(int(v) for v in raw.split(",") if v.strip())

  @property
  def op_name(self) -> str:
    """The JAX op name recorded in the metadata (e.g. 'jit(step)/transpose(jvp())/dot_general')."""
    match = re.search(r'op_name="([^"]*)"', self.attributes.get("metadata", ""))
    return match.group(1) if match else ""


@dataclasses.dataclass
class Computation:
  name: str
  instructions: dict[str, Instruction]
  root: str | None
  parameters: dict[int, str]  # parameter number -> instruction name
  is_entry: bool = False


@dataclasses.dataclass
class HloModule:
  """All computations of one HLO module."""

  name: str
  computations: dict[str, Computation]
  entry: str

  def instruction(self, computation: str, name: str) -> Instruction:
    return self.computations[computation].instructions[name]

  def called(self, instr: Instruction) -> Computation | None:
    """The computation a fusion (or call) instruction calls."""
    callee = instr.attributes.get("calls") or instr.attributes.get("to_apply")
    if not callee:
      return None
    return self.computations.get(callee.lstrip("%"))


def parse_hlo_module(text: str) -> HloModule:
  """Parses the text of one optimized HLO module.

  Args:
    text: what `jax.stages.Compiled.as_text()` returns (or an XLA dump file
      `*after_optimizations.txt`).

  Returns:
    An `HloModule`.

  Raises:
    ValueError: if the text holds no ENTRY computation.
  """
  module_name = ""
  computations: dict[str, Computation] = {}
  entry = None
  current: Computation | None = None
  for line in text.splitlines():
    stripped = line.strip()
    if not stripped or stripped.startswith("//"):
      continue
    if stripped.startswith("HloModule "):
      module_name = stripped.split()[1].rstrip(",")
      continue
    if current is None:
      if stripped.endswith("{"):
        is_entry = stripped.startswith("ENTRY ")
        header = stripped[len("ENTRY "):] if is_entry else stripped
        name = header.split()[0].split("(")[0].lstrip("%")
        current = Computation(name=name, instructions={}, root=None, parameters={},
                              is_entry=is_entry)
        if is_entry:
          entry = name
      continue
    if stripped == "}":
      computations[current.name] = current
      current = None
      continue
    instr = _parse_instruction(stripped, current.name)
    if instr is None:
      continue
    current.instructions[instr.name] = instr
    if instr.is_root:
      current.root = instr.name
    if instr.opcode == "parameter":
      number = re.match(r"\s*(\d+)", instr.attributes.get("_operand_text", ""))
      if number:
        current.parameters[int(number.group(1))] = instr.name
  if entry is None:
    raise ValueError("text=... holds no ENTRY computation; pass the optimized HLO of one "
                     "module (jax.jit(f).lower(...).compile().as_text()).")
  return HloModule(name=module_name, computations=computations, entry=entry)


def parse_shape(text: str) -> tuple[tuple[ArrayShape, ...], bool]:
  """Parses 'f32[2,3]{1,0}' or a tuple '(f32[2]{0}, s8[4]{0})' into array shapes."""
  # A long tuple numbers its elements: '(f32[1]{0}, ..., /*index=5*/f8e4m3fn[8,128]{1,0})'.
  text = re.sub(r"/\*.*?\*/", "", text).strip()
  if text.startswith("("):
    parts = _split_top_level(text[1:-1])
    shapes = []
    for part in parts:
      inner, _ = parse_shape(part)
      shapes.extend(inner)
    return tuple(shapes), True
  # Drop tiling / memory-space annotations such as {1,0:T(8,128)S(1)}.
  text = re.sub(r"\{([^}:]*):[^}]*\}", r"{\1}", text)
  match = _ARRAY_SHAPE.match(text)
  if not match:
    return (), False
  dims = tuple(int(d.lstrip("<=")) for d in match.group("dims").split(",") if d.strip())
  layout = match.group("layout")
  minor_to_major = (tuple(int(v) for v in layout.split(",") if v.strip())
                    if layout is not None else None)
  return (ArrayShape(match.group("dtype"), dims, minor_to_major),), False


def _parse_instruction(line: str, computation: str) -> Instruction | None:
  is_root = line.startswith("ROOT ")
  if is_root:
    line = line[len("ROOT "):]
  name, sep, rest = line.partition(" = ")
  if not sep:
    return None
  name = name.strip().lstrip("%")
  rest = rest.lstrip()
  if rest.startswith("("):
    end = _matching(rest, 0)
    shape_text, rest = rest[:end + 1], rest[end + 1:].lstrip()
  else:
    shape_text, _, rest = rest.partition(" ")
  shapes, is_tuple = parse_shape(shape_text)
  match = re.match(r"([\w\-\$\.]+)\(", rest)
  if not match:
    return None
  opcode = match.group(1)
  open_paren = match.end() - 1
  close_paren = _matching(rest, open_paren)
  operand_text = rest[open_paren + 1:close_paren]
  operands = []
  if opcode not in ("parameter", "constant"):
    for item in _split_top_level(operand_text):
      names = re.findall(r"%([\w\.\-]+)", item)
      if names:
        operands.append(names[-1])
      elif item.strip() and re.fullmatch(r"[\w\.\-]+", item.strip()):
        operands.append(item.strip())
  attributes = {"_operand_text": operand_text}
  for item in _split_top_level(rest[close_paren + 1:]):
    key, eq, value = item.strip().partition("=")
    if eq:
      attributes[key.strip()] = value.strip().strip('"') if key.strip() in (
          "custom_call_target",) else value.strip()
  return Instruction(name=name, opcode=opcode, shapes=shapes, is_tuple=is_tuple,
                     operands=tuple(operands), attributes=attributes,
                     computation=computation, is_root=is_root)


_OPEN = {"(": ")", "{": "}", "[": "]"}
# What the bracket scanners stop at: a whole quoted string (escapes inside it skipped; a
# custom call's backend_config can be megabytes, read in runs of plain characters), a
# bracket, or a comma. Everything else is passed over by the regex engine, not character
# by character in Python.
_TOKEN = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"?|[(){}\[\],]', re.DOTALL)


def _matching(text: str, start: int) -> int:
  """Index of the bracket closing the one at `start` (quotes are skipped)."""
  depth = 0
  for token in _TOKEN.finditer(text, start):
    ch = token.group()
    if ch in _OPEN:
      depth += 1
    elif ch in ")}]":
      depth -= 1
      if depth == 0:
        return token.start()
  return len(text) - 1


def _split_top_level(text: str) -> list[str]:
  """`text` split at each comma outside brackets and quotes."""
  parts, depth, begin = [], 0, 0
  for token in _TOKEN.finditer(text):
    ch = token.group()
    if ch in _OPEN:
      depth += 1
    elif ch in ")}]":
      depth -= 1
    elif ch == "," and depth == 0:
      parts.append(text[begin:token.start()])
      begin = token.end()
  if text[begin:].strip():
    parts.append(text[begin:])
  return parts
