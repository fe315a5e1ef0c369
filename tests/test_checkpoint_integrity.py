"""A damaged checkpoint never restores as other numbers: restore raises or returns the saved bits.

One checkpoint is saved per test process (random params that are never zero, in
float32, bfloat16 and float8; an optax Adam state and an FP8 state after one
step). Each case damages a copy of it. The damages run over every file that
orbax and fp8jax wrote, as found on disk, so a new orbax layout is covered too.
"""
from __future__ import annotations

import atexit
import fcntl
import functools
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import textwrap
import types
import warnings
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fp8jax

ckpt = pytest.importorskip("fp8jax.checkpoint")
RECIPE = fp8jax.DelayedScaling(amax_history_len=4)
TX = optax.adam(1e-2)
DAMAGED = "checkpoint is damaged or incomplete: restore an earlier checkpoint"


def _nonzero(key, shape, dtype):
  """Random values of magnitude in [0.5, 1.5) and random sign: no element is zero."""
  magnitude_key, sign_key = jax.random.split(key)
  magnitude = jax.random.uniform(magnitude_key, shape, minval=0.5, maxval=1.5)
  sign = jnp.where(jax.random.bernoulli(sign_key, 0.5, shape), 1.0, -1.0)
  return (magnitude * sign).astype(dtype)


def _state(seed: int = 7):
  """(params, opt_state, fp8_state) after one FP8 training step.

  The weights are large enough that orbax stores them in data files of their
  own, as it does a real model's (its OCDBT index inlines values under 1 KiB).
  """
  k = jax.random.split(jax.random.key(seed), 5)
  params = {"w1": _nonzero(k[0], (128, 128), jnp.bfloat16),
            "b1": _nonzero(k[1], (128,), jnp.float32),
            "w2": _nonzero(k[2], (128, 32), jnp.float32)}
  fp8_state = {"l1": fp8jax.init_dot_meta(RECIPE), "l2": fp8jax.init_dot_meta(RECIPE)}
  x = _nonzero(k[3], (16, 128), jnp.bfloat16)

  def loss_fn(params, fp8_state):
    h, m1 = fp8jax.fp8_dense(x, params["w1"], params["b1"], fp8_state["l1"])
    out, m2 = fp8jax.fp8_dense(jax.nn.relu(h), params["w2"], None, fp8_state["l2"])
    return jnp.mean(out.astype(jnp.float32) ** 2), {"l1": m1, "l2": m2}

  _, grads, fp8_state = fp8jax.value_and_grad(loss_fn)(params, fp8_state)
  updates, opt_state = TX.update(grads, TX.init(params), params)
  params = optax.apply_updates(params, updates)
  # An exported FP8 weight: its bytes must come back exactly too.
  params["w_fp8"] = _nonzero(k[4], (64, 64), jnp.float8_e4m3fn)
  return params, opt_state, fp8_state


