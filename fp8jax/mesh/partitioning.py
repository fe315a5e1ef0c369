"""Per-shard kernels: how XLA splits fp8jax's kernels over a mesh.

XLA's SPMD partitioner cannot look inside a custom kernel, so by itself it runs
one on the whole (gathered) tensor on every device. Each rule here wraps a
kernel in `jax.experimental.custom_partitioning` so that every device runs it
on its own shard:

* `shard_local`: the cast, amax and state-update kernels (one 2-D tensor and
  scalars), below;
* `shard_local_gemm`: an FP8 GEMM with its descale, the partial products of a
  split contraction summed after it;
* `shard_local_weight_cast`: a weight cast per FSDP shard, gathered in FP8;
* `shard_local_attention`: attention kernels over batch rows and heads;
* `vmapped_as`: a batching rule for any of them (custom_partitioning has none).

`shard_local` gives the cast and amax kernels the rule they obey:

* the kernel reads one 2-D tensor `t` (any sharding of its two axes), perhaps
  more tensors sharded alike (or a value per row [R, 1], split as `t`'s rows, or
  per column [1, C], as its columns, or per row and group of 128 columns, split as `t`
  with its columns in whole groups), and small replicated operands (FP8 scales,
  running amaxes, descales, an earlier kernel's tile maxima);
* each device runs the kernel on its own shard of `t`: its tensor outputs are
  `t`'s layout ("same", sharded as `t`) or its transpose ("transposed", the
  two axes' shardings swapped), or one value per row and group of 128 columns
  ("groups", split as `t`, its columns in whole groups), so nothing is gathered (the
  qkv gradient's cast, `heads=`, writes 3 columns per column of `t`, split by the same
  whole heads);
* the amax outputs ("amax") are made global by a max over the mesh axes that
  split `t` (bit for bit the single-device amax: a max does not depend on the
  order it is taken in); so are the maxima of the kernel's tiles ("tiles", left
  for a later kernel to reduce), where `t` is split; other scalar and vector
  outputs ("scalar", "vector") come from replicated operands alone and stay
  replicated.

An axis of `t` whose size the mesh does not divide is gathered first (XLA would
pad the shard, and the padding would enter the amax). A tensor that is
replicated runs as is on every device, as the unpartitioned kernel would.

`custom_partitioning` has no batching rule: `vmapped_as` gives a partitioned
kernel one, running another function (the unpartitioned kernel, or its jnp
reference) under `jax.vmap`. The attention rule is described where it is
defined, at the end of this file.
"""
from __future__ import annotations

import functools
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
from jax.custom_batching import custom_vmap
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec

from fp8jax.core.quantize import max_by_bits
from pallas_kernels.cast_transpose_checks import broadcast_kind
from pallas_kernels.cast_transpose_tiling import GROUP_COLUMNS

OUTPUT_KINDS = ("same", "transposed", "amax", "scalar", "tiles", "vector", "groups")


