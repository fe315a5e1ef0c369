"""fp8jax.data: the demo's byte corpus and its batches.

References are independent of the code under test: the stdlib files are listed
and read again here with pathlib, and batch rows are located in the corpus by
plain slicing.
"""
import hashlib
import json
import pathlib
import re
import sysconfig

import numpy as np
import pytest

from fp8jax.data import (VOCAB_SIZE, Corpus, CorpusError, stdlib_corpus, text_file_corpus,
                         train_batch, validation_batches)
from fp8jax.data import corpus as corpus_module
from fp8jax.data.corpus import split_blocks

# Small enough to keep the test fast, large enough to span many files.
SMALL = 300_000
SEPARATOR = re.compile(rb"\n# ---- (.+?) ----\n")


@pytest.fixture(scope="module")
def small_stdlib() -> Corpus:
  return stdlib_corpus(max_bytes=SMALL, validation_fraction=0.1)


def _expected_stdlib_paths() -> list[str]:
  # An independent listing (rglob + path parts) of the documented rule.
  root = pathlib.Path(sysconfig.get_paths()["stdlib"])
  excluded = {"site-packages", "test", "tests", "idlelib", "lib2to3", "turtledemo",
              "encodings"}
  paths = []
  for path in root.rglob("*.py"):
    parts = path.relative_to(root).parts
    if (excluded.isdisjoint(parts[:-1]) and not any(p.startswith("config-") for p in parts[:-1])
        and not parts[-1].startswith("_sysconfigdata") and path.is_file()
        and not path.is_symlink()):
      paths.append(path.relative_to(root).as_posix())
  return sorted(paths)


def _reassemble(corpus, n, fraction):
  """The text back from the two splits, block by block (the documented split rule)."""
  taken = {True: 0, False: 0}
  pieces = []
  for start, end, is_validation in split_blocks(n, fraction):
    source = corpus.validation if is_validation else corpus.train
    pieces.append(source[taken[is_validation]:taken[is_validation] + end - start])
    taken[is_validation] += end - start
  assert taken[True] == corpus.validation.size and taken[False] == corpus.train.size
  return np.concatenate(pieces)


def test_stdlib_corpus_is_deterministic(small_stdlib):
  again = stdlib_corpus(max_bytes=SMALL, validation_fraction=0.1)
  np.testing.assert_array_equal(again.train, small_stdlib.train)
  np.testing.assert_array_equal(again.validation, small_stdlib.validation)
  assert again.description == small_stdlib.description


def test_stdlib_corpus_keeps_exactly_max_bytes_split_as_documented(small_stdlib):
  train, validation = small_stdlib.train, small_stdlib.validation
  assert train.dtype == validation.dtype == np.uint8
  assert train.ndim == validation.ndim == 1
  assert train.size + validation.size == SMALL
  blocks = split_blocks(SMALL, 0.1)
  assert validation.size == sum(end - start for start, end, val in blocks if val)
  # Validation is drawn from the whole corpus: roughly every tenth block.
  assert 0.08 * SMALL <= validation.size <= 0.12 * SMALL
  assert _reassemble(small_stdlib, SMALL, 0.1).size == SMALL
  split = small_stdlib.description["split"]
  assert (split["train_bytes"], split["validation_bytes"]) == (train.size, validation.size)
  assert small_stdlib.description["bytes_used"] == SMALL


def test_stdlib_corpus_is_the_sorted_selected_files_with_separators(small_stdlib):
  root = pathlib.Path(sysconfig.get_paths()["stdlib"])
  expected_paths = _expected_stdlib_paths()
  # Rebuild the text from the files themselves: separator + bytes, in sorted order.
  expected = b""
  for relative in expected_paths:
    if len(expected) >= SMALL:
      break
    expected += f"\n# ---- {relative} ----\n".encode() + (root / relative).read_bytes()
  data = bytes(_reassemble(small_stdlib, SMALL, 0.1))
  assert data == expected[:SMALL]
  named = [m.decode() for m in SEPARATOR.findall(data)]
  assert named[0] == expected_paths[0] == small_stdlib.description["first_file"]
  assert named == sorted(named) == expected_paths[:len(named)]
  assert small_stdlib.description["num_files_selected"] == len(expected_paths)


