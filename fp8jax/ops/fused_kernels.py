"""fp8jax's FP8 bookkeeping kernels, and where they run instead of the same jnp.

The one module through which fp8jax reaches `pallas_kernels` for FP8 state and
quantization work (attention has its own, `fp8jax.ops.attention`; the per-block
GEMM kernel is a recipe's, `fp8jax.core.blocks`):

* `cast_transpose_amax`: an FP8 dense layer reads each high-precision tensor
  T [R, C] (activation, weight, output gradient) in two GEMMs with different
  contracted dims, and cuBLASLt's FP8 GEMM on Hopper wants the contracted dim
  innermost for both operands. So each tensor is needed as `q = saturate(T *
  scale)` in FP8 in its own layout and transposed, and its amax is recorded.
  One kernel reads T once, writes both FP8 copies and folds max|T| into the
  running amax; XLA by itself needs four kernels and two reads of T for it.
  `cast_in_chain` runs a layer's casts so that no launch of its own initialises
  their amax buffers (the first writes its tile maxima, the next reduces them and
  leaves zeroed accumulators for the ones after it).
* `cast_from_amax`: current scaling's cast. Given the tensor's amax (a reduction
  XLA computes in the kernel that writes the tensor where it can), one kernel makes
  the scale, its reciprocal, the GEMMs' descales and the running amax and casts:
  XLA by itself launches a kernel of a few bytes for each scalar.
* `packed_scalars`: float32 scalars (a layer's scales, where they are slices of a stack
  of layers' state) packed in one vector that the casts read in place: XLA launches a
  kernel for every slice a custom call reads, none for slices fused into the vector.
* `tensor_amax`: max|x| in one Pallas pass.
* `close_steps`: the end-of-step update of every FP8 role of a model in one
  launch (XLA compiles it into a few kernels per role).

Each is chosen when the program is lowered (`jax.lax.platform_dependent`): on a
GPU the Pallas kernel, elsewhere the jnp definition, so a program compiled for
an H100 on a CPU-only machine gets the kernels too. Kernel and jnp agree bit
for bit (tests/test_fused_kernels.py), except that XLA on CPU flushes
subnormal inputs to zero where the GPU keeps them.

On a mesh (plain `jit` with sharded arrays, one host or many) each kernel runs
on its device's shard and its amax output is made global by one max over the
mesh axes that split the tensor (`fp8jax.mesh.partitioning`; XLA combines
these scalar all-reduces into one), so no activation or gradient is gathered.
Inside `jax.shard_map` (per-device code) each kernel runs on the arrays the
device holds, declaring that its outputs vary over the mesh as their jnp
definitions' would (`pallas_kernels.varying`); the state update there reads the
all-reduced state packed in one vector. A tensor sharded over an explicit-axis
mesh (`AxisType.Explicit`: the sharding is in its type, and a Pallas call takes
only unsharded types) gets the jnp form: the same numbers, more kernels, with a
warning when JAX's backend is a GPU.
`fused_kernels(True)` forces the kernels on (an error for explicitly sharded
tensors), `fused_kernels(False)` off.
"""
from __future__ import annotations

import contextlib
import contextvars
import warnings
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.custom_batching import custom_vmap

import pallas_kernels
from pallas_kernels.activations import Prologue
from pallas_kernels.cast_transpose_checks import broadcast_kind
from pallas_kernels.cast_transpose_tiling import GROUP_COLUMNS
from pallas_kernels.vector_element import VectorElement, element_value
from fp8jax.core.formats import Fp8Format
from fp8jax.core.quantize import amax, amax_max, max_by_bits, quantize, scale_from_amax
from fp8jax.mesh.axes import fully_manual, inside_shard_map
from fp8jax.mesh.explicit import is_explicitly_sharded
from fp8jax.mesh.partitioning import shard_local, shard_local_weight_cast, vmapped_as
from fp8jax.ops import saved_activations

_F32_MAX = float(jnp.finfo(jnp.float32).max)
# The kinds (`fp8jax.mesh.partitioning`) of a cast's kept FP8 copy: codes split as x, one
# descale per row and group of columns split as x in whole groups.
_KEPT_KINDS = ("same", "groups")
_KERNEL_INPUT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
_FORCED = contextvars.ContextVar("fp8jax_fused_kernels", default=None)


