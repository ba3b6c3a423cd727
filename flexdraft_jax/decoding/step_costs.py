"""Flex's measured step costs on disk: a JSON table {key: {"ar": seconds, …}}
per cache file (`cost_cache_path`), kept in memory too; a file that is not
such a table is never written over."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import warnings

# Measured step costs of this process: cache path -> {key: costs}.
_COSTS_IN_MEMORY: dict = {}
_WARNED: set = set()
# Cache paths holding something that is not a cost table (another program's
# file, a folder): never written over; their costs stay in memory.
_NOT_OURS: set = set()


def cost_cache_path(setting="default"):
  """Where flex keeps measured step costs: a path, or None (memory only).

  `setting` is `SpecOptions.cost_cache`: "default" reads
  `$FLEXDRAFT_COST_CACHE` (a file; empty: memory only), else
  `$XDG_CACHE_HOME/flexdraft_jax/step_costs.json` (`~/.cache` without it).
  """
  if setting != "default":
    return setting or None
  env = os.environ.get("FLEXDRAFT_COST_CACHE")
  if env is not None:
    return env or None
  root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"),
                                                           ".cache")
  return os.path.join(root, "flexdraft_jax", "step_costs.json")


def _is_cost_table(x) -> bool:
  """A JSON value as `write_costs` writes it: {key: {"ar": seconds, ...}}."""
  return isinstance(x, dict) and all(
      isinstance(k, str) and isinstance(v, dict) and "ar" in v for k, v in x.items())


def read_costs(path) -> dict:
  """The cost table at `path` (memory only for None). A file that is not one
  (unreadable, not JSON, another shape, a folder) is never written over: it
  warns once and the costs stay in memory."""
  table = _COSTS_IN_MEMORY.setdefault(path, {})
  if path and path not in _NOT_OURS and os.path.lexists(path):
    try:
      with open(path) as f:
        on_disk = json.load(f)
      if not _is_cost_table(on_disk):
        raise ValueError("not a table of step costs")
      table.update(on_disk)
    except (OSError, ValueError) as e:
      _NOT_OURS.add(path)
      _warn_once(path, f"flex: {path} is not a step-cost cache this can read ({e}); "
                 "leaving it as it is and keeping the costs in memory")
  return table


def write_costs(path, table: dict):
  """Keeps `table` in memory and writes it to `path` (atomically, through a
  temporary file that no failure leaves behind); a file that is not ours or
  cannot be written warns once and is left as it is."""
  _COSTS_IN_MEMORY[path] = table
  if not path or path in _NOT_OURS:
    return
  tmp = None
  try:
    # A read-only file says "leave me" even to a user who could replace it.
    if os.path.lexists(path) and not (os.path.isfile(path) and os.access(path, os.W_OK)
                                      and os.stat(path).st_mode & 0o222):
      raise PermissionError("not a writable file")
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=os.path.basename(path) + ".", suffix=".tmp",
                               dir=folder)
    with os.fdopen(fd, "w") as f:
      json.dump(table, f, indent=1)
    os.replace(tmp, path)
    tmp = None
  except OSError as e:
    _warn_once(path, f"flex: cannot write the step-cost cache {path} ({e}); keeping "
               "the costs in memory")
  finally:
    if tmp is not None:
      with contextlib.suppress(OSError):
        os.remove(tmp)


def _warn_once(key, message: str):
  if (key, message.split(" (")[0]) not in _WARNED:
    _WARNED.add((key, message.split(" (")[0]))
    warnings.warn(message, RuntimeWarning, stacklevel=3)
