"""Test defaults: CPU only, unless the environment says otherwise."""
import os

import pytest

# Before jax is imported anywhere: tests run on the CPU backend; deviceless H100
# compiles do not need a GPU backend.
os.environ.setdefault("JAX_PLATFORMS", "cpu")


def pytest_sessionstart(session):
  # In CI the deviceless H100 tests must run, not skip: a missing 'hopper' extra
  # would otherwise turn every lowering and PTX proof into a silent skip.
  if os.environ.get("CI"):
    from fp8jax.deviceless import deviceless_toolchain_missing
    missing = deviceless_toolchain_missing()
    if missing:
      raise RuntimeError(f"CI must run the deviceless H100 tests, but {missing}")


@pytest.fixture
def hopper_device():
  """The first Hopper (sm_90) GPU; skips the test where there is none.

  Tests that take it are marked `gpu`: `python -m benchmarks.gpu_check` runs exactly
  those on a lent GPU (with JAX_PLATFORMS unset), and CI, which has no GPU, skips them.
  """
  import jax
  try:
    devices = jax.devices("gpu")
  except RuntimeError:
    devices = []
  hopper = [d for d in devices if str(getattr(d, "compute_capability", "")).startswith("9")]
  if not hopper:
    pytest.skip("needs a Hopper GPU; the CPU interpreter tests cover the kernels' logic")
  return hopper[0]
