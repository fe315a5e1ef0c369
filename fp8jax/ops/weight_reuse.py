"""FP8 weights quantized once per step under gradient accumulation.

Inside `fp8jax.accumulate_gradients` every microbatch sees the same parameters
and the same scales, so the FP8 copies of a kernel (with its transposed copy
and its amax) are the same for every microbatch. `accumulate_gradients`
therefore traces the loss once more, outside its microbatch loop, with
`collecting()`: each FP8 op quantizes its kernel there (the rest of that
forward pass is unused and removed by the compiler). The loop body is then
traced with `replaying(cache)`: the n-th FP8 op reuses the n-th quantization,
and only records the kernel's amax into its running amax.

A quantization is reused only for the very array it was computed from (the
same traced value, `is`, looking through the tracers of differentiation), with
the same recipe and format; anything else (a
kernel computed inside the loss, a different call order) is quantized in the
loop as usual. So an FP8 copy can never meet parameters it was not made from.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Any, NamedTuple

from fp8jax.ops.guards import current_trace

_CURRENT = contextvars.ContextVar("fp8jax_weight_cache", default=None)


class ReusedKernel(NamedTuple):
  """A kernel's FP8 copies made before its op, as the op's matrix path takes them
  (`fp8jax.ops.dot.matrix_fwd`): here, or cast before a loop over layers
  (`fp8jax.ops.stacked_weights`).

  Attributes:
    q, q_t: the FP8 kernel [K, N] and its transpose.
    amax: max|kernel|, to fold into the op's running amax; or None with `running_amax`.
    running_amax: the kernel role's new running amax itself (already folded), or None.
    scale_inv: the descale the copies were made with; None: the op's state's own.
    seed: a zeroed float32 buffer for x's cast to accumulate its amax into, or None.
  """

  q: Any
  q_t: Any
  amax: Any = None
  running_amax: Any = None
  scale_inv: Any = None
  seed: Any = None


@dataclasses.dataclass
class QuantizedKernel:
  """One kernel's quantization, and what it was computed from."""

  kernel: Any       # the array it was quantized from (compared by identity)
  recipe: Any
  fmt: Any
  arrays: ReusedKernel


@dataclasses.dataclass
class WeightCache:
  """The kernel quantizations of one traced loss, in call order.

  Attributes:
    collecting: recording (True) or reusing (False).
    trace: the trace the loss is traced in; ops traced in another (nested) one
      neither record nor reuse.
    entries: the recorded quantizations.
    position: the next entry to reuse.
  """

  collecting: bool
  trace: Any = None
  entries: list = dataclasses.field(default_factory=list)
  position: int = 0

  def applies_here(self) -> bool:
    """Whether the op being traced now is at the loss's own level (never where the trace
    cannot be told: nothing is reused then)."""
    return self.trace is not None and current_trace() == self.trace

  def add(self, kernel, meta, arrays) -> None:
    self.entries.append(QuantizedKernel(kernel, meta.recipe, meta.fmt, arrays))

  def take(self, kernel, meta) -> ReusedKernel | None:
    """The next recorded quantization if it was made from `kernel` under `meta`'s recipe."""
    if self.position >= len(self.entries):
      return None
    entry = self.entries[self.position]
    self.position += 1
    if (primal(kernel) is entry.kernel and entry.recipe == meta.recipe and
        entry.fmt == meta.fmt):
      return entry.arrays
    return None


def primal(value):
  """The array a differentiation tracer wraps (its primal), through nested ones.

  Inside `jax.grad` a parameter reaches the FP8 op wrapped in a tracer of the
  differentiation; the array underneath is the one the quantization was
  recorded from. Anything else has no `primal` and is compared as it is.
  """
  for _ in range(8):
    inner = getattr(value, "primal", None)
    if inner is None:
      return value
    value = inner
  return value


@contextlib.contextmanager
def collecting():
  """Record every FP8 kernel quantization traced inside; yields the `WeightCache`."""
  cache = WeightCache(collecting=True, trace=current_trace())
  token = _CURRENT.set(cache)
  try:
    yield cache
  finally:
    _CURRENT.reset(token)


@contextlib.contextmanager
def replaying(cache: WeightCache):
  """Reuse `cache`'s quantizations for the FP8 ops traced inside, in the same order.

  Enter it in the function being differentiated (where the loss's own ops are
  traced), not around the differentiation.
  """
  replay = WeightCache(collecting=False, trace=current_trace(), entries=cache.entries)
  token = _CURRENT.set(replay)
  try:
    yield replay
  finally:
    _CURRENT.reset(token)


def current() -> WeightCache | None:
  """The active cache, or None outside `collecting` / `replaying`."""
  return _CURRENT.get()