@contextlib.contextmanager
def fused_kernels(enabled: bool):
  """Forces fp8jax's fused GPU kernels on or off for the programs traced inside."""
  if not isinstance(enabled, bool):
    raise TypeError(f"enabled={enabled!r} must be True or False.")
  token = _FORCED.set(enabled)
  try:
    yield
  finally:
    _FORCED.reset(token)


_STACKED = contextvars.ContextVar("fp8jax_stacked_state", default=False)


@contextlib.contextmanager
def stacked_state():
  """The FP8 ops traced inside read state sliced from a stack of layers.

  A layer's casts copy its FP8 state through (`cast_in_chain`'s `pass_through`) so that
  the step's update, reading the copies, can write the donated state in place. Where
  the state of a layer is a slice of a stack (an `nn.scan` over layers, unrolled or
  not) the update reads the stack itself, and the copies would only cost a slice and a
  copy per array and layer (the 350m GPT: 286 launches a step). Inside this context a
  layer also hands its casts the scalars of its state they read (scales and descales; under
  current scaling the fallback scales and running amaxes) packed in one vector
  (`packed_scalars`), so that no launch slices each out of its stack (the 350m GPT: 624
  launches a step under delayed scaling, 288 under current; XLA writes every layer's vector
  of one projection in one kernel). A model that scans or unrolls its layers over stacked
  FP8 state traces them inside this context, as the demo GPT does (`fp8jax.models.gpt`).

  Returns:
    A context manager (`with fused_kernels.stacked_state(): ...`).
  """
  token = _STACKED.set(True)
  try:
    yield
  finally:
    _STACKED.reset(token)


def in_stacked_state() -> bool:
  """Whether ops are being traced inside `stacked_state()`."""
  return _STACKED.get()


def kernels_allowed(*trees) -> bool:
  """Whether the fused kernels may take the arrays in `trees` (if lowered for a GPU).

  Yes in every program partitioned by XLA (one device or a mesh, plain `jit`):
  each kernel runs on its device's shard (`fp8jax.mesh.partitioning`). Yes
  inside a `shard_map` over every mesh axis of more than one device (per-device
  code), where this JAX lets a kernel declare how its outputs vary over the
  mesh. No for arrays sharded over explicit mesh axes, nor (unless forced on)
  inside a `shard_map` that leaves an axis automatic, where the jnp form runs.
  """
  forced = _FORCED.get()
  explicit = is_explicitly_sharded(*trees)
  if forced and explicit:
    raise ValueError(
        "fused_kernels(True): the fused FP8 kernels cannot take arrays sharded over an "
        "explicit-axis mesh (jax.sharding.AxisType.Explicit): a Pallas call accepts only "
        "unsharded types. Leave fused_kernels unset there (the jnp form runs), or make the "
        "mesh with AxisType.Auto axes, where each device runs the kernels on its shard.")
  if forced is not None:
    return forced
  if explicit:
    if jax.default_backend() == "gpu":
      warnings.warn(
          "fp8jax's fused FP8 kernels do not run on arrays sharded over an explicit-axis mesh "
          "(jax.sharding.AxisType.Explicit); the jnp form runs instead (same numbers, more "
          "kernels). Make the mesh with AxisType.Auto axes to keep the kernels.", stacklevel=3)
    return False
  if not inside_shard_map():
    return True
  # Per-device code: where an automatic axis is left (shard_map over some axes
  # only), XLA would gather what it splits for the kernel; the jnp form runs.
  return pallas_kernels.can_declare_varying_outputs() and fully_manual()


def choose(args, kernel, reference):
  """`kernel(*args)` where the program is lowered for a GPU and kernels are allowed, else
  `reference(*args)`. Under `jax.vmap` the reference runs: a kernel partitioned
  for a mesh (`jax.experimental.custom_partitioning`) has no batching rule."""
  if not kernels_allowed(args):
    return reference(*args)
  return jax.lax.platform_dependent(*args, cuda=vmapped_as(kernel, reference),
                                    default=reference)