def test_stdlib_full_selection_names_no_excluded_directory():
  corpus = stdlib_corpus(max_bytes=2**40)  # the whole selection
  total = corpus.train.size + corpus.validation.size
  data = bytes(_reassemble(corpus, total, 0.1))
  named = [m.decode() for m in SEPARATOR.findall(data)]
  assert named == _expected_stdlib_paths()
  assert corpus.description["num_files"] == len(named)
  for path in named:
    directories = path.split("/")[:-1]
    assert not {"site-packages", "test", "tests", "idlelib", "lib2to3",
                "turtledemo", "encodings"} & set(directories), path


def test_stdlib_description_is_json_and_hashes_the_bytes_used(small_stdlib):
  description = json.loads(json.dumps(small_stdlib.description))
  assert description == small_stdlib.description
  data = bytes(_reassemble(small_stdlib, SMALL, 0.1))
  assert description["sha256"] == hashlib.sha256(data).hexdigest()
  assert description["source"] == "python-stdlib"
  assert description["python_version"].count(".") == 2


def test_stdlib_corpus_too_small_raises_and_suggests_data(tmp_path, monkeypatch):
  (tmp_path / "a.py").write_text("x = 1\n")
  monkeypatch.setattr(corpus_module, "_stdlib_directory", lambda: tmp_path)
  with pytest.raises(CorpusError, match=r"--data PATH") as error:
    stdlib_corpus()
  assert str(tmp_path) in str(error.value)


def test_stdlib_corpus_unreadable_directory_raises_and_suggests_data(tmp_path, monkeypatch):
  missing = tmp_path / "no-such-stdlib"
  monkeypatch.setattr(corpus_module, "_stdlib_directory", lambda: missing)
  with pytest.raises(CorpusError, match=r"--data PATH") as error:
    stdlib_corpus()
  assert str(missing) in str(error.value)


def test_text_file_corpus_round_trips_the_file(tmp_path):
  text = "".join(f"line {i}: héllo wörld\n" for i in range(400)).encode()
  path = tmp_path / "notes.txt"
  path.write_bytes(text)
  corpus = text_file_corpus(path, validation_fraction=0.25)
  assert bytes(_reassemble(corpus, len(text), 0.25)) == text
  assert 0.2 * len(text) <= corpus.validation.size <= 0.3 * len(text)
  assert corpus.description["source"] == "file"
  assert corpus.description["path"] == str(path.resolve())
  json.dumps(corpus.description)

  truncated = text_file_corpus(path, max_bytes=5000)
  assert bytes(_reassemble(truncated, 5000, 0.1)) == text[:5000]
  assert truncated.description["truncated"] is True


@pytest.mark.parametrize("case, content, pattern", [
    ("missing", None, "does not exist"),
    ("directory", None, "is a directory"),
    ("empty", b"", "is empty"),
    ("nul_bytes", b"abc\0def" * 1000, "NUL"),
    ("not_utf8", b"abc\xff\xfe" * 1000, "UTF-8"),
    ("too_short", b"short text\n", "fewer than the minimum 4096"),
])
def test_text_file_corpus_bad_file_raises_corpus_error_naming_path(tmp_path, case, content,
                                                                   pattern):
  path = tmp_path / f"{case}.txt"
  if case == "directory":
    path.mkdir()
  elif content is not None:
    path.write_bytes(content)
  with pytest.raises(CorpusError, match=pattern) as error:
    text_file_corpus(path)
  message = str(error.value)
  assert str(path) in message
  assert "\n" not in message


def test_text_file_utf8_character_cut_at_check_boundary_is_text(tmp_path):
  # 'é' is two bytes; put its first byte as the last byte of the checked prefix.
  head = b"a" * (corpus_module.TEXT_CHECK_BYTES - 1)
  path = tmp_path / "cut.txt"
  path.write_bytes(head + "é".encode() + b"b" * 100)
  corpus = text_file_corpus(path)
  assert corpus.description["bytes_used"] == len(head) + 2 + 100


def _unique_windows_corpus(n: int = 5000) -> np.ndarray:
  # uint8 bytes with no window that repeats within 251 tokens: a shuffled or
  # spliced row cannot be found in the corpus by _find_start.
  return (np.arange(n) % 251).astype(np.uint8)


def _find_start(tokens: np.ndarray, row: np.ndarray) -> int | None:
  for start in range(tokens.size - row.size + 1):
    if np.array_equal(tokens[start:start + row.size], row):
      return start
  return None


