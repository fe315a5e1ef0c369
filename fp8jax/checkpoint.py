"""Checkpoints of a training state: params, optimizer state and FP8 state, bit for bit.

    fp8jax.checkpoint.save(path, params=params, opt_state=opt_state, fp8_state=fp8_state)
    restored = fp8jax.checkpoint.restore(path, params=params, opt_state=opt_state,
                                         fp8_state=fp8_state)   # targets: structure + dtypes
    params, opt_state, fp8_state = (restored[k] for k in ("params", "opt_state", "fp8_state"))

Arrays are written with orbax (`orbax-checkpoint`, the `checkpoint` extra), next
to a JSON description: the shape and dtype of every array, and each FP8 meta's
recipe and format. `restore` compares the target with that description before
reading any array, so a target with another structure, dtype, history length or
recipe fails with an error that names the path and what differs; nothing is
converted silently. To move FP8 state to another recipe, restore it with the
recipes it was saved with (`keep_saved_recipes=True`) and convert it explicitly
with `fp8jax.resize_history`.

Integrity: version 3 records a CRC-32 of every saved array (params, optimizer
state and FP8 state) in the description, and a CRC-32 of the description
itself. `restore` recomputes them from what it read and returns nothing unless
all match. Any damage it finds (a file missing, cut short or overwritten, a
description or orbax record that does not parse, a value that does not match
its checksum) raises `CheckpointCorrupted` (a `ValueError`) naming the
directory, the item and, where known, the array; the error that orbax, json or
TensorStore raised is chained to it. A checksum covers an array's dtype, shape
and bytes in C order, independent of how the array was sharded: an array that
this process cannot address in full is gathered from all processes first, one
array at a time, so `save` and `restore` must run on every process, as orbax
requires anyway. Both `save` and `restore` read every array to the host once to
checksum it. CRC-32 is enough here because the threat is damage, not an
adversary: it detects every burst of up to 32 flipped bits and misses other
damage to an array with a probability of about 2**-32; it runs at several GB/s.
Damage to a file that orbax does not read (e.g. the text of a commit marker)
changes nothing that is restored, and is not reported.

A recipe that rounds gradients stochastically (`NVFP4Scaling`) keeps a PRNG key in
each gradient role (`Fp8Meta.rng`, uint32): saved and checksummed like every array, so
a restored run draws the numbers the uninterrupted one would have.

Versions: version 3 adds the checksums. Version 2 stores the four-field
`Fp8Meta` (scale, scale_inv, amax_history, amax). Version 1 (fp8jax 0.1.0)
stored scale and amax_history only; `restore` reads it into today's layout,
with `scale_inv = 1 / scale` and a running amax of 0: exactly the state
`end_step` would have returned, so training continues with the same scales.
Versions 1 and 2 have no checksums: `restore` checks their structure, shapes,
dtypes and recipes against their description and reports the files that
orbax finds missing, cut short or corrupt, but cannot check their values; it
warns once per checkpoint (`UnverifiedCheckpointWarning`). Save such a
checkpoint again to get one that is verified.

Completeness: each save writes into a directory of its own next to `<path>`,
`<path>.fp8jax-save-tmp-<token>` (through orbax, which writes into
`<that>.orbax-checkpoint-tmp`, adds a `commit_success.txt` marker and renames
it), and only then renames it to `<path>`. A process killed while saving leaves
one of these temporary directories and no `<path>`;
`restore` refuses temporary directories and directories without the marker or
a part. `restore` returns new trees and never modifies its targets, so a failed
restore leaves nothing half-loaded.

Concurrent saves: saves to one `<path>` at the same time (threads or processes)
each write their own temporary directory (threads of one process one after the
other: orbax's save is not thread-safe); the rename is the claim, and renaming
a directory onto one that exists fails, so exactly one save wins. The others
delete what they wrote and raise `CheckpointExists`; the winner's checkpoint is
complete and restores bit for bit. With `overwrite=True` the last save to
finish wins: the checkpoint it replaces is first renamed to
`<path>.fp8jax-replaced-<token>` and deleted once the new one is in place (a
process killed between the two renames leaves that complete checkpoint there,
and `restore(<path>)` names it).

Restoring a checkpoint of a recipe of your own imports the module the
checkpoint names (`module:Class`): restore only checkpoints you trust.
"""
from __future__ import annotations

import atexit
import dataclasses
import errno
import gc
import json
import logging
import os
import pathlib
import re
import shutil
import sys
import threading
import warnings
import zlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fp8jax.core import recipes as recipes_module
from fp8jax.core.recipes import import_recipe_class, recipe_kind
from fp8jax.core.formats import E4M3, E5M2
from fp8jax.core.meta import Fp8Meta, check_fp8_state, is_meta

