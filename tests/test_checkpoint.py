"""Checkpoints restore bit for bit, refuse mismatched targets and never load half a save."""
from __future__ import annotations

import dataclasses
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fp8jax
import fp8jax.checkpoint as ckpt
from fp8jax.step.all_reduce import replicated

RECIPE = fp8jax.DelayedScaling(amax_history_len=4)
TX = optax.adamw(1e-2, weight_decay=0.1)


def loss_fn(params, fp8_state, x, y):
  h, m1 = fp8jax.fp8_dense(x, params["w1"], params["b1"], fp8_state["l1"])
  out, m2 = fp8jax.fp8_dense(jax.nn.relu(h), params["w2"], None, fp8_state["l2"])
  return jnp.mean((out.astype(jnp.float32) - y) ** 2), {"l1": m1, "l2": m2}


@jax.jit
def train_step(params, opt_state, fp8_state, x, y):
  loss, grads, fp8_state = fp8jax.value_and_grad(loss_fn)(params, fp8_state, x, y)
  updates, opt_state = TX.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state, fp8_state, loss


def batch(i):
  x = jax.random.normal(jax.random.key(i), (16, 8)).astype(jnp.bfloat16) * (1 + i)
  return x, jnp.sum(x.astype(jnp.float32), axis=1, keepdims=True)


def trained_state(recipe=RECIPE, steps=3):
  """A state after a few steps: non-trivial scales, histories, Adam moments, bf16 params."""
  k1, k2 = jax.random.split(jax.random.key(0))
  params = {"w1": jax.random.normal(k1, (8, 16)).astype(jnp.bfloat16) / 3,
            "b1": jnp.zeros(16, jnp.bfloat16),
            "w2": jax.random.normal(k2, (16, 1)) / 4}
  fp8_state = {"l1": fp8jax.init_dot_meta(recipe), "l2": fp8jax.init_dot_meta(recipe)}
  opt_state = TX.init(params)
  for i in range(steps):
    params, opt_state, fp8_state, _ = train_step(params, opt_state, fp8_state, *batch(i))
  return params, opt_state, fp8_state


