"""Default locations outside the package: benchmark/prompt files and runs."""

import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def data_root() -> str:
  """`$FLEXDRAFT_DATA`, else `<repo>/../shared/data` (this project's checkout)."""
  return os.environ.get("FLEXDRAFT_DATA", os.path.join(REPO, "..", "shared", "data"))


def runs_root() -> str:
  """`$FLEXDRAFT_RUNS`, else `<repo>/../runs`."""
  return os.environ.get("FLEXDRAFT_RUNS", os.path.join(REPO, "..", "runs"))
