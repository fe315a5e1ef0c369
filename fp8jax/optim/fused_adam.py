"""Adam's step of one leaf with FP8 moments as one GPU kernel (`pallas_kernels.adam_fp8`).

`scale_by_adam_fp8` updates each large leaf here. On a GPU, where the fused kernels may
run (`fp8jax.ops.fused_kernels.kernels_allowed`), one kernel reads the gradient and both
stored moments and writes the update and both moments stored again (given the parameter,
as `fp8jax.optim.update_and_apply` gives it, it clips the gradient and writes the new
parameter instead of the update); in XLA (`reference`, the jnp form, everywhere else)
the float32 moments are written and read again for the blocks' statistics and for each
encoding. The two agree to float32 rounding (the kernel's
module says how). On a mesh each device runs the kernel on its shard of the leaf, every
axis split as the leaf is, and is told where its shard lies so that its stochastic
rounding draws the whole leaf's numbers (`jax.experimental.custom_partitioning`). The
columns are split only in whole 128-column blocks: a split that is not (768 columns over
4 devices) is gathered, gradient and codes, where the jnp form gathers only each block's
extremes; a width that is a multiple of 128 times the devices splitting it (the GPTs
from 350m on, over up to 8) moves nothing.
"""
from __future__ import annotations

import functools
import math
from typing import Callable

import jax
import jax.numpy as jnp
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec

import pallas_kernels
from pallas_kernels.adam_fp8 import BLOCK, MAX_AXES, AdamHyper, LeafPlace, StoredMoment
from fp8jax.mesh.axes import inside_shard_map
from fp8jax.mesh.partitioning import axis_names, define_rules
from fp8jax.ops import fused_kernels
from fp8jax.optim.moment_codec import Fp8Moment

_GRADIENT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def fits_the_kernel(g: jax.Array, block: int, nesterov: bool) -> bool:
  """Whether the kernel can take this leaf: blocks of its 128 columns, plain Adam
  (Nesterov's update stays jnp), a float gradient, fewer than 2**32 elements (the
  random numbers' counter) and axes, no shard_map around it (the jnp form runs there),
  and JAX's default random bits (threefry, partitionable), which the kernel draws."""
  return (block == BLOCK and not nesterov and jnp.dtype(g.dtype) in _GRADIENT_DTYPES
          and g.size < 2 ** 32 and g.ndim <= MAX_AXES and not inside_shard_map()
          and jax.config.jax_default_prng_impl == "threefry2x32"
          and jax.config.jax_threefry_partitionable)


def adam_step(g: jax.Array, mu: Fp8Moment, nu: Fp8Moment, constants: jax.Array,
              rounding_key: jax.Array | None, hyper: AdamHyper,
              reference: Callable, applied_to: tuple[jax.Array, jax.Array] | None = None
              ) -> tuple[jax.Array, Fp8Moment, Fp8Moment]:
  """The update (or new parameter) and new moments of one leaf: the kernel on a GPU, else
  `reference`.

  Args:
    g: the gradient [..., C] (at least 2-D; `fits_the_kernel`).
    mu, nu: its stored moments.
    constants: float32[8], the step's numbers (`pallas_kernels.adam_fp8.adam_constants`).
    rounding_key: the second moment's stochastic-rounding key (None: to nearest).
    hyper: the step's static options.
    reference: `reference(g, mu, nu) -> (update, mu, nu)`, the jnp form of the same step
      (with `applied_to`: `(new parameter, mu, nu)`).
    applied_to: None, or (the float32 parameter of g's shape, float32[4]
      `pallas_kernels.adam_fp8.APPLIED`): the kernel clips g, then writes the new
      parameter over the old.

  Returns:
    (the update in g's dtype, or with `applied_to` the new parameter, the new mu, the
    new nu).
  """
  key_words = (jax.random.key_data(rounding_key) if rounding_key is not None
               else jnp.zeros((2,), jnp.uint32))
  applies = applied_to is not None
  extra = tuple(applied_to) if applies else ()

  def kernel(g, mu, nu, constants, key_words, *extra):
    results = _partitioned(hyper, g.ndim, applies)(
        g, *mu, *nu, constants, key_words, jnp.zeros((MAX_AXES,), jnp.int32), *extra)
    written, *moments = results
    return written, Fp8Moment(*moments[:3]), Fp8Moment(*moments[3:])

  def jnp_step(g, mu, nu, constants, key_words, *extra):
    del constants, key_words, extra  # the reference makes its own
    return reference(g, mu, nu)

  return fused_kernels.choose((g, mu, nu, constants, key_words, *extra), kernel, jnp_step)