FORMAT_NAME = "fp8jax.checkpoint"
#: The format version `save` writes (in each checkpoint's metadata).
FORMAT_VERSION = 3
#: The format versions `restore` reads; others are refused by name.
READABLE_VERSIONS = (1, 2, 3)
FIRST_CHECKSUMMED_VERSION = 3
TMP_MARKER = ".orbax-checkpoint-tmp"
# In the name of the directory one save writes before renaming it into place. Not
# TMP_MARKER: orbax takes the text before its first TMP_MARKER as the final name.
STAGING_MARKER = ".fp8jax-save-tmp"
# In the name a checkpoint replaced by an overwrite=True save has until it is deleted.
REPLACED_MARKER = ".fp8jax-replaced"
_UNFINISHED_MARKERS = (TMP_MARKER, STAGING_MARKER)
COMMIT_MARKER = "commit_success.txt"
ITEMS = ("params", "opt_state", "fp8_state")
_FORMATS = {fmt.name: fmt for fmt in (E4M3, E5M2)}
# The parts without which nothing can be read. Checked up front: without
# state/_METADATA (orbax's record of the tree) orbax misreads the tree's structure
# instead of reporting a missing file.
_REQUIRED_FILES = (COMMIT_MARKER, "state", "state/_METADATA", "description",
                   "description/metadata")
_DAMAGED = ("The checkpoint is damaged or incomplete: restore an earlier checkpoint (or copy "
            "this one again, if it is a copy).")


class CheckpointCorrupted(ValueError):
  """A checkpoint whose files are missing, cut short or damaged; nothing was restored."""


class CheckpointExists(FileExistsError):
  """A save to a directory that holds a checkpoint, or that another save took first.

  Nothing of this save is left on disk; the checkpoint already at the directory is
  intact.
  """


class UnverifiedCheckpointWarning(UserWarning):
  """A checkpoint written before checksums (version < 3): its values are not verified."""


def _orbax():
  try:
    import orbax.checkpoint as ocp  # optional (the 'checkpoint' extra): imported when used
  except ImportError as error:
    raise ImportError(
        "fp8jax.checkpoint needs orbax-checkpoint: pip install 'fp8jax[checkpoint]' "
        "(or pip install orbax-checkpoint).") from error
  return ocp


# Recipe options added after checkpoint version 3, with the value that leaves a
# recipe as it was: written only when set, so that the description of a recipe
# that does not use them is the one earlier fp8jax wrote (and older checkpoints
# still match their targets). `recipe_from_description` fills in the defaults.
_OPTIONAL_RECIPE_FIELDS = {"power_of_two": False, "high_precision": ()}
# The same, for options one built-in recipe class gained ("gemm" is an older field of
# BlockScaling's, always written there).
_OPTIONAL_FIELDS_OF_KIND = {"MXFP8Scaling": {"scale_rounding": "floor", "gemm": "emulated"}}


def describe_recipe(recipe) -> dict:
  """A JSON-able description of a recipe: its class and fields (tuples as lists).

  The class is named as fp8jax's recipes are ("DelayedScaling"), or, for a recipe
  defined elsewhere, by its importable name "module:QualifiedName".
  """
  kind = recipe_kind(type(recipe))
  built_in = ":" not in kind  # a recipe of your own keeps every field: its defaults may differ
  optional = {**_OPTIONAL_RECIPE_FIELDS, **_OPTIONAL_FIELDS_OF_KIND.get(kind, {})}
  fields = {}
  for name, value in dataclasses.asdict(recipe).items():
    if built_in and name in optional and value == optional[name]:
      continue
    fields[name] = list(value) if isinstance(value, tuple) else value
  return {"kind": kind, **fields}


def recipe_from_description(description: dict):
  """The recipe object a `describe_recipe` dictionary describes."""
  fields = {name: tuple(value) if isinstance(value, list) else value  # lists from JSON
            for name, value in description.items()}
  kind = str(fields.pop("kind", None))
  cls = import_recipe_class(kind) if ":" in kind else getattr(recipes_module, kind, None)
  if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
    raise ValueError(f"checkpoint names an unknown FP8 recipe kind {kind!r}.")
  return cls(**fields)


def _array_spec(leaf) -> str:
  return f"{np.dtype(leaf.dtype).name}{list(np.shape(leaf))}"


def _host_array(leaf) -> np.ndarray:
  """The whole of an array on this host, gathered from all processes if it must be."""
  if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
    # A collective: every process calls it, for the same leaves in the same order.
    from jax.experimental import multihost_utils
    return np.asarray(multihost_utils.process_allgather(leaf, tiled=True))
  return np.asarray(leaf)


def _array_checksum(leaf) -> str:
  """CRC-32 (8 hex digits) of an array's dtype, shape and bytes in C order.

  The same for every sharding of the same values, and for bfloat16 and FP8
  dtypes alike: the bytes are read as uint8, never converted.
  """
  array = np.asarray(_host_array(leaf), order="C")  # (np.ascontiguousarray makes 0-d 1-d)
  header = zlib.crc32(_array_spec(array).encode())
  return f"{zlib.crc32(array.reshape(-1).view(np.uint8), header):08x}"


def _tree_checksums(tree: Any) -> dict:
  """`{keystr(path): _array_checksum(leaf)}` of every leaf of `tree`."""
  return {jax.tree_util.keystr(path): _array_checksum(leaf)
          for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}


