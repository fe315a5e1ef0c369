"""The demo's training runs: learning, exact resume, calibration, comparison files, user errors.

Small settings throughout (the tiny model, a few dozen steps of 8 x 64 tokens on a
slice of the standard library's source), so each run takes seconds on a CPU.
"""
from __future__ import annotations

import contextlib
import dataclasses

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

import fp8jax
from fp8jax import runs
from fp8jax.cli import main
from fp8jax.runs import checkpoints, metrics
from fp8jax.runs.steps import build, init_state
from fast_cli import cli_command

checkpoint_dirs = checkpoints.complete

# One `steps` value for every run here: runs that agree on the model and optimizer
# share their compiled steps (fp8jax.runs.train.compiled_steps), which keeps this fast.
SMALL = dict(size="tiny", steps=24, batch=8, seq=64, lr=3e-3, warmup_steps=5, eval_every=12,
             eval_batches=2, max_data_bytes=400_000)


# For what does not depend on how well the model learns (resuming, comparing, refusing):
# a quarter of the tokens per step.
QUICK = dict(SMALL, batch=4, seq=32)


def _config(**changes):
  return runs.RunConfig(**{**SMALL, **changes})


def _quick_config(**changes):
  return runs.RunConfig(**{**QUICK, **changes})


def _metric_lines(out_dir):
  return metrics.read(pathlib.Path(out_dir) / metrics.FILE)


@pytest.mark.parametrize("recipe", ["bf16", "delayed"])
def test_loss_falls_and_every_step_is_recorded(recipe, tmp_path):
  result = runs.train(_config(recipe=recipe, checkpoint_every=12), tmp_path, progress=False)
  # Byte-level text: the loss starts near ln(256) = 5.5 and must clearly fall.
  assert result.losses[0] > 4.5
  assert np.mean(result.losses[-5:]) < np.mean(result.losses[:5]) - 1.0
  lines = _metric_lines(tmp_path)
  steps = [line["step"] for line in lines if "loss" in line]
  assert steps == list(range(1, 25))
  assert sorted(result.val_losses) == [12, 24]
  assert [p.name for p in checkpoint_dirs(tmp_path)] == ["step_0000012", "step_0000024"]
  summary = json.loads((tmp_path / "run.json").read_text())
  assert summary["attention_backend"] == result.attention_backend == "xla"
  # The logged learning rate follows the documented schedule (written out here
  # independently): linear warm-up from lr / w to lr over w updates, then a cosine to
  # lr / 10 at `steps` updates; step s is optax's update number s - 1.
  lrs = [line["lr"] for line in lines if "lr" in line]
  lr, w, n = result.config.lr, result.config.warmup_steps, result.config.steps
  want = [lr / w + (lr - lr / w) * t / w if t < w else
          lr / 10 + (lr - lr / 10) * 0.5 * (1 + np.cos(np.pi * (t - w) / (n - w)))
          for t in range(n)]
  np.testing.assert_allclose(lrs, want, rtol=1e-5)  # float32 schedule arithmetic
  if recipe == "delayed":
    record = lines[-2]["fp8"] if "fp8" not in lines[-1] else lines[-1]["fp8"]
    assert record and all(min(r["scale"]) > 0 for r in record.values())
    # Every role saw a real amax in the last step.
    assert all(min(r["amax"]) > 0 for r in record.values())


