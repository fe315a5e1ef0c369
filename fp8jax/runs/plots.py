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
    import matplotlib
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


def scale_heatmap(metrics_path, path, title: str = "FP8 scales"):
  """log2 of every FP8 role's scale (rows: layer and role) over the steps (columns)."""
  plt = _pyplot()
  if plt is None:
    return None
  lines = [line for line in metrics.read(metrics_path) if "fp8" in line]
  if not lines:
    return None
  names = []
  for name, record in lines[0]["fp8"].items():
    names += [name] if len(record["scale"]) == 1 else [
        f"{name}[{i}]" for i in range(len(record["scale"]))]
  grid = np.array([[s for record in line["fp8"].values() for s in record["scale"]]
                   for line in lines]).T
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
