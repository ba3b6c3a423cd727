"""Default locations outside the package: benchmark/prompt files, runs and caches."""

import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def data_root() -> str:
  """`$FLEXDRAFT_DATA`, else `<repo>/../shared/data` (this project's checkout)."""
  return os.environ.get("FLEXDRAFT_DATA", os.path.join(REPO, "..", "shared", "data"))


def runs_root() -> str:
  """`$FLEXDRAFT_RUNS`, else `<repo>/../runs`."""
  return os.environ.get("FLEXDRAFT_RUNS", os.path.join(REPO, "..", "runs"))


_RELATIVE_WARNED = set()


def cache_root() -> str:
  """`$XDG_CACHE_HOME`, else `~/.cache`: the folder the caches are kept under
  (compiled programs, the CPU kernel, GGUF indexes, flex's step costs). The XDG
  base directory spec makes a relative path there invalid, to be ignored: a
  tilde the shell did not expand (`XDG_CACHE_HOME='~/.cache'`) would otherwise
  make `./~/.cache` in whatever folder a command runs from. One warning says so."""
  default = os.path.join(os.path.expanduser("~"), ".cache")
  setting = os.environ.get("XDG_CACHE_HOME")
  if not setting:
    return default
  if not os.path.isabs(setting):
    if setting not in _RELATIVE_WARNED:
      _RELATIVE_WARNED.add(setting)
      print(f"warning: $XDG_CACHE_HOME={setting!r} is not an absolute path, which the XDG "
            "base directory spec says to ignore: caches go to ~/.cache instead",
            file=sys.stderr)
    return default
  return setting
