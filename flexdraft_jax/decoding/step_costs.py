"""Flex's measured step costs on disk: a JSON table {key: {"ar": seconds, …}}
per cache file (`cost_cache_path`), kept in memory too; a file that is not
such a table is never written over. Several processes may share one file:
each write reads the file again and merges its new measurements into it under
a lock (`PATH.lock`, an `fcntl.flock`), so none is lost, and the file keeps
its mode."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import tempfile
import warnings

from flexdraft_jax import paths

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
  `$XDG_CACHE_HOME/flexdraft_jax/step_costs.json` (`~/.cache` without it or
  where it is a relative path: `paths.cache_root`).
  """
  if setting != "default":
    return setting or None
  env = os.environ.get("FLEXDRAFT_COST_CACHE")
  if env is not None:
    return env or None
  return os.path.join(paths.cache_root(), "flexdraft_jax", "step_costs.json")


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


@contextlib.contextmanager
def _locked(path: str):
  """Holds the lock of cache file `path` (an flock on `path`.lock beside it:
  the cache itself is replaced, not rewritten, so it cannot carry the lock)."""
  fd = os.open(path + ".lock", os.O_RDWR | os.O_CREAT, 0o666)
  try:
    fcntl.flock(fd, fcntl.LOCK_EX)
    yield
  finally:
    os.close(fd)


def write_costs(path, entries: dict):
  """Adds `entries` ({key: costs}, this process's new measurements) to the
  table in memory and to the file `path`: under its lock, the file is read
  again, the entries merged in, and the result written beside it and renamed
  over it, with the file's mode (no failure leaves the temporary file). A
  file that is not ours or cannot be written warns once and is left as it is."""
  table = _COSTS_IN_MEMORY.setdefault(path, {})
  table.update(entries)
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
    with _locked(path):
      merged = {}
      if os.path.lexists(path):
        with open(path) as f:
          on_disk = json.load(f)
        if not _is_cost_table(on_disk):
          raise ValueError("not a table of step costs")
        merged = on_disk
        mode = os.stat(path).st_mode & 0o777
      else:
        mode = 0o666 & ~_umask()
      merged.update(entries)
      fd, tmp = tempfile.mkstemp(prefix=os.path.basename(path) + ".", suffix=".tmp",
                                 dir=folder)
      with os.fdopen(fd, "w") as f:
        json.dump(merged, f, indent=1)
      os.chmod(tmp, mode)  # mkstemp makes it private
      os.replace(tmp, path)
      tmp = None
    for k, v in merged.items():  # what the others measured meanwhile
      table.setdefault(k, v)
  except ValueError as e:  # replaced meanwhile by something that is not ours
    _NOT_OURS.add(path)
    _warn_once(path, f"flex: {path} is not a step-cost cache this can read ({e}); "
               "leaving it as it is and keeping the costs in memory")
  except OSError as e:
    _warn_once(path, f"flex: cannot write the step-cost cache {path} ({e}); keeping "
               "the costs in memory")
  finally:
    if tmp is not None:
      with contextlib.suppress(OSError):
        os.remove(tmp)


def _umask() -> int:
  mask = os.umask(0)
  os.umask(mask)
  return mask


def _warn_once(key, message: str):
  if (key, message.split(" (")[0]) not in _WARNED:
    _WARNED.add((key, message.split(" (")[0]))
    warnings.warn(message, RuntimeWarning, stacklevel=3)
