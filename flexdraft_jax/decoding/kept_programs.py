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
batches trace as before); a file that does not read back is exported again.
The folder is bounded (`MAX_BYTES`): past it, the programs read or written
longest ago are removed (so those of an older package source, never read
again, age out).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import pathlib
import tempfile
import threading

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
      program = self._load_or_export(root, static, tree, leaves, args, kwargs)
      self._programs[signature] = program
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

  def _load_or_export(self, root, static, tree, leaves, args, kwargs):
    from jax import export
    _register_trees()
    path = os.path.join(root, self.key(static, tree, leaves))
    exported = None
    if os.path.exists(path):
      try:
        with open(path, "rb") as f:
          exported = export.deserialize(bytearray(f.read()))
        _touch(path)  # recently used: the last to be evicted
      except Exception as e:  # damaged or from an older format: export it again
        log.warning("flexdraft_jax: %s does not read back (%s); tracing it again",
                    path, str(e).splitlines()[0] if str(e) else type(e).__name__)
    if exported is None:
      exported = export.export(self.jitted, disabled_checks=_custom_calls())(
          *args, **kwargs)
      try:
        data = exported.serialize()
      except ImportError as e:  # jax.export's serializer needs `flatbuffers`
        log.warning("flexdraft_jax: traced programs are not kept (%s)", e)
        return functools.partial(self.jitted, **dict(static))
      if _write(path, data):
        _evict(root, keep=path)
    return jax.jit(exported.call, donate_argnums=self.donate_argnums)

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
      pass


def clear() -> None:
  """Drops the exported programs this process loaded (their compiled code)."""
  with _lock:
    for k in _KEPT:
      k.clear()


def kept(*, name: str, static_argnames, donate_argnums=()):
  """Decorator: `KeptProgram` over an already jitted function."""
  return lambda jitted: KeptProgram(jitted, name=name, static_argnames=static_argnames,
                                    donate_argnums=donate_argnums)
