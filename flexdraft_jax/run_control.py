"""What keeps a long command's folder sane: one run in it at a time, and a
clean stop on Ctrl-C or on the SIGTERM a cluster scheduler sends before it
kills a job.

- `folder_lock(dir, what)`: a lock file in `dir` naming its holder (pid, host,
  command); a second run gets one line naming the first. The lock is an
  `fcntl.flock` on that file, so it dies with its process; a lock file left by
  a process that is gone is taken over with a line saying so.
- `stop_on_signals()`: SIGINT and SIGTERM raise `Stopped` (a
  KeyboardInterrupt) in the main thread, and are recorded so that one whose
  exception Python drops is raised again at the next `check()`; `critical()`
  holds a signal back until a write that must not be cut in half (a shard, a
  results file) is done; `held()` holds one back for the caller to act on at a
  point of its choosing (training finishes its step and saves it first).
- `exit_now(status)`: how a command that owns its process ends after a stop.
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
#
# A stop is kept in two ways, because raising alone can be lost: Python runs a
# signal's handler in the main thread wherever it is, and an exception raised
# while a garbage-collection callback runs (JAX registers one, which runs at
# every collection) is printed as "Exception ignored" and dropped, and the run
# goes on. So the handler first records the signal (`_requested`), then raises;
# `check()`, called at every decode chunk, raises it again if it was lost, and
# `pending()` (training's stop point) reports it. Our handler stays installed
# until the run ends: a second signal is the project's too (a stop at once
# during the clean-up, nothing once the stop line is being written), never
# Python's defaults, which would kill the process with no line on SIGTERM.

_state = threading.local()
_pending: list = []    # a signal held back by critical() / held()
_requested: list = []  # the signal a Stopped was raised for (the first), until the run ends
_finishing = [False]   # the stop line is being written: later signals change nothing
_depth = [0]           # nesting of critical() in the main thread
_held = [0]            # nesting of held() in the main thread


def _raise(signum, frame):
  if _finishing[0]:
    return
  if _depth[0] or (_held[0] and not _pending):
    _pending.append(signum)
    return
  # A second signal while held() waits for the step to end stops at once, and
  # so does one while the run cleans up after a stop.
  raise _stopping(signum)


def _stopping(signum) -> Stopped:
  """The `Stopped` for `signum`, recorded first (`check()`)."""
  if not _requested:
    _requested.append(signum)
  return Stopped(signum)


def _quiet_lost_stop(unraisable, previous):
  """sys.unraisablehook: a Stopped that Python drops (raised in a gc callback)
  is recorded and `check()` raises it again, so it is not printed as lost."""
  if not isinstance(unraisable.exc_value, Stopped):
    previous(unraisable)


def _reset():
  _pending.clear()
  _requested.clear()
  _finishing[0] = False


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
  _reset()
  hook = sys.unraisablehook
  sys.unraisablehook = lambda u: _quiet_lost_stop(u, hook)
  try:
    yield
  finally:
    sys.unraisablehook = hook
    for sig, handler in saved.items():
      signal.signal(sig, handler)
    _state.saved = None
    _reset()


def check() -> None:
  """Raises `Stopped` again for a signal whose own exception was lost (see
  above); nothing otherwise, and nothing outside `stop_on_signals()`."""
  if _requested and not _finishing[0] and not _depth[0]:
    raise Stopped(_requested[0])


def finishing() -> None:
  """The run has stopped and is writing its stop line on the way out: a
  further SIGINT / SIGTERM changes nothing (the first one's status stands)."""
  _finishing[0] = True


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
        raise _stopping(signum)


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
  """The signal held back since (SIGINT or SIGTERM), or one whose `Stopped`
  was lost; None if neither."""
  return _pending[0] if _pending else (_requested[0] if _requested else None)


def stop(signum) -> Stopped:
  """The `Stopped` to raise for a held signal: the signal is taken (a second
  one during the clean-up stops it at once)."""
  _pending.clear()
  return _stopping(signum)


# A stop leaves the main thread wherever the signal found it, often with a JAX
# computation still running on XLA's threads; the wait below is bounded.
WAIT_SECONDS = 10.0


def _wait_for_jax() -> None:
  jax = sys.modules.get("jax")
  if jax is None:
    return
  try:
    for x in jax.live_arrays():
      try:
        x.block_until_ready()
      except Exception:  # deleted or donated meanwhile: nothing to wait for
        pass
    jax.effects_barrier()
  except Exception:
    pass


def exit_now(status: int):
  """Ends the process after a clean stop with `status`, skipping Python's
  interpreter teardown.

  A normal exit runs JAX's atexit hook, which destroys the backend (its client
  and thread pools), and then tears down modules and objects, while a
  computation the signal left in flight may still run on XLA's threads over
  buffers being freed: that crashed now and then (SIGSEGV, exit 139) after the
  stop line was printed. So this waits (at most WAIT_SECONDS, in a helper
  thread, so the main thread still takes signals) for the arrays in flight and
  JAX's effects (host callbacks), flushes stdout, stderr and the logging
  handlers, and ends with `os._exit(status)`: no atexit hooks, no teardown.
  Nothing is lost by skipping them: a command closes what it writes on its way
  out (files in `with` blocks, train's log and checkpoint manager, the folder
  lock), and every file it keeps is written whole or not at all (atomic
  replaces, `critical()`). For a command that owns its process only
  (`python -m flexdraft_jax`); called in-process, a command exits with
  SystemExit."""
  import logging
  finishing()
  waiter = threading.Thread(target=_wait_for_jax, name="stop-wait", daemon=True)
  waiter.start()
  waiter.join(WAIT_SECONDS)
  for stream in (sys.stdout, sys.stderr):
    try:
      stream.flush()
    except Exception:  # a closed pipe: nothing more can reach it
      pass
  try:
    logging.shutdown()
  except Exception:
    pass
  os._exit(status)


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


def process_alive(pid) -> bool:
  """Whether process `pid` (on this host) is running."""
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
      if old and old.get("pid") != pid and (old.get("host") != host or process_alive(old["pid"])):
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
