"""Two processes (jax.distributed over loopback) train the FP8 MLP to identical states.

The test runs examples/train_multiprocess.py's command line, which starts both
workers, kills them all if one fails or the time limit passes, and writes each
process's parameters and FP8 state. Here they are compared bit for bit, and
the recorded amaxes are checked against the global batch (independent of the
library): a process-local amax would be the amax of that process's rows only.
"""
from __future__ import annotations

import importlib.util
import json
import pathlib

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "train_multiprocess.py"


def load_example():
  spec = importlib.util.spec_from_file_location("train_multiprocess", SCRIPT)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


example = load_example()


@pytest.mark.multidevice
def test_two_processes_end_with_identical_params_and_global_fp8_state(tmp_path, capsys):
  # In this process, so that launch() itself kills the workers whatever happens;
  # --timeout bounds the run. --batch 32 is not the default: it must reach the workers.
  example.main(["--num-processes", "2", "--steps", "8", "--batch", "32",
                "--timeout", "200", "--out", str(tmp_path)])
  assert "identical on all processes: True" in capsys.readouterr().out

  saved = [np.load(tmp_path / f"process_{i}.npz") for i in range(2)]
  assert any("fp8_state" in key for key in saved[0].files)
  assert set(saved[0].files) == set(saved[1].files)
  for key in saved[0].files:
    np.testing.assert_array_equal(saved[0][key], saved[1][key], err_msg=key)

  logs = [json.loads((tmp_path / f"process_{i}.json").read_text()) for i in range(2)]
  assert [log["process_index"] for log in logs] == [0, 1]
  for log in logs:
    assert (log["devices"], log["platform"], log["batch"]) == (2, "cpu", 32)
    assert len(log["losses"]) == 8
    # Exact: the max over both processes' rows is the max of the global batch.
    assert log["x_amax_recorded"] == log["x_amax_global_batch"]
    assert np.all(np.isfinite(log["losses"]))
  # The check has teeth: on some steps a process's own rows have a smaller amax.
  assert any(own < glob for log in logs
             for own, glob in zip(log["x_amax_own_rows"], log["x_amax_global_batch"]))
  assert logs[0]["losses"] == logs[1]["losses"]


def test_launcher_forwards_every_shared_flag_to_its_workers():
  parser = example.build_parser()
  launcher = parser.parse_args(["--num-processes", "3", "--steps", "5", "--batch", "48",
                                "--mode", "jit", "--out", "somewhere"])
  shared = [dest for dest in vars(parser.parse_args([]))
            if dest not in example.LAUNCHER_ONLY + example.WORKER_ONLY]
  # Every shared flag was given a non-default value above, so a flag that the
  # launcher does not pass on would show up as the worker's default.
  assert all(getattr(launcher, dest) != parser.get_default(dest) for dest in shared)
  command = example.worker_command(
      1, "127.0.0.1:1", **{dest: getattr(launcher, dest) for dest in shared})
  worker = parser.parse_args(command[2:])
  assert {dest: getattr(worker, dest) for dest in shared} == {
      dest: getattr(launcher, dest) for dest in shared}
  assert (worker.worker, worker.cpu, worker.process_id) == (True, True, 1)


@pytest.mark.parametrize("cpu", [False, True])
def test_worker_forces_cpu_and_gloo_only_when_asked(monkeypatch, cpu):
  import jax

  class Initialized(Exception):
    pass

  def initialize(*args, **kwargs):
    raise Initialized  # stop before any training: only the configuration matters

  updates = []
  monkeypatch.setattr(jax.config, "update", lambda name, value: updates.append((name, value)))
  monkeypatch.setattr(jax.distributed, "initialize", initialize)
  args = example.build_parser().parse_args(
      ["--worker", "--process-id", "0", "--coordinator", "127.0.0.1:1"] + ["--cpu"] * cpu)
  with pytest.raises(Initialized):
    example.worker(args)
  # Without --cpu (a cluster host) JAX picks the platform, e.g. the host's GPUs.
  assert updates == ([("jax_platforms", "cpu"), ("jax_cpu_collectives_implementation", "gloo")]
                     if cpu else [])


@pytest.mark.parametrize("argv,match", [
    (["--coordinator", "10.0.0.1:12355"], "--coordinator and --process-id are for --worker"),
    (["--process-id", "1"], "--coordinator and --process-id are for --worker"),
    (["--worker", "--process-id", "0", "--coordinator", "h:1", "--timeout", "9"],
     "--timeout is the launcher's limit"),
    (["--num-processes", "2", "--batch", "33"], "--batch 33 does not split over"),
])
def test_flags_that_would_be_ignored_are_refused(capsys, argv, match):
  with pytest.raises(SystemExit):
    example.main(argv)
  assert match in capsys.readouterr().err
