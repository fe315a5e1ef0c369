"""The machine a run's numbers come from, as `compare.json` records it.

On a CPU the demo's losses depend, besides the versions and the data, on the processor:
XLA compiles each program for the host's instruction set (vector width, fused
multiply-adds, bf16 instructions), which changes float32 roundings in the last bits, and
training carries such differences on. So a recorded comparison names its processor, its
instruction-set extensions that XLA's CPU code uses, its core count and the XLA flags it
ran with; a table is reproduced exactly on the same processor with the same versions,
data and flags.
"""
from __future__ import annotations

import os
import pathlib
import platform

import jax

# The x86 extensions (as /proc/cpuinfo names them) that decide which instructions XLA's CPU
# code may use: SIMD width, FMA, bf16 and fp16 arithmetic, AMX tiles.
ISA_FLAGS = ("sse4_2", "avx", "avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
             "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8")
_CPUINFO = pathlib.Path("/proc/cpuinfo")


def describe() -> dict:
  """This process's machine.

  Returns:
    `{"device": jax's device kind ("cpu", "NVIDIA H100 80GB HBM3", ...), "cpu": the
    processor's model name, "cores": logical CPUs, "isa": the `ISA_FLAGS` it has (x86;
    [] elsewhere or where unknown), "xla_flags": $XLA_FLAGS}`.
  """
  cpu, flags = _cpuinfo()
  return {"device": jax.devices()[0].device_kind, "cpu": cpu, "cores": os.cpu_count(),
          "isa": [flag for flag in ISA_FLAGS if flag in flags],
          "xla_flags": os.environ.get("XLA_FLAGS", "")}


def summary(machine: dict) -> str:
  """`describe()`'s record in a few words, e.g. "2-core AMD EPYC CPU (AVX-512, AVX-512 BF16)"
  or "NVIDIA H100 80GB HBM3"."""
  if machine["device"] != "cpu":
    return machine["device"]
  isa = set(machine["isa"])
  features = [name for name, flag in (("AVX-512", "avx512f"), ("AVX-512 BF16", "avx512_bf16"),
                                      ("AMX", "amx_tile")) if flag in isa]
  if not features and "avx2" in isa:
    features = ["AVX2"]
  named = f" ({', '.join(features)})" if features else ""
  return f"{machine['cores']}-core {machine['cpu']} CPU{named}"


def _cpuinfo() -> tuple[str, set]:
  """(model name, flags) of the first processor in /proc/cpuinfo (Linux), else the
  platform's processor name and no flags."""
  try:
    text = _CPUINFO.read_text()
  except OSError:
    return platform.processor() or platform.machine(), set()
  fields = {}
  for line in text.splitlines():
    key, _, value = line.partition(":")
    fields.setdefault(key.strip(), value.strip())
  return (fields.get("model name") or platform.machine(), set(fields.get("flags", "").split()))
