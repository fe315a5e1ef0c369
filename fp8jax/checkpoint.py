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

Versions: version 2 stores the four-field `Fp8Meta` (scale, scale_inv,
amax_history, amax). Version 1 (fp8jax 0.1.0) stored scale and amax_history
only; `restore` reads it into today's layout, with `scale_inv = 1 / scale` and a
running amax of 0: exactly the state `end_step` would have returned, so
training continues with the same scales.

Completeness: orbax writes into `<path>.orbax-checkpoint-tmp*`, writes a
`commit_success.txt` marker and only then renames the directory to `<path>`. A
process killed while saving leaves the temporary directory and no `<path>`;
`restore` refuses temporary directories and directories without the marker or
a part. `restore` returns new trees and never modifies its targets, so a failed
restore leaves nothing half-loaded.
"""
from __future__ import annotations

import dataclasses
import json
import os
import pathlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fp8jax import recipes as recipes_module
from fp8jax.formats import E4M3, E5M2
from fp8jax.meta import Fp8Meta, check_fp8_state, is_meta

FORMAT_NAME = "fp8jax.checkpoint"
FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)
TMP_MARKER = ".orbax-checkpoint-tmp"
COMMIT_MARKER = "commit_success.txt"
ITEMS = ("params", "opt_state", "fp8_state")
_FORMATS = {fmt.name: fmt for fmt in (E4M3, E5M2)}


def _orbax():
  try:
    import orbax.checkpoint as ocp
  except ImportError as error:
    raise ImportError(
        "fp8jax.checkpoint needs orbax-checkpoint: pip install 'fp8jax[checkpoint]' "
        "(or pip install orbax-checkpoint).") from error
  return ocp


def describe_recipe(recipe) -> dict:
  """A JSON-able description of a recipe: its class name and fields."""
  return {"kind": type(recipe).__name__, **dataclasses.asdict(recipe)}


def recipe_from_description(description: dict):
  """The recipe object a `describe_recipe` dictionary describes."""
  fields = dict(description)
  kind = fields.pop("kind", None)
  cls = getattr(recipes_module, str(kind), None)
  if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
    raise ValueError(f"checkpoint names an unknown FP8 recipe kind {kind!r}.")
  return cls(**fields)


def _array_spec(leaf) -> str:
  return f"{np.dtype(leaf.dtype).name}{list(np.shape(leaf))}"


def describe(params: Any, opt_state: Any, fp8_state: Any, metadata: dict | None = None) -> dict:
  """The JSON description `save` writes: array specs per item, FP8 meta recipes, metadata."""
  check_fp8_state(fp8_state, "fp8_state")
  arrays = {}
  for name, tree in zip(ITEMS, (params, opt_state, fp8_state)):
    arrays[name] = {jax.tree_util.keystr(path): _array_spec(leaf)
                    for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}
  metas = {}
  for path, meta in jax.tree_util.tree_leaves_with_path(fp8_state, is_leaf=is_meta):
    metas[jax.tree_util.keystr(path)] = {
        "recipe": describe_recipe(meta.recipe), "fmt": meta.fmt.name,
        "scale_shape": list(np.shape(meta.scale)),
        "history_shape": list(np.shape(meta.amax_history))}
  return {"format": FORMAT_NAME, "version": FORMAT_VERSION, "arrays": arrays, "fp8_metas": metas,
          "metadata": dict(metadata or {})}


def save(directory: str | os.PathLike, *, params: Any, opt_state: Any, fp8_state: Any,
         overwrite: bool = False, metadata: dict | None = None) -> pathlib.Path:
  """Writes params, optimizer state and FP8 state to `directory`, atomically.

  Args:
    directory: the checkpoint directory to create (one per step, e.g. `ckpt/step_100`).
    params, opt_state, fp8_state: pytrees of arrays (sharded arrays too); use
      `{}` for an item you do not have.
    overwrite: replace an existing checkpoint at `directory` (the old one is
      deleted before the new one is complete; prefer a new directory per step).
    metadata: JSON-able facts saved with the arrays, atomically (e.g. the step and
      the data position of a training run); `read_description(...)["metadata"]`.

  Returns:
    The absolute path of the checkpoint.
  """
  ocp = _orbax()
  path = pathlib.Path(directory).absolute()
  if TMP_MARKER in path.name:
    raise ValueError(f"directory={str(directory)!r}: names ending in {TMP_MARKER!r} are "
                     "reserved for unfinished saves; choose another name.")
  if path.exists() and not overwrite:
    raise FileExistsError(
        f"directory={str(directory)!r} already exists; pass overwrite=True to replace it "
        "or save each step to its own directory.")
  if metadata is not None:
    try:
      json.dumps(metadata)
    except (TypeError, ValueError) as error:
      raise TypeError(f"metadata must be JSON-serializable: {error}") from None
  description = describe(params, opt_state, fp8_state, metadata)
  tree = {"params": params, "opt_state": opt_state, "fp8_state": fp8_state}
  checkpointer = ocp.Checkpointer(ocp.CompositeCheckpointHandler())
  checkpointer.save(path, args=ocp.args.Composite(
      state=ocp.args.StandardSave(tree), description=ocp.args.JsonSave(description)),
      force=overwrite)
  return path


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
    ValueError: a temporary directory of an unfinished save, or a directory
      missing the commit marker or one of its parts.
  """
  path = pathlib.Path(directory).absolute()
  if TMP_MARKER in path.name:
    raise ValueError(
        f"directory={str(directory)!r} is the temporary directory of a save that did not "
        "finish (its process was interrupted); it is incomplete and cannot be restored.")
  if not path.is_dir():
    leftovers = sorted(p.name for p in path.parent.glob(path.name + TMP_MARKER + "*"))
    hint = (f" Found {leftovers}: a save to it was interrupted before it finished, so no "
            "complete checkpoint of that name exists." if leftovers else "")
    raise FileNotFoundError(f"No checkpoint at directory={str(directory)!r}.{hint}")
  missing = [part for part in (COMMIT_MARKER, "state", "description")
             if not (path / part).exists()]
  # orbax's record of the tree: without it orbax misreads the tree's structure
  # instead of reporting a missing file.
  if "state" not in missing and not (path / "state" / "_METADATA").exists():
    missing.append("state/_METADATA")
  if missing:
    raise ValueError(
        f"directory={str(directory)!r} is not a complete fp8jax checkpoint: {missing} "
        "missing (a partial copy, or not written by fp8jax.checkpoint.save).")
  return path