def test_killed_and_resumed_run_gives_the_losses_of_an_uninterrupted_run(tmp_path):
  config = _quick_config(recipe="delayed", checkpoint_every=8)
  whole = runs.train(config, tmp_path / "whole", progress=False)
  runs.train(config, tmp_path / "split", progress=False, stop_after=13)  # killed after 13
  assert checkpoint_dirs(tmp_path / "split")[-1].name == "step_0000008"
  with _backend_compiles() as compiled:
    resumed = runs.train(config, tmp_path / "split", resume=True, progress=False)
  # The restored state takes the steps compiled for the fresh one (no second compile).
  assert _steps(compiled) == [], compiled
  assert resumed.losses == whole.losses  # bitwise: same batches, same compiled step
  strip = lambda lines: [{k: v for k, v in line.items() if not k.startswith(("step_time",
                                                                              "tokens_per"))}
                         for line in lines]
  assert strip(_metric_lines(tmp_path / "split")) == strip(_metric_lines(tmp_path / "whole"))
  restored = [fp8jax.checkpoint.restore(
      d / "checkpoints" / "step_0000024", params=p, opt_state=o, fp8_state=s)
      for d, (p, o, s) in ((tmp_path / name, _targets(config)) for name in ("whole", "split"))]
  for a, b in zip(jax.tree.leaves(restored[0]), jax.tree.leaves(restored[1])):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@contextlib.contextmanager
def _backend_compiles():
  """The names of the programs XLA compiles within (jax.monitoring's compile events)."""
  names = []

  def record(event, duration, **kwargs):
    if event == "/jax/core/compile/backend_compile_duration":
      names.append(str(kwargs.get("fun_name")))

  jax.monitoring.register_event_duration_secs_listener(record)
  try:
    yield names
  finally:
    jax.monitoring.unregister_event_duration_listener(record)


def _steps(names):
  return [name for name in names if "train_step" in name or "eval_step" in name]


def test_the_compile_listener_sees_a_step_compile():
  """What the resume test's `_steps(compiled) == []` relies on: a compile is seen by name."""
  def train_step(x):
    return x * 3.0 + 1.0

  with _backend_compiles() as compiled:
    jax.jit(train_step)(np.arange(5, dtype=np.float32))
  assert len(_steps(compiled)) == 1, compiled


def _targets(config):
  model, tx, _ = build(config)
  return jax.eval_shape(lambda: init_state(model, tx, config))


def test_calibration_changes_no_weight_and_fills_every_history(tmp_path):
  """Calibration records amaxes only, and leaves scales that fit the tensors.

  Fresh FP8 state casts every tensor with scale 1: after a bf16 run the output
  gradients (amax around 1e-2 and below) would use a sliver of E5M2's range (max
  57344) and their small entries flush to zero in the first FP8 steps.
  Calibrated state places each role's window amax on its format's max, as
  training does once its histories fill.
  """
  bf16 = runs.train(_config(recipe="bf16", checkpoint_every=20), tmp_path / "bf16",
                    progress=False, stop_after=20)
  path = runs.calibrate(bf16.checkpoint, tmp_path / "fp8", recipe="delayed", steps=4,
                        progress=False)
  config = _config(recipe="delayed")
  params, opt_state, fp8_state = _targets(config)
  calibrated = fp8jax.checkpoint.restore(path, params=params, opt_state=opt_state,
                                         fp8_state=fp8_state)
  before = fp8jax.checkpoint.restore(bf16.checkpoint, params=params, opt_state=opt_state,
                                     fp8_state={})
  for item in ("params", "opt_state"):
    for a, b in zip(jax.tree.leaves(calibrated[item]), jax.tree.leaves(before[item])):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  metas = jax.tree.leaves(calibrated["fp8_state"],
                          is_leaf=lambda n: isinstance(n, fp8jax.Fp8Meta))
  assert metas
  for meta in metas:
    history = np.asarray(meta.amax_history)
    assert np.all(history[..., :4] > 0) and np.all(history[..., 4:] == 0)  # 4 steps recorded
    used = np.max(history, axis=-1) * np.asarray(meta.scale) / meta.fmt.max
    np.testing.assert_allclose(used, 1.0, rtol=1e-6)  # the amax lands on the format's max
  grads = [m for path_, m in jax.tree_util.tree_leaves_with_path(
      calibrated["fp8_state"], is_leaf=lambda n: isinstance(n, fp8jax.Fp8Meta))
           if jax.tree_util.keystr(path_).endswith(".grad")]
  # With scale 1 (fresh state) the gradients would use less than 2**-12 of E5M2's range.
  assert grads and all(np.max(np.asarray(m.amax_history)) / m.fmt.max < 2**-12 for m in grads)
  # The calibrated run continues in FP8 from the bf16 run's step.
  resumed = runs.train(config, tmp_path / "fp8", resume=True, progress=False)
  assert len(resumed.losses) == 4


