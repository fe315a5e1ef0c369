"""Benchmark: every attention backend, bf16 and FP8, forward and backward: speed and numerics.

Default shapes follow the attention targets: B*S = 16k tokens, H*D = 2048, S = 4096,
D = 128, causal and not. Forward TFLOP/s = 4*B*S^2*H*D / t_fwd (halved for causal);
backward TFLOP/s = 2.5x the forward's FLOPs / t_bwd (the usual FlashAttention count),
with t_bwd = t(forward+backward) - t(forward).

    python -m benchmarks.attention                      # GPU, default shapes, both masks
    python -m benchmarks.attention --smoke              # CPU: tiny shapes
    python -m benchmarks.attention --out benchmarks/results/h100_attention.json

Rows (each skipped with its reason where it cannot run here):
  bf16/<backend>   fp8jax.attention(..., backend=<backend>) for every fp8jax backend;
                   bf16/auto is what fp8jax chooses by itself
  fp8/<backend>    fp8jax.fp8_attention(..., backend=<backend>), likewise fp8/auto
  fp8/cudnn_jax    jax's own cuDNN FP8 attention (jax._src.cudnn, private), to compare with
  jnp_reference    softmax(q k^T) v written in jnp

Numerics, per row, against float32 attention (HIGHEST precision) on the same bf16 inputs:
relative L2 errors of the output and of dq, dk, dv. `numerics_ok` holds when every one is
under `TOLERANCE[bf16 | fp8]`; rows that fail are not candidates for fp8jax's automatic
choice (see fp8jax.ops.attention_backend and benchmarks/attention_speeds.py).
"""
from __future__ import annotations

import argparse
import math

import jax
from jax import lax
import jax.numpy as jnp
from tqdm import tqdm

import fp8jax
from fp8jax.ops.attention_backend import BACKENDS

try:
  from benchmarks.timing import environment, median_seconds, write_report
except ImportError:  # run as a script from benchmarks/
  from timing import environment, median_seconds, write_report

# Relative L2 error bounds for a row to count as correct at full scale. bf16: inputs,
# output and P are rounded to bf16 (2**-9 relative each); over thousands of terms the
# relative L2 error stays near 2**-8, under 1e-2. FP8: q, k, v, P (and in the backward
# dO) are rounded to E4M3 (2**-4 relative, ~2**-5.8 rms per element): 3-5% is expected,
# under 1e-1. A gross defect (a dropped key block, a wrong head) moves the whole output
# by O(1) and fails; a single wrong tile among thousands may not, which is what the
# per-element numerics tests (pytest -m gpu, run by benchmarks.gpu_check) are for.
TOLERANCE = {"bf16": 1e-2, "fp8": 1e-1}


def jnp_reference(q, k, v, causal, precision=None):
  """softmax(q k^T / sqrt(d)) v in q's dtype; grouped heads share k, v."""
  group = q.shape[2] // k.shape[2]
  k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
  logits = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision=precision) / math.sqrt(q.shape[-1])
  if causal:
    logits = jnp.where(jnp.tril(jnp.ones(logits.shape[-2:], bool)), logits, -jnp.inf)
  probs = jax.nn.softmax(logits.astype(jnp.float32), -1).astype(q.dtype)
  return jnp.einsum("bhqk,bkhd->bqhd", probs, v, precision=precision)


def _cudnn_fp8(causal):
  """jax's cuDNN FP8 attention (private API): E4M3 q, k, v with unit scales, bf16 out."""
  from jax._src.cudnn import fused_attention_stablehlo as cudnn

  def attend(q, k, v):
    one = jnp.ones((1, 1, 1, 1), jnp.float32)
    params = {name: one for name in cudnn.fp8_params_keys}
    q8, k8, v8 = (x.astype(jnp.float8_e4m3fn) for x in (q, k, v))
    out, _, _ = cudnn.dot_product_attention(
        q8, k8, v8, fp8_params=params, scale=1.0 / math.sqrt(q.shape[-1]),
        mask_type=cudnn.MaskType.CAUSAL if causal else cudnn.MaskType.NO_MASK, use_fp8=True)
    return out.astype(jnp.bfloat16)

  return attend