def _local_step(hyper: AdamHyper, whole_shape: tuple[int, ...], g, mu_codes, mu_k,
                mu_offset, nu_codes, nu_k, nu_offset, constants, key_words, starts,
                *applied_to):
  """The kernel on a shard [..., C] of a leaf of `whole_shape` (its rows: the leading axes)."""
  place = LeafPlace(tuple(g.shape[:-1]), LeafPlace.whole(whole_shape).strides)
  as_rows = lambda a: a.reshape(-1, a.shape[-1])
  param, applied = applied_to if applied_to else (None, None)
  written, new_mu, new_nu = pallas_kernels.adam_fp8_update(
      as_rows(g), StoredMoment(*map(as_rows, (mu_codes, mu_k, mu_offset))),
      StoredMoment(*map(as_rows, (nu_codes, nu_k, nu_offset))), constants, key_words,
      starts, hyper=hyper, param=None if param is None else as_rows(param),
      applied=applied, place=place)
  likes = (g, mu_codes, mu_k, mu_offset, nu_codes, nu_k, nu_offset)
  return tuple(r.reshape(like.shape) for r, like in zip((written, *new_mu, *new_nu), likes))


def _leaf_spec(mesh, shape) -> PartitionSpec:
  """The leaf's sharding spec, any axis the mesh does not divide evenly (the columns: in
  whole blocks) unsharded."""
  spec = getattr(shape.sharding, "spec", None)
  entries = list(spec or ()) + [None] * (len(shape.shape) - len(spec or ()))
  for axis, entry in enumerate(entries):
    ways = math.prod(mesh.shape[name] for name in axis_names(entry))
    unit = BLOCK if axis == len(entries) - 1 else 1
    if ways > 1 and shape.shape[axis] % (unit * ways):
      entries[axis] = None
  return PartitionSpec(*entries)


@functools.lru_cache(maxsize=None)
def _partitioned(hyper: AdamHyper, ndim: int, applies: bool) -> Callable:
  """The kernel over a leaf of `ndim` axes, each device on its shard (`applies`: also given
  the parameter, split as the leaf, and the applied step's numbers, replicated)."""

  @custom_partitioning
  def step(g, *operands):
    return _local_step(hyper, g.shape, g, *operands)

  def shardings(mesh, spec):
    # The blocks' arrays split as the tensors: a columns' split in whole blocks splits them.
    return [NamedSharding(mesh, spec)] * 7

  def partition(mesh, arg_shapes, result_shape):
    spec = _leaf_spec(mesh, arg_shapes[0])
    whole_shape = arg_shapes[0].shape

    def lower_fn(g, *operands):
      tensors, (constants, key_words, starts), applied_to = (
          operands[:6], operands[6:9], operands[9:])
      local_starts = [jax.lax.axis_index(axis_names(entry)) * size if entry else 0
                      for entry, size in zip(spec, g.shape)]
      starts = starts + jnp.stack([jnp.asarray(s, jnp.int32) for s in local_starts]
                                  + [jnp.int32(0)] * (MAX_AXES - ndim))
      return _local_step(hyper, whole_shape, g, *tensors, constants, key_words, starts,
                         *applied_to)

    replicated = NamedSharding(mesh, PartitionSpec())
    results = tuple(shardings(mesh, spec))
    applied_args = (results[0], replicated) if applies else ()
    return mesh, lower_fn, results, results + (replicated,) * 3 + applied_args

  def infer_sharding_from_operands(mesh, arg_shapes, result_shape):
    return tuple(shardings(mesh, _leaf_spec(mesh, arg_shapes[0])))

  # Shardy: each leading axis a factor of its own, the columns (c) one and the blocks (o)
  # another. Tying them ("(b k)", k = BLOCK) would let Shardy split a column split that is
  # not whole blocks (768 columns over 4 devices) into sub-axes over both, which
  # custom_partitioning cannot express; `partition` ties them instead (the columns split
  # only in whole blocks, the blocks as the columns), and XLA reshards the blocks' small
  # arrays where the propagation chose otherwise.
  leading = " ".join(f"a{i}" for i in range(ndim - 1))
  tensor, per_block = f"{leading} c", f"{leading} o"
  layout = [tensor, tensor, per_block, per_block, tensor, per_block, per_block]
  operands = layout + ["v0", "v1", "v2"] + ([tensor, "v3"] if applies else [])
  rule = f"{', '.join(operands)} -> {', '.join(layout)}"
  return define_rules(step, partition, infer_sharding_from_operands, rule)
