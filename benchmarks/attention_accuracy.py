"""Benchmark: how far FP8 attention is from bf16's reference, per scaling mode and input kind.

    python -m benchmarks.attention_accuracy --out benchmarks/results/h100_attention_accuracy.json
    python -m benchmarks.attention_accuracy --emulate --batch 1   # CPU: the kernels' arithmetic
    python -m benchmarks.attention_accuracy --smoke                # CPU: tiny shapes

The metric is benchmarks.attention's: relative L2 errors of the output and of dq, dk, dv
against float32 attention (HIGHEST precision) on the same bf16 inputs and output gradient.

Modes of `fp8jax.fp8_attention` (CurrentScaling: scales from the tensors themselves):
  per_tensor      one scale per tensor
  blocks          one scale per 128 rows of each head (block_scales=True)
  rotate          q and k turned by a random orthogonal matrix first (rotate=True)
  blocks+rotate   both
Inputs (q, k, v; the output gradient is always N(0, 1)):
  gaussian        N(0, 1), as benchmarks.attention draws them
  outliers        N(0, 1) with 0.1% of the entries N(0, 10) (FlashAttention-3's test)
  channels        q and k with 4 of head_dim channels 5x larger, the same in both (the
                  channel outliers of trained models' queries and keys); v N(0, 1)

On a GPU the Hopper FP8 kernels run (backend "pallas_hopper_fp8"). With --emulate the
same arithmetic runs in jnp (`pallas_kernels.hopper_attention_reference`, which the
interpreter tests hold to the kernels), one (batch row, head) at a time, so the full
shape fits a CPU: it differs from the GPU only by the FP8 wgmma's shorter accumulator
and the approximate exp2.
"""
from __future__ import annotations

import argparse
import math
import time

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

import fp8jax
from fp8jax.ops import attention_rotation
import pallas_kernels
from pallas_kernels.hopper_attention_reference import hopper_fp8_attention_reference

try:
  from benchmarks.attention import forward_and_backward, jnp_reference
  from benchmarks.timing import environment, write_report
except ImportError:  # run as a script from benchmarks/
  from attention import forward_and_backward, jnp_reference
  from timing import environment, write_report

MODES = {"per_tensor": dict(block_scales=False, rotate=False),
         "blocks": dict(block_scales=True, rotate=False),
         "rotate": dict(block_scales=False, rotate=True),
         "blocks+rotate": dict(block_scales=True, rotate=True)}
INPUTS = ("gaussian", "outliers", "channels")
NAMES = ("out", "dq", "dk", "dv")


def draw(kind: str, shape, seed: int = 0):
  """(q, k, v, g) in bf16 of one input kind (module docstring)."""
  rng = np.random.default_rng(seed)
  q, k, v, g = (rng.standard_normal(shape, np.float32) for _ in range(4))
  if kind == "outliers":
    for x in (q, k, v):
      where = rng.random(shape) < 1e-3
      x[where] = 10 * rng.standard_normal(int(where.sum()), np.float32)
  elif kind == "channels":
    q[..., :4] *= 5
    k[..., :4] *= 5
  elif kind != "gaussian":
    raise ValueError(f"unknown input kind {kind!r}; choose from {INPUTS}.")
  return tuple(jnp.asarray(x, jnp.bfloat16) for x in (q, k, v, g))


def _kernel_errors(q, k, v, g, causal: bool, mode: dict) -> dict:
  """Relative errors of fp8jax.fp8_attention on the Hopper FP8 kernels (a GPU)."""
  meta = fp8jax.init_attention_meta(fp8jax.CurrentScaling())

  def fp8(q, k, v):
    return fp8jax.fp8_attention(q, k, v, meta, causal=causal, backend="pallas_hopper_fp8",
                                **mode)[0]

  got = jax.jit(forward_and_backward(fp8))(q, k, v, g)
  want = jax.jit(forward_and_backward(
      lambda q, k, v: jnp_reference(q, k, v, causal, precision=lax.Precision.HIGHEST)))(
          *(x.astype(jnp.float32) for x in (q, k, v, g)))
  flat = lambda r: (r[0], *r[1])  # noqa: E731
  return {name: float(jnp.linalg.norm((a.astype(jnp.float32) - b).ravel())
                      / jnp.linalg.norm(b.ravel()))
          for name, a, b in zip(NAMES, flat(got), flat(want))}


def _quantized(x, blocks: bool):
  """(x8, descale): per 128 rows of each head, or one per tensor (CurrentScaling's cast)."""
  if blocks:
    return pallas_kernels.quantize_head_blocks(x)
  return pallas_kernels.quantize_gradient(x)


