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
