"""The README's commands, usage example and demo figures stay true, and so do the docs'
examples that promise an outcome (tests/test_docs.py runs each; here what it does is checked)."""
import json
import pathlib
import re

import numpy as np
import pytest

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
RESULTS = README.parent / "examples" / "results"
# The pages that show the recorded demo: the README and the docs' getting started page.
GETTING_STARTED = README.parent / "docs" / "getting_started.md"
GUIDES = README.parent / "docs" / "guides"
DEMO_PAGES = [README, GETTING_STARTED]


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


def test_overflow_snippet_skips_nothing_on_a_finite_step():
  namespace = {}
  exec(compile(_python_block_after(GETTING_STARTED, "## A first FP8 train step", "```python"),
               "getting_started.md", "exec"), namespace)
  before = namespace["params"]
  exec(compile(_python_block_after(GUIDES / "fp8_state.md", "## Overflow", "report_overflow"),
               "fp8_state.md", "exec"), namespace)
  assert not bool(namespace["overflow"])
  assert not np.array_equal(np.asarray(namespace["params"]["w1"]), np.asarray(before["w1"]))


def _python_block_after(page: pathlib.Path, heading: str, marker: str) -> str:
  """The python example of section `heading` that holds `marker` or is the first after it."""
  text = page.read_text()
  section = text[text.index(heading):]
  at = section.index(marker)
  return next(block.group(1) for block in re.finditer(r"```python\n(.*?)```", section, re.S)
              if block.end() > at)


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


def test_flax_train_state_loop_runs_and_updates_fp8_state():
  namespace = _namespace_with_a_linen_model()
  exec(compile(_python_block_after(GUIDES / "flax.md", "## The training loop (linen)",
                                   "from fp8jax.flax import TrainState"), "flax.md", "exec"),
       namespace)
  state = namespace["state"]   # after the example's own step
  for _ in range(2):
    state, loss = namespace["train_step"](state, namespace["x"], namespace["y"])
  assert np.isfinite(float(loss)) and int(state.step) == 3
  for meta in namespace["jax"].tree.leaves(
      state.fp8_state, is_leaf=lambda n: isinstance(n, namespace["fp8jax"].Fp8Meta)):
    assert np.all(np.asarray(meta.amax_history)[:3] > 0)


def test_telemetry_snippet_runs_and_gives_finite_scalars():
  namespace = _namespace_with_a_linen_model()
  variables = namespace["model"].init(namespace["jax"].random.key(1), namespace["x"])
  namespace.update(params=variables["params"], fp8_state=variables["fp8_meta"])
  exec(compile(_python_block_after(GUIDES / "telemetry.md", "## Tensor statistics",
                                   "from fp8jax import telemetry"), "telemetry.md", "exec"),
       namespace)
  metrics = namespace["metrics"]
  assert any(key.endswith("snr_db") for key in metrics) and len(metrics) > 10
  assert not any(np.isnan(float(v)) for v in metrics.values())  # SNR may be +inf


def test_own_recipe_runs_in_the_sweep_beside_the_built_in_ones(tmp_path, monkeypatch):
  import json

  from fp8jax.cli import main

  module = tmp_path / "my_recipes.py"
  code = _python_block_after(GUIDES / "recipes.md", "## Write your own recipe",
                             "An EMA of the amax history")
  assert code.startswith("# my_recipes.py") and len(code.splitlines()) <= 40
  module.write_text(code)
  monkeypatch.syspath_prepend(str(tmp_path))
  section = (GUIDES / "recipes.md").read_text().split("## Write your own recipe")[1]
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


def test_rules_snippet_prints_the_report_shown_beside_it():
  import sys
  import jax
  import fp8jax
  sys.path.insert(0, str(README.parent / "tests"))
  from test_flax_any_model import LanguageModel, _ids
  text = (GUIDES / "flax.md").read_text()
  snippet = re.search(r"```python\n(from fp8jax.flax import Fp8Model, Fp8Rule\n.*?)```", text,
                      re.S).group(1)
  shown = re.search(r"This prints .*?```\n(path .*?)```", text, re.S).group(1)
  namespace = {"fp8jax": fp8jax, "model": LanguageModel(layers=1), "rng": jax.random.key(1),
               "ids": _ids(0), "print": lambda report: namespace.update(report=report)}
  exec(compile(snippet, "flax.md", "exec"), namespace)
  assert str(namespace["report"]).strip() == shown.strip()


def _record(name: str) -> dict:
  return json.loads((RESULTS / name).read_text())


def _gap(runs: list[dict], recipe: str) -> float:
  return next(run["rel_gap_vs_bf16"] for run in runs if run["recipe"] == recipe)


def _percent(gap: float) -> str:
  return f"{100 * gap:+.2f}%"


