"""Argument checks of the cast-transpose-amax kernels' public functions.

Each check names the argument, says what was wrong and how to fix it, and returns the
argument in the form the kernels take (float32 scalars as arrays, tuples of them).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import rotary_gradient

from pallas_kernels.cast_transpose_tiling import GROUP_COLUMNS, CastTransposeBlockSizes
from pallas_kernels.vector_element import VectorElement, check_vector_element

FP8_MAX = {
    jnp.dtype(jnp.float8_e4m3fn): float(jnp.finfo(jnp.float8_e4m3fn).max),  # 448
    jnp.dtype(jnp.float8_e5m2): float(jnp.finfo(jnp.float8_e5m2).max),      # 57344
}
INPUT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
# A prologue may also read FP8 codes (an activation kept for the backward pass in E4M3).
PROLOGUE_INPUT_DTYPES = INPUT_DTYPES + (jnp.dtype(jnp.float8_e4m3fn),)


def check_x(x) -> None:
  shape = jnp.shape(x)
  if len(shape) != 2:
    raise ValueError(
        f"x must be a 2-D [rows, cols] array, got shape {shape}; reshape it first, "
        "e.g. x.reshape(-1, x.shape[-1]).")
  if 0 in shape:
    raise ValueError(f"x has shape {shape}, with no elements; it has no FP8 copy or amax.")
  dtype = jnp.result_type(x)
  if dtype not in INPUT_DTYPES:
    raise TypeError(
        f"x has dtype {dtype}; pass bfloat16, float16 or float32 "
        "(e.g. x.astype(jnp.bfloat16)).")


def check_fp8(fp8_dtype, fp8_max) -> jnp.dtype:
  try:
    dtype = jnp.dtype(fp8_dtype)
  except TypeError:
    dtype = None
  if dtype not in FP8_MAX:
    raise TypeError(
        f"fp8_dtype={fp8_dtype!r} is not supported; pass jnp.float8_e4m3fn or "
        "jnp.float8_e5m2.")
  if isinstance(fp8_max, bool) or not isinstance(fp8_max, (int, float)) \
      or float(fp8_max) != FP8_MAX[dtype]:
    raise ValueError(
        f"fp8_max={fp8_max!r} does not match fp8_dtype {dtype.name}, whose largest finite "
        f"value is {FP8_MAX[dtype]}; pass fp8_max={FP8_MAX[dtype]}.")
  return dtype


def check_products(descale, partner_descales):
  """(descale f32[], tuple of f32[]) or (None, None); both or neither must be given."""
  if (descale is None) != (partner_descales is None):
    raise ValueError("descale and partner_descales go together: pass both (to get the GEMMs' "
                     "combined descales) or neither.")
  if descale is None:
    return None, None
  if not isinstance(partner_descales, (tuple, list)) or not 1 <= len(partner_descales) <= 4:
    raise ValueError("partner_descales must be a tuple of 1 to 4 float32 scalars, got "
                     f"{type(partner_descales).__name__}.")
  partners = tuple(scalar_f32(p, f"partner_descales[{i}]", element_ok=True)
                   for i, p in enumerate(partner_descales))
  return scalar_f32(descale, "descale", element_ok=True), partners


def check_margin(margin) -> None:
  if isinstance(margin, bool) or not isinstance(margin, int) or margin < 0:
    raise ValueError(f"margin={margin!r} must be an int >= 0 (the scale is divided by "
                     "2**margin).")


def check_accumulation(amax_in, accumulator, tile_amaxes):
  """(how the launch accumulates, amax_in, accumulator), checked."""
  if tile_amaxes:
    if amax_in is not None or accumulator is not None:
      raise ValueError("tile_amaxes=True writes each tile's maximum and reads no running "
                       "amax: pass amax_in=None and no accumulator, and give the running "
                       "amax to the launch that reduces the tiles (reduce=(tiles, amax_in)).")
    return "tiles", None, None
  amax_in = scalar_f32(amax_in, "amax_in")
  if accumulator is None:
    return "in_place", amax_in, None
  return "accumulator", amax_in, scalar_f32(accumulator, "accumulator")


def check_reduce(reduce):
  """(tiles float32[T], running float32[]) or None."""
  if reduce is None:
    return None
  if not isinstance(reduce, (tuple, list)) or len(reduce) != 2:
    raise ValueError("reduce must be (tiles, running): an earlier launch's tile maxima and "
                     f"its running amax; got {type(reduce).__name__}.")
  tiles, running = reduce
  if jnp.ndim(tiles) != 1 or jnp.size(tiles) == 0 or jnp.result_type(tiles) != jnp.float32:
    raise ValueError(f"reduce[0] must be a non-empty float32 vector of tile maxima, got shape "
                     f"{jnp.shape(tiles)} and dtype {jnp.result_type(tiles)}.")
  return tiles, scalar_f32(running, "reduce[1]")


def check_pass_through(pass_through) -> tuple:
  """The arrays to copy through, as float32 arrays of at most one dimension."""
  if not isinstance(pass_through, (tuple, list)):
    raise ValueError(f"pass_through must be a tuple of float32 arrays, got "
                     f"{type(pass_through).__name__}.")
  arrays = tuple(jnp.asarray(a) for a in pass_through)
  for i, a in enumerate(arrays):
    if a.ndim > 1 or a.size == 0 or a.dtype != jnp.float32:
      raise ValueError(f"pass_through[{i}] must be a non-empty float32 scalar or vector, got "
                       f"shape {a.shape} and dtype {a.dtype}.")
  return arrays


def scalar_f32(value, argname: str, element_ok: bool = False) -> jax.Array | VectorElement:
  """`value` as a float32[] array; Python floats are accepted, other dtypes are not.
  With `element_ok`, a `VectorElement` (a float32 read in place from a vector: scales and
  descales, which the kernel only reads) is checked and kept."""
  if isinstance(value, VectorElement):
    if not element_ok:
      raise ValueError(f"{argname} cannot be a VectorElement here: pass a float32[] array "
                       "(scales, descales and a read-only running amax may be read from a "
                       "vector).")
    return check_vector_element(value, argname)
  if isinstance(value, (int, float)) and not isinstance(value, bool):
    return jnp.asarray(value, jnp.float32)
  shape = jnp.shape(value)
  dtype = jnp.result_type(value)
  if shape != () or dtype != jnp.float32:
    raise ValueError(
        f"{argname} must be a float32 scalar (shape ()), got shape {shape} and dtype "
        f"{dtype}; pass one value per tensor, e.g. jnp.float32(v) or "
        f"{argname}.astype(jnp.float32).")
  return jnp.asarray(value)


def row_limit(valid_rows) -> jax.Array | None:
  """`valid_rows` (the rows in use) as an int32[] array, or None."""
  if valid_rows is None:
    return None
  if jnp.shape(valid_rows) != () or not jnp.issubdtype(jnp.result_type(valid_rows), jnp.integer):
    raise ValueError(
        f"valid_rows must be one integer, the number of leading rows of x in use (int32[]); "
        f"got shape {jnp.shape(valid_rows)} and dtype {jnp.result_type(valid_rows)}.")
  return jnp.asarray(valid_rows, jnp.int32)


def check_flag(value, argname: str) -> None:
  if not isinstance(value, bool):
    raise TypeError(f"{argname} must be True or False, got {value!r}.")


def check_block_sizes(block_sizes) -> None:
  if not isinstance(block_sizes, CastTransposeBlockSizes):
    raise TypeError(
        f"block_sizes must be a CastTransposeBlockSizes, got "
        f"{type(block_sizes).__name__}: {block_sizes!r}.")


def check_prologue(prologue, prologue_inputs, x) -> tuple:
  """The prologue's further tensors as a tuple, each of x's shape [R, C], or one row's
  values [R, 1], one column's [1, C] or one per row and group [R, ceil(C / GROUP_COLUMNS)]
  (`broadcast_kind`), in an input dtype or E4M3."""
  from_inputs = tuple(prologue_inputs)
  wanted = 0 if prologue is None else prologue.inputs
  if len(from_inputs) != wanted:
    raise ValueError(f"prologue_inputs has {len(from_inputs)} tensors but the prologue "
                     f"{'(none)' if prologue is None else _name(prologue.fn)} reads {wanted} "
                     "besides x.")
  for i, t in enumerate(from_inputs):
    if broadcast_kind(jnp.shape(t), jnp.shape(x)) is None or (
        jnp.result_type(t) not in PROLOGUE_INPUT_DTYPES):
      raise ValueError(f"prologue_inputs[{i}] has shape {jnp.shape(t)} and dtype "
                       f"{jnp.result_type(t)}; it must have x's shape {jnp.shape(x)} (or "
                       f"[R, 1], a value per row, [1, C], one per column, or "
                       f"[R, ceil(C / {GROUP_COLUMNS})], one per row and group of columns) "
                       f"and a dtype of {[d.name for d in PROLOGUE_INPUT_DTYPES]}.")
  if prologue is not None and prologue.rotary is not None:
    rotary_gradient.check_shapes(jnp.shape(x), [jnp.shape(t) for t in from_inputs],
                                 prologue.rotary)
  return from_inputs


def _name(fn) -> str:
  return getattr(fn, "__name__", None) or getattr(getattr(fn, "func", None), "__name__", repr(fn))


def broadcast_kind(shape: tuple, x_shape: tuple) -> str | None:
  """How a prologue input of `shape` covers a 2-D x of `x_shape`: "tile" (x's shape),
  "rows" ([R, 1], one value per row), "columns" ([1, C]), "groups" ([R, ceil(C /
  GROUP_COLUMNS)], one value per row and group of `GROUP_COLUMNS` columns, where C spans
  more than one group), or None (none of these)."""
  shape, x_shape = tuple(shape), tuple(x_shape)
  if shape == x_shape:
    return "tile"
  if len(x_shape) != 2:
    return None
  if shape == (x_shape[0], 1):
    return "rows"
  if shape == (1, x_shape[1]):
    return "columns"
  if shape == (x_shape[0], -(-x_shape[1] // GROUP_COLUMNS)):
    return "groups"
  return None
