"""Moving FP8 state between Flax's `fp8_ops` and fp8jax, without a loss spike.

Flax's `nn.Dense(dot_general_cls=nn.Fp8DirectDotGeneralOp)` keeps, per layer, in
the "_overwrite_with_gradient" collection: `input_`, `kernel_` and
`output_grad_` `amax_history` (float32[L]) and `scale` (float32[1]). Two
conventions differ from fp8jax's `Fp8Meta`:

- Flax's `scale` is a divisor (`q = x / scale`), and it is the one the *last*
  step used: each step recomputes `fp8_max / max(history)` from the history
  before recording its own amax, and keeps the stored scale only as the fallback
  when that is not usable. fp8jax stores the multiplier the *next* step uses.
- Flax's history is rotated: each step rolls it by one to the left and writes
  the new amax at index 0, so after n steps it reads
  `[a_n, a_(n-L+1), ..., a_(n-1)]`; fp8jax's is newest first,
  `[a_n, a_(n-1), ..., a_(n-L+1)]`.

`from_flax_fp8_ops` gives each layer the `DotMeta` whose next step quantizes with
exactly the scale Flax's next step would compute; `to_flax_fp8_ops` gives back
the rotated history (from which Flax recomputes the same scale) and the divisor
`1 / scale`. Both take the state between steps (as a step returned it). Flax's
layers keep no margin and use E4M3 for x and kernel, E5M2 for gradients, with
the max over the history: the recipe is `DelayedScaling(amax_history_len=L,
amax_compute_algo="max", margin=0, fp8_format="hybrid")`.

What carries over, and when the next step is the same step:

* The state, always: fp8jax's next scales are the ones Flax's next step computes,
  and `to_flax_fp8_ops(from_flax_fp8_ops(s))` continues exactly as `s` does.
* The step, in float32 with `Fp8DirectDotGeneralOp`: the two libraries compute
  the same step. After the same steps on the same inputs the converted Flax state
  is fp8jax's own state bit for bit, and the next step's outputs and gradients
  agree up to how each applies a scale (Flax divides by `1 / s`, fp8jax multiplies
  by `s`: a float32 ulp, which can move an element across an FP8 rounding boundary).
* Not in bf16 (a compute dtype other than float32): Flax quantizes in bf16
  (`x / scale` with the scale rounded to bf16, then the cast to FP8: two
  roundings) and forms and descales each GEMM's product in bf16, where fp8jax
  scales and descales in float32 and rounds once. From the same state the next
  step's outputs and gradients differ by percents (7 to 12% of the largest
  gradient element of a small two-layer MLP), and the amaxes downstream of the
  first product differ from then on: switching carries the scales over, not the
  trajectory.
* Not bit for bit with `Fp8DotGeneralOp` (Flax's deprecated quantize-dequantize
  op), even in float32: it multiplies dequantized operands where fp8jax descales
  the FP8 product, so tensors computed from a product (a later layer's input, an
  earlier layer's output gradient) and their amaxes differ in the last float32
  bits (~1e-7 relative). Pass `op_name="Fp8DotGeneralOp"` to `to_flax_fp8_ops`.

Layer names: Flax's op submodule is named after its class
(`Dense_0/Fp8DirectDotGeneralOp_0`), fp8jax's after `Fp8DotGeneral`
(`Dense_0/Fp8DotGeneral_0/dot_meta`); the conversion renames them, so the
state fits the same model with `dot_general_cls=fp8jax.flax.linen.Fp8DotGeneral`.
"""
from __future__ import annotations

from typing import Mapping

import jax.numpy as jnp
from jax import lax

from fp8jax.core.formats import E4M3, E5M2
from fp8jax.core.meta import DotMeta, Fp8Meta, is_meta
from fp8jax.core.recipes import DelayedScaling, is_flax_fp8_ops_recipe
from fp8jax.core.quantize import scale_from_amax

