"""The shared-memory ring of the warp-specialized Hopper kernels: producer loops, consumer pass.

Every Mosaic GPU kernel of this package has the FlashAttention-3 / DeepGEMM shape: per CTA
one producer warpgroup issues TMA copies into a ring of `stages` shared-memory slots and
compute warpgroups consume them. Step t of a CTA uses slot t % stages; the producer may
refill a slot only after every compute warpgroup has arrived on that slot's "free"
barrier(s) for the fill before.

* `stream_tiles`: the producer's loop over one fixed run of steps (a CTA = one tile).
* `stream_steps` + `drain_ring`: the same for a persistent kernel, whose CTA runs many
  work items one after another. The step count is carried across items, so the ring never
  empties between them: the copies of the next item's first steps overlap the current
  item's last products and its epilogue.
* `release_slot`: a compute warpgroup's pass over a slot it does not use.

Mosaic GPU's CPU interpreter insists that every thread that waits on a barrier observe
all of its phases; so the producer also waits for the last releases before the CTA ends
(free on hardware), and every compute warpgroup waits for every fill, used or not.
"""
from __future__ import annotations

import functools

from jax import lax
import jax.numpy as jnp

from pallas_kernels.mosaic_target import pl, plgpu


def when(condition, fn) -> None:
  """fn() where `condition` holds: a Python bool decides now, a traced one in the kernel."""
  if isinstance(condition, bool):
    if condition:
      fn()
  else:
    pl.when(condition)(fn)


def slot_of(step, stages: int):
  """The ring slot of a (traced int32) step."""
  return lax.rem(step, jnp.int32(stages))


def stream_tiles(total_steps, stages: int, issue, free_barriers) -> None:
  """The producer warpgroup's loop: `total_steps` steps through a ring of `stages` slots.

  Args:
    total_steps: steps the CTA's compute warpgroups consume (a Python int or int32).
    stages: slots in the ring.
    issue: issue(step, slot) starts the TMA copies of a step into a slot.
    free_barriers: free_barriers(slot) lists the barriers every compute warpgroup
      arrives on when it is done with a slot; all must pass before the slot is refilled.
  """
  for slot in range(stages):  # the first steps fill the empty ring (there may be fewer)
    when(slot < total_steps, functools.partial(issue, slot, slot))
  refills = (max(total_steps - stages, 0) if isinstance(total_steps, int)
             else jnp.maximum(total_steps - stages, 0))

  @pl.loop(0, refills)
  def _(step):
    for barrier in free_barriers(slot_of(step, stages)):
      plgpu.barrier_wait(barrier)
    issue(step + stages, slot_of(step, stages))

  drain_ring(total_steps, stages, free_barriers, first_unobserved=refills)


def stream_steps(first_step, num_steps, stages: int, issue, free_barriers) -> None:
  """The producer's steps of one work item of a persistent kernel.

  Args:
    first_step: the CTA's step count before this item (int32): the ring position.
    num_steps: this item's steps (a Python int or int32; 0 issues nothing).
    stages: slots in the ring.
    issue: issue(item_step, slot) starts the TMA copies of the item's step `item_step`
      (0-based within the item) into `slot`.
    free_barriers: as in `stream_tiles`.

  Call `drain_ring` with the CTA's final step count after its last item.
  """
  @pl.loop(0, num_steps)
  def _(item_step):
    step = first_step + item_step
    slot = slot_of(step, stages)

    @pl.when(step >= stages)  # the slot was filled before: wait until it is released
    def _():
      for barrier in free_barriers(slot):
        plgpu.barrier_wait(barrier)
    issue(item_step, slot)


def drain_ring(total_steps, stages: int, free_barriers, *, first_unobserved=None) -> None:
  """The producer observes the releases of the last fills, so no barrier phase is pending
  when the CTA's shared memory goes away.

  Args:
    total_steps: the CTA's step count (a Python int or int32).
    stages: slots in the ring.
    free_barriers: as in `stream_tiles`.
    first_unobserved: the first step whose release was not waited for; by default
      max(total_steps - stages, 0), as after `stream_steps`.
  """
  if first_unobserved is None:
    first_unobserved = (max(total_steps - stages, 0) if isinstance(total_steps, int)
                        else jnp.maximum(total_steps - stages, 0))

  @pl.loop(first_unobserved, total_steps)
  def _(step):
    for barrier in free_barriers(slot_of(step, stages)):
      plgpu.barrier_wait(barrier)


def release_slot(scratch, kinds, slot) -> None:
  """A compute warpgroup's pass over a slot it does not use: wait for each kind's tile, release it.

  Every warpgroup observes every phase of the ring's barriers, so skipping a step (a
  causal block only the CTA's other warpgroup needs) keeps the phases in step.
  `scratch` has `<kind>_ready` and `<kind>_free` barriers for each of `kinds`.
  """
  for kind in kinds:
    plgpu.barrier_wait(getattr(scratch, f"{kind}_ready").at[slot])
    plgpu.barrier_arrive(getattr(scratch, f"{kind}_free").at[slot])
