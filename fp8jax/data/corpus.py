"""The demo's training text: bytes of the Python standard library, or of a user's file.

Tokens are bytes (`VOCAB_SIZE = 256`), so no tokenizer and no download are needed:

    corpus = stdlib_corpus()                       # or text_file_corpus("notes.txt")
    batch = train_batch(corpus.train, step, batch_size=16, seq_len=256, seed=0)
    inputs, targets = batch[:, :-1], batch[:, 1:]  # int32 [16, 256] each
    for batch in validation_batches(corpus.validation, 16, 256, max_batches=8): ...

Standard library selection (`stdlib_corpus`), in the directory
`sysconfig.get_paths()["stdlib"]`: every regular file whose name ends in `.py`,
found by walking the directory without following symbolic links, except

* anything inside a directory named `site-packages` (third-party packages: they
  differ from machine to machine);
* anything inside a directory named `test`, `tests`, `idlelib`, `lib2to3`,
  `turtledemo` or `encodings` (whose files are mostly codec tables), so that the
  text is ordinary library code;
* build configuration, which also differs from machine to machine: files named
  `_sysconfigdata*.py` and anything inside a directory whose name starts with
  `config-` (e.g. `config-3.11-x86_64-linux-gnu/python-config.py`).

Directory names are compared exactly (case-sensitive) at any depth below the
stdlib directory. Files are ordered by their relative POSIX path (plain string
order, e.g. `__future__.py` < `_pydecimal.py` < `abc.py` < `asyncio/base_events.py`)
and each contributes `SEPARATOR_TEMPLATE` with its path followed by its raw bytes;
the concatenation is cut at `max_bytes` (usually inside the last file).

Split (both corpora): the text is cut into `split_blocks` (about 20 or more
blocks of at most 32 KiB), and block i goes to validation when
`floor((i + 1) * validation_fraction) > floor(i * validation_fraction)` (every
tenth block for 0.1), to train otherwise; each split is its blocks in order. So
validation text is text the model has not trained on, drawn from the whole
corpus rather than from its last files (in sorted order those would be a few
modules only).
"""
from __future__ import annotations

import codecs
import dataclasses
import hashlib
import os
import pathlib
import platform
import sysconfig

import numpy as np

from fp8jax.core.validation import check_int

#: Token ids are bytes: 256 of them.
VOCAB_SIZE = 256
SEPARATOR_TEMPLATE = "\n# ---- {path} ----\n"
EXCLUDED_DIRECTORIES = ("site-packages", "test", "tests", "idlelib", "lib2to3", "turtledemo",
                        "encodings")
MAX_SPLIT_BLOCK = 32 * 2**10
BUILD_CONFIG_FILE_PREFIX = "_sysconfigdata"
BUILD_CONFIG_DIRECTORY_PREFIX = "config-"
MIN_STDLIB_BYTES = 2**20
TEXT_CHECK_BYTES = 64 * 2**10
DEFAULT_MIN_FILE_BYTES = 4096

_SELECTION_RULE = (
    "every *.py regular file under the stdlib directory (symbolic links not followed), except "
    "files inside a directory named site-packages, test, tests, idlelib, lib2to3, turtledemo or "
    "encodings, "
    "files named _sysconfigdata*.py and files inside a directory named config-*")
_ORDER = "sorted by relative POSIX path (string order); each file preceded by a separator line"
_DATA_HINT = "pass a text file with --data PATH (text_file_corpus) instead"


class CorpusError(ValueError):
  """A corpus that cannot be used.

  The message is one line: the path (or the tokens' length), what is wrong and the fix.
  """


@dataclasses.dataclass(frozen=True)
class Corpus:
  """Byte tokens for training and validation, and where they came from.

  Attributes:
    train: uint8 [n_train], the training blocks of the bytes used, in order.
    validation: uint8 [n_validation], the validation blocks (every tenth one for a
      validation fraction of 0.1; see `split_blocks`), in order.
    description: JSON-serializable dict: `source` ("python-stdlib" or "file"), the
      directory or path, `python_version` (stdlib), `num_files`, `bytes_used`,
      `order`, `split` and `sha256` (hex digest of the bytes used, in their original
      order), so two runs can tell whether they trained on the same text.
  """

  train: np.ndarray
  validation: np.ndarray
  description: dict


