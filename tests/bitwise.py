"""Bit-for-bit comparison of arrays and pytrees of arrays (NaNs and signed zeros included)."""
from __future__ import annotations

import jax
import numpy as np


def bits(a) -> np.ndarray:
  """`a`'s raw bits as unsigned integers of its width."""
  a = np.asarray(a)
  return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def assert_bitwise(got, want) -> None:
  """Every leaf of `got` has the shape, dtype and bits of `want`'s."""
  got_leaves, want_leaves = jax.tree.leaves(got), jax.tree.leaves(want)
  assert len(got_leaves) == len(want_leaves)
  for g, w in zip(got_leaves, want_leaves):
    assert g.shape == w.shape and g.dtype == w.dtype, (g, w)
    np.testing.assert_array_equal(bits(g), bits(w))
