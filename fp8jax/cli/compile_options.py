"""The options that say how `fp8jax inspect` and `fp8jax cost` compile: flags and target."""
from __future__ import annotations

from fp8jax.cli.errors import CommandError


def add_compile_options(parser) -> None:
  """--xla-defaults and --target."""
  parser.add_argument("--xla-defaults", action="store_true",
                      help="compile with XLA's default flags instead of "
                           "xla_gpu_enable_triton_gemm=False")
  parser.add_argument("--target", choices=("auto", "deviceless", "device"), default="auto",
                      help="where to compile for (default: auto)")


def check_target(target: str) -> None:
  """Raises `CommandError` when the compile target cannot be used here."""
  import jax

  from fp8jax import deviceless

  try:
    has_gpu = jax.default_backend() == "gpu"
  except RuntimeError:
    has_gpu = False
  if target == "device" and not has_gpu:
    raise CommandError(f"--target device needs a JAX GPU backend, but the default backend is "
                       f"{jax.default_backend()!r}; use --target deviceless (or auto) to compile "
                       "for an H100 without a GPU.")
  if target == "deviceless" or (target == "auto" and not has_gpu):
    missing = deviceless.deviceless_toolchain_missing()
    if missing:
      raise CommandError(f"cannot compile for an H100 without a GPU: {missing}")
