"""The dots a module calls itself, read as one `lax.dot_general`: `read_dot_call`.

`lax.dot_general(lhs, rhs, dimension_numbers)`, `jnp.einsum("...", a, b)`,
`jnp.matmul(a, b)` and `jnp.dot(a, b)` are each one GEMM of two operands.
`read_dot_call` turns such a call into the dimension numbers `fp8_dot_general`
takes, the permutation its output needs, and the `LayerInfo` a filter sees; or
says why the call is no GEMM fp8jax can run (an einsum of three operands, a
label summed over one operand, integer operands, an output sharding, ...).
`lax.ragged_dot(x [M, K], w [G, K, N], group_sizes)`, the expert GEMMs of a
mixture-of-experts layer, runs as `fp8_ragged_dot` with a state per expert.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import opt_einsum

from fp8jax.ops.dot import fp8_dot_general
from fp8jax.ops.einsum import parse_two_operand_subscripts
from fp8jax.ops.ragged_dot import fp8_ragged_dot
from fp8jax.flax.layer_filter import LayerInfo
from fp8jax.flax.op_routing import is_jax_function
from fp8jax.core.meta import DotMeta, RaggedDotMeta, init_dot_meta, init_ragged_dot_meta
from fp8jax.core.recipes import Recipe


@dataclasses.dataclass(frozen=True)
class DotCall:
  """One call read as `lax.dot_general(lhs, rhs, dims)`, or why it cannot run in FP8.

  Attributes:
    kind: "dot_general", "einsum", "matmul", "dot" or "ragged_dot".
    lhs, rhs: the operands (None when the call is not a two-operand dot).
    dims: dimension numbers for `fp8_dot_general` (None for "ragged_dot").
    permutation: the transpose that takes dot_general's output to the call's, or None.
    dtype: the output dtype the call asks for.
    blocker: why FP8 cannot run this call, or None.
    group_sizes: "ragged_dot"'s rows per group.
  """

  kind: str
  lhs: Any
  rhs: Any
  dims: Any = None
  permutation: tuple | None = None
  dtype: Any = None
  blocker: str | None = None
  group_sizes: Any = None

  def info(self, path: tuple) -> LayerInfo:
    """What rules and filters see: the second operand plays the kernel (for a grouped
    matmul, each expert's [K, N] weight: K in, N out, the expert axis a batch dim)."""
    rhs_shape = tuple(self.rhs.shape)
    if self.kind == "ragged_dot" and len(rhs_shape) == 3:
      return LayerInfo(path, self.kind, rhs_shape, rhs_shape[1:2], rhs_shape[2:],
                       tuple(self.lhs.shape))
    if self.dims is None:
      return LayerInfo(path, self.kind, rhs_shape, (), rhs_shape, tuple(self.lhs.shape))
    (_, rhs_contract), (_, rhs_batch) = self.dims
    in_features = tuple(rhs_shape[d] for d in rhs_contract)
    out_features = tuple(s for d, s in enumerate(rhs_shape)
                         if d not in rhs_contract and d not in rhs_batch)
    return LayerInfo(path, self.kind, rhs_shape, in_features, out_features,
                     tuple(self.lhs.shape))


def read_dot_call(kind: str, args: tuple, kwargs: dict) -> DotCall | None:
  """The call as a `DotCall`; None when it is not a call on two arrays (left alone)."""
  try:
    call = _READERS[kind](*args, **kwargs)
  except TypeError:
    return None  # not a signature we know: the function itself reports it
  if call is None or call.blocker is not None:
    return call
  for name, operand in (("lhs", call.lhs), ("rhs", call.rhs)):
    dtype = jnp.dtype(operand.dtype)
    if not jnp.issubdtype(dtype, jnp.floating) or dtype.itemsize < 2:
      return dataclasses.replace(call, blocker=f"its {name} is {dtype}, not a float of 16 bits "
                                 "or more")
  if call.dims is not None and not call.dims[0][0]:
    return dataclasses.replace(call, blocker="it contracts no dimension (an outer product)")
  return call


def init_call_meta(call: DotCall, recipe: Recipe) -> DotMeta | RaggedDotMeta:
  """Fresh FP8 state for `call`: a `RaggedDotMeta` (a scale per expert) for a grouped
  matmul, else a `DotMeta`."""
  if call.kind == "ragged_dot":
    return init_ragged_dot_meta(recipe, int(call.rhs.shape[0]))
  return init_dot_meta(recipe)


def fp8_dot_call(call: DotCall, meta: DotMeta | RaggedDotMeta):
  """The call computed by `fp8_dot_general` (or `fp8_ragged_dot`) with `meta`: (output as
  the call gives it, new_meta). The operands are promoted to their common dtype first, as
  the call would."""
  dtype = jnp.result_type(call.lhs, call.rhs)  # weak types promote as in the call
  if call.kind == "ragged_dot":
    y, new_meta = fp8_ragged_dot(call.lhs.astype(dtype), call.rhs.astype(dtype),
                                 call.group_sizes, meta)
    return y.astype(call.dtype), new_meta
  y, new_meta = fp8_dot_general(call.lhs.astype(dtype), call.rhs.astype(dtype), meta, call.dims)
  if call.permutation is not None:
    y = jnp.transpose(y, call.permutation)
  return y.astype(call.dtype), new_meta


def _arrays(*values) -> bool:
  return all(hasattr(v, "shape") and hasattr(v, "dtype") for v in values)


def _options_blocker(precision=None, preferred_element_type=None, out_sharding=None,
                     **others) -> str | None:
  del precision  # FP8 GEMMs accumulate in float32 whatever the precision asked
  if out_sharding is not None:
    return "it names an out_sharding"
  if preferred_element_type is not None and not jnp.issubdtype(preferred_element_type,
                                                                jnp.floating):
    return f"preferred_element_type={jnp.dtype(preferred_element_type)} is not a float"
  for name, value in others.items():
    if value is not None:
      return f"it passes {name}"
  return None


def _dtype(lhs, rhs, preferred_element_type):
  if preferred_element_type is not None:
    return jnp.dtype(preferred_element_type)
  return jnp.result_type(lhs, rhs)


def _read_dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None,
                      **options) -> DotCall | None:
  if not _arrays(lhs, rhs):
    return None
  blocker = _options_blocker(precision, preferred_element_type, **options)
  (lc, rc), (lb, rb) = dimension_numbers
  dims = ((tuple(lc), tuple(rc)), (tuple(lb), tuple(rb)))
  return DotCall("dot_general", lhs, rhs, dims, None,
                 _dtype(lhs, rhs, preferred_element_type), blocker)