def shard_local(kernel: Callable, outputs: Sequence[str], tensors: int = 1,
                row_limit: int | None = None, heads: tuple[int, int] | None = None) -> Callable:
  """`kernel(t, *scalars) -> tuple of outputs`, run by each device on its shard of `t`.

  Args:
    kernel: a function of a 2-D array (of `tensors` 2-D arrays sharded alike, each of
      t's shape, [R, 1] or [1, C]: `kernel(t, *others, *scalars)`) and replicated float32
      operands (scalars,
      or vectors such as an earlier kernel's tile maxima) returning a tuple, output i
      of kind `outputs[i]` (see the module docstring).
    outputs: one of OUTPUT_KINDS per output.
    tensors: how many leading operands are such 2-D arrays.
    row_limit: the position among `scalars` of an int32[] that counts the leading rows
      of the whole `t` in use (a grouped GEMM's rows within its groups), or None. Where
      `t`'s rows are split, each device's kernel gets the count of its own shard's rows
      (the whole count less the rows of the shards before it; negative: none).
    heads: (H, D) for the qkv output gradient's cast (`pallas_kernels.rotary_gradient`):
      t's columns are H heads of D features and the "same" and "transposed" outputs'
      columns each head's q, k and v (3 D): their columns split as t's, by whole heads
      (a split the heads do not divide is gathered first).
  """
  outputs = tuple(outputs)
  unknown = [kind for kind in outputs if kind not in OUTPUT_KINDS]
  if unknown:
    raise ValueError(f"outputs={outputs!r}: {unknown} are not among {OUTPUT_KINDS}.")
  if heads is not None and "groups" in outputs:
    raise ValueError("heads= and a \"groups\" output split t's columns in different units "
                     "(whole heads, whole groups); a kernel has one of them.")

  @functools.lru_cache(maxsize=None)
  def partitioned_for(ranks: tuple, broadcasts: tuple, whole_groups: bool):
    @custom_partitioning
    def partitioned(*operands):
      return tuple(kernel(*operands))

    # Columns split only in whole heads (the rotary gradient) or whole groups (a
    # prologue input of one value per row and group of columns).
    column_unit = (heads[1] if heads is not None else
                   GROUP_COLUMNS if "groups" in broadcasts + outputs else 1)

    def partition(mesh, arg_shapes, result_shape):
      t_spec = _divisible_spec(mesh, arg_shapes[0], column_unit)
      split_over = tuple(name for entry in t_spec for name in axis_names(entry))

      row_axes = axis_names(t_spec[0])

      def lower_fn(*operands):
        if row_limit is not None and row_axes:
          operands = list(operands)
          at = tensors + row_limit
          operands[at] = operands[at] - jax.lax.axis_index(row_axes) * operands[0].shape[0]
        return global_amaxes(kernel(*operands), outputs, split_over, result_shape)

      replicated = NamedSharding(mesh, PartitionSpec())
      arg_shardings = ((NamedSharding(mesh, t_spec),)
                       + tuple(NamedSharding(mesh, _broadcast_spec(t_spec, kind))
                               for kind in broadcasts)
                       + (replicated,) * len(ranks))
      return mesh, lower_fn, _result_shardings(mesh, t_spec, outputs), arg_shardings

    def infer_sharding_from_operands(mesh, arg_shapes, result_shape):
      return _result_shardings(mesh, _divisible_spec(mesh, arg_shapes[0], column_unit),
                               outputs)

    if whole_groups:
      # t's columns are whole groups (g) of GROUP_COLUMNS (k), and a tensor of one value
      # per row and group is split as those groups: the propagation keeps a split of t's
      # columns on them (an independent factor would be gathered), never inside a group.
      return define_rules(partitioned, partition, infer_sharding_from_operands,
                          _sharding_rule(ranks, outputs, broadcasts, columns="(g k)",
                                         groups="g"),
                          k=GROUP_COLUMNS, need_replication_factors=("k",))
    if heads is None:
      return define_rules(partitioned, partition, infer_sharding_from_operands,
                          _sharding_rule(ranks, outputs, broadcasts))
    # Heads (h) split, never a head's features (d); the outputs hold q, k, v (s) per head.
    return define_rules(partitioned, partition, infer_sharding_from_operands,
                        _sharding_rule(ranks, outputs, broadcasts, columns="(h d)",
                                       out_columns="(h s d)"),
                        h=heads[0], s=3, d=heads[1], need_replication_factors=("d",))

  @functools.wraps(kernel)
  def call(*operands):
    scalars = operands[tensors:]
    broadcasts = tuple(_broadcast_kind(jnp.shape(t), jnp.shape(operands[0]))
                       for t in operands[1:tensors])
    whole_groups = ("groups" in broadcasts + outputs
                    and jnp.shape(operands[0])[1] % GROUP_COLUMNS == 0)
    return partitioned_for(tuple(jnp.ndim(s) for s in scalars), broadcasts,
                           whole_groups)(*operands)

  return call


def global_amaxes(results, outputs, split_over: tuple, result_shapes) -> tuple:
  """A per-shard kernel's results made those of the whole tensor (split over `split_over`).

  "amax" outputs: the max over those axes. "tiles" outputs (one maximum per kernel
  tile, for a later kernel to reduce): on a shard they are the shard's tiles, not
  the whole tensor's, so their max is taken over those axes and stands for every
  tile of the result (a later max over them gives the same amax).
  """
  results = list(results)
  if not split_over:
    return tuple(results)
  shapes = result_shapes if isinstance(result_shapes, (tuple, list)) else (result_shapes,)
  for i, kind in enumerate(outputs):
    if kind == "amax":
      results[i] = jax.lax.pmax(results[i], split_over)
    elif kind == "tiles":
      whole = jax.lax.pmax(max_by_bits(results[i]), split_over)
      results[i] = jnp.broadcast_to(whole, shapes[i].shape)
  return tuple(results)


