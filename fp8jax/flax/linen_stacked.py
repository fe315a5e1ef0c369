"""Every layer's FP8 weights cast before a linen `nn.scan` over layers (delayed or current
scaling).

A model that scans its layers with stacked params and FP8 state (`nn.scan` with
`variable_axes={"params": 0, "fp8_meta": 0}`) can cast the weights of all its layers
where the step starts, one launch per projection, instead of each layer slicing its
float32 weight out of the stack and casting it (two launches a layer and projection;
`fp8jax.ops.stacked_weights`). Cast them in the module that runs the scan and hand them
to the layers as the scan's input; each layer pairs its copies with its own kernels:

    class Stack(nn.Module):
      @nn.compact
      def __call__(self, x):
        weights = cast_scanned_weights(self, "blocks", {"qkv": 1, "mlp/up": 1})
        blocks = nn.scan(Block, variable_axes={"params": 0, "fp8_meta": 0},
                         split_rngs={"params": True}, length=4, unroll=4)
        with fp8jax.fused_kernels.stacked_state():
          return blocks(name="blocks")(x, weights)[0]

    class Block(nn.Module):
      @nn.compact
      def __call__(self, x, weights):
        with layer_weights(self, weights):   # its FP8 layers take their copies
          ...

A projection is named by its path inside a layer ("qkv", or "mlp/up" for `Fp8Mlp`'s up
projection), where the layer keeps its "kernel" param and its "dot_meta" state, with how
many of the kernel's leading axes it contracts (1 for `Fp8Dense`, `len(axis)` for
`Fp8DenseGeneral`). Projections whose state follows another recipe than delayed or current
scaling on the matrix path are left to cast their own weights; so is everything while the model
is initialized (no params yet). Under `fp8jax.accumulate_gradients` the weights are cast
once per microbatch, one launch per projection (its own reuse of a weight's cast across
microbatches applies where the loss's ops are traced, not inside a scanned layer). The
numbers are the same bit for bit.

Every layer's FP8 copies (two bytes per weight) then live through the step, under
`nn.remat` too, where the layers would otherwise recompute them (0.6 GB at the demo GPT's
350m). With a fully unrolled scan each layer reads its copies in place; a rolled one
(`unroll` < length) slices them out of the stack each iteration, FP8 instead of float32.
"""
from __future__ import annotations

import contextlib
from typing import Any

import flax.linen as nn

from fp8jax.flax.linen import FP8_COLLECTION
from fp8jax.ops import stacked_weights
from fp8jax.ops.dot import prologue_path


def cast_scanned_weights(module: nn.Module, scan_name: str,
                         projections: dict[str, int]) -> dict | None:
  """Every layer's FP8 weights of the scan `scan_name`, for its layers' loop.

  Args:
    module: the module that runs the scan (its `nn.compact` method, before the scan).
    scan_name: the scanned module's name (its stacked variables live under it).
    projections: {path of a projection inside a layer ("qkv", "mlp/up"): how many of its
      kernel's leading axes it contracts}.

  Returns:
    {path: `stacked_weights.LayerWeights` of every layer} to pass as the scan's input,
    or None where nothing is cast (initializing, or no projection follows delayed or
    current scaling).
  """
  if module.is_initializing():
    return None
  params = _get(module.variables, ("params", scan_name))
  state = _get(module.variables, (FP8_COLLECTION, scan_name))
  weights = {}
  for path, n_contract in projections.items():
    keys = tuple(path.split("/"))
    kernel = _get(params, keys + ("kernel",))
    meta = _get(state, keys + ("dot_meta",))
    if kernel is None or meta is None:
      raise ValueError(
          f"projections names {path!r}, but the scan {scan_name!r} has no 'kernel' param and "
          f"'dot_meta' state at {path!r} in its layers; name a projection by its path inside "
          "a layer, e.g. 'qkv' or 'mlp/up'.")
    if not prologue_path(meta.recipe):
      continue
    weights[path] = stacked_weights.cast_layers(kernel, n_contract, meta.kernel)
  return weights or None


def layer_weights(module: nn.Module, weights: dict | None) -> contextlib.AbstractContextManager:
  """A context in which the layer's FP8 ops take their copies from `weights`.

  Args:
    module: the layer (the scanned module, in its `nn.compact` method).
    weights: its slice of `cast_scanned_weights`'s result (the scan's input), or None.

  Returns:
    A context manager (`stacked_weights.supplying` of each kernel with its copies).
  """
  if not weights:
    return contextlib.nullcontext()
  params = module.variables.get("params")
  return stacked_weights.supplying(
      [(_get(params, tuple(path.split("/")) + ("kernel",)), copies)
       for path, copies in weights.items()])


def _get(tree: Any, path: tuple):
  for key in path:
    if tree is None or key not in tree:
      return None
    tree = tree[key]
  return tree
