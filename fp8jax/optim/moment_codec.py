"""Adam moments in one byte per element: E4M3 codes with a range expansion per 1x128 block.

A moment leaf of shape `[..., C]` is stored as `Fp8Moment(codes, k, offset)`: `codes`
float8_e4m3fn of the leaf's own shape (so it shards exactly as the parameter), and two
float32 numbers per block of `block` consecutive elements along the last axis
(`[..., ceil(C / block)]`: same rank, same PartitionSpec; on an explicit mesh whose devices
each hold less than a block of the last axis, that axis of `k` and `offset` is replicated).
The stored numbers do not depend on the sharding.

Why a range expansion (COAT, Xi et al. 2024): inside a block the magnitudes of Adam's
moments span a few decades, while E4M3 has 3 mantissa bits over 15 binades of normal
numbers. COAT maps each block by `y = sign(x) |x / c|^k` before the cast, with `k` chosen so
the block's max / min ratio fills the format's range; small blocks ranges are stretched
(k > 1), which divides the relative rounding error by k. Here, per block with nonzero
magnitudes in [a, b]:

    k = clip(floor(16 log2(T) / log2(b / a)) / 16, 1/16, k_max)   (k_max if a == b)
    log2 |y| = k (log2 |x| - lc) - lS,   lc = (log2 a + log2 b) / 2,
                                         lS = k (log2 b - lc) - log2 448

so b maps to 448 and a to at least 448 / T. T = 448 * 64 = 2**14.8, E4M3's normal range
(COAT aims at 448**2 / 2, which puts small elements among the subnormals, whose relative
error is up to 22%): every nonzero code is a normal number, relative error <= 2**-4 in y,
hence `|x_hat / x - 1| <= (1 + 2**-4)**(1/k) - 1` in x (twice the y error under stochastic
rounding). k_max caps how much float32 rounding of log2/exp2 is amplified in a block of
near-equal values. The block stores `k` and `offset = k lc + lS`; decoding is
`|x| = exp2((log2 |q| + offset) / k)`. Zeros stay exactly zero.

Rounding: the first moment rounds to nearest. The second moment rounds stochastically by
default: its per-step change at b2 = 0.999 is ~0.1% relative, far below E4M3's 6.25% half
step, so with round-to-nearest a block whose scale does not move never changes its stored
v (measured in a 4000-step simulation: sqrt(v) stuck 2.6x too large, the learning rate
2.6x too small). Stochastic rounding is unbiased, so v follows its true value on average.
The random bits come from (seed, step, leaf): no key is stored, a restored run continues
bit for bit, and the bits do not depend on sharding.
"""
from __future__ import annotations

import math
import operator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from pallas_kernels.adam_fp8 import E4M3, block_expansion, decode_block, expanded_codes
from fp8jax.mesh import explicit


class Fp8Moment(NamedTuple):
  """One moment leaf in one byte per element.

  Attributes:
    codes: float8_e4m3fn, the leaf's shape [..., C].
    k: float32 [..., ceil(C / block)], each block's expansion exponent.
    offset: float32 [..., ceil(C / block)], each block's `k lc + lS` (see the module).
  """

  codes: jax.Array
  k: jax.Array
  offset: jax.Array


