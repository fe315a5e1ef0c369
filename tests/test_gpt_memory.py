"""Memory like time: donated steps, the compile target's attention, the memory report.

* The demo's train step donates params, optimizer state and FP8 state: the compiled
  step aliases their bytes (XLA's memory analysis of a CPU compile, deterministic).
* Under a deviceless H100 compile attention is chosen for the H100 (sm_90): the Hopper
  flash kernel where an H100 would run cuDNN, which a compile without a GPU cannot
  build, and the choice says so.
* `fp8jax.lowering.memory`: the report's arithmetic and the largest-batch search.
* The GPT step at the `small` size, deviceless: FP8 moments and FP8 saved activations
  shrink arguments and total as at `1b`, whose figures are recorded in
  `examples/results/gpt_1b_memory_deviceless*.json` (arguments <= 0.55x bf16's at batch
  8, every FP8 step's total below bf16's, FP8's largest batch no smaller).
* The README's and the memory guide's 1b tables, largest batches and the figures the guide
  derives from them are the records'.
"""
from __future__ import annotations

import inspect
import json
import pathlib
import warnings

import jax
import jax.numpy as jnp
import pytest

import run_once

import fp8jax
from fp8jax import deviceless
from fp8jax.cli import main
from fp8jax.lowering.cost import CostConstants
from fp8jax.lowering import memory as memory_lib
from fp8jax.lowering.memory import GIB, MemoryReport
from fp8jax.runs import RunConfig
from fp8jax.runs.steps import build, compiled_steps, init_state

_MISSING = deviceless.deviceless_toolchain_missing()
needs_toolchain = [pytest.mark.hopper,
                   pytest.mark.skipif(_MISSING is not None, reason=str(_MISSING))]
ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "examples" / "results"


def _bytes(tree) -> int:
  return sum(leaf.nbytes for leaf in jax.tree.leaves(tree))


@pytest.mark.parametrize("recipe,optimizer", [("delayed", "adamw"), ("bf16", "adamw_fp8")])
def test_the_demo_train_step_aliases_params_optimizer_and_fp8_state(recipe, optimizer):
  config = RunConfig(recipe=recipe, optimizer=optimizer, batch=2, seq=32)
  model, tx, _ = build(config)
  train_step, _ = compiled_steps(config)
  params, opt_state, fp8_state = init_state(model, tx, config)
  tokens = jnp.zeros((2, 33), jnp.int32)
  stats = train_step.lower(params, opt_state, fp8_state, tokens).compile().memory_analysis()
  state = _bytes((params, opt_state, fp8_state))
  # Every state buffer is written in place but a few scalars XLA keeps apart (under
  # 0.1%); without donation the step aliases 0 bytes.
  assert 0.999 * state <= stats.alias_size_in_bytes <= state
  new_params, *_ = train_step(params, opt_state, fp8_state, tokens)
  assert all(leaf.is_deleted() for leaf in jax.tree.leaves(params))
  assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(new_params))


def test_memory_report_total_counts_outputs_not_written_into_donated_arguments():
  report = MemoryReport("step", "H100", arguments=10 * GIB, outputs=10 * GIB + 4,
                        aliased=10 * GIB, temp=30 * GIB)
  assert report.total == 40 * GIB + 4
  assert report.fits(41 * GIB) and not report.fits(40 * GIB)
  assert report.to_dict()["total"] == report.total
  assert "total 40.00 GiB" in str(report)


@pytest.mark.parametrize("text,value", [("80GiB", 80 * GIB), ("79.5 GB", int(79.5e9)),
                                        ("1024", 1024), ("2 mib", 2 * 2**20)])
def test_parse_bytes(text, value):
  assert memory_lib.parse_bytes(text) == value


@pytest.mark.parametrize("text", ["80 GiBs", "lots", "-3GiB", ""])
def test_parse_bytes_refuses_what_is_not_an_amount(text):
  with pytest.raises(ValueError, match="not an amount of memory"):
    memory_lib.parse_bytes(text)


def _bent_line(batch: int) -> int:
  """Bytes of a synthetic program: linear in the batch, bending up past batch 170 (as
  XLA's rematerialization near a device's capacity bends the real one)."""
  return 2 * GIB + batch * GIB // 3 + max(0, batch - 170) ** 2 * GIB // 50


