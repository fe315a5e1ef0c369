"""Test defaults: CPU only, unless the environment says otherwise."""
import os

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