def assert_bitwise_equal(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    assert x.dtype == y.dtype and x.shape == y.shape
    np.testing.assert_array_equal(np.atleast_1d(np.asarray(x)).view(np.uint8),
                                  np.atleast_1d(np.asarray(y)).view(np.uint8))


def test_restore_is_bit_exact_and_training_continues_identically(tmp_path):
  params, opt_state, fp8_state = trained_state()
  path = ckpt.save(tmp_path / "step_3", params=params, opt_state=opt_state, fp8_state=fp8_state)
  # Abstract targets (no arrays allocated) are enough.
  targets = jax.eval_shape(lambda: trained_state(steps=0))
  restored = ckpt.restore(path, params=targets[0], opt_state=targets[1], fp8_state=targets[2])
  assert_bitwise_equal(restored, {"params": params, "opt_state": opt_state,
                                  "fp8_state": fp8_state})
  # The real property: the next step from the restored state is the next step.
  want = train_step(params, opt_state, fp8_state, *batch(3))
  got = train_step(restored["params"], restored["opt_state"], restored["fp8_state"], *batch(3))
  assert_bitwise_equal(got, want)


def test_description_records_each_meta_recipe_and_format(tmp_path):
  params, opt_state, fp8_state = trained_state(steps=1)
  path = ckpt.save(tmp_path / "c", params=params, opt_state=opt_state, fp8_state=fp8_state)
  metas = ckpt.read_description(path)["fp8_metas"]
  assert set(metas) == {f"['{layer}'].{role}" for layer in ("l1", "l2")
                        for role in ("x", "kernel", "grad")}
  assert metas["['l1'].grad"]["fmt"] == "e5m2" and metas["['l2'].x"]["fmt"] == "e4m3"
  assert metas["['l1'].x"]["recipe"] == {"kind": "DelayedScaling", "amax_history_len": 4,
                                         "amax_compute_algo": "max", "margin": 0,
                                         "fp8_format": "hybrid"}
  assert ckpt.recipe_from_description(metas["['l1'].x"]["recipe"]) == RECIPE


@pytest.mark.parametrize("target_recipe,match", [
    (fp8jax.DelayedScaling(amax_history_len=8), "amax_history_len: checkpoint 4, target 8"),
    (fp8jax.DelayedScaling(4, "most_recent"), "amax_compute_algo: checkpoint 'max'"),
    (fp8jax.DelayedScaling(4, fp8_format="e4m3"), "fp8_format: checkpoint 'hybrid'"),
    (fp8jax.CurrentScaling(), "kind: checkpoint 'DelayedScaling', target 'CurrentScaling'"),
])
def test_target_with_other_recipe_is_refused_naming_what_differs(tmp_path, target_recipe, match):
  params, opt_state, fp8_state = trained_state(steps=1)
  path = ckpt.save(tmp_path / "c", params=params, opt_state=opt_state, fp8_state=fp8_state)
  target = {"l1": fp8jax.init_dot_meta(target_recipe), "l2": fp8jax.init_dot_meta(target_recipe)}
  with pytest.raises(ValueError, match=r"fp8_state\['l1'\]\.x does not match.*" + match +
                     ".*fp8jax.resize_history"):
    ckpt.restore(path, params=params, opt_state=opt_state, fp8_state=target)


def test_other_history_length_converts_only_through_resize_history(tmp_path):
  params, opt_state, fp8_state = trained_state(steps=3)
  path = ckpt.save(tmp_path / "c", params=params, opt_state=opt_state, fp8_state=fp8_state)
  new_recipe = fp8jax.DelayedScaling(amax_history_len=6)
  target = {"l1": fp8jax.init_dot_meta(new_recipe), "l2": fp8jax.init_dot_meta(new_recipe)}
  saved = ckpt.restore(path, params=params, opt_state=opt_state, fp8_state=target,
                       keep_saved_recipes=True)["fp8_state"]
  assert saved["l1"].x.recipe == RECIPE  # as saved, not as the target says
  converted = fp8jax.resize_history(saved, new_recipe)
  for layer in ("l1", "l2"):
    for role in ("x", "kernel", "grad"):
      old, new = getattr(fp8_state[layer], role), getattr(converted[layer], role)
      assert new.recipe == new_recipe and new.fmt == old.fmt
      np.testing.assert_array_equal(new.amax_history[:4], old.amax_history)
      np.testing.assert_array_equal(new.amax_history[4:], 0.0)
      assert float(new.scale) == float(old.scale)
  # The converted state trains with the new recipe.
  train_step(params, opt_state, converted, *batch(3))


def test_resize_history_keeps_newest_entries_of_stacked_metas():
  history = jnp.arange(1.0, 9.0).reshape(2, 4)  # two layers, newest first
  scale = jnp.array([2.0, 3.0])
  stacked = fp8jax.Fp8Meta(scale, 1 / scale, history, jnp.zeros(2), RECIPE, fp8jax.E4M3)
  short = fp8jax.resize_history(stacked, fp8jax.DelayedScaling(amax_history_len=2))
  np.testing.assert_array_equal(short.amax_history, [[1.0, 2.0], [5.0, 6.0]])
  np.testing.assert_array_equal(short.scale, [2.0, 3.0])
  current = fp8jax.resize_history(stacked, fp8jax.CurrentScaling())
  np.testing.assert_array_equal(current.amax_history, [[1.0], [5.0]])


def test_resize_history_refuses_to_change_formats():
  with pytest.raises(ValueError, match="cannot change the FP8 formats.*'hybrid'.*'e4m3'"):
    fp8jax.resize_history({"l": fp8jax.init_dot_meta(RECIPE)},
                          fp8jax.DelayedScaling(fp8_format="e4m3"))


def test_target_with_other_structure_or_dtype_is_refused(tmp_path):
  params, opt_state, fp8_state = trained_state(steps=1)
  path = ckpt.save(tmp_path / "c", params=params, opt_state=opt_state, fp8_state=fp8_state)
  with pytest.raises(ValueError, match=r"params\['b1'\]: the checkpoint holds bfloat16\[16\], "
                                       r"the target is float32\[16\]"):
    ckpt.restore(path, params=dict(params, b1=params["b1"].astype(jnp.float32)),
                 opt_state=opt_state, fp8_state=fp8_state)
  with pytest.raises(ValueError, match=r"params target does not have the saved structure.*'w2'"):
    ckpt.restore(path, params={"w1": params["w1"], "b1": params["b1"]}, opt_state=opt_state,
                 fp8_state=fp8_state)
  with pytest.raises(TypeError, match=r"fp8_state must be a pytree of fp8jax.Fp8Meta"):
    ckpt.restore(path, params=params, opt_state=opt_state, fp8_state=params)


def test_save_does_not_replace_an_existing_checkpoint_unless_asked(tmp_path):
  params, opt_state, fp8_state = trained_state(steps=0)
  ckpt.save(tmp_path / "c", params=params, opt_state=opt_state, fp8_state=fp8_state)
  with pytest.raises(FileExistsError, match="overwrite=True"):
    ckpt.save(tmp_path / "c", params=params, opt_state=opt_state, fp8_state=fp8_state)
  ckpt.save(tmp_path / "c", params=params, opt_state=opt_state, fp8_state=fp8_state,
            overwrite=True)


# A writer that stops inside orbax's finalize step (data written, directory not
# yet renamed) and waits there to be killed: a deterministic "killed mid-save".
WRITER = textwrap.dedent("""
    import pathlib, sys, time
    import jax.numpy as jnp
    from orbax.checkpoint._src.path import atomicity
    import fp8jax, fp8jax.checkpoint as ckpt

    root = pathlib.Path(sys.argv[1])
    state = dict(params={"w": jnp.arange(4096.0)}, opt_state={},
                 fp8_state={"l": fp8jax.init_dot_meta(fp8jax.DelayedScaling())})
    ckpt.save(root / "step_1", **state)            # a complete, earlier checkpoint

    async def stall(self):
        (root / "WRITING").write_text("data written, about to commit")
        time.sleep(600)
    atomicity.AtomicRenameTemporaryPath.finalize = stall
    ckpt.save(root / "step_2", **state)
""")


def test_writer_killed_mid_save_leaves_no_loadable_checkpoint(tmp_path):
  proc = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path)],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          start_new_session=True)
  try:
    deadline = time.monotonic() + 120
    while not (tmp_path / "WRITING").exists():
      assert proc.poll() is None, proc.stdout.read()[-3000:]
      assert time.monotonic() < deadline, "writer did not reach the commit step"
      time.sleep(0.1)
  finally:
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
  leftovers = [p.name for p in tmp_path.iterdir() if ckpt.TMP_MARKER in p.name]
  assert leftovers and leftovers[0].startswith("step_2")
  assert not (tmp_path / "step_2").exists()
  with pytest.raises(FileNotFoundError, match="step_2.*interrupted before it finished"):
    ckpt.check_complete(tmp_path / "step_2")
  with pytest.raises(ValueError, match="did not finish"):
    ckpt.restore(tmp_path / leftovers[0], params={}, opt_state={}, fp8_state={})
  assert not ckpt.is_complete(tmp_path / "step_2") and ckpt.is_complete(tmp_path / "step_1")


