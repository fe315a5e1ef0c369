"""Per-shard attention kernels: each device attends over its own batch rows and heads.

XLA cannot look inside a fused attention kernel, so by itself it gathers q, k
and v whole to every device and runs the kernel on the global batch there.
Attention is independent across batch rows and across heads (a kv head with
the query heads that share it), so `shard_local_attention` wraps a kernel in
`jax.experimental.custom_partitioning` with that rule:

* the batch axis keeps q's batch sharding (data parallel), the head axis keeps
  q's head sharding (tensor parallel), where it divides both the query and the
  kv heads: a contiguous block of query heads then meets exactly the kv heads
  it shares (query head i uses kv head i // group);
* the sequence and head_dim axes are gathered if they were split (a kernel row
  needs every key);
* an "amax" output is made global by a max over the mesh axes used: bit for
  bit the single-device amax.

Layouts name each array's axes by letter: "bshd" (q, the output, its
gradient), "btkd" (k, v), "bs" / "bt" (segment ids), "bhs" (row statistics
such as the log-sum-exp), "" (a replicated scalar); outputs may also be
"amax". An argument given as None (no segment ids) is left out of the call.
"""
from __future__ import annotations

import functools
from typing import Callable, Sequence

import jax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec

from fp8jax.kernel_partitioning import define_rules, axis_names

LAYOUTS = ("bshd", "btkd", "bs", "bt", "bhs", "")
OUTPUT_LAYOUTS = LAYOUTS + ("amax",)


def shard_local_attention(kernel: Callable, operands: Sequence[str],
                          outputs: Sequence[str]) -> Callable:
  """`kernel(*arrays) -> tuple`, run by each device on its batch rows and heads.

  Args:
    kernel: the attention kernel; argument i has layout `operands[i]`, output
      j layout `outputs[j]` (see the module docstring). operands[0] is q.
    operands: one of LAYOUTS per argument.
    outputs: one of OUTPUT_LAYOUTS per output.

  Returns:
    `call(*args)` with `kernel`'s arguments, where any may be None (left out).
  """
  operands, outputs = tuple(operands), tuple(outputs)
  for name, given, allowed in (("operands", operands, LAYOUTS),
                               ("outputs", outputs, OUTPUT_LAYOUTS)):
    unknown = [layout for layout in given if layout not in allowed]
    if unknown:
      raise ValueError(f"{name}={given!r}: {unknown} are not among {allowed}.")
  if operands[:1] != ("bshd",) or "btkd" not in operands:
    raise ValueError(f"operands={operands!r}: the first must be q ('bshd') and one must be "
                     "k or v ('btkd').")

  @functools.lru_cache(maxsize=None)
  def partitioned_for(present: tuple[bool, ...]):
    layouts = tuple(layout for layout, here in zip(operands, present) if here)

    def run(*arrays):
      it = iter(arrays)
      return tuple(kernel(*(next(it) if here else None for here in present)))

    def partition(mesh, arg_shapes, result_shape):
      batch, heads = _plan(mesh, arg_shapes, layouts)
      used = axis_names(batch) + axis_names(heads)

      def lower_fn(*arrays):
        results = list(run(*arrays))
        for i, layout in enumerate(outputs):
          if layout == "amax" and used:
            results[i] = jax.lax.pmax(results[i], used)
        return tuple(results)

      return (mesh, lower_fn, _shardings(mesh, outputs, batch, heads),
              _shardings(mesh, layouts, batch, heads))

    def infer_sharding_from_operands(mesh, arg_shapes, result_shape):
      return _shardings(mesh, outputs, *_plan(mesh, arg_shapes, layouts))

    rule = f"{', '.join(_factors(l) for l in layouts)} -> " \
           f"{', '.join(_factors(l) for l in outputs)}"
    return define_rules(custom_partitioning(run), partition, infer_sharding_from_operands, rule)

  @functools.wraps(kernel)
  def call(*args):
    if len(args) != len(operands):
      raise TypeError(f"{kernel.__name__} takes {len(operands)} arguments, got {len(args)}.")
    present = tuple(arg is not None for arg in args)
    return partitioned_for(present)(*(arg for arg in args if arg is not None))

  return call


def _factors(layout: str) -> str:
  """Shardy's factors of one layout: 'bshd' -> 'b s h d'; scalars have none."""
  return " ".join("" if layout == "amax" else layout)


def _plan(mesh, arg_shapes, layouts) -> tuple:
  """(batch, heads): the mesh axes (a PartitionSpec entry) that split each, from q's sharding."""
  q = arg_shapes[0]
  kv_heads = arg_shapes[layouts.index("btkd")].shape[2]
  spec = tuple(getattr(q.sharding, "spec", None) or ()) + (None,) * 4
  batch = spec[0] if _divides(mesh, spec[0], q.shape[0]) else None
  heads = spec[2]
  if (not _divides(mesh, heads, q.shape[2]) or not _divides(mesh, heads, kv_heads)
      or set(axis_names(heads)) & set(axis_names(batch))):
    heads = None
  return batch, heads


def _divides(mesh, entry, size: int) -> bool:
  ways = 1
  for name in axis_names(entry):
    ways *= mesh.shape[name]
  return size % ways == 0


def _shardings(mesh, layouts, batch, heads) -> tuple:
  axis_of = {"b": batch, "h": heads, "k": heads}
  return tuple(
      NamedSharding(mesh, PartitionSpec(*(axis_of.get(letter) for letter in
                                          ("" if layout == "amax" else layout))))
      for layout in layouts)
