"""Keeps CPU-only machines quiet when the CUDA plugin is installed.

Why this exists: the 'hopper' extra installs JAX's CUDA PJRT plugin so that
fp8jax can compile for an H100 on a machine without one. On such a machine,
the first use of any JAX backend runs the plugin's `initialize()`, which checks
the CUDA libraries; cuDNN is not part of the extra (nothing here needs it), so
the check fails and JAX logs a long "Unable to load cuDNN" traceback. Nothing
is wrong: JAX then picks the CPU. The check only matters when a GPU will run
the code.

What it does: when no NVIDIA GPU device node is visible and the user has not
asked for CUDA (JAX_PLATFORMS), it sets JAX_SKIP_CUDA_CONSTRAINTS_CHECK, the
plugin's own switch for that check. The plugin still registers (deviceless H100
compiles keep working even without JAX_PLATFORMS=cpu); JAX's backend choice is
unchanged, because JAX already skips the CUDA backend when no GPU is visible.
It must run before the first backend use; backends initialize lazily, so
importing this module after `import jax` is early enough. On a machine with a
GPU it does nothing.
"""
from __future__ import annotations

import os

# Device nodes through which JAX itself detects an NVIDIA GPU (bare metal,
# containers, WSL2).
_NVIDIA_DEVICE_NODES = ("/dev/nvidia0", "/dev/nvidiactl", "/dev/dxg")
_SKIP_CHECK = "JAX_SKIP_CUDA_CONSTRAINTS_CHECK"


def nvidia_gpu_visible() -> bool:
  """True if an NVIDIA GPU device node is present."""
  return any(os.path.exists(node) for node in _NVIDIA_DEVICE_NODES)


def cuda_requested() -> bool:
  """True if the user asked JAX for CUDA/GPU platforms (JAX_PLATFORMS or jax.config)."""
  platforms = os.environ.get("JAX_PLATFORMS", "")
  try:
    import jax
    platforms = jax.config.jax_platforms or platforms
  except (ImportError, AttributeError):
    pass
  return any(p.strip() in ("cuda", "gpu") for p in (platforms or "").split(","))


def quiet_cuda_check_without_gpu() -> bool:
  """Sets JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 when there is no GPU to check for.

  Returns:
    True if it set the variable, False if it left the environment alone (a GPU
    is visible, CUDA was requested, or the variable is already set).
  """
  if _SKIP_CHECK in os.environ or nvidia_gpu_visible() or cuda_requested():
    return False
  os.environ[_SKIP_CHECK] = "1"
  return True


quiet_cuda_check_without_gpu()