def _description_checksum(description: dict) -> str:
  """CRC-32 of a description's canonical JSON, without its own "description_crc32"."""
  body = {key: value for key, value in description.items() if key != "description_crc32"}
  # Through JSON first, so that the description as saved and as read back (tuples
  # become lists, integer keys strings) give the same text.
  canonical = json.dumps(json.loads(json.dumps(body)), sort_keys=True)
  return f"{zlib.crc32(canonical.encode()):08x}"


def describe(params: Any, opt_state: Any, fp8_state: Any, metadata: dict | None = None) -> dict:
  """The JSON description `save` writes: array specs, checksums, FP8 recipes, metadata.

  Per item, each array's dtype and shape ("arrays") and CRC-32 ("crc32"); each FP8
  meta's recipe and format; the caller's metadata; and a CRC-32 of all of it
  ("description_crc32"). Reads every array (to checksum it), so the arrays must be
  concrete.
  """
  check_fp8_state(fp8_state, "fp8_state")
  trees = dict(zip(ITEMS, (params, opt_state, fp8_state)))
  arrays = {name: {jax.tree_util.keystr(path): _array_spec(leaf)
                   for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}
            for name, tree in trees.items()}
  metas = {}
  for path, meta in jax.tree_util.tree_leaves_with_path(fp8_state, is_leaf=is_meta):
    metas[jax.tree_util.keystr(path)] = {
        "recipe": describe_recipe(meta.recipe), "fmt": meta.fmt.name,
        "scale_shape": list(np.shape(meta.scale)),
        "history_shape": list(np.shape(meta.amax_history)),
        # A stochastic-rounding key, only where there is one (earlier descriptions match).
        **({"rng_shape": list(np.shape(meta.rng))} if meta.rng is not None else {})}
  description = {"format": FORMAT_NAME, "version": FORMAT_VERSION, "arrays": arrays,
                 "fp8_metas": metas, "metadata": dict(metadata or {}),
                 "crc32": {name: _tree_checksums(tree) for name, tree in trees.items()}}
  description["description_crc32"] = _description_checksum(description)
  return description


def save(directory: str | os.PathLike, *, params: Any, opt_state: Any, fp8_state: Any,
         overwrite: bool = False, metadata: dict | None = None) -> pathlib.Path:
  """Writes params, optimizer state and FP8 state to `directory`, atomically.

  The arrays are written to a temporary directory of this save's own, which is then
  renamed to `directory`: a reader sees the whole checkpoint or none, and of several
  saves to one directory at the same time exactly one wins (see `CheckpointExists`).

  Args:
    directory: the checkpoint directory to create (one per step, e.g. `ckpt/step_100`).
    params, opt_state, fp8_state: pytrees of arrays (sharded arrays too); use
      `{}` for an item you do not have.
    overwrite: replace an existing checkpoint at `directory` (it is replaced once
      the new one is complete; prefer a new directory per step).
    metadata: JSON-able facts saved with the arrays, atomically (e.g. the step and
      the data position of a training run); `read_description(...)["metadata"]`.

  Returns:
    The absolute path of the checkpoint.

  Raises:
    CheckpointExists (a `FileExistsError`): `directory` exists and `overwrite` is
      False, or another save wrote a checkpoint there while this one was writing.
      This save's files are deleted; the other checkpoint is kept.
  """
  ocp = _orbax()
  path = pathlib.Path(directory).absolute()
  if _is_unfinished_name(path.name):
    raise ValueError(f"directory={str(directory)!r}: names containing {TMP_MARKER!r} or "
                     f"{STAGING_MARKER!r} are reserved for unfinished saves; choose another "
                     "name.")
  _check_parent_is_a_directory(path, directory)
  if path.exists() and not overwrite:
    raise CheckpointExists(
        f"directory={str(directory)!r} already exists; pass overwrite=True to replace it "
        "or save each step to its own directory.")
  if metadata is not None:
    try:
      json.dumps(metadata)
    except (TypeError, ValueError) as error:
      raise TypeError(f"metadata must be JSON-serializable: {error}") from None
  description = describe(params, opt_state, fp8_state, metadata)
  tree = {"params": params, "opt_state": opt_state, "fp8_state": fp8_state}
  staged = _staging_path(path)
  try:
    with _ORBAX_SAVE_LOCK:
      checkpointer = ocp.Checkpointer(ocp.CompositeCheckpointHandler())
      checkpointer.save(staged, args=ocp.args.Composite(
          state=ocp.args.StandardSave(tree), description=ocp.args.JsonSave(description)))
    claimed = _claim_on_every_process(staged, path, overwrite)
  except BaseException:
    if jax.process_index() == 0:  # it alone renames and deletes in a multi-process save
      _remove_staged(staged)
    raise
  if not claimed:
    again = "" if overwrite else ", or save again with overwrite=True to replace it"
    raise CheckpointExists(
        f"directory={str(directory)!r}: another save wrote a checkpoint there while this "
        "one was writing; that checkpoint is kept and this save's files were deleted. "
        f"Let one writer save to each directory (e.g. a directory per step){again}.")
  return path


