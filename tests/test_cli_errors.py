"""Every subcommand fails the same way on bad input: one `fp8jax: ...` line, train's status.

The bad inputs are refused while the arguments are checked, before anything compiles
or trains, so these tests take seconds.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from fp8jax.cli import main

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _train_error_status(tmp_path, capsys) -> int:
  """The status `fp8jax train` exits with on a user error (checked to be one too)."""
  status = main(["train", "--out", str(tmp_path / "run"), "--steps", "0"])
  err = capsys.readouterr().err
  assert err.startswith("fp8jax: ") and "--steps 0" in err, err
  return status


@pytest.mark.parametrize("argv, message", [
    (["cost", "--mesh", "data8"], "--mesh 'data8': expected AXIS=N pairs"),
    (["cost", "--factory", "no_colon"], "--factory 'no_colon': expected MODULE:FUNCTION"),
    (["cost", "--factory", "fp8jax_no_such_module:make"],
     "cannot import 'fp8jax_no_such_module'"),
    (["cost", "--factory", "fp8jax.core.formats:no_such_function"],
     "has no function 'no_such_function'"),
    (["inspect", "--factory", "fp8jax_no_such_module:make"],
     "cannot import 'fp8jax_no_such_module'"),
    (["inspect", "--factory", "no_colon"], "--factory 'no_colon': expected MODULE:FUNCTION"),
    (["inspect", "--hlo", "/no/such/module.txt"], "--hlo '/no/such/module.txt': no such file"),
])
def test_cost_and_inspect_errors_are_one_fp8jax_line_with_trains_exit_status(
    argv, message, tmp_path, capsys):
  train_status = _train_error_status(tmp_path, capsys)
  status = main(argv)
  err = capsys.readouterr().err
  assert status == train_status, err
  assert err.startswith("fp8jax: ") and len(err.splitlines()) == 1 and message in err, err
  assert "Traceback" not in err



@pytest.fixture
def nothing_compiles(monkeypatch):
  """`cost --gpt` with every compile of the demo GPT's step failing the test."""
  from fp8jax.runs import gpt_program

  def compiled(*args, **kwargs):
    raise AssertionError("the bad option was refused only after a compile")

  monkeypatch.setattr(gpt_program, "measure", compiled)


@pytest.mark.parametrize("argv, message", [
    (["--batch", "0"], "--batch 0 must be a positive integer"),
    (["--seq", "0"], "--seq 0 must be a positive integer"),
    (["--top-k", "3"], "--top-k 3 routes tokens among experts, and this GPT's MLP is dense; "
                       "add --experts N"),
    (["--fit", "0GiB"], "--fit 0GiB: the tiny GPT's parameters, optimizer state and FP8 "
                        "state alone take 4.8 MiB (delayed, adamw_fp8, fp8 saved) and 9.4 MiB "
                        "(bf16, adamw); give more than 4.8 MiB"),
    (["--fit", "4MiB"], "--fit 4MiB: the tiny GPT's parameters"),
], ids=["batch 0", "seq 0", "top-k without experts", "fit 0GiB", "fit under the state"])
def test_cost_gpt_refuses_what_train_refuses_in_one_line_before_compiling(
    argv, message, nothing_compiles, tmp_path, capsys):
  train_status = _train_error_status(tmp_path, capsys)
  status = main(["cost", "--gpt", "tiny", *argv])
  err = capsys.readouterr().err
  assert status == train_status, err
  assert err.startswith("fp8jax: ") and len(err.splitlines()) == 1 and message in err, err


def test_cost_gpt_fit_shows_each_compile_and_skips_a_step_whose_state_cannot_fit(
    monkeypatch, capsys):
  from fp8jax.cli import cost_gpt
  from fp8jax.lowering.memory import MemoryReport
  from fp8jax.runs import gpt_program

  mib = 2**20
  fp8 = gpt_program.GptProgram(size="tiny", batch=8, seq=64, optimizer="adamw_fp8")
  bf16 = gpt_program.GptProgram(size="tiny", batch=8, seq=64, recipe="bf16")
  capacity = 8 * mib  # the FP8 step's state (4.8 MiB) fits, the bf16 step's (9.4 MiB) not
  compiles = []

  def measure(program, target):  # a line of 4.8 MiB + 0.1 MiB per sequence, not a compile
    compiles.append((program.label, program.batch))
    total = int(4.8 * mib + 0.1 * mib * program.batch)
    return None, MemoryReport(program.label, "H100", arguments=total, outputs=0, aliased=0,
                              temp=0), None

  monkeypatch.setattr(gpt_program, "measure", measure)
  fits = cost_gpt.largest_batches((fp8, bf16), capacity, "deviceless")
  assert fits[bf16.label] == (0, None) and fits[fp8.label][0] == 32  # (8 - 4.8) / 0.1
  assert compiles and {label for label, _ in compiles} == {fp8.label}
  err = capsys.readouterr().err
  # tqdm's bar (on stderr): the count of compiles and the last one's verdict.
  assert f"{len(compiles)}compile" in err.replace(" ", ""), err
  assert f"{fp8.label}: batch {compiles[-1][1]}" in err, err