@pytest.mark.parametrize("capacity", [50 * GIB, 80 * GIB, 3 * GIB, GIB // 2])
def test_largest_batch_is_the_boundary_of_what_fits(capacity):
  compiled = []

  def program(batch):
    compiled.append(batch)
    return MemoryReport("p", "t", arguments=2 * GIB, outputs=0, aliased=0,
                        temp=_bent_line(batch) - 2 * GIB)

  batch, report = memory_lib.largest_batch(program, capacity)
  want = max([b for b in range(1, 4097) if _bent_line(b) <= capacity], default=0)
  assert batch == want
  assert report is None if want == 0 else report.total == _bent_line(want)
  assert len(set(compiled)) == len(compiled) <= 14  # two probes, doubling, bisection


@pytest.mark.parametrize("fp8", [False, True])
def test_a_deviceless_h100_compile_selects_the_hopper_kernel_and_says_why(fp8):
  if _MISSING is not None:
    pytest.skip(str(_MISSING))
  from fp8jax.ops.attention import choose_backend

  q = jax.ShapeDtypeStruct((2, 256, 4, 128), jnp.bfloat16)
  recipe = fp8jax.DelayedScaling() if fp8 else None
  choose = lambda: choose_backend(q, q, fp8=fp8, causal=True, has_segments=False, recipe=recipe)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    assert choose().name == "xla"  # this process's CPU
    with jax.set_mesh(deviceless.h100_mesh(x=1)):
      choice = choose()
  # The measured table has cuDNN fastest for H100 bf16 attention (and FP8 attention
  # dequantized into it); it cannot be compiled here, so the Hopper kernel stands in.
  assert choice.name == "pallas_hopper"
  assert "would run 'cudnn'" in choice.reason and "cannot be compiled without a GPU" in (
      choice.reason)


def test_a_stand_in_is_chosen_only_where_the_gpu_would_run_cudnn():
  from fp8jax.ops import attention_backend as backends

  key = backends.make_key((2, 256, 4, 64), (2, 256, 4, 64), "bfloat16", fp8=False, causal=True,
                          has_segments=False, recipe_type=None, platform="gpu",
                          gpu_arch="sm_90", compile_only=True)
  assert backends.select_backend(key).name == "pallas_hopper"
  # cuDNN is refused by name there, with the reason.
  with pytest.raises(ValueError, match="cannot be compiled without a GPU"):
    backends.select_backend(key, "cudnn")
  # Off Hopper the Pallas kernel stands in; with the device present nothing changes.
  import dataclasses
  assert backends.select_backend(dataclasses.replace(key, gpu_arch="sm_80")).name == "pallas"
  assert backends.select_backend(dataclasses.replace(key, compile_only=False)).name == "cudnn"


@pytest.fixture(scope="module")
def small_gpt():
  """{name: (program, measure(program))}: the small GPT's FP8 steps and bf16 twin, compiled
  for an H100 once per test run (three deviceless compiles, about 20 s each)."""
  if _MISSING is not None:
    pytest.skip(str(_MISSING))
  from fp8jax.runs.gpt_program import GptProgram, measure

  programs = {
      "fp8": GptProgram(size="small", batch=8, seq=256, recipe="delayed",
                        optimizer="adamw_fp8", saved_activations="fp8"),
      "plain_fp8": GptProgram(size="small", batch=8, seq=256, recipe="delayed"),
      "bf16": GptProgram(size="small", batch=8, seq=256, recipe="bf16")}
  return run_once.shared("small_gpt_memory", lambda _: {
      name: (program, measure(program)) for name, program in programs.items()})[1]


@pytest.mark.hopper
def test_small_gpt_fp8_memory_features_shrink_arguments_and_total_as_at_1b(small_gpt):
  memory = {name: result[1] for name, (_, result) in small_gpt.items()}
  # Arguments: fp32 params (4 B) + Adam moments (8 B in float32, ~2.1 B in FP8).
  assert memory["fp8"].arguments <= 0.55 * memory["bf16"].arguments
  assert memory["plain_fp8"].arguments >= 0.99 * memory["bf16"].arguments
  # Total: the saved activations are most of it at batch 8. The bf16 step's norms and GELU
  # keep their bf16 input alone (fp8jax.ops.rms_norm / gelu, no float32 intermediates), so
  # FP8's half-size copies save less of a smaller total than against autodiff's (0.43x
  # then; 0.67x now).
  assert memory["fp8"].total <= 0.7 * memory["bf16"].total
  assert memory["fp8"].temp < memory["plain_fp8"].temp < memory["bf16"].temp
  # Every step donates its state: the outputs are written into the arguments (but for
  # the loss and a few KB of scalars and small FP8 state; without donation, all 66 MB).
  for report in memory.values():
    assert report.outputs - report.aliased <= 1e-3 * report.outputs
  # Same attention kernel in both (the stand-in for cuDNN).
  assert {result[2].name for _, result in small_gpt.values()} == {"pallas_hopper"}


def _recorded_1b_rows():
  """The 1b memory table's rows, (label, memory report), from the three records."""
  full, plain, moments = (
      json.loads((RESULTS / f"gpt_1b_memory_deviceless{suffix}.json").read_text())
      for suffix in ("", "_fp8_plain", "_fp8_moments"))
  for record in (full, plain, moments):
    assert record["program"] | {"gpt": "1b", "batch": 8, "seq": 2048, "experts": 0,
                                  "fp8_layers": "all"} == record["program"]
    assert record["memory"]["bf16"] == full["memory"]["bf16"]  # one bf16 step for all
  assert plain["memory"]["fp8"]["label"] == "delayed, adamw"
  assert moments["memory"]["fp8"]["label"] == "delayed, adamw_fp8"
  assert full["memory"]["fp8"]["label"] == "delayed, adamw_fp8, fp8 saved"
  return full, [("bf16", full["memory"]["bf16"]), ("FP8 delayed", plain["memory"]["fp8"]),
                ("+ FP8 Adam moments", moments["memory"]["fp8"]),
                ("+ FP8 saved activations", full["memory"]["fp8"])]


def _table_rows(text: str) -> list:
  """The lines of the first markdown table in `text` headed `| step |`."""
  lines = text.splitlines()
  start = next(i for i, line in enumerate(lines) if line.startswith("| step |"))
  rows = []
  for line in lines[start + 2:]:
    if not line.startswith("|"):
      return rows
    rows.append(line)
  return rows


def test_recorded_1b_figures_are_the_readme_and_guide_tables_and_fp8_takes_less():
  full, rows = _recorded_1b_rows()
  bf16 = rows[0][1]
  gib = lambda n: f"{n / GIB:.2f} GiB"
  readme = (ROOT / "README.md").read_text()
  guide = (ROOT / "docs" / "guides" / "memory.md").read_text()
  fit = full["fit"]
  assert fit["capacity"] == 80 * GIB
  for text in (readme, guide):
    table = _table_rows(text)
    assert len(table) == len(rows), table
    for (label, report), line in zip(rows, table):
      assert line.startswith(f"| {label}"), (label, line)
      assert f"| {gib(report['arguments'])} | {gib(report['temp'])} | " in line, line
      assert gib(report["total"]) in line, line
      if text is guide:  # its share of the 80 GiB
        assert f"| {round(100 * report['total'] / fit['capacity'])}% " in line, line
    ratio = f"{rows[3][1]['total'] / bf16['total']:.2f}x bf16"
    assert ratio in table[3], (ratio, table[3])
  for label, report in rows[1:]:
    assert report["total"] < bf16["total"], label
  # The FP8 moments: 2.1 bytes per parameter for Adam's two moments instead of 8.
  assert rows[2][1]["arguments"] <= 0.55 * bf16["arguments"]
  fp8_fit, bf16_fit = (fit[label] for label in ("delayed, adamw_fp8, fp8 saved",
                                                "bf16, adamw"))
  assert fp8_fit["batch"] >= bf16_fit["batch"]
  said = (f"{bf16_fit['batch']} sequences in bf16, {fp8_fit['batch']} with all three "
          f"({fp8_fit['batch'] / bf16_fit['batch']:.2f}x")
  assert said in " ".join(readme.split()) and said in " ".join(guide.split()), said
  # The guide's reading of the rows and of the batches that fit.
  plain, with_all = rows[1][1], rows[3][1]
  per_sequence = lambda fitted, at_8: (
      (fitted["memory"]["temp"] - at_8["temp"]) / GIB / (fitted["batch"] - 8))
  for figure in (f"{100 * (1 - plain['temp'] / bf16['temp']):.0f}% off bf16's temp "
                 f"({(bf16['temp'] - plain['temp']) / GIB:.2f} GiB)",
                 f"{(plain['temp'] - with_all['temp']) / GIB:.2f} GiB more off the temp",
                 f"adds {per_sequence(fp8_fit, with_all):.2f} GiB of temp to the FP8 step and "
                 f"{per_sequence(bf16_fit, bf16):.2f} GiB to bf16's",
                 f"the {(bf16['arguments'] - with_all['arguments']) / GIB:.1f} GiB freed in "
                 f"arguments with the {(bf16['temp'] - with_all['temp']) / GIB:.2f} GiB less temp",
                 f"keeps {(plain['temp'] - with_all['temp']) / GIB:.2f} GiB less temp"):
    assert figure in " ".join(guide.split()), figure
  assert {choice["backend"] for choice in full["attention"].values()} == {"pallas_hopper"}
  # The middle rows' largest batches (their records' --fit) as the guide gives them, and
  # each feature fitting at least as many sequences as the row before it.
  fitted = {label: json.loads((RESULTS / f"gpt_1b_memory_deviceless{suffix}.json").read_text())
            ["fit"][label] for suffix, label in (("_fp8_plain", "delayed, adamw"),
                                                 ("_fp8_moments", "delayed, adamw_fp8"))}
  plain_fit, moments_fit = fitted["delayed, adamw"], fitted["delayed, adamw_fp8"]
  said = (f"FP8 delayed alone fits {plain_fit['batch']} (its temp grows "
          f"{per_sequence(plain_fit, plain):.2f} GiB a sequence), with the FP8 moments "
          f"{moments_fit['batch']}")
  assert said in " ".join(guide.split()), said
  assert plain_fit["batch"] <= moments_fit["batch"] <= fp8_fit["batch"]


@pytest.mark.hopper
def test_cost_gpt_prints_memory_beside_time_and_the_hopper_attention(small_gpt, capsys,
                                                                      monkeypatch):
  from fp8jax.runs import gpt_program

  # The command's two steps are the fixture's FP8 step (its defaults: FP8 moments, FP8
  # saved activations) and bf16 twin: it is handed their compiled reports, and any other
  # program it asked for would be a wrong default.
  compiled = {program: result for program, result in small_gpt.values()}
  asked = []
  signature = inspect.signature(gpt_program.measure)

  def measure(*args, **kwargs):
    bound = signature.bind(*args, **kwargs)   # a call the real one would take
    bound.apply_defaults()
    asked.append(dict(bound.arguments))
    return compiled[bound.arguments["program"]]

  monkeypatch.setattr(gpt_program, "measure", measure)
  assert main(["cost", "--gpt", "small", "--summary"]) == 0
  # The fixture's programs were compiled deviceless with the default constants.
  assert asked == [{"program": small_gpt[name][0], "target": "auto",
                    "constants": CostConstants()} for name in ("fp8", "bf16")]
  out = capsys.readouterr().out
  assert "predicted speedup of delayed, adamw_fp8, fp8 saved over bf16, adamw" in out
  assert "FP8 / bf16" in out and "arguments" in out and "of 80 GiB" in out
  assert out.count("attention (") == 2 and "pallas_hopper" in out and "xla" not in out


@pytest.mark.parametrize("argv,message", [
    (["cost", "--fit", "80GiB"], "--fit applies to the demo GPT: add --gpt SIZE"),
    (["cost", "--fp8-layers", "auto"], "--fp8-layers applies to the demo GPT: add --gpt SIZE"),
    (["cost", "--gpt", "tiny", "--fit", "lots"], "--fit: 'lots' is not an amount of memory"),
    (["cost", "--gpt", "huge"], "--gpt 'huge' is not one of"),
    (["cost", "--gpt", "tiny", "--widths", "8,8"], "--gpt compiles the demo GPT's step"),
])
def test_cost_gpt_errors_are_one_line(argv, message, capsys):
  assert main(argv) != 0
  err = capsys.readouterr().err
  assert err.startswith("fp8jax: ") and message in err and len(err.splitlines()) == 1, err