def _check_parent_is_a_directory(path: pathlib.Path, directory) -> None:
  """Raises NotADirectoryError naming the user's path when a file stands where a folder of
  it must be (the save would fail deep in orbax, naming its own staging path)."""
  for ancestor in path.parents:
    if ancestor.exists():
      if not ancestor.is_dir():
        raise NotADirectoryError(
            f"directory={str(directory)!r} cannot be created: {str(ancestor)!r} is a file, "
            "not a directory. Save under a directory (or remove that file).")
      return


# orbax's save keeps process-wide state (the id of the current save operation, which
# its background writers signal under): two saves at once in one process break each
# other's files even in different directories. So within a process saves write one at
# a time; across processes their own directories and the claiming rename suffice.
_ORBAX_SAVE_LOCK = threading.Lock()


def _staging_path(path: pathlib.Path) -> pathlib.Path:
  """`<path>.fp8jax-save-tmp-<token>`: where one save writes before its rename.

  The random token keeps concurrent saves to one `path` out of each other's files; in
  a multi-process save process 0 draws it and every process writes to the same place.
  """
  token = np.frombuffer(os.urandom(8), np.uint32)
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils  # a collective: every process calls save
    token = np.asarray(multihost_utils.broadcast_one_to_all(token))
  hex_token = token.astype(np.uint32).tobytes().hex()
  return path.with_name(f"{path.name}{STAGING_MARKER}-{hex_token}")


# rename(2) of a directory onto a non-empty one: Linux says ENOTEMPTY, POSIX allows EEXIST.
_TAKEN_ERRNOS = (errno.EEXIST, errno.ENOTEMPTY)


def _claim_on_every_process(staged: pathlib.Path, path: pathlib.Path, overwrite: bool) -> bool:
  """Renames the finished save to `path` (on process 0); whether this save won it.

  Every process learns the outcome from process 0, so that all of them return or
  raise alike, and none returns before the checkpoint is in place.
  """
  claimed = _claim(staged, path, overwrite) if jax.process_index() == 0 else False
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils
    claimed = bool(multihost_utils.broadcast_one_to_all(np.int32(claimed)))
  return claimed


def _claim(staged: pathlib.Path, path: pathlib.Path, overwrite: bool) -> bool:
  """Renames `staged` to `path`; False (and `staged` deleted) if another save holds `path`.

  With `overwrite`, the checkpoint at `path` is first renamed aside and deleted once
  `staged` took its place. Renaming a directory onto an existing non-empty one fails
  atomically, so of several saves racing here exactly one rename succeeds.
  """
  displaced = None
  if overwrite:
    token = staged.name.rsplit("-", 1)[-1]
    displaced = path.with_name(f"{path.name}{REPLACED_MARKER}-{token}")
    try:
      os.rename(path, displaced)
    except FileNotFoundError:  # nothing to replace (or another save moved it first)
      displaced = None
  try:
    os.rename(staged, path)
  except OSError as error:
    if error.errno not in _TAKEN_ERRNOS:
      if displaced is not None:
        os.rename(displaced, path)  # put the old checkpoint back before reporting
      raise
    _remove_staged(staged)
    claimed = False
  else:
    claimed = True
  if displaced is not None:
    shutil.rmtree(displaced, ignore_errors=True)
  return claimed


def _remove_staged(staged: pathlib.Path) -> None:
  """Deletes a save's temporary directory and the one orbax writes before renaming it."""
  for leftover in (staged, staged.with_name(staged.name + TMP_MARKER)):
    shutil.rmtree(leftover, ignore_errors=True)


def _is_unfinished_name(name: str) -> bool:
  """Whether `name` is that of a save's temporary directory (orbax's or fp8jax's)."""
  return any(marker in name for marker in _UNFINISHED_MARKERS)


def is_complete(directory: str | os.PathLike) -> bool:
  """Whether `directory` holds a finished fp8jax checkpoint (see `check_complete`)."""
  try:
    check_complete(directory)
  except (FileNotFoundError, ValueError):
    return False
  return True


def check_complete(directory: str | os.PathLike) -> pathlib.Path:
  """Raises unless `directory` is a checkpoint whose save finished; returns its path.

  Raises:
    FileNotFoundError: no such directory (the message names an unfinished save of
      that name, if one was left behind).
    CheckpointCorrupted: a temporary directory of an unfinished save, or a
      directory missing the commit marker or one of its parts.
  """
  path = pathlib.Path(directory).absolute()
  if _is_unfinished_name(path.name):
    raise CheckpointCorrupted(
        f"directory={str(directory)!r} is the temporary directory of a save that did not "
        "finish (its process was interrupted); it is incomplete and cannot be restored. "
        + _DAMAGED)
  if not path.is_dir():
    leftovers = sorted(p.name for marker in _UNFINISHED_MARKERS
                       for p in path.parent.glob(path.name + marker + "*"))
    hint = (f" Found {leftovers}: a save to it was interrupted before it finished, so no "
            "complete checkpoint of that name exists." if leftovers else "")
    replaced = sorted(p.name for p in path.parent.glob(path.name + REPLACED_MARKER + "*"))
    if replaced:
      hint += (f" Found {replaced}: the complete checkpoint an interrupted overwrite=True "
               "save was replacing; restore it from there, or rename it back.")
    raise FileNotFoundError(f"No checkpoint at directory={str(directory)!r}.{hint}")
  missing = [part for part in _REQUIRED_FILES if not (path / part).exists()]
  missing = [part for part in missing  # "state", not also "state/_METADATA"
             if os.path.dirname(part) not in missing]
  if missing:
    raise CheckpointCorrupted(
        f"directory={str(directory)!r} is not a complete fp8jax checkpoint: {missing} "
        "missing (a partial copy, or not written by fp8jax.checkpoint.save). " + _DAMAGED)
  return path