class _Layout(NamedTuple):
  """A leaf's last axis viewed as [..., groups, group] for the per-block statistics.

  A group is a block, or on an explicit mesh whose devices each hold less than a block (or
  a share that is not a multiple of one), the `gcd(share, block)` columns that lie in one
  block on one device. Each device then reduces its own groups, the groups' extremes (a
  `group`-th of the leaf) are gathered to make each block's, and each block's expansion is
  sliced back to the groups: the stored blocks, and every number in them, are those of one
  device.
  """

  block: int
  group: int
  columns: int
  split: Any  # the mesh axes that split the last axis on an explicit mesh, else None

  @property
  def groups_per_block(self) -> int:
    return self.block // self.group

  @property
  def blocks(self) -> int:
    return -(-self.columns // self.block)


def _layout(x: jax.Array, block: int) -> _Layout:
  columns, split = x.shape[-1], explicit.explicit_spec(x)[-1]
  if split is None:
    return _Layout(block, block, columns, None)
  mesh_shape = jax.typeof(x).sharding.mesh.shape
  shards = math.prod(mesh_shape[name] for name in (split if isinstance(split, tuple) else (split,)))
  # JAX shards evenly, so `columns` is a multiple of `shards`, and of `block` when a
  # share is (then the groups are the blocks and nothing is gathered).
  return _Layout(block, math.gcd(columns // shards, block), columns, split)


def _view(x: jax.Array, layout: _Layout) -> jax.Array:
  """x [..., C] as [..., C / group, group]; without groups, the last block padded with zeros
  (which change neither a block's max nor its smallest nonzero magnitude)."""
  if layout.group == layout.block:
    padded = layout.blocks * layout.block
    if padded != layout.columns:
      x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, padded - layout.columns)])
    return x.reshape(*x.shape[:-1], layout.blocks, layout.block)
  spec = explicit.explicit_spec(x)
  return explicit.reshape(x, (*x.shape[:-1], layout.columns // layout.group, layout.group),
                          (*spec[:-1], layout.split, None))


def _unview(viewed: jax.Array, layout: _Layout) -> jax.Array:
  return viewed.reshape(*viewed.shape[:-2], -1)[..., :layout.columns]


def _group_to_block(stat: jax.Array, layout: _Layout, reduce, neutral: float) -> jax.Array:
  """Each block's extreme [..., blocks] from its groups' [..., C / group]."""
  per = layout.groups_per_block
  if per == 1:
    return stat
  spec = explicit.explicit_spec(stat)
  gathered = _resharded(stat, (*spec[:-1], None))
  padding = layout.blocks * per - stat.shape[-1]
  gathered = jnp.pad(gathered, [(0, 0)] * (stat.ndim - 1) + [(0, padding)],
                     constant_values=neutral)
  return reduce(gathered.reshape(*stat.shape[:-1], layout.blocks, per), axis=-1)


def _block_to_group(stat: jax.Array, layout: _Layout) -> jax.Array:
  """Each group's [..., C / group, 1] copy of its block's number [..., blocks]."""
  per = layout.groups_per_block
  if per > 1:
    spec = explicit.explicit_spec(stat)
    repeated = jnp.broadcast_to(stat[..., None], (*stat.shape, per))
    repeated = repeated.reshape(*stat.shape[:-1], -1)[..., :layout.columns // layout.group]
    stat = _resharded(repeated, (*spec[:-1], layout.split))
  return stat[..., None]


def encode(x: jax.Array, *, block: int, k_max: float, key: jax.Array | None = None) -> Fp8Moment:
  """`x` (float32 [..., C]) as an `Fp8Moment`; stochastic rounding with `key`, else to nearest."""
  layout = _layout(x, block)
  grouped = _view(x.astype(jnp.float32), layout)
  magnitude = jnp.abs(grouped)
  nonzero = magnitude > 0
  largest = _group_to_block(jnp.max(magnitude, axis=-1), layout, jnp.max, 0.0)
  smallest = _group_to_block(jnp.min(jnp.where(nonzero, magnitude, jnp.inf), axis=-1),
                             layout, jnp.min, jnp.inf)
  k, center, log_shift = block_expansion(largest, smallest, k_max, operator.truediv)
  draw = None
  if key is not None:
    # Drawn in the leaf's own shape: the bits of an element do not depend on the layout.
    draw = _view(jax.random.uniform(key, x.shape, jnp.float32, out_sharding=_sharding(x)),
                 layout)
  codes = expanded_codes(grouped, *(_block_to_group(a, layout) for a in (k, center, log_shift)),
                         draw)
  offset = k * center + log_shift
  return Fp8Moment(codes=_unview(codes.astype(E4M3), layout), k=k, offset=offset)


def decode(moment: Fp8Moment, *, block: int) -> jax.Array:
  """The float32 moment an `Fp8Moment` holds."""
  layout = _layout(moment.codes, block)
  codes = _view(moment.codes.astype(jnp.float32), layout)
  value = decode_block(codes, _block_to_group(moment.k, layout),
                       _block_to_group(moment.offset, layout), operator.truediv)
  return _unview(value, layout)


def _resharded(x: jax.Array, spec) -> jax.Array:
  return jax.sharding.reshard(x, NamedSharding(jax.typeof(x).sharding.mesh, PartitionSpec(*spec)))


def _sharding(x: jax.Array):
  """x's sharding where it is part of its type (explicit meshes), else None."""
  return jax.typeof(x).sharding if explicit.is_explicitly_sharded(x) else None
