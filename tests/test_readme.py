"""The README's commands and usage example stay true."""
import pathlib
import re

import numpy as np

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_readme_starts_with_the_demo_and_test_commands():
  first_block = re.search(r"```bash\n(.*?)```", README.read_text(), re.S).group(1)
  assert first_block.splitlines() == [
      'pip install -e ".[examples]" && fp8jax compare',
      'pip install -e ".[test,hopper]" && python -m pytest -q',
  ]
  ci = (README.parent / ".ci" / "run").read_text()
  assert "grep -m1 -E '^pip install -e \"\\.\\[test' README.md" in ci


def test_readme_usage_example_runs_and_updates_fp8_state():
  code = re.search(r"```python\n(.*?)```", README.read_text(), re.S).group(1)
  namespace = {}
  exec(compile(code, "README.md", "exec"), namespace)
  assert np.isfinite(float(namespace["loss"]))
  state = namespace["fp8_state"]
  # After one step the newest history entry holds the observed amax for every role.
  for meta in state.values():
    for role in (meta.x, meta.kernel, meta.grad):
      assert float(role.amax_history[0]) > 0


def test_readme_overflow_snippet_skips_nothing_on_a_finite_step():
  text = README.read_text()
  namespace = {}
  exec(compile(re.search(r"```python\n(.*?)```", text, re.S).group(1), "README.md", "exec"),
       namespace)
  before = namespace["params"]
  exec(compile(_python_block_after("## Usage", "**Overflow.**"), "README.md", "exec"), namespace)
  assert not bool(namespace["overflow"])
  assert not np.array_equal(np.asarray(namespace["params"]["w1"]), np.asarray(before["w1"]))


def _python_block_after(heading: str, marker: str) -> str:
  text = README.read_text()
  section = text[text.index(heading):]
  section = section[section.index(marker):]
  return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def _namespace_with_a_linen_model():
  import flax.linen as nn
  import jax
  import jax.numpy as jnp
  import optax

  import fp8jax
  from fp8jax.flax import linen as fp8nn

  class Model(nn.Module):

    @nn.compact
    def __call__(self, x):
      return fp8nn.Fp8Dense(32)(nn.relu(fp8nn.Fp8Dense(64)(x)))

  x = jax.random.normal(jax.random.key(0), (16, 32))
  return dict(jax=jax, jnp=jnp, optax=optax, fp8jax=fp8jax, model=Model(), x=x, y=x * 0.5)


def test_readme_flax_train_state_loop_runs_and_updates_fp8_state():
  namespace = _namespace_with_a_linen_model()
  exec(compile(_python_block_after("## Using fp8jax with an existing Flax model",
                                   "**The training loop.**"), "README.md", "exec"), namespace)
  state = namespace["state"]
  for _ in range(2):
    state, loss = namespace["train_step"](state, namespace["x"], namespace["y"])
  assert np.isfinite(float(loss)) and int(state.step) == 2
  for meta in namespace["jax"].tree.leaves(
      state.fp8_state, is_leaf=lambda n: isinstance(n, namespace["fp8jax"].Fp8Meta)):
    assert np.all(np.asarray(meta.amax_history)[:2] > 0)


def test_readme_telemetry_snippet_runs_and_gives_finite_scalars():
  namespace = _namespace_with_a_linen_model()
  variables = namespace["model"].init(namespace["jax"].random.key(1), namespace["x"])
  namespace.update(params=variables["params"], fp8_state=variables["fp8_meta"])
  exec(compile(_python_block_after("## Recipes", "**Telemetry.**"), "README.md", "exec"),
       namespace)
  metrics = namespace["metrics"]
  assert any(key.endswith("snr_db") for key in metrics) and len(metrics) > 10
  assert not any(np.isnan(float(v)) for v in metrics.values())  # SNR may be +inf


def test_readme_own_recipe_runs_in_the_sweep_beside_the_built_in_ones(tmp_path, monkeypatch):
  import json

  from fp8jax.cli import main

  module = tmp_path / "my_recipes.py"
  code = _python_block_after("## Write your own recipe", "An EMA of the amax history")
  assert code.startswith("# my_recipes.py") and len(code.splitlines()) <= 40
  module.write_text(code)
  monkeypatch.syspath_prepend(str(tmp_path))
  section = README.read_text().split("## Write your own recipe")[1]
  command = re.search(r"fp8jax sweep (--recipes [^\n]*)", section).group(1).split()
  assert command[1] == "bf16,delayed,my_recipes:EmaAmaxScaling"
  # The README's recipes at the size of test_sweep.py (the tiny model, 8 steps of 4 x 32
  # tokens; the same settings share compiled steps); its --history grid is left out.
  status = main(["sweep", "--out", str(tmp_path / "sweep"), *command[:2], "--size", "tiny",
                 "--steps", "8", "--batch", "4", "--seq", "32", "--eval-every", "8",
                 "--no-predict"])
  assert status == 0
  saved = json.loads((tmp_path / "sweep" / "sweep.json").read_text())
  runs = {run["name"]: run for run in saved["runs"]}
  assert set(runs) == {"bf16", "delayed", "my_recipes:EmaAmaxScaling"}
  run = runs["my_recipes:EmaAmaxScaling"]
  assert run["recipe"]["kind"] == "my_recipes:EmaAmaxScaling" and run["recipe"]["decay"] == 0.5
  # It trained as the built-in delayed recipe did: 8 steps from the same initialization
  # and data, apart only in how the scales follow the amaxes (FP8 rounding, <5%).
  assert abs(run["final_loss"] / runs["delayed"]["final_loss"] - 1) < 0.05


def test_readme_rules_snippet_prints_the_report_shown_beside_it():
  import sys
  import jax
  import fp8jax
  sys.path.insert(0, str(README.parent / "tests"))
  from test_flax_any_model import LanguageModel, _ids
  text = README.read_text()
  snippet = re.search(r"```python\n(from fp8jax.flax import Fp8Model, Fp8Rule\n.*?)```", text,
                      re.S).group(1)
  shown = re.search(r"this prints\n.*?```\n(path .*?)```", text, re.S).group(1)
  namespace = {"fp8jax": fp8jax, "model": LanguageModel(layers=1), "rng": jax.random.key(1),
               "ids": _ids(0), "print": lambda report: namespace.update(report=report)}
  exec(compile(snippet, "README.md", "exec"), namespace)
  assert str(namespace["report"]).strip() == shown.strip()