def cast_transpose_amax(x: jax.Array, scale: jax.Array, running_amax: jax.Array,
                        fmt: Fp8Format, descale: jax.Array | None = None,
                        partner_descales: tuple | None = None,
                        gathered_for: jax.Array | None = None,
                        valid_rows: jax.Array | None = None):
  """`(q, q.T, max(running_amax, max|x|), products)` with `q = saturate(x * scale)` in `fmt`.

  Args:
    x: [R, C] bf16/f16/f32.
    scale: float32[] multiplied in before the cast.
    running_amax: float32[] the step's amax so far.
    fmt: the FP8 format.
    descale, partner_descales: optional float32[] and a tuple of float32[]: also
      return `min(descale * partner, float32 max)` per partner, the combined
      descales of the GEMMs x enters (see `fp8jax.ops.dot.scaled_matmul_nt`),
      computed by the same kernel instead of one scalar kernel per GEMM.
    gathered_for: for a weight, the 2-D activation it meets in its GEMM. On a
      mesh whose batch axes also split the weight (FSDP), the kernel then casts
      each device's shard and all-gathers the FP8 copy, transposing it after
      the gather (`fp8jax.mesh.partitioning.shard_local_weight_cast`).
    valid_rows: optional int32[]: only x's rows [0, valid_rows) are in use (a grouped
      GEMM's rows within its groups); the others are read as 0 (no amax, zero FP8 rows),
      in the same pass.

  Returns:
    q [R, C] and q.T [C, R] in `fmt.dtype`, the updated float32[] running amax,
    and the tuple of float32[] products (None without `partner_descales`).
  """
  cast = cast_in_chain(x, scale, running_amax, fmt, descale=descale,
                       partner_descales=partner_descales, gathered_for=gathered_for,
                       valid_rows=valid_rows)
  return cast.q, cast.q_t, cast.amax, cast.products


class Cast(NamedTuple):
  """What `cast_in_chain` returns.

  Attributes:
    q, q_t: `saturate(x * scale)` in the format, [R, C], and its transpose [C, R].
    amax: float32[] max(running_amax, max|x|); with `tile_amaxes`, a float32 vector
      whose max is max|x| (the kernel's tile maxima), for a later cast to reduce.
    products: the GEMMs' combined descales (None without `partner_descales`).
    reduced: float32[] max(running, max(tiles)) of `reduce=(tiles, running)`, or None.
    seeds: float32[] zeros, accumulators for later casts.
    passed: copies of the `pass_through` arrays.
    kept: with `keep_groups`, x (before the prologue; `prologue.kept`'s value where it
      names one) as the FP8 copy a backward pass keeps, `saved_activations.quantize_groups`'
      (codes, descales); else None.
  """

  q: jax.Array
  q_t: jax.Array
  amax: jax.Array
  products: tuple | None
  reduced: jax.Array | None
  seeds: tuple
  passed: tuple
  kept: tuple | None = None