def read_description(directory: str | os.PathLike) -> dict:
  """The JSON description stored with a complete checkpoint, its own checksum verified.

  Raises:
    CheckpointCorrupted: the description is missing, does not parse, or does not
      match its checksum (version 3 on); or see `check_complete`.
    ValueError: not an fp8jax checkpoint, or a version this fp8jax cannot read.
  """
  path = check_complete(directory)
  ocp = _orbax()
  checkpointer = ocp.Checkpointer(ocp.CompositeCheckpointHandler())
  try:
    description = checkpointer.restore(
        path, args=ocp.args.Composite(description=ocp.args.JsonRestore()))["description"]
  except (OSError, ValueError) as error:  # json's and Unicode's errors are ValueErrors
    raise CheckpointCorrupted(
        f"Could not read the description (description/metadata) of checkpoint "
        f"{str(directory)!r}: {_error_text(error)}. {_DAMAGED}") from error
  if not isinstance(description, dict):
    raise ValueError(f"directory={str(directory)!r} is not an fp8jax checkpoint.")
  version = description.get("version")
  # Verified before any field is trusted, whenever present: a damaged version
  # number must not turn the check off.
  has_checksum = isinstance(version, int) and version >= FIRST_CHECKSUMMED_VERSION
  if (has_checksum or "description_crc32" in description) and (
      description.get("description_crc32") != _description_checksum(description)):
    raise CheckpointCorrupted(
        f"Could not read checkpoint {str(directory)!r} intact: its description "
        "(description/metadata) does not match the checksum saved in it. " + _DAMAGED)
  if description.get("format") != FORMAT_NAME:
    raise ValueError(f"directory={str(directory)!r} is not an fp8jax checkpoint.")
  if version not in READABLE_VERSIONS:
    raise ValueError(
        f"directory={str(directory)!r} has fp8jax checkpoint version {version}, this "
        f"fp8jax reads versions {READABLE_VERSIONS}.")
  return description


def restore(directory: str | os.PathLike, *, params: Any, opt_state: Any, fp8_state: Any,
            keep_saved_recipes: bool = False) -> dict:
  """Reads a checkpoint written by `save` into the structure of the targets.

  Args:
    directory: a complete checkpoint directory.
    params, opt_state, fp8_state: targets: trees of arrays or `jax.ShapeDtypeStruct`
      (e.g. from `model.init`, `tx.init`, `jax.eval_shape`); their shardings are used.
      Structure, shapes and dtypes must equal the saved ones.
    keep_saved_recipes: restore every FP8 meta with the recipe it was saved
      with, taking only the tree structure from `fp8_state`; convert it
      afterwards with `fp8jax.resize_history`. By default the target's recipes
      must equal the saved ones.

  Returns:
    `{"params": ..., "opt_state": ..., "fp8_state": ...}`, bit-identical to what was
    saved: every array matched its checksum (version 3 on; older versions warn
    once that their values cannot be verified).

  Raises:
    CheckpointCorrupted: files missing, cut short or damaged, or an array that
      does not match its checksum; the message names the directory, the item and
      the array where known. Nothing is returned.
    FileNotFoundError / ValueError: a missing checkpoint, or a target that does
      not match the checkpoint; the message names the path inside the tree and
      both sides. Other errors of orbax or jax (e.g. a target sharding that does
      not divide an array's shape) pass through unchanged.
  """
  ocp = _orbax()
  path = check_complete(directory)
  description = read_description(path)
  check_fp8_state(fp8_state, "fp8_state")
  if keep_saved_recipes:
    fp8_state = _with_saved_recipes(fp8_state, description["fp8_metas"])
  else:
    _check_recipes(fp8_state, description["fp8_metas"])
  legacy = description["version"] == 1
  if legacy:
    fp8_state = jax.tree.map(_to_version_1, fp8_state, is_leaf=is_meta)
  targets = {"params": params, "opt_state": opt_state, "fp8_state": fp8_state}
  for name in ITEMS:
    _check_arrays(name, targets[name], description["arrays"][name])
  abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, targets)
  restored = _read_arrays(ocp, path, abstract, directory)
  if description["version"] >= FIRST_CHECKSUMMED_VERSION:
    _verify_checksums(directory, restored, description.get("crc32", {}))
  else:
    # Once per checkpoint: Python shows a warning once per distinct message.
    warnings.warn(
        f"checkpoint {str(directory)!r} is fp8jax checkpoint version "
        f"{description['version']}, written before checksums (version "
        f"{FIRST_CHECKSUMMED_VERSION}): its structure, shapes and dtypes were checked, its "
        "values cannot be. Save it again to get a checkpoint whose values are verified.",
        UnverifiedCheckpointWarning, stacklevel=2)
  if legacy:
    restored["fp8_state"] = jax.tree.map(_from_version_1, restored["fp8_state"],
                                         is_leaf=lambda n: isinstance(n, _MetaV1))
  return {name: restored[name] for name in ITEMS}


