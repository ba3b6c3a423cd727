"""What keeps a long command's folder sane: one run in it at a time, and a
clean stop on Ctrl-C or on the SIGTERM a cluster scheduler sends before it
kills a job.

- `folder_lock(dir, what)`: a lock file in `dir` naming its holder (pid, host,
  command); a second run gets one line naming the first. The lock is an
  `fcntl.flock` on that file, so it dies with its process; a lock file left by
  a process that is gone is taken over with a line saying so.
- `stop_on_signals()`: SIGINT and SIGTERM raise `Stopped` (a
  KeyboardInterrupt) in the main thread; `critical()` holds a signal back
  until a write that must not be cut in half (a shard, a results file) is done;
  `held()` holds one back for the caller to act on at a point of its choosing
  (training finishes its step and saves it first).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shlex
import signal
import socket
import sys
import threading
import time

from flexdraft_jax.model.config import FlexDraftError

LOCK_FILE = "flexdraft.lock"


class Stopped(KeyboardInterrupt):
  """A run stopped by a signal (SIGINT: Ctrl-C; SIGTERM: a scheduler).
  `where` says what was kept (set by the command that stopped)."""

  def __init__(self, signum: int = signal.SIGINT, where: str = ""):
    super().__init__(where)
    self.signum, self.where = signum, where

  @property
  def signame(self) -> str:
    return signal.Signals(self.signum).name


def stopped(e: BaseException, where: str) -> Stopped:
  """`e` (a Stopped, or a plain KeyboardInterrupt: SIGINT) saying `where`."""
  return Stopped(getattr(e, "signum", signal.SIGINT), where)


# ------------------------------------------------------------- signals ----

_state = threading.local()
_pending: list = []   # a signal held back by critical(), raised when it ends
_depth = [0]          # nesting of critical() in the main thread
_held = [0]           # nesting of held() in the main thread


def _raise(signum, frame):
  if _depth[0] or (_held[0] and not _pending):
    _pending.append(signum)
    return
  # A second signal while held() waits for the step to end stops at once;
  # one while the run cleans up acts at once (the defaults).
  _restore()
  raise Stopped(signum)


def _restore():
  saved = getattr(_state, "saved", None)
  if saved:
    for sig, handler in saved.items():
      signal.signal(sig, handler)
    _state.saved = None


@contextlib.contextmanager
def stop_on_signals():
  """Within: SIGINT (unless ignored, as in a background job) and SIGTERM raise
  `Stopped`. Outside the main thread it does nothing (Python delivers signals
  to the main thread only)."""
  if threading.current_thread() is not threading.main_thread() or getattr(
      _state, "saved", None):
    yield
    return
  saved = {}
  for sig in (signal.SIGINT, signal.SIGTERM):
    old = signal.getsignal(sig)
    if sig == signal.SIGINT and old is signal.SIG_IGN:
      continue
    saved[sig] = old
    signal.signal(sig, _raise)
  _state.saved = saved
  try:
    yield
  finally:
    _restore()
    _pending.clear()


@contextlib.contextmanager
def critical():
  """Holds SIGINT / SIGTERM back until the block is done (a write that must not
  be cut in half), then raises `Stopped` for it."""
  main = threading.current_thread() is threading.main_thread()
  if main:
    _depth[0] += 1
  try:
    yield
  finally:
    if main:
      _depth[0] -= 1
      if not _depth[0] and not _held[0] and _pending:
        signum = _pending[0]
        _pending.clear()
        _restore()
        raise Stopped(signum)


@contextlib.contextmanager
def held():
  """Holds the first SIGINT / SIGTERM back for the block, and leaves it pending
  when the block ends: the caller asks `pending()` at the points where it can
  stop, and raises `Stopped` itself. A second signal acts at once (outside a
  `critical()` write): Ctrl-C twice does not wait."""
  main = threading.current_thread() is threading.main_thread()
  if main:
    _held[0] += 1
  try:
    yield
  finally:
    if main:
      _held[0] -= 1


def pending():
  """The signal held back since (SIGINT or SIGTERM), or None."""
  return _pending[0] if _pending else None


def stop(signum) -> Stopped:
  """The `Stopped` to raise for a held signal: the signal is taken, and the
  default handlers are back (a second signal during the clean-up acts at once)."""
  _pending.clear()
  _restore()
  return Stopped(signum)


def resume_command(argv) -> str:
  """The shell command that reruns `argv` (["flexdraft_jax train", flags…])."""
  return shlex.join(["python", "-m", "flexdraft_jax", argv[0].split()[-1], *argv[1:]])


# ---------------------------------------------------------------- lock ----

def _holder(path: str) -> dict:
  try:
    with open(path, encoding="utf-8") as f:
      return json.load(f)
  except (OSError, ValueError):
    return {}


def _alive(pid) -> bool:
  try:
    os.kill(int(pid), 0)
  except ProcessLookupError:
    return False
  except (PermissionError, ValueError, TypeError, OverflowError):
    return True  # someone else's process, or a pid we cannot read: assume it runs
  return True


def _describe(holder: dict) -> str:
  since = holder.get("since")
  when = time.strftime(" since %Y-%m-%d %H:%M", time.localtime(since)) if since else ""
  return (f"{holder.get('command', 'a run')} (process {holder.get('pid', '?')} on "
          f"{holder.get('host', '?')}{when})")


@contextlib.contextmanager
def folder_lock(folder: str, what: str, flag: str = "--workdir"):
  """Holds `folder`/flexdraft.lock for the block: one run per folder. A folder
  held by a live run is a one-line FlexDraftError naming it; a lock left by a
  process that is gone is taken over with a line saying so."""
  import fcntl
  path = os.path.join(folder, LOCK_FILE)
  host, pid = socket.gethostname(), os.getpid()
  for _ in range(10):  # the file may be replaced while we open it: try again
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      os.close(fd)
      raise FlexDraftError(f"{flag} {folder} is in use by {_describe(_holder(path))}: "
                           "wait for it to end, or use another folder") from None
    except OSError as e:  # a file system without flock: judge by the pid
      if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
        os.close(fd)
        raise
      old = _holder(path)
      if old and old.get("pid") != pid and (old.get("host") != host or _alive(old["pid"])):
        os.close(fd)
        raise FlexDraftError(f"{flag} {folder} is in use by {_describe(old)}: wait for it "
                             f"to end, or use another folder (if it has ended, remove "
                             f"{path})") from None
    try:
      same = os.path.samestat(os.fstat(fd), os.stat(path))
    except FileNotFoundError:
      same = False
    if same:
      break
    os.close(fd)
  else:
    raise FlexDraftError(f"cannot lock {flag} {folder}: {path} keeps changing")
  old = _holder(path)
  if old.get("pid") and old.get("pid") != pid:
    print(f"{what}: taking over the lock of {_describe(old)}, which is no longer "
          "running", file=sys.stderr, flush=True)
  me = {"pid": pid, "host": host, "since": time.time(), "command": what}
  os.ftruncate(fd, 0)
  os.pwrite(fd, json.dumps(me).encode(), 0)
  try:
    yield path
  finally:
    try:
      os.remove(path)  # while still holding it: a waiting run then makes a new one
    except OSError:
      pass
    os.close(fd)