def vmapped_as(kernel: Callable, batched: Callable) -> Callable:
  """`kernel`, except under `jax.vmap`, where `batched` (same arguments and results) is
  vmapped instead. Arguments may be pytrees (None too); every result comes out batched."""
  vmappable = custom_vmap(kernel)

  @vmappable.def_vmap
  def rule(axis_size, in_batched, *args):
    in_axes = jax.tree.map(lambda is_batched: 0 if is_batched else None, in_batched)
    out = jax.vmap(batched, in_axes=tuple(in_axes), axis_size=axis_size)(*args)
    return out, jax.tree.map(lambda _: True, out)

  return vmappable


def _broadcast_kind(shape: tuple, t_shape: tuple) -> str:
  """"tile" for a further tensor of t's shape, "rows" for [R, 1], "columns" for [1, C],
  "groups" for one value per row and group of columns [R, ceil(C / GROUP_COLUMNS)]."""
  kind = broadcast_kind(shape, t_shape)
  if kind is None:
    raise ValueError(f"a further tensor of shape {tuple(shape)} neither has t's shape "
                     f"{tuple(t_shape)} nor is one value per row [R, 1], column [1, C] or "
                     f"row and group of {GROUP_COLUMNS} columns.")
  return kind


def _broadcast_spec(t_spec: PartitionSpec, kind: str) -> PartitionSpec:
  """A further tensor's spec: t's (its groups split as t's columns, in whole groups), or
  its rows' or columns' entry alone."""
  return {"tile": t_spec, "groups": t_spec, "rows": PartitionSpec(t_spec[0], None),
          "columns": PartitionSpec(None, t_spec[1])}[kind]


def _sharding_rule(ranks: tuple, outputs, broadcasts: tuple = (), columns: str = "c",
                   out_columns: str | None = None, groups: str | None = None) -> str:
  """Shardy's einsum-like rule: t (and each tensor sharded alike) is `r c` (a further
  tensor's axis of length 1 a factor of its own), scalars (operands and outputs) are
  rank 0, each vector operand and output a factor of its own (replicated in `partition`).
  `columns`, `out_columns`: the factors of t's and of the tensor outputs' columns (`c`);
  `groups`: the factor of t's columns that the per-group tensors' columns are (None: a
  factor of their own each)."""
  c, out = columns, out_columns or columns
  layout = {"same": f"r {out}", "transposed": f"{out} r", "amax": "", "scalar": "",
            "groups": f"r {groups or 'g{i}'}"}
  further = {"tile": f"r {c}", "rows": "r o{i}", "columns": "o{i} " + c,
             "groups": f"r {groups or 'o{i}'}"}
  operands = ", ".join([f"r {c}"] + [further[kind].format(i=i)
                                     for i, kind in enumerate(broadcasts)]
                       + [f"v{i}" if rank else "" for i, rank in enumerate(ranks)])
  results = ", ".join(layout.get(kind, "w{i}").format(i=i) for i, kind in enumerate(outputs))
  return f"{operands} -> {results}"


def define_rules(partitioned, partition, infer_sharding_from_operands, rule: str,
                 **rule_options):
  """Gives a `custom_partitioning` function its rules: `partition` and, for Shardy, the
  einsum-like `rule` (GSPMD, when Shardy is off, uses `infer_sharding_from_operands`)."""
  partitioned.def_partition(
      partition=partition,
      infer_sharding_from_operands=infer_sharding_from_operands,
      propagate_user_sharding=lambda mesh, user_shape: user_shape.sharding,
      sharding_rule=rule, **rule_options)
  return partitioned


def axis_names(entry) -> tuple:
  """The mesh axis names of one `PartitionSpec` entry (None, a name, or a tuple of names)."""
  if entry is None:
    return ()
  return entry if isinstance(entry, tuple) else (entry,)


