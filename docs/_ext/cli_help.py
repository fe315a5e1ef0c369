"""`{cli-help}` directive: the `--help` text of an `fp8jax` command, from its parser.

    ```{cli-help} compare
    ```

renders what `fp8jax compare --help` prints (no argument: `fp8jax --help`), read at
build time from the parser `fp8jax.cli.main` builds, so the reference follows the code.
"""
import contextlib
import io
import os

from docutils import nodes
from docutils.parsers.rst import Directive

# argparse wraps help text to $COLUMNS: a fixed width keeps the pages identical everywhere.
HELP_WIDTH = "100"


def help_text(command: str | None) -> str:
  """What `fp8jax [command] --help` prints."""
  from fp8jax.cli import main

  argv = [command, "--help"] if command else ["--help"]
  out = io.StringIO()
  previous = os.environ.get("COLUMNS")
  os.environ["COLUMNS"] = HELP_WIDTH
  try:
    with contextlib.redirect_stdout(out):
      try:
        main(argv)
      except SystemExit as exit_:
        if exit_.code not in (0, None):
          raise RuntimeError(f"fp8jax {' '.join(argv)} exited with status {exit_.code}") from None
  finally:
    if previous is None:
      del os.environ["COLUMNS"]
    else:
      os.environ["COLUMNS"] = previous
  return out.getvalue()


class CliHelp(Directive):
  optional_arguments = 1
  has_content = False

  def run(self):
    command = self.arguments[0] if self.arguments else None
    try:
      text = help_text(command)
    except Exception as error:  # the build must fail on it, naming the command
      raise self.error(f"fp8jax {command or ''} --help failed: {error}")
    block = nodes.literal_block(text, text)
    block["language"] = "text"
    return [block]


def setup(app):
  app.add_directive("cli-help", CliHelp)
  return {"parallel_read_safe": True, "parallel_write_safe": True}