def cast_in_chain(x: jax.Array, scale: jax.Array, running_amax: jax.Array | None,
                  fmt: Fp8Format, *, descale: jax.Array | None = None,
                  partner_descales: tuple | None = None, gathered_for: jax.Array | None = None,
                  accumulator: jax.Array | None = None, tile_amaxes: bool = False,
                  reduce: tuple | None = None, seeds: int = 0, pass_through: tuple = (),
                  prologue: Prologue | None = None, prologue_inputs: tuple = (),
                  valid_rows: jax.Array | None = None, keep_groups: bool = False) -> Cast:
  """`cast_transpose_amax` as one cast of a chain whose amaxes need no kernel of their own.

  The cast kernel folds its tiles' maxima into one float32 with atomics, so that
  buffer must hold the running amax before the launch; where the running amax
  cannot be overwritten (a jit parameter, a constant, a value read again) XLA
  copies it first: one launch per tensor. An FP8 layer's casts run one after
  another, so instead (`pallas_kernels.cast_transpose_amax_in_chain`):

  * the first writes its tiles' maxima (`tile_amaxes=True`, `running_amax=None`),
    which needs no initialised buffer;
  * a later one reduces them with their running amax (`reduce=(tiles, running)`,
    returned as `reduced`) and writes zeroed buffers (`seeds=n`);
  * a later one accumulates its amax into such a buffer (`accumulator=`).

  A cast can also copy small arrays through (`pass_through`), for the step's state
  update to read instead of the step's parameters: with the FP8 state donated,
  XLA can then write the update's results where those parameters were instead of
  copying each one there after the update.

  A cast can take its tensor as an elementwise function of x (and of tensors of x's
  shape, or of a value per row or column) that it computes itself (`prologue`,
  `pallas_kernels.activations`): the GELU before a projection, its backward before the
  previous projection's output gradient, or the RMSNorm before a projection. The
  function's result is cast and its amax recorded, in float32, and never written in bf16
  for a cast to read again.

  Elsewhere (the jnp form) the same values: the tile maxima are a vector of
  max|x| as long as the kernel's, the seeds zeros, the copies the arrays themselves.

  Args:
    x, scale, running_amax, fmt, descale, partner_descales, gathered_for, valid_rows: as
      for `cast_transpose_amax` (`running_amax` None with `tile_amaxes`; the scale and
      descales float32[] arrays or elements of `packed_scalars`).
    accumulator: a seed of an earlier cast of the same step.
    tile_amaxes: return the tile maxima instead of the running amax.
    reduce: (tiles, running) of an earlier cast.
    seeds: how many zeroed accumulators to return.
    pass_through: float32 scalars and vectors to return copies of.
    prologue, prologue_inputs: cast `prologue.fn(x, *prologue_inputs)` instead of x.
    keep_groups: also return x itself (before the prologue, or `prologue.kept`'s value of
      it) as the FP8 copy a backward pass keeps (`Cast.kept`), written by the same pass
      over x on a GPU. Every row is kept, those past `valid_rows` too (as `save` would
      keep them): each row is its own groups, so they change no other row's copy.

  Returns:
    A `Cast`.
  """
  if (pass_through or valid_rows is not None) and gathered_for is not None:
    raise ValueError("pass_through and valid_rows are for casts of activations and gradients; "
                     "a weight's cast (gathered_for=...) runs under a partitioning rule "
                     "without them.")
  with_products = partner_descales is not None
  n_products = len(partner_descales) if with_products else 0
  tiles_len = pallas_kernels.tile_count(x.shape) if tile_amaxes and x.ndim == 2 else 1

  if prologue is not None and gathered_for is not None:
    raise ValueError("prologue is for casts of activations and gradients; a weight's cast "
                     "(gathered_for=...) runs under a partitioning rule without it.")
  shapes = tuple(jnp.shape(a) for a in pass_through)
  others = _checked_prologue_inputs(x, prologue, prologue_inputs)

  def reference(x, scale, running_amax, descale, partner_descales, accumulator, reduce,
                pass_through, others, valid_rows, gathered_for=None):
    scale, descale = element_value(scale), element_value(descale)
    if with_products:
      partner_descales = tuple(map(element_value, partner_descales))
    kept = (saved_activations.quantize_groups(
        x if prologue is None else prologue.kept_of(x, others)) if keep_groups else None)
    if prologue is not None:
      x = prologue.applied_to(x, others)
    x = pallas_kernels.rows_in_use(x, valid_rows)
    q = quantize(x, scale, fmt)
    products = (tuple(jnp.minimum(descale * p, _F32_MAX) for p in partner_descales)
                if with_products else None)
    if tile_amaxes:
      new_amax = jnp.broadcast_to(amax(x), (tiles_len,))
    else:
      start = running_amax if accumulator is None else amax_max(accumulator, running_amax)
      new_amax = amax_max(start, amax(x))
    reduced = None
    if reduce is not None:
      tiles, running = reduce
      reduced = amax_max(running, max_by_bits(tiles))
    return Cast(q, q.T, new_amax, products, reduced, (jnp.zeros((), jnp.float32),) * seeds,
                tuple(pass_through), kept)

  def local_kernel(x, *operands):
    operands = list(operands)
    tensors = tuple(operands.pop(0) for _ in others)
    scale = operands.pop(0)
    rows = operands.pop(0) if valid_rows is not None else None
    running = None if tile_amaxes else operands.pop(0)
    descale = operands.pop(0) if with_products else None
    partners = tuple(operands.pop(0) for _ in range(n_products)) if with_products else None
    acc = operands.pop(0) if accumulator is not None else None
    tiles = (operands.pop(0), operands.pop(0)) if reduce is not None else None
    out = pallas_kernels.cast_transpose_amax_in_chain(
        x, scale, running, fp8_dtype=fmt.dtype, fp8_max=fmt.max, descale=descale,
        partner_descales=partners, accumulator=acc, tile_amaxes=tile_amaxes, reduce=tiles,
        seeds=seeds, pass_through=tuple(operands), prologue=prologue, prologue_inputs=tensors,
        valid_rows=rows, keep_groups=keep_groups)
    return (out.q, out.q_t, out.amax, *(out.products or ()),
            *((out.reduced,) if reduce is not None else ()), *out.seeds, *out.passed,
            *(out.kept or ()))

  kinds = (("same", "transposed", "tiles" if tile_amaxes else "amax")
           + ("scalar",) * (n_products + (reduce is not None) + seeds)
           + ("vector",) * len(pass_through) + _KEPT_KINDS * keep_groups)

  def kernel(x, scale, running_amax, descale, partner_descales, accumulator, reduce,
             pass_through, others, valid_rows, gathered_for):
    # Copied through as vectors (a partitioning rule gives each output one layout).
    operands = list(others) + [scale] + ([] if valid_rows is None else [valid_rows]) + (
        [] if tile_amaxes else [running_amax]) + (
        [descale, *partner_descales] if with_products else []) + (
        [accumulator] if accumulator is not None else []) + (
        list(reduce) if reduce is not None else []) + [jnp.ravel(a) for a in pass_through]
    if inside_shard_map():  # per-device code: the kernel on this device's arrays, as is
      results = local_kernel(x, *operands)
    else:
      on_leaves, leaves = _on_array_leaves(local_kernel, operands)
      if gathered_for is None:
        # A row limit counts the whole tensor's rows, and each device's shard gets its own
        # count: it is the scalar operand after the scale.
        results = shard_local(on_leaves, kinds, tensors=1 + len(others),
                              row_limit=1 if valid_rows is not None else None,
                              heads=_rotary_heads(prologue, x))(x, *leaves)
      else:
        results = shard_local_weight_cast(on_leaves)(
            x, gathered_for, *leaves, n_scalars_out=len(kinds) - 3, amax_kind=kinds[2])
    q, q_t, new_amax, *rest = results
    kept = tuple(rest[-2:]) if keep_groups else None
    rest = rest[:len(rest) - 2 * keep_groups]
    products = tuple(rest[:n_products]) if with_products else None
    rest = rest[n_products:]
    reduced = rest.pop(0) if reduce is not None else None
    passed = tuple(c.reshape(shape) for c, shape in zip(rest[seeds:], shapes))
    return Cast(q, q_t, new_amax, products, reduced, tuple(rest[:seeds]), passed, kept)

  if valid_rows is not None:
    valid_rows = jnp.asarray(valid_rows, jnp.int32)
  args = (x, scale, running_amax, descale, partner_descales, accumulator, reduce,
          tuple(pass_through), others, valid_rows, gathered_for)
  takes = _takes(x) and all(_takes(t, prologue_input=True) for t in others)
  cast = reference(*args) if not takes else choose(args, kernel, reference)
  return cast._replace(passed=tuple(map(_copy_of, pass_through, cast.passed)))


