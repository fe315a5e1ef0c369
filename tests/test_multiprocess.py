"""Two processes (jax.distributed over loopback) train the FP8 MLP to identical states.

The test launches examples/train_multiprocess.py, which starts both workers,
kills them all if one fails or the time limit passes, and writes each
process's parameters and FP8 state. Here they are compared bit for bit, and
the recorded amaxes are checked against the global batch (independent of the
library): a process-local amax would be the amax of that process's rows only.
"""
from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "train_multiprocess.py"


@pytest.mark.multidevice
def test_two_processes_end_with_identical_params_and_global_fp8_state(tmp_path):
  proc = subprocess.run(
      [sys.executable, str(SCRIPT), "--num-processes", "2", "--steps", "8",
       "--timeout", "200", "--out", str(tmp_path)],
      cwd=ROOT, capture_output=True, text=True, timeout=260)
  assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
  assert "identical on all processes: True" in proc.stdout

  saved = [np.load(tmp_path / f"process_{i}.npz") for i in range(2)]
  assert any("fp8_state" in key for key in saved[0].files)
  assert set(saved[0].files) == set(saved[1].files)
  for key in saved[0].files:
    np.testing.assert_array_equal(saved[0][key], saved[1][key], err_msg=key)

  logs = [json.loads((tmp_path / f"process_{i}.json").read_text()) for i in range(2)]
  assert [log["process_index"] for log in logs] == [0, 1]
  assert all(log["devices"] == 2 for log in logs)
  for log in logs:
    # Exact: the max over both processes' rows is the max of the global batch.
    assert log["x_amax_recorded"] == log["x_amax_global_batch"]
    assert np.all(np.isfinite(log["losses"]))
  # The check has teeth: on some steps a process's own rows have a smaller amax.
  assert any(own < glob for log in logs
             for own, glob in zip(log["x_amax_own_rows"], log["x_amax_global_batch"]))
  assert logs[0]["losses"] == logs[1]["losses"]