def test_the_installed_command_exits_with_the_error_status_not_an_exception(tmp_path, capsys):
  # Through the process boundary: `sys.exit(main())` must turn the error into the status.
  train_status = _train_error_status(tmp_path, capsys)
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env["PYTHONPATH"] = os.pathsep.join(filter(None, [_REPO, env.get("PYTHONPATH")]))
  result = subprocess.run([sys.executable, "-m", "fp8jax.cli", "inspect", "--hlo",
                           "/no/such/module.txt"], env=env, capture_output=True, text=True,
                          timeout=120)
  assert result.returncode == train_status, result.stderr
  assert result.stderr.startswith("fp8jax: --hlo '/no/such/module.txt'"), result.stderr


def test_inspect_strict_on_a_program_without_gemms_says_so(tmp_path, capsys):
  hlo = tmp_path / "no_gemm.txt"
  hlo.write_text("HloModule m\n\nENTRY main {\n  p = f32[4]{0} parameter(0)\n"
                 "  ROOT a = f32[4]{0} add(p, p)\n}\n")
  status = main(["inspect", "--hlo", str(hlo), "--strict"])
  assert status == 1
  assert "the program has no GEMMs" in capsys.readouterr().err


# ----- --factory code of the user's own that raises ----------------------------------------

_FAILING_FACTORIES = '''
import jax
import jax.numpy as jnp

SPEC = jax.ShapeDtypeStruct((16, 16), jnp.float32)


def raises():
  raise FileNotFoundError("no checkpoint at /data/step_100\\nsearched: /data")


def fails_to_trace():
  def step(x, w):
    return x @ w[:3]  # contracting 16 with 3
  return step, (SPEC, SPEC)
'''
_RAISES_AT_IMPORT = "import jax\nundefined_name + 1\n"
_TOOLCHAIN_MISSING = None
try:
  from fp8jax.deviceless import deviceless_toolchain_missing
  _TOOLCHAIN_MISSING = deviceless_toolchain_missing()
except Exception as error:  # noqa: BLE001  (no 'hopper' extra: the compile tests skip)
  _TOOLCHAIN_MISSING = str(error)
# Tracing happens inside the compile for an H100, which needs the 'hopper' extra.
needs_toolchain = pytest.mark.skipif(_TOOLCHAIN_MISSING is not None,
                                     reason=_TOOLCHAIN_MISSING or "")


@pytest.fixture
def factories(tmp_path, monkeypatch):
  (tmp_path / "failing_factories.py").write_text(_FAILING_FACTORIES)
  (tmp_path / "raises_at_import.py").write_text(_RAISES_AT_IMPORT)
  monkeypatch.syspath_prepend(str(tmp_path))


@pytest.mark.parametrize("command", ["inspect", "cost"])
@pytest.mark.parametrize("spec, message", [
    ("failing_factories:raises",
     "--factory 'failing_factories:raises' raised FileNotFoundError: no checkpoint at "
     "/data/step_100 ... (--traceback prints the traceback)"),
    ("raises_at_import:make",
     "--factory 'raises_at_import:make': importing 'raises_at_import' raised NameError: "
     "name 'undefined_name' is not defined (--traceback prints the traceback)"),
    pytest.param(
        "failing_factories:fails_to_trace",
        "--factory 'failing_factories:fails_to_trace': the function it returned failed to "
        "trace: TypeError: dot_general requires contracting dimensions to have the same shape",
        marks=needs_toolchain),
], ids=["factory raises", "module raises on import", "fn fails to trace"])
def test_a_factory_that_raises_is_one_fp8jax_line_naming_it_and_the_exception(
    command, spec, message, factories, tmp_path, capsys):
  train_status = _train_error_status(tmp_path, capsys)
  status = main([command, "--factory", spec])
  err = capsys.readouterr().err
  assert status == train_status, err
  assert err.startswith("fp8jax: ") and len(err.splitlines()) == 1, err
  assert message in err, err


@pytest.mark.parametrize("spec, frame", [
    ("failing_factories:raises", 'in raises\n    raise FileNotFoundError('),
    pytest.param("failing_factories:fails_to_trace", "in step\n    return x @ w[:3]",
                 marks=needs_toolchain),
], ids=["factory raises", "fn fails to trace"])
def test_traceback_flag_prints_the_user_codes_traceback_instead_of_one_line(
    spec, frame, factories, tmp_path, capsys):
  train_status = _train_error_status(tmp_path, capsys)
  status = main(["inspect", "--factory", spec, "--traceback"])
  err = capsys.readouterr().err
  assert status == train_status, err
  assert err.startswith("Traceback (most recent call last):"), err
  assert "failing_factories.py" in err and frame in err, err  # the line that raised
  assert not err.startswith("fp8jax: ")