def _emulated_errors(q, k, v, g, causal: bool, mode: dict) -> dict:
  """The same errors from the kernels' arithmetic in jnp, one (batch row, head) at a time."""
  if mode["rotate"]:
    q_in, k_in = attention_rotation.rotate(q), attention_rotation.rotate(k)
  else:
    q_in, k_in = q, k
  (q8, dq_), (k8, dk_), (v8, dv_) = (_quantized(x, mode["block_scales"])
                                     for x in (q_in, k_in, v))
  g8, g_descale = pallas_kernels.quantize_gradient(g)
  blocks = mode["block_scales"]

  @jax.jit
  def one(b, h, q8, k8, v8, g8, qf, kf, vf, gf):
    def pick(x):  # [batch, seq, heads, D] -> [1, seq, 1, D]
      return lax.dynamic_slice_in_dim(lax.dynamic_slice_in_dim(x, b, 1, 0), h, 1, 2)

    def pick_descale(d):  # [batch, heads, blocks] -> [1, 1, blocks]; scalars stay
      if not blocks:
        return d
      return lax.dynamic_slice_in_dim(lax.dynamic_slice_in_dim(d, b, 1, 0), h, 1, 1)
    out, _, dq, dk, dv = hopper_fp8_attention_reference(
        pick(q8), pick(k8), pick(v8), pick(g8), pick_descale(dq_), pick_descale(dk_),
        pick_descale(dv_), causal=causal, g_descale=g_descale)
    if mode["rotate"]:
      dq, dk = attention_rotation.unrotate(dq), attention_rotation.unrotate(dk)
    want_out, want_grads = forward_and_backward(
        lambda q, k, v: jnp_reference(q, k, v, causal, precision=lax.Precision.HIGHEST))(
            *(pick(x).astype(jnp.float32) for x in (qf, kf, vf, gf)))
    return [(jnp.sum((a.astype(jnp.float32) - w) ** 2), jnp.sum(w ** 2))
            for a, w in zip((out, dq, dk, dv), (want_out, *want_grads))]

  sums = np.zeros((4, 2))
  for b in range(q.shape[0]):
    for h in range(q.shape[2]):
      sums += np.array(one(b, h, q8, k8, v8, g8, q, k, v, g), np.float64)
  return {name: float(math.sqrt(err / ref)) for name, (err, ref) in zip(NAMES, sums)}


def run(batch, seq, heads, head_dim, causal, inputs, modes, emulate, deadline) -> dict:
  """One mask: every input kind's and mode's relative errors (until `deadline`)."""
  errors = _emulated_errors if emulate else _kernel_errors
  rows = {}
  for kind in inputs:
    q, k, v, g = draw(kind, (batch, seq, heads, head_dim))
    rows[kind] = {}
    for name in modes:
      if time.perf_counter() > deadline:
        rows[kind][name] = {"skipped": "not reached: the time budget was spent"}
        print(f"causal={causal} {kind:9s} {name:14s} skipped (time budget)")
        continue
      rows[kind][name] = errors(q, k, v, g, causal, MODES[name])
      print(f"causal={causal} {kind:9s} {name:14s} " + "  ".join(
          f"{n} {e:.4f}" for n, e in rows[kind][name].items()), flush=True)
  return {"batch": batch, "seq": seq, "heads": heads, "head_dim": head_dim, "causal": causal,
          "errors": rows}


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--smoke", action="store_true", help="tiny shapes, emulated (CPU)")
  parser.add_argument("--emulate", action="store_true",
                      help="the kernels' arithmetic in jnp (CPU) instead of the kernels")
  parser.add_argument("--batch", type=int, default=4)
  parser.add_argument("--seq", type=int, default=4096)
  parser.add_argument("--heads", type=int, default=16)
  parser.add_argument("--head-dim", type=int, default=128)
  parser.add_argument("--masks", default="none,causal", help="comma-separated: none, causal")
  parser.add_argument("--inputs", default=",".join(INPUTS), help="comma-separated input kinds")
  parser.add_argument("--modes", default=",".join(MODES), help="comma-separated modes")
  parser.add_argument("--budget-s", type=float, default=float("inf"),
                      help="measure no new configuration after this many seconds")
  parser.add_argument("--out", default=None, help="JSON path (default: print only)")
  args = parser.parse_args(argv)
  if args.smoke:
    args.batch, args.seq, args.heads, args.head_dim, args.emulate = 1, 128, 2, 64, True
  inputs, modes = args.inputs.split(","), args.modes.split(",")
  unknown = sorted(set(inputs) - set(INPUTS)) + sorted(set(modes) - set(MODES))
  if unknown:
    parser.error(f"unknown input kinds or modes {unknown}; inputs {INPUTS}, modes {tuple(MODES)}")
  deadline = time.perf_counter() + args.budget_s
  results = [run(args.batch, args.seq, args.heads, args.head_dim, mask == "causal", inputs,
                 modes, args.emulate, deadline) for mask in args.masks.split(",")]
  report = {**environment(), "benchmark": "attention_accuracy", "smoke": args.smoke,
            "emulated": args.emulate, "results": results}
  write_report(report, args.out)
  return report


if __name__ == "__main__":
  main()