def _read_arrays(ocp, path: pathlib.Path, abstract: dict, directory) -> dict:
  """orbax's restore of the arrays into `abstract`; damaged files raise CheckpointCorrupted."""
  checkpointer = ocp.Checkpointer(ocp.CompositeCheckpointHandler())
  # Installed before the read, not after a failure: a read that tensorstore finishes after
  # orbax closed its event loop can report "Event loop is closed" before the failure
  # reaches this function (under load).
  _reading_starts()
  abandoned = True   # unless it ends in full: a failed or interrupted read's others run on
  try:
    arrays = checkpointer.restore(
        path, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract)))["state"]
    abandoned = False
    return arrays
  except Exception as error:  # orbax wraps some of tensorstore's errors in plain Exceptions
    damage = _damage_in(error)
    if damage is None:
      abandoned = False
      raise  # e.g. a sharding that does not fit an array: its own message says what
    try:
      message = (f"Could not read the arrays of checkpoint {str(directory)!r} "
                 f"({_arrays_named_in(damage, abstract)}): its files are missing, cut "
                 f"short or corrupt: {_error_text(damage)}. {_DAMAGED}")
    finally:
      _close_abandoned_reads(error)
    raise CheckpointCorrupted(message) from error
  finally:
    _reading_ends(abandoned)


def _close_abandoned_reads(error: BaseException) -> None:
  """Ends the reads orbax left running when one array failed, without their echoes.

  orbax reads the arrays concurrently and stops at the first failure; the other reads
  stay suspended in coroutines that the failure's traceback keeps alive. When they are
  collected, each raises orbax's "Encountered error while reading array index" as an
  unraisable exception, and tensorstore's reads that finish later call into the closed
  event loop ("Event loop is closed", "Task exception was never retrieved"), up to
  interpreter exit: a thousand lines of tracebacks after fp8jax's one clear error. So
  the tracebacks of the chained errors are dropped (their messages stay), the
  coroutines are collected now, and from here on this process drops exactly those
  echoes of a failed read (the same hooks again at exit, should another library have
  replaced them; `_reading_ends`); every other unraisable exception and log record passes
  as before. The hooks are in place here: the read is still counted.
  """
  seen = set()
  while error is not None and id(error) not in seen:
    seen.add(id(error))
    error.__traceback__ = None
    error = error.__cause__ or error.__context__
  gc.collect()


def _unused_echo_silencer() -> dict:
  """The hook state of a process that has read no checkpoint: the hooks (with the hooks
  they replaced) and log filter that drop the echoes of a failed read, while installed;
  how many reads are running (in any thread); whether a failed read keeps the hooks to the
  process's exit."""
  return {"unraisablehook": None, "excepthook": None, "filter": None, "reading": 0,
          "kept_at_exit": False}


_echo_silencer = _unused_echo_silencer()
_echo_silencer_lock = threading.Lock()


def _reading_starts() -> None:
  """A read begins: the hooks are installed (if they are not) until the last read ends."""
  with _echo_silencer_lock:
    _echo_silencer["reading"] += 1
    _drop_echoes_of_failed_reads()


def _reading_ends(abandoned: bool) -> None:
  """A read ends. One that left reads running (`abandoned`: failed or interrupted) keeps
  the hooks to the exit; otherwise the last read to end puts back the hooks they replaced."""
  with _echo_silencer_lock:
    _echo_silencer["reading"] -= 1
    if abandoned:
      _drop_echoes_of_failed_reads()   # again: another thread's read may have removed them
      if not _echo_silencer["kept_at_exit"]:
        _echo_silencer["kept_at_exit"] = True
        atexit.register(_drop_echoes_of_failed_reads)
    elif _echo_silencer["reading"] == 0 and not _echo_silencer["kept_at_exit"]:
      _stop_dropping_echoes()


def _drop_echoes_of_failed_reads() -> None:
  """Installs the unraisable hook, exception hook and asyncio log filter that drop the
  echoes of an abandoned read (each once: a hook already there stays)."""
  _drop_echoes_in_hook("unraisablehook", lambda unraisable: unraisable.exc_value)
  # A read finishing in tensorstore's thread reports "Event loop is closed" through
  # sys.excepthook (PyErr_Print), not as unraisable: now and then, under load.
  _drop_echoes_in_hook("excepthook", lambda kind, value, traceback: value)
  if _echo_silencer["filter"] is None:
    _echo_silencer["filter"] = _EchoFilter()
    logging.getLogger("asyncio").addFilter(_echo_silencer["filter"])


