"""The platform a trace is compiled for: the context mesh's devices, else this process's.

A program's kernels are chosen while JAX traces it, and a trace does not see the
devices its arguments sit on. What it does see is the mesh set with `jax.set_mesh`
(JAX puts it in the trace context and the jit cache key): its abstract device names
the platform and device kind. So a program traced under
`jax.set_mesh(fp8jax.deviceless.h100_mesh(data=1))` is traced for an H100 even on a
CPU-only machine, and `fp8jax.deviceless.compile_for_h100` (hence `fp8jax cost`,
`fp8jax inspect`) does exactly that. Without such a mesh, the target is this
process's default backend and its first device.

    target = compile_target()   # CompileTarget(platform="gpu", gpu_arch="sm_90",
                                #               compile_only=True) under a deviceless mesh
"""
from __future__ import annotations

import dataclasses

import jax

# Device kinds (`jax.Device.device_kind`) of the GPUs whose architecture a deviceless
# compile may target; matched as substrings, most specific first.
_ARCH_OF_KIND = (("GH200", "sm_90"), ("H100", "sm_90"), ("H200", "sm_90"),
                 ("H800", "sm_90"), ("H20", "sm_90"), ("A100", "sm_80"), ("A800", "sm_80"),
                 ("L40", "sm_89"), ("L4", "sm_89"), ("B200", "sm_100"), ("GB200", "sm_100"))


@dataclasses.dataclass(frozen=True)
class CompileTarget:
  """What the current trace is compiled for.

  Attributes:
    platform: "cpu", "gpu" or "tpu".
    gpu_arch: e.g. "sm_90" for a Hopper GPU; None elsewhere or when unknown.
    compile_only: the target is a GPU but this process has none (a deviceless
      compile): nothing will run here, and what needs a GPU to compile (cuDNN's
      fused attention) cannot be built.
  """

  platform: str
  gpu_arch: str | None
  compile_only: bool


def gpu_arch_of_kind(device_kind: str) -> str | None:
  """"sm_90" for "NVIDIA H100 80GB HBM3" (and the other known kinds); None if unknown."""
  for name, arch in _ARCH_OF_KIND:
    if name in device_kind:
      return arch
  return None


def compile_target() -> CompileTarget:
  """The `CompileTarget` of the current trace (see the module docstring)."""
  process = _process_platform()
  device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
  if device is None or device.platform == process:
    return CompileTarget(process, _process_gpu_arch() if process == "gpu" else None, False)
  arch = gpu_arch_of_kind(device.device_kind) if device.platform == "gpu" else None
  return CompileTarget(device.platform, arch, True)


def _process_platform() -> str:
  try:
    return jax.default_backend()
  except RuntimeError:  # no backend could start
    return "cpu"


def _process_gpu_arch() -> str | None:
  capability = getattr(jax.devices()[0], "compute_capability", None)
  return "sm_" + str(capability).replace(".", "") if capability else None
