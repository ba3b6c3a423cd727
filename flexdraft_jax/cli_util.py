"""Shared CLI plumbing: absl entry with one-line errors instead of tracebacks."""

import sys

from absl import app

from flexdraft_jax.model.config import FlexDraftError


def run_main(main, argv):
  """Runs `main` under absl; user errors print one line and exit 1."""

  def wrapped(args):
    try:
      return main(args)
    except (FlexDraftError, FileNotFoundError) as e:
      print(f"error: {e}", file=sys.stderr)
      sys.exit(1)

  app.run(wrapped, argv=argv)
