"""Test defaults: CPU only, unless the environment says otherwise; one scratch directory per run."""
import gc
import os
import shutil
import tempfile
import warnings

import pytest

import run_once
from run_once import RUN_DIR

# Before jax is imported anywhere: tests run on the CPU backend; deviceless H100
# compiles do not need a GPU backend.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# XLA's CPU client runs programs on a pool of one thread per core unless PJRT_NPROC says
# otherwise. Mosaic GPU's interpreter runs each kernel thread (warpgroup) as a program
# that blocks in barrier callbacks until the others arrive, beside the program of the
# kernel call that waits for them all: on 2 cores a pool of 2 can hold the waiting call
# and one blocked thread while the threads they wait for queue behind them, for ever
# (seen as a hung FP8 attention test, about 1 run in 10 under load). At least 8 threads
# (one per core on a larger machine), unless PJRT_NPROC is set, cover a call and its
# producer and consumer warpgroups with room to spare.
os.environ.setdefault("PJRT_NPROC", str(max(8, os.cpu_count() or 1)))

# A directory for the whole run (`RUN_DIR`, from run_once.py, which uses it): the
# pytest-xdist workers and the processes tests start inherit it in their environment,
# and the process that made it removes it.
_MADE_RUN_DIR = pytest.StashKey[str]()


def pytest_configure(config):
  # The first process of a run (the xdist controller, or the only one) makes it, before
  # any worker starts and before jax is imported.
  if not os.environ.get(RUN_DIR):
    run_dir = tempfile.mkdtemp(prefix="fp8jax-test-run-")
    os.environ[RUN_DIR] = run_dir
    config.stash[_MADE_RUN_DIR] = run_dir
    # JAX's persistent compilation cache, within this run only: a program compiled by one
    # worker or test subprocess (the demo GPT's steps, the CLI runs), or by an earlier
    # test file of the same worker (whose in-memory caches are dropped after each file),
    # is loaded instead. Every program is written, not only those that took 1 s (JAX's
    # default): the seven files that train the tiny GPT took 3m27s instead of 3m51s.
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(run_dir, "jax_cache"))
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
  # Every test process has 8 CPU devices, so the mesh tests (multidevice.py) run in the
  # workers beside the others instead of in an 8-device process per file. Set here, after
  # the environment above and before any backend starts; processes the tests start keep
  # one device unless they ask for more. An XLA_FLAGS device count of the caller's wins.
  import jax
  if not _caller_sets_device_count():
    from multidevice import N_DEVICES
    jax.config.update("jax_num_cpu_devices", N_DEVICES)


def _caller_sets_device_count() -> bool:
  return "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", "")


@pytest.fixture(scope="session", autouse=True)
def interpreter_compiles_each_thread_program_once():
  """Mosaic GPU's CPU interpreter without its repeated compiles (interpreter_compile_once.py)."""
  import interpreter_compile_once
  if not interpreter_compile_once.install():
    warnings.warn("this JAX's Mosaic GPU interpreter is not the form tests/"
                  "interpreter_compile_once.py knows: the interpreter tests compile each "
                  "thread's program per thread and CTA (several times slower)")


def pytest_collection_modifyitems(config, items):
  # A test that takes the Hopper GPU is a GPU test, marked or not: the GPU check runs it.
  for item in items:
    if "hopper_device" in getattr(item, "fixturenames", ()):
      item.add_marker(pytest.mark.gpu)
  # The files whose tests share run-wide work (run_once.shared) run first. worksteal lets
  # an idle worker take the end of the other's queue, so such a file there could be
  # split, and the worker holding its later tests would wait, idle, while the other does
  # the shared work (the sweep: 20 s, seen at the end of a run). Otherwise order is kept.
  items.sort(key=lambda item: not _shares_run_wide_work(getattr(item, "module", None)))


def _shares_run_wide_work(module) -> bool:
  """Whether a test file uses run_once.shared (imported by name or with its module)."""
  return (getattr(module, "shared", None) is run_once.shared
          or getattr(module, "run_once", None) is run_once)


def pytest_collection_finish(session):
  # Python's cyclic garbage collector ran about 3,800 times in 70 s of tests and took
  # 6 to 7 s of it (9%): each full pass walks the whole heap, most of it the modules
  # imported at collection (jax, flax, every test file), which are never garbage. What
  # exists now is moved out of its view for good (gc.freeze: never collected, so what
  # collection made and a later file drops stays in memory), and a pass starts after
  # 50,000 new objects instead of 700 (JAX makes tens of thousands per trace): 1.1 s in
  # 635 passes, the same peak memory (1.1 GB), measured on 12 test files in one process
  # on Python 3.11; the whole suite took 9m16s instead of 10m22s. Each file still ends
  # with a full collection of the rest (below).
  gc.collect()
  gc.freeze()
  gc.set_threshold(50_000, 20, 100)


