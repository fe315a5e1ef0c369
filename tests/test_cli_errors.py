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