def _divisible_spec(mesh, shape, column_unit: int = 1) -> PartitionSpec:
  """The 2-D spec of `shape.sharding`, with any axis the mesh does not divide evenly
  unsharded (the columns in whole blocks of `column_unit`)."""
  sharding = shape.sharding
  spec = getattr(sharding, "spec", None)
  if spec is None:
    return PartitionSpec(None, None)
  entries = list(spec) + [None] * (2 - len(spec))
  for axis, entry in enumerate(entries[:2]):
    ways = 1
    for name in axis_names(entry):
      ways *= mesh.shape[name]
    if ways > 1 and shape.shape[axis] % ((column_unit if axis == 1 else 1) * ways):
      entries[axis] = None
  return PartitionSpec(*entries[:2])


def _result_shardings(mesh, t_spec: PartitionSpec, outputs) -> tuple:
  rows, cols = tuple(t_spec) + (None,) * (2 - len(t_spec))
  specs = {"same": PartitionSpec(rows, cols), "groups": PartitionSpec(rows, cols),
           "transposed": PartitionSpec(cols, rows),
           "amax": PartitionSpec(), "scalar": PartitionSpec(), "tiles": PartitionSpec(),
           "vector": PartitionSpec()}
  return tuple(NamedSharding(mesh, specs[kind]) for kind in outputs)


def shard_local_gemm(gemm: Callable) -> Callable:
  """`gemm(qa [P, C], qb [Q, C], descale float32[]) -> [P, Q]`, run on each device's shards.

  XLA partitions a plain dot by itself, but where the contracted dim C is
  split it sums the partial products right after the dot and only then applies
  the descale: one more pass over the output, outside the cuBLASLt GEMM. Here
  the rule is that of a dot (`p c, q c -> p q`, C a reduction factor), the
  per-device body is the whole scaled GEMM, and the partial products are summed
  over the axes that split C after it (XLA turns a sum followed by a slice into
  a reduce-scatter, as for any dot).
  """

  @custom_partitioning
  def partitioned(qa, qb, descale):
    return gemm(qa, qb, descale)

  def _specs(mesh, arg_shapes):
    (p, c_a), (q, c_b) = (tuple(_divisible_spec(mesh, s)) for s in arg_shapes[:2])
    c = c_a if c_a == c_b else None
    used = set(axis_names(p))
    if used & set(axis_names(q)):
      q = None
    used |= set(axis_names(q))
    if used & set(axis_names(c)):
      c = None
    return p, q, c

  def partition(mesh, arg_shapes, result_shape):
    p, q, c = _specs(mesh, arg_shapes)
    contracted_over = axis_names(c)

    def lower_fn(qa, qb, descale):
      out = gemm(qa, qb, descale)
      return jax.lax.psum(out, contracted_over) if contracted_over else out

    arg_shardings = (NamedSharding(mesh, PartitionSpec(p, c)),
                     NamedSharding(mesh, PartitionSpec(q, c)),
                     NamedSharding(mesh, PartitionSpec()))
    return mesh, lower_fn, NamedSharding(mesh, PartitionSpec(p, q)), arg_shardings

  def infer_sharding_from_operands(mesh, arg_shapes, result_shape):
    p, q, _ = _specs(mesh, arg_shapes)
    return NamedSharding(mesh, PartitionSpec(p, q))

  define_rules(partitioned, partition, infer_sharding_from_operands, "p c, q c, -> p q",
          reduction_factors=("c",))

  @functools.wraps(gemm)
  def call(qa, qb, descale):
    return partitioned(qa, qb, descale)

  return call


