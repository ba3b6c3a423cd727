"""The decode programs kept between processes as traced programs (`jax.export`).

JAX's persistent compilation cache (`compile_cache.py`) spares a second process
XLA's compiling, but not tracing the program in Python and lowering it to
StableHLO, which comes first because the cache is keyed by the lowered program:
for SmolLM2-135M's decode step, 30 target layers and 8 draft layers unrolled,
that is 0.7-1.1 s a program on a CPU, two programs (prefill, a chunk) for every
shape a command decodes. `kept(...)` wraps prefill and the chunk: the first
process exports each program it traces (`jax.export`: the lowered StableHLO, a
few hundred kB) into the compile cache's folder, and a later process calls the
exported program, which lowers in a fraction of that and then loads XLA's
compiled code from the compilation cache as before. The tokens are the same
program's either way.

An exported program is found by what fixes its trace: the function, the static
arguments (configs, mode, verify length …), the tree, shapes, dtypes and
shardings of the others, the device's platform and kind, JAX's tracing
settings, whether the CPU matmul kernel is in use, and a hash of this
package's own source. It sits in the compile cache's version folder (jax,
jaxlib, machine, CPU, kernel build), so it is off with it (`--compile_cache
off`, `$FLEXDRAFT_COMPILE_CACHE=off`); on its own, `$FLEXDRAFT_KEPT_PROGRAMS=off`
(what the test suite sets: its tests patch functions inside the programs).
Kept for the XLA attention on one device only (Pallas kernels and sharded
batches trace as before). The folder is bounded (`MAX_BYTES`): past it, the
programs read or written longest ago are removed (so those of an older package
source, never read again, age out).

A kept program is code the process runs, so a damaged one must never run:
a flipped bit in one read back without error and then crashed the process
(SIGSEGV) on every run of that shape. Two guards, each ending in one
`warning: …` line naming the file, after which the program is traced and
exported again, replacing the file (a file of this folder's, which only this
module writes):

- A checksum. Each file starts with a header holding the sha256 of the
  serialized program that follows (`_pack`); a file whose header is missing
  or whose payload does not match it (`_unpack`) is never deserialized.
- A trial. A program read from a file is on trial in a process until its
  first call has finished (outputs ready): an empty marker file
  `NAME.trial.PID.HOST` beside it says so, made before the file is
  deserialized and removed when that first call returns or raises. A marker
  whose process is gone (this host's PID no longer runs; another host's
  marker older than TRIAL_SECONDS) means that process died while running the
  program for the first time: a crash that a checksum cannot see (damage
  before it was computed, a fault in XLA). The program is then suspect and
  exported again, so a crash never repeats on the next run. A process killed
  for another reason in that window costs one trace, nothing more. A first
  call that raises (its StableHLO does not deserialize or verify, say) is
  exported again at once. Freshly exported programs are not put on trial:
  they are what tracing makes in this process anyway.
"""

from __future__ import annotations

import functools
import glob
import hashlib
import logging
import os
import pathlib
import socket
import sys
import tempfile
import threading
import time

import jax

from flexdraft_jax import compile_cache

log = logging.getLogger(__name__)

ENV = "FLEXDRAFT_KEPT_PROGRAMS"
SUBFOLDER = "exported"
SUFFIX = ".jaxexport"
# The exported/ folder's size bound: beyond it the least recently used
# programs are removed (a SmolLM2-135M decode program is 150-250 kB; a command
# keeps two per batch shape and mode variant it decodes).
MAX_BYTES = 256 << 20
# A kept file: HEADER, the sha256 of the payload (64 hex digits), a newline,
# then the payload (jax.export's serialized program).
HEADER = b"flexdraft kept program sha256="
TRIAL = ".trial"
# Another host's trial marker older than this is taken as left by a process
# that died (its PID cannot be checked from here).
TRIAL_SECONDS = 3600.0

_lock = threading.Lock()
_KEPT = []  # every KeptProgram, for `clear`


