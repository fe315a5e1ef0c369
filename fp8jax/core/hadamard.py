"""The Sylvester-Hadamard matrix, the transform behind NVFP4's wgrad rows and FP8
attention's rotation."""
from __future__ import annotations

import numpy as np


def sylvester_hadamard(n: int) -> np.ndarray:
  """float32 [n, n] with entries +-1 and orthogonal rows (H H^T = n I); n a power of two."""
  if n < 1 or n & (n - 1):
    raise ValueError(f"n={n}: a Sylvester-Hadamard matrix's size is a power of two.")
  h = np.ones((1, 1), np.float32)
  while h.shape[0] < n:
    h = np.block([[h, h], [h, -h]])
  return h
