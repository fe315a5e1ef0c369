"""Compile JAX functions for an H100 without a GPU ("deviceless" compile).

JAX can build an executable for a GPU target on a CPU-only machine when the CUDA
PJRT plugin and `ptxas` are installed (the `hopper` extra). This module wraps
that: a topology for one H100 SXM from the target description shipped in
`fp8jax/targets/`, argument specs placed on it, the compile, and the artefacts
people want to read (the optimized HLO and the PTX of each kernel).

Run with `JAX_PLATFORMS=cpu` (or in a process where no GPU backend is wanted):
the deviceless topology does not need the CUDA backend to be initialized.
"""
from __future__ import annotations

import contextlib
import functools
import glob
import importlib.resources
import importlib.util
import os
import shutil
import tempfile
from typing import Any, Callable, Sequence

import jax

from fp8jax import platform_guard  # noqa: F401  (the CUDA plugin must register quietly)

#: The H100 SXM target description deviceless compiles use (in `fp8jax.targets`).
H100_TARGET = "h100_sxm.txtpb"
#: A B200 target description for lowering checks only (which GEMM a program compiled for
#: Blackwell runs): the H100's with Blackwell's compute capability, SM count and name.
B200_TARGET = "b200_lowering.txtpb"


CUDA_PLUGIN_MODULES = ("jax_plugins.xla_cuda12", "jax_plugins.xla_cuda13")


def cuda_plugin_module() -> str | None:
  """The installed JAX CUDA plugin module (CUDA 12 or CUDA 13 build), or None."""
  for name in CUDA_PLUGIN_MODULES:
    try:
      if importlib.util.find_spec(name) is not None:
        return name
    except ModuleNotFoundError:  # no jax_plugins namespace at all
      return None
  return None


def deviceless_toolchain_missing() -> str | None:
  """Why a deviceless H100 compile cannot run here, or None if it can."""
  plugin = cuda_plugin_module()
  if plugin is None:
    return ("the CUDA PJRT plugin is not installed; install fp8jax's 'hopper' extra "
            "(pip install 'fp8jax[hopper]').")
  if plugin.endswith("cuda12") and not _ptxas_available():
    return ("ptxas was not found (neither the nvidia-cuda-nvcc-cu12 package nor ptxas on "
            "PATH); install fp8jax's 'hopper' extra (pip install 'fp8jax[hopper]').")
  return None


def _ptxas_available() -> bool:
  try:
    if importlib.util.find_spec("nvidia.cuda_nvcc") is not None:
      return True
  except ModuleNotFoundError:
    pass
  return shutil.which("ptxas") is not None


def h100_target_description() -> str:
  """The H100 SXM GPU target description (text protobuf) shipped with fp8jax."""
  return importlib.resources.files("fp8jax.targets").joinpath(H100_TARGET).read_text()


@functools.lru_cache(maxsize=None)
def h100_devices(count: int = 1):
  """The devices of an H100 SXM host with `count` GPUs (compile-only; nothing runs on them)."""
  from jax.experimental import topologies
  if not isinstance(count, int) or isinstance(count, bool) or not 1 <= count <= 8:
    raise ValueError(f"count={count!r} must be an int from 1 to 8 (GPUs of one H100 host).")
  missing = deviceless_toolchain_missing()
  if missing:
    raise RuntimeError(f"Cannot compile for an H100 without a GPU: {missing}")
  topology = topologies.get_topology_desc(
      "h100", "cuda", target_config=h100_target_description(), topology=f"1x1x{count}")
  return tuple(topology.devices)


@functools.lru_cache(maxsize=None)
def b200_mesh():
  """A one-device `Mesh` ("x") of a deviceless B200, for lowering checks only.

  Traced under `jax.set_mesh(b200_mesh())`, a program is compiled for compute
  capability 10.0 (`fp8jax.mesh.target.compile_target()` reads "sm_100"), so the recipes
  with `gemm="native"` take `jax.nn.scaled_matmul`. The target's memory and clock
  figures are the H100's: no basis for cost estimates.

  Returns:
    `jax.sharding.Mesh` of one compile-only B200 device, axis "x".
  """
  from jax.experimental import topologies
  from jax.sharding import Mesh
  missing = deviceless_toolchain_missing()
  if missing:
    raise RuntimeError(f"Cannot compile for a B200 without a GPU: {missing}")
  target = importlib.resources.files("fp8jax.targets").joinpath(B200_TARGET).read_text()
  topology = topologies.get_topology_desc("b200", "cuda", target_config=target,
                                          topology="1x1x1")
  return Mesh(list(topology.devices), ("x",))


def h100_mesh(**axes: int):
  """A `Mesh` of deviceless H100s, e.g. `h100_mesh(data=8)` or `h100_mesh(data=4, model=2)`.

  Place `ShapeDtypeStruct`s on it with `NamedSharding(mesh, PartitionSpec(...))`:
  `compile_for_h100` and `fp8jax.lowering.cost` keep those shardings, so the
  compiled program is what each GPU of that host would run.
  """
  import numpy as np
  from jax.sharding import Mesh
  if not axes or any(not isinstance(n, int) or isinstance(n, bool) or n < 1
                     for n in axes.values()):
    raise ValueError(f"axes={axes!r} must name at least one mesh axis with a positive int "
                     "size, e.g. h100_mesh(data=8).")
  count = int(np.prod(list(axes.values())))
  devices = np.asarray(h100_devices(count)).reshape(tuple(axes.values()))
  return Mesh(devices, tuple(axes))