def test_the_scale_heatmap_labels_layer_and_expert_separately():
  from fp8jax.runs import plots

  # The demo MoE GPT's state shapes: under nn.scan a layer axis, the expert weights' an
  # expert axis after it; the head is not scanned.
  dot = fp8jax.init_dot_meta(fp8jax.DelayedScaling())
  stacked = lambda shape: jax.tree.map(lambda a: jax.numpy.broadcast_to(a, shape + a.shape),
                                        dot)
  state = {"blocks": {"mlp": {"w_in_meta": stacked((2, 4))}, "attention": stacked((2,))},
           "head": dot}
  names, scales = plots.scale_rows(metrics.finite(metrics.fp8_records(state)))
  assert len(names) == len(scales) == 3 * 2 * 4 + 3 * 2 + 3
  assert names.count("blocks/mlp/w_in_meta/kernel [layer 1, expert 3]") == 1
  assert "blocks/attention/x [layer 1]" in names and "head/grad" in names
  # A record of an older run, without its shape: its entries numbered.
  old = {"blocks/mlp/w_in_meta/kernel": {"scale": [1.0] * 8}}
  assert plots.scale_rows(old)[0][-1] == "blocks/mlp/w_in_meta/kernel [entry 7]"

def test_compare_writes_the_table_json_and_non_trivial_plots(tmp_path):
  report = runs.compare(_quick_config(checkpoint_every=24), tmp_path,
                        recipes=("bf16", "delayed", "current"), progress=False)
  saved = json.loads((tmp_path / "compare.json").read_text())
  assert saved == json.loads(json.dumps(report))
  assert [run["recipe"] for run in saved["runs"]] == ["bf16", "delayed", "current"]
  by_recipe = {run["recipe"]: run for run in saved["runs"]}
  assert by_recipe["bf16"]["rel_gap_vs_bf16"] == 0.0
  for run in saved["runs"]:
    assert set(run) == {"recipe", "final_loss", "rel_gap_vs_bf16", "val_loss", "tokens_per_s",
                        "step_time_s", "attention_backend"}
    losses = [line["loss"] for line in _metric_lines(tmp_path / run["recipe"]) if "loss" in line]
    assert len(losses) == 24 and run["tokens_per_s"] > 0
    # final_loss is the mean training loss over the last 10% of the steps (2 of 24).
    assert run["final_loss"] == pytest.approx(np.mean(losses[-2:]), rel=1e-12)
    assert run["rel_gap_vs_bf16"] == pytest.approx(
        np.mean(losses[-2:]) / by_recipe["bf16"]["final_loss"] - 1, rel=1e-12)
  import matplotlib.image
  for name in ("compare.png", "fp8_scales.png"):
    image = matplotlib.image.imread(tmp_path / name)
    # A drawn figure: many distinct colours, not a blank canvas.
    assert image.shape[0] > 200 and len(np.unique(image.reshape(-1, image.shape[-1]), axis=0)) > 20
  assert "delayed" in runs.table(report) and "%" in runs.table(report)

  # Resuming the finished comparison reloads it: with its own settings (as the CLI takes
  # them from the checkpoints) it reports the same; with other settings it refuses.
  saved_settings = runs.checkpoints.saved_config(
      runs.checkpoints.complete(tmp_path / "bf16")[-1])[0]
  again = runs.compare(saved_settings, tmp_path, recipes=("bf16", "delayed", "current"),
                       progress=False, resume=True)
  assert again["runs"] == report["runs"] and again["config"] == report["config"]
  assert again["config"]["schedule_steps"] is None  # as the uninterrupted run wrote it
  for changed, message in (({"batch": QUICK["batch"] * 2}, "batch="),
                           ({"steps": 12}, "finished at step 24")):
    with pytest.raises(runs.RunError, match=message):
      runs.compare(dataclasses.replace(saved_settings, **changed), tmp_path,
                   recipes=("bf16", "delayed", "current"), progress=False, resume=True)


