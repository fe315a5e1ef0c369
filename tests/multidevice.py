"""The mesh tests: every test process has 8 CPU devices.

tests/conftest.py gives each test process (each pytest-xdist worker) 8 host CPU devices
before JAX starts (`jax_num_cpu_devices`), so the mesh tests run in the workers beside
the other tests. A test that needs the devices is marked with `multidevice`
(`pytest -m multidevice` selects them); in a process that has fewer (an XLA_FLAGS of its
own that sets the device count) it is skipped and says why.
"""
import jax
import pytest

N_DEVICES = 8


def multidevice(test):
  """Marks `test` as a mesh test that needs 8 devices."""
  enough = pytest.mark.skipif(
      jax.device_count() < N_DEVICES,
      reason=f"needs {N_DEVICES} devices: tests/conftest.py gives each test process 8 CPU "
             "devices unless XLA_FLAGS sets --xla_force_host_platform_device_count")
  return pytest.mark.multidevice(enough(test))
