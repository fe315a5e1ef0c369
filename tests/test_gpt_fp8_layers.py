"""`GptConfig.fp8_layers`: the demo GPT's projections in FP8 everywhere ("all") or where the
cost model predicts FP8 pays ("auto", the default layer filter's choice)."""
import warnings

import jax
import jax.numpy as jnp
import pytest

import fp8jax
from fp8jax.cli import cost_gpt
from fp8jax.flax import default_layer_filter
from fp8jax.models import gpt, gpt_fp8_layers
from fp8jax.runs import RunConfig, RunError, gpt_program

RECIPE = fp8jax.DelayedScaling()


@pytest.mark.parametrize("size, expected", [
    ("tiny", ()), ("small", ()), ("125m", ("qkv", "up", "down")),
    ("350m", ("qkv", "up", "down")), ("1b", ("qkv", "out", "up", "down"))])
def test_auto_runs_in_fp8_the_projections_the_default_filter_chooses(size, expected):
  config = gpt.config_for(size, fp8_layers="auto")
  assert gpt_fp8_layers.fp8_projections(config, RECIPE) == expected
  for name in gpt_fp8_layers.PROJECTIONS:  # the filter's own answer on each shape
    layer = gpt_fp8_layers.projection(config, name)
    assert (name in expected) == default_layer_filter(layer)
  # "all" (the default) runs every projection in FP8; no recipe runs none.
  every = gpt.config_for(size)
  assert gpt_fp8_layers.fp8_projections(every, RECIPE) == gpt_fp8_layers.PROJECTIONS
  assert gpt_fp8_layers.fp8_projections(config, None) == ()


def test_the_shapes_the_filter_sees_are_the_projections_kernels():
  config = gpt.config_for("125m")
  d, d_ff = config.d_model, config.d_ff
  k_n = {name: (gpt_fp8_layers.projection(config, name).k,
                gpt_fp8_layers.projection(config, name).n)
         for name in gpt_fp8_layers.PROJECTIONS}
  assert k_n == {"qkv": (d, 3 * d), "out": (d, d), "up": (d, d_ff), "down": (d_ff, d),
                 "head": (d, 256)}
  params = jax.eval_shape(gpt.Gpt(gpt.config_for("125m", n_layers=1)).init,
                          jax.random.key(0), jax.ShapeDtypeStruct((1, 8), jnp.int32))["params"]
  blocks = params["blocks"]
  assert blocks["attention"]["qkv"]["kernel"].shape == (1, d, config.n_heads, 3,
                                                       config.head_dim)
  assert blocks["attention"]["out"]["kernel"].shape == (1, config.n_heads, config.head_dim, d)
  assert blocks["mlp"]["up"]["kernel"].shape == (1, d, d_ff)
  assert blocks["mlp"]["down"]["kernel"].shape == (1, d_ff, d)


def _abstract_init(config, recipe=RECIPE):
  return jax.eval_shape(gpt.Gpt(config, recipe).init, jax.random.key(0),
                        jax.ShapeDtypeStruct((1, 16), jnp.int32))


def test_auto_keeps_the_parameters_and_drops_the_state_of_the_projections_in_bf16():
  auto = _abstract_init(gpt.config_for("125m", n_layers=1, seq_len=16, fp8_layers="auto"))
  every = _abstract_init(gpt.config_for("125m", n_layers=1, seq_len=16))
  assert jax.tree.structure(auto["params"]) == jax.tree.structure(every["params"])
  assert set(every["fp8_meta"]) == {"blocks", "head"}
  assert set(auto["fp8_meta"]) == {"blocks"}  # the head (N = 256) runs in bf16
  assert set(auto["fp8_meta"]["blocks"]["attention"]) == {"qkv", "attention_meta"}  # no out
  assert set(auto["fp8_meta"]["blocks"]["mlp"]) == {"up", "down"}


def test_auto_warns_when_it_runs_no_projection_in_fp8_and_all_keeps_the_demo_in_fp8():
  with pytest.warns(UserWarning, match=r"fp8_layers='auto' runs none of this d_model=128 "
                                       r"model's projections in FP8.*fp8_layers='all'"):
    _abstract_init(gpt.config_for("tiny", fp8_layers="auto"))
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    tiny = _abstract_init(gpt.config_for("tiny"))  # the CPU demo's model: every projection FP8
  assert set(tiny["fp8_meta"]["blocks"]["mlp"]) == {"up", "down"}
  assert "out" in tiny["fp8_meta"]["blocks"]["attention"] and "head" in tiny["fp8_meta"]


def test_a_bad_fp8_layers_is_refused_naming_the_choices():
  with pytest.raises(ValueError, match=r"GptConfig.fp8_layers='some' is not one of \('all', "
                                       r"'auto'\)"):
    gpt.config_for("tiny", fp8_layers="some")
  with pytest.raises(RunError, match=r"--fp8-layers 'some' is not one of \['all', 'auto'\]"):
    RunConfig(fp8_layers="some")
  assert RunConfig(fp8_layers="auto").fp8_layers == "auto"


def test_fp8jax_cost_labels_the_auto_step_and_says_which_projections_it_runs_in_fp8():
  program = gpt_program.GptProgram(size="125m", batch=8, seq=1024, fp8_layers="auto")
  assert program.label == "delayed, adamw, auto FP8 layers"
  assert program.config().fp8_layers == "auto"
  assert cost_gpt.fp8_layers_line(program) == (
      "projections (--fp8-layers auto): in FP8 qkv, up, down; in bf16 out, head (the cost "
      "model at 4096 tokens)")
  # The bf16 baseline has no FP8 layers to choose: its label says nothing of them.
  assert gpt_program.GptProgram(size="125m", batch=8, seq=1024, recipe="bf16",
                                fp8_layers="auto").label == "bf16, adamw"