def _checked_prologue_inputs(x, prologue: Prologue | None, prologue_inputs) -> tuple:
  others = tuple(prologue_inputs)
  if len(others) != (prologue.inputs if prologue is not None else 0) or any(
      broadcast_kind(jnp.shape(t), jnp.shape(x)) is None for t in others):
    raise ValueError(f"prologue_inputs: got {len(others)} of shapes "
                     f"{[jnp.shape(t) for t in others]}; the prologue takes "
                     f"{prologue.inputs if prologue is not None else 0}, each of x's shape "
                     f"{jnp.shape(x)}, or [R, 1] (a value per row), [1, C] (per column) or "
                     f"[R, ceil(C / {GROUP_COLUMNS})] (per row and group of {GROUP_COLUMNS} "
                     "columns).")
  return others


def _rotary_heads(prologue: Prologue | None, x) -> tuple | None:
  """(heads, head_dim) of a rotary prologue's gradient, for its sharding rule; else None."""
  if prologue is None or prologue.rotary is None:
    return None
  return x.shape[1] // prologue.rotary, prologue.rotary


def prologue_amax(x: jax.Array, prologue: Prologue, prologue_inputs: tuple) -> jax.Array:
  """max|prologue.fn(x, *prologue_inputs)| in float32, the amax current scaling casts that
  function's result with (`cast_from_amax`'s t_amax). Plain jnp: XLA reduces it from x and
  the inputs, where the result itself is not written for the cast to read again (in a
  small model XLA may still write an intermediate, such as the rotary qkv gradient's
  stack, before the reduction; at the 350m GPT's sizes it writes none, and one reduction
  of the stack is 144 launches a step fewer than one per part).

  The function is evaluated by XLA here and by the cast kernel again: where the two
  evaluate a transcendental (the GELU's tanh) one ulp apart at the largest element, the
  scale is that of an amax one ulp off, and that element may saturate to the format's
  max (a relative error of 2**-23 of one value). The recorded amax is this one.

  Returns:
    float32[] (NaN where the function gives a NaN).
  """
  return amax(prologue.applied_to(x, prologue_inputs))