def stdlib_corpus(max_bytes: int = 4 * 2**20, validation_fraction: float = 0.1) -> Corpus:
  """The first `max_bytes` of the standard library's own source (see the module docstring).

  Args:
    max_bytes: how many bytes to keep (>= 2); fewer when the selection is smaller.
    validation_fraction: the share of those bytes kept for validation, in (0, 1).

  Returns:
    A `Corpus` with `description["source"] == "python-stdlib"`.

  Raises:
    CorpusError: the stdlib directory cannot be read, or its selected files hold
      less than `MIN_STDLIB_BYTES` (1 MiB) in total.
  """
  check_int("max_bytes", max_bytes, minimum=2)
  _check_fraction(validation_fraction)
  directory = _stdlib_directory()
  try:
    relative_paths = _selected_python_files(directory)
  except OSError as error:
    raise CorpusError(f"The Python standard library at {str(directory)!r} cannot be read "
                      f"({error}); {_DATA_HINT}.") from error

  pieces, collected, num_files = [], 0, 0
  for relative in relative_paths:
    if collected >= max_bytes:
      break
    try:
      content = (directory / relative).read_bytes()
    except OSError as error:
      raise CorpusError(f"The standard library file {str(directory / relative)!r} cannot be "
                        f"read ({error}); {_DATA_HINT}.") from error
    piece = SEPARATOR_TEMPLATE.format(path=relative).encode("utf-8") + content
    pieces.append(piece)
    collected += len(piece)
    num_files += 1
  data = b"".join(pieces)[:max_bytes]

  if len(data) < max_bytes and len(data) < MIN_STDLIB_BYTES:
    # The whole selection was read and it is too small to train on.
    raise CorpusError(
        f"The Python standard library at {str(directory)!r} has only {len(data)} bytes of "
        f"selected .py source ({len(relative_paths)} files), fewer than {MIN_STDLIB_BYTES}; "
        f"{_DATA_HINT}.")
  description = {
      "source": "python-stdlib",
      "directory": str(directory),
      "python_version": platform.python_version(),
      "python_implementation": platform.python_implementation(),
      "selection": _SELECTION_RULE,
      "num_files_selected": len(relative_paths),
      "num_files": num_files,
      "first_file": relative_paths[0] if relative_paths else None,
      "last_file": relative_paths[num_files - 1] if num_files else None,
      "last_file_truncated": collected > len(data),
      "order": _ORDER,
      "separator": SEPARATOR_TEMPLATE,
      "max_bytes": max_bytes,
  }
  return _split(data, validation_fraction, description)


def text_file_corpus(path: str | os.PathLike, max_bytes: int | None = None,
                     validation_fraction: float = 0.1,
                     min_bytes: int = DEFAULT_MIN_FILE_BYTES) -> Corpus:
  """The bytes of one text file, optionally only its first `max_bytes`.

  Text means: its first `TEXT_CHECK_BYTES` (64 KiB) contain no NUL byte and decode
  as UTF-8 (a multi-byte character cut at the 64 KiB boundary is allowed). Later
  bytes are not checked: the model reads bytes, so they need not be valid text.

  Args:
    path: the file.
    max_bytes: keep only the first `max_bytes` bytes (>= `min_bytes`); None keeps all.
    validation_fraction: the share of the bytes kept for validation, in (0, 1).
    min_bytes: the fewest bytes accepted (>= 2). The default, 4096, leaves both
      splits room for a window of a few hundred tokens; a caller that knows its
      window and batch size can pass what they need.

  Returns:
    A `Corpus` with `description["source"] == "file"`.

  Raises:
    CorpusError: `path` is missing, a directory, empty, not text, or shorter than
      `min_bytes`.
  """
  check_int("min_bytes", min_bytes, minimum=2)
  if max_bytes is not None:
    check_int("max_bytes", max_bytes, minimum=min_bytes)
  _check_fraction(validation_fraction)
  path = pathlib.Path(path)
  shown = repr(str(path))
  if not path.exists():
    raise CorpusError(f"path={shown} does not exist; pass the path of an existing text file.")
  if path.is_dir():
    raise CorpusError(f"path={shown} is a directory; pass one text file inside it "
                      "(e.g. several files concatenated with cat).")
  try:
    with path.open("rb") as file:
      data = file.read() if max_bytes is None else file.read(max_bytes)
      file_bytes = os.fstat(file.fileno()).st_size
  except OSError as error:
    raise CorpusError(f"path={shown} cannot be read ({error}); check its permissions "
                      "or pass another text file.") from error
  if not data:
    raise CorpusError(f"path={shown} is empty; pass a text file with at least "
                      f"{min_bytes} bytes.")
  problem = _not_text(data[:TEXT_CHECK_BYTES])
  if problem:
    raise CorpusError(f"path={shown} is not a text file ({problem} in its first "
                      f"{TEXT_CHECK_BYTES} bytes); pass a UTF-8 text file.")
  if len(data) < min_bytes:
    raise CorpusError(f"path={shown} has {len(data)} bytes, fewer than the minimum "
                      f"{min_bytes}; pass a longer text file.")
  description = {
      "source": "file",
      "path": str(path.resolve()),
      "num_files": 1,
      "file_bytes": file_bytes,
      "max_bytes": max_bytes,
      "truncated": len(data) < file_bytes,
      "order": "the file's bytes from its start",
  }
  return _split(data, validation_fraction, description)