def test_compare_json_records_the_versions_machine_and_corpus_it_ran_on(tmp_path):
  import flax
  import jaxlib
  import optax
  # The bf16 run alone: its compiled step is the one the comparison above used.
  runs.compare(_quick_config(checkpoint_every=24), tmp_path, recipes=("bf16",), progress=False)
  saved = json.loads((tmp_path / "compare.json").read_text())
  # Compared with what each imported module says of itself (compare.py asks the
  # installed distributions), so a name or a version read from the wrong place fails.
  assert saved["versions"] == {
      "python": "{}.{}.{}".format(*sys.version_info[:3]), "jax": jax.__version__,
      "jaxlib": jaxlib.__version__, "flax": flax.__version__, "optax": optax.__version__,
      "numpy": np.__version__}
  # The machine: XLA compiles a CPU's programs for its instruction set (fp8jax.runs.machine).
  machine = saved["machine"]
  assert machine["device"] == jax.devices()[0].device_kind
  assert machine["cores"] == os.cpu_count()
  assert machine["xla_flags"] == os.environ.get("XLA_FLAGS", "")
  cpuinfo = pathlib.Path("/proc/cpuinfo")
  first = cpuinfo.read_text().split("\n\n")[0] if cpuinfo.exists() else ""
  fields = dict(line.split(":", 1) for line in first.splitlines() if ":" in line)
  fields = {key.strip(): value.strip() for key, value in fields.items()}
  if "model name" in fields and "flags" in fields:  # x86 Linux: what the kernel says
    assert machine["cpu"] == fields["model name"]
    assert set(machine["isa"]) <= set(fields["flags"].split()) and machine["isa"]
  assert runs.machine.summary(machine).startswith(f"{os.cpu_count()}-core ")
  # The corpus: what the run trained on (its run.json), without the machine's paths.
  trained_on = json.loads((tmp_path / "bf16" / "run.json").read_text())["corpus"]
  assert saved["corpus"] == {key: trained_on[key]
                             for key in ("source", "python_version", "sha256")}


@pytest.mark.parametrize("argv,message", [
    (["--data", "does/not/exist.txt"], "does/not/exist.txt"),
    (["--steps", "0"], "--steps 0 must be a positive integer"),
    (["--recipe", "fp4"], "--recipe 'fp4' is not one of"),
    (["--size", "huge"], "--size 'huge' is not one of"),
    (["--fp8-layers", "some"], "--fp8-layers 'some' is not one of"),
])
def test_bad_input_is_one_line_never_a_traceback(argv, message, tmp_path, capsys):
  status = main(["train", "--out", str(tmp_path / "run"), *argv])
  err = capsys.readouterr().err.strip()
  assert status == 2
  assert message in err and len(err.splitlines()) == 1 and "Traceback" not in err


@pytest.mark.parametrize("content,message", [(b"", "empty"), (b"\x00\x01\x02" * 3000, "text")])
def test_data_that_is_empty_or_not_text_is_refused_in_one_line(content, message, tmp_path,
                                                                 capsys):
  path = tmp_path / "data.txt"
  path.write_bytes(content)
  status = main(["train", "--out", str(tmp_path / "run"), "--data", str(path)])
  err = capsys.readouterr().err.strip()
  assert status == 2 and message in err and len(err.splitlines()) == 1