def packed_scalars(scalars) -> tuple:
  """float32 scalars as elements of one vector that the cast kernels read in place.

  A cast kernel's scalar operand that XLA has to slice out of a larger array (a layer's
  scale in a stack of layers' state) costs a launch of its own: XLA fuses a slice into
  the kernels it writes, never into a custom call. Packed, the slices fuse into the one
  kernel that writes the vector, and every cast reads its element where it is (the
  jnp form reads the same elements).

  Args:
    scalars: float32 arrays of one element each ([] or [1]).

  Returns:
    One `pallas_kernels.VectorElement` per scalar, in order, for `cast_in_chain`'s
    `scale`, `descale` and `partner_descales`, and `cast_from_amax`'s `fallback_scale`
    and `running_amax`.
  """
  vector = jnp.concatenate([jnp.ravel(s).astype(jnp.float32) for s in scalars])
  return tuple(VectorElement(vector, i) for i in range(len(scalars)))


def _on_array_leaves(local_kernel, operands: list):
  """(`local_kernel` taking the array leaves of `operands` instead, those leaves).

  A partitioning rule takes arrays: a `VectorElement` operand travels to it as its vector
  and is the element again inside (its index is static, in the tree).
  """
  leaves, tree = jax.tree.flatten(operands)

  def on_leaves(x, *leaves):
    return local_kernel(x, *jax.tree.unflatten(tree, leaves))

  return on_leaves, leaves


@custom_vmap
def _copy_of(original: jax.Array, copy: jax.Array) -> jax.Array:
  """`copy`, a kernel's copy of `original`. Under `jax.vmap` a kernel's outputs all come
  out batched (`fp8jax.mesh.partitioning.vmapped_as`); a copy of an unbatched array
  does not vary over the batch, so there it is the original itself."""
  del original
  return copy


@_copy_of.def_vmap
def _copy_of_rule(axis_size, in_batched, original, copy):
  del axis_size
  original_batched, copy_batched = in_batched
  if copy_batched and not original_batched:
    return original, False
  return copy, copy_batched


class ScaledCast(NamedTuple):
  """What `cast_from_amax` returns.

  Attributes:
    q, q_t: `saturate(x * scale)` in the format, [R, C], and its transpose [C, R].
    amax: float32[] max(running_amax, recorded).
    descale: float32[] 1 / scale.
    products: the GEMMs' combined descales (None without `partner_descales`).
    passed: copies of the `pass_through` arrays.
    kept: with `keep_groups`, x's FP8 copy for a backward pass (as `Cast.kept`); else None.
  """

  q: jax.Array
  q_t: jax.Array
  amax: jax.Array
  descale: jax.Array
  products: tuple | None
  passed: tuple
  kept: tuple | None = None