def test_demo_records_name_their_versions_and_the_table_is_seed_0_of_the_three():
  table, seeds = _record("compare_cpu.json"), _record("compare_cpu_3_seeds.json")
  assert set(table["versions"]) == {"python", "jax", "jaxlib", "flax", "optax", "numpy"}
  assert all(re.fullmatch(r"\d+\.\d+\S*", v) for v in table["versions"].values())
  assert seeds["versions"] == table["versions"]
  # One run behind the table and the first of the three seeds, with the demo's settings.
  assert table["config"]["seed"] == 0 and seeds["seeds"]["0"] == table["runs"]
  assert {**seeds["config"], "seed": 0} == table["config"]
  for recipe in ("delayed", "current"):
    gaps = [_gap(runs, recipe) for runs in seeds["seeds"].values()]
    assert seeds[f"{recipe}_rel_gap_vs_bf16_mean"] == pytest.approx(np.mean(gaps), rel=1e-12)
    assert seeds[f"{recipe}_rel_gap_vs_bf16_max"] == max(gaps)


@pytest.mark.parametrize("page", DEMO_PAGES, ids=lambda page: page.name)
def test_demo_table_is_the_recorded_comparison_as_fp8jax_compare_prints_it(page):
  from fp8jax import runs
  shown = re.search(r"```\n\$ fp8jax compare\n(.*?)```", page.read_text(), re.S).group(1)
  assert shown == runs.table(_record("compare_cpu.json")) + "\n"


@pytest.mark.parametrize("page", DEMO_PAGES, ids=lambda page: page.name)
def test_three_seed_figures_are_the_recorded_comparisons(page):
  record = _record("compare_cpu_3_seeds.json")
  text = " ".join(page.read_text().split())   # the sentence wraps across lines
  seeds = sorted(record["seeds"], key=int)
  assert f"over seeds {', '.join(seeds[:-1])} and {seeds[-1]} the final loss" in text
  for recipe in ("delayed", "current"):
    gaps = [_gap(record["seeds"][seed], recipe) for seed in seeds]
    quoted = (f"{', '.join(map(_percent, gaps[:-1]))} and {_percent(gaps[-1])} with {recipe} "
              f"scaling (mean {_percent(np.mean(gaps))})")
    assert quoted in text
  assert f"a {record['config']['steps']}-step run" in text
  walls = record["wall_s"].values()
  assert f"{min(walls)}-{max(walls)} s per comparison" in text


@pytest.mark.parametrize("page", DEMO_PAGES, ids=lambda page: page.name)
def test_the_pages_name_the_recorded_machine_wherever_they_quote_its_times_and_spread(page):
  """A CPU's numbers depend on its processor and on the text it trained on (the Python
  build's standard library): the records name both, and the pages name the recorded
  processor where they quote its times and the spread what varies is measured against."""
  from fp8jax.runs import machine
  table, seeds = _record("compare_cpu.json"), _record("compare_cpu_3_seeds.json")
  assert table["machine"] == seeds["machine"] and table["corpus"] == seeds["corpus"]
  assert table["machine"]["xla_flags"] == ""  # the pages' command, XLA's defaults
  assert re.fullmatch(r"[0-9a-f]{64}", table["corpus"]["sha256"])
  text = " ".join(page.read_text().split())
  named = machine.summary(table["machine"])
  walls = seeds["wall_s"].values()
  minutes = round(max(walls) / 30) / 2   # the slowest seed, to the half minute
  assert f"about {minutes:g} minutes on a {named}" in text
  assert f"{named}, {min(walls)}-{max(walls)} s per comparison" in text
  low, high = seeds["bf16_final_loss_spread"]
  assert f"bf16's own seed-to-seed spread ({low:.4f} to {high:.4f})" in text
  gaps = [run["rel_gap_vs_bf16"] for runs in seeds["seeds"].values() for run in runs
          if run["recipe"] != "bf16"]
  assert f"three seeds give here ({_percent(min(gaps))} to {_percent(max(gaps))})" in text