def h100_spec(shape: Sequence[int], dtype) -> jax.ShapeDtypeStruct:
  """A `ShapeDtypeStruct` placed (replicated) on the deviceless H100."""
  from jax.sharding import Mesh, NamedSharding, PartitionSpec
  mesh = Mesh(list(h100_devices()), ("x",))
  return jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=NamedSharding(mesh, PartitionSpec()))


def on_h100(tree: Any) -> Any:
  """Every array / ShapeDtypeStruct leaf of `tree` as an H100 spec of its shape and dtype.

  A leaf already placed on a deviceless H100 mesh (`h100_mesh`) keeps its sharding.
  """
  def place(leaf):
    if _on_deviceless_mesh(leaf):
      return leaf
    return h100_spec(leaf.shape, leaf.dtype)

  return jax.tree.map(place, tree)


def _on_deviceless_mesh(leaf) -> bool:
  mesh = getattr(getattr(leaf, "sharding", None), "mesh", None)
  devices = getattr(mesh, "devices", None)
  if devices is None or not isinstance(leaf, jax.ShapeDtypeStruct) or not 1 <= devices.size <= 8:
    return False
  return devices.flat[0] in h100_devices(int(devices.size))


def compile_for_h100(fn: Callable, *args, compiler_options: dict | None = None,
                     dump_dir: str | None = None, static_argnums=()):
  """Lowers and compiles `jax.jit(fn)(*args)` for an H100.

  Args:
    fn: the function to compile; a jitted one keeps its donated arguments.
    *args: pytrees of arrays or `ShapeDtypeStruct`s (only shapes and dtypes are used).
    compiler_options: XLA options, e.g. {"xla_gpu_enable_triton_gemm": False}.
    dump_dir: if given, XLA writes its dumps (HLO, PTX per kernel) there.
    static_argnums: passed to `jax.jit`.

  The trace runs under `jax.set_mesh` of the arguments' H100 mesh, so fp8jax's
  kernel choices (attention's backend) are the H100's; to trace your own program
  for an H100, do the same: `with jax.set_mesh(h100_mesh(data=1)): jax.jit(f).lower(...)`.

  Returns:
    The `jax.stages.Compiled` object; `.as_text()` is the optimized HLO.
  """
  options = dict(compiler_options or {})
  if dump_dir is not None:
    options["xla_dump_to"] = dump_dir
    # A kernel XLA finds in its kernel cache (`--xla_gpu_kernel_cache_file`, if the
    # caller's XLA_FLAGS set one) is not compiled again, so its PTX would be missing
    # from the dump: every kernel is compiled here.
    options.setdefault("xla_gpu_kernel_cache_file", "")
  specs = [a if i in static_argnums else on_h100(a) for i, a in enumerate(args)]
  # Traced under the H100 mesh, the program's kernels are chosen for the H100
  # (`fp8jax.mesh.target`), not for this process's CPU.
  with jax.set_mesh(_mesh_of(specs)):
    lowered = jitted(fn, static_argnums).lower(*specs)
  with _not_written_to_persistent_cache():
    return lowered.compile(compiler_options=options)


@contextlib.contextmanager
def _not_written_to_persistent_cache():
  """Compiles within it are not written to JAX's persistent compilation cache (where one
  is set, e.g. by JAX_COMPILATION_CACHE_DIR). A deviceless executable cannot be read back
  from it: deserializing needs a GPU client, so JAX warns and compiles again, and the
  entry was time and disk spent for nothing."""
  try:  # JAX's own per-thread setting: other threads' compiles are not affected
    from jax._src import config as jax_config
    setting = jax_config.persistent_cache_min_compile_time_secs
  except (ImportError, AttributeError):  # another JAX: the entry is written, as before
    yield
    return
  with setting(float("inf")):
    yield


def jitted(fn: Callable, static_argnums=()):
  """The jitted function to lower for `fn`.

  Returns:
    `fn` itself when it is already jitted and no `static_argnums` are asked for (its
    donated and static arguments kept: a jit around it would compile the same program
    without the donations), else `jax.jit(fn, static_argnums=static_argnums)`.
  """
  if hasattr(fn, "lower") and not static_argnums:
    return fn
  return jax.jit(fn, static_argnums=static_argnums)


def _mesh_of(specs):
  """The deviceless mesh the specs are placed on (the first found), else one H100's."""
  from jax.sharding import Mesh
  for leaf in jax.tree.leaves(specs):
    if _on_deviceless_mesh(leaf):
      return leaf.sharding.mesh
  return Mesh(list(h100_devices()), ("x",))


def compile_ptx(fn: Callable, *args, compiler_options: dict | None = None) -> dict[str, str]:
  """Compiles for an H100 and returns {ptx file name: PTX text} of every kernel XLA built."""
  with tempfile.TemporaryDirectory() as dump_dir:
    compile_for_h100(fn, *args, compiler_options=compiler_options, dump_dir=dump_dir)
    return {os.path.basename(path): open(path).read()
            for path in sorted(glob.glob(os.path.join(dump_dir, "*.ptx")))}
