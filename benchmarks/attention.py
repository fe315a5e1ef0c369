"""Benchmark: every attention backend, bf16 and FP8, forward and backward: speed and numerics.

Default shapes follow the attention targets: B*S = 16k tokens, H*D = 2048, S = 4096,
D = 128, causal and not. Forward TFLOP/s = 4*B*S^2*H*D / t_fwd (halved for causal);
backward TFLOP/s = 2.5x the forward's FLOPs / t_bwd (the usual FlashAttention count),
with t_bwd = t(forward+backward) - t(forward).

    python -m benchmarks.attention                      # GPU, default shapes, both masks
    python -m benchmarks.attention --smoke              # CPU: tiny shapes
    python -m benchmarks.attention --out benchmarks/results/h100_attention.json
    python -m benchmarks.attention --tune --out benchmarks/results/h100_attention_tuning.json

--tune times the Hopper kernels' variants instead (benchmarks/attention_tuning.py).

Rows (each skipped with its reason where it cannot run here):
  bf16/<backend>   fp8jax.attention(..., backend=<backend>) for every fp8jax backend;
                   bf16/auto is what fp8jax chooses by itself
  fp8/<backend>    fp8jax.fp8_attention(..., backend=<backend>), likewise fp8/auto
  fp8/cudnn_jax    jax's own cuDNN FP8 attention (jax._src.cudnn, private), to compare with,
                   with every FP8 scale calibrated from its tensor's amax (`_cudnn_fp8`);
  fp8/cudnn_jax_unit_scales  the same with every scale 1, as JAX's own test calls it
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
  from benchmarks import attention_tuning
  from benchmarks.timing import environment, median_seconds, write_report
except ImportError:  # run as a script from benchmarks/
  import attention_tuning
  from timing import environment, median_seconds, write_report

# Relative L2 error bounds for a row to count as correct at full scale. bf16: inputs,
# output and P are rounded to bf16 (2**-9 relative each); over thousands of terms the
# relative L2 error stays near 2**-8, under 1e-2. FP8: q, k, v, P (and in the backward
# dO) are rounded to E4M3 (2**-4 relative, ~2**-5.8 rms per element): 3-5% is expected,
# under 1e-1. A gross defect (a dropped key block, a wrong head) moves the whole output
# by O(1) and fails; a single wrong tile among thousands may not, which is what the
# per-element numerics tests (pytest -m gpu, run by benchmarks.gpu_check) are for.
TOLERANCE = {"bf16": 1e-2, "fp8": 1e-1}
E4M3_MAX = 448.0


def jnp_reference(q, k, v, causal, precision=None):
  """softmax(q k^T / sqrt(d)) v in q's dtype; grouped heads share k, v."""
  group = q.shape[2] // k.shape[2]
  k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
  logits = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision=precision) / math.sqrt(q.shape[-1])
  if causal:
    logits = jnp.where(jnp.tril(jnp.ones(logits.shape[-2:], bool)), logits, -jnp.inf)
  probs = jax.nn.softmax(logits.astype(jnp.float32), -1).astype(q.dtype)
  return jnp.einsum("bhqk,bkhd->bqhd", probs, v, precision=precision)


def _cudnn_fp8_unit_scales(causal):
  """jax's cuDNN FP8 attention (private API) as JAX's own test calls it: every scale 1.

  cuDNN rounds to E4M3 not only q, k, v but P (scale_s), dP (scale_dP), the output
  (scale_o) and dq, dk, dv (scale_dQ, ...): with unit scales, values under E4M3's
  normal range (2**-6) lose their precision and under 2**-10 vanish. At S = 4096 the
  backward's P (~1/S), dS and dq (~1e-2) are there: dq 64% off on an H200. JAX's test
  runs S <= 256 with 50% tolerances, where this does not show."""
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


def _e4m3_scale(amax):
  """E4M3's max over a float32 amax (1 where it is 0 or not finite)."""
  amax = jnp.asarray(amax, jnp.float32).reshape(1, 1, 1, 1)
  usable = jnp.isfinite(amax) & (amax > 0)
  return jnp.where(usable, E4M3_MAX / jnp.where(usable, amax, 1.0), 1.0)


def _quantize_e4m3(x, scale):
  return jnp.clip(x.astype(jnp.float32) * scale.reshape(()), -E4M3_MAX,
                  E4M3_MAX).astype(jnp.float8_e4m3fn)


