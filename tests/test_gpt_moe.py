"""The demo GPT with a mixture-of-experts MLP: its FP8 state per expert, its training
objective, its runs (learning, exact resume) and the errors of its settings.

Model-level tests use a two-layer GPT of width 64 (seconds to compile); run-level tests the
tiny size on a few dozen steps of 8 x 64 tokens, as tests/test_runs.py does.
"""
from __future__ import annotations

import dataclasses
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import fp8jax
from fp8jax import runs
from fp8jax.cli import main
from fp8jax.models import gpt, gpt_sharding
from fp8jax.runs import checkpoints, metrics
from fp8jax.runs.steps import build, init_state, train_step_for

SMALL_MODEL = gpt.GptConfig(d_model=64, n_layers=2, n_heads=1, seq_len=32, experts=4, top_k=2)
# Settings shared by the run tests, so they share their compiled steps.
SMALL_RUN = dict(size="tiny", steps=24, batch=8, seq=64, lr=3e-3, warmup_steps=5,
                 eval_every=12, eval_batches=2, max_data_bytes=400_000, experts=4, top_k=2)


def _tokens(batch=4, seq=SMALL_MODEL.seq_len):
  return jax.random.randint(jax.random.key(7), (batch, seq + 1), 0, gpt.VOCAB_SIZE, jnp.int32)


def _gradient_step(model, fp8: bool):
  """The demo's train step with an optimizer that adds the gradient to the params, so
  new params - params is the gradient the step took (float32 rounding of p + g only)."""
  return train_step_for(model, optax.identity(), fp8)


def _copy(tree):
  return jax.tree.map(jnp.array, tree)  # the step donates its arguments


def test_fp8_moe_gpt_records_each_experts_weight_amax_and_scale():
  recipe = fp8jax.DelayedScaling(amax_history_len=4)
  model = gpt.Gpt(SMALL_MODEL, recipe=recipe)
  tokens = _tokens()
  variables = model.init(jax.random.key(0), tokens[:, :-1])
  params, fp8_state = variables["params"], variables["fp8_meta"]
  step = _gradient_step(model, fp8=True)
  _, _, new_state, loss, _ = step(_copy(params), optax.identity().init(params),
                                  _copy(fp8_state), tokens)
  assert np.isfinite(float(loss))
  mlp = new_state["blocks"]["mlp"]
  assert set(mlp) == {"w_in_meta", "w_out_meta"}
  layers, experts = SMALL_MODEL.n_layers, SMALL_MODEL.experts
  for name, weight in (("w_in_meta", "w_in"), ("w_out_meta", "w_out")):
    kernel = mlp[name].kernel
    assert kernel.scale.shape == (layers, experts)
    # Each expert's weight amax, from numpy: the layer casts the float32 param to bf16
    # before the FP8 cast, and rounding is monotonic, so the amax is max|bf16(w)| exactly.
    w = np.asarray(params["blocks"]["mlp"][weight].astype(jnp.bfloat16), np.float64)
    want = np.abs(w).max(axis=(2, 3))                                    # [L, E]
    np.testing.assert_array_equal(np.asarray(kernel.amax_history[..., 0]), want)
    # Delayed scaling: scale = E4M3 max / amax, one float32 division per expert.
    np.testing.assert_allclose(np.asarray(kernel.scale), 448.0 / want, rtol=2**-23)
    # Not one shared scale (two experts' bf16 amaxes can still coincide).
    assert len(np.unique(np.asarray(kernel.scale))) > layers
    # x and the output gradient have one scale per layer, each from a recorded amax.
    for role in (mlp[name].x, mlp[name].grad):
      assert role.scale.shape == (layers,) and np.all(np.asarray(role.amax_history[:, 0]) > 0)


def _switch_loss(router_logits, k):
  """Switch Transformer balancing loss in plain jnp: E * sum_e f_e P_e, f without gradient."""
  num_experts = router_logits.shape[-1]
  probs = jax.nn.softmax(router_logits, axis=-1)
  chosen = jnp.argsort(-probs, axis=-1)[:, :k]                           # [T, k]
  counts = jnp.sum(chosen[..., None] == jnp.arange(num_experts), axis=(0, 1))
  fraction = jax.lax.stop_gradient(counts / chosen.size)
  return num_experts * jnp.sum(fraction * jnp.mean(probs, axis=0))


