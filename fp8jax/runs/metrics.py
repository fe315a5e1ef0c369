"""A run's `metrics.jsonl`: one JSON line per step, written so a killed run can resume.

A step's line holds `step`, `loss`, `lr`, `grad_norm`, `step_time_s`,
`tokens_per_s` and, in FP8, `fp8`: per FP8 layer and role the step's `amax` and
the `scale` for the next step (lists: one entry per layer for layers under
`nn.scan`). An evaluation adds a line `{"step", "val_loss"}`.
"""
from __future__ import annotations

import json
import math
import os
import pathlib

import jax
import numpy as np

import fp8jax

FILE = "metrics.jsonl"


def read(path) -> list[dict]:
  """The lines of a metrics file; a cut-off last line (a killed writer) is skipped."""
  lines = []
  for text in pathlib.Path(path).read_text().splitlines():
    if not text.strip():
      continue
    try:
      lines.append(json.loads(text))
    except json.JSONDecodeError:
      break  # only the last line can be incomplete: everything before it was flushed
  return lines


def rewrite(path, lines: list[dict]) -> None:
  """Replaces the file with `lines`, atomically (a new file, then a rename)."""
  path = pathlib.Path(path)
  temporary = path.with_name(path.name + ".tmp")
  temporary.write_text("".join(dumps(line) + "\n" for line in lines))
  os.replace(temporary, path)


def dumps(line: dict) -> str:
  """One JSON line; NaN and inf become null (strict JSON)."""
  return json.dumps(finite(line))


def finite(value):
  """`value` (nested dicts and lists) with every NaN or inf float replaced by None."""
  if isinstance(value, float) and not math.isfinite(value):
    return None
  if isinstance(value, dict):
    return {k: finite(v) for k, v in value.items()}
  if isinstance(value, list):
    return [finite(v) for v in value]
  return value


def fp8_records(fp8_state) -> dict:
  """{"<layer path>/<role>": {"amax": [...], "scale": [...]}} of a closed step's FP8 state."""
  records = {}
  metas = jax.tree_util.tree_leaves_with_path(
      fp8_state, is_leaf=lambda n: isinstance(n, fp8jax.Fp8Meta))
  for path, meta in jax.device_get(metas):
    records[_path_name(path)] = {"amax": np.ravel(meta.amax_history[..., 0]).tolist(),
                                 "scale": np.ravel(meta.scale).tolist()}
  return records


def _path_name(path) -> str:
  """'blocks/attention/attention_meta/q' for a tree path of dict keys and attributes."""
  parts = []
  for key in path:
    for attribute in ("key", "name", "idx"):
      if hasattr(key, attribute):
        parts.append(str(getattr(key, attribute)))
        break
  return "/".join(parts)
