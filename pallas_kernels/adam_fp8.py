"""Adam's step with FP8 moments in one pass: read g and both stored moments, write the
update and both moments stored again; or, given the parameter too, write the new parameter
instead of the update (AdamW's decay, the learning rate and optax's `apply_updates` in the
same pass).

The moments are stored as `fp8jax.optim.moment_codec` stores them: E4M3 codes of the
leaf's shape and, per row and block of `BLOCK` = 128 columns, an expansion exponent k and
an offset. One program holds [block_rows, 128]: whole blocks, so it decodes, updates and
re-encodes its blocks on its own. In XLA the same step is several passes (the float32
moments written and read again for each block's statistics, then for the encodings: 41
bytes a parameter, against 12 here with a float32 gradient, 8 with a bf16 one). Applied
to the parameter here, a float32 parameter costs 4 bytes more in this pass (it is read;
it is written instead of the update) and saves the pass that adds the update to it (12
bytes: the parameter and the update read, the parameter written).

Numbers: the jnp form's float32 operations in its order, so the interpreter's agree with
XLA's to a few float32 ulps (XLA:CPU fuses some multiply-adds of the jnp form into FMAs),
which moves a code by one step only where y lies that close to a rounding boundary; on a
GPU Triton's log2 (a log and a division), exp2 and sqrt may differ from XLA's by as much.
A NaN gradient makes a block's moments meaningless either way, but not the same ones
(Triton's max and min skip a NaN that XLA's return). The second moment's stochastic
rounding draws `jax.random.uniform(key, leaf shape)`'s numbers itself
(`pallas_kernels.threefry`), indexed by each element's place in the whole leaf
(`LeafPlace`: where a device's shard lies in the leaf, whose rows are all its leading axes),
so the stored moments do not depend on the sharding or the tiles.
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import threefry
from pallas_kernels.cast_transpose import _divide, store_masked
from pallas_kernels.cast_transpose_tiling import GROUP_COLUMNS

BLOCK = GROUP_COLUMNS  # a moment's block: one program's columns
E4M3 = jnp.float8_e4m3fn
E4M3_MAX = 448.0
LOG2_MAX = math.log2(E4M3_MAX)
# The target ratio of a block's largest to smallest code: E4M3's normal range, 448 / 2**-6.
TARGET_RATIO_LOG2 = LOG2_MAX + 6.0
K_STEP = 16  # k is a multiple of 1/16, as in COAT
_SMALLEST_NORMAL_EXPONENT = -6  # E4M3: below 2**-6 the codes are 2**-9 apart
_MANTISSA_BITS = 3


class StoredMoment(NamedTuple):
  """One moment of a 2-D leaf [R, C]: codes float8_e4m3fn [R, C], k and offset float32
  [R, ceil(C / BLOCK)] (`fp8jax.optim.Fp8Moment`'s fields)."""

  codes: jax.Array
  k: jax.Array
  offset: jax.Array


def round_to_e4m3_stochastic(y: jax.Array, draw: jax.Array) -> jax.Array:
  """y (float32, 0 <= y <= 448) to E4M3, stochastically: the upper of its two neighbouring
  codes with probability (y - lower) / (upper - lower), so that E[code] = y.

  The neighbours are found by arithmetic on powers of two (exact in float32): in y's
  binade [2**e, 2**(e + 1)) (e >= -6; below, E4M3's subnormals) the codes are 2**(e - 3)
  apart.

  Args:
    y: float32 magnitudes in [0, 448].
    draw: uniform [0, 1) numbers of y's shape.

  Returns:
    float8_e4m3fn codes.
  """
  exponent = (lax.bitcast_convert_type(y, jnp.int32) >> 23) - 127
  exponent = jnp.maximum(exponent, _SMALLEST_NORMAL_EXPONENT)
  power = lambda e: lax.bitcast_convert_type((e + 127) << 23, jnp.float32)
  spacing = power(exponent - _MANTISSA_BITS)
  per_spacing = power(_MANTISSA_BITS - exponent)
  lower = jnp.floor(y * per_spacing) * spacing
  upper = jnp.minimum(lower + spacing, E4M3_MAX)
  chosen = jnp.where(draw < (y - lower) * per_spacing, upper, lower)
  return chosen.astype(E4M3)


def decode_block(codes, k, offset, divide):
  """The float32 moment of codes [..., n] (float32) under their block's k and offset
  (broadcasting with them: [..., 1])."""
  magnitude = jnp.abs(codes)
  log_q = jnp.log2(jnp.where(magnitude > 0, magnitude, 1.0))
  value = jnp.exp2(divide(log_q + offset, k))
  return jnp.where(magnitude > 0, jnp.where(codes < 0, -value, value), 0.0)


def block_expansion(largest, smallest, k_max: float, divide):
  """(k, center, log_shift) of blocks whose nonzero magnitudes lie in [smallest, largest]
  (`fp8jax.optim.moment_codec`'s formulas; largest 0: an all-zero block)."""
  any_nonzero = largest > 0
  log_b = jnp.log2(jnp.where(any_nonzero, largest, 1.0))
  log_a = jnp.log2(jnp.where(any_nonzero, smallest, 1.0))
  spread = log_b - log_a
  k = jnp.where(spread > 0,
                jnp.floor(divide(K_STEP * TARGET_RATIO_LOG2, jnp.where(spread > 0, spread, 1.0)))
                / K_STEP, k_max)
  k = jnp.clip(k, 1.0 / K_STEP, k_max)
  center = 0.5 * (log_a + log_b)
  return k, center, k * (log_b - center) - LOG2_MAX


def expanded_codes(x, k, center, log_shift, draw):
  """x float32 [..., n] as float32 E4M3 codes (signed) under its block's expansion
  (broadcasting: [..., 1]); stochastic rounding with `draw`, else to nearest."""
  magnitude = jnp.abs(x)
  nonzero = magnitude > 0
  log_x = jnp.log2(jnp.where(nonzero, magnitude, 1.0))
  y = jnp.where(nonzero, jnp.exp2(k * (log_x - center) - log_shift), 0.0)
  y = jnp.minimum(y, E4M3_MAX)  # float32 rounding of the exp2 may land a hair above 448
  codes = y.astype(E4M3) if draw is None else round_to_e4m3_stochastic(y, draw)
  return jnp.where(x < 0, -codes.astype(jnp.float32), codes.astype(jnp.float32))


def encode_block(x, k_max: float, draw, divide):
  """x float32 [..., BLOCK] (zeros past the leaf's edge) as (codes float32, k, offset),
  k and offset [..., 1]; stochastic rounding with `draw`, else to nearest."""
  magnitude = jnp.abs(x)
  largest = jnp.max(magnitude, axis=-1, keepdims=True)
  smallest = jnp.min(jnp.where(magnitude > 0, magnitude, jnp.inf), axis=-1, keepdims=True)
  k, center, log_shift = block_expansion(largest, smallest, k_max, divide)
  return expanded_codes(x, k, center, log_shift, draw), k, k * center + log_shift


class AdamHyper(NamedTuple):
  """The update's static options: the storage's k_max and the second moment's rounding."""

  k_max: float
  stochastic: bool


# The step's float32 numbers, one operand: b1 and b2 with their complements as the jnp step
# makes them (`adam_constants`), eps_root, eps, and the bias corrections 1 - b**t.
CONSTANTS = ("one_minus_b1", "b1", "one_minus_b2", "b2", "eps_root", "eps", "correction1",
             "correction2")


def adam_constants(b1, b2, eps, eps_root, correction1, correction2) -> jax.Array:
  """`CONSTANTS` as float32[8]. b1 and b2 may be Python floats (1 - b rounded once to
  float32, as in `(1 - b1) * g`) or traced arrays (`optax.inject_hyperparams`)."""
  values = (1 - b1, b1, 1 - b2, b2, eps_root, eps, correction1, correction2)
  return jnp.stack([jnp.asarray(v, jnp.float32) for v in values])


MAX_AXES = 8  # the starts operand's length (a power of two, as Triton's blocks)

# The applied step's float32 numbers, one operand. The gradient is clipped first as
# `optax.clip_by_global_norm` does (g unchanged if grad_norm < max_grad_norm, else
# g / grad_norm * max_grad_norm; max_grad_norm inf: never); then new p = p + step_size *
# (update + weight_decay * p), optax's `add_decayed_weights` (none added for a decay of
# 0), `scale_by_learning_rate` and `apply_updates` in their order (step_size is minus the
# learning rate).
APPLIED = ("step_size", "weight_decay", "grad_norm", "max_grad_norm")


class LeafPlace(NamedTuple):
  """Where a kernel's [R, C] array lies in the whole leaf [n_0, ..., n_{d-1}, C], whose
  random numbers are indexed row-major.

  Attributes:
    leading: the shard's sizes of the leaf's leading axes (their product is R).
    strides: the whole leaf's strides of those axes, in elements.
  The starts of the shard along each axis (the leading ones, then the columns) are an
  operand, int32[MAX_AXES] (each device's own on a mesh)."""

  leading: tuple[int, ...]
  strides: tuple[int, ...]

  @classmethod
  def whole(cls, shape: tuple[int, ...]) -> "LeafPlace":
    """The place of a whole (unsharded) leaf of `shape`."""
    strides, stride = [], shape[-1]
    for size in reversed(shape[:-1]):
      strides.append(stride)
      stride *= size
    return cls(tuple(shape[:-1]), tuple(reversed(strides)))


def _flat_index(row, column, starts_ref, place: LeafPlace):
  """uint32 row-major index in the whole leaf of the shard's element (row, column)."""
  index = (column + starts_ref[len(place.leading)]).astype(jnp.uint32)
  rest = row
  for axis in reversed(range(len(place.leading))):
    size = place.leading[axis]
    local = rest % size if axis else rest
    rest = rest // size
    index = index + ((local + starts_ref[axis]).astype(jnp.uint32)
                     * jnp.uint32(place.strides[axis]))
  return index


def _kernel(*refs, hyper: AdamHyper, shape: tuple[int, int], place: LeafPlace,
            block_rows: int, applies: bool, interpret: bool):
  inputs = 12 if applies else 10
  (g_ref, mu_codes_ref, mu_k_ref, mu_offset_ref, nu_codes_ref, nu_k_ref, nu_offset_ref,
   constants_ref, key_ref, starts_ref) = refs[:10]
  (first_ref, new_mu_codes_ref, new_mu_k_ref, new_mu_offset_ref, new_nu_codes_ref,
   new_nu_k_ref, new_nu_offset_ref) = refs[inputs:]
  rows, columns = shape
  row = pl.program_id(0) * block_rows + lax.broadcasted_iota(jnp.int32, (block_rows, 1), 0)
  column = pl.program_id(1) * BLOCK + lax.broadcasted_iota(jnp.int32, (1, BLOCK), 1)
  row_mask = row < rows
  mask = jnp.logical_and(row_mask, column < columns)

  def divide(numerator, denominator):
    shape = jnp.broadcast_shapes(jnp.shape(numerator), jnp.shape(denominator))
    return _divide(numerator, jnp.broadcast_to(denominator, shape), interpret)

  tile = lambda ref: plgpu.load(ref, mask=mask, other=0.0).astype(jnp.float32)
  per_row = lambda ref: plgpu.load(ref, mask=row_mask, other=0.0)

  g = tile(g_ref)
  if applies:
    param_ref, applied_ref = refs[10:12]
    a = {name: applied_ref[i] for i, name in enumerate(APPLIED)}
    g = jnp.where(a["grad_norm"] < a["max_grad_norm"], g,
                  divide(g, a["grad_norm"]) * a["max_grad_norm"])
  c = {name: constants_ref[i] for i, name in enumerate(CONSTANTS)}
  # optax's order of operations, as `fp8jax.optim.scale_by_adam_fp8`.
  mu = c["one_minus_b1"] * g + c["b1"] * decode_block(
      tile(mu_codes_ref), per_row(mu_k_ref), per_row(mu_offset_ref), divide)
  nu = c["one_minus_b2"] * (g ** 2) + c["b2"] * decode_block(
      tile(nu_codes_ref), per_row(nu_k_ref), per_row(nu_offset_ref), divide)
  mu_hat = divide(mu, c["correction1"])
  nu_hat = divide(nu, c["correction2"])
  update = divide(mu_hat, jnp.sqrt(nu_hat + c["eps_root"]) + c["eps"])
  if applies:
    p = tile(param_ref)
    # A decay of 0 adds nothing (as optax skips it), not 0 * p (NaN for an infinite p).
    decayed = jnp.where(a["weight_decay"] == 0, update, update + a["weight_decay"] * p)
    store_masked(first_ref, (p + a["step_size"] * decayed).astype(first_ref.dtype), mask)
  else:
    store_masked(first_ref, update.astype(first_ref.dtype), mask)

  draw = None
  if hyper.stochastic:
    # The element's flat index in the whole leaf: jax.random.uniform's counter.
    draw = threefry.uniform((key_ref[0], key_ref[1]),
                            _flat_index(row, column, starts_ref, place))
  for moment, rounding, codes_ref, k_ref, offset_ref in (
      (mu, None, new_mu_codes_ref, new_mu_k_ref, new_mu_offset_ref),
      (nu, draw, new_nu_codes_ref, new_nu_k_ref, new_nu_offset_ref)):
    codes, k, offset = encode_block(moment, hyper.k_max, rounding, divide)
    store_masked(codes_ref, codes.astype(E4M3), mask)
    store_masked(k_ref, k, row_mask)
    store_masked(offset_ref, offset, row_mask)


def adam_fp8_update(g: jax.Array, mu: StoredMoment, nu: StoredMoment,
                    constants: jax.Array, key_words: jax.Array, starts: jax.Array, *,
                    hyper: AdamHyper, param: jax.Array | None = None,
                    applied: jax.Array | None = None, place: LeafPlace | None = None,
                    block_rows: int = 32, num_warps: int = 4, interpret: bool = False
                    ) -> tuple[jax.Array, StoredMoment, StoredMoment]:
  """One Adam step of a 2-D leaf whose moments are stored in FP8, in one pass.

  Args:
    g: the gradient [R, C] (float32, bf16 or f16).
    mu, nu: the stored first and second moments (`StoredMoment`, blocks of 128 columns).
    constants: float32[8], the step's numbers (`adam_constants`).
    key_words: uint32[2], the key of the second moment's stochastic rounding (unused
      without `hyper.stochastic`).
    starts: int32[MAX_AXES], where the shard starts along each axis of the leaf (its
      leading axes, then its columns; zeros unsharded).
    hyper: the update's static options.
    param: the parameter [R, C] (float32), or None. Given, the step writes the new
      parameter over it (`APPLIED`) instead of returning the update.
    applied: float32[4], `APPLIED`'s numbers; with `param` only.
    place: the shard's place in the leaf (`LeafPlace.whole(g.shape)`, the default: g is
      the whole leaf).
    block_rows, num_warps: the tiles' rows and each program's warps.
    interpret: run in the Pallas interpreter (CPU).

  Returns:
    (update [R, C] in g's dtype, or with `param` the new parameter in its dtype, the new
    mu, the new nu).
  """
  rows, columns = g.shape
  applies = param is not None
  if applies != (applied is not None):
    raise ValueError("param and applied go together: pass both (the step writes the new "
                     "parameter) or neither (it returns the update).")
  if applies and (param.shape != g.shape or applied.shape != (len(APPLIED),)):
    raise ValueError(f"param {param.shape} must have g's shape {g.shape} and applied "
                     f"{applied.shape} must be ({len(APPLIED)},) {APPLIED}.")
  blocks = pl.cdiv(columns, BLOCK)
  for name, moment in (("mu", mu), ("nu", nu)):
    if (moment.codes.shape != g.shape or moment.codes.dtype != E4M3
        or moment.k.shape != (rows, blocks) or moment.offset.shape != (rows, blocks)):
      raise ValueError(
          f"{name}: codes float8_e4m3fn {g.shape} and k, offset float32 {(rows, blocks)} "
          f"(one per row and block of {BLOCK} columns) go with g {g.shape}; got codes "
          f"{moment.codes.dtype} {moment.codes.shape}, k {moment.k.shape}, offset "
          f"{moment.offset.shape}.")
  place = LeafPlace.whole(g.shape) if place is None else place
  if math.prod(place.leading) != rows:
    raise ValueError(f"place.leading={place.leading} must multiply to g's rows {rows}.")
  tile_spec = pl.BlockSpec((block_rows, BLOCK), lambda i, j: (i, j))
  row_spec = pl.BlockSpec((block_rows, 1), lambda i, j: (i, j))
  whole = lambda length: pl.BlockSpec((length,), lambda i, j: (0,))
  per_block = jax.ShapeDtypeStruct((rows, blocks), jnp.float32)
  codes = jax.ShapeDtypeStruct((rows, columns), E4M3)
  first = param if applies else g
  # Each moment is written over its stored self, and the new parameter over the old (a
  # program reads its tiles before it writes them): XLA gives a donated optimizer state's
  # and parameter's buffers to the new ones without a copy.
  aliases = {operand: operand for operand in range(1, 7)}
  operands = [g, *mu, *nu, constants.astype(jnp.float32), key_words.astype(jnp.uint32),
              starts.astype(jnp.int32)]
  in_specs = [tile_spec, tile_spec, row_spec, row_spec, tile_spec, row_spec, row_spec,
              whole(len(CONSTANTS)), whole(2), whole(MAX_AXES)]
  if applies:
    aliases[len(operands)] = 0
    operands += [param, applied.astype(jnp.float32)]
    in_specs += [tile_spec, whole(len(APPLIED))]
  outs = pl.pallas_call(
      functools.partial(_kernel, hyper=hyper, shape=(rows, columns),
                        place=place, block_rows=block_rows, applies=applies,
                        interpret=interpret),
      grid=(pl.cdiv(rows, block_rows), blocks),
      in_specs=in_specs,
      out_specs=[tile_spec, tile_spec, row_spec, row_spec, tile_spec, row_spec, row_spec],
      out_shape=[jax.ShapeDtypeStruct(first.shape, first.dtype), codes, per_block,
                 per_block, codes, per_block, per_block],
      input_output_aliases=aliases,
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
      interpret=interpret,
      name="adam_fp8_update",
  )(*operands)
  written, *moments = outs
  return written, StoredMoment(*moments[:3]), StoredMoment(*moments[3:])