def cast_from_amax(x: jax.Array, t_amax: jax.Array, fallback_scale: jax.Array,
                   running_amax: jax.Array, fmt: Fp8Format, *, margin: int, power_of_two: bool,
                   recorded: jax.Array | None = None, partner_descales: tuple | None = None,
                   gathered_for: jax.Array | None = None, pass_through: tuple = (),
                   prologue: Prologue | None = None, prologue_inputs: tuple = (),
                   keep_groups: bool = False) -> ScaledCast:
  """Current scaling's cast of a 2-D x whose amax `t_amax` is already known.

  `scale = scale_from_amax(t_amax, fmt, margin, fallback_scale, power_of_two)`, the
  FP8 copies of x in both layouts, `1 / scale`, the GEMMs' combined descales and
  the running amax max(running_amax, recorded) (recorded: this trace's own amax of
  x, default t_amax). On a GPU all of it is one launch
  (`pallas_kernels.cast_transpose_from_amax`): the kernel makes the scale itself, so
  no launch computes a scale, a descale or a running amax. Elsewhere, and under
  `jax.vmap`, the same values in jnp.

  Args:
    x: [R, C] bf16/f16/f32.
    t_amax: float32[] max|x| of the whole tensor (x may be a shard of it).
    fallback_scale: float32[] the scale kept where t_amax gives none.
    running_amax: float32[] the step's amax so far (it and fallback_scale arrays or elements
      of `packed_scalars`).
    fmt: the FP8 format.
    margin, power_of_two: the recipe's (see `fp8jax.core.quantize.scale_from_amax`).
    recorded, gathered_for, pass_through: as for `cast_in_chain`.
    partner_descales: as for `cast_in_chain`, float32[] arrays (the other casts' descales,
      which their kernels make).
    prologue, prologue_inputs: as for `cast_in_chain`: cast `prologue.fn(x,
      *prologue_inputs)`; t_amax is then that function's amax (`prologue_amax`).
    keep_groups: as for `cast_in_chain`.

  Returns:
    A `ScaledCast`.
  """
  if (pass_through or prologue is not None) and gathered_for is not None:
    raise ValueError("pass_through and prologue are for casts of activations and gradients; "
                     "a weight's cast (gathered_for=...) runs under a partitioning rule "
                     "without them.")
  recorded = t_amax if recorded is None else recorded
  n_products = len(partner_descales) if partner_descales is not None else 0
  shapes = tuple(jnp.shape(a) for a in pass_through)
  others = _checked_prologue_inputs(x, prologue, prologue_inputs)

  def reference(x, t_amax, fallback_scale, running_amax, recorded, partner_descales,
                pass_through, others, gathered_for=None):
    fallback_scale, running_amax = element_value(fallback_scale), element_value(running_amax)
    kept = (saved_activations.quantize_groups(
        x if prologue is None else prologue.kept_of(x, others)) if keep_groups else None)
    if prologue is not None:
      x = prologue.applied_to(x, others)
    scale = scale_from_amax(t_amax, fmt, margin, fallback=fallback_scale,
                            power_of_two=power_of_two)
    descale = 1.0 / scale
    q = quantize(x, scale, fmt)
    products = (tuple(jnp.minimum(descale * p, _F32_MAX) for p in partner_descales)
                if partner_descales is not None else None)
    return ScaledCast(q, q.T, amax_max(running_amax, recorded), descale, products,
                      tuple(pass_through), kept)

  def local_kernel(x, *operands):
    tensors, (fallback_scale, t_amax, running_amax, recorded, *rest) = (
        operands[:len(others)], operands[len(others):])
    partners = tuple(rest[:n_products]) if partner_descales is not None else None
    out = pallas_kernels.cast_transpose_from_amax(
        x, t_amax, fallback_scale, running_amax, fp8_dtype=fmt.dtype, fp8_max=fmt.max,
        margin=margin, power_of_two=power_of_two, recorded_amax=recorded,
        partner_descales=partners, pass_through=tuple(rest[n_products:]), prologue=prologue,
        prologue_inputs=tuple(tensors), keep_groups=keep_groups)
    return (out.q, out.q_t, out.amax, out.descale, *(out.products or ()), *out.passed,
            *(out.kept or ()))

  # Every scalar output comes from replicated operands alone: nothing to reduce.
  kinds = ("same", "transposed", "scalar", "scalar") + ("scalar",) * n_products + (
      "vector",) * len(pass_through) + _KEPT_KINDS * keep_groups

  def kernel(x, t_amax, fallback_scale, running_amax, recorded, partner_descales,
             pass_through, others, gathered_for):
    operands = [*others, fallback_scale, t_amax, running_amax, recorded,
                *(partner_descales or ())]
    operands += [jnp.ravel(a) for a in pass_through]
    if inside_shard_map():
      results = local_kernel(x, *operands)
    else:
      on_leaves, leaves = _on_array_leaves(local_kernel, operands)
      if gathered_for is None:
        results = shard_local(on_leaves, kinds, tensors=1 + len(others),
                              heads=_rotary_heads(prologue, x))(x, *leaves)
      else:
        results = shard_local_weight_cast(on_leaves)(
            x, gathered_for, *leaves, n_scalars_out=len(kinds) - 3, amax_kind="scalar")
    q, q_t, new_amax, descale, *rest = results
    kept = tuple(rest[-2:]) if keep_groups else None
    rest = rest[:len(rest) - 2 * keep_groups]
    products = tuple(rest[:n_products]) if partner_descales is not None else None
    passed = tuple(c.reshape(shape) for c, shape in zip(rest[n_products:], shapes))
    return ScaledCast(q, q_t, new_amax, descale, products, passed, kept)

  args = (x, t_amax, fallback_scale, running_amax, recorded, partner_descales,
          tuple(pass_through), others, gathered_for)
  takes = _takes(x) and all(_takes(t, prologue_input=True) for t in others)
  cast = reference(*args) if not takes else choose(args, kernel, reference)
  return cast._replace(passed=tuple(map(_copy_of, pass_through, cast.passed)))