def read_description(directory: str | os.PathLike) -> dict:
  """The JSON description stored with a complete checkpoint."""
  path = check_complete(directory)
  ocp = _orbax()
  checkpointer = ocp.Checkpointer(ocp.CompositeCheckpointHandler())
  description = checkpointer.restore(
      path, args=ocp.args.Composite(description=ocp.args.JsonRestore()))["description"]
  if not isinstance(description, dict) or description.get("format") != FORMAT_NAME:
    raise ValueError(f"directory={str(directory)!r} is not an fp8jax checkpoint.")
  if description.get("version") not in READABLE_VERSIONS:
    raise ValueError(
        f"directory={str(directory)!r} has fp8jax checkpoint version "
        f"{description.get('version')}, this fp8jax reads versions {READABLE_VERSIONS}.")
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
    `{"params": ..., "opt_state": ..., "fp8_state": ...}`, bit-identical to what was saved.

  Raises:
    FileNotFoundError / ValueError: incomplete or missing checkpoint (see
      `check_complete`), or a target that does not match the checkpoint; the
      message names the path inside the tree and both sides.
    ValueError "Could not read the arrays": array files missing, cut short or
      corrupt. Other errors of orbax or jax (e.g. a target sharding that does not
      divide an array's shape) pass through unchanged.
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
  checkpointer = ocp.Checkpointer(ocp.CompositeCheckpointHandler())
  try:
    restored = checkpointer.restore(
        path, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract)))["state"]
  except (OSError, ValueError) as error:
    if not _is_unreadable_files_error(error):
      raise  # e.g. a sharding that does not fit an array: its own message says what
    raise ValueError(
        f"Could not read the arrays of checkpoint {str(directory)!r}: its files are "
        f"missing, cut short or corrupt (a partial copy?): {type(error).__name__}: "
        f"{error}") from error
  if legacy:
    restored["fp8_state"] = jax.tree.map(_from_version_1, restored["fp8_state"],
                                         is_leaf=lambda n: isinstance(n, _MetaV1))
  return {name: restored[name] for name in ITEMS}


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


# tensorstore raises every failure as a ValueError whose message starts with the
# status code. A deleted array file reads as NOT_FOUND, a truncated one as
# OUT_OF_RANGE (a byte range past its end), a corrupted one or a corrupted OCDBT
# manifest as DATA_LOSS. A target that does not fit (shape, sharding) fails in
# orbax or jax with a plain ValueError instead, which is let through.
_UNREADABLE_STATUS = ("NOT_FOUND:", "OUT_OF_RANGE:", "DATA_LOSS:", "PERMISSION_DENIED:")


def _is_unreadable_files_error(error: Exception) -> bool:
  """Whether an error of orbax's restore means that files are missing or unreadable."""
  if isinstance(error, (OSError, json.JSONDecodeError)):  # orbax's own metadata files
    return True
  return isinstance(error, ValueError) and str(error).startswith(_UNREADABLE_STATUS)


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
    def spec(field, shape):
      return jax.ShapeDtypeStruct(tuple(shape), np.float32,
                                  sharding=getattr(getattr(meta, field), "sharding", None))
    converted.append(Fp8Meta(
        scale=spec("scale", want["scale_shape"]), scale_inv=spec("scale_inv", want["scale_shape"]),
        amax_history=spec("amax_history", want["history_shape"]),
        amax=spec("amax", want["scale_shape"]),
        recipe=recipe_from_description(want["recipe"]), fmt=_FORMATS[want["fmt"]]))
  return jax.tree.unflatten(treedef, converted)
