"""Shared CLI plumbing: absl entry with one-line errors instead of tracebacks."""

import importlib.util
import os
import sys

from absl import app

from flexdraft_jax import run_control
from flexdraft_jax.model.config import FlexDraftError


# Whether the command owns its process (`python -m flexdraft_jax`, which sets
# it): then a stop ends the process through `run_control.exit_now`; a command
# run in-process (tests, notebooks) exits with SystemExit.
OWN_PROCESS = False


def define_compile_cache_flag() -> None:
  """`--compile_cache`, every command's: where compiled programs are kept.
  (Re)defined at its default: a process may run several commands."""
  from absl import flags

  from flexdraft_jax import compile_cache
  if "compile_cache" in flags.FLAGS:
    delattr(flags.FLAGS, "compile_cache")
  flags.DEFINE_string(
      "compile_cache", None,
      "folder of JAX's persistent compilation cache and of the decode programs "
      "kept traced, or 'off' (default: "
      f"${compile_cache.ENV}, else {compile_cache.default_root()}; one subfolder "
      "per JAX version and machine; $FLEXDRAFT_KEPT_PROGRAMS=off keeps compiled "
      "programs only)")


def use_compile_cache_flag() -> None:
  """The persistent compilation cache as `--compile_cache` says (given), or
  the environment's / default one."""
  from absl import flags

  from flexdraft_jax import compile_cache
  flag = flags.FLAGS["compile_cache"]
  if flag.present:
    compile_cache.use_compile_cache(flag.value)
  else:
    compile_cache.ensure()


def run_main(main, argv, doc: str = "", key_flags=("config", "workdir")):
  """Runs `main` under absl; user errors print one line and exit 1. `--help`
  shows `doc` and the `key_flags` (absl lists only the main module's own)."""
  from absl import flags
  define_compile_cache_flag()
  key_flags = tuple(key_flags) + ("compile_cache",)
  for name in key_flags:
    if name in flags.FLAGS:
      flags.FLAGS.register_key_flag_for_module(sys.argv[0], flags.FLAGS[name])
  main_module = sys.modules.get("__main__")
  if doc and getattr(getattr(main_module, "__spec__", None), "name", "") == "flexdraft_jax.__main__":
    main_module.__doc__ = doc  # what `--help` prints above the flags
  started = []

  def wrapped(args):
    started.append(True)
    try:
      with run_control.stop_on_signals():
        use_compile_cache_flag()
        return main(args)
    except (FlexDraftError, FileNotFoundError) as e:
      print(f"error: {e}", file=sys.stderr)
      sys.exit(1)
    except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM (run_control.Stopped)
      _stopped(e, argv)

  try:
    app.run(wrapped, argv=argv, flags_parser=_parse_flags)
  except KeyboardInterrupt as e:  # Ctrl-C while absl parsed the flags
    _stopped(e, argv)
  except (AttributeError, KeyError, OSError, SyntaxError, TypeError, ValueError) as e:
    if started:  # raised by the command itself: a bug, keep the traceback
      raise
    print(f"error: {_config_error(argv, e)}", file=sys.stderr)
    sys.exit(1)


def _stopped(e: KeyboardInterrupt, argv) -> None:
  """The stop line (`stopped by SIGTERM: …; to resume, run: …`), then exit
  128 + the signal: through `run_control.exit_now` when the command owns its
  process (OWN_PROCESS), else SystemExit."""
  run_control.finishing()  # a second signal from here on changes nothing
  e = e if isinstance(e, run_control.Stopped) else run_control.stopped(e, "")
  where = e.where or f"{argv[0].split()[-1]} stopped"
  print(f"stopped by {e.signame}: {where}; to resume, run: "
        f"{run_control.resume_command(argv)}", file=sys.stderr, flush=True)
  if OWN_PROCESS:
    run_control.exit_now(128 + e.signum)
  sys.exit(128 + e.signum)


HELP_FLAGS = ("--help", "-?", "--helpshort", "--helpfull", "--helpxml")


def _parse_flags(argv):
  """absl's flag parsing; a flag it refuses is one line (`error: …`), exit 1.
  Asked for help, absl prints the usage and exits 1; here that is exit 0."""
  from absl import flags
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:
    print(f"error: {e} (see --help)", file=sys.stderr)
    sys.exit(1)
  except SystemExit as e:
    if e.code == 1 and any(a in HELP_FLAGS for a in argv[1:]):
      sys.exit(0)
    raise


def _config_arg(argv):
  """The --config value and the --config.* override names in `argv`."""
  path, overrides = None, []
  for i, a in enumerate(argv):
    if a.startswith("--config="):
      path = a.split("=", 1)[1]
    elif a == "--config" and i + 1 < len(argv):
      path = argv[i + 1]
    elif a.startswith("--config."):
      overrides.append(a[len("--config."):].split("=", 1)[0])
  return path, overrides