def implementations(causal: bool) -> dict:
  """{row name: (q, k, v) -> out} for every row of the module docstring."""
  meta = fp8jax.init_attention_meta(fp8jax.DelayedScaling())

  def bf16(backend):
    return lambda q, k, v: fp8jax.attention(q, k, v, causal=causal, backend=backend)

  def fp8(backend):
    return lambda q, k, v: fp8jax.fp8_attention(q, k, v, meta, causal=causal,
                                                backend=backend)[0]

  rows = {}
  for name in ("auto",) + BACKENDS:
    rows[f"bf16/{name}"] = bf16(None if name == "auto" else name)
  for name in ("auto",) + BACKENDS:
    rows[f"fp8/{name}"] = fp8(None if name == "auto" else name)
  rows["fp8/cudnn_jax"] = _cudnn_fp8(causal)
  rows["jnp_reference"] = lambda q, k, v: jnp_reference(q, k, v, causal)
  return rows


def forward_and_backward(fn):
  def step(q, k, v, g):
    out, vjp = jax.vjp(fn, q, k, v)
    return out, vjp(g)
  return step


def _relative_errors(got, want) -> list[float]:
  return [float(jnp.linalg.norm((a.astype(jnp.float32) - b).ravel())
                / jnp.maximum(jnp.linalg.norm(b.ravel()), 1e-30)) for a, b in zip(got, want)]


def run(batch, seq, heads, head_dim, causal, repeats, only=None) -> dict:
  """One mask: every row's times, TFLOP/s and numerics."""
  keys = jax.random.split(jax.random.key(0), 4)
  shape = (batch, seq, heads, head_dim)
  q, k, v, g = (jax.random.normal(key, shape, jnp.float32).astype(jnp.bfloat16) for key in keys)
  exact = jax.jit(forward_and_backward(
      lambda q, k, v: jnp_reference(q, k, v, causal, precision=lax.Precision.HIGHEST)))
  want_out, want_grads = exact(*(x.astype(jnp.float32) for x in (q, k, v, g)))
  flops = 4 * batch * seq**2 * heads * head_dim * (0.5 if causal else 1.0)
  rows = {}
  for name, fn in tqdm(implementations(causal).items(), desc=f"causal={causal}"):
    if only and name not in only:
      continue
    try:
      fwd = median_seconds(jax.jit(fn), q, k, v, repeats=repeats)
      step = jax.jit(forward_and_backward(fn))
      both = median_seconds(step, q, k, v, g, repeats=repeats)
      out, grads = step(q, k, v, g)
    except Exception as error:  # noqa: BLE001 - record why a row cannot run here
      rows[name] = {"skipped": f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"}
      print(f"{name:18s} skipped: {rows[name]['skipped']}")
      continue
    errors = _relative_errors((out, *grads), (want_out, *want_grads))
    tolerance = TOLERANCE["fp8" if name.startswith("fp8/") else "bf16"]
    bwd_s = max(both["median_s"] - fwd["median_s"], 1e-12)
    rows[name] = {"forward": {**fwd, "tflops": flops / fwd["median_s"] / 1e12},
                  "forward_backward": both,
                  "backward_s": bwd_s, "backward_tflops": 2.5 * flops / bwd_s / 1e12,
                  "rel_errors": dict(zip(("out", "dq", "dk", "dv"), errors)),
                  "tolerance": tolerance, "numerics_ok": all(e <= tolerance for e in errors)}
    print(f"{name:18s} fwd {rows[name]['forward']['tflops']:7.1f} TFLOP/s   "
          f"bwd {rows[name]['backward_tflops']:7.1f} TFLOP/s   "
          f"max rel err {max(errors):.2e}{'' if rows[name]['numerics_ok'] else '  WRONG'}")
  return {"batch": batch, "seq": seq, "heads": heads, "head_dim": head_dim, "causal": causal,
          "dtype": "bfloat16", "forward_flops": flops, "implementations": rows}


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--smoke", action="store_true", help="tiny shapes, few repeats (CPU)")
  parser.add_argument("--batch", type=int, default=4)
  parser.add_argument("--seq", type=int, default=4096)
  parser.add_argument("--heads", type=int, default=16)
  parser.add_argument("--head-dim", type=int, default=128)
  parser.add_argument("--masks", default="none,causal", help="comma-separated: none, causal")
  parser.add_argument("--repeats", type=int, default=20)
  parser.add_argument("--only", nargs="*", default=None, help="row names to run")
  parser.add_argument("--out", default=None, help="JSON path (default: print only)")
  args = parser.parse_args(argv)
  if args.smoke:
    args.batch, args.seq, args.heads, args.head_dim, args.repeats = 1, 128, 2, 64, 2
  results = [run(args.batch, args.seq, args.heads, args.head_dim, mask == "causal",
                 args.repeats, args.only) for mask in args.masks.split(",")]
  report = {**environment(), "benchmark": "attention", "smoke": args.smoke, "results": results}
  write_report(report, args.out)
  return report


if __name__ == "__main__":
  main()