def _stop_dropping_echoes() -> None:
  """Puts back the hooks `_drop_echoes_of_failed_reads` replaced, unless another library
  has replaced them since (putting back would drop that library's hook)."""
  for name in ("unraisablehook", "excepthook"):
    installed = _echo_silencer[name]
    if installed is not None and getattr(sys, name) is installed[0]:
      setattr(sys, name, installed[1])
      _echo_silencer[name] = None
  if _echo_silencer["filter"] is not None:
    logging.getLogger("asyncio").removeFilter(_echo_silencer["filter"])
    _echo_silencer["filter"] = None


def _drop_echoes_in_hook(name: str, exception_of) -> None:
  """Wraps `sys.<name>` (unless the wrapper is already there) to drop the echoes of a failed
  read and pass everything else to the hook it replaced; `exception_of(*hook_args)`."""
  previous = getattr(sys, name)
  if _echo_silencer[name] is not None and previous is _echo_silencer[name][0]:
    return

  def hook(*args):
    if not _is_echo_of_failed_read(exception_of(*args)):
      previous(*args)

  _echo_silencer[name] = (hook, previous)
  setattr(sys, name, hook)


def _is_echo_of_failed_read(exception: BaseException | None) -> bool:
  text = str(exception)
  return (text.startswith("Encountered error while reading array index")
          or (isinstance(exception, RuntimeError) and text == "Event loop is closed"))


class _EchoFilter(logging.Filter):
  """Drops asyncio's "exception was never retrieved" reports of the abandoned reads."""

  def filter(self, record: logging.LogRecord) -> bool:
    exc_info = record.exc_info or (None, None, None)
    return not ("was never retrieved" in record.getMessage()
                and (exc_info[1] is None or _is_echo_of_failed_read(exc_info[1])
                     or _damage_in(exc_info[1]) is not None))


def _verify_checksums(directory, restored: dict, saved: dict) -> None:
  """Raises CheckpointCorrupted unless every restored array has the checksum saved for it."""
  wrong = []
  for item in ITEMS:
    for key, checksum in _tree_checksums(restored[item]).items():
      want = saved.get(item, {}).get(key)
      if checksum != want:
        wrong.append(f"{item}{key} (crc32 {checksum}, saved {want})")
  if wrong:
    more = f" and {len(wrong) - 5} more" if len(wrong) > 5 else ""
    raise CheckpointCorrupted(
        f"Could not read checkpoint {str(directory)!r} intact: {len(wrong)} array(s) read back "
        f"other values than were saved: {', '.join(wrong[:5])}{more}. {_DAMAGED}")


@dataclasses.dataclass(frozen=True)
class _MetaV1:
  """The `Fp8Meta` of checkpoint version 1: its two array fields, same names."""

  scale: Any
  amax_history: Any
  recipe: Any
  fmt: Any


jax.tree_util.register_dataclass(
    _MetaV1, data_fields=["scale", "amax_history"], meta_fields=["recipe", "fmt"])


def _to_version_1(meta: Fp8Meta) -> _MetaV1:
  return _MetaV1(scale=meta.scale, amax_history=meta.amax_history, recipe=meta.recipe,
                 fmt=meta.fmt)


def _from_version_1(old: _MetaV1) -> Fp8Meta:
  scale = jnp.asarray(old.scale)
  # What end_step returns: the reciprocal it computes, and no step in progress.
  return Fp8Meta(scale=scale, scale_inv=1.0 / scale, amax_history=old.amax_history,
                 amax=jnp.zeros_like(scale), recipe=old.recipe, fmt=old.fmt)


# tensorstore raises every failure as a ValueError. Read directly, its message
# starts with the status code: a deleted array file reads as NOT_FOUND, a
# truncated one as OUT_OF_RANGE (a byte range past its end) or FAILED_PRECONDITION
# (a compressed stream cut short), a corrupted one or a corrupted OCDBT manifest
# as DATA_LOSS. Through a nested driver (e.g. a b-tree node that does not
# decompress) the code is dropped and only tensorstore's "[tensorstore_spec=...]"
# annotation marks it. Codes of passing trouble (UNAVAILABLE, RESOURCE_EXHAUSTED,
# ...) are not damage and are let through, as is a target that does not fit
# (shape, sharding): orbax or jax raise those with plain messages.
_DAMAGE_STATUS = ("NOT_FOUND", "OUT_OF_RANGE", "DATA_LOSS", "FAILED_PRECONDITION")
# OS errors that mean a file is missing or cut short; others (no permission, too many
# open files, a timeout) are trouble of the machine, not of the checkpoint.
_DAMAGE_ERRNOS = (errno.ENOENT, errno.ENOTDIR, errno.EISDIR)
_STATUS_CODE = re.compile(r"^([A-Z_]+): ")
# How tensorstore's messages name an array: orbax's dotted name, e.g. "params.w2/".
_ORBAX_ARRAY_NAME = re.compile(r'"((?:params|opt_state|fp8_state)(?:\.[^"/\\]+)?)/')