@pytest.fixture(autouse=True, scope="module")
def _jax_caches_cleared_after_each_file():
  """JAX's caches (its traces and compiled programs) are dropped when a test file ends.

  A worker runs many files and JAX keeps every program it compiled: a worker grew to
  about 5 GB, and a file then ran about 7% slower than with the earlier files' caches
  dropped (measured on 8 files in one process: 3.2 GB and 176 s against 4.9 GB and
  190 s). A later file that needs a program again compiles it again, or loads it from
  the run's persistent compilation cache.
  """
  yield
  import jax
  jax.clear_caches()
  gc.collect()


@pytest.fixture(autouse=True)
def _cpu_optimized_where_marked(request):
  """A test marked `cpu_optimized` compiles its CPU programs with XLA's defaults."""
  if request.node.get_closest_marker("cpu_optimized") is None:
    yield
    return
  import cpu_compile_fast
  with cpu_compile_fast.optimized():
    yield


def pytest_unconfigure(config):
  run_dir = config.stash.get(_MADE_RUN_DIR, None)
  if run_dir:
    del os.environ[RUN_DIR]
    shutil.rmtree(run_dir, ignore_errors=True)


def pytest_sessionstart(session):
  # Every process of a run (each worker, each pytest subprocess a test starts) compiles
  # its CPU programs for compile time (cpu_compile_fast.py) before it collects the tests;
  # FP8JAX_TEST_CPU_DEFAULT_COMPILE=1 keeps XLA's defaults, to compare.
  if os.environ.get("FP8JAX_TEST_CPU_DEFAULT_COMPILE") != "1":
    import cpu_compile_fast
    if not cpu_compile_fast.install():
      warnings.warn("this JAX's compile options are not the form tests/cpu_compile_fast.py "
                    "knows: CPU programs compile with XLA's defaults (about twice as slow)")
  # Each process's deviceless H100 compiles compile a kernel they have compiled before
  # only once (gpu_kernel_cache.py).
  import gpu_kernel_cache
  gpu_kernel_cache.install(os.path.join(os.environ[RUN_DIR], f"xla_gpu_kernels_{os.getpid()}"))
  # In CI the deviceless H100 tests must run, not skip: a missing 'hopper' extra
  # would otherwise turn every lowering and PTX proof into a silent skip. So must the
  # mesh tests, which skip in a process with fewer than 8 devices.
  if os.environ.get("CI"):
    import jax
    from multidevice import N_DEVICES
    if jax.device_count() < N_DEVICES and not _caller_sets_device_count():
      raise RuntimeError(f"CI must run the mesh tests, but this process has "
                         f"{jax.device_count()} devices, not {N_DEVICES}")
    from fp8jax.deviceless import deviceless_toolchain_missing
    missing = deviceless_toolchain_missing()
    if missing:
      raise RuntimeError(f"CI must run the deviceless H100 tests, but {missing}")


@pytest.fixture
def interpreted_kernels(monkeypatch):
  """fp8jax's fused kernels chosen on CPU too, run by the Pallas interpreter."""
  import functools

  import pallas_kernels
  from fp8jax.ops import fused_kernels
  for name in ("cast_transpose_amax_in_chain", "cast_transpose_from_amax", "close_steps",
               "running_amax", "cast_transpose_stacked", "adam_fp8_update"):
    monkeypatch.setattr(pallas_kernels, name,
                        functools.partial(getattr(pallas_kernels, name), interpret=True))
  monkeypatch.setattr(fused_kernels, "choose", lambda args, kernel, reference: kernel(*args))


@pytest.fixture
def reduced_prologues(monkeypatch) -> list:
  """The prologues (`pallas_kernels.activations.Prologue`) whose amax current scaling's
  casts reduce before casting (`fused_kernels.prologue_amax`), in the order traced."""
  from fp8jax.ops import fused_kernels
  reduced = []
  real = fused_kernels.prologue_amax

  def spy(x, prologue, inputs):
    reduced.append(prologue)
    return real(x, prologue, inputs)

  monkeypatch.setattr(fused_kernels, "prologue_amax", spy)
  return reduced


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
