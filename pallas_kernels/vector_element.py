"""`VectorElement`: a float32 scalar operand that a kernel reads from a vector in place.

A kernel's scalar operand that is an element of a larger array (a layer's scale in a
stack of layers' state, one of several scales packed together) would otherwise be
sliced out by a launch of its own before the kernel: XLA fuses a slice into the
kernels it writes, never into a custom call. Handed over as `VectorElement(vector,
index)`, the kernel's block of that operand is `vector[index]` itself, so one vector
of packed scalars costs no launch for any of the kernels that read it.
"""
from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp


@jax.tree_util.register_pytree_node_class
class VectorElement:
  """`vector[index]` as a kernel's float32 scalar operand (`vector` float32 [n], `index`
  a Python int, static)."""

  def __init__(self, vector: jax.Array, index: int):
    self.vector = vector
    self.index = index

  def value(self) -> jax.Array:
    """The element as a float32[] array (what the plain-jnp forms compute with)."""
    return self.vector[self.index]

  def tree_flatten(self):
    return (self.vector,), self.index

  @classmethod
  def tree_unflatten(cls, index, children):
    return cls(children[0], index)

  def __repr__(self):
    return f"VectorElement({jax.typeof(self.vector)}, index={self.index})"


def check_vector_element(value: VectorElement, argname: str) -> VectorElement:
  """Raises ValueError unless `value` reads a float32 element of a 1-D float32 vector."""
  shape, dtype = jnp.shape(value.vector), jnp.result_type(value.vector)
  index = value.index
  if (len(shape) != 1 or dtype != jnp.float32 or isinstance(index, bool)
      or not isinstance(index, numbers.Integral) or not 0 <= index < shape[0]):
    raise ValueError(
        f"{argname}: a VectorElement must read element index of a float32 [n] vector with "
        f"0 <= index < n; got a vector of shape {shape} and dtype {dtype} and index "
        f"{index!r}.")
  return value


def element_value(value):
  """`value.value()` for a `VectorElement`, `value` itself otherwise (None included)."""
  return value.value() if isinstance(value, VectorElement) else value