def folder():
  """Where exported programs are kept now (None: not kept)."""
  base = compile_cache.folder()
  if base is None or os.environ.get(ENV, "").strip().lower() in compile_cache.OFF:
    return None
  return os.path.join(base, SUBFOLDER)


@functools.lru_cache(maxsize=None)
def source_key() -> str:
  """A hash of this package's Python source and kernels: any edit is a new key."""
  root = pathlib.Path(__file__).resolve().parents[1]
  h = hashlib.sha256()
  for path in sorted(root.rglob("*")):
    if path.suffix in (".py", ".cc") and "__pycache__" not in path.parts:
      h.update(str(path.relative_to(root)).encode())
      h.update(b"\0")
      h.update(path.read_bytes())
  return h.hexdigest()


def _trace_settings() -> str:
  """JAX's settings that change what a trace makes (x64, matmul precision,
  dtype promotion …), minus what names no setting (objects by address)."""
  from jax._src import config
  context = getattr(config, "trace_context", tuple)()
  return repr(tuple(v for v in context if " at 0x" not in repr(v)))


def _kernel_in_use() -> bool:
  from flexdraft_jax.kernels import cpu_matmul
  return cpu_matmul.available()


class KeptProgram:
  """A jitted function whose traced program is kept between processes.

  Calls take the jitted function's arguments: positional arrays (pytrees), and
  keywords, static (`static_argnames`) or arrays. `donate_argnums` are the
  positional arguments the jitted function donates."""

  def __init__(self, jitted, *, name: str, static_argnames, donate_argnums=()):
    self.jitted, self.name = jitted, name
    self.static_argnames = frozenset(static_argnames)
    self.donate_argnums = tuple(donate_argnums)
    self._programs = {}  # in-process: signature -> jitted exported call
    functools.update_wrapper(self, jitted)
    with _lock:
      _KEPT.append(self)

  def __getattr__(self, name):  # the jitted function's own (`lower`, `_cache_size` …)
    if name == "jitted":
      raise AttributeError(name)
    return getattr(self.jitted, name)

  def __call__(self, *args, **kwargs):
    root = folder()
    if root is None or kwargs.get("attn_impl", "xla") != "xla":
      return self.jitted(*args, **kwargs)
    static = tuple(sorted((k, v) for k, v in kwargs.items() if k in self.static_argnames))
    dynamic = {k: v for k, v in kwargs.items() if k not in self.static_argnames}
    leaves, tree = jax.tree.flatten((args, dynamic))
    if not all(isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)
               and len(x.sharding.device_set) == 1 for x in leaves):  # (traced: inlined)
      return self.jitted(*args, **kwargs)
    signature = (static, tree, tuple((x.aval, x.sharding) for x in leaves))
    program = self._programs.get(signature)
    if program is None:
      path = os.path.join(root, self.key(static, tree, leaves))
      program, on_trial = self._load_or_export(path, args, kwargs)
      self._programs[signature] = program
      if on_trial:
        return self._first_call(program, path, signature, args, kwargs, dynamic)
    return program(*args, **dynamic)

  def key(self, static, tree, leaves) -> str:
    """The file name of the program these arguments trace to."""
    h = hashlib.sha256()
    device = next(iter(leaves[0].sharding.device_set)) if leaves else jax.devices()[0]
    parts = (self.name, source_key(), _trace_settings(), str(_kernel_in_use()),
             f"{device.platform}:{device.device_kind}",
             repr(static), str(tree),
             ";".join(f"{x.aval.str_short()}{'~' if x.aval.weak_type else ''}@{x.sharding}"
                      for x in leaves))
    for part in parts:
      h.update(part.encode())
      h.update(b"\0")
    return f"{self.name}-{h.hexdigest()[:40]}{SUFFIX}"

  def _load_or_export(self, path, args, kwargs):
    """(the program for these arguments, whether it is on trial): the kept
    file's, read back and checked, else traced and exported into `path`."""
    from jax import export
    _register_trees()
    if os.path.exists(path):
      why = _suspect(path)
      if why is None:
        marker = _begin_trial(path)
        try:
          with open(path, "rb") as f:
            exported = export.deserialize(bytearray(_unpack(f.read())))
          _touch(path)  # recently used: the last to be evicted
          return jax.jit(exported.call, donate_argnums=self.donate_argnums), True
        except Exception as e:  # damaged, unreadable or of an older format
          _end_trial(marker)
          why = f"does not read back ({_first_line(e)})"
      _warn_damaged(path, why)
    return self._export(path, args, kwargs), False

  def _export(self, path, args, kwargs):
    """Traces and exports the program, and keeps it in `path` (replacing
    what is there, and the trial markers of processes that are gone)."""
    from jax import export
    exported = export.export(self.jitted, disabled_checks=_custom_calls())(*args, **kwargs)
    try:
      data = exported.serialize()
    except ImportError as e:  # jax.export's serializer needs `flatbuffers`
      log.warning("flexdraft_jax: traced programs are not kept (%s)", e)
      static = {k: v for k, v in kwargs.items() if k in self.static_argnames}
      return functools.partial(self.jitted, **static)
    if _write(path, _pack(data)):
      for marker in _dead_markers(path):
        _end_trial(marker)
      _evict(os.path.dirname(path), keep=path)
    return jax.jit(exported.call, donate_argnums=self.donate_argnums)

  def _first_call(self, program, path, signature, args, kwargs, dynamic):
    """The first call of a program read back from `path`, on trial until its
    outputs are ready. An error from it (its StableHLO does not deserialize
    or verify, say) exports the program again and calls that: an error of the
    call's own comes back from the traced program too."""
    marker = _marker(path)
    try:
      out = program(*args, **dynamic)
      jax.block_until_ready(out)
      return out
    except Exception as e:  # e.g. raised while lowering or compiling it
      error = e
    finally:
      _end_trial(marker)
    _warn_damaged(path, f"does not run ({_first_line(error)})")
    program = self._export(path, args, kwargs)
    self._programs[signature] = program
    return program(*args, **dynamic)

  def clear(self):
    self._programs.clear()


