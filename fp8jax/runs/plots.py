"""Plots of a run's metrics: loss curves, and FP8 scales per layer over the steps.

matplotlib is optional (the 'examples' extra); without it the functions return
None and write nothing.
"""
from __future__ import annotations

import pathlib
import sys

import numpy as np

from fp8jax.runs import metrics


def _pyplot():
  try:
    import matplotlib  # optional (the 'examples' extra): plots are skipped without it
  except ImportError:
    return None
  if "matplotlib.pyplot" not in sys.modules:
    matplotlib.use("Agg")  # files only; a notebook that chose its backend keeps it
  import matplotlib.pyplot as plt
  return plt


def loss_curves(runs: dict, path, smooth: int = 10):
  """Training loss (moving average over `smooth` steps) and validation loss per run.

  Args:
    runs: {label: [metrics.jsonl path, ...]} (one run's files in order).
    path: the PNG to write.
  """
  plt = _pyplot()
  if plt is None:
    return None
  fig, ax = plt.subplots(figsize=(8, 4.5))
  for label, files in runs.items():
    lines = [line for f in files for line in metrics.read(f)]
    steps = np.array([line["step"] for line in lines if "loss" in line])
    losses = np.array([line["loss"] for line in lines if "loss" in line])
    if len(losses) >= smooth:
      kernel = np.ones(smooth) / smooth
      ax.plot(steps[smooth - 1:], np.convolve(losses, kernel, mode="valid"),
              label=f"{label} train")
    else:
      ax.plot(steps, losses, label=f"{label} train")
    val = [(line["step"], line["val_loss"]) for line in lines if "val_loss" in line]
    if val:
      ax.plot(*zip(*val), "o--", label=f"{label} val")
  ax.set_xlabel("step")
  ax.set_ylabel("cross-entropy (nats per byte)")
  ax.set_title(f"training loss ({smooth}-step moving average)")
  ax.grid(alpha=0.3)
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return pathlib.Path(path)


def scale_rows(fp8_record: dict) -> tuple[list[str], list[float]]:
  """The rows of one logged step's FP8 scales (`metrics.fp8_records`): (labels, scales).

  A row per role, and per layer of `nn.scan` and per expert where the scale has those
  axes: "blocks/mlp/w_in_meta/kernel [layer 1, expert 3]". A record written without its
  `shape` numbers its entries instead.
  """
  names, values = [], []
  for name, record in fp8_record.items():
    scales = record["scale"]
    shape = record.get("shape", [len(scales)] if len(scales) > 1 else [])
    for index in np.ndindex(*shape):
      where = ", ".join(f"{axis} {i}" for axis, i in zip(
          ("layer", "expert") if "shape" in record else ("entry",), index))
      names.append(f"{name} [{where}]" if where else name)
    values += scales
  return names, values


def scale_heatmap(metrics_path, path, title: str = "FP8 scales"):
  """log2 of every FP8 role's scale (rows: layer and role) over the steps (columns)."""
  plt = _pyplot()
  if plt is None:
    return None
  lines = [line for line in metrics.read(metrics_path) if "fp8" in line]
  if not lines:
    return None
  names = scale_rows(lines[0]["fp8"])[0]
  grid = np.array([scale_rows(line["fp8"])[1] for line in lines]).T
  fig, ax = plt.subplots(figsize=(9, max(3.0, 0.18 * len(names) + 1.5)))
  image = ax.imshow(np.log2(grid), aspect="auto", interpolation="nearest", cmap="viridis",
                    extent=(lines[0]["step"] - 0.5, lines[-1]["step"] + 0.5, len(names) - 0.5,
                            -0.5))
  ax.set_yticks(range(len(names)))
  ax.set_yticklabels(names, fontsize=6)
  ax.set_xlabel("step")
  ax.set_title(title)
  fig.colorbar(image, ax=ax, label="log2(scale)")
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return pathlib.Path(path)


# Fractions at or below this are drawn as it: zero has no logarithm.
NUMERICS_FLOOR = 1e-6


def numerics_heatmaps(runs: dict, path):
  """Saturated and underflow (flushed + subnormal) fractions per layer over the steps.

  One row of two heatmaps per run (left: saturated, right: underflow): a row per
  FP8 layer and role that tensor telemetry measured (x and kernel of each
  projection; "[i]" is the layer under `nn.scan`), a column per logging step,
  coloured by log10 of the fraction (at most `NUMERICS_FLOOR` shows as it).

  Args:
    runs: {label: metrics.jsonl path} of FP8 runs with "telemetry" lines.
    path: the PNG to write.

  Returns:
    The path, or None without matplotlib or telemetry.
  """
  plt = _pyplot()
  tables = {label: _numerics_table(metrics_path) for label, metrics_path in runs.items()}
  tables = {label: table for label, table in tables.items() if table is not None}
  if plt is None or not tables:
    return None
  heights = [0.09 * len(table[1]) + 1.0 for table in tables.values()]
  fig, axes = plt.subplots(len(tables), 2, figsize=(12, sum(heights) + 0.5), squeeze=False,
                           sharey="row", gridspec_kw={"height_ratios": heights},
                           layout="constrained")
  floor = np.log10(NUMERICS_FLOOR)
  for row, (label, (steps, names, saturated, underflow)) in zip(axes, tables.items()):
    for ax, values, what in ((row[0], saturated, "saturated"),
                             (row[1], underflow, "underflow (flushed + subnormal)")):
      image = ax.imshow(np.log10(np.maximum(values, NUMERICS_FLOOR)), aspect="auto",
                        interpolation="nearest", cmap="magma", vmin=floor, vmax=0.0)
      ax.set_xticks(range(len(steps)))
      ax.set_xticklabels(steps, fontsize=6)
      if ax is row[0]:  # the right panel shares the rows
        ax.set_yticks(range(len(names)))
        ax.set_yticklabels(names, fontsize=5)
      ax.set_title(f"{label}: {what}", fontsize=8)
      ax.set_xlabel("step", fontsize=7)
  fig.colorbar(image, ax=axes, label=f"log10(fraction), floor {NUMERICS_FLOOR:g}",
               fraction=0.02, pad=0.01, shrink=min(1.0, 6.0 / sum(heights)))
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return pathlib.Path(path)


def _numerics_table(metrics_path):
  """(steps, row names, saturated [rows, steps], underflow [rows, steps]) or None."""
  lines = [line for line in metrics.read(metrics_path) if "telemetry" in line]
  if not lines:
    return None
  names, saturated, underflow = [], [], []
  for key, record in lines[0]["telemetry"].items():
    if "saturated" not in record:
      continue  # a role without tensor stats (the gradients, attention)
    label = key.removeprefix("blocks/")
    for i in range(len(record["saturated"])):
      names.append(label if len(record["saturated"]) == 1 else f"{label} [{i}]")
      saturated.append([_number(line["telemetry"][key]["saturated"][i]) for line in lines])
      underflow.append([_number(line["telemetry"][key]["flushed"][i]) +
                        _number(line["telemetry"][key]["subnormal"][i]) for line in lines])
  if not names:
    return None
  return [line["step"] for line in lines], names, np.array(saturated), np.array(underflow)


def _number(value) -> float:
  return np.nan if value is None else float(value)