def test_load_balancing_loss_enters_the_gradient_with_its_weight_and_the_loss_is_lm_only():
  tokens = _tokens()
  inputs, targets = tokens[:, :-1], tokens[:, 1:]
  models = {w: gpt.Gpt(dataclasses.replace(SMALL_MODEL, aux_loss_weight=w)) for w in (0.0, 0.5)}
  params = models[0.0].init(jax.random.key(0), inputs)["params"]

  def router_logits(p):  # [L, T, E], captured where the model computes them
    _, state = models[0.0].apply({"params": p}, inputs, capture_intermediates=True,
                                 mutable=["intermediates"])
    return state["intermediates"]["blocks"]["mlp"]["router"]["__call__"][0]

  def aux_reference(p):
    return sum(_switch_loss(logits, SMALL_MODEL.top_k) for logits in router_logits(p))

  results = {}
  for weight, model in models.items():
    new_params, _, _, loss, stats = _gradient_step(model, fp8=False)(
        _copy(params), optax.identity().init(params), {}, tokens)
    grads = jax.tree.map(lambda new, old: np.asarray(new, np.float64) - np.asarray(old),
                         new_params, params)
    results[weight] = (float(loss), float(stats["aux_loss"]), grads)

  # The reported loss is the cross-entropy alone (float64 from the model's logits; the
  # model computes it in float32 from its logits in another program, the train step,
  # where XLA may keep a bf16 intermediate of the unrolled blocks in float32 that the
  # forward-only program rounds: 2e-6 apart seen, hence 1e-5).
  logits = np.asarray(models[0.0].apply({"params": params}, inputs), np.float64)
  shifted = logits - logits.max(-1, keepdims=True)
  log_probs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
  cross_entropy = -np.take_along_axis(log_probs, np.asarray(targets)[..., None], -1).mean()
  for loss, aux, _ in results.values():
    assert loss == pytest.approx(cross_entropy, rel=1e-5)
    # The logged auxiliary loss is the sum over layers of each layer's Switch loss.
    assert aux == pytest.approx(float(aux_reference(params)), rel=1e-6)

  # d(objective) = d(cross-entropy) + 0.5 d(aux): the difference of the two steps'
  # router gradients is 0.5 times the reference aux loss's.
  router = lambda grads: grads["blocks"]["mlp"]["router"]["kernel"]               # [L, d, E]
  want = 0.5 * np.asarray(router(jax.grad(aux_reference)(params)))
  got = router(results[0.5][2]) - router(results[0.0][2])
  lm_part = np.abs(router(results[0.0][2])).max(axis=(1, 2))
  assert np.all(np.abs(want).max(axis=(1, 2)) > 0.5 * lm_part)  # the aux part is no sliver
  # The last layer's router gradient is float32 from the logits on in both programs, and
  # its cross-entropy part is the same: they agree to float32 rounding (1e-6 measured).
  np.testing.assert_allclose(got[-1], want[-1], atol=1e-5 * np.abs(want[-1]).max())
  # An earlier layer's also carries the later layers' aux gradient, which reaches it through
  # the bf16 residual stream, rounded there with the cross-entropy's cotangent: bf16's
  # relative rounding (2**-8) of the cross-entropy part, twice for margin (0.35% measured).
  for layer in range(SMALL_MODEL.n_layers - 1):
    np.testing.assert_allclose(got[layer], want[layer], atol=2**-7 * lm_part[layer])


def test_moe_params_shard_each_expert_like_the_dense_mlp():
  params = jax.eval_shape(gpt.Gpt(SMALL_MODEL).init, jax.random.key(0),
                          jax.ShapeDtypeStruct((1, 8), jnp.int32))["params"]
  for fsdp, w_in, w_out in ((None, P(None, None, None, "model"), P(None, None, "model", None)),
                            ("data", P(None, None, "data", "model"),
                             P(None, None, "model", "data"))):
    specs = gpt_sharding.param_specs(params, fsdp_axis=fsdp)["blocks"]["mlp"]
    # [L, E, d, d_ff] and [L, E, d_ff, d]: d_ff over "model", d over the FSDP axis.
    assert specs["w_in"] == w_in and specs["w_out"] == w_out
    assert specs["router"]["kernel"] == P()  # [L, d, E]: tiny, replicated


def _run_config(**changes):
  return runs.RunConfig(**{**SMALL_RUN, **changes})


def _metric_lines(out_dir):
  return metrics.read(pathlib.Path(out_dir) / metrics.FILE)