@pytest.mark.parametrize("damage,error,match", [
    ("commit_success.txt", ValueError, r"\['commit_success.txt'\] missing"),
    ("state", ValueError, r"\['state'\] missing"),
    ("state/_METADATA", ValueError, r"\['state/_METADATA'\] missing"),
    # tensorstore's NOT_FOUND, OUT_OF_RANGE and DATA_LOSS, in that order.
    ("array files", ValueError, "Could not read the arrays.*missing, cut short or corrupt"),
    ("array files cut short", ValueError, "Could not read the arrays.*OUT_OF_RANGE"),
    ("array index overwritten", ValueError, "Could not read the arrays.*DATA_LOSS"),
])
def test_partial_directory_is_detected_and_not_loaded(tmp_path, damage, error, match):
  params, opt_state, fp8_state = trained_state(steps=1)
  path = ckpt.save(tmp_path / "c", params=params, opt_state=opt_state, fp8_state=fp8_state)
  if damage == "array files":  # e.g. a copy cut short: the chunk files of the arrays
    for data_dir in path.glob("state/**/d"):
      shutil.rmtree(data_dir)
  elif damage == "array files cut short":
    for data_file in path.glob("state/d/*"):
      os.truncate(data_file, 16)
  elif damage == "array index overwritten":  # the OCDBT manifest that locates the chunks
    (path / "state" / "manifest.ocdbt").write_bytes(b"\x01" * 32)
  elif (path / damage).is_dir():
    shutil.rmtree(path / damage)
  else:
    (path / damage).unlink()
  with pytest.raises(error, match=match):
    ckpt.restore(path, params=params, opt_state=opt_state, fp8_state=fp8_state)


def test_target_mismatch_found_by_orbax_keeps_its_own_message(tmp_path, monkeypatch):
  params, opt_state, fp8_state = trained_state(steps=1)
  path = ckpt.save(tmp_path / "c", params=params, opt_state=opt_state, fp8_state=fp8_state)
  # fp8jax compares shapes before reading; without that check the mismatch reaches
  # orbax, whose error is about the target and must not read as damaged files.
  monkeypatch.setattr(ckpt, "_check_arrays", lambda *args: None)
  with pytest.raises(ValueError, match=r"Requested shape: \(8, 8\) is not compatible with the "
                                       r"stored shape: \(8, 16\)") as raised:
    ckpt.restore(path, params=dict(params, w1=jnp.zeros((8, 8), jnp.bfloat16)),
                 opt_state=opt_state, fp8_state=fp8_state)
  assert "Could not read" not in str(raised.value)


@pytest.mark.parametrize("keep_saved_recipes", [False, True])
def test_restore_places_arrays_on_the_target_shardings(tmp_path, keep_saved_recipes):
  params, opt_state, fp8_state = trained_state(steps=1)
  path = ckpt.save(tmp_path / "c", params=params, opt_state=opt_state, fp8_state=fp8_state)
  # One device is enough: a NamedSharding is a different placement from the
  # SingleDeviceSharding that orbax restores to when it is not told one.
  mesh = jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
  on_mesh = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  # keep_saved_recipes=True builds the FP8 targets from the saved shapes (here a
  # longer target history than saved); the shardings must still be the target's.
  recipe = fp8jax.DelayedScaling(amax_history_len=8) if keep_saved_recipes else RECIPE
  target = replicated(
      {"l1": fp8jax.init_dot_meta(recipe), "l2": fp8jax.init_dot_meta(recipe)}, mesh)
  restored = ckpt.restore(path, params=jax.device_put(params, on_mesh), opt_state=opt_state,
                          fp8_state=target, keep_saved_recipes=keep_saved_recipes)
  for leaf in jax.tree.leaves((restored["params"], restored["fp8_state"])):
    assert leaf.sharding == on_mesh
  assert_bitwise_equal(restored["fp8_state"], fp8_state)