def _load_config_file(path: str):
  file, *arg = path.split(":", 1)
  spec = importlib.util.spec_from_file_location("flexdraft_user_config", file)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(*arg)


def _config_error(argv, e) -> str:
  """One line for a --config file or override that absl's parsing refused."""
  path, overrides = _config_arg(argv)
  if path is None:
    return f"bad flags: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
  if not os.path.isfile(path.split(":", 1)[0]):
    return f"config file not found: {path}"
  try:
    config = _load_config_file(path)
  except Exception as e2:  # the user's config code: any error is theirs
    return f"cannot load config {path}: {type(e2).__name__}: {e2}"
  for name in overrides:
    node, parts = config, name.split(".")
    for i, part in enumerate(parts):
      try:
        node = node[part]
      except (KeyError, TypeError, IndexError):
        return (f"unknown config key --config.{name} ({path} has no "
                f"{'.'.join(parts[:i + 1])!r})")
  return f"bad --config flags: {type(e).__name__}: {e}"


def load_config(example: str):
  """The parsed --config (with its overrides), or a one-line error."""
  from absl import flags
  config = flags.FLAGS.config
  if config is None:
    raise FlexDraftError(f"--config is required (e.g. {example})")
  try:
    config.get("name")  # ml_collections defers a config file's load error to first use
  except OSError:
    path = flags.FLAGS["config"].config_filename
    if not os.path.isfile(path.split(":", 1)[0]):
      raise FlexDraftError(f"config file not found: {path}") from None
    raise FlexDraftError(f"cannot load config {path}") from None
  return config


def writable_dir(path: str, flag: str = "--workdir") -> str:
  """`path` made (if needed) and checked writable, as an absolute path; a
  one-line error naming `flag` otherwise."""
  if not path:
    raise FlexDraftError(f"{flag} is required")
  full = os.path.abspath(os.path.expanduser(path))
  try:
    os.makedirs(full, exist_ok=True)
    probe = os.path.join(full, f".write_test.{os.getpid()}")
    with open(probe, "w"):
      pass
    os.remove(probe)
  except (FileExistsError, NotADirectoryError):
    raise FlexDraftError(f"{flag} {path}: a file is in the way (not a directory)") from None
  except OSError as e:
    raise FlexDraftError(f"{flag} {path} is not writable: {e.strerror}") from None
  except ValueError as e:  # e.g. a NUL byte in the path
    raise FlexDraftError(f"{flag} {path!r} is not a valid path: {e}") from None
  return full


def check_can_write(path: str, flag: str) -> None:
  """`path`, a file or folder a command writes when its work is done, can be
  written then: the nearest folder above it that exists is a folder (not a
  file in the way) and writable. One line otherwise, before the work."""
  full = os.path.abspath(os.path.expanduser(path))
  parent = os.path.dirname(full)
  while not os.path.lexists(parent):
    parent = os.path.dirname(parent)
  if not os.path.isdir(parent):
    raise FlexDraftError(f"{flag} {path}: a file is in the way ({parent} is not a "
                         "directory)")
  if not os.access(parent, os.W_OK | os.X_OK):
    raise FlexDraftError(f"{flag} {path} cannot be written: {parent} is not writable")


def config_and_workdir(args, example: str):
  """The --config and --workdir flags of a config-driven command, checked (the
  workdir is made and must be writable)."""
  from absl import flags
  if len(args) > 1:
    raise FlexDraftError(f"unexpected arguments: {' '.join(args[1:])}")
  config = load_config(example)
  if not flags.FLAGS.workdir:
    raise FlexDraftError("--workdir is required")
  return config, writable_dir(flags.FLAGS.workdir)


def define_flags(argv, *, workdir: str = "") -> None:
  """(Re)defines `--config` (+ `--config.a.b=v` overrides, which ml_collections
  discovers from `argv`) and, when `workdir` (its help text) is given,
  `--workdir` on absl's global FLAGS."""
  from absl import flags
  from ml_collections import config_flags
  for name in list(flags.FLAGS):
    if name == "config" or name.startswith("config."):
      delattr(flags.FLAGS, name)
  config_flags.DEFINE_config_file(
      "config", None, "configs/X.py (its get_config()); override a field with "
      "--config.a.b=VALUE", lock_config=True, sys_argv=list(argv))
  if workdir:
    if "workdir" in flags.FLAGS:
      delattr(flags.FLAGS, "workdir")
    flags.DEFINE_string("workdir", None, f"(required) {workdir}; made if missing")