@functools.lru_cache(maxsize=None)
def _register_trees() -> None:
  """The named tuples decode programs take and return, for (de)serialization."""
  from jax import export

  from flexdraft_jax.decoding.state import DecodeState
  from flexdraft_jax.model.pytree import KVCache
  for cls in (DecodeState, KVCache):
    export.register_namedtuple_serialization(
        cls, serialized_name=f"flexdraft_jax.{cls.__name__}")


def _custom_calls():
  """The custom calls decode programs may hold (the CPU matmul kernel)."""
  from jax import export

  from flexdraft_jax.kernels import cpu_matmul
  return [export.DisabledSafetyCheck.custom_call(t)
          for t in (cpu_matmul._TARGET, cpu_matmul._TARGET_BF16)]


def _pack(data) -> bytes:
  """A kept file's bytes: the checksum header, then `data`."""
  data = bytes(data)
  return HEADER + hashlib.sha256(data).hexdigest().encode() + b"\n" + data


def _unpack(blob: bytes) -> bytes:
  """The serialized program in a kept file's bytes; ValueError if the header
  is missing or the checksum does not match."""
  if not blob.startswith(HEADER):
    raise ValueError("no checksum header: damaged, or of an older format")
  digest_end = len(HEADER) + 64
  digest, payload = blob[len(HEADER):digest_end], blob[digest_end + 1:]
  if blob[digest_end:digest_end + 1] != b"\n" or (
      hashlib.sha256(payload).hexdigest().encode() != digest):
    raise ValueError("its sha256 does not match its header: damaged")
  return payload


def _first_line(e: BaseException) -> str:
  return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def _warn_damaged(path: str, why: str) -> None:
  print(f"warning: the kept program {path} {why}; traced again, and the file replaced",
        file=sys.stderr, flush=True)