@functools.cache
def _saved() -> tuple[pathlib.Path, tuple]:
  """The checkpoint every case copies, and the state it holds (saved once per run).

  The cases are its files, and orbax names data files at random (and writes 3 or 4 of
  them), so the processes of one run (pytest-xdist workers) share one checkpoint, saved by
  the first of them: each collects the same cases. The state is computed in each process
  (a seeded step on the CPU, the same bits in every process).
  """
  state = _state()
  run_dir = os.environ.get("FP8JAX_TEST_RUN_DIR")   # tests/conftest.py
  if not run_dir:
    root = pathlib.Path(tempfile.mkdtemp(prefix="fp8jax-checkpoint-integrity-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    return ckpt.save(root / "saved", params=state[0], opt_state=state[1],
                     fp8_state=state[2]), state
  root = pathlib.Path(run_dir) / "checkpoint_integrity"
  root.mkdir(exist_ok=True)
  with open(root / "lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)   # released when closed
    if not ckpt.is_complete(root / "saved"):
      ckpt.save(root / "saved", params=state[0], opt_state=state[1], fp8_state=state[2])
  return root / "saved", state


def _files() -> list[str]:
  """Every file of the saved checkpoint, relative to its directory."""
  path, _ = _saved()
  return sorted(str(p.relative_to(path)) for p in path.rglob("*") if p.is_file())


def pytest_generate_tests(metafunc):
  # At collection: the cases are the files this orbax version writes.
  if "checkpoint_file" in metafunc.fixturenames:
    metafunc.parametrize("checkpoint_file", _files())


def _copy(tmp_path) -> pathlib.Path:
  path, _ = _saved()
  return pathlib.Path(shutil.copytree(path, tmp_path / "copied_checkpoint"))


def _restore(path):
  _, (params, opt_state, fp8_state) = _saved()
  return ckpt.restore(path, params=params, opt_state=opt_state, fp8_state=fp8_state)


def _bytes(tree) -> dict:
  """`{path: (dtype, shape, raw bytes)}` of every leaf: bf16 and FP8 compared as bits."""
  return {jax.tree_util.keystr(path): (np.dtype(leaf.dtype).name, np.shape(leaf),
                                       np.asarray(leaf).tobytes())
          for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}


def _assert_restores_the_saved_bits(restored):
  _, (params, opt_state, fp8_state) = _saved()
  want = {"params": params, "opt_state": opt_state, "fp8_state": fp8_state}
  assert jax.tree.structure(restored) == jax.tree.structure(want)
  assert _bytes(restored) == _bytes(want)


def _damage(file: pathlib.Path, how: str) -> None:
  """Inverts 16 bytes in the middle of `file` ("flip"), cuts it to half its size, or deletes it."""
  if how == "flip":
    data = bytearray(file.read_bytes())
    start = max(0, len(data) // 2 - 8)
    for i in range(start, min(start + 16, len(data))):
      data[i] ^= 0xFF
    file.write_bytes(bytes(data))
  elif how == "truncate":
    os.truncate(file, file.stat().st_size // 2)
  else:
    file.unlink()


def test_saved_state_is_not_trivial():
  # Guards the damage tests: zeros would survive some damages unnoticed.
  _, (params, opt_state, fp8_state) = _saved()
  for leaf in jax.tree.leaves(params):
    assert np.all(np.asarray(leaf, np.float32) != 0)
  assert {np.dtype(leaf.dtype).name for leaf in jax.tree.leaves(params)} == {
      "float32", "bfloat16", "float8_e4m3fn"}
  mu = np.asarray(opt_state[0].mu["w2"])  # the step moved Adam's moments (relu zeroes a few)
  assert np.count_nonzero(mu) > mu.size // 2
  assert float(fp8_state["l1"].x.amax_history[0]) > 0


def test_undamaged_checkpoint_restores_bit_exactly_without_warning(tmp_path):
  path = _copy(tmp_path)
  with warnings.catch_warnings():
    warnings.simplefilter("error", ckpt.UnverifiedCheckpointWarning)
    restored = _restore(path)
  _assert_restores_the_saved_bits(restored)


def test_description_records_a_crc32_of_every_array_and_of_itself():
  path, (params, opt_state, fp8_state) = _saved()
  description = ckpt.read_description(path)
  assert description["version"] == 3
  # An independent computation: zlib's CRC-32 of "dtype[shape]" then the C-order bytes.
  for item, tree in (("params", params), ("opt_state", opt_state), ("fp8_state", fp8_state)):
    for key, leaf in jax.tree_util.tree_leaves_with_path(tree):
      array = np.asarray(leaf)
      header = f"{array.dtype.name}{list(array.shape)}".encode()
      want = zlib.crc32(array.tobytes(), zlib.crc32(header))
      assert description["crc32"][item][jax.tree_util.keystr(key)] == f"{want:08x}"
  assert len(description["description_crc32"]) == 8


@pytest.mark.parametrize("how", ["flip", "truncate", "delete"])
def test_damaged_file_raises_checkpoint_corrupted_or_restores_the_saved_bits(
    tmp_path, checkpoint_file, how):
  path = _copy(tmp_path)
  _damage(path / checkpoint_file, how)
  try:
    restored = _restore(path)
  except ckpt.CheckpointCorrupted as error:
    assert "copied_checkpoint" in str(error) and DAMAGED in str(error), str(error)
    return
  # Not detected: then the damaged file is one that orbax does not read (a
  # commit marker's text, a per-process index merged into the main one).
  _assert_restores_the_saved_bits(restored)


def test_damage_to_the_files_holding_arrays_and_their_records_is_always_detected(tmp_path):
  # The parametrized test above accepts a bit-exact restore; here the files that
  # carry the arrays and their records must raise, whatever the damage.
  path, _ = _saved()
  data_files = sorted(path.glob("state/**/d/*"), key=lambda p: p.stat().st_size)
  must_detect = ["description/metadata", "state/_METADATA", "state/manifest.ocdbt",
                 str(data_files[-1].relative_to(path))]  # the largest: it holds weights
  for name in must_detect:
    for how in ("flip", "truncate", "delete"):
      copy = pathlib.Path(shutil.copytree(path, tmp_path / f"{how}_{name.replace('/', '_')}"))
      _damage(copy / name, how)
      with pytest.raises(ckpt.CheckpointCorrupted, match=DAMAGED):
        _restore(copy)


def test_other_values_in_intact_files_are_named_by_item_and_array(tmp_path):
  # A checkpoint whose array files are intact but hold other values than its
  # description records (as a flip inside stored data does, when the data still
  # decodes): orbax reads them without complaint, the checksums do not match.
  path = _copy(tmp_path)
  _, (params, opt_state, fp8_state) = _saved()
  other = dict(params, w1=params["w1"].at[3, 5].set(-params["w1"][3, 5]))
  donor = ckpt.save(tmp_path / "donor", params=other, opt_state=opt_state, fp8_state=fp8_state)
  shutil.rmtree(path / "state")
  shutil.copytree(donor / "state", path / "state")
  with pytest.raises(ckpt.CheckpointCorrupted,
                     match=r"copied_checkpoint.*1 array\(s\) read back other values than were "
                           r"saved: params\['w1'\] \(crc32 [0-9a-f]{8}, saved [0-9a-f]{8}\)"):
    _restore(path)


def test_a_description_edited_into_other_valid_json_is_refused(tmp_path):
  path = _copy(tmp_path)
  record = path / "description" / "metadata"
  description = json.loads(record.read_text())
  description["metadata"]["step"] = 1000  # still valid JSON, now says something else
  record.write_text(json.dumps(description))
  with pytest.raises(ckpt.CheckpointCorrupted,
                     match="copied_checkpoint.*description.*does not match the checksum"):
    ckpt.read_description(path)
  with pytest.raises(ckpt.CheckpointCorrupted, match="does not match the checksum"):
    _restore(path)


def test_version_2_checkpoint_restores_with_a_warning_that_values_are_unverified(tmp_path):
  # Version 2 wrote the same description without checksums.
  path = _copy(tmp_path)
  record = path / "description" / "metadata"
  description = json.loads(record.read_text())
  for key in ("crc32", "description_crc32"):
    del description[key]
  record.write_text(json.dumps(dict(description, version=2)))
  with pytest.warns(ckpt.UnverifiedCheckpointWarning,
                    match="copied_checkpoint.*version 2, written before checksums"):
    restored = _restore(path)
  _assert_restores_the_saved_bits(restored)


def test_damaged_version_2_array_files_still_raise_checkpoint_corrupted(tmp_path):
  path = _copy(tmp_path)
  record = path / "description" / "metadata"
  description = json.loads(record.read_text())
  record.write_text(json.dumps({key: value for key, value in description.items()
                                if key not in ("crc32", "description_crc32")} | {"version": 2}))
  shutil.rmtree(path / "state" / "d")
  with pytest.raises(ckpt.CheckpointCorrupted, match="copied_checkpoint.*missing, cut short"):
    _restore(path)


@pytest.mark.parametrize("file,how,cause", [
    ("description/metadata", "truncate", json.JSONDecodeError),
    ("state/_METADATA", "flip", UnicodeDecodeError),
    ("state/manifest.ocdbt", "delete", ValueError),  # tensorstore's NOT_FOUND
])
def test_errors_of_json_and_tensorstore_are_chained_to_checkpoint_corrupted(
    tmp_path, file, how, cause):
  path = _copy(tmp_path)
  _damage(path / file, how)
  with pytest.raises(ckpt.CheckpointCorrupted, match=cause.__name__) as raised:
    _restore(path)
  assert isinstance(raised.value.__cause__, cause)


# Runs with 4 host devices: saves the checkpoint's state sharded over them, then
# restores it onto another sharding. Prints the new checkpoint's checksums.
SHARDED = textwrap.dedent("""
    import json, pathlib, sys
    import jax, numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    sys.path.insert(0, sys.argv[1])
    import test_checkpoint_integrity as t
    import fp8jax.checkpoint as ckpt

    saved, out = pathlib.Path(sys.argv[2]), pathlib.Path(sys.argv[3])
    targets = jax.eval_shape(t._state)
    state = ckpt.restore(saved, params=targets[0], opt_state=targets[1], fp8_state=targets[2])
    mesh = jax.make_mesh((4,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
    def place(axis):  # split `axis` over the 4 devices where it divides, else replicate
      def put(a):
        spec = [None] * a.ndim
        if a.ndim and a.shape[axis] % 4 == 0:
          spec[axis] = "d"
        return jax.device_put(a, NamedSharding(mesh, P(*spec)))
      return put
    sharded = {k: jax.tree.map(place(0), v) for k, v in state.items()}
    assert sharded["params"]["w1"].addressable_shards[0].data.shape == (32, 128)
    ckpt.save(out, **sharded)
    on_cols = {k: jax.tree.map(place(-1), v) for k, v in state.items()}
    again = ckpt.restore(out, **on_cols)  # verifies the checksums on another sharding
    assert again["params"]["w1"].addressable_shards[0].data.shape == (128, 32)
    for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(state)):
      assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    print(json.dumps(ckpt.read_description(out)["crc32"]))
""")


def test_checksums_do_not_depend_on_the_sharding(tmp_path):
  path, _ = _saved()
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") +
                        " --xla_force_host_platform_device_count=4").strip())
  proc = subprocess.run(
      [sys.executable, "-c", SHARDED, str(pathlib.Path(__file__).parent), str(path),
       str(tmp_path / "sharded")], env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
  sharded = json.loads(proc.stdout.strip().splitlines()[-1])
  assert sharded == ckpt.read_description(path)["crc32"]


_RESTORE_DAMAGED_AND_EXIT = textwrap.dedent("""
    import logging, os, pathlib, shutil, sys, tempfile
    sys.path.insert(0, {tests!r})
    import test_checkpoint_integrity as t
    path, _ = t._saved()
    hooks = (sys.excepthook, sys.unraisablehook, list(logging.getLogger("asyncio").filters))
    t._restore(path)
    print("intact restore keeps the hooks:",
          hooks == (sys.excepthook, sys.unraisablehook, logging.getLogger("asyncio").filters))
    scratch = pathlib.Path(tempfile.mkdtemp(dir=os.environ.get("FP8JAX_TEST_RUN_DIR")))
    path = pathlib.Path(shutil.copytree(path, scratch / "damaged"))
    for data_file in (path / "state" / "d").iterdir():
      os.truncate(data_file, data_file.stat().st_size // 2)
    try:
      t._restore(path)
    except t.ckpt.CheckpointCorrupted as error:
      print("refused:", str(error)[:60])
    """)


def test_a_refused_damaged_checkpoint_leaves_no_flood_of_tracebacks_at_exit():
  """orbax abandons its other reads at the first damaged one; their errors used to print
  about a thousand lines of tracebacks when collected and at interpreter exit. An intact
  restore first, in the same process, must leave its exception hooks as they were."""
  script = _RESTORE_DAMAGED_AND_EXIT.format(tests=str(pathlib.Path(__file__).parent))
  proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                        timeout=300, env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert proc.returncode == 0, proc.stderr[-3000:]
  lines = proc.stdout.splitlines()
  # The hooks that drop a failed read's echoes are there for the read only: after an intact
  # restore, every exception of the process reaches the hooks it had before.
  assert "intact restore keeps the hooks: True" in lines, proc.stdout
  assert lines[-1].startswith("refused: Could not read the arrays of checkpoint"), proc.stdout
  for echo in ("Encountered error while reading", "Event loop is closed",
               "was never retrieved", "Traceback"):
    assert echo not in proc.stderr, proc.stderr[-3000:]


@pytest.fixture
def fresh_echo_hooks(monkeypatch):
  """This process's exception hooks as a process that never read a checkpoint has them:
  its own hooks (put back after the test) and fp8jax's hook state unused."""
  monkeypatch.setattr(ckpt, "_echo_silencer", ckpt._unused_echo_silencer())
  monkeypatch.setattr(ckpt.atexit, "register", lambda fn: None)  # not this test's exit
  monkeypatch.setattr(sys, "excepthook", lambda *args: None)
  monkeypatch.setattr(sys, "unraisablehook", lambda *args: None)
  return sys.excepthook, sys.unraisablehook


def _orbax_whose_restore(restore):
  """A stand-in for orbax whose checkpointer's restore calls `restore()`."""
  class Checkpointer:
    def __init__(self, handler):
      pass

    def restore(self, path, args):
      return {"state": restore()}

  return types.SimpleNamespace(
      Checkpointer=Checkpointer, CompositeCheckpointHandler=lambda: None,
      args=types.SimpleNamespace(Composite=lambda **items: items,
                                 StandardRestore=lambda abstract: abstract))


def test_the_echo_hooks_are_there_during_a_read_and_put_back_after_it(fresh_echo_hooks):
  """Installed before the read starts (a read tensorstore finishes after orbax closed its
  event loop reports there, before any failure reaches fp8jax), removed after it."""
  during = []
  orbax = _orbax_whose_restore(lambda: during.append((sys.excepthook, sys.unraisablehook)))
  ckpt._read_arrays(orbax, pathlib.Path("unused"), {}, "unused")
  assert during and all(hook not in fresh_echo_hooks for hook in during[0])
  assert (sys.excepthook, sys.unraisablehook) == fresh_echo_hooks


def test_a_read_abandoned_in_one_thread_keeps_the_hooks_another_threads_read_ends(
    fresh_echo_hooks):
  ckpt._reading_starts()                 # read A
  ckpt._reading_starts()                 # read B, in another thread
  ckpt._reading_ends(abandoned=False)    # A finishes: B still reads
  assert sys.excepthook is not fresh_echo_hooks[0]
  ckpt._reading_ends(abandoned=True)     # B fails on a damaged file: its reads run on
  assert sys.excepthook is not fresh_echo_hooks[0]
  ckpt._reading_starts()                 # a later intact read leaves them to the exit
  ckpt._reading_ends(abandoned=False)
  assert sys.excepthook is not fresh_echo_hooks[0]
  assert sys.unraisablehook is not fresh_echo_hooks[1]


def test_an_interrupted_read_keeps_the_hooks(fresh_echo_hooks):
  def interrupted():
    raise KeyboardInterrupt
  with pytest.raises(KeyboardInterrupt):
    ckpt._read_arrays(_orbax_whose_restore(interrupted), pathlib.Path("unused"), {}, "unused")
  assert sys.excepthook is not fresh_echo_hooks[0]
  assert ckpt._echo_silencer["kept_at_exit"] and ckpt._echo_silencer["reading"] == 0


def test_saving_under_a_file_names_the_users_path(tmp_path):
  params, opt_state, fp8_state = _saved()[1]
  (tmp_path / "not_a_folder").write_text("a file where a folder should be")
  target = tmp_path / "not_a_folder" / "step_1"
  with pytest.raises(NotADirectoryError, match=r"directory=.*not_a_folder/step_1.* cannot be "
                                               r"created: .*not_a_folder' is a file"):
    ckpt.save(target, params=params, opt_state=opt_state, fp8_state=fp8_state)
  assert sorted(p.name for p in tmp_path.iterdir()) == ["not_a_folder"]  # nothing staged
