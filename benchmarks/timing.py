"""Timing helpers shared by the benchmarks: warm-up, repeats, median, environment record."""
from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time

import jax


def median_seconds(fn, *args, warmup: int = 3, repeats: int = 20) -> dict:
  """Runs `fn(*args)` (a jitted function) `warmup` times, then times `repeats` calls.

  Each call is synchronised with `block_until_ready`, so a time is one whole
  step as a training loop would see it.

  Returns:
    {"median_s", "min_s", "max_s", "repeats"}.
  """
  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times),
          "repeats": repeats}


def environment() -> dict:
  """Device and software versions, recorded with every result."""
  device = jax.devices()[0]
  return {"device": getattr(device, "device_kind", str(device)), "platform": device.platform,
          "jax_version": jax.__version__, "python": platform.python_version(),
          "command": " ".join(sys.argv)}


def write_report(report: dict, path: str | None) -> None:
  """Writes `report` as JSON to `path` (creating its folder); does nothing for None."""
  if not path:
    return
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  with open(path, "w") as f:
    json.dump(report, f, indent=1)
  print(f"wrote {path}")