@pytest.mark.cpu_optimized
@pytest.mark.parametrize("recipe", ["bf16", "delayed"])
def test_moe_gpt_run_learns_and_logs_its_aux_loss_and_per_expert_state(recipe, tmp_path):
  result = runs.train(_run_config(recipe=recipe, checkpoint_every=24), tmp_path,
                      progress=False)
  # Byte-level text: the loss starts near ln(256) = 5.5 and must clearly fall.
  assert result.losses[0] > 4.5
  assert np.mean(result.losses[-5:]) < np.mean(result.losses[:5]) - 1.0
  steps = [line for line in _metric_lines(tmp_path) if "loss" in line]
  assert len(steps) == 24
  assert all(np.isfinite(line["aux_loss"]) and line["aux_loss"] > 0 for line in steps)
  summary = json.loads((tmp_path / "run.json").read_text())
  assert summary["model"]["experts"] == 4 and summary["model"]["top_k"] == 2
  assert summary["model"]["parameters"] == gpt.parameter_count(
      gpt.config_for("tiny", experts=4, top_k=2))
  if recipe == "delayed":
    layers = gpt.SIZES["tiny"].n_layers
    for name in ("blocks/mlp/w_in_meta/kernel", "blocks/mlp/w_out_meta/kernel"):
      amax = np.array([line["fp8"][name]["amax"] for line in steps])    # [step, L * E]
      scale = np.array([line["fp8"][name]["scale"] for line in steps])
      assert amax.shape == scale.shape == (24, layers * 4)  # one per layer and expert
      assert np.all(scale > 0) and np.mean(amax > 0) > 0.5
      # In these early steps the routing is still uneven and some steps leave an expert
      # without tokens: it records amax 0 and keeps its scale for the next step.
      idle = amax[1:] == 0
      np.testing.assert_array_equal(scale[1:][idle], scale[:-1][idle])


def test_parameter_count_counts_every_expert_and_the_router():
  for config in (SMALL_MODEL, dataclasses.replace(SMALL_MODEL, experts=0)):
    params = jax.eval_shape(gpt.Gpt(config).init, jax.random.key(0),
                            jax.ShapeDtypeStruct((1, 8), jnp.int32))["params"]
    assert gpt.parameter_count(config) == sum(leaf.size for leaf in jax.tree.leaves(params))


@pytest.mark.cpu_optimized
def test_killed_and_resumed_moe_run_gives_the_losses_of_an_uninterrupted_run(tmp_path, capsys):
  # A third of the learning run's steps: what is resumed matters here, not how far it
  # learns; killed after step 5, it resumes from step 4's checkpoint.
  config = _run_config(recipe="delayed", steps=8, checkpoint_every=4, eval_every=4)
  whole = runs.train(config, tmp_path / "whole", progress=False)
  runs.train(config, tmp_path / "split", progress=False, stop_after=5)
  assert checkpoints.complete(tmp_path / "split")[-1].name == "step_0000004"
  resumed = runs.train(config, tmp_path / "split", resume=True, progress=False)
  assert resumed.losses == whole.losses  # bitwise: same batches, same compiled step
  aux = lambda name: [line["aux_loss"] for line in _metric_lines(tmp_path / name)
                      if "loss" in line]
  assert aux("split") == aux("whole")
  model, tx, _ = build(config)
  targets = jax.eval_shape(lambda: init_state(model, tx, config))
  restored = [fp8jax.checkpoint.restore(tmp_path / name / "checkpoints" / "step_0000008",
                                        params=targets[0], opt_state=targets[1],
                                        fp8_state=targets[2]) for name in ("whole", "split")]
  for a, b in zip(jax.tree.leaves(restored[0]), jax.tree.leaves(restored[1])):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # The per-expert FP8 state went through the checkpoint: [layers, experts] scales.
  assert restored[0]["fp8_state"]["blocks"]["mlp"]["w_in_meta"].kernel.scale.shape == (4, 4)
  # Continuing it as another model is refused in one line, naming the setting.
  status = main(["train", "--resume", "--out", str(tmp_path / "split"), "--experts", "2",
                 "--steps", "30"])
  err = capsys.readouterr().err.strip()
  assert status == 2 and "experts=4" in err and "--experts" in err
  assert len(err.splitlines()) == 1


@pytest.mark.parametrize("argv,message", [
    (["--experts", "-1"], "--experts -1 must be a non-negative integer"),
    (["--experts", "2", "--top-k", "3"], "--top-k 3 must be an integer from 1 to --experts 2"),
    (["--experts", "4", "--top-k", "0"], "--top-k 0 must be an integer from 1 to --experts 4"),
    (["--top-k", "2"], "add --experts N"),
])
def test_bad_moe_options_are_one_line_never_a_traceback(argv, message, tmp_path, capsys):
  for command in ("train", "compare"):
    status = main([command, "--out", str(tmp_path / command), *argv])
    err = capsys.readouterr().err.strip()
    assert status == 2
    assert message in err and len(err.splitlines()) == 1 and "Traceback" not in err
    assert not (tmp_path / command).exists()  # refused before anything was written


