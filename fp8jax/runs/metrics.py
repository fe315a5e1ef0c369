"""A run's `metrics.jsonl`: one JSON line per step, written so a killed run can resume.

A step's line holds `step`, `loss`, `lr`, `grad_norm`, `step_time_s`,
`tokens_per_s`, for an MoE model `aux_loss` (the load-balancing loss summed over the
layers; `loss` is the cross-entropy alone) and, in FP8, `fp8`: per FP8 layer and
role the step's `amax` and the `scale` for the next step (flat lists: one entry per layer
for layers under `nn.scan`, and per expert after it for the expert GEMMs' weights), and
the `shape` they were flattened from ([], [layers] or [layers, experts]).
An evaluation adds a line `{"step", "val_loss"}`.

A run with telemetry (`train(..., telemetry_every=N)`) adds at its logging
steps a line `{"step", "telemetry"}` (`telemetry_records`): per FP8 layer and
role, lists with one entry per layer of `nn.scan`, of `headroom` (every role)
and `saturated`, `flushed`, `subnormal`, `snr_db` (the forward operands x and
kernel of the projections; see `fp8jax.telemetry`).
"""
from __future__ import annotations

import json
import math
import os
import pathlib

import jax
import numpy as np

import fp8jax
from fp8jax.telemetry import TensorStats

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
                                 "scale": np.ravel(meta.scale).tolist(),
                                 "shape": list(np.shape(meta.scale))}
  return records


def telemetry_records(tensor_stats, state_stats: dict) -> dict:
  """{"<layer path>/<role>": {field: [...]}} of one logging step.

  Args:
    tensor_stats: the "fp8_telemetry" collection of a forward pass
      (`fp8jax.runs.steps.telemetry_step`): TensorStats per layer and role.
    state_stats: `fp8jax.telemetry.state_stats` of the FP8 state (MetaStats per role).

  Returns:
    Per role, "headroom" from `state_stats` and "saturated", "flushed",
    "subnormal", "snr_db" from `tensor_stats` where it has the role; the layer
    path leaves out the variable name "dot_meta", so both name a role alike,
    e.g. "blocks/mlp/up/x" (a layer called more than once: "...x@1" for its
    second call). Lists hold one value per layer under `nn.scan`.
  """
  records: dict[str, dict] = {}
  for name, stats in jax.device_get(state_stats).items():
    name = "/".join(part for part in name.split("/") if part != "dot_meta")
    records.setdefault(name, {})["headroom"] = np.ravel(stats.headroom).tolist()
  calls = jax.tree_util.tree_leaves_with_path(
      jax.device_get(tensor_stats), is_leaf=lambda n: isinstance(n, TensorStats) or (
          isinstance(n, tuple) and all(isinstance(c, TensorStats) for c in n)))
  for path, sown in calls:
    for index, stats in enumerate(sown if isinstance(sown, tuple) and not isinstance(
        sown, TensorStats) else (sown,)):
      name = _path_name(path) + (f"@{index}" if index else "")
      record = records.setdefault(name, {})
      for field in ("saturated", "flushed", "subnormal", "snr_db"):
        record[field] = np.ravel(getattr(stats, field)).tolist()
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
