"""JAX's persistent compilation cache, on by default: a second process loads
the decode programs the first one compiled instead of compiling them again.

Where: `$FLEXDRAFT_COMPILE_CACHE` (a folder; `off` turns the cache off), else
`$XDG_CACHE_HOME/flexdraft_jax/xla` (`~/.cache` without it or where it is a
relative path: `paths.cache_root`); every command's `--compile_cache` flag and
`use_compile_cache()` set it for the process. A folder JAX was already given
(`jax_compilation_cache_dir`, e.g. by its own `JAX_COMPILATION_CACHE_DIR`) is
kept as it is unless one of ours is explicit.

Programs are kept in a subfolder per `version_key()`. JAX's own key hashes the
program, jaxlib's version, the backend's platform and version, the devices'
topology, the XLA flags and the compile options — but not which CPU it was
compiled for (XLA:CPU emits code for the host's instruction set; a home folder
shared by several machines would load another CPU's program), nor the decode
matmul kernel (kernels/cpu_matmul.py), a custom call that the program reaches
only by name. The subfolder names jax's and jaxlib's versions, and hashes the
machine, its CPU flags and the kernel's own build key (its source, jaxlib's
version, the CPU's flags): programs made under anything else are never read.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import threading

from flexdraft_jax import paths

ENV = "FLEXDRAFT_COMPILE_CACHE"
OFF = ("off", "0", "none", "false")
# Every program is written, however fast it compiled (JAX's default skips those
# under 1 s): a decode command runs dozens of small helpers (layout changes,
# slices) of 0.02-0.2 s each on a busy CPU, together seconds, and reading one
# back takes milliseconds. The size floor is JAX's (0: every size).
MIN_COMPILE_SECONDS = 0.0
# The cache folder's size bound: JAX evicts the least recently used programs
# beyond it (a SmolLM2-135M decode step is a few MB).
MAX_BYTES = 4 << 30

_lock = threading.Lock()
_state = {"folder": None, "explicit": False, "done": False}


def default_root() -> str:
  return os.path.join(paths.cache_root(), "flexdraft_jax", "xla")


def _cpu_flags() -> str:
  from flexdraft_jax.kernels import cpu_matmul
  return cpu_matmul._cpu_flags()


def version_key() -> str:
  """The subfolder for this JAX, jaxlib, machine and CPU decode kernel."""
  import jax
  import jaxlib

  from flexdraft_jax.kernels import cpu_matmul
  h = hashlib.sha256()
  for part in (platform.machine(), _cpu_flags(), cpu_matmul._key()):
    h.update(part.encode())
    h.update(b"\0")
  return f"jax{jax.__version__}-jaxlib{jaxlib.__version__}-{h.hexdigest()[:12]}"


def resolve(setting=None):
  """The root folder for `setting` (a folder, `off`, or None for the
  environment / default), or None when the cache is off."""
  if setting is None:
    setting = os.environ.get(ENV)
    if setting is None:
      return default_root()
  setting = os.fspath(setting).strip()
  if not setting or setting.lower() in OFF:
    return None
  return os.path.expanduser(setting)


def use_compile_cache(folder=None, *, explicit: bool = True):
  """Turns the persistent compilation cache on in `folder` (None: from
  `$FLEXDRAFT_COMPILE_CACHE`, else the default) or off (`"off"`), for the rest
  of the process; returns the folder programs are kept in (None: off). Called
  with `explicit=False` (what `load_target` and `generate` do) it sets the
  default once and leaves any earlier choice, ours or JAX's, as it is."""
  import jax
  from flexdraft_jax.model.config import FlexDraftError
  with _lock:
    if not explicit and (_state["done"] or _state["explicit"]):
      return _state["folder"]
    if not explicit and folder is None and os.environ.get(ENV) is None:
      given = jax.config.jax_compilation_cache_dir
      if given and _state["folder"] != given:  # someone chose JAX's own folder: keep it
        _state.update(folder=given, done=True)
        return given
    root = resolve(folder)
    if root is None:
      jax.config.update("jax_enable_compilation_cache", False)
      _state.update(folder=None, done=True, explicit=explicit)
      return None
    if os.path.exists(root) and not os.path.isdir(root):
      raise FlexDraftError(f"the compile cache {root} is not a folder (set another with "
                           f"--compile_cache or ${ENV}, or 'off')")
    path = os.path.join(root, version_key())
    if path != jax.config.jax_compilation_cache_dir:
      _reset_jax_cache()  # JAX reads its folder once: this one from now on
      jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_enable_compilation_cache", True)
    if jax.config.jax_persistent_cache_min_compile_time_secs > MIN_COMPILE_SECONDS:
      jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECONDS)
    if jax.config.jax_compilation_cache_max_size < 0:
      jax.config.update("jax_compilation_cache_max_size", MAX_BYTES)
    _state.update(folder=path, done=True, explicit=explicit)
    return path


def _reset_jax_cache() -> None:
  """Makes JAX forget the cache folder it read (it reads one once, at its first
  compile), quietly: JAX logs every reset at INFO ("Resetting cache at
  <empty>."), and absl, which runs every command, shows INFO on stderr, so that
  line came first in every command, before a bad input's `error: ...` line."""
  from jax.experimental.compilation_cache import compilation_cache
  logger = logging.getLogger(compilation_cache.reset_cache.__module__)
  level = logger.level
  if logger.getEffectiveLevel() < logging.WARNING:
    logger.setLevel(logging.WARNING)
  try:
    compilation_cache.reset_cache()
  finally:
    logger.setLevel(level)


def ensure() -> None:
  """The default, once per process, unless a folder or `off` was chosen."""
  if not _state["done"] and not _state["explicit"]:
    use_compile_cache(explicit=False)


def folder():
  """The folder programs are kept in now (None: off, or not set yet)."""
  return _state["folder"]
