"""fp8jax's attention API: FP8 state threading, backend selection, Flax layers."""
import dataclasses
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import fp8jax
import pallas_kernels
from benchmarks import attention_speeds, attention_tuning
from fp8jax import deviceless
from fp8jax.ops import attention as attention_op
from fp8jax.ops import attention_backend
from fp8jax.flax import linen as fp8nn
from fp8jax.flax import nnx as fp8nnx
from fp8_reference import quantize_reference

RECIPE = fp8jax.DelayedScaling(amax_history_len=4)


def _qkv(seed, batch=1, seq=64, heads=4, kv_heads=2, head_dim=64, dtype=jnp.bfloat16):
  # Draw in float32 and cast: sampling normals directly in bfloat16 caps the tails.
  ks = jax.random.split(jax.random.key(seed), 3)
  return (jax.random.normal(ks[0], (batch, seq, heads, head_dim)).astype(dtype),
          (2 * jax.random.normal(ks[1], (batch, seq, kv_heads, head_dim))).astype(dtype),
          (3 * jax.random.normal(ks[2], (batch, seq, kv_heads, head_dim))).astype(dtype))


def _reference(q, k, v, causal):
  """float64 numpy attention (GQA by repeating kv heads)."""
  q, k, v = (np.asarray(x.astype(jnp.float32), np.float64) for x in (q, k, v))
  group = q.shape[2] // k.shape[2]
  k, v = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)
  logits = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
  if causal:
    logits = np.where(np.tril(np.ones(logits.shape[-2:], bool)), logits, -np.inf)
  p = np.exp(logits - logits.max(-1, keepdims=True))
  return np.einsum("bhqk,bkhd->bqhd", p / p.sum(-1, keepdims=True), v)


@pytest.mark.parametrize("backend", ["pallas", "xla"])
def test_fp8_attention_meta_updates_over_two_jitted_steps_as_the_recipe_says(backend):
  q, k, v = _qkv(0)
  target = jax.random.normal(jax.random.key(9), q.shape).astype(jnp.bfloat16)
  meta = fp8jax.init_attention_meta(RECIPE)

  def loss_fn(qkv, meta):
    out, meta = fp8jax.fp8_attention(*qkv, meta, causal=True, backend=backend)
    return (jnp.sum(out.astype(jnp.float32) * target), out), meta  # d loss / d out = target

  step = jax.jit(fp8jax.value_and_grad(loss_fn, has_aux=True))
  (_, out1), _, meta1 = step((q, k, v), meta)
  (_, out2), _, meta2 = step((q, k, v / 2), meta1)
  want1 = {"q": jnp.max(jnp.abs(q)), "k": jnp.max(jnp.abs(k)), "v": jnp.max(jnp.abs(v)),
           "o": jnp.max(jnp.abs(out1)), "grad": jnp.max(jnp.abs(target))}
  for role, amax in want1.items():
    m1, m2 = getattr(meta1, role), getattr(meta2, role)
    # o's amax is max|O| before the bf16 output rounding: within one bf16 ulp (2**-8).
    rtol = 2**-8 if role == "o" else 0
    np.testing.assert_allclose(float(m1.amax_history[0]), float(amax), rtol=rtol)
    np.testing.assert_array_equal(np.asarray(m1.amax_history[1:]), 0.0)
    assert float(m1.scale) == pytest.approx(m1.fmt.max / float(m1.amax_history[0]), rel=1e-6)
    np.testing.assert_array_equal(np.asarray(m2.amax_history[1:2]), np.asarray(m1.amax_history[:1]))
  # Step 2 halved v: its newest entry halves, and the "max" window keeps step 1's scale.
  assert float(meta2.v.amax_history[0]) == float(meta1.v.amax_history[0]) / 2
  assert float(meta2.v.scale) == float(meta1.v.scale)