def test_blackwell_recipe_figures_are_the_recorded_three_seeds():
  record = _record("compare_recipes_cpu_3_seeds.json")
  assert set(record["versions"]) == {"python", "jax", "jaxlib", "flax", "optax", "numpy"}
  readme = " ".join(README.read_text().split())
  guide = (GUIDES / "recipes.md").read_text()
  seeds = sorted(record["seeds"], key=int)
  assert seeds == ["0", "1", "2"] and record["config"]["steps"] == 250
  from fp8jax.runs import machine
  walls = record["wall_s"].values()
  assert (f"a {machine.summary(record['machine'])}, {min(walls)}-{max(walls)} s per seed"
          in " ".join(guide.split()))
  for recipe in ("delayed", "mxfp8_round_up", "nvfp4"):  # "by less than that spread"
    assert record[f"{recipe}_within_bf16_seed_spread"]
  assert not record["mxfp8_within_bf16_seed_spread"]
  bf16 = [next(r["final_loss"] for r in record["seeds"][s] if r["recipe"] == "bf16")
          for s in seeds]
  assert f"spans {max(bf16) - min(bf16):.4f}" in " ".join(guide.split())
  assert f"spans {max(bf16) - min(bf16):.4f} over the seeds" in readme
  for recipe, said in (("mxfp8", "with MXFP8 under OCP's rule"),
                       ("mxfp8_round_up", "under NVIDIA's"), ("nvfp4", "with NVFP4")):
    gaps = [_gap(record["seeds"][seed], recipe) for seed in seeds]
    assert record[f"{recipe}_rel_gap_vs_bf16_mean"] == pytest.approx(np.mean(gaps), rel=1e-12)
    assert f"{_percent(np.mean(gaps))} {said}" in readme
  # The guide's table: each seed's gap and final loss, the mean gap, the spread.
  for recipe in ("bf16", "delayed", "mxfp8", "mxfp8_round_up", "nvfp4"):
    runs = [next(r for r in record["seeds"][s] if r["recipe"] == recipe) for s in seeds]
    finals = [run["final_loss"] for run in runs]
    cells = [f"{_percent(run['rel_gap_vs_bf16'])} ({run['final_loss']:.4f})" for run in runs]
    mean_gap = "" if recipe == "bf16" else _percent(np.mean([r["rel_gap_vs_bf16"] for r in runs]))
    row = (f"| {recipe} | {' | '.join(cells)} | {mean_gap} | {np.mean(finals):.4f}, "
           f"{min(finals):.4f}-{max(finals):.4f} ({max(finals) - min(finals):.4f}) |")
    assert row in guide, row


def test_memory_guide_table_is_the_recorded_three_seeds():
  """The memory guide's accuracy table: each variant's final loss (bf16) or gap to bf16 per
  seed and its mean, as examples/fp8_memory_accuracy.py recorded them."""
  record = _record("fp8_memory_3_seeds.json")
  text = (GUIDES / "memory.md").read_text()
  labels = {"bf16": "bf16", "delayed": "FP8 delayed", "delayed, FP8 moments": "+ FP8 moments",
            "delayed, FP8 saved activations": "+ FP8 saved activations",
            "delayed, FP8 moments + saved activations": "+ both",
            "bf16, FP8 moments": "bf16 + FP8 moments"}
  assert set(record["variants"]) == set(labels)
  for key, label in labels.items():
    variant = record["variants"][key]
    assert [run["seed"] for run in variant["runs"]] == [0, 1, 2]
    cells = [f"{run['final_loss']:.4f}" if key == "bf16" else _percent(run["rel_gap_vs_bf16"])
             for run in variant["runs"]]
    assert f"| {label} | {' | '.join(cells)} | {variant['mean_final_loss']:.4f} |" in text
    assert variant["within_bf16_seed_spread"]
  low, high = record["variants"]["bf16"]["seed_spread"]
  assert f"max - min over the seeds, {high - low:.3f})" in text
  # The machine the runs had, named where the table is (a CPU's numbers depend on it).
  from fp8jax.runs import machine
  assert set(record["versions"]) == {"python", "jax", "jaxlib", "flax", "optax", "numpy"}
  assert f"the machine: a {machine.summary(record['machine'])}" in " ".join(text.split())


def test_flax_guide_stack_casts_its_weights_before_the_loop_and_computes_the_same(
    monkeypatch):
  """The flax guide's scanned stack of blocks: its FP8 layers take the copies cast before
  the loop (4 projections of the block), and the model computes bit for bit what it
  computes when each layer casts its own weights."""
  import flax.linen as nn
  import jax
  import jax.numpy as jnp
  import fp8jax
  from fp8jax.flax import linen as fp8nn
  from fp8jax.flax import linen_stacked
  from fp8jax.ops import stacked_weights
  snippet = _python_block_after(GUIDES / "flax.md", "## A transformer block that costs",
                                "cast_scanned_weights")
  taken = []
  real = stacked_weights.supplied
  monkeypatch.setattr(stacked_weights, "supplied",
                      lambda kernel, layout: taken.append(real(kernel, layout) is not None)
                      or real(kernel, layout))

  def run():
    namespace = dict(nn=nn, jax=jax, jnp=jnp, fp8jax=fp8jax, fp8nn=fp8nn)
    exec(compile(snippet, "flax.md", "exec"), namespace)
    stack, variables, tokens = namespace["Stack"](), namespace["stack_variables"], \
        namespace["tokens"]
    # A second step, whose casts use the scales the first step's amaxes made.
    _, updates = stack.apply(variables, tokens, mutable=["fp8_meta"])
    variables = {"params": variables["params"], "fp8_meta": fp8jax.end_step(
        updates["fp8_meta"])}
    return stack.apply(variables, tokens, mutable=["fp8_meta"])

  first = run()
  # qkv, out, up and down took their copies in each trace of the block (flax traces a
  # scanned body more than once); without the cast, none did.
  assert taken.count(True) >= 4 and taken.count(True) % 4 == 0, taken
  monkeypatch.setattr(linen_stacked, "cast_scanned_weights", lambda *args: None)
  taken.clear()
  own = run()
  assert not any(taken)
  for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(own)):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