def shard_local_weight_cast(cast: Callable) -> Callable:
  """`cast(w, *scalars) -> (q, q_t, amax, *scalars_out)` for a weight sharded as FSDP shards it
  (`scalars`: replicated float32 scalars or vectors).

  `amax` is of the kind `call`'s `amax_kind` says: "amax" (one float32) or "tiles"
  (the maxima of the kernel's tiles), made global as `shard_local` makes them, or
  "scalar" (computed from replicated operands alone: already global).

  Called as `call(w, x, *scalars)`: `x` is the activation the weight meets in
  its GEMM; only its sharding is read. The mesh axes that split both the
  weight and x's rows (FSDP: the data axis) are the ones the GEMMs need
  gathered. Each device casts its own shard of the weight (one pass, its amax
  made global by a max), all-gathers the FP8 copy over those axes (half the
  bytes of a bf16 gather) and transposes it locally: with `CostConstants`, a
  local transpose moves each byte through HBM at 2.7 TB/s where gathering the
  transposed copy too would send it over NVLink at 0.45 TB/s. Axes that split
  the weight but not x's rows (tensor parallelism) stay split.
  """

  def _plan(mesh, arg_shapes):
    w_spec = tuple(_divisible_spec(mesh, arg_shapes[0]))
    x_spec = getattr(arg_shapes[1].sharding, "spec", None) or PartitionSpec()
    batch_axes = set(name for entry in tuple(x_spec)[:-1] for name in axis_names(entry))
    gather = [tuple(n for n in axis_names(entry) if n in batch_axes) for entry in w_spec]
    kept = [tuple(n for n in axis_names(entry) if n not in batch_axes) or None for entry in w_spec]
    kept = [k[0] if k is not None and len(k) == 1 else k for k in kept]
    return w_spec, gather, kept

  def _results(mesh, kept, n_scalars_out):
    rows, cols = kept
    specs = (PartitionSpec(rows, cols), PartitionSpec(cols, rows)) + \
        (PartitionSpec(),) * (1 + n_scalars_out)
    return tuple(NamedSharding(mesh, s) for s in specs)

  def partition(mesh, arg_shapes, result_shape, amax_kind):
    w_spec, gather, kept = _plan(mesh, arg_shapes)
    split_over = tuple(name for entry in w_spec for name in axis_names(entry))
    kinds = ("same", "transposed", amax_kind) + ("scalar",) * (len(result_shape) - 3)

    def lower_fn(w, x, *scalars):
      del x
      q, q_t, amax, *rest = global_amaxes(cast(w, *scalars), kinds, split_over, result_shape)
      if not any(gather):
        return (q, q_t, amax, *rest)
      for axis, names in enumerate(gather):
        if names:
          q = jax.lax.all_gather(q, names, axis=axis, tiled=True)
      return (q, q.T, amax, *rest)

    arg_shardings = (NamedSharding(mesh, PartitionSpec(*w_spec)), arg_shapes[1].sharding) + \
        (NamedSharding(mesh, PartitionSpec()),) * (len(arg_shapes) - 2)
    return mesh, lower_fn, _results(mesh, kept, len(result_shape) - 3), arg_shardings

  def infer_sharding_from_operands(mesh, arg_shapes, result_shape):
    _, _, kept = _plan(mesh, arg_shapes)
    return _results(mesh, kept, len(result_shape) - 3)

  @functools.lru_cache(maxsize=None)
  def partitioned_for(ranks: tuple, n_scalars_out: int, x_rank: int, amax_kind: str):
    @custom_partitioning
    def fn(w, x, *scalars):
      del x
      return tuple(cast(w, *scalars))

    # The results' factors are their own: where they are gathered is decided
    # in `partition`, not propagated from the weight's sharding.
    # A vector operand (packed scales, `fp8jax.ops.fused_kernels.packed_scalars`) is a
    # factor of its own, replicated in `partition`.
    x_factors = " ".join(f"x{i}" for i in range(x_rank))
    operands = ", ".join(["r c", x_factors]
                         + [f"v{i}" if rank else "" for i, rank in enumerate(ranks)])
    results = ", ".join(["p q", "q p", "t" if amax_kind == "tiles" else ""]
                        + [""] * n_scalars_out)
    return define_rules(fn, functools.partial(partition, amax_kind=amax_kind),
                        infer_sharding_from_operands, f"{operands} -> {results}")

  def call(w, x, *scalars, n_scalars_out: int = 0, amax_kind: str = "amax"):
    if amax_kind not in ("amax", "tiles", "scalar"):
      raise ValueError(f"amax_kind={amax_kind!r} must be 'amax', 'tiles' or 'scalar'.")
    ranks = tuple(jnp.ndim(s) for s in scalars)
    return partitioned_for(ranks, n_scalars_out, x.ndim, amax_kind)(w, x, *scalars)

  return call


