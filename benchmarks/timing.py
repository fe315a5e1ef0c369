"""Timing helpers shared by the benchmarks: warm-up, repeats, median, environment record."""
from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time

import jax


def median_seconds(fn, *args, warmup: int = 3, repeats: int = 20, calls_per_sample: int = 1) -> dict:
  """Seconds per call of `fn(*args)` (a jitted function): median over `repeats` samples.

  Each sample issues `calls_per_sample` calls back to back and waits for the last
  one, as a training loop does: with more than one call per sample, host dispatch
  overlaps device work, so the time is the device's, not the launcher's.

  Returns:
    {"median_s", "min_s", "max_s", "repeats", "calls_per_sample"}, per call.
  """
  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    for _ in range(calls_per_sample):
      out = fn(*args)
    jax.block_until_ready(out)
    times.append((time.perf_counter() - start) / calls_per_sample)
  return {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times),
          "repeats": repeats, "calls_per_sample": calls_per_sample}


def environment() -> dict:
  """Device and software versions, and the command line, recorded with every result."""
  device = jax.devices()[0]
  script = os.path.splitext(os.path.basename(sys.argv[0]))[0]
  return {"device": getattr(device, "device_kind", str(device)), "platform": device.platform,
          "jax_version": jax.__version__, "python": platform.python_version(),
          "command": " ".join([f"python -m benchmarks.{script}", *sys.argv[1:]])}


def write_report(report: dict, path: str | None) -> None:
  """Writes `report` as JSON to `path` (creating its folder); does nothing for None."""
  if not path:
    return
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  with open(path, "w") as f:
    json.dump(report, f, indent=1)
  print(f"wrote {path}")