def tensor_amax(x: jax.Array) -> jax.Array:
  """float32[] max|x| of a 2-D `x` in one pass (NaN if `x` holds a NaN)."""
  zero = jnp.zeros((), jnp.float32)

  def reference(x, start):
    return amax_max(start, amax(x))

  def kernel(x, start):
    if inside_shard_map():
      return pallas_kernels.running_amax(x, start)
    return _per_shard_amax(x, start)[0]

  if not _takes(x):
    return reference(x, zero)
  return choose((x, zero), kernel, reference)


def close_steps(amaxes, other_amaxes, histories, scales, *, numerators, history_len,
                amax_compute_algo, reference, written_over=None):
  """`reference(amaxes, other_amaxes, histories, scales)` (the jnp update of
  `fp8jax.step.close`), or `pallas_kernels.close_steps` doing the same in one launch.
  `written_over`: optional `(scale_invs, amaxes)` of the state the step was given,
  which the kernel writes a stacked role's new arrays over."""

  def kernel(amaxes, other_amaxes, histories, scales, written_over):
    packed = inside_shard_map()
    # Inside shard_map the state arrives as slices of one all-reduced vector
    # (`fp8jax.all_reduce_amax`); packed, they fold back into it instead of
    # each slice being a kernel. A stacked role's history and scale (a scanned stack
    # of layers' state, which the casts read in place and copy nothing of:
    # `stacked_state`) are the step's own, updated where they are, and its scale_inv
    # and amax written over the old ones (the 350m GPT: 34 copies fewer).
    return pallas_kernels.close_steps(
        amaxes, histories, scales, numerators=numerators, history_len=history_len,
        amax_compute_algo=amax_compute_algo, other_amaxes=other_amaxes,
        packed=packed, in_place=[not packed and jnp.shape(a)[0] > 1 for a in amaxes],
        written_over=written_over)

  def jnp_update(amaxes, other_amaxes, histories, scales, written_over):
    return reference(amaxes, other_amaxes, histories, scales)

  return choose((amaxes, other_amaxes, histories, scales, written_over), kernel, jnp_update)


_per_shard_amax = shard_local(lambda x, start: (pallas_kernels.running_amax(x, start),),
                              ("amax",))


def _takes(x, prologue_input: bool = False) -> bool:
  """Whether the cast kernels accept `x` (2-D, non-empty, bf16/f16/f32; a prologue's
  further tensor may also be E4M3 codes)."""
  dtypes = _KERNEL_INPUT_DTYPES + ((jnp.dtype(jnp.float8_e4m3fn),) if prologue_input else ())
  return x.ndim == 2 and x.size > 0 and jnp.dtype(x.dtype) in dtypes
