"""Independent float64 references for the FP8 tests.

Nothing here calls fp8jax: the FP8 rounding is written out from the format
definition (sign, exponent, mantissa bits, round half to even), and the
delayed-scaling rule is a plain-Python transcription of DESIGN.md.
"""
from __future__ import annotations

import math

import numpy as np

# OCP 8-bit floating point specification (v1.0), tables for E4M3 and E5M2.
FORMAT_TABLE = {
    "e4m3": dict(max=448.0, min_normal=2.0**-6, min_subnormal=2.0**-9, mantissa_bits=3),
    "e5m2": dict(max=57344.0, min_normal=2.0**-14, min_subnormal=2.0**-16, mantissa_bits=2),
}


def round_to_fp8(values: np.ndarray, name: str) -> np.ndarray:
  """Rounds finite float64 values already inside ±max onto the FP8 grid (half to even)."""
  table = FORMAT_TABLE[name]
  a = np.abs(values)
  exponent = np.floor(np.log2(np.where(a > 0, a, 1.0)))
  exponent = np.maximum(exponent, math.log2(table["min_normal"]))
  quantum = 2.0**(exponent - table["mantissa_bits"])
  # a / quantum is exact in float64 (power-of-two divide); np.round is half-to-even.
  rounded = np.round(a / quantum) * quantum
  return np.copysign(rounded, values)


def quantize_reference(x: np.ndarray, scale: float, name: str) -> np.ndarray:
  """float64 values of saturate(x * scale) in FP8, with the product rounded to float32.

  fp8jax forms x * scale in float32. For float32 x and scale the exact product
  fits in float64 (24 + 24 bits), so rounding it to float32 reproduces the
  float32 multiply exactly; then saturate and round onto the FP8 grid.
  """
  product = (np.asarray(x, np.float64) * np.float64(np.float32(scale))).astype(np.float32)
  product = product.astype(np.float64)
  table = FORMAT_TABLE[name]
  clipped = np.clip(product, -table["max"], table["max"])
  out = np.full(clipped.shape, np.nan)
  finite = ~np.isnan(clipped)
  out[finite] = round_to_fp8(clipped[finite], name)
  return out


def simulate_delayed_scaling(amaxes, history_len, algo, margin, fp8_max):
  """Scale used at each step and history after each step, by the DESIGN.md contract.

  Returns:
    (scales_used, histories): scales_used[t] is the scale in force during step t;
    histories[t] is the history (newest first) after step t.
  """
  history = [0.0] * history_len
  scale = 1.0
  scales_used, histories = [], []
  for amax in amaxes:
    scales_used.append(scale)
    finite = math.isfinite(amax)
    history = [amax if finite else 0.0] + history[:-1]
    window = max(history) if algo == "max" else history[0]
    if finite and amax > 0 and window > 0:
      candidate = np.float32(fp8_max / 2.0**margin) / np.float32(window)
      if math.isfinite(candidate) and candidate > 0:
        scale = float(candidate)
    histories.append(list(history))
  return scales_used, histories