FLAX_COLLECTION = "_overwrite_with_gradient"
# fp8jax role -> Flax's variable-name prefix.
_ROLES = {"x": "input", "kernel": "kernel", "grad": "output_grad"}
_FLAX_VARIABLES = frozenset(f"{prefix}_{kind}" for prefix in _ROLES.values()
                            for kind in ("amax_history", "scale"))
# Flax's FP8 dot_general ops, whose submodule names become fp8jax's op name.
FLAX_OP_NAMES = ("Fp8DirectDotGeneralOp", "Fp8DotGeneralOp")
FP8JAX_OP_NAME = "Fp8DotGeneral"
META_NAME = "dot_meta"


def from_flax_fp8_ops(flax_state: Mapping) -> dict:
  """fp8jax FP8 state (DotMetas) from Flax `fp8_ops` state between steps.

  Args:
    flax_state: the "_overwrite_with_gradient" collection (or any nested dict
      whose FP8 layers hold Flax's six variables).

  Returns:
    A nested dict of the same layout where each Flax op node `<FlaxOp>_i` becomes
    `Fp8DotGeneral_i: {"dot_meta": DotMeta}`; ready as a linen model's
    "fp8_meta" collection.

  The next step uses exactly the scales Flax's next step would. It is the step
  Flax would take (up to a float32 ulp of how the scale is applied) for state of
  `Fp8DirectDotGeneralOp` in float32 only; in bf16 the two libraries' steps
  differ by percents, and with `Fp8DotGeneralOp` in the last float32 bits (see
  the module docstring for why).
  """
  if not isinstance(flax_state, Mapping):
    raise TypeError(
        f"flax_state must be Flax's '{FLAX_COLLECTION}' collection (a dict), got "
        f"{type(flax_state).__name__}.")
  if FLAX_COLLECTION in flax_state:
    raise ValueError(
        f"flax_state holds a {FLAX_COLLECTION!r} key: this is a whole variables dict; pass "
        f"its FP8 collection, from_flax_fp8_ops(variables[{FLAX_COLLECTION!r}]).")
  if _is_flax_layer(flax_state):
    return {META_NAME: _dot_meta_from_flax(flax_state)}
  converted = {}
  for name, node in flax_state.items():
    if not isinstance(node, Mapping):
      raise ValueError(
          f"flax_state[{name!r}] is a {type(node).__name__}, not a Flax FP8 layer: an FP8 "
          f"layer holds exactly {sorted(_FLAX_VARIABLES)}.")
    converted[_renamed(name, FLAX_OP_NAMES, FP8JAX_OP_NAME)] = from_flax_fp8_ops(node)
  return converted


def to_flax_fp8_ops(fp8_state: Mapping, op_name: str = FLAX_OP_NAMES[0]) -> dict:
  """Flax `fp8_ops` state from fp8jax FP8 state between steps (the inverse conversion).

  Args:
    fp8_state: a linen model's "fp8_meta" collection of `DotMeta`s following
      `DelayedScaling` with the max over the history, no margin, "hybrid".
    op_name: the Flax op class the model will use (its submodule name prefix).

  Returns:
    The "_overwrite_with_gradient" collection for the same model with
    `dot_general_cls` set to that Flax op.

  Flax's next step recomputes exactly the scales fp8jax's next step would use,
  and converting Flax state there and back changes nothing. Flax's step then
  equals fp8jax's (up to a float32 ulp of how the scale is applied) in float32
  with `Fp8DirectDotGeneralOp` only; in bf16 they differ by percents, and with
  `Fp8DotGeneralOp` in the last float32 bits (see the module docstring).
  """
  if not isinstance(fp8_state, Mapping):
    raise TypeError(f"fp8_state must be a linen 'fp8_meta' collection (a dict), got "
                    f"{type(fp8_state).__name__}.")
  converted = {}
  for name, node in fp8_state.items():
    if isinstance(node, DotMeta):
      if name != META_NAME:
        raise ValueError(f"fp8_state: a DotMeta named {name!r}; Flax ops hold one named "
                         f"{META_NAME!r}.")
      return _dot_meta_to_flax(node)
    if is_meta(node) or not isinstance(node, Mapping):
      raise ValueError(
          f"fp8_state[{name!r}] is a {type(node).__name__}: only the DotMetas of FP8 "
          "matmuls have a Flax fp8_ops equivalent (attention FP8 state has none).")
    converted[_renamed(name, (FP8JAX_OP_NAME,), op_name)] = to_flax_fp8_ops(node, op_name)
  return converted