def _cudnn_fp8(causal, calibration):
  """jax's cuDNN FP8 attention with every scale set from its tensor's amax.

  q, k, v and dO are quantized with their own amaxes; the scales of P, dP, the output
  and dq, dk, dv come from the amaxes cuDNN reports for them (forward: amax_s, amax_o;
  backward: the amax entries of the params' cotangent) in one calibration call on the
  `calibration` inputs (q, k, v, g), as delayed scaling would after one step. The
  output and the gradients come back in E4M3 and are dequantized here. A custom VJP
  feeds cuDNN's backward dO in E4M3 with its own scale (JAX's AD would hand it the
  output's cotangent cast to E4M3 as it is)."""
  from jax._src.cudnn import fused_attention_stablehlo as cudnn
  mask = cudnn.MaskType.CAUSAL if causal else cudnn.MaskType.NO_MASK
  calibrated = {}

  def run(q8, k8, v8, params):
    return cudnn.dot_product_attention(q8, k8, v8, fp8_params=params,
                                       scale=1.0 / math.sqrt(q8.shape[-1]), mask_type=mask,
                                       use_fp8=True)

  def inputs(q, k, v):
    scales = [_e4m3_scale(jnp.max(jnp.abs(x.astype(jnp.float32)))) for x in (q, k, v)]
    return [_quantize_e4m3(x, s) for x, s in zip((q, k, v), scales)], scales

  def calibrate():
    q, k, v, g = calibration
    (q8, k8, v8), (sq, sk, sv) = inputs(q, k, v)
    one = jnp.ones((1, 1, 1, 1), jnp.float32)
    params = {name: one for name in cudnn.fp8_params_keys}
    s_g = _e4m3_scale(jnp.max(jnp.abs(g.astype(jnp.float32))))
    params.update(descale_q=1 / sq, descale_k=1 / sk, descale_v=1 / sv, descale_dO=1 / s_g)
    (_, amax_s, amax_o), vjp = jax.vjp(lambda p: run(q8, k8, v8, p), params)
    zero = jnp.zeros((1, 1, 1, 1), jnp.float32)
    (backward_amaxes,) = vjp((_quantize_e4m3(g, s_g), zero, zero))
    scales = {"s": _e4m3_scale(amax_s), "o": _e4m3_scale(amax_o), "dO": s_g}
    for name in ("dQ", "dK", "dV", "dP"):
      scales[name] = _e4m3_scale(backward_amaxes[f"amax_{name}"])
    return scales

  @jax.custom_vjp
  def attend(q, k, v):
    return attend_fwd(q, k, v)[0]

  def attend_fwd(q, k, v):
    if not calibrated:
      with jax.ensure_compile_time_eval():  # on concrete inputs, also while tracing
        calibrated.update(calibrate())
    c = calibrated
    (q8, k8, v8), (sq, sk, sv) = inputs(q, k, v)
    params = dict(descale_q=1 / sq, descale_k=1 / sk, descale_v=1 / sv, descale_s=1 / c["s"],
                  scale_s=c["s"], scale_o=c["o"], descale_o=1 / c["o"],
                  descale_dO=1 / c["dO"], descale_dP=1 / c["dP"], scale_dQ=c["dQ"],
                  scale_dK=c["dK"], scale_dV=c["dV"], scale_dP=c["dP"])
    params.update({f"amax_{n}": jnp.zeros((1, 1, 1, 1), jnp.float32)
                   for n in ("dQ", "dK", "dV", "dP")})
    (out8, _, _), vjp = jax.vjp(lambda q8, k8, v8: run(q8, k8, v8, params), q8, k8, v8)
    out = (out8.astype(jnp.float32) / c["o"].reshape(())).astype(jnp.bfloat16)
    return out, vjp

  def attend_bwd(vjp, g):
    c = calibrated
    zero = jnp.zeros((1, 1, 1, 1), jnp.float32)
    grads8 = vjp((_quantize_e4m3(g, c["dO"]), zero, zero))
    return tuple((x8.astype(jnp.float32) / c[name].reshape(())).astype(jnp.bfloat16)
                 for x8, name in zip(grads8, ("dQ", "dK", "dV")))

  attend.defvjp(attend_fwd, attend_bwd)
  return attend


def implementations(causal: bool, calibration=None) -> dict:
  """{row name: (q, k, v) -> out} for every row of the module docstring; `calibration`
  (q, k, v, g) sets the scales of jax's cuDNN FP8 attention (`_cudnn_fp8`)."""
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
  if calibration is not None:
    rows["fp8/cudnn_jax"] = _cudnn_fp8(causal, calibration)
  rows["fp8/cudnn_jax_unit_scales"] = _cudnn_fp8_unit_scales(causal)
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
  for name, fn in tqdm(implementations(causal, (q, k, v, g)).items(), desc=f"causal={causal}"):
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
  parser.add_argument("--tune", action="store_true",
                      help="time the Hopper kernels' variants (benchmarks/attention_tuning.py)")
  parser.add_argument("--budget-s", type=float, default=600.0,
                      help="--tune: stop timing variants after this many seconds")
  args = parser.parse_args(argv)
  if args.smoke:
    args.batch, args.seq, args.heads, args.head_dim, args.repeats = 1, 128, 2, 64, 2
  if args.tune:
    return _tune(args)
  results = [run(args.batch, args.seq, args.heads, args.head_dim, mask == "causal",
                 args.repeats, args.only) for mask in args.masks.split(",")]
  report = {**environment(), "benchmark": "attention", "smoke": args.smoke, "results": results}
  write_report(report, args.out)
  return report


def _tune(args) -> dict:
  """--tune: on a CPU (--smoke) two forward variants and one backward variant of the bf16
  kernels, one head, each run once in Mosaic GPU's interpreter, so the mode runs end to
  end without a GPU."""
  options = {}
  if args.smoke:
    args.heads, args.repeats = 1, 1
    options = dict(precisions=("bf16",), masks=("none",), interpret=True, warmup=0,
                   forward_variants=attention_tuning.FORWARD_VARIANTS[:1] + [
                       (128, 2, False, False)],
                   backward_variants=attention_tuning.BACKWARD_VARIANTS[:1])
  result = attention_tuning.tune(
      args.batch, args.seq, args.heads, args.head_dim,
      **{"masks": tuple(args.masks.split(",")), "precisions": ("fp8", "bf16"), **options},
      repeats=args.repeats, budget_s=args.budget_s)
  report = {**environment(), "benchmark": "attention_tuning", "smoke": args.smoke, **result}
  write_report(report, args.out)
  return report


if __name__ == "__main__":
  main()
