"""Compiles a function for Hopper and collects the optimized HLO and the PTX.

Two targets:
* "deviceless": an H100 SXM (sm_90a) topology built on this machine, no GPU
  needed (`fp8jax.deviceless`, the 'hopper' extra). XLA does not autotune here,
  so where autotuning would choose (Triton GEMM configs vs cuBLAS), the result
  is XLA's untuned default; with `xla_gpu_enable_triton_gemm=False` there is
  nothing to choose and the deviceless GEMMs are what a GPU runs.
* "device": the local GPU (when JAX has a GPU backend), autotuning included.
"auto" takes "device" when JAX's default backend is a GPU, else "deviceless".
"""
from __future__ import annotations

import dataclasses
import glob
import os
import tempfile
from typing import Any, Callable, Sequence

import jax

from fp8jax import deviceless

TARGETS = ("auto", "deviceless", "device")


@dataclasses.dataclass(frozen=True)
class CompiledText:
  """What a compile produced: the optimized HLO, the PTX files, and the target's name."""

  hlo: str
  ptx: dict[str, str]
  target: str


def compile_text(fn: Callable, *args, compiler_options: dict | None = None,
                 target: str = "auto", static_argnums: Sequence[int] = (),
                 collect_ptx: bool = True) -> CompiledText:
  """Compiles `jax.jit(fn)(*args)` for Hopper and returns its HLO and PTX.

  Args:
    fn: the function (jitted or not).
    *args: pytrees of arrays or `jax.ShapeDtypeStruct`s; only shapes and dtypes
      are used, nothing runs.
    compiler_options: XLA options, e.g. {"xla_gpu_enable_triton_gemm": False}.
    target: "auto", "deviceless" or "device" (see the module docstring).
    static_argnums: arguments passed to `jax.jit` as static.
    collect_ptx: also dump and return the PTX of every kernel XLA generated.

  Returns:
    A `CompiledText`.
  """
  options = dict(compiler_options or {})
  with tempfile.TemporaryDirectory(prefix="fp8jax-lowering-") as dump_dir:
    compiled, name = compile_program(fn, *args, compiler_options=options, target=target,
                                     static_argnums=static_argnums,
                                     dump_dir=dump_dir if collect_ptx else None)
    ptx = {}
    if collect_ptx:
      for path in sorted(glob.glob(os.path.join(dump_dir, "*.ptx"))):
        with open(path) as f:
          ptx[os.path.basename(path)] = f.read()
    return CompiledText(hlo=compiled.as_text(), ptx=ptx, target=name)


def compile_program(fn: Callable, *args, compiler_options: dict | None = None,
                    target: str = "auto", static_argnums: Sequence[int] = (),
                    dump_dir: str | None = None) -> tuple[Any, str]:
  """Compiles `jax.jit(fn)(*args)` for Hopper (a jitted `fn` as it is, donations kept).

  Args:
    fn, args, compiler_options, target, static_argnums: as for `compile_text`.
    dump_dir: if given, XLA writes its dumps (HLO, PTX per kernel) there.

  Returns:
    (the `jax.stages.Compiled`, the target's name): `.as_text()` is the optimized HLO,
    `.memory_analysis()` the device memory it needs.
  """
  if target not in TARGETS:
    raise ValueError(f"target={target!r} is not one of {TARGETS}.")
  static_argnums = tuple(static_argnums)
  for i, arg in enumerate(args):
    if i not in static_argnums:
      _check_arg(arg, i)
  if target == "auto":
    target = "device" if _has_gpu_backend() else "deviceless"
  if target == "device" and not _has_gpu_backend():
    raise RuntimeError(
        f"target='device' needs a JAX GPU backend, but the default backend is "
        f"{jax.default_backend()!r}. Use target='deviceless' to compile for an H100 "
        "without a GPU.")
  options = dict(compiler_options or {})
  if target == "deviceless":
    missing = deviceless.deviceless_toolchain_missing()
    if missing:
      raise RuntimeError(f"Cannot compile for an H100 without a GPU: {missing}")
    compiled = deviceless.compile_for_h100(fn, *args, compiler_options=options,
                                           dump_dir=dump_dir, static_argnums=static_argnums)
    return compiled, "H100 SXM, sm_90a (deviceless compile)"
  if dump_dir is not None:
    options["xla_dump_to"] = dump_dir
    options.setdefault("xla_gpu_kernel_cache_file", "")  # as compile_for_h100: every PTX
  specs = [a if i in static_argnums else _plain_specs(a) for i, a in enumerate(args)]
  compiled = deviceless.jitted(fn, static_argnums).lower(*specs).compile(
      compiler_options=options)
  device = jax.devices()[0]
  return compiled, f"{device.device_kind} (local {device.platform} device)"


def _has_gpu_backend() -> bool:
  try:
    return jax.default_backend() == "gpu"
  except RuntimeError:
    return False


def _plain_specs(tree: Any) -> Any:
  return jax.tree.map(lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype), tree)


def _check_arg(arg: Any, index: int) -> None:
  for path, leaf in jax.tree_util.tree_leaves_with_path(arg):
    if not (hasattr(leaf, "shape") and hasattr(leaf, "dtype")):
      where = f"args[{index}]{jax.tree_util.keystr(path)}"
      raise TypeError(
          f"{where} is a {type(leaf).__name__} ({leaf!r}); every leaf must be an array or a "
          "jax.ShapeDtypeStruct. Close over Python values with functools.partial, or pass "
          "static_argnums for arguments that are static.")