def _marker(path: str) -> str:
  """This process's trial marker for the program in `path`."""
  return f"{path}{TRIAL}.{os.getpid()}.{socket.gethostname()}"


def _markers(path: str) -> list:
  """[(marker, pid, host)] of the trial markers beside `path`."""
  found = []
  for marker in glob.glob(glob.escape(path) + TRIAL + ".*"):
    pid, _, host = marker[len(path) + len(TRIAL) + 1:].partition(".")
    if pid.isdigit():
      found.append((marker, int(pid), host))
  return found


def _dead_markers(path: str) -> list:
  """The trial markers beside `path` whose process is gone (see the module's
  docstring); never this process's."""
  from flexdraft_jax.run_control import process_alive
  here, dead = socket.gethostname(), []
  for marker, pid, host in _markers(path):
    if host == here:
      if pid != os.getpid() and not process_alive(pid):
        dead.append(marker)
    else:
      try:
        if time.time() - os.path.getmtime(marker) > TRIAL_SECONDS:
          dead.append(marker)
      except OSError:  # removed meanwhile
        pass
  return dead


def _suspect(path: str):
  """Why the program in `path` must not run (a process died running it for
  the first time), or None."""
  dead = _dead_markers(path)
  if not dead:
    return None
  pid, _, host = dead[0][len(path) + len(TRIAL) + 1:].partition(".")
  return (f"was running for the first time in process {pid} on {host} when that "
          "process ended (a crash?)")


def _begin_trial(path: str) -> str:
  """Puts the program in `path` on trial in this process (its marker made;
  a folder that cannot be written holds no marker)."""
  marker = _marker(path)
  try:
    with open(marker, "wb"):
      pass
  except OSError:
    pass
  return marker


def _end_trial(marker: str) -> None:
  try:
    os.unlink(marker)
  except OSError:  # never made (a read-only folder), or removed already
    pass


def _write(path: str, data) -> bool:
  """Atomically (a reader sees the whole file or none); a folder that cannot
  be written leaves the program unkept (False)."""
  tmp = None
  try:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
    with os.fdopen(fd, "wb") as f:
      f.write(data)
    os.chmod(tmp, 0o644)  # as JAX's own cache files
    os.replace(tmp, path)
    return True
  except OSError as e:
    log.warning("flexdraft_jax: cannot keep the traced program %s (%s)", path, e)
    if tmp is not None and os.path.exists(tmp):
      os.unlink(tmp)
    return False


def _touch(path: str) -> None:
  """Marks a program used now (its modification time: access times are often
  not kept)."""
  try:
    os.utime(path)
  except OSError:
    pass  # a read-only folder: its programs are still read, never evicted


def _evict(root: str, keep: str) -> None:
  """Removes the least recently used programs in `root` (`_touch`) until the
  folder is within MAX_BYTES; never `keep`, the program just written."""
  files = []
  try:
    with os.scandir(root) as entries:
      for e in entries:
        if e.name.endswith(SUFFIX) and e.is_file(follow_symlinks=False):
          st = e.stat(follow_symlinks=False)
          files.append((st.st_mtime, st.st_size, e.path))
  except OSError:
    return
  total = sum(size for _, size, _ in files)
  for _, size, path in sorted(files):
    if total <= MAX_BYTES:
      return
    if path == keep:
      continue
    try:
      os.unlink(path)
      total -= size
    except FileNotFoundError:  # another process evicted it first
      total -= size
    except OSError:
      continue
    for marker, _, _ in _markers(path):
      _end_trial(marker)


def clear() -> None:
  """Drops the exported programs this process loaded (their compiled code)."""
  with _lock:
    for k in _KEPT:
      k.clear()


def kept(*, name: str, static_argnames, donate_argnums=()):
  """Decorator: `KeptProgram` over an already jitted function."""
  return lambda jitted: KeptProgram(jitted, name=name, static_argnames=static_argnames,
                                    donate_argnums=donate_argnums)
