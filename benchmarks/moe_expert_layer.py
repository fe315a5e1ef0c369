"""One MoE expert layer's train step in FP8 and in bf16, predicted by fp8jax's cost model.

The layer is the expert MLP of an MoE block on tokens already sorted by expert (what
`Fp8MoE` runs between its routing and its combine), forward and backward, two grouped
matmuls per step at DeepSeek-V3-like shapes: 8 experts, d_model 7168, 4096 token rows
per expert, and

  "swiglu"  DeepSeek-V3's expert: hidden 2048, its gate and up projections in one grouped
            GEMM (K=7168, N=2x2048), silu(gate) * up, the down projection (K=2048, N=7168)
  "gelu"    `Fp8MoE`'s expert: K=7168 N=2048, GELU, K=2048 N=7168

Weights are float32 masters, as in mixed-precision training:

  fp8     `fp8jax.fp8_ragged_dot` with a state per expert, taking the masters as they are
          (it quantizes them itself, so no bf16 copy is made, and its wgrad kernels write
          float32 gradients); on an H100 each matmul's three GEMMs are fp8jax's grouped
          FP8 Mosaic kernels
  bf16    the same step on the best bf16 grouped GEMMs JAX ships for Hopper, its Mosaic GPU
          kernels, through `fp8jax.bf16_ragged_dot` (what `Fp8MoE` runs without a recipe):
          `ragged_dot_mgpu` for fprop and dgrad (`transpose_rhs`),
          `transposed_ragged_dot_mgpu` for wgrad, on bf16 copies of the masters

Both compile deviceless for an H100, so `fp8jax cost` compares them kernel by kernel:

    fp8jax cost --factory benchmarks.moe_expert_layer:fp8_step \\
                --baseline benchmarks.moe_expert_layer:bf16_step
    python -m benchmarks.moe_expert_layer     # each layer and recipe, the GEMMs listed

The loss `sum(y * dy)` brings in the gradient from above (`dy`); its reduction is one
kernel in both steps.
"""
from __future__ import annotations

import argparse
import functools
import json

import jax
import jax.numpy as jnp

import fp8jax
from fp8jax import lowering

EXPERTS = 8
D_MODEL = 7168
HIDDEN = 2048
ROWS_PER_EXPERT = 4096
ACTIVATIONS = ("swiglu", "gelu")


def _specs(activation: str, experts: int, rows_per_expert: int):
  """(params, x_sorted, group_sizes, dy) as ShapeDtypeStructs."""
  if activation not in ACTIVATIONS:
    raise ValueError(f"activation={activation!r}: choose one of {ACTIVATIONS}.")
  tokens = experts * rows_per_expert
  w_in_out = HIDDEN * (2 if activation == "swiglu" else 1)  # gate and up, side by side
  params = {"w_in": jax.ShapeDtypeStruct((experts, D_MODEL, w_in_out), jnp.float32),
            "w_out": jax.ShapeDtypeStruct((experts, HIDDEN, D_MODEL), jnp.float32)}
  return (params, jax.ShapeDtypeStruct((tokens, D_MODEL), jnp.bfloat16),
          jax.ShapeDtypeStruct((experts,), jnp.int32),
          jax.ShapeDtypeStruct((tokens, D_MODEL), jnp.bfloat16))


def _activate(h, activation: str):
  if activation == "gelu":
    return jax.nn.gelu(h)
  gate, up = jnp.split(h, 2, axis=-1)
  return jax.nn.silu(gate) * up


def fp8_step(activation: str = "swiglu", recipe: fp8jax.Recipe | None = None,
             experts: int = EXPERTS, rows_per_expert: int = ROWS_PER_EXPERT):
  """(step, args): the FP8 expert layer's loss, gradients (of the weights and of x) and new
  FP8 state; `dy` is the gradient arriving from above (the loss is sum(y * dy))."""
  recipe = recipe if recipe is not None else fp8jax.DelayedScaling()
  params, x, sizes, dy = _specs(activation, experts, rows_per_expert)
  metas = {name: fp8jax.init_ragged_dot_meta(recipe, experts) for name in ("in", "out")}

  def loss(inputs, metas, sizes, dy):
    params, x = inputs
    h, meta_in = fp8jax.fp8_ragged_dot(x, params["w_in"], sizes, metas["in"])
    y, meta_out = fp8jax.fp8_ragged_dot(_activate(h, activation), params["w_out"], sizes,
                                        metas["out"])
    return _loss(y, dy), {"in": meta_in, "out": meta_out}

  def fp8_expert_step(params, x, metas, sizes, dy):
    return fp8jax.value_and_grad(loss)((params, x), metas, sizes, dy)

  return fp8_expert_step, (params, x, metas, sizes, dy)