def train_batch(corpus_tokens: np.ndarray, step: int, batch_size: int, seq_len: int,
                seed: int) -> np.ndarray:
  """Training windows for one step: a pure function of (corpus, seed, step).

  Row b is `corpus_tokens[s_b : s_b + seq_len + 1]`, with the starts s_b drawn
  uniformly from the `n - seq_len` valid starts by `np.random.default_rng([seed, step])`.
  No state is kept, so a run resumed at step k sees exactly the batches an
  uninterrupted run sees (for a given numpy version).

  Args:
    corpus_tokens: 1-D integer array [n] of tokens (uint8 bytes), n >= seq_len + 1.
    step: the training step (>= 0).
    batch_size: windows per batch (>= 1).
    seq_len: tokens the model reads per window (>= 1).
    seed: the data seed (>= 0).

  Returns:
    int32 [batch_size, seq_len + 1]: inputs are `[:, :-1]`, targets `[:, 1:]`.
  """
  check_int("step", step, minimum=0)
  check_int("batch_size", batch_size, minimum=1)
  check_int("seq_len", seq_len, minimum=1)
  check_int("seed", seed, minimum=0)
  tokens = _check_tokens(corpus_tokens, "corpus_tokens", seq_len, windows=1)
  rng = np.random.default_rng([seed, step])
  starts = rng.integers(0, tokens.shape[0] - seq_len, size=batch_size)
  return _gather(tokens, starts, seq_len)