@pytest.mark.parametrize("causal", [False, True])
def test_fp8_attention_matches_float64_reference_within_p_rounding_bound(causal):
  q, k, v = _qkv(1, dtype=jnp.float32)
  meta = fp8jax.init_attention_meta(fp8jax.CurrentScaling())
  out, _ = fp8jax.fp8_attention(q, k, v, meta, causal=causal, backend="pallas")
  # The reference gets the same E4M3 q, k, v (independent float64 quantizer, the
  # scales current scaling computes: float32(448) / amax), dequantized.
  deq = []
  for x in (q, k, v):
    scale = np.float32(448.0) / np.float32(np.max(np.abs(np.asarray(x))))
    deq.append(quantize_reference(np.asarray(x), scale, "e4m3") * np.float64(np.float32(1) / scale))
  ref = _reference(*(jnp.asarray(d, jnp.float32) for d in deq), causal)
  # What is left is the kernel's E4M3 rounding of P (in [0, 1], scaled by 256):
  # relative 2**-4 per probability, or absolute 2**-10 / 256 in the subnormals, so
  #   |o - ref| <= 2**-4 * sum_j p_j |v_j| + seq * 2**-10 / 256 * max|v|
  # plus the bf16 output (2**-8 relative) and float32 arithmetic (1e-5 slack).
  qd, kd, vd = (np.repeat(d, q.shape[2] // d.shape[2], axis=2) if i else d
                for i, d in enumerate(deq))
  logits = np.einsum("bqhd,bkhd->bhqk", qd, kd) / np.sqrt(q.shape[-1])
  if causal:
    logits = np.where(np.tril(np.ones(logits.shape[-2:], bool)), logits, -np.inf)
  p = np.exp(logits - logits.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  weighted_abs_v = np.einsum("bhqk,bkhd->bqhd", p, np.abs(vd))
  bound = (2**-4 * weighted_abs_v + q.shape[1] * 2**-10 / 256 * np.abs(vd).max()
           + 2**-8 * np.abs(ref) + 1e-5)
  err = np.abs(np.asarray(out, np.float64) - ref)
  assert out.dtype == jnp.float32
  assert np.all(err <= bound), np.max(err / bound)
  # And the bound is not vacuous: the typical error is well inside it.
  assert np.median(err / bound) < 0.5


def test_bf16_attention_matches_float64_reference_with_segments():
  q, k, v = _qkv(2, batch=2, seq=48)
  seg = jnp.asarray(np.repeat([[0] * 30 + [1] * 18, [0] * 40 + [1] * 8], 1, axis=0), jnp.int32)
  out = fp8jax.attention(q, k, v, q_segment_ids=seg, kv_segment_ids=seg, backend="pallas")
  # Reference: each segment attends only within itself.
  ref = np.zeros(q.shape)
  for b in range(2):
    for s in (0, 1):
      rows = np.asarray(seg[b]) == s
      ref[b, rows] = _reference(q[b:b + 1, rows], k[b:b + 1, rows], v[b:b + 1, rows], False)[0]
  # bf16 inputs and output: 2**-8 relative per element, well under 1e-2 in norm.
  err = np.linalg.norm(np.asarray(out.astype(jnp.float32), np.float64) - ref) / np.linalg.norm(ref)
  assert err < 1e-2, err


def _key(**changes):
  base = dict(platform="gpu", gpu_arch="sm_90", dtype="bfloat16", fp8=True, head_dim=128,
              mask="causal", recipe_type="DelayedScaling", gqa_ratio=2, size_class="aligned",
              equal_lengths=True)
  return attention_backend.BackendKey(**{**base, **changes})


def test_float32_inputs_stay_on_the_fused_path_without_warning():
  # On a GPU f32 inputs choose the fused kernel; on this CPU the kernel runs when asked for.
  attention_backend.select_backend.cache_clear()
  q, k, v = _qkv(3, dtype=jnp.float32)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    choice = attention_backend.select_backend(_key(fp8=False, dtype="float32", head_dim=64))
    out = fp8jax.attention(q, k, v, backend="pallas")
  assert choice.name == "pallas" and choice.reason is None and out.dtype == jnp.float32


def test_cpu_chooses_xla_attention_without_warning_for_bf16_and_fp8():
  # The Pallas interpreter is the kernel's slow emulation; XLA is a CPU's fast path.
  attention_backend.select_backend.cache_clear()
  q, k, v = _qkv(11, seq=16)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    for fp8 in (False, True):
      for head_dim in (48, 64):  # also head dims the fused kernels lack
        choice = fp8jax.ops.attention.choose_backend(
            q[..., :head_dim], k[..., :head_dim], fp8=fp8, causal=True, has_segments=False,
            recipe=RECIPE if fp8 else None)
        assert choice == attention_backend.BackendChoice("xla"), (fp8, head_dim)
  assert attention_backend.select_backend(_key(platform="cpu", gpu_arch=None),
                                          "pallas").name == "pallas"


def test_backend_selection_runs_once_per_static_key_not_per_scale_value(monkeypatch):
  calls = []
  original = attention_backend._choose
  monkeypatch.setattr(attention_backend, "_choose", lambda key: calls.append(key) or original(key))
  attention_backend.select_backend.cache_clear()
  q, k, v = _qkv(4, seq=32)
  meta = fp8jax.init_attention_meta(RECIPE)
  step = jax.jit(lambda q, k, v, m: fp8jax.fp8_attention(q, k, v, m)[0])
  for i in range(3):  # new scale/amax values: no retrace, no new selection
    meta = jax.tree.map(
        lambda role: dataclasses.replace(role, amax=role.amax + i).with_scale(role.scale + i),
        meta, is_leaf=lambda n: isinstance(n, fp8jax.Fp8Meta))
    step(q, k, v, meta)
  fp8jax.fp8_attention(q, k, v, meta)           # eager call, same static key
  assert len(calls) == 1
  fp8jax.fp8_attention(q, k, v, meta, causal=True)  # a different mask: one more
  assert len(calls) == 2


def _entry(forward, backward, validated=True):
  return {"forward_tflops": forward, "backward_tflops": backward, "validated": validated}


def test_measured_table_is_the_committed_h100_benchmark():
  """The measured table fp8jax.ops.attention_backend reads is derived from its SOURCE, not
  typed in."""
  import json
  import pathlib
  source = pathlib.Path(__file__).resolve().parents[1] / attention_backend.SOURCE
  # The Hopper FP8 forward in that run failed its separate GPU check
  # (benchmarks/results/h100_hopper_fp8_attention_check.json).
  derived = attention_speeds.table_from_results(
      json.loads(source.read_text()), failed_checks=("fp8/pallas_hopper_fp8",))
  assert derived == attention_backend.MEASURED


def test_gpu_selection_takes_the_fastest_validated_measured_backend():
  attention_backend.select_backend.cache_clear()
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    # bf16: cuDNN (542 / 489 TFLOP/s) beats the Pallas kernel (276 / 157).
    assert attention_backend.select_backend(_key(fp8=False)).name == "cudnn"
  # FP8: the Hopper FP8 kernel measured 467 TFLOP/s forward but is not validated; the
  # validated FP8 kernel is slower than bf16 cuDNN, so FP8 runs dequantized on cuDNN and
  # the warning says why, with both measurements.
  with pytest.warns(UserWarning, match=r"'pallas': 160 TFLOP/s forward, 157 backward, is "
                                       r"slower than bf16 'cudnn': 542 TFLOP/s forward, 489"):
    assert attention_backend.select_backend(_key()).name == "cudnn"
  # A key cuDNN cannot run (causal with q_len != kv_len) gets the next validated one.
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    assert attention_backend.select_backend(
        _key(fp8=False, equal_lengths=False)).name == "pallas"


def test_fp8_backend_is_chosen_only_when_validated_and_faster_than_bf16(monkeypatch):
  def table(fp8_entry):
    return {"sm_90": {"none": {"bf16": {"cudnn": _entry(540, 490)},
                               "fp8": {"pallas_hopper_fp8": fp8_entry}}}}
  for fp8_entry, expected in ((_entry(800, 600), "pallas_hopper_fp8"),
                              (_entry(800, 600, validated=False), "cudnn"),
                              (_entry(600, 300), "cudnn")):  # faster forward, slower step
    monkeypatch.setattr(attention_backend, "MEASURED", table(fp8_entry))
    attention_backend.select_backend.cache_clear()
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always")
      assert attention_backend.select_backend(_key()).name == expected, fp8_entry
    assert bool(caught) == (expected == "cudnn"), [str(w.message) for w in caught]
  attention_backend.select_backend.cache_clear()


def test_unmeasured_gpu_uses_cudnn_for_bf16_and_warns_for_fp8():
  attention_backend.select_backend.cache_clear()
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    assert attention_backend.select_backend(_key(fp8=False, gpu_arch="sm_80")).name == "cudnn"
  with pytest.warns(UserWarning, match="no validated attention measurement for sm_80"):
    assert attention_backend.select_backend(_key(gpu_arch="sm_80")).name == "pallas"


def test_hopper_backends_state_what_they_cannot_run():
  attention_backend.select_backend.cache_clear()
  assert attention_backend.select_backend(
      _key(mask="causal+segments", equal_lengths=False), "pallas_hopper_fp8").name == (
          "pallas_hopper_fp8")
  for backend, change, match in (
      ("pallas_hopper_fp8", dict(fp8=False), "not quantized"),
      ("pallas_hopper", dict(gpu_arch="sm_80"), "not Hopper"),
      ("pallas_hopper", dict(head_dim=256), "head_dim 256"),
      ("pallas_hopper", dict(size_class="unaligned"), "multiples of 128"),
      ("pallas_hopper", dict(fp8=False, dtype="float32"), "float32")):
    with pytest.raises(ValueError, match=match):
      attention_backend.select_backend(_key(**change), backend)


def test_selection_falls_back_for_unsupported_head_dim_with_a_reason():
  attention_backend.select_backend.cache_clear()
  with pytest.warns(UserWarning, match="head_dim 48 is not one of the fused kernel's"):
    assert attention_backend.select_backend(_key(fp8=False, head_dim=48)).name == "cudnn"
  # Inputs cuDNN rejects fall back to XLA rather than failing inside cuDNN.
  for unsupported in (dict(dtype="float32", head_dim=48), dict(head_dim=20),
                      dict(head_dim=512)):
    with pytest.warns(UserWarning, match="head_dim"):
      choice = attention_backend.select_backend(_key(fp8=False, **unsupported))
    assert choice.name == "xla", unsupported


def test_requested_backend_that_cannot_run_is_an_error():
  with pytest.raises(ValueError, match="backend='cudnn' cannot run.*GPU"):
    attention_backend.select_backend(_key(platform="cpu", gpu_arch=None, fp8=False), "cudnn")
  with pytest.raises(ValueError, match="backend='triton' is not one of"):
    attention_backend.select_backend(_key(), "triton")


def test_attention_bad_input_is_explained():
  q, k, v = _qkv(5, seq=16)
  meta = fp8jax.init_attention_meta(RECIPE)
  with pytest.raises(TypeError, match="q has dtype int32"):
    fp8jax.fp8_attention(q.astype(jnp.int32), k, v, meta)
  with pytest.raises(ValueError, match="heads must be a multiple"):
    fp8jax.attention(q[:, :, :3], k, v)
  with pytest.raises(TypeError, match="meta must be a fp8jax.AttentionMeta"):
    fp8jax.fp8_attention(q, k, v, fp8jax.init_dot_meta(RECIPE))
  with pytest.raises(ValueError, match="pass both q_segment_ids and kv_segment_ids"):
    fp8jax.attention(q, k, v, q_segment_ids=jnp.zeros((1, 16), jnp.int32))


def test_linen_mha_matches_pure_composition():
  # float32 like the parameters: Flax promotes bf16 inputs to the params' dtype.
  x = jax.random.normal(jax.random.key(6), (2, 32, 64))
  model = fp8nn.Fp8MultiHeadAttention(num_heads=4, head_dim=64, num_kv_heads=2, causal=True,
                                      recipe=RECIPE)
  variables = model.init(jax.random.key(7), x)
  y, updates = model.apply(variables, x, mutable=["fp8_meta"])
  p, s = variables["params"], variables["fp8_meta"]
  proj = lambda name, t, axes: fp8jax.fp8_dot_general(t, p[name]["kernel"], s[name]["dot_meta"], axes)
  q, mq = proj("query", x, (((2,), (0,)), ((), ())))
  k, mk = proj("key", x, (((2,), (0,)), ((), ())))
  v, mv = proj("value", x, (((2,), (0,)), ((), ())))
  o, ma = fp8jax.fp8_attention(q, k, v, s["attention_meta"], causal=True)
  want, mo = proj("out", o, (((2, 3), (0, 1)), ((), ())))
  np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(want, np.float32))
  got = updates["fp8_meta"]
  for name, m in (("query", mq), ("key", mk), ("value", mv), ("out", mo)):
    for a, b in zip(jax.tree.leaves(got[name]["dot_meta"]), jax.tree.leaves(m)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  for a, b in zip(jax.tree.leaves(got["attention_meta"]), jax.tree.leaves(ma)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_nnx_mha_trains_with_value_and_grad_and_records_attention_amaxes():
  model = fp8nnx.Fp8MultiHeadAttention(64, num_heads=4, head_dim=64, causal=True,
                                       recipe=RECIPE, rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(8), (2, 32, 64)).astype(jnp.bfloat16)
  graphdef, params, fp8_state = nnx.split(model, nnx.Param, fp8nnx.Fp8MetaVariable)

  def loss_fn(params, fp8_state, x):
    m = nnx.merge(graphdef, params, fp8_state)
    return jnp.mean(m(x).astype(jnp.float32) ** 2), nnx.state(m, fp8nnx.Fp8MetaVariable)

  loss, grads, new_state = jax.jit(fp8jax.value_and_grad(loss_fn))(params, fp8_state, x)
  attn = new_state["attention_meta"].get_value()
  assert np.isfinite(float(loss))
  for role in ("q", "k", "v", "o", "grad"):
    assert float(getattr(attn, role).amax_history[0]) > 0, role
  grad_norms = [float(jnp.linalg.norm(g)) for g in jax.tree.leaves(grads)]
  assert len(grad_norms) == 4 and all(n > 0 for n in grad_norms)


def test_mixed_qkv_dtypes_are_explained():
  q, k, v = _qkv(10, seq=16)
  with pytest.raises(TypeError, match="q, k and v must share a dtype"):
    fp8jax.fp8_attention(q, k.astype(jnp.float32), v, fp8jax.init_attention_meta(RECIPE))


def test_tuning_picks_the_fastest_forward_plus_backward_per_stage_count():
  # The stage count is shared by both passes: the pick is the stage count whose fastest
  # forward plus fastest backward is least, not the fastest forward alone.
  def entry(seconds, **blocks):
    fields = dict(dataclasses.asdict(attention_tuning.DEFAULT), **blocks)
    return {"blocks": fields, "median_s": seconds}
  forward = [entry(1.0, num_stages=2, ping_pong=True), entry(0.7, num_stages=3, block_kv=64),
             entry(0.9, num_stages=2, ping_pong=False), {"blocks": dict(
                 dataclasses.asdict(attention_tuning.DEFAULT), num_stages=4), "skipped": "smem"}]
  backward = [entry(2.0, num_stages=2, block_q_dkv=128), entry(2.5, num_stages=3)]
  best = attention_tuning._best(forward, backward)
  # Stages 2: 0.9 + 2.0 = 2.9 < stages 3: 0.7 + 2.5 = 3.2.
  assert best == dict(dataclasses.asdict(attention_tuning.DEFAULT), num_stages=2,
                      ping_pong=False, block_q_dkv=128)


@pytest.mark.skipif(deviceless.deviceless_toolchain_missing() is not None,
                    reason="needs the deviceless H100 toolchain")
def test_hopper_backends_run_with_the_tuned_tiles_of_the_compile_targets_gpu(monkeypatch):
  tiles = dict(block_q=64, block_kv=64, block_q_dq=64, block_kv_dq=128, block_kv_dkv=64,
               block_q_dkv=128, num_stages=3, ping_pong=False)
  tuning = {"smoke": False, "best": {"fp8": {"causal": {"128": tiles}}}}
  monkeypatch.setattr(attention_backend, "TUNED", attention_speeds.tuned_from_tuning(tuning))
  with jax.set_mesh(deviceless.h100_mesh(data=1)):
    assert attention_op._hopper_blocks("pallas_hopper_fp8", True, 128) == (
        pallas_kernels.HopperAttentionBlockSizes(**tiles))
    # Nothing tuned for this mask, precision or head_dim: the kernels' defaults.
    assert attention_op._hopper_blocks("pallas_hopper_fp8", False, 128) is None
    assert attention_op._hopper_blocks("pallas_hopper", True, 128) is None
    assert attention_op._hopper_blocks("pallas_hopper_fp8", True, 64) is None
  # Off the tuned GPU (this CPU process) nothing applies either.
  assert attention_op._hopper_blocks("pallas_hopper_fp8", True, 128) is None
  # A smoke run's tuning is never a table.
  assert attention_speeds.tuned_from_tuning({**tuning, "smoke": True}) == {}