def test_a_checkpoint_of_another_size_is_refused_in_one_line(tmp_path, capsys):
  runs.train(_quick_config(recipe="bf16", checkpoint_every=2), tmp_path / "tiny", progress=False,
             stop_after=2)
  status = main(["train", "--out", str(tmp_path / "tiny"), "--resume", "--size", "small",
                 "--steps", "4"])
  err = capsys.readouterr().err.strip()
  assert status == 2 and "size='tiny'" in err and len(err.splitlines()) == 1
  # Starting another run into a directory that holds one is refused too.
  newest = str(checkpoint_dirs(tmp_path / "tiny")[-1])
  status = main(["train", "--out", str(tmp_path / "tiny"), "--init-from", newest])
  err = capsys.readouterr().err.strip()
  assert status == 2 and "already holds a run's checkpoints" in err


def test_fp8_state_of_other_fp8_layers_is_refused(monkeypatch):
  # --fp8-layers auto keeps the tiny model's projections in bf16, without their FP8 state:
  # the FP8 state of an "all" run does not fit it, resumed or as a new run's start.
  saved = _quick_config(recipe="delayed")
  monkeypatch.setattr(checkpoints, "saved_config", lambda path: (saved, 2))
  auto = saved.replace(fp8_layers="auto")
  with pytest.raises(runs.RunError, match="fp8_layers='all', this run has fp8_layers='auto'"):
    checkpoints.restore("ckpt", auto, corpus=None, continuing=True)
  with pytest.raises(runs.RunError, match="FP8 state of --fp8-layers all and this run is "
                                          "--fp8-layers auto; pass --fp8-layers all"):
    checkpoints.restore("ckpt", auto, corpus=None, continuing=False)


def test_compare_refuses_a_recipe_named_twice_before_training(tmp_path, capsys):
  status = main(["compare", "--out", str(tmp_path), "--recipes", "bf16,delayed,bf16"])
  err = capsys.readouterr().err.strip()
  assert status == 2 and "names a recipe twice" in err and not any(tmp_path.iterdir())


def test_ctrl_c_leaves_the_last_complete_checkpoint_loadable(tmp_path):
  out = tmp_path / "run"
  command = cli_command("train", "--out", str(out), "--recipe", "delayed", "--steps", "100000",
                        "--batch", "4", "--seq", "32", "--checkpoint-every", "3",
                        "--eval-every", "1000")
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
  deadline = time.monotonic() + 240
  while time.monotonic() < deadline and len(checkpoint_dirs(out)) < 2:
    time.sleep(0.2)
  assert checkpoint_dirs(out), "no checkpoint was written in time"
  process.send_signal(signal.SIGINT)
  _, err = process.communicate(timeout=120)
  assert process.returncode == 130, err.decode()[-2000:]
  message = err.decode().strip().splitlines()[-1]
  reported = int(message.split("interrupted after step ")[1].split(";")[0])
  newest = checkpoint_dirs(out)[-1]
  assert newest.name in message and "fp8jax train --resume --out" in message
  # The step in progress finished: its metrics line is the last one, and complete.
  assert _metric_lines(out)[-1]["step"] == reported
  config = runs.RunConfig(recipe="delayed", steps=100000, batch=4, seq=32,
                          schedule_steps=100000)
  params, opt_state, fp8_state = _targets(config)
  restored = fp8jax.checkpoint.restore(newest, params=params, opt_state=opt_state,
                                       fp8_state=fp8_state)
  assert all(np.all(np.isfinite(np.asarray(leaf))) for leaf in jax.tree.leaves(restored))
  # `--resume` with nothing but --out continues it with the run's own settings.
  status = main(["train", "--resume", "--out", str(out), "--steps",
                 str(int(newest.name.split("_")[1]) + 2)])
  assert status == 0
  assert [line["step"] for line in _metric_lines(out) if "loss" in line][-2:] == [
      int(newest.name.split("_")[1]) + 1, int(newest.name.split("_")[1]) + 2]
