"""One read per state per step: a state passed to two FP8 ops without threading is refused.

Every FP8 op returns its state with this call's amaxes recorded, and that
returned state is what the next op (or the loss function's return) must carry.
Passing the *same* state to two ops keeps only one op's record: the other op's
amaxes, and so its tensor's range, are silently lost (e.g. an x amax of 2.04
recorded where the tensor reached 20.35).

Inside `fp8jax.value_and_grad` (and `accumulate_gradients`) each op notes the
amax arrays of the state it reads, per trace; reading one again in the same
trace raises `UnthreadedStateError`. Reads in different traces (the branches of
`lax.cond`, a scan body traced again) are separate uses, not a reuse.
"""
from __future__ import annotations

import contextlib
import contextvars

import jax

from fp8jax.meta import is_meta

_READS = contextvars.ContextVar("fp8jax_meta_reads", default=None)


class UnthreadedStateError(ValueError):
  """One FP8 state was given to two FP8 ops in a step; the first op's amaxes would be lost."""


@contextlib.contextmanager
def checking_threading():
  """Checks, while the enclosed code traces, that no FP8 state is read by two ops."""
  token = _READS.set([])
  try:
    yield
  finally:
    _READS.reset(token)


def check_threaded(meta, op: str, init: str = "fp8jax.init_dot_meta") -> None:
  """Notes that `op` reads `meta`; raises `UnthreadedStateError` if an op read it already.

  Only the functional ops are checked this way: Flax layers own their state and
  read it afresh on every call.

  Args:
    meta: the state an FP8 op was given (a `DotMeta`, `AttentionMeta`, ...).
    op: the op's name for the message, e.g. "fp8_dot_general".
    init: the function that makes such a state, for the message.
  """
  reads = _READS.get()
  trace = _current_trace()
  if reads is None or trace is None:
    return
  for role in jax.tree.leaves(meta, is_leaf=is_meta):
    if not is_meta(role):
      continue
    # A list, compared by identity and trace equality (trace tokens are not hashable);
    # a step holds a few hundred reads at most.
    for amax, read_in, earlier_op in reads:
      if amax is role.amax and read_in == trace:
        raise UnthreadedStateError(
            f"{op} was given an FP8 state that {earlier_op} already read in this step. Each "
            "FP8 op returns the state with its amaxes recorded: pass that returned state to "
            f"the next op (y, meta = op(..., meta)), or give each op its own state ({init} "
            "per op). Reusing the same state keeps only one op's amaxes, so the other "
            "tensor's range is lost.")
    reads.append((role.amax, trace, op))


def _current_trace():
  """A token of the trace being built (equal for the same trace), or None if unknown."""
  try:
    from jax._src import core  # no public accessor; without it nothing is checked
    return core.get_opaque_trace_state()
  except Exception:  # a private API that may change: the check is a help, never a failure
    return None