def _damage_in(error: BaseException | None) -> BaseException | None:
  """The error, of orbax's restore or of one it was raised from, that means damaged files."""
  while error is not None:
    if isinstance(error, (UnicodeError, json.JSONDecodeError)):  # orbax's JSON records
      return error
    if isinstance(error, OSError) and (error.errno in _DAMAGE_ERRNOS or error.errno is None):
      return error
    if isinstance(error, ValueError):
      code = _STATUS_CODE.match(str(error))
      if (code.group(1) in _DAMAGE_STATUS if code else "[tensorstore_spec" in str(error)):
        return error
    error = error.__cause__
  return None


def _orbax_name(path) -> str:
  """orbax's dotted name of a tree path: `opt_state[0].mu['w2']` is "opt_state.0.mu.w2"."""
  return ".".join(str(getattr(key, "key", getattr(key, "idx", getattr(key, "name", key))))
                  for key in path)


def _arrays_named_in(error: BaseException, tree: dict) -> str:
  """The array of `tree` (by its path) that an error of orbax's restore names, if any."""
  match = _ORBAX_ARRAY_NAME.search(str(error))
  if not match:  # e.g. orbax's record of the whole tree
    return "params, opt_state and fp8_state"
  paths = {_orbax_name(path): f"{path[0].key}{jax.tree_util.keystr(path[1:])}"
           for path, _ in jax.tree_util.tree_leaves_with_path(tree)}
  return paths.get(match.group(1), match.group(1))


def _error_text(error: BaseException) -> str:
  """The type and first line of an error, without tensorstore's long spec annotation."""
  text = (str(error).split(" [tensorstore_spec")[0].splitlines() or [""])[0]
  if len(text) > 400:
    text = text[:400] + "..."
  return f"{type(error).__name__}: {text}"


def _check_arrays(item: str, target: Any, saved: dict) -> None:
  given = {jax.tree_util.keystr(path): _array_spec(leaf)
           for path, leaf in jax.tree_util.tree_leaves_with_path(target)}
  missing = sorted(set(saved) - set(given))
  extra = sorted(set(given) - set(saved))
  if missing or extra:
    raise ValueError(
        f"{item} target does not have the saved structure: in the checkpoint only: "
        f"{missing[:10]}; in the target only: {extra[:10]}.")
  for key, spec in given.items():
    if spec != saved[key]:
      raise ValueError(
          f"{item}{key}: the checkpoint holds {saved[key]}, the target is {spec}. Restore "
          "into a target of the saved dtype and shape (cast afterwards if you mean to).")


def _check_recipes(fp8_state: Any, saved: dict) -> None:
  for path, meta in jax.tree_util.tree_leaves_with_path(fp8_state, is_leaf=is_meta):
    key = jax.tree_util.keystr(path)
    if key not in saved:
      continue  # reported by _check_arrays with the structure
    want = saved[key]
    differences = []
    given = describe_recipe(meta.recipe)
    if given != want["recipe"]:
      fields = [f"{field}: checkpoint {want['recipe'].get(field)!r}, target {given.get(field)!r}"
                for field in dict.fromkeys([*want["recipe"], *given])
                if want["recipe"].get(field) != given.get(field)]
      differences.append("recipe " + ", ".join(fields) +
                         f" (checkpoint {recipe_from_description(want['recipe'])}, "
                         f"target {meta.recipe})")
    if meta.fmt.name != want["fmt"]:
      differences.append(f"format: checkpoint {want['fmt']}, target {meta.fmt.name}")
    if differences:
      raise ValueError(
          f"fp8_state{key} does not match the checkpoint: " + "; ".join(differences) +
          ". To change recipes, restore with keep_saved_recipes=True and convert with "
          "fp8jax.resize_history(fp8_state, new_recipe).")


def _with_saved_recipes(fp8_state: Any, saved: dict) -> Any:
  paths_and_metas, treedef = jax.tree_util.tree_flatten_with_path(fp8_state, is_leaf=is_meta)
  converted = []
  for path, meta in paths_and_metas:
    key = jax.tree_util.keystr(path)
    if key not in saved:
      raise ValueError(f"fp8_state{key} is not in the checkpoint.")
    want = saved[key]
    # The saved shapes (the history length may differ from the target's), the
    # target's placement: restore reads each array straight onto its shardings.
    def spec(field, shape, dtype=np.float32):
      return jax.ShapeDtypeStruct(tuple(shape), dtype,
                                  sharding=getattr(getattr(meta, field), "sharding", None))
    converted.append(Fp8Meta(
        scale=spec("scale", want["scale_shape"]), scale_inv=spec("scale_inv", want["scale_shape"]),
        amax_history=spec("amax_history", want["history_shape"]),
        amax=spec("amax", want["scale_shape"]),
        recipe=recipe_from_description(want["recipe"]), fmt=_FORMATS[want["fmt"]],
        rng=spec("rng", want["rng_shape"], np.uint32) if "rng_shape" in want else None))
  return jax.tree.unflatten(treedef, converted)