def fp8_block_step(activation: str = "swiglu"):
  """`fp8_step` under DeepSeek-V3's recipe: 1x128 activation and 128x128 weight blocks."""
  return fp8_step(activation, fp8jax.BlockScaling())


def _loss(y, dy):
  return jnp.sum(y.astype(jnp.float32) * dy.astype(jnp.float32))


def bf16_step(activation: str = "swiglu", experts: int = EXPERTS,
              rows_per_expert: int = ROWS_PER_EXPERT):
  """(step, args): the same layer's loss and gradients on JAX's bf16 Mosaic grouped GEMMs."""
  params, x, sizes, dy = _specs(activation, experts, rows_per_expert)

  def loss(params, x, sizes, dy):
    # As in Fp8MoE, every row is a (token, expert) pair of some expert.
    grouped = functools.partial(fp8jax.bf16_ragged_dot, all_rows_grouped=True)
    h = grouped(x, params["w_in"].astype(x.dtype), sizes)
    y = grouped(_activate(h, activation), params["w_out"].astype(x.dtype), sizes)
    return _loss(y, dy)

  def bf16_expert_step(params, x, sizes, dy):
    return jax.value_and_grad(loss, argnums=(0, 1))(params, x, sizes, dy)

  return bf16_expert_step, (params, x, sizes, dy)


def predict(activations=ACTIVATIONS, recipes=("delayed", "block")) -> dict:
  """Deviceless predictions of each FP8 recipe's step against the bf16 one, per layer."""

  recipe_steps = {"delayed": fp8_step, "block": fp8_block_step}
  result = {"shape": {"experts": EXPERTS, "rows_per_expert": ROWS_PER_EXPERT,
                      "d_model": D_MODEL, "hidden": HIDDEN}, "layers": {}}
  for activation in activations:
    bf16 = lowering.cost(*_unpack(bf16_step(activation)),
                         label=f"{activation} bf16 (JAX Mosaic grouped GEMMs)")
    layer = result["layers"][activation] = {"bf16": _summary(bf16), "fp8": {}}
    for name in recipes:
      fp8 = lowering.cost(*_unpack(recipe_steps[name](activation)),
                          label=f"{activation} fp8 {name}")
      comparison = lowering.compare(fp8, bf16)
      layer["fp8"][name] = {**_summary(fp8), "predicted_speedup": comparison.speedup}
      print(comparison)
  return result


def _unpack(made):
  fn, args = made
  return (fn, *args)


def _summary(report) -> dict:
  gemms = [k for k in report.kernels if k.grouped_kernel]
  return {"predicted_time_s": report.time_s, "kernel_launches": report.kernel_launches,
          "grouped_gemm_time_s": sum(k.time_s for k in gemms),
          "other_time_s": report.time_s - sum(k.time_s for k in gemms),
          "grouped_gemms": [{"kernel": k.grouped_kernel, "dtype": k.gemm_dtype,
                             "gemm": _role(k), "gflop": k.flops / 1e9,
                             "time_us": k.time_s * 1e6} for k in gemms]}


def _role(kernel) -> str:
  if kernel.grouped_kernel.startswith("transposed_"):
    return "wgrad"
  return "dgrad" if "transpose(" in kernel.op_name else "fprop"


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default=None, help="also write the predictions as JSON")
  args = parser.parse_args(argv)
  result = predict()
  print(json.dumps(result, indent=1))
  if args.out:
    with open(args.out, "w") as f:
      json.dump(result, f, indent=1)
  return result


if __name__ == "__main__":
  main()