@pytest.mark.parametrize("fields,message", [
    (dict(experts=-2), "GptConfig.experts=-2"),
    (dict(experts=2.0), "GptConfig.experts=2.0"),
    (dict(experts=4, top_k=5), "GptConfig.top_k=5 is more than experts=4"),
    (dict(experts=4, top_k=0), "GptConfig.top_k=0"),
    (dict(experts=4, aux_loss_weight=-0.01), "GptConfig.aux_loss_weight=-0.01"),
    (dict(experts=4, aux_loss_weight=float("nan")), "GptConfig.aux_loss_weight=nan"),
])
def test_bad_moe_model_fields_name_the_field(fields, message):
  with pytest.raises(ValueError, match=message.replace(".", r"\.")):
    gpt.config_for("tiny", **fields)



ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_moe_guide_shows_the_recorded_three_seed_comparison():
  """docs/guides/moe.md's table and figures are examples/results/compare_moe_cpu_3_seeds.json's,
  whose summary is recomputed here from its per-seed runs."""
  record = json.loads((ROOT / "examples/results/compare_moe_cpu_3_seeds.json").read_text())
  text = (ROOT / "docs/guides/moe.md").read_text()
  assert record["config"]["experts"] == 4 and record["config"]["top_k"] == 2
  assert record["command"].startswith("fp8jax compare --experts 4 --top-k 2 --seed S")
  seeds = sorted(record["seeds"], key=int)
  runs_of = {seed: {run["recipe"]: run for run in record["seeds"][seed]} for seed in seeds}
  bf16 = [runs_of[seed]["bf16"]["final_loss"] for seed in seeds]
  assert record["bf16_final_loss_spread"] == [min(bf16), max(bf16)]
  fp8 = [recipe for recipe in runs_of[seeds[0]] if recipe != "bf16"]
  assert fp8 == ["delayed", "current"]
  mean_row = f"| mean | {np.mean(bf16):.4f} |"
  for recipe in fp8:
    losses = [runs_of[seed][recipe]["final_loss"] for seed in seeds]
    gaps = [loss / base - 1 for loss, base in zip(losses, bf16)]
    for seed, gap in zip(seeds, gaps):
      assert runs_of[seed][recipe]["rel_gap_vs_bf16"] == pytest.approx(gap, rel=1e-12)
    assert record[f"{recipe}_rel_gap_vs_bf16_mean"] == pytest.approx(np.mean(gaps), rel=1e-12)
    assert record[f"{recipe}_rel_gap_vs_bf16_max"] == max(gaps)
    assert record[f"{recipe}_final_loss_mean"] == pytest.approx(np.mean(losses), rel=1e-12)
    within = abs(np.mean(losses) - np.mean(bf16)) <= max(bf16) - min(bf16)
    assert record[f"{recipe}_within_bf16_seed_spread"] == within
    assert within  # as the guide says of both
    mean_row += f" {np.mean(losses):.4f} ({100 * np.mean(gaps):+.2f}%) |"
  for seed in seeds:
    cells = [f"{runs_of[seed]['bf16']['final_loss']:.4f}"] + [
        f"{runs_of[seed][r]['final_loss']:.4f} ({100 * runs_of[seed][r]['rel_gap_vs_bf16']:+.2f}%)"
        for r in fp8]
    assert f"| {seed} | {' | '.join(cells)} |" in text
  assert mean_row in text
  assert f"bf16's seed spread ({min(bf16):.4f}-{max(bf16):.4f})" in text
  flat = " ".join(text.split())
  walls = record["wall_s"].values()
  assert f"{min(walls)}-{max(walls)} s per comparison" in flat
  # The dense demo's paired gaps it is set beside.
  dense = json.loads((ROOT / "examples/results/compare_cpu_3_seeds.json").read_text())
  dense_gaps = [run["rel_gap_vs_bf16"] for runs in dense["seeds"].values() for run in runs
                if run["recipe"] != "bf16"]
  assert (f"compare_cpu_3_seeds.json`: {100 * min(dense_gaps):+.2f}% to "
          f"{100 * max(dense_gaps):+.2f}%)") in flat