def validation_batches(corpus_tokens: np.ndarray, batch_size: int, seq_len: int,
                       max_batches: int) -> list[np.ndarray]:
  """Fixed validation windows: the same on every call.

  With w = seq_len + 1 and n tokens, there is room for n // w non-overlapping
  windows. The number used, m, is the largest multiple of `batch_size` that fits
  and is at most `max_batches * batch_size`; window i starts at i * (n // m), so
  the windows are evenly spaced from the first token and never overlap.

  Args:
    corpus_tokens: 1-D integer array [n] of tokens (uint8 bytes), with room for at
      least `batch_size` windows: n >= batch_size * (seq_len + 1).
    batch_size: windows per batch (>= 1).
    seq_len: tokens the model reads per window (>= 1).
    max_batches: the most batches returned (>= 1).

  Returns:
    A list of m // batch_size (1 to `max_batches`) int32 [batch_size, seq_len + 1]
    arrays, in order of position.
  """
  check_int("batch_size", batch_size, minimum=1)
  check_int("seq_len", seq_len, minimum=1)
  check_int("max_batches", max_batches, minimum=1)
  tokens = _check_tokens(corpus_tokens, "corpus_tokens", seq_len, windows=batch_size)
  n, window = tokens.shape[0], seq_len + 1
  num_batches = min(max_batches, n // window // batch_size)
  num_windows = num_batches * batch_size
  starts = np.arange(num_windows) * (n // num_windows)
  windows = _gather(tokens, starts, seq_len)
  return [windows[i * batch_size:(i + 1) * batch_size] for i in range(num_batches)]


def _stdlib_directory() -> pathlib.Path:
  return pathlib.Path(sysconfig.get_paths()["stdlib"])


def _selected_python_files(directory: pathlib.Path) -> list[str]:
  """Relative POSIX paths of the selected .py files under `directory`, sorted."""
  if not directory.is_dir():
    raise FileNotFoundError(f"{str(directory)!r} is not a directory")
  selected = []

  def raise_error(error: OSError):
    raise error

  for root, dirs, files in os.walk(directory, onerror=raise_error):
    # Pruning `dirs` in place keeps os.walk out of excluded trees (site-packages is
    # often larger than the whole standard library).
    dirs[:] = [name for name in dirs if name not in EXCLUDED_DIRECTORIES
               and not name.startswith(BUILD_CONFIG_DIRECTORY_PREFIX)]
    relative_root = pathlib.Path(root).relative_to(directory)
    for name in files:
      if (name.endswith(".py") and not name.startswith(BUILD_CONFIG_FILE_PREFIX)
          and os.path.isfile(os.path.join(root, name))
          and not os.path.islink(os.path.join(root, name))):
        selected.append((relative_root / name).as_posix())
  return sorted(selected)


def _not_text(head: bytes) -> str | None:
  """Why `head` is not UTF-8 text, or None when it is."""
  if b"\0" in head:
    return "it contains NUL bytes"
  try:
    # final=False: a character cut by the 64 KiB boundary is not an error.
    codecs.getincrementaldecoder("utf-8")().decode(head, final=False)
  except UnicodeDecodeError as error:
    return f"invalid UTF-8 at byte {error.start}"
  return None


def _check_fraction(validation_fraction: float) -> None:
  if (isinstance(validation_fraction, bool) or not isinstance(validation_fraction, (int, float))
      or not 0 < validation_fraction < 1):
    raise ValueError(f"validation_fraction={validation_fraction!r} must be a number strictly "
                     "between 0 and 1, e.g. 0.1.")


def split_blocks(n: int, validation_fraction: float) -> list[tuple[int, int, bool]]:
  """[(start, end, is_validation)] of the blocks that `n` bytes are split into (see the
  module docstring)."""
  size = min(MAX_SPLIT_BLOCK, max(1, n // 20))
  blocks = []
  for i, start in enumerate(range(0, n, size)):
    is_validation = int((i + 1) * validation_fraction) > int(i * validation_fraction)
    blocks.append((start, min(start + size, n), is_validation))
  return blocks


def _split(data: bytes, validation_fraction: float, description: dict) -> Corpus:
  tokens = np.frombuffer(data, dtype=np.uint8)
  blocks = split_blocks(len(data), validation_fraction)
  # Copies: frombuffer views are read-only and would pin `data`.
  parts = {True: [], False: []}
  for start, end, is_validation in blocks:
    parts[is_validation].append(tokens[start:end])
  if not parts[True] or not parts[False]:
    raise ValueError(f"validation_fraction={validation_fraction!r} leaves an empty split of "
                     f"{len(data)} bytes; use a fraction nearer 0.5 or more bytes.")
  train, validation = np.concatenate(parts[False]), np.concatenate(parts[True])
  description = {
      **description,
      "bytes_used": len(data),
      "split": {"validation_fraction": validation_fraction, "train_bytes": int(train.size),
                "validation_bytes": int(validation.size), "block_bytes": blocks[0][1],
                "rule": "block i of split_blocks is validation when floor((i + 1) * f) > "
                        "floor(i * f), train otherwise"},
      "sha256": hashlib.sha256(data).hexdigest(),
  }
  return Corpus(train=train, validation=validation, description=description)


def _check_tokens(corpus_tokens, argname: str, seq_len: int, windows: int) -> np.ndarray:
  tokens = np.asarray(corpus_tokens)
  if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
    raise ValueError(f"{argname} has shape {tokens.shape} and dtype {tokens.dtype}; pass a 1-D "
                     "integer array of tokens, e.g. Corpus.train (uint8).")
  needed = windows * (seq_len + 1)
  if tokens.shape[0] < needed:
    raise CorpusError(
        f"{argname} has {tokens.shape[0]} tokens, fewer than the {needed} needed for "
        f"{windows} window(s) of seq_len + 1 = {seq_len + 1}; use a shorter seq_len, a smaller "
        "batch_size or a longer text.")
  return tokens


def _gather(tokens: np.ndarray, starts: np.ndarray, seq_len: int) -> np.ndarray:
  """int32 [len(starts), seq_len + 1]: row i is tokens[starts[i] : starts[i] + seq_len + 1]."""
  return tokens[starts[:, None] + np.arange(seq_len + 1)].astype(np.int32)
