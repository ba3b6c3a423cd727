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


def config_and_workdir(args, example: str):
  """The --config and --workdir flags of a config-driven command, checked."""
  from absl import flags
  if len(args) > 1:
    raise FlexDraftError(f"unexpected arguments: {' '.join(args[1:])}")
  if flags.FLAGS.config is None:
    raise FlexDraftError(f"--config is required (e.g. {example})")
  if not flags.FLAGS.workdir:
    raise FlexDraftError("--workdir is required")
  return flags.FLAGS.config, flags.FLAGS.workdir