def test_train_batch_is_a_pure_function_of_seed_and_step():
  tokens = np.random.default_rng(0).integers(0, VOCAB_SIZE, 10_000).astype(np.uint8)
  first = train_batch(tokens, step=7, batch_size=4, seq_len=32, seed=3)
  # Other calls in between must not change the result (no hidden state).
  train_batch(tokens, step=8, batch_size=4, seq_len=32, seed=3)
  np.testing.assert_array_equal(train_batch(tokens, 7, 4, 32, 3), first)
  assert not np.array_equal(train_batch(tokens, 8, 4, 32, 3), first)
  assert not np.array_equal(train_batch(tokens, 7, 4, 32, 4), first)


def test_train_batch_resumed_run_sees_the_uninterrupted_batches():
  tokens = np.random.default_rng(1).integers(0, VOCAB_SIZE, 4_000).astype(np.uint8)
  uninterrupted = [train_batch(tokens, step, 2, 16, seed=0) for step in range(10)]
  resumed = [train_batch(tokens, step, 2, 16, seed=0) for step in range(5, 10)]
  for a, b in zip(uninterrupted[5:], resumed):
    np.testing.assert_array_equal(a, b)


def test_train_batch_rows_are_contiguous_slices_of_the_corpus():
  tokens = _unique_windows_corpus()
  seq_len = 40
  batch = train_batch(tokens, step=2, batch_size=16, seq_len=seq_len, seed=0)
  assert batch.shape == (16, seq_len + 1) and batch.dtype == np.int32
  for row in batch:
    start = _find_start(tokens, row)
    assert start is not None and 0 <= start <= tokens.size - (seq_len + 1)


def test_train_batch_reaches_both_ends_of_a_short_corpus():
  # With 3 valid starts and 200 windows, each start (the last one included) appears.
  tokens = _unique_windows_corpus(n=12)
  batch = train_batch(tokens, step=0, batch_size=200, seq_len=9, seed=0)
  assert set(batch[:, 0].tolist()) == {0, 1, 2}


@pytest.mark.parametrize("kwargs, error, pattern", [
    (dict(step=-1), ValueError, "step=-1"),
    (dict(batch_size=0), ValueError, "batch_size=0"),
    (dict(seq_len=0), ValueError, "seq_len=0"),
    (dict(seed=-1), ValueError, "seed=-1"),
    (dict(step=1.0), ValueError, "step=1.0"),
    (dict(seq_len=100), CorpusError, "100 tokens, fewer than the 101"),
])
def test_train_batch_bad_arguments_raise_naming_them(kwargs, error, pattern):
  tokens = _unique_windows_corpus(n=100)
  arguments = dict(step=0, batch_size=2, seq_len=8, seed=0) | kwargs
  with pytest.raises(error, match=pattern):
    train_batch(tokens, **arguments)


def test_train_batch_rejects_a_2d_corpus():
  with pytest.raises(ValueError, match="1-D integer array"):
    train_batch(np.zeros((10, 10), np.uint8), 0, 1, 4, 0)


def test_validation_batches_are_fixed_evenly_spaced_non_overlapping_slices():
  tokens = np.arange(3000, dtype=np.int32)  # every value unique: a row's start is its value
  batches = validation_batches(tokens, batch_size=4, seq_len=19, max_batches=3)
  assert len(batches) == 3
  assert all(b.shape == (4, 20) and b.dtype == np.int32 for b in batches)
  again = validation_batches(tokens, batch_size=4, seq_len=19, max_batches=3)
  for a, b in zip(batches, again):
    np.testing.assert_array_equal(a, b)
  rows = np.concatenate(batches)
  np.testing.assert_array_equal(rows, rows[:, :1] + np.arange(20))  # contiguous
  starts = rows[:, 0].tolist()
  # 12 windows over 3000 tokens: the documented stride 3000 // 12 = 250, from 0.
  assert starts == [250 * i for i in range(12)]


def test_validation_batches_are_limited_by_the_tokens_available():
  tokens = np.arange(205, dtype=np.int32)
  # Room for 205 // 20 = 10 windows: two full batches of 4, not max_batches=5.
  batches = validation_batches(tokens, batch_size=4, seq_len=19, max_batches=5)
  assert len(batches) == 2
  rows = np.concatenate(batches)
  np.testing.assert_array_equal(rows, rows[:, :1] + np.arange(20))
  starts = rows[:, 0].tolist()
  assert starts == [25 * i for i in range(8)]
  assert starts[-1] + 20 <= tokens.size
  with pytest.raises(CorpusError, match="205 tokens"):
    validation_batches(tokens, batch_size=11, seq_len=19, max_batches=1)