# ----- Attention: each device attends over its own batch rows and heads ------------------
#
# XLA cannot look inside a fused attention kernel, so by itself it gathers q, k
# and v whole to every device and runs the kernel on the global batch there.
# Attention is independent across batch rows and across heads (a kv head with
# the query heads that share it), so `shard_local_attention` wraps a kernel in
# `jax.experimental.custom_partitioning` with that rule:
#
# * the batch axis keeps q's batch sharding (data parallel), the head axis keeps
#   q's head sharding (tensor parallel), where it divides both the query and the
#   kv heads: a contiguous block of query heads then meets exactly the kv heads
#   it shares (query head i uses kv head i // group);
# * the sequence and head_dim axes are gathered if they were split (a kernel row
#   needs every key);
# * an "amax" output is made global by a max over the mesh axes used: bit for
#   bit the single-device amax.
#
# Layouts name each array's axes by letter: "bshd" (q, the output, its
# gradient), "btkd" (k, v), "bs" / "bt" (segment ids), "bhs" (row statistics
# such as the log-sum-exp), "bhn" / "bkm" (per-block scales of q / of k and v:
# batch, heads, blocks of rows), "" (a replicated scalar); outputs may also be
# "amax". An argument given as None (no segment ids) is left out of the call.

LAYOUTS = ("bshd", "btkd", "bs", "bt", "bhs", "bhn", "bkm", "")
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


def shard_local_stacked_cast(kernel: Callable) -> Callable:
  """`kernel(stack [L, R, C], scale [L], running [L]) -> (q [L, R, C], q_t [L, C, R], amax [L],
  seed [L])`, every layer's weight cast by each device on its shard
  (`fp8jax.ops.stacked_weights`).

  Each device casts its [R, C] shard of every layer (the layer axis whole: a split one
  is gathered first, as is an axis the mesh does not divide); q keeps the stack's
  sharding and q_t has its two last axes' swapped, so nothing is gathered (under FSDP
  XLA gathers each layer's FP8 copy where its GEMM reads it, in FP8). The amaxes are made
  global by a max over the mesh axes that split a layer; the seeds (zeros) are replicated.
  The layer axis is never split (a factor the rule replicates): a stack sharded over its
  layers is gathered first.
  """

  @custom_partitioning
  def partitioned(stack, scale, running):
    return tuple(kernel(stack, scale, running))

  def _specs(mesh, stack_shape):
    rows, cols = _divisible_spec(mesh, _LayerShard(stack_shape))
    return PartitionSpec(None, rows, cols), PartitionSpec(None, cols, rows)

  def _results(mesh, same, transposed):
    replicated = NamedSharding(mesh, PartitionSpec())
    return (NamedSharding(mesh, same), NamedSharding(mesh, transposed), replicated, replicated)

  def partition(mesh, arg_shapes, result_shape):
    same, transposed = _specs(mesh, arg_shapes[0])
    split_over = tuple(name for entry in same for name in axis_names(entry))

    def lower_fn(stack, scale, running):
      q, q_t, amaxes, seeds = kernel(stack, scale, running)
      return q, q_t, (jax.lax.pmax(amaxes, split_over) if split_over else amaxes), seeds

    replicated = NamedSharding(mesh, PartitionSpec())
    arg_shardings = (NamedSharding(mesh, same), replicated, replicated)
    return mesh, lower_fn, _results(mesh, same, transposed), arg_shardings

  def infer_sharding_from_operands(mesh, arg_shapes, result_shape):
    return _results(mesh, *_specs(mesh, arg_shapes[0]))

  return define_rules(partitioned, partition, infer_sharding_from_operands,
                      "l r c, l, l -> l r c, l c r, l, l", need_replication_factors=("l",))


class _LayerShard:
  """One layer of a stack's shape and sharding, [R, C], for `_divisible_spec`."""

  def __init__(self, stack_shape):
    self.shape = tuple(stack_shape.shape[1:])
    spec = getattr(stack_shape.sharding, "spec", None)
    self.sharding = None if spec is None else NamedSharding(
        stack_shape.sharding.mesh, PartitionSpec(*(tuple(spec) + (None,) * 3)[1:3]))
