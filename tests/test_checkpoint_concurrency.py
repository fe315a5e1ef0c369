"""Saves that race for one directory: exactly one wins, the others fail cleanly.

Every save writes into a temporary directory of its own and claims the checkpoint
directory with one rename, so the winner's checkpoint is whole and the losers raise
`CheckpointExists` and leave nothing behind. The independent reference is the tree
each save was given: what restores must equal the winner's, byte for byte.
"""
from __future__ import annotations

import concurrent.futures
import shutil
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp8jax
import fp8jax.checkpoint as ckpt
from test_checkpoint import assert_bitwise_equal

RECIPE = fp8jax.DelayedScaling(amax_history_len=4)
WRITERS = 4


def state(seed: int) -> dict:
  """A small state whose every array differs between seeds (bf16 params too)."""
  k1, k2 = jax.random.split(jax.random.key(seed))
  params = {"w": jax.random.normal(k1, (8, 16)).astype(jnp.bfloat16),
            "b": jax.random.normal(k2, (16,))}
  meta = fp8jax.init_dot_meta(RECIPE)
  fp8_state = {"l": jax.tree.map(lambda x: x + seed, meta)}
  return {"params": params, "opt_state": {"step": jnp.int32(seed)}, "fp8_state": fp8_state}


def restore_like(path, seed: int = 0) -> dict:
  targets = jax.eval_shape(lambda: state(seed))
  return ckpt.restore(path, **targets)


def test_states_of_different_seeds_differ_in_every_array():
  # Else a restore could match the winner's state by coincidence.
  for x, y in zip(jax.tree.leaves(state(0)), jax.tree.leaves(state(1))):
    assert not np.array_equal(np.asarray(x), np.asarray(y))


def test_of_four_concurrent_saves_to_one_directory_one_wins_and_restores_bit_exactly(
    tmp_path):
  path = tmp_path / "step_1"
  states = [state(seed) for seed in range(WRITERS)]
  start = threading.Barrier(WRITERS)  # the four saves start together

  def save(seed):
    start.wait(timeout=60)
    return ckpt.save(path, **states[seed])

  with concurrent.futures.ThreadPoolExecutor(WRITERS) as pool:
    futures = [pool.submit(save, seed) for seed in range(WRITERS)]
    errors = [future.exception(timeout=300) for future in futures]

  winners = [seed for seed, error in enumerate(errors) if error is None]
  assert len(winners) == 1, errors
  for error in errors:
    if error is not None:
      # fp8jax's error, not orbax's, TensorStore's or a bare OSError.
      assert type(error) is ckpt.CheckpointExists, repr(error)
      assert repr(str(path)) in str(error) and "overwrite=True" in str(error)
  assert [p.name for p in tmp_path.iterdir()] == ["step_1"]  # the losers' files are gone
  assert_bitwise_equal(restore_like(path), states[winners[0]])


def test_a_checkpoint_written_while_this_save_was_writing_is_kept_and_this_save_raises(
    tmp_path, monkeypatch):
  # Deterministic: the rival's save runs to the end between this save's write and its
  # rename, the window the threads above may or may not hit.
  path = tmp_path / "step_1"
  mine, rivals = state(0), state(1)
  claim = ckpt._claim

  def rival_claims_first(staged, final, overwrite):
    monkeypatch.setattr(ckpt, "_claim", claim)
    assert staged.is_dir() and not final.exists()  # this save is written, not renamed
    ckpt.save(path, **rivals)
    return claim(staged, final, overwrite)

  monkeypatch.setattr(ckpt, "_claim", rival_claims_first)
  with pytest.raises(ckpt.CheckpointExists) as raised:
    ckpt.save(path, **mine)
  message = str(raised.value)
  assert repr(str(path)) in message
  assert "another save wrote a checkpoint there while this one was writing" in message
  assert "overwrite=True" in message  # the fix
  assert [p.name for p in tmp_path.iterdir()] == ["step_1"]
  assert_bitwise_equal(restore_like(path), rivals)


def test_a_save_that_fails_midway_leaves_the_checkpoint_it_would_replace_intact(
    tmp_path, monkeypatch):
  path = tmp_path / "step_1"
  old, new = state(0), state(1)
  ckpt.save(path, **old)
  checkpointer = ckpt._orbax().Checkpointer
  write = checkpointer.save

  def write_then_fail(self, directory, *args, **kwargs):
    write(self, directory, *args, **kwargs)  # all written, as far as a disk that fills up
    raise OSError(28, "No space left on device", str(directory))

  monkeypatch.setattr(checkpointer, "save", write_then_fail)
  with pytest.raises(OSError, match="No space left"):
    ckpt.save(path, **new, overwrite=True)
  assert [p.name for p in tmp_path.iterdir()] == ["step_1"]  # the new save's files deleted
  assert_bitwise_equal(restore_like(path), old)


def test_overwrite_replaces_the_checkpoint_with_the_new_one_bit_exactly(tmp_path):
  path = tmp_path / "step_1"
  ckpt.save(path, **state(0))
  ckpt.save(path, **state(1), overwrite=True)
  assert [p.name for p in tmp_path.iterdir()] == ["step_1"]
  assert_bitwise_equal(restore_like(path), state(1))


def test_an_overwrite_cut_between_its_renames_leaves_the_old_checkpoint_named(
    tmp_path, monkeypatch):
  path = tmp_path / "step_1"
  ckpt.save(path, **state(0))
  rename = ckpt.os.rename

  def killed_after_the_first_rename(source, target):
    rename(source, target)
    if ckpt.REPLACED_MARKER in str(target):
      raise KeyboardInterrupt  # the process stops here: the new one never moved into place

  monkeypatch.setattr(ckpt.os, "rename", killed_after_the_first_rename)
  with pytest.raises(KeyboardInterrupt):
    ckpt.save(path, **state(1), overwrite=True)
  monkeypatch.undo()
  with pytest.raises(FileNotFoundError, match="interrupted overwrite=True save was replacing"):
    ckpt.restore(path, **jax.eval_shape(lambda: state(0)))
  replaced = next(tmp_path.glob("step_1" + ckpt.REPLACED_MARKER + "*"))
  assert_bitwise_equal(restore_like(replaced), state(0))  # complete, restorable as it is


def test_a_save_left_between_writing_and_renaming_is_never_taken_for_a_checkpoint(tmp_path):
  # A process killed after its write and before its rename leaves a whole
  # checkpoint under the temporary name; it must not be listed or restored.
  path = ckpt.save(tmp_path / "step_1", **state(0))
  staged = tmp_path / f"step_2{ckpt.STAGING_MARKER}-0123456789abcdef"
  shutil.copytree(path, staged)
  assert not ckpt.is_complete(staged)
  with pytest.raises(ckpt.CheckpointCorrupted, match="did not finish"):
    restore_like(staged)
  with pytest.raises(FileNotFoundError, match="interrupted before it finished"):
    ckpt.check_complete(tmp_path / "step_2")
  with pytest.raises(ValueError, match="reserved for unfinished saves"):
    ckpt.save(staged, **state(0))
