"""Running a test file's mesh tests on 8 CPU devices, in a subprocess.

The devices of a process are fixed when JAX starts, so a file with mesh tests marks
them `multidevice` and has one launcher test that reruns the file with
`--xla_force_host_platform_device_count=8`; there the mesh tests run and the
launcher skips.
"""
import os
import pathlib
import re
import subprocess
import sys

import jax
import pytest

N_DEVICES = 8
ROOT = pathlib.Path(__file__).resolve().parents[1]

multidevice = pytest.mark.skipif(
    jax.device_count() < N_DEVICES,
    reason="needs 8 devices; run by the file's 8-device subprocess launcher")


def run_mesh_tests_in_subprocess(test_file: str, n_mesh_tests: int) -> None:
  """Reruns `test_file` on 8 CPU devices; asserts its `n_mesh_tests` all passed there."""
  if jax.device_count() >= N_DEVICES:
    pytest.skip("this is the 8-device run")
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") +
                        f" --xla_force_host_platform_device_count={N_DEVICES}").strip())
  # -n 0: one process with its 8 devices, not a worker per core of its own.
  proc = subprocess.run(
      [sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider",
       str(test_file)],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
  assert proc.returncode == 0, proc.stdout[-8000:] + proc.stderr[-3000:]
  summary = proc.stdout.strip().splitlines()[-1]
  # The mesh tests ran there, none skipped.
  assert re.search(rf"(^|\D){n_mesh_tests} passed", summary), summary