def _read_einsum(subscripts, *operands, out=None, optimize=None, precision=None,
                 preferred_element_type=None, _dot_general=None, **options) -> DotCall | None:
  del optimize  # two operands: one contraction, whatever the path
  if len(operands) != 2 or not _arrays(*operands):
    return None  # not one GEMM of two arrays
  if not isinstance(subscripts, str):
    return DotCall("einsum", operands[0], operands[1], blocker="its subscripts are not a string")
  lhs, rhs = operands
  if _dot_general is not None and is_jax_function(_dot_general, "dot_general"):
    _dot_general = None  # Flax's attention passes lax.dot_general itself: the default
  blocker = _options_blocker(precision, preferred_element_type, out=out,
                             _dot_general=_dot_general, **options)
  try:
    terms, out_labels, _ = opt_einsum.parser.parse_einsum_input(
        (subscripts.replace(" ", ""), jax.ShapeDtypeStruct(lhs.shape, lhs.dtype),
         jax.ShapeDtypeStruct(rhs.shape, rhs.dtype)))
    spec = f"{terms}->{out_labels}"  # the ellipsis spelled out
    x_labels, k_labels, out_labels = parse_two_operand_subscripts(spec, lhs.ndim, rhs.ndim)
  except ValueError as error:
    return DotCall("einsum", lhs, rhs, blocker=blocker or str(error).rstrip("."))
  batch = [c for c in x_labels if c in k_labels and c in out_labels]
  contract = [c for c in x_labels if c in k_labels and c not in out_labels]
  if any(lhs.shape[x_labels.index(c)] != rhs.shape[k_labels.index(c)] for c in batch):
    return DotCall("einsum", lhs, rhs, blocker=blocker or "its batch dims broadcast")
  dims = ((tuple(x_labels.index(c) for c in contract), tuple(k_labels.index(c) for c in contract)),
          (tuple(x_labels.index(c) for c in batch), tuple(k_labels.index(c) for c in batch)))
  produced = batch + [c for c in x_labels if c not in k_labels] + [
      c for c in k_labels if c not in x_labels]
  permutation = tuple(produced.index(c) for c in out_labels)
  if permutation == tuple(range(len(permutation))):
    permutation = None
  return DotCall("einsum", lhs, rhs, dims, permutation,
                 _dtype(lhs, rhs, preferred_element_type), blocker)


def _read_matmul(a, b, *, precision=None, preferred_element_type=None,
                 **options) -> DotCall | None:
  return _matrix_product("matmul", a, b, precision, preferred_element_type, options)


def _read_dot(a, b, *, precision=None, preferred_element_type=None,
              **options) -> DotCall | None:
  if _arrays(a, b) and b.ndim > 2:
    return DotCall("dot", a, b, blocker="jnp.dot of a kernel of rank > 2 is not one GEMM")
  return _matrix_product("dot", a, b, precision, preferred_element_type, options)


def _matrix_product(kind, a, b, precision, preferred_element_type, options) -> DotCall | None:
  if not _arrays(a, b):
    return None
  blocker = _options_blocker(precision, preferred_element_type, **options)
  if a.ndim < 2 or b.ndim < 2:
    return DotCall(kind, a, b, blocker=blocker or "an operand is a vector")
  if b.ndim == 2:
    dims = (((a.ndim - 1,), (0,)), ((), ()))
  elif a.shape[:-2] == b.shape[:-2]:
    batch = tuple(range(a.ndim - 2))
    dims = (((a.ndim - 1,), (b.ndim - 2,)), (batch, batch))
  else:
    return DotCall(kind, a, b, blocker=blocker or "its batch dims broadcast")
  return DotCall(kind, a, b, dims, None, _dtype(a, b, preferred_element_type), blocker)


def _read_ragged_dot(lhs, rhs, group_sizes, precision=None, preferred_element_type=None,
                     **options) -> DotCall | None:
  if not _arrays(lhs, rhs, group_sizes):
    return None
  blocker = _options_blocker(precision, preferred_element_type, **options)
  if lhs.ndim != 2 or rhs.ndim != 3 or lhs.shape[1] != rhs.shape[1]:
    blocker = blocker or (f"it is not x [M, K] by w [G, K, N] (x {tuple(lhs.shape)}, w "
                          f"{tuple(rhs.shape)})")
  elif jnp.shape(group_sizes) != (rhs.shape[0],) or not jnp.issubdtype(group_sizes.dtype,
                                                                        jnp.integer):
    blocker = blocker or "its group_sizes is not an integer array of one size per group"
  return DotCall("ragged_dot", lhs, rhs, None, None, _dtype(lhs, rhs, preferred_element_type),
                 blocker, group_sizes)


_READERS = {"dot_general": _read_dot_general, "einsum": _read_einsum,
            "matmul": _read_matmul, "dot": _read_dot, "ragged_dot": _read_ragged_dot}