def flax_recipe(history_len: int) -> DelayedScaling:
  """The fp8jax recipe that does what Flax's `fp8_ops` do with a history of `history_len`."""
  return DelayedScaling(amax_history_len=history_len, amax_compute_algo="max", margin=0,
                        fp8_format="hybrid")


def _is_flax_layer(node: Mapping) -> bool:
  keys = set(node)
  if keys & _FLAX_VARIABLES and keys != _FLAX_VARIABLES:
    raise ValueError(
        f"a Flax FP8 layer holds exactly {sorted(_FLAX_VARIABLES)}; this one has "
        f"{sorted(keys)}.")
  return keys == _FLAX_VARIABLES


def _renamed(name: str, old_prefixes, new_prefix: str) -> str:
  for prefix in old_prefixes:
    if name.startswith(prefix + "_") and name[len(prefix) + 1:].isdigit():
      return f"{new_prefix}_{name[len(prefix) + 1:]}"
  return name


def _as_float32(value) -> jnp.ndarray:
  # Flax may keep the state in its max-accumulating float32 dtype (fp32_max_grad).
  return lax.convert_element_type(value, jnp.float32).reshape(jnp.shape(value))


def _unrotate(rotated):
  """Flax's rotated history -> newest first, on the last axis (layers stacked in front)."""
  return jnp.concatenate([rotated[..., :1], jnp.flip(rotated[..., 1:], axis=-1)], axis=-1)


def _rotate(history):
  """Newest-first history -> Flax's rotated order (its own inverse)."""
  return _unrotate(history)


def _dot_meta_from_flax(layer: Mapping) -> DotMeta:
  history_shape = jnp.shape(layer["input_amax_history"])
  recipe = flax_recipe(int(history_shape[-1]))
  formats = {"x": E4M3, "kernel": E4M3, "grad": E5M2}
  metas = {}
  for role, prefix in _ROLES.items():
    rotated = _as_float32(layer[f"{prefix}_amax_history"])
    divisor = _as_float32(layer[f"{prefix}_scale"])
    lead = rotated.shape[:-1]  # () for one layer, (layers,) under nn.scan
    if rotated.shape != history_shape or divisor.shape != lead + (1,):
      raise ValueError(
          f"{prefix}_amax_history has shape {rotated.shape} and {prefix}_scale "
          f"{divisor.shape}; a Flax FP8 layer's histories are all {history_shape} and its "
          f"scales {lead + (1,)}.")
    history = _unrotate(rotated)
    # Flax's next step: fp8_max / max(history), or the stored scale when unusable.
    scale = scale_from_amax(jnp.max(history, axis=-1), formats[role], 0,
                            fallback=1.0 / divisor[..., 0])
    metas[role] = Fp8Meta(scale=scale, scale_inv=1.0 / scale, amax_history=history,
                          amax=jnp.zeros(lead, jnp.float32), recipe=recipe, fmt=formats[role])
  return DotMeta(**metas)


def _dot_meta_to_flax(meta: DotMeta) -> dict:
  layer = {}
  for role, prefix in _ROLES.items():
    role_meta = getattr(meta, role)
    recipe = role_meta.recipe
    if not is_flax_fp8_ops_recipe(recipe):
      raise ValueError(
          f"to_flax_fp8_ops: the {role!r} meta follows {recipe}; Flax's fp8_ops do "
          "DelayedScaling with amax_compute_algo='max', margin=0, fp8_format='hybrid', "
          "power_of_two=False and high_precision=() only: converting would change the "
          "recipe silently.")
    layer[f"{prefix}_amax_history"] = _rotate(role_meta.amax_history)
    layer[f"{prefix}_scale"] = role_meta.scale_inv[..., None]
  return layer
